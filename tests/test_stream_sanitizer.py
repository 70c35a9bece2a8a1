"""The simulated accelerator's happens-before stream sanitizer, in raw torch (issue 34).

Each racy pattern of the acceptance corpus (tests/stream_offloaders.py) in a few lines on
``hpu:0`` under ``simulated.stream_checking()``: ``simulated.races()`` reports the expected kind,
both accesses (stream, op, and a ``where`` line in this file) and, for a reuse, where the memory
was freed.  Each correct way to order the same accesses (an event wait, a stream wait,
``record_stream``, a stream / event / device synchronize, a blocking copy) reports none.  Then the
API: distinct races are kept once each, ``clear_races`` and ``races(clear=True)`` forget them,
nothing is recorded while checking is off, and a namer installed with ``set_tensor_namer`` names
the memory.  The simulated device computes every op at once, so all of these give the right
numbers: only the sanitizer tells them apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload_ref.platform import simulated

from device_helpers import SIMULATED  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(not SIMULATED, reason="the stream sanitizer is the simulated "
                                "accelerator's: without it there is no device stream to check")

D = torch.device("hpu:0")
N = 64  # floats: 256 bytes
_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    """The line of this file that ends with the comment ``# <marker>``."""
    hits = [k + 1 for k, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def _at(where: tuple[str, ...], marker: str) -> bool:
    """``where``'s innermost frame is the line of this file marked ``marker``."""
    return bool(where) and f"{Path(__file__).name}:{_line(marker)}" in where[0]


@pytest.fixture
def checking() -> Iterator[None]:
    with simulated.stream_checking():
        simulated.clear_races()
        try:
            yield
        finally:
            simulated.set_tensor_namer(None)
            torch.accelerator.synchronize(D)
            simulated.clear_races()


def _streams() -> tuple[torch.Stream, torch.Stream]:
    """(the compute stream: the current one, the default stream of hpu:0; a copy stream)."""
    return torch.accelerator.current_stream(D), torch.Stream(D)


def _pinned(fill: float = 1.0) -> torch.Tensor:
    return torch.full((N,), fill).pin_memory()


def _one(kind: str) -> simulated.Race:
    found = simulated.races()
    assert len(found) == 1, [str(r) for r in found]
    race = found[0]
    assert race.kind == kind, str(race)
    assert race.device == 0
    assert race.advice, str(race)
    return race


def _names_both(race: simulated.Race) -> None:
    text = str(race)
    for access in (race.current, race.previous):
        assert access.stream_name in text and access.op in text, (access, text)
        assert access.where and access.where[0] in text, (access, text)


# -- the six patterns of the corpus ------------------------------------------------------------


def test_a_compute_that_never_waits_for_its_copy_is_a_read_after_write(checking) -> None:
    compute, copy = _streams()
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)  # <a-copy>
    out = weight * 2  # <a-read>
    race = _one("read-after-write")
    assert (race.current.stream, race.current.write) == (compute.stream_id, False)
    assert race.current.op.startswith("aten::mul"), race.current
    assert race.current.stream_name == "the default stream of hpu:0"
    assert _at(race.current.where, "a-read"), race.current.where
    assert (race.previous.stream, race.previous.write) == (copy.stream_id, True)
    assert race.previous.stream_name == f"stream {copy.stream_id} of hpu:0"
    assert "copy" in race.previous.op, race.previous
    assert _at(race.previous.where, "a-copy"), race.previous.where
    assert race.freed_at == ()
    assert "wait" in race.advice, race.advice
    _names_both(race)
    del out


