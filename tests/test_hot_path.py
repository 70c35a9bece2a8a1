"""The accelerator platform's hot path (Note [Stream lookups by index] in platform/accelerator.py):
the current stream looked up by index and a fill that makes its copy stream current without the
``stream()`` context manager, with exactly the effect of torch.accelerator's wrappers and of
``with platform.stream(...)``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.config import OffloadConfig, OffloadStrategy
from offload_ref.fixtures.many_blocks import build_pipeline, make_input
from offload_ref.platform import AcceleratorPlatform, simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

DEVICES = [torch.device("hpu", 0), torch.device("hpu", 1)]


@pytest.fixture
def restore_streams() -> Iterator[None]:
    """Every device's current stream and the current device, as they were."""
    index = torch.accelerator.current_device_index()
    streams = [torch.accelerator.current_stream(d) for d in DEVICES]
    yield
    for s in streams:
        torch.accelerator.set_stream(s)
    torch.accelerator.set_device_index(index)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_current_stream_is_torchs_current_stream_of_the_platforms_device(
        device: torch.device, restore_streams: None) -> None:
    platform = AcceleratorPlatform(device)
    other = DEVICES[1 - device.index]
    assert platform.current_stream() == torch.accelerator.current_stream(device)
    mine, theirs = torch.Stream(device=device), torch.Stream(device=other)
    torch.accelerator.set_stream(mine)
    torch.accelerator.set_stream(theirs)  # the other device current: still this device's stream
    assert platform.current_stream() == mine == torch.accelerator.current_stream(device)
    assert platform.current_stream() != theirs


def _watched(pairs: list[tuple[torch.Tensor, torch.Tensor]], seen: list[torch.Stream],
             device: torch.device, fail: bool = False) -> Iterator[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
    """``pairs``, noting the device's current stream as each copy is issued."""
    for pair in pairs:
        seen.append(torch.accelerator.current_stream(device))
        yield pair
    if fail:
        raise RuntimeError("a copy failed")


@pytest.mark.parametrize("current_index", [0, 1], ids=["device current", "other current"])
def test_fill_issues_its_copies_on_the_copy_stream_and_leaves_what_stream_would(
        current_index: int, restore_streams: None) -> None:
    device = DEVICES[0]
    platform = AcceleratorPlatform(device)
    copy, compute = platform.Stream(), platform.Stream()
    after, then = platform.Event(), platform.Event()
    src = torch.arange(8.0)
    dst = platform.empty(8, torch.float32)

    def state() -> tuple:
        return (torch.accelerator.current_device_index(),
                *(torch.accelerator.current_stream(d) for d in DEVICES))

    def prepare() -> None:
        torch.accelerator.set_stream(compute)
        torch.accelerator.set_device_index(current_index)
        after.record(compute)

    prepare()
    with platform.stream(copy):  # what the context manager leaves behind
        pass
    expected = state()
    prepare()
    seen: list[torch.Stream] = []
    platform.fill(copy, after, _watched([(dst, src)], seen, device), then)
    assert state() == expected
    assert seen == [copy]
    then.synchronize()
    assert torch.equal(dst.cpu(), src)
    prepare()
    with pytest.raises(RuntimeError, match="a copy failed"):
        platform.fill(copy, after, _watched([(dst, src)], seen, device, fail=True), then)
    assert state() == expected  # restored when the work raises, as the context manager does
    platform.synchronize()
    platform.free(dst)


def test_a_layerwise_step_makes_no_stream_lookup_through_torchs_wrappers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The steady state of a block (a prefetch hit) asks for the current stream by index and
    # fills without the stream() context manager: before, three torch.accelerator.current_stream
    # calls and one context manager per block were most of its stream bookkeeping.
    device = DEVICES[0]
    platform = AcceleratorPlatform(device)
    resident = build_pipeline(0, 8).to(device)
    pipe = build_pipeline(0, 8)
    x = make_input(0).to(device)
    held = platform.memory_allocated()
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                      platform)
    backend.enable(pipe)
    calls = {"current_stream": 0, "set_stream": 0, "stream()": 0}

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        with torch.inference_mode():
            reference = resident.transformer(x).cpu()
            assert torch.equal(pipe.transformer(x).cpu(), reference)  # the order learnt
            monkeypatch.setattr(torch.accelerator, "current_stream",
                                counted("current_stream", torch.accelerator.current_stream))
            monkeypatch.setattr(torch.accelerator, "set_stream",
                                counted("set_stream", torch.accelerator.set_stream))
            monkeypatch.setattr(AcceleratorPlatform, "stream",
                                counted("stream()", AcceleratorPlatform.stream))
            out = pipe.transformer(x)
            monkeypatch.undo()
            assert torch.equal(out.cpu(), reference)
        assert calls == {"current_stream": 0, "set_stream": 0, "stream()": 0}
        assert backend.stats().sync_recoveries == 0  # every block was a prefetch hit
    finally:
        monkeypatch.undo()
        backend.disable()
    del out
    assert platform.memory_allocated() == held
