"""The acceptance corpus of issue 34 through the kit (tests/stream_offloaders.py).

Offloaders written against ``torch.Stream`` / ``torch.Event`` / ``torch.accelerator`` alone,
judged only through their factories as ``offload-ref check --offloader`` judges them: the correct
two-slot block prefetcher (layer_wise) and the correct model-level swapper pass every check that
applies to them, the stream verdict (§S) included, on two fixtures; each racy variant fails with
the race's kind, the tensor, and both accesses named, the one in the offloader at its line.  The
simulated device computes every op at once, so the racy ones are bit-exact too: the parity
check's own comparison holds, and only the sanitizer fails them.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from offload_ref.cli import main
from offload_ref.contracts import streams as kit_streams
from offload_ref.contracts.offloader import load_offloader
from offload_ref.contracts.runner import run_checks
from offload_ref.fixtures import get_spec

import stream_offloaders as corpus  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(kit_streams.off_reason() is not None,
                                reason=f"stream checking is off: {kit_streams.off_reason()}")

STREAMS = "check_device_accesses_are_ordered_across_streams"
PARITY = "check_offloaded_output_matches_reference_bitwise"
PIPELINES = ("flux2", "wan22_t2v")
_SOURCE = Path(corpus.__file__).read_text().splitlines()


def _ref(name: str) -> str:
    return f"stream_offloaders:{name}"


def _line(marker: str) -> str:
    """``stream_offloaders.py:N``, N the line of the corpus marked ``# <marker>``."""
    hits = [k + 1 for k, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return f"stream_offloaders.py:{hits[0]}"


def _run(name: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks(impl=load_offloader(_ref(name)), include_global=False, **kwargs)


@pytest.mark.slow  # the whole kit on two fixtures: about 10-25 s each on 2 busy cores
@pytest.mark.parametrize("name, strategy", [("stream_prefetcher", "layer_wise"),
                                            ("stream_swapper", "model_level")])
def test_a_correct_stream_offloader_passes_every_check_that_applies(name, strategy) -> None:
    results = _run(name, specs=[get_spec(p) for p in PIPELINES])
    bad = [(str(r.id), r.outcome, r.message[:400]) for r in results if not r.ok]
    assert not bad, bad
    passed = {(r.id.check, r.id.spec, r.id.strategy) for r in results if r.outcome == "passed"}
    for pipeline in PIPELINES:  # the stream verdict and parity ran, under the offered strategy
        assert {(STREAMS, pipeline, strategy), (PARITY, pipeline, strategy)} <= passed, pipeline
    assert {s for _, _, s in passed} == {strategy}


def test_the_report_header_says_stream_checking_is_on(tmp_path) -> None:
    out = tmp_path / "report.json"
    code = main(["check", "--pipeline", "flux2", "--offloader", _ref("stream_prefetcher"),
                 "--check", STREAMS, "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == 0, [r["message"][:300] for r in data["results"]]
    assert "stream checking ON" in data["header"]["device"], data["header"]
    assert [(r["check"], r["strategy"], r["outcome"]) for r in data["results"]
            if r["outcome"] != "not_applicable"] == [(STREAMS, "layer_wise", "passed")]


#: racy offloader -> (the corpus line of its access that the report must name, whether the racing
#: memory is the device memory of a pipeline tensor, which the kit names by its module path)
_NAMED = {
    "no_wait_for_copy": ("slot-copy", True),
    "slot_refilled_while_in_use": ("slot-copy", True),
    "ready_event_on_compute_stream": ("slot-copy", True),
    "event_recorded_before_copy": ("slot-copy", True),
    "freed_without_record_stream": ("load", True),
    "host_reads_before_sync": ("copy-back", False),
}


def test_the_corpus_lists_each_defect_once() -> None:
    assert set(corpus.RACY) == set(_NAMED)
    assert len({defect for _, _, defect, _ in corpus.RACY.values()}) == len(corpus.RACY)


@pytest.mark.parametrize("name", sorted(_NAMED))
def test_a_racy_stream_offloader_fails_naming_the_tensor_and_both_accesses(name) -> None:
    _, strategy, defect, kinds = corpus.RACY[name]
    marker, on_a_module = _NAMED[name]
    results = _run(name, specs=[get_spec("flux2")], checks=[STREAMS, PARITY],
                   strategies=[strategy])
    by_check = {r.id.check: r for r in results}
    assert set(by_check) == {STREAMS, PARITY}, [str(r.id) for r in results]
    verdict = by_check[STREAMS]
    assert verdict.outcome == "failed", (defect, verdict.outcome, verdict.message[:600])
    message = verdict.message
    found = [k for k in kinds if f"stream race ({k})" in message]
    assert found, (defect, message[:1000])
    race = next(line for line in message.splitlines() if f"stream race ({found[0]})" in line)
    # both accesses: the stream, the op and the source line of each
    places = re.findall(r" at (\S+\.py:\d+)", race)
    assert len(places) >= 2, race
    assert _line(marker) in race, (marker, race)
    stream = r"(the host|the default stream of hpu:0|stream \d+ of hpu:0)"
    assert re.search(rf"{stream} (read|wrote) it in \S+", race), race  # the later access
    assert re.search(rf"the (read|write) by {stream} in \S+", race), race  # the earlier one
    if on_a_module:
        # by the module path of the tensor over it, or (unbound when the race was found: a slot
        # between blocks, a dropped copy) of the one a module last computed with there
        assert re.search(r"on (transformer|text_encoder)\.[\w.]+ (\(the tensor a module last "
                         r"computed with in that memory[^()]*\) )?\(hpu:0\)", race), race
    if found[0] == "use-after-free":
        assert _line("free") in race, race
    assert f"at fault: the offloader {_ref(name)}" in message, message
    # every case runs under the sanitizer: parity fails on the race alone, its values exact
    parity = by_check[PARITY]
    assert parity.outcome == "failed" and "stream race (" in parity.message, parity.message[:600]
    assert "the case also" not in parity.message, parity.message
