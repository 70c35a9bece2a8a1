"""Race reports name the right party and the right memory (issue 34, from an outside trial).

* A pipeline whose own block races on a side stream of its own is blamed on the pipeline also
  when its model lives in another module than its spec (a package: model.py + testing.py): §S
  drops its pipeline before the races are collected, and the pipeline's files were then only the
  spec's factory and inputs modules.
* The pipeline's own lines racing on a stream the offloader's hooks made current are the
  offloader's race, said consistently: the same code run resident does not race.
* Memory no tensor is bound to when the race is found (a ring slot between two blocks, a dropped
  swap-in) is named by the module path of the tensor a module last computed with there, and a
  block the kit reuses after ``disable()`` by the latest tensor bound to it (not the first).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.contracts import streams as kit_streams
from offload_ref.contracts.checks import streams as stream_check
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.spec import PipelineSpec

# the pipelines' code in another module than their specs (and than the offloader below)
from test_kit_streams import _PlainPipeline, _SideStreamPipeline  # noqa: E402 (tests/ on sys.path)

needs_sanitizer = pytest.mark.skipif(
    kit_streams.off_reason() is not None,
    reason=f"stream checking is off: {kit_streams.off_reason()}")

STREAMS = "check_device_accesses_are_ordered_across_streams"


def _check(spec: PipelineSpec, impl: Any = None) -> Any:
    kwargs = {"impl": impl} if impl is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([spec], checks=[STREAMS], strategies=("layer_wise",),
                               include_global=False, **kwargs)
    assert result.outcome == "failed", (result.outcome, result.message)
    return result


# -- the party ---------------------------------------------------------------------------------


def build_packaged(seed: int = 0) -> _SideStreamPipeline:
    """The side-stream pipeline of tests/test_kit_streams.py, its spec here: the model's code is
    in another module than the spec's factory and inputs, as in a package."""
    torch.manual_seed(seed)
    return _SideStreamPipeline()


def small_inputs(seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))}


PACKAGED = PipelineSpec(name="side_stream_packaged", factory=f"{__name__}:build_packaged",
                        inputs=f"{__name__}:small_inputs", strategies=("layer_wise",))


@needs_sanitizer
def test_a_packaged_pipelines_own_race_blames_the_pipeline() -> None:
    r = _check(PACKAGED)
    first = r.message.splitlines()[0]
    assert "test_kit_streams.py:" in first, first  # both accesses in the model's module
    assert "at fault: the pipeline: the pipeline races without any offloader" in r.message, \
        r.message


def build_plain(seed: int = 0) -> _PlainPipeline:
    torch.manual_seed(seed)
    return _PlainPipeline()


PLAIN = PipelineSpec(name="plain_blocks", factory=f"{__name__}:build_plain",
                     inputs=f"{__name__}:small_inputs", strategies=("layer_wise",))


