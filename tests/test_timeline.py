"""The modeled device timeline (Note [Modeled timeline] in offload_ref/timeline.py) and
``offload-ref bench --model``."""

from __future__ import annotations

import json

import pytest
import torch

from offload_ref.platform import simulated
from offload_ref.timeline import MODELS, DeviceModel, Op, model_named, recording, replay

needs_sim = pytest.mark.skipif(not simulated.available(),
                               reason=f"simulated accelerator: {simulated.unavailable_reason()}")

#: 1 GB/s and 1 TFLOP/s, no launch cost: durations read as bytes / 1e9 and FLOPs / 1e12
UNIT = DeviceModel("unit", h2d_gbps=1.0, d2h_gbps=1.0, memory_gbps=1e6, tflops_fp32=1.0,
                   tflops_16=2.0, launch_us=0.0, kernel_min_us=0.0)
COPY, COMPUTE = 1 << 48 | 7, 1 << 48  # two streams of device 1 (keys as the sanitizer makes them)


def _copy(seq: int, nbytes: int = 1000) -> Op:
    return Op("op", COPY, seq, "copy host to device", "h2d", nbytes, 0.0, 4)


def _mm(seq: int, flops: float = 2e6, size: int = 4) -> Op:
    return Op("op", COMPUTE, seq, "aten::mm", "", 0, flops, size)


def test_a_compute_that_waits_for_its_copy_starts_when_the_copy_ends() -> None:
    t = replay([_copy(1), Op("wait", COMPUTE, clock={COPY: 1}), _mm(1)], UNIT)
    assert t.total_s == pytest.approx(1e-6 + 2e-6)
    assert t.stall_s == pytest.approx(1e-6)
    assert t.bound_s == pytest.approx(2e-6) and t.ratio == pytest.approx(1.5)


def test_work_on_two_streams_with_no_wait_overlaps() -> None:
    t = replay([_copy(1), _mm(1)], UNIT)
    assert t.total_s == pytest.approx(2e-6) and t.stall_s == 0
    assert t.ratio == pytest.approx(1.0)


def test_ops_of_one_stream_and_of_one_engine_run_one_at_a_time() -> None:
    assert replay([_mm(1), _mm(2)], UNIT).total_s == pytest.approx(4e-6)
    other = 1 << 48 | 9
    two = [_mm(1), Op("op", other, 1, "aten::mm", "", 0, 2e6, 4)]
    assert replay(two, UNIT).total_s == pytest.approx(4e-6)  # one compute engine


def test_the_host_waits_and_launches_after_its_wait() -> None:
    model = DeviceModel("launch", h2d_gbps=1.0, d2h_gbps=1.0, memory_gbps=1e6, tflops_fp32=1.0,
                        tflops_16=2.0, launch_us=1.0, kernel_min_us=0.0)
    ops = [_copy(1), Op("host_wait", 0, clock={COPY: 1}), _mm(1)]
    t = replay(ops, model)
    # launch 1 us, copy 1 us, the host waits until 2 us, launches at 3 us, computes 2 us
    assert t.total_s == pytest.approx(5e-6)
    assert t.host_wait_s == pytest.approx(1e-6) and t.host_waits == 1


def test_sixteen_bit_operands_use_the_sixteen_bit_rate_and_a_pageable_copy_is_slower() -> None:
    assert replay([_mm(1, size=2)], UNIT).compute_s == pytest.approx(1e-6)
    slow = Op("op", COPY, 1, "copy", "h2d_pageable", 1000, 0.0, 4)
    assert replay([slow], UNIT).h2d_s == pytest.approx(1e-6 / UNIT.pageable_fraction)


def test_models_name_their_sources_and_custom_ones_parse() -> None:
    for model in MODELS.values():
        assert model.sources and all(model.sources)
    custom = model_named("base=h200,h2d_gbps=12.5")
    assert custom.h2d_gbps == 12.5 and custom.tflops_fp32 == MODELS["h200"].tflops_fp32
    for bad, words in (("nope", "no model of that name"), ("h2d_gbps", "no model"),
                       ("base=x,h2d_gbps=1", "base= names"), ("speed=3", "unknown field"),
                       ("h2d_gbps=fast", "not a number"), ("h2d_gbps=-1", "positive")):
        with pytest.raises(ValueError, match=words):
            model_named(bad)