def test_b_a_slot_refilled_while_its_block_may_still_compute_is_a_write_after_read(
        checking) -> None:
    compute, copy = _streams()
    slot = torch.empty(N, device=D)
    copy.wait_stream(compute)  # the slot was made on the compute stream
    ready = torch.Event(D)
    first, second = _pinned(1.0), _pinned(2.0)
    with copy:
        slot.copy_(first, non_blocking=True)
        ready.record(copy)
    compute.wait_event(ready)
    out = slot * 2  # <b-read>
    with copy:
        slot.copy_(second, non_blocking=True)  # <b-refill>
    race = _one("write-after-read")
    assert (race.current.stream, race.current.write) == (copy.stream_id, True)
    assert _at(race.current.where, "b-refill"), race.current.where
    assert (race.previous.stream, race.previous.write) == (compute.stream_id, False)
    assert race.previous.op.startswith("aten::mul"), race.previous
    assert _at(race.previous.where, "b-read"), race.previous.where
    _names_both(race)
    del out


def test_c_a_ready_event_recorded_on_the_compute_stream_orders_nothing(checking) -> None:
    compute, copy = _streams()
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)  # <c-copy>
    ready = torch.Event(D)
    ready.record(compute)  # the wrong stream
    compute.wait_event(ready)
    out = weight * 2  # <c-read>
    race = _one("read-after-write")
    assert race.current.stream == compute.stream_id and _at(race.current.where, "c-read")
    assert race.previous.stream == copy.stream_id and _at(race.previous.where, "c-copy")
    _names_both(race)
    del out


def test_d_memory_freed_without_record_stream_and_reused_is_a_use_after_free(checking) -> None:
    compute, copy = _streams()
    ready = torch.Event(D)
    first, second = _pinned(1.0), _pinned(2.0)  # host memory outlives its copies
    with copy:
        weight = first.to(D, non_blocking=True)
        ready.record(copy)
    address = weight.data_ptr()
    compute.wait_event(ready)
    out = weight * 2  # <d-read>
    del weight  # <d-free>
    with copy:
        again = second.to(D, non_blocking=True)  # <d-reuse>
    assert again.data_ptr() == address, ("precondition: the copy stream's next allocation of "
                                         "the same size reuses the block it freed")
    race = _one("use-after-free")
    assert (race.current.stream, race.current.write) == (copy.stream_id, True)
    assert _at(race.current.where, "d-reuse"), race.current.where
    assert (race.previous.stream, race.previous.write) == (compute.stream_id, False)
    assert _at(race.previous.where, "d-read"), race.previous.where
    assert _at(race.freed_at, "d-free"), race.freed_at
    assert race.freed_at[0] in str(race)
    assert "record_stream" in race.advice, race.advice
    _names_both(race)
    del out


def test_e_a_non_blocking_copy_to_the_host_read_before_a_synchronize(checking) -> None:
    compute, _ = _streams()
    x = torch.full((N,), 3.0, device=D)
    back = x.to("cpu", non_blocking=True)  # <e-copy>
    assert back.is_pinned()  # as on CUDA
    total = back.sum()  # <e-read>
    race = _one("host-read-before-sync")
    assert (race.current.stream, race.current.write) == (-1, False)
    assert race.current.stream_name == "the host"
    assert _at(race.current.where, "e-read"), race.current.where
    assert (race.previous.stream, race.previous.write) == (compute.stream_id, True)
    assert _at(race.previous.where, "e-copy"), race.previous.where
    assert "synchronize" in race.advice, race.advice
    _names_both(race)
    del total


def test_f_a_wait_on_an_event_recorded_before_its_copy_is_a_read_after_write(checking) -> None:
    compute, copy = _streams()
    ready = torch.Event(D)
    host = _pinned()
    with copy:
        ready.record(copy)  # before the copy is enqueued
        weight = host.to(D, non_blocking=True)  # <f-copy>
    compute.wait_event(ready)
    out = weight * 2  # <f-read>
    race = _one("read-after-write")
    assert race.current.stream == compute.stream_id and _at(race.current.where, "f-read")
    assert race.previous.stream == copy.stream_id and _at(race.previous.where, "f-copy")
    _names_both(race)
    del out


