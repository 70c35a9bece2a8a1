"""Stream offloaders an outsider might write, judged through the kit's offloader protocol.

Written only against ``torch.Stream``, ``torch.Event``, ``torch.accelerator`` and
``Tensor.record_stream`` (nothing of offload-ref but the pipelines' public declarations,
``_dit_modules`` and friends), as an engine author would write them for a GPU.  Each factory is
``factory(device, strategy)`` (``offload-ref check --offloader tests.stream_offloaders:NAME``).

Correct ones (bit-exact, no race):

* :func:`stream_prefetcher` (layer_wise): the blocks of each DiT (its ``nn.ModuleList``
  children, or the ones its class names in ``_layerwise_offload_blocks_attrs``) stream through
  two device slots.  A block's weights are staged in pinned host memory, copied into a slot on a
  copy stream, and a ready event is recorded on the copy stream after the copy; the block's
  forward pre-hook makes the compute stream wait on it and prefetches the next block into the
  other slot.  A slot is refilled only after the copy stream waited on the event the compute
  stream recorded when the block that used the slot was done; a staging buffer is refilled only
  after the host synchronized with its previous copy.  Everything outside the blocks stays on the
  device.
* :func:`stream_swapper` (model_level): each DiT and encoder is moved whole to the device on a
  copy stream at its forward pre-hook (the compute stream waits on an event recorded after the
  copies) and dropped at its forward hook; its device tensors are marked with
  ``record_stream(compute)`` first, so the caching allocator does not hand their memory to the
  copy stream's next load while the compute stream may still read it.

Racy ones, one defect each.  The simulated device executes every op at once, so they compute
the right numbers too: only the stream sanitizer tells them apart (:data:`RACY`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["RACY", "StreamPrefetcher", "StreamSwapper", "stream_prefetcher", "stream_swapper"]

_ALIGN = 64  # bytes: each host storage starts at a multiple of it inside a slot
_DITS = ("transformer", "unet")
_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")


# -- what to move ----------------------------------------------------------------------------


def _attribute(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


def _declared(pipeline: Any, attr: str, fallback: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The modules the pipeline declares under ``attr`` (``_dit_modules``), else the well-known
    attribute names ``fallback``; each module once."""
    paths = getattr(pipeline, attr, None)
    paths = list(paths) if paths else list(fallback)
    found: list[tuple[str, nn.Module]] = []
    for path in paths:
        module = _attribute(pipeline, path)
        if isinstance(module, nn.Module) and all(module is not m for _, m in found):
            found.append((path, module))
    return found


def _roots(pipeline: Any) -> list[nn.Module]:
    if isinstance(pipeline, nn.Module):
        return [pipeline]
    return [v for v in vars(pipeline).values() if isinstance(v, nn.Module)]


#: (the dict holding it, its key, whether it is a Parameter)
Entry = tuple[dict[str, Any], str, bool]


def _entries(modules: list[nn.Module], skip: set[int] | None = None) -> list[Entry]:
    """The parameters and buffers of ``modules`` and their submodules (not those inside a module
    whose id is in ``skip``), each registry slot once."""
    skip = skip or set()
    out: list[Entry] = []
    seen_modules: set[int] = set()
    seen: set[tuple[int, str]] = set()

    def walk(module: nn.Module) -> None:
        if id(module) in skip or id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        for registry in (module._parameters, module._buffers):
            for key, t in registry.items():
                if t is None or (id(registry), key) in seen:
                    continue
                seen.add((id(registry), key))
                out.append((registry, key, isinstance(t, nn.Parameter)))
        for child in module._modules.values():
            if child is not None:
                walk(child)

    for module in modules:
        walk(module)
    return out


def _data(entry: Entry) -> torch.Tensor:
    registry, key, is_param = entry
    return registry[key].data if is_param else registry[key]


