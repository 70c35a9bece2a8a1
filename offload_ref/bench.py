"""``offload-ref bench``: step time and bytes per strategy, measured in one run on one platform.

Note [Overlap ratio]
    overlap ratio = layerwise step time / max(resident step time, copy-only time), where the
    copy-only time streams every block of the ring once through the same copy stream with no
    compute.  1.0 is the physical limit (copies fully hidden behind compute, or compute behind
    copies); the serial ratio (prefetch switched off) shows what the prefetch buys.  All numbers
    are medians of repeated runs taken back to back, so ratios compare like with like on a
    shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .backends.layerwise import LayerWiseOffloadBackend
from .config import OffloadConfig, OffloadStrategy
from .platform import CpuPlatform, get_platform

__all__ = ["add_bench_parser", "run_bench"]


def _median_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_bench(*, hidden: int = 512, blocks: int = 8, tokens: int = 256, steps: int = 4,
              repeats: int = 5, device: str = "cpu", threads: int = 1) -> dict[str, Any]:
    """Measure resident, model-level and layerwise offload on the heavy fixture pipeline."""
    from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        config = HeavyConfig(hidden=hidden, blocks=blocks, tokens=tokens, steps=steps)
        platform = CpuPlatform() if device == "cpu" else get_platform(device)
        inputs = make_inputs(0, config)
        results: dict[str, Any] = {
            "machine": {"platform": platform.name, "cpus": os.cpu_count(),
                        "torch_threads": threads, "torch": torch.__version__,
                        "python": pyplatform.python_version()},
            "config": {"hidden": hidden, "blocks": blocks, "tokens": tokens, "steps": steps,
                       "repeats": repeats, "block_bytes": config.block_bytes},
        }
        with torch.inference_mode():
            reference = build_pipeline(0, config)
            context = reference.text_encoder(inputs["prompt"])
        t = torch.tensor([0.5])
        x = inputs["latents"]

        def generation(pipe):
            return lambda: pipe(**inputs)

        def step(pipe):
            return lambda: pipe.transformer(x, t, context)

        def timed(pipe, fn_of):
            with torch.inference_mode():
                fn_of(pipe)()  # warm-up (first swaps, the ring learns the order)
                return _median_time(fn_of(pipe), repeats, platform.synchronize)

        resident = build_pipeline(0, config)
        results["resident"] = {
            "generation_s": timed(resident, generation),
            "step_s": timed(resident, step),
            "h2d_bytes_per_generation": 0,
        }

        pipe = build_pipeline(0, config)
        backend = _backend(OffloadStrategy.MODEL_LEVEL, platform)
        backend.enable(pipe)
        gen_s = timed(pipe, generation)
        before = backend.stats().h2d_bytes
        with torch.inference_mode():
            pipe(**inputs)
        results["model_level"] = {
            "generation_s": gen_s,
            "h2d_bytes_per_generation": backend.stats().h2d_bytes - before,
            "peak_device_weight_bytes": backend.stats().peak_device_weight_bytes,
        }
        backend.disable()

        for name, prefetch in (("layerwise", True), ("layerwise_serial", False)):
            pipe = build_pipeline(0, config)
            backend = LayerWiseOffloadBackend(
                OffloadConfig(strategy=OffloadStrategy.LAYER_WISE), platform, prefetch=prefetch)
            backend.enable(pipe)
            entry = {"generation_s": timed(pipe, generation), "step_s": timed(pipe, step)}
            before = backend.stats().h2d_bytes
            with torch.inference_mode():
                pipe(**inputs)
            entry["h2d_bytes_per_generation"] = backend.stats().h2d_bytes - before
            entry["peak_device_weight_bytes"] = backend.stats().peak_device_weight_bytes
            if prefetch:
                entry["copy_only_step_s"] = _copy_only(backend, platform, repeats)
            results[name] = entry
            backend.disable()

        lw, serial = results["layerwise"], results["layerwise_serial"]
        bound = max(results["resident"]["step_s"], lw["copy_only_step_s"])
        lw["overlap_ratio"] = lw["step_s"] / bound
        lw["serial_ratio"] = serial["step_s"] / bound
        lw["exposed_stall_per_block_s"] = max(
            0.0, (lw["step_s"] - results["resident"]["step_s"]) / blocks)
        step_bytes = blocks * config.block_bytes
        lw["copy_gbps"] = step_bytes / lw["copy_only_step_s"] / 1e9
        return results
    finally:
        torch.set_num_threads(previous_threads)


def _backend(strategy: OffloadStrategy, platform: Any) -> Any:
    from .backends.base import get_offload_backend

    components = ("dit", "text_encoder") if strategy is OffloadStrategy.MODEL_LEVEL else ("dit",)
    return get_offload_backend(OffloadConfig(strategy=strategy, components=components),
                               platform=platform)


def _copy_only(backend: LayerWiseOffloadBackend, platform: Any, repeats: int) -> float:
    """Stream every block of every ring once through the ring's copy stream, no compute."""
    def copy_all() -> None:
        for r in backend.rings:
            with platform.stream(r.copy_stream):
                for k, group in enumerate(r.groups):
                    for dtype, flat in r._slot_flats(k, k % 2).items():
                        platform.copy_(flat, group.master.flats[dtype])

    platform.synchronize()
    copy_all()  # warm-up
    return _median_time(copy_all, repeats, platform.synchronize)


def format_table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"offload-ref bench on {results['machine']['platform']} "
        f"({results['machine']['cpus']} CPUs, {results['machine']['torch_threads']} torch "
        f"thread): hidden {cfg['hidden']}, {cfg['blocks']} blocks of "
        f"{cfg['block_bytes'] / 2**20:.1f} MiB, {cfg['tokens']} tokens, {cfg['steps']} steps, "
        f"median of {cfg['repeats']}",
        f"{'strategy':<18} {'generation ms':>14} {'DiT step ms':>12} {'H2D MiB/gen':>12} "
        f"{'peak device MiB':>16}",
    ]
    for name in ("resident", "model_level", "layerwise", "layerwise_serial"):
        r = results[name]
        step = f"{r['step_s'] * 1e3:12.2f}" if "step_s" in r else f"{'-':>12}"
        peak = r.get("peak_device_weight_bytes")
        peak_s = f"{peak / 2**20:16.1f}" if peak is not None else f"{'-':>16}"
        lines.append(f"{name:<18} {r['generation_s'] * 1e3:14.2f} {step} "
                     f"{r['h2d_bytes_per_generation'] / 2**20:12.1f} {peak_s}")
    lw = results["layerwise"]
    lines += [
        f"copy-only step: {lw['copy_only_step_s'] * 1e3:.2f} ms ({lw['copy_gbps']:.2f} GB/s)",
        f"overlap ratio (layerwise / max(resident, copy-only)): {lw['overlap_ratio']:.3f}  "
        f"(serial, prefetch off: {lw['serial_ratio']:.3f}; limit 1.0)",
        f"exposed stall per block: {lw['exposed_stall_per_block_s'] * 1e3:.3f} ms",
    ]
    return "\n".join(lines)


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="step time and bytes per strategy (one run, ratios)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256,
                   help="activation rows: more tokens = more compute per copied byte")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    results = run_bench(hidden=args.hidden, blocks=args.blocks, tokens=args.tokens,
                        steps=args.steps, repeats=args.repeats, device=args.device)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0
