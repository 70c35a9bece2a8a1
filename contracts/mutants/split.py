"""Split-model mutants (§E): defects in the shared helper, the delegation, the pipeline; the
checks they fail are in checks/split.py."""

from __future__ import annotations

from typing import Any

from offload_ref.backends.model_level import ModelLevelOffloadBackend

from ._declare import SPLIT, _backend_with, _patched, declare


class _DelegatesWithoutDisable(ModelLevelOffloadBackend):
    def _enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        pipeline.enable_omni_model_cpu_offload(
            device=self.platform.device, pin_memory=self.config.pin_memory,
            components=self.config.components, platform=self.platform)
        self._delegated = True


declare(
    "delegation_without_disable", "a failed split-model enable is not undone", SPLIT,
    make_backend=_backend_with(ModelLevelOffloadBackend=_DelegatesWithoutDisable),
    kills={"check_split_model_failed_enable_calls_disable"},
)


def _unchecked_component_names() -> Any:
    from offload_ref.split import ComponentGroups

    return _patched(ComponentGroups, "_check_name", lambda self, name: None)


declare(
    "split_accepts_unknown_names", "an unknown component name is silently accepted", SPLIT,
    patch=_unchecked_component_names,
    kills={"check_split_model_rejects_unknown_component"},
)


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


declare(
    "split_copies_when_disabled", "a disabled phase context still copies weights", SPLIT,
    patch=_copies_when_disabled,
    kills={"check_split_model_context_is_a_noop_when_offload_is_off"},
)


def _keeps_both_resident() -> Any:
    from offload_ref import split

    return _patched(split._Active, "activate",
                    lambda self, name: self.swapper.activate(name, []))


declare(
    "split_keeps_both_resident", "a phase swap loads without evicting the other phase", SPLIT,
    patch=_keeps_both_resident,
    kills={"check_split_model_keeps_exactly_one_component_resident"},
)


class _DelegationDropsComponents(ModelLevelOffloadBackend):
    def _enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        txn.on_rollback(pipeline.disable_omni_model_cpu_offload)
        pipeline.enable_omni_model_cpu_offload(device=self.platform.device,
                                               pin_memory=self.config.pin_memory)
        self._delegated = True


declare(
    "delegation_drops_components", "the split model's enable gets no component selection", SPLIT,
    make_backend=_backend_with(ModelLevelOffloadBackend=_DelegationDropsComponents),
    kills={
        "check_split_model_enable_and_disable_are_delegated",
        "check_split_model_keeps_exactly_one_component_resident",
    },
    # The split model enables every component: after its failed enable, host tensors come back
    # as views at another storage offset of the same bytes where host and device differ (on one
    # device the check passes).
    placement_kills={"check_split_model_failed_enable_calls_disable"},
)


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


declare(
    "reasoner_every_step", "the pipeline reruns its reasoner at every step", SPLIT,
    factory=_cosmos3_reasoner_every_step,
    kills={"check_split_model_runs_reasoner_once_and_generator_every_step"},
)
