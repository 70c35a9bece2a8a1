"""The GPU route: ``pytest -m cuda --benchmark-only -n 0 tests/benchmarks`` on a machine with an
NVIDIA GPU (ci/gpu_session.sh runs it).  Every test here is marked ``cuda`` and skipped, with the
reason, where ``torch.cuda.is_available()`` is False, so the route collects on any machine.

On the GPU it times, on the heavy fixture at a compute-heavy size, resident, model level,
layerwise, layerwise with prefetch off and the copies alone, each output checked bitwise against
the resident run; the per-block host overhead on a DiT of 64 tiny blocks against diffusers'
group offloading and accelerate's ``cpu_offload`` onloading to the same GPU (every contender
copies); ``enable()``; and two overlap properties a GPU must show (Note [Overlap ratio] in
offload_ref/bench.py): layerwise within 1.10x of max(resident, copies alone), and host-to-device
copies through the ring at >= 80% of a plain pinned copy's rate.  The overlap tests also run
under ``--benchmark-only``: their timings go through the ``benchmark`` fixture.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"),
]

#: compute-heavy: a block's compute is several times its copy on an H100/H200 over PCIe
HEAVY = dict(hidden=2048, blocks=8, tokens=2048, steps=2)
MANY_BLOCKS = 64


def _heavy():
    from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs

    config = HeavyConfig(**HEAVY)
    return config, build_pipeline, make_inputs


def _median_s(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.fixture(scope="module")
def heavy_reference() -> torch.Tensor:
    from offload_ref.contracts.case import move_to_device

    config, build_pipeline, make_inputs = _heavy()
    pipeline = move_to_device(build_pipeline(0, config), torch.device("cuda"))
    with torch.inference_mode():
        return pipeline(**make_inputs(0, config)).cpu()


@pytest.mark.parametrize("variant", ["resident", "model_level", "layer_wise",
                                     "layer_wise_prefetch_off"])
def test_heavy_generation_on_the_gpu(benchmark, variant: str,
                                     heavy_reference: torch.Tensor) -> None:
    from offload_ref.backends.layerwise import LayerWiseOffloadBackend
    from offload_ref.contracts.case import move_to_device
    from offload_ref.platform import get_platform

    config, build_pipeline, make_inputs = _heavy()
    pipeline = build_pipeline(0, config)
    inputs = make_inputs(0, config)
    platform = get_platform("cuda")
    backend = None
    if variant == "resident":
        move_to_device(pipeline, platform.device)
    elif variant == "layer_wise_prefetch_off":
        backend = LayerWiseOffloadBackend(OffloadConfig(strategy="layer_wise"), platform,
                                          prefetch=False)
    else:
        backend = get_offload_backend(OffloadConfig(strategy=variant), platform=platform)
    if backend is not None:
        backend.enable(pipeline)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            out = pipeline(**inputs)
        torch.cuda.synchronize()
        return out

    try:
        out = benchmark.pedantic(generate, rounds=5, warmup_rounds=1)
        assert torch.equal(out.cpu(), heavy_reference), f"{variant} differs from resident"
        if backend is not None:
            stats = backend.stats()
            benchmark.extra_info.update(h2d_bytes=stats.h2d_bytes,
                                        peak_device_weight_bytes=stats.peak_device_weight_bytes)
    finally:
        if backend is not None:
            backend.disable()


def test_layerwise_overlaps_copies_with_compute(benchmark) -> None:
    """Layerwise step <= 1.10x max(resident step, the copies alone) at a compute-heavy size."""
    from offload_ref.backends.layerwise import LayerWiseOffloadBackend
    from offload_ref.bench import _copy_all
    from offload_ref.contracts.case import move_to_device
    from offload_ref.platform import get_platform

    config, build_pipeline, make_inputs = _heavy()
    platform = get_platform("cuda")
    inputs = make_inputs(0, config)
    resident = move_to_device(build_pipeline(0, config), platform.device)
    offloaded = build_pipeline(0, config)
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy="layer_wise"), platform)
    backend.enable(offloaded)
    try:
        with torch.inference_mode():
            context = resident.text_encoder(inputs["prompt"].to(platform.device))
            t = torch.tensor([0.5], device=platform.device)
            x = inputs["latents"].to(platform.device)
            steps = {"resident": lambda: resident.transformer(x, t, context),
                     "layerwise": lambda: offloaded.transformer(x, t, context),
                     "copy_only": lambda: _copy_all(backend, platform)}
            for fn in steps.values():
                fn()
            measured = benchmark.pedantic(
                lambda: {name: _median_s(fn) for name, fn in steps.items()}, rounds=1)
        bound = max(measured["resident"], measured["copy_only"])
        ratio = measured["layerwise"] / bound
        benchmark.extra_info.update(overlap_ratio=ratio, **measured)
        assert ratio <= 1.10, (f"layerwise took {ratio:.3f}x max(resident, copy-only) "
                               f"({measured})")
    finally:
        backend.disable()


def test_ring_copies_run_near_the_pinned_copy_rate(benchmark) -> None:
    """Host-to-device bytes through the ring's copy stream at >= 80% of one plain pinned copy's
    rate on the same GPU."""
    from offload_ref.backends.layerwise import LayerWiseOffloadBackend
    from offload_ref.bench import _copy_all
    from offload_ref.platform import get_platform

    config, build_pipeline, _ = _heavy()
    platform = get_platform("cuda")
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy="layer_wise"), platform)
    backend.enable(build_pipeline(0, config))
    try:
        nbytes = config.blocks * config.block_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        device = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)

        def rates() -> dict[str, float]:
            plain = _median_s(lambda: device.copy_(host, non_blocking=True))
            ring = _median_s(lambda: _copy_all(backend, platform))
            return {"plain_gbps": nbytes / plain / 1e9, "ring_gbps": nbytes / ring / 1e9}

        measured = benchmark.pedantic(rates, rounds=1)
        benchmark.extra_info.update(**measured)
        assert measured["ring_gbps"] >= 0.8 * measured["plain_gbps"], measured
    finally:
        backend.disable()


@pytest.mark.parametrize("variant", ["resident", "offload_ref", "diffusers_group_offload",
                                     "accelerate_cpu_offload"])
def test_per_block_overhead_on_the_gpu(benchmark, variant: str) -> None:
    """One forward of 64 tiny blocks, every contender onloading to the same GPU: the difference
    to ``resident`` is each offloader's host work per block (plus its copies)."""
    from offload_ref.contracts.case import move_to_device
    from offload_ref.fixtures.many_blocks import build_pipeline as build_many, make_input

    device = torch.device("cuda")
    pipeline = build_many(0, MANY_BLOCKS)
    reference_pipeline = move_to_device(build_many(0, MANY_BLOCKS), device)
    x = make_input(0).to(device)
    with torch.inference_mode():
        reference = reference_pipeline.transformer(x).cpu()
    backend = None
    if variant == "resident":
        move_to_device(pipeline, device)
    elif variant == "offload_ref":
        backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), device)
        backend.enable(pipeline)
    elif variant == "diffusers_group_offload":
        hooks = pytest.importorskip("diffusers.hooks", reason="diffusers not installed")
        hooks.apply_group_offloading(pipeline.transformer, onload_device=device,
                                     offload_device=torch.device("cpu"),
                                     offload_type="block_level", num_blocks_per_group=1)
    else:
        accelerate = pytest.importorskip("accelerate", reason="accelerate not installed")
        accelerate.cpu_offload(pipeline.transformer, execution_device=device)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            out = pipeline.transformer(x)
        torch.cuda.synchronize()
        return out

    try:
        out = benchmark.pedantic(step, rounds=50, warmup_rounds=2)
        assert torch.equal(out.cpu(), reference), variant
        benchmark.extra_info.update(blocks=MANY_BLOCKS, variant=variant)
    finally:
        if backend is not None:
            backend.disable()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_enable_time_on_the_gpu(benchmark, strategy: str) -> None:
    config, build_pipeline, _ = _heavy()
    device = torch.device("cuda")

    def enable_and_disable() -> None:
        pipeline = build_pipeline(0, config)
        backend = get_offload_backend(OffloadConfig(strategy=strategy), device)
        backend.enable(pipeline)
        torch.cuda.synchronize()
        backend.disable()

    benchmark.pedantic(enable_and_disable, rounds=3, warmup_rounds=1)
