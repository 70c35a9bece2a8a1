"""``torchrun --nproc-per-node N -m offload_ref.distributed``: distributed layerwise offload of a
fixture pipeline (or your own spec) across N ranks, one request per rank.

Every rank runs its own request (the spec's inputs for ``seed + rank``), first without offload
(the single-process reference of that request), then under distributed layerwise offload through
a :class:`~offload_ref.distributed.WaveRunner`, and prints one line: its host bytes for the
streamed blocks, its peak device bytes, the step time of both runs, the bytes it gathered, and
whether its output equals the reference bit for bit.  The exit status is 0 when every rank
matched.

Examples::

    torchrun --nproc-per-node 2 -m offload_ref.distributed --pipeline cosmos3
    torchrun --nproc-per-node 2 -m offload_ref.distributed --pipeline flux2 --transfer rank-local
    torchrun --nproc-per-node 2 -m offload_ref.distributed --spec mypkg.testing:SPEC

Without torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment) it runs one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run_rank"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m offload_ref.distributed",
                                description=(__doc__ or "").split("\n\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--pipeline", default="cosmos3", help="a fixture name (default: cosmos3)")
    what.add_argument("--spec", help="MODULE:ATTR of a PipelineSpec with importable factory "
                                     "and inputs")
    p.add_argument("--transfer", choices=["allgather", "rank-local"], default="allgather",
                   help="how streamed blocks reach each rank's device (default: allgather)")
    p.add_argument("--resident-layers", type=int, default=0,
                   help="leading DiT blocks kept on the device (rank-local only)")
    p.add_argument("--steps", type=int, default=None,
                   help="num_inference_steps of every request (default: the spec's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits for the others at enable and at each wave")
    p.add_argument("--bandwidth-mb", type=float, default=0.0,
                   help="also time all_gather_into_tensor of this many MB (output size) after "
                        "the generation and print its GB/s (0: skip)")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write this rank's result as JSON to PATH (a {rank} in it is replaced)")
    return p


def _spec(args: argparse.Namespace) -> Any:
    from offload_ref.contracts.spec import PipelineSpec, load_object

    if args.spec:
        spec = load_object(args.spec)
        if not isinstance(spec, PipelineSpec):
            raise SystemExit(f"--spec {args.spec}: expected a PipelineSpec, got "
                             f"{type(spec).__name__}")
        return spec
    from offload_ref.fixtures import get_spec

    try:
        return get_spec(args.pipeline)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None


def _init(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # one process, no group: world 1
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def _outputs_equal(got: Any, want: Any) -> bool:
    """Bit for bit, leaf by leaf, as the kit compares: a tensor, or a diffusers output object,
    a tuple or a dict of tensors and numpy arrays (a non-tensor output used to read as
    different)."""
    from offload_ref.contracts.diagnosis import leaf_difference, leaves

    try:
        g, w = leaves(got), leaves(want)
    except TypeError:
        return False
    return [p for p, _ in g] == [p for p, _ in w] and all(
        leaf_difference(a, b) is None for (_, a), (_, b) in zip(g, w))


def run_rank(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run this rank's part (torch.distributed initialized, or a single process); returns what
    it printed, as a dict."""
    args = _parser().parse_args(argv)  # first: --help and usage errors need no torch

    import torch
    import torch.distributed as dist

    from offload_ref import OffloadConfig, get_offload_backend
    from offload_ref.distributed import Rendezvous, WaveRunner
    from offload_ref.platform import get_platform

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _init(device)
    if device.startswith("cuda") and dist.is_initialized():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', dist.get_rank()))}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    spec = _spec(args)
    from offload_ref.contracts.spec import load_object

    request = dict(load_object(spec.inputs)(seed=spec.seed + rank))
    if args.steps is not None:
        request["num_inference_steps"] = args.steps
    steps = request.get("num_inference_steps", 1)
    factory = load_object(spec.factory)

    def timed(pipeline: Any, runner: Any = None) -> tuple[Any, float]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = runner.run(request) if runner is not None else pipeline(**request)
        return out, time.perf_counter() - start

    reference, ref_s = timed(factory(seed=spec.seed))
    options: dict[str, Any] = {"weight_transfer": args.transfer}
    if args.resident_layers:
        options["resident_layers"] = args.resident_layers
    config = OffloadConfig(strategy="distributed_layer_wise", components=("dit",),
                           layer_options={"dit": options}, world_size=world)
    platform = get_platform(device)
    backend = get_offload_backend(config, platform=platform, timeout_s=args.timeout)
    pipeline = factory(seed=spec.seed)
    backend.enable(pipeline)
    rendezvous = Rendezvous.default(namespace="offload_ref/cli", timeout_s=args.timeout) \
        if world > 1 else None
    runner = WaveRunner(pipeline, rendezvous=rendezvous)
    timed(pipeline, runner)  # warm-up: first-call costs are not the step time
    out, off_s = timed(pipeline, runner)
    stats = backend.stats()
    backend.disable()
    same = _outputs_equal(out, reference)
    gbps = _allgather_gbps(args.bandwidth_mb, world, platform.device) \
        if args.bandwidth_mb and world > 1 else None
    result = {
        "rank": rank, "world": world, "pipeline": spec.name, "device": str(platform.device),
        "transfer": args.transfer, "host_block_bytes": stats.host_bytes,
        "host_padding_bytes": stats.host_padding_bytes,
        "file_backed_bytes": stats.file_backed_bytes,
        "peak_device_bytes": stats.peak_device_bytes,
        "gathered_bytes_per_generation": stats.collective_bytes // 2,
        "reference_step_ms": ref_s / steps * 1e3, "offloaded_step_ms": off_s / steps * 1e3,
        "bitwise_equal": same, "allgather_gbps": gbps,
    }
    print(f"[rank {rank}/{world}] {spec.name} {args.transfer}: host block bytes "
          f"{stats.host_bytes} (+{stats.host_padding_bytes} padding), peak device bytes "
          f"{stats.peak_device_bytes}, step {result['reference_step_ms']:.2f} ms resident vs "
          f"{result['offloaded_step_ms']:.2f} ms offloaded, gathered "
          f"{result['gathered_bytes_per_generation']} bytes per generation, output "
          f"{'equals' if same else 'DIFFERS FROM'} the single-process reference"
          + (f"; all_gather of {args.bandwidth_mb:g} MB: {gbps:.2f} GB/s" if gbps else ""),
          flush=True)
    if args.json_path:
        with open(args.json_path.replace("{rank}", str(rank)), "w") as f:
            json.dump(result, f, indent=2)
    return result


def _allgather_gbps(mb: float, world: int, device: Any, repeats: int = 5) -> float:
    """Output bytes per second of an in-place all_gather_into_tensor of ``mb`` MB, the median of
    ``repeats`` (after one warm-up), as the ring's gathers use it."""
    import statistics

    import torch
    import torch.distributed as dist

    n = max(world, int(mb * 1e6) // world * world)
    out = torch.zeros(n, dtype=torch.uint8, device=device)
    mine = out.narrow(0, dist.get_rank() * (n // world), n // world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        gather(out, mine)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        if i:
            times.append(time.perf_counter() - start)
    return n / statistics.median(times) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    result = run_rank(argv)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