@needs_sim
def test_the_recording_holds_ops_waits_and_host_waits_with_flops_and_bytes() -> None:
    device = simulated.device(0)
    w = torch.randn(64, 32).pin_memory()
    x = torch.randn(16, 64, device=device)
    copy = torch.Stream(device)
    before = simulated.check_streams()
    with recording() as ops:
        with copy:
            wd = w.to(device, non_blocking=True)
        torch.accelerator.current_stream(device).wait_event(copy.record_event())
        (x @ wd).sum()
        torch.accelerator.synchronize(device)
    assert simulated.check_streams() == before
    kinds = [(o.kind, o.copy) for o in ops]
    assert kinds[0] == ("op", "h2d") and ops[0].bytes == 64 * 32 * 4
    assert ("wait", "") in kinds and kinds[-1] == ("host_wait", "")
    (mm,) = [o for o in ops if o.name == "aten::mm"]
    assert mm.flops == 2 * 16 * 64 * 32 and mm.element_size == 4
    wait = next(o for o in ops if o.kind == "wait")
    assert wait.clock.get(ops[0].stream) == ops[0].seq  # it waits for the copy


@needs_sim
def test_bench_model_is_the_same_every_run_and_prefetch_reaches_the_bound_when_compute_heavy(
        ) -> None:
    from offload_ref.bench_model import run_model_bench

    kwargs = dict(hidden=128, blocks=4, tokens=8192)
    rows = ("resident", "offload_ref_layerwise", "offload_ref_layerwise_no_prefetch",
            "diffusers_group_offload_block", "accelerate_cpu_offload")
    first = run_model_bench(MODELS["h100-pcie"], rows=rows, **kwargs)
    second = run_model_bench(MODELS["h100-pcie"], rows=rows, **kwargs)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    r = first["rows"]
    assert first["compute_over_copy_per_block"] >= 1.2, first
    assert all(row["bitwise_equal_to_resident"] for row in r.values()), r
    assert r["offload_ref_layerwise"]["ratio"] <= 1.05, r["offload_ref_layerwise"]
    # the same check tells a serial offloader apart: without prefetch the copies are exposed
    assert r["offload_ref_layerwise_no_prefetch"]["ratio"] > 1.05
    assert r["offload_ref_layerwise"]["total_s"] < r["offload_ref_layerwise_no_prefetch"]["total_s"]
    assert r["offload_ref_layerwise"]["h2d_bytes"] > 0
    for peer in ("diffusers_group_offload_block", "accelerate_cpu_offload"):
        if peer in r:  # blocking copies: nothing overlaps, the serial sum is a floor
            assert r[peer]["total_s"] >= r[peer]["serial_s"], r[peer]
            assert r[peer]["h2d_bytes"] >= r["offload_ref_layerwise"]["h2d_bytes"]
            # ... and the rest is the device idle while the host launches after each wait
            assert r[peer]["total_s"] == pytest.approx(r[peer]["serial_s"] + r[peer]["idle_s"])
            assert r[peer]["idle_s"] >= (r[peer]["host_waits"] - 1) * 4e-6, r[peer]
    # overlap: prefetch hides copies, so the step is well under serial + idle
    ours = r["offload_ref_layerwise"]
    assert ours["total_s"] < 0.95 * (ours["serial_s"] + ours["idle_s"]), ours


def test_idle_is_the_time_no_engine_is_busy() -> None:
    model = DeviceModel("launch", h2d_gbps=1.0, d2h_gbps=1.0, memory_gbps=1e6, tflops_fp32=1.0,
                        tflops_16=2.0, launch_us=1.0, kernel_min_us=0.0)
    # launch 1 us, copy 1-2 us; the host waits, launches the mm at 3 us, mm 3-5 us
    t = replay([_copy(1), Op("host_wait", 0, clock={COPY: 1}), _mm(1)], model)
    assert t.idle_s == pytest.approx(2e-6)  # 0-1 us and 2-3 us: the two launches
    assert t.total_s == pytest.approx(t.compute_s + t.h2d_s + t.idle_s)  # nothing overlaps
    # overlapped work: the union counts once, so total < serial + idle
    t = replay([_copy(1), _mm(1)], UNIT)
    assert t.idle_s == 0 and t.total_s < t.compute_s + t.h2d_s


