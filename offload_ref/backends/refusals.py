"""What an enabled backend refuses besides a second thread (call_guard.py) and edits through
``.data`` (rebind_guard.py): autograd through streamed weights, weight edits it cannot honour,
and copies of what it attaches to a module.

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

Note [Refusal policy]
    Which of these refusals a backend applies is its :class:`RefusalPolicy`, named by the
    backend class (``OffloadBackend.refusal_policy_class``; each enable makes the backend's
    ``refusal_policy``): the hooks of layerwise and model level refuse autograd through it, the
    layerwise backend asks it whether a streamed tensor's ``.data`` refuses reads between
    forwards (Note [Reads between forwards] in rebind_guard.py), and every object the backend
    attaches to a module (:class:`RefusesCopies`) refuses copies through it.  The policy is
    stateless; a backend subclass names another one (the kit's mutants: a backend that lets one
    of these through).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..plan.tree import wrapper_inner

__all__ = [
    "OffloadAutogradError",
    "OffloadWeightEditError",
    "RefusalPolicy",
    "RefusesCopies",
    "refuse_autograd",
    "refuse_copy",
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


class RefusalPolicy:
    """What an enabled backend refuses, as one stateless object (Note [Refusal policy]).

    Seams (a subclass may override):

    * :meth:`refuse_autograd` -- Note [Autograd]: raise before a forward that would record a
      graph saving offloaded tensors (the hooks call it only with grad mode on).
    * :attr:`refuses_reads_between_forwards` -- Note [Reads between forwards] (rebind_guard.py):
      whether the layerwise backend lets a streamed tensor's ``.data`` be read only while its
      block runs.
    * :meth:`refuse_copy` -- Note [No copies while enabled]: raise for a copy or pickle of an
      object the backend attached; returning lets the copy proceed as any object's.
    """

    #: Note [Reads between forwards] (rebind_guard.py).
    refuses_reads_between_forwards: bool = True

    def refuse_autograd(self, label: str, names: Sequence[str], tensors: Sequence[torch.Tensor],
                        args: Any = (), kwargs: Any = None,
                        module: nn.Module | None = None) -> None:
        """:func:`refuse_autograd`."""
        refuse_autograd(label, names, tensors, args, kwargs, module)

    def refuse_copy(self, subject: str) -> None:
        """:func:`refuse_copy`."""
        refuse_copy(subject)


#: The policy of offload-ref's backends (and of an object no backend gave one).
REFUSE_ALL = RefusalPolicy()


class RefusesCopies:
    """Mixin for what an enabled backend attaches to a module: ``copy.deepcopy``, ``copy.copy``
    and pickling raise a ``TypeError`` naming :meth:`_copy_subject` (Note [No copies while
    enabled]).  All three reach ``__reduce_ex__``, which asks :attr:`refusal_policy` (the
    backend's, Note [Refusal policy]); a policy that lets the copy through gets an ordinary copy
    of the object."""

    __slots__ = ()

    #: Set by the backend that attaches the object (a class attribute default otherwise).
    refusal_policy: RefusalPolicy = REFUSE_ALL

    def _copy_subject(self) -> str:
        return "a module"

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.refusal_policy.refuse_copy(self._copy_subject())
        return object.__reduce_ex__(self, protocol)



class OffloadAutogradError(RuntimeError):
    """A forward through streamed or swapped weights ran with autograd recording (Note
    [Autograd])."""


class OffloadWeightEditError(RuntimeError):
    """An offloaded weight was edited outside ``backend.edit_weights()`` (Note [Weight edits])."""



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
            if p.requires_grad and wrapper_inner(p) is not None:  # its inner tensors stream
                _refuse_recording(label, f"its offloaded weight {name} requires grad",
                                  "freeze the weights (module.requires_grad_(False))")
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

