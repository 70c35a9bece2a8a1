"""``strategy="auto"``: resolve the choice at enable (it depends on the pipeline), then hand the
pipeline to the chosen strategy's backend.

Note [Auto backend]
    ``enable`` resolves the auto plan (``offload_ref.plan``, Note [Auto mode]): pure, so a budget
    nothing fits raises OffloadTopologyError before any mutation.  It then builds the chosen
    strategy's backend (``delegate``) on the same platform and enables it; that backend owns the
    pipeline, so ``backend_of(pipeline)`` is ``delegate`` and its transactional enable, exact
    restore and stats are the chosen strategy's own.  ``disable``, ``stats``, ``edit_weights``
    and the rest go to ``delegate``; after ``disable`` the next ``enable`` chooses again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..config import OffloadConfig, OffloadStrategy
from ..plan import AutoCandidate, ResolvedOffloadPlan, resolve_offload_plan
from ..platform import Platform
from .base import OffloadBackend
from .stats import OffloadStats
from .strategies import backend_class

__all__ = ["AutoOffloadBackend"]


class AutoOffloadBackend(OffloadBackend):
    """See Note [Auto backend].

    Seams (a subclass may override): :meth:`choose`, the strategy ``enable`` hands the pipeline
    to (and the auto plan it recorded the choice in).
    """

    strategy = OffloadStrategy.AUTO
    hook_name = "offload_ref.auto"

    def __init__(self, config: OffloadConfig, platform: Platform, **options: Any) -> None:
        super().__init__(config, platform)
        self.options = options
        self.delegate: OffloadBackend | None = None
        self.chosen: AutoCandidate | None = None

    def choose(self, pipeline: Any) -> tuple[AutoCandidate, ResolvedOffloadPlan]:
        """Seam: the candidate the budget allows and the auto plan (``plan.auto`` records the
        choice); pure, so it raises before any mutation.  ``enable`` builds the candidate's
        backend with its ``config`` and ``resident_heads``."""
        plan = resolve_offload_plan(pipeline, self.config, alignment=self.platform.alignment)
        assert plan.auto is not None
        return plan.auto.picked, plan

    def enable(self, pipeline: Any) -> None:
        delegate = self.delegate
        if delegate is not None and delegate.is_enabled():
            if delegate.pipeline is pipeline:
                return
            raise RuntimeError(f"{type(self).__name__} is already enabled on another "
                               f"{type(delegate.pipeline).__name__}; call disable() first")
        chosen, plan = self.choose(pipeline)
        delegate = _backend_for(chosen.config, self.platform, self.options)
        delegate.resident_heads = chosen.resident_heads
        delegate.fault_injector = self.fault_injector
        delegate.enable(pipeline)  # transactional: a failure rolls everything back
        self.delegate, self.chosen, self.plan = delegate, chosen, plan
        self.skip_reason = delegate.skip_reason

    def disable(self) -> None:
        if self.delegate is not None:
            self.delegate.disable()

    def is_enabled(self) -> bool:
        return self.delegate is not None and self.delegate.is_enabled()

    @property
    def pipeline(self) -> Any:
        return self.delegate.pipeline if self.delegate is not None else None

    @property
    def last_steps(self) -> list[str]:
        return self.delegate.last_steps if self.delegate is not None else []

    @last_steps.setter
    def last_steps(self, value: list[str]) -> None:  # base __init__ sets it
        pass

    def stats(self) -> OffloadStats:
        if self.delegate is None or not self.delegate.is_enabled():
            return OffloadStats()
        return self.delegate.stats()

    @contextmanager
    def edit_weights(self) -> Iterator[Any]:
        if not self.is_enabled():
            raise RuntimeError(f"{type(self).__name__}.edit_weights: the backend is not enabled")
        with self.delegate.edit_weights() as pipeline:
            yield pipeline

    def __getattr__(self, name: str) -> Any:
        # The chosen backend's own API (use_component, materialized_blocks, rings, ...).
        delegate = self.__dict__.get("delegate")
        if delegate is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(delegate, name)

    def __repr__(self) -> str:
        chosen = f" -> {self.chosen.name}" if self.chosen is not None else ""
        state = "enabled" if self.is_enabled() else "disabled"
        return f"<{type(self).__name__}{chosen} {state} on {self.platform.name}>"


def _backend_for(config: OffloadConfig, platform: Platform, options: dict) -> OffloadBackend:
    if config.strategy is OffloadStrategy.NONE:
        from .resident import ResidentBackend

        return ResidentBackend(config, platform)
    return backend_class(config.strategy)(config, platform, **options)
