"""The backend lifecycle shared by every strategy: transactional enable, exact-restore disable.

Note [Transactions]
    ``enable`` resolves the plan (pure), then prepares host masters and device copies off to the
    side, then commits (storage rebinds, hooks).  Every mutation goes through a
    :class:`Transaction` step that records its undo.  If any step raises, the undo log runs in
    reverse: every tensor is rebound to its original storage (same object, values, dtype, stride,
    sharing, device), every hook we installed is removed, every device and pinned byte we
    allocated is released, the backend is left disabled and retryable, and the error is raised
    as :class:`OffloadEnableError` chained to the cause.  The steps are enumerable (a dry run
    records their labels), which is how the conformance kit injects a fault at each one.

Note [Inference tensors]
    A pipeline built under ``torch.inference_mode()`` holds inference tensors.  Rebinding the
    ``.data`` of one to an ordinary tensor (a host master view, a device copy, a ring slot)
    leaves a tensor that every later op rejects ("Inference tensors do not track version
    counter"), in or out of inference mode.  So the first rebind of enable turns each inference
    tensor into an ordinary one in place (``torch.utils.swap_tensors``: the same Python object,
    class and attributes; undone exactly on rollback), and ``disable`` rebuilds the segments that
    held inference tensors as inference tensors again.  Forward works in or out of inference
    mode while enabled, and in the mode the pipeline was built for after disable.

Note [Original placement]
    ``disable`` rebuilds every tensor where it was before ``enable``: on the device if it was
    device-resident, on the host otherwise, with the same shape, stride and storage sharing,
    from the authoritative copy (the host master, or the device copy for state that was placed
    on the device).  The original storage itself is released at commit, otherwise offloading
    would save no memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import OffloadConfig, OffloadStrategy
from ..hooks import HookRegistry, ModelHook
from ..host import HostMaster, Layout, aligned_empty, unique_tensors
from ..plan import ResolvedOffloadPlan, pipeline_state, resolve_offload_plan  # noqa: F401 (re-exported)
from ..platform import Platform, get_platform

__all__ = [
    "OffloadBackend",
    "OffloadDisableError",
    "OffloadEnableError",
    "OffloadStats",
    "PIPELINE_ATTR",
    "Transaction",
    "get_offload_backend",
]

#: Set on the pipeline while a backend owns it (at most one strategy owns offload hooks).
PIPELINE_ATTR = "_offload_ref_backend"

FaultInjector = Callable[[int, str], None]


class OffloadEnableError(RuntimeError):
    """``enable`` failed; every change was rolled back (the cause is chained)."""


class OffloadDisableError(RuntimeError):
    """``disable`` failed; the backend stays enabled with its masters so it can be retried."""


@dataclass
class OffloadStats:
    """Bytes of one backend, counted since ``enable``.

    Weight counts never include alignment padding (Note [Aligned layout] in host.py); the
    ``*_padding_bytes`` fields hold it, so weight + padding is what the platform holds or copied.
    """

    host_bytes: int = 0  # host master weight bytes held
    pinned_bytes: int = 0  # host bytes page-locked for the masters (their padding included)
    device_weight_bytes: int = 0  # device bytes the backend holds for weights right now
    h2d_bytes: int = 0  # host -> device weight bytes moved during inference
    d2h_bytes: int = 0  # device -> host weight bytes moved during inference (always 0 here)
    swaps: int = 0  # component loads (model-level) or block materializations (layerwise)
    sync_recoveries: int = 0  # layerwise: blocks loaded synchronously (skipped or mispredicted)
    peak_device_weight_bytes: int = 0  # the most device_weight_bytes held at once
    host_padding_bytes: int = 0  # alignment padding inside the host masters
    device_padding_bytes: int = 0  # alignment padding inside the device buffers held now
    h2d_padding_bytes: int = 0  # padding copied along with h2d_bytes (whole flat buffers)
    peak_device_bytes: int = 0  # the most device bytes held at once, padding included

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def hold_device(self, weight: int, padding: int) -> None:
        self.device_weight_bytes += weight
        self.device_padding_bytes += padding
        self.peak_device_weight_bytes = max(self.peak_device_weight_bytes,
                                            self.device_weight_bytes)
        self.peak_device_bytes = max(self.peak_device_bytes,
                                     self.device_weight_bytes + self.device_padding_bytes)

    def release_device(self, weight: int, padding: int) -> None:
        self.device_weight_bytes -= weight
        self.device_padding_bytes -= padding

    def add_host(self, weight: int, padding: int, *, pinned: bool) -> None:
        self.host_bytes += weight
        self.host_padding_bytes += padding
        if pinned:
            self.pinned_bytes += weight + padding

    def add_h2d(self, weight: int, padding: int) -> None:
        self.h2d_bytes += weight
        self.h2d_padding_bytes += padding


class Transaction:
    """An undo log of enable's mutations; see Note [Transactions]."""

    def __init__(self, platform: Platform, registry: HookRegistry,
                 fault_injector: FaultInjector | None = None) -> None:
        self.platform = platform
        self.registry = registry
        self.fault_injector = fault_injector
        self.steps: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def step(self, label: str) -> None:
        self.steps.append(label)
        if self.fault_injector is not None:
            self.fault_injector(len(self.steps) - 1, label)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def host_master(self, label: str, layout: Layout, pin: bool) -> HostMaster:
        self.step(f"host master {label}")
        master = HostMaster(layout, self.platform, pin=pin)
        self.on_rollback(master.release)
        return master

    def device_empty(self, label: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.step(f"device alloc {label} ({dtype}, {numel})")
        t = self.platform.empty(numel, dtype)
        self.on_rollback(lambda: self.platform.free(t))
        return t

    def rebind(self, label: str, tensors: Sequence[torch.Tensor],
               new: Sequence[torch.Tensor]) -> None:
        self.step(f"rebind {label}")
        for t, n in zip(tensors, new):
            if t.is_inference():  # Note [Inference tensors]
                original = _swap_to_normal(label, t, n)
                self.on_rollback(lambda t=t, o=original: torch.utils.swap_tensors(t, o))
                continue
            old = t.data
            t.data = n
            self.on_rollback(lambda t=t, old=old: setattr(t, "data", old))

    def register_hook(self, module: nn.Module, name: str, hook: ModelHook, label: str) -> None:
        self.step(f"hook {name} on {label}")
        self.registry.register_hook(module, name, hook)
        self.on_rollback(lambda: self.registry.remove_hook(module, name))

    def set_attr(self, obj: Any, name: str, value: Any, label: str) -> None:
        self.step(f"set {label}.{name}")
        missing = object()
        old = obj.__dict__.get(name, missing)
        obj.__dict__[name] = value
        self.on_rollback(
            lambda: obj.__dict__.pop(name, None) if old is missing else obj.__dict__.__setitem__(
                name, old)
        )

    def rollback(self) -> None:
        errors = []
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            try:
                fn()
            except Exception as exc:  # undo everything we can before reporting
                errors.append(exc)
        if errors:
            raise RuntimeError(f"rollback left {len(errors)} change(s) undone: {errors}") \
                from errors[0]

    def commit(self) -> None:
        self._undo = []  # drops the references that kept the original storage alive


def _swap_to_normal(label: str, t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Turn the inference tensor ``t`` into an ordinary one viewing ``data``, keeping the Python
    object (and its class and attributes); returns the object that now holds the original
    (Note [Inference tensors])."""
    fresh = data.detach()
    if type(t) is not torch.Tensor:  # nn.Parameter and its subclasses
        fresh = torch.Tensor._make_subclass(type(t), fresh, t.requires_grad)
    fresh.__dict__.update(t.__dict__)
    try:
        torch.utils.swap_tensors(t, fresh)
    except RuntimeError as exc:
        raise RuntimeError(
            f"{label}: a tensor created under torch.inference_mode() cannot be converted for "
            f"offloading ({exc}); drop the other references to it, or build the pipeline "
            "outside inference_mode"
        ) from exc
    return fresh


def rebind_restored(t: torch.Tensor, v: torch.Tensor) -> None:
    """Give ``t`` its restored storage ``v`` at disable; an inference ``v`` (from a segment that
    held inference tensors) makes ``t`` a genuine inference tensor again (Note [Inference
    tensors])."""
    if not v.is_inference():
        t.data = v
        return
    with torch.inference_mode():
        fresh = v.detach()
        if type(t) is not torch.Tensor:
            fresh = torch.Tensor._make_subclass(type(t), fresh, t.requires_grad)
    fresh.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, fresh)


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
        layout = Layout(named, alignment=platform.alignment)
        was_resident = [platform.is_resident(src) for src in layout._sources]
        was_inference = [src.is_inference() for src in layout._sources]
        return cls(label, [t for _, t in named], layout, was_resident,
                   was_inference=was_inference)

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


def restore_group(group: TensorGroup, platform: Platform) -> list[torch.Tensor]:
    """Fresh storage for every segment at its original placement, filled from the authoritative
    copy; returns one tensor per group tensor (Note [Original placement])."""
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


class OffloadBackend:
    """One offload strategy applied to one pipeline.  See Note [Transactions]."""

    strategy: ClassVar[OffloadStrategy]
    hook_name: ClassVar[str]
    transaction_class: ClassVar[type[Transaction]] = Transaction

    def __init__(self, config: OffloadConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.plan: ResolvedOffloadPlan | None = None
        self.skip_reason: str | None = None
        self.registry = HookRegistry()
        #: Testing hook: called as ``fault_injector(step_index, label)`` before each mutation.
        self.fault_injector: FaultInjector | None = None
        self.last_steps: list[str] = []
        self._pipeline: weakref.ref | None = None
        self._stats = OffloadStats()

    # -- public lifecycle -----------------------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._pipeline is not None and self._pipeline() is not None

    @property
    def pipeline(self) -> Any:
        return None if self._pipeline is None else self._pipeline()

    def enable(self, pipeline: Any) -> None:
        """Apply the strategy to ``pipeline``.

        Enabling again on the same pipeline is a no-op; enabling on a second pipeline, or on a
        pipeline that another backend owns, raises ``RuntimeError``.
        """
        if self._pipeline is not None and self._pipeline() is None:
            self.disable()  # the last pipeline was collected while enabled: clean up first
        if self.is_enabled():
            if self.pipeline is pipeline:
                return
            raise RuntimeError(
                f"{type(self).__name__} is already enabled on another "
                f"{type(self.pipeline).__name__}; call disable() first"
            )
        owner = getattr(pipeline, PIPELINE_ATTR, None)
        if owner is not None:
            raise RuntimeError(
                f"{type(pipeline).__name__} is already offloaded by {owner!r}; disable that "
                "backend first (at most one offload strategy may own a pipeline)"
            )
        plan = resolve_offload_plan(pipeline, self.config,  # raises before any mutation
                                    alignment=self.platform.alignment)
        self.plan = plan
        self.skip_reason = plan.skip_reason
        if plan.skip_reason is not None:
            return
        _require_ownable(pipeline)  # enable ends by recording its owner: check that it can
        txn = self.transaction_class(self.platform, self.registry, self.fault_injector)
        self._stats = OffloadStats()
        # Note [Hooks leave inference mode]: what enable builds must be ordinary tensors, and
        # building it must not record autograd history, whatever mode the caller is in.
        with torch.inference_mode(False), torch.no_grad():
            try:
                self._enable(pipeline, plan, txn)
                txn.set_attr(pipeline, PIPELINE_ATTR, _Owner(self), type(pipeline).__name__)
                self.platform.synchronize()
            except BaseException as exc:
                self.last_steps = list(txn.steps)
                where = (f"step {len(txn.steps) - 1} ({txn.steps[-1]})" if txn.steps
                         else "preparation, before its first mutation")
                try:
                    try:  # let in-flight copies land before their buffers are released
                        self.platform.synchronize()
                    except Exception:  # noqa: BLE001 - the original error is the one to report
                        pass
                    txn.rollback()
                finally:
                    self._forget()
                if not isinstance(exc, Exception):
                    raise
                raise OffloadEnableError(
                    f"{type(self).__name__}.enable failed at {where}: {exc}; every change was "
                    "rolled back and the backend is disabled (enable can be retried)"
                ) from exc
        self.last_steps = list(txn.steps)
        txn.commit()
        self._pipeline = weakref.ref(pipeline)

    def disable(self) -> None:
        """Remove our hooks and rebuild every tensor at its original placement.  Idempotent.

        If the pipeline was garbage-collected while enabled, its components may still be alive
        (held by the caller or by ``self.plan``): they are restored the same way, then the plan
        is dropped."""
        if self._pipeline is None:
            return
        pipeline = self.pipeline
        with torch.inference_mode(False), torch.no_grad():
            try:
                self._disable(pipeline)
            except Exception as exc:
                raise OffloadDisableError(
                    f"Failed to fully disable {type(self).__name__}: {exc}; the backend stays "
                    "enabled with its host masters, call disable() again"
                ) from exc
        if pipeline is not None:
            pipeline.__dict__.pop(PIPELINE_ATTR, None)
        else:
            self.plan = None
        self._pipeline = None
        self._forget()

    def _forget(self) -> None:
        self._reset()
        self._stats = OffloadStats()  # stats describe the current enable only

    def stats(self) -> OffloadStats:
        """Bytes of the current enable (all zero while disabled)."""
        return OffloadStats(**self._stats.as_dict())

    # -- for subclasses -------------------------------------------------------------------------

    def _enable(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        raise NotImplementedError

    def _disable(self, pipeline: Any) -> None:
        """Restore and release; ``pipeline`` is None if it was garbage-collected."""
        raise NotImplementedError

    def _reset(self) -> None:
        """Forget per-enable state (after rollback or disable)."""

    def __repr__(self) -> str:
        state = "enabled" if self.is_enabled() else "disabled"
        return f"<{type(self).__name__} {state} on {self.platform.name}>"


def _require_ownable(pipeline: Any) -> None:
    """``enable`` holds the pipeline by weak reference and records its owner in the pipeline's
    ``__dict__`` (PIPELINE_ATTR); a pipeline that allows neither is rejected before the first
    mutation (the weak reference used to fail after the commit, leaving it half offloaded)."""
    missing = []
    try:
        weakref.ref(pipeline)
    except TypeError:
        missing.append("weak references ('__weakref__')")
    if not isinstance(getattr(pipeline, "__dict__", None), dict):
        missing.append(f"an instance __dict__ (for {PIPELINE_ATTR})")
    if missing:
        raise TypeError(
            f"{type(pipeline).__name__} cannot be offloaded: it supports no "
            f"{' and no '.join(missing)}; use a pipeline class without __slots__ (an nn.Module "
            "or a plain class), or add '__dict__' and '__weakref__' to its __slots__"
        )


class _Owner:
    """What PIPELINE_ATTR holds: a weak reference that prints as the owning backend."""

    def __init__(self, backend: OffloadBackend) -> None:
        self._ref = weakref.ref(backend)

    def __call__(self) -> OffloadBackend | None:
        return self._ref()

    def __repr__(self) -> str:
        backend = self._ref()
        return type(backend).__name__ if backend is not None else "a collected backend"


def get_offload_backend(
    config: OffloadConfig,
    device: str | torch.device | None = None,
    *,
    platform: Platform | None = None,
) -> OffloadBackend | None:
    """Exactly one backend for ``config``, or None when offloading is off.

    ``platform`` overrides the platform that ``device`` would select (tests pass a
    ``CpuPlatform(race_amplifier=True)``).  Nothing is installed until ``enable``.  A device
    that is not available (``"cuda"`` on a CPU-only torch) raises RuntimeError rather than
    silently running without offload; the distributed layerwise strategy raises
    NotImplementedError (its backend is not built yet).
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if config.strategy is OffloadStrategy.NONE:
        return None
    if platform is None:
        platform = get_platform(device)
    if config.strategy is OffloadStrategy.MODEL_LEVEL:
        from .model_level import ModelLevelOffloadBackend

        return ModelLevelOffloadBackend(config, platform)
    if config.strategy is OffloadStrategy.LAYER_WISE:
        from .layerwise import LayerWiseOffloadBackend

        return LayerWiseOffloadBackend(config, platform)
    raise NotImplementedError(
        "the distributed_layer_wise backend is not built yet in this version of offload-ref; "
        "use layer_wise (single process) meanwhile"
    )
