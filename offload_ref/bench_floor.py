"""The per-block floor: what any layerwise offloader with offload-ref's guarantees pays per block
on the many-blocks DiT, with none of its bookkeeping.

Note [Per-block floor]
    ``offload-ref bench`` reports layerwise's per-block host overhead (Note [Per-block overhead]
    in bench.py) beside the floor, timed in the same interleaved run: the many-blocks DiT with
    the hooks layerwise installs (a pre- and an always-called post-hook on each block, a
    pre-hook on its ``nn.Linear``) doing only the work no such offloader can skip:

    * one host-to-slot copy per block, of the block predicted next, into the other of two slots;
    * that block's tensors rebound to the slot's views, and the finished block's tensors rebound
      to NaN placeholders (so a block that is not materialized never reads stale weights);
    * the parameters of the guarded class (``RUNNING_PARAMETER``: ``.data`` reads between
      forwards are refused, Note [Reads between forwards] in backends/rebind_guard.py), which
      costs torch's argument parser a subclass check on every op that reads them.

    Everything layerwise costs above the floor is its own bookkeeping: the call guard (one thread
    at a time), the call-order predictor, the edit and autograd checks, events, statistics and
    the part hook's test for calls from outside the block.  The floor computes exactly what the
    resident model computes (:func:`floor_hooks` is checked against it in the tests).
    ``ci/per_block_instructions.py`` counts the same variants in instructions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backends.rebind_guard import RUNNING_PARAMETER, set_data

__all__ = ["floor_hooks"]


def _block_tensors(block: nn.Module) -> list[torch.Tensor]:
    return [*block.parameters(), *block.buffers()]


def floor_hooks(blocks: list[nn.Module]) -> list[Any]:
    """Install the floor's hooks on ``blocks`` (host tensors; see Note [Per-block floor]) and
    return their handles.  The blocks' tensors are rebound for good: use a pipeline of its own."""
    tensors = [_block_tensors(block) for block in blocks]
    dtypes = {t.dtype for ts in tensors for t in ts}
    if len(dtypes) != 1:
        raise ValueError(f"the floor packs one dtype per block; these blocks hold {dtypes}")
    masters = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in tensors]
    size = max(m.numel() for m in masters)
    slots = [torch.empty(size, dtype=masters[0].dtype) for _ in range(2)]

    def views(slot: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        out, at = [], 0
        for t in ts:
            out.append(slot[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return out

    slot_views = [[views(slot, ts) for ts in tensors] for slot in slots]
    nan = torch.full((), float("nan"), dtype=masters[0].dtype)
    placeholders = [[nan.expand(t.shape) for t in ts] for ts in tensors]
    for k, ts in enumerate(tensors):
        for t, v in zip(ts, placeholders[k]):
            set_data(t, v)
            if isinstance(t, nn.Parameter):
                t.__class__ = RUNNING_PARAMETER
    slots[0][:masters[0].numel()].copy_(masters[0])
    for t, v in zip(tensors[0], slot_views[0][0]):
        set_data(t, v)
    n = len(blocks)

    def pair(k: int) -> tuple[Any, Any]:
        q, s = (k + 1) % n, (k + 1) % 2
        fill, source = slots[s][:masters[q].numel()], masters[q]

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            fill.copy_(source)
            for t, v in zip(tensors[q], slot_views[s][q]):
                set_data(t, v)

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            for t, v in zip(tensors[k], placeholders[k]):
                set_data(t, v)

        return pre, post

    def part(module: nn.Module, args: tuple, kwargs: dict) -> None:
        return None

    handles = []
    for k, block in enumerate(blocks):
        pre, post = pair(k)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))
        for child in block.modules():  # the parts layerwise hooks: every tensor-owning one
            if child is not block and (next(child.parameters(), None) is not None
                                       or next(child.buffers(), None) is not None):
                handles.append(child.register_forward_pre_hook(part, with_kwargs=True))
    return handles
