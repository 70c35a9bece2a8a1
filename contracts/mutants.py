"""Deliberately broken offloaders: the kit proves each check can fail.

Every mutant is the real implementation with one defect that other offloaders have shipped (see
``shared/reference``).  ``tests/test_mutants.py`` runs the catalogue against each one and asserts
exactly which checks fail; a check that no mutant kills is itself a failing test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from offload_ref import discovery
from offload_ref.backends import OffloadEnableError, get_offload_backend
from offload_ref.backends.auto import AutoOffloadBackend
from offload_ref.backends.groups import ComponentSwapper
from offload_ref.backends.distributed import (
    AllGatherTransport,
    DistributedLayerwiseOffloadBackend,
    _all_gather,
)
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transaction import Transaction
from offload_ref.hooks import ModelHook
from offload_ref.discovery import FALLBACK_NAMES, get_submodule_path
from offload_ref.plan import (
    AutoChoice,
    OffloadTopologyError,
    ResolvedComponent,
    ResolvedOffloadPlan,
    _predict,
    _Resolver,
    auto_candidates,
    resolve_candidate,
    resolve_offload_plan,
)

from .case import DEFAULT_IMPLEMENTATION, Implementation

__all__ = ["MUTANTS", "Mutant"]


@dataclass(frozen=True)
class Mutant:
    """One defect, where to run the catalogue against it, and exactly which checks it fails.

    ``pipelines`` are fixture names; ``sections`` select checks by catalogue section prefix (see `registry.doc_for`);
    ``patch`` (optional) is entered around the run for defects in shared helpers; ``factory``
    (optional) replaces the pipelines' factory for defects in the pipeline itself.
    """

    name: str
    defect: str
    impl: Implementation
    pipelines: tuple[str, ...]
    sections: tuple[str, ...]
    strategies: tuple[str, ...]
    kills: frozenset[str]
    patch: Callable[[], Any] | None = None
    factory: Callable[..., Any] | None = None
    placement_kills: frozenset[str] = frozenset()

    def expected_kills(self, placement: bool) -> frozenset[str]:
        """The checks this mutant fails: :attr:`kills`, plus :attr:`placement_kills` where host
        and device differ (``placement``: the kit runs on the simulated accelerator or a GPU),
        for a defect that leaves a tensor on the wrong device: one device hides it there."""
        if placement:
            return self.kills | self.placement_kills
        from .checks.observable import DEVICE_MEMORY_CHECKS

        return self.kills - DEVICE_MEMORY_CHECKS

    def specs(self) -> list[Any]:
        from offload_ref.fixtures import get_spec

        specs = [get_spec(name) for name in self.pipelines]
        if self.factory is not None:
            specs = [dataclasses.replace(s, factory=self.factory) for s in specs]
        return specs

    def checks(self) -> list[str]:
        """The checks of :attr:`sections`.  A mutant of offload-ref's internals runs the checks
        judged from outside (checks/observable.py) only where they are among its kills: the
        protocol mutants prove those checks can fail, and each such check on every internal
        mutant would double the suite's time."""
        from .checks.observable import OBSERVABLE_CHECKS
        from .runner import load_catalogue

        ids = [i.id for i in load_catalogue().values()
               if i.scope == "spec" and i.section.startswith(self.sections)]
        if self.impl.capabilities.internals:
            claimed = self.kills | self.placement_kills
            ids = [i for i in ids if i not in OBSERVABLE_CHECKS or i in claimed]
        return sorted(ids)

    def run(self) -> set[str]:
        """The ids of the checks that fail (or error) against this mutant."""
        from .runner import run_checks

        with (self.patch() if self.patch else contextlib.nullcontext()):
            results = run_checks(self.specs(), checks=self.checks(), strategies=self.strategies,
                                 impl=self.impl, include_global=False)
        return {r.id.check for r in results if not r.ok}


# -- resolver mutants (§A) ----------------------------------------------------------------------


