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


def test_ranks_fork_from_a_server_and_take_the_callers_setting_at_the_call(
        monkeypatch, capfd, tmp_path) -> None:
    """Note [Forked from a server]: the ranks are not the caller's children (the fork server's),
    yet each sees the caller's environment and working folder as they are at the call, not as
    they were when the server started, and writes where the caller's stdout and stderr go now
    (here: this test's capture)."""
    import os

    import launch_ranks

    name = "OFFLOAD_REF_TEST_SETTING"
    monkeypatch.setenv(name, "before")
    first = run_ranks(launch_ranks.setting_seen, 2, args=(name,), timeout_s=90.0)
    assert [seen["value"] for seen in first] == ["before", "before"]
    capfd.readouterr()
    monkeypatch.setenv(name, "at the call")
    monkeypatch.chdir(tmp_path)
    second = run_ranks(launch_ranks.setting_seen, 2, args=(name,), timeout_s=90.0)
    assert [seen["value"] for seen in second] == ["at the call", "at the call"], second
    assert [seen["cwd"] for seen in second] == [str(tmp_path)] * 2, second
    assert all(seen["parent"] != os.getpid() for seen in first + second), (os.getpid(), second)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} writes to stdout" in out, out
        assert f"rank {rank} writes to stderr" in err, err


def test_spawned_ranks_are_the_callers_children_and_a_bad_start_method_is_refused(
        monkeypatch) -> None:
    import os

    import launch_ranks

    monkeypatch.setenv("OFFLOAD_REF_TEST_SETTING", "spawned")
    seen = run_ranks(launch_ranks.setting_seen, 2, args=("OFFLOAD_REF_TEST_SETTING",),
                     timeout_s=90.0, start_method="spawn")
    assert [(s["value"], s["parent"]) for s in seen] == [("spawned", os.getpid())] * 2, seen
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn"):
        run_ranks(launch_ranks.setting_seen, 2, args=("X",), start_method="fork")