@needs_sim
def test_the_cli_refuses_an_unknown_model_and_prints_the_table(capsys, monkeypatch) -> None:
    from offload_ref import bench_model
    from offload_ref.cli import main

    # the residency table's own sizes (8 blocks of 8 MiB) cost seconds: its wiring is tested
    # here, its figures by the test of residency against deeper prefetch below
    monkeypatch.setattr(bench_model, "RESIDENCY_SIZES", {"hidden": 32, "blocks": 6, "tokens": 64})
    assert main(["bench", "--model", "h100"]) == 2
    assert "no model of that name" in capsys.readouterr().err
    assert main(["bench", "--model", "h200", "--peers"]) == 2
    assert "separate tables" in capsys.readouterr().err
    small = ["bench", "--model", "rtx-4090", "--hidden", "32", "--blocks", "2", "--tokens", "64"]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "offload_ref_layerwise" in out and "x bound" in out
    assert "do not overlap" in out  # the simulated streams are not timed
    assert "At equal device bytes" in out and "head/depth" in out
    assert main([*small, "--no-residency", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "residency" not in r and "offload_ref_layerwise" in r["rows"], sorted(r)


@needs_sim
def test_calibrate_measures_the_device_and_sets_modeled_beside_measured(capsys) -> None:
    from offload_ref.cli import main

    assert main(["bench", "--model", "h100-pcie", "--calibrate"]) == 2
    assert "--calibrate measures a real device" in capsys.readouterr().err
    assert main(["bench", "--model", "h100-pcie", "--calibrate", "--device", "cpu"]) == 2
    capsys.readouterr()
    rc = main(["bench", "--model", "h100-pcie", "--calibrate", "--device", "hpu:0", "--hidden",
               "32", "--blocks", "2", "--tokens", "64", "--repeats", "1", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    model = r["model"]
    assert model["name"] == "calibrated on hpu:0" and "measured on hpu:0" in model["sources"][0]
    assert all(model[k] > 0 for k in ("h2d_gbps", "d2h_gbps", "memory_gbps", "tflops_fp32"))
    assert r["named"]["model"]["name"] == "h100-pcie"
    assert set(r["measured"]) == set(r["rows"]) == set(r["named"]["rows"])
    assert all(m["measured_s"] > 0 and m["bitwise_equal_to_resident"]
               for m in r["measured"].values()), r["measured"]
    assert "streams run one after another" in r["note"]  # the simulated device is serial


@needs_sim
def test_at_equal_device_bytes_residency_beats_deeper_prefetch_when_copies_dominate() -> None:
    from offload_ref.bench_model import run_residency_bench

    kwargs = dict(hidden=256, blocks=6, tokens=512, extra=(1, 2))
    first = run_residency_bench(MODELS["h100-pcie"], **kwargs)
    second = run_residency_bench(MODELS["h100-pcie"], **kwargs)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert first["compute_over_copy_per_block"] < 1, first  # copy-bound: the case in question
    r = first["rows"]
    assert all(row["bitwise_equal_to_resident"] for row in r.values()), r
    for pair in first["pairs"]:
        # Equal device bytes: a head block is one slot's worth (every block is the same size).
        assert pair["head_device_bytes"] == pair["depth_device_bytes"], pair
        assert pair["strided_device_bytes"] == pair["depth_device_bytes"], pair
        assert pair["head_over_depth"] < 0.95, pair
        # Spread through the ring, resident blocks let the copies run beside their compute.
        assert pair["strided_step_s"] <= pair["head_step_s"], pair
    # A deeper ring streams every block: it cannot beat the bandwidth bound of depth 1.
    one = r["offload_ref_layerwise"]
    for e in (1, 2):
        deep = r[f"offload_ref_layerwise_depth{e + 1}"]
        assert deep["h2d_bytes"] == one["h2d_bytes"]
        assert deep["peak_device_bytes"] > one["peak_device_bytes"]
        assert deep["total_s"] >= one["bound_s"]
    # Prefetch never costs more than it saves.
    assert one["total_s"] <= r["offload_ref_layerwise_no_prefetch"]["total_s"]


@needs_sim
@pytest.mark.parametrize("model,hidden,tokens", [("h100-pcie", 512, 2560), ("h200", 256, 4096),
                                                  ("rtx-4090", 256, 4096)])
def test_layerwise_stays_within_five_percent_of_the_bound_when_compute_exceeds_the_copy(
        model, hidden, tokens) -> None:
    from offload_ref.bench_model import run_model_bench

    rows = ("resident", "offload_ref_layerwise", "offload_ref_layerwise_no_prefetch")
    out = run_model_bench(MODELS[model], hidden=hidden, blocks=8, tokens=tokens, rows=rows)
    assert out["compute_over_copy_per_block"] >= 1.2, out
    r = out["rows"]
    assert r["offload_ref_layerwise"]["ratio"] <= 1.05, r["offload_ref_layerwise"]
    assert r["offload_ref_layerwise"]["total_s"] <= r["offload_ref_layerwise_no_prefetch"][
        "total_s"]
