"""Run a function on N local ranks, each in its own process (tests and the kit).

:func:`run_ranks` starts ``world`` processes; each initializes a process group on a
:class:`torch.distributed.FileStore` in a temporary directory (no ports, so runs in parallel never
collide), calls ``fn(rank, world, *args)`` and hands its result back through a pickle file.  The
parent waits until a deadline, and reports every rank's failure in one :class:`LaunchError`: the
ranks that raised (type, message, traceback), those that died without a result, and those still
running at the deadline (killed).

``fn`` must be a module-level function of an importable module (the child finds it by name).
Note [Forked from a server]: how the ranks start.
"""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

__all__ = ["LaunchError", "RankError", "run_ranks"]

# Once a rank has failed, the others are usually blocked in a collective that will never match,
# or about to raise RankFailedError themselves: they get this long to finish (and report their
# own error) before being killed.  The deadline still applies if it is sooner.
_AFTER_FAILURE_S = 2.0
_TRACEBACK_CHARS = 8000

# Note [Forked from a server]
#     A spawned rank starts a fresh interpreter and imports torch: about 1.6 s of CPU per rank
#     on the 2-core test machine, most of a two-rank check's cost (the kit's §H batch of every
#     pipeline, the distributed tests).  So ranks start the way Python 3.14 starts processes on
#     Linux by default: from multiprocessing's fork server, a single-threaded process started
#     once per parent process with torch imported and nothing run (no thread pool, no device,
#     no process group), which forks each rank.  multiprocessing hands a forked rank what spawn
#     hands it (the parent's sys.path and working folder at the call, its main module run
#     again); what a fork of the long-lived server would otherwise get wrong, the rank adopts
#     from _RankSetting: the parent's environment at the call, and its stdout and stderr at
#     the call (duplicated file descriptors, so output lands where the parent's would, a
#     pytest capture included).  ``fn`` and ``args`` travel pickled and are unpickled after
#     that, so a module that reads the environment when imported sees the parent's.  The
#     server is multiprocessing's own, one per process: run_ranks sets its preload list.
_PRELOAD = ["torch", "torch.distributed", "offload_ref.distributed.launch"]


_START_METHODS = ("forkserver", "spawn")


def _context(start_method: str) -> Any:
    """The multiprocessing context of the ranks (Note [Forked from a server])."""
    import multiprocessing

    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, once per process
    return ctx


def _adopt(stdout: Any, stderr: Any, env: dict[str, str]) -> None:
    """In the rank, while its arguments are unpickled: the parent's setting (_RankSetting)."""
    for fd, dup in ((1, stdout), (2, stderr)):
        own = dup.detach()
        if own != fd:  # spawn passes the parent's own descriptors
            os.dup2(own, fd)
            os.close(own)
    os.environ.clear()
    os.environ.update(env)


