"""Split-model mutants (§E): defects in the shared helper, the delegation, the pipeline; the
checks they fail are in checks/split.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from offload_ref.backends.groups import ComponentSwapper
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.split import ComponentGroups

from ._declare import SPLIT, backend_with, declare


class _DelegatesWithoutDisable(ModelLevelOffloadBackend):
    def enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        pipeline.enable_omni_model_cpu_offload(
            device=self.platform.device, pin_memory=self.config.pin_memory,
            components=self.config.components, platform=self.platform)


declare(
    "delegation_without_disable", "a failed split-model enable is not undone", SPLIT,
    make_backend=backend_with(ModelLevelOffloadBackend=_DelegatesWithoutDisable),
    kills={"check_split_model_failed_enable_calls_disable"},
)


def _cosmos3_with(groups_class: type[ComponentGroups]) -> Callable[..., Any]:
    """A cosmos3 factory whose transformer's ComponentGroups is ``groups_class``: a defect in the
    shared helper, through its seams (the split mutants here and in misuse.py)."""

    def build(seed: int = 0) -> Any:
        from offload_ref.fixtures.cosmos3 import build_pipeline

        return build_pipeline(seed, groups_class=groups_class)

    return build


class _UncheckedNames(ComponentGroups):
    def check_name(self, name: str) -> None:
        pass


declare(
    "split_accepts_unknown_names", "an unknown component name is silently accepted", SPLIT,
    factory=_cosmos3_with(_UncheckedNames),
    kills={"check_split_model_rejects_unknown_component"},
)


class _CopiesWhenDisabled(ComponentGroups):
    def activated(self, name: str) -> Any:
        if not self.enabled:  # a "defensive copy" of the phase's weights
            for module in self.members(name):
                for p in module.parameters():
                    p.data = p.data.clone()
        return super().activated(name)


declare(
    "split_copies_when_disabled", "a disabled phase context still copies weights", SPLIT,
    factory=_cosmos3_with(_CopiesWhenDisabled),
    kills={"check_split_model_context_is_a_noop_when_offload_is_off"},
)


class _LoadsWithoutEvicting(ComponentSwapper):
    def activate(self, label: str | None, evict: Iterable[str]) -> None:
        super().activate(label, [])


class _KeepsBothResident(ComponentGroups):
    swapper_class = _LoadsWithoutEvicting


declare(
    "split_keeps_both_resident", "a phase swap loads without evicting the other phase", SPLIT,
    factory=_cosmos3_with(_KeepsBothResident),
    kills={"check_split_model_keeps_exactly_one_component_resident"},
)


class _DelegationDropsComponents(ModelLevelOffloadBackend):
    def enable_delegated(self, pipeline, txn):
        txn.step("delegate")
        txn.on_rollback(pipeline.disable_omni_model_cpu_offload)
        pipeline.enable_omni_model_cpu_offload(device=self.platform.device,
                                               pin_memory=self.config.pin_memory)


declare(
    "delegation_drops_components", "the split model's enable gets no component selection", SPLIT,
    make_backend=backend_with(ModelLevelOffloadBackend=_DelegationDropsComponents),
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
