"""Mutants of what users do next to a generation (§J.3-§J.8): the checks they fail are in
checks/misuse.py."""

from __future__ import annotations

import contextlib
from typing import Any

from offload_ref.backends.layerwise import LayerWiseOffloadBackend

from ._declare import _patched, _patched_all


def _split_threads_unguarded() -> Any:
    """ComponentGroups without its call guard: two threads swap the groups at once."""
    from offload_ref.split import ComponentGroups

    @contextlib.contextmanager
    def activated(self, name):
        if self._swapper is not None:
            self._swapper.check(name)
            self._swapper.activate(name)
        yield

    return _patched(ComponentGroups, "_activated", activated)


class _EditsUnguarded(LayerWiseOffloadBackend):
    """Streams without refusing in-place edits between forwards: a loop editing every DiT weight
    changes the resident ones and stops at the first placeholder with torch's raw error."""

    def _after_guard(self, txn) -> None:
        pass


def _editing_in_place(base: type) -> type:
    """edit_weights() that yields the enabled pipeline: edits hit masters and placeholders."""

    @contextlib.contextmanager
    def edit_weights(self):
        yield self.pipeline

    return type(f"EditsInPlace{base.__name__}", (base,), {"edit_weights": edit_weights})


class _PlaceholderStateDict(LayerWiseOffloadBackend):
    """state_dict() reads whatever the tensors are bound to (placeholders between blocks)."""

    def _offloaded_tensors(self):
        return {key: None for key in super()._offloaded_tensors()}


def _unguarded(base: type) -> type:
    """Edits through ``.data`` pass unseen (no Note [Rebind guard]): the next swap drops them."""
    return type(f"Unguarded{base.__name__}", (base,), {"_rebound_tensors": lambda self: []})


def _backward_not_refused() -> Any:
    from offload_ref.backends import layerwise

    return _patched(layerwise, "refuse_autograd", lambda *args, **kwargs: None)


def _reads_between_forwards_allowed() -> Any:
    """Note [Reads between forwards] undone: ``.data`` of a streamed tensor reads whatever it is
    bound to (NaN placeholders, a slot still filling) between forwards."""
    from offload_ref.backends import layerwise

    return _patched(layerwise, "readable_while", lambda *args, **kwargs: None)


def _frozen_backward_not_refused() -> Any:
    """Note [Autograd] checking only whether the offloaded weights require grad: a frozen
    weight is still saved for the gradient of an input, and read back as a placeholder."""
    from offload_ref.backends import layerwise
    from offload_ref.backends import refusals as guard

    def weights_only(label, names, tensors, args=(), kwargs=None, module=None):
        guard.refuse_autograd(label, names, tensors)

    return _patched(layerwise, "refuse_autograd", weights_only)


def _unguarded_calls() -> Any:
    from offload_ref.backends.call_guard import CallGuard

    return _patched_all(CallGuard, enter=lambda self, label, frame: True,
                        holds=lambda self, frame: True, exit=lambda self, frame: True)


def _copies_not_refused() -> Any:
    """Note [No copies while enabled] undone: a deep copy or pickle of an enabled module
    copies its hooks, and fails deep inside with torch's "cannot pickle '_thread.lock'"."""
    from offload_ref.backends.refusals import RefusesCopies

    return _patched_all(RefusesCopies, __deepcopy__=None, __copy__=None,
                        __reduce_ex__=object.__reduce_ex__)
