"""What the conformance kit needs to know about a pipeline under test."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .calling import call_seeded, load_object
from .registry import strategy_names

__all__ = ["PipelineSpec", "load_object"]


def _seeded(ref: str | Callable[..., Any], seed: int) -> Any:
    """Call a factory or inputs reference for ``seed``: ``ref(seed=seed)``, or ``ref()`` under a
    seeded, restored RNG when it takes no arguments (as ``refs.without_seed`` does)."""
    return call_seeded(load_object(ref), seed, ref if isinstance(ref, str) else
                       f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', ref)}")


def _silence_progress_bars(pipeline: Any) -> None:
    """A diffusers pipeline draws a tqdm bar on stderr for every generation unless told not to;
    the kit runs hundreds of generations, and the bars would bury its report and progress line.
    Only the bar changes (diffusers' ``set_progress_bar_config(disable=True)``); a pipeline
    without that method, or whose setter fails, is left as built."""
    setter = getattr(pipeline, "set_progress_bar_config", None)
    if callable(setter):
        try:
            setter(disable=True)
        except Exception:  # noqa: BLE001 - a cosmetic setting never fails a case
            pass


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline under test.

    ``factory(seed=...)`` returns a fresh pipeline (an ``nn.Module``, or a plain object whose
    components are ``nn.Module`` attributes) on the host; ``inputs(seed=...)`` returns the keyword
    arguments of one generation; ``pipeline(**inputs)`` returns a tensor, or tensors in tuples,
    lists, mappings or dataclasses.  A factory or inputs taking no arguments at all is called
    under ``torch.manual_seed(seed)`` (the caller's RNG restored).  Both are ``"package.module:attr"`` references (so worker processes can
    import them) or callables (single-process checks only).  ``strategies`` lists the offload
    strategies the pipeline claims to support (strings or ``OffloadStrategy`` values, from
    ``registry.ALL_STRATEGIES``; an unknown name raises ``ValueError``).
    """

    name: str
    factory: str | Callable[..., Any]
    inputs: str | Callable[..., Any]
    strategies: tuple[str, ...] = ("model_level", "layer_wise")
    seed: int = 0
    description: str = ""
    tags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        strategies = strategy_names(self.strategies, f"PipelineSpec {self.name!r} strategies")
        object.__setattr__(self, "strategies", strategies)

    def build(self) -> Any:
        """A fresh pipeline from ``factory``, its progress bars off (``_silence_progress_bars``)."""
        pipeline = _seeded(self.factory, self.seed)
        _silence_progress_bars(pipeline)
        return pipeline

    def make_inputs(self) -> dict[str, Any]:
        return dict(_seeded(self.inputs, self.seed))

    def supports(self, strategy: Any) -> bool:
        return str(getattr(strategy, "value", strategy)) in self.strategies

    def __hash__(self) -> int:
        return hash((self.name, str(self.factory), str(self.inputs), self.strategies, self.seed))
