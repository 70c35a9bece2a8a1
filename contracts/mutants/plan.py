"""Mutants of plan resolution (§A), auto mode (§A.8) and the rejections the resolver owns
(§J.7): the checks they fail are in checks/plan.py."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from torch import nn

from offload_ref import discovery
from offload_ref.backends.auto import AutoOffloadBackend
from offload_ref.discovery import FALLBACK_NAMES, get_submodule_path
from offload_ref.plan import (
    AutoChoice,
    OffloadTopologyError,
    ResolvedComponent,
    ResolvedOffloadPlan,
    _Resolver,
    auto_candidates,
    resolve_candidate,
    resolve_offload_plan,
)

from ._declare import _patched


def _impure(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    pipeline.__dict__["_kit_resolved_here"] = True  # a resolver that caches on the model
    return plan


_resolutions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unstable(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    count = _resolutions.get(pipeline, 0)
    _resolutions[pipeline] = count + 1
    if count % 2:  # every second resolution of a pipeline lists its components backwards
        return dataclasses.replace(plan, components=plan.components[::-1])
    return plan


class _ClassAttrsWin(_Resolver):
    def _container_names(self, path: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        names = getattr(module, "_layerwise_offload_blocks_attrs", None)
        if names:
            return tuple(names), f"{type(module).__name__}._layerwise_offload_blocks_attrs"
        return super()._container_names(path, module)


def _class_attrs_win(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _ClassAttrsWin(pipeline, config).resolve()


def _scan_always(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    known = {id(c.module) for c in plan.components}
    extra = []
    for role, names in FALLBACK_NAMES.items():
        for name in names:
            module = get_submodule_path(pipeline, name)
            if isinstance(module, nn.Module) and id(module) not in known:
                known.add(id(module))
                extra.append(ResolvedComponent(name, module, role, False))
    return dataclasses.replace(plan, components=plan.components + tuple(extra))


def _warn_every_time(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    discovery._warned_classes.clear()
    return resolve_offload_plan(pipeline, config)


def _no_dotted_paths(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    return dataclasses.replace(
        plan, components=tuple(c for c in plan.components if "." not in c.path))


def _swallow_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError as exc:
        return ResolvedOffloadPlan(config.strategy, skip_reason=f"skipped: {exc}")


def _vague_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError:
        raise OffloadTopologyError("invalid offload topology") from None


def _legacy_as_explicit(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return resolve_offload_plan(pipeline, dataclasses.replace(config, explicit=True))


def _no_ring_aliases(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    components = tuple(
        dataclasses.replace(c, stacks=tuple(dataclasses.replace(s, aliases=()) for s in c.stacks))
        for c in plan.components)
    return dataclasses.replace(plan, components=components)


class _AcceptsResidentInBlock(_Resolver):
    def _check_unique_ownership(self, components):
        inside = {id(sub) for c in components for s in c.stacks for b in s.blocks
                  for sub in b.modules() if sub is not b}
        # A component inside a streamed block is silently streamed with it.
        super()._check_unique_ownership([c for c in components if id(c.module) not in inside])


def _resident_in_block_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsResidentInBlock(pipeline, config).resolve()


class _AcceptsSharedStorage(_Resolver):
    def _check_one_group_per_storage(self, components):
        pass  # left to the backend, which meets it mid-enable


def _shared_storage_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSharedStorage(pipeline, config).resolve()


class _VaeWithoutLifecycle(_Resolver):
    def _vaes(self, found, on_demand):
        selected = self.config.selects("vae")  # the lifecycle declaration is never checked
        return [ResolvedComponent(p, m, "vae", selected, selected) for p, m in found.vaes]


def _vae_without_lifecycle(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _VaeWithoutLifecycle(pipeline, config).resolve()


class _AcceptsSparse(_Resolver):
    def _reject_unreadable_storage(self, found):
        pass  # layouts and storages are never looked at: a sparse tensor crashes a later walk


def _sparse_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSparse(pipeline, config).resolve()


class _DelegatedUnvalidated(_Resolver):
    def _validate_delegated(self) -> None:
        pass


def _delegated_unvalidated(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _DelegatedUnvalidated(pipeline, config).resolve()


def _cycles_unchecked() -> Any:
    """Discovery walks the module graph without looking for a back edge."""
    return _patched(discovery, "require_acyclic", lambda *args, **kwargs: None)


class _BudgetBlindAuto(AutoOffloadBackend):
    """strategy='auto' that ignores the budget: always the coarsest strategy (every weight
    resident), as an offloader that reads "auto" as "off" does."""

    def _choose(self, pipeline):
        candidates = auto_candidates(pipeline, self.config, alignment=self.platform.alignment)
        chosen = candidates[0]
        plan = resolve_candidate(pipeline, chosen, alignment=self.platform.alignment)
        choice = AutoChoice(self.config.device_budget_bytes, chosen.name, tuple(candidates))
        return chosen, dataclasses.replace(plan, auto=choice)


class _HeadGreedyAuto(AutoOffloadBackend):
    """strategy='auto' that keeps one head block more than the budget allows (it compares the
    head's bytes with the budget, forgetting that the slots still stream)."""

    def _choose(self, pipeline):
        picked, plan = super()._choose(pipeline)
        heads = plan.auto.heads
        if picked in heads and heads.index(picked) + 1 < len(heads):
            picked = heads[heads.index(picked) + 1]
        return picked, plan


class _HeadlessAuto(AutoOffloadBackend):
    """strategy='auto' that never keeps a resident head: the budget between layerwise's peak
    and model level's goes unused."""

    def _choose(self, pipeline):
        picked, plan = super()._choose(pipeline)
        return (plan.auto.heads[0] if plan.auto.heads else picked), plan
