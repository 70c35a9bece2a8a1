"""``offload-ref check`` runs its cases in a child process, so that a native crash is an error of
the case it killed and the report is still written.

Note [Crash isolation]
    A segfault in a kernel (of the simulated accelerator, of torch, of a pipeline's own
    extension) used to end ``offload-ref check`` with exit status 139, no report and no JSON: the
    cases that had run were lost with the one that crashed, and nothing said which it was.  Now
    the command (the parent, :func:`supervise`) plans nothing and runs nothing itself: it starts
    a child process that runs the cases and appends, before each thing that may run the spec's
    code, what it is about to run (a spec's preflight, an applicability decision, a case), then
    each result, to a journal (JSON lines, flushed one by one: a line written before a crash is
    in the file after it).  The parent reads the journal as it grows (the progress line and the
    results come from it) and renders the report when the child is done.

    When the child dies before it is done (a signal, an exit in the code under test, an
    exception the kit did not catch), the parent charges the death to what the journal says was
    running: a case becomes an ``error`` whose first line names the signal and the op (from the
    simulated accelerator's crash line, ``offload-ref simulated accelerator: fatal signal 11
    (SIGSEGV) while running aten::mul.Tensor on hpu``, which it appends to the file named by
    ``OFFLOAD_REF_SIM_CRASH_FILE``, set per child), followed by the Python frames at the crash
    (the child's ``faulthandler`` writes them to a file of its own); a spec's preflight or
    planning becomes that spec's preflight error, and its checks are not run.  Then the parent
    starts a new child that skips every case with a result (it is given their ids) and goes on
    after the one that crashed.  Bounded: after :data:`MAX_CRASHES_PER_SPEC` crashes of one spec
    its remaining cases are not run, and after :data:`MAX_CHILDREN` children the run stops.  A
    planned case that was not run never vanishes from the report: it is an ``error`` whose message
    begins ``not run:`` and says why (the crashed cases, or the stop), so the matrix counts it as a
    failure (not ``-``, which means "no check"), the totals include it and the text report prints
    the reason once for all of them.

    Cost: one child start per run (Python, torch, the kit and the simulated accelerator from its
    build cache: about 1.5 s on the development machine), and for each crash one more start plus
    the preflight of the specs that still have cases.

    Ctrl-C: the terminal sends SIGINT to both processes.  The child stops at once (its
    :func:`~.escapes.telling_interrupts_apart` section hands the first SIGINT on and takes later
    ones for the parent's); the parent waits for it, forwards one SIGINT if the child is still
    running a second later (the signal was sent to the parent alone), and kills it on a second
    Ctrl-C or 10 s later.  The report then shows the results that came before, and the command
    exits 130.  A ``KeyboardInterrupt`` that the code under test raises itself is an error of its
    case (Note [Escaping exceptions] in contracts/escapes.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from .runner import CaseId, CheckResult, RunObserver

__all__ = ["CRASH_FILE_ENV", "MAX_CHILDREN", "MAX_CRASHES_PER_SPEC", "Journal", "Supervised",
           "child_setup", "crash_report", "supervise"]

#: the variable naming the file the simulated accelerator appends its crash line to
CRASH_FILE_ENV = "OFFLOAD_REF_SIM_CRASH_FILE"
#: a spec whose cases crashed the process this often has its remaining cases not run
MAX_CRASHES_PER_SPEC = 3
#: children started per run, at most (each crash starts one)
MAX_CHILDREN = 20
#: how long the parent lets a child stop after Ctrl-C before it forwards SIGINT / kills it
_FORWARD_AFTER_S, _KILL_AFTER_S = 1.0, 10.0
_POLL_S = 0.05
_MAX_FRAMES = 12

#: the op namespaces that are torch's own (a crash there is the simulated device's defect)
_TORCH_NAMESPACES = ("aten", "prims", "prim", "_c10d_functional", "c10d", "profiler")
_CRASH_LINE = re.compile(r"fatal signal (?P<num>\d+) \((?P<name>\w+)\) while running "
                         r"(?P<op>.+?) on (?P<device>\S+)\s*$")


def _crash_file_env() -> str:
    from offload_ref.platform import simulated

    return getattr(simulated, "CRASH_FILE_ENV", CRASH_FILE_ENV)


# -- the child ---------------------------------------------------------------------------------


class Journal(RunObserver):
    """The child's side: each line is written and flushed before what it announces runs."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def phase(self, what: str, spec: Any, strategy: str | None = None,
              check: str | None = None) -> None:
        self.write("phase", what=what, spec=spec.name if spec is not None else None,
                   strategy=strategy, check=check)

    def planned(self, ids: Sequence[CaseId]) -> None:
        self.write("planned", ids=[dataclasses.asdict(cid) for cid in ids])

    def started(self, cid: CaseId) -> None:
        self.write("started", id=dataclasses.asdict(cid))

    def result(self, result: CheckResult) -> None:
        self.write("result", result=dataclasses.asdict(result))


