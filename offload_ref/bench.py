"""``offload-ref bench``: step time and bytes per strategy, measured in one run on one platform.

Note [Overlap ratio]
    overlap ratio = layerwise step time / max(resident step time, copy-only time), where the
    copy-only time streams every block of the ring once through the same copy stream with no
    compute.  1.0 is the physical limit (copies fully hidden behind compute, or compute behind
    copies); the serial ratio (prefetch switched off) shows what the prefetch buys.  All numbers
    are medians of repeated runs taken back to back, so ratios compare like with like on a
    shared, noisy machine.

Note [Concurrent bound]
    The overlap ratio's bound, max(resident step, copy-only step), assumes that copies and
    compute do not slow each other.  On the CPU platform they share the memory bus and the
    machine's cores (its two-thread speedup is printed), so the bench also runs the resident
    step with the very same copies queued on the copy stream beside it, with no offloader logic
    between (``concurrent``): the fastest this machine does both at once.  ``layerwise /
    concurrent`` is then what the ring's scheduling costs beyond the machine's own contention.

Note [Enable floor]
    ``enable_memcpy_ratio`` compares enable with one warm ``dst.copy_(src)`` of the host-master
    bytes.  An enable that builds host masters cannot do only that: its destination is fresh
    memory (the kernel faults in and zeroes every page at the first write), and the original
    storage the masters replace is released (pages handed back).  The floor times exactly those
    three with no Python work between: ``platform.host_empty`` (the platform's own host memory,
    huge pages on the CPU platform), one copy into it, and dropping a written buffer of the same
    size.  ``floor_ratio`` (floor / memcpy) is the best ratio any copying enable can show on the
    machine; ``over_floor`` (enable / floor) is what the offloader's own work adds.

Note [Per-block overhead]
    per-block overhead = (layerwise step - resident step) / blocks on a DiT of many tiny blocks
    (``offload_ref.fixtures.many_blocks``: 64 x ``nn.Linear(8, 8)``, batch 1), where compute is a
    few microseconds, so the difference is the offloader's host work per block.  Reported on the
    inline platform (``InlinePlatform``: the ring's own Python work, hooks, predictor,
    rebinds, calls into streams and events, which is what also costs on CUDA) and on the CPU
    platform (plus its copy worker and stream-order checker; race amplifier off).  Each figure
    comes in wall time and in the calling thread's CPU time: on a loaded shared machine the
    process is descheduled for a varying share of a step, which inflates wall time but not
    thread CPU time.  Variants are timed round-robin; each sample times five back-to-back
    forwards and then synchronizes the variant's own platform only (a CPU platform's
    synchronize wakes its worker thread, whose latency would otherwise enter every variant's
    time as noise).  The inline platform is timed beside the resident model and the floor
    (Note [Per-block floor] in bench_floor.py: what any offloader with these guarantees pays
    per block), the CPU platform in a round-robin of its own beside the resident model: its
    forwards take twenty times longer, on two threads, and timed in the same round-robin they
    left the caches cold for the variant after them (the inline figure came out 1.5-2 µs per
    block higher on an Intel Xeon VM).  ``--peers`` (offload_ref/bench_peers.py, Note [Fair peers]) measures
    offload-ref beside diffusers' and accelerate's offloaders, every one copying to a device.

Note [Bench device]
    ``--device cpu`` times the CPU platform with its device storage on the CPU too
    (``CpuPlatform(device="cpu")``): every variant then computes on the same device as the
    resident baseline and the peers, which onload to the CPU, so a difference is the offloader's
    own cost.  The simulated accelerator (docs/simulated-accelerator.md) routes each op through
    a dispatcher fallback, a per-op cost that is not offloading's; it checks placement, not
    speed.  ``--device hpu`` times it anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform as pyplatform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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
    return {name: statistics.median(ts)
            for name, ts in _interleaved_samples(fns, repeats, sync).items()}


def _interleaved_samples(fns: dict[str, Callable[[], Any]], repeats: int,
                         sync: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds of each call of each function (``repeats`` each, after one warm-up call),
    measured round-robin as :func:`_interleaved`."""
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
    return times


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


def _bench_platform(device: str = "cpu") -> Any:
    """The platform a benchmark times: the CPU platform computing on the CPU for ``cpu`` (Note
    [Bench device]), else :func:`get_platform`'s."""
    return CpuPlatform(device="cpu") if device == "cpu" else get_platform(device)


