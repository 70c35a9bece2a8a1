"""Mutants of what stays where (§F): model level's groups (§F.1), the layerwise ring (§F.2,
§F.4), inference tensors (§F.3), alignment (§F.6), a resident head (§F.7); the checks they
fail are mostly in checks/residency.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from offload_ref.backends.groups import ComponentSwapper
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transaction import Transaction
from offload_ref.backends.transports import RankLocalTransport
from offload_ref.hooks import ModelHook
from offload_ref.host import LayoutRule
from offload_ref.plan import predict_device_bytes

from ..case import DEFAULT_IMPLEMENTATION
from ._declare import (
    ALIGNMENT, HEAD, LAYERWISE, MODEL_LEVEL, NESTED_RESIDENT, backend_with, with_ring, declare,
)


# -- §F.7: a resident head -------------------------------------------------------------------------


class _HeadStreamedRing(BlockRing):
    """A ring that streams the declared resident head too (it reads the containers, not the
    plan's head)."""

    def __init__(self, ring_plan, *args, **kwargs) -> None:
        super().__init__(dataclasses.replace(ring_plan, resident_head=0), *args, **kwargs)


declare(
    "head_streamed", "the declared resident head streams through the ring", HEAD,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_HeadStreamedRing)),
    kills={"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
)


class _CountingHook(ModelHook):
    calls = 0

    def pre_forward(self, module, args, kwargs):
        self.calls += 1


class _HooksTheHead(LayerWiseOffloadBackend):
    """Hooks every block of the DiT, the resident head included (hooks that do nothing there,
    but run twice per block and step, and sit where a user's hook expects none)."""

    def install(self, pipeline, plan, txn) -> None:
        super().install(pipeline, plan, txn)
        for ring in plan.rings:
            for block, path in zip(ring.blocks[:ring.resident_head], ring.block_paths):
                txn.register_hook(block, self.hook_name + ".head", _CountingHook(), path)


declare(
    "head_hooked", "the resident head blocks get hooks", HEAD,
    make_backend=backend_with(LayerWiseOffloadBackend=_HooksTheHead),
    kills={"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
)


class _HeadUnpredicted(LayerWiseOffloadBackend):
    """A plan whose predicted peak counts the resident head as streamed."""

    def resolve(self, pipeline):
        plan = super().resolve(pipeline)
        headless = dataclasses.replace(plan, components=tuple(
            dataclasses.replace(c, rings=tuple(dataclasses.replace(s, resident_head=0)
                                                for s in c.rings))
            for c in plan.components))
        return dataclasses.replace(plan, device_bytes_bound=predict_device_bytes(headless))


declare(
    "head_not_predicted", "the predicted peak counts the resident head as streamed", HEAD,
    make_backend=backend_with(LayerWiseOffloadBackend=_HeadUnpredicted),
    kills={"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
)


# -- §F.3: parity (inference tensors) --------------------------------------------------------------


class _InferenceBlindTransaction(Transaction):
    def rebind(self, label, tensors, new):
        self.step(f"rebind {label}")
        for t, n in zip(tensors, new):  # .data of an inference tensor rebound as of any other
            old = t.data
            t.data = n
            self.on_rollback(lambda t=t, old=old: setattr(t, "data", old))


class _InferenceBlindModelLevel(ModelLevelOffloadBackend):
    transaction_class = _InferenceBlindTransaction


declare(
    "inference_tensors_rebound_as_normal",
    "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
    MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_InferenceBlindModelLevel),
    kills={"check_pipeline_built_under_inference_mode_matches_reference"},
)


class _InferenceBlindLayerwise(LayerWiseOffloadBackend):
    transaction_class = _InferenceBlindTransaction


declare(
    "inference_tensors_rebound_as_normal_layerwise",
    "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
    LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=_InferenceBlindLayerwise),
    kills={"check_pipeline_built_under_inference_mode_matches_reference"},
)


# -- §F.1: model level -----------------------------------------------------------------------------


