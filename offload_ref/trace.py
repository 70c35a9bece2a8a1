"""``offload-ref trace``: one generation under ``torch.profiler``, written as a Chrome trace.

The offloader's own ranges (Note [Spans] in ``_spans.py``) are ordinary ``record_function``
ranges, so the trace is torch's own: it opens in Perfetto (ui.perfetto.dev) and chrome://tracing
and carries every aten op and, on CUDA, every kernel and memcpy next to them.  ``--png`` draws a
summary timeline with matplotlib (the optional extra ``offload-ref[trace]``; Note [Trace
picture] in trace_picture.py), and ``--compare-no-prefetch`` draws a second run with prefetch off
below it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

def draw_timeline(trace_path: str, png_path: str, *, stall_ms: float = 0.5,
                  compare: str | None = None) -> None:
    """Draw the trace at ``trace_path`` (and the one at ``compare`` below it, on the same time
    axis) into ``png_path`` (Note [Trace picture] in trace_picture.py).  Raises ImportError when
    matplotlib is missing."""
    from .trace_picture import draw, picture_of

    pictures = [picture_of(trace_path, stall_ms=stall_ms,
                           title=f"{trace_path}" + (" (prefetch on)" if compare else ""))]
    if compare is not None:
        pictures.append(picture_of(compare, stall_ms=stall_ms, title=f"{compare} (prefetch off)"))
    draw(pictures, png_path, stall_ms=stall_ms)


# -- the subcommand ----------------------------------------------------------------------------

def add_trace_parser(sub: Any, selection: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("trace", help="one generation under torch.profiler: a Chrome trace "
                                     "(and --png, a timeline picture)")
    from ._cli_types import MAX_THREADS, count, device, output_path

    selection(p, one="trace", also=f" ({_HEAVY} included)")  # one pipeline, one strategy
    p.add_argument("-o", "--output", required=True, metavar="TRACE.json", type=output_path,
                   help="where to write the Chrome trace (Perfetto, chrome://tracing)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="layerwise strategies: prefetch the next block (default) or load every "
                        "block when it runs (--no-prefetch, the serial baseline)")
    p.add_argument("--png", metavar="PATH", type=output_path,
                   help="also draw the timeline (needs matplotlib: offload-ref[trace])")
    p.add_argument("--stall-ms", type=float, default=0.5,
                   help="--png marks waits at least this long as stalls (default 0.5)")
    p.add_argument("--compare-no-prefetch", action="store_true",
                   help="layerwise: trace a second generation with prefetch off (written next "
                        "to -o as NAME.no-prefetch.json); --png draws it below the first")
    p.add_argument("--device", default="cpu", type=device, help="cpu (default) or cuda[:N]")
    p.add_argument("--torch-threads", type=count(1, MAX_THREADS), default=1, metavar="N",
                   help="torch intra-op threads while tracing (default 1)")
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
    compare = None
    if args.compare_no_prefetch:
        if strategy == "model_level" or not args.prefetch:
            raise _UsageError("--compare-no-prefetch compares a layerwise trace with prefetch on "
                              "against one with it off: use a layerwise --strategy, without "
                              "--no-prefetch")
        stem = args.output[:-5] if args.output.endswith(".json") else args.output
        compare = f"{stem}.no-prefetch.json"
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    run_trace(spec, strategy, args.output, prefetch=args.prefetch, device=args.device,
              threads=args.torch_threads, log=log)
    if compare is not None:
        run_trace(spec, strategy, compare, prefetch=False, device=args.device,
                  threads=args.torch_threads, log=log)
    if args.png:
        draw_timeline(args.output, args.png, stall_ms=args.stall_ms, compare=compare)
        print(f"offload-ref trace: timeline {args.png}", file=sys.stderr)
    return 0
