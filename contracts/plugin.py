"""The pytest11 plugin of offload-ref.

It imports only the standard library and pytest when pytest loads it; torch and the kit are
imported when a test asks for ``offload_ref_check``.  Two ways to run the kit on your pipeline:

* a test file with ``OFFLOAD_REF_SPECS = [PipelineSpec(...)]`` (and optionally
  ``OFFLOAD_REF_EXPECTED_FAILURES = {check_id: reason}``) and a test
  ``def test_offload(offload_ref_check): offload_ref_check()``;
* ``pytest --offload-ref-spec mypkg.specs:SPECS`` with the same test function.
"""

from __future__ import annotations

import importlib

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
