"""``offload-ref bench``'s enable cost: its baselines (a warm memcpy, the issue's figure, a copy
into fresh memory, and the floor of Note [Enable floor]) per strategy, in the JSON fields and in
the table."""

from __future__ import annotations

from offload_ref.bench import _enable_cost, format_table
from offload_ref.fixtures.heavy import HeavyConfig, build_pipeline
from offload_ref.platform import CpuPlatform


def test_enable_cost_reports_both_baselines() -> None:
    pipeline = build_pipeline(0, HeavyConfig(hidden=64, blocks=2))
    with CpuPlatform() as platform:
        cost = _enable_cost(pipeline, platform, repeats=2)
    assert set(cost) == {"model_level", "layer_wise"}
    for entry in cost.values():
        assert entry["host_bytes"] > 0
        for key in ("enable_s", "memcpy_s", "fresh_copy_s", "floor_s"):
            assert entry[key] > 0
        assert entry["ratio"] == entry["enable_s"] / entry["memcpy_s"]
        assert entry["fresh_copy_ratio"] == entry["enable_s"] / entry["fresh_copy_s"]
        assert entry["floor_ratio"] == entry["floor_s"] / entry["memcpy_s"]
        assert entry["over_floor"] == entry["enable_s"] / entry["floor_s"]


def test_table_prints_both_ratios() -> None:
    enable = {"model_level": {"enable_s": 0.03, "host_bytes": 64 << 20, "memcpy_s": 0.01,
                              "ratio": 3.0, "fresh_copy_s": 0.06, "fresh_copy_ratio": 0.5,
                              "floor_s": 0.02, "floor_ratio": 2.0, "over_floor": 1.5}}
    layerwise = {"step_s": 0.01, "generation_s": 0.1, "h2d_bytes_per_generation": 0,
                 "peak_device_weight_bytes": 0, "copy_only_step_s": 0.01, "copy_gbps": 1.0,
                 "overlap_ratio": 1.0, "serial_ratio": 1.0, "exposed_stall_per_block_s": 0.0,
                 "concurrent_bound_s": 0.01, "overlap_vs_concurrent": 1.0,
                 "serial_vs_concurrent": 1.0,
                 "per_block_overhead_us": 1.0, "per_block_overhead_cpu_us": 1.0,
                 "per_block_floor_us": 0.5, "per_block_floor_cpu_us": 0.25,
                 "per_block_overhead_cpu_platform_us": 1.0,
                 "per_block_overhead_cpu_platform_cpu_us": 1.0}
    results = {
        "machine": {"platform": "cpu", "cpus": 2, "torch_threads": 1,
                    "parallel_speedup_2_threads": 1.0},
        "config": {"hidden": 512, "blocks": 8, "block_bytes": 8 << 20, "tokens": 32,
                   "steps": 4, "repeats": 7},
        "resident": {"step_s": 0.01, "generation_s": 0.1, "h2d_bytes_per_generation": 0},
        "model_level": {"generation_s": 0.1, "h2d_bytes_per_generation": 0,
                        "peak_device_weight_bytes": 0},
        "layerwise": layerwise, "layerwise_serial": dict(layerwise),
        "enable": enable,
    }
    table = format_table(results)
    assert "1.0 µs thread CPU (floor, Note [Per-block floor]: 0.5 / 0.2)" in table
    assert "do not overlap" not in table
    results["machine"]["streams_overlap"] = False
    assert "streams do not overlap" in format_table(results)
    results["machine"]["streams_overlap"] = True
    assert ("enable model_level: 30.0 ms for 64.0 MiB of host masters = 3.0 x one memcpy of "
            "those bytes (10.0 ms), 0.50 x one copy into fresh memory (60.0 ms); the floor (Note "
            "[Enable floor]) is 20.0 ms = 2.00 x one memcpy, and enable is 1.50 x the floor") in table


def test_a_device_whose_streams_do_not_overlap_is_named_so() -> None:
    from offload_ref.bench import _bench_platform, _serial_streams
    from offload_ref.platform import simulated

    assert not _serial_streams(_bench_platform("cpu"))
    if simulated.available():
        assert _serial_streams(_bench_platform("hpu:0"))
