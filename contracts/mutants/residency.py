"""Mutants of what stays where (§F): model level's groups (§F.1), the layerwise ring (§F.2,
§F.4), inference tensors (§F.3), alignment (§F.6), a resident head (§F.7); the checks they
fail are mostly in checks/residency.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from offload_ref.backends.groups import ComponentSwapper
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transaction import Transaction
from offload_ref.hooks import ModelHook
from offload_ref.plan import _predict

from ._declare import _patched, _patched_all


class _HeadStreamedRing(BlockRing):
    """A ring that streams the declared resident head too (it reads the containers, not the
    plan's head)."""

    def __init__(self, stack, *args, **kwargs) -> None:
        super().__init__(dataclasses.replace(stack, resident_head=0), *args, **kwargs)


class _CountingHook(ModelHook):
    calls = 0

    def pre_forward(self, module, args, kwargs):
        self.calls += 1


class _HooksTheHead(LayerWiseOffloadBackend):
    """Hooks every block of the DiT, the resident head included (hooks that do nothing there,
    but run twice per block and step, and sit where a user's hook expects none)."""

    def _enable(self, pipeline, plan, txn) -> None:
        super()._enable(pipeline, plan, txn)
        for stack in plan.stacks:
            for block, path in zip(stack.blocks[:stack.resident_head], stack.block_paths):
                txn.register_hook(block, self.hook_name + ".head", _CountingHook(), path)


class _HeadUnpredicted(LayerWiseOffloadBackend):
    """A plan whose predicted peak counts the resident head as streamed."""

    def _resolve(self, pipeline):
        plan = super()._resolve(pipeline)
        headless = dataclasses.replace(plan, components=tuple(
            dataclasses.replace(c, stacks=tuple(dataclasses.replace(s, resident_head=0)
                                                for s in c.stacks))
            for c in plan.components))
        return dataclasses.replace(plan, device_bytes_bound=_predict(headless))


class _InferenceBlindTransaction(Transaction):
    def rebind(self, label, tensors, new):
        self.step(f"rebind {label}")
        for t, n in zip(tensors, new):  # .data of an inference tensor rebound as of any other
            old = t.data
            t.data = n
            self.on_rollback(lambda t=t, old=old: setattr(t, "data", old))


class _InferenceBlindModelLevel(ModelLevelOffloadBackend):
    transaction_class = _InferenceBlindTransaction


class _InferenceBlindLayerwise(LayerWiseOffloadBackend):
    transaction_class = _InferenceBlindTransaction


class _DoubleCopySwapper(ComponentSwapper):
    def load(self, label):
        group = self.swappable[label]
        loading = not group.device_flats
        super().load(label)
        if loading:  # a redundant second upload of the same bytes
            for dtype, flat in group.device_flats.items():
                self.platform.copy_(flat, group.master.flats[dtype])


class _DoubleCopyOnSwap(ModelLevelOffloadBackend):
    swapper_class = _DoubleCopySwapper


class _StatsCountHostAsDevice(ModelLevelOffloadBackend):
    def stats(self):
        s = super().stats()
        s.device_weight_bytes += s.host_bytes
        return s


class _TwoGroupsResident(ModelLevelOffloadBackend):
    def _activate(self, comp):
        if self._swapper is not None:
            self._swapper.activate(comp.path, [])  # loads, never evicts


class _VaeOffloaded(ModelLevelOffloadBackend):
    def _enable(self, pipeline, plan, txn):
        comps = tuple(dataclasses.replace(c, role="encoder", selected=True) if c.role == "vae"
                      else c for c in plan.components)
        super()._enable(pipeline, dataclasses.replace(plan, components=comps), txn)


class _NestedResidentSwaps(ModelLevelOffloadBackend):
    def _enable(self, pipeline, plan, txn):
        nested = {p for c in plan.components if c.selected for p in c.nested}
        comps = tuple(dataclasses.replace(c, nested=()) for c in plan.components
                      if c.path not in nested)  # the resident swaps with its DiT
        super()._enable(pipeline, dataclasses.replace(plan, components=comps), txn)


class _CopyBackSwapper(ComponentSwapper):
    def offload(self, label):
        group = self.swappable[label]
        for dtype, flat in group.device_flats.items():  # "save" the device copy to the host
            self.platform.copy_(group.master.flats[dtype], flat)
        super().offload(label)


class _D2HOnSwap(ModelLevelOffloadBackend):
    swapper_class = _CopyBackSwapper


class _NoReadyWait(BlockRing):
    def _wait_ready(self, s):
        pass


class _NoFreeWait(BlockRing):
    def _issue_copy(self, k, s):
        master = self.groups[k].master
        with self.platform.stream(self.copy_stream):
            for dtype, flat in self._slot_flats(k, s).items():
                self.platform.copy_(flat, master.flats[dtype])
            self.ready[s].record(self.copy_stream)
        self.slot_of[k] = s
        self.occupant[s] = k


class _NoWrapAround(BlockRing):
    def before(self, k, frame=None):
        if k == len(self.blocks) - 1:
            self.prefetch_enabled = False
            try:
                super().before(k, frame)
            finally:
                self.prefetch_enabled = True
        else:
            super().before(k, frame)


class _NoRecoveryRing(BlockRing):
    def before(self, k, frame=None):
        if self.slot_of[k] is None:  # run on whatever the slot holds
            s = 0 if self.occupant[0] is not None else 1
            self.slot_of[k] = s
            self.occupant[s] = k
            self._rebind(k, self._slot_views(k, s))
        super().before(k, frame)


class _SilentlySerialRing(BlockRing):
    """Loads every block when it runs (no prefetch) and does not count it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefetch_enabled = False

    def before(self, k, frame=None):
        recoveries = self.stats.sync_recoveries
        super().before(k, frame)
        self.stats.sync_recoveries = recoveries


class _ThreeSlotsRing(BlockRing):
    def prepare(self, txn, pipeline):
        super().prepare(txn, pipeline)
        self.slots.append(txn.device_empty(f"{self.label} spare slot", self.slot_bytes,
                                           self.slots[0].dtype))
        self._build_flats()


def _packs_without_padding() -> Any:
    """Segments packed back to back at element alignment (the layout before aligned regions)."""
    from offload_ref import host

    return _patched_all(host, _storage_phase=lambda ptr, offset, alignment: 0,
                        region_bytes=lambda phase, nbytes, alignment: nbytes)


def _realigns_every_tensor() -> Any:
    """Aligned regions, but every segment starts at its region's boundary (its phase dropped)."""
    from offload_ref import host

    return _patched(host, "_storage_phase", lambda ptr, offset, alignment: 0)
