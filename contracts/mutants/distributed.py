"""Mutants of distributed layerwise across ranks (§H, two spawned ranks): the checks they fail are
in checks/distributed.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from offload_ref.backends.distributed import AllGatherTransport, DistributedLayerWiseOffloadBackend
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.slots import Slot
from offload_ref.distributed import WaveRunner
from offload_ref.host import LayoutRule

from ..case import DEFAULT_IMPLEMENTATION
from ._declare import ALIGNMENT_H, DISTRIBUTED, backend_with, declare, with_ring


def _allgather(transport: type[AllGatherTransport]) -> Any:
    """``make_backend`` of the distributed backend whose AllGather rings use ``transport`` (its
    ``allgather_transport_class`` seam); spawned ranks rebuild it by the mutant's name
    (``Implementation.in_rank``)."""
    backend = type(f"Mutant{transport.__name__}", (DistributedLayerWiseOffloadBackend,),
                   {"allgather_transport_class": transport})
    return backend_with(DistributedLayerWiseOffloadBackend=backend)


class _EagerAllGather(AllGatherTransport):
    collective = False  # the ring then prefetches block 0 at enable


class _SkippedRankRunsAlone(DistributedLayerWiseOffloadBackend):
    def resolve(self, pipeline):
        return LayerWiseOffloadBackend.resolve(self, pipeline)  # a skipped plan is not refused


declare(
    "skipped_rank_runs_alone",
    "a rank whose plan is skipped runs un-offloaded beside its offloaded peers",
    DISTRIBUTED,
    make_backend=backend_with(DistributedLayerWiseOffloadBackend=_SkippedRankRunsAlone),
    kills={"check_rank_whose_plan_is_skipped_makes_every_rank_raise"},
)

declare(
    "eager_collective_at_enable",
    "enable prefetches block 0 with a collective, as a rank-local ring does",
    DISTRIBUTED,
    make_backend=_allgather(_EagerAllGather),
    kills={  # and rank 0's eager gather is never matched by failed rank 1
        "check_no_collective_at_enable",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
)


class _FailsSilently(DistributedLayerWiseOffloadBackend):
    def enable_failed(self, exc):
        pass  # the peers are not told


declare(
    "failed_rank_leaves_the_others_waiting",
    "a rank whose enable fails does not tell the others (they wait for the timeout)",
    DISTRIBUTED,
    make_backend=backend_with(DistributedLayerWiseOffloadBackend=_FailsSilently),
    kills={
        "check_rank_whose_plan_is_skipped_makes_every_rank_raise",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
)


class _GarbagePaddingAllGather(AllGatherTransport):
    def build_master(self, txn, group, sections, image_bytes):
        super().build_master(txn, group, sections, image_bytes)
        shard, S = self.shards[-1], self.shard_bytes[-1]
        tail = max(0, image_bytes - self.rank * S)
        if tail < S:
            shard[tail:].fill_(0xA5)  # what an uninitialized host buffer may hold


declare(
    "shard_not_zero_padded",
    "shard bytes past a block are left uninitialized",
    # nextstep: its blocks' images do not split into 64-byte aligned halves (flux2's do)
    dict(DISTRIBUTED, pipelines=("nextstep",)),
    make_backend=_allgather(_GarbagePaddingAllGather),
    kills={"check_allgather_shards_are_zero_padded"},
)


class _WrongRankAllGather(AllGatherTransport):
    def build_master(self, txn, group, sections, image_bytes):
        rank = self.rank
        self.rank = (rank + 1) % self.world  # cut the neighbour's shard ...
        try:
            super().build_master(txn, group, sections, image_bytes)
        finally:
            self.rank = rank  # ... and gather it into this rank's place


declare(
    "wrong_rank_shard_gathered", "each rank keeps and gathers its neighbour's shard", DISTRIBUTED,
    make_backend=_allgather(_WrongRankAllGather),
    kills={
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_distributed_cycles_restore_every_rank",
    },
)


class _ReadyBeforeGather(AllGatherTransport):
    """Names the copy stream as a fill's last writer, so the ring records the slot's ready
    event after the shard copy, not after the gather."""

    def writers(self):
        return (self.comm_stream, self.streams.copy)


declare(
    "no_wait_between_gather_and_compute",
    "the ready event is recorded after the shard copy, before the gather",
    DISTRIBUTED,
    make_backend=_allgather(_ReadyBeforeGather),
    kills={  # the generation and disable raise StreamOrderError
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_allgather_host_bytes_per_rank_are_one_over_world",
        "check_allgather_keeps_two_slots_per_rank",
        "check_allgather_shards_are_zero_padded",
        "check_distributed_cycles_restore_every_rank",
        "check_no_collective_at_enable",
    },
)


class _GathersRankLocalRings(DistributedLayerWiseOffloadBackend):
    """Every ring AllGathers across the ranks, rank-local ones included."""

    def transport_for(self, ring_plan):
        from offload_ref.config import WeightTransfer

        return super().transport_for(dataclasses.replace(ring_plan, transfer=WeightTransfer.ALLGATHER))


declare(
    "rank_local_rings_gather",
    "weight_transfer='rank-local' is ignored: every ring gathers 1/world shards",
    DISTRIBUTED,
    make_backend=backend_with(DistributedLayerWiseOffloadBackend=_GathersRankLocalRings),
    kills={  # rank-local mode is what the mmap scenario streams too
        "check_rank_local_outputs_match_each_ranks_reference",
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
)


class _CopyStreamOnlyWrites(BlockRing):
    """Builds each slot with the copy stream as its only writer (the transport still names the
    communication stream last, so every fill's ready event is right): recovery then orders
    compute after the shard copies but not after the gathers."""

    def new_slot(self, txn):
        slot = super().new_slot(txn)
        return Slot(slot.index, slot.storage, slot.ready, slot.free, slot.writers[:1])


declare(
    "interrupt_recovery_ignores_gathers",
    "recovery after a Ctrl-C orders compute after the copy stream only, while AllGather's last "
    "writer is the communication stream",
    DISTRIBUTED,
    make_backend=backend_with(DistributedLayerWiseOffloadBackend=with_ring(
        _CopyStreamOnlyWrites, base=DistributedLayerWiseOffloadBackend)),
    kills={"check_allgather_generation_after_an_interrupt_is_exact"},
)


def _load_leaving_buffers_uninitialized(module, paths, **kwargs):
    """load_safetensors that leaves non-persistent buffers as torch.empty left them (zeros
    here), as a to_empty() loader that forgets to save and restore them does."""
    from offload_ref import load_safetensors

    report = load_safetensors(module, paths, **kwargs)
    persistent = set(module.state_dict())
    for name, buffer in module.named_buffers():
        if name not in persistent:
            buffer.data.zero_()
    return report


declare(
    "mmap_drops_non_persistent_buffers",
    "mmap loading leaves non-persistent buffers uninitialized",
    DISTRIBUTED,
    load_safetensors=_load_leaving_buffers_uninitialized,
    kills={"check_mmap_loaded_weights_keep_non_persistent_buffers"},
)


class _WaveRunnerWithoutAgreement(WaveRunner):
    def run(self, request):
        with torch.inference_mode():
            return self.pipeline(**request)


declare(
    "unequal_wave_steps_accepted",
    "a DP wave runs without the ranks agreeing on its steps",
    DISTRIBUTED,
    make_wave_runner=_WaveRunnerWithoutAgreement,
    kills={"check_wave_with_unequal_steps_is_rejected_before_any_collective"},
)


class _StorageStartsAligned(LayoutRule):
    """A storage's copy starts on a fresh 64-byte boundary, as ``storage.to(device)`` gives: a
    tensor keeps its offset into its storage, but an mmap view's storage, which starts wherever
    the file put it, is realigned."""

    def phase(self, storage_ptr: int, byte_offset: int, alignment: int) -> int:
        return byte_offset % min(alignment, 64)


def _storages_realigned() -> Any:
    """``make_platform``: the kit's platform, its layouts placed by :class:`_StorageStartsAligned`
    (the platform's ``layout_rule``, Note [Aligned layout] in offload_ref/host.py)."""
    platform = DEFAULT_IMPLEMENTATION.make_platform()
    platform.layout_rule = _StorageStartsAligned()
    return platform


declare(
    "mmap_views_realigned_on_the_device",
    "device copies and slots of mmap-loaded weights start on a 64-byte boundary instead of at the "
    "file's phase (bit-exact on Intel, an ulp off on AMD EPYC)",
    ALIGNMENT_H,
    make_platform=_storages_realigned,
    kills={"check_mmap_loaded_weights_keep_their_alignment"},
)
