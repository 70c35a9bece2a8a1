"""The conformance kit under pytest, as an outside author runs it (issue 11).

Under test: the pytest11 plugin pins torch's intra-op threads for a session that runs kit checks
and restores them after; unknown strategy names (in a ``PipelineSpec``, in
``--offload-ref-strategy``, in ``iter_cases``) and misspelled ``expected_failures`` ids are errors
that name the closest valid one, never filters that quietly match nothing.

The plugin tests run pytest in-process (``pytester``) on an author-style test file: cheaper
than a subprocess (no second torch import).  torch's thread count is process-wide, and the
project's conftest pins it to 1 for this session, so the thread tests set another value first.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from offload_ref.config import OffloadStrategy
from offload_ref.contracts.pytest_support import check_params
from offload_ref.contracts.registry import ALL_STRATEGIES
from offload_ref.contracts.runner import iter_cases, run_checks
from offload_ref.contracts.spec import PipelineSpec
from offload_ref.fixtures import get_spec

pytest_plugins = ["pytester"]

_NEXTSTEP = get_spec("nextstep")
_ONE_CASE = "check_plan_resolution_is_pure-mine-layer_wise"

# A kit check on a pipeline whose factory records torch's thread count while a test runs: the
# factory runs inside the check (case.build()), so this is the value a check sees.  (Collection
# builds pipelines too, to see which checks apply: before the plugin pins the threads.)
_AUTHOR_TEST = '''
import os

import torch
from offload_ref.contracts.spec import PipelineSpec
from offload_ref.fixtures import get_spec

SEEN = []
_BASE = get_spec("nextstep")


def _factory(seed):
    if "test_author.py::test_offload" in os.environ.get("PYTEST_CURRENT_TEST", ""):
        SEEN.append(torch.get_num_threads())
    return _BASE.build()


OFFLOAD_REF_SPECS = [PipelineSpec("mine", _factory, _BASE.inputs, strategies=_BASE.strategies)]


def test_offload(offload_ref_check):
    offload_ref_check()


def test_zz_seen_inside_the_check():
    print("SEEN-IN-CHECK", ",".join(str(n) for n in sorted(set(SEEN))) or "none")
'''

_PLAIN_TEST = '''
import torch


def test_plain():
    print(f"SEEN-IN-TEST {torch.get_num_threads()}")
'''


@pytest.fixture
def three_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(previous)


def _seen(result, tag: str) -> str:
    """What the test file printed after ``tag`` (``-s``: the line follows the file name)."""
    found = re.findall(rf"{tag} (\S+)", "\n".join(result.outlines))
    assert found, "\n".join(result.outlines)
    return found[-1]


# -- torch threads ---------------------------------------------------------------------------


def test_plugin_pins_one_thread_inside_a_check_and_restores_it(pytester, three_threads) -> None:
    pytester.makepyfile(test_author=_AUTHOR_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "-s", "-k",
                                f"({_ONE_CASE}) or seen_inside")
    result.assert_outcomes(passed=2)
    assert _seen(result, "SEEN-IN-CHECK") == "1"
    assert torch.get_num_threads() == three_threads, "not restored at the end of the session"


def test_plugin_threads_option_sets_n_and_zero_leaves_torch_alone(pytester, three_threads) -> None:
    pytester.makepyfile(test_author=_AUTHOR_TEST)
    for option, expected in (("2", "2"), ("0", str(three_threads))):
        result = pytester.runpytest("-p", "no:cacheprovider", "-s", "--offload-ref-threads",
                                    option, "-k", f"({_ONE_CASE}) or seen_inside")
        result.assert_outcomes(passed=2)
        assert _seen(result, "SEEN-IN-CHECK") == expected, option
        assert torch.get_num_threads() == three_threads


def test_plugin_leaves_a_session_without_kit_checks_alone(pytester, three_threads) -> None:
    pytester.makepyfile(test_plain=_PLAIN_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    assert _seen(result, "SEEN-IN-TEST") == str(three_threads)


def test_plugin_rejects_negative_threads(pytester) -> None:
    pytester.makepyfile(test_plain=_PLAIN_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--offload-ref-threads", "-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--offload-ref-threads*"])


# -- strategy names --------------------------------------------------------------------------


@pytest.mark.parametrize("strategies, hint", [
    (("model_level", "layerwise"), "'layer_wise'"),
    (("model_level", "layer-wise"), "'layer_wise'"),
    (("module", "layer"), "'layer_wise'"),
])
def test_spec_rejects_unknown_strategy_names(strategies, hint) -> None:
    with pytest.raises(ValueError) as info:
        PipelineSpec("mine", _NEXTSTEP.factory, _NEXTSTEP.inputs, strategies=strategies)
    message = str(info.value)
    assert f"did you mean {hint}" in message, message
    assert all(name in message for name in ALL_STRATEGIES), message


def test_spec_rejects_a_string_for_strategies() -> None:
    with pytest.raises(ValueError, match="tuple of strategy names"):
        PipelineSpec("mine", _NEXTSTEP.factory, _NEXTSTEP.inputs, strategies="layer_wise")


def test_spec_accepts_offload_strategy_values() -> None:
    spec = PipelineSpec("mine", _NEXTSTEP.factory, _NEXTSTEP.inputs,
                        strategies=(OffloadStrategy.LAYER_WISE, "model_level"))
    assert spec.strategies == ("layer_wise", "model_level")


def test_iter_cases_rejects_unknown_strategy_filter() -> None:
    with pytest.raises(ValueError, match="did you mean 'layer_wise'"):
        iter_cases([_NEXTSTEP], strategies=["layerwise"])


def test_plugin_unknown_strategy_option_is_a_usage_error(pytester) -> None:
    pytester.makepyfile(test_plain=_PLAIN_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--offload-ref-strategy", "layerwise")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*layerwise*did you mean 'layer_wise'*"])


# -- expected failures -----------------------------------------------------------------------

_CHECK = "check_plan_resolution_is_pure"


def test_expected_failures_accept_check_ids_and_generated_case_ids() -> None:
    expected = {_CHECK: "why", f"check_plan_resolution_is_repeatable-nextstep-layer_wise": "why"}
    params = check_params([_NEXTSTEP], expected_failures=expected, checks=[_CHECK])
    assert params and all(p.marks[-1].name == "xfail" for p in params)


@pytest.mark.parametrize("key, closest", [
    ("check_plan_resolution_is_pur", _CHECK),                         # not a check id
    (f"{_CHECK}-nextstep-layerwise", f"{_CHECK}-nextstep-layer_wise"),  # strategy misspelled
    (f"{_CHECK}-nextstep-model_level", None),                        # never generated
])
def test_expected_failures_reject_unknown_ids_naming_the_closest(key, closest) -> None:
    for call in (lambda: check_params([_NEXTSTEP], expected_failures={key: "why"}),
                 lambda: run_checks([_NEXTSTEP], expected_failures={key: "why"})):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert repr(key) in message, message
        if closest is not None:
            assert f"did you mean {closest!r}" in message, message


def test_expected_failures_reject_an_empty_reason() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        check_params([_NEXTSTEP], expected_failures={_CHECK: ""})


def test_plugin_misspelled_module_expected_failures_is_an_error(pytester) -> None:
    pytester.makepyfile(test_author=_AUTHOR_TEST.replace(
        "def test_offload", 'OFFLOAD_REF_EXPECTED_FAILURES = {"check_plan_resolution_is_pur": "x"}'
        "\n\n\ndef test_offload"))
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", _ONE_CASE)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error naming the module
    result.stdout.no_fnmatch_line("*passed*")
    output = "\n".join(result.outlines + result.errlines)
    assert f"did you mean '{_CHECK}'" in output, output


_IMPORTS_DIFFUSERS_FIRST = """
import diffusers  # asks torch for its accelerator hooks, as a real author's test module would
from offload_ref.fixtures import get_spec

