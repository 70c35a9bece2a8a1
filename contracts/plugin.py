"""The pytest11 plugin of offload-ref.

It imports only the standard library and pytest when pytest loads it; torch and the kit are
imported when a test asks for ``offload_ref_check``.  Two ways to run the kit on your pipeline:

* a test file with ``OFFLOAD_REF_SPECS = [PipelineSpec(...)]`` (and optionally
  ``OFFLOAD_REF_EXPECTED_FAILURES = {check_id: reason}``) and a test
  ``def test_offload(offload_ref_check): offload_ref_check()``;
* ``pytest --offload-ref-spec mypkg.specs:SPECS`` with the same test function.

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

import importlib
import sys

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
        "--offload-ref-strategy", action="append", default=[], metavar="STRATEGY",
        help="restrict the kit to these strategies (model_level, layer_wise, "
             "distributed_layer_wise); an unknown name is a usage error",
    )
    group.addoption(
        "--offload-ref-threads", type=int, default=1, metavar="N",
        help="torch intra-op threads in a session that runs kit checks (default 1: the "
             "pipelines under test are tiny and thread hand-offs dominate; 0: leave torch's "
             "setting alone); restored when the session ends",
    )


_PREVIOUS_THREADS = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    strategies = config.getoption("--offload-ref-strategy")
    if strategies:
        from offload_ref.contracts.registry import strategy_names  # no torch

        try:
            strategy_names(strategies, "--offload-ref-strategy")
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    if config.getoption("--offload-ref-threads") < 0:
        raise pytest.UsageError("--offload-ref-threads: expected N >= 0 (0: leave torch alone)")


def _runs_kit_checks(items: list[pytest.Item]) -> bool:
    support = sys.modules.get("offload_ref.contracts.pytest_support")
    if support is None:  # nothing was bound to a check: not imported
        return False
    return any(isinstance(value, support.BoundCheck)
               for item in items
               for value in getattr(getattr(item, "callspec", None), "params", {}).values())


def pytest_collection_finish(session: pytest.Session) -> None:
    threads = session.config.getoption("--offload-ref-threads")
    if not threads or not _runs_kit_checks(session.items):
        return
    import torch

    session.config.stash[_PREVIOUS_THREADS] = torch.get_num_threads()
    torch.set_num_threads(threads)


def pytest_sessionfinish(session: pytest.Session) -> None:
    previous = session.config.stash.get(_PREVIOUS_THREADS, None)
    if previous is not None:
        import torch

        torch.set_num_threads(previous)
        del session.config.stash[_PREVIOUS_THREADS]


def _load(ref: str):
    module_name, _, attr = ref.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "offload_ref_check" not in metafunc.fixturenames:
        return
    from offload_ref.contracts.pytest_support import check_params

    refs = metafunc.config.getoption("--offload-ref-spec")
    specs = [s for ref in refs for s in _load(ref)]
    specs += list(getattr(metafunc.module, "OFFLOAD_REF_SPECS", []))
    if not specs:
        raise pytest.UsageError(
            f"{metafunc.function.__name__} uses offload_ref_check but no pipeline spec was given: "
            "set OFFLOAD_REF_SPECS in the test module or pass --offload-ref-spec MODULE:ATTR"
        )
    strategies = metafunc.config.getoption("--offload-ref-strategy") or None
    expected = getattr(metafunc.module, "OFFLOAD_REF_EXPECTED_FAILURES", None)
    try:
        params = check_params(specs, expected_failures=expected, strategies=strategies,
                              include_global=False)
    except ValueError as exc:  # a misspelled OFFLOAD_REF_EXPECTED_FAILURES key, ...
        raise pytest.UsageError(f"{metafunc.module.__name__}: {exc}") from None
    metafunc.parametrize("offload_ref_check", params)
