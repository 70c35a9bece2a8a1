"""Split-model mutants (§E): defects in the shared helper, the delegation, the pipeline; the
checks they fail are in checks/split.py."""

from __future__ import annotations

from typing import Any

from offload_ref.backends.model_level import ModelLevelOffloadBackend

from ._declare import _patched


class _DelegatesWithoutDisable(ModelLevelOffloadBackend):
    def _enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        pipeline.enable_omni_model_cpu_offload(
            device=self.platform.device, pin_memory=self.config.pin_memory,
            components=self.config.components, platform=self.platform)
        self._delegated = True


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
