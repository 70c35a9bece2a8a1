"""The kit judges any offloader through the public protocol (issue 24).

Under test: ``--offloader MODULE:ATTR`` (CLI), ``OFFLOAD_REF_OFFLOADER`` / ``--offload-ref-offloader``
(pytest) and ``parametrize_with_checks(offloader=...)``; the clear errors for a bad reference, a
factory of the wrong shape and an object missing a method; strategies a factory does not offer
and pipelines its ``enable()`` refuses reported not applicable with its words; the capability
record that decides which checks apply; a correct offloader that is not offload-ref (the plain
one of ``contracts/simple_offloader.py``) passing everything that applies; and the conformance
table's generator, with offload-ref's own backends through the public route passing everything.
The broken offloaders (a hook left after disable, everything kept on the device, tied storage
copied apart, a parameter's device not restored, ...) are mutants: tests/test_mutants.py asserts
each fails exactly its checks.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from offload_ref.cli import main
from offload_ref.contracts.capabilities import NEEDS, NEEDS_BY_AREA, PROTOCOL, inapplicable
from offload_ref.contracts.checks import observable
from offload_ref.contracts.offloader import OffloaderError, load_offloader
from offload_ref.contracts.registry import AREAS
from offload_ref.contracts.runner import load_catalogue, run_checks
from offload_ref.fixtures import get_spec

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
SIMPLE = "offload_ref.contracts.simple_offloader:simple_offloader"


# -- factories of every shape, for the errors ---------------------------------------------------


class _Half:
    def enable(self, pipeline):  # noqa: ANN001, ANN201 - a protocol object missing two methods
        pass


def no_disable(device, strategy):  # noqa: ANN001, ANN201
    return _Half()


def one_argument(device):  # noqa: ANN001, ANN201
    return _Half()


def broken_factory(device, strategy):  # noqa: ANN001, ANN201
    raise KeyError("the factory itself is broken")


def nothing_offered(device, strategy):  # noqa: ANN001, ANN201
    raise NotImplementedError("no strategy here")


def model_level_only(device, strategy):  # noqa: ANN001, ANN201
    from offload_ref.contracts.simple_offloader import SimpleOffloader

    if strategy != "model_level":
        raise NotImplementedError("this one swaps whole models only")
    return SimpleOffloader(device, strategy)


class _Refuses:
    def enable(self, pipeline):  # noqa: ANN001, ANN201
        raise NotImplementedError("my API takes DiffusionPipelines only")

    def disable(self):  # noqa: ANN201
        pass

    def is_enabled(self):  # noqa: ANN201
        return False


def refuses_every_pipeline(device, strategy):  # noqa: ANN001, ANN201
    return _Refuses()


NOT_A_FACTORY = 42


@pytest.mark.parametrize("ref, words", [
    ("no_such_module_xyz:factory", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:no_such_factory", "no_such_factory"),
    (f"{__name__}:NOT_A_FACTORY", "not a factory"),
    (f"{__name__}:one_argument", "cannot be called as factory(device, strategy)"),
    (f"{__name__}:no_disable", "without disable(), is_enabled()"),
    (f"{__name__}:broken_factory", "raised KeyError"),
    (f"{__name__}:nothing_offered", "offers no strategy"),
])
def test_a_bad_offloader_is_a_clear_error_before_any_check(ref, words, capsys) -> None:
    with pytest.raises(OffloaderError, match=None) as info:
        load_offloader(ref)
    assert words in str(info.value)
    assert "\n" not in str(info.value)
    assert main(["check", "--pipeline", "flux2", "--offloader", ref]) == 2
    err = capsys.readouterr().err
    assert f"offload-ref check: error: --offloader " in err and words in err
    assert "cases over" not in err  # nothing ran


def test_a_strategy_not_offered_and_a_refused_pipeline_are_not_applicable_with_the_words() -> None:
    spec = get_spec("flux2")
    checks = ["check_enable_disable_cycles_match_the_reference"]
    results = run_checks([spec], checks=checks, impl=load_offloader(
        f"{__name__}:model_level_only"), include_global=False)
    by_strategy = {r.id.strategy: r for r in results}
    assert by_strategy["model_level"].outcome == "passed"
    assert by_strategy["layer_wise"].outcome == "not_applicable"
    assert "this one swaps whole models only" in by_strategy["layer_wise"].message
    results = run_checks([spec], checks=checks, impl=load_offloader(
        f"{__name__}:refuses_every_pipeline"), include_global=False)
    refused = list(results)
    assert len(refused) == 2 and all(r.outcome == "not_applicable" for r in refused)
    assert all("my API takes DiffusionPipelines only" in r.message for r in refused)


def test_the_capability_record_names_real_checks_and_areas() -> None:
    catalogue = load_catalogue()
    assert set(NEEDS) <= set(catalogue), sorted(set(NEEDS) - set(catalogue))
    assert set(NEEDS_BY_AREA) <= set(AREAS)
    judged = [i for i in catalogue.values() if inapplicable(i.id, i.section, PROTOCOL) is None]
    # what judges a foreign offloader: every area where an offloader's behaviour shows
    assert {i.area for i in judged} == {"B", "C", "D", "F", "J", "S"}
    for info in judged:  # they drive the backend through the protocol only
        used = set(info.func.__code__.co_names)
        internals = used & {"stats", "fault_injector", "edit_weights", "use_component"}
        assert not internals, f"{info.id} uses {sorted(internals)} but judges foreign ones"


def test_device_memory_checks_are_the_ones_that_read_device_bytes() -> None:
    catalogue = load_catalogue()
    reading = {i.id for i in catalogue.values()
               if i.func.__module__ == observable.__name__
               and "_device_memory(case)" in inspect.getsource(i.func)}
    assert reading == observable.DEVICE_MEMORY_CHECKS


def test_an_unseen_correct_offloader_passes_everything_that_applies(tmp_path) -> None:
    """The plain offloader of contracts/simple_offloader.py, judged only through its factory,
    on a pipeline with both strategies and one whose buffer views a block's weight."""
    out = tmp_path / "report.json"
    code = main(["check", "--pipeline", "flux2", "--pipeline", "sd3", "--offloader", SIMPLE,
                 "--json", str(out)])
    data = json.loads(out.read_text())
    bad = [(r["check"], r["pipeline"], r["strategy"], r["message"][:200])
           for r in data["results"] if r["outcome"] not in ("passed", "not_applicable")]
    assert code == 0 and not bad, bad
    passed = {r["check"] for r in data["results"] if r["outcome"] == "passed"}
    assert {"check_shared_storage_stays_shared_while_enabled",
            "check_peak_device_bytes_stay_within_the_plan_bound" if torch.device(
                data["header"]["device"].split()[0]).type != "cpu" else
            "check_disable_removes_every_trace"} <= passed
    assert data["header"]["implementation"] == SIMPLE


