"""What an enabled backend refuses: a second thread inside it, autograd through streamed weights,
and weight edits it cannot honour.

Note [One thread at a time]
    An enabled pipeline serves one thread at a time.  Every offload hook *enters* the backend's
    :class:`CallGuard` before it touches a ring or a swap group and *exits* it after the module's
    forward.  A hook that fires in thread B while thread A is inside an offloaded module's forward
    raises :class:`OffloadConcurrencyError` in B before anything changes, so A's generation
    stays correct.  ``disable()`` and ``edit_weights()`` take the guard exclusively: they wait
    until no other thread is inside an offloaded forward, and hooks that fire meanwhile wait for
    them and then leave the module alone.

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

Note [Autograd]
    Streamed and swapped weights are rebound after every forward (to placeholders or host
    masters), so a backward would read other values than the forward did.  A hook that sees grad
    mode on while the weights it is about to stream require grad raises
    :class:`OffloadAutogradError` before the module runs: never a NaN gradient.  Run under
    ``torch.no_grad()`` / ``torch.inference_mode()`` (diffusers pipelines do), or freeze the
    weights with ``requires_grad_(False)``.  Frozen weights are saved as well whenever a gradient
    flows through them, so a streamed block also refuses when one of its inputs, or another of
    its parameters (an adapter added after enable), requires grad.

Note [Weight edits]
    Inside ``backend.edit_weights()`` the pipeline holds ordinary tensors (the backend is
    disabled); on exit it is enabled again and reads every weight anew.  Outside it, the backend
    records each offloaded tensor's version counter when it binds it; an in-place edit (``mul_``,
    ``copy_``, LoRA fusing) bumps it, and the next hook that would use or evict the tensor raises
    :class:`OffloadWeightEditError` naming it.  ``load_state_dict`` on a module holding offloaded
    weights raises before it copies anything.  ``disable()`` keeps an edit of a swapped
    component (its device copy or host master); an edit of a streamed block cannot be kept (the
    block's slot may have been filling while it ran), so ``disable()`` restores the block from its
    master with a RuntimeWarning naming the tensors: never silently.

Note [Rebind guard]
    ``.data`` bypasses the version counter: ``w.data += delta`` (peft's LoRA merge, diffusers'
    ``fuse_lora``) writes the storage without bumping ``w._version``, and ``w.data = new``
    (``module.to(dtype)``, ``enable_layerwise_casting``, peft's safe merge) rebinds it.  The
    next swap or block load rebinds the tensor again and drops either edit, silently.  So while
    a backend is enabled, every parameter it rebinds (exactly ``nn.Parameter``; subclasses keep
    their class) has its class changed to a subclass whose only difference is ``.data``:
    reading it returns ``detach()`` (the same storage, sharing the version counter, so an edit
    through it is refused like any in-place edit, Note [Weight edits]), and assigning anything
    but the same view raises
    :class:`OffloadWeightEditError` before anything changes.  ``__torch_function__`` is the
    disabled implementation, as for ``nn.Parameter``: ops return plain tensors and pay
    nothing.  Pickling and ``copy.deepcopy`` give the original class (a streamed tensor between
    its block's forwards refuses both, Note [Reads between forwards]).  The backend's own
    rebinds call the ``TensorBase.data`` setter directly (:data:`set_data`).  ``disable()``
    (and a rollback) give every tensor its class back.

    Buffers keep their class.  torch treats ``nn.Parameter`` specially wherever it checks for
    plain tensors (AOT autograd reads a parameter's ``.data`` and checks that), but a
    ``torch.Tensor`` subclass is an unknown type there: with guarded buffers,
    ``torch.compile`` (the default inductor backend, and ``aot_eager``) failed on every
    offloaded pipeline with "Multiple dispatch failed ... returned NotImplemented".  A buffer
    edited through ``.data`` is therefore not seen; buffers are rarely edited that way
    (``module.to(dtype)`` replaces buffer objects rather than assigning their ``.data``).

Note [Reads between forwards]
    Between its forwards a streamed block's tensors are bound to placeholders (NaN) or to a
    slot whose prefetch copy may still be in flight.  Code that reads weights through ``.data``
    outside the forward builds on those bytes: diffusers' ``fuse_qkv_projections`` concatenates
    ``to_q.weight.data`` and its siblings into new projections (NaN for good, even after
    ``disable()``), peft's merge reads ``base_layer.weight.data`` before it adds a delta and
    marks the layer merged.  So the guarded ``.data`` of a streamed tensor raises
    :class:`OffloadWeightEditError` unless its block is running (its own forward, or a part
    call that materialized it): the code fails at its first read, before it built or marked
    anything.  Such code may have changed other weights before it reached a streamed one
    (peft merges the resident layers first): so after a refused read, the next block forward
    compares the resident state's version counters with their values at enable, and refuses
    with :class:`OffloadWeightEditError` if any changed (a half-applied edit); otherwise it
    forgets the refusal.  Direct reads (``w.sum()``, ``torch.cat([w, ...])``) are not
    intercepted (the guard leaves ops alone for speed) and read placeholders, like any read
    outside forward.  Swapped (model-level) tensors always view real storage and read as usual.

Note [No copies while enabled]
    An enabled module is not a self-contained object: its tensors are placeholders, slot views
    or host masters, and the hooks that rebind them belong to the running backend (its rings,
    platform threads and locks).  ``copy.deepcopy`` of it would copy placeholders (NaN) for the
    blocks that are not loaded and hooks that drive the original backend's rings; pickling it
    (``torch.save(module)``) would store the same.  torch would fail somewhere inside with
    "cannot pickle '_thread.lock' object" or "Can't pickle local object", or worse, succeed.
    So every object an enabled backend attaches to a module (its forward hooks, its
    ``state_dict`` hooks, the pipeline's owner mark) refuses to be copied or pickled with a
    ``TypeError`` that names the module and the ways out: ``disable()`` first, copy inside
    ``with backend.edit_weights(): ...`` (the pipeline is plain there), or save
    ``module.state_dict()``, which holds the true weights while enabled.  The guarded tensors
    themselves still copy and pickle (as their original class): a ``state_dict(keep_vars=True)``
    holds them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

__all__ = [
    "CallGuard",
    "OffloadAutogradError",
    "OffloadConcurrencyError",
    "OffloadWeightEditError",
    "RefusesCopies",
    "call_frame",
    "get_data",
    "forget_readable",
    "guard_rebinds",
    "guarded_by",
    "readable_while",
    "refuse_edits_between_forwards",
    "refuse_autograd",
    "refuse_copy",
    "set_data",
    "unguard_rebinds",
]


def refuse_copy(subject: str) -> None:
    """Raise the TypeError of Note [No copies while enabled] for ``subject``."""
    raise TypeError(
        f"cannot copy or pickle {subject} while offload-ref offloads it: its tensors are "
        "placeholders, device slots or host masters, and its hooks drive the running backend, "
        "so a copy would be silently wrong or could not run.  Call backend.disable() first, "
        "copy inside `with backend.edit_weights(): ...` (the pipeline holds ordinary tensors "
        "there; offload_ref.backend_of(pipeline) finds the backend), or save "
        "module.state_dict(), which holds the true weights while enabled"
    )


class RefusesCopies:
    """Mixin for what an enabled backend attaches to a module: ``copy.deepcopy``, ``copy.copy``
    and pickling raise a ``TypeError`` naming :meth:`_copy_subject` (Note [No copies while
    enabled])."""

    __slots__ = ()

    def _copy_subject(self) -> str:
        return "a module"

    def __deepcopy__(self, memo: dict) -> Any:
        refuse_copy(self._copy_subject())

    def __copy__(self) -> Any:
        refuse_copy(self._copy_subject())

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self._copy_subject())


class OffloadConcurrencyError(RuntimeError):
    """A second thread called a pipeline while another thread was inside one of its offloaded
    modules (Note [One thread at a time])."""


class OffloadAutogradError(RuntimeError):
    """A forward through streamed or swapped weights ran with autograd recording (Note
    [Autograd])."""


class OffloadWeightEditError(RuntimeError):
    """An offloaded weight was edited outside ``backend.edit_weights()`` (Note [Weight edits])."""


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
    """Which threads are inside an offloaded module's forward (Note [One thread at a time])."""

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
                    "give each thread its own pipeline and backend, or serialize the calls"
                )
            self._add_entry(me, label, frame)
            return True

    def _enter_uncontended(self, me: int, label: str, frame: FrameType | None) -> bool:
        """The steady state of ``enter`` (nobody exclusive, nobody else inside); False: take the
        general path.  Caller holds the lock."""
        if self._exclusive is not None or self._closed:
            return False
        inside = self._inside
        if not inside:  # nobody inside: the steady state of a block's pre-hook
            inside[me] = [(label, frame)]
            return True
        if len(inside) > 1 or me not in inside:
            return False
        self._add_entry(me, label, frame)
        return True

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

    def entered_here(self) -> bool:
        """Whether this thread is inside a forward it entered (a block's parts run in the
        thread that runs the block; any other thread's call must enter and be refused)."""
        return _get_ident() in self._inside

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
        finally:
            with self._cond:
                self._exclusive = outer
                self._cond.notify_all()

    # -- internals --------------------------------------------------------------------------------

    def _busy_elsewhere(self, me: int) -> tuple[int, str] | None:
        """Another thread's live entry (caller holds the lock); stale entries are dropped."""
        others = [t for t, entries in self._inside.items() if t != me and entries]
        if not others:
            return None
        frames = sys._current_frames()
        for thread in others:
            entries = self._inside[thread]
            top = frames.get(thread)
            live = [(label, f) for label, f in entries
                    if top is not None and (f is None or _on_stack(f, top))]
            if live:
                self._inside[thread] = live
                return thread, live[-1][0]
            del self._inside[thread]
        return None

    def _prune_own(self, mine: list[tuple[str, FrameType | None]]) -> None:
        top = sys._getframe()
        mine[:] = [(label, f) for label, f in mine if f is None or _on_stack(f, top)]


