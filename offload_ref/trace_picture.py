"""The picture of ``offload-ref trace --png``: what to draw (:func:`picture_of`, plain data a test
can read) and the drawing (:func:`draw`, matplotlib).

Note [Trace picture]
    One lane per thread track with offloader ranges (and per CUDA stream with kernels).  A
    block's compute and its copy share the block's colour, and the legend names every block in
    the trace (colours repeat every eight blocks, and the legend says so).  A bar is never
    narrower than 0.4% of the time axis, so a copy of a tiny block stays visible; its true
    length is in the trace.  A wait of at least ``stall_ms`` is a stall: red, hatched, and joined
    by an arrow to the end of the copy it waited for (the last copy of the same block that began
    before the wait ended).  On the lane that computes the blocks, every gap of at least
    ``stall_ms`` between two block ranges is labelled with its length (host work between blocks:
    hooks, non-block modules), if it is at least 2.5% of the axis wide (room for the label), the
    longest twelve at most; a stall whose copy began before the trace started says so.  A dotted line marks where each pass
    over the DiT begins.  Time is in milliseconds from the earliest range in the trace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Bar", "Picture", "draw", "picture_of"]

_BLOCK_INDEX = re.compile(r"\bblock=(\d+)")
_COLOURS = 8  # distinct block colours (tab10 without red, which means a stall, and grey)
_MIN_WIDTH = 0.004  # of the time axis
_MAX_GAP_LABELS = 12
_GAP_LABEL = 0.025  # a gap is labelled from this share of the time axis on (and stall_ms)


@dataclass(frozen=True)
class Bar:
    lane: int
    start_ms: float
    dur_ms: float  # as recorded
    width_ms: float  # as drawn: at least _MIN_WIDTH of the axis
    kind: str  # "block", "copy", "collective", "wait", "stall", "gpu", "other"
    block: int | None


@dataclass
class Picture:
    title: str
    lanes: list[str]
    bars: list[Bar]
    blocks: list[int]  # every block index in the trace, for the legend
    links: list[tuple[Bar, Bar]] = field(default_factory=list)  # (copy, stall it ended)
    gaps: list[tuple[int, float, float]] = field(default_factory=list)  # lane, start, length
    passes: list[float] = field(default_factory=list)
    stalls: int = 0
    xlabel: str = "time (ms) from the earliest range in the trace"

    @property
    def end_ms(self) -> float:
        return max((b.start_ms + b.width_ms for b in self.bars), default=0.0)


def _kind(name: str, dur_ms: float, stall_ms: float) -> str:
    for prefix, kind in (("offload_ref.block", "block"), ("offload_ref.copy", "copy"),
                         ("offload_ref.collective", "collective"), ("offload_ref.wait", "wait")):
        if name.startswith(prefix):
            return "stall" if kind == "wait" and dur_ms >= stall_ms else kind
    return "other"


def picture_of(trace_path: str, *, stall_ms: float = 0.5, title: str | None = None) -> Picture:
    """What ``trace --png`` draws for the Chrome trace at ``trace_path`` (Note [Trace
    picture])."""
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
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in ours + gpu)
    min_width = max((end - t0) / 1e3 * _MIN_WIDTH, 1e-6)
    lanes: dict[Any, list[dict[str, Any]]] = {}
    for e in ours:
        lanes.setdefault(("cpu", e.get("pid"), e.get("tid")), []).append(e)
    for e in gpu:
        lanes.setdefault(("gpu", e.get("pid"), e.get("tid")), []).append(e)
    order = sorted(lanes, key=lambda key: (key[0] == "gpu",
                                           not any(".block " in e["name"] for e in lanes[key]),
                                           str(key)))
    bars: list[Bar] = []
    for row, key in enumerate(order):
        for e in sorted(lanes[key], key=lambda e: float(e["ts"])):
            start, dur = (float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0)) / 1e3
            name = str(e["name"])
            match = _BLOCK_INDEX.search(name)
            kind = "gpu" if key[0] == "gpu" else _kind(name, dur, stall_ms)
            if kind == "wait":
                continue  # a short wait: nothing to show
            bars.append(Bar(row, start, dur, max(dur, min_width), kind,
                            int(match.group(1)) if match else None))
    labels = [f"CUDA stream {tid}" if kind == "gpu" else
              (thread_names.get((pid, tid)) or f"thread {tid}") for kind, pid, tid in order]
    picture = Picture(title or f"offload_ref timeline: {trace_path}", labels, bars,
                      sorted({b.block for b in bars if b.block is not None}))
    picture.stalls = sum(b.kind == "stall" for b in bars)
    copies = [b for b in bars if b.kind in ("copy", "collective")]
    for stall in (b for b in bars if b.kind == "stall"):
        done = stall.start_ms + stall.dur_ms
        waited = [c for c in copies if c.block == stall.block and c.start_ms <= done]
        if waited:
            picture.links.append((max(waited, key=lambda c: c.start_ms), stall))
    compute = sorted((b for b in bars if b.kind == "block"), key=lambda b: b.start_ms)
    if compute:
        lane = compute[0].lane
        on_lane = [b for b in compute if b.lane == lane]
        shortest = max(stall_ms, _GAP_LABEL * (end - t0) / 1e3)  # room for its label
        gaps = [(lane, a.start_ms + a.dur_ms, b.start_ms - (a.start_ms + a.dur_ms))
                for a, b in zip(on_lane, on_lane[1:])
                if b.start_ms - (a.start_ms + a.dur_ms) >= shortest]
        picture.gaps = sorted(sorted(gaps, key=lambda g: -g[2])[:_MAX_GAP_LABELS],
                              key=lambda g: g[1])
        picture.passes = [b.start_ms for b in on_lane if b.block == 0]
    return picture


def draw(pictures: Sequence[Picture], png_path: str, *, stall_ms: float = 0.5) -> None:
    """Draw ``pictures`` one above the other on one time axis into ``png_path``.  Raises
    ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tab10 = plt.get_cmap("tab10")
    palette = [tab10(i) for i in range(10) if i not in (3, 7)]  # red means a stall, grey idle

    def colour(block: int | None) -> Any:
        return "0.6" if block is None else palette[block % _COLOURS]

    heights = [1.2 + 0.8 * len(p.lanes) for p in pictures]
    fig, axes = plt.subplots(len(pictures), 1, figsize=(14, sum(heights)), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    blocks: set[int] = set()
    for ax, picture in zip(axes[:, 0], pictures):
        blocks.update(picture.blocks)
        for b in picture.bars:
            span = [(b.start_ms, b.width_ms)]
            if b.kind == "gpu":
                ax.broken_barh(span, (b.lane - 0.3, 0.6), color="0.4")
            elif b.kind == "stall":
                ax.broken_barh(span, (b.lane - 0.45, 0.9), facecolor="red", edgecolor="darkred",
                               hatch="//", alpha=0.8)
            elif b.kind == "block":
                ax.broken_barh(span, (b.lane - 0.35, 0.7), facecolor=colour(b.block),
                               edgecolor="black", linewidth=0.3)
            else:  # copy, collective, other
                ax.broken_barh(span, (b.lane - 0.25, 0.5), facecolor=colour(b.block),
                               edgecolor="black", linewidth=0.6,
                               hatch=".." if b.kind == "collective" else None)
        for copy, stall in picture.links:
            ax.annotate("", xy=(stall.start_ms + stall.dur_ms, stall.lane),
                        xytext=(copy.start_ms + copy.width_ms, copy.lane),
                        arrowprops={"arrowstyle": "->", "color": "darkred", "linewidth": 0.8})
        for n, (lane, start, length) in enumerate(picture.gaps):
            ax.text(start + length / 2, lane + 0.42 + 0.12 * (n % 2), f"{length:.2f} ms",
                    fontsize="xx-small", ha="center", va="top", color="0.25")
        linked = {id(stall) for _, stall in picture.links}
        for b in picture.bars:
            if b.kind == "stall" and id(b) not in linked:
                ax.text(b.start_ms + b.width_ms, b.lane - 0.45, " its copy began before the trace",
                        fontsize="xx-small", va="bottom", color="darkred")
        for n, start in enumerate(picture.passes):
            ax.axvline(start, color="0.3", linestyle=":", linewidth=0.8)
            ax.text(start, -0.6, f"pass {n + 1}", fontsize="x-small", va="bottom")
        ax.set_yticks(range(len(picture.lanes)), picture.lanes)
        ax.invert_yaxis()
        ax.set_title(f"{picture.title} ({picture.stalls} stall(s) of at least {stall_ms:g} ms)",
                     pad=16, fontsize="medium")
    axes[-1, 0].set_xlabel(pictures[-1].xlabel)
    shown = sorted(blocks)
    handles = [Patch(facecolor=colour(k), edgecolor="black", label=f"block {k}")
               for k in shown[:24]]
    if len(shown) > 24:
        handles.append(Patch(facecolor="white", label=f"... block {shown[-1]}"))
    if len(shown) > _COLOURS:
        handles.append(Patch(facecolor="white", label=f"(colours repeat every {_COLOURS})"))
    handles += [Patch(facecolor="white", edgecolor="black",
                      label="tall bar: compute; short bar: its copy"),
                Patch(facecolor="red", hatch="//", label="stall (a long wait); arrow: from "
                      "the copy it waited for"),
                Patch(facecolor="white", edgecolor="0.3", linestyle=":",
                      label="a pass over the DiT begins; grey numbers: gaps between blocks")]
    axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                      fontsize="small")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120, bbox_inches="tight")  # the legend sits outside the axes
    plt.close(fig)
