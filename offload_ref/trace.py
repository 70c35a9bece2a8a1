"""``offload-ref trace``: one generation under ``torch.profiler``, written as a Chrome trace.

The offloader's own ranges (Note [Spans] in ``_spans.py``) are ordinary ``record_function``
ranges, so the trace is torch's own: it opens in Perfetto (ui.perfetto.dev) and chrome://tracing
and carries every aten op and, on CUDA, every kernel and memcpy next to them.  ``--png`` draws a
summary timeline with matplotlib (the optional extra ``offload-ref[trace]``): one lane per
thread or stream, ranges coloured by block, stalls (long waits) marked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["add_trace_parser", "draw_timeline", "offload_spans", "run_trace"]

#: A built-in pipeline that ``trace`` (and ``bench``) know beyond the kit's fixtures: the heavy
#: DiT-shaped one, whose blocks take long enough to compute that overlap is visible.
_HEAVY = "heavy"
_BLOCK_INDEX = re.compile(r"\bblock=(\d+)")
_MISSING_MATPLOTLIB = ('offload-ref trace: error: --png needs matplotlib; '
                       'pip install "offload-ref[trace]"')


def _heavy_spec() -> Any:
    from offload_ref.contracts.spec import PipelineSpec

    return PipelineSpec(
        name=_HEAVY, factory="offload_ref.fixtures.heavy:build_pipeline",
        inputs="offload_ref.fixtures.heavy:make_inputs",
        strategies=("model_level", "layer_wise", "distributed_layer_wise"),
        description="the benchmark pipeline (fixtures/heavy.py, default HeavyConfig)")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


def _worker_thread_names() -> dict[int, str]:
    """Native thread id -> a track name, for the CPU platform's copy-stream workers."""
    prefix = "offload_ref-cpu-stream-"
    return {t.native_id: f"offload_ref CPU stream '{t.name[len(prefix):]}' (copy worker)"
            for t in threading.enumerate() if t.name.startswith(prefix) and t.native_id}


def _name_threads(path: str, names: dict[int, str]) -> None:
    """Give the profiler's thread tracks readable names (Perfetto and chrome://tracing show the
    ``thread_name`` metadata events)."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            name = names.get(event.get("tid"))
            if name is not None:
                event.setdefault("args", {})["name"] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)


def _all_threads(log: Callable[[str], None]) -> Any:
    """The profiler config that records ranges of every thread: the CPU platform's copy worker
    is a thread the profiler did not start on, whose ranges are dropped otherwise (Note [Spans]
    in _spans.py).  None (with a note) on a torch without the option."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        log(f"offload-ref trace: torch {torch.__version__} cannot profile all threads; the CPU "
            "platform's copy ranges will be missing (CUDA's are on the issuing thread)")
        return None


