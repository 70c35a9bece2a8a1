"""Offload backends, one per strategy, and the factory above them.

The factory imports a strategy's module only when that strategy is asked for; the backends import
the shared leaf modules (``stats``, ``transaction``, ``groups``, ``ring``) and never each other.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import OffloadConfig, OffloadStrategy
from ..platform import Platform, get_platform
from .base import OffloadBackend, OffloadDisableError, OffloadEnableError, backend_of
from .stats import OffloadStats
from .strategies import BACKENDS, backend_class

__all__ = [
    "OffloadBackend",
    "OffloadDisableError",
    "OffloadEnableError",
    "OffloadStats",
    "backend_of",
    "get_offload_backend",
]

def get_offload_backend(
    config: OffloadConfig,
    device: str | torch.device | None = None,
    *,
    platform: Platform | None = None,
    **options: Any,
) -> OffloadBackend | None:
    """Exactly one backend for ``config``, or None when offloading is off.

    ``strategy="auto"`` gets an :class:`~offload_ref.backends.auto.AutoOffloadBackend`, which
    picks the strategy for the budget when it is enabled and hands the pipeline to that
    strategy's backend (Note [Auto backend] in auto.py).

    ``platform`` overrides the platform that ``device`` would select (tests pass a
    ``CpuPlatform(race_amplifier=True)``).  Nothing is installed until ``enable``.  A device
    that is not available (``"cuda"`` on a CPU-only torch) raises RuntimeError rather than
    silently running without offload.  ``options`` go to the backend's constructor (the
    distributed layerwise backend takes ``process_group`` and ``timeout_s``).

    ``device="cpu"`` keeps device storage on offload-ref's simulated accelerator (``hpu:0``,
    compiled on first use), so host and device differ as on a GPU: inputs go to
    :func:`offload_ref.execution_device`.  Where it cannot load, the run is host-only and a
    ``RuntimeWarning`` says why; ``platform=CpuPlatform(device="cpu")`` (or
    ``OFFLOAD_REF_SIM=0``) asks for a host-only run.
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if config.strategy is OffloadStrategy.NONE:
        return None
    if platform is None:
        platform = get_platform(device)
    if config.strategy is OffloadStrategy.AUTO:  # the choice depends on the pipeline: at enable
        from .auto import AutoOffloadBackend

        return AutoOffloadBackend(config, platform, **options)
    return backend_class(config.strategy)(config, platform, **options)
