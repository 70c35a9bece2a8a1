"""Model-level (sequential) offload: whole components swap between host masters and the device.

Residency rule (the bound the contract suite enforces): before an encoder runs, every DiT is on
the host; before a DiT runs, the encoders and every other DiT are on the host; VAEs, declared
residents, unselected components and the rest of the pipeline's state stay on the device.  So
the device holds at most one swap group (the encoders, or one DiT) plus the resident state.
A swap group is its component's own tensors (``offload_ref.plan.owned_tensors``): a resident
declared inside a DiT (a timestep embedder) stays on the device while the rest of the DiT swaps.
Pipeline-managed components (a VAE selected with its declared lifecycle) are left to the
pipeline's ``load_to_device`` / ``offload_to_cpu``.  The resolver has already checked that no
storage belongs to two of these groups.

A swap moves host -> device only: offloading rebinds the component's tensors to its immutable
host master (no device -> host copy, no pinned memory allocated per swap).

Split models (:class:`~offload_ref.discovery.SupportsModelCpuOffload`) are delegated to: the
pipeline's ``enable_omni_model_cpu_offload`` owns the swaps (usually through
:class:`offload_ref.split.ComponentGroups`), and a failure inside it calls its disable.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..config import OffloadStrategy
from ..hooks import ModelHook
from ..host import storage_key
from ..plan import ResolvedComponent, ResolvedOffloadPlan, owned_tensors
from ..platform import Platform
from .guard import CallGuard, OffloadWeightEditError, call_frame, refuse_autograd
from .base import (
    OffloadBackend,
    OffloadStats,
    TensorGroup,
    Transaction,
    pipeline_state,
    rebind_restored,
    restore_group,
)

__all__ = ["ComponentSwapper", "ModelLevelOffloadBackend", "SequentialOffloadHook"]


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
                other = claimed.setdefault(storage_key(t), label)
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
        # Note [Weight edits] (guard.py): our own rebinds never bump a version counter.
        self.versions = {label: [t._version for t in g.tensors]
                         for label, g in self.swappable.items()}

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
            for t, v in zip(group.tensors, group.master.host_views()):
                t.data = v
            for dtype in list(group.device_flats):
                self.platform.free(group.device_flats.pop(dtype))
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
            for dtype, flat in flats.items():
                self.platform.copy_(flat, group.master.flats[dtype])
            for t, v in zip(group.tensors, group.layout.views(flats)):
                t.data = v
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
        for t, v in zip(group.tensors, group.master.host_views()):
            t.data = v  # back to the immutable master: no device -> host copy
        for dtype in list(group.device_flats):
            self.platform.discard(group.device_flats[dtype])
        self.settle()  # frees the buffers and releases their bytes in stats

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
        groups = list(self.swappable.values()) + self.resident
        # A loaded component edited in place keeps the edit: restore it from its device copy.
        restored = [restore_group(g, self.platform,  # may raise: nothing changed
                                  g.device_flats if g.label in self.swappable and g.device_flats
                                  and self.edited(g.label) else None)
                    for g in groups]
        self.platform.synchronize()
        for group, views in zip(groups, restored):
            for t, v in zip(group.tensors, views):
                rebind_restored(t, v)
        self.release()

    def release(self) -> None:
        for group in list(self.swappable.values()) + self.resident:
            for flat in group.device_flats.values():
                self.platform.free(flat)
            group.device_flats = {}
            if group.master is not None:
                group.master.release()
        self.forget()

    def forget(self) -> None:
        self.swappable = {}
        self.resident = []
        self._unsettled = None
        self._held = set()


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(module.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    return named


class SequentialOffloadHook(ModelHook):
    """Hooks of one component: make it the resident swap group before its forward; enter and
    leave the backend's call guard (Note [One thread at a time] in guard.py)."""

    def __init__(self, backend: ModelLevelOffloadBackend, component: ResolvedComponent,
                 guard: CallGuard) -> None:
        self.backend = backend
        self.component = component
        self.guard = guard

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frame = call_frame()
        if not self.guard.enter(self.component.path, frame):
            return None  # the backend is being disabled: leave the module alone
        try:
            swapper = self.backend._swapper
            group = swapper.swappable.get(self.component.path) if swapper else None
            if group is not None:  # Note [Autograd]
                refuse_autograd(self.component.path,
                                [r.name for r in group.layout.records], group.tensors)
            with torch.inference_mode(False):  # Note [Hooks leave inference mode] (layerwise.py)
                self.backend._activate(self.component)
        except BaseException:
            self.guard.exit(frame)
            raise
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.guard.exit(call_frame())
        return None


