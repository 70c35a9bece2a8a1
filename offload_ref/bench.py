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


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int,
                 sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin so that drift in the
    machine's speed affects every strategy alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: first swaps, the ring learns the caller's order
        fn()
        sync()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _parallel_speedup(threads: int = 2) -> float:
    """Throughput of ``threads`` concurrent matmul threads over one (1.0: no parallelism).

    What bounds overlap on a CPU platform: the copy worker and the compute thread only overlap
    as far as the machine runs two threads at once."""
    import threading

    a = torch.randn(256, 512)
    b = torch.randn(2048, 512)

    def work() -> None:
        for _ in range(20):
            torch.nn.functional.linear(a, b)

    work()
    start = time.perf_counter()
    work()
    one = time.perf_counter() - start
    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * one / (time.perf_counter() - start)


def run_bench(*, hidden: int = 512, blocks: int = 8, tokens: int = 256, steps: int = 4,
              repeats: int = 7, device: str = "cpu", threads: int = 1) -> dict[str, Any]:
    """Measure resident, model-level and layerwise offload on the heavy fixture pipeline."""
    from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    backends: list[Any] = []
    try:
        config = HeavyConfig(hidden=hidden, blocks=blocks, tokens=tokens, steps=steps)
        platform = CpuPlatform() if device == "cpu" else get_platform(device)
        inputs = make_inputs(0, config)
        results: dict[str, Any] = {
            "machine": {"platform": platform.name, "cpus": os.cpu_count(),
                        "torch_threads": threads, "torch": torch.__version__,
                        "python": pyplatform.python_version(),
                        "parallel_speedup_2_threads": round(_parallel_speedup(), 3)},
            "config": {"hidden": hidden, "blocks": blocks, "tokens": tokens, "steps": steps,
                       "repeats": repeats, "block_bytes": config.block_bytes},
        }
        pipes = {name: build_pipeline(0, config) for name in
                 ("resident", "model_level", "layerwise", "layerwise_serial")}
        backends = [
            _backend(OffloadStrategy.MODEL_LEVEL, platform),
            LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                    platform),
            LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                    platform, prefetch=False),
        ]
        for backend, name in zip(backends, ("model_level", "layerwise", "layerwise_serial")):
            backend.enable(pipes[name])
        named_backends = dict(zip(("model_level", "layerwise", "layerwise_serial"), backends))
        with torch.inference_mode():
            context = pipes["resident"].text_encoder(inputs["prompt"])
            t = torch.tensor([0.5])
            x = inputs["latents"]
            generations = {name: (lambda p=p: p(**inputs)) for name, p in pipes.items()}
            dit_steps = {name: (lambda p=p: p.transformer(x, t, context))
                         for name, p in pipes.items() if name != "model_level"}
            dit_steps["copy_only"] = lambda: _copy_all(named_backends["layerwise"], platform)
            gen_s = _interleaved(generations, repeats, platform.synchronize)
            step_s = _interleaved(dit_steps, repeats, platform.synchronize)
            for name, p in pipes.items():
                backend = named_backends.get(name)
                before = backend.stats().h2d_bytes if backend else 0
                p(**inputs)
                platform.synchronize()
                entry = {"generation_s": gen_s[name],
                         "h2d_bytes_per_generation":
                             backend.stats().h2d_bytes - before if backend else 0}
                if name in step_s:
                    entry["step_s"] = step_s[name]
                if backend is not None:
                    entry["peak_device_weight_bytes"] = backend.stats().peak_device_weight_bytes
                    entry["peak_device_bytes"] = backend.stats().peak_device_bytes
                results[name] = entry

        results["enable"] = _enable_cost(pipes["resident"], platform, repeats)
        lw, serial = results["layerwise"], results["layerwise_serial"]
        lw["copy_only_step_s"] = step_s["copy_only"]
        bound = max(results["resident"]["step_s"], lw["copy_only_step_s"])
        lw["overlap_ratio"] = lw["step_s"] / bound
        lw["serial_ratio"] = serial["step_s"] / bound
        lw["exposed_stall_per_block_s"] = max(
            0.0, (lw["step_s"] - results["resident"]["step_s"]) / blocks)
        lw["copy_gbps"] = blocks * config.block_bytes / lw["copy_only_step_s"] / 1e9
        return results
    finally:
        for backend in backends:
            backend.disable()
        torch.set_num_threads(previous_threads)


def _backend(strategy: OffloadStrategy, platform: Any) -> Any:
    from .backends import get_offload_backend

    components = ("dit", "text_encoder") if strategy is OffloadStrategy.MODEL_LEVEL else ("dit",)
    return get_offload_backend(OffloadConfig(strategy=strategy, components=components),
                               platform=platform)


def _enable_cost(pipeline: Any, platform: Any, repeats: int) -> dict[str, Any]:
    """enable() time per strategy against one plain memcpy of the same host-master bytes."""
    out: dict[str, Any] = {}
    for strategy in (OffloadStrategy.MODEL_LEVEL, OffloadStrategy.LAYER_WISE):
        backend = _backend(strategy, platform)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.enable(pipeline)
            platform.synchronize()
            times.append(time.perf_counter() - start)
            nbytes = backend.stats().host_bytes
            backend.disable()
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copies = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
        enable_s, memcpy_s = statistics.median(times), statistics.median(copies)
        out[strategy.value] = {"enable_s": enable_s, "host_bytes": nbytes,
                               "memcpy_s": memcpy_s, "ratio": enable_s / memcpy_s}
    return out


def _copy_all(backend: LayerWiseOffloadBackend, platform: Any) -> None:
    """Stream every block of every ring once through the ring's copy stream, no compute (the
    slots' events are not involved: nothing reads them)."""
    for ring in backend.rings:
        with platform.stream(ring.copy_stream):
            for k, group in enumerate(ring.groups):
                for dtype, flat in ring._slot_flats(k, k % 2).items():
                    platform.copy_(flat, group.master.flats[dtype])


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
        *(f"enable {name}: {e['enable_s'] * 1e3:.1f} ms for {e['host_bytes'] / 2**20:.1f} MiB of "
          f"host masters = {e['ratio']:.1f} x one memcpy of those bytes "
          f"({e['memcpy_s'] * 1e3:.1f} ms)" for name, e in results["enable"].items()),
        f"two-thread parallel speedup of this machine: "
        f"{results['machine']['parallel_speedup_2_threads']:.2f} (2.0 = two real cores)",
    ]
    return "\n".join(lines)


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="step time and bytes per strategy (one run, ratios)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256,
                   help="activation rows: more tokens = more compute per copied byte")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    results = run_bench(hidden=args.hidden, blocks=args.blocks, tokens=args.tokens,
                        steps=args.steps, repeats=args.repeats, device=args.device)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0
