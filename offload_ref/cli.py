"""``offload-ref``: run the conformance kit, explain a plan, benchmark, trace.

    offload-ref check [MODULE:ATTR]... [--pipeline NAME]... [--spec MODULE:ATTR]...
                      [--inputs MODULE:ATTR] [--name NAME]... [--check ID]...
                      [--strategy S]... [--offloader MODULE:ATTR] [--list] [--json PATH]
                      [--torch-threads N] [--single-device]
    offload-ref plan  [MODULE:ATTR]... [--pipeline NAME]... [--spec MODULE:ATTR]...
                      [--inputs MODULE:ATTR] [--name NAME]... [--strategy S]...
                      [--strategy auto --device-budget N]
    offload-ref bench [--hidden N] [--blocks N] [--tokens N] [--steps N] [--repeats N]
                      [--device D] [--peers] [--growth] [--spec MODULE:ATTR] [--json]
                      [--model NAME|key=value,... [--no-residency] [--calibrate]]
    offload-ref trace [--pipeline NAME | --spec MODULE:ATTR] [--strategy S] -o TRACE.json
                      [--no-prefetch] [--png TIMELINE.png] [--compare-no-prefetch]
                      [--stall-ms MS] [--device D] [--torch-threads N]
    offload-ref peers [--peer NAME]... [--pipeline NAME]... [--markdown docs/peers.md]
                      [--perf-pipeline NAME] [--repeats N] [--torch-threads N]

``offload-ref COMMAND --help`` explains every option of a command.

Exit status: 0 when everything holds (check: every case passed, failed as expected or does not
apply; plan: every selected plan resolves), 1 when something does not, 2 for a bad argument, 130
when Ctrl-C stopped a check (the report shows the results that came before).

offload-ref check runs its cases in a child process: a crash (a segfault in a kernel) is an error
of the case it killed, naming the signal and the op, and the other cases run in a new process.

MODULE:ATTR (positional or --spec) names a PipelineSpec, a list or tuple of them, or a factory: a
callable taking no arguments or seed= that builds your pipeline.  A factory's pipeline is called
with the keyword arguments --inputs returns (default: none) and is checked under the --strategy
values (default: model_level and layer_wise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._cli_selection import _closest, _selection, _UsageError
from .config import OffloadStrategy
from ._cli_types import MAX_THREADS, count, output_path

__all__ = ["main"]


def _check_ids(args: argparse.Namespace) -> list[str] | None:
    from offload_ref.contracts.runner import load_catalogue

    catalogue = load_catalogue()
    for check_id in args.check:
        if check_id not in catalogue:
            raise _UsageError(f"--check {check_id!r}: unknown check id"
                              f"{_closest(check_id, sorted(catalogue))} "
                              f"(`offload-ref check --list` prints them all)")
    return args.check or None


def _implementation(args: argparse.Namespace) -> Any:
    """offload-ref's backends, or the offloader ``--offloader MODULE:ATTR`` names."""
    from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
    from offload_ref.contracts.offloader import OffloaderError, load_offloader

    if not args.offloader:
        return DEFAULT_IMPLEMENTATION
    try:
        return load_offloader(args.offloader)
    except OffloaderError as exc:
        raise _UsageError(f"--offloader {exc}") from None


def _cmd_check(args: argparse.Namespace) -> int:
    from offload_ref.contracts.runner import RunObserver, load_catalogue, run_checks

    if args.list:
        for info in sorted(load_catalogue().values(), key=lambda i: (i.section, i.id)):
            print(f"§{info.section:<5} {info.id:<62} {info.title}")
        return 0
    if args.single_device:
        os.environ["OFFLOAD_REF_SIM"] = "0"
    if args.isolate:
        return _check_isolated(args)
    import time

    import torch

    from offload_ref.contracts import report
    from offload_ref.platform import simulated

    simulated.available()  # first: torch looks its accelerator hooks up once per process
    from offload_ref.contracts.escapes import telling_interrupts_apart

    with telling_interrupts_apart():  # Note [Escaping exceptions]
        specs, sources = _selection(args)
        checks = _check_ids(args)
        impl = _implementation(args)
    torch.set_num_threads(args.torch_threads)
    head = report.header(implementation=impl.name, pipelines=_pipelines(specs, sources),
                         threads=args.torch_threads)

    class Announce(RunObserver):
        def planned(self, ids: Sequence[Any]) -> None:
            _announce(len(ids), len(specs))

    start = time.perf_counter()
    progress = _Progress(sys.stderr)
    try:
        results = run_checks(specs, checks=checks, strategies=args.strategy or None,
                             include_global=_include_global(args), sources=sources,
                             progress=progress, impl=impl, observer=Announce())
    finally:
        progress.close()
    return _report(args, results, head, time.perf_counter() - start)