def run_bench(*, hidden: int = 512, blocks: int = 8, tokens: int = 256, steps: int = 4,
              repeats: int = 7, device: str = "cpu", threads: int = 1,
              peers: bool = False) -> dict[str, Any]:
    """Measure resident, model-level and layerwise offload on the heavy fixture pipeline
    (``peers``: also :func:`run_peers`, on ``device`` unless it is the host, where it runs on
    :func:`peers_device`'s default)."""
    from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    backends: list[Any] = []
    try:
        config = HeavyConfig(hidden=hidden, blocks=blocks, tokens=tokens, steps=steps)
        platform = _bench_platform(device)
        inputs = make_inputs(0, config)
        results: dict[str, Any] = {
            "machine": {"platform": platform.name, "cpus": os.cpu_count(),
                        "streams_overlap": not _serial_streams(platform),
                        "torch_threads": threads, "torch": torch.__version__,
                        "python": pyplatform.python_version(),
                        "parallel_speedup_2_threads": round(_parallel_speedup(), 3)},
            "config": {"hidden": hidden, "blocks": blocks, "tokens": tokens, "steps": steps,
                       "repeats": repeats, "block_bytes": config.block_bytes},
        }
        pipes = {name: build_pipeline(0, config) for name in
                 ("resident", "model_level", "layerwise", "layerwise_serial")}
        # The baseline: the whole pipeline on the device, as a user with enough memory runs it.
        from .contracts.case import move_to_device

        move_to_device(pipes["resident"], platform.device)
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
            context = pipes["resident"].text_encoder(inputs["prompt"].to(platform.device))
            t = torch.tensor([0.5], device=platform.device)
            x = inputs["latents"].to(platform.device)
            generations = {name: (lambda p=p: p(**inputs)) for name, p in pipes.items()}
            dit_steps = {name: (lambda p=p: p.transformer(x, t, context))
                         for name, p in pipes.items() if name != "model_level"}
            dit_steps["copy_only"] = lambda: _copy_all(named_backends["layerwise"], platform)
            # Note [Concurrent bound]: the same copies queued on the copy stream while the
            # resident step computes beside them, with no offloader logic in between.
            dit_steps["concurrent"] = lambda: (
                _copy_all(named_backends["layerwise"], platform),
                pipes["resident"].transformer(x, t, context))
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

        results["enable"] = _enable_cost(build_pipeline(0, config), platform, repeats)  # host-built
        results["enable_memcpy_ratio"] = {k: v["ratio"] for k, v in results["enable"].items()}
        results["enable_floor_ratio"] = {k: v["floor_ratio"] for k, v in results["enable"].items()}
        results["enable_fresh_copy_ratio"] = {k: v["fresh_copy_ratio"]
                                              for k, v in results["enable"].items()}
        lw, serial = results["layerwise"], results["layerwise_serial"]
        lw["copy_only_step_s"] = step_s["copy_only"]
        bound = max(results["resident"]["step_s"], lw["copy_only_step_s"])
        lw["overlap_ratio"] = lw["step_s"] / bound
        lw["concurrent_bound_s"] = step_s["concurrent"]
        lw["overlap_vs_concurrent"] = lw["step_s"] / step_s["concurrent"]
        lw["serial_vs_concurrent"] = serial["step_s"] / step_s["concurrent"]
        lw["serial_ratio"] = serial["step_s"] / bound
        lw["exposed_stall_per_block_s"] = max(
            0.0, (lw["step_s"] - results["resident"]["step_s"]) / blocks)
        lw["copy_gbps"] = blocks * config.block_bytes / lw["copy_only_step_s"] / 1e9
        overhead = per_block_overhead(repeats=max(repeats, 50))
        lw["per_block_overhead_us"] = overhead["inline"]["per_block_overhead_us"]
        lw["per_block_overhead_cpu_us"] = overhead["inline"]["per_block_overhead_cpu_us"]
        lw["per_block_floor_us"] = overhead["floor"]["per_block_overhead_us"]
        lw["per_block_floor_cpu_us"] = overhead["floor"]["per_block_overhead_cpu_us"]
        lw["per_block_overhead_cpu_platform_us"] = overhead["cpu"]["per_block_overhead_us"]
        lw["per_block_overhead_cpu_platform_cpu_us"] = \
            overhead["cpu"]["per_block_overhead_cpu_us"]
        if peers:
            from .bench_peers import run_peers

            results["peers"] = run_peers(device=None if device == "cpu" else device,
                                         repeats=repeats)
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


def _median_enable_s(backend: Any, pipeline: Any, platform: Any, repeats: int
                     ) -> tuple[float, int]:
    """Median seconds of ``backend.enable(pipeline)`` (each followed by ``disable()``) and the
    host-master bytes it built."""
    times, nbytes = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        backend.enable(pipeline)
        platform.synchronize()
        times.append(time.perf_counter() - start)
        nbytes = backend.stats().host_bytes
        backend.disable()
    return statistics.median(times), nbytes


