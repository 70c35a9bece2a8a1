"""The block ring: the transformer blocks of one ring of the plan
(:class:`~offload_ref.plan.RingPlan`) streamed through fixed device slots: two, or more under
Note [Prefetch depth].

Note [The ring]
    A :class:`BlockRing` owns its blocks' groups, two device slots (:class:`Slot`, each with its
    ready and free events: Note [Slots] in slots.py), its transport (which owns the blocks' host
    side and fills the slots) and the predictor that says which block to prefetch next.  Hooks on the blocks
    are thin callbacks into it::

        pre-forward of block k                      post-forward of block k
        ----------------------                      -----------------------
        compute waits ready[slot(k)]                record_use(slot(k)), discard it
        (k not materialized: load it now, count     record free[slot(k)] on compute
         a synchronous recovery)                    rebind k to placeholders
        q = predicted next; t = other slot
        copy stream waits free[t], copies q -> t,
        records ready[t]; rebind q to slot t

    A slot is written only after the compute that read it has finished (its free event) and read
    only after the copy that filled it has finished (its ready event): events only, no host-side
    synchronize.  The block predicted after the last one is block 0 (wrap-around), so between
    passes exactly block 0 of each ring is materialized and the next step starts warm.  A caller
    that skips blocks (cache systems) or runs them in another order is served by a synchronous
    load of the missing block, and the :class:`CallOrderPredictor` (predictor.py) learns the
    observed order, so any order that repeats (Cosmos3's generator loop, skip-layer guidance)
    stops missing from its second repetition on.

Note [Slot layout]
    A slot is one byte slab sized for the largest block.  A block's tensors are packed per dtype
    (Note [Host master layout]) with each segment in an aligned region (Note [Aligned layout]),
    so every dtype section is a multiple of the platform's alignment; inside the slab the
    sections follow one another from offset 0, so each one starts aligned and every tensor bound
    to a slot keeps its alignment phase.  The device bytes of a ring are exactly its number of
    slots (2 unless Note [Prefetch depth]) x its largest *aligned* block.  (Separate per-dtype slots sized by per-dtype maxima would exceed that bound
    for rings whose blocks mix dtypes unevenly.)  Of a slot, the largest block's weight bytes
    count as device weight bytes and the rest as device padding.

The ring's predictor is in predictor.py, its slots in slots.py and its transports (Note
[Transports]) in transports.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.autograd import profiler as _profiler

from .. import _spans
from ..discovery import get_submodule_path
from ..host import storage_key
from ..plan import RingPlan, named_tensors
from ..platform import Platform
from ..platform.base import fast_calls
from .call_guard import call_frame
from .groups import TensorGroup, restore_group
from .predictor import CallOrderPredictor
from .rebind_guard import set_data
from .slots import RingStreams, Slot
from .stats import OffloadStats
from .transaction import Transaction
from .transports import RankLocalTransport, Transport

__all__ = ["BlockRing"]


class _Placeholders:
    """Stand-ins for the tensors of blocks that are not materialized: the right shape and dtype,
    one shared element, NaN where the dtype has it, and never device storage."""

    def __init__(self) -> None:
        self._base: dict[torch.dtype, torch.Tensor] = {}

    def like(self, record_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        base = self._base.get(dtype)
        if base is None:
            fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
            base = self._base[dtype] = torch.full((), fill, dtype=dtype)
        return base.expand(tuple(record_shape))


class BlockRing:
    """One ring of blocks, its slots, transport and predictor.  See Note [The ring].  ``plan``
    is the plan's description of the ring (a :class:`~offload_ref.plan.RingPlan`); ``streams``
    the streams the backend's rings share (a :class:`RingStreams`; a bare copy stream is taken
    as one).

    Seams (a subclass may override; the kit's mutants use nothing else): :meth:`prepare`,
    :meth:`commit`, :meth:`before`, :meth:`after`, :meth:`wait_ready`, :meth:`recover`,
    :meth:`storage_keys`; ``prefetch_enabled``; the transport passed in."""

    def __init__(self, plan: RingPlan, platform: Platform, stats: OffloadStats,
                 streams: RingStreams | Any, placeholders: _Placeholders, *, pin: bool,
                 prefetch: bool = True, transport: Transport | None = None) -> None:
        if not isinstance(streams, RingStreams):
            streams = RingStreams(platform, streams)
        self.transport: Transport = transport if transport is not None else RankLocalTransport()
        self.plan = plan
        self.label = "+".join(plan.container_paths)
        self.platform = platform
        self.stats = stats
        self.streams = streams
        self.copy_stream = streams.copy
        self.placeholders = placeholders
        self.pin = pin
        self.prefetch_enabled = prefetch
        self.blocks: tuple[nn.Module, ...] = plan.streamed_blocks
        self.block_paths = plan.streamed_paths
        self.groups: list[TensorGroup] = []
        self.sections: list[dict[torch.dtype, tuple[int, int]]] = []  # byte offset, numel
        self.slot_bytes = 0  # the largest aligned block (Note [Slot layout])
        self.slot_weight_bytes = 0  # the largest block's weight bytes
        self.slots: list[Slot] = []  # Note [Slots] (slots.py)
        self.num_slots = plan.slots  # two, or one more per extra block of Note [Prefetch depth]
        self._depth = plan.prefetch_depth
        n = len(self.blocks)
        self.order = CallOrderPredictor(n)
        self.slot_of: list[int | None] = [None] * n  # block -> the index of its slot
        # Blocks whose forward is in progress (nested calls), each with the frame of the
        # nn.Module call that runs it (None: unknown); see Note [Interrupted blocks].
        self._running: list[tuple[int, FrameType | None]] = []
        self._dirty = False  # hook work in progress, or interrupted (Note [Interrupted blocks])
        self._cold = False  # block 0 not loaded yet: its first load is no recovery
        # Note [Fast path]: one platform call per fill, and no calls that do nothing.
        self._platform_fill, skip_accesses = fast_calls(platform)
        self._tracks_accesses = not skip_accesses
        self.creates_no_tensors = False
        self._checks_files = False  # set by prepare when a block is served from file pages
        self.transport.bind(streams, stats, self.label, pin=pin, predict_after=self.predict_after)

    # -- enable ---------------------------------------------------------------------------------

    @property
    def stack(self) -> RingPlan:
        """The old name of :attr:`plan`, kept for one release."""
        return self.plan

    def prepare(self, txn: Transaction, pipeline: Any) -> None:
        aliases: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for alias in self.plan.aliases:
            t = get_submodule_path(pipeline, alias.path)
            if isinstance(t, torch.Tensor):
                aliases.setdefault(alias.block_path, []).append((alias.path, t))
        shared_names = set(self.plan.shared)
        per_block = [named_tensors(block, path) for block, path in zip(self.blocks,
                                                                          self.block_paths)]
        shared = {storage_key(t) for named in per_block for n, t in named if n in shared_names}
        for block, path, named in zip(self.blocks, self.block_paths, per_block):
            named = [(n, t) for n, t in named if not t.numel() or storage_key(t) not in shared]
            named += aliases.get(path, [])
            group = TensorGroup.of(path, named, self.platform)
            sections, image_bytes = {}, 0
            for dtype in sorted(group.layout.numel, key=lambda d: (-d.itemsize, str(d))):
                numel = group.layout.numel[dtype]
                sections[dtype] = (image_bytes, numel)  # offset: a multiple of the alignment
                image_bytes += numel * dtype.itemsize
            self.transport.build_master(txn, group, sections, image_bytes)
            group.drop_sources()
            self.groups.append(group)
            self.sections.append(sections)
            self.slot_bytes = max(self.slot_bytes, self.transport.slot_bytes(image_bytes))
            self.slot_weight_bytes = max(self.slot_weight_bytes, group.weight_bytes)
        for _ in range(self.num_slots):
            self.slots.append(self.new_slot(txn))
        self.build_views()
        self._checks_files = self.maps_files
        self.stats.hold_device(self.num_slots * self.slot_weight_bytes,
                               self.num_slots * (self.slot_bytes - self.slot_weight_bytes))

    def new_slot(self, txn: Transaction) -> Slot:
        """A slot of :attr:`slot_bytes` device bytes with fresh events; :meth:`prepare` makes
        :attr:`num_slots` and then builds every slot's views."""
        s = len(self.slots)
        storage = txn.device_empty(f"{self.label} slot {s}", self.slot_bytes, torch.uint8)
        return Slot(s, storage, self.platform.Event(), self.platform.Event(),
                    self.transport.writers())

    def storage_keys(self) -> set[tuple[str, int]]:
        return {storage_key(t) for g in self.groups for t in g.tensors if t.numel()}

    def commit(self, txn: Transaction) -> None:
        for k, group in enumerate(self.groups):
            txn.rebind(self.block_paths[k], group.tensors, self._placeholder_views(k))
        if self.transport.collective:
            # Note [Collective safety]: no collective at enable.  Block 0 is loaded by the first
            # forward that calls it, which every rank issues in the same order.
            self._cold = True
            return
        txn.step(f"prefetch {self.block_paths[0]}")
        self._issue_copy(0, 0)
        txn.rebind(self.block_paths[0], self.groups[0].tensors, self.slots[0].views[0])

    # -- views ----------------------------------------------------------------------------------

    def build_views(self) -> None:
        """Build every slot's flats, views and plain fills, per block (at enable, once every
        slot exists: views made under inference_mode would be inference tensors, which a copy
        issued outside inference_mode may not write)."""
        for slot in self.slots:
            slot.flats = [
                {dtype: slot.storage.narrow(0, offset, numel * dtype.itemsize).view(dtype)
                 for dtype, (offset, numel) in sections.items()}
                for sections in self.sections]
            slot.views = [group.layout.views(flats)
                          for group, flats in zip(self.groups, slot.flats)]
        self._placeholder_cache: list[list[torch.Tensor] | None] = [None] * len(self.groups)
        self.refresh_fills()

    def refresh_fills(self) -> None:
        """Ask the transport which fills are plain copies (at enable, and after it changed how it
        fills)."""
        for slot in self.slots:
            slot.fills = [self.transport.fill_pairs(slot, k, group)
                          for k, group in enumerate(self.groups)]
        # Note [Hooks leave inference mode] (layerwise.py): the hooks may stay in inference mode
        # when every fill is plain copies (views, placeholders and fills are all built here).
        self.creates_no_tensors = all(p is not None for slot in self.slots for p in slot.fills)

    @property
    def maps_files(self) -> bool:
        """Whether a block of the ring is served from file pages (Note [Mapped masters])."""
        return self.transport.maps_files

    def mapped_image_bytes(self) -> int:
        """The largest slot image of a block served from file pages (0: none is)."""
        return self.transport.mapped_image_bytes(self.groups, self.sections)

    def use_staging(self, pool: Any) -> None:
        """Fill the ring's file-backed blocks through ``pool`` (Note [Pinned staging])."""
        self.transport.use_staging(pool, self.groups, self.sections)
        self.refresh_fills()

    def predict_after(self, q: int) -> int:
        """The block expected after ``q`` when ``q`` is the one predicted next (a fill's
        look-ahead: Note [Pinned staging] in staging.py)."""
        return self.order.predict_after(q)

    def _placeholder_views(self, k: int) -> list[torch.Tensor]:
        views = self._placeholder_cache[k]
        if views is None:
            layout = self.groups[k].layout
            views = self._placeholder_cache[k] = [
                self.placeholders.like(r.shape, layout.segments[r.segment].dtype)
                for r in layout.records]
        return views

    def _rebind(self, k: int, views: Sequence[torch.Tensor]) -> None:
        for t, v in zip(self.groups[k].tensors, views):
            set_data(t, v)  # Note [Rebind guard] (rebind_guard.py)

    def bind(self, k: int, s: int) -> None:
        """Bind block ``k`` to slot ``s`` as the slot holds it, with no fill: ``slot_of`` and the
        slot's occupant say so, and the block's tensors are the slot's views."""
        self.slot_of[k] = s
        self.slots[s].occupant = k
        self._rebind(k, self.slots[s].views[k])

    # -- transfers ------------------------------------------------------------------------------

    def _issue_copy(self, k: int, s: int) -> None:
        """Fill slot s with block k (the transport's copies, and collective where it has one),
        after the slot's last reader; the slot's ready event is recorded when it is filled."""
        slot = self.slots[s]
        pairs = slot.fills[k]
        if self._checks_files:  # Note [Changed files] in loading.py: before any page is read
            self.transport.verify_sources(k, self.groups[k])
        if pairs is not None and not _profiler._is_profiler_enabled:  # Note [Fast path]
            self._platform_fill(self.copy_stream, slot.free, pairs, slot.ready)
        else:
            self._transport_fill(slot, k)
        self.slot_of[k] = s
        slot.occupant = k
        self.transport.count_fill(k, self.groups[k])
        self.stats.swaps += 1

    def _transport_fill(self, slot: Slot, k: int) -> None:
        """The transport's fill of ``slot`` with block ``k``, then the slot's ready event on the
        last stream the transport writes on (Note [Slots]: the ring records every ready event)."""
        self.transport.fill(slot, k, self.groups[k])
        last = self.transport.writers()[-1]
        with self.platform.stream(last):
            slot.ready.record(last)

    def evict(self, s: int) -> None:
        """Forget the (never run) block prefetched into slot s."""
        slot = self.slots[s]
        k = slot.occupant
        if k is not None:
            self._rebind(k, self._placeholder_views(k))
            self.slot_of[k] = None
            slot.occupant = None

    def _load(self, k: int, s: int) -> None:
        self.evict(s)
        self._issue_copy(k, s)
        self._rebind(k, self.slots[s].views[k])

    # -- hooks ----------------------------------------------------------------------------------

    # Note [Interrupted blocks]
    #     torch runs a block's post-hook (always_call) for an Exception only: a KeyboardInterrupt
    #     (any BaseException) inside a block's forward skips it, and one that lands inside our
    #     own hook work can stop it between any two instructions.  Two rules make every such
    #     state recoverable by the next hook call:
    #
    #     * A running block remembers the frame of the ``nn.Module`` call that runs it.  When
    #       ``running`` is not empty (nested calls, or an interrupted forward: rare, so the
    #       steady state walks no frames), ``before`` checks that each running block's frame is
    #       still on this thread's stack; one that is not ended without its post-hook (stale).
    #     * Hook work runs under ``_dirty``: set first, cleared last.  A ring found dirty, or
    #       holding a stale block, is reset (``recover``): every slot no live block reads gets a
    #       fresh ready event after all the copies issued into it, compute waits for it, the
    #       slot is discarded and its free event recorded, every other block is rebound to its
    #       placeholders and unmarked.  Each step is idempotent, so an interrupted reset is
    #       simply redone.  The call-order predictor relearns the order from the next call on
    #       (the interrupted pass would otherwise stay in its history as a fragment it keeps
    #       matching), so prefetch is as good as before once the order has repeated once.

    def before(self, k: int, frame: FrameType | None = None) -> None:
        """Pre-forward of block k; ``frame`` is the ``nn.Module`` call running it (the hook
        found it already; found here when None)."""
        running = self._running
        if self._dirty or running:
            self.recover(k, None)  # cheap when every running block is live (nested calls)
            running = self._running
        self._dirty = True
        q = self.order.call(k)  # learn the order the caller runs; q: the block predicted next
        s = self.slot_of[k]
        if s is None or self._tracks_accesses:
            s = self._materialize(k)
        else:  # _materialize(k), inlined: a prefetch hit (Note [Fast path])
            self.wait_ready(s)
        busy = {self.slot_of[r] for r, _ in running} if running else ()
        running.append((k, frame if frame is not None else call_frame()))
        if self._depth != 1:
            if self.prefetch_enabled:
                self._prefetch_ahead(k, s, q, busy)
            self._dirty = False
            return
        t = 1 - s
        if self.prefetch_enabled and t not in busy:
            if q != k and self.slot_of[q] is None:
                if self.slots[t].occupant is not None:
                    self.evict(t)
                self._issue_copy(q, t)
                for tensor, v in zip(self.groups[q].tensors, self.slots[t].views[q]):
                    set_data(tensor, v)
        self._dirty = False

    # Note [Prefetch depth]
    #     With ``prefetch_depth`` d (plain layerwise; ``RingPlan.prefetch_depth``) a ring has d + 1
    #     slots and block k's pre-hook makes sure the d blocks predicted after k (the predictor's
    #     continuation of the observed order, ``CallOrderPredictor.ahead``) are in slots or on
    #     their way: each one that is not gets a slot no running block uses, an empty one first,
    #     else one whose block is not among those d.  In a repeating order that is one copy per
    #     block, issued d blocks ahead, and between passes blocks 0..d-1 stay materialized.  It
    #     spends d - 1 more slots of device bytes than depth 1; it can hide a copy that is
    #     longer than one block's compute only if later blocks compute for longer than they
    #     copy, so at equal device bytes a resident head (fewer bytes streamed per step) is the
    #     better use when copies dominate (``offload-ref bench --model`` compares the two).
    #     Depth 1 keeps the two-slot code path of Note [Fast path], and is what contract §F.2
    #     describes (at most two blocks materialized); a deeper ring departs from it by design,
    #     so it is opt-in and the kit checks depth 1.

    def _prefetch_ahead(self, k: int, s: int, q: int, busy: Any) -> None:
        wanted: set[int] = set()
        for p in self.order.ahead(q, self._depth):
            if p == k or p in wanted:
                break
            wanted.add(p)
            if self.slot_of[p] is not None:
                continue
            t = self._prefetch_slot(s, busy, wanted)
            if t is None:
                break
            if self.slots[t].occupant is not None:
                self.evict(t)
            self._issue_copy(p, t)
            for tensor, v in zip(self.groups[p].tensors, self.slots[t].views[p]):
                set_data(tensor, v)

    def _prefetch_slot(self, s: int, busy: Any, wanted: set[int]) -> int | None:
        spare = None
        for t, slot in enumerate(self.slots):
            if t == s or t in busy:
                continue
            if slot.occupant is None:
                return t
            if spare is None and slot.occupant not in wanted:
                spare = t
        return spare

    # Note [Fast path]
    #     Per-block host overhead is Python calls, so the steady state of a block's hooks (in
    #     order, prefetch hit) makes few: the predictor observes and predicts in one call
    #     (``CallOrderPredictor.call``); the rebinds are inlined; a prefetch is one
    #     ``platform.fill`` (Note [One-call fills] in platform/base.py); ``record_use`` / ``discard`` are not called on platforms whose
    #     ``tracks_accesses`` is False; spans cost one attribute read while no profiler runs;
    #     the call guard takes its own lock directly (Note [Guard locking] in call_guard.py); the
    #     hooks do not leave inference mode when the ring creates no tensor in them; torch
    #     calls the hooks' bound methods with no wrapper between.  Every other state (recovery,
    #     a miss, a running profiler, a collective transport) takes the general calls, which do
    #     the same thing one step at a time.  ``offload-ref bench --peers`` measures it.

    # Note [Block parts]
    #     A model may call a submodule of a streamed block outside that block's forward: diffusers'
    #     DiTTransformer2DModel runs ``transformer_blocks[0].norm1.emb(...)`` after its block
    #     loop.  The block's own hooks do not fire then, so the submodule would read whatever its
    #     tensors are bound to: a slot whose prefetch copy may still be in flight (no wait on its
    #     ready event), or placeholders.  Every tensor-owning submodule of a block carries a part
    #     pre-hook (layerwise.py) that does nothing while the block runs in the calling thread
    #     and otherwise calls ``before_part``, and registers a post-hook for that call alone that
    #     calls ``after_part`` (Note [One-shot part post-hooks] in layerwise.py): the block is
    #     loaded if it is not materialized, compute waits for its ready event and the part runs
    #     as a running block (so no prefetch refills its slot meanwhile); afterwards the slot's
    #     free event is recorded after the part's reads and the block stays bound (it is usually
    #     the block predicted next).  The call order is not observed: a part call is no block
    #     call.

    def is_running(self, k: int) -> bool:
        for r, _ in self._running:
            if r == k:
                return True
        return False

    def before_part(self, k: int, frame: FrameType | None = None) -> None:
        """Pre-forward of a submodule of block k called outside k's forward (Note [Block
        parts])."""
        if self._dirty or self._running:
            self.recover(None, None)  # cheap when every running block is live
        self._dirty = True
        self._materialize(k)
        self._running.append((k, frame if frame is not None else call_frame()))
        self._dirty = False

    def _materialize(self, k: int) -> int:
        """Block k's slot, loaded first if the block is not in one (skipped, reordered, prefetch
        disabled, a deferred first load, or a part called outside its block), with compute
        ordered after its copy."""
        s = self.slot_of[k]
        if s is None:
            s = self._recovery_slot(k)
            self._load(k, s)
            if self._cold:
                self._cold = False
            else:
                self.stats.sync_recoveries += 1
        self.wait_ready(s)
        if self._tracks_accesses:
            self.platform.record_use(self.slots[s].storage)
        return s

    def after_part(self, k: int) -> None:
        """Post-forward of a submodule of block k that ``before_part`` let run."""
        if self._dirty:
            self.recover(None, k)
            return
        self._dirty = True
        for i in range(len(self._running) - 1, -1, -1):
            if self._running[i][0] == k:
                del self._running[i]
                break
        s = self.slot_of[k]
        if s is not None:  # the block stays bound; its slot is refilled only after these reads
            slot = self.slots[s]
            if self._tracks_accesses:
                self.platform.record_use(slot.storage)
            slot.free.record(self.platform.current_stream())
        self._dirty = False

    @property
    def running(self) -> list[int]:
        """Blocks whose forward is in progress (more than one: nested calls)."""
        return [r for r, _ in self._running]

    @property
    def interrupted(self) -> bool:
        """Whether hook work of this ring was interrupted (or is in progress): the next hook
        call resets the ring first (Note [Interrupted blocks])."""
        return self._dirty

    def wait_ready(self, s: int) -> None:
        """Order compute after the fill of slot s (a device-side wait on its ready event)."""
        slot = self.slots[s]
        if not _profiler._is_profiler_enabled:  # Note [Spans] (_spans.py): no range to open
            self.platform.current_stream().wait_event(slot.ready)
        else:
            span = _spans.enter("wait", "ring=%s block=%s slot=%d", self.label, slot.occupant, s)
            self.platform.current_stream().wait_event(slot.ready)
            _spans.exit(span)
        if self._checks_files:  # Note [Deferred reads of file pages] in transports.py
            self.transport.raise_if_refused(slot.occupant)

    def after(self, k: int) -> None:
        if self._dirty:  # our hook work was interrupted (or raised): reset, k included
            self.recover(None, k)
            return
        self._dirty = True
        running = self._running
        if running and running[-1][0] == k:
            del running[-1]
        else:
            for i in range(len(running) - 1, -1, -1):
                if running[i][0] == k:
                    del running[i]
                    break
        s = self.slot_of[k]
        if s is not None:
            platform = self.platform
            slot = self.slots[s]
            if self._tracks_accesses:
                platform.record_use(slot.storage)
                platform.discard(slot.storage)
            slot.free.record(platform.current_stream())
            self.slot_of[k] = None  # unmarked before its tensors lose the slot
            slot.occupant = None
            views = self._placeholder_cache[k]
            if views is None:
                views = self._placeholder_views(k)
            for t, v in zip(self.groups[k].tensors, views):
                set_data(t, v)
        self._dirty = False

    def recover(self, calling: int | None, finishing: int | None) -> None:
        """Reset the ring after interrupted hook work or a stale running block (Note
        [Interrupted blocks]); ``calling`` is the block whose pre-hook runs now, ``finishing``
        the one whose post-hook does."""
        stack = _stack_frame_ids() if self._running else set()
        live = [(r, f) for r, f in self._running
                if r != finishing and (f is None or id(f) in stack)]
        if not self._dirty and len(live) == len(self._running):
            return  # nested calls: every running block is still running
        self._dirty = True
        platform = self.platform
        live_blocks = {r for r, _ in live}
        keep = {self.slot_of[r] for r in live_blocks}
        compute = platform.current_stream()
        for s in range(self.num_slots):
            if s in keep:
                continue
            # After every write issued into the slot, on each stream its fills write it on
            # (Note [Slots]): its ready event ends recorded on the last writer, which the next
            # fill into it waits for.
            slot = self.slots[s]
            for stream in slot.writers:
                slot.ready.record(stream)
                compute.wait_event(slot.ready)
            platform.discard(slot.storage)
            slot.free.record(compute)
        for b in range(len(self.blocks)):
            if b not in live_blocks:
                self.slot_of[b] = None
                self._rebind(b, self._placeholder_views(b))
        for s in range(self.num_slots):
            if s not in keep:
                self.slots[s].occupant = None
        self._running = live
        if calling is not None and not live:
            # An interrupted pass leaves a fragment in the call history that the predictor
            # would keep matching (skip-layer guidance orders are not first-order): relearn the
            # order from here, which takes one repetition of it.
            self.order = CallOrderPredictor(len(self.blocks))
        else:
            self.order.repair()  # an interrupted observe may have left it half updated
        self._dirty = False

    def _recovery_slot(self, k: int) -> int:
        busy = {self.slot_of[r] for r, _ in self._running}
        free = [s for s in range(self.num_slots) if s not in busy]
        if not free:
            n = self.num_slots
            raise RuntimeError(
                f"{self.label}: block {self.block_paths[k]} is called while {n} blocks of its "
                f"ring are already running ({[self.block_paths[r] for r in self.running]}); a "
                f"ring streams through {n} slots, so blocks may nest at most {n - 1} deep"
            )
        for s in free:
            if self.slots[s].occupant is None:
                return s
        # The free slots hold prefetched blocks that did not run: drop one we will not need.
        keep = self.order.predict(k)
        return next((s for s in free if self.slots[s].occupant != keep), free[0])

    # -- introspection --------------------------------------------------------------------------

    def materialized(self) -> list[int]:
        return [k for k in range(len(self.blocks)) if self.slot_of[k] is not None]

    @property
    def largest_block_bytes(self) -> int:
        return self.slot_bytes

    # -- disable --------------------------------------------------------------------------------

    def restored_views(self) -> list[list[torch.Tensor]]:
        """Every block's tensors rebuilt at their original placement: from the transport's host
        side, or through slot 0 with one fill per block where the transport says so (AllGather:
        every rank disables together)."""
        if not self.transport.restores_through_slots:
            return self.transport.restored_views(self.groups)
        platform = self.platform
        platform.synchronize()
        for s in range(len(self.slots)):
            self.evict(s)  # nothing stays bound to a slot that the fills below overwrite
        self._cold = True
        compute = platform.current_stream()
        slot = self.slots[0]
        out = []
        with self.transport.disabling():
            for k, group in enumerate(self.groups):
                self._transport_fill(slot, k)
                compute.wait_event(slot.ready)
                platform.record_use(slot.storage)
                out.append(restore_group(group, platform, slot.flats[k]))
                slot.free.record(compute)
        return out

    def true_value(self, k: int, i: int) -> torch.Tensor:
        """A copy of the true value of tensor ``i`` of block ``k`` (from its host side)."""
        return self.transport.true_value(k, self.groups[k], i)

    def release(self) -> None:
        for slot in list(self.slots):  # each forgotten on the line that frees it: a retry
            self.platform.free(slot.storage); self.slots.remove(slot)  # noqa: E702
            slot.flats, slot.views, slot.fills = [], [], []
        self._placeholder_cache = []
        self._running = []  # drops the frames of interrupted blocks
        for g in self.groups:
            self.transport.release(g)
        self.groups = []


def _stack_frame_ids() -> set[int]:
    """ids of the frames on this thread's stack (live frames, so no id is reused)."""
    ids = set()
    f = sys._getframe(1)
    while f is not None:
        ids.add(id(f))
        f = f.f_back
    return ids
