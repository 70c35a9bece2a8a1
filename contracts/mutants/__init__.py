"""Deliberately broken offloaders: the kit proves each check can fail.

Every mutant is the real implementation with one defect that other offloaders have shipped (see
``shared/reference``).  ``tests/test_mutants.py`` runs the catalogue against each one and asserts
exactly which checks fail; a check that no mutant kills is itself a failing test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.model_level import ModelLevelOffloadBackend

from ..case import DEFAULT_IMPLEMENTATION, Implementation
from ._declare import (
    Mutant, _backend_with, _layerwise, _patched, _RESOLVER, _MODEL_LEVEL, _LAYERWISE, _SPLIT,
    _ALIGNMENT, _MISUSE_LAYER, _MISUSE_MODEL, _J7, _SPLIT_THREADS, _J7_SPLIT, _INTERRUPTS,
    _DISTRIBUTED, _NESTED_RESIDENT, _AUTO, _HEAD, _PROTOCOL,
)
from .plan import (
    _impure, _unstable, _class_attrs_win, _scan_always, _warn_every_time, _no_dotted_paths,
    _swallow_topology_errors, _vague_topology_errors, _legacy_as_explicit, _no_ring_aliases,
    _resident_in_block_accepted, _shared_storage_accepted, _vae_without_lifecycle,
    _sparse_accepted, _delegated_unvalidated, _cycles_unchecked, _BudgetBlindAuto, _HeadGreedyAuto,
    _HeadlessAuto,
)
from .lifecycle import (
    _RollbackMissesAHook, _LeavesAHook, _RollbackLeaksDeviceMemory, _RollbackLeaksHostMasters,
    _LosesTheCause, _DisableNotIdempotent, _ForgetsPlacement, _KeepsInterruptedBlocksRunning,
)
from .aliases import _NameBasedPlacement, _TwoMastersRing
from .split import (
    _DelegatesWithoutDisable, _unchecked_component_names, _copies_when_disabled,
    _keeps_both_resident, _DelegationDropsComponents, _cosmos3_reasoner_every_step,
)
from .residency import (
    _HeadStreamedRing, _HooksTheHead, _HeadUnpredicted, _InferenceBlindModelLevel,
    _InferenceBlindLayerwise, _DoubleCopyOnSwap, _StatsCountHostAsDevice, _TwoGroupsResident,
    _VaeOffloaded, _NestedResidentSwaps, _D2HOnSwap, _packs_without_padding,
    _realigns_every_tensor, _NoReadyWait, _NoFreeWait, _NoWrapAround, _NoRecoveryRing,
    _SilentlySerialRing, _ThreeSlotsRing,
)
from .misuse import (
    _split_threads_unguarded, _EditsUnguarded, _editing_in_place, _PlaceholderStateDict,
    _unguarded, _backward_not_refused, _reads_between_forwards_allowed,
    _frozen_backward_not_refused, _unguarded_calls, _copies_not_refused,
)
from .distributed import (
    _garbage_padding_build, _wrong_rank_build, _ready_on_copy_stream_fill,
    _gathers_rank_local_rings, _recovery_waits_for_copies_only, _buffers_left_uninitialized,
    _wave_runner_without_agreement,
)

__all__ = ["MUTANTS", "Mutant"]


def _m(name: str, defect: str, scope: dict, *, patch: Any = None, factory: Any = None,
       **changes: Any) -> Mutant:
    impl = DEFAULT_IMPLEMENTATION.replace(name=name, in_rank=f"{__name__}:in_rank", **changes)
    return Mutant(name, defect, impl, kills=frozenset(KILLS[name]), patch=patch,
                  factory=factory, placement_kills=frozenset(PLACEMENT_KILLS.get(name, ())),
                  **scope)


def _protocol(name: str) -> Mutant:
    from .. import simple_offloader
    from ..offloader import offloader_implementation

    factory, defect = simple_offloader.BROKEN[name]
    impl = offloader_implementation(factory, name=f"{simple_offloader.__name__}:{name}",
                                    validate=False)
    return Mutant(name, defect, impl, kills=frozenset(KILLS[name]),
                  placement_kills=frozenset(PLACEMENT_KILLS.get(name, ())), **_PROTOCOL)


def _resolver(name: str, defect: str, resolve: Callable[..., Any]) -> Mutant:
    return _m(name, defect, _RESOLVER, resolve_offload_plan=resolve)


def _model_level(name: str, defect: str, backend: type, scope: dict = _MODEL_LEVEL) -> Mutant:
    return _m(name, defect, scope,
              make_backend=_backend_with(ModelLevelOffloadBackend=backend))


def _layer(name: str, defect: str, backend: type) -> Mutant:
    return _layer_scoped(name, defect, backend, _LAYERWISE)


def _layer_scoped(name: str, defect: str, backend: type, scope: dict) -> Mutant:
    return _m(name, defect, scope, make_backend=_backend_with(LayerWiseOffloadBackend=backend))


def _distributed(name: str, defect: str, *, scope: dict = _DISTRIBUTED, **patches: Any) -> Mutant:
    """A mutant of the AllGather transport or the distributed backend, applied (by name) inside
    every spawned rank too (Note [One spawn per batch] in checks/distributed.py)."""
    def patch() -> Any:
        from offload_ref.backends import distributed

        stack = contextlib.ExitStack()
        for qualified, value in patches.items():
            owner_name, attr = qualified.split(".")
            stack.enter_context(_patched(getattr(distributed, owner_name), attr, value))
        return stack

    return _m(name, defect, scope, patch=patch)


#: Exactly the checks each mutant fails (asserted by tests/test_mutants.py).
KILLS: dict[str, set[str]] = {
    "auto_ignores_budget": {"check_auto_mode_measured_peak_never_exceeds_the_budget"},
    "auto_head_over_budget": {"check_auto_mode_fills_the_budget_with_a_resident_head",
                              "check_auto_mode_measured_peak_never_exceeds_the_budget"},
    "auto_keeps_no_head": {"check_auto_mode_fills_the_budget_with_a_resident_head"},
    "delegated_unvalidated": {"check_sparse_buffer_is_rejected_before_mutation",
                              "check_cyclic_module_graph_is_rejected_before_mutation"},
    "split_threads_unguarded": {"check_second_thread_gets_a_clear_error_or_exact_output"},
    "interrupt_recovery_ignores_gathers": {
        "check_allgather_generation_after_an_interrupt_is_exact"},
    "skipped_rank_runs_alone": {"check_rank_whose_plan_is_skipped_makes_every_rank_raise"},
    "edits_unguarded": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change"},
    "head_streamed": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "head_hooked": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "head_not_predicted": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "shard_not_zero_padded": {"check_allgather_shards_are_zero_padded"},
    "wrong_rank_shard_gathered": {
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_distributed_cycles_restore_every_rank",
    },
    "no_wait_between_gather_and_compute": {  # the generation and disable raise StreamOrderError
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_allgather_host_bytes_per_rank_are_one_over_world",
        "check_allgather_keeps_two_slots_per_rank",
        "check_allgather_shards_are_zero_padded",
        "check_distributed_cycles_restore_every_rank",
        "check_no_collective_at_enable",
    },
    "eager_collective_at_enable": {  # and rank 0's eager gather is never matched by failed rank 1
        "check_no_collective_at_enable",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
    "unequal_wave_steps_accepted": {
        "check_wave_with_unequal_steps_is_rejected_before_any_collective",
    },
    "mmap_drops_non_persistent_buffers": {
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
    "rank_local_rings_gather": {  # rank-local mode is what the mmap scenario streams too
        "check_rank_local_outputs_match_each_ranks_reference",
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
    "failed_rank_leaves_the_others_waiting": {
        "check_rank_whose_plan_is_skipped_makes_every_rank_raise",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
    "rollback_leaks_host_masters": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
    },
    "inference_tensors_rebound_as_normal": {
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    "inference_tensors_rebound_as_normal_layerwise": {
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    "double_copy_on_swap": {
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
    "silently_serial": {
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
    "stats_count_host_as_device": {
        "check_stats_match_what_the_platform_saw",
    },
    "rollback_leaks_device_memory": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
    "enable_error_loses_cause": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
    },
    "disable_not_idempotent": {
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_second_disable_is_a_noop",
    },
    "impure_resolver": {
        "check_plan_resolution_is_pure",
    },
    "unstable_resolver": {
        "check_plan_resolution_is_repeatable",
    },
    "class_attrs_beat_plan": {
        "check_missing_block_container_is_rejected",
        "check_plan_block_attrs_beat_class_attributes",
        "check_single_block_dit_is_rejected",
    },
    "scan_despite_declarations": {
        "check_declared_components_beat_attribute_scan",
    },
    "warns_every_time": {
        "check_attribute_scan_warns_once_per_pipeline_class",
    },
    "no_dotted_paths": {
        "check_dotted_paths_resolve_nested_components",
    },
    "swallows_topology_errors": {
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
    },
    "vague_topology_errors": {
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
    },
    "legacy_is_strict": {
        "check_legacy_topology_without_dit_is_a_recorded_noop",
    },
    "resident_in_block_accepted": {
        "check_resident_inside_a_streamed_block_is_rejected",
    },
    "shared_storage_accepted": {
        "check_tensor_in_two_model_level_groups_is_rejected",
    },
    "vae_selection_without_lifecycle": {  # the on-demand lifecycle goes unchecked as well
        "check_on_demand_component_without_lifecycle_is_rejected",
        "check_vae_selection_without_lifecycle_is_rejected",
    },
    "sparse_buffer_accepted": {
        "check_sparse_buffer_is_rejected_before_mutation",
    },
    "cyclic_graph_unchecked": {
        "check_cyclic_module_graph_is_rejected_before_mutation",
    },
    "nested_resident_swaps_with_its_dit": {
        "check_model_level_keeps_one_group_resident",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
    },
    "name_based_aliases": {
        "check_tensors_aliasing_a_block_belong_to_its_ring",
    },
    "rollback_misses_a_hook": {
        "check_failed_enable_can_be_retried",
        "check_failed_enable_restores_the_pipeline",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
    "hook_left_after_disable": {
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_enable_disable_cycles_match_the_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
    "two_groups_resident": {
        "check_model_level_keeps_one_group_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
    "vae_offloaded": {
        "check_model_level_keeps_one_group_resident",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_peak_device_bytes_stay_within_the_plan_bound",
        "check_second_enable_changes_nothing_observable",
    },
    "d2h_copy_on_swap": {
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
    "disable_forgets_placement": {
        "check_cycles_do_not_grow_memory",
        "check_disable_restores_parameters_and_placement",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_views_keep_strides_and_sharing",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
    "delegation_without_disable": {
        "check_split_model_failed_enable_calls_disable",
    },
    "delegation_drops_components": {
        "check_split_model_enable_and_disable_are_delegated",
        "check_split_model_keeps_exactly_one_component_resident",
    },
    "split_keeps_both_resident": {
        "check_split_model_keeps_exactly_one_component_resident",
    },
    "split_accepts_unknown_names": {
        "check_split_model_rejects_unknown_component",
    },
    "split_copies_when_disabled": {
        "check_split_model_context_is_a_noop_when_offload_is_off",
    },
    "reasoner_every_step": {
        "check_split_model_runs_reasoner_once_and_generator_every_step",
    },
    "missing_ready_wait": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_block_alias_follows_its_block",
        "check_offloaded_tensors_keep_their_alignment",
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_disable_restores_parameters_and_placement",
        "check_enable_disable_cycles_match_the_reference",
        "check_failed_enable_can_be_retried",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
        "check_layerwise_streams_every_block_of_every_ring",
        "check_offloaded_output_matches_reference_bitwise",
        "check_offloaded_output_matches_reference_without_race_amplifier",
        "check_parameter_shared_by_two_blocks_is_never_copied_twice",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_second_enable_is_idempotent_and_exclusive",
        "check_skipped_block_is_recovered",
        "check_stats_match_what_the_platform_saw",
        "check_views_keep_strides_and_sharing",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_peak_device_bytes_stay_within_the_plan_bound",
        "check_second_enable_changes_nothing_observable",
    },
    "slot_reused_before_free": set(),  # the same checks as missing_ready_wait (below)
    "no_wraparound_prefetch": {
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
    "alias_placed_as_non_block_state": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_block_alias_follows_its_block",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
    "tied_parameter_two_masters": {
        "check_parameter_shared_by_two_blocks_is_never_copied_twice",
    },
    "skipped_block_not_recovered": {
        "check_skipped_block_is_recovered",
    },
    "packs_without_padding": {
        "check_offloaded_tensors_keep_their_alignment",
    },
    "realigns_every_tensor": {
        "check_offloaded_tensors_keep_their_alignment",
    },
    "edit_weights_in_place_layerwise": {
        "check_edit_weights_round_trip_takes_effect_exactly",
    },
    "edit_weights_in_place_model_level": {
        "check_edit_weights_round_trip_takes_effect_exactly",
    },
    "state_dict_returns_placeholders": {
        "check_state_dict_while_enabled_returns_true_weights",
    },
    "backward_not_refused": {
        "check_backward_is_exact_or_refused_at_forward",
    },
    "data_edits_unguarded_layerwise": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edits_through_data_are_exact_or_refused",
        "check_reads_through_data_are_true_or_refused",  # no guard, so no read guard either
    },
    "data_edits_unguarded_model_level": {
        "check_edits_through_data_are_exact_or_refused",
    },
    "reads_between_forwards_allowed": {
        "check_reads_through_data_are_true_or_refused",
    },
    "frozen_backward_not_refused": {
        "check_backward_is_exact_or_refused_at_forward",
    },
    "concurrent_calls_unguarded": {
        "check_second_thread_gets_a_clear_error_or_exact_output",
    },
    "copies_not_refused": {
        "check_copies_of_an_enabled_pipeline_are_refused_or_exact",
    },
    "interrupted_block_stays_running": {
        "check_interrupt_inside_a_block_leaves_a_recoverable_ring",
    },
    "three_slots": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_stats_match_what_the_platform_saw",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
}
KILLS.update({
    "simple_leaves_a_hook": {
        "check_disable_removes_every_trace",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_second_enable_changes_nothing_observable",
    },
    "simple_keeps_everything": {"check_peak_device_bytes_stay_within_the_plan_bound"},
    "simple_copies_ties_apart": {"check_shared_storage_stays_shared_while_enabled"},
    "simple_forgets_a_device": {
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_generation_after_an_interrupt_is_exact",
        "check_second_enable_changes_nothing_observable",
    },
    "simple_first_snapshot": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edit_between_cycles_takes_effect_and_survives_disable",
        "check_edits_through_data_are_exact_or_refused",
    },
    "simple_no_rollback": {"check_enable_failing_part_way_leaves_the_pipeline_as_it_was"},
    "simple_stacks_hooks": {"check_second_enable_changes_nothing_observable"},
    "simple_interrupt_leak": {"check_generation_after_an_interrupt_is_exact"},
})
# A slot race surfaces the same way whichever event wait is missing: the stream-order checker
# raises inside forward, so every check that runs a forward on a ring fails.
KILLS["slot_reused_before_free"] = set(KILLS["missing_ready_wait"])
# What one device hides: where host and device differ, a tensor the defect leaves on the wrong
# device meets the other device's tensors in the next forward and raises torch's same-device
# error, so every check that runs one fails too (Mutant.expected_kills).
PLACEMENT_KILLS: dict[str, set[str]] = {
    # A weight the broken offloader leaves on the device after disable meets host tensors in
    # the next un-offloaded generation.
    "simple_forgets_a_device": {
        "check_enable_disable_cycles_match_the_reference",
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    # The VAE parked on the host between calls: the latents are made on the device, then meet a
    # host VAE; every check that generates under model level fails, not only the residency one.
    "vae_offloaded": {
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_disable_restores_parameters_and_placement",
        "check_enable_disable_cycles_match_the_reference",
        "check_failed_enable_can_be_retried",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_offloaded_output_matches_reference_bitwise",
        "check_offloaded_output_matches_reference_without_race_amplifier",
        "check_offloaded_tensors_keep_their_alignment",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_second_enable_is_idempotent_and_exclusive",
        "check_stats_match_what_the_platform_saw",
        "check_views_keep_strides_and_sharing",
    },
    # Tensors left on the device after disable: the un-offloaded run after it mixes devices.
    "disable_forgets_placement": {
        "check_enable_disable_cycles_match_the_reference",
    },
    # The split model enables every component: after its failed enable, host tensors come back
    # as views at another storage offset of the same bytes where host and device differ (on one
    # device the check passes).
    "delegation_drops_components": {
        "check_split_model_failed_enable_calls_disable",
    },
}
MUTANTS: tuple[Mutant, ...] = (
    # §A.8 (auto mode)
    _m("auto_ignores_budget", "strategy='auto' ignores device_budget_bytes: every weight stays "
       "resident", _AUTO, make_backend=_backend_with(AutoOffloadBackend=_BudgetBlindAuto)),
    _m("auto_head_over_budget", "strategy='auto' keeps one resident head block more than the "
       "budget allows", _HEAD, make_backend=_backend_with(AutoOffloadBackend=_HeadGreedyAuto)),
    _m("auto_keeps_no_head", "strategy='auto' never fills the budget left above layerwise's "
       "peak with a resident head", _HEAD,
       make_backend=_backend_with(AutoOffloadBackend=_HeadlessAuto)),
    _m("delegated_unvalidated", "a split model that delegates model level skips the input "
       "validation every other pipeline gets", _J7_SPLIT,
       resolve_offload_plan=_delegated_unvalidated),
    _m("split_threads_unguarded", "a split model's component groups let a second thread swap "
       "while the first runs", _SPLIT_THREADS, patch=_split_threads_unguarded),
    _m("edits_unguarded", "an in-place edit of every DiT weight between generations changes "
       "the resident ones and stops at the first streamed one", _MISUSE_LAYER,
       make_backend=_backend_with(LayerWiseOffloadBackend=_EditsUnguarded)),
    # §F.7 (a resident head)
    _layer_scoped("head_streamed", "the declared resident head streams through the ring",
                  _layerwise(_HeadStreamedRing), _HEAD),
    _layer_scoped("head_hooked", "the resident head blocks get hooks", _HooksTheHead, _HEAD),
    _layer_scoped("head_not_predicted", "the predicted peak counts the resident head as "
                  "streamed", _HeadUnpredicted, _HEAD),
    # §A
    _resolver("impure_resolver", "resolution writes an attribute on the pipeline", _impure),
    _resolver("unstable_resolver", "every second resolution lists components in another order",
              _unstable),
    _resolver("class_attrs_beat_plan", "_layerwise_offload_blocks_attrs wins over OffloadPlan",
              _class_attrs_win),
    _resolver("scan_despite_declarations",
              "the name scan runs even when components are declared", _scan_always),
    _resolver("warns_every_time", "the fallback-scan warning repeats for every resolution",
              _warn_every_time),
    _resolver("no_dotted_paths", "nested (dotted) components are dropped", _no_dotted_paths),
    _resolver("swallows_topology_errors", "invalid topologies are skipped instead of rejected",
              _swallow_topology_errors),
    _resolver("vague_topology_errors", "topology errors name no path and no fix",
              _vague_topology_errors),
    _resolver("legacy_is_strict", "legacy flags get the explicit, erroring topology rules",
              _legacy_as_explicit),
    _resolver("name_based_aliases", "the plan records no ring aliases", _no_ring_aliases),
    _resolver("resident_in_block_accepted",
              "a resident declared inside a streamed block silently streams with it",
              _resident_in_block_accepted),
    _resolver("shared_storage_accepted",
              "a storage in two model-level groups is left for enable to meet",
              _shared_storage_accepted),
    _resolver("vae_selection_without_lifecycle",
              "a selected VAE is handed to a lifecycle the pipeline never declared",
              _vae_without_lifecycle),
    # §J.7 (rejections the resolver owns)
    _m("sparse_buffer_accepted", "a sparse buffer reaches the storage walks", _J7,
       resolve_offload_plan=_sparse_accepted),
    _m("cyclic_graph_unchecked", "a cyclic module graph is walked without a cycle check", _J7,
       patch=_cycles_unchecked),
    # §B, §C, §F.1 (model level)
    _model_level("rollback_misses_a_hook", "a failed enable leaves one hook installed",
                 _RollbackMissesAHook),
    _model_level("rollback_leaks_device_memory", "a failed enable keeps its device allocations",
                 _RollbackLeaksDeviceMemory),
    _model_level("enable_error_loses_cause", "a failed enable re-raises without its cause",
                 _LosesTheCause),
    _model_level("disable_not_idempotent", "every disable call re-materializes the weights",
                 _DisableNotIdempotent),
    _model_level("rollback_leaks_host_masters", "a failed enable keeps its host masters",
                 _RollbackLeaksHostMasters),
    _model_level("inference_tensors_rebound_as_normal",
                 "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
                 _InferenceBlindModelLevel),
    _model_level("double_copy_on_swap", "every swap uploads the component twice",
                 _DoubleCopyOnSwap),
    _model_level("stats_count_host_as_device", "stats() adds host master bytes to device bytes",
                 _StatsCountHostAsDevice),
    _model_level("hook_left_after_disable", "disable forgets one hook", _LeavesAHook),
    _model_level("two_groups_resident", "a DiT runs with the encoders still on the device",
                 _TwoGroupsResident),
    _model_level("vae_offloaded", "the VAE is swapped like an encoder", _VaeOffloaded),
    _model_level("nested_resident_swaps_with_its_dit",
                 "a resident declared inside a DiT is swapped out with it",
                 _NestedResidentSwaps, _NESTED_RESIDENT),
    _model_level("d2h_copy_on_swap", "offloading copies the device weights back to the host",
                 _D2HOnSwap),
    _model_level("disable_forgets_placement",
                 "disable removes hooks but leaves tensors offloaded", _ForgetsPlacement),
    # §E (split models)
    _model_level("delegation_without_disable", "a failed split-model enable is not undone",
                 _DelegatesWithoutDisable, _SPLIT),
    _model_level("delegation_drops_components",
                 "the split model's enable gets no component selection",
                 _DelegationDropsComponents, _SPLIT),
    _m("split_keeps_both_resident", "a phase swap loads without evicting the other phase",
       _SPLIT, patch=_keeps_both_resident),
    _m("split_accepts_unknown_names", "an unknown component name is silently accepted",
       _SPLIT, patch=_unchecked_component_names),
    _m("split_copies_when_disabled", "a disabled phase context still copies weights", _SPLIT,
       patch=_copies_when_disabled),
    _m("reasoner_every_step", "the pipeline reruns its reasoner at every step", _SPLIT,
       factory=_cosmos3_reasoner_every_step),
    # §F.6 (alignment, every strategy)
    _m("packs_without_padding", "tensors are packed back to back, at element alignment only",
       _ALIGNMENT, patch=_packs_without_padding),
    _m("realigns_every_tensor", "a weight stored off a 64-byte boundary is moved onto one",
       _ALIGNMENT, patch=_realigns_every_tensor),
    # §J (misuse next to a generation)
    _m("edit_weights_in_place_layerwise", "edit_weights() does not re-read: edits hit the ring",
       _MISUSE_LAYER, make_backend=_backend_with(
           LayerWiseOffloadBackend=_editing_in_place(LayerWiseOffloadBackend))),
    _m("edit_weights_in_place_model_level",
       "edit_weights() does not re-read: edits hit masters and device copies", _MISUSE_MODEL,
       make_backend=_backend_with(
           ModelLevelOffloadBackend=_editing_in_place(ModelLevelOffloadBackend))),
    _layer_scoped("state_dict_returns_placeholders",
                  "state_dict() while enabled returns the NaN placeholders of streamed blocks",
                  _PlaceholderStateDict, _MISUSE_LAYER),
    _layer_scoped("data_edits_unguarded_layerwise",
                  "an edit through .data outside edit_weights() is dropped by the next block load",
                  _unguarded(LayerWiseOffloadBackend), _MISUSE_LAYER),
    _model_level("data_edits_unguarded_model_level",
                 "an edit through .data outside edit_weights() is dropped by the next swap",
                 _unguarded(ModelLevelOffloadBackend), _MISUSE_MODEL),
    _m("backward_not_refused", "a grad-mode forward through streamed blocks is not refused",
       _MISUSE_LAYER, patch=_backward_not_refused),
    _m("reads_between_forwards_allowed", "reading a streamed weight's .data between forwards "
       "gives its placeholder (diffusers' fuse_qkv_projections builds NaN projections from it)",
       _MISUSE_LAYER, patch=_reads_between_forwards_allowed),
    _m("frozen_backward_not_refused", "a grad-mode forward through frozen streamed weights "
       "with an input that requires grad is not refused (autograd saves the placeholders)",
       _MISUSE_LAYER, patch=_frozen_backward_not_refused),
    _m("concurrent_calls_unguarded", "a second thread runs the ring while the first is inside",
       _MISUSE_LAYER, patch=_unguarded_calls),
    _m("copies_not_refused", "copy.deepcopy of an enabled module copies its offload hooks",
       dict(pipelines=("flux2",), sections=("J.8",), strategies=("model_level", "layer_wise")),
       patch=_copies_not_refused),
    # §D, §F.2, §F.4 (layerwise)
    _layer("missing_ready_wait", "compute reads a slot without waiting for its copy",
           _layerwise(_NoReadyWait)),
    _layer("slot_reused_before_free", "a prefetch overwrites a slot before its reader finished",
           _layerwise(_NoFreeWait)),
    _layer("no_wraparound_prefetch", "the last block does not prefetch block 0",
           _layerwise(_NoWrapAround)),
    _layer("alias_placed_as_non_block_state",
           "an alias of a block tensor gets its own device copy", _NameBasedPlacement),
    _layer("tied_parameter_two_masters", "a weight shared by two blocks streams with each",
           _layerwise(_TwoMastersRing)),
    _layer("skipped_block_not_recovered", "a block that was not prefetched runs on stale weights",
           _layerwise(_NoRecoveryRing)),
    _layer("silently_serial", "no prefetch, and the synchronous loads are not counted",
           _layerwise(_SilentlySerialRing)),
    _layer("three_slots", "the ring keeps a third device slot", _layerwise(_ThreeSlotsRing)),
    # §J.1 (interrupts)
    _m("interrupted_block_stays_running",
       "a block interrupted by Ctrl-C stays running: its slot is never released",
       _INTERRUPTS, make_backend=_backend_with(
           LayerWiseOffloadBackend=_layerwise(_KeepsInterruptedBlocksRunning))),
    _layer("inference_tensors_rebound_as_normal_layerwise",
           "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
           _InferenceBlindLayerwise),
    # §H (distributed layerwise, two spawned ranks)
    # nextstep: its blocks' images do not split into 64-byte aligned halves (flux2's do)
    _distributed("interrupt_recovery_ignores_gathers", "recovery after a Ctrl-C orders compute "
                 "after the copy stream only, while AllGather's last writer is the "
                 "communication stream", **{"AllGatherTransport.writers":
                                            _recovery_waits_for_copies_only}),
    _distributed("skipped_rank_runs_alone", "a rank whose plan is skipped runs un-offloaded "
                 "beside its offloaded peers", **{"DistributedLayerwiseOffloadBackend._resolve":
                                                  LayerWiseOffloadBackend._resolve}),
    _distributed("shard_not_zero_padded", "shard bytes past a block are left uninitialized",
                 scope=dict(_DISTRIBUTED, pipelines=("nextstep",)), **{"AllGatherTransport.build_master": _garbage_padding_build}),
    _distributed("wrong_rank_shard_gathered", "each rank keeps and gathers its neighbour's shard",
                 **{"AllGatherTransport.build_master": _wrong_rank_build}),
    _distributed("no_wait_between_gather_and_compute",
                 "the ready event is recorded after the shard copy, before the gather",
                 **{"AllGatherTransport.fill": _ready_on_copy_stream_fill}),
    _distributed("eager_collective_at_enable",
                 "enable prefetches block 0 with a collective, as a rank-local ring does",
                 **{"AllGatherTransport.collective": False}),
    _distributed("failed_rank_leaves_the_others_waiting",
                 "a rank whose enable fails does not tell the others (they wait for the timeout)",
                 **{"DistributedLayerwiseOffloadBackend._enable_failed": lambda self, exc: None}),
    _distributed("rank_local_rings_gather",
                 "weight_transfer='rank-local' is ignored: every ring gathers 1/world shards",
                 **{"DistributedLayerwiseOffloadBackend._transport_for": _gathers_rank_local_rings}),
    _m("unequal_wave_steps_accepted", "a DP wave runs without the ranks agreeing on its steps",
       _DISTRIBUTED, patch=_wave_runner_without_agreement),
    _m("mmap_drops_non_persistent_buffers",
       "mmap loading leaves non-persistent buffers uninitialized", _DISTRIBUTED,
       patch=_buffers_left_uninitialized),
    # Offloaders judged through the public protocol alone (any offloader's route)
    *(_protocol(name) for name in ("simple_leaves_a_hook", "simple_keeps_everything",
                                   "simple_copies_ties_apart", "simple_forgets_a_device",
                                   "simple_first_snapshot", "simple_no_rollback",
                                   "simple_stacks_hooks", "simple_interrupt_leak")),
)


def in_rank(name: str) -> tuple[Implementation, Any]:
    """The mutant ``name``'s implementation and patch context, in a spawned rank
    (``Implementation.in_rank``)."""
    mutant = next(m for m in MUTANTS if m.name == name)
    return mutant.impl, (mutant.patch() if mutant.patch else contextlib.nullcontext())