def _announce(total: int, pipelines: int) -> None:
    print(f"offload-ref check: {total} cases over {pipelines} pipeline(s)", file=sys.stderr)


def _include_global(args: argparse.Namespace) -> bool:
    return not (args.spec or args.refs) or bool(args.pipeline)


def _pipelines(specs: Sequence[Any], sources: dict[Any, str]) -> dict[str, str]:
    return {spec.name: sources.get(spec, "built-in fixture") for spec in specs}


def _report(args: argparse.Namespace, results: Sequence[Any], head: dict[str, Any],
            seconds: float, interrupted: str | None = None) -> int:
    """Write the report (text, ``--json``); the exit status."""
    from offload_ref.contracts import report

    rows = report.rows_from_results(results)
    if args.json:
        content = report.to_json(rows, head, seconds)
        if interrupted is not None:
            content["interrupted"] = interrupted
        data = json.dumps(content, indent=2)
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(data + "\n")
    if args.json != "-":
        report.render(rows, head, seconds=seconds)
    if interrupted is not None:
        print(f"offload-ref check: {interrupted}", file=sys.stderr)
        return 130
    return 0 if all(r.ok for r in results) else 1


#: the child process of ``offload-ref check`` (contracts/isolation.py); its argument: the config
_CHILD = ("import sys; from offload_ref.cli import _check_child; "
          "sys.exit(_check_child(sys.argv[1]))")


def _check_isolated(args: argparse.Namespace) -> int:
    """``offload-ref check`` as the command runs it: the arguments are validated here (a bad one
    is exit status 2, as in process), the cases run in child processes (Note [Crash isolation]
    in contracts/isolation.py), the report is written here."""
    import time

    from offload_ref.contracts import report
    from offload_ref.contracts.escapes import telling_interrupts_apart
    from offload_ref.contracts.isolation import supervise

    # a module of the selection, or the --offloader factory the parent validates, raising
    # KeyboardInterrupt itself: a usage error, not the user's Ctrl-C (Note [Escaping exceptions])
    with telling_interrupts_apart():
        specs, sources = _selection(args)
        _check_ids(args)
        impl = _implementation(args)
    start = time.perf_counter()
    progress = _Progress(sys.stderr)

    try:
        run = supervise([sys.executable, "-c", _CHILD], args.argv,
                        spec_names=[spec.name for spec in specs],
                        include_global=_include_global(args),
                        sources={spec.name: source for spec, source in sources.items()},
                        progress=progress, announce=lambda total: _announce(total, len(specs)))
    finally:
        progress.close()
    if run.usage_error is not None:
        raise _UsageError(run.usage_error)
    device = run.device or ("unknown (the process running the checks stopped before it said; "
                            "the errors below say why)")
    head = report.header(implementation=impl.name, pipelines=_pipelines(specs, sources),
                         threads=args.torch_threads, device=device)
    interrupted = None
    if run.interrupted is not None:
        during = f" during {run.interrupted}" if run.interrupted else ""
        interrupted = (f"interrupted (Ctrl-C){during}; the report shows the {len(run.results)} "
                       f"result(s) that came before")
    return _report(args, run.results, head, time.perf_counter() - start, interrupted)


def _check_child(config_path: str) -> int:
    """The child process of ``offload-ref check``: run the cases its config selects, writing
    each to the journal; the parent writes the report (Note [Crash isolation])."""
    import traceback

    from offload_ref.contracts import isolation
    from offload_ref.contracts.escapes import is_users_interrupt, telling_interrupts_apart

    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    isolation.child_setup(config)
    journal = isolation.Journal(config["journal"])
    with telling_interrupts_apart(once=True):
        try:
            return _run_child(config, journal)
        except _UsageError as exc:
            journal.write("usage_error", message=str(exc))
            return 2
        except BaseException as exc:  # noqa: BLE001 - the parent charges it to what was running
            if is_users_interrupt(exc):
                journal.write("interrupted")
                return 130
            journal.write("escaped", text=traceback.format_exc())
            return 70
        finally:
            journal.close()


