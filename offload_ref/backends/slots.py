"""A ring's slots and the streams its rings share: the objects that carry the ring's ordering.

Note [Slots]
    A ring streams its blocks through two :class:`Slot` objects.  Each slot owns its device bytes
    and the two events that order every access to them; who records and who waits is fixed:

    ========  ===================================================  ==============================
    event     recorded                                             waited on
    ========  ===================================================  ==============================
    ready     by the ring alone, after every fill it issues (in    by compute, before it reads the
              ``platform.fill`` on the fast path, after the        slot; by an AllGather fill's
              transport's ``fill`` otherwise), on the fill's last  shard copy (a gather may still
              stream (``writers()[-1]``: the copy stream for       be landing in the slot)
              rank-local fills, the communication stream for
              AllGather)
    free      by compute, after the slot's last read               by every fill, before it writes
    ========  ===================================================  ==============================

    ``writers`` lists every stream a fill writes the slot on (the transport's ``writers()``,
    last writer last).  Recovery after an interrupt (Note [Interrupted blocks] in ring.py) asks
    the slot: it records ``ready`` on each of its writers and orders compute after each, so a
    fill interrupted after any of its streams is waited for.  ``occupant`` is the block bound to
    the slot (None: none); ``flats``, ``views`` and ``fills`` are built once per block at enable
    (Note [Fast path] in ring.py).

Note [Ring streams]
    The streams a backend's rings share live in one :class:`RingStreams`, passed to every ring and
    bound into every transport: every ring's copies run on its ``copy`` stream, and AllGather
    fills gather on its ``comm`` stream (backends/distributed.py; None where no ring of the
    backend can gather).  Both are one per backend, reused by every enable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RingStreams", "Slot"]


@dataclass(frozen=True)
class RingStreams:
    """The platform and the streams the rings of one backend share (Note [Ring streams])."""

    platform: Any
    copy: Any
    comm: Any = None


class Slot:
    """One device slot of a ring and the events that order it; see Note [Slots]."""

    __slots__ = ("index", "storage", "ready", "free", "writers", "occupant", "flats", "views",
                 "fills")

    def __init__(self, index: int, storage: torch.Tensor, ready: Any, free: Any,
                 writers: tuple[Any, ...]) -> None:
        self.index = index
        #: The slot's device bytes (uint8), sized for the ring's largest aligned block.
        self.storage = storage
        #: Recorded by the ring on the last stream of each fill; compute waits on it.
        self.ready = ready
        #: Recorded on compute after the slot's last read; every fill waits on it.
        self.free = free
        #: The streams a fill writes this slot on, last writer last.
        self.writers = writers
        #: The block bound to this slot (its tensors are views of it), or None.
        self.occupant: int | None = None
        #: Per block: ``{dtype: flat}`` views of the block's dtype sections in this slot.
        self.flats: list[dict[torch.dtype, torch.Tensor]] = []
        #: Per block: the views its tensors are bound to while it is in this slot.
        self.views: list[list[torch.Tensor]] = []
        #: Per block: the ``(slot view, host view)`` copies of a plain fill, or None.
        self.fills: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []

    def __repr__(self) -> str:
        return f"<Slot {self.index} holding {self.occupant}>"
