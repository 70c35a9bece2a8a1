"""The pytest11 plugin of offload-ref.

It imports only the standard library and pytest when pytest loads it; torch and the kit are
imported when a test asks for ``offload_ref_check``.  Two ways to run the kit on your pipeline:

* a test file with ``OFFLOAD_REF_SPECS = [PipelineSpec(...)]`` (and optionally
  ``OFFLOAD_REF_EXPECTED_FAILURES = {check_id: reason}``) and a test
  ``def test_offload(offload_ref_check): offload_ref_check()``;
* ``pytest --offload-ref-spec mypkg.specs:SPECS`` with the same test function.

To judge another offloader than offload-ref's backends (an engine's own, diffusers', accelerate's),
name its factory: ``OFFLOAD_REF_OFFLOADER = "mypkg.offload:factory"`` in the test file, or
``--offload-ref-offloader mypkg.offload:factory`` (see ``offload_ref.contracts.offloader``).

Torch threads: a session that will run kit checks (a collected test bound to a check, through
``offload_ref_check`` or ``parametrize_with_checks``) runs with ``torch.set_num_threads(N)``,
``N`` from ``--offload-ref-threads`` (default 1, as ``offload-ref check --torch-threads``), taken
when collection ends and restored when the session ends.  The fixture pipelines and most
author pipelines under test are tiny: intra-op thread hand-offs dominate their run time (2.7x
on a plain run, 11x under ``-n 2`` on 2 cores, where the workers' thread pools fight for the
cores; issue 11).  torch's setting is process-wide, so the other tests of that session run with N
threads too; a session that collects no kit check is left alone (the plugin is loaded by every
pytest run in an environment where offload-ref is installed), and ``--offload-ref-threads 0``
leaves torch's setting alone everywhere.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest

MARKERS = (
    "contract: a conformance-kit check (public check id in the test name)",
    "cuda: needs an NVIDIA GPU; skipped with a stated reason elsewhere",
    "distributed: spawns several processes (gloo on CPU)",
    "slow: takes more than a few seconds",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("offload-ref", "offload-ref conformance kit")
    group.addoption(
        "--offload-ref-spec", action="append", default=[], metavar="MODULE:ATTR",
        help="a PipelineSpec (or a list of them) for tests using the offload_ref_check fixture",
    )
    group.addoption(
        "--offload-ref-offloader", default=None, metavar="MODULE:ATTR",
        help="judge another offloader than offload-ref's backends: a factory(device, strategy) "
             "returning an object with enable(pipeline), disable() and is_enabled() (the same "
             "as OFFLOAD_REF_OFFLOADER in the test module; the option wins)",
    )
    group.addoption(
        "--offload-ref-strategy", action="append", default=[], metavar="STRATEGY",
        help="restrict the kit to these strategies (model_level, layer_wise, "
             "distributed_layer_wise); an unknown name is a usage error",
    )
    group.addoption(
        "--offload-ref-require-cuda", action="store_true", default=False,
        help="fail the session when no CUDA device is available or no test marked cuda ran "
             "(by default such tests are skipped and the summary says that nothing ran)",
    )
    group.addoption(
        "--offload-ref-threads", type=int, default=1, metavar="N",
        help="torch intra-op threads in a session that runs kit checks (default 1: the "
             "pipelines under test are tiny and thread hand-offs dominate; 0: leave torch's "
             "setting alone); restored when the session ends",
    )


_PREVIOUS_THREADS = pytest.StashKey[int]()
#: Whether the plugin froze the collected objects (Note [Frozen heap] in runner.py)
_FROZEN = pytest.StashKey[bool]()
_ROWS = pytest.StashKey[list]()
_CUDA = pytest.StashKey[dict]()
_SPAWNED = pytest.StashKey[bool]()
_CASE_PROPERTY = "offload_ref_case"
_CUDA_PROPERTY = "offload_ref_cuda"
#: a spawned-rank case (§H), and the xdist group prefix of one pipeline's (pytest_support.py)
_SPAWN_PROPERTY = "offload_ref_spawn"
_SPAWN_GROUP = "offload_ref-distributed-"
#: the session's config, for the report hooks that pytest calls without one
_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    strategies = config.getoption("--offload-ref-strategy")
    if strategies:
        from offload_ref.contracts.registry import strategy_names  # no torch

        try:
            strategy_names(strategies, "--offload-ref-strategy")
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    if (config.getoption("--offload-ref-require-cuda") and not hasattr(config, "workerinput")
            and not _cuda_available()):
        raise pytest.UsageError(
            "--offload-ref-require-cuda: no CUDA device is available (torch.cuda.is_available() "
            "is False); run on a machine with an NVIDIA GPU and a CUDA build of torch")
    if config.getoption("--offload-ref-threads") < 0:
        raise pytest.UsageError("--offload-ref-threads: expected N >= 0 (0: leave torch alone)")
    if (config.getoption("--offload-ref-spec") or config.getoption("--offload-ref-offloader")
            or "contract" in (config.option.markexpr or "")):
        _load_the_kit_device()


_LOADED: list[bool] = []  # the kit's device was loaded (or found unavailable) in this process
#: what marks a test file that runs kit checks, read before pytest imports it
_KIT_FILE_MARKERS = (b"OFFLOAD_REF_SPECS", b"OFFLOAD_REF_OFFLOADER", b"parametrize_with_checks",
                     b"offload_ref_check", b"offload_ref.contracts")


def _load_the_kit_device() -> None:
    """Load the simulated accelerator now, before anything asks torch for its accelerator hooks
    (importing diffusers does, and so does ``torch.random.fork_rng``): after that it cannot
    register, and the kit would run with placement checks off (its header says why).  Only in
    sessions that run kit checks: loading adds a device to the process."""
    _LOADED.append(True)
    if os.environ.get("OFFLOAD_REF_SIM", "1") == "0":
        return
    from offload_ref.platform import simulated

    simulated.available()  # loads it, or records why it cannot (the report prints that)


def pytest_collect_file(file_path: Any, parent: Any) -> None:
    """Before a test module that uses the kit is imported, load the kit's device."""
    name = file_path.name
    if _LOADED or file_path.suffix != ".py" or not (name.startswith("test_") or
                                                     name.endswith("_test.py")):
        return None
    try:
        text = file_path.read_bytes()
    except OSError:
        return None
    if any(marker in text for marker in _KIT_FILE_MARKERS):
        _load_the_kit_device()
    return None


