"""What the kit can see of an offloader, and which checks that lets it judge: the one record.

offload-ref's own backends are judged through their internals as well as from the outside: the
kit injects faults at each mutation step (``fault_injector``), reads ``stats()``, edits inside
``edit_weights()``, and counts bytes on the platform it hands the backend.  Any other offloader
(diffusers', accelerate's, an engine's own) is judged through the public protocol of
:mod:`offload_ref.contracts.offloader` alone: ``enable(pipeline)``, ``disable()``,
``is_enabled()``, and what torch itself shows (tensors, hooks, ``torch.accelerator`` memory).

:data:`NEEDS` says, for every check of the catalogue that needs more than that protocol, what it
needs; :func:`inapplicable` turns it into the reason a report prints.  Nothing else decides
which checks apply to a foreign offloader: check bodies carry no such predicates.  A test keeps
:data:`NEEDS` honest (every key is a check id; every check that runs on a foreign offloader is
one that uses only the protocol).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Capabilities", "NEEDS", "NEEDS_BY_AREA", "OFFLOAD_REF", "PROTOCOL", "inapplicable"]


@dataclass(frozen=True)
class Capabilities:
    """What an implementation under test exposes to the kit."""

    #: ``"offload_ref"``: the kit may use offload-ref's internals (resolver, config parser,
    #: backend API, platform accounting); ``"protocol"``: enable / disable / is_enabled only
    seen_through: str
    #: The exception types that count as a loud refusal of a misuse (an edit through ``.data``,
    #: a read of a placeholder).  offload-ref names its own; a foreign offloader may refuse
    #: with any exception, as long as it does not serve a wrong result silently.
    refusals: tuple[type[BaseException], ...]

    @property
    def internals(self) -> bool:
        return self.seen_through == "offload_ref"


def _offload_ref_refusals() -> tuple[type[BaseException], ...]:
    from offload_ref import OffloadWeightEditError

    return (OffloadWeightEditError,)


#: offload-ref's own backends, through every seam the kit has.
OFFLOAD_REF = Capabilities("offload_ref", _offload_ref_refusals())
#: Any offloader behind the public protocol (offload-ref's own, driven through it, included).
PROTOCOL = Capabilities("protocol", (Exception,))

_RESOLVER = ("tests offload-ref's plan resolver, not an offloader's behaviour (a foreign "
             "offloader has its own way of choosing what to move)")
_CONFIG = "tests offload-ref's config parser (OffloadConfig), not an offloader's behaviour"
_SPLIT = "tests offload-ref's delegation to a split model's enable_omni_model_cpu_offload"
_DISTRIBUTED = ("tests offload-ref's distributed layerwise backend (the protocol has no "
                "distributed strategy)")
_FAULTS = ("needs offload-ref's fault injector at each mutation step; "
           "check_enable_failing_part_way_leaves_the_pipeline_as_it_was injects faults from "
           "outside instead")
_PLATFORM = ("needs offload-ref's platform accounting (device, pinned and host bytes of the "
             "backend alone); check_every_disable_restores_tensors_and_frees_the_device and "
             "check_peak_device_bytes_stay_within_the_plan_bound measure through "
             "torch.accelerator instead")
_STATS = "needs offload-ref's stats() (copies, synchronous recoveries, peak bytes)"
_RING = "needs offload-ref's ring and prefetch schedule (materialized blocks, slots)"
_EDIT_WEIGHTS = "needs offload-ref's edit_weights() context"
_HEAD = ("tests a resident head declared in offload-ref's OffloadPlan.layerwise_resident_layers "
         "(a foreign offloader has its own way of choosing what stays on the device)")

#: Check id -> what it needs beyond the protocol.  A check absent here runs on any offloader.
NEEDS: dict[str, str] = {
    # §A plan resolution, §G config, §E split models, §H distributed: offload-ref's own parts.
    "check_plan_resolution_is_pure": _RESOLVER,
    "check_plan_resolution_is_repeatable": _RESOLVER,
    "check_attribute_scan_warns_once_per_pipeline_class": _RESOLVER,
    "check_declared_components_beat_attribute_scan": _RESOLVER,
    "check_plan_block_attrs_beat_class_attributes": _RESOLVER,
    "check_dotted_paths_resolve_nested_components": _RESOLVER,
    "check_block_claimed_by_two_components_is_rejected": _RESOLVER,
    "check_encoder_allgather_requires_declared_replication": _RESOLVER,
    "check_missing_block_container_is_rejected": _RESOLVER,
    "check_model_level_without_dit_is_rejected": _RESOLVER,
    "check_model_level_without_encoder_is_rejected": _RESOLVER,
    "check_on_demand_component_without_lifecycle_is_rejected": _RESOLVER,
    "check_resident_inside_a_streamed_block_is_rejected": _RESOLVER,
    "check_resident_layers_leaving_one_streaming_block_are_rejected": _RESOLVER,
    "check_resident_layers_need_a_resident_dit_path": _RESOLVER,
    "check_single_block_dit_is_rejected": _RESOLVER,
    "check_tensor_in_two_model_level_groups_is_rejected": _RESOLVER,
    "check_vae_selection_without_lifecycle_is_rejected": _RESOLVER,
    "check_legacy_topology_without_dit_is_a_recorded_noop": _RESOLVER,
    "check_tensors_aliasing_a_block_belong_to_its_ring": _RESOLVER,
    "check_auto_mode_measured_peak_never_exceeds_the_budget": _RESOLVER,
    "check_auto_mode_fills_the_budget_with_a_resident_head": _RESOLVER,
    "check_resident_head_stays_put_unhooked_and_within_the_prediction": _HEAD,
    "check_cyclic_module_graph_is_rejected_before_mutation": _RESOLVER,
    "check_sparse_buffer_is_rejected_before_mutation": _RESOLVER,
    "check_split_model_context_is_a_noop_when_offload_is_off": _SPLIT,
    "check_split_model_enable_and_disable_are_delegated": _SPLIT,
    "check_split_model_failed_enable_calls_disable": _SPLIT,
    "check_split_model_keeps_exactly_one_component_resident": _SPLIT,
    "check_split_model_rejects_unknown_component": _SPLIT,
    "check_split_model_runs_reasoner_once_and_generator_every_step": _SPLIT,
    # §B: faults at offload-ref's own mutation steps.
    "check_failed_enable_can_be_retried": _FAULTS,
    "check_failed_enable_releases_memory_and_chains_the_cause": _FAULTS,
    "check_failed_enable_restores_the_pipeline": _FAULTS,
    # §C: the platform's accounting, offload-ref's documented exclusivity.
    "check_cycles_do_not_grow_memory": _PLATFORM,
    "check_disable_restores_parameters_and_placement": _PLATFORM,
    "check_random_lifecycle_sequences_keep_invariants": _PLATFORM,
    "check_second_enable_is_idempotent_and_exclusive": (
        "judges offload-ref's documented exclusivity (one backend per pipeline) and its "
        "platform accounting; check_second_enable_changes_nothing_observable judges a second "
        "enable() from outside"),
    # §D: aliases inside offload-ref's ring.
    "check_block_alias_follows_its_block": f"{_RING}; {_EDIT_WEIGHTS}",
    "check_parameter_shared_by_two_blocks_is_never_copied_twice": _STATS,
    "check_views_keep_strides_and_sharing": _RING,
    # §F: the strategies' residency, seen on offload-ref's platform and ring.
    "check_model_level_keeps_one_group_resident": (
        f"{_PLATFORM}; check_model_level_keeps_the_other_components_off_the_device_in_every_"
        "generation judges model-level residency from the tensors' devices, over two "
        "generations"),
    "check_model_level_swaps_move_component_bytes_host_to_device_only": _PLATFORM,
    "check_stats_match_what_the_platform_saw": _STATS,
    "check_layerwise_keeps_at_most_two_blocks_resident": _PLATFORM,
    "check_layerwise_materializes_only_block_zero_between_passes": _RING,
    "check_layerwise_prefetches_the_next_block_before_it_runs": _RING,
    "check_layerwise_streams_every_block_of_every_ring": _RING,
    "check_skipped_block_is_recovered": _RING,
    "check_offloaded_tensors_keep_their_alignment": _PLATFORM,
    "check_offloaded_output_matches_reference_without_race_amplifier": (
        "switches offload-ref's platform off its race amplifier (a foreign offloader has no "
        "such platform: check_offloaded_output_matches_reference_bitwise judges its parity)"),
    # §J: offload-ref's own seams and wording.
    "check_interrupt_inside_a_block_leaves_a_recoverable_ring": (
        f"{_STATS}; check_generation_after_an_interrupt_is_exact judges interrupts from "
        "outside"),
    "check_edit_weights_round_trip_takes_effect_exactly": (
        f"{_EDIT_WEIGHTS}; check_edit_between_cycles_takes_effect_and_survives_disable judges "
        "edits from outside"),
    "check_copies_of_an_enabled_pipeline_are_refused_or_exact": (
        "judges offload-ref's refusal messages (naming disable() and edit_weights())"),
}


#: Catalogue area -> what all of its checks need beyond the protocol.
NEEDS_BY_AREA: dict[str, str] = {"G": _CONFIG, "H": _DISTRIBUTED}


def inapplicable(check_id: str, section: str, capabilities: Capabilities) -> str | None:
    """None when check ``check_id`` (of catalogue ``section``) can judge an implementation with
    ``capabilities``; else why not."""
    if capabilities.internals:
        return None
    need = NEEDS.get(check_id) or NEEDS_BY_AREA.get(section[:1])
    return None if need is None else f"not judged through the offloader protocol: {need}"
