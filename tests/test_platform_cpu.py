"""CpuPlatform: thread-backed streams, events, the device ledger, stream-order checking and the
race amplifier (the things that let GPU stream logic be tested without a GPU)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from offload_ref.platform import (
    CpuPlatform,
    Event,
    Platform,
    Stream,
    StreamOrderError,
    get_platform,
)
from device_helpers import DEVICE, host  # noqa: E402 (tests/ is on sys.path)

_LAYERS = 8
_WIDTH = 16


@pytest.fixture
def platform() -> Iterator[CpuPlatform]:
    p = CpuPlatform()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def amplified() -> Iterator[CpuPlatform]:
    # Larger delays than the default make a missing wait lose the race on every machine.
    p = CpuPlatform(race_amplifier=True, seed=1234, max_delay_s=0.005)
    try:
        yield p
    finally:
        p.close()


def _gate(platform: CpuPlatform) -> threading.Event:
    """Queue a work item on the current stream that blocks until the returned gate is set."""
    gate = threading.Event()
    platform.submit(lambda: gate.wait(10.0))
    return gate


def _layer_weights(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(_WIDTH, _WIDTH, generator=generator) / _WIDTH**0.5 for _ in range(_LAYERS)]


def _reference(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for weight in weights:
        x = torch.tanh(x @ weight)
    return x


def _run_ring(
    platform: CpuPlatform,
    weights: list[torch.Tensor],
    x: torch.Tensor,
    *,
    wait_ready: bool,
    declare_reads: bool,
) -> torch.Tensor:
    """A two-slot layer ring as the layerwise offloader runs it: the copy of layer i+1 overlaps
    the compute of layer i; a slot is refilled only after the compute that read it (free event)
    and read only after its copy (ready event, unless ``wait_ready`` is False: the bug)."""
    copy = platform.Stream()
    x = x.to(platform.device)  # the activations live on the device, next to the slots
    numel = weights[0].numel()
    slots = [platform.empty(numel, weights[0].dtype) for _ in range(2)]
    ready = [platform.Event() for _ in range(2)]
    free = [platform.Event() for _ in range(2)]

    def prefetch(i: int) -> None:
        slot = i % 2
        with platform.stream(copy):
            copy.wait_event(free[slot])
            platform.copy_(slots[slot], weights[i].reshape(-1))
            ready[slot].record()

    compute = platform.current_stream()
    try:
        prefetch(0)
        for i in range(len(weights)):
            if i + 1 < len(weights):
                prefetch(i + 1)
            slot = i % 2
            if wait_ready:
                compute.wait_event(ready[slot])
            if declare_reads:
                platform.record_use(slots[slot])
            x = torch.tanh(x @ slots[slot].view(weights[i].shape))
            if declare_reads:
                platform.record_use(slots[slot])
            free[slot].record()
        platform.synchronize()
        return x
    finally:
        platform.synchronize()
        for slot_tensor in slots:
            platform.free(slot_tensor)


# -- protocol -------------------------------------------------------------------------------------
def test_cpu_platform_satisfies_the_platform_protocol(platform: CpuPlatform) -> None:
    assert isinstance(platform, Platform)
    assert isinstance(platform.Stream(), Stream)
    assert isinstance(platform.current_stream(), Stream)
    assert isinstance(platform.Event(), Event)
    assert platform.name == "cpu"
    assert platform.device == DEVICE  # device storage on the simulated accelerator where it loads
    assert platform.pin_memory_supported is False


def test_stream_context_sets_and_restores_the_current_stream(platform: CpuPlatform) -> None:
    compute = platform.current_stream()
    copy = platform.Stream()
    with platform.stream(copy):
        assert platform.current_stream() is copy
        with platform.stream(None):
            assert platform.current_stream() is copy
    assert platform.current_stream() is compute
    with CpuPlatform() as other, pytest.raises(ValueError, match="not a stream of this"):
        with platform.stream(other.current_stream()):
            pass


# -- streams and events ---------------------------------------------------------------------------
def test_worker_stream_runs_copies_in_issue_order(amplified: CpuPlatform) -> None:
    copy = amplified.Stream()
    dst = amplified.empty(256, torch.float32)
    sources = [torch.full((256,), float(i)) for i in range(10)]
    log: list[int] = []
    with amplified.stream(copy):
        for i, src in enumerate(sources):
            amplified.copy_(dst, src)
            amplified.submit(lambda i=i: log.append(int(dst[0].item()) * 100 + i))
        done = amplified.Event()
        done.record()
    done.synchronize()
    assert log == [i * 100 + i for i in range(10)], "copies and work ran out of issue order"
    torch.testing.assert_close(host(dst), sources[-1], rtol=0, atol=0, msg="last copy did not win")


def test_event_completes_only_after_the_work_queued_before_it(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    dst = platform.empty(4, torch.float32)
    event = platform.Event()
    with platform.stream(copy):
        gate = _gate(platform)
        try:
            platform.copy_(dst, torch.ones(4))
            event.record()
            time.sleep(0.01)
            assert not event.query(), "event completed before the work queued before it ran"
            assert not copy.query()
        finally:
            gate.set()
    event.synchronize()
    assert event.query() and copy.query()
    platform.current_stream().wait_event(event)
    platform.record_use(dst)
    torch.testing.assert_close(host(dst), torch.ones(4), rtol=0, atol=0)


def test_rerecording_an_event_resets_it(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    event = platform.Event()
    assert event.query(), "a never-recorded event counts as complete (as in CUDA)"
    event.record(copy)
    event.synchronize()
    assert event.query()
    with platform.stream(copy):
        gate = _gate(platform)
    try:
        event.record(copy)
        assert not event.query(), "re-recording did not reset the event"
    finally:
        gate.set()
    event.synchronize()
    assert event.query()


def test_compute_stream_work_runs_immediately(platform: CpuPlatform) -> None:
    ran: list[str] = []
    platform.submit(lambda: ran.append("now"))
    assert ran == ["now"]
    event = platform.Event()
    event.record()
    assert event.query(), "an event on the compute stream completes at record"


def test_worker_stream_waits_for_an_event_of_another_worker(platform: CpuPlatform) -> None:
    first, second = platform.Stream(), platform.Stream()
    slot = platform.empty(64, torch.float32)
    out = platform.empty(64, torch.float32)
    with platform.stream(first):
        gate = _gate(platform)
        platform.copy_(slot, torch.full((64,), 3.0))
    try:
        second.wait_stream(first)
        with platform.stream(second):
            platform.copy_(out, slot)  # ordered after the first copy by wait_stream
            done = platform.Event()
            done.record()
        time.sleep(0.01)
        assert not done.query(), "the second stream did not wait for the first"
    finally:
        gate.set()
    done.synchronize()
    platform.current_stream().wait_event(done)
    platform.record_use(out)
    torch.testing.assert_close(host(out), torch.full((64,), 3.0), rtol=0, atol=0)


def test_elapsed_time_measures_milliseconds_between_completions(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    start, end = platform.Event(enable_timing=True), platform.Event(enable_timing=True)
    with platform.stream(copy):
        start.record()
        platform.submit(lambda: time.sleep(0.02))
        end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert 15.0 <= elapsed < 5000.0, f"elapsed_time {elapsed} ms for a 20 ms sleep"


def test_elapsed_time_requires_timing_and_completion(platform: CpuPlatform) -> None:
    plain, timed = platform.Event(), platform.Event(enable_timing=True)
    plain.record()
    timed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        plain.elapsed_time(timed)
    with pytest.raises(RuntimeError, match="not completed"):
        timed.elapsed_time(platform.Event(enable_timing=True))


def test_worker_failure_surfaces_at_synchronize_and_stops_the_stream(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    dst = platform.empty(4, torch.float32)
    dst.zero_()
    with platform.stream(copy):
        platform.submit(lambda: 1 / 0)
        platform.copy_(dst, torch.ones(4))  # must not run: the stream is broken
        after = platform.Event()
        after.record()
    with pytest.raises(RuntimeError, match="'copy-1'") as info:
        platform.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    platform.synchronize()  # reported once platform-wide; the stream itself stays broken
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        copy.synchronize()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        after.synchronize()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        platform.current_stream().wait_event(after)
    torch.testing.assert_close(host(dst), torch.zeros(4), rtol=0, atol=0, msg="work ran after a failure")


def test_a_failure_on_a_stream_is_caught_by_its_own_type_at_the_host(platform: CpuPlatform
                                                                     ) -> None:
    # Note [Stream failures keep their type]: `except OffloadScheduleError` at the call that
    # waited once missed a schedule error raised on a stream (a RuntimeError wrapping it)
    from offload_ref.backends.distributed import OffloadScheduleError
    from offload_ref.platform.cpu import StreamWorkError

    def schedule_error() -> None:
        raise OffloadScheduleError("rank 1 called block 3 where rank 0 called block 2")

    copy = platform.Stream()
    with platform.stream(copy):
        platform.submit(schedule_error)
    with pytest.raises(OffloadScheduleError, match="'copy-1' failed with OffloadScheduleError: "
                                                   "rank 1 called block 3") as info:
        platform.synchronize()
    assert isinstance(info.value, StreamWorkError) and isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, OffloadScheduleError)
    with pytest.raises(OffloadScheduleError):
        copy.synchronize()  # each later wait: the same type


def test_a_stream_waiting_on_a_failed_stream_fails_too(platform: CpuPlatform) -> None:
    broken, waiter = platform.Stream(), platform.Stream()
    with platform.stream(broken):
        platform.submit(lambda: [][0])
    waiter.wait_stream(broken)
    with pytest.raises(RuntimeError) as info:
        waiter.synchronize()
    assert "waited on an event of failed stream" in str(info.value.__cause__)


# -- stream-order checking ------------------------------------------------------------------------
def test_ring_with_event_waits_matches_the_reference(amplified: CpuPlatform) -> None:
    weights = _layer_weights()
    x = torch.randn(4, _WIDTH, generator=torch.Generator().manual_seed(1))
    out = _run_ring(amplified, weights, x, wait_ready=True, declare_reads=True)
    torch.testing.assert_close(host(out), _reference(weights, x), rtol=0, atol=0, msg="ring != reference")
    assert amplified.hazards == []
    assert amplified.memory_allocated() == 0


def test_missing_ready_wait_is_a_stream_order_error_when_reads_are_declared(
    amplified: CpuPlatform,
) -> None:
    weights, x = _layer_weights(), torch.randn(4, _WIDTH)
    with pytest.raises(StreamOrderError, match="record_use on stream 'compute'.*'copy-1'"):
        _run_ring(amplified, weights, x, wait_ready=False, declare_reads=True)
    assert len(amplified.hazards) == 1
    assert "device allocation #1" in str(amplified.hazards[0])


def test_missing_ready_wait_gives_a_wrong_output_under_the_race_amplifier(
    amplified: CpuPlatform,
) -> None:
    weights, x = _layer_weights(), torch.randn(4, _WIDTH)
    out = _run_ring(amplified, weights, x, wait_ready=False, declare_reads=False)
    reference = _reference(weights, x)
    assert not torch.equal(host(out), reference), "a missing ready wait went unnoticed (passed by luck)"


def test_write_after_read_without_the_free_event_is_a_stream_order_error(
    platform: CpuPlatform,
) -> None:
    copy = platform.Stream()
    slot = platform.empty(16, torch.float32)
    ready = platform.Event()
    with platform.stream(copy):
        platform.copy_(slot, torch.ones(16))
        ready.record()
    platform.current_stream().wait_event(ready)
    platform.record_use(slot)  # compute reads the slot ...
    with platform.stream(copy), pytest.raises(StreamOrderError) as info:
        platform.copy_(slot, torch.zeros(16))  # ... and the copy stream refills it: a race
    message = str(info.value)
    assert "'copy-1'" in message and "'compute'" in message and "last read" in message
    assert platform.hazards == [info.value]
    platform.synchronize()
    torch.testing.assert_close(host(slot), torch.ones(16), rtol=0, atol=0, msg="the racy copy was issued")

    free = platform.Event()
    free.record()  # after the read: now the refill is ordered
    copy.wait_event(free)
    with platform.stream(copy):
        platform.copy_(slot, torch.zeros(16))
    assert len(platform.hazards) == 1


def test_reading_device_storage_before_its_write_completes_is_caught(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    slot = platform.empty(8, torch.float32)
    with platform.stream(copy):
        platform.copy_(slot, torch.ones(8))
    with pytest.raises(StreamOrderError, match="last written on stream 'copy-1'"):
        platform.copy_(torch.empty(8), slot)  # a device-to-host read on compute, unordered
    platform.current_stream().wait_stream(copy)
    host = torch.empty(8)
    platform.copy_(host, slot)
    torch.testing.assert_close(host, torch.ones(8), rtol=0, atol=0)


def test_submitted_work_is_order_checked_like_a_copy(platform: CpuPlatform) -> None:
    """A collective submitted on a communication stream declares the slot it writes: writing it
    before the copy stream's write is ordered, or reading it on compute before the collective is
    ordered, is a StreamOrderError, as for a copy."""
    copy, comm = platform.Stream(), platform.Stream()
    slot = platform.empty(8, torch.float32)
    with platform.stream(copy):
        platform.copy_(slot[:4], torch.ones(4))
    with platform.stream(comm), pytest.raises(StreamOrderError, match="submit on stream"):
        platform.submit(lambda: slot[4:].fill_(2.0), reads=(slot,), writes=(slot,))
    comm.wait_stream(copy)
    with platform.stream(comm):
        platform.submit(lambda: slot[4:].fill_(2.0), reads=(slot,), writes=(slot,))
    with pytest.raises(StreamOrderError, match="last written on stream 'copy-2'"):
        platform.record_use(slot)
    platform.current_stream().wait_stream(comm)
    platform.record_use(slot)
    torch.testing.assert_close(host(slot), torch.tensor([1.0] * 4 + [2.0] * 4), rtol=0, atol=0)


def test_order_composes_through_a_chain_of_events(platform: CpuPlatform) -> None:
    first, second = platform.Stream(), platform.Stream()
    slot = platform.empty(8, torch.float32)
    with platform.stream(first):
        platform.copy_(slot, torch.ones(8))
    second.wait_stream(first)
    platform.current_stream().wait_stream(second)
    platform.record_use(slot)  # ordered after first's write through second
    assert platform.hazards == []


def test_host_synchronize_orders_later_work_on_every_stream(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    slot = platform.empty(8, torch.float32)
    platform.record_use(slot)
    platform.synchronize()
    with platform.stream(copy):
        platform.copy_(slot, torch.ones(8))
    copy.synchronize()
    platform.record_use(slot)
    assert platform.hazards == []


def test_free_of_storage_another_stream_still_writes_is_caught(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    slot = platform.empty(8, torch.float32)
    with platform.stream(copy):
        platform.copy_(slot, torch.ones(8))
    with pytest.raises(StreamOrderError, match="free on stream 'compute'"):
        platform.free(slot)
    assert platform.is_resident(slot), "a rejected free must leave the allocation in place"
    platform.synchronize()
    platform.free(slot)


def test_host_tensors_are_not_tracked(platform: CpuPlatform) -> None:
    copy = platform.Stream()
    host = torch.zeros(8)
    with platform.stream(copy):
        platform.copy_(host, torch.ones(8))
    platform.record_use(host)
    platform.copy_(host, torch.ones(8))
    platform.synchronize()
    assert platform.hazards == []


# -- race amplifier poisoning ---------------------------------------------------------------------
_POISONED = {
    "bfloat16": (torch.bfloat16, lambda t: bool(t.isnan().all())),
    "bool": (torch.bool, lambda t: bool(t.all())),
    "complex64": (torch.complex64, lambda t: bool(t.isnan().all())),
    "float32": (torch.float32, lambda t: bool(t.isnan().all())),
    "int64": (torch.int64, lambda t: bool((t == torch.iinfo(torch.int64).max).all())),
    "int8": (torch.int8, lambda t: bool((t == 127).all())),
}


@pytest.mark.parametrize("dtype_name", sorted(_POISONED))
def test_discard_and_free_poison_storage_under_the_amplifier(
    amplified: CpuPlatform, dtype_name: str
) -> None:
    dtype, is_poisoned = _POISONED[dtype_name]
    for release in (amplified.discard, amplified.free):
        slot = amplified.empty(32, dtype)
        slot.zero_()
        release(slot)  # on the compute stream: poisoned at once
        assert is_poisoned(slot), f"{release.__name__} did not poison a {dtype} slot: {slot}"


def test_discard_poisons_in_stream_order(amplified: CpuPlatform) -> None:
    copy = amplified.Stream()
    slot = amplified.empty(64, torch.float32)
    with amplified.stream(copy):
        amplified.copy_(slot, torch.ones(64))
        amplified.discard(slot)  # after the copy on the same stream: the slot ends poisoned
    amplified.synchronize()
    assert slot.isnan().all(), "discard did not run after the copy queued before it"


def test_fresh_allocations_are_poisoned_only_under_the_amplifier(amplified: CpuPlatform) -> None:
    assert amplified.empty(32, torch.float32).isnan().all()


def test_no_poisoning_without_the_amplifier(platform: CpuPlatform) -> None:
    slot = platform.empty(8, torch.float32)
    slot.fill_(2.0)
    platform.discard(slot)
    torch.testing.assert_close(host(slot), torch.full((8,), 2.0), rtol=0, atol=0)


# -- ledger ---------------------------------------------------------------------------------------
def test_ledger_accounts_allocations_views_and_frees(platform: CpuPlatform) -> None:
    assert platform.memory_allocated() == 0
    a = platform.empty(100, torch.float32)
    b = platform.empty(10, torch.float16)
    empty = platform.empty(0, torch.float32)
    assert (a.shape, b.shape, empty.shape) == ((100,), (10,), (0,))
    assert platform.memory_allocated() == 100 * 4 + 10 * 2
    assert platform.is_resident(a) and platform.is_resident(b) and platform.is_resident(empty)
    assert platform.is_resident(a[10:20].view(2, 5)), "a view of an allocation is resident"
    assert not platform.is_resident(torch.empty(100))
    assert not platform.is_resident(a.clone())
    platform.free(a[3:7])  # freeing through a view releases the whole allocation
    assert not platform.is_resident(a)
    assert platform.memory_allocated() == 10 * 2
    platform.free(b)
    platform.free(empty)
    assert platform.memory_allocated() == 0


def test_free_of_a_foreign_tensor_raises_naming_it(platform: CpuPlatform) -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 4\) and dtype torch.float64.*empty\(\)"):
        platform.free(torch.empty(3, 4, dtype=torch.float64))
    a = platform.empty(4, torch.float32)
    platform.free(a)
    with pytest.raises(ValueError, match="not device storage"):
        platform.free(a)


def test_ledger_is_thread_safe(platform: CpuPlatform) -> None:
    def churn() -> None:
        for _ in range(200):
            platform.free(platform.empty(16, torch.float32))

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert platform.memory_allocated() == 0


# -- host storage ---------------------------------------------------------------------------------
def test_host_memory_is_never_pinned_on_cpu(platform: CpuPlatform) -> None:
    for pin in (False, True):
        tensor = platform.host_empty(1001, torch.float16, pin=pin)
        assert tensor.shape == (1001,) and tensor.dtype == torch.float16
        assert not tensor.is_pinned()
        assert tensor.untyped_storage().nbytes() == 1001 * 2, "host_empty must be exact-size"
        assert not platform.is_resident(tensor)
        platform.host_free(tensor)
    assert platform.pinned_bytes() == 0


# -- lifetime -------------------------------------------------------------------------------------
def test_close_stops_the_worker_threads() -> None:
    with CpuPlatform() as platform:
        streams = [platform.Stream() for _ in range(3)]
        threads = [stream._worker.thread for stream in streams]  # type: ignore[union-attr]
        assert all(thread.daemon and thread.is_alive() for thread in threads)
    assert not any(thread.is_alive() for thread in threads)
    assert platform.closed
    with pytest.raises(RuntimeError, match="closed"):
        platform.Stream()
    platform.close()  # idempotent


def test_a_dropped_stream_stops_its_thread_after_its_work(platform: CpuPlatform) -> None:
    stream = platform.Stream()
    thread = stream._worker.thread  # type: ignore[union-attr]
    ran: list[int] = []
    with platform.stream(stream):
        platform.submit(lambda: ran.append(1))
    del stream
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive() and ran == [1]


# -- get_platform ---------------------------------------------------------------------------------
def test_get_platform_returns_a_cached_instance_per_device_and_amplifier() -> None:
    cpu = get_platform("cpu")
    assert isinstance(cpu, CpuPlatform)
    assert get_platform("cpu") is cpu
    assert get_platform(torch.device("cpu")) is cpu
    amplified = get_platform("cpu", race_amplifier=True)
    assert amplified is not cpu and amplified.race_amplifier  # type: ignore[attr-defined]
    assert get_platform("cpu", race_amplifier=True) is amplified
    if not torch.cuda.is_available():
        assert get_platform() is cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=str)
def test_get_platform_cuda_without_cuda_raises(device: object) -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        get_platform(device)  # type: ignore[arg-type]
    assert str(device) in str(info.value)


@pytest.mark.parametrize("device", ["mps", "meta", "not-a-device", "xla:0"])
def test_get_platform_rejects_unknown_devices(device: str) -> None:
    with pytest.raises(ValueError, match=r'accepted: "cpu", "cuda", "cuda:N"'):
        get_platform(device)


def test_batched_issue_never_stalls_a_wait_inside_the_stream_block() -> None:
    """Note [Batched issue]: work issued inside a ``platform.stream(s)`` block is queued when the
    block exits, or earlier when anyone waits, polls or synchronizes: never a deadlock."""
    with CpuPlatform() as platform:
        stream = platform.Stream()
        src = torch.arange(16.0)
        dst = platform.empty(16, torch.float32)
        with platform.stream(stream):
            platform.copy_(dst, src)
            event = platform.Event()
            event.record(stream)
            event.synchronize()  # a host wait inside the block: the batch is flushed first
            assert event.query()
            platform.copy_(dst, src * 2)
            deadline = time.monotonic() + 5.0
            while not stream.query():  # a poll inside the block gets the work under way
                assert time.monotonic() < deadline, "queued work never started"
                time.sleep(0.001)
            platform.copy_(dst, src * 3)
            platform.synchronize()
        assert torch.equal(host(dst), src * 3)
        platform.free(dst)


def _fill_scenario(platform: CpuPlatform, fill) -> tuple[torch.Tensor, StreamOrderError | None]:
    """Fill a slot twice through ``fill``: the second time without the free event after
    compute's read (a race the checker must report from the fill call itself)."""
    copy = platform.Stream()
    slot = platform.empty(16, torch.float32)
    free, ready = platform.Event(), platform.Event()
    fill(copy, free, [(slot, torch.ones(16))], ready)
    platform.current_stream().wait_event(ready)
    platform.record_use(slot)  # compute reads the slot, records no free event after it ...
    error = None
    try:
        fill(copy, free, [(slot, torch.zeros(16))], ready)  # ... and the slot is refilled
    except StreamOrderError as exc:
        error = exc
    platform.synchronize()
    out = slot.clone()
    free.record()  # ordered now
    fill(copy, free, [(slot, torch.full((16,), 2.0))], ready)
    ready.synchronize()
    return torch.stack([out, slot.clone()]), error


