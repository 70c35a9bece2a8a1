"""Layerwise (blockwise) offload: each ring of transformer blocks streams through two fixed
device slots (:class:`~offload_ref.backends.ring.BlockRing`, Note [The ring] in ring.py) while the
rest of the pipeline stays on the device.  This module holds the hooks and the backend.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.autograd import profiler as _profiler
from torch.utils.hooks import RemovableHandle

from .. import _spans
from ..config import OffloadStrategy
from ..discovery import get_submodule_path
from ..hooks import ModelHook, runs_after_offload
from ..host import storage_key
from ..plan.tree import wrappers_in
from ..plan import (
    OffloadTopologyError,
    ResolvedOffloadPlan,
    named_tensors,
    pipeline_state,
    staging_budget_error,
)
from .base import OffloadBackend
from .call_guard import _INNER_CODE, CallGuard, _on_stack, call_frame
from .groups import ComponentSwapper
from .inference import rebind_restored
from .rebind_guard import (
    IDLE_PARAMETER,
    RUNNING_PARAMETER,
    forget_readable,
    idle_wrappers,
    readable_while,
    refuse_edits_between_forwards,
    run_wrappers,
)
from .refusals import REFUSE_ALL, OffloadWeightEditError, RefusalPolicy, RefusesCopies
from .ring import BlockRing, _Placeholders
from .staging import StagingPool
from .transaction import Transaction
from .slots import RingStreams
from .transports import Transport

__all__ = ["LayerWiseOffloadBackend", "LayerWiseOffloadHook", "LayerwiseOffloadHook"]

# Note [Hooks leave inference mode], at the cost of the C++ guard alone: torch.inference_mode's
# Python wrapper costs several times more, twice per block.
_leave_inference_mode: Any = getattr(torch._C, "_InferenceMode", None)
_grad_enabled = torch.is_grad_enabled
if _leave_inference_mode is None:  # pragma: no cover - older or newer torch
    _leave_inference_mode = torch.inference_mode


class LayerWiseOffloadHook(RefusesCopies, ModelHook):
    """Thin callbacks from one block into its ring, inside the backend's call guard (Note [One
    thread at a time] in call_guard.py), refusing autograd and weight edits it cannot honour (Notes
    [Autograd], [Weight edits] in refusals.py)."""

    def __init__(self, ring: BlockRing, index: int, guard: CallGuard | None = None,
                 refusals: _ReadRefusals | None = None,
                 refusal_policy: RefusalPolicy = REFUSE_ALL) -> None:
        self.ring = ring
        self.index = index
        self.refusal_policy = refusal_policy  # the backend's (Note [Refusal policy])
        self.guard = guard if guard is not None else CallGuard(ring.label)
        group = ring.groups[index]
        self.path = ring.block_paths[index]
        self.names = [r.name for r in group.layout.records]
        self.tensors = group.tensors
        self.versions = [t._version for t in group.tensors]  # our rebinds never bump them
        # Plain aliases sharing each tensor's version counter (detach() keeps it, across our
        # rebinds too): a guarded tensor's own ``_version`` getter looks up
        # ``__torch_function__`` first (Note [Rebind guard] in rebind_guard.py), twice per tensor
        # per block.  Made after the ring's commit, they view placeholders or a slot, never the
        # original storage.
        self.counters = [t.detach() for t in group.tensors]
        self._span: Any = None  # the block's compute range (Note [Spans] in _spans.py)
        # The edit guard of the component the block belongs to (Note [Edits between forwards]
        # in rebind_guard.py), set at enable.
        self.component: _ComponentEditGuard | None = None
        # The backend's, shared by its hooks (Note [Reads between forwards] in rebind_guard.py).
        self.refusals = refusals if refusals is not None else _ReadRefusals()

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"block {self.path!r}"

    # Note [Hooks leave inference mode]: tensors the offloader creates or views inside a hook
    # must be ordinary tensors, or disable (run outside inference mode) could not reuse them.

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frame = call_frame()
        guard = self.guard
        component = self.component
        # Note [Blocks inside their component]: no entry of its own inside the component's call
        entered = component is None or not guard.covers(component.frame, frame)
        if entered and not guard.enter(self.path, frame):
            return None  # the backend is being disabled: leave the block alone
        hooks = module._forward_hooks
        if len(hooks) > 1:  # Note [Outermost hooks]
            self._run_post_hook_last(hooks)
        component = self.component
        if component is not None and component.idle:  # Note [Edits between forwards]
            component.run()  # the pipeline called the block without its component
        try:
            if _grad_enabled():
                self.refusal_policy.refuse_autograd(self.path, self.names, self.tensors, args,
                                                    kwargs, module)
            for t, v in zip(self.counters, self.versions):
                if t._version != v:
                    self._refuse_edit()
            if self.refusals.name is not None:  # Note [Reads between forwards] (rebind_guard.py)
                self.refusals.check()
            ring = self.ring
            if ring.creates_no_tensors:  # Note [Hooks leave inference mode]
                ring.before(self.index, frame)
            else:
                with _leave_inference_mode(False):
                    ring.before(self.index, frame)
            if _profiler._is_profiler_enabled:  # Note [Spans]: one bool read when off
                self._span = _spans.enter("block", "ring=%s block=%d slot=%s", ring.label,
                                          self.index, ring.slot_of[self.index])
        except BaseException:
            if entered:
                guard.exit(frame)
            raise
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        frame = call_frame()
        guard = self.guard
        entered = guard.holds(frame)
        if not entered:
            running = self.ring._running  # Note [Blocks inside their component]
            if not (running and running[-1][1] is frame and frame is not None):
                return None
        try:
            if self._span is not None:
                _spans.exit(self._span)
                self._span = None
            ring = self.ring
            if ring.creates_no_tensors:
                ring.after(self.index)
            else:
                with _leave_inference_mode(False):
                    ring.after(self.index)
        finally:
            if entered:
                guard.exit(frame)
        return None

    # Note [Blocks inside their component]
    #     A block called from inside its ring owner's forward (the DiT's, in the thread that
    #     holds the owner's component entry: Note [Component entries] in call_guard.py) takes no
    #     call-guard entry of its own: the component entry already refuses every other thread,
    #     and ``disable()`` / ``edit_weights()`` already wait for it.  The owner's hook keeps the
    #     frame of the call it entered; a block whose own call frame has that frame on its
    #     stack runs inside it.  Any other block call (another thread's, a direct call, a call
    #     after an interrupted forward left the owner's frame behind, or while the guard is
    #     held exclusively or closed) enters the guard as before.  The post-hook tells its call
    #     apart by the ring's record of the running block (its call frame), since the guard
    #     holds nothing for it.  It saves two locked sections of the guard per block.

    # Note [Outermost hooks]
    #     A block's own torch hooks must see its weights: they run inside the offloader's pair.
    #     The offload pre-hook is registered first (``prepend``, hooks.py), so a pre-hook the block
    #     had before ``enable`` runs after the weights are placed.  A forward hook registered after
    #     ``enable`` would run after the post-hook has rebound the block to placeholders, so the
    #     pre-hook moves the post-hook to the end of the block's forward hooks (torch reads them
    #     after the forward runs; the order of the steady state, one hook, is checked by a length
    #     alone), ahead of hooks marked ``offload_ref.hooks.after_offload`` (observers of what the
    #     offloader leaves).  Global module hooks (``register_module_forward_pre_hook``) and a
    #     pre-hook registered later with ``prepend=True`` still run before the offloader's.

    def _run_post_hook_last(self, hooks: Any) -> None:
        key = self.post_hook_id
        if key not in hooks:
            return
        after = [k for k, h in hooks.items() if runs_after_offload(h)]
        hooks.move_to_end(key)
        for k in after:
            hooks.move_to_end(k)

    def _refuse_edit(self) -> None:
        edited = self.edited()
        raise OffloadWeightEditError(
            f"{edited[0]} (and {len(edited) - 1} more of {self.path}) was edited in place "
            "while its block streams; the ring would drop the edit at the next swap.  "
            "Edit weights inside `with backend.edit_weights(): ...` so the backend re-reads "
            "them (disable() keeps an edit made while the block was on the device)"
        )

    def edited(self) -> list[str]:
        return [n for n, t, v in zip(self.names, self.counters, self.versions)
                if t._version != v]


# Note [One-shot part post-hooks]
#     A part hook runs on every call of every tensor-owning submodule of a streamed block, and
#     torch's hook dispatch is most of its cost: a pre-hook alone costs about as much as the
#     block's own pair, and a post-hook adds a third of that again.  Only a call from outside
#     the block (rare: Note [Block parts] in ring.py) needs a post-hook, so the part carries a
#     pre-hook alone, and that pre-hook registers a post-hook (``always_call``) for the outside
#     call it lets run.  torch reads a module's forward hooks after its forward runs, so a
#     post-hook registered by a pre-hook runs for the same call; ``_one_shot_post_hooks_run``
#     checks that on the running torch once, and parts carry a permanent post-hook where it
#     does not hold.
#
#     Each such post-hook carries its own :class:`_OneShot` (the call's ``nn.Module`` frame and
#     thread) and only ever removes itself: torch calls every hook of its list for the call
#     (a hook removed by another one before its turn would be called with the wrong
#     arguments).  When it fires for its own call it finishes the call and removes itself;
#     for a call that is over without it (a KeyboardInterrupt skips ``always_call`` hooks; the
#     ring recovers the block as from any interrupted forward, Note [Interrupted blocks]) it
#     removes itself; for another live call of the part (nested, or another thread's refused
#     call) it does nothing.  After a forward that raised, torch runs the hooks over the
#     module's hook dict itself, not a copy, and a hook removing itself there would replace
#     the model's error with "OrderedDict mutated during iteration"; so there it only marks
#     itself done, and its next firing removes it.  A second thread's refused call can still
#     see that error (with OffloadConcurrencyError as its context) if the first thread's hook
#     removes itself meanwhile.  ``disable()`` removes every one still registered.


@functools.cache
def _one_shot_post_hooks_run() -> bool:
    """Whether this torch runs a forward hook that a forward pre-hook registered during the
    same call (Note [One-shot part post-hooks])."""
    fired: list[bool] = []
    probe = _Probe()

    def pre(module: nn.Module, args: tuple) -> None:
        module.register_forward_hook(lambda m, a, out: fired.append(True), always_call=True)

    if _INNER_CODE is None:  # not torch's known call path: a hook could not tell when to go
        return False
    probe.register_forward_pre_hook(pre)
    try:
        probe()
    except Exception:  # noqa: BLE001 - e.g. a user's global module hook: keep permanent hooks
        return False
    return bool(fired)


class _Probe(nn.Module):
    """A module whose call touches no tensor (the probe may run under a user's torch mode)."""

    def forward(self) -> None:
        return None


class _OneShot:
    """The post-hook of one outside call of a part (Note [One-shot part post-hooks])."""

    __slots__ = ("done", "frame", "handle", "module", "thread")

    def __init__(self, module: nn.Module, frame: FrameType | None) -> None:
        self.module = weakref.ref(module)
        self.frame = frame
        self.thread = threading.get_ident()
        self.handle: RemovableHandle | None = None
        self.done = False  # the call is finished (or over); the hook is only left to remove

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            return
        # Interrupted inside torch's register_forward_hook, after it stored the hook and before
        # it returned the handle: find the hook by its own _OneShot.
        module = self.module()
        hooks = getattr(module, "_forward_hooks", None) or {}
        for key, hook in list(hooks.items()):
            if isinstance(hook, functools.partial) and hook.args[:1] == (self,):
                del hooks[key]
                for flags in (getattr(module, "_forward_hooks_with_kwargs", {}),
                              getattr(module, "_forward_hooks_always_called", {})):
                    flags.pop(key, None)

    def over(self) -> bool:
        """Whether its call has ended (its frame is no longer on its thread's stack)."""
        return self.frame is not None and not _on_stack(
            self.frame, sys._current_frames().get(self.thread))


class _ReadRefusals:
    """A refused ``.data`` read of a streamed tensor, or a refused in-place edit (Note [Edits
    between forwards] in rebind_guard.py), and the resident state's version counters at enable: the
    next block forward refuses a half-applied edit, or warns that a refused edit left the
    weights as they were (Note [Reads between forwards] in rebind_guard.py)."""

    __slots__ = ("name", "owner", "resident", "op")

    def __init__(self, owner: str = "the backend",
                 resident: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        self.name: str | None = None
        self.op: str | None = None  # the refused in-place op; None: a refused read
        self.owner = owner
        # Plain aliases sharing each counter (a guarded tensor's ``_version`` costs more).
        self.resident = [(n, t.detach(), t._version) for n, t in resident]

    def refused(self, name: str) -> None:
        self.name, self.op = name, None

    def refused_edit(self, name: str, op: str) -> None:
        if self.name is None or self.op is not None:  # a refused read is the graver record
            self.name, self.op = name, op

    def edited(self) -> list[str]:
        return [n for n, alias, v in self.resident if alias._version != v]

    def what(self) -> str:
        if self.op is None:
            return f"a read of {self.name}.data was refused while {self.owner} streams it"
        return (f"an in-place edit ({self.op}) of {self.name} outside edit_weights() was "
                f"refused while {self.owner} streams it")

    def check(self) -> None:
        edited = self.edited()
        if not edited:
            if self.op is not None:
                warnings.warn(
                    f"{self.what()}, before it changed any weight: this generation runs the "
                    "weights as they were.  Redo the edit inside "
                    "`with backend.edit_weights(): ...`", RuntimeWarning, stacklevel=4)
            self.name = self.op = None  # nothing was changed before it
            return
        raise OffloadWeightEditError(
            f"{self.what()}, and {len(edited)} resident weight(s) were edited in place since "
            f"enable (e.g. {edited[:3]}): the code was probably applying one edit to every "
            "weight (a LoRA merge, a cast) and stopped half-way, so this pipeline holds part of "
            "it.  Redo the edit inside `with backend.edit_weights(): ...` (undo the applied part "
            "first if the tool that made it keeps its own record, as peft does), or disable() "
            "to keep what was applied")

    def at_disable(self) -> str | None:
        """What ``disable()`` says of a refusal no generation has reported yet, if any."""
        if self.name is None:
            return None
        edited = self.edited()
        if edited:
            return (f"{self.what()}; {len(edited)} resident weight(s) edited in place before "
                    f"it keep their edit after disable() (e.g. {edited[:3]}): the pipeline "
                    "holds part of that edit.  Undo it, or redo all of it now that the backend "
                    "is disabled")
        return (f"{self.what()}, before it changed any weight: disable() leaves the weights as "
                "they were.  Redo the edit now that the backend is disabled, or inside "
                "`with backend.edit_weights(): ...` next time")


class _ComponentEditGuard(RefusesCopies, ModelHook):
    """On the owner of a ring (a DiT, a streamed encoder): its parameters, streamed and
    resident, take the plain guarded class for its forward and refuse in-place edits outside
    it (Note [Edits between forwards] in rebind_guard.py).  Two class assignments per parameter and
    forward of the component, nothing per block.  A parameter ``disable()`` has unguarded
    meanwhile keeps its class.

    It also holds an entry in the backend's call guard for the whole forward of the component
    (Note [Component entries] in call_guard.py): ``disable()`` from another thread waits until
    the component's forward has ended, its non-block modules (``proj_out``, ``norm_out``) and the
    gaps between blocks included, as it does under model level."""

    def __init__(self, path: str, calls: CallGuard) -> None:
        self.path = path
        self.calls = calls  # the backend's: closed once disable() has begun
        # The call frame of the forward it entered, until its post-hook (Note [Blocks inside
        # their component] in LayerWiseOffloadHook)
        self.frame: FrameType | None = None
        self.tensors: list[torch.Tensor] = []  # its parameters (nested owners' excluded)
        self.params: list[torch.Tensor] = []  # ... once guarded
        self.wrappers: list[torch.Tensor] = []  # its wrapper subclasses (Note [Guarded wrappers])
        self.idle = False

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"{self.path!r} (a streamed component)"

    # Each call sets the class whatever it was: an interrupted forward (no post-hook) leaves
    # the parameters plain until the next one, never refusing inside a forward.
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frame = call_frame()
        calls = self.calls
        if not calls.enter_component(self.path, frame):
            return None  # the backend is being disabled: leave the component alone
        try:
            self.run()
        except BaseException:
            calls.exit_component(frame)
            raise
        self.frame = frame
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        frame = call_frame()
        calls = self.calls
        if not calls.holds_component(frame):
            return None
        try:
            if calls.closed:
                return None
            for t in self.params:
                if type(t) is RUNNING_PARAMETER:
                    t.__class__ = IDLE_PARAMETER
            idle_wrappers(self.wrappers)
            self.idle = bool(self.params) or bool(self.wrappers)
        finally:
            if self.frame is frame:
                self.frame = None
            calls.exit_component(frame)
        return None

    def run(self) -> None:
        """Give the parameters the plain guarded class (the component's forward runs)."""
        self.idle = False
        if self.calls.closed:
            return
        for t in self.params:
            if type(t) is IDLE_PARAMETER:
                t.__class__ = RUNNING_PARAMETER
        run_wrappers(self.wrappers)


class LayerWisePartHook(RefusesCopies, ModelHook):
    """On a tensor-owning submodule of a streamed block: when the model calls it outside the
    block's forward, the block is materialized and waited for around the call (Note [Block
    parts] in ring.py).  Inside the block's forward it does nothing.  Its post-hook exists only
    for an outside call (Note [One-shot part post-hooks])."""

    def __init__(self, block_hook: LayerWiseOffloadHook, path: str) -> None:
        self.block_hook = block_hook
        self.refusal_policy = block_hook.refusal_policy  # Note [Refusal policy] (refusals.py)
        self.ring = block_hook.ring
        self.index = block_hook.index
        self.path = path
        # Calls of this part that ``before_part`` let run and whose post-hook has not run yet
        # (an interrupted one stays counted: its post-hooks then take the full path, as before).
        # Zero in the steady state, so an in-block post-hook returns at once.
        self._outside = 0
        # The one-shot post-hooks registered and not yet removed (``disable()`` removes them).
        self._one_shots: list[_OneShot] = []

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"{self.path!r} (a part of a streamed block)"

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        running = self.ring._running
        if (running and running[-1][0] == self.index or self.ring.is_running(self.index)) \
                and self.block_hook.guard.entered_here():
            return None  # the block's own forward (the steady state)
        frame = call_frame()  # an outside call, or another thread's (the guard refuses it)
        block = self.block_hook
        if not block.guard.enter(self.path, frame):
            return None
        self._outside += 1
        one_shot = None
        try:
            if type(self).post_forward is ModelHook.post_forward:  # one-shot post-hooks
                one_shot = _OneShot(module, frame)
                self._one_shots.append(one_shot)
                one_shot.handle = module.register_forward_hook(
                    functools.partial(self._post_outside, one_shot), with_kwargs=True,
                    always_call=True)
            block.refusal_policy.refuse_autograd(
                block.path, block.names, self.ring.groups[self.index].tensors, args, kwargs, module)
            edited = block.edited()
            if edited:
                raise OffloadWeightEditError(
                    f"{edited[0]} (and {len(edited) - 1} more of {block.path}) was edited in "
                    "place while its block streams; edit weights inside "
                    "`with backend.edit_weights(): ...`")
            with _leave_inference_mode(False):
                self.ring.before_part(self.index, frame)
        except BaseException:
            self._outside -= 1
            if one_shot is not None:  # inside a pre-hook torch holds a copy of the hooks
                self._remove(one_shot)
            block.guard.exit(frame)
            raise
        return None

    def _post_outside(self, one_shot: _OneShot, module: nn.Module, args: tuple,
                      *rest: Any) -> None:
        """The post-hook of one outside call (Note [One-shot part post-hooks]); ``rest`` is
        ``(kwargs, output)``."""
        # After a forward that returned, torch runs the hooks from ``inner`` over a copy of the
        # module's hook dict, where a hook may remove itself (functools.partial adds no frame).
        safe = sys._getframe(1).f_code is _INNER_CODE
        if not one_shot.done:
            frame = call_frame()
            if frame is one_shot.frame:
                one_shot.done = True
                self._finish_outside(frame)
            elif one_shot.over():
                one_shot.done = True
            else:
                return None  # another live call of this part (nested, or another thread's)
        if safe:
            self._remove(one_shot)
        return None

    def _remove(self, one_shot: _OneShot) -> None:
        # Removed before it is forgotten: an interrupt in between leaves a removed hook listed
        # (removing it again does nothing), never a registered one unlisted.
        one_shot.remove()
        if one_shot in self._one_shots:
            self._one_shots.remove(one_shot)

    def _finish_outside(self, frame: FrameType | None) -> None:
        if not self._outside or not self.ring.is_running(self.index):
            return None  # no outside call of this part is pending (the in-block steady state)
        if not self.block_hook.guard.holds(frame):
            return None  # inside the block's forward: the block's own hooks handle it
        self._outside -= 1
        try:
            with _leave_inference_mode(False):
                self.ring.after_part(self.index)
        finally:
            self.block_hook.guard.exit(frame)
        return None

    def remove_pending(self) -> None:
        """Remove every one-shot post-hook still registered (``disable()``)."""
        while self._one_shots:
            self._remove(self._one_shots[-1])


class _PermanentPostPartHook(LayerWisePartHook):
    """A part hook with a permanent post-hook, for a torch that does not run a post-hook
    registered during the same call (Note [One-shot part post-hooks])."""

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._outside:
            return None
        self._finish_outside(call_frame())
        return None


def _block_parts(block: nn.Module, blocks: set[int]) -> list[tuple[str, nn.Module]]:
    """The submodules of ``block`` that own tensors, other blocks and their subtrees excluded."""
    out = []
    skip: list[str] = []
    for name, sub in block.named_modules(remove_duplicate=True):
        if not name:
            continue
        if any(name.startswith(p + ".") for p in skip):
            continue
        if id(sub) in blocks:
            skip.append(name)
            continue
        if next(sub.parameters(), None) is not None or next(sub.buffers(), None) is not None:
            out.append((name, sub))
    return out


class LayerWiseOffloadBackend(OffloadBackend):
    """Streams the declared blocks of the selected components through :class:`BlockRing` s;
    everything else stays on the device.  Selected by ``enable_layerwise_offload`` or compact
    ``mode="layer"`` with rank-local transfer.

    ``prefetch=False`` is a debug switch: every block is loaded synchronously when it runs (the
    serial baseline that overlap measurements compare against).  ``prefetch_depth`` (default 1):
    blocks each ring copies ahead of the running one, one device slot each (Note [Prefetch
    depth] in ring.py); the plan predicts the extra slots.

    Seams (a subclass may override), besides :class:`~offload_ref.backends.base.OffloadBackend`'s
    (``resolve``, ``install``, ``uninstall``, ``after_guard``, ``offloaded_tensors``,
    ``rebound_tensors``, ...):

    * :meth:`transport_for` ``(ring_plan)`` -- the ``Transport`` of one ring (how its host side
      reaches its slots; transports.py).
    * :attr:`ring_class` -- the :class:`BlockRing` each ring is built as (policy class).
    """

    strategy = OffloadStrategy.LAYER_WISE
    hook_name = "offload_ref.layerwise"
    ring_class: type[BlockRing] = BlockRing

    def __init__(self, config, platform, *, prefetch: bool = True,
                 prefetch_depth: int = 1) -> None:
        super().__init__(config, platform)
        self.prefetch = prefetch
        self.prefetch_depth = prefetch_depth
        self.rings: list[BlockRing] = []
        self._resident: ComponentSwapper | None = None
        self._copy_stream: Any = None
        self._hooks: list[LayerWiseOffloadHook] = []
        self._parts: list[LayerWisePartHook] = []
        self._edit_guards: list[_ComponentEditGuard] = []
        self._refusals: _ReadRefusals | None = None
        self._staging: StagingPool | None = None
        self._restored = False  # disable's restore phase is done (a retry only releases)

    def install(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        placeholders = _Placeholders()
        if self._copy_stream is not None:
            try:  # a stream whose work failed skips all later work: this enable starts clean
                self._copy_stream.synchronize()
            except Exception:  # noqa: BLE001 - raised at the generation it broke (and reported)
                self._copy_stream = None
        if self._copy_stream is None:  # one per backend, reused by every enable
            self._copy_stream = self.platform.Stream()
        streams = self.ring_streams()  # Note [Ring streams] (slots.py)
        # Pipeline-managed (on-demand) components stream their declared rings too; only their
        # non-block residency is left to their load_to_device / offload_to_cpu.
        streamed = [c for c in plan.components if c.selected]
        for comp in streamed:
            for ring_plan in comp.rings:
                if len(ring_plan.streamed_blocks) < 2:
                    continue
                ring = self.ring_class(ring_plan, self.platform, self._stats, streams, placeholders,
                                       pin=self.config.pin_memory, prefetch=self.prefetch,
                                       transport=self.transport_for(ring_plan))
                self.rings.append(ring)
                ring.prepare(txn, pipeline)
        self._staging = self._staging_pool(txn)  # Note [Pinned staging] (staging.py)
        ring_storage = set().union(*(r.storage_keys() for r in self.rings)) if self.rings \
            else set()
        # Non-block state is placed by storage identity, so a tensor aliasing a streamed block
        # stays with its ring (Note [Ownership by identity]); pipeline-managed components are
        # left to the pipeline.
        # The tree, then each placed component by its resolved path: a plain-object pipeline
        # may reach a component through a non-module attribute (a dotted path the tree walk
        # does not follow), and its non-block state and resident head belong on the device all
        # the same (the plan predicts them there).
        on_demand = [c.module for c in plan.components if c.on_demand]
        placed = pipeline_state(pipeline, on_demand)
        seen = {id(t) for _, t in placed}
        for comp in plan.components:
            if not comp.on_demand:
                placed += [(n, t) for n, t in named_tensors(comp.module, comp.path)
                           if id(t) not in seen]
                seen.update(id(t) for _, t in placed)
        rest = [(n, t) for n, t in placed if not t.numel() or storage_key(t) not in ring_storage]
        resident = ComponentSwapper(self.platform, self._stats)
        self._resident = resident
        resident.prepare(txn, [], [("<resident>", rest)], pin=False)
        for ring in self.rings:
            ring.commit(txn)
        # Note [Reads between forwards] (rebind_guard.py): a streamed tensor's guarded .data reads
        # only while its block runs.
        streamed_tensors = [t for ring in self.rings for g in ring.groups for t in g.tensors]
        # Note [Wrapper subclasses] (plan/tree.py): a streamed wrapper stays on the device
        self.wrappers.keep_on_device({id(t): v for ring in self.rings
                                      for k, g in enumerate(ring.groups)
                                      for t, v in zip(g.tensors, ring.slots[0].views[k])})
        txn.on_rollback(lambda: forget_readable(streamed_tensors))
        refusals = _ReadRefusals(type(self).__name__, resident.named_tensors())
        self._refusals = refusals
        if self.refusal_policy.refuses_reads_between_forwards:  # Note [Refusal policy]
            for ring in self.rings:
                for k, group in enumerate(ring.groups):
                    # a block's wrapper subclasses too (Note [Guarded wrappers] in
                    # rebind_guard.py)
                    wrappers = self.wrappers.holding(group.tensors)
                    txn.on_rollback(functools.partial(forget_readable, wrappers))
                    readable_while([*group.tensors, *wrappers],
                                   functools.partial(ring.is_running, k), refusals.refused)
        self._hooks = []
        self._parts = []
        blocks = {id(b) for ring in self.rings for b in ring.blocks}
        parts: set[int] = set()
        for ring in self.rings:
            for k, (block, path) in enumerate(zip(ring.blocks, ring.block_paths)):
                hook = LayerWiseOffloadHook(ring, k, self._guard, refusals, self.refusal_policy)
                self._hooks.append(hook)
                txn.register_hook(block, self.hook_name, hook, path)
                # Note [Block parts] (ring.py): a submodule the model calls outside the block.
                for name, sub in _block_parts(block, blocks):
                    if id(sub) in parts:  # shared by two blocks: served by its first
                        continue
                    parts.add(id(sub))
                    part_class = (LayerWisePartHook if _one_shot_post_hooks_run()
                                  else _PermanentPostPartHook)
                    part = part_class(hook, f"{path}.{name}")
                    self._parts.append(part)
                    txn.register_hook(sub, self.hook_name + ".part", part, f"{path}.{name}")
        # Note [Edits between forwards] (rebind_guard.py): each ring's owner, innermost first (a
        # nested ring's owner guards its own parameters).
        self._edit_guards = []
        claimed: set[int] = set()
        guards: dict[str, _ComponentEditGuard] = {}
        for path in sorted({r.plan.owner_path for r in self.rings}, key=lambda p: -p.count(".")):
            owner = get_submodule_path(pipeline, path)
            if not isinstance(owner, nn.Module):
                continue
            guard = guards[path] = _ComponentEditGuard(path, self._guard)
            guard.refusal_policy = self.refusal_policy  # Note [Refusal policy] (refusals.py)
            # Note [Guarded wrappers] (rebind_guard.py): its wrappers take their own class for
            # its forward
            wrappers = [(n, w) for n, w in wrappers_in([(path, owner)]) if id(w) not in claimed]
            guard.tensors = [t for t in owner.parameters() if id(t) not in claimed]
            claimed.update(id(t) for t in guard.tensors)
            claimed.update(id(w) for _, w in wrappers)
            guard.wrappers = [w for _, w in wrappers]
            self.wrapper_guards += wrappers
            self._edit_guards.append(guard)
            txn.register_hook(owner, self.hook_name + ".edits", guard, path)
        for hook in self._hooks:
            hook.component = guards.get(hook.ring.plan.owner_path)

    def after_guard(self, txn: Transaction) -> None:
        # Note [Edits between forwards] (rebind_guard.py): the rings' components refuse in-place
        # edits outside their forwards.  A rollback unguards them with the rest.
        txn.step("refuse in-place edits of streamed components between forwards")
        report = self._refusals.refused_edit
        for guard in self._edit_guards:
            guard.params = refuse_edits_between_forwards(guard.tensors, report)
            guard.idle = bool(guard.params) or bool(guard.wrappers)

    def transport_for(self, ring_plan: Any) -> Transport | None:
        """The transport of the ring ``ring_plan`` plans (None: rank-local host masters)."""
        return None

    def ring_streams(self) -> RingStreams:
        """The streams this enable's rings share (Note [Ring streams] in slots.py): the backend's
        copy stream."""
        return RingStreams(self.platform, self._copy_stream)

    def _staging_pool(self, txn: Transaction) -> StagingPool | None:
        """The pinned staging pool of the rings served from file pages, if they use one (Note
        [Pinned staging] in staging.py): ``OffloadConfig.staging_slots`` slots of the largest
        file-backed block (default: two where the platform pins memory), as many as
        ``staging_budget_bytes`` holds when it is set."""
        mapped = [r for r in self.rings if r.maps_files]
        if not mapped:
            return None
        config = self.config
        slots = config.staging_slots
        if slots is None and config.staging_budget_bytes is None:
            slots = 2 if config.pin_memory and self.platform.pin_memory_supported else 0
        if slots == 0:
            return None
        slot_bytes = max(r.mapped_image_bytes() for r in mapped)
        if config.staging_budget_bytes is not None:
            fit = config.staging_budget_bytes // slot_bytes
            slots = fit if slots is None else min(slots, fit)
            if slots < 2:  # the resolver refuses this before any mutation
                raise OffloadTopologyError(staging_budget_error(config.staging_budget_bytes,
                                                                slot_bytes))
        pool = StagingPool(self.platform, self._stats, slot_bytes=slot_bytes, slots=slots,
                           pin=config.pin_memory)
        pool.prepare(txn, "layerwise")
        for ring in mapped:
            ring.use_staging(pool)
        return pool

    def rebound_tensors(self) -> list[tuple[str, Any]]:
        named = [n for ring in self.rings for g in ring.groups for n in g.named_tensors()]
        if self._resident is not None:
            named += self._resident.named_tensors()
        return named

    def offloaded_tensors(self) -> dict[int, Any]:
        """A streamed tensor reads as a copy of its host master (Note [Weight edits]): a copy,
        so editing a state_dict value never writes a master; from the master even while the
        block is bound to a slot, whose prefetch copy may still be in flight on the copy
        stream."""
        out: dict[int, Any] = {}
        for ring in self.rings:
            for k, group in enumerate(ring.groups):
                for i, t in enumerate(group.tensors):
                    out[id(t)] = lambda ring=ring, k=k, i=i: ring.true_value(k, i)
        return out

    def uninstall(self, pipeline: Any) -> None:
        if not self._restored:  # a retry after a release that raised only releases
            self._restore_all()
            self._restored = True
        self.platform.synchronize()
        for ring in list(self.rings):  # each forgotten once released: a retry releases the rest
            ring.release(); self.rings.remove(ring)  # noqa: E702 (Note [Undo first])
        if self._staging is not None:
            self._staging.release(); self._staging = None  # noqa: E702

    def _restore_all(self) -> None:
        """Every tensor back at its original placement, hooks removed (disable's first phase;
        raises before it changes anything, or completes)."""
        if self._staging is not None:
            self._staging.close()  # no staging is issued from here on (synchronized below)
        for guard in self._edit_guards:  # unguarded: no class swaps from now on
            guard.params, guard.wrappers, guard.idle, guard.frame = [], [], False, None
        refused = self._refusals.at_disable() if self._refusals is not None else None
        if refused is not None:
            warnings.warn(refused, RuntimeWarning, stacklevel=4)
        # A streamed block edited in place cannot keep the edit: between generations its slot
        # may still be filling (a prefetch in flight), so the edit may have raced with the copy.
        # Its masters are restored, loudly (Note [Weight edits]).
        edited = [name for h in self._hooks for name in h.edited()]
        if edited:
            warnings.warn(
                f"{len(edited)} streamed weight(s) were edited in place outside edit_weights() "
                f"(e.g. {edited[:3]}); disable() restores them from their host masters, because "
                "the edit may have raced with a prefetch copy.  Edit streamed weights inside "
                "`with backend.edit_weights(): ...`", RuntimeWarning, stacklevel=4)
        restored = [ring.restored_views() for ring in self.rings]  # may raise: nothing changed
        self.platform.synchronize()
        assert self._resident is not None
        self._resident.restore()
        for ring, views in zip(self.rings, restored):
            for group, vs in zip(ring.groups, views):
                for t, v in zip(group.tensors, vs):
                    rebind_restored(t, v)
        self.registry.remove_all()
        for part in self._parts:
            part.remove_pending()
        # Every streamed tensor's read rule goes, buffers included (unguard_rebinds forgets the
        # parameters' only): an entry left behind would keep the refusal record, and through it
        # the resident state's device storage, alive after disable().
        forget_readable([t for ring in self.rings for g in ring.groups for t in g.tensors])

    def _reset(self) -> None:
        # After a rollback the undo log has already freed the slots and masters.
        self._restored = False
        self.rings = []
        self._hooks = []
        self._parts = []
        self._edit_guards = []
        self._refusals = None
        self._staging = None
        self._resident = None

    def materialized_blocks(self) -> dict[str, list[int]]:
        """Ring label -> indices of the blocks currently bound to device slots."""
        return {ring.label: ring.materialized() for ring in self.rings}


# Old names (``Layerwise``), kept for one release: the class names spell it ``LayerWise``, as
# ``OffloadStrategy.LAYER_WISE`` and :class:`LayerWiseOffloadBackend` do.
LayerwiseOffloadHook = LayerWiseOffloadHook  # old name, kept for one release
LayerwisePartHook = LayerWisePartHook  # old name, kept for one release