def run_trace(spec: Any, strategy: str, output: str, *, prefetch: bool = True,
              device: str = "cpu", threads: int = 1,
              log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Enable ``strategy`` on a fresh pipeline of ``spec``, run one warm-up generation, then one
    generation under ``torch.profiler``, and export its Chrome trace to ``output``.  Returns a
    summary (span counts per kind)."""
    from torch.profiler import ProfilerActivity, profile

    from offload_ref.backends import get_offload_backend
    from offload_ref.config import OffloadConfig, OffloadStrategy
    from offload_ref.plan import selectable_components
    from offload_ref.platform import CpuPlatform, get_platform

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    platform = CpuPlatform() if device == "cpu" else get_platform(device)
    pipeline = spec.build()
    inputs = {k: _to_device(v, platform.device) for k, v in spec.make_inputs().items()}
    config = OffloadConfig(strategy=OffloadStrategy(strategy),
                           components=selectable_components(pipeline, strategy))
    options = {} if strategy == "model_level" else {"prefetch": prefetch}
    backend = get_offload_backend(config, platform=platform, **options)
    activities = [ProfilerActivity.CPU]
    if platform.name == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        backend.enable(pipeline)
        with torch.inference_mode():
            pipeline(**inputs)  # warm-up: first swaps, the ring learns the caller's order
            platform.synchronize()
            with _without_profiler_chatter(), \
                    profile(activities=activities, experimental_config=_all_threads(log)) as prof:
                pipeline(**inputs)
                platform.synchronize()
        names = {threading.main_thread().native_id: "compute (caller thread)",
                 threading.get_native_id(): "compute (caller thread)",
                 **_worker_thread_names()}
    finally:
        backend.disable()
        torch.set_num_threads(previous_threads)
    prof.export_chrome_trace(output)
    _name_threads(output, names)
    counts: dict[str, int] = {}
    for event in offload_spans(output):
        kind = event["name"].split()[0].split(".", 1)[1]
        counts[kind] = counts.get(kind, 0) + 1
    log(f"offload-ref trace: {spec.name} / {strategy} (prefetch {'on' if prefetch else 'off'}) "
        f"on {platform.name}: {output} with "
        + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no offload_ref spans"))
    return {"spans": counts}


#: lines Kineto writes to stderr at every profiler start and stop, whatever its log level
_CHATTER = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _without_profiler_chatter() -> Any:
    """Hold back Kineto's own ``USDT:``/``STAGE:`` lines (written by C++ to file descriptor 2)
    while profiling; every other line written to stderr meanwhile is passed on afterwards."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (an embedded interpreter): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(_CHATTER):
                    sys.stderr.write(line)
            sys.stderr.flush()


def offload_spans(path: str) -> list[dict[str, Any]]:
    """The complete (``"ph": "X"``) ``offload_ref.*`` events of a Chrome trace, by start time."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and str(e.get("name", "")).startswith("offload_ref.")]
    return sorted(events, key=lambda e: float(e["ts"]))


# -- the picture -------------------------------------------------------------------------------

def draw_timeline(trace_path: str, png_path: str, *, stall_ms: float = 0.5) -> None:
    """One lane per thread track with offloader ranges (and per CUDA stream with kernels), each
    range coloured by its block; waits longer than ``stall_ms`` are marked as stalls.  Raises
    ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace_path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    thread_names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
                    for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ours = [e for e in events
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("offload_ref.")]
    gpu = [e for e in events if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ours:
        raise ValueError(f"{trace_path}: no offload_ref spans to draw")
    t0 = min(float(e["ts"]) for e in ours + gpu)
    lanes: dict[Any, list[dict[str, Any]]] = {}
    for e in ours:
        lanes.setdefault(("cpu", e.get("pid"), e.get("tid")), []).append(e)
    for e in gpu:
        lanes.setdefault(("gpu", e.get("pid"), e.get("tid")), []).append(e)
    order = sorted(lanes, key=lambda key: (key[0] == "gpu",
                                           not any(".block " in e["name"] for e in lanes[key]),
                                           str(key)))
    tab10 = plt.get_cmap("tab10")
    palette = [tab10(i) for i in range(10) if i not in (3, 7)]  # red means a stall, grey idle

    def cmap(index: int) -> Any:
        return palette[index % len(palette)]

    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(order)))
    stalls = 0
    for row, key in enumerate(order):
        for e in lanes[key]:
            start, dur = (float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0)) / 1e3
            name = str(e["name"])
            match = _BLOCK_INDEX.search(name)
            colour = cmap(int(match.group(1))) if match else "0.6"
            if key[0] == "gpu":
                ax.broken_barh([(start, dur)], (row - 0.3, 0.6), color="0.4")
            elif name.startswith("offload_ref.wait"):
                if dur >= stall_ms:
                    stalls += 1
                    ax.broken_barh([(start, dur)], (row - 0.45, 0.9), facecolor="red",
                                   edgecolor="darkred", hatch="//", alpha=0.8)
            elif name.startswith("offload_ref.block"):
                ax.broken_barh([(start, dur)], (row - 0.35, 0.7), facecolor=colour,
                               edgecolor="black", linewidth=0.3)
            else:  # copy, collective
                ax.broken_barh([(start, dur)], (row - 0.25, 0.5), facecolor=colour,
                               edgecolor="black", linewidth=0.3,
                               hatch=".." if name.startswith("offload_ref.collective") else None)
    labels = []
    for key in order:
        kind, pid, tid = key
        if kind == "gpu":
            labels.append(f"CUDA stream {tid}")
        else:
            labels.append(thread_names.get((pid, tid)) or f"thread {tid}")
    # Each pass over the DiT starts with its first block's compute: a dotted line per pass
    # (a denoising step makes one pass, or two under classifier-free guidance).
    starts = sorted((float(e["ts"]) - t0) / 1e3 for e in ours
                    if str(e["name"]).startswith("offload_ref.block")
                    and (m := _BLOCK_INDEX.search(str(e["name"]))) and int(m.group(1)) == 0)
    for n, start in enumerate(starts):
        ax.axvline(start, color="0.3", linestyle=":", linewidth=0.8)
        ax.text(start, -0.6, f"pass {n + 1}", fontsize="x-small", va="bottom")
    ax.set_yticks(range(len(order)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first offloader range")
    ax.set_title(f"offload_ref timeline: {trace_path} (colour = block; red hatched = wait "
                 f">= {stall_ms:g} ms, {stalls} stall(s))", pad=16)  # room for the pass labels
    ax.legend(handles=[Patch(facecolor="red", hatch="//", label="stall (wait)"),
                       Patch(facecolor=cmap(0), label="block 0 (compute or its copy)"),
                       Patch(facecolor=cmap(1), label="block 1 ..."),
                       Patch(facecolor="white", edgecolor="0.3", linestyle=":",
                             label="a pass over the DiT begins")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120, bbox_inches="tight")  # the legend sits outside the axes
    plt.close(fig)


# -- the subcommand ----------------------------------------------------------------------------

def add_trace_parser(sub: Any, selection: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("trace", help="one generation under torch.profiler: a Chrome trace "
                                     "(and --png, a timeline picture)")
    from ._cli_types import MAX_THREADS, count, device, output_path

    selection(p)
    p.add_argument("-o", "--output", required=True, metavar="TRACE.json", type=output_path,
                   help="where to write the Chrome trace (Perfetto, chrome://tracing)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="layerwise strategies: prefetch the next block (default) or load every "
                        "block when it runs (--no-prefetch, the serial baseline)")
    p.add_argument("--png", metavar="PATH", type=output_path,
                   help="also draw the timeline (needs matplotlib: offload-ref[trace])")
    p.add_argument("--stall-ms", type=float, default=0.5,
                   help="--png marks waits at least this long as stalls (default 0.5)")
    p.add_argument("--device", default="cpu", type=device, help="cpu (default) or cuda[:N]")
    p.add_argument("--torch-threads", type=count(1, MAX_THREADS), default=1, metavar="N")
    p.set_defaults(func=_cmd_trace)


def _cmd_trace(args: argparse.Namespace) -> int:
    from offload_ref._cli_selection import _selection, _UsageError

    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(_MISSING_MATPLOTLIB, file=sys.stderr)
            return 2
    specs = [_heavy_spec() for name in args.pipeline if name == _HEAVY]
    args.pipeline = [name for name in args.pipeline if name != _HEAVY]
    if args.pipeline or args.refs or args.spec:
        specs += _selection(args)[0]
    if len(specs) != 1:
        raise _UsageError(f"name exactly one pipeline (--pipeline NAME, {_HEAVY} included, or "
                          f"--spec MODULE:ATTR); got {len(specs)}")
    spec = specs[0]
    if len(args.strategy) > 1:
        raise _UsageError("trace runs one strategy: give --strategy once")
    strategy = args.strategy[0] if args.strategy else (
        "layer_wise" if spec.supports("layer_wise") else spec.strategies[0])
    if not spec.supports(strategy):
        raise _UsageError(f"--strategy {strategy}: {spec.name} supports "
                          f"{', '.join(spec.strategies)}")
    run_trace(spec, strategy, args.output, prefetch=args.prefetch, device=args.device,
              threads=args.torch_threads, log=lambda line: print(line, file=sys.stderr))
    if args.png:
        draw_timeline(args.output, args.png, stall_ms=args.stall_ms)
        print(f"offload-ref trace: timeline {args.png}", file=sys.stderr)
    return 0
