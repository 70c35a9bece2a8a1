"""The timeline (issue 12): the offloader's ranges in a torch.profiler trace, and
``offload-ref trace``.

The overlap assertions read the trace of the heavy fixture (8 blocks of 8.4 MiB, 4 steps: 32
block calls) on the CPU platform, whose copy stream is a worker thread: with prefetch on, the
copy of block k + 1 is issued before block k computes, and one overlap in 32 calls is enough
even on a loaded machine; with prefetch off every block's copy is waited for before its compute
range opens, so no overlap is possible at all."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_ref.cli import main

_BLOCK = re.compile(r"\bblock=(\d+)")


def _events(path: Path) -> list[dict[str, Any]]:
    trace = json.loads(path.read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["name"].startswith(f"offload_ref.{kind} ")]


def _interval(e: dict[str, Any]) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    (a0, a1), (b0, b1) = _interval(a), _interval(b)
    return a0 < b1 and b0 < a1


def _block(e: dict[str, Any]) -> int:
    match = _BLOCK.search(e["name"])
    assert match, e["name"]
    return int(match.group(1))


def _trace(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / f"{name}.json"
    assert main(["trace", *extra, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def heavy_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("trace")
    args = ("--pipeline", "heavy", "--strategy", "layer_wise")
    return {"prefetch": _trace(tmp, "prefetch", *args),
            "serial": _trace(tmp, "serial", *args, "--no-prefetch")}


def test_trace_copy_spans_are_on_the_copy_worker_track(heavy_traces: dict[str, Path]) -> None:
    path = heavy_traces["prefetch"]
    events = _events(path)
    copies, blocks, waits = _kind(events, "copy"), _kind(events, "block"), _kind(events, "wait")
    assert len(blocks) == 32 and len(copies) >= 32 and len(waits) == 32, \
        (len(blocks), len(copies), len(waits))
    assert all("copy" in e["name"] for e in copies)
    copy_tids = {e["tid"] for e in copies}
    block_tids = {e["tid"] for e in blocks}
    assert copy_tids.isdisjoint(block_tids), (copy_tids, block_tids)
    assert {e["tid"] for e in waits} == block_tids  # waits are the compute thread's
    names = {e["tid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert all("copy worker" in names.get(t, "") for t in copy_tids), names
    assert re.fullmatch(r"offload_ref\.copy ring=transformer\.blocks block=\d slot=[01]",
                        copies[0]["name"]), copies[0]["name"]


def test_trace_prefetch_overlaps_copy_of_next_block_with_compute(
        heavy_traces: dict[str, Path]) -> None:
    events = _events(heavy_traces["prefetch"])
    copies, blocks = _kind(events, "copy"), _kind(events, "block")
    overlapping = [(_block(b), _block(c)) for b in blocks for c in copies
                   if _block(c) == (_block(b) + 1) % 8 and _overlap(b, c)]
    assert overlapping, "no copy of block k + 1 overlaps the compute of block k"


def test_trace_without_prefetch_no_copy_overlaps_compute(heavy_traces: dict[str, Path]) -> None:
    events = _events(heavy_traces["serial"])
    copies, blocks = _kind(events, "copy"), _kind(events, "block")
    assert len(copies) >= 32 and len(blocks) == 32
    both = [(b["name"], c["name"]) for b in blocks for c in copies if _overlap(b, c)]
    assert not both, both[:3]
    # Each block's own copy ends before its compute range opens.
    first_copy = {}
    for c in copies:
        first_copy.setdefault(_block(c), []).append(c)
    for b in blocks:
        before = [c for c in first_copy[_block(b)] if _interval(c)[1] <= _interval(b)[0]]
        assert before, b["name"]


def test_trace_model_level_swaps_and_spec_reference(tmp_path: Path) -> None:
    events = _events(_trace(tmp_path, "ml", "--pipeline", "flux2", "--strategy", "model_level"))
    assert any(e["name"].startswith("offload_ref.copy component=") for e in events)
    events = _events(_trace(tmp_path, "spec", "--spec", "offload_ref.fixtures.flux2:build_pipeline",
                            "--inputs", "offload_ref.fixtures.flux2:make_inputs",
                            "--strategy", "layer_wise"))
    assert _kind(events, "copy") and _kind(events, "block")


def test_trace_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "t.json")
    assert main(["trace", "-o", out]) == 2
    assert "exactly one pipeline" in capsys.readouterr().err
    assert main(["trace", "--pipeline", "heavy", "--strategy", "layer_wise",
                 "--strategy", "model_level", "-o", out]) == 2
    assert main(["trace", "--pipeline", "bagel", "--strategy", "model_level", "-o", out]) == 2
    assert "supports" in capsys.readouterr().err


def test_trace_png_without_matplotlib_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    out = tmp_path / "t.json"
    assert main(["trace", "--pipeline", "flux2", "-o", str(out),
                 "--png", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "offload-ref[trace]"' in err[0], err
    assert not out.exists()


def test_trace_png_draws_the_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    _trace(tmp_path, "t", "--pipeline", "flux2", "--strategy", "layer_wise", "--no-prefetch",
           "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_profiler_s_own_lines_do_not_reach_the_terminal(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Kineto writes USDT:/STAGE: lines to file descriptor 2 at every start and stop."""
    assert main(["trace", "--pipeline", "flux2", "--strategy", "layer_wise",
                 "-o", str(tmp_path / "t.json")]) == 0
    err = capfd.readouterr().err
    assert "USDT:" not in err and "STAGE:" not in err, err
    assert "offload-ref trace: flux2 / layer_wise" in err, err


