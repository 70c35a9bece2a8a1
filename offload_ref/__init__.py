"""offload-ref: a reference implementation of CPU offloading for diffusion pipelines.

Imports are lazy (PEP 562) so that ``import offload_ref.contracts.plugin`` (pytest's plugin
loading) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ComponentGroups",
    "HookRegistry",
    "HostBudgetError",
    "LayerOptions",
    "LoadReport",
    "ModelHook",
    "MappedFileChangedError",
    "OffloadAutogradError",
    "OffloadBackend",
    "OffloadConcurrencyError",
    "OffloadConfig",
    "OffloadEnableError",
    "OffloadPlan",
    "OffloadScheduleError",
    "OffloadStats",
    "OffloadStrategy",
    "OffloadTopologyError",
    "ResolvedOffloadPlan",
    "SupportsComponentDiscovery",
    "SupportsModelCpuOffload",
    "OffloadWeightEditError",
    "WeightTransfer",
    "anonymous_rss_bytes",
    "backend_of",
    "execution_device",
    "get_offload_backend",
    "is_file_backed",
    "load_safetensors",
    "resolve_offload_plan",
]

_WHERE = {
    "OffloadConfig": ".config",
    "OffloadStrategy": ".config",
    "LayerOptions": ".config",
    "WeightTransfer": ".config",
    "SupportsComponentDiscovery": ".discovery",
    "SupportsModelCpuOffload": ".discovery",
    "OffloadPlan": ".plan",
    "OffloadTopologyError": ".plan",
    "ResolvedOffloadPlan": ".plan",
    "resolve_offload_plan": ".plan",
    "HookRegistry": ".hooks",
    "ModelHook": ".hooks",
    "HostBudgetError": ".host",
    "OffloadBackend": ".backends.base",
    "OffloadEnableError": ".backends.base",
    "OffloadStats": ".backends.stats",
    "get_offload_backend": ".backends",
    "backend_of": ".backends.base",
    "execution_device": ".backends.base",
    "OffloadAutogradError": ".backends.refusals",
    "OffloadConcurrencyError": ".backends.call_guard",
    "OffloadWeightEditError": ".backends.refusals",
    "OffloadScheduleError": ".backends.distributed",
    "ComponentGroups": ".split",
    "LoadReport": ".loading",
    "MappedFileChangedError": ".loading",
    "anonymous_rss_bytes": ".loading",
    "is_file_backed": ".loading",
    "load_safetensors": ".loading",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
