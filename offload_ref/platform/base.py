"""The platform abstraction: every stream, event, synchronization, device allocation, pinning and
memory statistic of the offloader goes through a :class:`Platform`.

Note [Stream semantics]
    Work issued while a stream is current runs in issue order on that stream.  ``event.record(s)``
    completes once everything issued on ``s`` before it has run; ``s.wait_event(e)`` makes work
    issued on ``s`` afterwards wait for ``e``.  The compute stream is the platform's current stream
    outside any ``platform.stream(...)`` context.  Device storage must not be written before the
    work that reads it has completed, nor read before the work that writes it has completed; the
    offloader expresses both orders with events only (never a host-side synchronize in steady
    state).  ``record_use`` declares that the current stream reads a device tensor, so platforms
    that check stream order (the CPU platform) can report a missing wait as a
    :class:`StreamOrderError` at the offending call instead of a wrong number later.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Event", "Platform", "Stream", "StreamOrderError", "aligned_empty", "fast_calls",
           "fill_on_stream"]


class StreamOrderError(RuntimeError):
    """Device storage was accessed without the event wait that orders it after a conflicting
    access on another stream (a data race on a real accelerator)."""


@runtime_checkable
class Stream(Protocol):
    def wait_event(self, event: Event) -> None: ...

    def wait_stream(self, other: Stream) -> None: ...

    def synchronize(self) -> None: ...


@runtime_checkable
class Event(Protocol):
    def record(self, stream: Stream | None = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...


@runtime_checkable
class Platform(Protocol):
    """What the offloader needs from a device.  See Note [Stream semantics]."""

    name: str  # "cpu" | "cuda"
    device: torch.device  # where compute runs and device storage lives
    pin_memory_supported: bool
    #: Bytes: every tensor an offloader rebinds keeps its address phase modulo ``alignment``, and
    #: every buffer from :meth:`empty` / :meth:`host_empty` starts on a multiple of it (Note
    #: [Aligned layout] in host.py).  64 on the CPU platform, 256 on CUDA.
    alignment: int

    def Stream(self) -> Stream: ...  # noqa: N802 (a constructor, as in torch.cuda.Stream)

    def Event(self, enable_timing: bool = False) -> Event: ...  # noqa: N802

    def current_stream(self) -> Stream: ...

    def stream(self, stream: Stream) -> AbstractContextManager[Any]: ...

    def synchronize(self) -> None: ...

    # -- work ---------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` on the current stream (asynchronously where possible)."""

    def submit(self, fn: Callable[[], Any], *, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> None:
        """Run ``fn`` on the current stream (collectives issued on a communication stream);
        ``reads`` / ``writes`` are the device buffers it reads and writes, so stream-order
        checking sees it exactly as it sees a copy."""

    def record_use(self, tensor: torch.Tensor) -> None:
        """Declare that work on the current stream reads device ``tensor`` (order checking)."""

    # Optional: ``fill(stream, after, pairs, then)``, exactly :func:`fill_on_stream` in one call
    # (Note [One-call fills]); the ring uses :func:`fill_on_stream` for a platform without it.
    # Optional: ``tracks_accesses = False`` says ``record_use`` and ``discard`` do nothing, so
    # the ring's steady state may skip calling them (a platform without it is called).

    # -- device storage -----------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device tensor of exactly ``numel`` elements whose first element is
        ``alignment``-aligned, counted in ``memory_allocated``."""

    def free(self, tensor: torch.Tensor) -> None:
        """Release a tensor from :meth:`empty` (the caller drops its references)."""

    def discard(self, tensor: torch.Tensor) -> None:
        """The contents of device ``tensor`` are dead (debug platforms poison them)."""

    def memory_allocated(self) -> int:
        """Device bytes currently held (the CPU ledger, or CUDA's allocator)."""

    def is_resident(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is device storage of this platform."""

    # -- host storage -------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """A flat host tensor of exactly ``numel`` elements whose first element is
        ``alignment``-aligned; page-locked when ``pin`` and the platform can pin (exact size:
        never the power-of-two rounding of a caching allocator)."""

    def host_free(self, tensor: torch.Tensor) -> None:
        """Release a tensor from :meth:`host_empty` (unregisters pinned memory)."""

    def pinned_bytes(self) -> int:
        """Host bytes currently page-locked through :meth:`host_empty`."""

    def host_allocated(self) -> int:
        """Host bytes currently allocated through :meth:`host_empty` (pinned or not)."""


def aligned_empty(numel: int, dtype: torch.dtype, alignment: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(numel)`` whose first element is ``alignment``-aligned (a view into a
    slightly larger storage when the allocator's own alignment is smaller)."""
    tensor = torch.empty(numel, dtype=dtype, device=device)
    if numel == 0 or tensor.data_ptr() % alignment == 0:
        return tensor
    itemsize = tensor.element_size()
    if alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a multiple of {dtype}'s size {itemsize}")
    backing = torch.empty(numel + alignment // itemsize, dtype=dtype, device=device)
    start = (-backing.data_ptr()) % alignment // itemsize
    return backing.narrow(0, start, numel)


# Note [One-call fills]
#     A ring fill is always the same four steps on the copy stream: wait for the slot's free
#     event, one copy per dtype, record the slot's ready event.  Issued through the generic
#     ``stream`` / ``wait_event`` / ``copy_`` / ``record`` calls it costs a context manager and
#     five or six calls per block; ``platform.fill`` issues the same work in one call (the CPU
#     platform takes its ledger lock once and queues one batch, CUDA enters the stream once).
#     Its effect, ordering and checks are exactly those of :func:`fill_on_stream`.  The ring
#     uses it only when the class that defines ``fill`` also defines ``copy_`` and ``stream``
#     (:func:`fast_calls`): a platform proxy that counts copies, or a subclass that overrides
#     ``copy_``, gets every copy through its ``copy_``.  ``tracks_accesses = False`` is
#     honoured on the same terms.


def _owner(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _same_definer(platform: Any, name: str, generic: Sequence[str]) -> bool:
    """Whether ``platform``'s class defines ``name`` together with every method of ``generic``
    (one class of its MRO defines them all, and the instance overrides none): then ``name`` is
    consistent with them.  A proxy that forwards attributes, or a subclass or an instance that
    overrides ``copy_`` but inherits ``fill``, is not."""
    cls = type(platform)
    owner = _owner(cls, name)
    if owner is None:
        return False
    instance = getattr(platform, "__dict__", {})
    return all(_owner(cls, g) is owner and g not in instance for g in generic)


def fast_calls(platform: Any) -> tuple[Callable[..., None], bool]:
    """The ring's one-call fill and whether ``record_use`` / ``discard`` may be skipped
    (Note [One-call fills]): ``platform.fill`` and ``platform.tracks_accesses`` where the
    class that defines them also defines the generic methods they stand for, otherwise
    :func:`fill_on_stream` and False (every generic call is made, so a wrapping or instrumented
    platform sees every copy and every access)."""
    if _same_definer(platform, "fill", ("copy_", "stream")):
        fill = platform.fill
    else:
        fill = functools.partial(fill_on_stream, platform)
    skip = (_same_definer(platform, "tracks_accesses", ("record_use", "discard"))
            and not platform.tracks_accesses)
    return fill, skip


def fill_on_stream(platform: Platform, stream: Stream, after: Event,
                   pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], then: Event) -> None:
    """The generic fill (Note [One-call fills]): ``stream`` waits for ``after``, copies every
    ``(dst, src)`` of ``pairs`` and records ``then``."""
    with platform.stream(stream):
        stream.wait_event(after)
        for dst, src in pairs:
            platform.copy_(dst, src)
        then.record(stream)
