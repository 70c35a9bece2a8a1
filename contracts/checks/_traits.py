"""Computing the traits record (:mod:`..traits`): once per (spec, strategy), for every check.

Each trait is probed here and nowhere else, at most once per (spec, strategy), and only when a
check asks for it: the runner asks, per (spec, strategy), for every trait its selected checks
require, so that the full catalogue probes each pipeline once and one selected check costs its
own probes only.  The facts read from the pipeline as built share one build; the ring traits
share one resolved plan (the plan a check case resolves, under the record's strategy); the skip
experiment mutates and runs a pipeline of its own.  A probe that
raises leaves its trait None and the exception in :attr:`PipelineTraits.errors`, so only the
checks requiring that trait report it.  The probes do not depend on the implementation under
test (they use offload-ref's resolver, as a check case's ``build`` and ``config`` do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from offload_ref.discovery import discover_components, get_submodule_path

from ..preflight import kit_plan
from ..spec import PipelineSpec
from ..traits import Missing, PipelineTraits, TRAITS
from ..facts import dit_block_count, storage_groups
from .aliases import tie_candidate_in
from .plan import encoder_block_list_of
from .residency import skip_block, streaming_rings
from .split import split_groups

__all__ = ["traits_of"]

#: (spec, strategy) -> its record, for the process's lifetime (as the preflight's results).
_RECORDS: dict[tuple[PipelineSpec, str], PipelineTraits] = {}


def traits_of(spec: PipelineSpec, strategy: Any,
              wanted: Iterable[str] | None = None) -> PipelineTraits:
    """The traits of ``spec`` under ``strategy`` (a name or an ``OffloadStrategy``): at least
    ``wanted`` (trait names; None: every trait) probed.  Each trait is probed on the first call
    that wants it and kept; a call wanting nothing new returns the same record."""
    key = (spec, str(getattr(strategy, "value", strategy)))
    names = set(TRAITS) if wanted is None else set(wanted)
    unknown = names - set(TRAITS)
    if unknown:
        raise ValueError(f"unknown trait(s) {sorted(unknown)}; traits: {', '.join(TRAITS)}")
    known = _RECORDS.get(key)
    missing = names - (known.probed if known is not None else set())
    if known is None or missing:
        _RECORDS[key] = _compute(spec, key[1], missing, known)
    return _RECORDS[key]


class _Once:
    """A zero-argument call made once: its value, or the exception it raised, kept."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn, self._done, self._value, self._error = fn, False, None, None

    def __call__(self) -> Any:
        if not self._done:
            self._done = True
            try:
                self._value = self._fn()
            except Exception as exc:  # noqa: BLE001 - kept, and raised to each fact that needs it
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value


def _compute(spec: PipelineSpec, strategy: str, names: set[str],
             known: PipelineTraits | None) -> PipelineTraits:
    """``known`` (None: a record of nothing yet) with the traits ``names`` probed too."""
    pipeline = _Once(spec.build)
    found = _Once(lambda: discover_components(pipeline()))
    dit = _Once(lambda: dit_block_count(pipeline(), found()))
    ring = _Once(lambda: _resolved_rings(spec, strategy))

    delegates = _Once(lambda: strategy == "model_level" and callable(
        getattr(pipeline(), "enable_omni_model_cpu_offload", None)))
    phases = _Once(lambda: [tuple(g.names) for _, g in split_groups(pipeline())]
                   if delegates() else [])

    probes: dict[str, Callable[[], Any]] = {
        "delegates_model_level": delegates,
        "split_model": lambda: bool(phases()),
        "reasoner_and_generator": lambda: any({"reasoner", "generator"} <= set(phase)
                                              for phase in phases()),
        "has_vae": lambda: bool(found().vaes),
        "dit_path": lambda: dit()[0],
        "dit_blocks": lambda: dit()[1],
        "encoder_block_list": lambda: encoder_block_list_of(pipeline()),
        "shares_storage": lambda: bool(storage_groups(pipeline())),
        "tie_candidate": lambda: _tie_candidate(ring()),
        "skippable_block": lambda: _skippable_block(spec, strategy),
        "importable": lambda: _importable(spec),
        "streams_blocks": lambda: _streams_blocks(ring(), strategy),
    }
    assert set(probes) == set(TRAITS), set(probes) ^ set(TRAITS)
    if known is None:
        known = PipelineTraits(spec=spec.name, strategy=strategy)
    values: dict[str, Any] = {}
    errors = list(known.errors)
    for name in probes:  # in the record's order, whatever order they were asked in
        if name not in names:
            continue
        try:
            values[name] = probes[name]()
        except Exception as exc:  # noqa: BLE001 - the checks requiring it report it
            values[name] = None
            errors.append((name, exc))
    return dataclasses.replace(known, probed=known.probed | frozenset(names),
                               errors=tuple(errors), **values)


