"""The inline platform: every stream runs its work on the issuing thread, and events are free.

A measuring instrument, not a debugging aid: it keeps the CPU platform's device ledger (so
residency and ``memory_allocated`` stay observable) but has no copy worker, no stream-order
checking and no race amplifier.  Work runs in issue order on one thread, so every event order is
trivially satisfied and there is nothing to check.  What an offloader costs on it is its own pure
Python work per call (hooks, predictor, rebinds, the calls into streams and events): the part of
its host overhead that also costs on CUDA, where streams and events are asynchronous calls into
the driver.  ``offload-ref bench`` reports ``layerwise.per_block_overhead_us`` on it.  Use
:class:`~offload_ref.platform.CpuPlatform` to test stream logic.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from offload_ref.platform.cpu import CpuPlatform

__all__ = ["InlinePlatform"]


class _InlineStream:
    """A stream whose work has run by the time it is issued."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<InlineStream {self.name!r}>"

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _InlineEvent:
    """An event that completes when recorded (everything issued before it has run)."""

    __slots__ = ("enable_timing", "time")

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        if self.enable_timing:
            self.time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _InlineEvent) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time: both events must be recorded with enable_timing=True")
        return (end.time - self.time) * 1000.0


class InlinePlatform(CpuPlatform):
    """The device storage of :class:`CpuPlatform` (its ledger; on the simulated accelerator
    where it loads, or on the CPU with ``device="cpu"``) with inline streams and free events;
    see the module docstring."""

    tracks_accesses = False  # record_use / discard are no-ops (nothing to check)

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__(race_amplifier=False, device=device)
        self._inline_compute = _InlineStream("compute")

    def __repr__(self) -> str:
        return f"InlinePlatform(device={str(self.device)!r}, closed={self._closed})"

    def Stream(self, name: str | None = None) -> _InlineStream:  # noqa: N802
        return _InlineStream(name or "copy")

    def Event(self, enable_timing: bool = False) -> _InlineEvent:  # noqa: N802
        return _InlineEvent(enable_timing)

    def current_stream(self) -> _InlineStream:
        return self._inline_compute

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        yield stream

    def synchronize(self) -> None:
        return None

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fill(self, stream: Any, after: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
             then: Any) -> None:
        for dst, src in pairs:
            dst.copy_(src)
        if then.enable_timing:  # an untimed inline event's record does nothing
            then.record(stream)

    def submit(self, fn: Callable[[], Any], *, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> None:
        fn()

    def record_use(self, tensor: torch.Tensor) -> None:
        return None

    def discard(self, tensor: torch.Tensor) -> None:
        return None

    def free(self, tensor: torch.Tensor) -> None:
        with self._lock:
            allocation = self._require_allocation(tensor, "free")
            del self._ledger[allocation.tensor.untyped_storage().data_ptr()]
            self._allocated -= allocation.nbytes
