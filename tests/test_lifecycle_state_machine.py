"""Random lifecycles of the model-level and layerwise backends (Hypothesis state machines).

Under test: any sequence of enable / disable / forward / component activation / repeated enable
or disable keeps the invariants of docs/architecture.md after every step --

* outputs equal the un-offloaded reference bit for bit, enabled or not;
* disabled: no ``_offload_ref*`` attribute, no offload hook, no device byte, the same parameter
  and buffer objects, the same torch hook counts as the freshly built pipeline;
* enabled, model-level: at most one swap group on the device (one DiT, or encoders only);
* enabled, layerwise: at most two materialized blocks per ring;
* enabled: ``stats().device_weight_bytes + device_padding_bytes`` is what the platform's ledger
  holds.

The pipeline and its reference output are built once per machine class (rebuilt only after a
failed example); each example gets a fresh ``CpuPlatform(race_amplifier=True)`` and backend, and
ends disabled.  No pytest fixtures: Hypothesis runs many examples per test function.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from offload_ref.contracts.facts import (
    hook_residue,
    offload_attributes,
    snapshot,
    storage_groups,
)
from offload_ref.fixtures import get_spec

from offload_ref.backends import get_offload_backend
from offload_ref.config import OffloadConfig, OffloadStrategy
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

_SETTINGS = settings(
    derandomize=True,
    database=None,
    max_examples=15,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _Shared:
    """What a machine class builds once: the pipeline, its inputs, reference and identities."""

    def __init__(self, spec_name: str) -> None:
        spec = get_spec(spec_name)
        self.inputs = spec.make_inputs()
        with torch.inference_mode():  # disabled the pipeline runs on the host, enabled on the device
            self.reference = spec.build()(**spec.make_inputs())
            self.device_reference = resident(spec.build())(**spec.make_inputs())
        self.pipeline = spec.build()
        self.pristine = snapshot(self.pipeline, values=True)
        self.sharing = storage_groups(self.pipeline)
        self.identities = {name: entry[0] for name, entry in self.pristine.tensors.items()}
        self.hook_counts = self.pristine.hooks


class _LifecycleMachine(RuleBasedStateMachine):
    SPEC: ClassVar[str]
    STRATEGY: ClassVar[OffloadStrategy]
    COMPONENTS: ClassVar[tuple[str, ...]]
    _shared: ClassVar[_Shared | None] = None

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls._shared is None:
            cls._shared = _Shared(cls.SPEC)
        self.shared = cls._shared
        self.pipeline = self.shared.pipeline
        self.platform = CpuPlatform(race_amplifier=True)
        config = OffloadConfig(strategy=self.STRATEGY, components=self.COMPONENTS)
        self.backend = get_offload_backend(config, platform=self.platform)
        assert self.backend is not None, f"no backend for {config}"
        self.ops: list[str] = []
        self._check_disabled("start of the example")  # the previous example left it clean

    @property
    def where(self) -> str:
        return f"{self.SPEC}/{self.STRATEGY.value} after {self.ops}"

    # -- rules ------------------------------------------------------------------------------------

    @rule(twice=st.booleans())
    def enable(self, twice: bool) -> None:
        self.ops.append("enable x2" if twice else "enable")
        self.backend.enable(self.pipeline)
        assert self.backend.is_enabled(), f"{self.where}: enable left the backend disabled"
        if twice:
            before = (self._hooks(), self._placement())
            self.backend.enable(self.pipeline)  # a no-op on the same pipeline
            assert self.backend.is_enabled()
            assert (self._hooks(), self._placement()) == before, (
                f"{self.where}: a second enable changed the hooks or the device placement")

    @rule(twice=st.booleans())
    def disable(self, twice: bool) -> None:
        self.ops.append("disable x2" if twice else "disable")
        self.backend.disable()
        assert not self.backend.is_enabled(), f"{self.where}: disable left the backend enabled"
        if twice:
            before = snapshot(self.pipeline)
            self.backend.disable()  # idempotent
            assert not self.backend.is_enabled()
            problems = before.diff(snapshot(self.pipeline))
            assert not problems, f"{self.where}: a second disable changed the pipeline: {problems}"
        self._after_disable()

    @rule()
    def forward(self) -> None:
        self.ops.append("forward")
        with torch.inference_mode():
            out = self.pipeline(**self.shared.inputs)
        want = (self.shared.device_reference if self.backend.is_enabled()
                else self.shared.reference)
        torch.testing.assert_close(
            out, want, rtol=0, atol=0,
            msg=lambda m: f"{self.where}: output differs from the un-offloaded reference: {m}")

    def _after_disable(self) -> None:
        """Strategy-specific checks of a disabled backend."""

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def offload_state_matches_the_lifecycle(self) -> None:
        if self.backend.is_enabled():
            self._check_enabled(self.where)
        else:
            self._check_disabled(self.where)

    def _check_disabled(self, where: str) -> None:
        residue = offload_attributes(self.pipeline) + hook_residue(self.pipeline)
        assert not residue, f"{where}: disabled pipeline keeps {residue}"
        allocated = self.platform.memory_allocated()
        assert allocated == 0, f"{where}: disabled backend holds {allocated} device bytes"
        now = snapshot(self.pipeline)
        changed = sorted(name for name, ident in self.shared.identities.items()
                         if now.tensors.get(name, (None,))[0] != ident)
        assert not changed and set(now.tensors) == set(self.shared.identities), (
            f"{where}: parameter/buffer objects replaced: {changed}")
        assert now.hooks == self.shared.hook_counts, f"{where}: torch hook counts changed"

    def _check_enabled(self, where: str) -> None:
        stats = self.backend.stats()
        held = stats.device_weight_bytes + stats.device_padding_bytes
        allocated = self.platform.memory_allocated()
        assert held == allocated, (
            f"{where}: stats() device weight + padding bytes = {held} but the platform holds "
            f"{allocated}")
        self._check_bound(where)

    def _check_bound(self, where: str) -> None:
        raise NotImplementedError

    def _hooks(self) -> list[str]:
        return hook_residue(self.pipeline)

    def _placement(self) -> Any:
        raise NotImplementedError

    def teardown(self) -> None:
        try:
            self.backend.disable()
            where = f"{self.where} + teardown disable"
            self._check_disabled(where)
            # Restored exactly (values, dtype, shape, stride, offset, sharing), on new storage.
            problems = self.shared.pristine.diff(snapshot(self.pipeline, values=True),
                                                 pointers=False)
            assert not problems, f"{where}: the pipeline is not restored: {problems[:5]}"
            sharing = storage_groups(self.pipeline)
            assert sharing == self.shared.sharing, (
                f"{where}: storage sharing {self.shared.sharing} -> {sharing}")
        except BaseException:
            type(self)._shared = None  # the next example must not inherit a damaged pipeline
            raise
        finally:
            self.platform.close()


class ModelLevelLifecycle(_LifecycleMachine):
    SPEC = "wan22_t2v"
    STRATEGY = OffloadStrategy.MODEL_LEVEL
    COMPONENTS = ("dit", "text_encoder")

    @precondition(lambda self: self.backend.is_enabled())
    @rule(data=st.data())
    def phase(self, data: st.DataObject) -> None:
        comp = data.draw(st.sampled_from(self.backend.plan.components), label="component")
        self.ops.append(f"phase {comp.path}")
        with self.backend.use_component(comp.path):
            self._check_enabled(f"{self.where} (inside)")
            loaded = self.backend.loaded_components()
            if comp.role in ("dit", "encoder"):
                assert comp.path in loaded, f"{self.where}: {comp.path} not loaded inside"

    def _after_disable(self) -> None:
        try:
            with self.backend.use_component("transformer"):
                pass
        except RuntimeError:
            return
        raise AssertionError(f"{self.where}: use_component on a disabled backend did not raise")

    def _roles(self) -> dict[str, str]:
        return {c.path: c.role for c in self.backend.plan.components}

    def _check_bound(self, where: str) -> None:
        roles = self._roles()
        loaded = self.backend.loaded_components()
        dits = [p for p in loaded if roles[p] == "dit"]
        encoders = [p for p in loaded if roles[p] == "encoder"]
        assert len(dits) <= 1, f"{where}: several DiTs on the device: {loaded}"
        assert not (dits and encoders), f"{where}: a DiT and encoders on the device: {loaded}"
        assert set(loaded) <= set(roles), loaded

    def _placement(self) -> Any:
        return self.backend.loaded_components(), self.platform.memory_allocated()


class LayerwiseLifecycle(_LifecycleMachine):
    SPEC = "nextstep"
    STRATEGY = OffloadStrategy.LAYER_WISE
    COMPONENTS = ("dit",)

    def _check_bound(self, where: str) -> None:
        rings = self.backend.materialized_blocks()
        assert rings, f"{where}: an enabled layerwise backend has no ring"
        for label, blocks in rings.items():
            assert len(blocks) <= 2, f"{where}: ring {label} has blocks {blocks} materialized"
            assert len(set(blocks)) == len(blocks)

    def _placement(self) -> Any:
        return self.backend.materialized_blocks(), self.platform.memory_allocated()


TestModelLevelLifecycle = ModelLevelLifecycle.TestCase
TestModelLevelLifecycle.settings = _SETTINGS
TestLayerwiseLifecycle = LayerwiseLifecycle.TestCase
TestLayerwiseLifecycle.settings = _SETTINGS
