"""``offload-ref check`` as an outside model author uses it (issue 11).

Under test: ``MODULE:ATTR`` given positionally (a spec, a list of specs, or a factory, with
``--inputs``); a failure's reproduction line reruns exactly that case, for an author's spec as for
a built-in fixture; a bad ``--spec`` / positional reference, ``--check`` id or ``--pipeline`` name
is one line on stderr and exit status 2, never a traceback.

The author's package (``kit_author.testing``) is written into a temporary folder.  Two tests run
the console script in a subprocess (about three seconds each); the others call ``main`` in this
process, with the temporary folder on ``sys.path``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from offload_ref.cli import main

_TIMEOUT_S = 120
_BITWISE = "check_offloaded_output_matches_reference_bitwise"
_REPEATABLE = "check_plan_resolution_is_repeatable"

_AUTHOR_MODULE = textwrap.dedent('''
    """A tiny author package: a FLUX.2-shaped pipeline, one broken variant, specs, factories."""
    import itertools

    from offload_ref.contracts import PipelineSpec
    from offload_ref.fixtures import flux2

    _calls = itertools.count(1)


    class JitteryFlux2(flux2.Flux2Pipeline):
        """Reproducible as a reference (the kit's preflight runs it twice), but once offloaded
        each generation adds a growing offset: never bitwise equal to the reference."""

        def forward(self, **inputs):
            offloaded = "_offload_ref_backend" in self.__dict__
            return super().forward(**inputs) + (next(_calls) if offloaded else 0)


    def build_pipeline():                      # a factory without a seed parameter
        return flux2.Flux2Pipeline()


    def build_seeded(seed=0):                  # a factory with one
        return flux2.build_pipeline(seed)


    def build_jittery(seed=0):
        return flux2.build(JitteryFlux2, seed)


    def make_inputs(seed=0):
        return flux2.make_inputs(seed)


    def needs_args(width, depth):
        raise AssertionError("never called")


    SPEC = PipelineSpec(name="jittery", factory="kit_author.testing:build_jittery",
                        inputs="kit_author.testing:make_inputs", strategies=("model_level",))
    GOOD = PipelineSpec(name="good", factory="kit_author.testing:build_seeded",
                        inputs="kit_author.testing:make_inputs", strategies=("model_level",))
    SPECS = [GOOD, SPEC]
    NOT_A_SPEC = 3
''')


@pytest.fixture(scope="module")
def author(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("author")
    package = root / "kit_author"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "testing.py").write_text(_AUTHOR_MODULE)
    return root


@pytest.fixture
def on_path(author: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(author))
    return author


def _cli(args: list[str], root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PYTHONPATH"] = str(root)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    script = Path(sys.executable).with_name("offload-ref")
    return subprocess.run([str(script), *args], check=False, cwd=root, env=env,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)


def _repro_lines(stdout: str) -> dict[str, str]:
    """Failed case id -> its reproduction command."""
    found = re.findall(r"^(?:FAILED|ERROR) (\S+)\n(?:.*\n)*?  reproduce: (.+)$", stdout, re.M)
    return dict(found)


# -- positional MODULE:ATTR and rerunnable reproduction lines ---------------------------------


def test_positional_factory_and_spec_run_and_their_repro_line_reruns_the_case(
        author: Path) -> None:
    proc = _cli(["check", "kit_author.testing:build_seeded", "kit_author.testing:SPEC",
                 "--inputs", "kit_author.testing:make_inputs",
                 "--check", _BITWISE, "--strategy", "model_level"], author)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 cases over 2 pipeline(s)" in proc.stderr, out
    assert re.search(r"^build_seeded\s+model_level\s+ok 1$", proc.stdout, re.M), out
    assert re.search(r"^jittery\s+model_level\s+FAIL 1/1$", proc.stdout, re.M), out
    repro = _repro_lines(proc.stdout)
    case = f"{_BITWISE}-jittery-model_level"
    assert repro == {case: f"offload-ref check kit_author.testing:SPEC --check {_BITWISE} "
                           f"--strategy model_level"}, out

    again = _cli(shlex.split(repro[case])[1:], author)
    out = again.stdout + again.stderr
    assert again.returncode == 1, out
    assert "1 cases over 1 pipeline(s)" in again.stderr, out
    assert _repro_lines(again.stdout) == repro, out


def test_bad_reference_from_the_console_script_is_one_line_and_exit_2(author: Path) -> None:
    proc = _cli(["check", "kit_author.testing:SPCE", "--check", _BITWISE], author)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "kit_author.testing:SPCE" in lines[0] and "SPEC" in lines[0], lines


def test_the_console_script_finds_a_module_in_the_current_folder(author: Path) -> None:
    """As `python -m` does (before: only with PYTHONPATH=. or `python -m offload_ref.cli`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT")) and k != "PYTHONPATH"}
    script = Path(sys.executable).with_name("offload-ref")
    proc = subprocess.run([str(script), "check", "kit_author.testing:GOOD", "--check",
                           _REPEATABLE, "--strategy", "model_level"], check=False, cwd=author,
                          env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    missing = subprocess.run([str(script), "check", "not_here:SPEC"], check=False, cwd=author,
                             env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert missing.returncode == 2 and f"from {author}" in missing.stderr, missing.stderr


# -- in-process: loading, repro lines, validation -----------------------------------------------


def test_factory_without_seed_becomes_an_importable_spec(on_path: Path) -> None:
    from offload_ref.contracts.refs import load_specs
    from offload_ref.contracts.spec import load_object

    [spec] = load_specs("kit_author.testing:build_pipeline")
    assert spec.name == "build_pipeline"
    assert spec.strategies == ("model_level", "layer_wise")
    assert isinstance(spec.factory, str) and isinstance(spec.inputs, str)
    assert spec.make_inputs() == {}  # no --inputs: the pipeline is called without arguments
    first, second = load_object(spec.factory)(seed=3), load_object(spec.factory)(seed=3)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs between two builds of one seed"

    [narrowed] = load_specs("kit_author.testing:build_seeded",
                            inputs="kit_author.testing:make_inputs", strategies=["layer_wise"])
    assert narrowed.factory == "kit_author.testing:build_seeded"  # takes seed= itself
    assert narrowed.inputs == "kit_author.testing:make_inputs"
    assert narrowed.strategies == ("layer_wise",)


def test_repro_line_of_a_spec_from_a_list_selects_it_by_name(
        on_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "--spec", "kit_author.testing:SPECS", "--check", _BITWISE])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert _repro_lines(out) == {
        f"{_BITWISE}-jittery-model_level":
            f"offload-ref check --spec kit_author.testing:SPECS --name jittery "
            f"--check {_BITWISE} --strategy model_level"}, out

    rc = main(["check", "--spec", "kit_author.testing:SPECS", "--name", "good",
               "--check", _BITWISE])
    assert rc == 0, capsys.readouterr().out


def test_fixture_repro_line_names_pipeline_check_and_strategy() -> None:
    from offload_ref.contracts.runner import CaseId

    assert CaseId(_BITWISE, "flux2", "layer_wise").repro() == (
        f"offload-ref check --pipeline flux2 --check {_BITWISE} --strategy layer_wise")
    assert CaseId(_REPEATABLE, None, None).repro() == f"offload-ref check --check {_REPEATABLE}"


@pytest.mark.parametrize(("argv", "needles"), [
    (["--spec", "kit_author.testing"], ["--spec", "'kit_author.testing'", "MODULE:ATTR"]),
    (["kit_author_missing.testing:SPEC"], ["'kit_author_missing.testing:SPEC'", "cannot import",
                                           "kit_author_missing", "PYTHONPATH"]),
    (["kit_author.testing:SPCE"], ["'kit_author.testing:SPCE'", "no attribute 'SPCE'",
                                   "did you mean", "SPEC"]),
    (["kit_author.testing:NOT_A_SPEC"], ["'kit_author.testing:NOT_A_SPEC'", "int",
                                         "PipelineSpec"]),
    (["kit_author.testing:needs_args"], ["'kit_author.testing:needs_args'", "width", "seed"]),
    (["--inputs", "kit_author.testing:make_inputs", "kit_author.testing:SPEC"],
     ["--inputs", "factory"]),
    (["--check", "check_offloaded_output_matches_reference_bitwse"],
     ["--check", "'check_offloaded_output_matches_reference_bitwse'", "unknown check id",
      _BITWISE, "--list"]),
    (["--pipeline", "flux3"], ["--pipeline", "'flux3'", "flux2"]),
    (["kit_author.testing:SPECS", "--name", "jitery"], ["--name", "'jitery'", "jittery"]),
], ids=["no-colon", "no-module", "no-attribute", "not-a-spec", "factory-args", "inputs-no-factory",
        "unknown-check", "unknown-fixture", "unknown-name"])
def test_bad_selection_is_one_clear_line_and_exit_2(
        on_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        needles: list[str]) -> None:
    rc = main(["check", *argv])
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("offload-ref check: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert captured.out == "", captured.out


def test_bench_measures_an_authors_own_pipeline(author: Path) -> None:
    """`offload-ref bench --spec MODULE:ATTR` (before: built-in fixtures only)."""
    script = Path(sys.executable).with_name("offload-ref")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT")) and k != "PYTHONPATH"}
    proc = subprocess.run([str(script), "bench", "--spec", "kit_author.testing:GOOD",
                           "--repeats", "1", "--json"], check=False, cwd=author, env=env,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    [result] = json.loads(proc.stdout)["pipelines"]
    assert result["pipeline"] == "good"
    assert set(result["generation_s"]) == {"resident", "model_level"}  # GOOD claims model level
    assert result["enable_s"]["model_level"] > 0 and result["ratio_to_resident"]["resident"] == 1


def test_progress_in_a_log_moves_at_least_every_few_seconds(monkeypatch) -> None:
    """Not a terminal: a line per tenth of the run, and one whenever ``every`` seconds passed
    since the last (long first cases once left a CI log at 0% for minutes)."""
    import io
    from types import SimpleNamespace

    from offload_ref import cli

    clock = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    progress = cli._Progress(stream, every=15.0)
    result = SimpleNamespace(ok=True, id=SimpleNamespace(spec="flux2", strategy="layer_wise",
                                                         check="check_x"))
    progress(1, 1000, result)  # 0%: the first line
    progress(2, 1000, result)  # same tenth, no time passed: nothing
    clock[0] += 16
    progress(3, 1000, result)  # same tenth, 16 s later: a line
    progress(4, 1000, result)
    progress(100, 1000, result)  # a new tenth
    lines = stream.getvalue().splitlines()
    assert [line.split("]")[0] for line in lines] == ["[   1/1000", "[   3/1000", "[ 100/1000"]


def test_progress_in_a_log_is_denser_in_its_first_seconds(monkeypatch) -> None:
    """The first ``early_for`` seconds after the first line get a line every ``early`` seconds
    (the first use's build takes most of the first minute: the log must show 0% passed right
    after it), then every ``every`` seconds as before."""
    import io
    from types import SimpleNamespace

    from offload_ref import cli

    clock = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    progress = cli._Progress(stream, every=15.0, early=2.0, early_for=30.0)
    result = SimpleNamespace(ok=True, id=SimpleNamespace(spec="flux2", strategy="layer_wise",
                                                         check="check_x"))
    for done in range(1, 61):  # a case a second, all in the first tenth of 1000
        progress(done, 1000, result)
        clock[0] += 1
    shown = [int(line.split("/")[0].strip("[ ")) for line in stream.getvalue().splitlines()]
    # the first line, then one every 2 s while under 30 s after it, then one every 15 s
    assert shown == [*range(1, 30, 2), 44, 59]
