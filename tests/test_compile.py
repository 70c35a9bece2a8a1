"""``torch.compile`` of an offloaded DiT.  Before, the rebind guard's buffer class (a
``torch.Tensor`` subclass) made AOT autograd fail on every offloaded pipeline ("Multiple dispatch
failed for 'aten.unsqueeze.default'; all __torch_dispatch__ handlers returned NotImplemented"),
which is the path of the default inductor backend too.  ``aot_eager`` keeps eager numerics, so
the outputs are compared bit for bit.

On the CPU device (``CpuPlatform(device="cpu")``): the simulated accelerator runs sdpa as CPU's own
kernel on the device's bytes, which tracing with fake tensors cannot enter (a documented limit,
docs/simulated-accelerator.md); compiling is about the rebind guard, not placement."""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_aot_compiled_dit_under_offload_matches_eager(strategy: str) -> None:
    spec = get_spec("flux2")
    with torch.no_grad():
        want = spec.build()(**spec.make_inputs())
    torch._dynamo.reset()
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform(device="cpu"))
    backend.enable(pipeline)
    try:
        pipeline.transformer.compile(backend="aot_eager")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(pipeline(**spec.make_inputs()), want)
    finally:
        backend.disable()
        torch._dynamo.reset()