def test_spans_cost_nothing_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """No record_function (and no name string) is made while no profiler runs; under one, every
    block, copy and wait is a range."""
    from offload_ref.backends.layerwise import LayerWiseOffloadBackend
    from offload_ref.config import OffloadConfig, OffloadStrategy
    from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline, make_inputs
    from offload_ref.platform import CpuPlatform

    real = torch.autograd.profiler.record_function
    names: list[str] = []

    def counting(name: str, *args: Any) -> Any:
        names.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    config = HeavyConfig(hidden=64, blocks=4, tokens=8, steps=2)
    pipeline, inputs = build_pipeline(0, config), make_inputs(0, config)
    platform = CpuPlatform()
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE), platform)
    backend.enable(pipeline)
    try:
        with torch.inference_mode():
            pipeline(**inputs)
            platform.synchronize()
            assert names == []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                pipeline(**inputs)
                platform.synchronize()
            profiled = len(names)
            pipeline(**inputs)
            platform.synchronize()
            assert len(names) == profiled  # none once the profiler has stopped
    finally:
        backend.disable()
        platform.close()
    ours = [n for n in names if n.startswith("offload_ref.")]
    assert sum(n.startswith("offload_ref.block ") for n in ours) == 8, ours
    assert sum(n.startswith("offload_ref.wait ") for n in ours) == 8, ours
    assert sum(n.startswith("offload_ref.copy ") for n in ours) >= 8, ours


def test_the_picture_names_every_block_keeps_copies_visible_and_joins_stalls_to_copies(
        heavy_traces: dict[str, Path]) -> None:
    """Note [Trace picture] (offload_ref/trace_picture.py): issue 36 found a legend that stopped at
    block 1, copies drawn as hairlines, stalls unconnected and an axis in the tool's words."""
    from offload_ref.trace_picture import _MIN_WIDTH, picture_of

    serial = picture_of(str(heavy_traces["serial"]))
    ours = [e for e in _events(heavy_traces["serial"]) if e["name"].startswith("offload_ref.")]
    assert serial.blocks == sorted({_block(e) for e in ours if "block=" in e["name"]})
    assert len(serial.blocks) == 8
    axis = serial.end_ms
    copies = [b for b in serial.bars if b.kind == "copy"]
    assert copies and all(b.width_ms >= _MIN_WIDTH * axis * 0.99 for b in copies)
    assert any(b.width_ms > b.dur_ms for b in copies)  # widened to stay visible
    stalls = [b for b in serial.bars if b.kind == "stall"]
    assert stalls and serial.stalls == len(stalls)
    for copy, stall in serial.links:  # the copy each stall waited for: its block, begun before
        assert copy.block == stall.block and copy.start_ms <= stall.start_ms + stall.dur_ms
    assert len(serial.links) >= len(stalls) - 1  # at most the first one's copy precedes the trace
    assert "ms" in serial.xlabel and "offloader range" not in serial.xlabel
    assert serial.passes and serial.passes == sorted(serial.passes)
    for lane, start, length in serial.gaps:
        assert length >= 0.5 and serial.lanes[lane]


def test_compare_no_prefetch_traces_both_runs_and_draws_them_one_above_the_other(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "both.png"
    out = _trace(tmp_path, "both", "--pipeline", "flux2", "--strategy", "layer_wise",
                 "--compare-no-prefetch", "--png", str(png))
    second = tmp_path / "both.no-prefetch.json"
    assert out.exists() and second.exists()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["trace", "--pipeline", "flux2", "--strategy", "model_level",
                 "--compare-no-prefetch", "-o", str(tmp_path / "m.json")]) == 2
    assert "layerwise --strategy" in capsys.readouterr().err
