"""Where a CPU platform keeps its device storage (Note [Device storage on the simulated
accelerator] in cpu.py)."""

from __future__ import annotations

import torch

__all__ = ["storage_device"]


def storage_device(device: str | torch.device | None) -> torch.device:
    """Where a CPU platform keeps device storage: ``device`` when given (``"cpu"``, or a
    simulated accelerator device ``"hpu:N"``), else the simulated accelerator's ``hpu:0`` when it
    is available, else the CPU (Note [Device storage on the simulated accelerator])."""
    if device is None:
        from offload_ref.platform import simulated

        return simulated.device(0) if simulated.available() else torch.device("cpu")
    parsed = torch.device(device)
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "hpu":
        from offload_ref.platform import simulated

        simulated.load()  # raises, saying why, when it cannot be loaded
        return torch.device("hpu", parsed.index or 0)
    raise ValueError(
        f"CpuPlatform: device must be 'cpu' or a simulated accelerator device 'hpu:N', got "
        f"{str(device)!r}")