class ModelLevelOffloadBackend(OffloadBackend):
    """See the module docstring.  Selected by ``enable_cpu_offload`` or ``mode="module"``."""

    strategy = OffloadStrategy.MODEL_LEVEL
    hook_name = "offload_ref.sequential"
    swapper_class: type[ComponentSwapper] = ComponentSwapper

    def __init__(self, config, platform) -> None:
        super().__init__(config, platform)
        self._swapper: ComponentSwapper | None = None
        self._components: tuple[ResolvedComponent, ...] = ()
        self._delegated = False

    # -- lifecycle ------------------------------------------------------------------------------

    def _enable(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        if plan.delegated:
            self._enable_delegated(pipeline, txn)
            return
        swapper = self.swapper_class(self.platform, self._stats)
        self._swapper = swapper
        placed = [c for c in plan.components if not c.on_demand]  # the rest is the pipeline's
        swappable = [c for c in placed if c.role in ("dit", "encoder") and c.selected]
        managed = {id(t) for c in plan.components if c.on_demand
                   for _, t in owned_tensors(plan, c)}
        # One resident group: a tensor reachable from two kept components is one device copy.
        kept = [(n, t) for c in placed if c not in swappable for n, t in owned_tensors(plan, c)
                if id(t) not in managed]
        kept += pipeline_state(pipeline, [c.module for c in plan.components])
        swapper.prepare(
            txn, [(c.path, owned_tensors(plan, c)) for c in swappable],
            [("<resident>", kept)] if kept else [], pin=self.config.pin_memory
        )
        self._components = plan.components
        for comp in plan.components:
            if comp.role in ("dit", "encoder") and not comp.on_demand:
                txn.register_hook(comp.module, self.hook_name,
                                  SequentialOffloadHook(self, comp, self._guard), comp.path)

    def _enable_delegated(self, pipeline: Any, txn: Transaction) -> None:
        kwargs = {"device": self.platform.device, "pin_memory": self.config.pin_memory}
        enable = pipeline.enable_omni_model_cpu_offload
        params = inspect.signature(enable).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        # DESIGN's minimal signature is (*, device, pin_memory); pass the rest when accepted:
        # the selection, the platform and the parallel facts the config holds.
        facts = (("components", self.config.components), ("platform", self.platform),
                 ("use_hsdp", self.config.use_hsdp), ("world_size", self.config.world_size))
        for name, value in facts:
            if name in params or takes_any:
                kwargs[name] = value
        txn.step(f"{type(pipeline).__name__}.enable_omni_model_cpu_offload")
        # Registered before the call: a failure inside the pipeline's enable calls its disable.
        txn.on_rollback(pipeline.disable_omni_model_cpu_offload)
        enable(**kwargs)
        self._delegated = True

    def _disable(self, pipeline: Any) -> None:
        if self._delegated:
            if pipeline is not None:  # a collected split model took its offload state with it
                pipeline.disable_omni_model_cpu_offload()
            return
        assert self._swapper is not None
        self._swapper.restore()
        self.registry.remove_all()
        self.platform.synchronize()

    def _reset(self) -> None:
        self._swapper = None
        self._components = ()
        self._delegated = False


    # -- swaps ----------------------------------------------------------------------------------

    def _activate(self, comp: ResolvedComponent) -> None:
        swapper = self._swapper
        if swapper is None:
            return
        if comp.role == "dit":
            evict = [c.path for c in self._components
                     if c.role in ("dit", "encoder") and c is not comp]
        else:
            evict = [c.path for c in self._components if c.role == "dit"]
        evict = [p for p in evict if p in swapper.swappable]
        swapper.check_edits([comp.path, *evict])  # Note [Weight edits]
        swapper.activate(comp.path, evict)

    @contextmanager
    def use_component(self, path: str) -> Iterator[None]:
        """Make the component at dotted ``path`` resident for a non-forward entry point::

            with backend.use_component("text_encoder"):
                pipeline.encode_prompt(...)   # does not go through text_encoder.forward

        VAEs and residents are always on the device; entering them is a no-op.
        """
        if not self.is_enabled():
            raise RuntimeError(f"{type(self).__name__} is not enabled")
        for comp in self._components:
            if comp.path == path:
                if comp.role in ("dit", "encoder"):
                    with torch.inference_mode(False):
                        self._activate(comp)
                yield
                return
        known = [c.path for c in self._components]
        raise ValueError(f"unknown component {path!r}; the plan's components are {known}")

    def _offloaded_tensors(self) -> dict[int, Any]:
        # Swapped tensors always view real storage (a host master or a device copy): state_dict
        # reads them as they are; load_state_dict must go through edit_weights.
        if self._swapper is None:
            return {}
        return {id(t): None for g in self._swapper.swappable.values() for t in g.tensors}

    def stats(self) -> OffloadStats:
        if not self._delegated or self.pipeline is None:
            return super().stats()
        from ..split import ComponentGroups  # a split model keeps its own counters

        total = OffloadStats()
        for module in self.pipeline.modules():
            for value in list(module.__dict__.values()):
                if isinstance(value, ComponentGroups) and value.stats is not None:
                    for key, n in value.stats.as_dict().items():
                        setattr(total, key, getattr(total, key) + n)
        total.pinned_bytes = self.platform.pinned_bytes() if total.host_bytes else 0
        return total

    def swap_log(self) -> list[tuple[str, int]]:
        """``(component path, bytes moved host -> device)`` of every load since enable."""
        return list(self._swapper.log) if self._swapper is not None else []

    def loaded_components(self) -> tuple[str, ...]:
        """Paths of the swappable components currently on the device."""
        if self._swapper is None:
            return ()
        return tuple(p for p in self._swapper.swappable if self._swapper.is_loaded(p))