def refuse_autograd(label: str, names: Sequence[str], tensors: Sequence[torch.Tensor],
                    args: Any = (), kwargs: Any = None, module: nn.Module | None = None) -> None:
    """Raise OffloadAutogradError if autograd would record a graph that saves ``tensors`` (Note
    [Autograd]): one of them requires grad, or -- frozen weights are saved too, for the
    gradient of whatever flows through them -- an input in ``args`` / ``kwargs`` or another
    parameter of ``module`` (a LoRA adapter added later, say) requires grad.  Cheap when grad
    mode is off (the normal case)."""
    if not torch.is_grad_enabled():
        return
    for name, t in zip(names, tensors):
        if t.requires_grad:
            _refuse_recording(label, f"its offloaded weight {name} requires grad", "freeze the "
                              "weights (module.requires_grad_(False))")
    for where, t in _grad_leaves(args, kwargs):
        _refuse_recording(label, f"its input {where} requires grad, so autograd saves the "
                          "offloaded weights it flows through", "detach the inputs")
    if module is not None:
        offloaded = {id(t) for t in tensors}
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in offloaded:
                _refuse_recording(label, f"its parameter {name} requires grad (it is not "
                                  "offloaded: added after enable?), so autograd saves the "
                                  "offloaded weights its gradient flows through",
                                  "freeze it, or add it inside backend.edit_weights()")


