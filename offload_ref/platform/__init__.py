"""Platforms: the streams, events, device storage and pinning the offloader runs on.

:func:`get_platform` returns the process-wide default platform of a device; construct
:class:`CpuPlatform` or :class:`CudaPlatform` directly for a private one (tests that close it, a
race amplifier with another seed).
"""

from __future__ import annotations

import threading

import torch

from offload_ref.platform.base import Event, Platform, Stream, StreamOrderError
from offload_ref.platform.cpu import CpuPlatform
from offload_ref.platform.inline import InlinePlatform
from offload_ref.platform.cuda import CudaPlatform

__all__ = [
    "CpuPlatform",
    "CudaPlatform",
    "InlinePlatform",
    "Event",
    "Platform",
    "Stream",
    "StreamOrderError",
    "get_platform",
]

_ACCEPTED = '"cpu", "cuda", "cuda:N"'
_defaults: dict[tuple[str, bool], Platform] = {}
_defaults_lock = threading.Lock()


def _normalize(device: str | torch.device | None) -> torch.device:
    """The device a request names, with CUDA's index resolved (so "cuda" and "cuda:0" share a
    platform when device 0 is current)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    if parsed.type != "cuda":
        raise ValueError(
            f"get_platform: unsupported device type {parsed.type!r} (from {str(device)!r}); "
            f"accepted: {_ACCEPTED}"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"get_platform: device {str(device)!r} requested but CUDA is not available "
            f"(torch.cuda.is_available() is False); use \"cpu\" or a CUDA build of torch"
        )
    if parsed.index is None:
        parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def get_platform(
    device: str | torch.device | None = None, *, race_amplifier: bool = False
) -> Platform:
    """The process-wide default platform for ``device`` (None: CUDA when available, else CPU).

    One instance per (device, race_amplifier), so that every component of a process shares the
    same streams and ledger.  A closed cached CPU platform is replaced by a fresh one.  The race
    amplifier exists on the CPU platform only."""
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
            else:
                platform = CudaPlatform(resolved)
            _defaults[key] = platform
        return platform
