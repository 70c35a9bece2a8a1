"""Fresh host memory for the CPU platform's large flat buffers (host masters, its "device"
storage).

Note [Huge-page host memory]
    Enable copies every weight once into freshly allocated flat buffers.  A fresh buffer from
    ``torch.empty`` is untouched memory: its first write takes one page fault per 4 KiB page
    (glibc maps allocations of 32 MiB and more straight from the kernel, and smaller ones are
    fresh too until the heap has grown to hold them), and the kernel zeroes each page at the
    fault.  On the AMD EPYC test machine a copy of 64 MiB into a fresh ``torch.empty`` took
    65 ms against 14 ms into memory that had been written before; the faults, not the copy,
    were most of enable's time.

    So a large buffer (:data:`THRESHOLD` bytes or more) is its own anonymous private mapping,
    advised ``MADV_HUGEPAGE``: with transparent huge pages in ``madvise`` or ``always`` mode its
    first write takes one fault per 2 MiB page, and the same copy took 18 ms.  Details:

    * The mapping is one huge page longer than the buffer, and the buffer starts at the first
      2 MiB boundary inside it, because a huge page needs a 2 MiB aligned virtual range (the
      kernel does not always align the mapping itself).  The slack is never touched, so it costs
      address space, not memory.  Only the whole huge pages inside the buffer are advised: its
      tail shorter than 2 MiB stays in small pages instead of rounding its resident size up by up
      to 2 MiB.
    * ``torch.frombuffer`` wraps the mapping without copying; the tensor's storage holds the
      ``mmap`` object (through its buffer export) and releasing the storage unmaps it, so the
      memory lives exactly as long as any tensor viewing it.  The storage is exactly the
      buffer's size and starts 2 MiB aligned, which keeps the platforms' alignment contract
      (Note [Aligned layout] in host.py) and makes ``untyped_storage().data_ptr()`` a distinct
      key per buffer (the CPU platform's ledger and host accounting key on it).
    * Nothing is page-locked: ``tensor.pin_memory()`` raises without an accelerator.  The CUDA
      platform does not use this module (its pinned memory comes from torch's host allocator).
    * Where transparent huge pages are unavailable (not Linux, no ``mmap.MADV_HUGEPAGE``, the
      kernel setting ``never``, or a mapping or advice that fails), and for small buffers, the
      buffer is ``aligned_empty`` (``torch.empty``) as before: a mapping of small pages would
      fault just as often and lose glibc's reuse of freed heap memory.

    The price: the kernel zeroes every huge page of a new mapping (about 7 ms per 64 MiB on
    the test machine), where glibc can hand a buffer under 32 MiB memory freed earlier that is
    already faulted in (an enable right after a disable).  The first enable of a process gets
    fresh memory from glibc too, and pays the small-page faults in full.

    Only :meth:`CpuPlatform.host_empty` uses this.  The platform's "device" storage
    (:meth:`CpuPlatform.empty`) stays on ``torch.empty``: on the enable path its only large
    buffers are layerwise's ring slots, which the copy worker writes first, and on the test
    machine (a VM whose memory the host maps in at first touch) huge pages faulted on the
    worker's CPU often came from never-touched memory: block 0's 8 MiB prefetch took 11-21 ms
    instead of the 2 ms of reused heap memory.
"""

from __future__ import annotations

import functools
import mmap
import sys

import torch

from offload_ref.platform.base import aligned_empty

__all__ = ["HUGE_PAGE_BYTES", "THRESHOLD", "empty", "huge_pages_available"]

#: The transparent huge page size of x86-64 and of arm64 with 4 KiB base pages.
HUGE_PAGE_BYTES = 2 << 20
#: Buffers of at least this many bytes are mapped with huge pages (Note [Huge-page host memory]).
THRESHOLD = HUGE_PAGE_BYTES

_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_available() -> bool:
    """Whether anonymous mappings can be advised into transparent huge pages here."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING, encoding="ascii") as f:
            setting = f.read()
    except OSError:
        return False
    return "[never]" not in setting


def empty(numel: int, dtype: torch.dtype, alignment: int) -> torch.Tensor:
    """A flat CPU tensor of exactly ``numel`` elements starting ``alignment``-aligned: a
    huge-page mapping when it is large and huge pages are available, else ``aligned_empty``
    (Note [Huge-page host memory])."""
    nbytes = numel * dtype.itemsize
    if nbytes >= THRESHOLD and alignment <= HUGE_PAGE_BYTES and huge_pages_available():
        tensor = _mapped_empty(numel, dtype, nbytes)
        if tensor is not None:
            return tensor
    return aligned_empty(numel, dtype, alignment)


def _mapped_empty(numel: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, OverflowError):
        return None  # out of address space or a refused mapping: torch.empty reports its own
    try:
        base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        offset = -base % HUGE_PAGE_BYTES
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
        # Shares the mapping; its storage keeps ``mapping`` alive and unmaps it when released.
        return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
    except (OSError, ValueError, RuntimeError):  # e.g. EINVAL: a kernel without THP support
        mapping.close()
        return None
