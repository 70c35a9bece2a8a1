"""``torch.compile`` of an offloaded DiT.  Before, the rebind guard's buffer class (a
``torch.Tensor`` subclass) made AOT autograd fail on every offloaded pipeline ("Multiple dispatch
failed for 'aten.unsqueeze.default'; all __torch_dispatch__ handlers returned NotImplemented"),
which is the path of the default inductor backend too.  ``aot_eager`` keeps eager numerics, so
the outputs are compared bit for bit, on the device (the simulated accelerator traces sdpa as an
opaque operator that runs CPU's kernel)."""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_aot_compiled_dit_under_offload_matches_eager(strategy: str) -> None:
    spec = get_spec("flux2")
    with torch.no_grad():
        want = resident(spec.build())(**spec.make_inputs())
    torch._dynamo.reset()
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    try:
        pipeline.transformer.compile(backend="aot_eager")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(pipeline(**spec.make_inputs()), want)
    finally:
        backend.disable()
        torch._dynamo.reset()
