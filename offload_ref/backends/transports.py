"""How a ring's blocks reach its slots: the transport interface and the rank-local transport.

Note [Mapped masters]
    Weights loaded with ``offload_ref.load_safetensors`` are views of memory-mapped files.  A
    rank-local ring does not copy such a block into a host master: the file pages are its host
    side (one copy in the page cache for every process that maps the file, and no anonymous
    memory), each fill copies the block's storage spans from them into the slot, and disable
    rebinds every tensor to its original file view.  A block with any tensor that is not
    file-backed (a ``post_load_weights`` cast, say) gets an ordinary host master.

Note [Transports]
    The ring never moves bytes itself: its :class:`Transport` builds each block's host side at
    enable, fills a slot on demand, restores the blocks at disable and answers ``state_dict``.
    :class:`RankLocalTransport` keeps a full host master per block and fills a slot with one copy
    per dtype.  The distributed transports (backends/distributed.py) keep 1/world of each block
    per rank and rebuild it in the slot with an AllGather.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _spans
from ..platform import Platform
from .groups import TensorGroup, restore_group
from .transaction import Transaction

# ``BlockRing`` (ring.py) appears in annotations only: ring.py imports this module (a ring's
# default transport is rank-local), so this one does not import ring.py.

__all__ = ["RankLocalTransport", "Transport"]


class Transport:
    """How a ring's blocks reach its slots: the ring owns one (the way FSDP2 keeps its all-gather
    a swappable callable beside its parameter group).  The ring keeps events, predictor,
    placeholders and recovery; a transport owns the host side of each block and the work that
    fills a slot.  See Note [Transports].

    ``collective`` transports issue a collective per fill, so enable issues none (the ring defers
    block 0's first load to the first forward) and every rank must run the same schedule."""

    name: str = "transport"
    collective: bool = False

    def build_master(self, txn: Transaction, ring: BlockRing, group: TensorGroup,
                     sections: dict[torch.dtype, tuple[int, int]], image_bytes: int) -> None:
        """Build the host side of ``group`` (one block) while its source tensors are alive;
        count it in ``ring.stats``.  ``sections`` place each dtype's flat in the block's
        ``image_bytes``-byte slot image (Note [Slot layout] in ring.py)."""
        raise NotImplementedError

    def slot_bytes(self, image_bytes: int) -> int:
        """Slot bytes a block whose image has ``image_bytes`` bytes needs."""
        return image_bytes

    def fill(self, ring: BlockRing, k: int, s: int) -> None:
        """Issue the work that fills slot ``s`` with block ``k``: ordered after ``ring.free[s]``,
        ending with ``ring.ready[s]`` recorded on the stream that finished it."""
        raise NotImplementedError

    def writers(self, ring: BlockRing) -> tuple[Any, ...]:
        """Every stream a fill of this transport writes a slot on, the last one last.  Recovery
        (Note [Interrupted blocks] in ring.py) orders the compute stream after each: an
        interrupted fill may have stopped after any of them."""
        return (ring.copy_stream,)

    def fill_pairs(self, ring: BlockRing, k: int, s: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The ``(slot view, host view)`` copies that fill slot ``s`` with block ``k``, when a
        fill is exactly those copies on the copy stream between ``free[s]`` and ``ready[s]``
        (the ring then issues them in one ``platform.fill``, Note [Fast path] in ring.py); None
        when a fill is more (a collective).  Called once per block and slot at enable."""
        return None

    def count_fill(self, ring: BlockRing, k: int) -> None:
        """Count one fill of block ``k`` in ``ring.stats``."""
        group = ring.groups[k]
        ring.stats.add_h2d(group.weight_bytes, group.padding_bytes)

    def restored_views(self, ring: BlockRing) -> list[list[torch.Tensor]]:
        """Fresh storage for every block's tensors at their original placement (disable)."""
        return [restore_group(g, ring.platform) for g in ring.groups]

    def true_value(self, ring: BlockRing, k: int, i: int) -> torch.Tensor:
        """A copy of tensor ``i`` of block ``k`` as its host side holds it."""
        group = ring.groups[k]
        layout = group.layout
        record = layout.records[i]
        flat = group.master.flats[layout.segments[record.segment].dtype]
        return record.view(flat).detach().clone()

    def release(self, group: TensorGroup, platform: Platform) -> None:
        if group.master is not None:
            group.master.release()


class RankLocalTransport(Transport):
    """Each process keeps a full host copy of every block and fills a slot with one host to
    device copy per dtype (single-process layerwise, and the rank-local distributed mode).

    A block whose tensors are all views of safetensors files (``offload_ref.load_safetensors``)
    keeps no copy: its host side *is* the file pages (shared through the page cache, no
    anonymous memory), and a fill copies each storage span from them.  See Note [Mapped
    masters]."""

    name = "rank-local"

    def __init__(self, *, map_files: bool = True) -> None:
        self.map_files = map_files
        #: Note [Pinned staging] (staging.py): the pool mapped blocks are filled through.
        self.staging: Any = None
        self._segments: dict[int, list[tuple[int, torch.dtype, int, torch.Tensor]]] = {}
        # (block, ring slot, staging slot) -> the copies of a staged fill
        self._staged: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._mapped: dict[int, list[torch.Tensor]] = {}  # id(group) -> one span per segment
        self._copies: dict[int, list[torch.Tensor]] = {}  # id(group) -> private host copies
        self._counts: dict[int, tuple[int, int]] = {}  # block -> h2d (weight, padding) per fill

    def build_master(self, txn, ring, group, sections, image_bytes) -> None:
        # detach(): the tensors themselves are rebound at commit; these keep their storage.
        sources = [t.detach() for t in group.layout._sources]
        backed = [_is_file_backed(t) for t in sources] if self.map_files else []
        if not any(backed):
            group.master = txn.host_master(group.label, group.layout, ring.pin)
            ring.stats.add_host(group.weight_bytes, group.padding_bytes,
                                pinned=group.master.pinned)
            return
        # Note [Mapped masters]: file views are the host side of their spans; any other span
        # (a non-persistent buffer, a post-load cast) gets a private host copy of its own.
        txn.step(f"map {group.label} from its files")
        mapped: list[torch.Tensor] = []
        self._mapped[id(group)] = mapped
        txn.on_rollback(lambda key=id(group): self._release_mapped(ring.platform, key))
        copied = 0
        for seg, src, file_backed in zip(group.layout.segments, sources, backed):
            span = torch.as_strided(src, (seg.numel,), (1,), seg.lo) if seg.numel else src
            if file_backed or not seg.numel:
                mapped.append(span)
                continue
            copy = ring.platform.host_empty(seg.numel, seg.dtype, pin=ring.pin)
            mapped.append(copy)  # listed before the copy: released by the rollback either way
            self._copies.setdefault(id(group), []).append(copy)
            copy.copy_(span)
            copied += seg.numel * copy.element_size()
        ring.stats.add_host(group.weight_bytes, 0, pinned=False)
        ring.stats.file_backed_bytes += group.weight_bytes - copied

    @property
    def maps_files(self) -> bool:
        """Whether any block of the ring is served from file pages (Note [Mapped masters])."""
        return bool(self._mapped)

    def mapped_image_bytes(self, ring: BlockRing) -> int:
        """The largest slot image of a block served from file pages (0: none is)."""
        return max((sum(numel * dtype.itemsize for dtype, (_, numel) in ring.sections[k].items())
                    for k, g in enumerate(ring.groups) if id(g) in self._mapped), default=0)

    def use_staging(self, ring: BlockRing, pool: Any) -> None:
        """Fill the ring's file-backed blocks through ``pool`` (Note [Pinned staging])."""
        self.staging = pool
        for k, group in enumerate(ring.groups):
            mapped = self._mapped.get(id(group))
            if mapped is None:
                continue
            sections = ring.sections[k]
            self._segments[k] = [
                (sections[seg.dtype][0] + seg.offset * seg.dtype.itemsize, seg.dtype,
                 seg.numel, span)
                for seg, span in zip(group.layout.segments, mapped) if seg.numel]
        ring.refresh_fills()

    def _pairs(self, ring: BlockRing, k: int, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        group = ring.groups[k]
        mapped = self._mapped.get(id(group))
        flats = ring._slot_flats(k, s)
        if mapped is None:
            return [(flat, group.master.flats[dtype]) for dtype, flat in flats.items()]
        return [(flats[seg.dtype].narrow(0, seg.offset, seg.numel), span)
                for seg, span in zip(group.layout.segments, mapped) if seg.numel]

    def fill_pairs(self, ring: BlockRing, k: int, s: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if self.staging is not None and k in self._segments:
            return None  # through the staging pool: more than plain copies
        return self._pairs(ring, k, s)

    def fill(self, ring: BlockRing, k: int, s: int) -> None:
        """The general path of a fill (a profiler running, or a block staged through pinned
        slots): the copies of :meth:`fill_pairs` inside a copy span."""
        platform = ring.platform
        pool = self.staging if k in self._segments else None
        if pool is not None:  # Note [Pinned staging]
            key = (id(ring), k)
            p = pool.acquire(key, self._segments[k])
            pairs = self._staged.get((k, s, p))
            if pairs is None:  # built once per block, ring slot and staging slot
                pairs = self._staged[(k, s, p)] = pool.copies(
                    p, key, self._segments[k], [dst for dst, _ in self._pairs(ring, k, s)])
        else:
            pairs = ring._fills[s][k] or self._pairs(ring, k, s)
        with platform.stream(ring.copy_stream):
            ring.copy_stream.wait_event(ring.free[s])
            if pool is not None:
                ring.copy_stream.wait_event(pool.filled[p])  # its own slot, not the pool
            copy_span = _spans.stream_enter(platform, "copy", "ring=%s block=%d slot=%d",
                                            ring.label, k, s)
            for dst, src in pairs:
                platform.copy_(dst, src)
            _spans.stream_exit(platform, copy_span)
            if pool is not None:
                pool.read[p].record(ring.copy_stream)  # the slot is free after this copy
            ring.ready[s].record(ring.copy_stream)
        if pool is not None:
            after = ring.predict_after(k)
            if after in self._segments:
                pool.prefetch((id(ring), after), self._segments[after], keep=p)

    def count_fill(self, ring: BlockRing, k: int) -> None:
        counts = self._counts.get(k)
        if counts is None:
            group = ring.groups[k]
            if id(group) in self._mapped:  # spans only: the padding is not copied
                counts = (group.weight_bytes, 0)
            else:
                counts = (group.weight_bytes, group.padding_bytes)
            self._counts[k] = counts
        stats = ring.stats  # stats.add_h2d(*counts), inlined (Note [Fast path] in ring.py)
        stats.h2d_bytes += counts[0]
        stats.h2d_padding_bytes += counts[1]

    def _mapped_views(self, group: TensorGroup) -> list[torch.Tensor] | None:
        """The original file views of a mapped group's tensors."""
        mapped = self._mapped.get(id(group))
        if mapped is None:
            return None
        layout = group.layout
        views = []
        for record in layout.records:
            seg = layout.segments[record.segment]
            span = mapped[record.segment]  # element 0 is the segment's element ``seg.lo``
            if not _is_file_backed(span):
                span = span.clone()  # a private copy: restore into fresh storage of our own
            views.append(torch.as_strided(span, record.shape, record.stride,
                                          span.storage_offset() + record.offset - seg.offset))
        return views

    def restored_views(self, ring: BlockRing) -> list[list[torch.Tensor]]:
        out = []
        for group in ring.groups:
            views = self._mapped_views(group)
            out.append(views if views is not None else restore_group(group, ring.platform))
        return out

    def true_value(self, ring: BlockRing, k: int, i: int) -> torch.Tensor:
        views = self._mapped_views(ring.groups[k])
        if views is not None:
            return views[i].detach().clone()
        return super().true_value(ring, k, i)

    def _release_mapped(self, platform: Platform, key: int) -> None:
        self._mapped.pop(key, None)
        for copy in self._copies.pop(key, []):
            platform.host_free(copy)

    def release(self, group: TensorGroup, platform: Platform) -> None:
        self._release_mapped(platform, id(group))
        self._counts.clear()
        self._segments.clear()
        self._staged.clear()
        self.staging = None
        super().release(group, platform)


def _is_file_backed(t: torch.Tensor) -> bool:
    from ..loading import is_file_backed

    return is_file_backed(t)

