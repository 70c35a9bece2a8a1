"""The ``.data`` guard: while a backend is enabled, each parameter it rebinds has a guarded class
whose ``.data`` sees or refuses edits, refuses reads between its block's forwards, and (outside
the forward that uses it) refuses in-place edits.

Note [Rebind guard]
    ``.data`` bypasses the version counter: ``w.data += delta`` (peft's LoRA merge, diffusers'
    ``fuse_lora``) writes the storage without bumping ``w._version``, and ``w.data = new``
    (``module.to(dtype)``, ``enable_layerwise_casting``, peft's safe merge) rebinds it.  The
    next swap or block load rebinds the tensor again and drops either edit, silently.  So while
    a backend is enabled, every parameter it rebinds (exactly ``nn.Parameter``; subclasses keep
    their class) has its class changed to a subclass whose only difference is ``.data``:
    reading it returns ``detach()`` (the same storage, sharing the version counter, so an edit
    through it is refused like any in-place edit, Note [Weight edits] in refusals.py), and
    assigning anything but the same view raises
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..plan.tree import wrapper_inner
from .refusals import OffloadWeightEditError

__all__ = [
    "forget_readable",
    "get_data",
    "guard_rebinds",
    "guarded_by",
    "readable_while",
    "refuse_edits_between_forwards",
    "set_data",
    "unguard_rebinds",
]


# -- Note [Rebind guard] ----------------------------------------------------------------------

#: The ``TensorBase.data`` setter itself: the backends' own rebinds (a guarded tensor's
#: ``.data = v`` refuses anything but the same view).
set_data = torch._C.TensorBase.data.__set__
#: The ``TensorBase.data`` getter itself (a fresh version counter, as plain ``.data``).
get_data = torch._C.TensorBase.data.__get__

# id(tensor) -> (qualified name, owner) of every guarded tensor, for the error message.
_GUARDED: dict[int, tuple[str, str]] = {}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    inner_a, inner_b = wrapper_inner(a), wrapper_inner(b)
    if inner_a is not None or inner_b is not None:  # Note [Wrapper subclasses] (plan/tree.py)
        return (inner_a is not None and inner_b is not None and len(inner_a) == len(inner_b)
                and a.shape == b.shape and a.dtype == b.dtype
                and all(_same_view(x, y) for (_, x), (_, y) in zip(inner_a, inner_b)))
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
    if id(self) not in _GUARDED:  # a guarded wrapper class's op made this one: not ours
        set_data(self, value)
        return
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


# Note [Guarded wrappers]
#     A wrapper subclass (Note [Wrapper subclasses] in plan/tree.py) streams by its inner
#     tensors, which are plain tensors and keep their class; its own ``.data`` is what code
#     reads and assigns (a fused projection, a LoRA merge, ``module.to(dtype)``).  So while a
#     backend is enabled each wrapper it offloads has, outside the forward that uses it, a
#     guarded subclass of its class: ``.data`` as a guarded parameter's (a read between its
#     block's forwards refused, an assignment refused), every other op handed to the original
#     class's ``__torch_dispatch__`` / ``__torch_function__`` (a subclass keyed op table, as
#     torchao's, finds its entries).  Inside the forward it has its own class again
#     (:func:`run_wrappers`, from the component's hook): a forward sees the type it was built
#     with.  Between forwards ``type(w)`` is the guarded class, ``isinstance`` holds.

def _wrapper_guard(cls: type) -> type:
    """The guarded subclass of the wrapper class ``cls`` (Note [Guarded wrappers])."""
    guarded = _GUARDED_CLASS.get(cls)
    if guarded is not None:
        return guarded
    namespace: dict[str, Any] = {
        "data": _GUARDED_DATA,
        "__module__": __name__,
        "__qualname__": f"_Guarded{cls.__name__}",
        "__doc__": f"A {cls.__name__} an offload backend guards (Note [Guarded wrappers]).",
    }
    for hook in ("__torch_dispatch__", "__torch_function__"):
        original = getattr(cls, hook, None)
        if original is None or original is torch._C._disabled_torch_function_impl:
            continue
        namespace[hook] = classmethod(
            lambda _, *args, _original=original, **kwargs: _original(*args, **kwargs))
    guarded = type(f"_Guarded{cls.__name__}", (cls,), namespace)
    _GUARDED_CLASS[cls] = guarded
    _ORIGINAL[guarded] = cls
    return guarded


def run_wrappers(wrappers: Sequence[torch.Tensor]) -> None:
    """Give each guarded wrapper its own class for the forward that uses it (Note [Guarded
    wrappers])."""
    for t in wrappers:
        original = _ORIGINAL.get(type(t))
        if original is not None and id(t) in _GUARDED:
            t.__class__ = original


def idle_wrappers(wrappers: Sequence[torch.Tensor]) -> None:
    """... and its guarded class again after it."""
    for t in wrappers:
        if id(t) in _GUARDED and type(t) not in _ORIGINAL:
            t.__class__ = _wrapper_guard(type(t))


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
            if wrapper_inner(t) is None:
                continue
            guarded = _wrapper_guard(type(t))  # Note [Guarded wrappers]
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
