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

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import OffloadConfig, OffloadStrategy
from ..hooks import HookRegistry, ModelHook
from ..host import HostMaster, Layout, aligned_empty, unique_tensors
from ..discovery import get_submodule_path
from ..plan import ResolvedOffloadPlan, pipeline_state, resolve_offload_plan  # noqa: F401 (re-exported)
from ..platform import Platform, get_platform
from .guard import CallGuard, OffloadWeightEditError

__all__ = [
    "OffloadBackend",
    "backend_of",
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

    def add_handles(self, label: str, installs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Install torch hooks (each ``install()`` returns a removable handle) as one step."""
        self.step(f"hooks {label}")
        handles = []
        for install in installs:
            handles.append(install())
            self.on_rollback(handles[-1].remove)
        return handles

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
        self._pipeline: Callable[[], Any] | None = None  # a weak reference where possible
        self._stats = OffloadStats()
        self._guard = CallGuard(type(self).__name__)
        self._handles: list[Any] = []  # state-dict hooks of the current enable
        self._finalizer: weakref.finalize | None = None

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
        reference = _reference(pipeline)  # before any mutation: nothing can fail after commit
        txn = self.transaction_class(self.platform, self.registry, self.fault_injector)
        self._stats = OffloadStats()
        self._guard = CallGuard(type(self).__name__)  # hooks of an earlier enable see theirs
        # Note [Hooks leave inference mode]: what enable builds must be ordinary tensors, and
        # building it must not record autograd history, whatever mode the caller is in.
        with torch.inference_mode(False), torch.no_grad():
            try:
                self._enable(pipeline, plan, txn)
                self._install_state_hooks(pipeline, plan, txn)
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
        self._pipeline = reference
        if isinstance(reference, weakref.ref):
            # The pipeline keeps its backend alive (PIPELINE_ATTR); if the pipeline is collected
            # while enabled, this releases the device and host buffers it still held.
            self._finalizer = weakref.finalize(pipeline, _release_orphan, self)

    def disable(self) -> None:
        """Remove our hooks and rebuild every tensor at its original placement.  Idempotent.

        If the pipeline was garbage-collected while enabled, its components may still be alive
        (held by the caller or by ``self.plan``): they are restored the same way, then the plan
        is dropped."""
        if self._pipeline is None:
            return
        pipeline = self.pipeline
        # Note [One thread at a time]: wait until no other thread is inside an offloaded
        # forward; hooks that fire from now on leave their modules alone.
        with self._guard.exclusive(close=True), torch.inference_mode(False), torch.no_grad():
            try:
                self._disable(pipeline)
            except Exception as exc:
                raise OffloadDisableError(
                    f"Failed to fully disable {type(self).__name__}: {exc}; the backend stays "
                    "enabled with its host masters, call disable() again"
                ) from exc
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if pipeline is not None:
            pipeline.__dict__.pop(PIPELINE_ATTR, None)
        else:
            self.plan = None
        self._pipeline = None
        self._forget()

    @contextmanager
    def edit_weights(self) -> Iterator[Any]:
        """Edit the weights of the enabled pipeline: LoRA loading and fusing, ``load_state_dict``,
        in-place updates (Note [Weight edits])::

            with backend.edit_weights() as pipe:
                pipe.transformer.load_state_dict(new_weights)

        Inside the block the pipeline holds ordinary tensors at their original placement (the
        backend is disabled, edits made before are kept); on exit, also after an exception,
        the backend is enabled again and reads every weight anew, so edits take effect exactly.
        ``stats()`` then count from the new enable.
        """
        pipeline = self.pipeline
        if pipeline is None:
            raise RuntimeError(f"{type(self).__name__}.edit_weights: the backend is not enabled")
        self.disable()
        try:
            yield pipeline
        finally:
            self.enable(pipeline)

    def _install_state_hooks(self, pipeline: Any, plan: ResolvedOffloadPlan,
                             txn: Transaction) -> None:
        """``state_dict()`` returns true weights and ``load_state_dict`` refuses to run while
        enabled (Note [Weight edits]), on every module that holds an offloaded tensor (and on its
        ancestors for ``load_state_dict``)."""
        self._handles = []
        live = self._offloaded_tensors()
        if not live:
            return
        by_path: dict[str, nn.Module] = {}
        for root_path, root in _roots(pipeline, plan):
            for path, module in root.named_modules(prefix=root_path):
                by_path.setdefault(path, module)
        owners = []
        guarded: dict[int, tuple[str, nn.Module]] = {}
        for path, module in by_path.items():
            entries = [(n, live[id(t)]) for n, t in _direct_tensors(module) if id(t) in live]
            if not entries:
                continue
            owners.append((path, module, entries))
            parts = path.split(".") if path else []
            for i in range(len(parts) + 1):  # the module and every ancestor
                ancestor = by_path.get(".".join(parts[:i]))
                if ancestor is not None:
                    guarded.setdefault(id(ancestor), (".".join(parts[:i]), ancestor))
        name = type(self).__name__
        installs = []
        for path, module, entries in owners:
            if any(value is not None for _, value in entries):
                hook = _true_weights_hook(entries)
                installs.append(lambda m=module, h=hook: m.register_state_dict_post_hook(h))
        for path, module in guarded.values():
            hook = _refuse_load_hook(path or type(pipeline).__name__, name)
            installs.append(lambda m=module, h=hook: m.register_load_state_dict_pre_hook(h))
        # One step: the rollback suite injects a fault at every step, so per-module steps
        # would cost a full enable per module for nothing.
        self._handles = txn.add_handles("state_dict / load_state_dict", installs)

    def _offloaded_tensors(self) -> dict[int, Callable[[], torch.Tensor | None] | None]:
        """``id(tensor) -> value`` for every tensor the backend streams or swaps: ``value()``
        returns its true weight when the tensor is not bound to it (a placeholder), else None;
        ``value`` is None for tensors always bound to real storage."""
        return {}

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
    """``enable`` records its owner in the pipeline's ``__dict__`` (PIPELINE_ATTR); a pipeline
    without one (``__slots__`` and no ``__dict__``) is rejected before the first mutation.  A
    pipeline without weak references is supported: the backend holds it strongly."""
    if not isinstance(getattr(pipeline, "__dict__", None), dict):
        raise TypeError(
            f"{type(pipeline).__name__} cannot be offloaded: it has no instance __dict__ (for "
            f"{PIPELINE_ATTR}, which says which backend owns it); use a pipeline class without "
            "__slots__ (an nn.Module or a plain class), or add '__dict__' to its __slots__"
        )


class _Owner:
    """What PIPELINE_ATTR holds: the owning backend (a strong reference: an enabled pipeline
    keeps its backend alive, so dropping the backend never strands the pipeline)."""

    def __init__(self, backend: OffloadBackend) -> None:
        self._backend = backend

    def __call__(self) -> OffloadBackend:
        return self._backend

    def __repr__(self) -> str:
        return type(self._backend).__name__


class _Strong:
    """A strong stand-in for ``weakref.ref`` for pipelines that refuse weak references."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __call__(self) -> Any:
        return self._obj


def _reference(pipeline: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(pipeline)
    except TypeError:  # e.g. types.SimpleNamespace, or __slots__ without __weakref__
        return _Strong(pipeline)


def _release_orphan(backend: OffloadBackend) -> None:
    """The pipeline was collected while enabled: give back what the backend still holds."""
    try:
        backend.disable()
    except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
        warnings.warn(f"offload-ref: releasing the buffers of a collected pipeline's "
                      f"{type(backend).__name__} failed: {exc}", RuntimeWarning, stacklevel=1)


def backend_of(pipeline: Any) -> OffloadBackend | None:
    """The backend that currently owns ``pipeline``'s offload (None if none does).

    An enabled pipeline keeps its backend alive, so a backend whose last reference was dropped
    without ``disable()`` is reachable here: ``backend_of(pipe).disable()``."""
    owner = getattr(pipeline, PIPELINE_ATTR, None)
    return owner() if isinstance(owner, _Owner) else None


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [(n, t) for n, t in module._parameters.items() if t is not None]
    out += [(n, t) for n, t in module._buffers.items() if t is not None]
    return out


def _roots(pipeline: Any, plan: ResolvedOffloadPlan) -> list[tuple[str, nn.Module]]:
    if isinstance(pipeline, nn.Module):
        return [("", pipeline)]
    return [(c.path, c.module) for c in plan.components]


def _true_weights_hook(entries: list[tuple[str, Callable[[], Any] | None]]) -> Callable:
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name, value in entries:
            key = prefix + name
            if value is None or key not in state_dict:
                continue
            current = state_dict[key]
            if isinstance(current, nn.Parameter) or current is getattr(module, name, None):
                continue  # keep_vars=True: the caller asked for the objects themselves
            true = value()
            if true is not None:
                state_dict[key] = true
    return hook


def _refuse_load_hook(path: str, backend: str) -> Callable:
    def hook(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        raise OffloadWeightEditError(
            f"load_state_dict on {path} while {backend} offloads its weights: offloaded weights "
            "live in host masters and device slots, and an in-place load would be lost or half "
            "applied; load them inside `with backend.edit_weights(): ...` (offload_ref."
            "backend_of(pipeline) finds the backend), which re-reads every weight on exit"
        )
    return hook


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
