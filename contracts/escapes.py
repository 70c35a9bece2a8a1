"""A ``BaseException`` from a spec's own code is an error of the case it ran in, never the end of
the run.

Note [Escaping exceptions]
    The kit wraps everything a spec runs (its factory, its inputs, its pipeline's generations) in
    ``except Exception``.  ``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit`` (and pytest's
    outcome exceptions, and any other ``BaseException``) pass through that: a factory calling
    ``sys.exit(0)`` ended ``offload-ref check`` with status 0 and no report, so a CI job passed
    while checking nothing.  The runner therefore catches ``BaseException`` around a spec's code
    and reports it as an error of the case (or of the spec's preflight), naming the exception
    and the line that raised it, with one exception: the user's own Ctrl-C.

    Telling the user's Ctrl-C from a ``KeyboardInterrupt`` that code raised: while
    :func:`telling_interrupts_apart` is active (the runner's whole run, in the main thread),
    SIGINT goes through a handler that records it before handing it to the handler it replaced
    (Python's default raises ``KeyboardInterrupt``).  A ``KeyboardInterrupt`` with no SIGINT
    recorded was raised by code, the spec's, and is an error of its case; one after a recorded
    SIGINT stops the run.  Where no handler can be installed (outside the main thread) every
    ``KeyboardInterrupt`` is taken for the user's: it stops the run, as it always did.  Where
    SIGINT is ignored or left to the system's default action, no ``KeyboardInterrupt`` can come
    from a signal, so every one is code's.

    Every place the kit calls user code catches ``BaseException`` the same way: a spec's factory,
    inputs and pipeline (above), and an ``--offloader`` factory and its offloader's ``enable()``,
    ``disable()`` and ``is_enabled()``, in the parent process (which calls the factory once per
    strategy to validate it before any case) and in the child that runs the cases.  Who raised
    it is named: the offloader's wrapper (contracts/offloader.py) marks an escaping exception
    with :func:`raised_by` (``the offloader factory m:f('hpu:0', 'layer_wise')``, ``the offloader
    m:f's enable()``) and :func:`describe` says so.  Where it lands:

    * before any case, while the parent validates the ``--offloader`` factory (or imports its
      module): a usage error, one ``offload-ref check: error: --offloader ...`` line on stderr and
      exit status 2, as for any other bad argument (no case ran, so there is no report to write);
    * while a case runs (the factory called again for the case's backend, or one of the
      offloader's methods): an error of that case in the report and the ``--json``, exit status 1;
    * a ``KeyboardInterrupt`` the kit cannot tell from the user's Ctrl-C (no SIGINT handler could
      be installed): the run stops as on Ctrl-C; the parent validates the factory inside a
      :func:`telling_interrupts_apart` section, so there a ``KeyboardInterrupt`` the factory
      raises itself is a usage error, not exit 130.
"""

from __future__ import annotations

import signal
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

__all__ = ["describe", "is_users_interrupt", "raised_at", "raised_by", "telling_interrupts_apart"]

#: how many :func:`telling_interrupts_apart` sections are active (main thread only)
_depth = 0
#: True while the active section's handler tells signals apart (False: every KeyboardInterrupt
#: is code's, SIGINT being ignored or left to the default action)
_handled = False
#: SIGINT signals received since the outermost section began
_received = 0


@contextmanager
def telling_interrupts_apart(*, once: bool = False) -> Iterator[None]:
    """Record each SIGINT before the handler it replaces sees it, for the duration
    (Note [Escaping exceptions]).  ``once``: hand only the first SIGINT on (later ones are
    recorded and dropped), for a process whose parent handles a second Ctrl-C itself."""
    global _depth, _handled, _received
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
        yield
        return
    installed = callable(previous)

    def record(signum: int, frame: FrameType | None) -> None:
        global _received
        _received += 1
        if _received == 1 or not once:
            previous(signum, frame)

    if installed:
        signal.signal(signal.SIGINT, record)
    _depth, _handled, _received = 1, installed, 0
    try:
        yield
    finally:
        _depth = 0
        if installed:
            signal.signal(signal.SIGINT, previous)


def is_users_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` should stop the run: a ``KeyboardInterrupt`` the user's Ctrl-C caused, or
    one the kit cannot tell from it (no :func:`telling_interrupts_apart` section active)."""
    if not isinstance(exc, KeyboardInterrupt):
        return False
    if threading.current_thread() is not threading.main_thread() or not _depth:
        return True
    return _handled and _received > 0


def users_interrupts() -> int:
    """How many SIGINT signals the active section recorded."""
    return _received


def _innermost(tb: TracebackType | None) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(tb)
    return frames[-1] if frames else None


def raised_at(exc: BaseException) -> str:
    """``path:line in function`` of the line that raised ``exc`` ('' when unknown)."""
    frame = _innermost(exc.__traceback__)
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else ""


_BY = "_offload_ref_raised_by"


def raised_by(exc: BaseException, who: str) -> BaseException:
    """Mark ``exc`` as raised by ``who`` (the innermost mark wins: a factory called from a
    wrapper keeps the factory's name); :func:`describe` names it.  Returns ``exc``."""
    if not getattr(exc, _BY, None):
        try:
            setattr(exc, _BY, who)
        except (AttributeError, TypeError):  # pragma: no cover - an exception without __dict__
            pass
    return exc


def describe(exc: BaseException, when: str = "") -> str:
    """``SystemExit(0) [raised by WHO] [raised WHEN] (at path:line in function)``, then what it
    would have done had the kit not caught it (one line).  WHO: the party :func:`raised_by`
    marked, if any."""
    args = ", ".join(repr(a) for a in exc.args)
    where = raised_at(exc)
    who = getattr(exc, _BY, None)
    text = (f"{type(exc).__name__}({args})" + (f" raised by {who}" if who else "")
            + (f" {'' if who else 'raised '}{when}" if when else "")
            + (f" (at {where})" if where else ""))
    if isinstance(exc, SystemExit):
        code = exc.code if exc.code is not None else 0
        return (f"{text}; a SystemExit is no Exception: uncaught, it would have ended the whole "
                f"run with exit status {code} and no report")
    if isinstance(exc, KeyboardInterrupt):
        return (f"{text}; no Ctrl-C reached the process, so the code under test raised it "
                f"itself: uncaught, it would have stopped the whole run with no report")
    return (f"{text}; a {type(exc).__name__} is no Exception: uncaught, it would have ended the "
            f"whole run with no report")
