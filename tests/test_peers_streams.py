"""diffusers' group offloading with ``use_stream=True`` judged for stream ordering (issue 34, item
5): the peer adapters for its stream variants pass their options through; the kit's sanitizer
catches each stream race reported upstream (diffusers #11981, #12673, #14657, #13502) once the
installed diffusers is patched back to the reported behaviour, naming both accesses, and finds none
of the fixed ones in the installed diffusers as it is; what the installed diffusers still has
(#13502's unordered onload, on a block-level model with nothing around its blocks, and a
use-after-free in backward without ``record_stream``) is shown, with the change that removes it;
and the verdict rules never call a report absent unless the probe sees its bug.  The device error
diffusers' block-level offloading raises on diffusers' own DiT is shown to be diffusers' (a block's
layer called after the block loop), with and without streams."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from offload_ref import peers
from offload_ref.platform import simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

diffusers = pytest.importorskip("diffusers")
GO = "diffusers/hooks/group_offloading.py"
REPORTS = {r.number: r for r in peers.UPSTREAM_REPORTS}


@pytest.fixture(scope="module")
def device() -> torch.device:
    return simulated.device(0)


def _probe(number, offload_type, shape="framed", patches=None, device=None):
    report = REPORTS[number]
    if patches is None:
        patches = (report.restore,)
    return peers._probe_once(report, offload_type, shape, device, patches)


def _streams(race) -> tuple[int, int]:
    return race.current.stream, race.previous.stream


def _in(access, path: str, function: str) -> bool:
    return bool(access.where) and path in access.where[0] and f"in {function}" in access.where[0]


def _check_reuse(found, copied_in: str, freed_in: str | None) -> None:
    """Use-after-free races, each naming the compute stream's read and the transfer stream's
    later write into the memory; the copies among those writes are made by diffusers'
    ``copied_in``, and the memory was freed by ``freed_in`` (None: no frame of the free is
    captured, as when autograd's device thread frees it)."""
    assert found and {r.kind for r in found} == {"use-after-free"}
    for race in found:
        assert race.current.stream > 0 and race.current.write
        assert race.previous.stream == 0 and not race.previous.write
    copies = [r for r in found if r.current.op.startswith("copy host to device")]
    assert copies and all(_in(r.current, GO, copied_in) for r in copies)
    if freed_in is not None:
        freed = [r for r in found if r.freed_at]
        assert freed and all(GO in r.freed_at[0] and f"in {freed_in}" in r.freed_at[0]
                             for r in freed)


# -- the adapters of the stream variants ----------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("diffusers_group_offload_block_stream",
     {"offload_type": "block_level", "use_stream": True, "record_stream": False,
      "low_cpu_mem_usage": False, "num_blocks_per_group": 1}),
    ("diffusers_group_offload_block_stream_record",
     {"offload_type": "block_level", "use_stream": True, "record_stream": True,
      "low_cpu_mem_usage": False, "num_blocks_per_group": 1}),
    ("diffusers_group_offload_block_stream_low_cpu_mem",
     {"offload_type": "block_level", "use_stream": True, "record_stream": False,
      "low_cpu_mem_usage": True, "num_blocks_per_group": 1}),
    ("diffusers_group_offload_leaf_stream",
     {"offload_type": "leaf_level", "use_stream": True, "record_stream": False,
      "low_cpu_mem_usage": False}),
    ("diffusers_group_offload_leaf_stream_record",
     {"offload_type": "leaf_level", "use_stream": True, "record_stream": True,
      "low_cpu_mem_usage": False}),
    ("diffusers_group_offload_leaf_stream_low_cpu_mem",
     {"offload_type": "leaf_level", "use_stream": True, "record_stream": False,
      "low_cpu_mem_usage": True}),
    ("diffusers_group_offload_block",
     {"offload_type": "block_level", "use_stream": False, "num_blocks_per_group": 1}),
])
def test_each_stream_variant_calls_diffusers_with_its_options(
        monkeypatch, device, name, expected) -> None:
    import diffusers.hooks

    calls = []
    monkeypatch.setattr(diffusers.hooks, "apply_group_offloading",
                        lambda module, **options: calls.append((module, options)))
    assert name in peers.PEERS and peers.PEERS[name] == f"offload_ref.peers:{name}"
    adapter = getattr(peers, name)(device, "layer_wise")
    dit, encoder = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    adapter.install(SimpleNamespace(), [dit, encoder])
    assert [m for m, _ in calls] == [dit, encoder]
    for _, options in calls:
        assert options == {"onload_device": device, "offload_device": torch.device("cpu"),
                           **expected}


