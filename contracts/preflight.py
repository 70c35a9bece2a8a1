"""Validate a pipeline spec once, before any check runs (issue 11 item 6).

A spec the kit cannot drive -- a factory needing arguments, inputs that are not keyword
arguments, an output of an uncomparable type, a reference that differs between two runs of one
seed, a pipeline that is neither an ``nn.Module`` nor a plain object with components -- would
otherwise fail every check with the same raw internal error.  :func:`preflight` reports each such
problem once, in one line naming the spec, the object and the fix; the runner then reports the
spec's checks as not run (``runner.run_checks``, ``pytest_support.check_params``), and the other
specs run normally.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .outputs import OutputStructureError, leaves
from .refs import RefError, takes_seed
from .registry import one_line
from .spec import PipelineSpec, _seeded, load_object

__all__ = ["failed_preflight", "kit_plan", "preflight", "unresolved_strategies"]

#: spec -> its problems; keyed by the spec itself (held here), so an id is never reused.
_CACHE: dict[PipelineSpec, list[str]] = {}


def _name(obj: Any) -> str:
    """``module:attr`` of a reference or of a callable (its qualname), for messages."""
    if isinstance(obj, str):
        return obj
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{qualname}" if module else qualname


def preflight(spec: PipelineSpec) -> list[str]:
    """The problems that keep the kit from running ``spec``'s checks, one line each (empty: the
    spec is usable).  Computed once per spec in a process."""
    if spec not in _CACHE:
        from .case import kit_device

        kit_device()  # the simulated accelerator loads before the pipeline's first run can stop it
        _CACHE[spec] = _problems(spec)
    return list(_CACHE[spec])


def _problems(spec: PipelineSpec) -> list[str]:
    where = f"spec {spec.name!r}"
    problems = []
    for role, ref, fix in (
        ("factory", spec.factory, "a callable returning a fresh pipeline"),
        ("inputs", spec.inputs, "a callable returning the pipeline's keyword arguments"),
    ):
        try:
            func = load_object(ref)
        except Exception as exc:  # noqa: BLE001 - an unimportable reference
            problems.append(f"{where}: {role} {ref!r} cannot be loaded ({one_line(exc)}); "
                            f"name {fix} as 'package.module:attr'")
            continue
        if not callable(func):
            problems.append(f"{where}: {role} {_name(ref)} is a {type(func).__name__}, not "
                            f"callable; pass {fix}")
            continue
        try:
            takes_seed(func, _name(ref))
        except RefError:
            required = _required(func)
            problems.append(f"{where}: {role} {_name(ref)} needs argument(s) "
                            f"{', '.join(required)}; it must take no arguments or only seed= "
                            f"(wrap it in one that does)")
    if problems:
        return problems

    outputs = []
    for run in (1, 2):
        try:
            pipeline = spec.build()
        except Exception as exc:  # noqa: BLE001 - the author's factory failed
            return [f"{where}: building the pipeline with factory {_name(spec.factory)} raised "
                    f"{one_line(exc)}; fix the factory (it must build a pipeline for seed="
                    f"{spec.seed})"]
        if run == 1:
            kind = _pipeline_kind_problem(where, pipeline)
            if kind:
                return [kind]
        try:
            inputs = _seeded(spec.inputs, spec.seed)
        except Exception as exc:  # noqa: BLE001 - the author's inputs failed
            return [f"{where}: inputs {_name(spec.inputs)} raised {one_line(exc)}; fix it (it "
                    f"must return the keyword arguments of one generation for seed={spec.seed})"]
        if not isinstance(inputs, Mapping):
            return [f"{where}: inputs {_name(spec.inputs)} returned a {type(inputs).__name__}, "
                    f"not a mapping; return a dict of keyword arguments (the kit calls "
                    f"pipeline(**inputs))"]
        try:
            with torch.inference_mode():
                output = pipeline(**dict(inputs))
        except Exception as exc:  # noqa: BLE001 - the author's pipeline failed
            return [f"{where}: calling the pipeline of {_name(spec.factory)} "
                    f"({type(pipeline).__qualname__}) with the inputs of {_name(spec.inputs)} "
                    f"raised {one_line(exc)}; fix the pipeline or its inputs"]
        try:
            leaves(output)
        except OutputStructureError as exc:
            return [f"{where}: the output of {type(pipeline).__qualname__} cannot be compared: "
                    f"{exc}"]
        outputs.append(output)
    from .observe import compare_outputs
    from .registry import CheckFailure

    try:
        compare_outputs("second run", outputs[1], outputs[0], reference="the first run")
    except CheckFailure as exc:
        return [f"{where}: two fresh builds and runs of seed={spec.seed} differ "
                f"({one_line(exc).removeprefix('CheckFailure: ')}); the kit compares offloaded "
                f"outputs bitwise against a reference, so seed every random draw (weights in "
                f"the factory, noise from a generator seeded by the inputs)"]
    return []


def failed_preflight(specs: Iterable[PipelineSpec]) -> dict[PipelineSpec, list[str]]:
    """The specs of ``specs`` that fail :func:`preflight`, with their problem lines."""
    out = {}
    for spec in specs:
        problems = preflight(spec)
        if problems:
            out[spec] = problems
    return out


#: spec -> {strategy: why its plan does not resolve}
_UNRESOLVED: dict[PipelineSpec, dict[str, str]] = {}


def unresolved_strategies(spec: PipelineSpec) -> dict[str, str]:
    """The strategies ``spec`` claims whose plan the resolver rejects for the kit's own selection
    (every component the strategy can offload), each with the resolver's message: one root cause
    (an undeclared block list, ...) that would otherwise fail, or crash, every check of that
    strategy.  Computed once per spec; a spec failing :func:`preflight` is not resolved."""
    if spec not in _UNRESOLVED:
        _UNRESOLVED[spec] = {} if preflight(spec) else _resolve_each(spec)
    return dict(_UNRESOLVED[spec])


def _resolve_each(spec: PipelineSpec) -> dict[str, str]:
    from offload_ref.plan import OffloadTopologyError

    out = {}
    for strategy in spec.strategies:
        plan = kit_plan(spec, strategy)
        if isinstance(plan, OffloadTopologyError):
            out[strategy] = " ".join(str(plan).split())
        # any other exception is not a topology verdict: the checks will say
    return out


# Note [One plan per run]
#     Planning a run asks each (spec, strategy) for its plan twice: the preflight, to report a
#     strategy whose plan the resolver rejects once instead of in every check, and the traits
#     (contracts/checks/_traits.py), for the rings the ring checks are planned on.  Both want
#     the same thing, the plan the kit's own selection resolves for a fresh build, so both take
#     it from :func:`kit_plan`, which resolves it once per (spec, strategy) and process and
#     keeps it (with the modules it names; the traits kept its rings before).  The cases
#     themselves build and enable their own pipelines, and each enable resolves its own plan.

#: (spec, strategy name) -> the kit's plan of a fresh build, or the exception raised getting it
_PLANS: dict[tuple[PipelineSpec, str], Any] = {}


def kit_plan(spec: PipelineSpec, strategy: Any) -> Any:
    """The plan the kit's selection resolves for a fresh build of ``spec`` under ``strategy``
    (a name or an ``OffloadStrategy``), or the exception building or resolving raised: one
    resolution per (spec, strategy) in a process (Note [One plan per run])."""
    from offload_ref.config import OffloadStrategy

    from .case import CheckCase

    key = (spec, str(getattr(strategy, "value", strategy)))
    if key not in _PLANS:
        case = None
        try:
            case = CheckCase(spec, OffloadStrategy(key[1]))
            _PLANS[key] = case.resolve(case.build(), case.config())
        except Exception as exc:  # noqa: BLE001 - kept: each asker decides what it means
            _PLANS[key] = exc
        finally:
            if case is not None:
                case.close()
    return _PLANS[key]


def _required(func: Callable[..., Any]) -> list[str]:
    params = inspect.signature(func).parameters.values()
    return [p.name for p in params if p.default is p.empty and p.name != "seed"
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _pipeline_kind_problem(where: str, pipeline: Any) -> str | None:
    if isinstance(pipeline, nn.Module):
        return None
    cls = f"{type(pipeline).__module__}.{type(pipeline).__qualname__}"
    if not callable(pipeline):
        return (f"{where}: the pipeline, a {cls}, is not callable; the kit runs a generation "
                f"as pipeline(**inputs): return an nn.Module or an object with __call__")
    from offload_ref.discovery import discover_components

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a declaration-less pipeline: a check reports it
            found = discover_components(pipeline)
    except Exception as exc:  # noqa: BLE001 - a malformed declaration
        return (f"{where}: the components of {cls} cannot be discovered ({one_line(exc)}); "
                f"fix its _dit_modules / _encoder_modules / _vae_modules declarations")
    if not (found.dits or found.encoders or found.vaes or found.residents):
        return (f"{where}: the pipeline, a {cls}, is neither an nn.Module nor an object with "
                f"discoverable components; declare its nn.Module attributes in _dit_modules, "
                f"_encoder_modules and _vae_modules (offload_ref.SupportsComponentDiscovery)")
    return None
