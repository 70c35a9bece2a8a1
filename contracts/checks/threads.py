"""§J.6: a second thread calling an enabled pipeline gets a clear error or an exact output, and
the first thread's generation stays exact; judged against the pipeline itself serving the same two
calls with no offloader."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from offload_ref.discovery import get_submodule_path

from ..facts import first_dit
from ..observe import calls_in_a_fresh_generation, observe, output_mismatch
from ..registry import check, fail, not_applicable
from .lifecycle import SINGLE_PROCESS


def _pause_point(case: Any, pipeline: Any) -> tuple[str, nn.Module]:
    """Where the first thread waits: inside the last streamed block, at its last submodule that
    holds weights (layerwise: the block's own hooks and its parts' have run, its forward is under
    way, and a second generation would rebind its slot to another block), or inside the first DiT
    (model level; for a split model, inside its first component context:
    :func:`_first_called_inside`)."""
    plan = case.resolve(pipeline)
    rings = [s for s in plan.rings if len(s.streamed_blocks) >= 2]
    if rings:
        ring = rings[0]
        block, path = ring.streamed_blocks[-1], ring.block_paths[-1]
        owners = [(f"{path}.{name}" if name else path, sub)
                  for name, sub in block.named_modules()
                  if any(True for _ in sub.parameters(recurse=False))]
        return owners[-1] if owners else (path, block)
    dit = next((c for c in plan.components if c.role == "dit"), None)
    if dit is None:  # a split model delegates model level: its plan lists no component
        return _first_called_inside(case, pipeline, *first_dit(pipeline))
    return dit.path, dit.module


def _first_called_inside(case: Any, pipeline: Any, path: str, dit: nn.Module
                         ) -> tuple[str, nn.Module]:
    """The DiT's tensor-owning submodule a generation calls first, in ``pipeline``.  A split
    model calls it inside its first component context, so a thread waiting there holds that
    context while a second generation swaps the phases (and ends on another phase, as Cosmos3's
    reasoner-then-generator does): without a guard the first thread resumes on weights swapped
    out.  (The DiT's own forward hook fires before any context is entered, and a thread waiting
    in the last phase resumes on weights the second generation swapped back.)  Found on a fresh
    pipeline run on the host; the DiT itself when none of its submodules owns tensors."""
    calls = calls_in_a_fresh_generation(case, lambda fresh: [
        (name, sub) for name, sub in get_submodule_path(fresh, path).named_modules()
        if name and any(True for _ in sub.parameters(recurse=False))])
    if not calls:
        return path, dit
    return f"{path}.{calls[0]}", dit.get_submodule(calls[0])


def _same_threads(fn: Any) -> Any:
    """``fn`` for another thread, with this thread's intra-op thread count (OpenMP keeps it per
    thread: a fresh thread would use every core and split reductions differently)."""
    n = torch.get_num_threads()

    def run(*args: Any) -> Any:
        torch.set_num_threads(n)
        return fn(*args)

    return run


def _in_thread(fn: Any) -> Any:
    """``fn()`` run in a fresh thread (as the first thread of the check runs)."""
    box: dict[str, Any] = {}

    @_same_threads
    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    if "error" in box:
        raise box["error"]
    return box["out"]


def _two_calls(case: Any, pipeline: Any, path: str, module: nn.Module) -> dict[str, Any]:
    """A first thread's generation on ``pipeline``, paused at ``path`` (``module``), and a second
    generation in this thread meanwhile; then the first is released.  What happened: ``entered``
    (the first thread reached ``path``), ``second`` or ``second_error``, ``first`` or
    ``first_error``, ``alive`` (the first thread had not finished after its release)."""
    entered, release = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def pause(p: str, m: nn.Module) -> None:
        if threading.current_thread().name == "offload-ref-first" and not entered.is_set():
            entered.set()
            release.wait(timeout=30)

    @_same_threads
    def first() -> None:
        try:
            result["first"] = case.run(pipeline)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            result["first_error"] = exc

    with observe([(path, module)], pause):
        thread = threading.Thread(target=first, name="offload-ref-first", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not entered.wait(timeout=0.05) and thread.is_alive() and \
                time.monotonic() < deadline:
            pass
        result["entered"] = entered.is_set()
        try:
            if result["entered"]:
                try:
                    result["second"] = case.run(pipeline)
                except Exception as exc:  # noqa: BLE001 - judged by the caller
                    result["second_error"] = exc
        finally:
            release.set()
            thread.join(timeout=30)
    result["alive"] = thread.is_alive()
    return result


def _refused(error: BaseException | None) -> bool:
    """Whether the second call's error is a clear refusal of a concurrent call."""
    return isinstance(error, RuntimeError) and "thread" in str(error)