class _DoubleCopySwapper(ComponentSwapper):
    def load(self, label):
        group = self.swappable[label]
        loading = not group.device_flats
        super().load(label)
        if loading:  # a redundant second upload of the same bytes
            for dtype, flat in group.device_flats.items():
                self.platform.copy_(flat, group.master.flats[dtype])


class _DoubleCopyOnSwap(ModelLevelOffloadBackend):
    swapper_class = _DoubleCopySwapper


declare(
    "double_copy_on_swap", "every swap uploads the component twice", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_DoubleCopyOnSwap),
    kills={
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
)


class _StatsCountHostAsDevice(ModelLevelOffloadBackend):
    def stats(self):
        s = super().stats()
        s.device_weight_bytes += s.host_bytes
        return s


declare(
    "stats_count_host_as_device", "stats() adds host master bytes to device bytes", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_StatsCountHostAsDevice),
    kills={"check_stats_match_what_the_platform_saw"},
)


class _TwoGroupsResident(ModelLevelOffloadBackend):
    def activate(self, comp):
        if self.swapper is not None:
            self.swapper.activate(comp.path, [])  # loads, never evicts


declare(
    "two_groups_resident", "a DiT runs with the encoders still on the device", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_TwoGroupsResident),
    kills={
        "check_model_level_keeps_one_group_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
)


class _VaeOffloaded(ModelLevelOffloadBackend):
    def install(self, pipeline, plan, txn):
        comps = tuple(dataclasses.replace(c, role="encoder", selected=True) if c.role == "vae"
                      else c for c in plan.components)
        super().install(pipeline, dataclasses.replace(plan, components=comps), txn)


declare(
    "vae_offloaded", "the VAE is swapped like an encoder", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_VaeOffloaded),
    kills={
        "check_model_level_keeps_one_group_resident",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_peak_device_bytes_stay_within_the_plan_bound",
        "check_second_enable_changes_nothing_observable",
    },
    # The VAE parked on the host between calls: the latents are made on the device, then meet a
    # host VAE; every check that generates under model level fails, not only the residency one.
    placement_kills={
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
)


class _NestedResidentSwaps(ModelLevelOffloadBackend):
    def install(self, pipeline, plan, txn):
        nested = {p for c in plan.components if c.selected for p in c.nested}
        comps = tuple(dataclasses.replace(c, nested=()) for c in plan.components
                      if c.path not in nested)  # the resident swaps with its DiT
        super().install(pipeline, dataclasses.replace(plan, components=comps), txn)


declare(
    "nested_resident_swaps_with_its_dit",
    "a resident declared inside a DiT is swapped out with it",
    NESTED_RESIDENT,
    make_backend=backend_with(ModelLevelOffloadBackend=_NestedResidentSwaps),
    kills={
        "check_model_level_keeps_one_group_resident",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
    },
)


class _CopyBackSwapper(ComponentSwapper):
    def offload(self, label):
        group = self.swappable[label]
        for dtype, flat in group.device_flats.items():  # "save" the device copy to the host
            self.platform.copy_(group.master.flats[dtype], flat)
        super().offload(label)


class _D2HOnSwap(ModelLevelOffloadBackend):
    swapper_class = _CopyBackSwapper


declare(
    "d2h_copy_on_swap", "offloading copies the device weights back to the host", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_D2HOnSwap),
    kills={
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
)


# -- §F.2, §F.4: the layerwise ring ----------------------------------------------------------------


# A slot race surfaces the same way whichever event wait is missing: the stream-order checker
# raises inside forward, so every check that runs a forward on a ring fails.
_SLOT_RACE_KILLS = frozenset({
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
})


class _NoReadyWait(BlockRing):
    def wait_ready(self, s):
        pass


declare(
    "missing_ready_wait", "compute reads a slot without waiting for its copy", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_NoReadyWait)),
    kills=_SLOT_RACE_KILLS,
)


