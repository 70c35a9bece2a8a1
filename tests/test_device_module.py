"""``torch.hpu``, the simulated accelerator's device module, offers the stream, event and memory
API device-generic code reaches through ``torch.get_device_module`` (issue 34, item 1), with
``torch.cuda``'s semantics; diffusers' ``apply_group_offloading(..., use_stream=True)`` runs on it
unchanged (before: ``ValueError: Using streams for data transfer requires an onload device whose
backend implements streams``) and gives the un-offloaded model's outputs bit for bit, with the
stream sanitizer on and finding nothing."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from offload_ref.platform import simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

D0, D1 = torch.device("hpu", 0), torch.device("hpu", 1)


@pytest.fixture
def hpu():
    """``torch.hpu``; the current device and each device's current stream are restored after."""
    module = torch.get_device_module("hpu")
    device = torch.accelerator.current_device_index()
    streams = [torch.accelerator.current_stream(i) for i in range(module.device_count())]
    yield module
    for stream in streams:
        torch.accelerator.set_stream(stream)
    torch.accelerator.set_device_index(device)


def test_the_device_module_is_torch_hpu_and_offers_what_diffusers_stream_paths_call(hpu) -> None:
    assert hpu is torch.hpu
    # what diffusers' group offloading (hooks/group_offloading.py, TorchDeviceBackend) and
    # torch.cuda-style device-generic code call on the device module
    for name in ("Stream", "Event", "StreamContext", "stream", "current_stream",
                 "default_stream", "set_stream", "synchronize", "device_count", "current_device",
                 "set_device", "is_available", "get_device_name", "get_device_properties",
                 "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
                 "memory_stats", "empty_cache", "mem_get_info", "manual_seed"):
        assert callable(getattr(hpu, name)), name
    assert hpu.is_available() and hpu.device_count() >= 2
    assert hpu.get_device_name(1) == "offload-ref simulated accelerator"


def test_streams_are_torch_streams_of_the_device_asked_for(hpu) -> None:
    s, t = hpu.Stream(), hpu.Stream(device="hpu:1", priority=-1)
    assert isinstance(s, torch.Stream) and isinstance(s, hpu.Stream)
    assert s.device == D0 and t.device == D1
    assert s.stream_id not in (0, hpu.Stream().stream_id)  # a new stream each time
    assert hpu.default_stream(1) == torch.Stream(stream_id=0, device_index=1,
                                                 device_type=s.device_type)
    # a plain torch.Stream of the device is one too (as torch.accelerator's are)
    assert isinstance(torch.accelerator.current_stream(), hpu.Stream)
    assert not isinstance(torch.Event("hpu"), hpu.Stream)
    with pytest.raises(ValueError, match="not of offload-ref's simulated accelerator"):
        hpu.Stream(stream_id=0, device_index=0, device_type=0)  # the CPU's
    hpu.set_device(1)
    assert hpu.Stream().device == D1 and hpu.current_device() == 1


@pytest.mark.parametrize("bad", ["cpu", "cuda:0", 7])
def test_a_device_that_is_not_one_of_the_simulated_devices_is_refused_by_name(hpu, bad) -> None:
    for call in (lambda: hpu.Stream(bad), lambda: hpu.memory_allocated(bad),
                 lambda: hpu.current_stream(bad), lambda: hpu.synchronize(bad)):
        with pytest.raises(ValueError, match=r"simulated accelerator"):
            call()


def test_a_stream_made_current_is_current_inside_the_context_and_restored_after(hpu) -> None:
    default = hpu.current_stream()
    assert default == hpu.default_stream() and default.stream_id == 0
    s, inner = hpu.Stream(), hpu.Stream()
    with hpu.stream(s) as entered:
        assert entered is s and hpu.current_stream() == s
        assert torch.accelerator.current_stream() == s
        with hpu.stream(inner):
            assert hpu.current_stream() == inner
        assert hpu.current_stream() == s
        with hpu.stream(None):  # None changes nothing
            assert hpu.current_stream() == s
    assert hpu.current_stream() == default
    with pytest.raises(KeyError), hpu.stream(s):
        raise KeyError("restored on an exception too")
    assert hpu.current_stream() == default
    hpu.set_stream(s)
    assert hpu.current_stream(D0) == s
    hpu.set_stream(None)
    assert hpu.current_stream(0) == s
    hpu.set_stream(default)
    assert hpu.current_stream() == default
    with pytest.raises(TypeError, match="torch.Stream"):
        hpu.set_stream(3)


