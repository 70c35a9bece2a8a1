"""The kit's report: a header, a pipeline x strategy x contract-area matrix, then every failure.

One renderer serves ``offload-ref check`` and the pytest plugin's terminal summary (which feeds
it rows rebuilt from test reports, so the matrix survives pytest-xdist).  :func:`to_json` is the
same content as data (``offload-ref check --json PATH``).

Reading a cell: ``ok 5`` (5 cases, all passed or failed as expected), ``FAIL 2/5`` (2 of 5
failed), ``n/a`` (no case of that area applies to that pipeline; the reasons are listed under
the matrix), ``-`` (the area has no check for that strategy).  Each failure carries its severity
(:mod:`.severity`: wrong output, error, memory, trace); the JSON's matrix cells carry the worst.
"""

from __future__ import annotations

import platform as _platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .registry import AREAS, doc_for
from .severity import Severity, judge, worst

__all__ = ["Row", "header", "kit_device_line", "render", "rows_from_results", "summary", "to_json"]

#: outcomes that count as "nothing unexpected"
_OK = ("passed", "xfailed")
PREFLIGHT_DOC = "docs/model-authors.md#preflight"
_BAD = ("failed", "error", "xpassed")


@dataclass(frozen=True)
class Row:
    """One case as the report sees it (from a :class:`~.runner.CheckResult` or a pytest report)."""

    check: str
    section: str
    pipeline: str | None
    strategy: str | None
    outcome: str
    message: str = ""
    repro: str = ""
    seconds: float = 0.0
    title: str = ""
    #: how bad a failure is (:mod:`.severity`); None: judged from the check and the message
    severity: str | None = None

    @property
    def level(self) -> Severity | None:
        """The failure's severity (None for an outcome that is no failure): the one the run
        recorded, else the check's default refined by its message (the pytest route)."""
        if self.outcome not in ("failed", "error"):
            return None
        if self.severity:
            return Severity.of(self.severity)
        return judge(self.check, self.outcome, self.message)

    @property
    def area(self) -> str:
        if self.check == "preflight":
            return "preflight"
        return self.section[:1] if self.section else "?"

    @property
    def doc(self) -> str:
        if self.check == "preflight":
            return PREFLIGHT_DOC
        try:
            return doc_for(self.section)
        except KeyError:
            return "docs/model-authors.md"


def rows_from_results(results: Iterable[Any]) -> list[Row]:
    from .runner import load_catalogue

    catalogue = load_catalogue()
    rows = []
    for r in results:
        info = catalogue.get(r.id.check)
        rows.append(Row(r.id.check, info.section if info else "", r.id.spec, r.id.strategy,
                        r.outcome, r.message, r.id.repro(), r.seconds,
                        info.title if info else "", getattr(r, "severity", None)))
    return rows


def kit_device_line() -> str:
    """Where the kit computes, in words: the simulated accelerator (placement checks on), or the
    CPU alone and why (placement checks off); and whether stream ordering is checked (the
    simulated accelerator's happens-before sanitizer: contracts/streams.py), or why not."""
    from offload_ref.platform import simulated

    from .streams import header_text

    reason = simulated.unavailable_reason()
    if reason is None:
        return ("hpu:0 (offload-ref's simulated accelerator; host memory on cpu) through "
                f"CpuPlatform, race amplifier on; placement checks ON; {header_text()}")
    return (f"cpu (CpuPlatform, race amplifier on; host and device are both the CPU); "
            f"PLACEMENT CHECKS OFF: {reason}; {header_text()}")


