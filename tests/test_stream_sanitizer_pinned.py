"""The stream sanitizer and pinned host memory that a non_blocking copy reads (Note [Host writes to
pinned memory a copy reads] in simdevice.cpp): a host write before the copy is synchronized is
found by its effect on any thread, at the next copy from the bytes, at a synchronization, or when
the races are collected; a write after a synchronization is not a race."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_ref.platform import simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

D = torch.device("hpu", 0)


@pytest.fixture
def staging():
    simulated.clear_races()
    with simulated.stream_checking():
        copy = torch.Stream(device=D)
        main = torch.accelerator.current_stream(D)
        buffer = torch.empty(1024).pin_memory()
        target = torch.empty(1024, device=D)

        def upload() -> torch.Event:
            torch.accelerator.set_stream(copy)
            try:
                target.copy_(buffer, non_blocking=True)
                return copy.record_event()
            finally:
                torch.accelerator.set_stream(main)

        yield buffer, upload
    simulated.clear_races()


def _kinds() -> list[tuple[str, str]]:
    return [(r.kind, r.current.op) for r in simulated.races(clear=True)]


def test_an_overwrite_before_the_next_copy_is_found_at_that_copy(staging) -> None:
    buffer, upload = staging
    buffer.fill_(1.0)
    upload()
    buffer.fill_(2.0)  # the first copy may still be reading
    upload()
    (kind, op), = _kinds()
    assert kind == "host-write-before-copy-done" and "later copy" in op


def test_an_overwrite_on_another_thread_is_found_at_the_synchronization(staging) -> None:
    buffer, upload = staging
    upload()
    writer = threading.Thread(target=lambda: buffer.fill_(4.0))
    writer.start()
    writer.join()
    torch.accelerator.synchronize(D)
    (kind, op), = _kinds()
    assert kind == "host-write-before-copy-done" and "synchronization" in op


def test_an_overwrite_after_the_copy_is_synchronized_is_no_race(staging) -> None:
    buffer, upload = staging
    done = upload()
    done.synchronize()
    buffer.fill_(3.0)
    upload().synchronize()
    buffer.fill_(5.0)
    assert _kinds() == []


def test_an_unchanged_buffer_copied_twice_is_no_race(staging) -> None:
    _, upload = staging
    upload()
    upload()
    assert _kinds() == []