class SideStreamRunner:
    """Keeps the pipeline resident and runs each block on a stream of its own: its pre-hook makes
    the side stream wait for the caller's and makes it current, its forward hook makes the
    caller's current again without waiting for the side stream (the defect)."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        self.device, self.enabled = torch.device(device), False

    def enable(self, pipeline: Any) -> None:
        self.original = []
        with torch.no_grad():
            for t in [*pipeline.transformer.parameters(), *pipeline.transformer.buffers()]:
                self.original.append((t, t.data))
                t.data = t.data.to(self.device)
        self.side = torch.Stream(device=self.device)
        self.saved: list[Any] = []
        self.handles = [h for b in pipeline.transformer.blocks for h in (
            b.register_forward_pre_hook(self._pre), b.register_forward_hook(self._post))]
        self.enabled = True

    def _pre(self, block: nn.Module, args: Any) -> None:
        caller = torch.accelerator.current_stream(self.device)
        self.saved.append(caller)
        self.side.wait_stream(caller)
        torch.accelerator.set_stream(self.side)

    def _post(self, block: nn.Module, args: Any, output: Any) -> None:
        torch.accelerator.set_stream(self.saved.pop())  # no wait for the side stream

    def disable(self) -> None:
        if not self.enabled:
            return
        torch.accelerator.synchronize(self.device)
        for handle in self.handles:
            handle.remove()
        with torch.no_grad():
            for t, data in self.original:
                t.data = data
        self.enabled = False

    def is_enabled(self) -> bool:
        return self.enabled


def side_stream_runner(device: torch.device, strategy: str) -> SideStreamRunner:
    return SideStreamRunner(device, strategy)


@needs_sanitizer
def test_the_pipelines_lines_on_the_offloaders_stream_blame_the_offloader_consistently() -> None:
    impl = offloader_implementation(side_stream_runner, name=f"{__name__}:side_stream_runner")
    r = _check(PLAIN, impl)
    first = r.message.splitlines()[0]
    # both accesses are the pipeline's own lines, neither is the offloader's (this file)
    assert first.count("test_kit_streams.py:") >= 2, first
    assert "test_kit_race_names.py" not in first, first
    assert "in _pre" not in first and "in _post" not in first, first
    party = next(line for line in r.message.splitlines() if "at fault:" in line)
    assert party.startswith(f"  at fault: the offloader {__name__}:side_stream_runner: both "
                            "accesses are the pipeline's own code ("), party
    assert "run resident (no offloader) the pipeline made them without a race" in party, party
    assert "neither access" not in party, party


# -- the memory --------------------------------------------------------------------------------


@needs_sanitizer
def test_memory_no_tensor_is_bound_to_is_named_by_the_latest_tensor_computed_with_there() -> None:
    device = torch.device("hpu:0")
    slot = torch.zeros(64, device=device)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():
        a.weight.data = slot[0:16].view(4, 4)
        a.bias.data = slot[16:20]
    kit_streams._BOUND.clear()
    try:
        kit_streams.note_bindings(a, "blocks.0.lin", device)
        a.weight.data = torch.zeros(4, 4)  # unbound again: the slot holds nothing named
        a.bias.data = torch.zeros(4)
        address = slot.data_ptr()
        assert kit_streams.name_memory([a, b], address, 64, 0) == (
            "blocks.0.lin.weight (the tensor a module last computed with in that memory)")
        assert kit_streams.name_memory([a, b], slot[16:].data_ptr(), 16, 0).startswith(
            "blocks.0.lin.bias (")
        # the slot refilled for the next block: its tensors, and the earlier one said
        b.weight.data = slot[0:16].view(4, 4)
        kit_streams.note_bindings(b, "blocks.1.lin", device)
        b.weight.data = torch.zeros(4, 4)
        assert kit_streams.name_memory([a, b], address, 64, 0) == (
            "blocks.1.lin.weight (the tensor a module last computed with in that memory, which "
            "held 2 tensors in turn; before it blocks.0.lin.weight)")
        # a tensor bound there now wins; other devices and unknown memory are not named
        b.weight.data = slot[0:16].view(4, 4)
        assert kit_streams.name_memory([b], address, 64, 0) == "weight"
        assert kit_streams.name_memory([], address, 64, 1) is None
        assert kit_streams.name_memory([], 16, 4, 0) is None
    finally:
        kit_streams._BOUND.clear()


@needs_sanitizer
def test_memory_the_kit_reuses_after_disable_is_named_by_its_latest_tensor(monkeypatch) -> None:
    device = torch.device("hpu:0")
    storages: dict[int, Any] = {}
    slot = torch.zeros(64, device=device)
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    paths = {id(a): "blocks.0.lin", id(b): "blocks.1.lin"}
    kit_streams._BOUND.clear()
    try:
        for module in (a, b):  # the slot held block 0's weight, then block 1's
            module.weight.data = slot[0:16].view(4, 4)
            stream_check._note_storages(module, paths, device, storages)
            module.weight.data = torch.zeros(4, 4)
    finally:
        kit_streams._BOUND.clear()
    named: list[tuple[int, str]] = []
    monkeypatch.setattr(stream_check, "name_range", lambda at, n, name: named.append((at, name)))
    address = slot.data_ptr()
    del slot  # freed: the kit's allocation of its size gets it again
    stream_check._reuse(storages, device)
    assert [name for at, name in named if at == address] == [
        "the device memory last bound to blocks.1.lin.weight (freed at disable(), allocated again "
        "by the kit; it held 2 tensors in turn, before it blocks.0.lin.weight)"], named


def test_the_party_follows_the_rerun_without_the_offloader_and_says_so() -> None:
    from offload_ref.contracts.blame import race_party

    pipeline, offloader = {"fixtures/flux2.py"}, {"my_engine/offload.py"}
    mine = ("fixtures/flux2.py:12 in forward",)
    other = ("site/lib.py:3 in helper",)
    copy = ("my_engine/offload.py:77 in prefetch",)
    # the same race without the offloader: the pipeline's, whoever's files the lines are in
    assert race_party(mine, other, offloader, pipeline, True)[0] == "pipeline"
    # none without it: the offloader's, and the reason says what the frames are
    party, why = race_party(mine, mine, offloader, pipeline, False)
    assert party == "offloader", why
    assert why.startswith("both accesses are the pipeline's own code ("), why
    party, why = race_party(mine, other, offloader, pipeline, False)
    assert party == "offloader" and why.startswith(
        "neither access is in the offloader's files the kit knows ("), why
    assert "pipeline's own code" not in why
    # the offloader's own frame decides, whatever a rerun said
    assert race_party(mine, copy, offloader, pipeline, True)[0] == "offloader"
    # not known: both in the pipeline's files is the pipeline's; else the offloader's, truthfully
    assert race_party(mine, mine, offloader, pipeline)[0] == "pipeline"
    party, why = race_party(mine, other, offloader, pipeline)
    assert party == "offloader" and "nor are both the pipeline's own code" in why, why
