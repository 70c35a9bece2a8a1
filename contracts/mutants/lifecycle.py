"""Mutants of enable's rollback (§B), enable/disable cycles (§C) and interrupt recovery (§J.1):
the checks they fail are mostly in checks/lifecycle.py."""

from __future__ import annotations

from offload_ref.backends import OffloadEnableError
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transaction import Transaction
from offload_ref.hooks import HookRegistry

from ._declare import INTERRUPTS, MODEL_LEVEL, backend_with, with_ring, declare


# -- §B, §C: rollback and cycles (model level) -----------------------------------------------------


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


declare(
    "rollback_misses_a_hook", "a failed enable leaves one hook installed", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_RollbackMissesAHook),
    kills={
        "check_failed_enable_can_be_retried",
        "check_failed_enable_restores_the_pipeline",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
)


class _LeavesAHook(ModelLevelOffloadBackend):
    def uninstall(self, pipeline):
        installed = self.registry.installed()
        self.swapper.restore()
        for module, name in installed[1:]:
            self.registry.remove_hook(module, name)
        # Forget the first hook: a fresh registry knows nothing of it, so no one removes it.
        self.registry = HookRegistry()


declare(
    "hook_left_after_disable", "disable forgets one hook", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_LeavesAHook),
    kills={
        "check_cycles_do_not_grow_memory",
        "check_disable_removes_every_trace",
        "check_enable_disable_cycles_match_the_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
)


class _LeakyTransaction(Transaction):
    def device_empty(self, label, numel, dtype):
        self.step(f"device alloc {label}")
        return self.platform.empty(numel, dtype)  # no undo: a failed enable keeps the bytes


class _RollbackLeaksDeviceMemory(ModelLevelOffloadBackend):
    transaction_class = _LeakyTransaction


declare(
    "rollback_leaks_device_memory", "a failed enable keeps its device allocations", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_RollbackLeaksDeviceMemory),
    kills={
        "check_failed_enable_releases_memory_and_chains_the_cause",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    },
)


class _LeakyHostTransaction(Transaction):
    def host_master(self, label, layout, pin):
        self.step(f"host master {label}")
        from offload_ref.host import HostMaster

        return HostMaster(layout, self.platform, pin=pin)  # no undo: masters outlive a rollback


class _RollbackLeaksHostMasters(ModelLevelOffloadBackend):
    transaction_class = _LeakyHostTransaction


declare(
    "rollback_leaks_host_masters", "a failed enable keeps its host masters", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_RollbackLeaksHostMasters),
    kills={"check_failed_enable_releases_memory_and_chains_the_cause"},
)


class _LosesTheCause(ModelLevelOffloadBackend):
    def enable(self, pipeline):
        try:
            super().enable(pipeline)
        except OffloadEnableError as exc:
            raise OffloadEnableError(str(exc)) from None


declare(
    "enable_error_loses_cause", "a failed enable re-raises without its cause", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_LosesTheCause),
    kills={"check_failed_enable_releases_memory_and_chains_the_cause"},
)


class _DisableNotIdempotent(ModelLevelOffloadBackend):
    def disable(self):
        pipeline = self.pipeline or self.__dict__.get("_kit_last")
        super().disable()
        if pipeline is not None:  # re-materializes on every call, enabled or not
            self.__dict__["_kit_last"] = pipeline
            for p in pipeline.parameters():
                p.data = p.data.clone()


declare(
    "disable_not_idempotent", "every disable call re-materializes the weights", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_DisableNotIdempotent),
    kills={
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_second_disable_is_a_noop",
    },
)


class _ForgetsPlacement(ModelLevelOffloadBackend):
    def uninstall(self, pipeline):
        self.registry.remove_all()  # tensors stay where the offloader put them


declare(
    "disable_forgets_placement", "disable removes hooks but leaves tensors offloaded", MODEL_LEVEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_ForgetsPlacement),
    kills={
        "check_cycles_do_not_grow_memory",
        "check_disable_restores_parameters_and_placement",
        "check_pipeline_built_under_inference_mode_matches_reference",
        "check_random_lifecycle_sequences_keep_invariants",
        "check_views_keep_strides_and_sharing",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_second_enable_changes_nothing_observable",
    },
    # Tensors left on the device after disable: the un-offloaded run after it mixes devices.
    placement_kills={"check_enable_disable_cycles_match_the_reference"},
)


# -- §J.1: interrupts ------------------------------------------------------------------------------


class _KeepsInterruptedBlocksRunning(BlockRing):
    """Trusts the post-hook to end every forward: torch skips it for a KeyboardInterrupt, so the
    interrupted block stays running (holding its slot) forever."""

    def recover(self, calling, finishing):
        if self.interrupted:  # interrupted hook work is still repaired; a stale block is not seen
            super().recover(calling, finishing)


declare(
    "interrupted_block_stays_running",
    "a block interrupted by Ctrl-C stays running: its slot is never released",
    INTERRUPTS,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_KeepsInterruptedBlocksRunning)),
    kills={"check_interrupt_inside_a_block_leaves_a_recoverable_ring"},
)
