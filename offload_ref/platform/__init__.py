"""Platforms: the streams, events, device storage and pinning the offloader runs on.

:func:`get_platform` returns the process-wide default platform of a device; construct
:class:`CpuPlatform` or :class:`CudaPlatform` directly for a private one (tests that close it, a
race amplifier with another seed).
"""

from __future__ import annotations

import threading

import torch

from offload_ref.platform.accelerator import AcceleratorPlatform, describe_device
from offload_ref.platform.base import Event, Platform, Stream, StreamOrderError
from offload_ref.platform.cpu import CpuPlatform
from offload_ref.platform.inline import InlinePlatform
from offload_ref.platform.cuda import CudaPlatform

__all__ = [
    "AcceleratorPlatform",
    "CpuPlatform",
    "CudaPlatform",
    "InlinePlatform",
    "Event",
    "Platform",
    "Stream",
    "StreamOrderError",
    "describe_device",
    "get_platform",
]

_ACCEPTED = '"cpu", "cuda", "cuda:N", "hpu", "hpu:N" (the simulated accelerator), or another torch accelerator'
_defaults: dict[tuple[str, bool], Platform] = {}
_defaults_lock = threading.Lock()


def _normalize(device: str | torch.device | None) -> torch.device:
    """The device a request names, with an accelerator's index resolved (so "cuda" and "cuda:0"
    share a platform when device 0 is current)."""
    if device is None:  # CUDA's current device when there is one (cached under its index)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"get_platform: device must be None, a str or a torch.device, got "
            f"{type(device).__name__}"
        )
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(
            f"get_platform: unknown device {device!r}; accepted: {_ACCEPTED}"
        ) from exc
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "hpu":
        from offload_ref.platform import simulated

        try:
            simulated.load()
        except simulated.SimulatedAcceleratorUnavailable as exc:
            raise RuntimeError(
                f"get_platform: {str(device)!r} names offload-ref's simulated accelerator, which "
                f"is not available here: {exc}") from exc
        return torch.device("hpu", 0 if parsed.index is None else parsed.index)
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"get_platform: device {str(device)!r} requested but CUDA is not available "
                f"(torch.cuda.is_available() is False); use \"cpu\" or a CUDA build of torch"
            )
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
        return parsed
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != parsed.type:
        raise ValueError(
            f"get_platform: unsupported device type {parsed.type!r} (from {str(device)!r}): it "
            f"is not torch's current accelerator; accepted: {_ACCEPTED}"
        )
    if parsed.index is None:
        parsed = torch.device(parsed.type, torch.accelerator.current_device_index())
    return parsed


def get_platform(
    device: str | torch.device | None = None, *, race_amplifier: bool = False
) -> Platform:
    """The process-wide default platform for ``device`` (None: CUDA when available, else CPU).

    ``"cpu"`` is the CPU platform (thread streams, stream-order checking), whose device storage
    lives on the simulated accelerator when it is available (Note [Device storage on the
    simulated accelerator] in cpu.py); ``"cuda"`` is :class:`CudaPlatform`; ``"hpu"`` and any
    other torch accelerator is :class:`AcceleratorPlatform`.  One instance per (device,
    race_amplifier), so that every component of a process shares the same streams and ledger.
    A closed cached CPU platform is replaced by a fresh one.  The race amplifier exists on the
    CPU platform only."""
    resolved = _normalize(device)
    if race_amplifier and resolved.type != "cpu":
        raise ValueError(
            f"get_platform: race_amplifier=True is only available on the CPU platform, not on "
            f"{str(resolved)!r}"
        )
    key = (str(resolved), race_amplifier)
    with _defaults_lock:
        platform = _defaults.get(key)
        if platform is None or (isinstance(platform, CpuPlatform) and platform.closed):
            if resolved.type == "cpu":
                platform = CpuPlatform(race_amplifier=race_amplifier)
            elif resolved.type == "cuda":
                platform = CudaPlatform(resolved)
            else:
                platform = AcceleratorPlatform(resolved)
            _defaults[key] = platform
        return platform
