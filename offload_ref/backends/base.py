"""The backend lifecycle shared by every strategy: transactional enable (Note [Transactions] in
transaction.py), exact-restore disable (Note [Original placement] in groups.py), ownership of a
pipeline, and the ``state_dict`` / ``load_state_dict`` guards of an enabled pipeline.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import OffloadConfig, OffloadStrategy
from ..hooks import PIPELINE_ATTR, HookRegistry
from ..loading import any_file_backed, changed_mapped_files, mapped_files, verify_mapped_files
from ..host import require_host_budget
from ..plan import ResolvedOffloadPlan, named_tensors, resolve_offload_plan
from ..plan.tree import _module_attributes, pipeline_state, wrapper_inner
from ..platform import Platform
from .._interrupts import deferred_interrupts, interruption_point
from .call_guard import CallGuard
from .rebind_guard import guard_rebinds, guarded_by, unguard_rebinds
from .refusals import OffloadWeightEditError, RefusalPolicy, RefusesCopies
from .stats import OffloadStats
from .transaction import FaultInjector, Transaction
from .wrappers import NO_WRAPPERS, WrapperSet

__all__ = [
    "OffloadBackend",
    "backend_of",
    "OffloadDisableError",
    "OffloadEnableError",
    "PIPELINE_ATTR",
]

class OffloadEnableError(RuntimeError):
    """``enable`` failed; every change was rolled back (the cause is chained)."""


class OffloadDisableError(RuntimeError):
    """``disable`` failed; the backend stays enabled with its masters so it can be retried."""


class OffloadBackend:
    """One offload strategy applied to one pipeline.  See Note [Transactions].

    Users call ``enable``, ``disable``, ``edit_weights``, ``stats`` and ``is_enabled``.  ``enable``
    is a template: it resolves the plan, then builds everything inside one transaction, calling
    the methods below in this order; a strategy (and a subclass that changes one step of a
    strategy: the kit's mutants, a test's broken backend) overrides them, never the private
    helpers around them.

    Seams (a subclass may override):

    * :meth:`resolve` ``(pipeline)`` -- the plan ``enable`` applies; pure, raises before any
      mutation.
    * :meth:`install` ``(pipeline, plan, txn)`` -- build the strategy: masters, slots, hooks,
      every mutation recorded in ``txn`` (a :class:`~offload_ref.backends.transaction.Transaction`
      of :attr:`transaction_class`) so a failure rolls it back.
    * :meth:`offloaded_tensors` -- the tensors ``state_dict`` / ``load_state_dict`` guard.
    * :meth:`rebound_tensors` -- the tensors the ``.data`` guard covers (Note [Rebind guard]).
    * :meth:`after_guard` ``(txn)`` -- once those tensors are guarded.
    * :meth:`before_commit` ``(txn)`` -- the last step that may still fail and roll back.
    * :meth:`enable_failed` ``(exc)`` -- enable failed, before its rollback.
    * :meth:`uninstall` ``(pipeline)`` -- ``disable``'s work: restore every tensor at its
      original placement and remove the hooks.

    Policy classes (class attributes): :attr:`transaction_class`, the undo log ``enable`` records
    into (strategies add theirs, e.g. ``ring_class``, ``swapper_class``); :attr:`call_guard_class`,
    the guard each enable's hooks enter (Note [One thread at a time] in call_guard.py);
    :attr:`refusal_policy_class`, what the hooks and the objects the backend attaches refuse
    (Note [Refusal policy] in refusals.py; each enable's instance is :attr:`refusal_policy`).
    """

    strategy: ClassVar[OffloadStrategy]
    hook_name: ClassVar[str]
    transaction_class: ClassVar[type[Transaction]] = Transaction
    call_guard_class: ClassVar[type[CallGuard]] = CallGuard
    refusal_policy_class: ClassVar[type[RefusalPolicy]] = RefusalPolicy

    def __init__(self, config: OffloadConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.plan: ResolvedOffloadPlan | None = None
        self.skip_reason: str | None = None
        self.registry = HookRegistry()
        #: Testing hook: called as ``fault_injector(step_index, label)`` before each mutation.
        self.fault_injector: FaultInjector | None = None
        #: Plain layerwise: DiT path -> resident head, replacing the model's
        #: ``OffloadPlan.layerwise_resident_layers`` (None: the declaration; auto sets its choice).
        self.resident_heads: dict[str, int] | None = None
        #: Plain layerwise: blocks each ring copies ahead (Note [Prefetch depth] in ring.py).
        self.prefetch_depth = 1
        self.last_steps: list[str] = []
        self._pipeline: Callable[[], Any] | None = None  # a weak reference where possible
        self._stats = OffloadStats()
        self._guard = self.call_guard_class(type(self).__name__)
        self.refusal_policy = self.refusal_policy_class()  # Note [Refusal policy]
        self._handles: list[Any] = []  # state-dict hooks of the current enable
        # Note [Rebind guard] (rebind_guard.py): the tensors guarded by the current enable.
        self._guarded: list[torch.Tensor] = []
        self._guarded_named: list[tuple[str, torch.Tensor]] = []
        self._finalizer: weakref.finalize | None = None
        #: The wrapper subclasses of the current enable (Note [Wrapper subclasses] in
        #: plan/tree.py); swappers call its ``follow()`` after each move.
        self.wrappers: WrapperSet = NO_WRAPPERS
        #: ``(qualified name, wrapper)`` of the wrappers the install's hooks give their own class
        #: for the forward that uses them, guarded otherwise (Note [Guarded wrappers] in
        #: rebind_guard.py).
        self.wrapper_guards: list[tuple[str, torch.Tensor]] = []

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
        _require_unowned_modules(pipeline)
        plan = self.resolve(pipeline)  # raises before any mutation
        self.plan = plan
        self.skip_reason = plan.skip_reason
        if plan.skip_reason is not None:
            return
        _require_ownable(pipeline)  # enable ends by recording its owner: check that it can
        # Note [Host budget] (host.py): the host masters fit, before anything is allocated
        require_host_budget(f"{type(self).__name__} on {type(pipeline).__name__}",
                            plan.host_allocations or (), self.platform, self.config.pin_memory,
                            self.config.host_budget_bytes)
        # Note [Changed files] (loading.py): enable reads the weights' file pages.
        if any_file_backed():
            verify_mapped_files(mapped_files(_all_tensors(pipeline, plan)),
                                f"{type(self).__name__}.enable()")
        with deferred_interrupts():  # Note [Deferred interrupts] in _interrupts.py
            self._enable_transaction(pipeline, plan)

    def _enable_transaction(self, pipeline: Any, plan: ResolvedOffloadPlan) -> None:
        self._forget()  # whatever an interrupted disable or rollback left of the last enable
        reference = _reference(pipeline)  # before any mutation: nothing can fail after commit
        txn = self.transaction_class(self.platform, self.registry, self.fault_injector)
        self._stats = OffloadStats()
        # A fresh guard: hooks of an earlier enable see theirs.
        self._guard = self.call_guard_class(type(self).__name__)
        self.refusal_policy = self.refusal_policy_class()  # Note [Refusal policy] (refusals.py)
        # Note [Hooks leave inference mode]: what enable builds must be ordinary tensors, and
        # building it must not record autograd history, whatever mode the caller is in.
        with torch.inference_mode(False), torch.no_grad():
            try:
                # Note [Wrapper subclasses] (plan/tree.py): found before any rebind; the undo,
                # recorded first, runs after every other one.
                self.wrappers = WrapperSet.of(_module_roots(pipeline))
                if self.wrappers:
                    txn.on_rollback(functools.partial(self.wrappers.follow, as_built=True))
                self.install(pipeline, plan, txn)
                if self.wrappers:
                    txn.step("wrapper subclasses take their inner tensors' device")
                    self.wrappers.follow()
                self._install_state_hooks(pipeline, plan, txn)
                self._guarded_named = self.rebound_tensors() + self.wrapper_guards
                self._guarded = txn.guard_rebinds(self._guarded_named, type(self).__name__)
                self.after_guard(txn)
                txn.set_attr(pipeline, PIPELINE_ATTR, _Owner(self), type(pipeline).__name__)
                interruption_point()  # a Ctrl-C during enable rolls it back
                self.platform.synchronize()
                self.before_commit(txn)  # the last thing that may fail (Note [Collective safety])
                # The backend's own state, then the commit (one assignment), still inside the
                # transaction: an exception at any line of enable rolls it back (issue 37).
                self.last_steps = list(txn.steps)
                self._pipeline = reference
                if isinstance(reference, weakref.ref):
                    # The pipeline keeps its backend alive (PIPELINE_ATTR); if the pipeline is
                    # collected while enabled, this releases the device and host buffers it
                    # still held.
                    self._finalizer = weakref.finalize(pipeline, _release_orphan, self)
                txn.commit()
            except BaseException as exc:
                self._pipeline = None
                if self._finalizer is not None:
                    self._finalizer.detach()
                    self._finalizer = None
                self.enable_failed(exc)
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

    def disable(self) -> None:
        """Remove our hooks and rebuild every tensor at its original placement.  Idempotent.

        If the pipeline was garbage-collected while enabled, its components may still be alive
        (held by the caller or by ``self.plan``): they are restored the same way, then the plan
        is dropped."""
        if self._pipeline is None:
            return
        with deferred_interrupts():  # Note [Deferred interrupts]: disable runs to its end
            self._disable_all()

    def _disable_all(self) -> None:
        pipeline = self.pipeline
        # Note [One thread at a time]: wait until no other thread is inside an offloaded
        # forward; hooks that fire from now on leave their modules alone.
        with self._guard.exclusive(close=True), torch.inference_mode(False), torch.no_grad():
            try:
                unguard_rebinds(self._guarded)  # Note [Rebind guard]: plain tensors again
                # A retry after an exception anywhere in here redoes what is left (each step of
                # uninstall is idempotent: Note [Undo first] in transaction.py).
                self.uninstall(pipeline)
                self.wrappers.follow(as_built=True)  # Note [Wrapper subclasses] (plan/tree.py)
            except Exception as exc:
                unguard_rebinds(self._guarded)  # every one plain (idempotent), then guarded
                self._guarded = []
                guard_rebinds(self._guarded_named, type(self).__name__, self._guarded)
                raise OffloadDisableError(
                    f"Failed to fully disable {type(self).__name__}: {exc}; the backend stays "
                    "enabled with its host masters, call disable() again"
                ) from exc
            self._guarded = []
            while self._handles:  # each forgotten once removed
                self._handles[-1].remove(); self._handles.pop()  # noqa: E702
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        plan = self.plan
        if pipeline is not None:
            pipeline.__dict__.pop(PIPELINE_ATTR, None)
        else:
            self.plan = None
        self._pipeline = None
        self._forget()
        if plan is not None and any_file_backed():  # Note [Changed files] in loading.py
            changed = changed_mapped_files(mapped_files(_all_tensors(pipeline, plan)))
            if changed:
                warnings.warn(
                    f"{type(self).__name__}.disable() restored tensors that are views of a file "
                    f"changed since load_safetensors mapped it: {changed[0]}. They do not hold "
                    "the loaded checkpoint; load it again from an intact file",
                    RuntimeWarning, stacklevel=3)

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
            try:
                self.enable(pipeline)
            except Exception as exc:
                raise OffloadEnableError(
                    f"{type(self).__name__}.edit_weights: re-enabling offload after the edit "
                    f"failed: {exc}.  Offload is now off (backend.is_enabled() is False): the "
                    "pipeline holds the edited weights as ordinary tensors.  Fix the cause and "
                    "call backend.enable(pipeline) again"
                ) from exc

    def _install_state_hooks(self, pipeline: Any, plan: ResolvedOffloadPlan,
                             txn: Transaction) -> None:
        """``state_dict()`` returns true weights and ``load_state_dict`` refuses to run while
        enabled (Note [Weight edits]), on every module that holds an offloaded tensor (and on its
        ancestors for ``load_state_dict``)."""
        self._handles = []
        live = self.offloaded_tensors()
        if not live:
            return
        by_path: dict[str, nn.Module] = {}
        for root_path, root in _roots(pipeline, plan):
            for path, module in root.named_modules(prefix=root_path):
                by_path.setdefault(path, module)
        owners = []
        guarded: dict[int, tuple[str, nn.Module]] = {}
        for path, module in by_path.items():
            entries = [(n, v) for n, t in _direct_tensors(module)
                       for v in (_true_value(t, live),) if v is not _NOT_LIVE]
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
                hook = _TrueWeightsHook(entries, path or type(pipeline).__name__)
                hook.refusal_policy = self.refusal_policy
                installs.append(lambda m=module, h=hook: m.register_state_dict_post_hook(h))
        for path, module in guarded.values():
            hook = _RefuseLoadHook(path or type(pipeline).__name__, name)
            hook.refusal_policy = self.refusal_policy
            installs.append(lambda m=module, h=hook: m.register_load_state_dict_pre_hook(h))
        # One step: the rollback suite injects a fault at every step, so per-module steps
        # would cost a full enable per module for nothing.
        self._handles = txn.add_handles("state_dict / load_state_dict", installs)

    def rebound_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(qualified name, tensor)`` of every tensor the backend rebinds while enabled
        (Note [Rebind guard] in rebind_guard.py guards them)."""
        return []

    def offloaded_tensors(self) -> dict[int, Callable[[], torch.Tensor | None] | None]:
        """``id(tensor) -> value`` for every tensor the backend streams or swaps: ``value()``
        returns its true weight when the tensor is not bound to it (a placeholder), else None;
        ``value`` is None for tensors always bound to real storage."""
        return {}

    def _forget(self) -> None:
        self._reset()
        self._guarded, self._guarded_named = [], []  # a rollback has unguarded them
        self.wrappers, self.wrapper_guards = NO_WRAPPERS, []
        self._stats = OffloadStats()  # stats describe the current enable only

    def stats(self) -> OffloadStats:
        """Bytes of the current enable (all zero while disabled)."""
        return OffloadStats(**self._stats.as_dict())

    # -- seams (the class docstring lists them) -------------------------------------------------

    def resolve(self, pipeline: Any) -> ResolvedOffloadPlan:
        """The plan ``enable`` applies (pure: Note [Resolution is pure] in plan.py)."""
        return resolve_offload_plan(pipeline, self.config, alignment=self.platform.alignment,
                                    resident_heads=self.resident_heads,
                                    prefetch_depth=self.prefetch_depth)

    def install(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        """Apply ``plan`` to ``pipeline`` (``enable``'s work), recording every mutation in
        ``txn`` so that a failure anywhere in enable rolls it back."""
        raise NotImplementedError

    def uninstall(self, pipeline: Any) -> None:
        """``disable``'s work: remove the hooks, restore every tensor at its original placement
        and release the buffers; ``pipeline`` is None if it was garbage-collected."""
        raise NotImplementedError

    def after_guard(self, txn: Transaction) -> None:
        """After the rebound tensors are guarded (Note [Rebind guard] in rebind_guard.py)."""

    def before_commit(self, txn: Transaction) -> None:
        """Called once everything is built and bound, before the undo log is dropped: the last
        point where enable can still fail and roll back (ranks agree here)."""

    def enable_failed(self, exc: BaseException) -> None:
        """Called when enable failed, before its rollback (a rank tells the others)."""

    def _reset(self) -> None:
        """Forget per-enable state (after rollback or disable)."""

    def __repr__(self) -> str:
        state = "enabled" if self.is_enabled() else "disabled"
        return f"<{type(self).__name__} {state} on {self.platform.name}>"


def _all_tensors(pipeline: Any, plan: ResolvedOffloadPlan) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``pipeline`` and of its resolved components (a component
    may sit behind a non-module attribute), by qualified name."""
    named = pipeline_state(pipeline, []) if pipeline is not None else []
    seen = {id(t) for _, t in named}
    for comp in plan.components:
        for name, t in named_tensors(comp.module, comp.path):
            if id(t) not in seen:
                seen.add(id(t))
                named.append((name, t))
    return named


def _require_unowned_modules(pipeline: Any) -> None:
    """Refuse a pipeline that shares a module with a pipeline another backend has enabled
    (``Pipe2(**pipe1.components)``): the pipeline mark says nothing of that, and two backends
    rebinding one module's tensors would each undo the other's work.  Guarded tensors (Note
    [Rebind guard] in rebind_guard.py) exist only while their backend is enabled, so one found here
    names the owner."""
    roots = [pipeline] if isinstance(pipeline, nn.Module) else [
        v for v in getattr(pipeline, "__dict__", {}).values() if isinstance(v, nn.Module)]
    for root in roots:
        for module in root.modules():
            for registry in (module._parameters, module._buffers):
                for t in registry.values():
                    owned = guarded_by(t) if t is not None else None
                    if owned is not None:
                        name, owner = owned
                        raise RuntimeError(
                            f"{type(pipeline).__name__} shares a module with a pipeline that "
                            f"{owner} offloads ({name} is one of its tensors); a module can be "
                            "offloaded by one backend at a time: disable that backend first "
                            "(offload_ref.backend_of(other_pipeline) finds it), or enable "
                            "offload on one of the pipelines only"
                        )


def _require_ownable(pipeline: Any) -> None:
    """``enable`` records its owner in the pipeline's ``__dict__`` (PIPELINE_ATTR); a pipeline
    without one (``__slots__`` and no ``__dict__``) is rejected before the first mutation.  A
    pipeline without weak references is supported: the backend holds it strongly."""
    if not isinstance(getattr(pipeline, "__dict__", None), dict):
        cls = type(pipeline)
        declared = cls.__dict__.get("__slots__", ())
        declared = (declared,) if isinstance(declared, str) else tuple(declared)
        where = _defined_at(cls)
        raise TypeError(
            f"{cls.__name__} cannot be offloaded: it has no instance __dict__ (for "
            f"{PIPELINE_ATTR}, which says which backend owns it).  Change "
            f"{cls.__module__}.{cls.__qualname__}.__slots__{where} from {declared!r} to "
            f"{(*declared, '__dict__')!r}, or use a pipeline class without __slots__ (an "
            "nn.Module or a plain class)"
        )


def _defined_at(cls: type) -> str:
    """`` (file:line)`` of a class's definition, when the source can be found."""
    import inspect

    try:
        lines = inspect.getsourcelines(cls)
        return f" ({inspect.getsourcefile(cls)}:{lines[1]})"
    except (OSError, TypeError):
        return ""


class _Owner(RefusesCopies):
    """What PIPELINE_ATTR holds: the owning backend (a strong reference: an enabled pipeline
    keeps its backend alive, so dropping the backend never strands the pipeline)."""

    __slots__ = ("_backend",)

    def __init__(self, backend: OffloadBackend) -> None:
        self._backend = backend

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"a pipeline that {type(self._backend).__name__} is enabled on"

    @property
    def refusal_policy(self) -> RefusalPolicy:  # Note [Refusal policy]
        return self._backend.refusal_policy

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


def execution_device(pipeline: Any) -> torch.device:
    """The device ``pipeline`` computes on: where its latents, noise and timesteps belong (what
    diffusers' ``_execution_device`` answers), under any offloader or none.  In this order:

    1. while an offload-ref backend owns the pipeline, the backend's device;
    2. a device that an offloader's hooks declare on one of the pipeline's modules: accelerate's
       (``module._hf_hook.execution_device``, diffusers' model and sequential CPU offload use
       them) and diffusers' group offloading (its hooks' onload device);
    3. otherwise the first device other than the host (and not ``meta``) where one of the
       pipeline's parameters or buffers lives: an offloader parks components on the host between
       their calls but never computes there, so a component it keeps resident (the VAE), or the
       pipeline moved whole to the device, tells the device while a parked component says
       ``cpu``;
    4. otherwise the CPU (every tensor on the host: an un-offloaded pipeline built there, or one
       whose offloader parks every component and declares no device; ask that offloader).

    Reading a component's parameters instead (``next(self.transformer.parameters()).device``) is
    a placement bug under any offloader (docs/model-authors.md#placement)."""
    backend = backend_of(pipeline)
    if backend is not None:
        return backend.platform.device
    if isinstance(pipeline, nn.Module):
        modules = [pipeline]
    else:
        modules = [v for v in getattr(pipeline, "__dict__", {}).values()
                   if isinstance(v, nn.Module)]
    declared = _declared_device(modules)
    if declared is not None:
        return declared
    host = None
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor is None or tensor.is_meta:
                continue
            if tensor.device.type != "cpu":
                return tensor.device
            host = host or tensor.device
    return host or torch.device("cpu")


def _declared_device(modules: list[nn.Module]) -> torch.device | None:
    """The execution device an offloader's hooks declare on one of ``modules`` (accelerate's
    ``_hf_hook.execution_device``, diffusers' group-offloading onload device), or None."""
    for root in modules:
        for module in root.modules():
            hook = getattr(module, "_hf_hook", None)
            device = getattr(hook, "execution_device", None)
            if device is None:  # a SequentialHook holds accelerate's hooks in .hooks
                device = next((d for h in getattr(hook, "hooks", ()) or ()
                               if (d := getattr(h, "execution_device", None)) is not None), None)
            if device is not None:
                return torch.device(device) if not isinstance(device, int) else \
                    torch.device("cuda", device)
            registry = getattr(module, "_diffusers_hook", None)
            device = _group_onload_device(registry)
            if device is not None:
                return device
    return None


def _group_onload_device(registry: Any) -> torch.device | None:
    """The onload device of diffusers' group-offloading hook in a module's hook registry."""
    hooks = getattr(registry, "hooks", None)
    if not isinstance(hooks, dict):
        return None
    for hook in hooks.values():
        for holder in (getattr(hook, "config", None), getattr(hook, "group", None)):
            device = getattr(holder, "onload_device", None)
            if device is not None:
                return torch.device(device)
    return None


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = [(n, t) for n, t in module._parameters.items() if t is not None]
    out += [(n, t) for n, t in module._buffers.items() if t is not None]
    return out


_NOT_LIVE = object()


def _true_value(t: torch.Tensor, live: dict[int, Callable[[], torch.Tensor | None] | None]
                ) -> Any:
    """What ``offloaded_tensors`` says of ``t`` (:data:`_NOT_LIVE` if nothing); for a wrapper
    subclass, a value built around its inner tensors' true values (Note [Wrapper subclasses] in
    plan/tree.py), or None when each of them is always bound to real storage."""
    inner = wrapper_inner(t)
    if inner is None:
        return live.get(id(t), _NOT_LIVE)
    parts = [(name, it, _true_value(it, live)) for name, it in inner]
    if all(v is _NOT_LIVE for _, _, v in parts):
        return _NOT_LIVE
    if all(v is None or v is _NOT_LIVE for _, _, v in parts):
        return None

    def value() -> torch.Tensor:
        true = {}
        for name, it, v in parts:
            got = v() if callable(v) else None
            true[name] = it if got is None else got
        _, ctx = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__(true, ctx, t.size(), t.stride())

    return value


def _module_roots(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """``(prefix, module)``: the pipeline, or the nn.Module attributes of a plain-object
    pipeline."""
    if isinstance(pipeline, nn.Module):
        return [("", pipeline)]
    return _module_attributes(pipeline)


def _roots(pipeline: Any, plan: ResolvedOffloadPlan) -> list[tuple[str, nn.Module]]:
    if isinstance(pipeline, nn.Module):
        return [("", pipeline)]
    return [(c.path, c.module) for c in plan.components]


class _TrueWeightsHook(RefusesCopies):
    """``state_dict`` post-hook of a module holding offloaded tensors: each value is the true
    weight, not the placeholder or slot the tensor is bound to (Note [Weight edits])."""

    # no __slots__: torch marks a public state_dict hook with an attribute

    def __init__(self, entries: list[tuple[str, Callable[[], Any] | None]], path: str) -> None:
        self.entries = entries
        self.path = path

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"module {self.path!r}"

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: Any) -> None:
        for name, value in self.entries:
            key = prefix + name
            if value is None or key not in state_dict:
                continue
            current = state_dict[key]
            if isinstance(current, nn.Parameter) or current is getattr(module, name, None):
                continue  # keep_vars=True: the caller asked for the objects themselves
            true = value()
            if true is not None:
                state_dict[key] = true


class _RefuseLoadHook(RefusesCopies):
    """``load_state_dict`` pre-hook on a module holding offloaded tensors and on its ancestors."""

    def __init__(self, path: str, backend: str) -> None:
        self.path = path
        self.backend = backend

    def _copy_subject(self) -> str:  # Note [No copies while enabled]
        return f"module {self.path!r}"

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        raise OffloadWeightEditError(
            f"load_state_dict on {self.path} while {self.backend} offloads its weights: "
            "offloaded weights live in host masters and device slots, and an in-place load would "
            "be lost or half applied; load them inside `with backend.edit_weights(): ...` "
            "(offload_ref.backend_of(pipeline) finds the backend), which re-reads every weight "
            "on exit"
        )