def _enable_cost(pipeline: Any, platform: Any, repeats: int) -> dict[str, Any]:
    """enable() time per strategy against two copies of the same host-master bytes: a warm
    ``dst.copy_(src)`` (the issue's figure, ``ratio``) and a copy into freshly allocated memory,
    ``torch.empty(n).copy_(src)`` (``fresh_copy_ratio``): the least any enable that makes a host
    copy pays, page faults of its fresh destination included.  Both copy from the same source."""
    out: dict[str, Any] = {}
    for strategy in (OffloadStrategy.MODEL_LEVEL, OffloadStrategy.LAYER_WISE):
        enable_s, nbytes = _median_enable_s(_backend(strategy, platform), pipeline, platform,
                                            repeats)
        # A written source: a never-written torch.empty reads the kernel's shared zero page,
        # which made the denominator about 1.4x too fast.  The weights are written memory.
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src).fill_(0)
        copies, fresh = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.empty(nbytes, dtype=torch.uint8).copy_(src)
            fresh.append(time.perf_counter() - start)
        floor = []
        for _ in range(repeats):
            # Note [Enable floor]: what any enable that copies into host masters pays, with no
            # Python work at all: the platform's own fresh host memory, one copy into it, and
            # the release of the original storage that the copy replaces.
            originals = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
            start = time.perf_counter()
            master = platform.host_empty(nbytes, torch.uint8, pin=True)
            master.copy_(src)
            del originals
            floor.append(time.perf_counter() - start)
            platform.host_free(master)
            del master
        memcpy_s = statistics.median(copies)
        fresh_s, floor_s = statistics.median(fresh), statistics.median(floor)
        out[strategy.value] = {"enable_s": enable_s, "host_bytes": nbytes,
                               "memcpy_s": memcpy_s, "ratio": enable_s / memcpy_s,
                               "fresh_copy_s": fresh_s, "fresh_copy_ratio": enable_s / fresh_s,
                               "floor_s": floor_s, "floor_ratio": floor_s / memcpy_s,
                               "over_floor": enable_s / floor_s}
    return out


def _copy_all(backend: LayerWiseOffloadBackend, platform: Any) -> None:
    """Stream every block of every ring once through the ring's copy stream, no compute (the
    slots' events are not involved: nothing reads them)."""
    for ring in backend.rings:
        with platform.stream(ring.copy_stream):
            for k, group in enumerate(ring.groups):
                for dtype, flat in ring.slots[k % 2].flats[k].items():
                    platform.copy_(flat, group.master.flats[dtype])


def _serial_streams(platform: Any) -> bool:
    """Whether ``platform``'s device runs its streams one after another (the simulated
    accelerator's do), so no copy can overlap compute there."""
    from .platform import simulated

    device = getattr(platform, "device", None)
    return device is not None and torch.device(device).type == simulated.DEVICE_TYPE


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
    if not results["machine"].get("streams_overlap", True):
        lines.append(
            "note: this device's streams do not overlap (the simulated accelerator runs every "
            "stream's work in order on the host), so the overlap ratios below cannot show what "
            "prefetch buys, and its cost here is not overhead on a GPU; `offload-ref bench "
            "--model NAME` models it (docs/benchmarks.md, Modeled timeline)")
    lines += [
        f"copy-only step: {lw['copy_only_step_s'] * 1e3:.2f} ms ({lw['copy_gbps']:.2f} GB/s)",
        f"overlap ratio (layerwise / max(resident, copy-only)): {lw['overlap_ratio']:.3f}  "
        f"(serial, prefetch off: {lw['serial_ratio']:.3f}; limit 1.0)",
        f"concurrent bound (Note [Concurrent bound]: the resident step with the same copies "
        f"running beside it): {lw['concurrent_bound_s'] * 1e3:.2f} ms; layerwise / bound "
        f"{lw['overlap_vs_concurrent']:.3f} (serial {lw['serial_vs_concurrent']:.3f})",
        f"exposed stall per block: {lw['exposed_stall_per_block_s'] * 1e3:.3f} ms",
        *(f"enable {name}: {e['enable_s'] * 1e3:.1f} ms for {e['host_bytes'] / 2**20:.1f} MiB of "
          f"host masters = {e['ratio']:.1f} x one memcpy of those bytes "
          f"({e['memcpy_s'] * 1e3:.1f} ms), {e['fresh_copy_ratio']:.2f} x one copy into fresh "
          f"memory ({e['fresh_copy_s'] * 1e3:.1f} ms); the floor (Note [Enable floor]) is "
          f"{e['floor_s'] * 1e3:.1f} ms = {e['floor_ratio']:.2f} x one memcpy, and enable is "
          f"{e['over_floor']:.2f} x the floor" for name, e in results["enable"].items()),
        f"per-block host overhead, 64 tiny blocks (Note [Per-block overhead]): inline "
        f"platform {lw['per_block_overhead_us']:.1f} µs wall / "
        f"{lw['per_block_overhead_cpu_us']:.1f} µs thread CPU (floor, Note [Per-block floor]: "
        f"{lw['per_block_floor_us']:.1f} / {lw['per_block_floor_cpu_us']:.1f}); CPU platform "
        f"{lw['per_block_overhead_cpu_platform_us']:.1f} µs wall / "
        f"{lw['per_block_overhead_cpu_platform_cpu_us']:.1f} µs thread CPU",
        f"two-thread parallel speedup of this machine: "
        f"{results['machine']['parallel_speedup_2_threads']:.2f} (2.0 = two real cores)",
    ]
    return "\n".join(lines)


