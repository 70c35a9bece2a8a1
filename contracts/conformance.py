"""The conformance table of the ecosystem's offloaders: ``offload-ref peers``.

Each offloader of :data:`offload_ref.peers.PEERS` (offload-ref's own backends through the public
protocol are the control row) is judged by the kit through the offloader protocol
(:mod:`.offloader`) on the built-in fixtures and the real diffusers pipelines; the results are
folded into one cell per contract area (pass, fail with the first cause and the check it fails,
not applicable), and beside them, measured in the same run on one pipeline: step time relative
to the resident pipeline, host time per streamed block, and peak device bytes relative to the
plan's bound.  ``docs/peers.md`` is this module's output.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .registry import AREAS
from .runner import CheckResult, run_checks
from .severity import Severity, judge

__all__ = ["AREAS_JUDGED", "Cell", "PeerRow", "judge_peer", "level_of", "measure_peer",
           "render_markdown"]

#: The areas a protocol offloader is judged in (the others test offload-ref's own resolver,
#: config parser, split-model delegation and distributed backend: :mod:`.capabilities`).
AREAS_JUDGED = ("B", "C", "D", "F", "J", "S")
_DIAGNOSED = "diagnosis: cause:"
#: Failing cases shown in full per check and offloader (the rest are named)
_SHOWN = 3


@dataclass
class Cell:
    """One offloader in one contract area, over every pipeline and strategy."""

    passed: int = 0
    failed: list[CheckResult] = field(default_factory=list)
    not_applicable: int = 0

    @property
    def verdict(self) -> str:
        if self.failed:
            return "fail"
        return "pass" if self.passed else "n/a"

    @property
    def worst(self) -> CheckResult | None:
        """The failing case the cell shows: the first (by case id) of the worst severity."""
        if not self.failed:
            return None
        return min(self.failed, key=lambda r: (level_of(r).rank, str(r.id)))


def level_of(result: CheckResult) -> Severity:
    """A failing case's severity: the one its run recorded, else judged from its check and
    message (:mod:`.severity`)."""
    recorded = getattr(result, "severity", None)
    if recorded:
        return Severity.of(recorded)
    return judge(result.id.check, result.outcome, result.message) or Severity.WRONG_OUTPUT


@dataclass
class PeerRow:
    name: str
    reference: str
    strategies: tuple[str, ...]
    cells: dict[str, Cell]
    results: list[CheckResult]
    perf: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def cause_of(message: str, limit: int = 160) -> str:
    """A failure's (or a refusal's) cause in one line: the placement diagnosis's ``cause:`` when
    there is one, else the first line of the message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = next((ln[len(_DIAGNOSED):].strip() for ln in lines if ln.startswith(_DIAGNOSED)),
                lines[0] if lines else "-")
    line = line.replace("|", "/")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def judge_peer(name: str, reference: str, specs: Sequence[Any],
               sources: dict[Any, str] | None = None,
               progress: Callable[[int, int, CheckResult], None] | None = None) -> PeerRow:
    """Run the kit on ``specs`` against the offloader ``reference`` names (``MODULE:ATTR``);
    ``sources`` as :func:`~.runner.run_checks` takes them (reproduction lines)."""
    from .offloader import load_offloader

    impl = load_offloader(reference)
    start = time.perf_counter()
    results = run_checks(specs, impl=impl, include_global=False, progress=progress,
                         sources=sources)
    cells = {area: Cell() for area in AREAS_JUDGED}
    for r in results:
        area = _area_of(r)
        if area not in cells:
            continue
        cell = cells[area]
        if r.outcome == "passed":
            cell.passed += 1
        elif r.outcome == "not_applicable":
            cell.not_applicable += 1
        else:
            cell.failed.append(r)
    offered = tuple(s for s in ("model_level", "layer_wise") if impl.unsupported(s) is None)
    return PeerRow(name, reference, offered, cells, results,
                   seconds=time.perf_counter() - start)


def _area_of(result: CheckResult) -> str:
    from .runner import load_catalogue

    info = load_catalogue().get(result.id.check)
    return info.area if info is not None else "-"


# -- measured beside the verdicts --------------------------------------------------------------