class _NoFreeWaitTransport(RankLocalTransport):
    """Fills a slot without waiting for its last reader (its free event)."""

    def fill_pairs(self, slot, k, group):
        return None  # every fill through fill() below

    def fill(self, slot, k, group):
        copy_stream = self.streams.copy
        with self.platform.stream(copy_stream):
            for dtype, flat in slot.flats[k].items():
                self.platform.copy_(flat, group.master.flats[dtype])  # the ring records ready


class _NoFreeWait(BlockRing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "transport": _NoFreeWaitTransport()})


declare(
    "slot_reused_before_free", "a prefetch overwrites a slot before its reader finished", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_NoFreeWait)),
    kills=_SLOT_RACE_KILLS,
)


class _NoWrapAround(BlockRing):
    def before(self, k, frame=None):
        if k == len(self.blocks) - 1:
            self.prefetch_enabled = False
            try:
                super().before(k, frame)
            finally:
                self.prefetch_enabled = True
        else:
            super().before(k, frame)


declare(
    "no_wraparound_prefetch", "the last block does not prefetch block 0", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_NoWrapAround)),
    kills={
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
)


class _NoRecoveryRing(BlockRing):
    def before(self, k, frame=None):
        if self.slot_of[k] is None:  # run on whatever the slot holds
            self.bind(k, 0 if self.slots[0].occupant is not None else 1)
        super().before(k, frame)


declare(
    "skipped_block_not_recovered",
    "a block that was not prefetched runs on stale weights",
    LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_NoRecoveryRing)),
    kills={"check_skipped_block_is_recovered"},
)


class _SilentlySerialRing(BlockRing):
    """Loads every block when it runs (no prefetch) and does not count it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefetch_enabled = False

    def before(self, k, frame=None):
        recoveries = self.stats.sync_recoveries
        super().before(k, frame)
        self.stats.sync_recoveries = recoveries


declare(
    "silently_serial", "no prefetch, and the synchronous loads are not counted", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_SilentlySerialRing)),
    kills={
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
)


class _ThreeSlotsRing(BlockRing):
    def prepare(self, txn, pipeline):
        super().prepare(txn, pipeline)
        self.slots.append(self.new_slot(txn))
        self.build_views()


declare(
    "three_slots", "the ring keeps a third device slot", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_ThreeSlotsRing)),
    kills={
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_stats_match_what_the_platform_saw",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
)


# -- §F.6: alignment, every strategy ---------------------------------------------------------------


def _laid_out_by(rule: type[LayoutRule]) -> Callable[[], Any]:
    """``make_platform``: the kit's platform, with layouts placed by ``rule`` (the platform's
    ``layout_rule``, Note [Aligned layout] in offload_ref/host.py)."""

    def make() -> Any:
        platform = DEFAULT_IMPLEMENTATION.make_platform()
        platform.layout_rule = rule()
        return platform

    return make


class _BackToBack(LayoutRule):
    """Segments packed back to back at element alignment (the layout before aligned regions)."""

    def phase(self, storage_ptr: int, byte_offset: int, alignment: int) -> int:
        return 0

    def region_bytes(self, phase: int, nbytes: int, alignment: int) -> int:
        return nbytes


declare(
    "packs_without_padding",
    "tensors are packed back to back, at element alignment only",
    ALIGNMENT,
    make_platform=_laid_out_by(_BackToBack),
    kills={"check_offloaded_tensors_keep_their_alignment"},
)


class _OnRegionBoundaries(LayoutRule):
    """Aligned regions, but every segment starts at its region's boundary (its phase dropped)."""

    def phase(self, storage_ptr: int, byte_offset: int, alignment: int) -> int:
        return 0


declare(
    "realigns_every_tensor", "a weight stored off a 64-byte boundary is moved onto one", ALIGNMENT,
    make_platform=_laid_out_by(_OnRegionBoundaries),
    kills={"check_offloaded_tensors_keep_their_alignment"},
)