def add_bench_parser(sub: Any) -> None:
    from ._cli_types import count, device

    p = sub.add_parser("bench", help="step time and bytes per strategy (one run, ratios)")
    p.add_argument("--hidden", type=count(1), default=None,
                   help="hidden size of the heavy fixture (default 512; --model: 128)")
    p.add_argument("--blocks", type=count(1), default=8,
                   help="transformer blocks of the heavy fixture (default 8)")
    p.add_argument("--tokens", type=count(1), default=None,
                   help="activation rows: more tokens = more compute per copied byte (default "
                        "256; --model: 8192, a block's compute several times its copy)")
    p.add_argument("--steps", type=count(1), default=4,
                   help="denoising steps per generation (default 4)")
    p.add_argument("--repeats", type=count(1), default=None,
                   help="samples per variant (default 7; --peers: 20)")
    p.add_argument("--device", default=None, type=device,
                   help="default cpu; --peers: the device every offloader copies to (default "
                        "cuda when present, else the kit's device, hpu:0); never the host")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--peers", action="store_true",
                   help="only the side by side, every offloader copying to --device: "
                        "offload-ref layerwise vs diffusers group offloading (block and leaf "
                        "level, with and without streams) and accelerate cpu_offload; model "
                        "level vs diffusers enable_model_cpu_offload and accelerate "
                        "cpu_offload_with_hook; bytes counted per forward")
    p.add_argument("--growth", action="store_true",
                   help="only the growth table: enable time and per-block overhead at 8, 64, "
                        "512 blocks and 10^3, 10^5 tensors, with fitted exponents")
    p.add_argument("--model", metavar="NAME|key=value,...",
                   help="only the modeled DiT step of every offloader on a GPU model "
                        "(h100-pcie, h200, rtx-4090, or key=value pairs over base=NAME): the "
                        "simulated accelerator's recorded stream order replayed on the model "
                        "(offload_ref/timeline.py), the same numbers on every run")
    p.add_argument("--residency", action=argparse.BooleanOptionalAction, default=True,
                   help="with --model: also the table of resident blocks against deeper "
                        "prefetch at equal device bytes, at its own copy-bound size (hidden "
                        "512, 8 blocks, 1024 tokens; most of --model's time); --no-residency "
                        "leaves it out")
    p.add_argument("--calibrate", action="store_true",
                   help="with --model: measure copy rates, matmul rates and launch cost on "
                        "--device (a GPU: cuda:N; hpu:0 calibrates the simulated device itself), "
                        "and print each row modeled on NAME and on the calibrated model beside "
                        "its step measured there")
    p.add_argument("--spec", metavar="MODULE:ATTR",
                   help="only your own pipeline (a PipelineSpec or a factory, as `offload-ref "
                        "check` takes it): generation time resident / model level / layerwise, "
                        "layerwise extra time per block call, enable time per strategy")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _cmd_bench_model(args)
    args.hidden = 512 if args.hidden is None else args.hidden
    args.tokens = 256 if args.tokens is None else args.tokens
    if args.spec:
        args.repeats = 7 if args.repeats is None else args.repeats
        args.device = args.device or "cpu"
        return _cmd_bench_spec(args)
    if args.peers:  # Note [Fair peers]: a device every offloader copies to, never the host
        from .bench_peers import PeersDeviceError, peers_device

        try:
            peers_dev = peers_device(args.device)
        except PeersDeviceError as exc:
            print(f"offload-ref {exc}", file=sys.stderr)
            return 2
    if args.repeats is None:
        args.repeats = 20 if args.peers and not args.growth else 7
    args.device = args.device or "cpu"
    if args.peers or args.growth:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch_threads": 1,
                                               "torch": torch.__version__}}
            text = []
            if args.peers:
                from .bench_peers import format_peers, run_peers

                out["peers"] = run_peers(device=peers_dev, repeats=args.repeats)
                text.append(format_peers(out["peers"]))
            if args.growth:
                out["growth"] = run_growth(repeats=args.repeats)
                text.append(format_growth(out["growth"]))
        finally:
            torch.set_num_threads(previous)
        print(json.dumps(out, indent=2) if args.json else "\n\n".join(text))
        return 0
    results = run_bench(hidden=args.hidden, blocks=args.blocks, tokens=args.tokens,
                        steps=args.steps, repeats=args.repeats, device=args.device)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def _cmd_bench_model(args: argparse.Namespace) -> int:
    """``bench --model``: Note [Modeled timeline] in offload_ref/timeline.py."""
    from .bench_model import (RESIDENCY_SIZES, format_model_bench, format_residency_bench,
                              run_model_bench, run_residency_bench)
    from .timeline import model_named

    try:
        model = model_named(args.model)
    except ValueError as exc:
        print(f"offload-ref bench: error: {exc}", file=sys.stderr)
        return 2
    for other in ("peers", "growth", "spec"):
        if getattr(args, other):
            print(f"offload-ref bench: error: --model and --{other} are separate tables; run "
                  "them one at a time", file=sys.stderr)
            return 2
    sizes = dict(hidden=args.hidden or 128, blocks=args.blocks, tokens=args.tokens or 8192)
    if args.calibrate:
        from .bench_model import format_calibration, run_calibration

        if args.device is None:
            print("offload-ref bench: error: --calibrate measures a real device: give --device "
                  "cuda:N (or hpu:0, the simulated device itself)", file=sys.stderr)
            return 2
        device = torch.device(args.device)
        if device.type == "cpu":
            print("offload-ref bench: error: --calibrate --device cpu: the host copies to "
                  "nothing; give the device the model stands for (cuda:N)", file=sys.stderr)
            return 2
        results = run_calibration(model, device, repeats=args.repeats or 5, **sizes)
        print(json.dumps(results, indent=2) if args.json else format_calibration(results))
        return 0
    from .platform import simulated

    if not simulated.available():  # the recording is the simulated accelerator's
        print(f"offload-ref bench: error: --model replays the simulated accelerator's stream "
              f"order, and it is unavailable here: {simulated.unavailable_reason()}",
              file=sys.stderr)
        return 1
    device = args.device or simulated.device(0)
    try:
        results = run_model_bench(model, device=device, **sizes)
    except ValueError as exc:
        print(f"offload-ref bench: error: {exc}", file=sys.stderr)
        return 2
    # Residency against deeper prefetch at equal device bytes, at its own copy-bound size.
    if args.residency:
        results["residency"] = run_residency_bench(model, device=device, **RESIDENCY_SIZES)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_model_bench(results))
        if args.residency:
            print()
            print(format_residency_bench(results["residency"]))
    return 0