def test_a_failure_reproduces_with_the_offloader_named() -> None:
    from offload_ref.contracts.mutants import MUTANTS

    mutant = next(m for m in MUTANTS if m.name == "simple_stacks_hooks")
    results = run_checks([get_spec("flux2")], checks=[
        "check_second_enable_changes_nothing_observable"], strategies=["layer_wise"],
        impl=mutant.impl, include_global=False)
    assert [r.outcome for r in results] == ["failed"]
    assert results[0].id.repro() == (
        "offload-ref check --pipeline flux2 --check check_second_enable_changes_nothing_observable"
        f" --strategy layer_wise --offloader {mutant.impl.name}")


_AUTHOR = '''
from offload_ref.fixtures import get_spec

OFFLOAD_REF_SPECS = [get_spec("flux2")]
OFFLOAD_REF_OFFLOADER = "offload_ref.contracts.simple_offloader:simple_offloader"


def test_offload(offload_ref_check):
    offload_ref_check()
'''


def test_pytest_route_judges_the_module_offloader_and_the_option_wins(pytester) -> None:
    pytester.makepyfile(test_author=_AUTHOR)
    args = ("-p", "no:cacheprovider", "-q", "-k",
            "check_second_disable_is_a_noop or check_plan_resolution_is_pure")
    result = pytester.runpytest(*args, "-rs")
    # check_second_disable_is_a_noop under model_level and layer_wise (distributed: not offered);
    # check_plan_resolution_is_pure judges offload-ref's resolver: not applicable, with why
    result.assert_outcomes(passed=2, skipped=3)
    assert any("not judged through the offloader protocol" in line for line in result.outlines)
    result = pytester.runpytest(*args, "--offload-ref-offloader",
                                f"{__name__}:refuses_every_pipeline", "-rs")
    result.assert_outcomes(skipped=5)
    assert any("my API takes DiffusionPipelines only" in line for line in result.outlines)
    result = pytester.runpytest(*args, "--offload-ref-offloader", "nope_xyz:factory")
    assert result.ret != pytest.ExitCode.OK
    result.assert_outcomes(errors=1)  # the test module's collection: nothing ran
    assert any("offloader 'nope_xyz:factory': cannot import module 'nope_xyz'" in line
               for line in result.outlines + result.errlines)


def test_the_conformance_table_generator_runs_and_the_control_passes(tmp_path) -> None:
    page = tmp_path / "peers.md"
    code = main(["peers", "--peer", "offload_ref", "--peer", "accelerate_cpu_offload",
                 "--pipeline", "flux2", "--repeats", "1", "--markdown", str(page)])
    text = page.read_text()
    assert code == 0  # the control row (offload-ref through the protocol) has no failure
    control = next(line for line in text.splitlines() if line.startswith("| `offload_ref`"))
    assert "fail" not in control and "pass (" in control
    accelerate = next(line for line in text.splitlines()
                      if line.startswith("| `accelerate_cpu_offload` | layer_wise"))
    # every fail cell links to its check's cases below and states a cause
    for cell in accelerate.split(" | ")[2:]:
        if "fail" in cell:
            anchor = cell.split("](#", 1)[1].split(")", 1)[0]
            assert f'<a id="{anchor}"></a>' in text
            assert cell.split("): ", 1)[1].strip(" |")
    assert "step / resident" in text and "peak / bound" in text


def test_the_published_table_lists_every_adapter_and_the_control_passes() -> None:
    from offload_ref.peers import PEERS

    text = (ROOT / "docs" / "peers.md").read_text()
    rows = {line.split("`")[1]: line for line in text.splitlines()
            if line.startswith("| `") and "|" in line[3:]}
    assert set(PEERS) <= set(rows), sorted(set(PEERS) - set(rows))
    assert "fail" not in rows["offload_ref"]
    assert "Generated by `offload-ref peers --markdown docs/peers.md`" in text
