"""Model-level offload: whole components swap between host masters and the device.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..config import OffloadStrategy
from ..hooks import ModelHook
from ..plan.tree import wrappers_in
from ..plan import (
    ComponentRole,
    ResolvedComponent,
    ResolvedOffloadPlan,
    owned_tensors,
    pipeline_state,
)
from .base import OffloadBackend
from .groups import ComponentSwapper
from .stats import OffloadStats
from .call_guard import CallGuard, call_frame
from .rebind_guard import idle_wrappers, run_wrappers
from .refusals import RefusesCopies
from .transaction import Transaction

__all__ = ["ComponentSwapper", "ModelLevelOffloadBackend", "ModelLevelOffloadHook",
           "SequentialOffloadHook"]

#: The roles whose components swap (each DiT, the encoders); the others stay on the device.
_SWAPPED = (ComponentRole.DIT, ComponentRole.ENCODER)


class ModelLevelOffloadHook(RefusesCopies, ModelHook):
    """Hooks of one component: make it the resident swap group before its forward; enter and
    leave the backend's call guard (Note [One thread at a time] in call_guard.py)."""

    def __init__(self, backend: ModelLevelOffloadBackend, component: ResolvedComponent,
                 guard: CallGuard, wrappers: Sequence[torch.Tensor] = ()) -> None:
        self.backend = backend
        self.component = component
        self.guard = guard
        self.wrappers = list(wrappers)  # Note [Guarded wrappers] (rebind_guard.py)
        self.refusal_policy = backend.refusal_policy  # Note [Refusal policy] (refusals.py)

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"component {self.component.path!r}"

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frame = call_frame()
        if not self.guard.enter(self.component.path, frame):
            return None  # the backend is being disabled: leave the module alone
        try:
            swapper = self.backend.swapper
            group = swapper.swappable.get(self.component.path) if swapper else None
            if group is not None:  # Note [Autograd]
                self.refusal_policy.refuse_autograd(
                    self.component.path, [r.name for r in group.layout.records], group.tensors)
            with torch.inference_mode(False):  # Note [Hooks leave inference mode] (layerwise.py)
                self.backend.activate(self.component)
            run_wrappers(self.wrappers)  # Note [Guarded wrappers] (rebind_guard.py)
        except BaseException:
            self.guard.exit(frame)
            raise
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.guard.exit(call_frame()) and self.wrappers and not self.guard.entered_here():
            idle_wrappers(self.wrappers)  # the outermost call of the component ended
        return None