def test_a_stream_of_another_device_switches_the_device_inside_the_context(hpu) -> None:
    hpu.set_device(0)
    previous_on_1 = hpu.Stream(1)
    hpu.set_stream(previous_on_1)
    hpu.set_device(0)
    s = hpu.Stream(1)
    with hpu.stream(s):
        assert hpu.current_device() == 1 and hpu.current_stream() == s
        assert hpu.current_stream(0) == hpu.default_stream(0)
    assert hpu.current_device() == 0
    assert hpu.current_stream(1) == previous_on_1


def test_the_current_stream_is_per_thread(hpu) -> None:
    seen: list[torch.Stream] = []
    s = hpu.Stream()
    with hpu.stream(s):
        worker = threading.Thread(target=lambda: seen.append(hpu.current_stream(0)))
        worker.start()
        worker.join()
    assert seen == [hpu.default_stream(0)]


def test_events_order_streams_and_time(hpu) -> None:
    copy_stream = hpu.Stream()
    start, end = hpu.Event(enable_timing=True), hpu.Event(enable_timing=True)
    assert isinstance(start, hpu.Event) and isinstance(start, torch.Event)
    start.record(copy_stream)
    time.sleep(0.02)
    end.record(copy_stream)
    end.synchronize()
    assert start.query() and end.query()
    assert 15.0 <= start.elapsed_time(end) < 10_000.0  # milliseconds of host time
    ready = copy_stream.record_event()
    assert isinstance(ready, hpu.Event) and ready.device == D0
    hpu.current_stream().wait_event(ready)
    ready.wait()  # on the current stream
    hpu.current_stream().wait_stream(copy_stream)
    copy_stream.synchronize()
    hpu.synchronize()
    hpu.synchronize(1)
    on_1 = hpu.Event(device="hpu:1")
    on_1.record(hpu.Stream(1))
    assert on_1.device == D1


def test_memory_statistics_move_with_allocations(hpu) -> None:
    hpu.synchronize(1)
    before = hpu.memory_allocated(1)
    hpu.reset_peak_memory_stats(D1)
    assert hpu.max_memory_allocated(1) == before
    x = torch.empty(1 << 16, dtype=torch.uint8, device=D1)
    assert hpu.memory_allocated("hpu:1") == before + (1 << 16)
    assert hpu.memory_stats(1)["allocated_bytes.all.current"] == before + (1 << 16)
    assert hpu.memory_reserved(1) >= hpu.memory_allocated(1)
    assert hpu.max_memory_reserved(1) >= hpu.memory_reserved(1)
    del x
    assert hpu.memory_allocated(1) == before
    assert hpu.max_memory_allocated(1) == before + (1 << 16)
    hpu.reset_max_memory_allocated(1)
    assert hpu.max_memory_allocated(1) == before
    reserved = hpu.memory_reserved(1)
    hpu.empty_cache()
    assert hpu.memory_allocated(1) <= hpu.memory_reserved(1) <= reserved
    # the current device when none is named
    hpu.set_device(1)
    assert hpu.memory_allocated() == hpu.memory_allocated(1)


def test_memory_info_and_properties_follow_the_capacity(hpu) -> None:
    old = simulated.capacity(1)
    simulated.set_capacity(1 << 30, index=1)
    try:
        free, total = hpu.mem_get_info(1)
        assert total == 1 << 30 and free <= total - hpu.memory_allocated(1)
        assert hpu.get_device_properties(D1).total_memory == 1 << 30
    finally:
        simulated.set_capacity(old, index=1)


def test_diffusers_device_backend_reads_the_statistics_of_the_device_it_names(hpu) -> None:
    from diffusers.utils.torch_utils import TorchDeviceBackend

    backend = TorchDeviceBackend("hpu:1")
    assert backend.module is hpu and backend.device_count() == hpu.device_count()
    backend.synchronize()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    base = hpu.memory_allocated(1)
    x = torch.empty(1 << 12, dtype=torch.uint8, device=D1)
    y = torch.empty(1 << 12, dtype=torch.uint8, device=D0)
    assert backend.max_memory_allocated() == base + (1 << 12)  # hpu:1's, not hpu:0's
    free, total = backend.mem_get_info()
    assert (free, total) == hpu.mem_get_info(1) and free <= total
    del x, y


# -- diffusers' group offloading with streams, on hpu:0, unchanged ---------------------------------


