"""Mutants of distributed layerwise across ranks (§H): the checks they fail are in
checks/distributed.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from offload_ref.backends.distributed import (
    AllGatherTransport,
    DistributedLayerwiseOffloadBackend,
    _all_gather,
)

from ._declare import _patched


_BUILD_SHARD = AllGatherTransport.build_master
_TRANSPORT_FOR = DistributedLayerwiseOffloadBackend._transport_for


def _garbage_padding_build(self, txn, ring, group, sections, image_bytes):
    _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    shard, S = self.shards[-1], self.shard_bytes[-1]
    tail = max(0, image_bytes - self.rank * S)
    if tail < S:
        shard[tail:].fill_(0xA5)  # what an uninitialized host buffer may hold


def _wrong_rank_build(self, txn, ring, group, sections, image_bytes):
    rank = self.rank
    self.rank = (rank + 1) % self.world  # cut the neighbour's shard ...
    try:
        _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    finally:
        self.rank = rank  # ... and gather it into this rank's place


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


def _gathers_rank_local_rings(self, stack):
    """Every ring AllGathers across the ranks, rank-local ones included."""
    from offload_ref.config import WeightTransfer

    return _TRANSPORT_FOR(self, dataclasses.replace(stack, transfer=WeightTransfer.ALLGATHER))


def _recovery_waits_for_copies_only(self, ring):
    return (ring.copy_stream,)


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


def _wave_runner_without_agreement() -> Any:
    from offload_ref.distributed import waves

    return _patched(waves.WaveRunner, "run", _wave_without_agreement)
