"""The CUDA platform: the accelerator platform (torch.Stream, torch.Event, torch.accelerator) plus
exact-size pinned host memory.

Importing this module makes no CUDA call, so it imports on a CPU-only torch; constructing a
:class:`CudaPlatform` needs CUDA.

Pinned memory is page-locked with ``cudaHostRegister`` over an ordinary (pageable) allocation of
exactly the requested size.  ``tensor.pin_memory()`` and ``torch.empty(pin_memory=True)`` go
through the caching host allocator, which rounds every block up to a power of two: up to twice the
page-locked memory, invisible in our accounting.
"""

from __future__ import annotations

import mmap

from typing import Any

import torch

from .accelerator import AcceleratorPlatform
from .base import aligned_empty

__all__ = ["CudaPlatform"]

_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault


def _cuda_error_text(cudart: Any, code: Any) -> str:
    """``cudaGetErrorString`` of a return code, without failing on an unknown code."""
    try:
        return f"{cudart.cudaGetErrorString(code)} (cudaError {int(code)})"
    except Exception:  # noqa: BLE001 (the numeric code is still worth reporting)
        return f"cudaError {int(code)}"


PAGE_BYTES = mmap.PAGESIZE


def page_aligned_buffer(numel: int, dtype: torch.dtype,
                        page: int = PAGE_BYTES) -> tuple[torch.Tensor, int, int]:
    """A host tensor of ``numel`` elements starting on a page boundary, inside a private
    allocation that also owns every page the tensor touches.  Returns ``(tensor, first page
    address, bytes of whole pages)``: the range to page-lock without touching a neighbour."""
    itemsize = dtype.itemsize
    nbytes = numel * itemsize
    span = -(-nbytes // page) * page
    backing = torch.empty(span + page, dtype=torch.uint8)
    start = (-backing.data_ptr()) % page
    tensor = backing[start:start + nbytes].view(dtype)
    return tensor, backing.data_ptr() + start, span


class CudaPlatform(AcceleratorPlatform):
    """The accelerator platform on one CUDA device, plus what only CUDA has: exact-size pinned
    host memory (``cudaHostRegister`` over whole pages of a private allocation).

    Streams, events, copies and device storage are the accelerator platform's (``torch.Stream``,
    ``torch.Event``, ``torch.accelerator``): the code that runs on the simulated accelerator in
    CI."""

    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaPlatform needs a CUDA device, got {str(device)!r}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"cannot create a CUDA platform for {str(device)!r}: CUDA is not available "
                f"(torch.cuda.is_available() is False)"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(
                f"CUDA device {str(device)!r} does not exist: this process sees {count} CUDA "
                f"device(s) (cuda:0 .. cuda:{count - 1})"
            )
        super().__init__(device)
        self.name = "cuda"
        # storage ptr -> (registered page address, requested bytes, the buffer): the entry keeps
        # page-locked memory alive until host_free unregisters it (freeing registered memory
        # would leave the pages locked).
        self._cuda_pinned: dict[int, tuple[int, int, torch.Tensor]] = {}
        self._pinned_total = 0

    def close(self) -> None:
        """Unregister the pinned memory still registered (after the device is idle, since
        in-flight copies may read it).  The platform stays usable.  Idempotent."""
        with self._lock:
            entries = list(self._cuda_pinned.items())
            self._cuda_pinned.clear()
            self._pinned_total = 0
        if not entries:
            return
        torch.cuda.synchronize(self.device)
        cudart = torch.cuda.cudart()
        for _, (reg_ptr, _bytes, _tensor) in entries:
            cudart.cudaHostUnregister(reg_ptr)  # best effort: the tensors are being dropped anyway

    # -- host storage -------------------------------------------------------------------------
    def host_empty(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """``numel`` elements of host memory, page-locked in place when ``pin``.

        Pinned buffers are registered with ``cudaHostRegister`` over whole pages that belong to
        this buffer alone: registering ranges that share a page with another registration fails
        (cudaErrorHostMemoryAlreadyRegistered).  So the locked size is the request rounded up
        to the page size -- never the caching host allocator's power-of-two blocks.
        :meth:`pinned_bytes` counts the requested bytes (what the host masters hold)."""
        if not pin or numel == 0:
            tensor = aligned_empty(numel, dtype, self.alignment)
            self._count_host(tensor, +1)
            return tensor
        tensor, reg_ptr, reg_bytes = page_aligned_buffer(numel, dtype)
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(reg_ptr, reg_bytes, _HOST_REGISTER_DEFAULT)
        if int(code) != 0:
            raise RuntimeError(
                f"host_empty: cudaHostRegister of {reg_bytes} bytes at 0x{reg_ptr:x} failed: "
                f"{_cuda_error_text(cudart, code)}; lower the pinned-memory demand (or pass "
                f"pin=False) and check the locked-memory limit (ulimit -l)"
            )
        nbytes = numel * tensor.element_size()
        with self._lock:
            # The entry keeps the buffer alive while registered: freed-but-registered memory
            # would make a later registration at the same address fail.
            self._cuda_pinned[tensor.untyped_storage().data_ptr()] = (reg_ptr, nbytes, tensor)
            self._pinned_total += nbytes
        self._count_host(tensor, +1)
        return tensor

    def host_free(self, tensor: torch.Tensor) -> None:
        """Release a tensor from :meth:`host_empty`, unregistering it if it was pinned.

        Synchronizes the device first: a copy still in flight may read the pages.  Called at
        teardown only, never in steady state."""
        self._count_host(tensor, -1)
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            entry = self._cuda_pinned.pop(key, None)
            if entry is not None:
                self._pinned_total -= entry[1]
        if entry is None:
            return
        torch.cuda.synchronize(self.device)
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostUnregister(entry[0])
        if int(code) != 0:
            raise RuntimeError(
                f"host_free: cudaHostUnregister at 0x{entry[0]:x} failed: "
                f"{_cuda_error_text(cudart, code)}"
            )

    def _count_host(self, tensor: torch.Tensor, sign: int) -> None:
        if not tensor.numel():
            return
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            if sign > 0:
                self._host[key] = tensor.numel() * tensor.element_size()
            else:
                self._host.pop(key, None)

    def host_allocated(self) -> int:
        """Host bytes from :meth:`host_empty` not yet released (requested sizes)."""
        with self._lock:
            return sum(self._host.values())

    def host_lock_bytes(self, nbytes: int) -> int:
        """Host bytes page-locked for a pinned request of ``nbytes`` (Note [Host budget] in
        host.py): whole pages, as :meth:`host_empty` registers them."""
        return -(-nbytes // PAGE_BYTES) * PAGE_BYTES

    def pinned_bytes(self) -> int:
        with self._lock:
            return self._pinned_total
