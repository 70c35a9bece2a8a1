"""argparse types of ``offload-ref``'s options: a bad value is a usage error (exit 2, one
``error:`` line naming the option) before any work, never a traceback after it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

__all__ = ["count", "device", "output_path"]

#: the most torch threads an option accepts (torch.set_num_threads overflows far above it)
MAX_THREADS = 4096


def count(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An int from ``low`` to ``high`` (no upper bound when None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range (an int {bound})")
        return value
    parse.__name__ = "int"
    return parse


def output_path(text: str) -> str:
    """A file to write later: its folder must exist and be writable now (``-``: stdout)."""
    if text == "-":
        return text
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not "
                                         f"exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} is not "
                                         f"writable")
    return text


def device(text: str) -> str:
    """A torch device string of a type offload-ref runs on: cpu, cuda[:N], hpu[:N]."""
    import torch

    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda[:N], hpu[:N])"
                                         ) from None
    if parsed.type not in ("cpu", "cuda", "hpu"):
        raise argparse.ArgumentTypeError(f"{text!r}: offload-ref runs on cpu, cuda[:N] and hpu[:N] "
                                         f"(the simulated accelerator), not {parsed.type}")
    return text