def test_a_host_write_to_pinned_memory_a_copy_still_reads(checking) -> None:
    _, copy = _streams()
    source = _pinned()
    with copy:
        weight = source.to(D, non_blocking=True)  # <h-copy>
    source.fill_(5.0)  # <h-write>
    race = _one("host-write-before-copy-done")  # <h-found>
    assert (race.current.stream, race.current.write) == (-1, True)
    # found by its effect (Note [Host writes to pinned memory a copy reads]): the bytes the copy
    # read changed; the race names where that was noticed (here: where the races were collected)
    assert "seen by its effect" in race.current.op and "collected" in race.current.op
    assert any("_one" in line for line in race.current.where), race.current.where
    assert (race.previous.stream, race.previous.write) == (copy.stream_id, False)
    assert _at(race.previous.where, "h-copy"), race.previous.where
    del weight


# -- the same accesses, ordered: no race ----------------------------------------------------------


def _copy_then_read(order: str) -> None:
    compute, copy = _streams()
    ready = torch.Event(D)
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)
        ready.record(copy)
    if order == "wait_event":
        compute.wait_event(ready)
    elif order == "wait_stream":
        compute.wait_stream(copy)
    elif order == "stream.synchronize":
        copy.synchronize()
    elif order == "event.synchronize":
        ready.synchronize()
    elif order == "accelerator.synchronize":
        torch.accelerator.synchronize(D)
    else:
        raise AssertionError(order)
    (weight * 2).sum()
    # weight was allocated on the copy stream and read on compute: without record_stream, its
    # free would hand the memory to the copy stream's next allocation while compute may still
    # read it (Note [Freed memory another stream may still use]); a host synchronization above
    # orders everything anyway
    weight.record_stream(compute)


@pytest.mark.parametrize("order", ["wait_event", "wait_stream", "stream.synchronize",
                                   "event.synchronize", "accelerator.synchronize"])
def test_a_copy_ordered_before_its_read_is_no_race(checking, order) -> None:
    _copy_then_read(order)
    assert simulated.races() == []


def test_a_blocking_copy_on_another_stream_needs_no_wait(checking) -> None:
    """``non_blocking=False`` is the copy followed by a host synchronization with its stream:
    what the host does next comes after it."""
    _, copy = _streams()
    host = _pinned()
    with copy:
        weight = host.to(D)
    (weight * 2).sum()
    assert simulated.races() == []


def test_a_non_blocking_copy_from_pageable_memory_still_needs_a_wait(checking) -> None:
    """CUDA stages a pageable source and returns before the device copy lands: the call is
    synchronous for the host's buffer only, so the device read still needs the wait."""
    compute, copy = _streams()
    host = torch.ones(N)
    with copy:
        weight = host.to(D, non_blocking=True)  # <p-copy>
    (weight * 2).sum()  # <p-read>
    race = _one("read-after-write")
    assert race.current.stream == compute.stream_id and _at(race.current.where, "p-read")
    assert race.previous.stream == copy.stream_id and _at(race.previous.where, "p-copy")


def test_a_non_blocking_copy_into_pageable_host_memory_is_synchronous(checking) -> None:
    """A device-to-host copy into pageable memory returns once it is done (CUDA's rule): the
    host may read it at once."""
    x = torch.full((N,), 3.0, device=D)
    back = torch.empty(N)
    back.copy_(x, non_blocking=True)
    assert not back.is_pinned()
    assert back.sum().item() == 3.0 * N
    assert simulated.races() == []


def test_a_slot_refilled_after_waiting_for_its_reader_is_no_race(checking) -> None:
    compute, copy = _streams()
    slot = torch.empty(N, device=D)
    copy.wait_stream(compute)
    sources = [_pinned(float(k)) for k in range(4)]
    for k in range(4):  # the two-slot prefetcher's loop, one slot
        ready = torch.Event(D)
        with copy:
            slot.copy_(sources[k], non_blocking=True)
            ready.record(copy)
        compute.wait_event(ready)
        out = slot * 2
        done = torch.Event(D)
        done.record(compute)
        copy.wait_event(done)
    assert simulated.races() == []
    torch.accelerator.synchronize(D)
    assert torch.equal(out.cpu(), torch.full((N,), 6.0))


