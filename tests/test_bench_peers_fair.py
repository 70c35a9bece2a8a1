"""``offload-ref bench --peers`` is a fair race (Note [Fair peers] in offload_ref/bench.py):
every offloader copies to the bench's device, each row's bytes per forward are counted (not
assumed), an offloader that copies nothing shows 0 and is never put in a ratio, and every output
is checked bitwise against the resident run.  Small sizes and one sample: these tests check what
the bench reports, not how fast anything is."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

from offload_ref import bench_peers
from offload_ref.bench_peers import (PEER_LAYERWISE, PEER_MODEL_LEVEL, CopyCounter, PeersDeviceError,
                                     format_peers, peers_device, run_peers)
from offload_ref.cli import main
from offload_ref.contracts.case import move_to_device
from offload_ref.platform import simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"offload-ref's simulated accelerator is not available: "
           f"{simulated.unavailable_reason()}")

pytest.importorskip("diffusers.hooks", reason="diffusers not installed")
pytest.importorskip("accelerate", reason="accelerate not installed")

SMALL: dict[str, Any] = {"device": "hpu:0", "blocks": 6, "hidden": 32, "heavy_blocks": 2,
                         "tokens": 4, "steps": 1, "repeats": 1}


class ResidentNoCopy:
    """An 'offloader' that puts the whole pipeline on the device at enable() and copies nothing
    per forward: the bench must show it at 0 bytes and put it in no ratio."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def enable(self, pipeline: Any) -> None:
        move_to_device(pipeline, self.device)

    def disable(self) -> None:
        pass


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_peers(**SMALL, extra={"no_copy_resident": ResidentNoCopy})


def _offloaders(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(model, name, row) for model, entry in result["models"].items()
            for name, row in entry["rows"].items()
            if name not in ("resident", "no_copy_resident")]


def test_every_offloader_ran_and_copied_to_the_device(result: dict[str, Any]) -> None:
    rows = {model: set(entry["rows"]) for model, entry in result["models"].items()}
    layerwise = {"resident", "offload_ref_layerwise", "no_copy_resident", *PEER_LAYERWISE}
    assert rows == {"many_blocks": layerwise, "heavy_step": layerwise,
                    "heavy_generation": {"resident", *PEER_MODEL_LEVEL}}, result["skipped"]
    assert result["skipped"] == {}
    for model, name, row in _offloaders(result):
        assert row["h2d_bytes"] > 0, (model, name, row)
        assert row["copy_ops"], (model, name, row)  # counted from the ops it ran
        assert row["bitwise_equal_to_resident"] is True, (model, name)
    # device -> host is counted too: accelerate's hook offloads with module.to("cpu")
    gen = result["models"]["heavy_generation"]["rows"]
    assert gen["accelerate_cpu_offload_with_hook"]["d2h_bytes"] > 0
    assert gen["offload_ref_model_level"]["d2h_bytes"] == 0


def test_offload_refs_counted_bytes_are_its_backends_own(result: dict[str, Any]) -> None:
    for model, ours in (("many_blocks", "offload_ref_layerwise"),
                        ("heavy_step", "offload_ref_layerwise"),
                        ("heavy_generation", "offload_ref_model_level")):
        row = result["models"][model]["rows"][ours]
        assert row["h2d_bytes"] == row["backend_h2d_bytes"] > 0, (model, row)
        # a peer keeps no such count: its row has none rather than a made-up 0
        assert all("backend_h2d_bytes" not in r for n, r in
                   result["models"][model]["rows"].items() if n != ours), model


def test_an_offloader_that_copies_nothing_shows_zero_and_gets_no_ratio(
        result: dict[str, Any]) -> None:
    for model in ("many_blocks", "heavy_step"):
        entry = result["models"][model]
        row = entry["rows"]["no_copy_resident"]
        assert (row["h2d_bytes"], row["d2h_bytes"]) == (0, 0)
        assert row["bitwise_equal_to_resident"] is True
        for ratios in entry["ratios"].values():
            assert isinstance(ratios["no_copy_resident"], str)
            assert "no_copy_resident copied nothing host -> device" in ratios["no_copy_resident"]
    text = format_peers(result)
    assert "offload_ref_layerwise / no_copy_resident, µs per block over resident: no ratio: " \
           "no_copy_resident copied nothing host -> device" in text


