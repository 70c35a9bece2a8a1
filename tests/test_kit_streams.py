"""The kit judges stream ordering (issue 34, item 4): every case runs under the simulated
accelerator's happens-before sanitizer, a race fails the case naming the tensor by its module path,
both accesses and the missing ordering, and ``check_device_accesses_are_ordered_across_streams``
(§S) gives each pipeline and strategy a stream verdict.  A tiny block prefetcher written against
``torch.Stream`` / ``torch.Event`` / ``torch.accelerator`` alone passes when its compute waits for
its copy and fails when it does not (tests/stream_offloaders.py holds the full corpus of racy
offloaders); a pipeline that races on a stream of its own is blamed, not the offloader.  The parts
that need no sanitizer (naming memory, the report's words, the party at fault) run everywhere."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.contracts import streams as kit_streams
from offload_ref.contracts.blame import race_party
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.registry import AREAS, doc_for
from offload_ref.contracts.runner import load_catalogue
from offload_ref.contracts.runner import run_checks  # noqa: I001
from offload_ref.contracts.spec import PipelineSpec
from offload_ref.fixtures import get_spec
from offload_ref.platform import simulated

pytest_plugins = ["pytester"]

STREAMS = "check_device_accesses_are_ordered_across_streams"
PARITY = "check_offloaded_output_matches_reference_bitwise"
CHECKING = kit_streams.off_reason() is None
needs_sanitizer = pytest.mark.skipif(
    not CHECKING, reason=f"stream checking is off here: {kit_streams.off_reason()}")


# -- a block prefetcher written against torch's device-generic stream API alone -------------------


class StreamPrefetcher:
    """Layerwise: every block of every ``nn.ModuleList`` of the pipeline streams through one copy
    stream into fresh device memory; a block's pre-hook makes the compute stream wait for its
    copy (unless ``wait=False``: the defect), binds it, and prefetches the next block of its list;
    its forward hook parks it on its pinned host copy.  Everything else moves to the device at
    ``enable()``."""

    def __init__(self, device: torch.device, strategy: str, *, wait: bool = True) -> None:
        if strategy != "layer_wise":
            raise NotImplementedError("this prefetcher streams blocks only")
        self.device, self.wait = torch.device(device), wait
        self.enabled = False

    def _tensors(self, module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
        return [(m, name, t) for m in module.modules()
                for registry in (m._parameters, m._buffers)
                for name, t in registry.items() if t is not None]

    def _like(self, t: torch.Tensor, phase: int) -> torch.Tensor:
        """An empty device tensor like ``t`` whose address is ``phase`` bytes past a 64-byte
        boundary: the phase the pipeline built it at, so that kernels that choose their path by
        alignment (MKL's GEMV on AMD EPYC) compute as in the reference (Note [Aligned layout])."""
        raw = torch.empty(phase + t.nbytes, dtype=torch.uint8, device=self.device)
        return raw[phase:].view(t.dtype).view(t.shape)

    def enable(self, pipeline: Any) -> None:
        components = ([pipeline] if isinstance(pipeline, nn.Module) else
                      [v for v in vars(pipeline).values() if isinstance(v, nn.Module)])
        lists = [m for c in components for m in c.modules() if isinstance(m, nn.ModuleList)]
        self.blocks = [b for blocks in lists for b in blocks]
        self.next = {id(a): b for blocks in lists for a, b in zip(blocks, blocks[1:])}
        streamed = {id(t) for b in self.blocks for _, _, t in self._tensors(b)}
        self.original: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for c in components:
                for _, _, t in self._tensors(c):
                    if id(t) not in streamed and t.device != self.device:
                        self.original.append((t, t.data))
                        t.data = self._like(t, t.data_ptr() % 64).copy_(t.data)
            self.host = {}
            self.phase = {}
            for b in self.blocks:
                self.host[id(b)] = [(t, t.data.contiguous().pin_memory())
                                    for _, _, t in self._tensors(b)]
                self.phase.update((id(t), t.data_ptr() % 64) for _, _, t in self._tensors(b))
                self.original += [(t, t.data) for _, _, t in self._tensors(b)]
        self.copy = torch.Stream(device=self.device)
        self.pending: dict[int, tuple[list[torch.Tensor], torch.Event]] = {}
        self.handles = [h for b in self.blocks for h in (
            b.register_forward_pre_hook(self._pre), b.register_forward_hook(self._post))]
        self.enabled = True

    def _load(self, block: nn.Module) -> None:
        compute = torch.accelerator.current_stream(self.device)
        targets = [self._like(h, self.phase[id(t)]) for t, h in self.host[id(block)]]
        self.copy.wait_stream(compute)  # the memory may be a block the compute stream just read
        with self.copy:
            for target, (_, h) in zip(targets, self.host[id(block)]):
                target.copy_(h, non_blocking=True)
        ready = torch.Event(device=self.device)
        self.copy.record_event(ready)
        self.pending[id(block)] = (targets, ready)

    def _pre(self, block: nn.Module, args: Any) -> None:
        if id(block) not in self.pending:
            self._load(block)
        targets, ready = self.pending.pop(id(block))
        if self.wait:
            torch.accelerator.current_stream(self.device).wait_event(ready)
        for (t, _), target in zip(self.host[id(block)], targets):
            t.data = target
        following = self.next.get(id(block))
        if following is not None and id(following) not in self.pending:
            self._load(following)

    def _post(self, block: nn.Module, args: Any, output: Any) -> None:
        for t, h in self.host[id(block)]:
            t.data = h

    def disable(self) -> None:
        if not self.enabled:
            return
        torch.accelerator.synchronize(self.device)
        for handle in self.handles:
            handle.remove()
        with torch.no_grad():
            for t, data in self.original:
                t.data = data
        self.pending.clear()
        self.enabled = False

    def is_enabled(self) -> bool:
        return self.enabled


def prefetcher(device: torch.device, strategy: str) -> StreamPrefetcher:
    return StreamPrefetcher(device, strategy)


def racy_prefetcher(device: torch.device, strategy: str) -> StreamPrefetcher:
    """Compute never waits for its copy stream."""
    return StreamPrefetcher(device, strategy, wait=False)


def _impl(factory: Any) -> Any:
    return offloader_implementation(factory, name=f"{__name__}:{factory.__name__}")


def _run(factory: Any, checks: list[str], spec: Any = None) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([spec or get_spec("flux2")], checks=checks,
                             strategies=("layer_wise",), impl=_impl(factory),
                             include_global=False)
    return {r.id.check: r for r in results}


# -- with the sanitizer --------------------------------------------------------------------------


@needs_sanitizer
def test_a_prefetcher_whose_compute_never_waits_for_its_copy_fails_naming_tensor_and_accesses(
        ) -> None:
    made: list[StreamPrefetcher] = []

    def recorded(device: torch.device, strategy: str) -> StreamPrefetcher:
        made.append(racy_prefetcher(device, strategy))
        return made[-1]

    recorded.__name__ = racy_prefetcher.__name__  # the report names the factory
    results = _run(recorded, [STREAMS, PARITY])
    r = results[STREAMS]
    assert r.outcome == "failed", (r.outcome, r.message)
    assert r.severity == "wrong output"
    first = r.message.splitlines()[0]
    # the module path of a weight of a streamed block (the first block the prefetcher streams)
    assert re.match(r"stream race \(read-after-write\) on text_encoder\.blocks\.0\.[\w.]+weight "
                    r"\(hpu:0\): ", first), first
    # the compute stream's read and the copy stream's write, each with its source line
    assert " read it in aten::native_layer_norm (weight) at fixtures/_common.py:" in first, first
    # the copy stream of a prefetcher of this run (a stream's number is its order of creation in
    # the process: under pytest-xdist, or after other tests, it is not 1)
    copy = re.search(r"while the write by stream (\d+) of hpu:0 in copy host to device "
                     r"\(non_blocking", first)
    assert copy is not None, first
    assert int(copy.group(1)) in {p.copy.stream_id for p in made if hasattr(p, "copy")}, first
    assert int(copy.group(1)) != 0
    assert " at tests/test_kit_streams.py:" in first and " in _load was not ordered" in first
    assert "missing ordering: " in r.message
    assert f"at fault: the offloader {__name__}:racy_prefetcher" in r.message, r.message
    assert kit_streams.DOC in r.message
    # a race during any other case fails that case too
    parity = results[PARITY]
    assert parity.outcome == "failed" and parity.message.startswith("stream race"), parity.message


@needs_sanitizer
def test_the_docs_example_is_the_report_the_kit_gives(monkeypatch) -> None:
    """docs/model-authors.md §9 shows this test's racy prefetcher's report: its race line, the
    lines naming the callers, the missing ordering and the party are the kit's, word for word."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # files are written relative to the working folder
    message = _run(racy_prefetcher, [STREAMS])[STREAMS].message

    def norm(text: str) -> str:  # a stream's number is its order of creation in the process
        return re.sub(r"stream \d+ of", "stream N of", " ".join(text.split()))

    doc = norm((root / "docs" / "model-authors.md").read_text())
    for line in message.splitlines()[:5]:
        assert norm(line) in doc, line


@needs_sanitizer
def test_a_prefetcher_that_waits_for_its_copy_passes() -> None:
    results = _run(prefetcher, [STREAMS, PARITY])
    assert {c: r.outcome for c, r in results.items()} == {STREAMS: "passed", PARITY: "passed"}, \
        {c: r.message for c, r in results.items()}


class _SideStreamBlock(nn.Module):
    """A block that computes half its work on a side stream of its own and reads the result on
    the current stream without waiting: the pipeline's race, whatever the offloader."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = torch.Stream(device=x.device)
        with side:
            y = self.lin(x)
        return x + y  # no wait on `side`: read-after-write across streams


class _SideStreamDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SideStreamBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _SideStreamPipeline:
    _dit_modules = ("transformer",)

    def __init__(self) -> None:
        self.transformer = _SideStreamDiT()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from offload_ref import execution_device

        return self.transformer(x.to(execution_device(self)))


class _PlainBlock(nn.Module):
    """A block of tests/test_kit_race_names.py's plain pipeline (no stream of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _PlainDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PlainBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * 2  # reads the last block's output on the caller's stream


class _PlainPipeline:
    _dit_modules = ("transformer",)

    def __init__(self) -> None:
        self.transformer = _PlainDiT()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from offload_ref import execution_device

        return self.transformer(x.to(execution_device(self)))


def build_side_stream_pipeline(seed: int = 0) -> _SideStreamPipeline:
    torch.manual_seed(seed)
    return _SideStreamPipeline()


def side_stream_inputs(seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))}


SIDE_STREAM = PipelineSpec(name="side_stream", factory=f"{__name__}:build_side_stream_pipeline",
                           inputs=f"{__name__}:side_stream_inputs", strategies=("layer_wise",))


@needs_sanitizer
def test_a_race_inside_the_pipelines_own_code_blames_the_pipeline() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([SIDE_STREAM], checks=[STREAMS], strategies=("layer_wise",),
                             include_global=False)
    (r,) = results
    assert r.outcome == "failed", (r.outcome, r.message)
    assert "at fault: the pipeline: the pipeline races without any offloader" in r.message, \
        r.message


def _current() -> tuple[int, list[torch.Stream]]:
    return (torch.accelerator.current_device_index(),
            [torch.accelerator.current_stream(i) for i in range(torch.accelerator.device_count())])


@needs_sanitizer
def test_the_kits_rerun_of_a_pipeline_race_leaves_the_current_device_and_streams_as_they_were(
        ) -> None:
    # Note [Current device and streams between cases]: the rerun without offloader once
    # restored each device's stream in turn and left the last device current, so the next cases'
    # offloaders made their streams there and their races went unseen
    assert torch.accelerator.device_count() >= 2, "the regression needs a second device"
    before = _current()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (r,) = run_checks([SIDE_STREAM], checks=[STREAMS], strategies=("layer_wise",),
                          include_global=False)
    assert "the pipeline races without any offloader" in r.message, r.message  # it reran
    assert "was left" not in r.message, r.message
    assert _current() == before


class _StreamLeavingPrefetcher(StreamPrefetcher):
    """Makes its copy stream current at enable() and never restores the one it replaced."""

    def enable(self, pipeline: Any) -> None:
        super().enable(pipeline)
        torch.accelerator.set_stream(self.copy)


def stream_leaving_prefetcher(device: torch.device, strategy: str) -> StreamPrefetcher:
    return _StreamLeavingPrefetcher(device, strategy)


@needs_sanitizer
def test_a_case_that_leaves_another_stream_current_fails_and_the_next_case_starts_clean() -> None:
    before = _current()
    results = _run(stream_leaving_prefetcher, [PARITY, STREAMS])
    assert _current() == before
    for r in results.values():
        assert r.outcome == "failed", (r.id, r.outcome, r.message)
        assert re.search(r"the current stream of hpu:0 was left at stream \d+ \(it was stream 0\)",
                         r.message), r.message
        assert ("at fault: the offloader tests.test_kit_streams:stream_leaving_prefetcher" in
                r.message or "at fault: the offloader test_kit_streams:stream_leaving_prefetcher"
                in r.message), r.message


class _StreamLeavingPipeline(_PlainPipeline):
    """Makes a stream of its own current in its call and leaves it so."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from offload_ref import execution_device

        device = execution_device(self)
        if device.type != "cpu":
            torch.accelerator.set_stream(torch.Stream(device))
        return super().__call__(x)


def build_stream_leaving_pipeline(seed: int = 0) -> _StreamLeavingPipeline:
    torch.manual_seed(seed)
    return _StreamLeavingPipeline()


STREAM_LEAVING = PipelineSpec(name="stream_leaving",
                              factory=f"{__name__}:build_stream_leaving_pipeline",
                              inputs=f"{__name__}:side_stream_inputs", strategies=("layer_wise",))


@needs_sanitizer
def test_a_pipeline_that_leaves_its_own_stream_current_is_the_party_at_fault() -> None:
    before = _current()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([STREAM_LEAVING], checks=[PARITY], strategies=("layer_wise",),
                             include_global=False)
    assert _current() == before
    (r,) = [r for r in results if r.id.check == PARITY]
    assert r.outcome == "failed", (r.outcome, r.message)
    assert "at fault: the pipeline: one generation of it resident" in r.message, r.message


@needs_sanitizer
def test_offload_refs_own_backends_pass_on_the_accelerator_platform() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([get_spec("flux2")], checks=[STREAMS], include_global=False)
    assert {r.id.strategy: r.outcome for r in results} == {
        "model_level": "passed", "layer_wise": "passed"}, [r.message for r in results]


@needs_sanitizer
def test_stream_checking_is_restored_after_each_case() -> None:
    from offload_ref.platform import simulated

    before = simulated.check_streams()
    _run(prefetcher, [STREAMS])
    assert simulated.check_streams() == before
    assert simulated.races() == []


_AUTHOR = f'''
from offload_ref.fixtures import get_spec

OFFLOAD_REF_SPECS = [get_spec("flux2")]
OFFLOAD_REF_OFFLOADER = "{__name__}:racy_prefetcher"


def test_offload(offload_ref_check):
    offload_ref_check()
'''


@needs_sanitizer
def test_the_pytest_route_runs_every_case_under_the_sanitizer_too(pytester) -> None:
    pytester.makepyfile(test_author=_AUTHOR)
    result = pytester.runpytest("-p", "no:cacheprovider", "-q", "-m", "contract", "-k",
                                f"{STREAMS} or {PARITY}")
    result.assert_outcomes(failed=2, skipped=2)  # layer_wise fails; model_level: not offered
    out = "\n".join(result.outlines)
    assert out.count("stream race (read-after-write) on text_encoder.blocks.0.norm1.weight") >= 2
    assert f"at fault: the offloader {__name__}:racy_prefetcher" in out
    assert "stream checking ON (happens-before, hpu streams)" in out  # the matrix's device line


# -- without the sanitizer: the header, the catalogue, naming, words, the party -------------------


def test_the_header_says_whether_stream_checking_is_on() -> None:
    from offload_ref.contracts.report import kit_device_line

    line = kit_device_line()
    if CHECKING:
        assert "stream checking ON (happens-before, hpu streams)" in line, line
    else:
        assert f"STREAM CHECKING OFF: {kit_streams.off_reason()}" in line, line


def test_single_device_turns_stream_checking_off_and_says_why(monkeypatch) -> None:
    from offload_ref.platform import simulated

    monkeypatch.setattr(simulated, "unavailable_reason",
                        lambda: "OFFLOAD_REF_SIM=0 turns it off")
    assert kit_streams.header_text() == (
        "STREAM CHECKING OFF: --single-device (OFFLOAD_REF_SIM=0): host and device are both the "
        "CPU, with no accelerator streams to check")
    monkeypatch.setattr(simulated, "unavailable_reason", lambda: "no C++ compiler")
    assert kit_streams.header_text() == (
        "STREAM CHECKING OFF: the simulated accelerator is unavailable: no C++ compiler")


def test_the_stream_check_is_in_its_own_area_with_a_doc() -> None:
    info = load_catalogue()[STREAMS]
    assert info.section == "S" and AREAS["S"] == "streams"
    assert doc_for("S") == kit_streams.DOC


def test_memory_is_named_by_the_module_path_of_the_tensor_over_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    w = model[1].weight
    assert kit_streams.name_memory([model], w.data_ptr() + 4, 4) == "1.weight"
    bias = model[0].bias
    assert kit_streams.name_memory([model], bias.data_ptr(), 16) == "0.bias"
    assert kit_streams.name_memory([model], 16, 4) is None
    # a storage holding several tensors (a slot): the one whose own bytes cover the range
    slab = torch.zeros(64)
    a, b = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
    a.weight.data, b.weight.data = slab[0:4].view(2, 2), slab[16:20].view(2, 2)
    pipe = nn.ModuleDict({"a": a, "b": b})
    assert kit_streams.name_memory([pipe], slab[16:].data_ptr(), 8) == "b.weight"
    assert kit_streams.name_memory([pipe], slab[40:].data_ptr(), 4) in (
        "the storage of a.weight", "the storage of b.weight")


# the sanitizer's own records (plain dataclasses: importing them loads no extension)
_Access, _Race = simulated.Access, simulated.Race


_READ = _Access(0, "the default stream of hpu:0", "aten::addmm", "mat2", False,
                ("fixtures/flux2.py:40 in forward",))
_COPY = _Access(1, "stream 1 of hpu:0", "copy host to device (non_blocking)", "self", True,
                ("my_engine/offload.py:77 in prefetch", "my_engine/offload.py:90 in pre_hook"))


def test_the_report_names_the_tensor_both_accesses_the_ordering_and_the_party(monkeypatch
                                                                              ) -> None:
    monkeypatch.setattr(kit_streams, "_offloader_files", lambda: {"my_engine/offload.py"})
    monkeypatch.setattr(kit_streams, "_pipeline_files", lambda case: {"fixtures/flux2.py"})
    race = _Race("read-after-write", 0, "transformer.transformer_blocks.1.ff.weight", _READ,
                 _COPY, (), "")
    same = _Race("read-after-write", 0, "transformer.transformer_blocks.1.ff.bias", _READ, _COPY,
                 (), "")
    refill = _Race("write-after-read", 0, "transformer.transformer_blocks.0.ff.weight", _COPY,
                   _READ, (), "")
    again = _Race("read-after-write", 0, "transformer.transformer_blocks.1.ff.bias (the tensor "
                  "a module last computed with in that memory, which held 3 tensors in turn)",
                  _READ, _COPY, (), "")  # the same tensor again, another memory history
    headline_again = _Race("read-after-write", 0, "transformer.transformer_blocks.1.ff.weight "
                           "(the tensor a module last computed with in that memory)", _READ,
                           _COPY, (), "")
    text = kit_streams.race_report([race, same, again, headline_again, refill], None,
                                   "my_engine.offload:factory")
    lines = text.splitlines()
    assert lines[0] == (
        "stream race (read-after-write) on transformer.transformer_blocks.1.ff.weight (hpu:0): "
        "the default stream of hpu:0 read it in aten::addmm (mat2) at fixtures/flux2.py:40 in "
        "forward, while the write by stream 1 of hpu:0 in copy host to device (non_blocking) "
        "(self) at my_engine/offload.py:77 in prefetch was not ordered before it")
    assert "  missing ordering: record an event on the writing stream after the write" in text
    assert ("  at fault: the offloader my_engine.offload:factory: the offloader's code made the "
            "unordered access (my_engine/offload.py:77 in prefetch)") in text
    assert "on a GPU it reads bytes another stream may still be writing" in text
    # one missing ordering between two streams races on many tensors: named once, then counted
    assert lines[-2] == ("  the same race between these two streams on 1 more tensor(s): "
                         "transformer.transformer_blocks.1.ff.bias")
    assert lines[-1].startswith("  also: stream race (write-after-read) on "
                                "transformer.transformer_blocks.0.ff.weight (hpu:0): stream 1 of "
                                "hpu:0 wrote it in copy host to device"), lines[-1]
    # the sanitizer's own advice wins over the kit's generic one
    advised = _Race("use-after-free", 0, "x", _READ, _COPY, ("my_engine/offload.py:99 in park",),
                    "call record_stream(compute) before dropping it")
    text = kit_streams.race_report([advised], None, "o")
    assert "missing ordering: call record_stream(compute) before dropping it" in text
    assert "the memory had been freed at my_engine/offload.py:99 in park" in text


def test_the_pipeline_is_blamed_only_when_both_accesses_are_its_own_code() -> None:
    pipeline, offloader = {"fixtures/flux2.py"}, {"my_engine/offload.py"}
    mine = ("fixtures/flux2.py:12 in forward",)
    assert race_party(mine, mine, offloader, pipeline)[0] == "pipeline"
    assert race_party(mine, _COPY.where, offloader, pipeline)[0] == "offloader"
    # a pipeline frame called from the offloader's hook is the offloader's
    hooked = ("fixtures/flux2.py:12 in forward", "my_engine/offload.py:5 in new_forward")
    assert race_party(mine, hooked, offloader, pipeline)[0] == "offloader"
    # no frames captured: the streams that move weights are the offloader's
    assert race_party((), (), offloader, pipeline)[0] == "offloader"
    assert race_party(mine, ("site/lib.py:3 in copy",), offloader, pipeline)[0] == "offloader"