def _resolved_rings(spec: PipelineSpec, strategy: str) -> tuple[list[Any], list[Any]] | Exception:
    """The plan a check case of ``spec`` resolves under ``strategy`` (the preflight's: Note [One
    plan per run] in contracts/preflight.py): its rings, and its DiTs' rings; or the exception
    resolving raised (each ring trait decides what it makes of it)."""
    plan = kit_plan(spec, strategy)
    if isinstance(plan, Exception):
        return plan
    return streaming_rings(plan), [s for c in plan.dits for s in c.rings]


def _tie_candidate(ring: Any) -> str | None:
    if isinstance(ring, ValueError):  # a plan that does not resolve has nothing to tie
        return None
    if isinstance(ring, Exception):
        raise ring
    found = tie_candidate_in(ring[0])
    return None if found is None else found[2]


def _streams_blocks(ring: Any, strategy: str) -> bool | Missing:
    if not isinstance(ring, Exception) and any(len(s.streamed_blocks) >= 2 for s in ring[1]):
        return True
    return Missing(f"needs a DiT ring streaming two or more blocks under {strategy}")


def _importable(spec: PipelineSpec) -> bool | Missing:
    if isinstance(spec.factory, str) and isinstance(spec.inputs, str):
        return True
    return Missing("needs the factory and inputs as importable module:attr strings (spawned "
                   "ranks rebuild the pipeline from them), not callables")


def _skippable_block(spec: PipelineSpec, strategy: str) -> str | Missing:
    """Skip the middle block of the first streamed nn.ModuleList of three or more (on a pipeline
    of its own) and run: the block's path when the pipeline runs without it, else why not."""
    plan = kit_plan(spec, strategy)  # its paths, found on the kit's build (Note [One plan ...])
    if isinstance(plan, ValueError):
        return Missing("needs a pipeline whose layerwise plan resolves (the plan checks report "
                       "why it does not)")
    if isinstance(plan, Exception):
        raise plan
    pipeline = spec.build()  # skipped on a pipeline of its own
    for ring in [r for c in plan.dits for r in c.rings]:
        for path in ring.container_paths:
            c = get_submodule_path(pipeline, path)
            if isinstance(c, nn.ModuleList) and len(c) >= 3:
                calls = []
                victim = c[len(c) // 2]
                h = victim.register_forward_pre_hook(lambda m, a: calls.append(1))
                skip_block(c, len(c) // 2)
                try:
                    with torch.inference_mode():
                        pipeline(**spec.make_inputs())
                except Exception as exc:  # noqa: BLE001 - skipping this block breaks the model
                    return Missing(
                        f"needs a block that can be skipped; skipping {path}[{len(c) // 2}] "
                        f"makes the pipeline raise {type(exc).__name__}")
                finally:
                    h.remove()
                if calls:
                    return Missing(
                        f"needs a pipeline that iterates its block list; {path} is called by "
                        f"index (a skipped entry still ran)")
                return f"{path}[{len(c) // 2}]"
    return Missing("needs a streamed nn.ModuleList of three or more blocks")
