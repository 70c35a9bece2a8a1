"""An ``--offloader`` whose code raises a ``BaseException`` that is no ``Exception``
(``SystemExit``, a ``KeyboardInterrupt`` it raises itself) is reported, naming who raised it, with
a non-zero exit status (Note [Escaping exceptions] in contracts/escapes.py).  Before, a factory
raising ``SystemExit(0)`` made ``offload-ref check --offloader m:f`` exit 0 with nothing printed
and no ``--json``; ``SystemExit(3)`` exited 3, silent; ``KeyboardInterrupt`` printed a raw
traceback and exited 130 as if the user had pressed Ctrl-C: the parent validated the factory
catching ``Exception`` alone.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from crash_pipelines import REPEATABLE, cli, results
from offload_ref.cli import main

BITWISE = "check_offloaded_output_matches_reference_bitwise"

OFFLOADERS = textwrap.dedent('''
    """Offloaders whose code exits or raises KeyboardInterrupt, at each place the kit calls it."""
    from offload_ref.contracts.simple_offloader import SimpleOffloader

    calls = {"factory": 0}


    def factory_exit_0(device, strategy):
        raise SystemExit(0)


    def factory_exit_3(device, strategy):
        raise SystemExit(3)


    def factory_interrupt(device, strategy):
        raise KeyboardInterrupt


    def factory_exit_in_the_case(device, strategy):
        # the parent's validation calls it once per strategy; the case's own call exits
        calls["factory"] += 1
        if calls["factory"] > 2:
            raise SystemExit(0)
        return SimpleOffloader(device, strategy)


    class _Exits(SimpleOffloader):
        where = ""

        def enable(self, pipeline):
            if self.where == "enable":
                raise SystemExit(0)
            super().enable(pipeline)

        def disable(self):
            if self.where == "disable":
                raise KeyboardInterrupt
            super().disable()


    def _exits(where):
        def factory(device, strategy):
            offloader = _Exits(device, strategy)
            offloader.where = where
            return offloader
        return factory


    enable_exits = _exits("enable")
    disable_interrupts = _exits("disable")
''')


@pytest.fixture(scope="module")
def author(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("escapy")
    (root / "escapy").mkdir()
    (root / "escapy" / "__init__.py").write_text("")
    (root / "escapy" / "offloaders.py").write_text(OFFLOADERS)
    (root / "escapy" / "exits_on_import.py").write_text("raise SystemExit(0)\n")
    return root


@pytest.mark.parametrize(("factory", "raised"), [
    ("factory_exit_0", "SystemExit(0)"), ("factory_exit_3", "SystemExit(3)"),
    ("factory_interrupt", "KeyboardInterrupt()")])
def test_a_factory_raising_a_base_exception_is_a_usage_error_naming_it(
        author: Path, factory: str, raised: str) -> None:
    proc = cli(["--pipeline", "flux2", "--strategy", "model_level", "--check", REPEATABLE,
                "--offloader", f"escapy.offloaders:{factory}", "--json", f"{factory}.json"],
               author)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"offload-ref check: error: --offloader escapy.offloaders:{factory}(hpu:0, "
        f"'model_level'), called to validate the factory before any case ran, raised {raised} "
        f"(at "), line
    assert "offloaders.py" in line, line
    assert not (author / f"{factory}.json").exists()  # no case ran: no report


def test_a_module_exiting_on_import_is_a_usage_error(
        author: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.syspath_prepend(str(author))
    assert main(["check", "--pipeline", "flux2", "--check", REPEATABLE,
                 "--offloader", "escapy.exits_on_import:factory"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload-ref check: error: --offloader 'escapy.exits_on_import:factory':"
                          " importing its module raised SystemExit(0) (at "), err


def test_an_exit_from_the_offloaders_code_while_a_case_runs_is_an_error_of_that_case_naming_it(
        author: Path) -> None:
    """In the child: the factory called again for the case's backend, enable(), disable()."""
    for offloader, raised, who in (
            ("factory_exit_in_the_case", "SystemExit(0)",
             "the offloader factory escapy.offloaders:factory_exit_in_the_case('hpu:0', "
             "'model_level')"),
            ("enable_exits", "SystemExit(0)", "the offloader escapy.offloaders:enable_exits's "
             "enable()"),
            ("disable_interrupts", "KeyboardInterrupt()",
             "the offloader escapy.offloaders:disable_interrupts's disable()")):
        proc = cli(["--pipeline", "flux2", "--strategy", "model_level", "--check", BITWISE,
                    "--offloader", f"escapy.offloaders:{offloader}",
                    "--json", f"{offloader}.json"], author)
        assert proc.returncode == 1, (offloader, proc.stdout, proc.stderr)
        result = results(author / f"{offloader}.json")[f"{BITWISE}-flux2-model_level"]
        assert result["outcome"] == "error", result
        assert result["message"].startswith(f"{raised} raised by {who} while this case ran (at "), \
            result["message"]
        assert f"ERROR {BITWISE}-flux2-model_level" in proc.stdout, proc.stdout
