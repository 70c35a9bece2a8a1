"""Layerwise steady state allocates nothing per block (issue 12): after warm-up, a forward of a
many-block DiT under layerwise offload creates exactly as many new tensor storages as the same
forward of the resident model (the model's own activations), on the CPU platform (copy worker)
and on the inline platform."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures.many_blocks import build_pipeline, make_input
from offload_ref.platform import CpuPlatform, InlinePlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

BLOCKS = 32


class _StorageCounter(TorchDispatchMode):
    """Counts op outputs whose storage is none of the op's inputs' (a real allocation: factory
    ops, and every non-view, non-in-place op), per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.numel()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                name = str(func)
                self.allocations[name] = self.allocations.get(name, 0) + 1
        return out

    @property
    def total(self) -> int:
        return sum(self.allocations.values())


def _count(fn) -> _StorageCounter:
    counter = _StorageCounter()
    with torch.inference_mode(), counter:
        fn()
    return counter


def _platform(name: str) -> CpuPlatform:
    return InlinePlatform() if name == "inline" else CpuPlatform()


@pytest.mark.parametrize("platform_name", ["cpu", "inline"])
def test_layerwise_steady_state_allocates_no_tensor_per_block(platform_name: str) -> None:
    # The resident model: the whole pipeline on the device the offloaded one computes on.
    whole, offloaded = resident(build_pipeline(0, BLOCKS)), build_pipeline(0, BLOCKS)
    x = make_input(0)
    platform = _platform(platform_name)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    backend.enable(offloaded)
    try:
        with torch.inference_mode():
            reference = whole(x)
            for _ in range(2):  # warm-up: first fills, placeholders, the predictor learns
                assert torch.equal(offloaded(x), reference)
        platform.synchronize()
        base = _count(lambda: whole(x))
        counted = _count(lambda: (offloaded(x), platform.synchronize()))
        extra = {op: n - base.allocations.get(op, 0) for op, n in counted.allocations.items()
                 if n != base.allocations.get(op, 0)}
        assert base.total >= BLOCKS  # the counter sees the model's own activations
        assert counted.total == base.total, (
            f"layerwise allocated {counted.total - base.total} storages beyond the resident "
            f"forward's {base.total} in one steady-state forward of {BLOCKS} blocks: {extra}")
    finally:
        backend.disable()
        platform.close()