# -- the upstream reports: caught once put back, absent as installed ------------------------------


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_11981_a_prefetched_last_group_computed_without_a_wait_is_a_race(
        device, offload_type) -> None:
    installed, _ = _probe(11981, offload_type, patches=(), device=device)
    assert installed == [], "\n".join(map(str, installed))
    found, exact = _probe(11981, offload_type, device=device)
    assert exact  # program order: the values are right; the sanitizer is what sees the bug
    assert found and {r.kind for r in found} == {"read-after-write"}
    last = "norm_out" if offload_type == "leaf_level" else "blocks.2"
    assert {r.tensor.rsplit(".", 1)[0] for r in found} <= {last, f"{last}.ff", f"{last}.norm"}
    assert {r.tensor.rsplit(".", 1)[1] for r in found} == {"weight", "bias"}
    for race in found:  # the compute stream's read, the transfer stream's un-waited copy
        assert race.current.stream == 0 and not race.current.write
        assert race.current.op in ("aten::addmm", "aten::native_layer_norm")
        assert race.previous.stream > 0 and race.previous.write
        assert race.previous.op.startswith("copy host to device (non_blocking")
        assert _in(race.previous, GO, "_transfer_tensor_to_device")
        assert race.tensor in str(race) and race.previous.op in str(race)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_12673_record_stream_on_the_transfer_stream_frees_memory_the_compute_stream_reads(
        device, offload_type) -> None:
    installed, _ = _probe(12673, offload_type, patches=(), device=device)
    assert installed == [], "\n".join(map(str, installed))
    found, _ = _probe(12673, offload_type, device=device)
    _check_reuse(found, "_transfer_tensor_to_device", "_offload_to_memory")


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_14657_the_disk_path_freeing_before_the_compute_stream_finished_is_a_race(
        device, offload_type) -> None:
    installed, _ = _probe(14657, offload_type, patches=(), device=device)
    assert installed == [], "\n".join(map(str, installed))
    found, _ = _probe(14657, offload_type, device=device)
    _check_reuse(found, "_onload_from_disk", "_offload_to_disk")


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_13502_onloads_whose_copies_nothing_orders_race_and_its_wait_stream_orders_them(
        device, offload_type) -> None:
    installed, _ = _probe(13502, offload_type, patches=(), device=device)
    assert installed == [], "\n".join(map(str, installed))
    report = REPORTS[13502]
    found, _ = _probe(13502, offload_type, device=device)
    assert found and {r.kind for r in found} == {"read-after-write"}
    for race in found:  # the addmm/layer_norm on the compute stream, the copy on the transfer one
        assert _streams(race)[0] == 0 and _streams(race)[1] > 0
        assert race.previous.op.startswith("copy host to device (non_blocking")
    repaired, exact = _probe(13502, offload_type, patches=(report.restore, report.repair),
                             device=device)
    assert repaired == [] and exact, "\n".join(map(str, repaired))


