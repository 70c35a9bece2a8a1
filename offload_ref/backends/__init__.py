"""Offload backends: one per strategy, all built on the transaction of :mod:`.base`."""

from .base import OffloadBackend, OffloadEnableError, OffloadStats, get_offload_backend

__all__ = ["OffloadBackend", "OffloadEnableError", "OffloadStats", "get_offload_backend"]