class _RankSetting:
    """What a rank takes from its parent at the call (Note [Forked from a server]): pickles
    as the parent's current environment and its stdout and stderr (duplicated for the child),
    which the child adopts as it is unpickled."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _adopt, (reduction.DupFd(1), reduction.DupFd(2), dict(os.environ))


@dataclass(frozen=True)
class RankError:
    """How one rank failed: ``kind`` is "raised", "died" (no result) or "hung" (killed)."""

    rank: int
    kind: str
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None

    def summary(self) -> str:
        if self.kind == "raised":
            return f"rank {self.rank}: {self.exc_type}: {self.message}"
        if self.kind == "hung":
            return f"rank {self.rank}: {self.message}"
        return f"rank {self.rank}: {self.message} (exit code {self.exitcode})"


class LaunchError(RuntimeError):
    """At least one rank of :func:`run_ranks` failed.  ``errors``: one :class:`RankError` per
    failed rank, by rank; ``hung``: the ranks killed at the deadline."""

    def __init__(self, message: str, errors: list[RankError]) -> None:
        super().__init__(message)
        self.errors = errors
        self.hung = [e.rank for e in errors if e.kind == "hung"]

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.errors]


def _check_importable(fn: Callable[..., Any]) -> None:
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    where = f"{module_name}.{qualname}" if module_name else repr(fn)
    if not callable(fn) or module_name is None or qualname is None:
        raise TypeError(f"run_ranks: fn must be a module-level function, got {fn!r}")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"run_ranks: fn {where} is a lambda or a function defined inside another function; "
            f"the ranks import fn by name, so it must be a module-level function of an "
            f"importable module (e.g. offload_ref.distributed._selftest)")
    if module_name == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise TypeError(f"run_ranks: fn {where} lives in an interactive __main__, which the "
                        f"ranks cannot import; move it to a module")
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError as exc:
        raise TypeError(f"run_ranks: the module of fn ({module_name}) is not importable: "
                        f"{exc}") from exc
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not fn:
        raise TypeError(f"run_ranks: {where} does not name fn in its module (a decorated or "
                        f"rebound function?); the ranks would import something else")


def _rank_main(rank: int, world: int, setting: None, payload: bytes, store_path: str,
               result_path: str, backend: str, threads: int, timeout_s: float,
               collective_timeout_s: float) -> None:
    """A rank: the parent's setting (adopted while ``setting`` was unpickled), process group
    up, ``fn``, result file, process group down."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    outcome: tuple = ("ok",)
    try:
        from offload_ref.platform import simulated

        # before any process group: torch looks its accelerator hooks up once per process (and
        # before the arguments, which may hold its tensors)
        simulated.available()
        fn, args = pickle.loads(payload)
        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        # Note [Every rank is up before any leaves]: gloo connects the ranks pairwise inside
        # init_process_group, and a rank whose connections are done returns before its peers'
        # are; a rank that then runs no collective could destroy the group and exit while a
        # slower peer was still connecting to it ("Gloo connectFullMesh failed ... Connection
        # closed by peer", seen in CI under load on the docs' run_ranks example).  Each rank
        # waits on the store until every rank has returned from init_process_group.
        store.set(f"offload_ref/up/{rank}", "1")
        store.wait([f"offload_ref/up/{r}" for r in range(world)],
                   datetime.timedelta(seconds=collective_timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:
            raise TypeError(f"the result of rank {rank} is not picklable: "
                            f"{type(exc).__name__}: {exc}") from exc
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit included
        outcome = ("err", type(exc).__qualname__, str(exc), traceback.format_exc())
        payload = pickle.dumps(outcome)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, result_path)
    if outcome[0] == "err":
        raise SystemExit(1)  # the parent sees a failure from the exit code alone


def _read_result(path: Path) -> tuple | None:
    from offload_ref.platform import simulated

    simulated.available()  # a rank's result may hold simulated-accelerator tensors
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def run_ranks(fn: Callable[..., Any], world: int = 2, *, args: tuple = (),
              timeout_s: float = 120.0, backend: str = "gloo", threads: int = 1,
              workdir: str | os.PathLike | None = None,
              collective_timeout_s: float | None = None,
              start_method: str = "forkserver") -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks, each a process of its own; their results,
    by rank.

    Raises :class:`LaunchError` naming every rank that raised (with the first traceback), died
    without a result, or was still running ``timeout_s`` after the start (killed).  ``workdir``
    holds the store and result files (a fresh temporary directory, removed after, by default).
    ``collective_timeout_s`` is the process group's timeout (default ``timeout_s``): a collective
    that a peer never matches raises after it, instead of waiting for the deadline.
    ``start_method``: "forkserver" (ranks forked from a server with torch imported, Note [Forked
    from a server]; spawn where the platform has no fork server) or "spawn" (a fresh interpreter
    per rank, about 1.6 s of CPU more a rank).
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"run_ranks: world must be an int >= 1, got {world!r}")
    if not timeout_s > 0:
        raise ValueError(f"run_ranks: timeout_s must be > 0, got {timeout_s!r}")
    if start_method not in _START_METHODS:
        raise ValueError(f"run_ranks: start_method must be one of {', '.join(_START_METHODS)}, "
                         f"got {start_method!r}")
    _check_importable(fn)
    args = tuple(args)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_ranks: fn and args must be picklable to reach the ranks: "
                        f"{type(exc).__name__}: {exc}") from exc

    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="offload_ref_ranks_") if own_dir else workdir)
    root.mkdir(parents=True, exist_ok=True)
    store_path = str(root / "store")
    results = [root / f"rank{r}.pkl" for r in range(world)]
    for path in (*results, Path(store_path)):
        path.unlink(missing_ok=True)
    ctx = _context(start_method)
    start = time.monotonic()
    deadline = start + timeout_s
    procs = []
    try:
        for r in range(world):
            proc = ctx.Process(target=_rank_main, name=f"offload_ref-rank{r}", daemon=True,
                               args=(r, world, _RankSetting(), payload, store_path,
                                     str(results[r]), backend,
                                     threads, timeout_s,
                                     timeout_s if collective_timeout_s is None
                                     else collective_timeout_s))
            proc.start()
            procs.append(proc)
        first_failure: float | None = None
        while True:
            running = [p for p in procs if p.is_alive()]
            if not running:
                break
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            limit = deadline if first_failure is None else min(deadline,
                                                               first_failure + _AFTER_FAILURE_S)
            if now >= limit:
                break
            wait([p.sentinel for p in running], timeout=min(0.05, limit - now))
        errors: list[RankError] = []
        outputs: list[Any] = []
        elapsed = time.monotonic() - start
        hung = [proc.is_alive() for proc in procs]
        _stop([proc for proc, alive in zip(procs, hung) if alive])
        for r, proc in enumerate(procs):
            if hung[r]:
                why = (f"still running at the deadline, {timeout_s} s after the start "
                       f"(timeout_s); killed" if first_failure is None or elapsed >= timeout_s else
                       f"still running {_AFTER_FAILURE_S:.0f} s after another rank failed "
                       f"(blocked in an unmatched collective?); killed")
                errors.append(RankError(r, "hung", message=why))
                outputs.append(None)
                continue
            outcome = _read_result(results[r])
            if outcome is None:
                errors.append(RankError(r, "died", message="exited without a result",
                                        exitcode=proc.exitcode))
                outputs.append(None)
            elif outcome[0] == "err":
                _, exc_type, message, tb = outcome
                errors.append(RankError(r, "raised", exc_type, message, tb, proc.exitcode))
                outputs.append(None)
            else:
                outputs.append(outcome[1])
        if errors:
            raise LaunchError(_launch_message(fn, world, errors), errors)
        return outputs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


def _stop(procs: list[Any]) -> None:
    """SIGTERM every process, then SIGKILL those still alive a moment later."""
    for proc in procs:
        proc.terminate()
    end = time.monotonic() + 2.0
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _launch_message(fn: Callable[..., Any], world: int, errors: list[RankError]) -> str:
    name = f"{fn.__module__}.{fn.__qualname__}"
    lines = [f"run_ranks({name}, world={world}): {len(errors)} of {world} ranks failed:"]
    lines += [f"  {e.summary()}" for e in errors]
    first = next((e for e in errors if e.traceback), None)
    if first is not None:
        tb = first.traceback
        if len(tb) > _TRACEBACK_CHARS:
            tb = "...\n" + tb[-_TRACEBACK_CHARS:]
        lines.append(f"traceback of rank {first.rank}:")
        lines.append(tb.rstrip())
    return "\n".join(lines)
