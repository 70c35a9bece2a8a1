"""What a check receives: the pipeline under test, the strategy, and the implementation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload_ref.config import OffloadConfig, OffloadStrategy
from offload_ref.plan import resolve_offload_plan, selectable_components
from offload_ref.platform import CpuPlatform

from .spec import PipelineSpec

__all__ = ["CheckCase", "Implementation", "DEFAULT_IMPLEMENTATION"]


def _make_backend(config: OffloadConfig, platform: Any) -> Any:
    from offload_ref.backends import get_offload_backend

    return get_offload_backend(config, platform=platform)


def _make_platform() -> Any:
    return CpuPlatform(race_amplifier=True)


@dataclass(frozen=True)
class Implementation:
    """The offloader under test.  The kit's own tests swap parts for deliberately broken ones
    (mutants) to prove that each check can fail."""

    name: str = "offload_ref"
    resolve_offload_plan: Callable[..., Any] = resolve_offload_plan
    config_from_od_config: Callable[[Any], OffloadConfig] = OffloadConfig.from_od_config
    config_from_mapping: Callable[..., OffloadConfig] = OffloadConfig.from_mapping
    make_backend: Callable[[OffloadConfig, Any], Any] = _make_backend
    make_platform: Callable[[], Any] = _make_platform

    def replace(self, **changes: Any) -> Implementation:
        return dataclasses.replace(self, **changes)


DEFAULT_IMPLEMENTATION = Implementation()


@dataclass
class CheckCase:
    """One (check, pipeline spec, strategy) instance.  Resources it creates are closed by
    :meth:`close` (the runner calls it)."""

    spec: PipelineSpec | None
    strategy: OffloadStrategy | None
    impl: Implementation = DEFAULT_IMPLEMENTATION
    _platforms: list[Any] = field(default_factory=list)
    _reference: Any = None
    _components: tuple[str, ...] | None = None

    # -- pipelines ------------------------------------------------------------------------------

    def build(self) -> Any:
        assert self.spec is not None, "a global check has no pipeline"
        return self.spec.build()

    def inputs(self) -> dict[str, Any]:
        assert self.spec is not None
        return self.spec.make_inputs()

    def run(self, pipeline: Any, inputs: dict[str, Any] | None = None) -> torch.Tensor:
        with torch.inference_mode():
            return pipeline(**(inputs if inputs is not None else self.inputs()))

    def reference(self) -> torch.Tensor:
        """The output of a fresh pipeline with no offloading (computed once per case)."""
        if self._reference is None:
            self._reference = self.run(self.build())
        return self._reference

    # -- offloader ------------------------------------------------------------------------------

    def config(self, **overrides: Any) -> OffloadConfig:
        """The explicit config of this case's strategy, selecting everything the pipeline can
        offload (``offload_ref.plan.selectable_components``)."""
        assert self.strategy is not None
        if self._components is None:
            self._components = selectable_components(self.build(), self.strategy)
        fields = {"strategy": self.strategy, "components": self._components}
        fields.update(overrides)
        return OffloadConfig(**fields)

    def resolve(self, pipeline: Any, config: OffloadConfig | None = None) -> Any:
        return self.impl.resolve_offload_plan(pipeline, config or self.config())

    def platform(self) -> Any:
        p = self.impl.make_platform()
        self._platforms.append(p)
        return p

    def backend(self, config: OffloadConfig | None = None, platform: Any = None) -> Any:
        platform = platform if platform is not None else self.platform()
        backend = self.impl.make_backend(config or self.config(), platform)
        if backend is None:
            raise AssertionError(f"no backend for {config or self.config()}")
        return backend

    def close(self) -> None:
        for p in self._platforms:
            close = getattr(p, "close", None)
            if close is not None:
                close()
        self._platforms.clear()

    @property
    def label(self) -> str:
        parts = [self.spec.name if self.spec else "-", str(self.strategy or "-")]
        return "/".join(parts)