def _grad_leaves(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` of the tensors in ``args`` / ``kwargs`` (nested in lists, tuples and
    dicts) that require grad."""
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[str, Any]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    stack += [(f"{k}=", v) for k, v in (kwargs or {}).items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                out.append((where, value))
        elif isinstance(value, (list, tuple)):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            stack += [(f"{where}[{k!r}]", v) for k, v in value.items()]
    return out


def _refuse_recording(label: str, why: str, fix: str) -> None:
    raise OffloadAutogradError(
        f"{label} runs with autograd recording and {why}: offloaded weights are rebound after "
        "each forward (to placeholders or to another block's slot), so a backward would read "
        "other values than the forward did.  Run the pipeline under torch.no_grad() or "
        f"torch.inference_mode(), or {fix}; training through an offloaded module is not "
        "supported"
    )


# -- Note [Rebind guard] ----------------------------------------------------------------------

#: The ``TensorBase.data`` setter itself: the backends' own rebinds (a guarded tensor's
#: ``.data = v`` refuses anything but the same view).
set_data = torch._C.TensorBase.data.__set__
#: The ``TensorBase.data`` getter itself (a fresh version counter, as plain ``.data``).
get_data = torch._C.TensorBase.data.__get__

# id(tensor) -> (qualified name, owner) of every guarded tensor, for the error message.
_GUARDED: dict[int, tuple[str, str]] = {}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


# id(tensor) -> (whether its storage may be read now, what to tell its backend of a refused
# read), for tensors whose binding is real only at times (a streamed block's: Note [Reads
# between forwards]).
_READABLE: dict[int, tuple[Callable[[], bool], Callable[[str], None]]] = {}


def readable_while(tensors: Sequence[torch.Tensor], readable: Callable[[], bool],
                   on_refused: Callable[[str], None]) -> None:
    """Let ``.data`` of each guarded tensor in ``tensors`` be read only while ``readable()``;
    a refused read calls ``on_refused(name)`` first (Note [Reads between forwards]).
    :func:`unguard_rebinds` forgets it."""
    for t in tensors:
        _READABLE[id(t)] = (readable, on_refused)


def forget_readable(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        _READABLE.pop(id(t), None)


def _require_readable(self: torch.Tensor, what: str) -> None:
    entry = _READABLE.get(id(self))
    if entry is not None and not entry[0]():
        name, owner = _GUARDED.get(id(self), ("an offloaded tensor", "an offload backend"))
        entry[1](name)
        raise OffloadWeightEditError(
            f"{name}{what} outside its block's forward while {owner} streams it: "
            "between forwards the tensor is bound to a placeholder (NaN) or to a slot whose "
            "copy may still be in flight, so whatever is built from it (fused projections, a "
            "LoRA merge, a cast) would be silently wrong, and an edit through it would be "
            "dropped.  Make the change inside `with backend.edit_weights(): ...` "
            "(offload_ref.backend_of(pipeline) finds the backend), where the pipeline holds its "
            "real weights, or read the true values from state_dict()"
        )


def _guarded_data(self: torch.Tensor) -> torch.Tensor:
    _require_readable(self, ".data was read")
    return self.detach()  # shares storage and version counter: an edit through it is seen


def _guarded_set_data(self: torch.Tensor, value: Any) -> None:
    if value is self or (isinstance(value, torch.Tensor) and _same_view(value, self)):
        return  # ``w.data += d`` assigns the edited view back; ``.to()`` a no-op conversion
    name, owner = _GUARDED.get(id(self), ("an offloaded tensor", "an offload backend"))
    raise OffloadWeightEditError(
        f"{name}.data was assigned a new tensor while {owner} offloads it (`.data = ...`, "
        "`module.to(dtype)`, a layerwise cast or a LoRA merge): the backend would rebind it "
        "at the next swap and drop the change.  Make the change inside "
        "`with backend.edit_weights(): ...` (offload_ref.backend_of(pipeline) finds the "
        "backend), which re-reads every weight on exit.  If a hook does this at every forward "
        "(diffusers' enable_layerwise_casting), it cannot run under offloading: remove it, or "
        "cast the weights once inside edit_weights()"
    )


_GUARDED_DATA = property(_guarded_data, _guarded_set_data,
                         doc="Note [Rebind guard]: detach() on read; only the same view on write.")


def _parameter_deepcopy(self: nn.Parameter, memo: dict) -> nn.Parameter:
    # nn.Parameter.__deepcopy__ with a plain Parameter (it builds ``type(self)``).
    if id(self) in memo:
        return memo[id(self)]
    _require_readable(self, " was deep-copied")
    out = nn.Parameter(self.detach().clone(memory_format=torch.preserve_format),
                       self.requires_grad)
    memo[id(self)] = out
    return out


class _GuardedParameter(nn.Parameter):
    """A parameter while its backend is enabled (Note [Rebind guard]); ``nn.Parameter``'s own
    ``__reduce_ex__`` reads ``.data`` and rebuilds a plain ``Parameter``."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    data = _GUARDED_DATA  # type: ignore[assignment]
    __deepcopy__ = _parameter_deepcopy


# -- Note [Edits between forwards] ------------------------------------------------------------
#
#     A layerwise backend cannot honour an in-place edit of a component it streams made outside
#     ``edit_weights()``: a streamed tensor is bound to a placeholder (torch raises its raw
#     "more than one element of the written-to tensor refers to a single memory location") or
#     to a slot the next fill overwrites, and an edit applied to every weight in a loop (a LoRA
#     fuse, ``p.mul_(2)`` for each parameter) would stop at the first such tensor with the
#     resident weights before it already changed: a mix.  So outside the forward that uses
#     them, the guarded parameters of every component with a ring (its streamed blocks and its
#     resident rest) are :class:`_IdleParameter` s, whose ``__torch_function__`` refuses an
#     in-place op on them (a ``*_`` method, an in-place operator, ``__setitem__``, an ``out=``
#     argument) with :class:`OffloadWeightEditError` naming ``edit_weights()`` before the op
#     runs: the loop stops at its first tensor, with nothing changed.  Every other op passes
#     through as with the disabled implementation.  A hook on the component gives all its
#     parameters the plain guarded class for the component's forward: two class assignments
#     per parameter and call, nothing per block, and no per-op dispatch inside the forward
#     (where the ring's own rebinds would otherwise pay it too).  The refusal is recorded with the backend (as a refused read is,
#     Note [Reads between forwards]): the next generation warns that it runs the unedited
#     weights, or refuses if weights outside the guard (another component's) were edited
#     first, and ``disable()`` says the same.  Buffers keep their class (Note [Rebind guard]):
#     an in-place edit of a streamed buffer is still caught by its version counter at the
#     block's next forward.  A pipeline that calls the blocks without calling the component
#     itself gives them the plain class at the first block call, for good: its edits are caught
#     by the version counters alone (at the block's next forward), as before this guard.


# id(tensor) -> what to tell its backend of a refused in-place edit: ``(name, op)``.
_ON_EDIT_REFUSED: dict[int, Callable[[str, str], None]] = {}
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and",
                            "or", "xor", "lshift", "rshift", "matmul")) | {"__setitem__"}
_METADATA_ONLY = frozenset({"requires_grad_"})  # changes no value


def _written(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The idle parameter an op named ``name`` would write, if any."""
    out = kwargs.get("out")
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if type(t) is _IdleParameter:
            return t
    inplace = name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.endswith("__") and name not in _METADATA_ONLY)
    if not inplace or not args:
        return None
    first = args[0]
    if type(first) is _IdleParameter:
        return first
    if isinstance(first, (tuple, list)):  # torch._foreach_mul_(tensors, ...)
        return next((t for t in first if type(t) is _IdleParameter), None)
    return None


def _refuse_edit(t: torch.Tensor, op: str) -> None:
    name, owner = _GUARDED.get(id(t), ("an offloaded tensor", "an offload backend"))
    report = _ON_EDIT_REFUSED.get(id(t))
    if report is not None:
        report(name, op)
    raise OffloadWeightEditError(
        f"{name}: an in-place edit ({op}) outside edit_weights() was refused before it changed "
        f"anything: {owner} streams this component's blocks, so between forwards its weights "
        "are bound to placeholders or to slots the next fill overwrites, and an edit applied "
        "to weight after weight would stop part-way.  Make the edit inside "
        "`with backend.edit_weights(): ...` (offload_ref.backend_of(pipeline) finds the "
        "backend), which re-reads every weight on exit; no weight of this component changed"
    )


class _IdleParameter(_GuardedParameter):
    """A guarded parameter of a streamed component outside the forward that uses it: refuses
    in-place edits (Note [Edits between forwards])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        written = _written(getattr(func, "__name__", ""), args, kwargs)
        if written is not None:
            _refuse_edit(written, getattr(func, "__name__", repr(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


#: The class of a guarded parameter while the forward that uses it runs.
RUNNING_PARAMETER: type = _GuardedParameter
#: ... and outside it (Note [Edits between forwards]).
IDLE_PARAMETER: type = _IdleParameter


def refuse_edits_between_forwards(tensors: Sequence[torch.Tensor],
                                  on_refused: Callable[[str, str], None]) -> list[torch.Tensor]:
    """Make each guarded parameter of ``tensors`` refuse in-place edits until its forward runs
    (Note [Edits between forwards]); a refused edit calls ``on_refused(name, op)`` first.
    Returns the parameters it marked (the hooks swap their class); :func:`unguard_rebinds`
    forgets them."""
    marked = []
    for t in tensors:
        if type(t) is _GuardedParameter:
            _ON_EDIT_REFUSED[id(t)] = on_refused
            t.__class__ = _IdleParameter
            marked.append(t)
    return marked


# Parameters only: a buffer's class stays ``torch.Tensor`` (Note [Rebind guard]).
_GUARDED_CLASS: dict[type, type] = {nn.Parameter: _GuardedParameter}
_ORIGINAL: dict[type, type] = {v: k for k, v in _GUARDED_CLASS.items()}
_ORIGINAL[_IdleParameter] = nn.Parameter


def guarded_by(t: torch.Tensor) -> tuple[str, str] | None:
    """``(qualified name, owner)`` of a tensor an enabled backend guards, else None."""
    if type(t) not in _ORIGINAL:
        return None
    return _GUARDED.get(id(t), ("an offloaded tensor", "an offload backend"))


def guard_rebinds(named: Sequence[tuple[str, torch.Tensor]], owner: str,
                  into: list[torch.Tensor]) -> None:
    """Guard ``.data`` of each tensor (Note [Rebind guard]), appending each to ``into`` (for
    :func:`unguard_rebinds`) before its class changes, so an interrupt leaves nothing guarded
    that the caller cannot unguard."""
    for name, t in named:
        guarded = _GUARDED_CLASS.get(type(t))
        if guarded is None:
            continue
        _GUARDED[id(t)] = (name, owner)
        into.append(t)
        t.__class__ = guarded


def unguard_rebinds(tensors: Sequence[torch.Tensor]) -> None:
    """Give each tensor guarded by :func:`guard_rebinds` its class back (idempotent)."""
    for t in tensors:
        original = _ORIGINAL.get(type(t))
        if original is not None:
            t.__class__ = original
        _GUARDED.pop(id(t), None)
        _READABLE.pop(id(t), None)
        _ON_EDIT_REFUSED.pop(id(t), None)
