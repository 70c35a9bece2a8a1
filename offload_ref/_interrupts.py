"""Ctrl-C during ``enable`` and ``disable``.

Note [Deferred interrupts]
    ``KeyboardInterrupt`` lands between any two bytecodes of the main thread.  Inside
    ``disable()`` that meant half a disable: blocks rebound to their restored weights while
    their neighbours still had hooks (the next generations read NaN), a swapper that had freed
    some device buffers and not others (every later call failed), guarded classes left on
    tensors of a pipeline that was no longer offloaded.  Inside ``enable()`` it could land
    between a hook's registration and the undo entry that removes it, leaving a hook that no
    rollback removed and that made every later enable fail.

    So ``enable()`` and ``disable()`` run with SIGINT deferred: while :func:`deferred_interrupts`
    is active, the main thread's SIGINT handler only records the signal.  ``disable()`` runs to
    its end and then raises the ``KeyboardInterrupt`` (the pipeline is plain, the backend
    disabled).  ``enable()`` stays interruptible where that is safe: at :func:`interruption_point`
    calls (between the copies that build host masters, and once before commit), a recorded
    signal is raised as ``KeyboardInterrupt`` inside the transaction, which rolls everything
    back and re-raises it.  After the section the previous handler is back, and a signal still
    recorded is delivered to it (the default one raises ``KeyboardInterrupt``).

    Only real signals are deferred: the handler can be replaced only in the main thread, and
    only there does Python deliver SIGINT.  In other threads the context does nothing.  A
    previous handler that is not callable (``SIG_IGN``, ``SIG_DFL``) is left alone.  Nested
    sections share the outermost one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["deferred_interrupts", "interruption_point"]

_depth = 0  # main thread only
_pending: list[tuple[int, FrameType | None]] = []
_previous: Any = None  # the handler the outermost section replaced


def _record(signum: int, frame: FrameType | None) -> None:
    _pending.append((signum, frame))


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Record SIGINT instead of raising it for the duration (Note [Deferred interrupts])."""
    global _depth, _previous
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    try:
        previous: Any = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - no signal support here
        previous = None
    if not callable(previous):
        yield
        return
    signal.signal(signal.SIGINT, _record)
    _depth, _previous = 1, previous
    try:
        yield
    finally:
        _depth, _previous = 0, None
        signal.signal(signal.SIGINT, previous)
        _deliver(previous)


def _deliver(handler: Any) -> None:
    if _pending:
        signum, frame = _pending[0]
        _pending.clear()
        handler(signum, frame)  # the default handler raises KeyboardInterrupt


def interruption_point() -> None:
    """Raise ``KeyboardInterrupt`` here if SIGINT was recorded while deferred: a place where
    stopping is safe (Note [Deferred interrupts])."""
    if _pending and _previous is not None and \
            threading.current_thread() is threading.main_thread():
        _deliver(_previous)