@pytest.mark.parametrize("amplifier", [False, True], ids=["plain", "amplified"])
def test_one_call_fill_is_exactly_the_generic_fill(amplifier: bool) -> None:
    """Note [One-call fills]: ``platform.fill`` has the values, ordering and checks of the
    stream / wait_event / copy_ / record sequence, including the race it reports."""
    from offload_ref.platform.base import fill_on_stream

    results = []
    for use_fill in (False, True):
        with CpuPlatform(race_amplifier=amplifier, seed=7, max_delay_s=0.001) as platform:
            fill = platform.fill if use_fill else (
                lambda *a, p=platform: fill_on_stream(p, *a))
            results.append(_fill_scenario(platform, fill))
    (generic, generic_error), (one_call, one_call_error) = results
    assert generic_error is not None and one_call_error is not None
    assert str(one_call_error) == str(generic_error)
    torch.testing.assert_close(one_call, generic, rtol=0, atol=0)
    torch.testing.assert_close(host(one_call[0]), torch.ones(16), rtol=0, atol=0)
    torch.testing.assert_close(host(one_call[1]), torch.full((16,), 2.0), rtol=0, atol=0)


def test_one_call_fill_waits_for_the_free_event_of_another_stream() -> None:
    """The fill's copy runs after the work its ``after`` event was recorded behind."""
    with CpuPlatform() as platform:
        slow, copy = platform.Stream(), platform.Stream()
        slot = platform.empty(1 << 16, torch.float32)
        gate, ready = platform.Event(), platform.Event()
        release = threading.Event()
        with platform.stream(slow):
            platform.submit(lambda: release.wait(5.0), writes=(slot,))
            gate.record()
        platform.fill(copy, gate, [(slot, torch.ones(1 << 16))], ready)
        time.sleep(0.05)
        assert not ready.query(), "the fill ran before the event it waits for"
        release.set()
        ready.synchronize()
        assert torch.equal(host(slot), torch.ones(1 << 16))
        platform.free(slot)


