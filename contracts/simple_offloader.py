"""A deliberately plain offloader written against the public protocol alone, and its mutants.

:class:`SimpleOffloader` is what a model author might write in an afternoon: forward hooks that
copy a unit's weights to the device before it runs and park them on the host again, with no
stream, no prefetch and no ring.  It is correct (the kit passes it on every check that applies
to a foreign offloader), slow, and small enough to read.  The kit's tests use it twice:

* as an *unseen* offloader, judged only through ``factory(device, strategy)`` (the route
  ``offload-ref check --offloader`` takes), to show that the outside checks pass a correct
  offloader that is not offload-ref;
* with one defect each (:data:`BROKEN`), the ways offloaders in the wild go wrong, to show
  that each outside check fails exactly where it should (:mod:`.mutants`).

Units: model level swaps each DiT and encoder whole (one loaded at a time); layerwise streams each
block of the plan's rings (loaded before it runs, parked after) and keeps the rest on the device.
What it moves is found with offload-ref's public resolver, as an author's offloader might use its
own model table; how it moves it is its own.  It moves storages, so it refuses a pipeline with
wrapper-subclass weights (quantized weights without storage of their own) with
``NotImplementedError``, which the kit reports as not applicable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["BROKEN", "SimpleOffloader", "simple_offloader"]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, a one-byte float (float8, which ``torch.equal`` does not implement on
    the CPU) by its bits."""
    if a.is_floating_point() and a.element_size() == 1 and a.dtype == b.dtype:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _wrapper_subclasses(pipeline: Any) -> list[str]:
    """The parameters and buffers of ``pipeline`` that are wrapper tensor subclasses (quantized
    weights such as torchao's ``Float8Tensor``: no storage of their own, their data in inner
    tensors), as ``path (class)``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    roots = ([("", pipeline)] if isinstance(pipeline, nn.Module) else
             [(f"{k}.", v) for k, v in vars(pipeline).items() if isinstance(v, nn.Module)])
    return [f"{prefix}{name} ({type(t).__name__})" for prefix, root in roots
            for name, t in [*root.named_parameters(), *root.named_buffers()]
            if type(t) not in (torch.Tensor, nn.Parameter) and is_traceable_wrapper_subclass(t)]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` view the same memory the same way (``param.data`` is a new tensor object
    on every read, so identity cannot tell)."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


class _Unit:
    """Tensors loaded and parked together: their host data, kept to rebind, and the device
    views while loaded."""

    def __init__(self, name: str, modules: list[nn.Module],
                 exclude: frozenset[int] = frozenset()) -> None:
        self.name = name
        self.modules = modules
        self.entries: list[tuple[dict[str, Any], str, bool]] = []  # (registry, name, is_param)
        seen: set[tuple[int, str]] = set()
        for module in modules:
            for sub in module.modules():
                for registry in (sub._parameters, sub._buffers):
                    for key, t in registry.items():
                        if (t is None or t.is_meta or (id(registry), key) in seen
                                or id(t) in exclude):
                            continue
                        seen.add((id(registry), key))
                        self.entries.append((registry, key, isinstance(t, nn.Parameter)))
        self.host: list[torch.Tensor] = [self._data(e) for e in self.entries]
        self.loaded: list[torch.Tensor] | None = None
        #: what load() copies from, tensor by tensor (None: the host tensors); mutants only
        self.sources: list[torch.Tensor] | None = None
        #: one device copy per host storage (False: one per tensor); mutants only
        self.share_storage = True

    @staticmethod
    def _data(entry: tuple[dict[str, Any], str, bool]) -> torch.Tensor:
        registry, key, is_param = entry
        return registry[key].data if is_param else registry[key]

    @staticmethod
    def _bind(entry: tuple[dict[str, Any], str, bool], tensor: torch.Tensor) -> None:
        registry, key, is_param = entry
        if is_param:
            registry[key].data = tensor
        else:
            registry[key] = tensor

    def load(self, device: torch.device) -> None:
        """Copy to the device storage by storage (views and aliases keep their sharing)."""
        if self.loaded is not None:
            return
        for k, entry in enumerate(self.entries):  # a tensor assigned while parked is adopted
            if not _same_tensor(self._data(entry), self.host[k]):
                self.host[k] = self._data(entry)
        copies: dict[int, torch.UntypedStorage] = {}
        views = []
        with torch.no_grad():
            for k, t in enumerate(self.host):
                source = self.sources[k] if self.sources is not None else t
                storage = source.untyped_storage()
                key = storage.data_ptr() if self.share_storage else k
                target = copies.get(key)
                if target is None:
                    target = copies[key] = storage.to(device=device)
                # an inference tensor stays one, a normal one stays normal (whatever the mode
                # of the generation that loads it)
                with torch.inference_mode(t.is_inference()):
                    views.append(torch.empty(0, dtype=t.dtype, device=device).set_(
                        target, t.storage_offset(), t.size(), t.stride()))
            for entry, view in zip(self.entries, views):
                self._bind(entry, view)
        self.loaded = views

    def park(self) -> None:
        """Back to the host, keeping what was edited while loaded: an in-place edit is copied
        back, a tensor assigned in place of the device view is adopted."""
        if self.loaded is None:
            return
        with torch.no_grad():
            for k, (entry, view) in enumerate(zip(self.entries, self.loaded)):
                now, host = self._data(entry), self.host[k]
                with torch.inference_mode(host.is_inference()):
                    if not _same_tensor(now, view):
                        self.host[k] = now.to(host.device)  # assigned while loaded
                    elif not _equal(now, host.to(now.device)):
                        host.copy_(now)  # edited in place while loaded
        for entry, host in zip(self.entries, self.host):
            self._bind(entry, host)
        self.loaded = None


class SimpleOffloader:
    """See the module docstring.  One pipeline at a time; one thread inside it at a time."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        if strategy not in ("model_level", "layer_wise"):
            raise NotImplementedError(f"SimpleOffloader has no {strategy}")
        self.device, self.strategy = torch.device(device), strategy
        self.pipeline: Any = None
        self.units: list[_Unit] = []
        self.kept: _Unit | None = None
        self.handles: list[Any] = []
        self.current: _Unit | None = None
        self._inside: dict[int, int] = {}  # thread id -> units entered

    # -- the protocol ------------------------------------------------------------------------

    def enable(self, pipeline: Any) -> None:
        if self.pipeline is pipeline:
            return
        if self.pipeline is not None:
            raise RuntimeError("SimpleOffloader already offloads another pipeline; disable() it "
                               "first")
        units, rest = self._units(pipeline)
        self.pipeline, self.units = pipeline, units
        try:
            # a tensor of a unit reached from outside it too (an alias) moves with its unit
            owned = frozenset(id(registry[key]) for unit in units
                              for registry, key, _ in unit.entries)
            self.kept = _Unit("kept", rest, owned)
            self.kept.load(self.device)
            for unit in units:
                for module in unit.modules[:1]:
                    self.handles.append(module.register_forward_pre_hook(
                        lambda m, args, kwargs, unit=unit: self._enter(unit, args, kwargs),
                        with_kwargs=True))
                    self.handles.append(module.register_forward_hook(
                        lambda m, args, out, unit=unit: self._leave(unit), always_call=True))
        except BaseException:
            self._undo()
            raise

    def disable(self) -> None:
        if self.pipeline is not None:
            self._undo()

    def is_enabled(self) -> bool:
        return self.pipeline is not None

    # -- the rest ------------------------------------------------------------------------------

    def _undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        for unit in self.units:
            unit.park()
        if self.kept is not None:
            self.kept.park()
        self.handles, self.units, self.kept = [], [], None
        self.pipeline, self.current, self._inside = None, None, {}

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        from offload_ref import OffloadConfig, resolve_offload_plan
        from offload_ref.plan import selectable_components

        wrapped = _wrapper_subclasses(pipeline)
        if wrapped:  # it moves storages, and such a tensor has none of its own
            raise NotImplementedError(
                f"SimpleOffloader does not offload wrapper tensor subclasses (quantized "
                f"weights): {', '.join(wrapped[:2])}{' ...' if len(wrapped) > 2 else ''} "
                "keep their data in inner tensors, and it copies each weight's own storage")
        config = OffloadConfig(strategy=self.strategy,
                               components=selectable_components(pipeline, self.strategy))
        plan = resolve_offload_plan(pipeline, config)
        if plan.delegated or not plan.components:
            raise NotImplementedError(f"SimpleOffloader does not offload "
                                      f"{type(pipeline).__name__}: {plan.skip_reason or 'split'}")
        if self.strategy == "model_level":
            units = [_Unit(c.path, [c.module]) for c in plan.components
                     if c.selected and c.role in ("dit", "encoder") and not c.on_demand]
        else:
            units = [_Unit(f"{'+'.join(s.container_paths)}[{k}]", [block])
                     for s in plan.rings if len(s.streamed_blocks) >= 2
                     for k, block in enumerate(s.streamed_blocks)]
        moved = {id(m) for u in units for m in u.modules}
        rest = _outside(pipeline, moved)
        # A tensor outside the units that views a unit's storage (an alias) moves with that
        # unit: bound to its device copy while loaded, to its host storage while parked.
        storages = {t.untyped_storage().data_ptr(): u for u in units for t in u.host}
        tensors = {id(registry[key]) for u in units for registry, key, _ in u.entries}
        for module in rest:
            for registry in (module._parameters, module._buffers):
                for key, t in registry.items():
                    if t is None or id(t) in tensors or not t.numel():
                        continue
                    unit = storages.get(t.untyped_storage().data_ptr())
                    if unit is not None:
                        unit.entries.append((registry, key, isinstance(t, nn.Parameter)))
                        unit.host.append(unit._data(unit.entries[-1]))
        return units, rest

    def _enter(self, unit: _Unit, args: Any, kwargs: Any) -> None:
        me = threading.get_ident()
        if any(n for t, n in self._inside.items() if t != me):
            raise RuntimeError("SimpleOffloader: this pipeline was called from a second thread "
                               "while another thread is inside it; call it from one thread at "
                               "a time")
        if torch.is_grad_enabled() and (
                any(p.requires_grad for m in unit.modules for p in m.parameters())
                or any(isinstance(a, torch.Tensor) and a.requires_grad
                       for a in (*args, *kwargs.values()))):
            raise RuntimeError(f"SimpleOffloader: {unit.name} was called with autograd "
                               "recording (grad mode); offloaded weights serve inference only: "
                               "run under torch.no_grad() or torch.inference_mode()")
        self._inside[me] = self._inside.get(me, 0) + 1
        if self.strategy == "model_level" and self.current is not unit:
            if self.current is not None:
                self.current.park()
            self.current = unit
        unit.load(self.device)

    def _leave(self, unit: _Unit) -> None:
        me = threading.get_ident()
        self._inside[me] = max(0, self._inside.get(me, 0) - 1)
        if self.strategy == "layer_wise":
            unit.park()