def _impure(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    pipeline.__dict__["_kit_resolved_here"] = True  # a resolver that caches on the model
    return plan


_resolutions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unstable(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    count = _resolutions.get(pipeline, 0)
    _resolutions[pipeline] = count + 1
    if count % 2:  # every second resolution of a pipeline lists its components backwards
        return dataclasses.replace(plan, components=plan.components[::-1])
    return plan


class _ClassAttrsWin(_Resolver):
    def _container_names(self, path: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        names = getattr(module, "_layerwise_offload_blocks_attrs", None)
        if names:
            return tuple(names), f"{type(module).__name__}._layerwise_offload_blocks_attrs"
        return super()._container_names(path, module)


def _class_attrs_win(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _ClassAttrsWin(pipeline, config).resolve()


def _scan_always(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    known = {id(c.module) for c in plan.components}
    extra = []
    for role, names in FALLBACK_NAMES.items():
        for name in names:
            module = get_submodule_path(pipeline, name)
            if isinstance(module, nn.Module) and id(module) not in known:
                known.add(id(module))
                extra.append(ResolvedComponent(name, module, role, False))
    return dataclasses.replace(plan, components=plan.components + tuple(extra))


def _warn_every_time(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    discovery._warned_classes.clear()
    return resolve_offload_plan(pipeline, config)


def _no_dotted_paths(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    return dataclasses.replace(
        plan, components=tuple(c for c in plan.components if "." not in c.path))


def _swallow_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError as exc:
        return ResolvedOffloadPlan(config.strategy, skip_reason=f"skipped: {exc}")


def _vague_topology_errors(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    try:
        return resolve_offload_plan(pipeline, config)
    except OffloadTopologyError:
        raise OffloadTopologyError("invalid offload topology") from None


def _legacy_as_explicit(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return resolve_offload_plan(pipeline, dataclasses.replace(config, explicit=True))


def _no_ring_aliases(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    plan = resolve_offload_plan(pipeline, config)
    components = tuple(
        dataclasses.replace(c, stacks=tuple(dataclasses.replace(s, aliases=()) for s in c.stacks))
        for c in plan.components)
    return dataclasses.replace(plan, components=components)


class _AcceptsResidentInBlock(_Resolver):
    def _check_unique_ownership(self, components):
        inside = {id(sub) for c in components for s in c.stacks for b in s.blocks
                  for sub in b.modules() if sub is not b}
        # A component inside a streamed block is silently streamed with it.
        super()._check_unique_ownership([c for c in components if id(c.module) not in inside])


def _resident_in_block_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsResidentInBlock(pipeline, config).resolve()


class _AcceptsSharedStorage(_Resolver):
    def _check_one_group_per_storage(self, components):
        pass  # left to the backend, which meets it mid-enable


def _shared_storage_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSharedStorage(pipeline, config).resolve()


class _VaeWithoutLifecycle(_Resolver):
    def _vaes(self, found, on_demand):
        selected = self.config.selects("vae")  # the lifecycle declaration is never checked
        return [ResolvedComponent(p, m, "vae", selected, selected) for p, m in found.vaes]


def _vae_without_lifecycle(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _VaeWithoutLifecycle(pipeline, config).resolve()


class _AcceptsSparse(_Resolver):
    def _reject_unreadable_storage(self, found):
        pass  # layouts and storages are never looked at: a sparse tensor crashes a later walk


def _sparse_accepted(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _AcceptsSparse(pipeline, config).resolve()


class _DelegatedUnvalidated(_Resolver):
    def _validate_delegated(self) -> None:
        pass


def _delegated_unvalidated(pipeline: Any, config: Any) -> ResolvedOffloadPlan:
    return _DelegatedUnvalidated(pipeline, config).resolve()


def _split_threads_unguarded() -> Any:
    """ComponentGroups without its call guard: two threads swap the groups at once."""
    from offload_ref.split import ComponentGroups

    @contextlib.contextmanager
    def activated(self, name):
        if self._swapper is not None:
            self._swapper.check(name)
            self._swapper.activate(name)
        yield

    return _patched(ComponentGroups, "_activated", activated)


def _cycles_unchecked() -> Any:
    """Discovery walks the module graph without looking for a back edge."""
    return _patched(discovery, "require_acyclic", lambda *args, **kwargs: None)


# -- backend mutants (§B, §C, §E, §F.1) ---------------------------------------------------------


def _backend_with(**classes: type) -> Callable[[Any, Any], Any]:
    """``make_backend`` that swaps the class of the backend the real factory would build."""

    def make(config: Any, platform: Any) -> Any:
        backend = get_offload_backend(config, platform=platform)
        cls = classes.get(type(backend).__name__)
        if cls is not None:
            backend.__class__ = cls
        return backend

    return make


class _BudgetBlindAuto(AutoOffloadBackend):
    """strategy='auto' that ignores the budget: always the coarsest strategy (every weight
    resident), as an offloader that reads "auto" as "off" does."""

    def _choose(self, pipeline):
        candidates = auto_candidates(pipeline, self.config, alignment=self.platform.alignment)
        chosen = candidates[0]
        plan = resolve_candidate(pipeline, chosen, alignment=self.platform.alignment)
        choice = AutoChoice(self.config.device_budget_bytes, chosen.name, tuple(candidates))
        return chosen, dataclasses.replace(plan, auto=choice)


class _HeadGreedyAuto(AutoOffloadBackend):
    """strategy='auto' that keeps one head block more than the budget allows (it compares the
    head's bytes with the budget, forgetting that the slots still stream)."""

    def _choose(self, pipeline):
        picked, plan = super()._choose(pipeline)
        heads = plan.auto.heads
        if picked in heads and heads.index(picked) + 1 < len(heads):
            picked = heads[heads.index(picked) + 1]
        return picked, plan


class _HeadlessAuto(AutoOffloadBackend):
    """strategy='auto' that never keeps a resident head: the budget between layerwise's peak
    and model level's goes unused."""

    def _choose(self, pipeline):
        picked, plan = super()._choose(pipeline)
        return (plan.auto.heads[0] if plan.auto.heads else picked), plan


# -- resident head mutants (§F.7) ------------------------------------------------------------


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


class _EditsUnguarded(LayerWiseOffloadBackend):
    """Streams without refusing in-place edits between forwards: a loop editing every DiT weight
    changes the resident ones and stops at the first placeholder with torch's raw error."""

    def _after_guard(self, txn) -> None:
        pass


class _ForgetsOneHookTransaction(Transaction):
    _forgotten = False

    def register_hook(self, module, name, hook, label):
        if self._forgotten:
            return super().register_hook(module, name, hook, label)
        self._forgotten = True
        self.step(f"hook {name} on {label}")
        self.registry.register_hook(module, name, hook)  # no undo recorded


class _RollbackMissesAHook(ModelLevelOffloadBackend):
    transaction_class = _ForgetsOneHookTransaction


class _LeavesAHook(ModelLevelOffloadBackend):
    def _disable(self, pipeline):
        installed = self.registry.installed()
        kept = installed[0] if installed else None
        self._swapper.restore()
        for module, name in installed[1:]:
            self.registry.remove_hook(module, name)
        if kept is not None:  # forget it: the registry will never remove it
            self.registry._installed = [(weakref.ref(kept[0]), "lost")]


class _LeakyTransaction(Transaction):
    def device_empty(self, label, numel, dtype):
        self.step(f"device alloc {label}")
        return self.platform.empty(numel, dtype)  # no undo: a failed enable keeps the bytes


class _RollbackLeaksDeviceMemory(ModelLevelOffloadBackend):
    transaction_class = _LeakyTransaction


class _LeakyHostTransaction(Transaction):
    def host_master(self, label, layout, pin):
        self.step(f"host master {label}")
        from offload_ref.host import HostMaster

        return HostMaster(layout, self.platform, pin=pin)  # no undo: masters outlive a rollback


class _RollbackLeaksHostMasters(ModelLevelOffloadBackend):
    transaction_class = _LeakyHostTransaction


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


class _LosesTheCause(ModelLevelOffloadBackend):
    def enable(self, pipeline):
        try:
            super().enable(pipeline)
        except OffloadEnableError as exc:
            raise OffloadEnableError(str(exc)) from None


class _DisableNotIdempotent(ModelLevelOffloadBackend):
    def disable(self):
        pipeline = self.pipeline or self.__dict__.get("_kit_last")
        super().disable()
        if pipeline is not None:  # re-materializes on every call, enabled or not
            self.__dict__["_kit_last"] = pipeline
            for p in pipeline.parameters():
                p.data = p.data.clone()


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


class _ForgetsPlacement(ModelLevelOffloadBackend):
    def _disable(self, pipeline):
        self.registry.remove_all()  # tensors stay where the offloader put them


class _DelegatesWithoutDisable(ModelLevelOffloadBackend):
    def _enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        pipeline.enable_omni_model_cpu_offload(
            device=self.platform.device, pin_memory=self.config.pin_memory,
            components=self.config.components, platform=self.platform)
        self._delegated = True


# -- layerwise mutants (§D, §F.2, §F.4) ---------------------------------------------------------


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


class _NameBasedRing(BlockRing):
    def __init__(self, stack, *args, **kwargs):
        super().__init__(dataclasses.replace(stack, aliases=()), *args, **kwargs)

    def storage_keys(self):
        return set()  # non-block state is then chosen by module, not by storage


class _NameBasedPlacement(LayerWiseOffloadBackend):
    ring_class = _NameBasedRing


class _TwoMastersRing(BlockRing):
    def __init__(self, stack, *args, **kwargs):
        super().__init__(dataclasses.replace(stack, shared=()), *args, **kwargs)


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


class _KeepsInterruptedBlocksRunning(BlockRing):
    """Trusts the post-hook to end every forward: torch skips it for a KeyboardInterrupt, so the
    interrupted block stays running (holding its slot) forever."""

    def _recover(self, calling, finishing):
        if self._dirty:  # interrupted hook work is still repaired; a stale block is not seen
            super()._recover(calling, finishing)


# -- split-model mutants (§E): defects in the shared helper, the delegation, the pipeline ------


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _patched_all(owner: Any, **values: Any) -> contextlib.ExitStack:
    """``_patched`` for several names of one owner, undone together."""
    stack = contextlib.ExitStack()
    for name, value in values.items():
        stack.enter_context(_patched(owner, name, value))
    return stack


def _unchecked_component_names() -> Any:
    from offload_ref.split import ComponentGroups

    return _patched(ComponentGroups, "_check_name", lambda self, name: None)


def _copies_when_disabled() -> Any:
    from offload_ref.split import ComponentGroups

    original = ComponentGroups._activated

    def activated(self, name):
        if self._swapper is None:  # a "defensive copy" of the phase's weights
            for module in self._groups[name]:
                for p in module.parameters():
                    p.data = p.data.clone()
        return original(self, name)

    return _patched(ComponentGroups, "_activated", activated)


def _keeps_both_resident() -> Any:
    from offload_ref import split

    return _patched(split._Active, "activate",
                    lambda self, name: self.swapper.activate(name, []))


def _packs_without_padding() -> Any:
    """Segments packed back to back at element alignment (the layout before aligned regions)."""
    from offload_ref import host

    return _patched_all(host, _storage_phase=lambda ptr, offset, alignment: 0,
                        region_bytes=lambda phase, nbytes, alignment: nbytes)


def _realigns_every_tensor() -> Any:
    """Aligned regions, but every segment starts at its region's boundary (its phase dropped)."""
    from offload_ref import host

    return _patched(host, "_storage_phase", lambda ptr, offset, alignment: 0)


# -- §J mutants: what users do next to a generation -------------------------------------------


def _editing_in_place(base: type) -> type:
    """edit_weights() that yields the enabled pipeline: edits hit masters and placeholders."""

    @contextlib.contextmanager
    def edit_weights(self):
        yield self.pipeline

    return type(f"EditsInPlace{base.__name__}", (base,), {"edit_weights": edit_weights})


class _PlaceholderStateDict(LayerWiseOffloadBackend):
    """state_dict() reads whatever the tensors are bound to (placeholders between blocks)."""

    def _offloaded_tensors(self):
        return {key: None for key in super()._offloaded_tensors()}


def _unguarded(base: type) -> type:
    """Edits through ``.data`` pass unseen (no Note [Rebind guard]): the next swap drops them."""
    return type(f"Unguarded{base.__name__}", (base,), {"_rebound_tensors": lambda self: []})


def _backward_not_refused() -> Any:
    from offload_ref.backends import layerwise

    return _patched(layerwise, "refuse_autograd", lambda *args, **kwargs: None)


def _reads_between_forwards_allowed() -> Any:
    """Note [Reads between forwards] undone: ``.data`` of a streamed tensor reads whatever it is
    bound to (NaN placeholders, a slot still filling) between forwards."""
    from offload_ref.backends import layerwise

    return _patched(layerwise, "readable_while", lambda *args, **kwargs: None)


def _frozen_backward_not_refused() -> Any:
    """Note [Autograd] checking only whether the offloaded weights require grad: a frozen
    weight is still saved for the gradient of an input, and read back as a placeholder."""
    from offload_ref.backends import layerwise
    from offload_ref.backends import refusals as guard

    def weights_only(label, names, tensors, args=(), kwargs=None, module=None):
        guard.refuse_autograd(label, names, tensors)

    return _patched(layerwise, "refuse_autograd", weights_only)


def _unguarded_calls() -> Any:
    from offload_ref.backends.call_guard import CallGuard

    return _patched_all(CallGuard, enter=lambda self, label, frame: True,
                        holds=lambda self, frame: True, exit=lambda self, frame: True)


def _copies_not_refused() -> Any:
    """Note [No copies while enabled] undone: a deep copy or pickle of an enabled module
    copies its hooks, and fails deep inside with torch's "cannot pickle '_thread.lock'"."""
    from offload_ref.backends.refusals import RefusesCopies

    return _patched_all(RefusesCopies, __deepcopy__=None, __copy__=None,
                        __reduce_ex__=object.__reduce_ex__)


class _DelegationDropsComponents(ModelLevelOffloadBackend):
    def _enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        txn.on_rollback(pipeline.disable_omni_model_cpu_offload)
        pipeline.enable_omni_model_cpu_offload(device=self.platform.device,
                                               pin_memory=self.config.pin_memory)
        self._delegated = True


def _cosmos3_reasoner_every_step(seed: int = 0) -> Any:
    """A split pipeline that forgets the reasoner's context, so the reasoner reruns each step."""
    from offload_ref.fixtures.cosmos3 import build_pipeline

    pipeline = build_pipeline(seed)
    predict = pipeline.predict

    def forgetful(latents, sigma, step, cond):
        cond["context"] = None
        return predict(latents, sigma, step, cond)

    pipeline.predict = forgetful
    return pipeline


def _layerwise(ring: type[BlockRing], base: type = LayerWiseOffloadBackend) -> type:
    return type(f"Mutant{ring.__name__}", (base,), {"ring_class": ring})


_RESOLVER = dict(pipelines=("flux2",), sections=("A",),
                 strategies=("model_level", "layer_wise", "distributed_layer_wise"))
_MODEL_LEVEL = dict(pipelines=("wan22_t2v",), sections=("B", "C", "D", "F"),
                    strategies=("model_level",))
_LAYERWISE = dict(pipelines=("flux2",), sections=("B", "C", "D", "F"),
                  strategies=("layer_wise",))
_SPLIT = dict(pipelines=("cosmos3",), sections=("E",), strategies=("model_level",))
# Alignment defects change outputs only on machines whose kernels pick their path by alignment
# (MKL's GEMV on AMD EPYC): the parity checks would fail there and pass elsewhere, so these
# mutants run the alignment check alone, which fails on every machine.
_ALIGNMENT = dict(pipelines=("flux2", "cosmos3"), sections=("F.6",),
                  strategies=("model_level", "layer_wise"))
_MISUSE = ("J.3", "J.4", "J.5", "J.6", "J.8")
_MISUSE_LAYER = dict(pipelines=("flux2",), sections=_MISUSE, strategies=("layer_wise",))
_MISUSE_MODEL = dict(pipelines=("wan22_t2v",), sections=_MISUSE, strategies=("model_level",))
_J7 = dict(pipelines=("flux2",), sections=("J.7",), strategies=("model_level", "layer_wise"))
_SPLIT_THREADS = dict(pipelines=("cosmos3",), sections=("J.6",), strategies=("model_level",))
_J7_SPLIT = dict(pipelines=("cosmos3",), sections=("J.7",), strategies=("model_level",))
_INTERRUPTS = dict(pipelines=("flux2",), sections=("J.1",), strategies=("layer_wise",))
_DISTRIBUTED = dict(pipelines=("flux2",), sections=("H",),
                    strategies=("distributed_layer_wise",))
_NESTED_RESIDENT = dict(pipelines=("soulx_singer",), sections=("F",), strategies=("model_level",))
# wan22: every auto candidate has a prediction (encoder rings included)
_AUTO = dict(pipelines=("wan22_t2v",), sections=("A.8",), strategies=("layer_wise",))
# qwen_image: four blocks (heads of one and two), and a budget between layerwise's peak and
# model level's leaves room for a head
_HEAD = dict(pipelines=("qwen_image",), sections=("A.8", "F.7"), strategies=("layer_wise",))


def _m(name: str, defect: str, scope: dict, *, patch: Any = None, factory: Any = None,
       **changes: Any) -> Mutant:
    impl = DEFAULT_IMPLEMENTATION.replace(name=name, in_rank=f"{__name__}:in_rank", **changes)
    return Mutant(name, defect, impl, kills=frozenset(KILLS[name]), patch=patch,
                  factory=factory, placement_kills=frozenset(PLACEMENT_KILLS.get(name, ())),
                  **scope)


# Offloaders judged through the public protocol alone (contracts/simple_offloader.py): a plain,
# correct offloader with one defect each.  Run on flux2 (both strategies) and sd3 (layerwise:
# a buffer outside the blocks views a block's weight).
_PROTOCOL = dict(pipelines=("flux2", "sd3"), sections=("B", "C", "D", "F", "J"),
                 strategies=("model_level", "layer_wise"))


def _protocol(name: str) -> Mutant:
    from .offloader import offloader_implementation
    from .simple_offloader import BROKEN

    factory, defect = BROKEN[name]
    impl = offloader_implementation(factory, name=f"{__package__}.simple_offloader:{name}",
                                    validate=False)
    return Mutant(name, defect, impl, kills=frozenset(KILLS[name]),
                  placement_kills=frozenset(PLACEMENT_KILLS.get(name, ())), **_PROTOCOL)


def _resolver(name: str, defect: str, resolve: Callable[..., Any]) -> Mutant:
    return _m(name, defect, _RESOLVER, resolve_offload_plan=resolve)


def _model_level(name: str, defect: str, backend: type, scope: dict = _MODEL_LEVEL) -> Mutant:
    return _m(name, defect, scope,
              make_backend=_backend_with(ModelLevelOffloadBackend=backend))


def _layer(name: str, defect: str, backend: type) -> Mutant:
    return _layer_scoped(name, defect, backend, _LAYERWISE)


def _layer_scoped(name: str, defect: str, backend: type, scope: dict) -> Mutant:
    return _m(name, defect, scope, make_backend=_backend_with(LayerWiseOffloadBackend=backend))

# -- §H mutants: distributed layerwise across ranks ---------------------------------------------


def _distributed(name: str, defect: str, *, scope: dict = _DISTRIBUTED, **patches: Any) -> Mutant:
    """A mutant of the AllGather transport or the distributed backend, applied (by name) inside
    every spawned rank too (Note [One spawn per batch] in checks/distributed.py)."""
    def patch() -> Any:
        from offload_ref.backends import distributed

        stack = contextlib.ExitStack()
        for qualified, value in patches.items():
            owner_name, attr = qualified.split(".")
            stack.enter_context(_patched(getattr(distributed, owner_name), attr, value))
        return stack

    return _m(name, defect, scope, patch=patch)


_BUILD_SHARD = AllGatherTransport.build_master
_TRANSPORT_FOR = DistributedLayerwiseOffloadBackend._transport_for


def _garbage_padding_build(self, txn, ring, group, sections, image_bytes):
    _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    shard, S = self.shards[-1], self.shard_bytes[-1]
    tail = max(0, image_bytes - self.rank * S)
    if tail < S:
        shard[tail:].fill_(0xA5)  # what an uninitialized host buffer may hold


def _wrong_rank_build(self, txn, ring, group, sections, image_bytes):
    rank = self.rank
    self.rank = (rank + 1) % self.world  # cut the neighbour's shard ...
    try:
        _BUILD_SHARD(self, txn, ring, group, sections, image_bytes)
    finally:
        self.rank = rank  # ... and gather it into this rank's place


def _ready_on_copy_stream_fill(self, ring, k, s):
    """Records the ready event after the shard copy, not after the gather."""
    platform = ring.platform
    out, mine = self._slot_views(ring, k, s)
    with platform.stream(ring.copy_stream):
        ring.copy_stream.wait_event(ring.free[s])
        platform.copy_(mine, self.shards[k])
        self.copied[s].record(ring.copy_stream)
        ring.ready[s].record(ring.copy_stream)
    with platform.stream(self.comm_stream):
        self.comm_stream.wait_event(self.copied[s])
        platform.submit(lambda: _all_gather(out, mine, self.group),
                        reads=(ring.slots[s],), writes=(ring.slots[s],))


def _gathers_rank_local_rings(self, stack):
    """Every ring AllGathers across the ranks, rank-local ones included."""
    from offload_ref.config import WeightTransfer

    return _TRANSPORT_FOR(self, dataclasses.replace(stack, transfer=WeightTransfer.ALLGATHER))


def _recovery_waits_for_copies_only(self, ring):
    return (ring.copy_stream,)


def _wave_without_agreement(self, request):
    with __import__("torch").inference_mode():
        return self.pipeline(**request)


def _buffers_left_uninitialized() -> Any:
    """load_safetensors that leaves non-persistent buffers as torch.empty left them (zeros
    here), as a to_empty() loader that forgets to save and restore them does."""
    from offload_ref import loading

    def wipe(others, kept):
        for slot in others:
            slot.tensor.data.zero_()
        return []

    return _patched(loading, "_restore_non_persistent", wipe)


def _wave_runner_without_agreement() -> Any:
    from offload_ref.distributed import waves

    return _patched(waves.WaveRunner, "run", _wave_without_agreement)


#: Exactly the checks each mutant fails (asserted by tests/test_mutants.py).
KILLS: dict[str, set[str]] = {
    "auto_ignores_budget": {"check_auto_mode_measured_peak_never_exceeds_the_budget"},
    "auto_head_over_budget": {"check_auto_mode_fills_the_budget_with_a_resident_head",
                              "check_auto_mode_measured_peak_never_exceeds_the_budget"},
    "auto_keeps_no_head": {"check_auto_mode_fills_the_budget_with_a_resident_head"},
    "delegated_unvalidated": {"check_sparse_buffer_is_rejected_before_mutation",
                              "check_cyclic_module_graph_is_rejected_before_mutation"},
    "split_threads_unguarded": {"check_second_thread_gets_a_clear_error_or_exact_output"},
    "interrupt_recovery_ignores_gathers": {
        "check_allgather_generation_after_an_interrupt_is_exact"},
    "skipped_rank_runs_alone": {"check_rank_whose_plan_is_skipped_makes_every_rank_raise"},
    "edits_unguarded": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change"},
    "head_streamed": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "head_hooked": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "head_not_predicted": {"check_resident_head_stays_put_unhooked_and_within_the_prediction"},
    "shard_not_zero_padded": {"check_allgather_shards_are_zero_padded"},
    "wrong_rank_shard_gathered": {
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_distributed_cycles_restore_every_rank",
    },
    "no_wait_between_gather_and_compute": {  # the generation and disable raise StreamOrderError
        "check_allgather_generation_after_an_interrupt_is_exact",
        "check_allgather_outputs_match_each_ranks_reference",
        "check_allgather_host_bytes_per_rank_are_one_over_world",
        "check_allgather_keeps_two_slots_per_rank",
        "check_allgather_shards_are_zero_padded",
        "check_distributed_cycles_restore_every_rank",
        "check_no_collective_at_enable",
    },
    "eager_collective_at_enable": {  # and rank 0's eager gather is never matched by failed rank 1
        "check_no_collective_at_enable",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
    "unequal_wave_steps_accepted": {
        "check_wave_with_unequal_steps_is_rejected_before_any_collective",
    },
    "mmap_drops_non_persistent_buffers": {
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
    "rank_local_rings_gather": {  # rank-local mode is what the mmap scenario streams too
        "check_rank_local_outputs_match_each_ranks_reference",
        "check_mmap_loaded_weights_keep_non_persistent_buffers",
    },
    "failed_rank_leaves_the_others_waiting": {
        "check_rank_whose_plan_is_skipped_makes_every_rank_raise",
        "check_failed_rank_makes_every_rank_raise_naming_it",
    },
    "rollback_leaks_host_masters": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
    },
    "inference_tensors_rebound_as_normal": {
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    "inference_tensors_rebound_as_normal_layerwise": {
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    "double_copy_on_swap": {
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
    "silently_serial": {
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
    "stats_count_host_as_device": {
        "check_stats_match_what_the_platform_saw",
    },
    "rollback_leaks_device_memory": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
    "enable_error_loses_cause": {
        "check_failed_enable_releases_memory_and_chains_the_cause",
    },
    "disable_not_idempotent": {
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_second_disable_is_a_noop",
    },
    "impure_resolver": {
        "check_plan_resolution_is_pure",
    },
    "unstable_resolver": {
        "check_plan_resolution_is_repeatable",
    },
    "class_attrs_beat_plan": {
        "check_missing_block_container_is_rejected",
        "check_plan_block_attrs_beat_class_attributes",
        "check_single_block_dit_is_rejected",
    },
    "scan_despite_declarations": {
        "check_declared_components_beat_attribute_scan",
    },
    "warns_every_time": {
        "check_attribute_scan_warns_once_per_pipeline_class",
    },
    "no_dotted_paths": {
        "check_dotted_paths_resolve_nested_components",
    },
    "swallows_topology_errors": {
        "check_block_claimed_by_two_components_is_rejected",
        "check_encoder_allgather_requires_declared_replication",
        "check_missing_block_container_is_rejected",
        "check_model_level_without_dit_is_rejected",
        "check_model_level_without_encoder_is_rejected",
        "check_on_demand_component_without_lifecycle_is_rejected",
        "check_resident_inside_a_streamed_block_is_rejected",
        "check_resident_layers_leaving_one_streaming_block_are_rejected",
        "check_resident_layers_need_a_resident_dit_path",
        "check_single_block_dit_is_rejected",
        "check_tensor_in_two_model_level_groups_is_rejected",
        "check_vae_selection_without_lifecycle_is_rejected",
    },
    "vague_topology_errors": {
        "check_block_claimed_by_two_components_is_rejected",
        "check_encoder_allgather_requires_declared_replication",
        "check_missing_block_container_is_rejected",
        "check_model_level_without_dit_is_rejected",
        "check_model_level_without_encoder_is_rejected",
        "check_on_demand_component_without_lifecycle_is_rejected",
        "check_resident_inside_a_streamed_block_is_rejected",
        "check_resident_layers_leaving_one_streaming_block_are_rejected",
        "check_resident_layers_need_a_resident_dit_path",
        "check_single_block_dit_is_rejected",
        "check_tensor_in_two_model_level_groups_is_rejected",
        "check_vae_selection_without_lifecycle_is_rejected",
    },
    "legacy_is_strict": {
        "check_legacy_topology_without_dit_is_a_recorded_noop",
    },
    "resident_in_block_accepted": {
        "check_resident_inside_a_streamed_block_is_rejected",
    },
    "shared_storage_accepted": {
        "check_tensor_in_two_model_level_groups_is_rejected",
    },
    "vae_selection_without_lifecycle": {  # the on-demand lifecycle goes unchecked as well
        "check_on_demand_component_without_lifecycle_is_rejected",
        "check_vae_selection_without_lifecycle_is_rejected",
    },
    "sparse_buffer_accepted": {
        "check_sparse_buffer_is_rejected_before_mutation",
    },
    "cyclic_graph_unchecked": {
        "check_cyclic_module_graph_is_rejected_before_mutation",
    },
    "nested_resident_swaps_with_its_dit": {
        "check_model_level_keeps_one_group_resident",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
    },
    "name_based_aliases": {
        "check_tensors_aliasing_a_block_belong_to_its_ring",
    },
    "rollback_misses_a_hook": {
        "check_failed_enable_can_be_retried",
        "check_failed_enable_restores_the_pipeline",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
    "hook_left_after_disable": {
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_enable_disable_cycles_match_the_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
    "two_groups_resident": {
        "check_model_level_keeps_one_group_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
    "vae_offloaded": {
        "check_model_level_keeps_one_group_resident",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_peak_device_bytes_stay_within_the_plan_bound",
        "check_second_enable_changes_nothing_observable",
    },
    "d2h_copy_on_swap": {
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_stats_match_what_the_platform_saw",
    },
    "disable_forgets_placement": {
        "check_cycles_do_not_grow_memory",
        "check_disable_restores_parameters_and_placement",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_views_keep_strides_and_sharing",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
    "delegation_without_disable": {
        "check_split_model_failed_enable_calls_disable",
    },
    "delegation_drops_components": {
        "check_split_model_enable_and_disable_are_delegated",
        "check_split_model_keeps_exactly_one_component_resident",
    },
    "split_keeps_both_resident": {
        "check_split_model_keeps_exactly_one_component_resident",
    },
    "split_accepts_unknown_names": {
        "check_split_model_rejects_unknown_component",
    },
    "split_copies_when_disabled": {
        "check_split_model_context_is_a_noop_when_offload_is_off",
    },
    "reasoner_every_step": {
        "check_split_model_runs_reasoner_once_and_generator_every_step",
    },
    "missing_ready_wait": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_block_alias_follows_its_block",
        "check_offloaded_tensors_keep_their_alignment",
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_disable_restores_parameters_and_placement",
        "check_enable_disable_cycles_match_the_reference",
        "check_failed_enable_can_be_retried",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
        "check_layerwise_streams_every_block_of_every_ring",
        "check_offloaded_output_matches_reference_bitwise",
        "check_offloaded_output_matches_reference_without_race_amplifier",
        "check_parameter_shared_by_two_blocks_is_never_copied_twice",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_second_enable_is_idempotent_and_exclusive",
        "check_skipped_block_is_recovered",
        "check_stats_match_what_the_platform_saw",
        "check_views_keep_strides_and_sharing",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_peak_device_bytes_stay_within_the_plan_bound",
        "check_second_enable_changes_nothing_observable",
    },
    "slot_reused_before_free": set(),  # the same checks as missing_ready_wait (below)
    "no_wraparound_prefetch": {
        "check_layerwise_materializes_only_block_zero_between_passes",
        "check_layerwise_prefetches_the_next_block_before_it_runs",
    },
    "alias_placed_as_non_block_state": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_block_alias_follows_its_block",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
    "tied_parameter_two_masters": {
        "check_parameter_shared_by_two_blocks_is_never_copied_twice",
    },
    "skipped_block_not_recovered": {
        "check_skipped_block_is_recovered",
    },
    "packs_without_padding": {
        "check_offloaded_tensors_keep_their_alignment",
    },
    "realigns_every_tensor": {
        "check_offloaded_tensors_keep_their_alignment",
    },
    "edit_weights_in_place_layerwise": {
        "check_edit_weights_round_trip_takes_effect_exactly",
    },
    "edit_weights_in_place_model_level": {
        "check_edit_weights_round_trip_takes_effect_exactly",
    },
    "state_dict_returns_placeholders": {
        "check_state_dict_while_enabled_returns_true_weights",
    },
    "backward_not_refused": {
        "check_backward_is_exact_or_refused_at_forward",
    },
    "data_edits_unguarded_layerwise": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edits_through_data_are_exact_or_refused",
        "check_reads_through_data_are_true_or_refused",  # no guard, so no read guard either
    },
    "data_edits_unguarded_model_level": {
        "check_edits_through_data_are_exact_or_refused",
    },
    "reads_between_forwards_allowed": {
        "check_reads_through_data_are_true_or_refused",
    },
    "frozen_backward_not_refused": {
        "check_backward_is_exact_or_refused_at_forward",
    },
    "concurrent_calls_unguarded": {
        "check_second_thread_gets_a_clear_error_or_exact_output",
    },
    "copies_not_refused": {
        "check_copies_of_an_enabled_pipeline_are_refused_or_exact",
    },
    "interrupted_block_stays_running": {
        "check_interrupt_inside_a_block_leaves_a_recoverable_ring",
    },
    "three_slots": {
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_stats_match_what_the_platform_saw",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
}

KILLS.update({
    "simple_leaves_a_hook": {
        "check_disable_removes_every_trace",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_second_enable_changes_nothing_observable",
    },
    "simple_keeps_everything": {"check_peak_device_bytes_stay_within_the_plan_bound"},
    "simple_copies_ties_apart": {"check_shared_storage_stays_shared_while_enabled"},
    "simple_forgets_a_device": {
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_generation_after_an_interrupt_is_exact",
        "check_second_enable_changes_nothing_observable",
    },
    "simple_first_snapshot": {
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edit_between_cycles_takes_effect_and_survives_disable",
        "check_edits_through_data_are_exact_or_refused",
    },
    "simple_no_rollback": {"check_enable_failing_part_way_leaves_the_pipeline_as_it_was"},
    "simple_stacks_hooks": {"check_second_enable_changes_nothing_observable"},
    "simple_interrupt_leak": {"check_generation_after_an_interrupt_is_exact"},
})

# A slot race surfaces the same way whichever event wait is missing: the stream-order checker
# raises inside forward, so every check that runs a forward on a ring fails.
KILLS["slot_reused_before_free"] = set(KILLS["missing_ready_wait"])

# What one device hides: where host and device differ, a tensor the defect leaves on the wrong
# device meets the other device's tensors in the next forward and raises torch's same-device
# error, so every check that runs one fails too (Mutant.expected_kills).
PLACEMENT_KILLS: dict[str, set[str]] = {
    # A weight the broken offloader leaves on the device after disable meets host tensors in
    # the next un-offloaded generation.
    "simple_forgets_a_device": {
        "check_enable_disable_cycles_match_the_reference",
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
    # The VAE parked on the host between calls: the latents are made on the device, then meet a
    # host VAE; every check that generates under model level fails, not only the residency one.
    "vae_offloaded": {
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_disable_restores_parameters_and_placement",
        "check_enable_disable_cycles_match_the_reference",
        "check_failed_enable_can_be_retried",
        "check_model_level_swaps_move_component_bytes_host_to_device_only",
        "check_offloaded_output_matches_reference_bitwise",
        "check_offloaded_output_matches_reference_without_race_amplifier",
        "check_offloaded_tensors_keep_their_alignment",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_second_enable_is_idempotent_and_exclusive",
        "check_stats_match_what_the_platform_saw",
        "check_views_keep_strides_and_sharing",
    },
    # Tensors left on the device after disable: the un-offloaded run after it mixes devices.
    "disable_forgets_placement": {
        "check_enable_disable_cycles_match_the_reference",
    },
    # The split model enables every component: after its failed enable, host tensors come back
    # as views at another storage offset of the same bytes where host and device differ (on one
    # device the check passes).
    "delegation_drops_components": {
        "check_split_model_failed_enable_calls_disable",
    },
}

MUTANTS: tuple[Mutant, ...] = (
    # §A.8 (auto mode)
    _m("auto_ignores_budget", "strategy='auto' ignores device_budget_bytes: every weight stays "
       "resident", _AUTO, make_backend=_backend_with(AutoOffloadBackend=_BudgetBlindAuto)),
    _m("auto_head_over_budget", "strategy='auto' keeps one resident head block more than the "
       "budget allows", _HEAD, make_backend=_backend_with(AutoOffloadBackend=_HeadGreedyAuto)),
    _m("auto_keeps_no_head", "strategy='auto' never fills the budget left above layerwise's "
       "peak with a resident head", _HEAD,
       make_backend=_backend_with(AutoOffloadBackend=_HeadlessAuto)),
    _m("delegated_unvalidated", "a split model that delegates model level skips the input "
       "validation every other pipeline gets", _J7_SPLIT,
       resolve_offload_plan=_delegated_unvalidated),
    _m("split_threads_unguarded", "a split model's component groups let a second thread swap "
       "while the first runs", _SPLIT_THREADS, patch=_split_threads_unguarded),
    _m("edits_unguarded", "an in-place edit of every DiT weight between generations changes "
       "the resident ones and stops at the first streamed one", _MISUSE_LAYER,
       make_backend=_backend_with(LayerWiseOffloadBackend=_EditsUnguarded)),
    # §F.7 (a resident head)
    _layer_scoped("head_streamed", "the declared resident head streams through the ring",
                  _layerwise(_HeadStreamedRing), _HEAD),
    _layer_scoped("head_hooked", "the resident head blocks get hooks", _HooksTheHead, _HEAD),
    _layer_scoped("head_not_predicted", "the predicted peak counts the resident head as "
                  "streamed", _HeadUnpredicted, _HEAD),
    # §A
    _resolver("impure_resolver", "resolution writes an attribute on the pipeline", _impure),
    _resolver("unstable_resolver", "every second resolution lists components in another order",
              _unstable),
    _resolver("class_attrs_beat_plan", "_layerwise_offload_blocks_attrs wins over OffloadPlan",
              _class_attrs_win),
    _resolver("scan_despite_declarations",
              "the name scan runs even when components are declared", _scan_always),
    _resolver("warns_every_time", "the fallback-scan warning repeats for every resolution",
              _warn_every_time),
    _resolver("no_dotted_paths", "nested (dotted) components are dropped", _no_dotted_paths),
    _resolver("swallows_topology_errors", "invalid topologies are skipped instead of rejected",
              _swallow_topology_errors),
    _resolver("vague_topology_errors", "topology errors name no path and no fix",
              _vague_topology_errors),
    _resolver("legacy_is_strict", "legacy flags get the explicit, erroring topology rules",
              _legacy_as_explicit),
    _resolver("name_based_aliases", "the plan records no ring aliases", _no_ring_aliases),
    _resolver("resident_in_block_accepted",
              "a resident declared inside a streamed block silently streams with it",
              _resident_in_block_accepted),
    _resolver("shared_storage_accepted",
              "a storage in two model-level groups is left for enable to meet",
              _shared_storage_accepted),
    _resolver("vae_selection_without_lifecycle",
              "a selected VAE is handed to a lifecycle the pipeline never declared",
              _vae_without_lifecycle),
    # §J.7 (rejections the resolver owns)
    _m("sparse_buffer_accepted", "a sparse buffer reaches the storage walks", _J7,
       resolve_offload_plan=_sparse_accepted),
    _m("cyclic_graph_unchecked", "a cyclic module graph is walked without a cycle check", _J7,
       patch=_cycles_unchecked),
    # §B, §C, §F.1 (model level)
    _model_level("rollback_misses_a_hook", "a failed enable leaves one hook installed",
                 _RollbackMissesAHook),
    _model_level("rollback_leaks_device_memory", "a failed enable keeps its device allocations",
                 _RollbackLeaksDeviceMemory),
    _model_level("enable_error_loses_cause", "a failed enable re-raises without its cause",
                 _LosesTheCause),
    _model_level("disable_not_idempotent", "every disable call re-materializes the weights",
                 _DisableNotIdempotent),
    _model_level("rollback_leaks_host_masters", "a failed enable keeps its host masters",
                 _RollbackLeaksHostMasters),
    _model_level("inference_tensors_rebound_as_normal",
                 "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
                 _InferenceBlindModelLevel),
    _model_level("double_copy_on_swap", "every swap uploads the component twice",
                 _DoubleCopyOnSwap),
    _model_level("stats_count_host_as_device", "stats() adds host master bytes to device bytes",
                 _StatsCountHostAsDevice),
    _model_level("hook_left_after_disable", "disable forgets one hook", _LeavesAHook),
    _model_level("two_groups_resident", "a DiT runs with the encoders still on the device",
                 _TwoGroupsResident),
    _model_level("vae_offloaded", "the VAE is swapped like an encoder", _VaeOffloaded),
    _model_level("nested_resident_swaps_with_its_dit",
                 "a resident declared inside a DiT is swapped out with it",
                 _NestedResidentSwaps, _NESTED_RESIDENT),
    _model_level("d2h_copy_on_swap", "offloading copies the device weights back to the host",
                 _D2HOnSwap),
    _model_level("disable_forgets_placement",
                 "disable removes hooks but leaves tensors offloaded", _ForgetsPlacement),
    # §E (split models)
    _model_level("delegation_without_disable", "a failed split-model enable is not undone",
                 _DelegatesWithoutDisable, _SPLIT),
    _model_level("delegation_drops_components",
                 "the split model's enable gets no component selection",
                 _DelegationDropsComponents, _SPLIT),
    _m("split_keeps_both_resident", "a phase swap loads without evicting the other phase",
       _SPLIT, patch=_keeps_both_resident),
    _m("split_accepts_unknown_names", "an unknown component name is silently accepted",
       _SPLIT, patch=_unchecked_component_names),
    _m("split_copies_when_disabled", "a disabled phase context still copies weights", _SPLIT,
       patch=_copies_when_disabled),
    _m("reasoner_every_step", "the pipeline reruns its reasoner at every step", _SPLIT,
       factory=_cosmos3_reasoner_every_step),
    # §F.6 (alignment, every strategy)
    _m("packs_without_padding", "tensors are packed back to back, at element alignment only",
       _ALIGNMENT, patch=_packs_without_padding),
    _m("realigns_every_tensor", "a weight stored off a 64-byte boundary is moved onto one",
       _ALIGNMENT, patch=_realigns_every_tensor),
    # §J (misuse next to a generation)
    _m("edit_weights_in_place_layerwise", "edit_weights() does not re-read: edits hit the ring",
       _MISUSE_LAYER, make_backend=_backend_with(
           LayerWiseOffloadBackend=_editing_in_place(LayerWiseOffloadBackend))),
    _m("edit_weights_in_place_model_level",
       "edit_weights() does not re-read: edits hit masters and device copies", _MISUSE_MODEL,
       make_backend=_backend_with(
           ModelLevelOffloadBackend=_editing_in_place(ModelLevelOffloadBackend))),
    _layer_scoped("state_dict_returns_placeholders",
                  "state_dict() while enabled returns the NaN placeholders of streamed blocks",
                  _PlaceholderStateDict, _MISUSE_LAYER),
    _layer_scoped("data_edits_unguarded_layerwise",
                  "an edit through .data outside edit_weights() is dropped by the next block load",
                  _unguarded(LayerWiseOffloadBackend), _MISUSE_LAYER),
    _model_level("data_edits_unguarded_model_level",
                 "an edit through .data outside edit_weights() is dropped by the next swap",
                 _unguarded(ModelLevelOffloadBackend), _MISUSE_MODEL),
    _m("backward_not_refused", "a grad-mode forward through streamed blocks is not refused",
       _MISUSE_LAYER, patch=_backward_not_refused),
    _m("reads_between_forwards_allowed", "reading a streamed weight's .data between forwards "
       "gives its placeholder (diffusers' fuse_qkv_projections builds NaN projections from it)",
       _MISUSE_LAYER, patch=_reads_between_forwards_allowed),
    _m("frozen_backward_not_refused", "a grad-mode forward through frozen streamed weights "
       "with an input that requires grad is not refused (autograd saves the placeholders)",
       _MISUSE_LAYER, patch=_frozen_backward_not_refused),
    _m("concurrent_calls_unguarded", "a second thread runs the ring while the first is inside",
       _MISUSE_LAYER, patch=_unguarded_calls),
    _m("copies_not_refused", "copy.deepcopy of an enabled module copies its offload hooks",
       dict(pipelines=("flux2",), sections=("J.8",), strategies=("model_level", "layer_wise")),
       patch=_copies_not_refused),
    # §D, §F.2, §F.4 (layerwise)
    _layer("missing_ready_wait", "compute reads a slot without waiting for its copy",
           _layerwise(_NoReadyWait)),
    _layer("slot_reused_before_free", "a prefetch overwrites a slot before its reader finished",
           _layerwise(_NoFreeWait)),
    _layer("no_wraparound_prefetch", "the last block does not prefetch block 0",
           _layerwise(_NoWrapAround)),
    _layer("alias_placed_as_non_block_state",
           "an alias of a block tensor gets its own device copy", _NameBasedPlacement),
    _layer("tied_parameter_two_masters", "a weight shared by two blocks streams with each",
           _layerwise(_TwoMastersRing)),
    _layer("skipped_block_not_recovered", "a block that was not prefetched runs on stale weights",
           _layerwise(_NoRecoveryRing)),
    _layer("silently_serial", "no prefetch, and the synchronous loads are not counted",
           _layerwise(_SilentlySerialRing)),
    _layer("three_slots", "the ring keeps a third device slot", _layerwise(_ThreeSlotsRing)),
    # §J.1 (interrupts)
    _m("interrupted_block_stays_running",
       "a block interrupted by Ctrl-C stays running: its slot is never released",
       _INTERRUPTS, make_backend=_backend_with(
           LayerWiseOffloadBackend=_layerwise(_KeepsInterruptedBlocksRunning))),
    _layer("inference_tensors_rebound_as_normal_layerwise",
           "the .data of a pipeline's inference tensors is rebound to ordinary tensors",
           _InferenceBlindLayerwise),
    # §H (distributed layerwise, two spawned ranks)
    # nextstep: its blocks' images do not split into 64-byte aligned halves (flux2's do)
    _distributed("interrupt_recovery_ignores_gathers", "recovery after a Ctrl-C orders compute "
                 "after the copy stream only, while AllGather's last writer is the "
                 "communication stream", **{"AllGatherTransport.writers":
                                            _recovery_waits_for_copies_only}),
    _distributed("skipped_rank_runs_alone", "a rank whose plan is skipped runs un-offloaded "
                 "beside its offloaded peers", **{"DistributedLayerwiseOffloadBackend._resolve":
                                                  LayerWiseOffloadBackend._resolve}),
    _distributed("shard_not_zero_padded", "shard bytes past a block are left uninitialized",
                 scope=dict(_DISTRIBUTED, pipelines=("nextstep",)), **{"AllGatherTransport.build_master": _garbage_padding_build}),
    _distributed("wrong_rank_shard_gathered", "each rank keeps and gathers its neighbour's shard",
                 **{"AllGatherTransport.build_master": _wrong_rank_build}),
    _distributed("no_wait_between_gather_and_compute",
                 "the ready event is recorded after the shard copy, before the gather",
                 **{"AllGatherTransport.fill": _ready_on_copy_stream_fill}),
    _distributed("eager_collective_at_enable",
                 "enable prefetches block 0 with a collective, as a rank-local ring does",
                 **{"AllGatherTransport.collective": False}),
    _distributed("failed_rank_leaves_the_others_waiting",
                 "a rank whose enable fails does not tell the others (they wait for the timeout)",
                 **{"DistributedLayerwiseOffloadBackend._enable_failed": lambda self, exc: None}),
    _distributed("rank_local_rings_gather",
                 "weight_transfer='rank-local' is ignored: every ring gathers 1/world shards",
                 **{"DistributedLayerwiseOffloadBackend._transport_for": _gathers_rank_local_rings}),
    _m("unequal_wave_steps_accepted", "a DP wave runs without the ranks agreeing on its steps",
       _DISTRIBUTED, patch=_wave_runner_without_agreement),
    _m("mmap_drops_non_persistent_buffers",
       "mmap loading leaves non-persistent buffers uninitialized", _DISTRIBUTED,
       patch=_buffers_left_uninitialized),
    # Offloaders judged through the public protocol alone (any offloader's route)
    *(_protocol(name) for name in ("simple_leaves_a_hook", "simple_keeps_everything",
                                   "simple_copies_ties_apart", "simple_forgets_a_device",
                                   "simple_first_snapshot", "simple_no_rollback",
                                   "simple_stacks_hooks", "simple_interrupt_leak")),
)


def in_rank(name: str) -> tuple[Implementation, Any]:
    """The mutant ``name``'s implementation and patch context, in a spawned rank
    (``Implementation.in_rank``)."""
    mutant = next(m for m in MUTANTS if m.name == name)
    return mutant.impl, (mutant.patch() if mutant.patch else contextlib.nullcontext())