class ModelLevelOffloadBackend(OffloadBackend):
    """See the module docstring.  Selected by ``enable_cpu_offload`` or ``mode="module"``.

    Seams (a subclass may override), besides :class:`~offload_ref.backends.base.OffloadBackend`'s
    (``resolve``, ``install``, ``uninstall``, ...):

    * :meth:`activate` ``(component)`` -- make a component the resident swap group; the
      component's hook calls it before each forward, :meth:`use_component` on entry.
    * :meth:`enable_delegated` ``(pipeline, txn)`` -- ``install`` of a split model: hand its
      offload to the pipeline's ``enable_omni_model_cpu_offload``.
    * :attr:`swapper_class` -- the :class:`ComponentSwapper` an enable builds (policy class);
      :attr:`swapper` is the current enable's (read-only).
    """

    strategy = OffloadStrategy.MODEL_LEVEL
    hook_name = "offload_ref.model_level"
    swapper_class: type[ComponentSwapper] = ComponentSwapper

    def __init__(self, config, platform) -> None:
        super().__init__(config, platform)
        self._swapper: ComponentSwapper | None = None
        self._components: tuple[ResolvedComponent, ...] = ()
        self._delegated = False

    # -- lifecycle ------------------------------------------------------------------------------

    def install(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        if plan.delegated:
            self.enable_delegated(pipeline, txn)
            self._delegated = True
            return
        swapper = self.swapper_class(self.platform, self._stats)
        swapper.wrappers = self.wrappers  # Note [Wrapper subclasses] (plan/tree.py)
        self._swapper = swapper
        placed = [c for c in plan.components if not c.on_demand]  # the rest is the pipeline's
        swappable = [c for c in placed if c.role in _SWAPPED and c.selected]
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
            if comp.role in _SWAPPED and not comp.on_demand:
                # Note [Guarded wrappers] (rebind_guard.py): a swapped component's wrappers
                wrappers = wrappers_in([(comp.path, comp.module)]) if comp in swappable else []
                self.wrapper_guards += wrappers
                txn.register_hook(comp.module, self.hook_name,
                                  ModelLevelOffloadHook(self, comp, self._guard,
                                                        [w for _, w in wrappers]), comp.path)

    def enable_delegated(self, pipeline: Any, txn: Transaction) -> None:
        """Hand a split model's offload to its ``enable_omni_model_cpu_offload`` (with the
        keywords it accepts), registering its ``disable_omni_model_cpu_offload`` as the undo;
        ``disable`` then calls that."""
        kwargs = {"device": self.platform.device, "pin_memory": self.config.pin_memory}
        enable = pipeline.enable_omni_model_cpu_offload
        params = inspect.signature(enable).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        # The starting design's minimal signature is (*, device, pin_memory); pass the rest when
        # accepted: the selection, the platform and the parallel facts the config holds.
        facts = (("components", self.config.components), ("platform", self.platform),
                 ("use_hsdp", self.config.use_hsdp), ("world_size", self.config.world_size))
        for name, value in facts:
            if name in params or takes_any:
                kwargs[name] = value
        txn.step(f"{type(pipeline).__name__}.enable_omni_model_cpu_offload")
        # Registered before the call: a failure inside the pipeline's enable calls its disable.
        txn.on_rollback(pipeline.disable_omni_model_cpu_offload)
        enable(**kwargs)

    def uninstall(self, pipeline: Any) -> None:
        if self._delegated:
            if pipeline is not None:  # a collected split model took its offload state with it
                pipeline.disable_omni_model_cpu_offload()
            return
        assert self._swapper is not None
        self._swapper.restore()
        self.registry.remove_all()
        self.platform.synchronize()

    @property
    def swapper(self) -> ComponentSwapper | None:
        """The current enable's swapper (None while disabled, or for a delegated split model)."""
        return self._swapper

    def _reset(self) -> None:
        self._swapper = None
        self._components = ()
        self._delegated = False


    # -- swaps ----------------------------------------------------------------------------------

    def activate(self, comp: ResolvedComponent) -> None:
        """Make ``comp`` the resident swap group: load it, offload the groups the residency rule
        (the module docstring) evicts for it.  Called by its hook before each of its forwards
        (and by :meth:`use_component`); a no-op while disabled."""
        swapper = self._swapper
        if swapper is None:
            return
        if comp.role == ComponentRole.DIT:
            evict = [c.path for c in self._components if c.role in _SWAPPED and c is not comp]
        else:
            evict = [c.path for c in self._components if c.role == ComponentRole.DIT]
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
                if comp.role in _SWAPPED:
                    with torch.inference_mode(False):
                        self.activate(comp)
                yield
                return
        known = [c.path for c in self._components]
        raise ValueError(f"unknown component {path!r}; the plan's components are {known}")

    def rebound_tensors(self) -> list[tuple[str, Any]]:
        if self._swapper is None:
            return []
        return self._swapper.named_tensors()

    def offloaded_tensors(self) -> dict[int, Any]:
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


# The old name, kept for one release: the hook is named after its strategy
# (``OffloadStrategy.MODEL_LEVEL``), as its backend is; its hook name is ``offload_ref.model_level``
# (``offload_ref.sequential`` before).
SequentialOffloadHook = ModelLevelOffloadHook  # old name, kept for one release
