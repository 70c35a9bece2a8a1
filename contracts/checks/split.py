"""Catalogue §E: split-model phase swaps (the Cosmos3 shape)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from offload_ref.split import ComponentGroups

from ..registry import check, fail
from ..observe import is_offloaded, is_resident
from ..facts import expect_error, hook_residue, module_view, offload_attributes, snapshot


def split_groups(pipeline: nn.Module) -> list[tuple[nn.Module, ComponentGroups]]:
    """(module with _offload_context, its ComponentGroups) pairs."""
    out = []
    for module in module_view(pipeline).modules():
        for value in module.__dict__.values():
            if isinstance(value, ComponentGroups):
                out.append((module, value))
    return out


@contextmanager
def _watch_contexts(groups: ComponentGroups, on_enter) -> Iterator[Counter]:
    """Count (and observe) every ``groups.context(name)`` entry."""
    counts: Counter = Counter()
    original = groups.context

    @contextmanager
    def watched(name: str):
        with original(name):
            counts[name] += 1
            on_enter(name)
            yield

    groups.context = watched  # an instance attribute shadows the method; removed below
    try:
        yield counts
    finally:
        del groups.context


def _members(groups: ComponentGroups) -> dict[str, list[nn.Module]]:
    return {name: list(mods) for name, mods in groups._groups.items()}


@check("E", strategies=("model_level",), requires=("split_model",))
def check_split_model_keeps_exactly_one_component_resident(case) -> None:
    """While a component's phase runs it is device-resident and every other component is on
    the host; modules the pipeline pins (the VAE) stay on the device."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    problems: list[str] = []
    vaes = [m for n, m in module_view(pipeline).named_children() if "vae" in n]
    for owner, groups in split_groups(pipeline):
        members = _members(groups)

        def on_enter(name: str) -> None:
            for other, mods in members.items():
                for m in mods:
                    if other == name and not is_resident(platform, m):
                        problems.append(f"{name} runs while not resident")
                    if other != name and not is_offloaded(platform, m):
                        problems.append(f"{other} is on the device while {name} runs")
            for vae in vaes:
                if not is_resident(platform, vae):
                    problems.append(f"the VAE left the device while {name} runs")

        with _watch_contexts(groups, on_enter) as counts:
            case.compare("split model offloaded", case.run(pipeline), case.reference())
        if not counts:
            problems.append(f"{type(owner).__name__}._offload_context was never entered")
    backend.disable()
    if problems:
        fail(sorted(set(problems))[0])


@check("E", strategies=("model_level",), requires=("reasoner_and_generator",))
def check_split_model_runs_reasoner_once_and_generator_every_step(case) -> None:
    """Per generation the reasoner phase runs once and the generator phase every step."""
    pipeline = case.build()
    inputs = case.inputs()
    steps = inputs.get("num_inference_steps")
    backend = case.backend()
    backend.enable(pipeline)
    for _, groups in split_groups(pipeline):
        with _watch_contexts(groups, lambda name: None) as counts:
            case.run(pipeline, inputs)
        if counts.get("reasoner") != 1 or counts.get("generator") != steps:
            fail(f"phase counts {dict(counts)}, expected reasoner=1 and generator={steps}")
    backend.disable()


@check("E", strategies=("model_level",), requires=("split_model",))
def check_split_model_rejects_unknown_component(case) -> None:
    """_offload_context with an unknown name raises ValueError, enabled or not."""
    pipeline = case.build()
    backend = case.backend()
    for state in ("disabled", "enabled"):
        if state == "enabled":
            backend.enable(pipeline)
        for owner, _ in split_groups(pipeline):
            def enter(owner=owner) -> None:
                with owner._offload_context("kit-unknown-component"):
                    pass

            expect_error(f"unknown component while {state}", enter,
                         mentions=("kit-unknown-component",))
    backend.disable()


