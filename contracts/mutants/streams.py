"""Mutants of stream ordering on the accelerator platform: offload-ref's own code path of a GPU
(:class:`~offload_ref.platform.AcceleratorPlatform`: ``torch.Stream``, ``torch.Event``,
``torch.accelerator``) with one ordering defect each, the four the field has shipped: compute
reads a slot without waiting for its copy, a copy overwrites a slot its previous block may still
be reading, the ready event is recorded on the wrong stream, and a slot another stream wrote is
freed without ordering that stream first (its memory then handed out again; defined here, not yet
declared: see its section).

On the simulated accelerator every stream runs at once, in program order, so none of them changes
an output: only the happens-before stream sanitizer (``offload_ref.platform.simulated``) sees
them, and the kit's stream-ordering check fails them.  Each runs on flux2 under layerwise
offload, the strategy whose ring uses a copy stream.
"""

from __future__ import annotations

from typing import Any

from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transports import RankLocalTransport
from offload_ref.platform import AcceleratorPlatform

from ..case import kit_device
from ._declare import backend_with, declare, with_ring

__all__ = ["ComputeOnlySynchronize", "NoFreeWaitTransport", "NoReadyWaitRing",
           "ReadyOnComputeTransport", "compute_only_synchronize"]

#: Where the stream mutants run: §S's check alone (checks/streams.py), on layerwise flux2 (two
#: slots, a copy stream, prefetch).  It runs offload-ref's backends on
#: ``Implementation.make_accelerator_platform`` (the accelerator platform on the kit's device).
STREAM_CHECKS = frozenset({"check_device_accesses_are_ordered_across_streams"})
STREAMS = dict(pipelines=("flux2",), sections=("S",), strategies=("layer_wise",))


# -- compute never waits for its copy ---------------------------------------------------------


class NoReadyWaitRing(BlockRing):
    """Compute reads a slot without waiting for the event recorded after its fill."""

    def wait_ready(self, s: int) -> None:
        pass


declare(
    "accelerator_ready_wait_skipped",
    "on the accelerator platform, compute reads a slot without waiting for its copy's event",
    STREAMS,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(NoReadyWaitRing)),
    kills=STREAM_CHECKS,
)


# -- a slot refilled while its previous block may still be computing ---------------------------


class NoFreeWaitTransport(RankLocalTransport):
    """Fills a slot on the copy stream without waiting for its free event (recorded on compute
    after the slot's last read)."""

    def fill_pairs(self, slot: Any, k: int, group: Any) -> None:
        return None  # every fill through fill() below

    def fill(self, slot: Any, k: int, group: Any) -> None:
        platform, copy = self.platform, self.streams.copy
        with platform.stream(copy):
            for dst, src in self.plain_pairs(slot, k, group):
                platform.copy_(dst, src)  # the ring records slot.ready after (Note [Slots])

    @staticmethod
    def plain_pairs(slot: Any, k: int, group: Any) -> list[tuple[Any, Any]]:
        """The ``(slot view, host master flat)`` copies of block ``k`` (one per dtype)."""
        return [(flat, group.master.flats[dtype]) for dtype, flat in slot.flats[k].items()]


class _NoFreeWaitRing(BlockRing):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "transport": NoFreeWaitTransport()})


declare(
    "accelerator_free_wait_skipped",
    "on the accelerator platform, a prefetch overwrites a slot without waiting for the compute "
    "that last read it",
    STREAMS,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_NoFreeWaitRing)),
    kills=STREAM_CHECKS,
)


# -- the ready event recorded on the compute stream instead of the copy stream -----------------


class ReadyOnComputeTransport(NoFreeWaitTransport):
    """Fills a slot on the copy stream after its free event, but names the compute stream (the
    stream current at enable) as a fill's last writer, so the ring records the slot's ready
    event there, where the copy stream's work is not: compute's wait on it orders nothing."""

    def writers(self) -> tuple[Any, ...]:
        return (self.streams.copy, self.platform.current_stream())

    def fill(self, slot: Any, k: int, group: Any) -> None:
        platform, copy = self.platform, self.streams.copy
        with platform.stream(copy):
            copy.wait_event(slot.free)
            for dst, src in self.plain_pairs(slot, k, group):
                platform.copy_(dst, src)


class _ReadyOnComputeRing(BlockRing):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "transport": ReadyOnComputeTransport()})


declare(
    "accelerator_ready_recorded_on_compute",
    "on the accelerator platform, the slot's ready event is recorded on the compute stream "
    "instead of the copy stream",
    STREAMS,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_ReadyOnComputeRing)),
    kills=STREAM_CHECKS,
)


# -- a slot freed while the copy stream may still write it -------------------------------------
#
# The freed slot is found when §S collects its races: a free block whose write by the copy stream
# is not ordered before its allocation stream (Note [Freed memory another stream may still use]
# in simdevice.cpp), whatever size the next allocation asks for.


class ComputeOnlySynchronize(AcceleratorPlatform):
    """An accelerator platform whose ``synchronize()`` waits for the calling thread's current
    (compute) stream only, as ``torch.cuda.current_stream().synchronize()`` in place of
    ``torch.cuda.synchronize()`` does: the synchronize before a ring's slots are freed (disable,
    and a failed enable's rollback) no longer orders the copy stream, whose prefetch of block 0
    may still be writing a slot when the allocator hands its memory out again."""

    def synchronize(self) -> None:
        self.current_stream().synchronize()


def compute_only_synchronize() -> ComputeOnlySynchronize:
    """``make_accelerator_platform``: :class:`ComputeOnlySynchronize` on the kit's device."""
    return ComputeOnlySynchronize(kit_device())


declare(
    "accelerator_slots_freed_before_the_copy_stream",
    "on the accelerator platform, synchronize() waits for the compute stream only, so disable "
    "frees slots the copy stream may still be writing",
    STREAMS,
    make_accelerator_platform=compute_only_synchronize,
    kills=STREAM_CHECKS,
)

