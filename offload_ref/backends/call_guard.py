"""The call guard: an enabled pipeline serves one thread at a time.

Note [One thread at a time]
    An enabled pipeline serves one thread at a time.  Every offload hook *enters* the backend's
    :class:`CallGuard` before it touches a ring or a swap group and *exits* it after the module's
    forward.  A hook that fires in thread B while thread A is inside an offloaded module's forward
    raises :class:`OffloadConcurrencyError` in B before anything changes, so A's generation
    stays correct.  ``disable()`` and ``edit_weights()`` take the guard exclusively: they wait
    until no other thread is inside an offloaded forward, and hooks that fire meanwhile wait for
    them and then leave the module alone.  The guard's class is a policy of its owner:
    ``OffloadBackend.call_guard_class``, ``ComponentGroups.call_guard_class`` (one guard per
    enable).

    torch skips ``always_call`` forward hooks for a ``BaseException`` (Ctrl-C), so an entry can
    outlive its forward.  Each entry records the frame of the ``nn.Module.__call__`` running
    it; an entry whose frame is no longer on its thread's stack is stale and dropped.  Frames are
    only inspected on a conflict, so the steady state costs a lock and a list append per call.

Note [Guard locking]
    The hooks take the guard's lock (the condition's own lock, a C lock) directly: a
    Condition's ``with`` costs two Python calls, twice per block.  A ``with`` statement runs its
    lock's ``__exit__`` on a line of its own, the ``with`` line again, and an interrupt delivered
    there (a tracer's line event) would skip the release.  So each locked section is one line,
    ``with lock: return self._locked_part(...)``: the body is a call, and no line starts between
    its return and the release.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType

from torch import nn

__all__ = [
    "CallGuard",
    "OffloadConcurrencyError",
    "call_frame",
]


class OffloadConcurrencyError(RuntimeError):
    """A second thread called a pipeline while another thread was inside one of its offloaded
    modules (Note [One thread at a time])."""



_CALL_CODE = nn.Module._call_impl.__code__
_get_ident = threading.get_ident


# A hook is always reached through the same torch frames.  torch (2.x) calls hooks from the
# nested ``inner`` of ``_call_impl``, so the caller's caller is checked for that code first; then
# the depth this caller's code had last time (one ``sys._getframe(depth)`` materializes one frame
# object, where walking ``f_back`` materializes every frame on the way), and then the walk.  The
# depths are keyed by ``id(code)``: a code object does not cache its hash, which hashes its names
# and constants on every lookup (a fifth of a block's hook work).  Each entry keeps its code
# alive, so its id is never reused.
_INNER_CODE = next((c for c in _CALL_CODE.co_consts
                    if isinstance(c, CodeType) and c.co_name == "inner"), None)
_CALL_DEPTH: dict[int, tuple[CodeType, int]] = {}
_getframe = sys._getframe


def call_frame() -> FrameType | None:
    """The frame of the ``nn.Module`` call whose hooks are running the caller (None if torch's
    call path is not recognised: such entries are then never considered stale)."""
    try:
        frame = _getframe(2)
    except ValueError:  # a shallower stack: not called from a hook
        frame = None
    if frame is not None and frame.f_code is _INNER_CODE:
        return frame.f_back  # the ``_call_impl`` that runs ``inner``
    caller = _getframe(1)
    code = caller.f_code
    known = _CALL_DEPTH.get(id(code))
    if known is not None and known[0] is code:
        try:
            frame = _getframe(known[1] + 1)
        except ValueError:  # a shallower stack than last time
            frame = None
        if frame is not None and frame.f_code is _CALL_CODE:
            return frame
    frame = caller
    for d in range(12):
        if frame is None:
            return None
        if frame.f_code is _CALL_CODE:
            _CALL_DEPTH[id(code)] = (code, d)
            return frame
        frame = frame.f_back
    return None


def _on_stack(frame: FrameType, top: FrameType | None) -> bool:
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class CallGuard:
    """Which threads are inside an offloaded module's forward (Note [One thread at a time]).

    Seams (a subclass named by ``call_guard_class`` may override): :meth:`enter`, :meth:`holds`
    and :meth:`exit` (the hooks' side), :meth:`enter_component`, :meth:`holds_component` and
    :meth:`exit_component` (a streamed component's whole forward: Note [Component entries]),
    :meth:`covers` (a block inside such a forward),
    :meth:`exclusive` (``disable()`` and ``edit_weights()``).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        # The condition's own lock, taken directly on the hooks' fast path: a Condition's
        # ``with`` costs two Python-level calls per use, twice per block (Note [Fast path] in
        # ring.py).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # The condition's waiter deque (None if this Python's Condition has none): notify_all
        # with no waiter is only a cost.
        self._waiters = getattr(self._cond, "_waiters", None)
        self._inside: dict[int, list[tuple[str, FrameType | None]]] = {}
        # Note [Component entries]: whole forwards of streamed components, apart from ``_inside``
        self._components: dict[int, list[tuple[str, FrameType | None]]] = {}
        self._exclusive: int | None = None  # thread holding the guard exclusively
        self._closed = False  # set by exclusive(close=True): hooks leave modules alone

    # -- hooks ------------------------------------------------------------------------------------

    def enter(self, label: str, frame: FrameType | None) -> bool:
        """Register a forward of ``label`` in this thread.  False: the backend is being (or was)
        disabled, leave the module alone.  Raises OffloadConcurrencyError if another thread is
        inside."""
        me = _get_ident()
        # Note [Guard locking]: one line, so no line event separates the body from the release.
        with self._lock: entered = self._enter_uncontended(me, label, frame)  # noqa: E701
        if entered:
            return True
        with self._cond:
            if not self._admit(me, label):
                return False
            self._add_entry(me, label, frame)
            return True

    def _enter_uncontended(self, me: int, label: str, frame: FrameType | None) -> bool:
        """The steady state of ``enter`` (nobody exclusive, nobody else inside); False: take the
        general path.  Caller holds the lock."""
        if self._exclusive is not None or self._closed:
            return False
        components = self._components
        if components and (len(components) > 1 or me not in components):
            return False  # another thread is inside a component: the general path refuses
        inside = self._inside
        if not inside:  # nobody inside: the steady state of a block's pre-hook
            inside[me] = [(label, frame)]
            return True
        if len(inside) > 1 or me not in inside:
            return False
        self._add_entry(me, label, frame)
        return True

    # Note [Component entries]
    #     Under layerwise the owner of a ring (the DiT) holds a component entry for its whole
    #     forward, so ``exclusive`` (disable, edit_weights) waits for the component's forward and
    #     not just for the block running at that moment, and another thread's call is refused
    #     from the component's first line on.  Component entries are kept apart from the hooks'
    #     own (``_components``, not ``_inside``): hooks read this thread's entries to tell a
    #     nested call from a new one, and a block's entry would otherwise always nest, paying
    #     the stack walk that prunes stale entries on every block.  A component entry left by a
    #     forward a Ctrl-C ended is harmless (nothing reads this thread's component entries to
    #     decide nesting, and other threads test them for liveness), so this thread's are
    #     pruned only once eight have piled up: walking the stack there kept a generation's
    #     activations alive into the next one (the kit's peak checks saw 3.6-6 KB more).

    def enter_component(self, label: str, frame: FrameType | None) -> bool:
        """Register this thread's forward of the streamed component ``label`` (Note
        [Component entries]); False and the rest as :meth:`enter`."""
        me = _get_ident()
        with self._cond:
            if not self._admit(me, label):
                return False
            mine = self._components.setdefault(me, [])
            if len(mine) >= 8:  # left by forwards a Ctrl-C ended: keep the live ones
                self._prune_own(mine)
            mine.append((label, frame))
            return True

    def holds_component(self, frame: FrameType | None) -> bool:
        mine = self._components.get(_get_ident())
        return bool(mine) and any(f is frame for _, f in mine)

    def exit_component(self, frame: FrameType | None) -> None:
        me = _get_ident()
        with self._cond:
            mine = self._components.get(me)
            if not mine:
                return
            for i in range(len(mine) - 1, -1, -1):
                if mine[i][1] is frame:
                    del mine[i:]
                    break
            if not mine:
                del self._components[me]
                self._cond.notify_all()

    def _add_entry(self, me: int, label: str, frame: FrameType | None) -> None:
        """Record this thread's forward of ``label`` (caller holds the lock)."""
        mine = self._inside.get(me)
        if mine is None:
            self._inside[me] = [(label, frame)]
            return
        if mine:
            self._prune_own(mine)
        mine.append((label, frame))

    @property
    def closed(self) -> bool:
        """Whether ``exclusive(close=True)`` has begun (the backend is being disabled)."""
        return self._closed or self._exclusive is not None

    def covers(self, outer: FrameType | None, frame: FrameType | None) -> bool:
        """Whether a block call in ``frame`` runs inside the component call ``outer`` that this
        guard admitted (``enter_component``), and so needs no entry of its own: the guard is
        neither held exclusively nor closed, and ``outer`` is on ``frame``'s stack (Note
        [Blocks inside their component] in layerwise.py)."""
        return (outer is not None and frame is not None and self._exclusive is None
                and not self._closed and _on_stack(outer, frame))

    def entered_here(self) -> bool:
        """Whether this thread is inside a forward it entered (a block's parts run in the
        thread that runs the block; any other thread's call must enter and be refused).  A
        component entry counts: a block inside its component's call holds no entry of its own
        (Note [Blocks inside their component] in layerwise.py)."""
        me = _get_ident()
        return me in self._inside or me in self._components

    def holds(self, frame: FrameType | None) -> bool:
        """Whether this thread entered the forward running in ``frame``."""
        mine = self._inside.get(_get_ident())
        if not mine:
            return False
        return frame is None or mine[-1][1] is frame or any(f is frame for _, f in mine)

    def exit(self, frame: FrameType | None) -> bool:
        """Unregister this thread's forward that runs in ``frame``; False if it was never entered
        (the hook's ``enter`` returned False)."""
        me = _get_ident()
        with self._lock: return self._exit_locked(me, frame)  # noqa: E701 (Note [Guard locking])

    def _exit_locked(self, me: int, frame: FrameType | None) -> bool:
        mine = self._inside.get(me)
        if not mine:
            return False
        if mine[-1][1] is frame:  # the innermost entry: the steady state
            del mine[-1]
        else:
            for i in range(len(mine) - 2, -1, -1):
                if mine[i][1] is frame:
                    del mine[i:]
                    break
            else:
                if frame is not None:
                    return False
                mine.pop()
        if not mine:
            del self._inside[me]
            waiters = self._waiters
            if waiters or waiters is None or self._exclusive is not None:
                self._cond.notify_all()
        return True

    # -- disable, edit_weights --------------------------------------------------------------------

    @contextmanager
    def exclusive(self, *, close: bool) -> Iterator[None]:
        """Wait until no other thread is inside, then keep new entries out until the block ends.
        With ``close``, hooks that fire after the block leave their modules alone."""
        me = threading.get_ident()
        with self._cond:
            while self._exclusive is not None and self._exclusive != me:
                self._cond.wait()
            while self._busy_elsewhere(me):
                self._cond.wait(timeout=0.05)  # also re-checks entries left by an interrupt
            outer = self._exclusive
            self._exclusive = me
        try:
            yield
            if close:
                with self._cond:
                    self._closed = True
                    # Entries left by forwards a Ctrl-C ended hold their frames, and with them
                    # activations: nothing reads them once closed (Note [Component entries]).
                    self._components.clear()
        finally:
            with self._cond:
                self._exclusive = outer
                self._cond.notify_all()

    # -- internals --------------------------------------------------------------------------------

    def _admit(self, me: int, label: str) -> bool:
        """The general path of an entry (caller holds the condition): wait out another thread's
        ``exclusive``; False once closed; OffloadConcurrencyError if another thread is inside."""
        while self._exclusive is not None and self._exclusive != me:
            self._cond.wait()
        if self._closed:
            return False
        busy = self._busy_elsewhere(me)
        if busy:
            thread, where = busy
            raise OffloadConcurrencyError(
                f"{label} was called in thread {me} while thread {thread} is inside {where} "
                f"of the same pipeline, offloaded by {self.owner}; an enabled pipeline serves "
                "one thread at a time (its weights stream through shared device slots): "
                "give each thread its own pipeline and backend, or serialize the calls")
        return True

    def _busy_elsewhere(self, me: int) -> tuple[int, str] | None:
        """Another thread's live entry, a component's included (caller holds the lock); stale
        entries are dropped."""
        frames = None
        for table in (self._inside, self._components):
            others = [t for t, entries in table.items() if t != me and entries]
            if not others:
                continue
            frames = frames if frames is not None else sys._current_frames()
            for thread in others:
                entries = table[thread]
                top = frames.get(thread)
                live = [(label, f) for label, f in entries
                        if top is not None and (f is None or _on_stack(f, top))]
                if live:
                    table[thread] = live
                    return thread, live[-1][0]
                del table[thread]
        return None

    def _prune_own(self, mine: list[tuple[str, FrameType | None]]) -> None:
        top = sys._getframe()
        mine[:] = [(label, f) for label, f in mine if f is None or _on_stack(f, top)]