@pytest.fixture(scope="module")
def sd3():
    """A tiny diffusers SD3 transformer (3 blocks) on the host, its inputs, and its output computed
    on hpu:0 without any offloading."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(0)
        model = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
            pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
        model.eval().requires_grad_(False)
        for p in model.parameters():  # zero-initialized projections would hide a lost weight
            p.add_(0.02 * torch.randn(p.shape))
        inputs = {"hidden_states": torch.randn(1, 4, 8, 8),
                  "encoder_hidden_states": torch.randn(1, 6, 16),
                  "pooled_projections": torch.randn(1, 16), "timestep": torch.tensor([500.0])}
    expected = _run(copy.deepcopy(model).to(D0), inputs)
    return model, inputs, expected


@torch.no_grad()
def _run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    out = model(**{k: v.to(D0) for k, v in inputs.items()}, return_dict=False)[0]
    return out.cpu()


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True], ids=["pinned", "low_cpu_mem"])
@pytest.mark.parametrize("record_stream", [False, True], ids=["no_record", "record_stream"])
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_diffusers_group_offloading_with_streams_runs_and_is_bit_exact(
        hpu, sd3, monkeypatch, offload_type, record_stream, low_cpu_mem_usage) -> None:
    from diffusers.hooks import apply_group_offloading

    model, inputs, expected = sd3
    model = copy.deepcopy(model)
    entered: list[torch.Stream] = []
    real_stream = hpu.stream

    def spy(stream):  # diffusers enters its transfer stream through the device module
        entered.append(stream)
        return real_stream(stream)

    monkeypatch.setattr(hpu, "stream", spy)
    options = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    apply_group_offloading(model, onload_device=D0, offload_device=torch.device("cpu"),
                           offload_type=offload_type, use_stream=True,
                           record_stream=record_stream, low_cpu_mem_usage=low_cpu_mem_usage,
                           **options)
    simulated.clear_races()
    with simulated.stream_checking():
        outputs = [_run(model, inputs) for _ in range(2)]  # the 2nd prefetches in traced order
        found = simulated.races(clear=True)
    assert entered and all(isinstance(s, hpu.Stream) and s.stream_id != 0 for s in entered)
    assert not found, "\n".join(str(race) for race in found)
    for out in outputs:
        assert torch.equal(out, expected)
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


def test_the_sanitizer_sees_diffusers_stream_copies_a_skipped_wait_is_a_race(
        hpu, sd3, monkeypatch) -> None:
    """The control for the test above: the same run with diffusers' waits for its transfer
    stream skipped (``Stream.synchronize`` a no-op) is reported, so 'no race' there is a
    finding, not blindness."""
    from diffusers.hooks import apply_group_offloading

    model, inputs, expected = sd3
    model = copy.deepcopy(model)
    apply_group_offloading(model, onload_device=D0, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    _run(model, inputs)  # the first call traces the order and copies blocking
    monkeypatch.setattr(hpu.Stream, "synchronize", lambda self: None)
    simulated.clear_races()
    with simulated.stream_checking():
        _run(model, inputs)  # prefetches without waiting
        found = simulated.races(clear=True)
    assert found, "diffusers' un-waited prefetch copies went unreported"
    race = next(r for r in found if r.kind == "read-after-write")
    assert race.previous.write and "copy" in race.previous.op
    assert race.current.stream == 0 and race.previous.stream != 0


class _BuffersOnly(torch.nn.Module):
    """A module whose only state is its own buffers (a mel filterbank, say): no leaf layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("basis", torch.linspace(-1.0, 1.0, 48).reshape(6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.basis  # the read of the buffer


@pytest.mark.parametrize("record_stream", [False, True], ids=["no_record", "record_stream"])
def test_diffusers_leaf_level_streams_compute_on_a_buffers_only_module_before_its_copy(
        hpu, record_stream) -> None:
    """A finding of the sanitizer in the installed diffusers (0.42): at leaf level with streams, a
    module with its own buffers and no leaf layer is one group that onloads itself, copying
    ``non_blocking`` on the transfer stream, and nothing waits for that copy before its forward
    reads the buffer (``stream.synchronize()`` runs before the copies; no next group follows).
    On a GPU the read may see the memory before the copy lands.  The fixture ``soulx_singer``'s
    ``mel`` component is such a module; the outputs here are still exact, as streams compute
    synchronously."""
    from diffusers.hooks import apply_group_offloading

    model, x = _BuffersOnly(), torch.randn(2, 6)
    expected = (x.to(D0) @ model.basis.to(D0)).cpu()
    apply_group_offloading(model, onload_device=D0, offload_device=torch.device("cpu"),
                           offload_type="leaf_level", use_stream=True,
                           record_stream=record_stream)
    simulated.clear_races()
    with simulated.stream_checking(), torch.no_grad():
        outputs = [model(x.to(D0)).cpu() for _ in range(2)]
        found = simulated.races(clear=True)
    assert all(torch.equal(out, expected) for out in outputs)
    race = next((r for r in found if r.kind == "read-after-write"), None)
    assert race is not None, f"the un-waited copy of the buffer went unreported: {found}"
    assert race.current.stream == 0 and race.current.op == "aten::mm"
    assert any("test_device_module.py" in frame for frame in race.current.where)
    assert race.previous.write and race.previous.stream != 0
    assert "copy host to device" in race.previous.op
    assert any("group_offloading.py" in frame for frame in race.previous.where)
