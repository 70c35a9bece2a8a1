"""run_ranks: no rank's function starts before every rank is up (Note [Every rank is up before
any leaves] in offload_ref/distributed/launch.py).  A rank running no collective once destroyed
its group and exited while its peer was still connecting to it, and the peer's init failed
("Gloo connectFullMesh failed ... Connection closed by peer"): that race cannot be forced from
here, so this checks the ordering that rules it out."""

from __future__ import annotations

import pytest

from offload_ref.distributed import run_ranks

pytestmark = pytest.mark.distributed


def test_every_rank_is_up_before_any_rank_function_runs() -> None:
    import launch_ranks

    seen = run_ranks(launch_ranks.peers_up_at_start, 3, timeout_s=90.0)
    assert seen == [[True, True, True]] * 3, seen