def _judge_two_calls(case: Any, got: dict[str, Any], reference: Any, threaded_reference: Any,
                     pipeline: Any) -> None:
    error = got.get("second_error")
    if error is not None and not _refused(error):
        fail(f"the second thread got an error that does not say it is a concurrent call: "
             f"{type(error).__name__}: {error}", severity="error")
    if error is None:
        case.compare("second thread (served while another was inside)", got["second"],
                     reference)
    if got["alive"]:
        fail("the first thread did not finish after it was released")
    if "first_error" in got:
        fail(f"the first thread's generation failed: {type(got['first_error']).__name__}: "
             f"{got['first_error']}", severity="error")
    case.compare("first thread", got["first"], threaded_reference)
    case.compare("afterwards, one thread", case.run(pipeline), reference)


def _went_wrong(got: dict[str, Any], reference: Any, threaded_reference: Any
                ) -> tuple[tuple[str, ...], str] | None:
    """How a two-call run went wrong, first thing first: ``(kind, what)``, the kind comparable
    between runs (which thread, error or mismatch, the exception's type) and the words for it;
    None when both calls came out exact."""
    if got["alive"]:
        return ("alive",), "the first thread did not finish"
    for who in ("second", "first"):
        error = got.get(f"{who}_error")
        if error is not None:
            return ((who, "error", type(error).__name__),
                    f"the {who} thread's generation failed: {type(error).__name__}: {error}")
    for who, want in (("second", reference), ("first", threaded_reference)):
        mismatch = output_mismatch(f"{who} thread", got[who], want)
        if mismatch is not None:
            return (who, "mismatch"), mismatch.splitlines()[0]
    return None


def _without_offloading(case: Any, path: str, reference: Any, threaded_reference: Any
                        ) -> tuple[tuple[str, ...], str] | None:
    """How the pipeline itself, with no offloader, goes wrong serving the same two calls
    (:func:`_went_wrong`; None: both come out exact, or the first never got there)."""
    resident = case.build_resident()
    got = _two_calls(case, resident, path, get_submodule_path(resident, path))
    case.forget_runs()
    if not got["entered"]:
        return None  # it never got there: nothing to compare the offloaded run with
    return _went_wrong(got, reference, threaded_reference)


@check("J.6", strategies=SINGLE_PROCESS)
def check_second_thread_gets_a_clear_error_or_exact_output(case) -> None:
    """A second thread calling a pipeline while another thread is inside one of its offloaded
    modules gets a clear error (or an exact output), and the first thread's generation stays
    exact; afterwards a single-threaded generation is exact again, and ``disable()`` leaves no
    device bytes allocated (a split model delegating model level to its component groups
    too).  A run that goes wrong is judged against the pipeline itself serving the same two
    calls with no offloader: where that goes wrong the same way (the same thread, the same
    exception type or a mismatch; a pipeline whose scheduler keeps per-call state on itself),
    the pipeline cannot be called from two threads at once and the check does not apply;
    otherwise the offloader is at fault."""
    from ..registry import CheckFailure

    reference = case.reference()
    threaded_reference = _in_thread(lambda: case.run(case.build_resident()))
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    path, module = _pause_point(case, pipeline)
    got = _two_calls(case, pipeline, path, module)
    if not got["entered"]:
        if "first_error" in got:  # its generation failed before it got there: say how
            raise got["first_error"]
        fail(f"the first thread never reached {path}")
    try:
        _judge_two_calls(case, got, reference, threaded_reference, pipeline)
    except CheckFailure as failure:
        if _refused(got.get("second_error")):  # the pipeline's concurrency never came into play
            why = "it refused the second call, so no second generation ran on the pipeline"
        else:
            own = _without_offloading(case, path, reference, threaded_reference)
            mine = _went_wrong(got, reference, threaded_reference)
            if own is None:
                why = "the pipeline alone, with no offloader, served the same two calls exactly"
            elif mine is None or mine[0] != own[0]:
                why = (f"the pipeline alone, with no offloader, goes wrong another way serving "
                       f"the same two calls ({own[1]}), and this run did not go wrong that way")
            else:  # went wrong exactly as the pipeline alone does: the pipeline's own
                backend.disable()
                not_applicable(
                    f"the pipeline cannot serve two concurrent generations itself: with no "
                    f"offloader, a second generation while a first one was inside {path} went "
                    f"wrong ({own[1]}); the offloader served the second call and went wrong the "
                    f"same way, so this check cannot judge it")
        raise CheckFailure(f"{failure}\n  at fault: the offloader {case.impl.name}: {why}",
                           failure.severity) from None
    backend.disable()
    if case.impl.capabilities.internals and platform.memory_allocated():
        fail(f"after two threads and disable(), {platform.memory_allocated()} device bytes stay "
             "allocated: nothing may stay on the device after disable(), whatever threads did")