def child_setup(config: dict[str, Any]) -> None:
    """What a child does first: the parent's import path, death with its parent (Linux), and
    ``faulthandler`` writing the Python frames of a crash into the attempt's file (before the
    simulated accelerator loads, so that its crash handler hands the signal on to it)."""
    import faulthandler

    sys.path[:] = config["sys_path"]
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != config["parent"]:  # the parent died before prctl: nobody will read
        os._exit(1)
    faults = open(config["fault_file"], "w", encoding="utf-8")  # noqa: SIM115 - kept open
    faulthandler.enable(file=faults, all_threads=True)
    _KEEP.append(faults)


_KEEP: list[Any] = []


# -- the parent --------------------------------------------------------------------------------


@dataclasses.dataclass
class Supervised:
    """What :func:`supervise` brings back."""

    results: list[CheckResult]
    #: the kit's device line, as the child reported it (None: no child got that far)
    device: str | None
    #: None: the run was not interrupted; else what was running when Ctrl-C came ('' nothing)
    interrupted: str | None
    #: a child's usage error (the parent's own selection passed: it should not happen)
    usage_error: str | None
    children: int


class _Tail:
    """The journal's complete lines, as they come."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


class _Run:
    """The parent's view of the run, across children."""

    def __init__(self, spec_names: Sequence[str], include_global: bool,
                 sources: Mapping[str, str | None],
                 progress: Callable[[int, int, CheckResult], None] | None,
                 announce: Callable[[int], None] | None) -> None:
        self.spec_names, self.include_global = list(spec_names), include_global
        self.progress, self.announce = progress, announce
        self.results: list[CheckResult] = []
        self.done: set[str] = set()
        self.plan: list[CaseId] | None = None
        self.total = 0
        self.device: str | None = None
        self.excluded: dict[str, str] = {}  # spec name -> why its cases are not run
        self.crashes: Counter[str] = Counter()
        self.crashed: dict[str, list[str]] = {}  # spec name -> the ids of its crashed cases
        self.sources = dict(sources)
        self.reset()

    def reset(self) -> None:
        """A new child: nothing of it is known yet."""
        self.running: dict[str, Any] | None = None
        self.finished = self.interrupted = False
        self.usage_error: str | None = None
        self.escaped: str | None = None
        self.last: str | None = None  # the id of the child's last result

    def take(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "device":
            self.device = record["line"]
        elif kind in ("phase", "started"):
            self.running = record
        elif kind == "planned":
            ids = [CaseId(**fields) for fields in record["ids"]]
            self.plan = self.plan if self.plan is not None else ids
            self.total = len(self.results) + sum(str(c) not in self.done for c in ids)
            if self.announce is not None:
                self.announce(self.total)
                self.announce = None
            self.running = None
        elif kind == "result":
            fields = dict(record["result"])
            self.add(CheckResult(**{**fields, "id": CaseId(**fields["id"])}))
            if self.running and self.running["kind"] == "started" and \
                    self.running["id"] == fields["id"]:
                self.running = None
        elif kind == "done":
            self.finished = True
        elif kind == "interrupted":
            self.interrupted = True
        elif kind == "usage_error":
            self.usage_error = record["message"]
        elif kind == "escaped":
            self.escaped = record["text"]

    def add(self, result: CheckResult) -> None:
        if str(result.id) in self.done:
            return
        self.done.add(str(result.id))
        self.results.append(result)
        self.last = str(result.id)
        self.total = max(self.total, len(self.results))
        if self.progress is not None:
            self.progress(len(self.results), self.total, result)

    def remaining(self) -> list[CaseId] | None:
        """The planned cases with no result whose spec still runs (None: no plan yet)."""
        if self.plan is None:
            return None
        return [c for c in self.plan if str(c) not in self.done and c.spec not in self.excluded]

    def next_selection(self) -> tuple[list[str], bool] | None:
        """The spec names and whether global cases run, for the next child (None: nothing
        is left to run)."""
        left = self.remaining()
        if left is None:
            names = [n for n in self.spec_names if n not in self.excluded]
            return (names, self.include_global) if names or self.include_global else None
        if not left:
            return None
        names = sorted({c.spec for c in left if c.spec is not None})
        return names, any(c.spec is None for c in left)

    def exclude(self, spec: str, why: str) -> None:
        """Run no more case of ``spec``; each planned case of it without a result gets the
        error ``not run: WHY`` (:meth:`not_run`)."""
        self.excluded[spec] = why

    def not_run(self, stopped: str | None = None) -> None:
        """Give each planned case without a result an error saying why it was not run: its
        spec's exclusion, else ``stopped`` (the run stopped; None: leave the others), so that
        the matrix and the totals count it and the text report prints the reason."""
        for cid in self.plan or ():
            if str(cid) in self.done:
                continue
            why = self.excluded.get(cid.spec) if cid.spec is not None else None
            why = why or stopped
            if why is not None:
                self.add(CheckResult(cid, "error", f"not run: {why}",
                                     **_severity(cid.check, "error")))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _naming_an_op(line: str) -> re.Match[str] | None:
    found = _CRASH_LINE.search(line)
    return found if found and not found["op"].startswith("no hpu op") else None


def crash_report(returncode: int, crash_text: str, faults: str, escaped: str | None = None
                 ) -> tuple[str, list[str]]:
    """How the child ended, in words (``died from signal 11 (SIGSEGV) in aten::mul.Tensor on
    hpu``), and the lines that explain it: the simulated accelerator's crash line and what it
    means, or why there is none, then the Python frames at the crash."""
    lines = [line.strip() for line in crash_text.splitlines() if "fatal signal" in line]
    # the line that names an op, if one does (a signal the process raises after a crash in an
    # op appends a second line, naming none)
    lines.sort(key=lambda line: bool(_naming_an_op(line)))
    crash = _naming_an_op(lines[-1]) if lines else None
    op = crash["op"] if crash else None
    if returncode < 0:
        number = -returncode
        how = f"died from signal {number} ({_signal_name(number)})"
        how += f" in {op} on {crash['device']}" if crash else "; the op is unknown"
    elif escaped:
        how = f"stopped on an exception the kit did not catch (exit status {returncode})"
    else:
        how = f"exited with status {returncode} before it reported a result"
    detail = []
    if op and op.split("::")[0] in _TORCH_NAMESPACES:
        detail.append(
            f"offload-ref's simulated accelerator crashed in torch's {op} (its crash line: "
            f"{lines[-1]!r}).  A crash of the simulated device in one of torch's ops is a defect "
            f"of offload-ref, not a verdict on the pipeline: rerun with --single-device to judge "
            f"the pipeline on the CPU alone, and report the op and the frames below to "
            f"offload-ref")
    elif op:
        detail.append(
            f"{op} is not one of torch's ops (its crash line: {lines[-1]!r}): its own kernel "
            f"crashed while the simulated accelerator ran it on hpu tensors; rerun with "
            f"--single-device to see whether it crashes on the CPU too, and look at the frames "
            f"below")
    elif lines:
        detail.append(f"the simulated accelerator's crash line: {lines[-1]!r}: the crash was not "
                      f"inside one of its ops (the pipeline's own native code, torch, or a "
                      f"library); the Python frames below show where it was")
    elif returncode == -signal.SIGKILL:
        detail.append("SIGKILL comes from outside the process: the system's out-of-memory "
                      "killer (look at the pipeline's memory), or a user")
    elif returncode < 0:
        detail.append("the simulated accelerator wrote no crash line, so the crash was not inside "
                      "one of its ops (the pipeline's own native code, torch, or a library); the "
                      "Python frames below show where it was")
    elif escaped:
        detail += ["the exception:", *("  " + line for line in escaped.strip().splitlines()[-8:])]
    else:
        detail.append("the code under test ended the process itself (os._exit, or native code "
                      "calling exit()); the Python frames are unknown")
    frames = _frames(faults)
    if frames:
        shown = frames[:_MAX_FRAMES]
        detail += ["Python frames at the crash, most recent call first:", *shown]
        if len(frames) > len(shown):
            detail.append(f"  ... {len(frames) - len(shown)} more")
    return how, detail


def _frames(faults: str) -> list[str]:
    """The crashing thread's frames from ``faulthandler``'s output."""
    blocks: list[tuple[str, list[str]]] = []
    for line in faults.splitlines():
        if line.endswith("(most recent call first):"):
            blocks.append((line, []))
        elif blocks and line.startswith("  File "):
            blocks[-1][1].append(line.rstrip())
    current = [frames for head, frames in blocks if head.startswith("Current thread")]
    frames = current[0] if current else (blocks[0][1] if blocks else [])
    while frames and frames[-1].startswith(_KIT_FRAMES):  # the child's own way to the case
        frames.pop()
    return frames


_KIT_FRAMES = tuple(f'  File "{path}' for path in (
    sys.modules[CaseId.__module__].__file__ or "<runner>",
    getattr(importlib.util.find_spec("offload_ref.cli"), "origin", None) or "<cli>", "<string>"))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class _CtrlC:
    """The parent's Ctrl-C: counted, not raised, while children run (main thread only)."""

    def __init__(self) -> None:
        self.presses = 0
        self.first = 0.0
        self.forwarded = False

    def press(self, signum: int = signal.SIGINT, frame: FrameType | None = None) -> None:
        self.presses += 1
        self.first = self.first or time.monotonic()

    @contextmanager
    def installed(self) -> Iterator[_CtrlC]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self.press)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    def tend(self, child: subprocess.Popen[bytes]) -> None:
        if not self.presses or child.poll() is not None:
            return
        waited = time.monotonic() - self.first
        if self.presses > 1 or waited > _KILL_AFTER_S:
            child.kill()
        elif waited > _FORWARD_AFTER_S and not self.forwarded:
            self.forwarded = True
            child.send_signal(signal.SIGINT)