def _run_child(config: dict[str, Any], journal: Any) -> int:
    import torch

    from offload_ref.contracts import report
    from offload_ref.contracts.refs import import_from_the_current_folder
    from offload_ref.contracts.runner import run_checks
    from offload_ref.platform import simulated

    import_from_the_current_folder()
    args = _parser().parse_args(config["argv"])
    if args.single_device:
        os.environ["OFFLOAD_REF_SIM"] = "0"
    simulated.available()  # first: torch looks its accelerator hooks up once per process
    journal.write("device", line=report.kit_device_line())
    specs, sources = _selection(args)
    specs = [spec for spec in specs if spec.name in config["only"]]
    impl = _implementation(args)
    torch.set_num_threads(args.torch_threads)
    run_checks(specs, checks=_check_ids(args), strategies=args.strategy or None,
               include_global=config["include_global"], sources=sources, impl=impl,
               observer=journal, skip=config["skip"])
    journal.write("done")
    return 0


class _Progress:
    """One progress line on stderr while the kit runs: rewritten in place on a terminal, a line
    per tenth of the run otherwise (CI logs), and at least one every ``every`` seconds there
    (a run whose first cases are long still shows it moves).  For the first ``early_for``
    seconds after its first line a log gets one every ``early`` seconds instead: on first use
    the build of the simulated accelerator takes most of the first minute, and the log should
    show the run moving past 0% right after it."""

    def __init__(self, stream: Any, every: float = 15.0, *, early: float = 2.0,
                 early_for: float = 30.0) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.failed = 0
        self.shown = -1
        self.width = 0
        self.every = every
        self.early, self.early_for = early, early_for
        self.last = time.monotonic()
        self.first: float | None = None  # when the first line was written

    def __call__(self, done: int, total: int, result: Any) -> None:
        self.failed += not result.ok
        where = "/".join(p for p in (result.id.spec, result.id.strategy) if p) or "global"
        line = (f"[{done:>{len(str(total))}}/{total}] {100 * done // max(total, 1):>3}%  "
                f"{self.failed} failed  {where} {result.id.check}")
        if self.tty:
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line.ljust(self.width))
            self.stream.flush()
        else:
            now = time.monotonic()
            early = self.first is None or now - self.first < self.early_for
            if (10 * done // max(total, 1) > self.shown
                    or now - self.last >= (self.early if early else self.every)):
                self.shown = 10 * done // max(total, 1)
                self.last = now
                if self.first is None:
                    self.first = now
                self.stream.write(line + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _cmd_plan(args: argparse.Namespace) -> int:
    from offload_ref.config import OffloadConfig
    from offload_ref.plan import resolve_offload_plan, selectable_components

    specs, _ = _selection(args)
    strategies = args.strategy or None
    if args.device_budget is not None and "auto" not in (strategies or ()):
        raise _UsageError("--device-budget applies to --strategy auto only")
    if "auto" in (strategies or ()) and args.device_budget is None:
        raise _UsageError("--strategy auto needs --device-budget N (bytes)")
    if args.device_budget is not None and args.device_budget < 1:
        raise _UsageError(f"--device-budget {args.device_budget}: must be a positive int (bytes)")
    rejected = 0
    for spec in specs:
        for strategy in strategies or spec.strategies:
            pipeline = spec.build()
            if strategy == "auto":
                config = OffloadConfig(strategy="auto", device_budget_bytes=args.device_budget)
            else:
                components = selectable_components(pipeline, strategy)
                config = OffloadConfig(strategy=strategy, components=components)
            print(f"== {spec.name} ==")
            try:
                print(resolve_offload_plan(pipeline, config).describe())
            except ValueError as exc:
                print(f"rejected: {exc}")
                rejected += 1
            print()
    if rejected:
        print(f"offload-ref plan: {rejected} plan(s) rejected", file=sys.stderr)
    return 1 if rejected else 0


#: The real diffusers pipelines ``offload-ref peers`` judges beside the fixtures (name -> the
#: attribute of offload_ref.fixtures.diffusers_dit).
_DIFFUSERS_SPECS = {"diffusers_dit": "DIT_SPEC", "diffusers_sd3": "SD3_SPEC"}


def _cmd_peers(args: argparse.Namespace) -> int:
    import time

    import torch

    from offload_ref.platform import simulated

    simulated.available()  # first: torch looks its accelerator hooks up once per process
    from offload_ref.contracts import conformance, report
    from offload_ref.fixtures import SPECS, get_spec
    from offload_ref.peers import PEERS

    for name in args.peer:
        if name not in PEERS:
            raise _UsageError(f"--peer {name!r}: no such adapter{_closest(name, list(PEERS))} "
                              f"(adapters: {', '.join(PEERS)})")
    fixtures = [spec.name for spec in SPECS]
    for name in args.pipeline:
        if name not in fixtures and name not in _DIFFUSERS_SPECS:
            raise _UsageError(f"--pipeline {name!r}: no built-in fixture of that name"
                              f"{_closest(name, fixtures + list(_DIFFUSERS_SPECS))}")
    specs = [get_spec(n) for n in args.pipeline if n not in _DIFFUSERS_SPECS]
    if not args.pipeline:
        specs = list(SPECS)
    sources: dict[Any, str] = {}
    wanted = [n for n in _DIFFUSERS_SPECS if not args.pipeline or n in args.pipeline]
    if wanted:
        try:
            from offload_ref.fixtures import diffusers_dit
        except ImportError as exc:  # diffusers not installed: the fixtures alone
            print(f"offload-ref peers: the diffusers pipelines are left out ({exc})",
                  file=sys.stderr)
        else:
            for name in wanted:
                spec = getattr(diffusers_dit, _DIFFUSERS_SPECS[name])
                specs.append(spec)
                sources[spec] = (f"--spec offload_ref.fixtures.diffusers_dit:"
                                 f"{_DIFFUSERS_SPECS[name]}")
    torch.set_num_threads(args.torch_threads)
    names = args.peer or list(PEERS)
    # the step-time columns, on each of these a peer serves (diffusers' pipeline methods serve
    # a DiffusionPipeline only)
    perf_specs = [get_spec(args.perf_pipeline)] + [s for s in specs if s.name == "diffusers_sd3"]
    rows = []
    for name in names:
        start = time.perf_counter()
        row = conformance.judge_peer(name, PEERS[name], specs, sources)
        for strategy in row.strategies:
            measured = [conformance.measure_peer(PEERS[name], perf_spec, strategy,
                                                 repeats=args.repeats)
                        for perf_spec in perf_specs]
            served = [m for m in measured if "skipped" not in m]
            row.perf += served or measured[:1]
        rows.append(row)
        verdicts = "  ".join(f"{a}:{row.cells[a].verdict}" for a in conformance.AREAS_JUDGED)
        print(f"{name:<38} {verdicts}  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    command = "offload-ref peers" + (f" --markdown {args.markdown}" if args.markdown else "")
    from offload_ref.contracts.case import kit_device
    from offload_ref.platform import describe_device

    device = kit_device()
    head = report.header(threads=args.torch_threads,
                         device=describe_device(device))
    from offload_ref import peers

    try:  # Note [Upstream stream reports] in offload_ref/peers.py
        findings: Any = peers.probe_upstream_reports()
    except Exception as exc:  # noqa: BLE001 - the page says why, in place of the findings
        findings = str(exc) if isinstance(exc, RuntimeError) else \
            f"the probes failed: {type(exc).__name__}: {exc}"
        print(f"offload-ref peers: diffusers' upstream reports not probed: {findings}",
              file=sys.stderr)
    page = conformance.render_markdown(rows, header=head,
                                       command=command,
                                       pipelines=[spec.name for spec in specs],
                                       notes=peers.upstream_reports_markdown(findings))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(page)
    else:
        print(page)
    control = [r for r in rows if r.name == "offload_ref"]
    return 1 if any(c.failed for r in control for c in r.cells.values()) else 0


def main(argv: Sequence[str] | None = None, *, isolate: bool | None = None) -> int:
    """The ``offload-ref`` command.  ``argv`` None: the command line (``sys.argv``).

    ``isolate``: whether ``check`` runs its cases in child processes (Note [Crash isolation] in
    contracts/isolation.py); by default it does when ``argv`` is None, as the command does, and
    does not when a caller passes ``argv``, so that a test can patch the kit in its own process.
    """
    from offload_ref.contracts.refs import import_from_the_current_folder

    import_from_the_current_folder()  # MODULE:ATTR in the current folder, as `python -m` finds
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.isolate = argv is None if isolate is None else isolate
    try:
        return args.func(args)
    except _UsageError as exc:
        print(f"offload-ref {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-ref", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def selection(p: argparse.ArgumentParser, auto: bool = False, one: str | None = None,
                  also: str = "") -> None:
        """The pipeline and strategy options; ``one``: the verb of a command that takes exactly
        one pipeline and one strategy (trace), ``also`` what it adds to the fixtures."""
        p.add_argument("refs", nargs="*", default=[], metavar="MODULE:ATTR",
                       help="your own pipeline: a PipelineSpec, a list or tuple of them, or a "
                            "factory (a callable taking no arguments or seed=) whose pipeline "
                            "is called with the keyword arguments of --inputs; found in the "
                            "current folder or on sys.path")
        p.add_argument("--pipeline", action="append", default=[],
                       help="a built-in fixture name (default: all, unless MODULE:ATTR is given)"
                       if one is None else f"the built-in fixture to {one}{also}; name exactly "
                                           "one pipeline, here or as MODULE:ATTR")
        p.add_argument("--spec", action="append", default=[], metavar="MODULE:ATTR",
                       help="the same as a positional MODULE:ATTR")
        p.add_argument("--inputs", metavar="MODULE:ATTR",
                       help="for a factory: inputs(seed=...) or inputs() returning the keyword "
                            "arguments of one generation (default: none)")
        p.add_argument("--name", action="append", default=[],
                       help="keep only the selected pipelines of this name")
        p.add_argument("--strategy", action="append", default=[],
                       choices=[s.value for s in OffloadStrategy.served()]
                       + (["auto"] if auto else []),
                       help=("only this strategy (repeatable; default: every strategy each "
                             "pipeline claims)" + ("; auto needs --device-budget" if auto else ""))
                       if one is None else (f"the strategy to {one}, once (default: layer_wise "
                                            "where the pipeline claims it, else its first)"))

    p_check = sub.add_parser("check", help="run the conformance kit")
    selection(p_check)
    p_check.add_argument("--check", action="append", default=[], metavar="ID",
                         help="only this check (repeatable): its id, as --list and a "
                              "report's rerun lines print it")
    p_check.add_argument("--list", action="store_true", help="list the check catalogue")
    p_check.add_argument("--offloader", metavar="MODULE:ATTR",
                         help="judge another offloader than offload-ref's backends: a factory "
                              "called as factory(device, strategy) returning an object with "
                              "enable(pipeline), disable() and is_enabled(); checks that need "
                              "offload-ref's internals are reported not applicable, with why "
                              "(offload_ref.peers has diffusers' and accelerate's)")
    p_check.add_argument("--json", metavar="PATH", type=output_path,
                         help="also write the report as JSON to PATH ('-': to stdout, instead "
                              "of the text report)")
    p_check.add_argument("--torch-threads", type=count(1, MAX_THREADS), default=1, metavar="N",
                         help="torch intra-op threads while checking (default 1: the built-in "
                              "pipelines are tiny, and thread hand-offs dominate their run time)")
    p_check.add_argument("--single-device", action="store_true",
                         help="run on the CPU alone (host and device both 'cpu'), as before the "
                              "simulated accelerator: placement checks are off (the same as "
                              "OFFLOAD_REF_SIM=0)")
    p_check.set_defaults(func=_cmd_check)

    p_plan = sub.add_parser("plan", help="explain the resolved topology of a pipeline")
    selection(p_plan, auto=True)
    p_plan.add_argument("--device-budget", type=count(1), metavar="N",
                        help="with --strategy auto: the device budget in bytes; prints the "
                             "strategy auto picks and every strategy's predicted peak")
    p_plan.set_defaults(func=_cmd_plan)

    p_peers = sub.add_parser(
        "peers", help="judge the ecosystem's offloaders (offload_ref.peers) through the "
                      "offloader protocol and print the conformance table (docs/peers.md)")
    p_peers.add_argument("--peer", action="append", default=[], metavar="NAME",
                         help="an adapter of offload_ref.peers (default: all)")
    p_peers.add_argument("--pipeline", action="append", default=[], metavar="NAME",
                         help="a built-in fixture, or diffusers_dit / diffusers_sd3 (real "
                              "diffusers pipelines; default: all of them)")
    p_peers.add_argument("--perf-pipeline", default="flux2", metavar="NAME",
                         help="the fixture the step-time and peak-bytes columns are measured "
                              "on (default: flux2, which offers both strategies)")
    p_peers.add_argument("--repeats", type=count(1), default=5, metavar="N",
                         help="timed generations per variant (default 5, interleaved)")
    p_peers.add_argument("--markdown", metavar="PATH", type=output_path,
                         help="write the page to PATH (docs/peers.md) instead of stdout")
    p_peers.add_argument("--torch-threads", type=count(1, MAX_THREADS), default=1, metavar="N",
                         help="torch intra-op threads while judging (default 1)")
    p_peers.set_defaults(func=_cmd_peers)

    from offload_ref.bench import add_bench_parser

    add_bench_parser(sub)
    from offload_ref.trace import add_trace_parser

    add_trace_parser(sub, selection)
    return parser


if __name__ == "__main__":
    sys.exit(main())
