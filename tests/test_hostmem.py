"""The CPU platform's large-buffer allocator (Note [Huge-page host memory] in
offload_ref/platform/_hostmem.py): aligned, writable, exact-size buffers that are unmapped when
their last tensor goes, on the huge-page path and on its torch.empty fallback."""

from __future__ import annotations

import gc
import mmap
import warnings

import pytest
import torch

from offload_ref.host import HostMaster, Layout
from offload_ref.loading import anonymous_rss_bytes
from offload_ref.platform import CpuPlatform, _hostmem

_LARGE = 3 * _hostmem.HUGE_PAGE_BYTES + 12_345  # not a multiple of the huge page size
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.bool, torch.int64,
           torch.complex64)

needs_thp = pytest.mark.skipif(not _hostmem.huge_pages_available(),
                               reason="transparent huge pages unavailable here (not Linux, or "
                                      "the kernel setting is never)")


def _mapping_of(ptr: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping holding address ``ptr`` (None: unmapped)."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                if entry is not None:
                    return entry
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {} if start <= ptr < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


def _check_buffer(t: torch.Tensor, numel: int, dtype: torch.dtype, alignment: int) -> None:
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.device.type == "cpu" and not t.is_pinned() and not t.requires_grad
    assert t.untyped_storage().nbytes() == numel * dtype.itemsize, "exact size"
    assert t.data_ptr() % alignment == 0
    t.fill_(True if dtype == torch.bool else 3)  # writable, every element
    assert bool((t == (True if dtype == torch.bool else 3)).all())


@needs_thp
@pytest.mark.parametrize("dtype", _DTYPES)
def test_large_buffers_are_aligned_exact_and_writable(dtype: torch.dtype) -> None:
    numel = _LARGE // dtype.itemsize
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer warns on read-only buffers: none here
        t = _hostmem.empty(numel, dtype, 64)
    _check_buffer(t, numel, dtype, 64)
    assert t.data_ptr() % _hostmem.HUGE_PAGE_BYTES == 0, "starts on a huge page boundary"
    assert t.storage_offset() == 0


@needs_thp
def test_large_buffers_are_advised_huge_pages_and_unmapped_when_freed() -> None:
    t = _hostmem.empty(_LARGE, torch.uint8, 64)
    ptr = t.data_ptr()
    entry = _mapping_of(ptr)
    assert entry is not None
    assert "hg" in entry["VmFlags"].split(), f"not advised MADV_HUGEPAGE: {entry['VmFlags']}"
    # The tail shorter than a huge page is not advised (it stays in small pages).
    tail = _mapping_of(ptr + _LARGE - 1)
    assert tail is not None and "hg" not in tail["VmFlags"].split()
    views = [t[10:], t.view(torch.int8)]  # views keep the mapping alive
    del t
    gc.collect()
    assert _mapping_of(ptr) is not None
    views[0][0] = 1
    del views
    gc.collect()
    assert _mapping_of(ptr) is None, "the mapping outlived its last tensor"


@needs_thp
def test_freed_buffers_give_their_memory_back() -> None:
    if anonymous_rss_bytes() is None:
        pytest.skip("RssAnon not reported by this kernel")
    nbytes = 64 << 20
    before = anonymous_rss_bytes()
    t = _hostmem.empty(nbytes, torch.uint8, 64)
    t.fill_(1)
    held = anonymous_rss_bytes()
    assert held - before >= nbytes // 2
    del t
    gc.collect()
    assert anonymous_rss_bytes() - before < nbytes // 4


def test_small_buffers_use_torch_empty() -> None:
    t = _hostmem.empty(1000, torch.float32, 64)
    _check_buffer(t, 1000, torch.float32, 64)
    assert _hostmem.empty(0, torch.float32, 64).numel() == 0


@pytest.mark.parametrize("how", ["unavailable", "mmap fails", "madvise fails"])
def test_fallback_without_huge_pages(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Without huge pages (or when mapping or advising fails) a large buffer is torch's own
    allocation, with the same guarantees."""
    mapped: list[int] = []
    real_mmap = mmap.mmap

    def counting_mmap(*args, **kwargs):
        mapped.append(1)
        if how == "mmap fails":
            raise OSError(12, "Cannot allocate memory")
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(_hostmem, "huge_pages_available", lambda: how != "unavailable")
    monkeypatch.setattr(_hostmem.mmap, "mmap", counting_mmap)
    if how == "madvise fails":  # as on a kernel built without THP: madvise gives EINVAL
        monkeypatch.setattr(_hostmem.mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    for dtype in (torch.float32, torch.uint8):
        numel = _LARGE // dtype.itemsize
        t = _hostmem.empty(numel, dtype, 64)
        _check_buffer(t, numel, dtype, 64)
        assert t.untyped_storage().resizable(), "the fallback is torch's own allocation"
    assert bool(mapped) == (how != "unavailable")


def test_cpu_platform_host_empty_of_a_large_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pinning(self, *args, **kwargs):
        raise AssertionError("pin_memory() called on the CPU platform")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    with CpuPlatform() as platform:
        tensors = [platform.host_empty(_LARGE // 4, torch.float32, pin=pin)
                   for pin in (False, True)]
        for t in tensors:
            _check_buffer(t, _LARGE // 4, torch.float32, platform.alignment)
            assert not platform.is_resident(t)
        assert platform.host_allocated() == 2 * (_LARGE // 4) * 4
        assert platform.pinned_bytes() == 0 and platform.memory_allocated() == 0
        for t in tensors:
            platform.host_free(t)
        assert platform.host_allocated() == 0


def test_host_master_of_large_tensors_keeps_phases_and_values() -> None:
    """A host master flat from the huge-page path holds the right values at the right phases
    (Note [Aligned layout]): views of a shared storage, a transposed view, a misaligned one."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1024, generator=g)  # 4 MiB: its master flat is a huge-page buffer
    backing = torch.randn(300_001, generator=g, dtype=torch.float64)
    odd = backing[3:].view(-1)  # 24 bytes past its storage's start
    named = [("w", big), ("wt", big.t()), ("row", big[7]), ("odd", odd)]
    with CpuPlatform() as platform:
        layout = Layout(named, alignment=platform.alignment)
        master = HostMaster(layout, platform, pin=True)
        try:
            for flat in master.flats.values():
                assert flat.data_ptr() % platform.alignment == 0
            for (name, src), view in zip(named, master.host_views()):
                assert torch.equal(view, src), name
                assert view.stride() == src.stride(), name
                assert view.data_ptr() % 64 == src.data_ptr() % 64, name
            views = master.host_views()
            assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
        finally:
            master.release()
        assert platform.host_allocated() == 0
