"""Tensor groups: tensors moved together, and the swapper that keeps whole groups resident or on
their host masters.  Both strategies build on them (model level swaps components; layerwise keeps
its non-block state resident with a swapper).

Note [Original placement]
    ``disable`` rebuilds every tensor where it was before ``enable``: on the device if it was
    device-resident, on the host otherwise, with the same shape, stride and storage sharing,
    from the authoritative copy (the host master, or the device copy for state that was placed
    on the device).  The original storage itself is released at commit, otherwise offloading
    would save no memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _spans
from ..host import HostMaster, Layout, aligned_empty, layout_rule, storage_key, unique_tensors
from ..platform import Platform
from .inference import rebind_restored
from .rebind_guard import set_data
from .refusals import OffloadWeightEditError
from .stats import OffloadStats
from .transaction import Transaction
from .wrappers import NO_WRAPPERS, WrapperSet

__all__ = ["ComponentSwapper", "TensorGroup", "restore_group"]


@dataclass
class TensorGroup:
    """Tensors moved together, their layout, and where each segment lived before enable."""

    label: str
    tensors: list[torch.Tensor]
    layout: Layout
    was_resident: list[bool]  # per segment (Note [Original placement])
    master: HostMaster | None = None  # offloaded groups
    device_flats: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    was_inference: list[bool] = field(default_factory=list)  # per segment (Note [Inference tensors])

    @classmethod
    def of(cls, label: str, named: Sequence[tuple[str, torch.Tensor]],
           platform: Platform) -> TensorGroup:
        named = unique_tensors(named)  # Parameters reachable twice are one tensor
        layout = Layout(named, alignment=platform.alignment, rule=layout_rule(platform))
        was_resident = [platform.is_resident(src) for src in layout._sources]
        was_inference = [src.is_inference() for src in layout._sources]
        return cls(label, [t for _, t in named], layout, was_resident,
                   was_inference=was_inference)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(qualified name, tensor)`` of the group's tensors."""
        return [(r.name, t) for r, t in zip(self.layout.records, self.tensors)]

    def drop_sources(self) -> None:
        """Forget the original tensors' storage once it is copied (commit releases it)."""
        self.layout.drop_sources()

    @property
    def nbytes(self) -> int:
        """Bytes held or copied for the group (alignment padding included)."""
        return self.layout.nbytes

    @property
    def weight_bytes(self) -> int:
        return self.layout.weight_bytes

    @property
    def padding_bytes(self) -> int:
        return self.layout.padding_bytes


