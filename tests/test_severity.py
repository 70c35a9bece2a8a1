"""Each failure carries its severity (contracts/severity.py): the kit's checks get a default by
what they assert, the kit's "not as built" problem lists are weighed problem by problem, the
failure site overrides both, and the report, the JSON and the conformance table show it."""

from __future__ import annotations

import dataclasses
import io
import warnings

import pytest

from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.registry import CATALOGUE, CheckFailure, fail
from offload_ref.contracts.runner import load_catalogue, run_checks
from offload_ref.contracts.severity import DEFAULTS, Severity, judge, of_problems, worst
from offload_ref.contracts.simple_offloader import BROKEN, simple_offloader
from offload_ref.fixtures import get_spec


def _run(factory, checks, strategy="layer_wise", spec="flux2"):
    impl = offloader_implementation(factory, name=getattr(factory, "__qualname__", "f"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks([get_spec(spec)], checks=checks, strategies=[strategy], impl=impl,
                          include_global=False)


def test_the_table_names_catalogue_checks_and_the_levels_order_worst_first() -> None:
    catalogue = load_catalogue()
    assert set(DEFAULTS) <= set(catalogue), sorted(set(DEFAULTS) - set(catalogue))
    assert [s.value for s in Severity] == ["wrong output", "error", "memory", "trace"]
    assert worst(["trace", Severity.MEMORY, None, "error"]) is Severity.ERROR
    assert worst([]) is None
    assert Severity.of("WRONG_OUTPUT") is Severity.WRONG_OUTPUT
    with pytest.raises(ValueError, match="unknown severity 'cosmetic'; one of 'wrong output'"):
        Severity.of("cosmetic")
    with pytest.raises(ValueError, match="unknown severity"):
        fail("x", severity="bad")


def test_a_check_without_a_default_is_never_taken_for_a_lesser_failure() -> None:
    assert "check_offloaded_output_matches_reference_bitwise" not in DEFAULTS
    assert judge("check_offloaded_output_matches_reference_bitwise", "failed",
                 "output differs") is Severity.WRONG_OUTPUT
    assert judge("check_nobody_wrote", "failed", "x") is Severity.WRONG_OUTPUT
    # an exception out of the user's generation / enable / disable is an error, whatever check
    assert judge("check_disable_removes_every_trace", "error",
                 "RuntimeError: boom") is Severity.ERROR
    assert judge("check_disable_removes_every_trace", "passed") is None
    assert judge("check_disable_removes_every_trace", "xfailed", "expected: x") is None


def test_problem_lists_are_weighed_problem_by_problem() -> None:
    attrs = "module <root> attributes: added ['_all_hooks'], removed []"
    assert of_problems([attrs]) is Severity.TRACE
    assert of_problems([attrs, "values of a.weight changed"]) is Severity.WRONG_OUTPUT
    assert of_problems([attrs, "512 bytes are still allocated on hpu:0"]) is Severity.MEMORY
    same = "(1, 'cpu', 7, torch.float32, (2, 2), (2, 1), 0, True, False)"
    assert of_problems([f"tensor w: {same} -> {same.replace('(1,', '(9,')}"]) is Severity.TRACE
    assert of_problems([f"tensor w: {same} -> {same.replace('cpu', 'hpu:0')}"]) is \
        Severity.MEMORY
    assert of_problems([f"tensor w: {same} -> {same.replace('float32', 'float16')}"]) is \
        Severity.WRONG_OUTPUT
    assert of_problems([f"tensor w: {same} -> {same.replace('True, False', 'True, True')}"]) \
        is Severity.ERROR
    assert of_problems([f"tensor w: {same} -> None"]) is Severity.WRONG_OUTPUT
    # a problem the table does not know: no guess from the others (the check's default decides)
    assert of_problems([attrs, "something else entirely"]) is None
    message = f"disable left traces on P: [{attrs!r}, 'module a hooks: +x']"
    assert judge("check_disable_removes_every_trace", "failed", message) is Severity.TRACE
    assert judge("check_every_disable_restores_tensors_and_frees_the_device", "failed",
                 "after disable (cycle 0), P is not as built: ['values of w changed']") is \
        Severity.WRONG_OUTPUT


def test_the_failure_site_overrides_the_default(monkeypatch) -> None:
    """``fail(..., severity=)`` wins over the table, and reaches the result and the report."""
    from offload_ref.contracts.report import render, rows_from_results, to_json

    def says_memory(case) -> None:
        fail("held 12 bytes", severity="memory")

    load_catalogue()
    parity = CATALOGUE["check_offloaded_output_matches_reference_bitwise"]
    monkeypatch.setitem(CATALOGUE, parity.id, dataclasses.replace(parity, func=says_memory))
    [result] = _run(simple_offloader, [parity.id])
    assert (result.outcome, result.severity) == ("failed", "memory"), result
    rows = rows_from_results([result])
    out = io.StringIO()
    render(rows, out=out)
    assert "severity: memory (memory not returned" in out.getvalue(), out.getvalue()
    assert "severity of the failures (worst first): 1 memory" in out.getvalue()
    data = to_json(rows)
    assert data["results"][0]["severity"] == "memory"
    assert {m["severity"] for m in data["matrix"]} == {"memory"}
    assert CheckFailure("x", "trace").severity is Severity.TRACE


@pytest.mark.parametrize("broken,check,level", [
    # the only defect: a forward hook left after disable() -- a trace, not a wrong image
    ("simple_leaves_a_hook", "check_disable_removes_every_trace", "trace"),
    # one parameter left on the device after disable(): its bytes stay held
    ("simple_forgets_a_device", "check_every_disable_restores_tensors_and_frees_the_device",
     "memory"),
    # serves stale weights: the generation is wrong
    ("simple_first_snapshot", "check_edit_between_cycles_takes_effect_and_survives_disable",
     "wrong output"),
])
def test_broken_offloaders_fail_with_the_severity_of_what_they_break(broken, check,
                                                                    level) -> None:
    factory, _ = BROKEN[broken]
    [result] = _run(factory, [check])
    assert result.outcome == "failed", (result.outcome, result.message)
    assert result.severity == level, (result.severity, result.message)
    [control] = _run(simple_offloader, [check])
    assert control.outcome == "passed" and control.severity is None, control


def test_the_conformance_table_shows_the_worst_severity_per_cell() -> None:
    from offload_ref.contracts.conformance import AREAS_JUDGED, Cell, PeerRow, render_markdown
    from offload_ref.contracts.runner import CaseId, CheckResult

    trace = CheckResult(CaseId("check_disable_removes_every_trace", "a", "layer_wise"),
                        "failed", "disable left traces on P: [\"module <root> attributes: "
                        "added ['_all_hooks'], removed []\"]", severity="trace")
    wrong = CheckResult(CaseId("check_enable_disable_cycles_match_the_reference", "b",
                               "layer_wise"), "failed", "output differs", severity="wrong output")
    cells = {a: Cell() for a in AREAS_JUDGED}
    cells["C"].failed += [trace, wrong]
    cells["B"].failed += [dataclasses.replace(trace, severity=None)]  # judged from its message
    row = PeerRow("x", "m:x", ("layer_wise",), cells, [trace, wrong])
    text = render_markdown([row], header={"kit": "0", "torch": "0", "machine": "m",
                                          "device": "d"}, command="c", pipelines=["a", "b"])
    line = next(ln for ln in text.splitlines() if ln.startswith("| `x`"))
    b, c = line.split(" | ")[2:4]
    assert b.startswith("**fail: trace** [check_disable_removes_every_trace]"), b
    # the worst failure names the cell, though its check sorts after the trace's
    assert c.startswith("**fail: wrong output** [check_enable_disable_cycles_match_the_"
                        "reference]") and "(+1 more)" in c, c
    assert "- a / layer_wise: failed (trace): disable left traces" in text


def test_a_check_registered_outside_the_kit_gives_its_own_default(monkeypatch) -> None:
    from offload_ref.contracts import registry, severity

    monkeypatch.setattr(registry, "CATALOGUE", dict(registry.CATALOGUE))
    monkeypatch.setattr(severity, "DECLARED", {})

    @registry.check("J", severity="trace")
    def check_my_cache_is_cleared(case) -> None:
        """My cache is cleared."""

    assert registry.CATALOGUE["check_my_cache_is_cleared"].severity is Severity.TRACE
    assert judge("check_my_cache_is_cleared", "failed", "left") is Severity.TRACE
    with pytest.raises(ValueError, match="unknown severity 'minor'"):
        registry.check("J", severity="minor")


def test_an_exception_out_of_the_users_call_caught_by_an_output_check_is_an_error() -> None:
    j6 = "check_second_thread_gets_a_clear_error_or_exact_output"
    assert judge(j6, "failed", "the first thread's generation failed: IndexError: index 3 is "
                 "out of bounds") is Severity.ERROR
    assert judge(j6, "failed", "the first thread's output differs: 3 of 8 elements") is \
        Severity.WRONG_OUTPUT
    j5 = "check_backward_is_exact_or_refused_at_forward"
    assert judge(j5, "failed", "calling text_encoder with autograd was refused without saying "
                 "what to do (run under torch.no_grad()): Expected all tensors") is Severity.ERROR
    assert judge(j5, "failed", "backward through offloaded transformer gave 63 wrong or NaN "
                 "gradients") is Severity.WRONG_OUTPUT
    # docs/peers.md showed this as a wrong output: it is an error waiting for the next call
    assert judge(j5, "failed", "after a generation under torch.inference_mode() the enabled "
                 "pipeline's weights are inference tensors (222, e.g. ['w']; the model was built "
                 "with ordinary ones): unfreezing them for fine-tuning raises 'Setting "
                 "requires_grad=True on inference tensor outside InferenceMode'") is \
        Severity.ERROR
    # whatever the check asserts: the user's call stopped with an exception
    assert judge("check_cycles_do_not_grow_memory", "failed",
                 "after cycle 2 enable() raised RuntimeError: x") is Severity.ERROR
    assert judge("check_cycles_do_not_grow_memory", "failed",
                 "after cycle 2: (device, pinned, host) bytes (8, 0, 0) != baseline (0, 0, 0)") \
        is Severity.MEMORY


def test_a_differing_output_is_a_wrong_output_in_a_check_whose_default_is_a_trace() -> None:
    """An outside review: an offloader that rounds a weight in place failed two checks whose
    default is ``trace`` (a retried enable, a second enable) with "output differs", reported
    as a trace: a differing generation is a wrong output whatever the check asserts."""
    import torch

    from offload_ref.contracts.observe import compare_outputs

    assert DEFAULTS["check_second_enable_changes_nothing_observable"] is Severity.TRACE
    with pytest.raises(CheckFailure) as failure:
        compare_outputs("after a second enable()", torch.ones(2), torch.zeros(2))
    assert failure.value.severity is Severity.WRONG_OUTPUT
    assert judge("check_second_enable_changes_nothing_observable", "failed",
                 str(failure.value), failure.value.severity) is Severity.WRONG_OUTPUT
