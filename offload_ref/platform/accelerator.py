"""The accelerator platform: streams, events, device storage and pinning of any torch accelerator,
written only against torch's device-generic API (``torch.Stream``, ``torch.Event``,
``torch.accelerator`` and torch's pinned host memory).

So the code a GPU runs is the code CI runs: on a CPU-only machine it runs over offload-ref's
simulated accelerator (``hpu``, :mod:`offload_ref.platform.simulated`), on a GPU machine over CUDA
(:class:`~offload_ref.platform.CudaPlatform` adds only CUDA's exact-size pinning), and on XPU or
NPU as they are.

Importing this module touches no device; constructing an :class:`AcceleratorPlatform` needs the
device's accelerator to be torch's current accelerator.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .base import aligned_empty

__all__ = ["AcceleratorPlatform", "describe_device"]

# Note [Stream lookups by index]
#     ``torch.accelerator.current_stream(device)`` spends most of its time turning the device
#     into an index (``_get_device_index``, about a microsecond), and ``set_stream`` is a Python
#     wrapper around one C call.  The hot path (a block's wait, a fill, a block's free record)
#     asks for the current stream of a known index through the C call those wrappers make, and
#     a fill makes its copy stream current with a bare set/restore pair instead of the
#     ``stream()`` context manager (a generator: several times the cost of the pair).  The effect
#     is the wrappers' own: the same C calls, the same streams, the same device made current.
_get_stream: Callable[[int], torch.Stream] = getattr(
    torch._C, "_accelerator_getStream", torch.accelerator.current_stream)
_set_stream: Callable[[torch.Stream], None] = getattr(
    torch._C, "_accelerator_setStream", torch.accelerator.set_stream)
_get_device: Callable[[], int] = getattr(
    torch._C, "_accelerator_getDeviceIndex", torch.accelerator.current_device_index)
_set_device: Callable[[int], None] = getattr(
    torch._C, "_accelerator_setDeviceIndex", torch.accelerator.set_device_index)

# Note [The current device after a stream switch]
#     ``set_stream`` also makes the stream's device the current one (as ``torch.cuda.set_stream``
#     does), so restoring the previous stream of *this* device leaves this device current.  On a
#     platform for ``cuda:1`` under a caller whose current device is ``cuda:0`` that moved the
#     caller: its next ``torch.empty(..., device="cuda")``, and the next ``Stream()`` anyone
#     made, landed on ``cuda:1``.  ``stream()`` and ``fill()`` put the caller's current device
#     back as well (``torch.cuda.StreamContext`` does the same); the kit fails a case that
#     leaves another device or stream current (Note [Current device and streams between cases]
#     in contracts/streams.py), which is how this was found.


def describe_device(device: torch.device | str) -> str:
    """A device as offload-ref prints it: the simulated accelerator is named for what it is."""
    from offload_ref.platform import simulated

    return simulated.describe_device(device)


class AcceleratorPlatform:
    """Streams, events and device storage of one accelerator device, through ``torch.Stream``,
    ``torch.Event`` and ``torch.accelerator``.

    ``record_use`` and ``discard`` are no-ops: an accelerator neither checks stream order nor
    poisons dead storage (the CPU platform does both)."""

    name = "accelerator"
    pin_memory_supported = True
    alignment = 256  # cuBLAS(Lt)'s preferred operand alignment (Note [Aligned layout], host.py)
    tracks_accesses = False  # record_use / discard are no-ops

    def __init__(self, device: str | torch.device) -> None:
        device = torch.device(device)
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != device.type:
            raise RuntimeError(
                f"cannot create an accelerator platform for {str(device)!r}: torch's current "
                f"accelerator is {accelerator.type if accelerator else 'none'!r}")
        count = torch.accelerator.device_count()
        if device.index is None:
            device = torch.device(device.type, torch.accelerator.current_device_index())
        if device.index >= count:
            raise ValueError(
                f"{describe_device(device)} does not exist: this process sees {count} "
                f"{device.type} device(s) ({device.type}:0 .. {device.type}:{count - 1})")
        self.device = device
        self._index: int = device.index  # Note [Stream lookups by index]
        self.name = device.type
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # device allocations from empty(): storage ptr -> bytes
        self._host: dict[int, int] = {}  # host_empty storage ptr -> requested bytes
        self._pinned: dict[int, int] = {}  # pinned host_empty storage ptr -> requested bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"

    def __enter__(self) -> AcceleratorPlatform:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release beyond what the tensors hold; the platform stays usable."""

    # -- streams and events -------------------------------------------------------------------
    def Stream(self, priority: int = 0) -> torch.Stream:  # noqa: N802
        return torch.Stream(device=self.device, priority=priority)

    def Event(self, enable_timing: bool = False) -> torch.Event:  # noqa: N802
        return torch.Event(device=self.device, enable_timing=enable_timing)

    def current_stream(self) -> torch.Stream:
        return _get_stream(self._index)  # Note [Stream lookups by index]

    @contextlib.contextmanager
    def stream(self, stream: torch.Stream | None) -> Iterator[torch.Stream | None]:
        """Make ``stream`` current on this device inside the block (None: no change)."""
        if stream is None:
            yield None
            return
        device = _get_device()
        previous = _get_stream(self._index)
        _set_stream(stream)
        try:
            yield stream
        finally:
            _set_stream(previous)
            if device != self._index:  # Note [The current device after a stream switch]
                _set_device(device)

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device)

    # -- work ---------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Asynchronous with respect to the host when the host side is pinned."""
        dst.copy_(src, non_blocking=True)

    def fill(self, stream: torch.Stream, after: torch.Event,
             pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], then: torch.Event) -> None:
        """Note [One-call fills] (platform/base.py): exactly ``with self.stream(stream)``
        around the work, without the context manager (Note [Stream lookups by index])."""
        device = _get_device()
        previous = _get_stream(self._index)
        _set_stream(stream)
        try:
            stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            then.record(stream)
        finally:
            _set_stream(previous)
            if device != self._index:  # Note [The current device after a stream switch]
                _set_device(device)

    def submit(self, fn: Callable[[], Any], *, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> None:
        """Call ``fn`` now: the work it launches goes to the stream the caller made current."""
        fn()

    def record_use(self, tensor: torch.Tensor) -> None:
        """No-op: an accelerator does not check stream order (see the CPU platform)."""

    # -- device storage -----------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device tensor whose first element is ``alignment``-aligned."""
        tensor = aligned_empty(numel, dtype, self.alignment, self.device)
        if not tensor.numel():
            return tensor
        # One line: counted and handed to the caller with no line between (as CpuPlatform.empty).
        with self._lock: return self._counted(tensor)  # noqa: E701

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self._live[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes(); return tensor  # noqa: E702,E501

    def free(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor``; its memory returns to the allocator when the caller drops its
        references.  The caller must have ordered every stream that used it before."""
        if not self.is_resident(tensor):
            raise ValueError(
                f"free: the tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} on "
                f"{describe_device(tensor.device)} is not device storage of {self!r}")
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            found = self._live.pop(ptr, None)
        if found is None and tensor.untyped_storage().nbytes():
            raise ValueError(
                f"free: the tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                f"(storage at 0x{ptr:x}) was not returned by empty() or was already freed")

    def discard(self, tensor: torch.Tensor) -> None:
        """No-op on an accelerator (the CPU platform poisons dead storage)."""

    def memory_allocated(self) -> int:
        return torch.accelerator.memory_allocated(self.device)

    def is_resident(self, tensor: torch.Tensor) -> bool:
        device = tensor.device
        return device.type == self.device.type and device.index == self.device.index

    # -- host storage -------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """``numel`` elements of host memory, ``alignment``-aligned, from torch's pinned host
        allocator when ``pin``."""
        if not pin or numel == 0:
            tensor = aligned_empty(numel, dtype, self.alignment)
        else:
            tensor = _aligned_pinned(numel, dtype, self.alignment)
        if numel:
            nbytes = numel * tensor.element_size()
            key = tensor.untyped_storage().data_ptr()
            with self._lock:
                self._host[key] = nbytes
                if pin:
                    self._pinned[key] = nbytes
        return tensor

    def host_free(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor from :meth:`host_empty`; its memory returns when dropped."""
        if not tensor.numel():
            return
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._host.pop(key, None)
            self._pinned.pop(key, None)

    def host_lock_bytes(self, nbytes: int) -> int:
        """Host bytes locked for a pinned request of ``nbytes`` (Note [Host budget] in
        host.py).  On CUDA torch's caching host allocator serves each request from a block of
        the next power of two (five 1.20 GiB requests locked 10.01 GiB: sglang #39021); other
        accelerators' host allocators are taken to lock what was requested."""
        if self.device.type != "cuda" or nbytes <= 0:
            return nbytes
        return 1 << (nbytes - 1).bit_length()

    def host_allocated(self) -> int:
        """Host bytes from :meth:`host_empty` not yet released (requested sizes)."""
        with self._lock:
            return sum(self._host.values())

    def pinned_bytes(self) -> int:
        """Host bytes from :meth:`host_empty` with ``pin`` not yet released (requested sizes)."""
        with self._lock:
            return sum(self._pinned.values())


def _aligned_pinned(numel: int, dtype: torch.dtype, alignment: int) -> torch.Tensor:
    """``torch.empty(numel, pin_memory=True)`` whose first element is ``alignment``-aligned."""
    tensor = torch.empty(numel, dtype=dtype, pin_memory=True)
    if tensor.data_ptr() % alignment == 0:
        return tensor
    itemsize = tensor.element_size()
    backing = torch.empty(numel + alignment // itemsize, dtype=dtype, pin_memory=True)
    start = (-backing.data_ptr()) % alignment // itemsize
    return backing.narrow(0, start, numel)
