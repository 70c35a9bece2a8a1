"""Store-based coordination of ranks: Rendezvous rounds, DP waves, and the run_ranks launcher.

A spawn costs about 3.5 s here (mostly ``import torch`` in each rank), so the two-rank checks
share one spawn: ``_selftest.scenarios`` runs them in sequence on both ranks and returns what it
saw, and the tests below assert on that (module-scoped fixture).  The launcher's failure report
(a raising rank and a hung one) costs a second spawn.  The remaining tests run in this process:
a world of 1, argument checks, and the protocol itself on a HashStore shared by threads (the
race between a rank's timeout and a late rank's arrival).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from offload_ref.distributed import (
    LaunchError,
    RankDisagreementError,
    RankFailedError,
    Rendezvous,
    WaveMismatchError,
    WaveRunner,
    run_ranks,
)
from offload_ref.distributed import _selftest
from offload_ref.distributed.waves import run_wave
from offload_ref.fixtures import get_spec

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    start = time.monotonic()
    observed = run_ranks(_selftest.scenarios, 2, timeout_s=90.0)
    assert time.monotonic() - start < 60.0
    return observed


# -- two spawned ranks ---------------------------------------------------------------------------


def test_exchange_returns_every_ranks_value_by_rank(two_ranks):
    text = [f"rank {r}: ü\n ok:fail:{r}" for r in range(2)]
    for obs in two_ranks:
        assert obs["world"] == 2 and obs["namespace"] == "offload_ref"
        assert obs["exchange"]["raised"] is None and obs["exchange"]["value"] == text
        assert obs["exchange_again"]["value"] == ["0", "10"]
        assert obs["after_failures"]["value"] == ["again 0", "again 1"]
    assert [obs["rank"] for obs in two_ranks] == [0, 1]


def test_agree_passes_on_equal_values_and_names_the_differing_rank_on_both(two_ranks):
    for obs in two_ranks:
        assert obs["agree_equal"]["raised"] is None
        differ = obs["agree_differ"]
        assert differ["raised"] == "RankDisagreementError"
        assert differ["values"] == {0: "plan A", 1: "plan B of rank 1"}
        assert "the offload plan" in differ["message"]
        assert "rank 1: 'plan B of rank 1'" in differ["message"]
        assert f"seen by rank {obs['rank']}" in differ["message"]


def test_a_failing_rank_makes_the_other_raise_promptly_naming_it(two_ranks):
    fail = two_ranks[0]["fail"]
    assert fail["raised"] == "RankFailedError"
    assert fail["failed"] == {1: "CUDA out of memory on rank 1"}
    assert "'step'" in fail["message"] and "rank 1: CUDA out of memory on rank 1" in fail["message"]
    # rank 1 failed 0.3 s after rank 0 started waiting; the round's timeout was 30 s
    assert fail["seconds"] < 1.0, fail


def test_a_silent_rank_is_named_at_the_timeout_and_the_late_rank_does_not_proceed(two_ranks):
    silent = two_ranks[0]["silent"]
    assert silent["raised"] == "RankFailedError"
    assert silent["failed"] == {1: "did not report within 1.0 s"}
    assert "crashed, hung, or not calling 'silent'" in silent["message"]
    assert 1.0 <= silent["seconds"] < 3.0, silent
    late = two_ranks[1]["late"]  # arrives after rank 0 gave up: fails at once, no 30 s wait
    assert late["raised"] == "RankFailedError"
    assert late["failed"] == {1: "did not report within 1.0 s"}
    assert late["seconds"] < 1.0, late


def test_subgroup_rendezvous_uses_its_own_namespace(two_ranks):
    for obs in two_ranks:
        assert obs["sub_namespace"] == "offload_ref/g0,1"
        assert obs["sub_exchange"]["value"] == ["sub 0", "sub 1"]
        assert obs["all_reduce"] == 3.0  # the process group is still matched after all rounds


def test_wave_of_equal_steps_runs_each_ranks_own_request(two_ranks):
    pipeline = get_spec(_selftest.WAVE_FIXTURE).build()
    outputs = []
    for rank, obs in enumerate(two_ranks):
        assert obs["wave_equal"]["raised"] is None
        expected = pipeline(**_selftest.wave_request(rank))
        got = obs["wave_equal"]["value"]
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
        outputs.append(got)
        assert obs["calls_after_equal"] == 1
    assert not torch.equal(outputs[0], outputs[1])  # the seeds differ: two different requests


@pytest.mark.parametrize("case, steps", [
    ("wave_unequal", {0: 2, 1: 3}),
    ("wave_missing", {0: 2, 1: "missing"}),
    ("wave_bool", {0: "invalid: bool True", 1: 1}),
])
def test_wave_mismatch_is_rejected_on_every_rank_without_calling_the_pipeline(two_ranks, case,
                                                                               steps):
    for obs in two_ranks:
        seen = obs[case]
        assert seen["raised"] == "WaveMismatchError", seen
        assert seen["steps"] == steps
        for rank, value in steps.items():
            assert f"rank {rank}: {value}" in seen["message"]
        assert "Fix: pass the same explicit num_inference_steps" in seen["message"]
        assert obs["calls_at_end"] == 1  # only the equal wave reached the pipeline


def test_a_rank_that_fails_the_wave_stops_the_other_before_its_pipeline(two_ranks):
    seen = two_ranks[0]["wave_peer_failed"]
    assert seen["raised"] == "RankFailedError"
    assert seen["failed"] == {1: "no request queued on rank 1"}
    assert "'wave'" in seen["message"] and seen["seconds"] < 5.0
    assert two_ranks[0]["calls_at_end"] == 1


def test_run_ranks_reports_a_raising_rank_and_kills_the_others_soon_after():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(_selftest.raise_or_hang, 2, timeout_s=120.0)
    assert time.monotonic() - start < 30.0  # not the 120 s deadline: 2 s after rank 0 failed
    error = info.value
    assert error.ranks == [0, 1] and error.hung == [1]
    raised, hung = error.errors
    assert (raised.rank, raised.kind, raised.exc_type) == (0, "raised", "ValueError")
    assert raised.message == "boom on rank 0"
    assert "raise_or_hang" in raised.traceback
    message = str(error)
    assert "rank 0: ValueError: boom on rank 0" in message
    assert "rank 1: still running 2 s after another rank failed" in message
    assert "traceback of rank 0" in message
    assert 'raise ValueError(f"boom on rank {rank}")' in message


def test_run_ranks_kills_ranks_still_running_at_the_deadline_and_names_them():
    import launch_ranks

    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(launch_ranks.hang, 2, timeout_s=1.5)
    assert 1.5 <= time.monotonic() - start < 10.0
    assert info.value.hung == [0, 1]
    for rank in (0, 1):
        assert (f"rank {rank}: still running at the deadline, 1.5 s after the start "
                f"(timeout_s); killed" in str(info.value))


# -- one process ---------------------------------------------------------------------------------


def test_run_ranks_refuses_functions_a_spawned_rank_cannot_import():
    def local(rank, world):
        return rank

    for fn in (local, lambda rank, world: rank):
        with pytest.raises(TypeError, match="module-level function of an importable module"):
            run_ranks(fn, 2)
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(_selftest.trivial, 2, args=(threading.Lock(),))


def test_world_of_one_needs_no_store_and_waves_check_locally():
    assert not dist.is_initialized()
    rv = Rendezvous(None, 0, 1)
    assert rv.exchange("anything", "v") == ["v"]
    rv.agree("anything", "v", what="x")
    rv.fail("anything", "nobody listens")
    with pytest.raises(RuntimeError, match="not initialized"):
        Rendezvous.default()

    pipeline = _selftest.CountingPipeline(get_spec(_selftest.WAVE_FIXTURE).build())
    request = _selftest.wave_request(0)
    assert torch.equal(WaveRunner(pipeline).run(request), pipeline.pipeline(**request))
    assert pipeline.calls == 1
    for steps in (None, 0, 2.0, True, "3"):
        bad = dict(request, num_inference_steps=steps)
        with pytest.raises(WaveMismatchError, match="single process") as info:
            run_wave(pipeline, bad)
        assert list(info.value.steps) == [0] and info.value.steps[0] != 2
    del request["num_inference_steps"]
    with pytest.raises(WaveMismatchError) as info:
        WaveRunner(pipeline).run(request)
    assert info.value.steps == {0: "missing"}
    assert pipeline.calls == 1


def _threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run each call in its own thread: its return value or the exception it raised."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - observed, asserted on by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_three_ranks_disagreeing_get_one_short_diff_and_failures_merge():
    store = dist.HashStore()
    ranks = [Rendezvous(store, r, 3, timeout_s=5.0) for r in range(3)]
    long = "x" * 400
    values = [long, long, long[:250] + "Y" + long[251:]]
    out = _threads([lambda r=r: ranks[r].agree("fp", values[r], what="plan fingerprint")
                    for r in range(3)])
    for r, exc in enumerate(out):
        assert isinstance(exc, RankDisagreementError)
        assert exc.values == dict(enumerate(values))
        assert "ranks 0, 1:" in str(exc) and "rank 2: differs at char 250" in str(exc)
        assert len(str(exc)) < 600
    # two ranks gave up the round before the third arrives: it names both, with their reasons
    ranks[1].fail("go", "bad plan")
    ranks[2].fail("go", "no memory")
    with pytest.raises(RankFailedError) as info:
        ranks[0].exchange("go", "ok")
    assert info.value.failed == {1: "bad plan", 2: "no memory"}
    assert "decided by rank 1" in str(info.value)


def test_a_timeout_racing_a_late_arrival_never_splits_the_ranks():
    """Rank 0 times out at about the moment rank 1 arrives: both proceed or both raise."""
    outcomes = set()
    for i in range(20):
        store = dist.HashStore()
        waiting = Rendezvous(store, 0, 2, timeout_s=0.02, poll_s=0.001)
        late = Rendezvous(store, 1, 2, timeout_s=5.0, poll_s=0.001)
        delay = 0.003 * i  # from well before to well after rank 0's 20 ms deadline
        out = _threads([lambda: waiting.exchange("t", "a"),
                        lambda: (time.sleep(delay), late.exchange("t", "b"))[1]])
        kinds = tuple("ok" if isinstance(o, list) else type(o).__name__ for o in out)
        assert kinds in {("ok", "ok"), ("RankFailedError", "RankFailedError")}, (delay, out)
        outcomes.add(kinds[0])
    assert outcomes == {"ok", "RankFailedError"}  # both sides of the race were exercised
