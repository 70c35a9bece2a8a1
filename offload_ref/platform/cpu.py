"""The CPU platform: accelerator stream semantics on threads, so stream logic is testable anywhere.

The compute stream is the calling thread: work issued on it runs at once.  Every stream created
with :meth:`CpuPlatform.Stream` is one daemon worker thread that runs its queued work in issue
order; torch releases the GIL inside ``copy_``, so a copy stream really overlaps compute.  Device
storage is ordinary CPU memory registered in a ledger, which makes residency observable.

Two debugging aids make a missing event wait fail loudly instead of passing by luck:

* stream-order checking (always on, see Note [Stream-order checking]): an access to device storage
  that is not ordered after a conflicting access on another stream raises
  :class:`StreamOrderError` from the issuing call;
* the race amplifier (``race_amplifier=True``): queued copies start late and run in chunks, and
  dead or freed storage (and fresh allocations) are poisoned with NaN, so reading a slot before its
  copy has landed gives a wrong number.

Note [Stream-order checking]
    The check runs at issue time, on the issuing thread, and models accelerator semantics rather
    than what the threads happen to do: on CUDA the compute stream is asynchronous too, so a host
    thread that blocked in ``compute.wait_event(e)`` orders nothing on other streams.  Every stream
    numbers the items issued on it (its sequence) and keeps a vector clock: for every other stream
    the highest sequence known to have completed before the stream's next item.  ``event.record(s)``
    snapshots ``s``'s clock plus ``s``'s own sequence; ``w.wait_event(e)`` merges that snapshot into
    ``w``'s clock (so orders compose through chains of events).  Host waits (``synchronize`` of the
    platform, a stream or an event, or a ``query`` that returned True) merge into a host clock that
    orders everything issued afterwards on any stream.  Each ledger allocation remembers its last
    write and, per stream, its last read.  A write on ``w`` is legal when the last write and every
    last read are on ``w`` or covered by ``w``'s clock (or the host clock); a read needs the same
    for the last write.  ``copy_`` writes ``dst`` and reads ``src``; ``record_use`` reads;
    ``discard`` and ``free`` write (poisoning or releasing storage another stream still uses is a
    race too).  Host tensors are not tracked.  The granularity is a whole allocation (one slot).

Note [Batched issue]
    Waking a worker thread costs tens of microseconds on a loaded machine (a futex wake and a
    GIL handoff per ``SimpleQueue.put``), and a ring fill issues three items (wait on the slot's
    free event, copy, record its ready event).  So items issued on a copy stream inside a
    ``platform.stream(s)`` block are collected and queued as one batch when the outermost block
    exits.  Issue order, sequence numbers and the checks are unchanged; only the thread's wake-up
    is deferred to the end of the block, or earlier when any thread is about to wait (a host
    wait, a synchronize, a query that finds work pending flushes every open batch first), so
    nothing ever waits on work that is not queued.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from offload_ref.platform import _hostmem
from offload_ref.platform._stream_failures import StreamWorkError, stream_failure
from offload_ref.platform._storage import storage_device
from offload_ref.platform.base import StreamOrderError, aligned_empty, fill_on_stream

__all__ = ["CpuPlatform", "StreamWorkError"]

# How long close() waits for the worker threads to drain before abandoning their queued work.
_CLOSE_TIMEOUT_S = 5.0
# Blocking waits wake up this often to notice that the platform was closed under them.
_WAIT_SLICE_S = 0.05
# A queued copy runs in this many chunks (inclusive range) under the race amplifier.
_AMPLIFIER_CHUNKS = (2, 4)

_STOP = object()  # queue sentinel: the worker exits after the items queued before it


class _StreamStopped(RuntimeError):
    """Work put on a CPU stream whose platform was closed."""


def _poison_(tensor: torch.Tensor) -> None:
    """Overwrite ``tensor`` with a value no correct computation produces from it."""
    if tensor.numel() == 0:
        return
    dtype = tensor.dtype
    if dtype == torch.bool:
        tensor.fill_(True)
    elif dtype.is_complex:
        tensor.fill_(complex(float("nan"), float("nan")))
    elif dtype.is_floating_point:
        tensor.fill_(float("nan"))
    else:
        try:
            tensor.fill_(torch.iinfo(dtype).max)
        except (TypeError, RuntimeError):  # exotic dtypes: poison the raw bytes instead
            tensor.untyped_storage().fill_(0xFF)


def _check_copy_shapes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Reject a shape mismatch at issue time, as CUDA's copy_ does, not later on a worker."""
    if src.shape == dst.shape:
        return
    try:
        broadcast = torch.broadcast_shapes(src.shape, dst.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != dst.shape:
        raise RuntimeError(
            f"copy_: source of shape {tuple(src.shape)} cannot be copied into a destination of "
            f"shape {tuple(dst.shape)} (not broadcastable to it)"
        )


class _Flag:
    """A one-shot ``threading.Event`` (set once, never cleared) on one bare lock: creating a
    ``threading.Event`` (a Condition and its lock) per event record was a measurable share of the
    per-block cost."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()  # held until set(): a waiter blocks acquiring it

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=timeout):
            self._lock.release()  # let the other waiters through
        return self._set


class _Recording:
    """One ``record`` of an event: set when the work issued before it has run.

    ``clock`` is the recording stream's vector clock at record time (Note [Stream-order
    checking]); ``failure`` is (stream name, cause) when the stream was broken by then, and
    ``worker`` the broken stream's worker (raising the failure here reports it, so a later
    platform-wide synchronize does not raise it a second time)."""

    __slots__ = ("clock", "done", "failure", "stream_name", "time", "worker")

    def __init__(self, stream_name: str, clock: dict[int, int]) -> None:
        self.stream_name = stream_name
        self.clock = clock
        self.done = _Flag()
        self.time: float | None = None
        self.failure: tuple[str, BaseException] | None = None
        self.worker: _Worker | None = None

    def complete(self, failure: tuple[str, BaseException] | None = None,
                 worker: _Worker | None = None) -> None:
        self.time = time.perf_counter()
        self.failure = failure
        self.worker = worker if failure is not None else None
        self.done.set()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            if self.worker is not None:
                self.worker.failure_reported = True  # it surfaced here, loudly
            raise stream_failure(*self.failure)


@dataclass(eq=False)
class _Allocation:
    """A ledger entry: the storage of one :meth:`CpuPlatform.empty` and its last accesses."""

    index: int
    tensor: torch.Tensor  # keeps the storage (and so its data_ptr key) alive until free()
    numel: int
    nbytes: int
    last_write: tuple[int, int] | None = None  # (stream id, sequence)
    reads: dict[int, int] = field(default_factory=dict)  # stream id -> sequence of last read
    host: bool = False  # host storage whose order is checked (CpuPlatform.order_host)

    def describe(self) -> str:
        return (
            f"{'host' if self.host else 'device'} allocation #{self.index} ({self.numel} x "
            f"{self.tensor.dtype}, {self.nbytes} bytes)"
        )


class _Worker:
    """The thread behind one copy stream.  It holds no reference to its stream, so a stream
    that is garbage collected stops its thread (after the work already queued on it)."""

    def __init__(self, platform: CpuPlatform, stream: _CpuStream) -> None:
        self.name = stream.name
        self._platform = platform
        self._stream_ref = weakref.ref(stream)
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        # Whether the failure has been raised on the host (by an event wait, a stream or a
        # platform synchronize): CpuPlatform.synchronize raises each failure only once.
        self.failure_reported = False
        self.stopping = False
        self.pending = 0
        # Note [Batched issue]: items issued while a ``platform.stream(s)`` block of this stream
        # is open are queued as one batch when the outermost block exits (or when any thread is
        # about to block), so a fill (wait, copy, record) wakes the thread once, not three times.
        self.batch: list[tuple[str, Any]] | None = None
        self.batch_depth = 0
        self.cond = threading.Condition()
        self.thread = threading.Thread(
            target=self._run, name=f"offload_ref-cpu-stream-{stream.name}", daemon=True
        )

    def put(self, kind: str, payload: Any) -> None:
        with self.cond:
            if self.stopping:
                raise _StreamStopped(f"CPU stream '{self.name}' is stopped (its platform was "
                                     "closed)")
            self.pending += 1
            if self.batch is not None:
                self.batch.append((kind, payload))
            else:
                self.queue.put((kind, payload))

    def put_batch(self, items: list[tuple[str, Any]]) -> None:
        with self.cond:
            if self.stopping:
                raise _StreamStopped(f"CPU stream '{self.name}' is stopped (its platform was "
                                     "closed)")
            self.pending += len(items)
            if self.batch is not None:
                self.batch.extend(items)
            else:
                self.queue.put(("batch", items))

    def begin_batch(self) -> None:
        with self.cond:
            self.batch_depth += 1
            if self.batch is None:
                self.batch = []

    def end_batch(self) -> None:
        with self.cond:
            self.batch_depth -= 1
            self._flush()
            if self.batch_depth <= 0:
                self.batch_depth = 0
                self.batch = None

    def flush(self) -> None:
        with self.cond:
            self._flush()

    def _flush(self) -> None:
        """Queue the open batch, in issue order (caller holds ``cond``)."""
        if self.batch:
            self.queue.put(("batch", self.batch))
            self.batch = []

    def stop(self) -> None:
        with self.cond:
            if self.stopping:
                return
            self.stopping = True
            self._flush()
            self.batch = None
            self.queue.put(_STOP)

    def _run(self) -> None:
        # Work that issues more work (a submit()ted function calling copy_) runs on this stream.
        self._platform._tls.worker_stream = self._stream_ref
        try:
            while (item := self.queue.get()) is not _STOP:
                items = item[1] if item[0] == "batch" else (item,)
                try:
                    for kind, payload in items:
                        self._execute(kind, payload)
                finally:  # one update per queue item: ``pending`` reaches 0 once all of it ran
                    with self.cond:
                        self.pending -= len(items)
                        self.cond.notify_all()
        finally:
            self._platform._worker_exited(self)

    def _execute(self, kind: str, payload: Any) -> None:
        if kind == "mark":
            if self.failure is not None:
                payload.complete((self.name, self.failure), self)
            else:
                payload.complete()
            return
        if self.failure is not None or self._platform._abort.is_set():
            return  # a broken stream runs nothing after the failed item
        try:
            if kind == "work":
                payload()
            else:  # "wait"
                self._platform._block_until(payload)
                if payload.failure is not None:
                    name, cause = payload.failure
                    raise RuntimeError(f"waited on an event of failed stream '{name}'") from cause
        except BaseException as exc:  # noqa: BLE001 (stored and re-raised on the host)
            self.failure = exc


class _CpuStream:
    """A CPU stream: the compute stream (``_worker is None``: work runs on the issuing thread)
    or a copy stream backed by a :class:`_Worker`.  Ordering state lives in the platform."""

    def __init__(self, platform: CpuPlatform, sid: int, name: str, *, worker: bool) -> None:
        self._platform = platform
        self.sid = sid
        self.name = name
        self._worker: _Worker | None = None
        if worker:
            self._worker = _Worker(platform, self)
            weakref.finalize(self, self._worker.stop)

    def __repr__(self) -> str:
        kind = "compute" if self._worker is None else "worker"
        return f"<CpuStream {self.name!r} ({kind})>"

    def _runs_inline(self) -> bool:
        """Whether work issued now runs on the issuing thread: always on the compute stream,
        and on a copy stream when its own worker issues it (work that issues more work)."""
        return self._worker is None or threading.current_thread() is self._worker.thread

    def _put(self, kind: str, payload: Any) -> None:
        """Queue an item on the worker (callers checked ``not self._runs_inline()``)."""
        assert self._worker is not None
        self._worker.put(kind, payload)

    def wait_event(self, event: _CpuEvent) -> None:
        """Work issued on this stream afterwards waits for ``event``'s latest record.  On the
        compute stream that is a host wait (work there runs at issue)."""
        self._platform._check_own_event(event)
        recording = event._recording
        if recording is None:  # never recorded: nothing to wait for (as in CUDA)
            return
        with self._platform._lock:
            self._platform._merge_clock(self.sid, recording.clock)
            if not self._runs_inline():
                self._put("wait", recording)
                return
        self._platform._block_until(recording)
        recording.raise_if_failed()

    def wait_stream(self, other: _CpuStream) -> None:
        """Work issued here afterwards waits for the work issued on ``other`` so far."""
        event = self._platform.Event()
        event.record(other)
        self.wait_event(event)

    def query(self) -> bool:
        """Whether all work queued on this stream has run."""
        if self._worker is None:
            return True
        with self._worker.cond:
            self._worker._flush()  # Note [Batched issue]: queued work gets under way
            return self._worker.pending == 0

    def synchronize(self) -> None:
        """Block the host until the work issued on this stream so far has run; re-raise a
        failure of that work."""
        platform = self._platform
        with platform._lock:
            snapshot = platform._snapshot(self.sid)
            worker = self._worker
            if worker is not None and not self._runs_inline():
                marker = _Recording(self.name, snapshot)
                worker.put("mark", marker)
            else:
                marker = None
        if marker is not None:
            platform._block_until(marker)
        with platform._lock:
            platform._merge_clock(None, snapshot)
        if worker is not None and worker.failure is not None:
            worker.failure_reported = True
            raise stream_failure(worker.name, worker.failure)


class _CpuEvent:
    """An event of a :class:`CpuPlatform`.  Recording again starts a new recording (as CUDA
    does); waits issued before that keep waiting for the recording they saw."""

    def __init__(self, platform: CpuPlatform, enable_timing: bool) -> None:
        self._platform = platform
        self.enable_timing = enable_timing
        self._recording: _Recording | None = None

    def __repr__(self) -> str:
        recording = self._recording
        state = "unrecorded" if recording is None else f"recorded on '{recording.stream_name}'"
        return f"<CpuEvent {state}>"

    def record(self, stream: _CpuStream | None = None) -> None:
        """Complete once the work issued on ``stream`` (default: the current one) before this
        call has run."""
        platform = self._platform
        stream = platform.current_stream() if stream is None else platform._check_own_stream(stream)
        with platform._lock:
            recording = _Recording(stream.name, platform._snapshot(stream.sid))
            self._recording = recording
            if not stream._runs_inline():
                stream._put("mark", recording)
                return
        recording.complete()  # inline: everything issued before has already run

    def wait(self, stream: _CpuStream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for this event."""
        stream = self._platform.current_stream() if stream is None else stream
        stream.wait_event(self)

    def query(self) -> bool:
        """Whether the latest recording has completed (True when never recorded)."""
        recording = self._recording
        if recording is None:
            return True
        if not recording.done.is_set():
            self._platform._flush_batches()  # Note [Batched issue]: a poll must not stall it
            return False
        recording.raise_if_failed()
        with self._platform._lock:
            self._platform._merge_clock(None, recording.clock)
        return True

    def synchronize(self) -> None:
        """Block the host until the latest recording has completed."""
        recording = self._recording
        if recording is None:
            return
        self._platform._block_until(recording)
        recording.raise_if_failed()
        with self._platform._lock:
            self._platform._merge_clock(None, recording.clock)

    def elapsed_time(self, end: _CpuEvent) -> float:
        """Milliseconds between the completion of this event and of ``end``."""
        times = []
        for label, event in (("start", self), ("end", end)):
            if not event.enable_timing:
                raise RuntimeError(
                    f"elapsed_time: the {label} event was created without enable_timing=True"
                )
            recording = event._recording
            if recording is None or recording.time is None:
                raise RuntimeError(
                    f"elapsed_time: the {label} event has not completed; record it and "
                    f"synchronize it first"
                )
            times.append(recording.time)
        return (times[1] - times[0]) * 1000.0


