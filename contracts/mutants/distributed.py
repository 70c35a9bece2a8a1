"""Mutants of distributed layerwise across ranks (§H, two spawned ranks): the checks they fail are
in checks/distributed.py."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from offload_ref.backends.distributed import (
    AllGatherTransport,
    DistributedLayerwiseOffloadBackend,
    _all_gather,
)
from offload_ref.backends.layerwise import LayerWiseOffloadBackend

from ._declare import DISTRIBUTED, _patched, declare


def _in_every_rank(patches: dict[str, Any]) -> Any:
    """A mutant of the AllGather transport or the distributed backend, applied (by name) inside
    every spawned rank too (Note [One spawn per batch] in checks/distributed.py): ``patches``
    maps ``"Class.attr"`` of ``offload_ref.backends.distributed`` to the value it takes."""
    def patch() -> Any:
        from offload_ref.backends import distributed

        stack = contextlib.ExitStack()
        for qualified, value in patches.items():
            owner_name, attr = qualified.split(".")
            stack.enter_context(_patched(getattr(distributed, owner_name), attr, value))
        return stack

    return patch


declare(
    "skipped_rank_runs_alone",
    "a rank whose plan is skipped runs un-offloaded beside its offloaded peers",
    DISTRIBUTED,
    patch=_in_every_rank(
        {"DistributedLayerwiseOffloadBackend._resolve": LayerWiseOffloadBackend._resolve}),
    kills={"check_rank_whose_plan_is_skipped_makes_every_rank_raise"},
)

declare(
    "eager_collective_at_enable",
    "enable prefetches block 0 with a collective, as a rank-local ring does",
    DISTRIBUTED,
    patch=_in_every_rank({"AllGatherTransport.collective": False}),
    kills={  # and rank 0's eager gather is never matched by failed rank 1
        "check_no_collective_at_enable",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
)

declare(
    "failed_rank_leaves_the_others_waiting",
    "a rank whose enable fails does not tell the others (they wait for the timeout)",
    DISTRIBUTED,
    patch=_in_every_rank(
        {"DistributedLayerwiseOffloadBackend._enable_failed": lambda self, exc: None}),
    kills={
        "check_rank_whose_plan_is_skipped_makes_every_rank_raise",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
)


_BUILD_SHARD = AllGatherTransport.build_master
_TRANSPORT_FOR = DistributedLayerwiseOffloadBackend._transport_for


def _garbage_padding_build(self, txn, ring, group, sections, image_bytes):
    _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    shard, S = self.shards[-1], self.shard_bytes[-1]
    tail = max(0, image_bytes - self.rank * S)
    if tail < S:
        shard[tail:].fill_(0xA5)  # what an uninitialized host buffer may hold


declare(
    "shard_not_zero_padded",
    "shard bytes past a block are left uninitialized",
    # nextstep: its blocks' images do not split into 64-byte aligned halves (flux2's do)
    dict(DISTRIBUTED, pipelines=("nextstep",)),
    patch=_in_every_rank({"AllGatherTransport.build_master": _garbage_padding_build}),
    kills={"check_allgather_shards_are_zero_padded"},
)


def _wrong_rank_build(self, txn, ring, group, sections, image_bytes):
    rank = self.rank
    self.rank = (rank + 1) % self.world  # cut the neighbour's shard ...
    try:
        _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    finally:
        self.rank = rank  # ... and gather it into this rank's place


declare(
    "wrong_rank_shard_gathered", "each rank keeps and gathers its neighbour's shard", DISTRIBUTED,
    patch=_in_every_rank({"AllGatherTransport.build_master": _wrong_rank_build}),
    kills={
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_distributed_cycles_restore_every_rank",
    },
)


def _ready_on_copy_stream_fill(self, ring, k, s):
    """Records the ready event after the shard copy, not after the gather."""
    platform = ring.platform
    out, mine = self._slot_views(ring, k, s)
    with platform.stream(ring.copy_stream):
        ring.copy_stream.wait_event(ring.free[s])
        platform.copy_(mine, self.shards[k])
        self.copied[s].record(ring.copy_stream)
        ring.ready[s].record(ring.copy_stream)
    with platform.stream(self.comm_stream):
        self.comm_stream.wait_event(self.copied[s])
        platform.submit(lambda: _all_gather(out, mine, self.group),
                        reads=(ring.slots[s],), writes=(ring.slots[s],))


declare(
    "no_wait_between_gather_and_compute",
    "the ready event is recorded after the shard copy, before the gather",
    DISTRIBUTED,
    patch=_in_every_rank({"AllGatherTransport.fill": _ready_on_copy_stream_fill}),
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


def _gathers_rank_local_rings(self, stack):
    """Every ring AllGathers across the ranks, rank-local ones included."""
    from offload_ref.config import WeightTransfer

    return _TRANSPORT_FOR(self, dataclasses.replace(stack, transfer=WeightTransfer.ALLGATHER))


declare(
    "rank_local_rings_gather",
    "weight_transfer='rank-local' is ignored: every ring gathers 1/world shards",
    DISTRIBUTED,
    patch=_in_every_rank(
        {"DistributedLayerwiseOffloadBackend._transport_for": _gathers_rank_local_rings}),
    kills={  # rank-local mode is what the mmap scenario streams too
        "check_rank_local_outputs_match_each_ranks_reference",
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
)


def _recovery_waits_for_copies_only(self, ring):
    return (ring.copy_stream,)


declare(
    "interrupt_recovery_ignores_gathers",
    "recovery after a Ctrl-C orders compute after the copy stream only, while AllGather's last "
    "writer is the communication stream",
    DISTRIBUTED,
    patch=_in_every_rank({"AllGatherTransport.writers": _recovery_waits_for_copies_only}),
    kills={"check_allgather_generation_after_an_interrupt_is_exact"},
)


def _wave_without_agreement(self, request):
    with __import__("torch").inference_mode():
        return self.pipeline(**request)


def _buffers_left_uninitialized() -> Any:
    """load_safetensors that leaves non-persistent buffers as torch.empty left them (zeros
    here), as a to_empty() loader that forgets to save and restore them does."""
    from offload_ref import loading

    def wipe(others, kept):
        for slot in others:
            slot.tensor.data.zero_()
        return []

    return _patched(loading, "_restore_non_persistent", wipe)


declare(
    "mmap_drops_non_persistent_buffers",
    "mmap loading leaves non-persistent buffers uninitialized",
    DISTRIBUTED,
    patch=_buffers_left_uninitialized,
    kills={"check_mmap_loaded_weights_keep_non_persistent_buffers"},
)


def _wave_runner_without_agreement() -> Any:
    from offload_ref.distributed import waves

    return _patched(waves.WaveRunner, "run", _wave_without_agreement)


declare(
    "unequal_wave_steps_accepted",
    "a DP wave runs without the ranks agreeing on its steps",
    DISTRIBUTED,
    patch=_wave_runner_without_agreement,
    kills={"check_wave_with_unequal_steps_is_rejected_before_any_collective"},
)