def test_13502_is_still_in_the_installed_diffusers_on_a_model_with_nothing_around_its_blocks(
        device) -> None:
    """At block level a model whose top level holds only its block list gets no lazy-prefetch
    hook: every block onloads itself non_blocking on the transfer stream and is computed at once.
    #13502's wait_stream after each onload, applied to the installed diffusers, orders it."""
    report = REPORTS[13502]
    found, _ = _probe(13502, "block_level", "blocks_only", patches=(), device=device)
    assert found and {r.kind for r in found} == {"read-after-write"}
    assert {r.tensor for r in found} <= {f"blocks.{i}.{p}" for i in range(3)
                                         for p in ("ff.weight", "ff.bias", "norm.weight",
                                                   "norm.bias")}
    for race in found:
        assert race.current.stream == 0 and race.previous.stream > 0
        assert _in(race.previous, GO, "_transfer_tensor_to_device")
    fixed, _ = _probe(13502, "block_level", "blocks_only", patches=(report.repair,),
                      device=device)
    assert fixed == [], "\n".join(map(str, fixed))
    leaf, _ = _probe(13502, "leaf_level", "blocks_only", patches=(), device=device)
    assert leaf == [], "\n".join(map(str, leaf))  # leaf level traces the layers and waits


def test_13502_is_still_in_the_installed_diffusers_on_a_module_whose_tensors_are_its_own(
        device) -> None:
    """At leaf level the tensors of the module given to apply_group_offloading itself (no layer
    under it: soulx_singer's mel front end) form a group nothing traces or waits for."""
    report = REPORTS[13502]
    found, _ = _probe(13502, "leaf_level", "own_tensors", patches=(), device=device)
    assert found and {r.kind for r in found} == {"read-after-write"}
    assert {r.tensor for r in found} == {"window", "scale"}
    assert {r.current.op for r in found} == {"aten::mul", "aten::mm"}
    for race in found:
        assert race.current.stream == 0 and race.previous.stream > 0
        assert _in(race.previous, GO, "_transfer_tensor_to_device")
    fixed, _ = _probe(13502, "leaf_level", "own_tensors", patches=(report.repair,),
                      device=device)
    assert fixed == [], "\n".join(map(str, fixed))


def test_backward_without_record_stream_frees_a_saved_weight_the_compute_stream_read(
        device) -> None:
    """Found by the probes, not one of the upstream reports: a weight autograd saved outlives the
    leaf group's offload, is freed after backward read it, and its memory is handed to the next
    onload on the transfer stream; with record_stream=True the allocator knows, and it is not."""
    report = next(r for r in peers.UPSTREAM_REPORTS if r.number is None)
    assert report.backward
    found, exact = peers._probe_once(report, "leaf_level", "linear", device, ())
    assert exact
    _check_reuse(found, "_transfer_tensor_to_device", None)
    assert {r.previous.op for r in found} == {"aten::mm"}  # backward's read of the saved weight
    recorded = peers.UpstreamReport(**{**report.__dict__, "options": (("record_stream", True),)})
    found, _ = peers._probe_once(recorded, "leaf_level", "linear", device, ())
    assert found == [], "\n".join(map(str, found))


def test_putting_a_report_back_is_undone_after_the_probe(device) -> None:
    from diffusers.hooks import group_offloading as g

    def state():
        return (g.GroupOffloadingHook.pre_forward, g.ModuleGroup._transfer_tensor_to_device,
                g.ModuleGroup._offload_to_disk, g.ModuleGroup.onload_,
                torch.hpu.Stream.synchronize, "synchronize" in torch.hpu.Stream.__dict__,
                simulated.check_streams())

    before = state()
    for report in peers.UPSTREAM_REPORTS:
        if report.restore is not None:
            patches = (report.restore,) + ((report.repair,) if report.repair else ())
            peers._probe_once(report, "leaf_level", "framed", device, patches)
    assert state() == before


# -- the verdicts, and the page section ----------------------------------------------------------


def _race(kind: str) -> simulated.Race:
    access = simulated.Access(0, "the default stream of hpu:0", "aten::addmm", "self", False, ())
    return simulated.Race(kind, 0, "w", access, access, (), "")