def restore_group(group: TensorGroup, platform: Platform,
                  source: dict[torch.dtype, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Fresh storage for every segment at its original placement, filled from the authoritative
    copy (or from ``source``, flats of the same layout: a device copy that holds an edit, Note
    [Weight edits]); returns one tensor per group tensor (Note [Original placement])."""
    if source is None:
        source = group.master.flats if group.master is not None else group.device_flats
    inference = group.was_inference or [False] * len(group.layout.segments)
    buffers = []
    for seg, resident, was_inference in zip(group.layout.segments, group.was_resident,
                                            inference):
        # A segment that held inference tensors is rebuilt as one (Note [Inference tensors]);
        # it starts ``seg.phase`` elements into its fresh storage, so every tensor keeps its
        # alignment phase (Note [Aligned layout]).
        numel = seg.phase + seg.numel
        with torch.inference_mode(was_inference):
            buf = platform.empty(numel, seg.dtype) if resident else aligned_empty(
                numel, seg.dtype, group.layout.alignment)
            if seg.numel:
                src = source[seg.dtype].narrow(0, seg.offset, seg.numel)
                dst = buf.narrow(0, seg.phase, seg.numel)
                if resident:
                    platform.copy_(dst, src)
                else:
                    dst.copy_(src)
        buffers.append(buf)
    views = []
    for record in group.layout.records:
        seg = group.layout.segments[record.segment]
        buf = buffers[record.segment]
        with torch.inference_mode(inference[record.segment]):
            views.append(torch.as_strided(buf, record.shape, record.stride,
                                          buf.storage_offset() + record.offset - seg.offset
                                          + seg.phase))
    return views


class ComponentSwapper:
    """Owns the tensor groups of one model-level offload: swappable components (host master,
    device copy while loaded) and resident state (device copy)."""

    def __init__(self, platform: Platform, stats: OffloadStats) -> None:
        self.platform = platform
        self.stats = stats
        self.swappable: dict[str, TensorGroup] = {}
        self.resident: list[TensorGroup] = []
        self.log: list[tuple[str, int]] = []  # (component, bytes) of every load, in order
        self.versions: dict[str, list[int]] = {}  # swappable label -> version counters at enable
        # The component whose load or offload is in progress, or was interrupted; the next
        # swap settles it first (Note [Interrupted swaps]).
        self._unsettled: str | None = None
        self._held: set[str] = set()  # components whose device bytes are counted in stats
        self._restored: set[int] = set()  # ids of groups restore() has rebound (a retry skips)
        # label -> an event recorded after the copies of its last load (Note [Masters a copy
        # still reads])
        self._copied: dict[str, Any] = {}
        # Set by the owner: the wrapper subclasses whose inner tensors these groups hold, given
        # their inner tensors' device after every move (Note [Wrapper subclasses] in
        # plan/tree.py).
        self.wrappers: WrapperSet = NO_WRAPPERS

    # -- enable ---------------------------------------------------------------------------------

    def prepare(
        self,
        txn: Transaction,
        swappable: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]]]],
        resident: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]]]],
        *,
        pin: bool,
    ) -> None:
        """Build masters and device copies off to the side, then commit (Note [Transactions]).

        ``swappable`` and ``resident`` are ``(label, [(qualified name, tensor)])`` groups; no
        storage may appear in two groups (the resolver rejects such topologies)."""
        claimed: dict[tuple, str] = {}

        def claim(label: str, named: Iterable[tuple[str, torch.Tensor]]) -> list:
            out = []
            for name, t in named:
                if t is None or t.numel() == 0:
                    continue
                # Meta tensors all report storage 0: each is its own (Layout rejects it, naming
                # it as never materialized).
                key = ("meta", id(t)) if t.is_meta else storage_key(t)
                other = claimed.setdefault(key, label)
                if other != label:  # the resolver rejects this for plans; split models' own
                    # groups (offload_ref.split.ComponentGroups) meet it here
                    raise ValueError(
                        f"{name} (in {label}) shares storage with a tensor of {other}; a tensor "
                        "can belong to one offload group only (untie it or declare both parts "
                        "as one component)"
                    )
                out.append((name, t))
            return out

        swap_named = [(label, claim(label, named)) for label, named in swappable]
        resident_named = [(label, claim(label, named)) for label, named in resident]
        # Build everything first: nothing the pipeline sees changes until the rebinds below.
        for label, named in swap_named:
            group = TensorGroup.of(label, named, self.platform)
            group.master = txn.host_master(label, group.layout, pin)
            self.swappable[label] = group
            self.stats.add_host(group.weight_bytes, group.padding_bytes,
                                pinned=group.master.pinned)
        for label, named in resident_named:
            named = [(n, t) for n, t in named if not self.platform.is_resident(t)]
            if not named:
                continue
            group = TensorGroup.of(label, named, self.platform)
            for dtype, numel in group.layout.numel.items():
                group.device_flats[dtype] = txn.device_empty(label, numel, dtype)
            txn.step(f"copy {label} to the device")
            group.layout.pack_into(group.device_flats, self.platform.copy_)
            self.resident.append(group)
            self.stats.hold_device(group.weight_bytes, group.padding_bytes)
        for group in [*self.swappable.values(), *self.resident]:
            group.drop_sources()
        # Commit: swappable components start on the host, resident state on the device.
        for label, group in self.swappable.items():
            txn.rebind(label, group.tensors, group.master.host_views())
        for group in self.resident:
            txn.rebind(group.label, group.tensors, group.layout.views(group.device_flats))
        txn.on_rollback(self.forget)
        # Note [Weight edits] (refusals.py): our own rebinds never bump a version counter.
        self.versions = {label: [t._version for t in g.tensors]
                         for label, g in self.swappable.items()}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(qualified name, tensor)`` of every tensor of every group (the tensors it rebinds)."""
        return [named for g in [*self.swappable.values(), *self.resident]
                for named in g.named_tensors()]

    def edited(self, label: str) -> list[str]:
        """Names of ``label``'s tensors edited in place since enable (Note [Weight edits])."""
        group = self.swappable[label]
        return [r.name for r, t, v in zip(group.layout.records, group.tensors,
                                          self.versions.get(label, ()))
                if t._version != v]

    def check_edits(self, labels: Iterable[str]) -> None:
        """Raise OffloadWeightEditError if a component about to be swapped was edited in place
        outside ``edit_weights()``: swapping it would drop the edit (a device copy) or serve it
        from a host master that is meant to be immutable."""
        for label in labels:
            names = self.edited(label) if label in self.swappable else []
            if names:
                where = "its device copy" if self.is_loaded(label) else "its host master"
                raise OffloadWeightEditError(
                    f"{names[0]} (and {len(names) - 1} more of {label}) was edited in place while "
                    f"offloaded, in {where}; edit weights inside `with backend.edit_weights(): "
                    "...` so the backend re-reads them (disable() keeps this edit)"
                )

    # -- steady state ---------------------------------------------------------------------------

    # Note [Interrupted swaps]
    #     A load or an offload can stop at any instruction (a KeyboardInterrupt lands between
    #     two of them, a copy or an allocation raises).  It marks its component unsettled first
    #     and clears the mark last; every buffer it allocates is entered in ``device_flats`` in
    #     the statement that allocates it, and leaves it in the statement that frees it.  The
    #     next swap (or disable) settles an unsettled component: every tensor back on its host
    #     master, every buffer still listed freed.  Settling is idempotent, so an interrupted
    #     settle is simply redone.

    def is_loaded(self, label: str) -> bool:
        return bool(self.swappable[label].device_flats) and label != self._unsettled

    def settle(self) -> None:
        """Put an interrupted load or offload back on its host master (Note [Interrupted
        swaps])."""
        label = self._unsettled
        if label is None:
            return
        group = self.swappable.get(label)
        if group is not None:
            self._wait_for_copies(label)
            for t, v in zip(group.tensors, group.master.host_views()):
                set_data(t, v)
            self.wrappers.follow()
            for dtype in list(group.device_flats):  # freed, then forgotten: Note [Undo first]
                self.platform.free(group.device_flats[dtype]); del group.device_flats[dtype]  # noqa: E702,E501
            if label in self._held:
                self.stats.release_device(group.weight_bytes, group.padding_bytes)
                self._held.discard(label)
        self._unsettled = None

    def load(self, label: str) -> None:
        self.settle()
        group = self.swappable[label]
        if group.device_flats:
            return
        self._unsettled = label
        try:
            flats = group.device_flats
            for dtype, n in group.layout.numel.items():
                flats[dtype] = self.platform.empty(n, dtype)
            span = _spans.stream_enter(self.platform, "copy", "component=%s", label)
            for dtype, flat in flats.items():
                self.platform.copy_(flat, group.master.flats[dtype])
            copied = self.platform.Event()
            copied.record()
            self._copied[label] = copied
            _spans.stream_exit(self.platform, span)
            for t, v in zip(group.tensors, group.layout.views(flats)):
                set_data(t, v)
            self.wrappers.follow()
        except BaseException:
            # A failed (or interrupted) load leaves the component on its master and gives back
            # every buffer it allocated, whatever was raised (Note [Transactions]).
            self.settle()
            raise
        self.stats.add_h2d(group.weight_bytes, group.padding_bytes)
        self.stats.swaps += 1
        self.log.append((label, group.weight_bytes))
        self._held.add(label)
        self.stats.hold_device(group.weight_bytes, group.padding_bytes)
        self._unsettled = None

    def offload(self, label: str) -> None:
        self.settle()
        group = self.swappable[label]
        if not group.device_flats:
            return
        self._unsettled = label
        self._wait_for_copies(label)
        for t, v in zip(group.tensors, group.master.host_views()):
            set_data(t, v)  # back to the immutable master: no device -> host copy
        self.wrappers.follow()
        for dtype in list(group.device_flats):
            self.platform.discard(group.device_flats[dtype])
        self.settle()  # frees the buffers and releases their bytes in stats

    # Note [Masters a copy still reads]
    #     A load copies a component's pinned host masters to the device non_blocking.  Once its
    #     tensors are back on their masters (offload, settle), anyone may write a master through
    #     ``.data`` (a LoRA merge, a rescale), and on a GPU that copy may still be reading it: the
    #     host waits for an event recorded after the load's copies first.  By then the copy is
    #     long done on a GPU (a component computed in between), so the wait costs nothing there;
    #     the simulated accelerator's stream sanitizer reported the write as
    #     host-write-before-copy-done without it (tests/test_model_level_master_edits.py).

    def _wait_for_copies(self, label: str) -> None:
        copied = self._copied.pop(label, None)
        if copied is not None:
            copied.synchronize()

    def activate(self, label: str | None, evict: Iterable[str]) -> None:
        """Offload ``evict`` then load ``label`` (the bound holds at every instant)."""
        for other in evict:
            if other != label:
                self.offload(other)
        if label is not None and label in self.swappable:
            self.load(label)

    # -- disable --------------------------------------------------------------------------------

    def restore(self) -> None:
        """Rebuild every tensor at its original placement (Note [Original placement])."""
        self.settle()
        # A retry after a restore that raised skips the groups it already restored (their
        # masters may be released): Note [Undo first] in transaction.py.
        done = self._restored
        groups = [g for g in list(self.swappable.values()) + self.resident if id(g) not in done]
        # A loaded component edited in place keeps the edit: restore it from its device copy.
        restored = [restore_group(g, self.platform,  # may raise: nothing changed
                                  g.device_flats if g.label in self.swappable and g.device_flats
                                  and self.edited(g.label) else None)
                    for g in groups]
        self.platform.synchronize()
        for group, views in zip(groups, restored):
            for t, v in zip(group.tensors, views):
                rebind_restored(t, v)
            done.add(id(group))
        self.wrappers.follow(as_built=True)
        self.release()

    def release(self) -> None:
        for group in list(self.swappable.values()) + self.resident:
            # Each buffer forgotten on the line that frees it (Note [Undo first] in
            # transaction.py): a release that raised midway can run again.
            for dtype in list(group.device_flats):
                self.platform.free(group.device_flats[dtype]); del group.device_flats[dtype]  # noqa: E702,E501
            if group.master is not None:
                group.master.release()
        self.forget()

    def forget(self) -> None:
        self.swappable, self.resident = {}, []  # first: a retry then finds nothing to restore
        self._unsettled = None
        self._copied = {}
        self._held = set()
        self._restored = set()