def _bind(entry: Entry, tensor: torch.Tensor) -> None:
    registry, key, is_param = entry
    if is_param:
        registry[key].data = tensor
    else:
        registry[key] = tensor


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` view the same memory the same way (``.data`` is a new object each read)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.untyped_storage().data_ptr()
            == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset())


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as bytes."""
    with torch.inference_mode(t.is_inference()):
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(base: torch.Tensor, byte_offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor over ``base``'s storage from ``byte_offset`` on, laid out as ``like`` is over its
    own storage (same dtype, sizes, strides and storage offset); normal or inference as ``like``."""
    size = like.element_size()
    assert byte_offset % size == 0, (byte_offset, size)
    with torch.inference_mode(like.is_inference()):
        return torch.empty(0, dtype=like.dtype, device=base.device).set_(
            base.untyped_storage(), (base.storage_offset() + byte_offset) // size
            + like.storage_offset(), like.size(), like.stride())


class _Unit:
    """Tensors moved together (a block, a component, or what stays on the device)."""

    def __init__(self, name: str, entries: list[Entry],
                 modules: list[nn.Module] | None = None) -> None:
        self.name = name
        self.modules = modules or []  # hooked on its first module
        self.entries = entries
        self.host = [_data(e) for e in entries]  # what is bound while parked
        self.loaded: list[torch.Tensor] | None = None  # the device views while loaded

    def adopt(self) -> None:
        """Take a tensor assigned while parked (``w.data = w.data * 2``) as the host copy."""
        for k, entry in enumerate(self.entries):
            now = _data(entry)
            if not _same(now, self.host[k]):
                self.host[k] = now

    def storages(self) -> tuple[list[torch.Tensor], list[int]]:
        """The host storages under the unit's tensors (each once, as bytes) and, per tensor, the
        index of its storage: views and aliases keep sharing one device copy."""
        flats: list[torch.Tensor] = []
        where: dict[int, int] = {}
        index: list[int] = []
        for t in self.host:
            key = t.untyped_storage().data_ptr()
            if key not in where or key == 0:
                where[key] = len(flats)
                flats.append(_flat(t))
            index.append(where[key])
        return flats, index

    def bind(self, views: list[torch.Tensor]) -> None:
        for entry, view in zip(self.entries, views):
            _bind(entry, view)
        self.loaded = views

    def park(self) -> None:
        for entry, host in zip(self.entries, self.host):
            _bind(entry, host)
        self.loaded = None


def _layout(flats: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for flat in flats:
        offsets.append(end)
        end += -(-flat.numel() // _ALIGN) * _ALIGN
    return offsets, end


def _check_disjoint(units: list[_Unit], kept: _Unit) -> None:
    """A storage that two units (or a unit and what stays on the device) share cannot move with
    one of them alone: refuse the pipeline."""
    owner: dict[int, str] = {}
    for unit in (*units, kept):
        for t in unit.host:
            key = t.untyped_storage().data_ptr()
            if key and owner.setdefault(key, unit.name) != unit.name:
                raise NotImplementedError(
                    f"a tensor of {unit.name} shares its storage with {owner[key]}; this "
                    "offloader moves whole storages per unit")


# -- the common lifecycle ----------------------------------------------------------------------


class _StreamOffloader:
    """Hooks, rollback, the thread and grad-mode guards, and what stays on the device."""

    strategy = ""

    def __init__(self, device: torch.device, strategy: str) -> None:
        if strategy != self.strategy:
            raise NotImplementedError(f"{type(self).__name__} offers {self.strategy} only")
        self.device = torch.device(device)
        self.pipeline: Any = None
        self.units: list[_Unit] = []
        self.kept: _Unit | None = None
        self.kept_flats: list[torch.Tensor] = []  # the device copies of what stays there
        self.kept_host: list[torch.Tensor] = []  # their host storages
        self.handles: list[Any] = []
        self.copy_stream: torch.Stream | None = None
        self._inside: dict[int, int] = {}

    # the protocol

    def enable(self, pipeline: Any) -> None:
        if self.pipeline is pipeline:
            return
        if self.pipeline is not None:
            raise RuntimeError(f"{type(self).__name__} already offloads another pipeline; "
                               "disable() it first")
        units = self._units(pipeline)
        inside = {id(m) for unit in units for m in unit.modules}
        kept = _Unit("the rest", _entries(_roots(pipeline), inside))
        _check_disjoint(units, kept)
        self.pipeline, self.units, self.kept = pipeline, units, kept
        try:
            self.copy_stream = torch.Stream(self.device)
            self._keep_on_device()
            self._setup()
            for unit in units:
                module = unit.modules[0]
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

    # the parts each offloader fills in

    def _units(self, pipeline: Any) -> list[_Unit]:
        raise NotImplementedError

    def _setup(self) -> None:
        pass

    def _load(self, unit: _Unit) -> None:
        raise NotImplementedError

    def _unload(self, unit: _Unit) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        pass

    # the rest

    def _compute(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def _keep_on_device(self) -> None:
        """Move what no unit holds to the device once (blocking copies on the compute stream)."""
        kept = self.kept
        assert kept is not None
        flats, index = kept.storages()
        self.kept_flats = [flat.to(self.device) for flat in flats]
        self.kept_host = flats
        kept.bind([_view(self.kept_flats[i], 0, t) for t, i in zip(kept.host, index)])

    def _restore_kept(self) -> None:
        """Back to the host, keeping edits made while enabled: the device bytes are copied back
        (non_blocking, into pinned memory) and written into the host storages that differ; a
        tensor assigned in place of a device view is adopted."""
        kept = self.kept
        if kept is None or kept.loaded is None:
            return
        backs = [dev.to("cpu", non_blocking=True) for dev in self.kept_flats]  # <copy-back>
        self._wait_for_copies_back()
        _, index = kept.storages()
        written: set[int] = set()
        for k, (entry, view) in enumerate(zip(kept.entries, kept.loaded)):
            now = _data(entry)
            if not _same(now, view):  # assigned while enabled: adopt it
                with torch.inference_mode(now.is_inference()):
                    kept.host[k] = now.to(kept.host[k].device)
                continue
            i = index[k]
            if i in written:
                continue
            written.add(i)
            host, back = self.kept_host[i], backs[i]
            with torch.inference_mode(host.is_inference()):
                if not torch.equal(host, back):  # <read-back>
                    host.copy_(back)
        kept.park()

    def _wait_for_copies_back(self) -> None:
        self._compute().synchronize()

    def _undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        for unit in self.units:
            if unit.loaded is not None:
                self._unload(unit)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # no copy may still read or write what is freed below
        self._restore_kept()
        self._teardown()
        self.handles, self.units, self.kept = [], [], None
        self.kept_flats, self.kept_host = [], []
        self.pipeline, self.copy_stream, self._inside = None, None, {}

    def _enter(self, unit: _Unit, args: Any, kwargs: Any) -> None:
        me = threading.get_ident()
        if any(n for t, n in self._inside.items() if t != me):
            raise RuntimeError(f"{type(self).__name__}: this pipeline was called from a second "
                               "thread while another thread is inside it; call it from one "
                               "thread at a time")
        if torch.is_grad_enabled() and (
                any(p.requires_grad for m in unit.modules for p in m.parameters())
                or any(isinstance(a, torch.Tensor) and a.requires_grad
                       for a in (*args, *kwargs.values()))):
            raise RuntimeError(f"{type(self).__name__}: {unit.name} was called with autograd "
                               "recording; its weights are reused device memory: run under "
                               "torch.no_grad() or torch.inference_mode()")
        self._inside[me] = self._inside.get(me, 0) + 1
        self._load(unit)

    def _leave(self, unit: _Unit) -> None:
        me = threading.get_ident()
        self._inside[me] = max(0, self._inside.get(me, 0) - 1)
        if unit.loaded is not None:
            self._unload(unit)


def _module_unit(name: str, modules: list[nn.Module]) -> _Unit:
    return _Unit(name, _entries(modules), modules)


# -- layer_wise: two slots -----------------------------------------------------------------


class StreamPrefetcher(_StreamOffloader):
    """See the module docstring.  The defects of :data:`RACY` are switched on by the flags."""

    strategy = "layer_wise"
    #: (a) the compute stream never waits for the block's copy
    wait_for_copy = True
    #: (b) a slot is refilled without waiting for the compute that used it
    wait_for_slot = True
    #: (c) the ready event is recorded on the compute stream
    ready_on_copy_stream = True
    #: (f) the ready event is recorded before the copy is enqueued
    record_after_copy = True

    def _units(self, pipeline: Any) -> list[_Unit]:
        blocks: list[tuple[str, nn.Module]] = []
        for path, dit in _declared(pipeline, "_dit_modules", _DITS):
            names = getattr(dit, "_layerwise_offload_blocks_attrs", None) or [
                name for name, child in dit.named_children()
                if isinstance(child, nn.ModuleList) and len(child) >= 2]
            for name in names:
                container = _attribute(dit, name)
                if isinstance(container, nn.ModuleList):
                    blocks += [(f"{path}.{name}.{k}", b) for k, b in enumerate(container)]
        if len(blocks) < 2:
            raise NotImplementedError(f"{type(pipeline).__name__} has no DiT with a list of 2 or "
                                      "more blocks")
        return [_module_unit(name, [block]) for name, block in blocks]

    def _setup(self) -> None:
        self.order = {id(unit): k for k, unit in enumerate(self.units)}
        self.layouts = [_layout(unit.storages()[0]) for unit in self.units]
        self.running: tuple[_Unit, int] | None = None
        self.prefetched: tuple[_Unit, int] | None = None  # for the very next block call only
        self.turn = 0
        self._allocate(max(end for _, end in self.layouts))

    def _allocate(self, nbytes: int) -> None:
        compute = self._compute()
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                      for _ in range(2)]
        self.staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        assert self.copy_stream is not None
        self.copy_stream.wait_stream(compute)  # the slots were made on the compute stream
        #: per slot: the event after its last copy (copy stream), after its last use (compute)
        self.ready: list[torch.Event | None] = [None, None]
        self.free: list[torch.Event | None] = [None, None]

    def _fill(self, unit: _Unit, slot: int) -> None:
        """Copy ``unit``'s weights into ``slot`` on the copy stream; ``self.ready[slot]`` is the
        event after the copy."""
        assert self.copy_stream is not None
        unit.adopt()
        flats, _ = unit.storages()
        offsets, end = _layout(flats)
        if end > self.slots[slot].numel():  # a tensor assigned while parked grew the block
            self.copy_stream.synchronize()
            self._compute().synchronize()
            self._allocate(end)  # a running block keeps the old slot alive through its views
            self.prefetched = None
        ready = self.ready[slot]
        if ready is not None:
            ready.synchronize()  # the staging buffer's previous copy is done
        staging = self.staging[slot]
        for flat, offset in zip(flats, offsets):
            staging[offset:offset + flat.numel()].copy_(flat)
        compute = self._compute()
        event = torch.Event(self.device)
        with self.copy_stream:
            free = self.free[slot]
            if free is not None and self.wait_for_slot:
                self.copy_stream.wait_event(free)
            if not self.record_after_copy:
                event.record(self.copy_stream)
            self.slots[slot][:end].copy_(staging[:end], non_blocking=True)  # <slot-copy>
            if self.record_after_copy:
                event.record(self.copy_stream if self.ready_on_copy_stream else compute)
        self.ready[slot] = event

    def _views(self, unit: _Unit, slot: int) -> list[torch.Tensor]:
        flats, index = unit.storages()
        offsets, _ = _layout(flats)
        return [_view(self.slots[slot], offsets[i], t) for t, i in zip(unit.host, index)]

    def _load(self, unit: _Unit) -> None:
        if self.running is not None:  # a block interrupted (Ctrl-C skips the forward hook)
            self._unload(self.running[0])
            self.prefetched = None
        compute = self._compute()
        if self.prefetched is not None and self.prefetched[0] is unit:
            slot = self.prefetched[1]
        else:
            slot = self.turn
            self._fill(unit, slot)
        self.prefetched = None
        ready = self.ready[slot]
        if self.wait_for_copy and ready is not None:
            compute.wait_event(ready)
        unit.bind(self._views(unit, slot))
        self.running = (unit, slot)
        self.turn = 1 - slot
        k = self.order[id(unit)] + 1
        if k < len(self.units):  # prefetch the next block into the other slot
            self._fill(self.units[k], 1 - slot)
            self.prefetched = (self.units[k], 1 - slot)
            self.turn = slot

    def _unload(self, unit: _Unit) -> None:
        if self.running is not None and self.running[0] is unit:
            event = torch.Event(self.device)
            event.record(self._compute())
            self.free[self.running[1]] = event
            self.running = None
        unit.park()

    def _teardown(self) -> None:
        self.slots, self.staging, self.ready, self.free = [], [], [None, None], [None, None]
        self.prefetched = self.running = None


# -- model_level: whole components -----------------------------------------------------------


class StreamSwapper(_StreamOffloader):
    """See the module docstring.  The defects of :data:`RACY` are switched on by the flags."""

    strategy = "model_level"
    #: (d) the device copies are dropped without ``record_stream`` of the compute stream
    record_stream = True
    #: (e) disable() reads the non_blocking copies back without synchronizing first
    sync_before_reading_back = True

    def _units(self, pipeline: Any) -> list[_Unit]:
        found = (_declared(pipeline, "_dit_modules", _DITS)
                 + _declared(pipeline, "_encoder_modules", _ENCODERS))
        inner = {id(sub) for _, m in found for sub in list(m.modules())[1:]}
        units = [_module_unit(path, [m]) for path, m in found if id(m) not in inner]
        if len(units) < 2:
            raise NotImplementedError(f"{type(pipeline).__name__} has fewer than two components "
                                      "to swap (a DiT and an encoder)")
        return units

    def _setup(self) -> None:
        self.current: _Unit | None = None
        self.on_device: dict[int, list[torch.Tensor]] = {}

    def _load(self, unit: _Unit) -> None:
        if self.current is unit:  # still loaded (an interrupt skipped its forward hook)
            return
        if self.current is not None:
            self._unload(self.current)
        assert self.copy_stream is not None
        unit.adopt()
        flats, index = unit.storages()
        compute = self._compute()
        ready = torch.Event(self.device)
        with self.copy_stream:
            copies = [flat.to(self.device, non_blocking=True) for flat in flats]  # <load>
            ready.record(self.copy_stream)
        compute.wait_event(ready)
        self.on_device[id(unit)] = copies
        unit.bind([_view(copies[i], 0, t) for t, i in zip(unit.host, index)])
        self.current = unit

    def _unload(self, unit: _Unit) -> None:
        copies = self.on_device.pop(id(unit), [])
        if self.record_stream:
            compute = self._compute()
            for copy in copies:
                copy.record_stream(compute)
        unit.park()
        del copies  # <free>
        if self.current is unit:
            self.current = None

    def _wait_for_copies_back(self) -> None:
        if self.sync_before_reading_back:
            super()._wait_for_copies_back()

    def _teardown(self) -> None:
        self.current, self.on_device = None, {}


def stream_prefetcher(device: torch.device, strategy: str) -> StreamPrefetcher:
    """``factory(device, strategy)`` of the correct two-slot prefetcher (layer_wise)."""
    return StreamPrefetcher(device, strategy)


def stream_swapper(device: torch.device, strategy: str) -> StreamSwapper:
    """``factory(device, strategy)`` of the correct model-level swapper."""
    return StreamSwapper(device, strategy)


# -- racy on purpose -------------------------------------------------------------------------


def _racy(cls: type[_StreamOffloader], name: str, **flags: bool
          ) -> Callable[[torch.device, str], _StreamOffloader]:
    variant = type(name, (cls,), dict(flags))

    def factory(device: torch.device, strategy: str) -> _StreamOffloader:
        return variant(device, strategy)

    factory.__name__ = factory.__qualname__ = name
    return factory


no_wait_for_copy = _racy(StreamPrefetcher, "no_wait_for_copy", wait_for_copy=False)
slot_refilled_while_in_use = _racy(StreamPrefetcher, "slot_refilled_while_in_use",
                                   wait_for_slot=False)
ready_event_on_compute_stream = _racy(StreamPrefetcher, "ready_event_on_compute_stream",
                                      ready_on_copy_stream=False)
freed_without_record_stream = _racy(StreamSwapper, "freed_without_record_stream",
                                    record_stream=False)
host_reads_before_sync = _racy(StreamSwapper, "host_reads_before_sync",
                               sync_before_reading_back=False)
event_recorded_before_copy = _racy(StreamPrefetcher, "event_recorded_before_copy",
                                   record_after_copy=False)

#: name -> (factory, strategy, the defect in words, the race kinds it must cause)
RACY: dict[str, tuple[Callable[[torch.device, str], _StreamOffloader], str, str,
                      frozenset[str]]] = {
    "no_wait_for_copy": (no_wait_for_copy, "layer_wise",
                         "the compute stream never waits for the block's copy",
                         frozenset({"read-after-write"})),
    "slot_refilled_while_in_use": (slot_refilled_while_in_use, "layer_wise",
                                   "a slot is refilled while its previous block may still be "
                                   "computing", frozenset({"write-after-read"})),
    "ready_event_on_compute_stream": (ready_event_on_compute_stream, "layer_wise",
                                      "the ready event is recorded on the compute stream, not "
                                      "the copy stream", frozenset({"read-after-write"})),
    "freed_without_record_stream": (freed_without_record_stream, "model_level",
                                    "a component's device copies, last read by the compute "
                                    "stream, are freed without record_stream and their memory "
                                    "reused by the copy stream", frozenset({"use-after-free"})),
    "host_reads_before_sync": (host_reads_before_sync, "model_level",
                               "disable() reads a non_blocking device-to-host copy before a "
                               "synchronize", frozenset({"host-read-before-sync"})),
    "event_recorded_before_copy": (event_recorded_before_copy, "layer_wise",
                                   "the ready event is recorded before the copy is enqueued",
                                   frozenset({"read-after-write"})),
}
