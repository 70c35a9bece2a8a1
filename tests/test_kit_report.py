"""The kit's report (issue 11): checks that do not apply say why, one matrix pipeline x strategy x
contract area, the JSON form, the progress line, and the same matrix from pytest, under xdist too.

The CLI runs in this process (``main``); the plugin runs through ``pytester`` (in process for the
plain run, a subprocess for ``-n 2``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re

import pytest
from torch import nn

from offload_ref.cli import main
from offload_ref.contracts.pytest_support import check_params
from offload_ref.contracts.registry import CATALOGUE, CheckInfo, not_applicable
from offload_ref.contracts.report import Row, render
from offload_ref.contracts.runner import plan_cases, run_checks
from offload_ref.fixtures import get_spec
from offload_ref.fixtures.qwen_image import build_pipeline as _build_qwen_image

pytest_plugins = ["pytester"]

_TWO_BLOCKS = "check_plan_block_attrs_beat_class_attributes"
_SKIP = "check_skipped_block_is_recovered"
_BITWISE = "check_offloaded_output_matches_reference_bitwise"


def one_block_pipeline(seed: int = 0) -> nn.Module:
    pipeline = _build_qwen_image(seed)
    pipeline.transformer.transformer_blocks = nn.ModuleList(
        list(pipeline.transformer.transformer_blocks)[:1])
    return pipeline


_ONE_BLOCK = dataclasses.replace(get_spec("qwen_image"), name="one_block",
                                 factory=f"{__name__}:one_block_pipeline",
                                 strategies=("layer_wise",))


# A one-block DiT's layerwise plan does not resolve: one preflight error, its checks not run
# (tests/test_kit_preflight.py).  The tests below need a check that does not apply to a pipeline
# that resolves: the two block checks, asked here for more blocks than qwen_image has.
_FEW_BLOCKS = dataclasses.replace(get_spec("qwen_image"), name="few_blocks",
                                  strategies=("layer_wise",))


@pytest.fixture
def more_blocks_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_ref.contracts.facts import dit_has_blocks
    from offload_ref.contracts.runner import load_catalogue

    load_catalogue()
    for check_id in (_TWO_BLOCKS, _SKIP):
        monkeypatch.setitem(CATALOGUE, check_id, dataclasses.replace(
            CATALOGUE[check_id], applies=dit_has_blocks(99),
            needs="a DiT with 99 or more declared blocks"))


# -- item 7: not applicable, with the reason ---------------------------------------------------


def test_a_check_that_does_not_apply_is_reported_with_its_reason_not_dropped(
        more_blocks_needed: None) -> None:
    results = run_checks([_FEW_BLOCKS], checks=[_TWO_BLOCKS, _SKIP], include_global=False)
    outcomes = {r.id.check: (r.outcome, r.message) for r in results}
    assert set(outcomes) == {_TWO_BLOCKS, _SKIP}, outcomes
    outcome, reason = outcomes[_TWO_BLOCKS]
    assert outcome == "not_applicable", outcomes
    assert "99 or more declared blocks" in reason and "transformer has " in reason, reason
    assert outcomes[_SKIP][0] == "not_applicable", outcomes
    assert all(r.ok for r in results)


def test_pytest_route_shows_a_not_applicable_case_as_a_skip_with_its_reason(
        more_blocks_needed: None) -> None:
    params = {p.id: p for p in check_params([_FEW_BLOCKS], checks=[_TWO_BLOCKS],
                                            include_global=False)}
    (param,) = params.values()
    skips = [m for m in param.marks if m.name == "skip"]
    assert skips and skips[0].kwargs["reason"].startswith("not applicable: needs a DiT"), \
        param.marks


def test_a_check_body_can_find_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    def check_kit_test_body_not_applicable(case) -> None:
        not_applicable("the pipeline has no audio branch")

    info = CheckInfo("check_kit_test_body_not_applicable", check_kit_test_body_not_applicable,
                     "F.1", strategies=("layer_wise",))
    monkeypatch.setitem(CATALOGUE, info.id, info)
    (result,) = run_checks([_FEW_BLOCKS], checks=[info.id], include_global=False)
    assert (result.outcome, result.message) == ("not_applicable",
                                                "the pipeline has no audio branch")


def test_every_check_with_applies_states_what_it_needs() -> None:
    from offload_ref.contracts.runner import load_catalogue

    missing = [i.id for i in load_catalogue().values() if i.applies and not i.needs]
    assert not missing


def test_an_applies_probe_that_raises_is_an_error_of_that_case_only() -> None:
    def broken(spec, strategy):
        raise RuntimeError("probe exploded")

    info = dataclasses.replace(CATALOGUE[_TWO_BLOCKS], applies=broken, needs="something")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CATALOGUE, _TWO_BLOCKS, info)
        planned = plan_cases([_FEW_BLOCKS, get_spec("flux2")], checks=[_TWO_BLOCKS, _BITWISE],
                             include_global=False)
    errors = [c for c in planned if c.planning_error]
    assert {c.spec.name for c in errors} == {"few_blocks", "flux2"}
    assert all("probe exploded" in c.planning_error for c in errors)
    assert any(c.info.id == _BITWISE and not c.planning_error for c in planned)


# -- the matrix --------------------------------------------------------------------------------


def _rows(pipeline: str) -> list[Row]:
    return [Row("check_a", "A.1", pipeline, "layer_wise", "passed"),
            Row("check_b", "F.3", pipeline, "layer_wise", "failed", "boom"),
            Row("check_c", "D.2", pipeline, "layer_wise", "not_applicable", "needs ties"),
            Row("check_d", "G", None, None, "passed")]


def test_one_diagnosed_cause_behind_many_parity_failures_is_printed_once() -> None:
    """An outside review's pipeline read a streamed weight outside its block: 16 checks failed
    with 16 different first lines and one diagnosis, printed 16 times."""
    cause = ("  diagnosis: NaN under offloading where the reference has none; tensors read "
             "outside their block: x.weight was read by the pipeline's own code")
    rows = [Row(f"check_{i}", "J.3", "p", "layer_wise", "failed",
                f"step {i}: output differs from the un-offloaded reference\n{cause}")
            for i in range(3)]
    rows.append(Row("check_other", "F.3", "p", "layer_wise", "failed", "another cause"))
    out = io.StringIO()
    render(rows, out=out)
    text = out.getvalue()
    assert text.count("tensors read outside their block") == 1, text
    assert "the same diagnosis in 2 more case(s): check_1-p-layer_wise, check_2-p-layer_wise" \
        in text
    assert "another cause" in text


def test_cases_of_different_severities_are_never_folded_under_one_header() -> None:
    """An outside review: two cases with one first line, one a wrong output and one a trace,
    were printed under one "severity: wrong output" header while the footer counted a trace."""
    rows = [Row("check_x", "C.1", "p", "layer_wise", "failed", "same first line",
                severity="wrong output"),
            Row("check_y", "C.2", "p", "layer_wise", "failed", "same first line",
                severity="trace")]
    out = io.StringIO()
    render(rows, out=out)
    text = out.getvalue()
    assert "the same failed in" not in text, text
    assert "severity: wrong output" in text and "severity: trace" in text, text


def test_matrix_columns_stay_aligned_for_names_of_any_length() -> None:
    for name in ("p", "a_pipeline_name_far_longer_than_any_column_header_of_the_matrix"):
        out = io.StringIO()
        render(_rows(name), out=out)
        lines = out.getvalue().splitlines()
        table = lines[:lines.index("")]
        header, rule, *body = table
        starts = [m.start() for m in re.finditer(r"(?<=  )\S", rule)]
        for line in (header, *body):
            for start in starts:
                assert line[start - 2:start] == "  " and line[start] != " ", (name, table)
        assert any(line.startswith(name) and "FAIL 1/1" in line and "n/a" in line
                   for line in body), table
        assert "(global)" in out.getvalue()


def test_cli_json_report_has_header_matrix_and_results(tmp_path, capsys) -> None:
    path = tmp_path / "report.json"
    rc = main(["check", "--pipeline", "qwen_image", "--check", _SKIP, "--check", _BITWISE,
               "--strategy", "layer_wise", "--json", str(path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    data = json.loads(path.read_text())
    assert data["format"] == "offload-ref-check/1"
    assert {"kit", "torch", "device", "machine", "pipelines"} <= set(data["header"])
    assert data["header"]["pipelines"] == {"qwen_image": "--pipeline qwen_image"}
    assert data["summary"]["passed"] == 2 and data["summary"]["failed"] == 0
    assert {(m["area"], m["cell"]) for m in data["matrix"]} == {("F", "ok 2")}
    assert {r["check"] for r in data["results"]} == {_SKIP, _BITWISE}
    # the text report still goes to stdout, with its header and matrix
    assert "offload-ref check" in captured.out and "F residency" in captured.out
    # progress on stderr: lines [done/total] when stderr is not a terminal
    assert re.search(r"^\[2/2\] 100%  0 failed", captured.err, re.M), captured.err


def test_cli_json_to_stdout_is_only_json(capsys) -> None:
    rc = main(["check", "--pipeline", "flux2", "--check", _TWO_BLOCKS, "--json", "-"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out)["summary"]["total"] == 2


def test_exit_status_counts_only_unexpected_failures(capsys, more_blocks_needed: None) -> None:
    # not applicable is no failure: exit 0; a failed case: exit 1
    assert main(["check", f"{__name__}:_FEW_BLOCKS", "--check", _TWO_BLOCKS]) == 0
    out = capsys.readouterr().out
    assert "0 passed, 0 failed, 1 not applicable" in out, out
    # a plan that does not resolve is one error, its checks not run: exit 1
    assert main(["check", f"{__name__}:_ONE_BLOCK", "--check", _TWO_BLOCKS]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 1 failed (1 with an error), 1 not applicable" in out, out
    assert "requires at least two blocks" in out, out
    assert main(["check", f"{__name__}:_JITTERY_OFFLOADED", "--check", _BITWISE]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 1 failed" in out, out


def jittery_offloaded(seed: int = 0) -> nn.Module:
    """Deterministic, but its output moves by one once its DiT is offloaded."""
    pipeline = _build_qwen_image(seed)
    forward = type(pipeline).forward

    def patched(self, **inputs):
        out = forward(self, **inputs)
        offloaded = any(h for h in self.transformer._forward_pre_hooks.values())
        return out + 1 if offloaded else out

    pipeline.forward = patched.__get__(pipeline)
    return pipeline


_JITTERY_OFFLOADED = dataclasses.replace(get_spec("qwen_image"), name="jittery_offloaded",
                                         factory=f"{__name__}:jittery_offloaded",
                                         strategies=("model_level",))


# -- the plugin's matrix -------------------------------------------------------------------------

_AUTHOR_TEST = '''
from offload_ref.fixtures import get_spec
OFFLOAD_REF_SPECS = [get_spec("flux2")]

def test_offload(offload_ref_check):
    offload_ref_check()
'''


@pytest.mark.parametrize("workers", [None, "2"])
def test_plugin_prints_the_matrix_also_under_xdist(pytester, workers) -> None:
    pytester.makepyfile(test_author=_AUTHOR_TEST)
    args = ["-p", "no:cacheprovider", "-k", f"{_TWO_BLOCKS} or {_SKIP}"]
    if workers:
        result = pytester.runpytest_subprocess(*args, "-n", workers, timeout=300)
    else:
        result = pytester.runpytest(*args)
    result.assert_outcomes(passed=3)
    text = result.stdout.str()
    assert "offload-ref conformance matrix" in text, text
    assert re.search(r"^flux2\s+layer_wise\s+ok 1\s+ok 1$", text, re.M), text
    assert re.search(r"^flux2\s+distributed_layer_wise\s+ok 1\s+-$", text, re.M), text


def test_plugin_cuda_selection_without_a_gpu_says_nothing_ran(pytester) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the cuda tests would run")
    pytester.makepyfile(test_gpu='''
        import pytest, torch

        @pytest.mark.cuda
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        def test_on_gpu():
            pass

        def test_on_cpu():
            pass
    ''')
    for workers in ([], ["-n", "2"]):  # under xdist the controller sees only the reports
        result = (pytester.runpytest_subprocess if workers else pytester.runpytest)(
            "-p", "no:cacheprovider", "-m", "cuda", *workers)
        result.assert_outcomes(skipped=1, deselected=None if workers else 1)
        assert result.ret == 0
        result.stdout.fnmatch_lines(["*1 test(s) marked cuda were selected and none ran: no "
                                     "CUDA device is available*"])
    strict = pytester.runpytest("-p", "no:cacheprovider", "-m", "cuda",
                                "--offload-ref-require-cuda")
    assert strict.ret == pytest.ExitCode.USAGE_ERROR
    strict.stderr.fnmatch_lines(["*--offload-ref-require-cuda: no CUDA device is available*"])


def test_pytest_repro_line_of_a_module_spec_reruns_that_test(pytester) -> None:
    """A spec from OFFLOAD_REF_SPECS has no reference the CLI could import: its repro line is the
    pytest node id, and running it reruns exactly that case (issue 11 item 2)."""
    pytester.makepyfile(test_author=f'''
        from {__name__} import _JITTERY_OFFLOADED
        OFFLOAD_REF_SPECS = [_JITTERY_OFFLOADED]

        def test_offload(offload_ref_check):
            offload_ref_check()
    ''')
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", _BITWISE)
    result.assert_outcomes(failed=1)
    nodeid = f"test_author.py::test_offload[{_BITWISE}-jittery_offloaded-model_level]"
    assert f"reproduce: python -m pytest '{nodeid}'" in result.stdout.str()
    again = pytester.runpytest("-p", "no:cacheprovider", nodeid)
    again.assert_outcomes(failed=1)
