"""A line tracer that raises at one chosen line of offload-ref's own code (issue 37, item 6):
``lines_run(fn)`` lists the distinct (file, line) places offload_ref executes inside ``fn``, in
first-run order; ``fault_at(place, exc)`` is a context in which the first execution of ``place``
raises ``exc`` instead of running it.  A trace function that raises propagates into the traced
frame at that line, and Python drops the tracer; the thread's and every other tracer are put back
afterwards."""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import offload_ref

ROOT = str(Path(offload_ref.__file__).parent)

Place = tuple[str, int]


class InjectedFault(RuntimeError):
    """The fault a line tracer raised."""


def _ours(filename: str) -> bool:
    return filename.startswith(ROOT)


#: Lines that run no operation: CPython reports a line event for their NOP, but no real exception
#: (an interrupt included: the eval loop checks for one at calls and backward jumps only) can be
#: raised there, and a tracer raising at ``try:`` inside a ``with`` skips the with's exit.
_NO_OP = ("try:", "else:", "finally:", "pass")


def _can_raise(place: Place) -> bool:
    return linecache.getline(*place).strip() not in _NO_OP


def lines_run(fn: Callable[[], Any]) -> list[Place]:
    """The distinct places of offload_ref that ``fn`` executes, in the order they first run."""
    seen: dict[Place, None] = {}

    def local(frame, event, arg):
        if event == "line":
            seen.setdefault((frame.f_code.co_filename, frame.f_lineno), None)
        return local

    def tracer(frame, event, arg):
        return local if _ours(frame.f_code.co_filename) else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return [place for place in seen if _can_raise(place)]


@contextlib.contextmanager
def fault_at(place: Place, exc: BaseException) -> Iterator[list[bool]]:
    """Raise ``exc`` the first time this thread runs ``place``; yields a one-item list that says
    whether it fired."""
    fired = [False]
    me = threading.get_ident()

    def local(frame, event, arg):
        if (event == "line" and not fired[0] and frame.f_lineno == place[1]
                and frame.f_code.co_filename == place[0] and threading.get_ident() == me):
            fired[0] = True
            raise exc
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == place[0] else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(previous)