def measure_peer(reference: str, spec: Any, strategy: str, *, repeats: int = 5
                 ) -> dict[str, Any]:
    """On ``spec`` under ``strategy``, in one run: median generation seconds of the offloaded and
    the resident pipeline (interleaved), their ratio, the extra host time per streamed block
    call, and the peak device bytes from ``enable()`` through a generation (activations of the
    resident run subtracted) relative to the plan's bound."""
    from offload_ref.bench import _interleaved
    from offload_ref.plan import resolve_offload_plan, selectable_components

    from offload_ref.config import OffloadConfig

    from .case import kit_device, move_to_device
    from .offloader import load_offloader
    from .registry import CheckNotApplicable

    device = kit_device()
    impl = load_offloader(reference)
    if impl.unsupported(strategy):
        return {"skipped": impl.unsupported(strategy), "strategy": strategy,
                "pipeline": spec.name}
    plan = resolve_offload_plan(spec.build(), OffloadConfig(
        strategy=strategy, components=selectable_components(spec.build(), strategy)),
        alignment=256)
    inputs = spec.make_inputs()

    def generate(pipeline: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                pipeline(**inputs)
        return run

    def synchronize() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    resident = move_to_device(spec.build(), device)
    measured = device.type != "cpu"
    if measured:
        gc.collect()
        start = torch.accelerator.memory_allocated(device)
        torch.accelerator.reset_peak_memory_stats(device)
    generate(resident)()
    activations = (torch.accelerator.max_memory_allocated(device) - start) if measured else 0
    pipeline = spec.build()
    backend = impl.make_backend(OffloadConfig(strategy=strategy,
                                              components=selectable_components(pipeline,
                                                                               strategy)), None)
    if measured:
        gc.collect()
        base = torch.accelerator.memory_allocated(device)
        torch.accelerator.reset_peak_memory_stats(device)
    try:
        backend.enable(pipeline)
    except CheckNotApplicable as exc:
        return {"skipped": str(exc), "strategy": strategy, "pipeline": spec.name}
    try:
        generate(pipeline)()
        peak = (torch.accelerator.max_memory_allocated(device) - base - activations
                if measured else None)
        calls = _count_block_calls(plan, pipeline, generate(pipeline))
        times = _interleaved({"offloaded": generate(pipeline), "resident": generate(resident)},
                             repeats, synchronize)
    finally:
        backend.disable()
    bound = plan.predicted_device_bytes()
    return {
        "pipeline": spec.name, "strategy": strategy, "device": str(device),
        "offloaded_s": times["offloaded"], "resident_s": times["resident"],
        "step_ratio": times["offloaded"] / times["resident"],
        "block_calls": calls,
        "per_block_us": ((times["offloaded"] - times["resident"]) / calls * 1e6) if calls
        else None,
        "peak_bytes": peak, "bound_bytes": bound,
        "peak_over_bound": (peak / bound) if peak is not None and bound else None,
    }


def _count_block_calls(plan: Any, pipeline: Any, run: Callable[[], None]) -> int:
    """Streamed block calls in one generation (layerwise), or swapped component calls (model
    level), counted with forward pre-hooks on ``pipeline``'s modules at the plan's paths."""
    from offload_ref.discovery import get_submodule_path

    paths = [p for s in plan.rings if len(s.streamed_blocks) >= 2
             for p in s.streamed_paths]
    if not paths:
        paths = [c.path for c in plan.components if c.selected and c.role in ("dit", "encoder")]
    count = [0]
    handles = [get_submodule_path(pipeline, p).register_forward_pre_hook(
        lambda m, a: count.__setitem__(0, count[0] + 1)) for p in paths]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return count[0]


# -- the page ----------------------------------------------------------------------------------


def _anchor(peer: str, check: str) -> str:
    return f"{peer}-{check}".replace("_", "-").lower()


def render_markdown(rows: Sequence[PeerRow], *, header: dict[str, Any], command: str,
                    pipelines: Iterable[str], notes: Sequence[str] = ()) -> str:
    """docs/peers.md; ``notes``: markdown lines put below the verdict table."""
    from .registry import doc_for
    from .runner import load_catalogue
    from .streams import header_text

    catalogue = load_catalogue()
    out = [
        "# Conformance of the ecosystem's offloaders",
        "",
        "<!-- generated by the command below; do not edit by hand -->",
        "",
        f"Generated by `{command}` (kit {header['kit']}, torch {header['torch']}, "
        f"{header['machine']}; device {header['device']}; {header_text()}).",
        "",
        "Every offloader is judged by the kit through the public offloader protocol "
        "(`offload-ref check --offloader MODULE:ATTR`, [model-authors.md]"
        "(model-authors.md#9-judge-your-own-offloader)) on the built-in fixtures and the real "
        f"diffusers pipelines ({', '.join(pipelines)}), under each strategy it offers.  A cell folds one contract "
        "area over every pipeline and strategy: **pass** (every case that applies passed; the "
        "count), **fail: SEVERITY** (the worst failure found there, worst first: *wrong output* "
        "(a generation or a weight read differs from the un-offloaded truth), *error* (an "
        "exception raised into the user's generation, enable() or disable(), or left for its "
        "next call), *memory* (memory "
        "not returned or held beyond the plan), *trace* (a leftover attribute or hook that "
        "changes nothing computed); then the first failing check of that severity, linked to its "
        "cases below, and its cause in one line), **n/a** (nothing applied: the offloader's API refuses these pipelines, or the "
        "area judges offload-ref's internals).  Areas A (plan), E (split models), G (config) and "
        "H (distributed) judge offload-ref's own resolver, config parser and backends: they "
        "are not applicable through the protocol (contracts/capabilities.py says why, check by "
        "check).  The `offload_ref` row is offload-ref's own backends through the same route: "
        "the control.",
        "",
    ]
    head = "| offloader | strategies | " + " | ".join(
        f"{a} {AREAS[a]}" for a in AREAS_JUDGED) + " |"
    out += [head, "|" + "---|" * (2 + len(AREAS_JUDGED))]
    for row in rows:
        cells = []
        for area in AREAS_JUDGED:
            cell = row.cells[area]
            if cell.failed:
                first = cell.worst
                checks = sorted({r.id.check for r in cell.failed})
                more = f" (+{len(checks) - 1} more)" if len(checks) > 1 else ""
                cells.append(f"**fail: {level_of(first)}** "
                             f"[{first.id.check}](#{_anchor(row.name, first.id.check)})"
                             f"{more}: {cause_of(first.message, 150)}")
            elif cell.passed:
                cells.append(f"pass ({cell.passed})")
            else:
                cells.append("n/a")
        out.append(f"| `{row.name}` | {', '.join(row.strategies) or '-'} | "
                   + " | ".join(cells) + " |")
    if notes:
        out += ["", *notes]
    out += ["", "## Measured beside the verdicts", "",
            "In the same run, on one pipeline, on the kit's device: median generation time "
            "offloaded over resident (interleaved repeats), the extra time per streamed block "
            "call (layerwise; per swapped component call at model level), and the peak device "
            "bytes from `enable()` through a generation, minus the activations the resident run "
            "needs, over the plan's bound (tensors padded to 256 bytes).  On the simulated "
            "accelerator every op pays a dispatcher fallback and copies are host memcpy: times "
            "compare offloaders with each other here, not with a GPU (docs/benchmarks.md has "
            "GPU figures).",
            "",
            "| offloader | strategy | pipeline | step / resident | extra per call | "
            "peak / bound |",
            "|---|---|---|---|---|---|"]
    for row in rows:
        for p in row.perf:
            strategy = p["strategy"]
            if "skipped" in p:
                out.append(f"| `{row.name}` | {strategy} | {p['pipeline']} | n/a: "
                           f"{cause_of(p['skipped'], 200)} | | |")
                continue
            per = f"{p['per_block_us']:.0f} us x {p['block_calls']}" if p["per_block_us"] \
                is not None else "-"
            ratio = f"{p['peak_over_bound']:.2f}" if p["peak_over_bound"] is not None else "-"
            out.append(f"| `{row.name}` | {strategy} | {p['pipeline']} | "
                       f"{p['step_ratio']:.2f} | {per} | {ratio} |")
    out += ["", "## Failures, check by check", ""]
    for row in rows:
        failures = [r for cell in row.cells.values() for r in cell.failed]
        if not failures:
            continue
        out += [f"### `{row.name}`", "", f"`{row.reference}`", ""]
        by_check: dict[str, list[CheckResult]] = {}
        for r in failures:
            by_check.setdefault(r.id.check, []).append(r)
        for check_id in sorted(by_check):
            info = catalogue[check_id]
            cases = by_check[check_id]
            out += [f"<a id=\"{_anchor(row.name, check_id)}\"></a>",
                    f"**{check_id}** (§{info.section}, {doc_for(info.section)}): {info.title}",
                    ""]
            cases = sorted(cases, key=lambda r: str(r.id))
            for r in cases[:_SHOWN]:
                out.append(f"- {r.id.spec} / {r.id.strategy}: {r.outcome} ({level_of(r)}): "
                           f"{cause_of(r.message)}  ")
                out.append(f"  `{r.id.repro()}`")
            if len(cases) > _SHOWN:
                out.append(f"- and {len(cases) - _SHOWN} more: "
                           + ", ".join(f"{r.id.spec} / {r.id.strategy}" for r in cases[_SHOWN:]))
            out.append("")
    return "\n".join(out).rstrip() + "\n"