@pytest.mark.parametrize("how", ["record_stream", "wait_stream", "synchronize"])
def test_memory_freed_after_its_reader_is_ordered_is_no_race(checking, how) -> None:
    compute, copy = _streams()
    ready = torch.Event(D)
    first, second = _pinned(1.0), _pinned(2.0)
    with copy:
        weight = first.to(D, non_blocking=True)
        ready.record(copy)
    compute.wait_event(ready)
    out = weight * 2
    if how == "record_stream":
        weight.record_stream(compute)
    elif how == "wait_stream":
        copy.wait_stream(compute)
    else:
        compute.synchronize()
    address = weight.data_ptr()
    del weight
    with copy:
        again = second.to(D, non_blocking=True)
    assert simulated.races() == []
    if how != "record_stream":  # the block is free for the copy stream again
        assert again.data_ptr() == address, "precondition: the freed block is reused"
    del out, again


@pytest.mark.parametrize("how", ["stream.synchronize", "event.synchronize", "accelerator",
                                 "blocking"])
def test_a_copy_to_the_host_read_after_a_synchronize_is_no_race(checking, how) -> None:
    compute, _ = _streams()
    x = torch.full((N,), 3.0, device=D)
    if how == "blocking":
        back = x.to("cpu")
    else:
        back = x.to("cpu", non_blocking=True)
        done = torch.Event(D)
        done.record(compute)
        if how == "stream.synchronize":
            compute.synchronize()
        elif how == "event.synchronize":
            done.synchronize()
        else:
            torch.accelerator.synchronize(D)
    assert back.sum().item() == 3.0 * N
    assert simulated.races() == []


def test_one_stream_alone_never_races(checking) -> None:
    x = torch.randn(N).to(D)
    y = (x * 2 + 1).relu()
    x.add_(y)
    host = y.to("cpu", non_blocking=True)
    torch.accelerator.current_stream(D).synchronize()
    assert host.sum().item() == pytest.approx(y.sum().item())
    del x
    z = torch.empty(N, device=D).fill_(1.0)
    assert z.cpu().sum().item() == N
    assert simulated.races() == []


# -- the API ---------------------------------------------------------------------------------------


def _unwaited_read(copy: torch.Stream, keep: list[torch.Tensor]) -> None:
    """The copy stream writes a tensor the compute stream reads without a wait; its memory is
    kept in ``keep`` (a reuse would be another race)."""
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)
    (weight * 2).sum()  # <api-read>
    keep += [host, weight]


def test_the_same_race_again_is_reported_once_and_another_one_beside_it(checking) -> None:
    _, copy = _streams()
    keep: list[torch.Tensor] = []
    for _ in range(3):
        _unwaited_read(copy, keep)
    assert len(simulated.races()) == 1
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)
    (weight + 1).sum()  # <api-other-read>
    found = simulated.races()
    assert len(found) == 2, [str(r) for r in found]
    assert {_line("api-read"), _line("api-other-read")} == {
        int(r.current.where[0].split(":")[1].split()[0]) for r in found}


