"""Where the project's tests compute: host and device differ wherever the simulated accelerator
loads (docs/simulated-accelerator.md), as on a GPU.

Tests build pipelines on the host, as users do.  The un-offloaded reference is the whole
pipeline moved to :data:`DEVICE` (:func:`resident`), inputs a test feeds a module itself go to
:data:`DEVICE` (:func:`on_device`), and outputs are compared there, bit for bit.  Host-side
things (the backend's host masters, ``state_dict()`` of a disabled pipeline) stay on the host:
comparing them with a device tensor raises torch's same-device error, which is the point.
"""

from __future__ import annotations

from typing import Any

import torch

from offload_ref.contracts.case import kit_device, on_kit_device

__all__ = ["DEVICE", "SIMULATED", "host", "on_device", "resident"]

DEVICE: torch.device = kit_device()
SIMULATED: bool = DEVICE.type != "cpu"


def resident(pipeline: Any) -> Any:
    """``pipeline`` moved whole to :data:`DEVICE` in place (storage by storage, keeping address
    phases): the reference an offloaded run must match bit for bit."""
    return on_kit_device(pipeline)


def on_device(value: Any) -> Any:
    """``value`` with every tensor in it (nested in dicts, lists and tuples) copied to
    :data:`DEVICE`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE)
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    return value


def host(value: Any) -> Any:
    """``value`` with every tensor in it copied to the host (to compare with host tensors)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host(v) for v in value)
    return value