@pytest.mark.parametrize("installed, restored, verdict", [
    ([], [_race("read-after-write")], "absent"),
    ([], [], "not established"),  # the probe did not see the bug: never "absent"
    ([], [_race("use-after-free")], "not established"),  # another kind is not this report's
    ([_race("read-after-write")], [_race("read-after-write")], "present"),
    ([_race("use-after-free")], [_race("read-after-write")], "not established"),
    ([], None, "none found"),
    ([_race("read-after-write")], None, "present"),
])
def test_a_report_is_absent_only_when_the_probe_sees_its_bug(installed, restored, verdict) -> None:
    finding = peers.UpstreamFinding(REPORTS[11981], "leaf_level", "framed", installed, restored,
                                    None, True)
    assert finding.verdict == verdict


def test_the_page_section_names_the_verdicts_and_both_accesses(device) -> None:
    findings = peers.probe_upstream_reports(
        [REPORTS[11981], REPORTS[13502]], offload_types=("block_level",))
    lines = peers.upstream_reports_markdown(findings)
    text = "\n".join(lines)
    assert lines[0].startswith("## diffusers' upstream stream reports")
    rows = [line for line in lines if line.startswith("| [diffusers#")]
    assert len(rows) == 4  # 11981 on framed; 13502 on framed, blocks_only and own_tensors
    assert rows[0].endswith("| **absent** |") and rows[2].endswith("| **present** |")
    assert rows[3].endswith("| **not established** |")  # block level streams nothing there
    assert ("read-after-write on blocks.2.ff.bias: the compute (default) stream read it in "
            "aten::addmm (self)") in rows[0]
    assert "the transfer stream wrote it in copy host to device" in rows[0]
    assert f"at {GO}:" in rows[0] and "/site-packages/" not in text
    assert f"diffusers {diffusers.__version__} still has: #13502 (block_level on *blocks_only*)" \
        in text and "is free of: #11981;" in text
    assert peers.upstream_reports_markdown("no diffusers") == [
        lines[0], "", "Not probed: no diffusers.", ""]


def test_the_peers_page_puts_the_section_below_the_verdict_table() -> None:
    from offload_ref.contracts import conformance
    from offload_ref.contracts.report import header

    page = conformance.render_markdown([], header=header(device="hpu:0"), command="c",
                                       pipelines=["p"], notes=["## notes", "", "text"])
    assert "stream checking" in page.splitlines()[4].lower()
    table = page.index("| offloader | strategies |")
    assert table < page.index("## notes") < page.index("## Measured beside the verdicts")


# -- the device error on diffusers' DiT is diffusers' -------------------------------------------


@pytest.mark.parametrize("use_stream", [False, True], ids=["no_stream", "stream"])
def test_block_level_on_diffusers_dit_fails_where_the_dit_calls_block_0_after_its_loop(
        device, use_stream) -> None:
    """DiTTransformer2DModel.forward calls ``transformer_blocks[0].norm1.emb`` again after its
    block loop, when block-level group offloading has moved block 0 back to the host: the
    same-device error the peers table shows, with streams or without, raised from that line."""
    import traceback

    from diffusers.hooks import apply_group_offloading

    from offload_ref.fixtures.diffusers_dit import build_dit

    dit = build_dit().transformer
    resident = copy.deepcopy(dit).to(device)
    inputs = {"hidden_states": torch.randn(1, 4, 8, 8), "timestep": torch.tensor([10]),
              "class_labels": torch.tensor([1])}
    with torch.no_grad():
        resident(**{k: v.to(device) for k, v in inputs.items()})  # un-offloaded: it runs
        apply_group_offloading(dit, onload_device=device, offload_type="block_level",
                               num_blocks_per_group=1, use_stream=use_stream)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"
                           ) as info:
            dit(**{k: v.to(device) for k, v in inputs.items()})
    frames = traceback.extract_tb(info.value.__traceback__)
    dit_frames = [f for f in frames if f.filename.endswith("dit_transformer_2d.py")]
    assert dit_frames and "transformer_blocks[0].norm1.emb" in dit_frames[-1].line
