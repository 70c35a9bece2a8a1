"""Offload topology: what a model declares (:class:`OffloadPlan`) and what the offloader will do
(:class:`ResolvedOffloadPlan`, from the pure :func:`resolve_offload_plan`).

Note [Resolution is pure]
    ``resolve_offload_plan`` moves no tensor, installs no hook, writes no attribute and reads no
    process group: multi-rank facts come from :class:`OffloadConfig`.  Every topology error is
    raised here, so a pipeline the offloader cannot serve is rejected before its first component
    is placed.  Backends consume the resolved plan alone; they never rediscover containers by name.

The package, one file per concept (a submodule imports only those above it in this list):

* ``declarations.py``: :class:`OffloadPlan`, :class:`OffloadTopologyError`, and what the
  declarations alone imply (:func:`encoder_kind`, :func:`selectable_components`);
* ``tree.py``: walks of module trees (:func:`named_tensors`, :func:`pipeline_state`, storage
  keys);
* ``resolved.py``: the resolved types (:class:`ResolvedOffloadPlan`, :class:`ResolvedComponent`
  and its :class:`ComponentRole`, :class:`RingPlan`, :class:`RingAlias`, :class:`AutoCandidate`,
  :class:`AutoChoice`) and the tensors a component owns (:func:`owned_tensors`);
* ``prediction.py``: byte arithmetic (the predicted peak device bytes, slots, shards, staging);
* ``ownership.py``: ring aliases and shared tensors (Note [Ownership by identity]);
* ``resolver.py``: :class:`Resolver`, every topology check (a subclass may override its named
  rules: the seams its docstring lists);
* ``auto.py``: ``strategy="auto"`` (Note [Auto mode]);
* this file: :func:`resolve_offload_plan`, the entry point, and the names other modules import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import OffloadConfig, OffloadStrategy
from ..host import ALLOCATOR_ALIGNMENT
from .auto import (
    _resolve_auto,
    auto_candidates,
    choose_auto,
    head_candidates,
    resident_plan,
    resident_state,
    resolve_candidate,
)
from .declarations import (
    OffloadPlan,
    OffloadTopologyError,
    _head_map,
    encoder_kind,
    selectable_components,
)
from .prediction import (host_allocations, predict_device_bytes, predict_host_bytes, shard_bytes,
                         staging_budget_error)
from .resolved import (
    AutoCandidate,
    AutoChoice,
    BlockStack,
    ComponentRole,
    ResolvedComponent,
    ResolvedOffloadPlan,
    RingAlias,
    RingPlan,
    owned_tensors,
)
from .resolver import Resolver
from .tree import _tensors, named_tensors, pipeline_state

__all__ = [
    "AutoCandidate",
    "AutoChoice",
    "BlockStack",
    "ComponentRole",
    "OffloadPlan",
    "OffloadTopologyError",
    "ResolvedComponent",
    "ResolvedOffloadPlan",
    "Resolver",
    "RingAlias",
    "RingPlan",
    "auto_candidates",
    "encoder_kind",
    "head_candidates",
    "named_tensors",
    "owned_tensors",
    "pipeline_state",
    "host_allocations",
    "predict_device_bytes",
    "predict_host_bytes",
    "resolve_offload_plan",
    "staging_budget_error",
    "selectable_components",
]


def resolve_offload_plan(pipeline: Any, config: OffloadConfig, *,
                         alignment: int = ALLOCATOR_ALIGNMENT,
                         resident_heads: Mapping[str, int] | None = None,
                         prefetch_depth: int = 1) -> ResolvedOffloadPlan:
    """Resolve ``pipeline``'s topology for ``config``.  Pure; see Note [Resolution is pure].

    ``alignment`` is the platform's (``Platform.alignment``: 64 bytes on CPU, 256 on CUDA); it
    only enters the predicted peak device bytes (Note [Aligned layout] in host.py).
    ``resident_heads`` (plain layerwise only; DiT path -> leading blocks kept on the device)
    replaces the model's ``OffloadPlan.layerwise_resident_layers``: auto mode passes the head it
    chose (a DiT it does not name keeps no head).  ``prefetch_depth`` (plain layerwise only):
    blocks each ring copies ahead of the running one, so each ring has ``prefetch_depth + 1``
    slots (Note [Prefetch depth] in backends/ring.py)."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two (bytes), got {alignment!r}")
    if type(prefetch_depth) is not int or prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
    if prefetch_depth != 1 and config.strategy is not OffloadStrategy.LAYER_WISE:
        raise ValueError(
            f"prefetch_depth={prefetch_depth} applies to strategy 'layer_wise' only (the "
            f"distributed rings keep two slots per rank: Note [Collective safety]); got strategy "
            f"{config.strategy.value!r}: leave prefetch_depth at 1")
    if config.strategy is OffloadStrategy.AUTO:
        return _resolve_auto(pipeline, config, alignment)
    if resident_heads is not None:
        resident_heads = _head_map(resident_heads)
    return Resolver(pipeline, config, alignment, resident_heads, prefetch_depth).resolve()