def supervise(command: Sequence[str], argv: Sequence[str], *, spec_names: Sequence[str],
              include_global: bool, sources: Mapping[str, str | None] | None = None,
              progress: Callable[[int, int, CheckResult], None] | None = None,
              announce: Callable[[int], None] | None = None) -> Supervised:
    """Run ``offload-ref check`` with arguments ``argv`` in children started as ``[*command,
    CONFIG]`` until every case has a result (Note [Crash isolation]).  The child reads its
    arguments, the spec names it keeps (``only``), whether it runs the global cases, the case ids
    it skips and the paths of its journal and fault file from the JSON file CONFIG.
    ``spec_names``: the names the arguments select, ``sources``: the arguments that select each
    again (reproduction lines); ``progress(done, total, result)`` is called
    for each result as it comes, ``announce(total)`` once the first child has planned."""
    run = _Run(spec_names, include_global, sources or {}, progress, announce)
    ctrl_c = _CtrlC()
    children = 0
    with tempfile.TemporaryDirectory(prefix="offload-ref-check-") as folder, ctrl_c.installed():
        selection: tuple[list[str], bool] | None = (list(spec_names), include_global)
        while selection is not None:
            children += 1
            run.reset()
            only, with_global = selection
            paths = {name: os.path.join(folder, f"{name}-{children}")
                     for name in ("config", "journal", "faults", "crash")}
            with open(paths["config"], "w", encoding="utf-8") as f:
                json.dump({"argv": list(argv), "sys_path": sys.path, "parent": os.getpid(),
                           "only": only, "include_global": with_global,
                           "skip": sorted(run.done), "journal": paths["journal"],
                           "fault_file": paths["faults"]}, f)
            env = {**os.environ, _crash_file_env(): paths["crash"]}
            tail = _Tail(paths["journal"])
            child = subprocess.Popen([*command, paths["config"]], env=env)
            try:
                while True:
                    try:
                        code: int | None = child.wait(timeout=_POLL_S)
                    except subprocess.TimeoutExpired:
                        code = None
                    for record in tail.read():
                        run.take(record)
                    if code is not None:
                        break
                    ctrl_c.tend(child)
            except KeyboardInterrupt:  # not the main thread: no handler to count it
                ctrl_c.press()
                child.send_signal(signal.SIGINT)
                code = child.wait()
                for record in tail.read():
                    run.take(record)
            if run.finished:
                break
            if ctrl_c.presses or run.interrupted:
                running = run.running
                return Supervised(run.results, run.device, _what(running), None, children)
            if run.usage_error is not None:
                return Supervised(run.results, run.device, None, run.usage_error, children)
            _charge(run, code, _read(paths["crash"]), _read(paths["faults"]))
            selection = run.next_selection()
            if selection is not None and children >= MAX_CHILDREN:
                stopped = (f"offload-ref check stopped after {children} processes running its "
                           f"checks died (the errors above say what crashed)")
                if run.plan is None:  # the cases left are unknown: one error says so
                    run.add(CheckResult(CaseId("preflight", None, None), "error",
                                        f"{stopped}; the planned cases were not run"))
                run.not_run(stopped)
                break
        run.not_run()
    return Supervised(run.results, run.device, None, None, children)