class CpuPlatform:
    """Accelerator stream semantics on CPU threads, with stream-order checking and an optional
    race amplifier (see the module docstring).

    ``seed`` and ``max_delay_s`` tune the race amplifier: every queued copy is delayed by a
    random time in ``[0, max_delay_s]`` and split into chunks with short random pauses.  Close the
    platform (or use it as a context manager) to stop its worker threads."""

    name = "cpu"
    pin_memory_supported = False  # tensor.pin_memory() raises without an accelerator
    alignment = 64  # MKL picks its kernel path by alignment (Note [Aligned layout], host.py)
    tracks_accesses = True  # record_use / discard feed the stream-order checker
    #: A host-to-host copy_ runs in its stream's order, like any other (an accelerator runs it
    #: at once): Note [Pinned staging] in backends/staging.py.
    stream_ordered_host_copies = True

    def __init__(
        self, *, race_amplifier: bool = False, seed: int = 0, max_delay_s: float = 0.002,
        device: str | torch.device | None = None,
    ) -> None:
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        # Note [Device storage on the simulated accelerator]: device storage (slots, resident
        # weights) lives on the simulated accelerator when it is available, so a host tensor
        # meeting a device weight is torch's same-device error, as on a GPU; ``device="cpu"``
        # keeps the single-device mode (host and device both "cpu").
        self.device = storage_device(device)
        self._device_type = self.device.type
        self.race_amplifier = race_amplifier
        self.max_delay_s = max_delay_s
        self.hazards: list[StreamOrderError] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # guards ordering state, ledger and rng
        self._tls = threading.local()
        self._abort = threading.Event()
        self._closed = False
        self._sids = itertools.count()
        self._workers: set[_Worker] = set()
        # Note [Stream-order checking]: per-stream sequences and clocks, keyed by stream id so
        # that the state outlives no stream object.
        self._seq: dict[int, int] = {}
        self._clocks: dict[int, dict[int, int]] = {}
        self._names: dict[int, str] = {}
        self._host_clock: dict[int, int] = {}
        self._ledger: dict[int, _Allocation] = {}
        self._host: dict[int, int] = {}  # host_empty storage pointer -> bytes
        self._ordered_host: dict[int, _Allocation] = {}  # order_host(): checked host storage
        self._allocation_index = itertools.count(1)
        self._allocated = 0
        self._compute = self._new_stream("compute", worker=False)
        self._copy_names = itertools.count(1)

    def __repr__(self) -> str:
        return (f"CpuPlatform(device={str(self.device)!r}, race_amplifier={self.race_amplifier}, "
                f"closed={self._closed})")

    def __enter__(self) -> CpuPlatform:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the worker threads after the work already queued on them (abandoning it if
        they do not finish within a few seconds).  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        for worker in workers:
            worker.stop()
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for worker in workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        if any(worker.thread.is_alive() for worker in workers):
            self._abort.set()  # wakes blocked waits; remaining items are skipped
            for worker in workers:
                worker.thread.join(1.0)

    # -- streams and events -------------------------------------------------------------------
    def Stream(self, name: str | None = None) -> _CpuStream:  # noqa: N802
        """A new copy stream: one daemon worker thread running its work in issue order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("CpuPlatform is closed; create a new platform")
        stream = self._new_stream(name or f"copy-{next(self._copy_names)}", worker=True)
        worker = stream._worker
        assert worker is not None
        with self._lock:
            self._workers.add(worker)
        worker.thread.start()
        return stream

    def Event(self, enable_timing: bool = False) -> _CpuEvent:  # noqa: N802
        return _CpuEvent(self, enable_timing)

    def current_stream(self) -> _CpuStream:
        """The stream made current on this thread, the stream whose worker runs this thread, or
        the compute stream."""
        stream = getattr(self._tls, "stream", None)
        if stream is not None:
            return stream
        worker_ref = getattr(self._tls, "worker_stream", None)
        if worker_ref is not None and (worker_stream := worker_ref()) is not None:
            return worker_stream
        return self._compute

    @contextlib.contextmanager
    def stream(self, stream: _CpuStream | None) -> Iterator[_CpuStream | None]:
        """Make ``stream`` current on this thread for the block (None: leave it unchanged)."""
        if stream is None:
            yield None
            return
        self._check_own_stream(stream)
        previous = getattr(self._tls, "stream", None)
        worker = None if stream._runs_inline() else stream._worker
        try:  # switched inside the try: an interrupt right after it still switches back
            self._tls.stream = stream
            if worker is not None:
                worker.begin_batch()  # Note [Batched issue]
            yield stream
        finally:
            self._tls.stream = previous
            if worker is not None:
                worker.end_batch()

    def synchronize(self) -> None:
        """Block until every stream has run its queued work; re-raise the first failure not
        reported by an earlier call (a broken stream keeps raising from its own synchronize and
        events, but does not fail every later platform-wide synchronize of a shared platform)."""
        with self._lock:
            workers = list(self._workers)
            snapshot = dict(self._seq)
        markers = []
        for worker in workers:
            if worker.thread is threading.current_thread():
                continue  # work on this stream that synchronizes: what precedes it has run
            marker = _Recording(worker.name, {})
            try:
                worker.put("mark", marker)
            except _StreamStopped:  # its thread drains the queue and exits (any other error
                # would leave a live worker joined forever)
                worker.thread.join()
                continue
            markers.append(marker)
        for marker in markers:
            self._block_until(marker)
        with self._lock:
            self._merge_clock(None, snapshot)
        for worker in workers:
            if worker.failure is not None and not worker.failure_reported:
                worker.failure_reported = True
                raise stream_failure(worker.name, worker.failure)

    # -- work ---------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` on the current stream (queued on a copy stream)."""
        _check_copy_shapes(dst, src)
        stream = self.current_stream()
        with self._lock:
            self._access(stream, "copy_", reads=(src,), writes=(dst,))
            if stream._runs_inline():
                work = None
            else:
                amplify = self.race_amplifier
                work = self._amplified_copy(dst, src) if amplify else _plain_copy(dst, src)
                stream._put("work", work)
        if work is None:
            dst.copy_(src)

    def fill(self, stream: _CpuStream, after: _CpuEvent,
             pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], then: _CpuEvent) -> None:
        """Exactly :func:`~offload_ref.platform.base.fill_on_stream`, in one lock section and
        one queued batch (Note [One-call fills] in base.py)."""
        self._check_own_stream(stream)
        self._check_own_event(after)
        self._check_own_event(then)
        worker = stream._worker
        if worker is None or self.race_amplifier or worker.thread.ident == threading.get_ident():
            fill_on_stream(self, stream, after, pairs, then)
            return
        for dst, src in pairs:
            _check_copy_shapes(dst, src)
        recording = after._recording
        items: list[tuple[str, Any]] = []
        with self._lock:
            try:
                if recording is not None:
                    self._merge_clock(stream.sid, recording.clock)
                    items.append(("wait", recording))
                for dst, src in pairs:
                    self._access(stream, "copy_", reads=(src,), writes=(dst,))
                    items.append(("work", _plain_copy(dst, src)))
                mark = _Recording(stream.name, self._snapshot(stream.sid))
                then._recording = mark
                items.append(("mark", mark))
            finally:  # what was numbered is queued, as the one-item-at-a-time issue would
                if items:
                    worker.put_batch(items)

    def submit(self, fn: Callable[[], Any], *, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> None:
        """Run ``fn`` on the current stream (queued on a copy stream; its result is dropped).
        ``reads`` and ``writes`` are checked and recorded as a copy's are (Note [Stream-order
        checking]): a collective writing a slot is ordered like a copy into it."""
        stream = self.current_stream()
        with self._lock:
            self._access(stream, "submit", reads=tuple(reads), writes=tuple(writes))
            if not stream._runs_inline():
                stream._put("work", fn)
                return
        fn()

    def record_use(self, tensor: torch.Tensor) -> None:
        """Declare that the current stream reads ``tensor`` (raises StreamOrderError when the
        read is not ordered after the last write on another stream)."""
        stream = self.current_stream()
        with self._lock:
            self._access(stream, "record_use", reads=(tensor,))

    # -- device storage -----------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh flat tensor of exactly ``numel`` elements, counted in the ledger."""
        if numel < 0:
            raise ValueError(f"empty: numel must be >= 0, got {numel}")
        # A zero-size tensor has no storage address; back it with one element so that every
        # allocation has a distinct ledger key, but count what was asked for.
        backing = aligned_empty(max(numel, 1), dtype, self.alignment, self.device)
        tensor = backing[:numel]
        if self.race_amplifier:
            _poison_(backing)  # uninitialized memory must not pass for weights by luck
        nbytes = numel * backing.element_size()
        key = backing.untyped_storage().data_ptr()
        allocation = _Allocation(next(self._allocation_index), backing, numel, nbytes)
        # One line (Note [Guard locking] in call_guard.py): counted in the ledger and handed to
        # the caller with no line between, so an exception raised at any line of enable either
        # leaves no allocation or one its caller received (issue 37).
        with self._lock: return self._counted(key, allocation, tensor)  # noqa: E701

    def _counted(self, key: int, allocation: _Allocation, tensor: torch.Tensor) -> torch.Tensor:
        self._ledger[key] = allocation; self._allocated += allocation.nbytes; return tensor  # noqa: E702,E501

    def free(self, tensor: torch.Tensor) -> None:
        """Release the allocation holding ``tensor`` (a write: poisoned under the amplifier)."""
        stream = self.current_stream()
        with self._lock:
            allocation = self._require_allocation(tensor, "free")
            self._access(stream, "free", writes=(tensor,))
            work = self._poison_in_order(stream, allocation.tensor)
        if work is not None:
            work()
        # The ledger lets go last, on one line (Note [Undo first] in backends/transaction.py): a
        # free that raised before it changed nothing and can be called again.
        with self._lock: self._uncount(allocation)  # noqa: E701

    def _uncount(self, allocation: _Allocation) -> None:
        del self._ledger[allocation.tensor.untyped_storage().data_ptr()]; self._allocated -= allocation.nbytes  # noqa: E702,E501

    def discard(self, tensor: torch.Tensor) -> None:
        """The contents of ``tensor`` are dead (a write: poisoned under the amplifier)."""
        stream = self.current_stream()
        with self._lock:
            self._require_allocation(tensor, "discard")
            self._access(stream, "discard", writes=(tensor,))
            work = self._poison_in_order(stream, tensor)
        if work is not None:
            work()

    def memory_allocated(self) -> int:
        with self._lock:
            return self._allocated

    def is_resident(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            found = self._lookup(tensor)
            return found is not None and not found.host

    # -- host storage -------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """Ordinary exact-size host memory; ``pin`` is ignored (nothing to pin for on CPU).
        Counted in :meth:`host_allocated` until :meth:`host_free`."""
        tensor = _hostmem.empty(numel, dtype, self.alignment)  # Note [Huge-page host memory]
        if numel:
            with self._lock:
                self._host[tensor.untyped_storage().data_ptr()] = numel * tensor.element_size()
        return tensor

    def host_free(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor from :meth:`host_empty` (never page-locked here)."""
        if tensor.numel():
            with self._lock:
                self._host.pop(tensor.untyped_storage().data_ptr(), None)
                self._ordered_host.pop(tensor.untyped_storage().data_ptr(), None)

    def host_allocated(self) -> int:
        """Host bytes from :meth:`host_empty` not yet released (leaks show up here)."""
        with self._lock:
            return sum(self._host.values())

    def pinned_bytes(self) -> int:
        return 0

    def order_host(self, tensor: torch.Tensor) -> None:
        """Check the stream order of every access to ``tensor`` (host storage from
        :meth:`host_empty`: a staging buffer, written on one stream and read on another) as for
        device storage (Note [Stream-order checking]), until :meth:`host_free`.  It stays host
        storage: :meth:`is_resident` is False, and it is counted in :meth:`host_allocated`."""
        if not tensor.numel():
            return
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._ordered_host[key] = _Allocation(
                next(self._allocation_index), tensor, tensor.numel(),
                tensor.numel() * tensor.element_size(), host=True)

    # -- internals ----------------------------------------------------------------------------
    def _new_stream(self, name: str, *, worker: bool) -> _CpuStream:
        with self._lock:
            sid = next(self._sids)
            self._seq[sid] = 0
            self._clocks[sid] = {}
            self._names[sid] = name
        return _CpuStream(self, sid, name, worker=worker)

    def _worker_exited(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)

    def _check_own_stream(self, stream: Any) -> _CpuStream:
        if not isinstance(stream, _CpuStream) or stream._platform is not self:
            raise ValueError(f"{stream!r} is not a stream of this CpuPlatform")
        return stream

    def _check_own_event(self, event: Any) -> None:
        if not isinstance(event, _CpuEvent) or event._platform is not self:
            raise ValueError(f"{event!r} is not an event of this CpuPlatform")

    def _flush_batches(self) -> None:
        """Queue every open batch (Note [Batched issue]): what a waiter waits for is under way."""
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.flush()

    def _block_until(self, recording: _Recording) -> None:
        """Wait for ``recording``, giving up (with an error) if the platform is torn down."""
        if recording.done.is_set():
            return
        self._flush_batches()
        while not recording.done.wait(_WAIT_SLICE_S):
            if self._abort.is_set():
                raise RuntimeError(
                    f"CpuPlatform was closed while waiting for an event on "
                    f"'{recording.stream_name}'"
                )

    def _snapshot(self, sid: int) -> dict[int, int]:
        """Stream ``sid``'s vector clock including its own sequence (caller holds the lock)."""
        clock = dict(self._clocks[sid])
        clock[sid] = self._seq[sid]
        return clock

    def _merge_clock(self, sid: int | None, clock: dict[int, int]) -> None:
        """Merge ``clock`` into stream ``sid``'s clock, or the host clock when ``sid`` is None
        (caller holds the lock)."""
        target = self._host_clock if sid is None else self._clocks[sid]
        for other, seq in clock.items():
            if other != sid and seq > target.get(other, 0):
                target[other] = seq

    def _lookup(self, tensor: torch.Tensor) -> _Allocation | None:
        if tensor.is_sparse:
            return None
        device = tensor.device.type
        if device != self._device_type and (device != "cpu" or not self._ordered_host):
            return None
        try:
            key = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        found = self._ledger.get(key) if device == self._device_type else None
        if found is None and device == "cpu":
            found = self._ordered_host.get(key)
        return found

    def _require_allocation(self, tensor: torch.Tensor, what: str) -> _Allocation:
        allocation = self._lookup(tensor)
        if allocation is not None and allocation.host:
            allocation = None  # device storage only: free/discard never take host storage
        if allocation is None:
            described = (
                f"tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} on {tensor.device}"
            )
            if tensor.device.type in ("cpu", self._device_type) and not tensor.is_sparse:
                described += f" (storage at 0x{tensor.untyped_storage().data_ptr():x})"
            raise ValueError(
                f"{what}: the {described} is not device storage of this CpuPlatform; pass a tensor "
                f"returned by empty() (or a view of one) that has not been freed"
            )
        return allocation

    def _access(
        self,
        stream: _CpuStream,
        what: str,
        *,
        reads: tuple[torch.Tensor, ...] = (),
        writes: tuple[torch.Tensor, ...] = (),
    ) -> None:
        """Number one item issued on ``stream`` and check its device accesses (Note
        [Stream-order checking]); caller holds the lock.  Raises before anything is recorded."""
        sid = stream.sid
        seq = self._seq[sid] + 1
        read_allocations = [a for a in map(self._lookup, reads) if a is not None]
        write_allocations = [a for a in map(self._lookup, writes) if a is not None]
        for allocation in read_allocations:
            if allocation.last_write is not None:
                self._check_ordered(stream, what, allocation, "written", allocation.last_write)
        for allocation in write_allocations:
            if allocation.last_write is not None:
                self._check_ordered(stream, what, allocation, "written", allocation.last_write)
            for reader, read_seq in allocation.reads.items():
                self._check_ordered(stream, what, allocation, "read", (reader, read_seq))
        self._seq[sid] = seq
        for allocation in read_allocations:
            allocation.reads[sid] = seq
        for allocation in write_allocations:
            allocation.last_write = (sid, seq)
            allocation.reads.clear()

    def _check_ordered(
        self,
        stream: _CpuStream,
        what: str,
        allocation: _Allocation,
        verb: str,
        access: tuple[int, int],
    ) -> None:
        other, seq = access
        if other == stream.sid:
            return
        known = max(self._clocks[stream.sid].get(other, 0), self._host_clock.get(other, 0))
        if seq <= known:
            return
        other_name = self._names[other]
        error = StreamOrderError(
            f"{what} on stream '{stream.name}' accesses {allocation.describe()}, last {verb} on "
            f"stream '{other_name}' (its item {seq}), without an event wait ordering it after that "
            f"access: record an event on '{other_name}' after the access and make "
            f"'{stream.name}' wait_event() on it first"
        )
        self.hazards.append(error)
        raise error

    def _poison_in_order(
        self, stream: _CpuStream, tensor: torch.Tensor
    ) -> Callable[[], None] | None:
        """Under the amplifier, poison ``tensor`` in ``stream``'s order: queue it on a copy stream,
        or return the work for the caller to run once it has released the lock."""
        if not self.race_amplifier:
            return None
        work = functools.partial(_poison_, tensor)
        if stream._runs_inline():
            return work
        stream._put("work", work)
        return None

    def _amplified_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """A copy that starts late and lands in chunks (random draws taken at issue time, so a
        seeded platform replays the same schedule for the same issue order)."""
        rng = self._rng
        delay = rng.uniform(0.0, self.max_delay_s)
        chunks = rng.randint(*_AMPLIFIER_CHUNKS)
        pauses = [rng.uniform(0.0, self.max_delay_s / 4) for _ in range(chunks - 1)]
        if dst.dim() == 0 or src.shape != dst.shape or dst.shape[0] < chunks:
            pauses = []

        def copy() -> None:
            time.sleep(delay)
            if not pauses:
                dst.copy_(src)
                return
            bounds = [round(i * dst.shape[0] / (len(pauses) + 1)) for i in range(len(pauses) + 2)]
            for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
                if i:
                    time.sleep(pauses[i - 1])
                dst[start:stop].copy_(src[start:stop])

        return copy


def _plain_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src)

    return copy