def test_an_access_already_reported_does_not_hide_another_unordered_one_beside_it(checking
                                                                                  ) -> None:
    # two copy streams write overlapping halves of one buffer, neither waiting for the other (one
    # race, reported); the compute stream then reads all of it without waiting for either: the
    # second writer's unordered write is a race of its own, not hidden by the first one's record
    _, first = _streams()
    second = torch.Stream(D)
    buffer = torch.zeros(N, device=D)
    torch.accelerator.current_stream(D).synchronize()
    with first:
        buffer[: N // 2 + 8].fill_(1.0)  # <overlap-first>
    with second:
        buffer[N // 2 - 8:].fill_(2.0)  # <overlap-second>
    assert [r.kind for r in simulated.races()] == ["write-after-write"]
    buffer.sum()  # <overlap-read>
    found = simulated.races()
    reads = [r for r in found if _at(r.current.where, "overlap-read")]
    assert reads and {r.kind for r in reads} == {"read-after-write"}, [str(r) for r in found]
    assert second.stream_id in {r.previous.stream for r in reads}, [str(r) for r in reads]


def test_clear_races_and_races_clear_forget_what_was_found(checking) -> None:
    _, copy = _streams()
    keep: list[torch.Tensor] = []
    _unwaited_read(copy, keep)
    assert len(simulated.races()) == 1
    assert len(simulated.races()) == 1  # reading does not clear
    simulated.clear_races()
    assert simulated.races() == []
    _unwaited_read(copy, keep)
    assert len(simulated.races(clear=True)) == 1
    assert simulated.races() == []
    _unwaited_read(copy, keep)  # found again once forgotten
    assert len(simulated.races()) == 1


def test_with_stream_checking_off_nothing_is_recorded(checking) -> None:
    _, copy = _streams()
    keep: list[torch.Tensor] = []
    assert simulated.check_streams() is True
    with simulated.stream_checking(False):
        assert simulated.check_streams() is False
        _unwaited_read(copy, keep)
        assert simulated.races() == []
    assert simulated.check_streams() is True  # restored
    assert simulated.races() == []  # nothing was kept from while it was off
    _unwaited_read(copy, keep)
    assert len(simulated.races()) == 1


def test_check_streams_sets_and_reports_the_setting() -> None:
    before = simulated.check_streams()
    try:
        assert simulated.check_streams(True) is True
        assert simulated.check_streams() is True
        assert simulated.check_streams(False) is False
        assert simulated.check_streams() is False
    finally:
        simulated.check_streams(before)
    assert simulated.check_streams() is before


def test_a_namer_names_the_memory_and_without_one_the_tensor_is_described(checking) -> None:
    _, copy = _streams()
    host = _pinned()
    with copy:
        weight = host.to(D, non_blocking=True)
    start, end = weight.data_ptr(), weight.data_ptr() + weight.nbytes
    calls: list[tuple[int, int, int]] = []

    def namer(device: int, address: int, nbytes: int) -> str | None:
        calls.append((device, address, nbytes))
        return "transformer.blocks.3.ff.weight" if start <= address < end else None

    simulated.set_tensor_namer(namer)
    (weight * 2).sum()
    race = _one("read-after-write")
    assert race.tensor == "transformer.blocks.3.ff.weight"
    assert "transformer.blocks.3.ff.weight" in str(race)
    assert calls and all(d == 0 and start <= a < end and 0 < n <= weight.nbytes
                         for d, a, n in calls), calls
    simulated.set_tensor_namer(None)
    simulated.clear_races()
    with copy:
        other = host.to(D, non_blocking=True)
    (other * 3).sum()
    race = _one("read-after-write")
    assert "float32" in race.tensor and "transformer" not in race.tensor, race.tensor


def test_a_race_on_the_second_device_names_it() -> None:
    device = torch.device("hpu:1")
    with simulated.stream_checking():
        simulated.clear_races()
        copy = torch.Stream(device)
        host = _pinned()
        with copy:
            weight = host.to(device, non_blocking=True)
        (weight * 2).sum()
        found = simulated.races(clear=True)
        torch.accelerator.synchronize(device)
    assert len(found) == 1 and found[0].device == 1, [str(r) for r in found]
    assert found[0].current.stream_name == "the default stream of hpu:1"
    assert found[0].previous.stream_name == f"stream {copy.stream_id} of hpu:1"
