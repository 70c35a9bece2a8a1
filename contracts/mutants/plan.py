"""Mutants of plan resolution (§A), auto mode (§A.8) and the rejections the resolver owns
(§J.7): the checks they fail are in checks/plan.py."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from torch import nn

from offload_ref.backends.auto import AutoOffloadBackend
from offload_ref.discovery import FALLBACK_NAMES, forget_scan_warnings, get_submodule_path
from offload_ref.plan import (
    AutoChoice,
    OffloadTopologyError,
    ResolvedComponent,
    ResolvedOffloadPlan,
    Resolver,
    auto_candidates,
    resolve_candidate,
    resolve_offload_plan,
)

from ._declare import AUTO, HEAD, J7, J7_SPLIT, RESOLVER, backend_with, declare


# -- §A: resolution --------------------------------------------------------------------------------


def _impure(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    pipeline.__dict__["_kit_resolved_here"] = True  # a resolver that caches on the model
    return plan


declare(
    "impure_resolver", "resolution writes an attribute on the pipeline", RESOLVER,
    resolve_offload_plan=_impure,
    kills={"check_plan_resolution_is_pure"},
)


_resolutions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unstable(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    count = _resolutions.get(pipeline, 0)
    _resolutions[pipeline] = count + 1
    if count % 2:  # every second resolution of a pipeline lists its components backwards
        return dataclasses.replace(plan, components=plan.components[::-1])
    return plan


declare(
    "unstable_resolver", "every second resolution lists components in another order", RESOLVER,
    resolve_offload_plan=_unstable,
    kills={"check_plan_resolution_is_repeatable"},
)


class _ClassAttrsWin(Resolver):
    def container_names(self, path: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        names = getattr(module, "_layerwise_offload_blocks_attrs", None)
        if names:
            return tuple(names), f"{type(module).__name__}._layerwise_offload_blocks_attrs"
        return super().container_names(path, module)


def _class_attrs_win(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _ClassAttrsWin(pipeline, config).resolve()


declare(
    "class_attrs_beat_plan", "_layerwise_offload_blocks_attrs wins over OffloadPlan", RESOLVER,
    resolve_offload_plan=_class_attrs_win,
    kills={
        "check_missing_block_container_is_rejected",
        "check_plan_block_attrs_beat_class_attributes",
        "check_single_block_dit_is_rejected",
    },
)


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


declare(
    "scan_despite_declarations", "the name scan runs even when components are declared", RESOLVER,
    resolve_offload_plan=_scan_always,
    kills={"check_declared_components_beat_attribute_scan"},
)


def _warn_every_time(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    forget_scan_warnings()
    return resolve_offload_plan(pipeline, config)


declare(
    "warns_every_time", "the fallback-scan warning repeats for every resolution", RESOLVER,
    resolve_offload_plan=_warn_every_time,
    kills={"check_attribute_scan_warns_once_per_pipeline_class"},
)


def _no_dotted_paths(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    return dataclasses.replace(
        plan, components=tuple(c for c in plan.components if "." not in c.path))


declare(
    "no_dotted_paths", "nested (dotted) components are dropped", RESOLVER,
    resolve_offload_plan=_no_dotted_paths,
    kills={"check_dotted_paths_resolve_nested_components"},
)


#: The checks that a topology the resolver must reject is rejected, with a message naming the
#: path and the fix: a resolver that skips such topologies fails them all, and so does one whose
#: messages name neither.
_TOPOLOGY_REJECTIONS = {
    "check_block_claimed_by_two_components_is_rejected",
    "check_encoder_allgather_requires_declared_replication",
    "check_missing_block_container_is_rejected",
    "check_model_level_without_dit_is_rejected",
    "check_model_level_without_encoder_is_rejected",
    "check_on_demand_component_without_lifecycle_is_rejected",
    "check_resident_inside_a_streamed_block_is_rejected",
    "check_resident_layers_leaving_one_streaming_block_are_rejected",
    "check_resident_layers_need_a_resident_dit_path",
    "check_single_block_dit_is_rejected",
    "check_tensor_in_two_model_level_groups_is_rejected",
    "check_vae_selection_without_lifecycle_is_rejected",
}


def _swallow_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError as exc:
        return ResolvedOffloadPlan(config.strategy, skip_reason=f"skipped: {exc}")


declare(
    "swallows_topology_errors", "invalid topologies are skipped instead of rejected", RESOLVER,
    resolve_offload_plan=_swallow_topology_errors,
    kills=_TOPOLOGY_REJECTIONS,
)


def _vague_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError:
        raise OffloadTopologyError("invalid offload topology") from None


declare(
    "vague_topology_errors", "topology errors name no path and no fix", RESOLVER,
    resolve_offload_plan=_vague_topology_errors,
    kills=_TOPOLOGY_REJECTIONS,
)


def _legacy_as_explicit(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return resolve_offload_plan(pipeline, dataclasses.replace(config, explicit=True))


declare(
    "legacy_is_strict", "legacy flags get the explicit, erroring topology rules", RESOLVER,
    resolve_offload_plan=_legacy_as_explicit,
    kills={"check_legacy_topology_without_dit_is_a_recorded_noop"},
)


def _no_ring_aliases(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    components = tuple(
        dataclasses.replace(c, rings=tuple(dataclasses.replace(s, aliases=()) for s in c.rings))
        for c in plan.components)
    return dataclasses.replace(plan, components=components)


declare(
    "name_based_aliases", "the plan records no ring aliases", RESOLVER,
    resolve_offload_plan=_no_ring_aliases,
    kills={"check_tensors_aliasing_a_block_belong_to_its_ring"},
)


class _AcceptsResidentInBlock(Resolver):
    def check_unique_ownership(self, components):
        inside = {id(sub) for c in components for s in c.rings for b in s.blocks
                  for sub in b.modules() if sub is not b}
        # A component inside a streamed block is silently streamed with it.
        super().check_unique_ownership([c for c in components if id(c.module) not in inside])


def _resident_in_block_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsResidentInBlock(pipeline, config).resolve()


declare(
    "resident_in_block_accepted",
    "a resident declared inside a streamed block silently streams with it",
    RESOLVER,
    resolve_offload_plan=_resident_in_block_accepted,
    kills={"check_resident_inside_a_streamed_block_is_rejected"},
)


class _AcceptsSharedStorage(Resolver):
    def check_one_group_per_storage(self, components):
        pass  # left to the backend, which meets it mid-enable


def _shared_storage_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSharedStorage(pipeline, config).resolve()


declare(
    "shared_storage_accepted",
    "a storage in two model-level groups is left for enable to meet",
    RESOLVER,
    resolve_offload_plan=_shared_storage_accepted,
    kills={"check_tensor_in_two_model_level_groups_is_rejected"},
)


class _VaeWithoutLifecycle(Resolver):
    def vae_components(self, found, on_demand):
        selected = self.config.selects("vae")  # the lifecycle declaration is never checked
        return [ResolvedComponent(p, m, "vae", selected, selected) for p, m in found.vaes]


def _vae_without_lifecycle(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _VaeWithoutLifecycle(pipeline, config).resolve()


declare(
    "vae_selection_without_lifecycle",
    "a selected VAE is handed to a lifecycle the pipeline never declared",
    RESOLVER,
    resolve_offload_plan=_vae_without_lifecycle,
    kills={  # the on-demand lifecycle goes unchecked as well
        "check_on_demand_component_without_lifecycle_is_rejected",
        "check_vae_selection_without_lifecycle_is_rejected",
    },
)


# -- §J.7: rejections the resolver owns ------------------------------------------------------------


class _AcceptsSparse(Resolver):
    def reject_unreadable_storage(self, found):
        pass  # layouts and storages are never looked at: a sparse tensor crashes a later walk


def _sparse_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSparse(pipeline, config).resolve()


declare(
    "sparse_buffer_accepted", "a sparse buffer reaches the storage walks", J7,
    resolve_offload_plan=_sparse_accepted,
    kills={"check_sparse_buffer_is_rejected_before_mutation"},
)


class _DelegatedUnvalidated(Resolver):
    def validate_delegated(self) -> None:
        pass


def _delegated_unvalidated(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _DelegatedUnvalidated(pipeline, config).resolve()


declare(
    "delegated_unvalidated",
    "a split model that delegates model level skips the input validation every other pipeline gets",
    J7_SPLIT,
    resolve_offload_plan=_delegated_unvalidated,
    kills={
        "check_sparse_buffer_is_rejected_before_mutation",
        "check_cyclic_module_graph_is_rejected_before_mutation",
    },
)


class _CyclesUnchecked(Resolver):
    def check_acyclic(self, root, prefix=""):
        pass  # discovery walks the module graph without looking for a back edge


def _cycles_unchecked(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _CyclesUnchecked(pipeline, config).resolve()


declare(
    "cyclic_graph_unchecked", "a cyclic module graph is walked without a cycle check", J7,
    resolve_offload_plan=_cycles_unchecked,
    kills={"check_cyclic_module_graph_is_rejected_before_mutation"},
)


# -- §A.8: auto mode -------------------------------------------------------------------------------


class _BudgetBlindAuto(AutoOffloadBackend):
    """strategy='auto' that ignores the budget: always the coarsest strategy (every weight
    resident), as an offloader that reads "auto" as "off" does."""

    def choose(self, pipeline):
        candidates = auto_candidates(pipeline, self.config, alignment=self.platform.alignment)
        chosen = candidates[0]
        plan = resolve_candidate(pipeline, chosen, alignment=self.platform.alignment)
        choice = AutoChoice(self.config.device_budget_bytes, chosen.name, tuple(candidates))
        return chosen, dataclasses.replace(plan, auto=choice)


declare(
    "auto_ignores_budget",
    "strategy='auto' ignores device_budget_bytes: every weight stays resident",
    AUTO,
    make_backend=backend_with(AutoOffloadBackend=_BudgetBlindAuto),
    kills={"check_auto_mode_measured_peak_never_exceeds_the_budget"},
)


class _HeadGreedyAuto(AutoOffloadBackend):
    """strategy='auto' that keeps one head block more than the budget allows (it compares the
    head's bytes with the budget, forgetting that the slots still stream)."""

    def choose(self, pipeline):
        picked, plan = super().choose(pipeline)
        heads = plan.auto.heads
        if picked in heads and heads.index(picked) + 1 < len(heads):
            picked = heads[heads.index(picked) + 1]
        return picked, plan


declare(
    "auto_head_over_budget",
    "strategy='auto' keeps one resident head block more than the budget allows",
    HEAD,
    make_backend=backend_with(AutoOffloadBackend=_HeadGreedyAuto),
    kills={
        "check_auto_mode_fills_the_budget_with_a_resident_head",
        "check_auto_mode_measured_peak_never_exceeds_the_budget",
    },
)


class _HeadlessAuto(AutoOffloadBackend):
    """strategy='auto' that never keeps a resident head: the budget between layerwise's peak
    and model level's goes unused."""

    def choose(self, pipeline):
        picked, plan = super().choose(pipeline)
        return (plan.auto.heads[0] if plan.auto.heads else picked), plan


declare(
    "auto_keeps_no_head",
    "strategy='auto' never fills the budget left above layerwise's peak with a resident head",
    HEAD,
    make_backend=backend_with(AutoOffloadBackend=_HeadlessAuto),
    kills={"check_auto_mode_fills_the_budget_with_a_resident_head"},
)