def _outside(pipeline: Any, moved: set[int]) -> list[nn.Module]:
    """The modules of ``pipeline`` whose own tensors belong to no unit (with their submodules
    outside every unit), one entry each."""
    roots = ([pipeline] if isinstance(pipeline, nn.Module) else
             [v for v in vars(pipeline).values() if isinstance(v, nn.Module)])
    out: list[nn.Module] = []
    seen: set[int] = set()

    def walk(module: nn.Module) -> None:
        if id(module) in moved or id(module) in seen:
            return
        seen.add(id(module))
        out.append(_Own(module))
        for child in module.children():
            walk(child)

    for root in roots:
        walk(root)
    return out


class _Own(nn.Module):
    """A module's own tensors, without its children (a unit of its own may sit inside)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.__dict__["_parameters"] = module._parameters
        self.__dict__["_buffers"] = module._buffers


def simple_offloader(device: torch.device, strategy: str) -> SimpleOffloader:
    """``factory(device, strategy)`` of :class:`SimpleOffloader` (the offloader protocol)."""
    return SimpleOffloader(device, strategy)


# -- broken on purpose -------------------------------------------------------------------------


class _LeavesAHook(SimpleOffloader):
    """disable() forgets the forward hook of the last unit."""

    def _undo(self) -> None:
        kept = self.handles[-1:] if self.handles else []
        self.handles = self.handles[:-1]
        super()._undo()
        del kept  # never removed


class _KeepsEverything(SimpleOffloader):
    """Moves every weight to the device at enable and never parks one."""

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        units, rest = super()._units(pipeline)
        return [], rest + [m for u in units for m in u.modules]


class _CopiesTiesApart(SimpleOffloader):
    """Copies every tensor to the device on its own, so tensors that share storage (a tied
    weight reached by two paths, views of one weight) get a device copy each."""

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        units, rest = super()._units(pipeline)
        for unit in units:
            unit.share_storage = False
        return units, rest


class _ForgetsADevice(SimpleOffloader):
    """disable() leaves the first parameter of the kept (resident) modules on the device."""

    def _undo(self) -> None:
        kept = self.kept
        first = None
        if kept is not None and kept.loaded is not None:
            first = next(((entry, view) for entry, view in zip(kept.entries, kept.loaded)
                          if entry[2]), None)
        super()._undo()
        if first is not None:
            _Unit._bind(*first)


class _FirstSnapshot(SimpleOffloader):
    """Keeps a copy of the weights of its first enable and loads that copy at every later one:
    an edit made while disabled is never served (a server that caches weights does this)."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        super().__init__(device, strategy)
        self._first: list[tuple[Any, list[list[torch.Tensor]]]] = []

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        units, rest = super()._units(pipeline)
        first = next((snap for p, snap in self._first if p is pipeline), None)
        if first is None:
            first = [_copies(u.host) for u in units]
            self._first.append((pipeline, first))
        for unit, sources in zip(units, first):
            unit.sources = sources
        return units, rest


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` that share storage as they do."""
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        copy = storages.setdefault(storage.data_ptr(), storage.clone())
        with torch.inference_mode(t.is_inference()):
            out.append(torch.empty(0, dtype=t.dtype).set_(copy, t.storage_offset(), t.size(),
                                                          t.stride()))
    return out


class _NoRollback(SimpleOffloader):
    """A failure inside enable() leaves what was installed so far."""

    _enabling = False

    def enable(self, pipeline: Any) -> None:
        self._enabling = True
        try:
            super().enable(pipeline)
        finally:
            self._enabling = False

    def _undo(self) -> None:
        if not self._enabling:
            super()._undo()


class _StacksOnSecondEnable(SimpleOffloader):
    """A second enable() on the same pipeline installs every hook again."""

    def enable(self, pipeline: Any) -> None:
        if self.pipeline is not pipeline:
            super().enable(pipeline)
            return
        for unit in self.units:
            self.handles.append(unit.modules[0].register_forward_pre_hook(
                lambda m, args, kwargs, unit=unit: self._enter(unit, args, kwargs),
                with_kwargs=True))


class _InterruptLeak(SimpleOffloader):
    """Keeps each loaded unit in an in-flight list from its pre-hook to its post-hook; an
    interrupt skips the post-hook, and the entry (with its device copy) stays forever."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        super().__init__(device, strategy)
        self.in_flight: list[list[torch.Tensor]] = []

    def _enter(self, unit: _Unit, args: Any, kwargs: Any) -> None:
        super()._enter(unit, args, kwargs)
        self.in_flight.append(list(unit.loaded or ()))

    def _leave(self, unit: _Unit) -> None:
        if self.in_flight:
            self.in_flight.pop()
        super()._leave(unit)


def _broken(cls: type[SimpleOffloader]) -> Callable[[torch.device, str], SimpleOffloader]:
    def factory(device: torch.device, strategy: str) -> SimpleOffloader:
        return cls(device, strategy)

    factory.__doc__ = cls.__doc__
    factory.__qualname__ = f"broken_{cls.__name__.lstrip('_')}"
    return factory


#: name -> (factory, the defect in one line)
BROKEN: dict[str, tuple[Callable[[torch.device, str], SimpleOffloader], str]] = {
    "simple_leaves_a_hook": (_broken(_LeavesAHook), "disable() forgets one forward hook"),
    "simple_keeps_everything": (_broken(_KeepsEverything),
                                "every weight stays on the device while enabled"),
    "simple_copies_ties_apart": (_broken(_CopiesTiesApart),
                                 "tensors sharing storage get a device copy each"),
    "simple_forgets_a_device": (_broken(_ForgetsADevice),
                                "disable() leaves one parameter on the device"),
    "simple_first_snapshot": (_broken(_FirstSnapshot),
                              "serves the weights of its first enable forever"),
    "simple_no_rollback": (_broken(_NoRollback), "a failed enable() leaves what it installed"),
    "simple_stacks_hooks": (_broken(_StacksOnSecondEnable),
                            "a second enable() installs its hooks again"),
    "simple_interrupt_leak": (_broken(_InterruptLeak),
                              "a block interrupted by Ctrl-C keeps its device copy after "
                              "disable()"),
}
