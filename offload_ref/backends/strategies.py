"""Which backend class serves which strategy: the table below both the factory
(``get_offload_backend`` in ``__init__.py``) and the auto backend, which builds the strategy it picks
from the same table (so neither imports the other)."""

from __future__ import annotations

import importlib

from ..config import OffloadStrategy
from .base import OffloadBackend

__all__ = ["BACKENDS", "backend_class"]

#: strategy -> (module, class) of its backend.
BACKENDS: dict[OffloadStrategy, tuple[str, str]] = {
    OffloadStrategy.MODEL_LEVEL: (".model_level", "ModelLevelOffloadBackend"),
    OffloadStrategy.LAYER_WISE: (".layerwise", "LayerWiseOffloadBackend"),
    OffloadStrategy.DISTRIBUTED_LAYER_WISE: (".distributed", "DistributedLayerWiseOffloadBackend"),
}


def backend_class(strategy: OffloadStrategy) -> type[OffloadBackend]:
    """The backend class of ``strategy``, its module imported only now (a strategy nobody asks
    for costs no import)."""
    module, name = BACKENDS[strategy]
    return getattr(importlib.import_module(module, __package__), name)
