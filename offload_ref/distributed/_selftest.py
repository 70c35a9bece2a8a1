"""Rank functions for tests/test_rendezvous.py and for measuring a spawn.

They live in the package because :func:`~offload_ref.distributed.launch.run_ranks` spawns its
ranks, which import the rank function by module name, and tests/ is not a package.  Each
returns plain observations (types, messages, attributes, tensors) for the parent to assert on,
so that a failed expectation shows up as a test failure in the parent, not as a rank error.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .rendezvous import RankDisagreementError, RankFailedError, Rendezvous
from .waves import WaveMismatchError, WaveRunner

WAVE_FIXTURE = "flux2"
WAVE_STEPS = 2


def wave_request(rank: int, steps: Any = WAVE_STEPS) -> dict[str, Any]:
    """Rank ``rank``'s request of a wave: the fixture's inputs, a seed of its own, ``steps``."""
    from offload_ref.fixtures import get_spec

    request = get_spec(WAVE_FIXTURE).make_inputs()
    request["generator_seed"] = 100 + rank
    request["num_inference_steps"] = steps
    return request


class CountingPipeline:
    """Counts the calls that reach the wrapped pipeline."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.calls = 0

    def __call__(self, **request: Any) -> Any:
        self.calls += 1
        return self.pipeline(**request)


def _catch(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` did: its return value, or the error's type, message and attributes."""
    start = time.monotonic()
    try:
        value = call()
    except (RankFailedError, RankDisagreementError, WaveMismatchError) as exc:
        extra = {name: getattr(exc, name) for name in ("failed", "values", "steps")
                 if hasattr(exc, name)}
        return {"raised": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - start, **extra}
    return {"raised": None, "value": value, "seconds": time.monotonic() - start}


def trivial(rank: int, world: int) -> int:
    return rank


def rank_cpu_seconds(rank: int, world: int) -> float:
    """The CPU time this rank's process has used so far (ci/run_ranks_cost.py)."""
    return time.process_time()


def raise_or_hang(rank: int, world: int) -> None:
    """Rank 0 raises at once; the others never return."""
    if rank == 0:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(3600)


def scenarios(rank: int, world: int) -> dict[str, Any]:
    """Every two-rank check of tests/test_rendezvous.py, in sequence, on both ranks."""
    assert world == 2, world
    rv = Rendezvous.default(timeout_s=30.0)
    obs: dict[str, Any] = {"rank": rank, "world": rv.world, "namespace": rv.namespace}

    # Values of any text come back by rank, round after round.
    obs["exchange"] = _catch(lambda: rv.exchange("hello", f"rank {rank}: ü\n ok:fail:{rank}"))
    obs["exchange_again"] = _catch(lambda: rv.exchange("hello", str(10 * rank)))
    obs["agree_equal"] = _catch(lambda: rv.agree("plan", "same plan", what="the offload plan"))
    obs["agree_differ"] = _catch(lambda: rv.agree(
        "plan", "plan A" if rank == 0 else "plan B of rank 1", what="the offload plan"))

    # A rank that gives up: the other, already waiting, raises promptly.
    if rank == 1:
        time.sleep(0.3)
        rv.fail("step", "CUDA out of memory on rank 1")
    else:
        obs["fail"] = _catch(lambda: rv.exchange("step", "ready"))

    # A silent rank: the other raises at its 1 s timeout; the late rank then raises at once.
    quick = Rendezvous.default(timeout_s=1.0)
    if rank == 0:
        obs["silent"] = _catch(lambda: quick.exchange("silent", "ready"))
        rv.exchange("sync", "")
    else:
        rv.exchange("sync", "")  # returns once rank 0 has given up on "silent"
        obs["late"] = _catch(lambda: rv.exchange("silent", "late"))

    # Rounds of the same topics still work after all that.
    obs["after_failures"] = _catch(lambda: rv.exchange("hello", f"again {rank}"))

    # A subgroup rendezvous keeps its keys apart.
    group = dist.new_group([0, 1])
    sub = Rendezvous.default(group, timeout_s=30.0)
    obs["sub_namespace"] = sub.namespace
    obs["sub_exchange"] = _catch(lambda: sub.exchange("hello", f"sub {rank}"))

    # Waves (rendezvous=None: Rendezvous.default()).
    from offload_ref.fixtures import get_spec

    pipeline = CountingPipeline(get_spec(WAVE_FIXTURE).build())
    runner = WaveRunner(pipeline)
    obs["wave_equal"] = _catch(lambda: runner.run(wave_request(rank)))
    obs["calls_after_equal"] = pipeline.calls
    obs["wave_unequal"] = _catch(lambda: runner.run(wave_request(rank, 2 if rank == 0 else 3)))
    missing = wave_request(rank)
    if rank == 1:
        del missing["num_inference_steps"]
    obs["wave_missing"] = _catch(lambda: runner.run(missing))
    obs["wave_bool"] = _catch(lambda: runner.run(wave_request(rank, True if rank == 0 else 1)))
    if rank == 1:
        runner.fail("no request queued on rank 1")
    else:
        obs["wave_peer_failed"] = _catch(lambda: runner.run(wave_request(rank)))
    obs["calls_at_end"] = pipeline.calls

    # The process group is still matched: one collective, every rank.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    obs["all_reduce"] = total.item()
    return obs
