"""A ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` from a spec's code is an
error of the case it ran in (or of the spec's preflight), never a silent end of the run (issue 33
item 8, Note [Escaping exceptions] in contracts/escapes.py): before, a factory raising
``SystemExit(0)`` ended ``offload-ref check`` with exit status 0 and no report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from crash_pipelines import BITWISE, REPEATABLE, cli, results, write_author
from offload_ref.cli import main
from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.pytest_support import check_params
from offload_ref.contracts.registry import CheckFailure
from offload_ref.contracts.runner import run_checks


@pytest.fixture(scope="module")
def author(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_author(tmp_path_factory.mktemp("crashy"))


def test_a_factory_raising_system_exit_or_keyboard_interrupt_is_an_error_in_the_report(
        author: Path) -> None:
    proc = cli(["crashy.pipes:raise_system_exit_0", "crashy.pipes:raise_system_exit_3",
                "crashy.pipes:raise_interrupt", "crashy.pipes:build_nothing",
                "--inputs", "crashy.pipes:make_inputs", "--strategy", "model_level",
                "--check", REPEATABLE, "--json", "raising.json"], author)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    by_case = results(author / "raising.json")
    assert by_case[f"{REPEATABLE}-build_nothing-model_level"]["outcome"] == "passed", by_case
    for name, raised in (("raise_system_exit_0", "SystemExit(0)"),
                         ("raise_system_exit_3", "SystemExit(3)"),
                         ("raise_interrupt", "KeyboardInterrupt()")):
        result = by_case[f"preflight-{name}"]
        assert result["outcome"] == "error", result
        assert result["message"].startswith(
            f"spec {name!r}: while the kit validated it (its preflight: building the pipeline "
            f"and running it twice), its factory crashy.pipes:{name} raised {raised} (at "), \
            result["message"]
        assert result["message"].endswith(f"the checks of {name} were not run"), result
        assert f"ERROR preflight-{name}" in proc.stdout, out


def test_main_called_in_process_reports_a_factorys_system_exit_too(
        author: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.syspath_prepend(str(author))
    assert main(["check", "crashy.pipes:raise_system_exit_0", "--check", REPEATABLE]) == 1
    out = capsys.readouterr().out
    assert "ERROR preflight-raise_system_exit_0" in out, out
    assert "its factory crashy.pipes:raise_system_exit_0 raised SystemExit(0) (at " in out, out


def test_a_base_exception_raised_in_a_generation_is_an_error_of_its_case(
        author: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(author))
    from crashy.pipes import RAISING_IN_GENERATION  # type: ignore[import-not-found]

    results = {str(r.id): r for r in run_checks(RAISING_IN_GENERATION,
                                                checks=[BITWISE, REPEATABLE],
                                                include_global=False)}
    for name, raised in (("system_exit", "SystemExit(3)"), ("interrupt", "KeyboardInterrupt()"),
                         ("generator_exit", "GeneratorExit()")):
        result = results[f"{BITWISE}-{name}-model_level"]
        assert result.outcome == "error", result
        assert result.message.startswith(f"{raised} raised while this case ran (at "), result
        assert "crashy/pipes.py" in result.message.splitlines()[0], result
        assert results[f"{REPEATABLE}-{name}-model_level"].outcome == "passed", results


def test_a_module_exiting_on_import_is_a_usage_error(
        author: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.syspath_prepend(str(author))
    assert main(["check", "crashy.exits_on_import:SPEC"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload-ref check: error: MODULE:ATTR 'crashy.exits_on_import:SPEC': "
                          "loading it raised SystemExit(0) (at "), err


def test_the_pytest_route_fails_the_preflight_test_of_a_factory_raising_system_exit(
        author: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, pytest collecting ``parametrize_with_checks([SPEC])`` stopped on the SystemExit
    and exited 0 with "no tests ran"."""
    monkeypatch.syspath_prepend(str(author))
    from crashy.pipes import GOOD  # type: ignore[import-not-found]

    exits = PipelineSpec(name="exits", factory="crashy.pipes:raise_system_exit_0",
                         inputs="crashy.pipes:make_inputs", strategies=("model_level",))
    params = {p.id: p for p in check_params([exits, GOOD], checks=[REPEATABLE],
                                            include_global=False)}
    assert set(params) == {"preflight-exits", f"{REPEATABLE}-nothing-model_level"}, params
    (body,) = params["preflight-exits"].values
    with pytest.raises(CheckFailure) as failure:
        body()
    assert str(failure.value).startswith(
        "spec 'exits': while the kit validated it (its preflight: building the pipeline and "
        "running it twice), its factory crashy.pipes:raise_system_exit_0 raised SystemExit(0) "
        "(at "), failure.value
    assert str(failure.value).endswith("the checks of exits were not run"), failure.value
