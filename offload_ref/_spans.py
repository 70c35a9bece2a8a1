"""Profiler spans: every copy, collective, wait and block compute of the offloader is a
``torch.profiler.record_function`` range, so it shows up in a user's own ``torch.profiler``
trace next to their kernels.

Note [Spans]
    A span costs one bool read when no profiler runs: each helper checks
    ``torch.autograd.profiler._is_profiler_enabled`` (a module global that ``torch.profiler``
    sets for the whole process while it profiles, on every thread; the C++
    ``torch._C._autograd._profiler_enabled()`` is thread-local and reads False on threads the
    profiler does not know) and returns None, so the name is never built.  Spans are opened and
    closed by plain calls: a context manager's two method calls would cost more than the check.

    Names are ``offload_ref.<kind> <where>``: kinds ``copy`` (a host to device fill),
    ``collective`` (an AllGather), ``wait`` (compute waits for a slot's copy: on the CPU platform
    a host block, so a stall is a long wait span) and ``block`` (a block's forward, from its
    pre-hook to its post-hook); ``where`` is ``ring=<ring label> block=<k> slot=<s>`` for ring
    work and ``component=<label>`` for model-level swaps.

    :func:`stream_enter` / :func:`stream_exit` ranges are ordered on the *current stream*: their
    enter and exit are ``platform.submit`` ted around the work, so on the CPU platform they run
    on the copy stream's worker thread, exactly around the copies (their own thread track in the trace), and on CUDA
    they run on the issuing thread at issue time (the copies themselves are the memcpy kernels on
    the copy stream's lane).  torch records ranges of a thread it did not start the profile on
    only under ``_ExperimentalConfig(profile_all_threads=True)`` (what ``offload-ref trace``
    passes).
"""

from __future__ import annotations

import functools
from typing import Any

from torch.autograd import profiler as _profiler

__all__ = ["enabled", "enter", "exit", "stream_enter", "stream_exit"]


def enabled() -> bool:
    """Whether a profiler runs in this process (on any thread)."""
    return _profiler._is_profiler_enabled


def _name(kind: str, fmt: str, args: tuple[Any, ...]) -> str:
    return f"offload_ref.{kind} {fmt % args}"


def enter(kind: str, fmt: str, *args: Any) -> Any:
    """Open a range on the calling thread, closed by :func:`exit` (a block's pre-hook to its
    post-hook, a wait); None when no profiler runs.  No context manager: when off, a span is two
    calls that each read one bool.  A range left open by an exception ends when its handle is
    collected."""
    if not _profiler._is_profiler_enabled:
        return None
    rf = _profiler.record_function(_name(kind, fmt, args))
    rf.__enter__()
    return rf


def exit(rf: Any) -> None:  # noqa: A001 (pairs with enter)
    if rf is not None:
        rf.__exit__(None, None, None)


def stream_enter(platform: Any, kind: str, fmt: str, *args: Any) -> Any:
    """Open a range ordered on ``platform``'s current stream, before the work issued next (Note
    [Spans]); close it with :func:`stream_exit` on the same stream.  None when no profiler runs."""
    if not _profiler._is_profiler_enabled:
        return None
    rf = _profiler.record_function(_name(kind, fmt, args))
    platform.submit(rf.__enter__)
    return rf


def stream_exit(platform: Any, rf: Any) -> None:
    if rf is not None:
        platform.submit(functools.partial(rf.__exit__, None, None, None))