def header(*, implementation: str = "offload_ref", pipelines: Mapping[str, str] | None = None,
           device: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """What the report is about: versions, device, and what is under test."""
    import torch

    try:
        from importlib.metadata import version

        kit = version("offload-ref")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        kit = "unknown (not installed)"
    if device is None:
        device = kit_device_line()
    return {
        "kit": kit,
        "torch": torch.__version__,
        "python": _platform.python_version(),
        "machine": _machine(),
        "device": device,
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "implementation": implementation,
        "pipelines": dict(pipelines or {}),
    }


def _machine() -> str:
    """The CPU model (results that hold on one CPU and not another are defects worth seeing)."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.partition(":")[2].strip()
                    break
    except OSError:
        model = _platform.processor()
    return " ".join(p for p in (_platform.machine(), model) if p)


def summary(rows: Sequence[Row]) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "error", "xfailed", "xpassed",
                             "not_applicable", "skipped")}
    for row in rows:
        counts[row.outcome] = counts.get(row.outcome, 0) + 1
    counts["total"] = len(rows)
    return counts


def _matrix(rows: Sequence[Row]) -> tuple[list[str], dict[tuple[str, str], dict[str, list[Row]]]]:
    order = ["preflight", *AREAS]
    areas = sorted({r.area for r in rows}, key=lambda a: (order.index(a) if a in order
                                                         else len(order), a))
    cells: dict[tuple[str, str], dict[str, list[Row]]] = {}
    for row in rows:
        key = (row.pipeline or "(global)", row.strategy or "-")
        cells.setdefault(key, {}).setdefault(row.area, []).append(row)
    return areas, cells


def _cell(rows: Sequence[Row] | None) -> str:
    if not rows:
        return "-"
    ran = [r for r in rows if r.outcome != "not_applicable" and r.outcome != "skipped"]
    if not ran:
        return "n/a"
    bad = sum(r.outcome in _BAD for r in ran)
    return f"FAIL {bad}/{len(ran)}" if bad else f"ok {len(ran)}"


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(head), line(["-" * w for w in widths]), *(line(b) for b in body)]


def render(rows: Sequence[Row], head: Mapping[str, Any] | None = None, *,
           out: TextIO | None = None, seconds: float | None = None,
           failures: bool = True) -> None:
    """Print the report: header, matrix, not-applicable reasons, failures (unless
    ``failures=False``: pytest prints them itself), one summary line."""
    out = out or sys.stdout
    w = out.write
    if head:
        w(f"offload-ref check {head['kit']} · torch {head['torch']} · python {head['python']}"
          f" · {head['machine']}\n")
        w(f"device: {head['device']} · torch threads: {head['torch_threads']}"
          f" · implementation: {head['implementation']}\n")
        if head.get("pipelines"):
            w("under test:\n")
            for line in _table(("pipeline", "from"), sorted(head["pipelines"].items()))[2:]:
                w(f"  {line}\n")
        w("\n")
    areas, cells = _matrix(rows)
    titles = [f"{a} {AREAS.get(a, '')}".strip() for a in areas]
    body = []
    for (pipeline, strategy), by_area in sorted(cells.items()):
        body.append([pipeline, strategy, *(_cell(by_area.get(a)) for a in areas)])
    for line in _table(("pipeline", "strategy", *titles), body):
        w(line + "\n")

    not_applicable: dict[tuple[str, str], list[str]] = {}
    not_run: dict[str, list[str]] = {}  # one root cause (preflight) kept many checks from running
    for r in rows:
        if r.outcome == "not_applicable":
            where = f"{r.pipeline}/{r.strategy}" if r.pipeline else "-"
            if r.message.strip().startswith("not run:"):
                not_run.setdefault(r.message.strip(), []).append(r.check)
            else:
                not_applicable.setdefault((r.check, r.message.strip()), []).append(where)
    if not_applicable or not_run:
        count = sum(len(v) for v in not_applicable.values()) + sum(map(len, not_run.values()))
        w(f"\nnot applicable ({count} cases):\n")
        for (check_id, reason), where in sorted(not_applicable.items()):
            w(f"  {check_id} on {', '.join(sorted(where))}\n    not applicable: {reason}\n")
        for reason, checks in sorted(not_run.items()):
            w(f"  {len(checks)} check(s): {reason}\n")

    bad = [r for r in rows if r.outcome in _BAD] if failures else []
    # One root cause (a pipeline the strategy rejects, a module refusing hooks) fails many
    # checks with the same error: print it once, then the other cases it failed.
    # A parity failure whose diagnosis names its cause (the module that diverged, a tensor
    # read outside its block) groups by that diagnosis: the same bug fails every check that
    # generates, each with its own first line.
    # A group shares one severity too: its header states it for every case folded under it.
    groups: dict[tuple[str, Any, str | None, Any], list[Row]] = {}
    for r in bad:
        lines = r.message.strip().splitlines() or [""]
        causes = tuple(line.strip() for line in lines if line.strip().startswith("diagnosis:")
                       and "not run" not in line and "did not reproduce" not in line)
        groups.setdefault((r.outcome, causes or lines[0], r.pipeline, r.level), []).append(r)
    for (_, cause, _, _), group in groups.items():
        r = group[0]
        w(f"\n{r.outcome.upper()} {_case_id(r)}\n  pipeline {r.pipeline or '-'} · strategy "
          f"{r.strategy or '-'} · {_area_text(r)} · {r.doc}\n")
        if r.level is not None:
            w(f"  severity: {r.level} ({LEVEL_TEXT[r.level]})\n")
        if r.title:
            w(f"  contract: {r.title}\n")
        for line in r.message.strip().splitlines() or ["(no message)"]:
            w(f"  {line}\n")
        if r.repro:
            w(f"  reproduce: {r.repro}\n")
        if len(group) > 1:
            others = ", ".join(_case_id(o) for o in group[1:])
            same = "diagnosis" if isinstance(cause, tuple) else r.outcome
            w(f"  the same {same} in {len(group) - 1} more case(s): {others}\n")
    levels = [r.level for r in rows if r.level is not None]
    if levels:
        counts = [f"{sum(v is level for v in levels)} {level}" for level in Severity
                  if any(v is level for v in levels)]
        w(f"\nseverity of the failures (worst first): {', '.join(counts)} "
          f"({SEVERITY_DOC})\n")
    s = summary(rows)
    parts = [f"{s['passed']} passed", f"{s['failed'] + s['error']} failed"]
    if s["error"]:
        parts[-1] += f" ({s['error']} with an error)"
    if s["xfailed"]:
        parts.append(f"{s['xfailed']} failed as expected")
    if s["xpassed"]:
        parts.append(f"{s['xpassed']} passed unexpectedly (expected to fail)")
    if s["not_applicable"]:
        parts.append(f"{s['not_applicable']} not applicable")
    if s["skipped"]:
        parts.append(f"{s['skipped']} skipped")
    tail = f" in {seconds:.1f} s" if seconds is not None else ""
    w(f"\n{', '.join(parts)} ({s['total']} cases{tail})\n")


#: What each severity means, in the report's words.
LEVEL_TEXT = {
    Severity.WRONG_OUTPUT: "a generation or a value the user reads differs from the "
                           "un-offloaded truth",
    Severity.ERROR: "an error raised into the user's generation, enable() or disable(), or "
                    "left for its next call",
    Severity.MEMORY: "memory not returned, or held beyond the contract",
    Severity.TRACE: "a leftover trace that changes nothing computed",
}
SEVERITY_DOC = "docs/model-authors.md#reading-the-report"


def _area_text(r: Row) -> str:
    return f"§{r.section} {AREAS.get(r.area, '')}".strip() if r.section else r.area


def _case_id(r: Row) -> str:
    return "-".join(p for p in (r.check, r.pipeline, r.strategy) if p)


def to_json(rows: Sequence[Row], head: Mapping[str, Any] | None = None,
            seconds: float | None = None) -> dict[str, Any]:
    areas, cells = _matrix(rows)
    matrix = []
    for (pipeline, strategy), by_area in sorted(cells.items()):
        for area in areas:
            group = by_area.get(area, [])
            if group:
                counts = summary(group)
                level = worst(r.level for r in group)
                matrix.append({"pipeline": pipeline, "strategy": strategy, "area": area,
                               "area_title": AREAS.get(area, ""), "cell": _cell(group),
                               "severity": None if level is None else level.value,
                               **{k: v for k, v in counts.items() if v}})
    return {
        "format": "offload-ref-check/1",
        "header": dict(head or {}),
        "summary": summary(rows),
        "seconds": seconds,
        "matrix": matrix,
        "results": [{"check": r.check, "section": r.section, "pipeline": r.pipeline,
                     "strategy": r.strategy, "outcome": r.outcome,
                     "severity": None if r.level is None else r.level.value,
                     "message": r.message, "reproduce": r.repro,
                     "seconds": round(r.seconds, 4)} for r in rows],
    }
