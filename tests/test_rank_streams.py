"""The distributed checks' spawned ranks run each scenario under stream checking, as the parent
runs every case (contracts/checks/distributed.py, _rank_streams_checked): a race in a rank becomes
that scenario's error, which fails its checks."""

from __future__ import annotations

import pytest
import torch

from offload_ref.contracts.checks.distributed import _rank_streams_checked
from offload_ref.platform import simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")


def test_a_race_in_a_rank_scenario_is_reported_with_the_rank() -> None:
    device = simulated.device(0)
    copy = torch.Stream(device=device)
    host = torch.randn(16, 16).pin_memory()
    with _rank_streams_checked(1) as races:
        with copy:
            weight = host.to(device, non_blocking=True)
        (weight @ weight).sum()  # compute never waited for the copy
    assert len(races) == 1 and races[0].startswith("rank 1: stream race (read-after-write)")
    assert not simulated.check_streams()  # the previous setting is restored


def test_an_ordered_scenario_reports_nothing() -> None:
    device = simulated.device(0)
    copy = torch.Stream(device=device)
    host = torch.randn(16, 16).pin_memory()
    with _rank_streams_checked(0) as races:
        with copy:
            weight = host.to(device, non_blocking=True)
        torch.accelerator.current_stream(device).wait_stream(copy)
        (weight @ weight).sum()
        weight.record_stream(torch.accelerator.current_stream(device))
    assert races == []
