"""CudaPlatform: the CPU platform's stream and storage semantics on a real GPU, plus exact-size
pinned host memory.  Every test needs an NVIDIA GPU and is skipped (with the reason) without one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_ref.platform import CudaPlatform, Event, Platform, Stream, get_platform

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)",
    ),
]


@pytest.fixture
def platform() -> Iterator[CudaPlatform]:
    p = CudaPlatform()
    try:
        yield p
    finally:
        p.synchronize()
        p.close()


def test_cuda_platform_satisfies_the_platform_protocol(platform: CudaPlatform) -> None:
    assert isinstance(platform, Platform)
    assert isinstance(platform.Stream(), Stream)
    assert isinstance(platform.current_stream(), Stream)
    assert isinstance(platform.Event(), Event)
    assert platform.name == "cuda" and platform.pin_memory_supported
    assert platform.device.type == "cuda" and platform.device.index is not None


def test_events_order_a_copy_stream_before_compute(platform: CudaPlatform) -> None:
    numel = 1 << 22  # large enough that an unordered read would see a partial copy
    host = platform.host_empty(numel, torch.float32, pin=True)
    host.copy_(torch.arange(numel, dtype=torch.float32))
    slot = platform.empty(numel, torch.float32)
    slot.zero_()
    copy = platform.Stream()
    ready = platform.Event()
    copy.wait_stream(platform.current_stream())  # the zero_ above is on compute
    with platform.stream(copy):
        platform.copy_(slot, host)
        ready.record()
    platform.current_stream().wait_event(ready)
    total = slot.double().sum()
    expected = float(numel) * (numel - 1) / 2
    assert total.item() == expected, f"compute read the slot before its copy: {total} != {expected}"
    platform.synchronize()
    platform.free(slot)
    platform.host_free(host)


def test_event_recorded_after_queued_work_completes_after_it(platform: CudaPlatform) -> None:
    copy = platform.Stream()
    start, end = platform.Event(enable_timing=True), platform.Event(enable_timing=True)
    with platform.stream(copy):
        start.record()
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time
        end.record()
    assert not end.query(), "an event completed before the work queued before it"
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0.0


def _page_locked(tensor: torch.Tensor) -> bool:
    """What the CUDA driver says of the tensor's memory: page-locked host memory it knows.
    (``Tensor.is_pinned()`` asks torch's own pinned allocator first: torch 2.11 answers False
    for memory registered with cudaHostRegister, seen on an H200.)"""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    memory_type = ctypes.c_uint(0)
    code = driver.cuPointerGetAttribute(ctypes.byref(memory_type), 2,  # ..._MEMORY_TYPE
                                        ctypes.c_void_p(tensor.data_ptr()))
    return code == 0 and memory_type.value == 1  # CU_MEMORYTYPE_HOST


def test_pinned_host_memory_is_exactly_the_requested_size(platform: CudaPlatform) -> None:
    assert platform.pinned_bytes() == 0
    odd = platform.host_empty(1_000_003, torch.float16, pin=True)  # not a power of two
    assert _page_locked(odd)
    assert platform.pinned_bytes() == 1_000_003 * 2
    other = platform.host_empty(4097, torch.float32, pin=True)
    assert platform.pinned_bytes() == 1_000_003 * 2 + 4097 * 4
    pageable = platform.host_empty(64, torch.float32, pin=False)
    assert not _page_locked(pageable)
    zero = platform.host_empty(0, torch.float32, pin=True)  # nothing to register
    assert platform.pinned_bytes() == 1_000_003 * 2 + 4097 * 4
    for tensor in (odd, other, pageable, zero):
        platform.host_free(tensor)
    assert platform.pinned_bytes() == 0
    assert not _page_locked(odd)


def test_memory_allocated_grows_and_shrinks(platform: CudaPlatform) -> None:
    platform.synchronize()
    before = platform.memory_allocated()
    slot = platform.empty(1 << 20, torch.float32)
    assert platform.memory_allocated() >= before + (1 << 20) * 4
    assert platform.is_resident(slot) and platform.is_resident(slot[5:9])
    assert not platform.is_resident(torch.empty(4))
    platform.free(slot)
    del slot
    assert platform.memory_allocated() == before


def test_free_of_a_foreign_tensor_raises(platform: CudaPlatform) -> None:
    with pytest.raises(ValueError, match="not device storage"):
        platform.free(torch.empty(4))
    with pytest.raises(ValueError, match="not returned by empty"):
        platform.free(torch.empty(4, device=platform.device))


def test_submit_and_record_use_run_on_the_current_stream(platform: CudaPlatform) -> None:
    copy = platform.Stream()
    seen: list[torch.cuda.Stream] = []
    with platform.stream(copy):
        platform.submit(lambda: seen.append(torch.cuda.current_stream()))
        platform.record_use(torch.empty(1, device=platform.device))
    # torch.cuda.Stream and the generic torch.Stream never compare equal: compare the stream
    assert [(s.device_index, s.stream_id) for s in seen] == [(copy.device_index, copy.stream_id)]


def test_get_platform_caches_the_cuda_platform() -> None:
    platform = get_platform("cuda")
    assert isinstance(platform, CudaPlatform)
    assert get_platform(platform.device) is platform
    assert get_platform() is platform
    with pytest.raises(ValueError, match="race_amplifier"):
        get_platform("cuda", race_amplifier=True)


def test_buffers_start_256_byte_aligned(platform: CudaPlatform) -> None:
    assert platform.alignment == 256
    for numel in (1, 3, 1000):
        assert platform.empty(numel, torch.float16).data_ptr() % 256 == 0
        for pin in (True, False):
            host = platform.host_empty(numel, torch.float32, pin=pin)
            assert host.data_ptr() % 256 == 0
            platform.host_free(host)


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_device_copies_keep_their_alignment_phase(platform: CudaPlatform, strategy: str) -> None:
    """Every device tensor keeps its address modulo 64, and one that started its host storage
    lands on a 256-byte boundary (Note [Aligned layout]); flux2's GEMV weight, stored 4 bytes
    past a boundary, stays 4 bytes past one."""
    from offload_ref import OffloadConfig, get_offload_backend
    from offload_ref.fixtures import get_spec

    pipeline = get_spec("flux2").build()
    before = {n: (t.data_ptr() % 64, t.storage_offset())
              for n, t in pipeline.state_dict(keep_vars=True).items() if t.numel()}
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    try:
        with torch.inference_mode():
            pipeline(**get_spec("flux2").make_inputs())  # binds block 0 and the other slots
        on_device = 0
        for name, t in pipeline.state_dict(keep_vars=True).items():
            if not (t.is_cuda and t.numel()) or 0 in t.stride():  # placeholders: stride 0
                continue
            phase, offset = before[name]
            assert t.data_ptr() % 64 == phase, name
            if offset == 0:
                assert t.data_ptr() % 256 == 0, name
            on_device += 1
        assert on_device
    finally:
        backend.disable()