@check("E", strategies=("model_level",), requires=("split_model",))
def check_split_model_context_is_a_noop_when_offload_is_off(case) -> None:
    """With offload disabled, entering a component context moves nothing."""
    pipeline = case.build()
    before = snapshot(pipeline, values=True)
    for owner, groups in split_groups(pipeline):
        for name in groups.names:
            with owner._offload_context(name):
                pass
    problems = before.diff(snapshot(pipeline, values=True))
    if problems:
        fail(f"_offload_context changed the pipeline with offload off: {problems[:4]}")


def _accepts(fn: Any, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _spy(pipeline: nn.Module, fail_enable: bool = False) -> dict[str, list]:
    """Record the delegation calls; forward to the pipeline what its own signature accepts."""
    calls: dict[str, list] = {"enable": [], "disable": []}
    enable, disable = pipeline.enable_omni_model_cpu_offload, \
        pipeline.disable_omni_model_cpu_offload

    def spy_enable(**kwargs):
        calls["enable"].append(kwargs)
        enable(**{k: v for k, v in kwargs.items() if _accepts(enable, k)})
        if fail_enable:
            raise RuntimeError("kit: the pipeline's enable failed after partial work")

    def spy_disable():
        calls["disable"].append(True)
        disable()

    pipeline.__dict__["enable_omni_model_cpu_offload"] = spy_enable
    pipeline.__dict__["disable_omni_model_cpu_offload"] = spy_disable
    return calls


def _unspy(pipeline: nn.Module) -> None:
    pipeline.__dict__.pop("enable_omni_model_cpu_offload", None)
    pipeline.__dict__.pop("disable_omni_model_cpu_offload", None)


@check("E", strategies=("model_level",), requires=("delegates_model_level",))
def check_split_model_enable_and_disable_are_delegated(case) -> None:
    """The backend calls the pipeline's enable_omni_model_cpu_offload once with device,
    pin_memory and (when its signature takes it) the component selection, and its disable
    once."""
    pipeline = case.build()
    calls = _spy(pipeline)
    backend = case.backend()
    backend.enable(pipeline)
    backend.disable()
    _unspy(pipeline)
    if len(calls["enable"]) != 1 or len(calls["disable"]) != 1:
        fail(f"enable called {len(calls['enable'])}x, disable {len(calls['disable'])}x; "
             "expected once each")
    kwargs = calls["enable"][0]
    wanted = ["device", "pin_memory"]
    if _accepts(pipeline.enable_omni_model_cpu_offload, "components"):
        wanted.append("components")
    missing = [k for k in wanted if k not in kwargs]
    if missing:
        fail(f"enable_omni_model_cpu_offload was called without {missing}: {sorted(kwargs)}")
    if kwargs["pin_memory"] != backend.config.pin_memory:
        fail("pin_memory was not passed through")


@check("E", strategies=("model_level",), requires=("delegates_model_level",))
def check_split_model_failed_enable_calls_disable(case) -> None:
    """A failure inside the pipeline's enable calls its disable, leaves the backend disabled and
    the pipeline restored, and chains the cause; a retry works."""
    pipeline = case.build()
    before = snapshot(pipeline, values=True)
    calls = _spy(pipeline, fail_enable=True)
    platform = case.platform()
    backend = case.backend(platform=platform)
    try:
        backend.enable(pipeline)
    except Exception as exc:
        error = exc
    else:
        fail("enable succeeded although the pipeline's enable raised")
    _unspy(pipeline)
    chain, e = [], error
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    if not any("kit: the pipeline's enable failed" in m for m in chain):
        fail(f"the error does not chain the pipeline's failure: {error!r}")
    if not calls["disable"]:
        fail("the pipeline's disable_omni_model_cpu_offload was not called after its enable "
             "failed")
    if backend.is_enabled():
        fail("backend enabled after a failed delegated enable")
    problems = before.diff(snapshot(pipeline, values=True), pointers=False)
    problems += hook_residue(pipeline) + offload_attributes(pipeline)
    if problems or platform.memory_allocated():
        fail(f"pipeline not restored after a failed delegated enable: {problems[:4]}, "
             f"{platform.memory_allocated()} device bytes")
    backend.enable(pipeline)
    case.compare("retry after a failed delegated enable", case.run(pipeline),
                    case.reference())
    backend.disable()