def _runs_kit_checks(items: list[pytest.Item]) -> bool:
    support = sys.modules.get("offload_ref.contracts.pytest_support")
    if support is None:  # nothing was bound to a check: not imported
        return False
    return any(isinstance(value, support.BoundCheck)
               for item in items
               for value in getattr(getattr(item, "callspec", None), "params", {}).values())


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _dist_given(config: pytest.Config) -> bool:
    """Whether the command line names a pytest-xdist distribution mode itself."""
    return any(a == "--dist" or a.startswith("--dist=") or a == "-d"
               for a in config.invocation_params.args)


def pytest_cmdline_main(config: pytest.Config) -> None:  # after xdist's (tryfirst), before main
    """Under ``-n N`` without ``--dist``, pytest-xdist distributes with ``load``; the kit's
    spawned-rank checks (§H) of one pipeline share one spawn only on one worker, which
    ``loadgroup`` gives them (Note [One spawn per batch] in checks/distributed.py), so the
    plugin asks for it then.  A ``--dist`` given on the command line is kept (the summary says
    what it cost when §H cases ran).  A worker parses the command line again and takes
    ``loadgroup`` (the ``@group`` suffix of its items' ids, which the scheduler groups by) only
    from ``--dist loadgroup`` there, so the controller tells each worker
    (:func:`pytest_configure_node`)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        if workerinput.get(_LOADGROUP_KEY):
            config.option.loadgroup = True
        return
    if getattr(config.option, "dist", "no") == "load" and not _dist_given(config):
        config.option.dist = "loadgroup"


_LOADGROUP_KEY = "offload_ref_loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's hook, on the controller, for each worker before it starts."""
    node.workerinput[_LOADGROUP_KEY] = getattr(node.config.option, "dist", "no") == "loadgroup"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Tag kit cases for the summary matrix, and tests marked ``cuda`` for the summary's note
    (both travel in ``user_properties``, to the controller under pytest-xdist)."""
    import json

    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.user_properties.append((_CUDA_PROPERTY, "1"))
        if any(str(m.kwargs.get("name", m.args[0] if m.args else "")).startswith(_SPAWN_GROUP)
               for m in item.iter_markers("xdist_group")):
            item.user_properties.append((_SPAWN_PROPERTY, "1"))
        params = getattr(getattr(item, "callspec", None), "params", {})
        for value in params.values():
            fields = getattr(value, "report_fields", None)
            if callable(fields):
                if hasattr(value, "nodeid"):
                    value.nodeid = item.nodeid
                item.user_properties.append((_CASE_PROPERTY, json.dumps(fields())))
                break


def _row(report: pytest.TestReport) -> dict | None:
    import json

    for key, value in report.user_properties:
        if key == _CASE_PROPERTY:
            row = json.loads(value)
            break
    else:
        return None
    if report.skipped and hasattr(report, "wasxfail"):
        outcome = "xfailed"
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcome = "not_applicable" if "not applicable:" in reason else "skipped"
        row["message"] = reason.partition("not applicable: ")[2] or reason
    elif report.failed:
        outcome = "error" if report.when != "call" else (
            "xpassed" if "XPASS" in str(report.longrepr) else "failed")
        row["message"] = str(getattr(report.longrepr, "reprcrash", None) and
                             report.longrepr.reprcrash.message or "").strip()
    else:
        outcome = "passed"
    row["outcome"] = outcome
    row["seconds"] = report.duration
    return row


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect one row per kit case (on the controller under pytest-xdist, which receives every
    worker's reports with their ``user_properties``)."""
    config = _CONFIG[0] if _CONFIG else None
    if config is None or hasattr(config, "workerinput"):
        return
    final = report.when == "call" or (report.when == "setup" and not report.passed)
    if report.when in ("setup", "call") and any(k == _CUDA_PROPERTY
                                                 for k, _ in report.user_properties):
        # counted where the reports arrive (the controller under pytest-xdist, whose workers
        # collect the items): a test is selected at its setup, and ran when it has a call phase
        cuda = config.stash.setdefault(_CUDA, {"selected": 0, "ran": 0})
        cuda["selected" if report.when == "setup" else "ran"] += 1
    if report.when == "setup" and any(k == _SPAWN_PROPERTY for k, _ in report.user_properties):
        config.stash[_SPAWNED] = True
    if final:
        row = _row(report)
        if row is not None:
            config.stash.setdefault(_ROWS, []).append(row)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    rows = config.stash.get(_ROWS, None)
    if rows:
        import io

        from offload_ref.contracts.report import Row, render

        out = io.StringIO()
        render([Row(**{k: v for k, v in r.items() if k in Row.__dataclass_fields__})
                for r in rows], out=out, failures=False)
        from offload_ref.contracts.report import kit_device_line

        terminalreporter.write_sep("=", "offload-ref conformance matrix")
        terminalreporter.write(f"device: {kit_device_line()}\n")
        terminalreporter.write(out.getvalue())
    dist = getattr(config.option, "dist", "no")
    if config.stash.get(_SPAWNED, False) and dist not in ("no", "loadgroup"):
        terminalreporter.write_sep("=", "offload-ref: --dist", yellow=True, bold=True)
        terminalreporter.write_line(
            f"--dist {dist} spread one pipeline's spawned-rank checks (§H) over the workers, each "
            f"spawning its own ranks; --dist loadgroup (what -n N alone gives with offload-ref "
            f"installed) keeps them on one worker and one spawn")
    cuda = config.stash.get(_CUDA, None)
    if cuda and cuda["selected"] and not cuda["ran"]:
        why = ("no CUDA device is available (torch.cuda.is_available() is False)"
               if not _cuda_available() else "every one was skipped")
        terminalreporter.write_sep("=", "offload-ref: CUDA", yellow=True, bold=True)
        terminalreporter.write_line(
            f"{cuda['selected']} test(s) marked cuda were selected and none ran: {why}. "
            f"Nothing was measured on a GPU; --offload-ref-require-cuda makes this an error.",
            yellow=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    cuda = session.config.stash.get(_CUDA, None)
    if (session.config.getoption("--offload-ref-require-cuda") and not (cuda and cuda["ran"])
            and not hasattr(session.config, "workerinput")):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _restore_threads(session)
    if session.config.stash.get(_FROZEN, False):
        gc.unfreeze()
        del session.config.stash[_FROZEN]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test of a session whose plugin froze the heap, what earlier tests left alive
    is frozen too (Note [Frozen heap] in runner.py)."""
    if item.config.stash.get(_FROZEN, False):
        from .runner import refreeze_heap

        refreeze_heap()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _runs_kit_checks(session.items):
        return
    from .runner import freeze_heap  # Note [Frozen heap] in runner.py

    session.config.stash[_FROZEN] = freeze_heap()
    threads = session.config.getoption("--offload-ref-threads")
    if not threads:
        return
    import torch

    session.config.stash[_PREVIOUS_THREADS] = torch.get_num_threads()
    torch.set_num_threads(threads)


def _restore_threads(session: pytest.Session) -> None:
    previous = session.config.stash.get(_PREVIOUS_THREADS, None)
    if previous is not None:
        import torch

        torch.set_num_threads(previous)
        del session.config.stash[_PREVIOUS_THREADS]


def _load(ref: str) -> list[tuple[Any, str]]:
    """``(spec, source)`` pairs for ``--offload-ref-spec REF``: a spec, a list of them, or a
    factory, as ``offload-ref check`` takes it; ``source`` is what reruns it there."""
    import shlex

    from offload_ref.contracts.refs import (RefError, import_from_the_current_folder, resolve,
                                            specs_from)

    import_from_the_current_folder()
    try:
        obj = resolve(ref)
        specs = specs_from(ref, obj)
    except RefError as exc:
        raise pytest.UsageError(f"--offload-ref-spec {exc}") from None
    source = shlex.quote(ref)
    if isinstance(obj, (list, tuple)):
        return [(spec, f"{source} --name {shlex.quote(spec.name)}") for spec in specs]
    return [(spec, source) for spec in specs]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "offload_ref_check" not in metafunc.fixturenames:
        return
    from offload_ref.contracts.pytest_support import check_params

    refs = metafunc.config.getoption("--offload-ref-spec")
    loaded = [pair for ref in refs for pair in _load(ref)]
    specs = [spec for spec, _ in loaded]
    sources = {spec: source for spec, source in loaded}
    specs += list(getattr(metafunc.module, "OFFLOAD_REF_SPECS", []))
    if not specs:
        raise pytest.UsageError(
            f"{metafunc.function.__name__} uses offload_ref_check but no pipeline spec was given: "
            "set OFFLOAD_REF_SPECS in the test module or pass --offload-ref-spec MODULE:ATTR"
        )
    strategies = metafunc.config.getoption("--offload-ref-strategy") or None
    expected = getattr(metafunc.module, "OFFLOAD_REF_EXPECTED_FAILURES", None)
    offloader = (metafunc.config.getoption("--offload-ref-offloader")
                 or getattr(metafunc.module, "OFFLOAD_REF_OFFLOADER", None))
    from offload_ref.contracts.offloader import OffloaderError
    from offload_ref.contracts.pytest_support import implementation_of

    try:
        impl = implementation_of(offloader)
    except OffloaderError as exc:
        raise pytest.UsageError(f"offloader {exc}") from None
    try:
        params = check_params(specs, expected_failures=expected, strategies=strategies,
                              include_global=False, sources=sources, impl=impl)
    except ValueError as exc:  # a misspelled OFFLOAD_REF_EXPECTED_FAILURES key, ...
        raise pytest.UsageError(f"{metafunc.module.__name__}: {exc}") from None
    metafunc.parametrize("offload_ref_check", params)
