"""``offload-ref bench --model NAME``: every offloader's DiT step on a modeled GPU (Note [Modeled
timeline] in offload_ref/timeline.py).

Each row enables one offloader on the heavy fixture on the simulated accelerator, runs two
warm-up steps (an offloader that learns its order on the first step has learned it), records
one step under :func:`~offload_ref.timeline.recording` and replays it on the model: modeled
step time, the bound ``max(compute, streamed bytes / h2d bandwidth)``, their ratio, the
serial sum (compute + copies, nothing overlapped), the compute stalls per block and the bytes
copied.  Every row's output is compared bitwise with the resident step.  The numbers depend on
the program's order alone, so two runs print the same table on any machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .backends.layerwise import LayerWiseOffloadBackend
from .config import OffloadConfig, OffloadStrategy
from .platform import get_platform
from .timeline import DeviceModel, recording, replay

__all__ = ["MODEL_ROWS", "RESIDENCY_SIZES", "calibrate", "format_calibration",
           "format_model_bench", "format_residency_bench", "measure_rows", "run_calibration",
           "run_model_bench", "run_residency_bench"]

#: The rows of ``bench --model``, in order (a peer's row is skipped, with why, where its
#: package is missing).
MODEL_ROWS = ("resident", "offload_ref_layerwise", "offload_ref_layerwise_no_prefetch",
              "diffusers_group_offload_block", "diffusers_group_offload_block_stream",
              "accelerate_cpu_offload")


def _offloader(name: str, device: torch.device) -> Callable[[Any], Any]:
    """``enable(pipeline)`` for row ``name``, returning what ``disable()`` undoes (or None)."""
    if name == "resident":
        def resident(pipe: Any) -> None:
            from .contracts.case import move_to_device

            move_to_device(pipe, device)
        return resident
    if name.startswith("offload_ref_layerwise"):
        head, depth, strided = _shape_of(name)

        def ours(pipe: Any) -> Any:
            backend = LayerWiseOffloadBackend(
                OffloadConfig(strategy=OffloadStrategy.LAYER_WISE), get_platform(device),
                prefetch=not name.endswith("no_prefetch"), prefetch_depth=depth)
            if strided:  # Note [Resident blocks] in plan/resolver.py
                import dataclasses

                from .plan import OffloadPlan

                plan = getattr(pipe, "_offload_plan", None) or OffloadPlan()
                pipe.__dict__["_offload_plan"] = dataclasses.replace(
                    plan, layerwise_resident_layers={"transformer": strided},
                    layerwise_resident_policy={"transformer": "strided"})
            elif head:
                backend.resident_heads = {"transformer": head}
            backend.enable(pipe)
            return backend
        return ours

    def peer(pipe: Any) -> Any:
        from . import peers

        offloader = getattr(peers, name)(device, "layer_wise")
        offloader.enable(pipe)
        return offloader
    return peer


def _shape_of(name: str) -> tuple[int, int, int]:
    """(resident head, prefetch depth, strided resident blocks) of an offload-ref row:
    ``offload_ref_layerwise_headN`` keeps N leading blocks resident, ``..._stridedN`` N blocks
    spread through the ring, ``..._depthN`` copies N blocks ahead."""
    tail = name.rpartition("_")[2]
    for key in ("head", "depth", "strided"):
        if tail.startswith(key) and tail[len(key):].isdigit():
            n = int(tail[len(key):])
            return {"head": (n, 1, 0), "depth": (0, n, 0), "strided": (0, 1, n)}[key]
    return 0, 1, 0


def _missing(name: str) -> str | None:
    package = name.split("_")[0]
    if package not in ("diffusers", "accelerate"):
        return None
    try:
        __import__(package)
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip the row
        return f"{package} not importable: {exc}"
    return None


def run_model_bench(model: DeviceModel, *, hidden: int = 128, blocks: int = 8,
                    tokens: int = 8192, device: str | torch.device = "hpu:0",
                    rows: tuple[str, ...] = MODEL_ROWS) -> dict[str, Any]:
    """The table of ``bench --model``: each of ``rows`` on the heavy fixture's DiT step
    (``hidden``, ``blocks``, ``tokens``) replayed on ``model``."""
    from .fixtures.heavy import HeavyConfig, build_pipeline
    from .platform import simulated

    dev = torch.device(device)
    if dev.type != simulated.DEVICE_TYPE:
        raise ValueError(f"bench --model records the simulated accelerator's stream order: "
                         f"--device {dev} is not one of its devices ({simulated.DEVICE_TYPE}:N)")
    simulated.available()
    config = HeavyConfig(hidden=hidden, blocks=blocks, tokens=tokens, steps=1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    t, context = torch.tensor([0.5]).to(dev), torch.randn(1, hidden, generator=g).to(dev)
    out: dict[str, Any] = {
        "model": {"name": model.name, "h2d_gbps": model.h2d_gbps, "d2h_gbps": model.d2h_gbps,
                  "memory_gbps": model.memory_gbps, "tflops_fp32": model.tflops_fp32,
                  "tflops_16": model.tflops_16, "launch_us": model.launch_us,
                  "kernel_min_us": model.kernel_min_us, "sources": list(model.sources)},
        "config": {"hidden": hidden, "blocks": blocks, "tokens": tokens,
                   "block_bytes": config.block_bytes, "device": str(dev)},
        "rows": {}, "skipped": {},
    }
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    reference = None
    try:
        for name in rows:
            why = _missing(name)
            if why is not None:
                out["skipped"][name] = why
                continue
            pipe = build_pipeline(0, config)
            handle = _offloader(name, dev)(pipe)
            device_bytes = None
            try:
                with torch.inference_mode():
                    for _ in range(2):
                        pipe.transformer(x, t, context)
                    torch.accelerator.synchronize(dev)
                    with recording() as ops:
                        result = pipe.transformer(x, t, context)
                        torch.accelerator.synchronize(dev)
                result = result.cpu()
                if isinstance(handle, LayerWiseOffloadBackend):
                    device_bytes = handle.stats().peak_device_bytes
            finally:
                if handle is not None:
                    handle.disable()
            if reference is None:
                reference = result
            line = replay(ops, model)
            out["rows"][name] = {
                **line.as_dict(),
                "serial_s": line.compute_s + line.h2d_s + line.d2h_s,
                "stall_per_block_us": line.stall_s / blocks * 1e6,
                "peak_device_bytes": device_bytes,
                "bitwise_equal_to_resident": bool(torch.equal(result, reference)),
            }
    finally:
        torch.set_num_threads(previous)
    compute = [r["compute_s"] for r in out["rows"].values()]
    copies = [r["h2d_s"] for n, r in out["rows"].items() if n != "resident"]
    out["compute_over_copy_per_block"] = (round(max(compute) / max(copies), 3)
                                          if compute and copies and max(copies) else None)
    out["note"] = ("modeled from the recorded stream order (Note [Modeled timeline] in "
                   "offload_ref/timeline.py): the same numbers on every run; the simulated "
                   "accelerator's own streams do not overlap, so these are not timings of it. "
                   "bound = max(compute, streamed bytes / h2d bandwidth); serial = compute + "
                   "copies with nothing overlapped; idle = time no engine was busy, the device "
                   "waiting for the host's launches (a row that overlaps nothing takes serial + "
                   "idle: blocking copies expose a launch each); launch = ops x launch cost, the "
                   "host's floor (a row whose launch exceeds its bound is launch-bound)")
    return out


#: ``bench --model``'s second table: a copy-bound size (8 MiB blocks, compute about half a
#: block's copy on the shipped models) where the use of spare device bytes decides the step.
RESIDENCY_SIZES = {"hidden": 512, "blocks": 8, "tokens": 1024}


def run_residency_bench(model: DeviceModel, *, hidden: int = 512, blocks: int = 8,
                        tokens: int = 1024, extra: tuple[int, ...] = (1, 2, 3),
                        device: str | torch.device = "hpu:0") -> dict[str, Any]:
    """Residency against deeper prefetch at equal device bytes (issue 35, item 5): for each
    ``e`` in ``extra`` spare blocks of device memory beyond layerwise's two slots, offload-ref
    layerwise with ``e`` resident blocks, leading (a head) and strided, beside prefetch depth
    ``e + 1`` (none resident), each modeled on ``model``; with plain layerwise and prefetch off
    for scale."""
    rows = ("resident", "offload_ref_layerwise", "offload_ref_layerwise_no_prefetch",
            *(f"offload_ref_layerwise_head{e}" for e in extra),
            *(f"offload_ref_layerwise_strided{e}" for e in extra),
            *(f"offload_ref_layerwise_depth{e + 1}" for e in extra))
    out = run_model_bench(model, hidden=hidden, blocks=blocks, tokens=tokens, device=device,
                          rows=rows)
    r = out["rows"]
    out["pairs"] = [{
        "spare_blocks": e,
        "head_device_bytes": r[f"offload_ref_layerwise_head{e}"]["peak_device_bytes"],
        "depth_device_bytes": r[f"offload_ref_layerwise_depth{e + 1}"]["peak_device_bytes"],
        "head_step_s": r[f"offload_ref_layerwise_head{e}"]["total_s"],
        "strided_step_s": r[f"offload_ref_layerwise_strided{e}"]["total_s"],
        "strided_device_bytes": r[f"offload_ref_layerwise_strided{e}"]["peak_device_bytes"],
        "depth_step_s": r[f"offload_ref_layerwise_depth{e + 1}"]["total_s"],
        "head_over_depth": round(r[f"offload_ref_layerwise_head{e}"]["total_s"]
                                 / r[f"offload_ref_layerwise_depth{e + 1}"]["total_s"], 4),
    } for e in extra]
    return out


def format_residency_bench(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"At equal device bytes, on {r['model']['name']} (hidden {c['hidden']}, {c['blocks']} "
        f"blocks of {c['block_bytes'] / 2**20:.2f} MiB, {c['tokens']} tokens; compute / copy "
        f"per block {r['compute_over_copy_per_block']}): spare blocks kept resident (head) "
        "against spread through the ring (strided) against spent on deeper prefetch (depth)",
        f"{'spare':>5} {'head MiB':>9} {'depth MiB':>9} {'head us':>9} {'strided us':>10} "
        f"{'depth us':>9} {'head/depth':>10}",
    ]
    for p in r["pairs"]:
        lines.append(f"{p['spare_blocks']:>5} {p['head_device_bytes'] / 2**20:>9.2f} "
                     f"{p['depth_device_bytes'] / 2**20:>9.2f} {p['head_step_s'] * 1e6:>9.1f} "
                     f"{p['strided_step_s'] * 1e6:>10.1f} "
                     f"{p['depth_step_s'] * 1e6:>9.1f} {p['head_over_depth']:>10.3f}")
    return "\n".join(lines)


def format_model_bench(r: dict[str, Any]) -> str:
    m, c = r["model"], r["config"]
    lines = [
        f"Modeled DiT step on {m['name']} (h2d {m['h2d_gbps']:g} GB/s, "
        f"{m['tflops_fp32']:g} TFLOP/s fp32, {m['memory_gbps']:g} GB/s memory, launch "
        f"{m['launch_us']:g} us/op): heavy fixture, hidden {c['hidden']}, {c['blocks']} blocks "
        f"of {c['block_bytes'] / 2**20:.2f} MiB, {c['tokens']} tokens; compute / copy per block "
        f"{r['compute_over_copy_per_block']}",
        f"{'row':<38} {'step us':>9} {'bound us':>9} {'x bound':>8} {'serial us':>10} "
        f"{'idle us':>8} {'launch us':>9} {'stall us/blk':>12} {'h2d MiB':>8} {'bitwise':>8}",
    ]
    for name, row in r["rows"].items():
        lines.append(
            f"{name:<38} {row['total_s'] * 1e6:>9.1f} {row['bound_s'] * 1e6:>9.1f} "
            f"{row['ratio']:>8.3f} {row['serial_s'] * 1e6:>10.1f} {row['idle_s'] * 1e6:>8.1f} "
            f"{row['launch_s'] * 1e6:>9.1f} "
            f"{row['stall_per_block_us']:>12.2f} {row['h2d_bytes'] / 2**20:>8.2f} "
            f"{'yes' if row['bitwise_equal_to_resident'] else 'NO':>8}")
    for name, why in r["skipped"].items():
        lines.append(f"{name:<38} skipped: {why}")
    lines.append(r["note"])
    lines += [f"  source: {s}" for s in m["sources"]]
    return "\n".join(lines)


# -- calibration on a real device --------------------------------------------------------------


def _median_s(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def calibrate(device: str | torch.device, *, copy_mib: int = 64, matmul: int = 2048,
              repeats: int = 5) -> DeviceModel:
    """A :class:`~offload_ref.timeline.DeviceModel` measured on ``device``: pinned host ->
    device and device -> host rates (``copy_mib`` MiB), device memory bandwidth (a device copy
    of it: read and write), dense matmul rates (``matmul``-square, fp32 and bf16), the host's
    time per launched op (a chain of tiny adds, no synchronize between them) and the shortest
    op (one tiny add, synchronized).  Medians of ``repeats``."""
    dev = torch.device(device)
    sync = lambda: torch.accelerator.synchronize(dev)  # noqa: E731
    n = copy_mib * 2**20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(n, dtype=torch.uint8, device=dev)
    other = torch.empty_like(on_device)
    h2d = _median_s(lambda: on_device.copy_(host, non_blocking=True), sync, repeats)
    d2h = _median_s(lambda: host.copy_(on_device, non_blocking=True), sync, repeats)
    d2d = _median_s(lambda: other.copy_(on_device), sync, repeats)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(matmul, matmul, device=dev).to(dtype)
        b = torch.randn(matmul, matmul, device=dev).to(dtype)
        rates[dtype] = 2 * matmul**3 / _median_s(lambda a=a, b=b: a @ b, sync, repeats)
    tiny = torch.zeros(1, device=dev)
    chain = 200

    def launches() -> None:
        for _ in range(chain):
            tiny.add_(1)

    start = time.perf_counter()
    launches()
    launch = (time.perf_counter() - start) / chain
    sync()
    one = _median_s(lambda: tiny.add_(1), sync, max(repeats, 20))
    return DeviceModel(
        f"calibrated on {dev}", h2d_gbps=n / h2d / 1e9, d2h_gbps=n / d2h / 1e9,
        memory_gbps=2 * n / d2d / 1e9, tflops_fp32=rates[torch.float32] / 1e12,
        tflops_16=rates[torch.bfloat16] / 1e12, launch_us=launch * 1e6,
        kernel_min_us=max(0.0, one - launch) * 1e6,
        sources=(f"measured on {dev} by offload-ref bench --calibrate: {copy_mib} MiB pinned "
                 f"copies each way and a device copy, {matmul}-square matmuls in fp32 and bf16, "
                 f"{chain} tiny ops launched back to back; medians of {repeats}",))


def measure_rows(device: str | torch.device, *, hidden: int, blocks: int, tokens: int,
                 rows: tuple[str, ...] = MODEL_ROWS, repeats: int = 5) -> dict[str, Any]:
    """Each of ``rows``'s DiT step on ``device`` itself, wall-clock median of ``repeats`` after
    two warm-up steps, each sample ending with a device synchronize, and whether its output is
    bitwise equal to the resident row's."""
    from .fixtures.heavy import HeavyConfig, build_pipeline

    dev = torch.device(device)
    config = HeavyConfig(hidden=hidden, blocks=blocks, tokens=tokens, steps=1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    t, context = torch.tensor([0.5]).to(dev), torch.randn(1, hidden, generator=g).to(dev)
    out: dict[str, Any] = {}
    reference = None
    for name in rows:
        if _missing(name) is not None:
            continue
        pipe = build_pipeline(0, config)
        handle = _offloader(name, dev)(pipe)
        try:
            with torch.inference_mode():
                step = lambda: pipe.transformer(x, t, context)  # noqa: E731
                seconds = _median_s(step, lambda: torch.accelerator.synchronize(dev), repeats)
                result = step().cpu()
        finally:
            if handle is not None:
                handle.disable()
        if reference is None:
            reference = result
        out[name] = {"measured_s": seconds,
                     "bitwise_equal_to_resident": bool(torch.equal(result, reference))}
    return out


def _modeled_apart(model: DeviceModel, sizes: dict[str, int]) -> dict[str, Any]:
    """:func:`run_model_bench` of ``model`` in a process of its own with no GPU visible: one
    process serves one accelerator through ``torch.accelerator``, and the recording is the
    simulated accelerator's, while the calibration ran on the GPU."""
    import json
    import os
    import subprocess
    import sys
    from dataclasses import asdict

    fields = {k: v for k, v in asdict(model).items() if k not in ("name", "sources")}
    text = ",".join(f"{k}={v!r}" for k, v in fields.items())
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_REF_SIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "offload_ref.cli", "bench", "--model", text, "--json",
           "--no-residency", *(f"--{k}={v}" for k, v in sizes.items())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the modeled table of {model.name} failed ({' '.join(cmd)}):\n"
                           f"{done.stderr.strip()}")
    return json.loads(done.stdout)


