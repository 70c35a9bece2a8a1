"""A wrapper subclass's own device follows its inner tensors (Note [Wrapper subclasses] in
plan/tree.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..plan.tree import tensor_leaves, wrappers_in
from .rebind_guard import set_data

__all__ = ["NO_WRAPPERS", "WrapperSet"]


class WrapperSet:
    """The wrapper subclasses of one enable, each with what rebuilds it: its inner tensors'
    names and its ``__tensor_flatten__`` context, size and strides as it was built.

    :meth:`follow` runs after every rebind that may move inner tensors to another device (enable,
    a model-level swap, a settle, disable, a rollback): a wrapper whose device differs from its
    inner tensors' takes the metadata of one ``__tensor_unflatten__`` builds around them (the
    ``TensorBase.data`` setter: the module keeps the same object, and its attributes, the inner
    tensors, are the ones the backend rebinds).  With no wrapper it does nothing."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        #: ``(qualified name, wrapper)``, inner wrappers first.
        self.named = list(named)
        self.entries: list[tuple[torch.Tensor, list[str], Any, torch.Size, tuple[int, ...]]] = []
        for _, w in self.named:
            names, ctx = w.__tensor_flatten__()
            self.entries.append((w, list(names), ctx, w.size(), w.stride()))
        self.inference = [w.is_inference() for _, w in self.named]
        # each wrapper's leaves, found once: ``holding`` runs once per streamed block
        self._leaf_ids = [[id(leaf) for _, leaf in tensor_leaves("", w)] for _, w in self.named]
        # id(wrapper) -> device stand-ins of its inner tensors, to build it around while
        # enabled, whatever they are bound to (:meth:`keep_on_device`)
        self._kept: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, roots: Iterable[tuple[str, nn.Module]]) -> WrapperSet:
        """The wrappers of each ``(prefix, module)`` of ``roots``."""
        return cls(wrappers_in(roots))

    def holding(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The wrappers whose inner tensors (all of them) are among ``tensors``."""
        ids = {id(t) for t in tensors}
        return [w for (w, *_), leaves in zip(self.entries, self._leaf_ids)
                if leaves and all(i in ids for i in leaves)]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def keep_on_device(self, views: dict[int, torch.Tensor]) -> None:
        """Keep every wrapper whose inner tensors all have a device view in ``views``
        (``id(inner tensor) -> a device tensor of its shape and strides``: a ring's slot views)
        on the device while enabled, built around those views: a ring's inner tensors move
        between host placeholders and device slots at every block and are read on the device
        only, in the block's forward (between forwards a guarded wrapper's ``.data`` is refused,
        Note [Guarded wrappers] in rebind_guard.py), so its wrapper never has to follow them."""
        for w, names, *_ in self.entries:
            inner = [getattr(w, name) for name in names]
            if inner and all(id(t) in views for t in inner):
                self._kept[id(w)] = {name: views[id(t)] for name, t in zip(names, inner)}

    def follow(self, *, as_built: bool = False) -> None:
        """Give each wrapper the device of its inner tensors (inner wrappers first).  A wrapper
        built under ``torch.inference_mode()`` becomes an ordinary tensor (as its inner tensors
        do: Note [Inference tensors] in inference.py), and with ``as_built`` (disable, a
        rollback) an inference tensor again."""
        for (w, names, ctx, size, stride), was_inference in zip(self.entries, self.inference):
            inner = None if as_built else self._kept.get(id(w))
            if inner is None:
                inner = {name: getattr(w, name) for name in names}
            device = next((t.device for t in inner.values() if t.numel()),
                          next(iter(inner.values())).device if inner else w.device)
            inference = as_built and was_inference
            if w.is_inference() != inference:
                # the .data setter would leave an inference tensor without a version counter
                with torch.inference_mode(inference):
                    twin = type(w).__tensor_unflatten__(inner, ctx, size, stride)
                twin.__dict__.update(w.__dict__)  # its own inner tensors, whatever it was built around
                torch.utils.swap_tensors(w, twin)
            elif w.device != device:
                set_data(w, type(w).__tensor_unflatten__(inner, ctx, size, stride))


NO_WRAPPERS = WrapperSet(())