def _what(running: dict[str, Any] | None) -> str:
    """What a journal record says was running, in words ('' for nothing)."""
    if running is None:
        return ""
    if running["kind"] == "started":
        return str(CaseId(**running["id"]))
    spec, what = running["spec"], running["what"]
    if what == "plan":
        return f"deciding whether {running['check']} applies to {spec} under {running['strategy']}"
    return f"the {'preflight' if what == 'preflight' else 'plan resolution'} of {spec}"


def _charge(run: _Run, code: int, crash_text: str, faults: str) -> None:
    """Record the death of a child as an error of what was running."""
    how, detail = crash_report(code, crash_text, faults, run.escaped)
    running = run.running
    if running is None:
        if run.device is None or run.plan is None and run.last is None:
            where = "before it ran any case"
            stop = True
        else:
            where = f"between cases (after {run.last})" if run.last else "between cases"
            stop = False
        result = CheckResult(CaseId("preflight", None, None), "error", "\n".join(
            [f"the process running the checks {how}, {where}", *detail]))
        run.add(result)
        if stop:
            run.plan, run.spec_names, run.include_global = [], [], False
        return
    if running["kind"] == "started":
        cid = CaseId(**running["id"])
        spec = cid.spec
        if spec is not None:
            run.crashes[spec] += 1
        tail = "the kit ran the other cases in a new process"
        if spec is not None:
            run.crashed.setdefault(spec, []).append(str(cid))
        if spec is not None and run.crashes[spec] >= MAX_CRASHES_PER_SPEC:
            tail = (f"{run.crashes[spec]} cases of {spec} crashed the process: its remaining "
                    f"cases were not run")
            run.exclude(spec, (
                f"{run.crashes[spec]} cases of {spec} crashed the process "
                f"({', '.join(run.crashed[spec])}), so the kit ran no more of its cases; rerun "
                f"this one with the reproduce line, or fix the crash and rerun them all"))
        run.add(CheckResult(cid, "error", "\n".join(
            [f"the process running this case {how}", *detail, tail]),
            **_severity(cid.check, "error")))
        return
    spec = running["spec"]
    cid = CaseId("preflight", spec, running.get("strategy"), run.sources.get(spec))
    run.exclude(spec, f"the process died while it ran {_what(running)} ({cid} says how)")
    run.add(CheckResult(cid, "error", "\n".join(
        [f"the process running {_what(running)} {how}", *detail,
         f"the checks of {spec} were not run"])))


def _severity(check: str, outcome: str) -> dict[str, Any]:
    """The severity field of a result, where results carry one (contracts/severity.py)."""
    if "severity" not in {f.name for f in dataclasses.fields(CheckResult)}:
        return {}
    try:
        from . import severity
    except ImportError:  # pragma: no cover
        return {}
    level = severity.judge(check, outcome, "")
    return {"severity": None if level is None else level.value}