def run_calibration(model: DeviceModel, device: str | torch.device, *, hidden: int, blocks: int,
                    tokens: int, matmul: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """``bench --model NAME --calibrate --device D``: the model calibrated on ``D``
    (:func:`calibrate`), every row recorded on the simulated accelerator and replayed on both
    ``model`` and the calibrated one, and each row measured on ``D`` itself."""
    from .platform import simulated

    calibrated = calibrate(device, matmul=matmul, repeats=repeats)
    sizes = dict(hidden=hidden, blocks=blocks, tokens=tokens)
    named = _modeled_apart(model, sizes)
    out = _modeled_apart(calibrated, sizes)
    out["model"].update(name=calibrated.name, sources=list(calibrated.sources))
    named["model"].update(name=model.name, sources=list(model.sources))
    out["named"] = {"model": named["model"], "rows": named["rows"]}
    out["measured"] = measure_rows(device, hidden=hidden, blocks=blocks, tokens=tokens,
                                   rows=tuple(out["rows"]), repeats=repeats)
    out["calibrated_on"] = str(torch.device(device))
    if torch.device(device).type == simulated.DEVICE_TYPE:
        out["note"] += (". Calibrated on the simulated accelerator itself: its streams run one "
                        "after another, so its measured steps are serial, whatever the model "
                        "says of overlap")
    return out


def format_calibration(r: dict[str, Any]) -> str:
    """``bench --model NAME --calibrate``: the calibrated model's table, then each row modeled
    on NAME and on the calibrated model beside its step measured on the device."""
    name = r["named"]["model"]["name"]
    lines = [format_model_bench(r), "",
             f"measured on {r['calibrated_on']} (wall medians) beside the model calibrated there "
             f"and {name}:",
             f"{'row':<38} {name + ' us':>14} {'calibrated us':>14} {'measured us':>12} "
             f"{'measured/calibrated':>20} {'bitwise':>8}"]
    for row_name, row in r["rows"].items():
        measured = r["measured"].get(row_name)
        if measured is None:
            continue
        lines.append(f"{row_name:<38} {r['named']['rows'][row_name]['total_s'] * 1e6:>14.1f} "
                     f"{row['total_s'] * 1e6:>14.1f} {measured['measured_s'] * 1e6:>12.1f} "
                     f"{measured['measured_s'] / row['total_s']:>20.3f} "
                     f"{'yes' if measured['bitwise_equal_to_resident'] else 'NO':>8}")
    return "\n".join(lines)