# -- an author's own pipeline (issue 23) -----------------------------------------------------------

class BenchSpecError(Exception):
    """A pipeline ``bench --spec`` cannot measure, in one line naming the pipeline, the step and
    the cause (the CLI prints it as ``offload-ref bench: error: ...`` and exits 1)."""


def _cmd_bench_spec(args: argparse.Namespace) -> int:
    from .contracts.refs import RefError, resolve, specs_from

    from .contracts.escapes import describe, is_users_interrupt, telling_interrupts_apart

    with telling_interrupts_apart():  # Note [Escaping exceptions]: the author's own exits
        try:
            specs = specs_from(args.spec, resolve(args.spec))
        except RefError as exc:
            print(f"offload-ref bench: error: --spec {exc}", file=sys.stderr)
            return 2
        except BaseException as exc:  # noqa: BLE001 - SystemExit, its own KeyboardInterrupt
            if is_users_interrupt(exc):
                raise
            print(f"offload-ref bench: error: --spec {args.spec!r}: loading it raised "
                  f"{describe(exc)}; fix the module", file=sys.stderr)
            return 2
        try:
            results = [run_spec_bench(spec, repeats=args.repeats, device=args.device)
                       for spec in specs]
        except BenchSpecError as exc:
            print(f"offload-ref bench: error: {exc}", file=sys.stderr)
            return 1
    out = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "device": args.device,
                       "torch_threads": _SPEC_THREADS, "load_average": _load_average()},
           "pipelines": results}
    print(json.dumps(out, indent=2) if args.json else
          "\n\n".join([_machine_line(out["machine"]),
                        *(format_spec_bench(r) for r in out["pipelines"])]))
    return 0


#: torch threads ``bench --spec`` runs with, as ``--peers`` and ``--growth`` (one thread: the
#: figures do not depend on how many cores the machine lends the run at that moment)
_SPEC_THREADS = 1


