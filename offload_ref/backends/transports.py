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

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _spans
from .groups import TensorGroup, restore_group
from .slots import RingStreams, Slot
from .stats import OffloadStats
from .transaction import Transaction

__all__ = ["RankLocalTransport", "Transport"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class Transport:
    """How a ring's blocks reach its slots: the ring owns one (the way FSDP2 keeps its all-gather
    a swappable callable beside its parameter group).  The ring keeps events, predictor,
    placeholders and recovery; a transport owns the host side of each block and the work that
    fills a slot.  It sees the slot it fills and the block's group, never the ring: the ring
    binds it once (:meth:`bind`) to the streams, counters and look-ahead it needs.  See Note
    [Transports]; a transport is the seam a broken or new way of moving bytes plugs into.

    ``collective`` transports issue a collective per fill, so enable issues none (the ring defers
    block 0's first load to the first forward) and every rank must run the same schedule; at
    disable the ring rebuilds each block through a slot with one more fill per block, which
    every rank issues in the same order."""

    name: str = "transport"
    collective: bool = False
    #: Whether disable rebuilds the blocks through a slot, with one :meth:`fill` per block (the
    #: host side alone cannot: an AllGather rank holds 1/world of each block); else from
    #: :meth:`restored_views`.
    restores_through_slots: bool = False

    def bind(self, streams: RingStreams, stats: OffloadStats, label: str, *, pin: bool,
             predict_after: Callable[[int], int]) -> None:
        """Called once by the ring that owns this transport, before any other method:
        ``streams`` (Note [Ring streams] in slots.py), the counters fills are counted in, the
        ring's label, whether host sides are pinned, and the ring's look-ahead (the block
        expected after a given one)."""
        self.streams = streams
        self.platform = streams.platform
        self.stats = stats
        self.label = label
        self.pin = pin
        self.predict_after = predict_after

    def build_master(self, txn: Transaction, group: TensorGroup,
                     sections: dict[torch.dtype, tuple[int, int]], image_bytes: int) -> None:
        """Build the host side of ``group`` (one block) while its source tensors are alive;
        count it in ``stats``.  ``sections`` place each dtype's flat in the block's
        ``image_bytes``-byte slot image (Note [Slot layout] in ring.py)."""
        raise NotImplementedError

    def slot_bytes(self, image_bytes: int) -> int:
        """Slot bytes a block whose image has ``image_bytes`` bytes needs."""
        return image_bytes

    def writers(self) -> tuple[Any, ...]:
        """Every stream a fill of this transport writes a slot on, the last one last (a slot's
        ``writers``, Note [Slots] in slots.py)."""
        return (self.streams.copy,)

    def fill(self, slot: Slot, k: int, group: TensorGroup) -> None:
        """Issue the work that fills ``slot`` with block ``k`` (``group``), ordered after
        ``slot.free``, its last write on the last of :meth:`writers`; the ring records
        ``slot.ready`` after it (Note [Slots] in slots.py: the ring is that event's one owner)."""
        raise NotImplementedError

    def fill_pairs(self, slot: Slot, k: int, group: TensorGroup) -> Pairs | None:
        """The ``(slot view, host view)`` copies that fill ``slot`` with block ``k``, when a fill
        is exactly those copies on the copy stream between ``slot.free`` and ``slot.ready``
        (the ring then issues them in one ``platform.fill``, Note [Fast path] in ring.py); None
        when a fill is more (a collective).  Called once per block and slot at enable."""
        return None

    def verify_sources(self, k: int, group: TensorGroup) -> None:
        """Raise before a fill of block ``k`` if its host side can no longer be read as it was
        built (a mapped file truncated or overwritten: Note [Changed files] in loading.py)."""
        return None

    def raise_if_refused(self, k: int) -> None:
        """Raise, once compute has waited for block ``k``'s fill, the error of a fill whose
        copies were refused where they ran (Note [Deferred reads of file pages])."""
        return None

    def count_fill(self, k: int, group: TensorGroup) -> None:
        """Count one fill of block ``k`` in ``stats``."""
        self.stats.add_h2d(group.weight_bytes, group.padding_bytes)

    def restored_views(self, groups: list[TensorGroup]) -> list[list[torch.Tensor]]:
        """Fresh storage for every block's tensors at their original placement (disable); a
        collective transport's blocks are rebuilt through a slot by the ring instead."""
        return [restore_group(g, self.platform) for g in groups]

    def disabling(self) -> Any:
        """A context around the fills that rebuild a collective transport's blocks at disable."""
        return contextlib.nullcontext()

    def true_value(self, k: int, group: TensorGroup, i: int) -> torch.Tensor:
        """A copy of tensor ``i`` of block ``k`` as its host side holds it."""
        layout = group.layout
        record = layout.records[i]
        flat = group.master.flats[layout.segments[record.segment].dtype]
        return record.view(flat).detach().clone()

    def release(self, group: TensorGroup) -> None:
        if group.master is not None:
            group.master.release()

    # -- what a transport that serves file pages or shards answers (the defaults: neither) -----

    @property
    def maps_files(self) -> bool:
        """Whether a block is served from file pages (Note [Mapped masters]): the ring then
        checks the files before each fill and may stage them (:meth:`use_staging`)."""
        return False

    def mapped_image_bytes(self, groups: list[TensorGroup],
                           sections: list[dict[torch.dtype, tuple[int, int]]]) -> int:
        """The largest slot image of a block served from file pages (0: none is)."""
        return 0

    def use_staging(self, pool: Any, groups: list[TensorGroup],
                    sections: list[dict[torch.dtype, tuple[int, int]]]) -> None:
        """Fill the blocks served from file pages through ``pool`` (Note [Pinned staging]);
        asked only of a transport whose :attr:`maps_files` is True."""
        raise TypeError(f"the {self.name} transport serves no block from file pages")

    def shard_sizes(self) -> list[int]:
        """Bytes of this rank's host shard of each block, in ring order; empty when every rank
        holds whole blocks.  Every rank must agree on them (the distributed enable compares)."""
        return []

    def block_checksums(self) -> list[int]:
        """A digest of each block's weights that every rank must agree on before fills gather
        from several ranks; empty when no fill reads another rank's bytes."""
        return []

    def host_shards(self) -> list[torch.Tensor] | None:
        """This rank's host shard of each block (None: the transport keeps whole blocks)."""
        return None


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
        self._staged: dict[tuple[int, int, int], Pairs] = {}
        self._mapped: dict[int, list[torch.Tensor]] = {}  # id(group) -> one span per segment
        self._uses: dict[int, Any] = {}  # id(group) -> its files (Note [Changed files])
        self._after_uses: dict[int, Any] = {}  # block -> its files, for the staging look-ahead
        self._copies: dict[int, list[torch.Tensor]] = {}  # id(group) -> private host copies
        self._counts: dict[int, tuple[int, int]] = {}  # block -> h2d (weight, padding) per fill
        # Note [Deferred reads of file pages]: whether this platform's copies read their source
        # after the call that issues them returns, and each block whose last fill or staging was
        # refused where it ran (the error the host raises after waiting for the fill).
        self._deferred = False
        self._refused: dict[int, BaseException] = {}
        self._stage_reads: dict[int, Callable[[Pairs], Callable[[], None]]] = {}

    def build_master(self, txn, group, sections, image_bytes) -> None:
        # detach(): the tensors themselves are rebound at commit; these keep their storage.
        sources = [t.detach() for t in group.layout._sources]
        backed = [_is_file_backed(t) for t in sources] if self.map_files else []
        if not any(backed):
            group.master = txn.host_master(group.label, group.layout, self.pin)
            self.stats.add_host(group.weight_bytes, group.padding_bytes,
                                pinned=group.master.pinned)
            return
        # Note [Mapped masters]: file views are the host side of their spans; any other span
        # (a non-persistent buffer, a post-load cast) gets a private host copy of its own.
        txn.step(f"map {group.label} from its files")
        self._deferred = bool(getattr(self.platform, "stream_ordered_host_copies", False))
        mapped: list[torch.Tensor] = []
        self._mapped[id(group)] = mapped
        txn.on_rollback(lambda key=id(group): self._release_mapped(key))
        copied = 0
        for seg, src, file_backed in zip(group.layout.segments, sources, backed):
            span = torch.as_strided(src, (seg.numel,), (1,), seg.lo) if seg.numel else src
            if file_backed or not seg.numel:
                mapped.append(span)
                continue
            copy = self.platform.host_empty(seg.numel, seg.dtype, pin=self.pin)
            mapped.append(copy)  # listed before the copy: released by the rollback either way
            self._copies.setdefault(id(group), []).append(copy)
            copy.copy_(span)
            copied += seg.numel * copy.element_size()
        self.stats.add_host(group.weight_bytes, 0, pinned=False)
        self.stats.file_backed_bytes += group.weight_bytes - copied
        names: dict[int, str] = {}
        for record in group.layout.records:
            names.setdefault(record.segment, record.name)
        self._uses[id(group)] = mapped_files(
            [(names.get(i, group.label), span) for i, (span, file_backed)
             in enumerate(zip(mapped, backed)) if file_backed])

    def verify_sources(self, k: int, group: TensorGroup) -> None:
        uses = self._uses.get(id(group))
        if uses:
            verify_mapped_files(uses, _copy_of(group))

    @property
    def maps_files(self) -> bool:
        """Whether any block of the ring is served from file pages (Note [Mapped masters])."""
        return bool(self._mapped)

    def mapped_image_bytes(self, groups: list[TensorGroup],
                           sections: list[dict[torch.dtype, tuple[int, int]]]) -> int:
        """The largest slot image of a block served from file pages (0: none is)."""
        return max((sum(numel * dtype.itemsize for dtype, (_, numel) in sections[k].items())
                    for k, g in enumerate(groups) if id(g) in self._mapped), default=0)

    def use_staging(self, pool: Any, groups: list[TensorGroup],
                    sections: list[dict[torch.dtype, tuple[int, int]]]) -> None:
        """Fill the ring's file-backed blocks through ``pool`` (Note [Pinned staging]); the ring
        asks for its plain fills again afterwards (``BlockRing.use_staging``)."""
        self.staging = pool
        for k, group in enumerate(groups):
            mapped = self._mapped.get(id(group))
            if mapped is None:
                continue
            self._after_uses[k] = self._uses.get(id(group))
            # what the pool reads this block's pages through, later, on its own thread or
            # stream (Note [Deferred reads of file pages])
            self._stage_reads[k] = functools.partial(
                self._checked, k, self._after_uses[k],
                f"the staging of block {group.label!r} for its copy to the device")
            self._segments[k] = [
                (sections[k][seg.dtype][0] + seg.offset * seg.dtype.itemsize, seg.dtype,
                 seg.numel, span)
                for seg, span in zip(group.layout.segments, mapped) if seg.numel]

    def _pairs(self, slot: Slot, k: int, group: TensorGroup) -> Pairs:
        mapped = self._mapped.get(id(group))
        flats = slot.flats[k]
        if mapped is None:
            return [(flat, group.master.flats[dtype]) for dtype, flat in flats.items()]
        return [(flats[seg.dtype].narrow(0, seg.offset, seg.numel), span)
                for seg, span in zip(group.layout.segments, mapped) if seg.numel]

    def fill_pairs(self, slot: Slot, k: int, group: TensorGroup) -> Pairs | None:
        if self.staging is not None and k in self._segments:
            return None  # through the staging pool: more than plain copies
        if self._deferred and id(group) in self._mapped:
            return None  # file pages read later: checked there (Note [Deferred reads ...])
        return self._pairs(slot, k, group)

    # Note [Deferred reads of file pages]
    #     A fill checks its files when it is issued (Note [Changed files] in loading.py), but the
    #     pages are read when the copy runs.  On a GPU a copy from pageable memory reads it
    #     before the call returns; on the CPU platform a copy stream's worker thread runs it
    #     later, and the staging look-ahead (Note [Pinned staging]) reads on the staging thread
    #     whenever it gets there, on every platform.  A file truncated in between (after a
    #     generation returned, with the next pass's first block already issued) would kill the
    #     process with SIGBUS on that thread.  So a read of file pages that runs later checks
    #     its files again right where it runs, as one piece of work with the copies it guards:
    #     when a file changed it copies nothing and keeps the error, which the host raises once
    #     compute has waited for the block (``raise_if_refused``, from the ring's
    #     ``wait_ready``), as a fill refused at issue would.  What is left is the window between
    #     one fstat and the copy after it on the same thread, as on a GPU.

    def _checked(self, k: int, uses: Any, doing: str, copies: Pairs) -> Callable[[], None]:
        """The copies of one deferred read of block ``k``'s file pages (``uses``: its files),
        behind a check of those files where they run (Note [Deferred reads of file pages])."""
        refused = self._refused
        refused.pop(k, None)  # a refusal of an earlier read that nothing waited for

        def read() -> None:
            error = mapped_file_change(uses, doing) if uses else None
            if error is not None:
                refused[k] = error
                return
            for dst, src in copies:
                dst.copy_(src)

        return read

    def raise_if_refused(self, k: int) -> None:
        if self._refused:
            error = self._refused.pop(k, None)
            if error is not None:
                if self.staging is not None:
                    self.staging.forget((id(self), k))  # staged again by the next fill
                raise error

    def fill(self, slot: Slot, k: int, group: TensorGroup) -> None:
        """The general path of a fill (a profiler running, or a block staged through pinned
        slots): the copies of :meth:`fill_pairs` inside a copy span."""
        platform = self.platform
        copy_stream = self.streams.copy
        pool = self.staging if k in self._segments else None
        read = None
        if pool is not None:  # Note [Pinned staging]
            key = (id(self), k)
            p = pool.acquire(key, self._segments[k], self._stage_reads[k])
            pairs = self._staged.get((k, slot.index, p))
            if pairs is None:  # built once per block, ring slot and staging slot
                pairs = self._staged[(k, slot.index, p)] = pool.copies(
                    p, key, self._segments[k], [dst for dst, _ in self._pairs(slot, k, group)])
        else:
            pairs = slot.fills[k] or self._pairs(slot, k, group)
            if self._deferred and id(group) in self._mapped:  # Note [Deferred reads ...]
                read = self._checked(k, self._uses.get(id(group)), _copy_of(group), pairs)
        with platform.stream(copy_stream):
            copy_stream.wait_event(slot.free)
            if pool is not None:
                copy_stream.wait_event(pool.slots[p].filled)  # its own slot, not the pool
            copy_span = _spans.stream_enter(platform, "copy", "ring=%s block=%d slot=%d",
                                            self.label, k, slot.index)
            if read is not None:
                platform.submit(read, reads=[src for _, src in pairs],
                                writes=[dst for dst, _ in pairs])
            else:
                for dst, src in pairs:
                    platform.copy_(dst, src)
            _spans.stream_exit(platform, copy_span)
            if pool is not None:
                pool.slots[p].read.record(copy_stream)  # the slot is free after this copy
        if pool is not None:
            after = self.predict_after(k)
            if after in self._segments:
                uses = self._after_uses.get(after)
                if uses:  # the look-ahead reads the next block's pages now
                    verify_mapped_files(uses, f"the staging of block {after} of {self.label}")
                pool.prefetch((id(self), after), self._segments[after], keep=p,
                              read=self._stage_reads[after])

    def count_fill(self, k: int, group: TensorGroup) -> None:
        counts = self._counts.get(k)
        if counts is None:
            if id(group) in self._mapped:  # spans only: the padding is not copied
                counts = (group.weight_bytes, 0)
            else:
                counts = (group.weight_bytes, group.padding_bytes)
            self._counts[k] = counts
        stats = self.stats  # stats.add_h2d(*counts), inlined (Note [Fast path] in ring.py)
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

    def restored_views(self, groups: list[TensorGroup]) -> list[list[torch.Tensor]]:
        out = []
        for group in groups:
            views = self._mapped_views(group)
            out.append(views if views is not None else restore_group(group, self.platform))
        return out

    def true_value(self, k: int, group: TensorGroup, i: int) -> torch.Tensor:
        views = self._mapped_views(group)
        if views is not None:
            uses = self._uses.get(id(group))
            if uses:  # Note [Changed files]: a truncated page kills the process when read
                name = group.layout.records[i].name
                verify_mapped_files(uses, f"reading {name!r} (its true value, for state_dict())")
            return views[i].detach().clone()
        return super().true_value(k, group, i)

    def _release_mapped(self, key: int) -> None:
        self._mapped.pop(key, None)
        self._uses.pop(key, None)
        for copy in self._copies.pop(key, []):
            self.platform.host_free(copy)

    def release(self, group: TensorGroup) -> None:
        self._release_mapped(id(group))
        self._counts.clear()
        self._segments.clear()
        self._after_uses.clear()
        self._stage_reads.clear()
        self._refused.clear()
        self._staged.clear()
        self.staging = None
        super().release(group)


def mapped_files(named: Any) -> Any:
    from ..loading import mapped_files as files

    return files(named)


def verify_mapped_files(uses: Any, doing: str) -> None:
    from ..loading import verify_mapped_files as verify

    verify(uses, doing)


def _copy_of(group: TensorGroup) -> str:
    """The step a changed file refuses for a fill of ``group`` (Note [Changed files])."""
    return f"the copy of block {group.label!r} to the device"


def mapped_file_change(uses: Any, doing: str) -> Any:
    from ..loading import mapped_file_change as change

    return change(uses, doing)


def _is_file_backed(t: torch.Tensor) -> bool:
    from ..loading import is_file_backed

    return is_file_backed(t)
