"""Pinned staging for blocks served from file pages.

Note [Pinned staging]
    A rank-local ring whose blocks are views of safetensors files (Note [Mapped masters] in
    transports.py) keeps no host copy: each fill copies the block's spans from the page cache.  On a
    GPU such a copy runs from pageable memory: the driver stages it through a bounce buffer of
    its own, synchronously with respect to the host.  A :class:`StagingPool` gives those fills a
    fixed set of page-locked slots instead, each one slot image (the layout of a ring slot,
    Note [Slot layout]):

    * **Background fill.**  After a fill issues its host-to-device copy, the pool stages the
      block predicted after it, from the process's staging thread, on its *staging stream* (on
      an accelerator the thread does the host copy itself; on the CPU platform the stream's
      worker does), while the current block computes.
    * **The copy waits only for its own slot.**  The host-to-device copy of block k waits for
      the event recorded after k was staged (its slot's ``filled``), not for the pool.
    * **Reuse after the reader.**  A slot is written again only after the event recorded after
      the copy that last read it (the slot's ``read``, on the copy stream): the staging stream
      waits for it (and the worker thread waits on the host first, since a host copy on an
      accelerator runs at once).  The CPU platform checks this order (``order_host``): a slot
      reused before its copy's event is a StreamOrderError.
    * **Bounded.**  The pool holds ``OffloadConfig.staging_slots`` slots (at least two: one is
      read while the next is filled), fewer if ``staging_budget_bytes`` allows fewer; a budget
      below two slots of the largest file-backed block is refused by the resolver.
    * **Counters** in ``stats()``: ``staging_hits`` (the block was staged in advance),
      ``staging_misses`` (staged when its fill came), ``staging_bytes`` (bytes staged from
      file pages), ``staging_wait_ns`` (host time a fill waited for its slot to be staged),
      ``staging_pool_bytes``.

    The pool holds no weights: the file pages stay the host side, ``state_dict()`` and
    ``disable()`` read and restore the file views, and anonymous memory grows by the pool alone.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .stats import OffloadStats
from .transaction import Transaction

__all__ = ["StagingPool", "StagingSlot"]

#: (byte offset in the slot image, dtype, element count, source span) per segment of a block.
Segments = Sequence[tuple[int, torch.dtype, int, torch.Tensor]]
#: Given a staging's (staging view, file span) copies, the work that checks the block's files
#: and makes them (Note [Deferred reads of file pages] in transports.py).
Reader = Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], Callable[[], None]]


class _Worker:
    """The staging thread of this process: every pool's stagings run on it, in the order they
    were queued.  One per process, not one per enable: a fresh thread takes a fresh malloc
    arena, whose pages made the anonymous memory of an enable vary by up to 2 MB."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="offload-ref-staging",
                                       daemon=True)
        self.thread.start()

    def put(self, job: Any) -> None:
        self.queue.put(job)

    def _run(self) -> None:
        while True:
            self.queue.get()()  # a pool's _stage: it records its own failure


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker:
    """The staging thread, started on first use (again in a forked child: threads do not
    survive a fork)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid():
            _WORKER = _Worker()
        return _WORKER


class StagingSlot:
    """One pinned staging slot of a :class:`StagingPool` and its state (the pool's lock guards
    ``holds``, ``tickets`` and ``done``)."""

    __slots__ = ("buffer", "filled", "read", "holds", "tickets", "done", "issued")

    def __init__(self, buffer: torch.Tensor, filled: Any, read: Any) -> None:
        self.buffer = buffer
        #: recorded on the staging stream after a staging into the slot
        self.filled = filled
        #: recorded on the copy stream after the slot's last reader
        self.read = read
        #: the block key staged (or being staged) in the slot, or None
        self.holds: Any = None
        #: stagings issued into the slot, and the last one the worker has issued on its stream
        self.tickets = 0
        self.done = 0
        #: set by the worker once a staging into the slot is issued
        self.issued = threading.Event()


class StagingPool:
    """A fixed set of pinned staging slots shared by the rings of one backend.  See Note
    [Pinned staging]."""

    def __init__(self, platform: Any, stats: OffloadStats, *, slot_bytes: int, slots: int,
                 pin: bool) -> None:
        if slots < 2:
            raise ValueError(f"a staging pool needs at least two slots, got {slots}")
        self.platform = platform
        self.stats = stats
        self.slot_bytes = slot_bytes
        self.n = slots
        self.pin = pin
        self.slots: list[StagingSlot] = []  # made by prepare()
        self._lru: list[int] = list(range(slots))  # least recently acquired first
        self._views: dict[tuple[int, Any], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._stream: Any = None
        self._pending = 0  # stagings queued and not yet issued
        self._idle = threading.Event()
        self._failure: BaseException | None = None
        # Host copies on a stream run in that stream's order on the CPU platform; on an
        # accelerator they run at once, so the worker waits on the host before it writes.
        self._host_ordered = bool(getattr(platform, "stream_ordered_host_copies", False))

    # -- enable -----------------------------------------------------------------------------

    def prepare(self, txn: Transaction, label: str) -> None:
        """Allocate the slots (pinned where the platform pins) and their events, as one
        transaction step each; a rollback stops the worker and frees them."""
        order_host = getattr(self.platform, "order_host", None)
        for p in range(self.n):
            buf = txn.host_empty(f"{label} staging slot {p}", self.slot_bytes, torch.uint8,
                                 self.pin)
            if order_host is not None:
                order_host(buf)
            self.slots.append(StagingSlot(buf, self.platform.Event(), self.platform.Event()))
        txn.on_rollback(self.close)  # runs before the buffers are freed (last in, first out)
        self._stream = self.platform.Stream()
        pinned = self.pin and bool(getattr(self.platform, "pin_memory_supported", False))
        self.stats.staging_pool_bytes = self.n * self.slot_bytes
        if pinned:
            self.stats.pinned_bytes += self.n * self.slot_bytes

    # -- fills ------------------------------------------------------------------------------

    def acquire(self, key: Any, segments: Segments, read: Reader | None = None) -> int:
        """The slot holding block ``key``, staged (in advance: a hit; now: a miss), once its
        staging is issued; the caller's copy waits for ``slots[p].filled`` and records
        ``slots[p].read``.
        ``read`` makes the staging's copies one piece of work that checks the block's files
        first (Note [Deferred reads of file pages] in transports.py)."""
        with self._lock:
            p = self._slot_of(key)
            hit = p is not None
            if p is None:
                p = self._victim(exclude=None)
                ticket = self._enqueue(p, key, segments, read)
            else:
                ticket = self.slots[p].tickets
            self._touch(p)
        start = time.perf_counter_ns()
        self._wait_issued(p, ticket)
        waited = time.perf_counter_ns() - start
        stats = self.stats
        stats.staging_wait_ns += waited
        if hit:
            stats.staging_hits += 1
        else:
            stats.staging_misses += 1
        return p

    def prefetch(self, key: Any, segments: Segments, *, keep: int,
                 read: Reader | None = None) -> None:
        """Stage block ``key`` in the background, unless it is staged already; slot ``keep``
        (the one a copy was just issued from) is not taken.  ``read``: as for ``acquire``."""
        with self._lock:
            if self._slot_of(key) is not None:
                return
            self._enqueue(self._victim(exclude=keep), key, segments, read)

    def forget(self, key: Any) -> None:
        """Block ``key`` is staged again by its next fill (its staging was refused)."""
        with self._lock:
            p = self._slot_of(key)
            if p is not None:
                self.slots[p].holds = None

    def copies(self, p: int, key: Any, segments: Segments, dsts: Sequence[torch.Tensor]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(device view, staging view)`` pairs that copy block ``key`` out of slot ``p``."""
        return list(zip(dsts, (view for view, _ in self._staging_views(p, key, segments))))

    # -- internals (callers hold the lock where noted) --------------------------------------

    def _slot_of(self, key: Any) -> int | None:
        for p, slot in enumerate(self.slots):
            if slot.holds == key:
                return p
        return None

    def _victim(self, exclude: int | None) -> int:
        return next(p for p in self._lru if p != exclude)

    def _touch(self, p: int) -> None:
        self._lru.remove(p)
        self._lru.append(p)

    def _staging_views(self, p: int, key: Any, segments: Segments
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = self._views.get((p, key))
        if views is None:
            buf = self.slots[p].buffer
            views = self._views[(p, key)] = [
                (buf.narrow(0, offset, numel * dtype.itemsize).view(dtype), span)
                for offset, dtype, numel, span in segments]
        return views

    def _enqueue(self, p: int, key: Any, segments: Segments, read: Reader | None) -> int:
        """Issue a staging of ``key`` into slot ``p`` (caller holds the lock)."""
        slot = self.slots[p]
        slot.holds = key
        slot.tickets += 1
        ticket = slot.tickets
        views = self._staging_views(p, key, segments)
        self._pending += 1
        work = read(views) if read is not None else None
        _worker().put(functools.partial(self._stage, p, ticket, views, work))
        return ticket

    def _wait_issued(self, p: int, ticket: int) -> None:
        slot = self.slots[p]
        while True:
            with self._lock:  # the worker sets the event under the lock, after ``done``
                if self._failure is not None:
                    raise RuntimeError(f"staging a block into pinned slot {p} failed: "
                                       f"{self._failure}") from self._failure
                if slot.done >= ticket:
                    return
                slot.issued.clear()
            slot.issued.wait()

    def _stage(self, p: int, ticket: int, views: list[tuple[torch.Tensor, torch.Tensor]],
               work: Callable[[], None] | None) -> None:
        """On the staging worker: wait for the copy that last read slot ``p``, copy the block's
        spans from the file pages into it (through ``work`` when given: it checks the files
        first), record the slot's ``filled``."""
        platform, slot = self.platform, self.slots[p]
        try:
            with platform.stream(self._stream):
                self._after_reader(p)
                if work is None:
                    for dst, src in views:
                        platform.copy_(dst, src)
                elif self._host_ordered:  # runs on the stream, in its order
                    platform.submit(work, reads=[src for _, src in views],
                                    writes=[dst for dst, _ in views])
                else:  # an accelerator: a host copy runs now, on this thread
                    work()
                slot.filled.record(self._stream)
            self.stats.staging_bytes += sum(v.numel() * v.element_size() for v, _ in views)
        except BaseException as exc:  # noqa: BLE001 - raised in the thread that waits
            self._failure = exc
        with self._lock:
            slot.done = max(slot.done, ticket)
            self._pending -= 1
            slot.issued.set()
            if not self._pending:
                self._idle.set()

    def _after_reader(self, p: int) -> None:
        """Order the staging of slot ``p`` after the copy that last read it: the staging stream
        waits for the slot's ``read`` (the order the CPU platform checks), and where a host copy
        runs at once (an accelerator) the worker waits on the host first."""
        read = self.slots[p].read
        if not self._host_ordered:
            read.synchronize()
        self._stream.wait_event(read)

    def close(self) -> None:
        """Wait until every staging this pool queued has been issued, and drop the views."""
        while True:
            with self._lock:
                if not self._pending:
                    break
                self._idle.clear()
            self._idle.wait()
        self._views = {}

    def release(self) -> None:
        """Close the pool and free the slots (disable; every copy has been synchronized)."""
        self.close()
        for slot in self.slots:
            self.platform.host_free(slot.buffer)
        self.slots = []