def _load_average() -> list[float] | None:
    """The system's 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None


def _machine_line(machine: dict[str, Any]) -> str:
    load = machine.get("load_average")
    load_text = ("load average " + ", ".join(f"{x:.2f}" for x in load) + " (1, 5, 15 min)"
                 if load else "load average unknown")
    return (f"{machine['cpus']} CPUs, torch threads: {machine['torch_threads']}, {load_text}: "
            f"a load near or above the CPU count slows every row and widens the spread")


def _spread(samples: list[float]) -> float:
    """The interquartile range of ``samples`` in seconds (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1


@contextlib.contextmanager
def _step(spec: Any, what: str) -> Iterator[None]:
    """Turn a failure of ``what`` (the author's code, or a strategy refusing the pipeline) into
    a :class:`BenchSpecError` naming the pipeline and the step; a factory's ``SystemExit`` too,
    which would otherwise end the benchmark with its exit code and no word."""
    from .contracts.escapes import is_users_interrupt

    try:
        yield
    except BenchSpecError:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported in one line, chained
        if is_users_interrupt(exc):  # the user's Ctrl-C (Note [Escaping exceptions])
            raise
        text = " ".join(str(exc).split()) or "(no message)"
        if len(text) > 400:
            text = text[:397] + "..."
        raise BenchSpecError(f"{spec.name}: {what} raised {type(exc).__name__}: {text}") from exc


def run_spec_bench(spec: Any, *, repeats: int = 7, device: str = "cpu",
                   threads: int = _SPEC_THREADS) -> dict[str, Any]:
    """:func:`_run_spec_bench` with torch pinned to ``threads`` threads (restored after)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = _run_spec_bench(spec, repeats=repeats, device=device)
    finally:
        torch.set_num_threads(previous)
    result["torch_threads"] = threads
    return result


def _run_spec_bench(spec: Any, *, repeats: int, device: str) -> dict[str, Any]:
    """One pipeline under each strategy it claims (model level, layerwise), against the whole
    pipeline on the device: median generation seconds (interleaved, one run), layerwise extra
    time per streamed block call, and median ``enable()`` seconds of a host-built pipeline.

    Takes any pipeline the kit takes: an ``nn.Module``, a diffusers pipeline or a plain object
    holding modules (the strategies find its components and blocks as ``enable()`` does, and
    the block calls are counted on the layerwise backend's own rings).  A step that raises (the
    factory, the inputs, a strategy's ``enable()``, a generation) raises
    :class:`BenchSpecError` naming the pipeline and the step."""
    from .backends import get_offload_backend
    from .contracts.case import move_to_device
    from .contracts.preflight import unresolved_strategies
    from .plan import selectable_components

    platform = _bench_platform(device)

    def build(why: str) -> Any:
        with _step(spec, f"its factory ({why})"):
            return spec.build()

    def config(pipe: Any, strategy: str) -> OffloadConfig:
        with _step(spec, f"choosing its components for {strategy}"):
            return OffloadConfig(strategy=strategy,
                                 components=selectable_components(pipe, strategy))

    resident = build("the resident pipeline")
    with _step(spec, "its inputs (make_inputs)"):
        inputs = spec.make_inputs()
    with _step(spec, "checking which strategies resolve"):
        skipped = {s: why for s, why in unresolved_strategies(spec).items()
                   if s in ("model_level", "layer_wise")}
    strategies = [s for s in ("model_level", "layer_wise")
                  if spec.supports(s) and s not in skipped]
    with _step(spec, f"moving it whole to {platform.device}"):
        pipes: dict[str, Any] = {"resident": move_to_device(resident, platform.device)}
    backends: dict[str, Any] = {}
    block_calls = 0
    try:
        for strategy in strategies:
            pipe = build(strategy)
            with _step(spec, f"enable() under {strategy}"):
                backend = get_offload_backend(config(pipe, strategy), platform=platform)
                backend.enable(pipe)
            backends[strategy] = backend
            pipes[strategy] = pipe
        if "layer_wise" in pipes:
            calls: list[int] = []
            handles = [block.register_forward_pre_hook(lambda *a: calls.append(1))
                       for ring in backends["layer_wise"].plan.rings
                       for block in ring.streamed_blocks]
            try:
                with _step(spec, "a generation under layer_wise"), torch.inference_mode():
                    pipes["layer_wise"](**inputs)
            finally:
                for h in handles:
                    h.remove()
            block_calls = len(calls)
        with _step(spec, f"a generation ({', '.join(pipes)}, interleaved)"), \
                torch.inference_mode():
            samples = _interleaved_samples(
                {n: (lambda p=p: p(**inputs)) for n, p in pipes.items()}, repeats,
                platform.synchronize)
    finally:
        for backend in backends.values():
            backend.disable()
    enable: dict[str, float] = {}
    for strategy in strategies:
        pipe = build(f"enable() timing under {strategy}")
        with _step(spec, f"enable() under {strategy}"):
            backend = get_offload_backend(config(pipe, strategy), platform=platform)
            enable[strategy] = _median_enable_s(backend, pipe, platform, repeats)[0]
    gen = {n: statistics.median(ts) for n, ts in samples.items()}
    spread = {n: _spread(ts) for n, ts in samples.items()}
    result: dict[str, Any] = {"pipeline": spec.name, "repeats": repeats, "not_run": skipped,
                              "generation_s": gen, "generation_spread_s": spread,
                              "enable_s": enable,
                              "ratio_to_resident": {n: gen[n] / gen["resident"] for n in gen}}
    if block_calls:
        result["layerwise_block_calls"] = block_calls
        extra = gen["layer_wise"] - gen["resident"]
        noise = max(spread["layer_wise"], spread["resident"])
        # a difference within the spread of the run (or negative: layerwise cannot be faster
        # than the resident pipeline doing the same work plus copies) is no measurement
        below = extra <= noise
        result["layerwise_extra_below_noise"] = below
        result["layerwise_extra_us_per_block_call"] = None if below else \
            1e6 * extra / block_calls
    return result


def format_spec_bench(r: dict[str, Any]) -> str:
    lines = [f"{r['pipeline']} (median of {r['repeats']}, interleaved)",
             f"{'':<12} {'generation':>12} {'x resident':>11} {'enable()':>10}"]
    for name, seconds in r["generation_s"].items():
        en = r["enable_s"].get(name)
        lines.append(f"{name:<12} {1e3 * seconds:>10.2f}ms {r['ratio_to_resident'][name]:>10.2f}x"
                     + (f" {1e3 * en:>8.2f}ms" if en is not None else f" {'-':>10}"))
    lines[0] += f", torch threads: {r['torch_threads']}" if "torch_threads" in r else ""
    spread = r.get("generation_spread_s")
    if spread:
        lines.append("spread (interquartile range of the generations): " + ", ".join(
            f"{n} {1e3 * v:.2f}ms" for n, v in spread.items()))
    if r.get("layerwise_block_calls"):
        head = f"layerwise: {r['layerwise_block_calls']} block calls per generation, "
        extra = r.get("layerwise_extra_us_per_block_call")
        if extra is None or extra < 0:
            gen = r["generation_s"]
            noise = 1e3 * max((spread or {}).get(n, 0.0) for n in ("layer_wise", "resident"))
            lines.append(
                head + "extra time per block call below the noise of this run (medians: "
                f"layerwise {1e3 * gen['layer_wise']:.2f}ms, resident "
                f"{1e3 * gen['resident']:.2f}ms per generation; spread {noise:.2f}ms"
                + ("" if r["repeats"] > 1 else ", unknown with one repeat")
                + "): rerun with more --repeats, or more work per block, on a quiet machine")
        else:
            lines.append(head + f"{extra:.1f} us extra per block call (copies not hidden by "
                         "compute, plus the ring's own work)")
    for strategy, why in r.get("not_run", {}).items():
        lines.append(f"{strategy}: not run, its plan does not resolve: {why}")
    return "\n".join(lines)


# -- per-block host overhead, peers, growth (issue 12) -------------------------------------------

def _interleaved_cpu(fns: dict[str, Callable[[], Any]], repeats: int,
                     syncs: dict[str, Callable[[], None]], *,
                     calls: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """Like :func:`_interleaved`, returning medians of wall seconds and of this thread's CPU
    seconds per call (the CPU time of the calling thread does not count the time the machine
    gave to other processes, so it is the steadier figure on a loaded machine).  ``syncs``
    holds each function's own synchronize (so no function's time includes another's); each
    sample times ``calls`` back-to-back calls and one synchronize."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
        fn()
        syncs[name]()
    for _ in range(repeats):
        for name, fn in fns.items():
            done = syncs[name]
            c, start = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            done()
            wall[name].append((time.perf_counter() - start) / calls)
            cpu[name].append((time.thread_time() - c) / calls)
    return ({n: statistics.median(v) for n, v in wall.items()},
            {n: statistics.median(v) for n, v in cpu.items()})


#: Forwards per timed sample of the many-blocks DiT (a forward is about a millisecond: one
#: sample of several keeps the clock and the synchronize small against it).
_CALLS_PER_SAMPLE = 5


def _no_sync() -> None:
    return None


def _many_blocks(blocks: int, tensors_per_block: int = 1) -> Any:
    from offload_ref.fixtures.many_blocks import build_pipeline

    return build_pipeline(0, blocks, tensors_per_block=tensors_per_block)


def _overhead_row(variants: dict[str, Callable[[], Any]], blocks: int, repeats: int,
                  syncs: dict[str, Callable[[], None]], *, calls: int = 1,
                  ) -> dict[str, dict[str, float]]:
    """Step time and (step - resident step) / blocks of every variant, in one interleaved run.
    ``variants`` must contain ``"resident"``; ``syncs`` holds the variants that have a platform
    to synchronize (Note [Per-block overhead])."""
    wall, cpu = _interleaved_cpu(variants, repeats,
                                 {name: syncs.get(name, _no_sync) for name in variants},
                                 calls=calls)
    out = {}
    for name in variants:
        out[name] = {
            "step_s": wall[name],
            "per_block_overhead_us": (wall[name] - wall["resident"]) / blocks * 1e6,
            "step_cpu_s": cpu[name],
            "per_block_overhead_cpu_us": (cpu[name] - cpu["resident"]) / blocks * 1e6,
        }
    return out


def _enable_layerwise(pipes: dict[str, Any], platforms: dict[str, Any], backends: list[Any]
                      ) -> None:
    """Enable layerwise on ``pipes[name]`` for each platform, appending each backend to
    ``backends`` as it is enabled (so the caller disables those that were, on any failure)."""
    for name, platform in platforms.items():
        backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                          platform)
        backend.enable(pipes[name])
        backends.append(backend)


def per_block_overhead(*, blocks: int = 64, tensors_per_block: int = 1, repeats: int = 30,
                       ) -> dict[str, dict[str, float]]:
    """Layerwise host overhead per block on a DiT of many tiny blocks (Note [Per-block
    overhead]): on the inline platform (the ring's own Python work) beside the floor (Note
    [Per-block floor] in bench_floor.py), and on the CPU platform (with its copy worker,
    stream-order checker on, race amplifier off) in a run of its own."""
    from offload_ref.fixtures.many_blocks import make_input

    from .bench_floor import floor_hooks
    from .platform.inline import InlinePlatform

    x = make_input(0)
    pipes = {name: _many_blocks(blocks, tensors_per_block)
             for name in ("resident", "floor", "inline", "cpu")}
    floor_hooks(list(pipes["floor"].transformer.blocks))
    platforms = {"inline": InlinePlatform(device="cpu"), "cpu": _bench_platform()}
    backends: list[Any] = []
    try:
        _enable_layerwise(pipes, platforms, backends)

        syncs = {name: platform.synchronize for name, platform in platforms.items()}
        with torch.inference_mode():
            fns = {name: (lambda p=p: p.transformer(x)) for name, p in pipes.items()}
            out = _overhead_row({n: fns[n] for n in ("resident", "floor", "inline")}, blocks,
                                repeats, syncs, calls=_CALLS_PER_SAMPLE)
            cpu = _overhead_row({n: fns[n] for n in ("resident", "cpu")}, blocks, repeats, syncs,
                                calls=_CALLS_PER_SAMPLE)
        out["cpu"] = cpu["cpu"]
        return out
    finally:
        for backend in backends:
            backend.disable()
        for platform in platforms.values():
            platform.close()


def _apply_peer(name: str, module: torch.nn.Module) -> None:
    """A peer's hooks onloading to the CPU itself: the no-copies regression timing of
    tests/benchmarks (``test_many_blocks_step_side_by_side``).  Nothing crosses a device there,
    so those timings are never compared with an offloader that copies (the fair side by side is
    :func:`run_peers`)."""
    cpu = torch.device("cpu")
    if name == "diffusers_group_offload":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(module, onload_device=cpu, offload_device=cpu,
                               offload_type="block_level", num_blocks_per_group=1)
    else:
        from accelerate import cpu_offload

        cpu_offload(module, execution_device=cpu)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares exponent b of y = a x^b."""
    import math

    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return (sum((a - mx) * (b - my) for a, b in zip(lx, ly))
            / sum((a - mx) ** 2 for a in lx))


def _enable_time(build: Callable[[], Any], repeats: int) -> tuple[float, int]:
    pipe = build()
    platform = _bench_platform()
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                      platform)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            backend.enable(pipe)
            platform.synchronize()
            times.append(time.perf_counter() - start)
            backend.disable()
    finally:
        platform.close()
    return statistics.median(times), sum(1 for _ in pipe.state_dict().values())


def run_growth(*, block_counts: tuple[int, ...] = (8, 64, 512),
               tensor_counts: tuple[int, ...] = (1_000, 100_000), tensor_blocks: int = 64,
               repeats: int = 7) -> dict[str, Any]:
    """Enable time and per-block overhead against the number of blocks and of tensors, with
    the fitted exponent of each (1.0: linear)."""
    by_blocks = []
    for n in block_counts:
        enable_s, tensors = _enable_time(lambda n=n: _many_blocks(n), repeats)
        overhead = per_block_overhead(blocks=n, repeats=max(5, repeats))
        by_blocks.append({"blocks": n, "tensors": tensors, "enable_s": enable_s,
                          "per_block_overhead_us": overhead["inline"]["per_block_overhead_us"],
                          "per_block_overhead_cpu_us":
                              overhead["inline"]["per_block_overhead_cpu_us"],
                          "per_block_overhead_cpu_platform_us":
                              overhead["cpu"]["per_block_overhead_us"]})
    by_tensors = []
    for count in tensor_counts:
        per_block = max(2, round(count / tensor_blocks))  # a Linear's 2 plus extra buffers
        enable_s, tensors = _enable_time(
            lambda p=per_block: _many_blocks(tensor_blocks, p - 1), max(3, repeats // 2))
        overhead = per_block_overhead(blocks=tensor_blocks, tensors_per_block=per_block - 1,
                                      repeats=max(5, repeats))
        by_tensors.append({"blocks": tensor_blocks, "tensors": tensors, "enable_s": enable_s,
                           "per_block_overhead_us": overhead["inline"]["per_block_overhead_us"],
                           "per_block_overhead_cpu_us":
                               overhead["inline"]["per_block_overhead_cpu_us"]})
    exponents = {
        "enable_vs_blocks": _slope([r["blocks"] for r in by_blocks],
                                   [r["enable_s"] for r in by_blocks]),
        "step_overhead_vs_blocks": _slope(
            [r["blocks"] for r in by_blocks],
            [r["per_block_overhead_cpu_us"] * r["blocks"] for r in by_blocks]),
        "enable_vs_tensors": _slope([r["tensors"] for r in by_tensors],
                                    [r["enable_s"] for r in by_tensors]),
        "per_block_overhead_vs_tensors": _slope(
            [r["tensors"] for r in by_tensors],
            [max(r["per_block_overhead_cpu_us"], 1e-3) for r in by_tensors]),
    }
    return {"by_blocks": by_blocks, "by_tensors": by_tensors, "exponents": exponents}


def format_growth(growth: dict[str, Any]) -> str:
    lines = [f"{'blocks':>7} {'tensors':>8} {'enable ms':>10} {'µs/block inline wall':>21} "
             f"{'µs/block inline cpu':>20}"]
    for r in [*growth["by_blocks"], *growth["by_tensors"]]:
        lines.append(f"{r['blocks']:>7} {r['tensors']:>8} {r['enable_s'] * 1e3:10.1f} "
                     f"{r['per_block_overhead_us']:21.1f} {r['per_block_overhead_cpu_us']:20.1f}")
    lines.append("exponents: " + ", ".join(f"{k} {v:.2f}"
                                           for k, v in growth["exponents"].items()))
    return "\n".join(lines)
