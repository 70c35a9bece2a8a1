"""Byte arithmetic of a resolved plan: its predicted peak device bytes
(:func:`predict_device_bytes`), the span bytes of tensors, ring slots and AllGather shards, and
the staging budget's refusal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config import OffloadStrategy, WeightTransfer
from ..host import padded_span_bytes, storage_key, tensor_extent
from .resolved import (
    ComponentRole,
    ResolvedComponent,
    ResolvedOffloadPlan,
    _streamed_tensors,
    owned_tensors,
)
from .tree import _tensors, pipeline_state


def _ring_tensors(plan: ResolvedOffloadPlan) -> list[tuple[Any, list[list[torch.Tensor]]]]:
    """Each ring that streams (two blocks or more) with its streamed blocks' tensors: one walk
    per block, shared by the device and the host predictions of one resolution."""
    return [(s, [_streamed_tensors(s, k) for k in range(len(s.streamed_blocks))])
            for s in plan.rings if len(s.streamed_blocks) >= 2]


def predict_device_bytes(plan: ResolvedOffloadPlan,
                         rings: list[tuple[Any, list[list[torch.Tensor]]]] | None = None) -> int:
    """The predicted peak device bytes of ``plan`` (``ResolvedOffloadPlan.device_bytes_bound``,
    which the resolver sets with it; a plan changed after resolution can be predicted again).

    Model level keeps the resident state plus the largest swap group (one DiT, or the
    encoders); layerwise keeps everything but the streamed blocks, plus two of each ring's
    largest block.  A swap group is its component's own tensors (:func:`owned_tensors`);
    pipeline-managed (on-demand) components hold no bytes of ours, but their rings do.  Bytes
    are storage spans, counted once however many paths reach them, each in its aligned region
    (the bytes a host master or device copy allocates, padding included)."""
    if not plan.components:
        return plan.other_state_bytes
    a = plan.alignment
    placed = [c for c in plan.components if not c.on_demand]
    if plan.strategy is OffloadStrategy.MODEL_LEVEL:
        swapped = [c for c in placed
                   if c.selected and c.role in (ComponentRole.DIT, ComponentRole.ENCODER)]
        kept = _span_bytes(_tensors(*(c.module for c in placed if c not in swapped)), a)
        groups = [_span_bytes((t for _, t in owned_tensors(plan, c)), a)
                  for c in swapped if c.role == ComponentRole.DIT]
        groups.append(_span_bytes((t for c in swapped if c.role == ComponentRole.ENCODER
                                   for _, t in owned_tensors(plan, c)), a))
        return plan.other_state_bytes + kept + max(groups)
    held = _tensors(*(c.module for c in placed))
    held_ids = {id(t) for t in held}
    # One walk per block: its streamed tensors serve both its slot size and the streamed total.
    rings = _ring_tensors(plan) if rings is None else rings
    per_block = [[_span_bytes(ts, a) for ts in blocks] for _, blocks in rings]
    streamed = _span_bytes([t for _, blocks in rings for ts in blocks for t in ts
                            if id(t) in held_ids], a)
    return (plan.other_state_bytes + _span_bytes(held, a) - streamed
            + sum(s.slots * _slot_bytes(max(sizes), s.transfer, plan.world_size, a)
                  for (s, _), sizes in zip(rings, per_block)))


def staging_budget_error(budget: int, slot_bytes: int) -> str:
    """The refusal of a staging budget that cannot hold two slots (Note [Pinned staging] in
    backends/staging.py)."""
    return (f"OffloadConfig.staging_budget_bytes = {budget} cannot hold two pinned staging "
            f"slots of the largest file-backed block ({slot_bytes} bytes each, "
            f"{2 * slot_bytes} for two): one slot is filled while the copy reads the other.  "
            f"Raise it to at least {2 * slot_bytes}, or set staging_slots=0 to copy from the "
            "file pages directly")


def shard_bytes(image_bytes: int, world: int, alignment: int) -> int:
    """Bytes of each rank's shard of a block whose slot image has ``image_bytes`` bytes, for an
    AllGather across ``world`` ranks: ceil(image / world), rounded up to ``alignment`` (Note
    [AllGather transport] in backends/distributed.py)."""
    if not image_bytes:
        return 0
    share = -(-image_bytes // world)
    return -(-share // alignment) * alignment


def _slot_bytes(image_bytes: int, transfer: WeightTransfer, world: int, alignment: int) -> int:
    """Bytes of one ring slot for the largest block's ``image_bytes``: the image itself, or
    ``world`` shards of it for AllGather."""
    if transfer is not WeightTransfer.ALLGATHER or world == 1:
        return image_bytes
    return world * shard_bytes(image_bytes, world, alignment)


def _span_bytes(tensors: Iterable[torch.Tensor], alignment: int) -> int:
    """Bytes a host master of ``tensors`` allocates: per storage (counted once), the aligned
    region of the span its tensors touch (Note [Aligned layout] in host.py)."""
    return padded_span_bytes(tensors, alignment)


def _other_state_bytes(pipeline: Any, components: list[ResolvedComponent],
                       alignment: int) -> int:
    """Span bytes of the pipeline's tensors reachable from no component (they stay on the
    device whatever the strategy); a view into a component's storage adds only what it touches
    beyond that storage's span.  A plain-object pipeline's are those of its undeclared module
    attributes (:func:`~offload_ref.plan.tree.pipeline_state`, the walk the backends place
    the pipeline's own state by)."""
    mine = _tensors(*(c.module for c in components))
    # The same distinct tensors as _tensors(pipeline, *modules), without walking the components
    # twice (a span total does not depend on the order).
    seen = {id(t) for t in mine}
    everything = list(mine)
    if isinstance(pipeline, nn.Module):
        everything += [t for t in _tensors(pipeline) if id(t) not in seen]
    else:
        modules = [c.module for c in components if isinstance(c.module, nn.Module)]
        for _, t in pipeline_state(pipeline, modules):
            if id(t) not in seen:
                seen.add(id(t))
                everything.append(t)
    return _span_bytes(everything, alignment) - _span_bytes(mine, alignment)


# Note [Host bytes]
#     ``enable()`` allocates host memory for the host masters only: under model level one
#     master per swapped component (a DiT, or an encoder; on-demand components keep their own),
#     under layerwise one per streamed block of every ring (its resident non-block state goes to
#     the device, and a resident block is placed there once).  A master is one flat buffer per
#     dtype of the group's tensors, each storage's span in its aligned region (Note [Aligned
#     layout] in host.py), so its bytes are the span bytes of the group's tensors of that dtype.
#     Under layerwise a tensor whose storage is file pages (mmap-loaded) is served from those
#     pages and costs nothing; the other tensors of such a block get exact-size private copies,
#     one per storage span (model level copies file-backed weights into its masters as any
#     others).  Rings served from file pages add a pinned staging pool when they use one (its size
#     depends on the platform: ``stats().staging_pool_bytes``; Note [Pinned staging]), which
#     this prediction leaves out.  An AllGather ring keeps a rank's shard, not whole blocks.
#     These are requested sizes: ``platform.host_allocated()`` after ``enable()`` equals their
#     sum; a platform that pins through a caching allocator may lock more
#     (``host_lock_bytes``, checked against ``OffloadConfig.host_budget_bytes``).


def host_allocations(plan: ResolvedOffloadPlan,
                     rings: list[tuple[Any, list[list[torch.Tensor]]]] | None = None
                     ) -> tuple[tuple[str, int], ...]:
    """``(what, bytes)`` of every host buffer ``enable()`` allocates for ``plan`` (Note [Host
    bytes]), requested sizes.  ``rings``: :func:`_ring_tensors` of ``plan``, when the caller
    has it."""
    from ..loading import is_file_backed

    a = plan.alignment
    out: list[tuple[str, int]] = []

    def master(label: str, tensors: list[torch.Tensor], maps_files: bool = False) -> None:
        tensors = [t for t in tensors if t.numel()]
        if maps_files and any(is_file_backed(t) for t in tensors):
            copies = [t for t in tensors if not is_file_backed(t)]
            spans: dict[Any, list[int]] = {}
            for t in copies:  # exact-size private copies, one per storage span
                lo, hi = tensor_extent(t)
                span = spans.setdefault(storage_key(t), [lo, hi, t.element_size()])
                span[0], span[1] = min(span[0], lo), max(span[1], hi)
            out.extend((f"{label} (copy)", (hi - lo) * size) for lo, hi, size in spans.values())
            return
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            nbytes = _span_bytes([t for t in tensors if t.dtype == dtype], a)
            if nbytes:
                out.append((f"{label} ({dtype})", nbytes))

    placed = [c for c in plan.components if not c.on_demand]
    if plan.strategy is OffloadStrategy.MODEL_LEVEL:
        for c in placed:
            if c.selected and c.role in (ComponentRole.DIT, ComponentRole.ENCODER):
                master(c.path, [t for _, t in owned_tensors(plan, c)])
        return tuple(out)
    for s, blocks in (_ring_tensors(plan) if rings is None else rings):
        for path, tensors in zip(s.streamed_paths, blocks):
            if s.transfer is WeightTransfer.ALLGATHER and plan.world_size > 1:
                shard = shard_bytes(_span_bytes(tensors, a), plan.world_size, a)
                if shard:
                    out.append((f"{path} (rank shard)", shard))
            else:
                master(path, tensors, maps_files=True)
    return tuple(out)


def predict_host_bytes(plan: ResolvedOffloadPlan) -> int:
    """Host bytes ``enable()`` allocates for ``plan``: the sum of :func:`host_allocations`."""
    return sum(n for _, n in host_allocations(plan))