def test_the_json_has_the_fields(result: dict[str, Any]) -> None:
    loaded = json.loads(json.dumps(result))
    machine = loaded["machine"]
    for key in ("date_utc", "cpu", "cpus", "torch", "python", "torch_threads", "commit",
                "device", "device_name", "offload_ref_platform", "load_average_start",
                "load_average_end", "stream_checking"):
        assert key in machine, key
    assert machine["device"] == "hpu:0"
    assert machine["offload_ref_platform"] == "AcceleratorPlatform"
    for entry in loaded["models"].values():
        for row in entry["rows"].values():
            for key in ("h2d_bytes", "d2h_bytes", "h2d_bytes_counted", "d2h_bytes_counted",
                        "copy_ops", "step_s", "step_thread_cpu_s", "step_process_cpu_s",
                        "x_resident", "x_resident_thread_cpu", "per_block_overhead_us",
                        "per_block_overhead_thread_cpu_us", "per_block_overhead_process_cpu_us",
                        "bitwise_equal_to_resident", "blocks"):
                assert key in row, key
        assert set(entry["ratios"]) == {"per_block_overhead_thread_cpu",
                                        "per_block_overhead_wall", "step_thread_cpu"}


def test_copy_counter_counts_bytes_between_devices_only() -> None:
    device = peers_device("hpu:0")
    host = torch.arange(16, dtype=torch.float32)
    for mode in (torch.inference_mode, torch.no_grad):  # Tensor.to is seen whole under one
        with mode(), CopyCounter() as counter:
            on_device = host.to(device)  # 64 B host -> device
            back = on_device.cpu()  # 64 B device -> host
            torch.empty(8, dtype=torch.float64, device=device).copy_(host[:8])  # 64 B, dtype
            host.clone().copy_(on_device)  # 64 B device -> host
            on_device.to(device)  # same device: nothing moved
            host.to("meta")  # no data
            host.to(torch.float64)  # host to host
        assert (counter.h2d, counter.d2h, counter.d2d) == (128, 128, 0), mode
        assert torch.equal(back, host)


def test_the_host_is_refused_as_the_peers_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PeersDeviceError, match="the CPU is the host, so no offloader would copy"):
        peers_device("cpu")
    assert main(["bench", "--peers", "--device", "cpu"]) == 2
    assert "use hpu:0 (offload-ref's simulated accelerator) or cuda" in capsys.readouterr().err


def test_cli_peers_json(monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    small = {k: v for k, v in SMALL.items() if k not in ("device", "repeats")}
    monkeypatch.setattr(bench_peers, "run_peers", functools.partial(run_peers, **small))
    assert main(["bench", "--peers", "--device", "hpu:0", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    peers = out["peers"]
    assert peers["machine"]["device"] == "hpu:0" and peers["repeats"] == 1
    for entry in peers["models"].values():
        for name, row in entry["rows"].items():
            assert (row["h2d_bytes"] > 0) is (name != "resident"), name


def test_the_old_setup_onloading_to_the_host_copies_nothing() -> None:
    """What the old ``--peers`` timed: diffusers' group offloading with onload = offload = cpu
    computes on the host storage and moves no byte between devices; onloading to the device,
    the same call moves every block's weights there."""
    from diffusers.hooks import apply_group_offloading

    from offload_ref.fixtures.many_blocks import build_pipeline, make_input

    device = peers_device("hpu:0")
    x = make_input(0)
    moved = {}
    for onload in (torch.device("cpu"), device):
        pipeline = build_pipeline(0, 4)
        apply_group_offloading(pipeline.transformer, onload_device=onload,
                               offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1)
        inputs = x.to(onload)
        with torch.inference_mode():
            pipeline.transformer(inputs)
            with CopyCounter() as counter:
                pipeline.transformer(inputs)
        moved[onload.type] = counter.h2d
    weights = sum(p.numel() * p.element_size()
                  for p in build_pipeline(0, 4).transformer.parameters())
    assert moved == {"cpu": 0, "hpu": weights}