def test_the_ring_uses_one_call_fills_only_where_they_stand_for_the_platforms_own_copy_() -> None:
    """Note [One-call fills]: a proxy or a subclass that instruments ``copy_`` (or
    ``record_use``) sees every copy (and access) the ring makes; only a platform whose class
    defines ``fill`` with ``copy_`` gets the one-call fill."""
    import functools

    from offload_ref.platform.base import fast_calls, fill_on_stream
    from offload_ref.platform.inline import InlinePlatform

    class Proxy:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def copy_(self, dst, src):
            self._inner.copy_(dst, src)

    class CountingCopies(CpuPlatform):
        def copy_(self, dst, src):
            super().copy_(dst, src)

    class CountingReads(InlinePlatform):
        def record_use(self, tensor):
            pass

    def generic(fill) -> bool:
        return isinstance(fill, functools.partial) and fill.func is fill_on_stream

    with CpuPlatform() as cpu, InlinePlatform() as inline, CountingCopies() as counting, \
            CountingReads() as reads:
        fill, skip = fast_calls(cpu)
        assert fill == cpu.fill and not skip
        fill, skip = fast_calls(inline)
        assert fill == inline.fill and skip
        for wrapped in (Proxy(cpu), Proxy(inline), counting):
            fill, skip = fast_calls(wrapped)
            assert generic(fill) and not skip, wrapped
        assert not fast_calls(reads)[1]
        cpu.copy_ = cpu.copy_  # an instance override (a monkeypatched spy)
        assert generic(fast_calls(cpu)[0])
