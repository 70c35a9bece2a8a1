"""How a failure of work queued on a CPU-platform stream reaches the host (Note [Stream failures
keep their type])."""

from __future__ import annotations

__all__ = ["StreamWorkError", "stream_failure"]


class StreamWorkError(RuntimeError):
    """Work queued on a CPU stream failed; the stream skips all later work.  Raised as a class
    that is also the failure's own type where it can be (Note [Stream failures keep their
    type]), so ``except OffloadScheduleError`` catches a schedule error raised on a stream."""


#: failure type -> its StreamWorkError subclass (None: the type cannot be combined)
_FAILURE_TYPES: dict[type, type | None] = {}


def _failure_type(cause: BaseException) -> type:
    """Note [Stream failures keep their type]: work on a stream's worker thread fails there,
    and the host learns of it at its next wait, as a fresh error (tracebacks would pile up on
    one).  That error was a plain RuntimeError with the failure as ``__cause__``, so a caller's
    ``except OffloadScheduleError`` (the documented type) missed it.  It is now an instance of
    a class deriving from both :class:`StreamWorkError` and the failure's type, for any
    ``Exception`` whose type allows it; else a plain :class:`StreamWorkError`."""
    kind = type(cause)
    if kind not in _FAILURE_TYPES:
        combined: type | None = None
        if isinstance(cause, Exception) and not issubclass(kind, StreamWorkError):
            try:
                combined = type(kind.__name__, (StreamWorkError, kind), {
                    "__init__": BaseException.__init__, "__str__": BaseException.__str__,
                    "__module__": kind.__module__, "__qualname__": kind.__qualname__})
            except TypeError:  # incompatible layouts (OSError's fields, say)
                combined = None
        _FAILURE_TYPES[kind] = combined
    return _FAILURE_TYPES[kind] or StreamWorkError


def stream_failure(stream_name: str, cause: BaseException) -> RuntimeError:
    """A fresh error for a failed stream (fresh each time, so tracebacks do not pile up), of
    the failure's own type where it can be (Note [Stream failures keep their type])."""
    error = _failure_type(cause)(
        f"work queued on CPU stream '{stream_name}' failed with "
        f"{type(cause).__name__}: {cause}; the stream skips all later work"
    )
    error.__cause__ = cause
    return error