OFFLOAD_REF_SPECS = [get_spec("flux2")]

def test_offload(offload_ref_check):
    offload_ref_check()


def test_frozen_while_kit_checks_run():
    import gc
    print("FROZEN-DURING", gc.get_freeze_count())
"""

_PRINTS_FREEZE_AFTER = """
def pytest_unconfigure(config):
    import gc
    print("FROZEN-AFTER", gc.get_freeze_count())
"""


def test_the_pytest_route_runs_placement_checks_on_although_the_module_imports_diffusers(
        pytester) -> None:
    """Before: importing diffusers (or torch.random.fork_rng in a pipeline's first run) looked up
    torch's HPU hooks before the simulated accelerator loaded, and every pytest route of the kit
    ran with placement checks off.  The plugin now loads it before such a module is imported."""
    pytester.makepyfile(test_author=_IMPORTS_DIFFUSERS_FIRST)
    pytester.makeconftest(_PRINTS_FREEZE_AFTER)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-s",
        "-k", "check_offloaded_output_matches_reference_bitwise or frozen")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "placement checks ON" in out and "PLACEMENT CHECKS OFF" not in out, out
    # Note [Frozen heap] in contracts/runner.py: frozen while the kit's cases
    # run, given back to the collector when the session ends
    assert _seen(result, "FROZEN-DURING") != "0", out
    assert _seen(result, "FROZEN-AFTER") == "0", out


_KEEPS_OBJECTS_BETWEEN_TESTS = """
from offload_ref.fixtures import get_spec

OFFLOAD_REF_SPECS = [get_spec("flux2")]
KEPT = []

def test_offload(offload_ref_check):
    offload_ref_check()


def test_a_holds_objects():
    import gc
    KEPT.extend([] for _ in range(50_000))  # lists: objects the collector tracks
    print("FROZEN-WHILE-KEEPING", gc.get_freeze_count())


def test_b_later():
    import gc
    print("FROZEN-AFTER-KEEPING", gc.get_freeze_count())
"""


def test_what_earlier_tests_left_alive_is_frozen_before_the_next(pytester) -> None:
    """Note [Frozen heap]: a session whose plugin froze the heap freezes again before each test,
    so a collection walks what the current test made, not what earlier ones (or the imports
    they made) keep alive."""
    pytester.makepyfile(test_author=_KEEPS_OBJECTS_BETWEEN_TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-s",
        "-k", "check_offloaded_output_matches_reference_bitwise or holds_objects or later")
    result.assert_outcomes(passed=4)  # the check under both strategies, then the two tests
    while_keeping = int(_seen(result, "FROZEN-WHILE-KEEPING"))
    assert int(_seen(result, "FROZEN-AFTER-KEEPING")) >= while_keeping + 50_000, result.outlines


_RUN_CHECKS_FREEZES_BETWEEN_CASES = """
import gc
from offload_ref.contracts.runner import RunObserver, run_checks
from offload_ref.fixtures import get_spec

KEPT = []
seen = []

class Watch(RunObserver):
    def started(self, case_id):
        seen.append(gc.get_freeze_count())
        KEPT.extend([] for _ in range(20_000))

run_checks([get_spec("flux2")], checks=["check_dotted_paths_resolve_nested_components",
                                        "check_offloaded_output_matches_reference_bitwise"],
           strategies=["layer_wise"], include_global=False, observer=Watch())
print("FREEZE-COUNTS", seen, gc.get_freeze_count())
"""


def test_run_checks_freezes_what_its_cases_leave_alive_and_unfreezes_at_the_end(
        pytester) -> None:
    """Note [Frozen heap]: run_checks, where it froze the heap, freezes again before each case
    and unfreezes everything at the end."""
    result = pytester.run(sys.executable, "-c", _RUN_CHECKS_FREEZES_BETWEEN_CASES)
    assert result.ret == 0, result.outlines
    (line,) = [line for line in result.outlines if line.startswith("FREEZE-COUNTS")]
    first, second, after = map(
        int, re.fullmatch(r"FREEZE-COUNTS \[(\d+), (\d+)\] (\d+)", line).groups())
    assert first > 0 and second >= first + 20_000 and after == 0, line


def test_a_kit_session_inside_a_frozen_process_leaves_the_freeze_alone(pytester) -> None:
    """gc.freeze does not nest: a kit session (or run_checks) started where objects are frozen
    already (this session's own plugin, a pytester session inside a test) must neither freeze
    nor unfreeze.  Before, such an inner session unfroze the outer one's objects at its end, and
    every later gc.collect of the outer session walked them again (Note [Frozen heap])."""
    import gc

    from offload_ref.contracts.runner import run_checks
    from offload_ref.fixtures import get_spec

    froze_here = not gc.get_freeze_count()
    if froze_here:  # this test run alone: no kit session froze this process
        gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pytester.makepyfile(test_author=_IMPORTS_DIFFUSERS_FIRST)
        pytester.runpytest_inprocess(
            "-p", "no:cacheprovider", "-k", "frozen").assert_outcomes(passed=1)
        # frozen objects freed by reference counting leave the count; none may join it (a
        # second freeze), nor may the rest leave (an unfreeze)
        assert frozen // 2 < gc.get_freeze_count() <= frozen
        run_checks([get_spec("flux2")], checks=["check_dotted_paths_resolve_nested_components"],
                   include_global=False)
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        if froze_here:
            gc.unfreeze()


# -- pytest-xdist --------------------------------------------------------------------------------

_DIST_CONFTEST = '''
def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller
        print("DIST-MODE", session.config.option.dist)


def pytest_collection_finish(session):
    if hasattr(session.config, "workerinput"):  # the ids a worker's scheduler groups by
        with open(session.config.rootpath / "worker-ids.txt", "a") as f:
            f.write("\\n".join(item.nodeid for item in session.items) + "\\n")
'''


@pytest.mark.parametrize("args, mode", [(("-n", "1"), "loadgroup"),
                                        (("-n", "1", "--dist", "load"), "load"),
                                        (("-n", "1", "--dist=loadscope"), "loadscope")])
def test_n_alone_distributes_by_group_and_an_explicit_dist_is_kept(pytester, args, mode) -> None:
    """§H cases of one pipeline share one spawn on one worker only under ``loadgroup``:
    ``-n N`` alone gets it (the plugin asks for it), a ``--dist`` given is the user's."""
    pytest.importorskip("xdist")
    pytester.makeconftest(_DIST_CONFTEST)
    pytester.makepyfile(test_plain="import pytest\n\n"
                                   "@pytest.mark.xdist_group(name='ranks')\n"
                                   "def test_grouped():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", *args)
    assert _seen(result, "DIST-MODE") == mode
    ids = (pytester.path / "worker-ids.txt").read_text().split()
    # a worker groups only when it knows the mode too: the suffix is what the scheduler reads
    assert ids == (["test_plain.py::test_grouped@ranks"] if mode == "loadgroup" else
                   ["test_plain.py::test_grouped"]), ids


def test_an_explicit_dist_that_splits_spawned_rank_checks_is_warned_about(pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_ranks='''
import pytest

@pytest.mark.xdist_group(name="offload_ref-distributed-flux2")
def test_rank_case():
    pass
''')
    warned = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1", "--dist", "load")
    assert "--dist load spread one pipeline's spawned-rank checks" in warned.stdout.str()
    quiet = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1")
    assert "spawned-rank checks" not in quiet.stdout.str()
