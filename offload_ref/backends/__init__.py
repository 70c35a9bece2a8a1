"""Offload backends, one per strategy, and the factory above them.

The factory imports a strategy's module only when that strategy is asked for; the backends import
the shared leaf modules (``stats``, ``transaction``, ``groups``, ``ring``) and never each other.
"""

from __future__ import annotations

import importlib

import torch

from ..config import OffloadConfig, OffloadStrategy
from ..platform import Platform, get_platform
from .base import OffloadBackend, OffloadDisableError, OffloadEnableError, backend_of
from .stats import OffloadStats

__all__ = [
    "OffloadBackend",
    "OffloadDisableError",
    "OffloadEnableError",
    "OffloadStats",
    "backend_of",
    "get_offload_backend",
]

#: strategy -> (module, class) of its backend.
BACKENDS: dict[OffloadStrategy, tuple[str, str]] = {
    OffloadStrategy.MODEL_LEVEL: (".model_level", "ModelLevelOffloadBackend"),
    OffloadStrategy.LAYER_WISE: (".layerwise", "LayerWiseOffloadBackend"),
}


def get_offload_backend(
    config: OffloadConfig,
    device: str | torch.device | None = None,
    *,
    platform: Platform | None = None,
) -> OffloadBackend | None:
    """Exactly one backend for ``config``, or None when offloading is off.

    ``platform`` overrides the platform that ``device`` would select (tests pass a
    ``CpuPlatform(race_amplifier=True)``).  Nothing is installed until ``enable``.  A device
    that is not available (``"cuda"`` on a CPU-only torch) raises RuntimeError rather than
    silently running without offload; the distributed layerwise strategy raises
    NotImplementedError (its backend is not built yet).
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if config.strategy is OffloadStrategy.NONE:
        return None
    if platform is None:
        platform = get_platform(device)
    where = BACKENDS.get(config.strategy)
    if where is None:
        raise NotImplementedError(
            f"the {config.strategy.value} backend is not built yet in this version of offload-ref; "
            "use layer_wise (single process) meanwhile"
        )
    module, name = where
    return getattr(importlib.import_module(module, __name__), name)(config, platform)
