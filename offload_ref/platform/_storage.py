"""Where a CPU platform keeps its device storage (Note [Device storage on the simulated
accelerator] in cpu.py)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["storage_device"]


def storage_device(device: str | torch.device | None) -> torch.device:
    """Where a CPU platform keeps device storage: ``device`` when given (``"cpu"``, or a
    simulated accelerator device ``"hpu:N"``), else the simulated accelerator's ``hpu:0`` when it
    is available, else the CPU (Note [Device storage on the simulated accelerator])."""
    from offload_ref.platform import simulated

    if device is None:
        if simulated.available():
            return simulated.device(0)
        _warn_single_device(simulated.unavailable_reason() or "")
        return torch.device("cpu")
    parsed = torch.device(device)
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "hpu":
        simulated.load()  # raises, saying why, when it cannot be loaded
        return torch.device("hpu", parsed.index or 0)
    raise ValueError(
        f"CpuPlatform: device must be 'cpu' or a simulated accelerator device 'hpu:N', got "
        f"{str(device)!r}")


_WARNED: list[str] = []  # the reason warned about (once per process)


def _warn_single_device(reason: str) -> None:
    """Say once that a CPU platform given no device runs single-device: host and device are both
    the CPU, so the placement guarantee (a host tensor meeting a device weight raises, as on a
    GPU) is gone, and nothing else would say so.  Not when ``OFFLOAD_REF_SIM=0`` asked for it."""
    if _WARNED or reason.startswith("OFFLOAD_REF_SIM=0"):
        return
    _WARNED.append(reason)
    package, level, frame = os.path.dirname(os.path.dirname(__file__)), 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        level, frame = level + 1, frame.f_back  # point at the caller outside offload_ref
    warnings.warn(
        f"offload-ref: host and device are both 'cpu', so a tensor left on the wrong device goes "
        f"unseen: the simulated accelerator is not available: {reason}.  "
        f"CpuPlatform(device='cpu') asks for this single-device mode without a warning",
        RuntimeWarning, stacklevel=level)
