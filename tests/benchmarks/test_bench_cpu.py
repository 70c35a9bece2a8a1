"""pytest-benchmark suite on the CPU platform: ``pytest tests/benchmarks --benchmark-only -n 0``.

Under xdist (the normal test run) pytest-benchmark only executes each body once, which still
checks that every strategy runs and matches the resident output.  The timed platforms compute on
the CPU, like the resident baseline and the peers (Note [Bench device] in offload_ref/bench.py);
placement is checked by the rest of the suite, on the simulated accelerator.
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
    platform = CpuPlatform(device="cpu")
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


# -- per-block host overhead and peers (issue 12; Note [Per-block overhead] in bench.py) ---------

MANY_BLOCKS = 64
PEERS = ("resident", "layerwise_inline", "layerwise_cpu", "diffusers_group_offload",
         "accelerate_cpu_offload")


@pytest.fixture(scope="module")
def many_blocks_reference() -> torch.Tensor:
    from offload_ref.fixtures.many_blocks import build_pipeline as build_many, make_input

    with torch.inference_mode():
        return build_many(0, MANY_BLOCKS)(make_input(0))


@pytest.mark.parametrize("variant", PEERS)
def test_many_blocks_step_side_by_side(benchmark, variant: str,
                                       many_blocks_reference: torch.Tensor) -> None:
    """One forward of a DiT of 64 tiny blocks: offload-ref layerwise (inline and CPU
    platform) against diffusers' block-level group offloading and accelerate's cpu_offload hooks,
    both onloading to the CPU (so their cost over ``resident`` is their host overhead).  Same
    model, weights and input; each variant's output is checked bitwise."""
    from offload_ref.fixtures.many_blocks import build_pipeline as build_many, make_input
    from offload_ref.platform import InlinePlatform

    if variant == "diffusers_group_offload":
        pytest.importorskip("diffusers.hooks", reason="diffusers not installed")
        pytest.importorskip("accelerate", reason="accelerate not installed")
    if variant == "accelerate_cpu_offload":
        pytest.importorskip("accelerate", reason="accelerate not installed")
    from offload_ref.bench import _apply_peer

    pipeline = build_many(0, MANY_BLOCKS)
    x = make_input(0)
    platform = None
    backend = None
    if variant.startswith("layerwise"):
        platform = (InlinePlatform(device="cpu") if variant == "layerwise_inline"
                    else CpuPlatform(device="cpu"))
        backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
        backend.enable(pipeline)
    elif variant != "resident":
        _apply_peer(variant, pipeline.transformer)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            out = pipeline.transformer(x)
        if platform is not None:
            platform.synchronize()
        return out

    try:
        out = benchmark(step)
        assert torch.equal(out, many_blocks_reference)
        benchmark.extra_info.update(blocks=MANY_BLOCKS, variant=variant)
    finally:
        if backend is not None:
            backend.disable()
        if platform is not None:
            platform.close()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_enable_time(benchmark, strategy: str) -> None:
    """enable() + disable() on the benchmark heavy configuration (enable_memcpy_ratio in
    ``offload-ref bench --json`` compares it to one memcpy)."""
    pipeline = build_pipeline(0, CONFIG)
    platform = CpuPlatform(device="cpu")
    components = ("dit", "text_encoder") if strategy == "model_level" else ("dit",)
    backend = get_offload_backend(OffloadConfig(strategy=strategy, components=components),
                                  platform=platform)

    def cycle() -> None:
        backend.enable(pipeline)
        platform.synchronize()
        backend.disable()

    try:
        benchmark(cycle)
        assert platform.memory_allocated() == 0
    finally:
        platform.close()
