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

from collections.abc import Callable
from typing import Any

import torch

from .backends.layerwise import LayerWiseOffloadBackend
from .config import OffloadConfig, OffloadStrategy
from .platform import get_platform
from .timeline import DeviceModel, recording, replay

__all__ = ["MODEL_ROWS", "format_model_bench", "run_model_bench"]

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
        def ours(pipe: Any) -> Any:
            backend = LayerWiseOffloadBackend(
                OffloadConfig(strategy=OffloadStrategy.LAYER_WISE), get_platform(device),
                prefetch=not name.endswith("no_prefetch"))
            backend.enable(pipe)
            return backend
        return ours

    def peer(pipe: Any) -> Any:
        from . import peers

        offloader = getattr(peers, name)(device, "layer_wise")
        offloader.enable(pipe)
        return offloader
    return peer


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
            try:
                with torch.inference_mode():
                    for _ in range(2):
                        pipe.transformer(x, t, context)
                    torch.accelerator.synchronize(dev)
                    with recording() as ops:
                        result = pipe.transformer(x, t, context)
                        torch.accelerator.synchronize(dev)
                result = result.cpu()
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
                   "accelerator's own streams do not overlap, so these are not timings of it")
    return out


def format_model_bench(r: dict[str, Any]) -> str:
    m, c = r["model"], r["config"]
    lines = [
        f"Modeled DiT step on {m['name']} (h2d {m['h2d_gbps']:g} GB/s, "
        f"{m['tflops_fp32']:g} TFLOP/s fp32, {m['memory_gbps']:g} GB/s memory, launch "
        f"{m['launch_us']:g} us/op): heavy fixture, hidden {c['hidden']}, {c['blocks']} blocks "
        f"of {c['block_bytes'] / 2**20:.2f} MiB, {c['tokens']} tokens; compute / copy per block "
        f"{r['compute_over_copy_per_block']}",
        f"{'row':<38} {'step us':>9} {'bound us':>9} {'x bound':>8} {'serial us':>10} "
        f"{'stall us/blk':>12} {'h2d MiB':>8} {'bitwise':>8}",
    ]
    for name, row in r["rows"].items():
        lines.append(
            f"{name:<38} {row['total_s'] * 1e6:>9.1f} {row['bound_s'] * 1e6:>9.1f} "
            f"{row['ratio']:>8.3f} {row['serial_s'] * 1e6:>10.1f} "
            f"{row['stall_per_block_us']:>12.2f} {row['h2d_bytes'] / 2**20:>8.2f} "
            f"{'yes' if row['bitwise_equal_to_resident'] else 'NO':>8}")
    for name, why in r["skipped"].items():
        lines.append(f"{name:<38} skipped: {why}")
    lines.append(r["note"])
    lines += [f"  source: {s}" for s in m["sources"]]
    return "\n".join(lines)
