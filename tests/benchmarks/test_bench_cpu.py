"""pytest-benchmark suite on the CPU platform: ``pytest tests/benchmarks --benchmark-only -n 0``.

Under xdist (the normal test run) pytest-benchmark only executes each body once, which still
checks that every strategy runs and matches the resident output.
"""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs
from offload_ref.platform import CpuPlatform

CONFIG = HeavyConfig(hidden=256, blocks=6, tokens=128, steps=2)


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    with torch.inference_mode():
        return build_pipeline(0, CONFIG)(**make_inputs(0, CONFIG))


@pytest.mark.parametrize("strategy", ["resident", "model_level", "layer_wise"])
def test_generation_time(benchmark, strategy: str, reference: torch.Tensor) -> None:
    pipeline = build_pipeline(0, CONFIG)
    inputs = make_inputs(0, CONFIG)
    platform = CpuPlatform()
    backend = None
    if strategy != "resident":
        backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
        backend.enable(pipeline)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            out = pipeline(**inputs)
        platform.synchronize()
        return out

    try:
        out = benchmark(generate)
        assert torch.equal(out, reference)
        if backend is not None:
            stats = backend.stats()
            benchmark.extra_info.update(
                h2d_bytes=stats.h2d_bytes, host_bytes=stats.host_bytes,
                peak_device_weight_bytes=stats.peak_device_weight_bytes)
    finally:
        if backend is not None:
            backend.disable()
        platform.close()
