"""Mutants of enable's rollback (§B), enable/disable cycles (§C) and interrupt recovery (§J.1):
the checks they fail are mostly in checks/lifecycle.py."""

from __future__ import annotations

import weakref

from offload_ref.backends import OffloadEnableError
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.backends.transaction import Transaction


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


class _ForgetsPlacement(ModelLevelOffloadBackend):
    def _disable(self, pipeline):
        self.registry.remove_all()  # tensors stay where the offloader put them


class _KeepsInterruptedBlocksRunning(BlockRing):
    """Trusts the post-hook to end every forward: torch skips it for a KeyboardInterrupt, so the
    interrupted block stays running (holding its slot) forever."""

    def _recover(self, calling, finishing):
        if self._dirty:  # interrupted hook work is still repaired; a stale block is not seen
            super()._recover(calling, finishing)
