"""DistributedLayerWiseOffloadBackend on real ranks, beyond the conformance kit's §H checks.

The kit (contracts/checks/distributed.py) covers outputs, host bytes per rank, slots, shard
padding, restore, waves, a rank failure injected into enable and mmap buffers, across two
ranks.  This file covers what it does not: misconfigured worlds refused before any mutation,
``state_dict`` and ``edit_weights`` under AllGather, pipelines enabled in opposite orders on the
ranks, a world of three, the torchrun entry (``python -m offload_ref.distributed``), and the
anonymous memory of streaming mmap-loaded weights.

A spawn costs about 3.5 s, so the two-rank checks share one spawn (``two_rank_batch``: every
scenario in sequence on both ranks, observations back to the parent); a world of three and the
memory measurement (a fresh process, so nothing else has touched its heap) take one each.  The
rank functions live in ``offload_ref.distributed._backend_selftest`` (tests/ is not a package).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from offload_ref import OffloadConfig, anonymous_rss_bytes, get_offload_backend
from offload_ref.distributed import _backend_selftest as st
from offload_ref.distributed import run_ranks
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform

ALIGNMENT = 64  # CpuPlatform's; the shard sizes below are computed here, not by the plan


def _allgather_config(world_size: int) -> OffloadConfig:
    return OffloadConfig(strategy="distributed_layer_wise", components=("dit",),
                         layer_options={"dit": {"weight_transfer": "allgather"}},
                         world_size=world_size)


def _block_bytes(pipeline: Any) -> int:
    """Weight bytes of the flux2 fixture's streamed DiT blocks (both containers)."""
    dit = pipeline.transformer
    blocks = [*dit.transformer_blocks, *dit.single_transformer_blocks]
    return sum(t.numel() * t.element_size() for b in blocks
               for t in [*b.parameters(), *b.buffers()])


def _scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's observations of one scenario (failing with its traceback if it raised)."""
    out = []
    for obs in ranks:
        got = obs[name]
        if isinstance(got, dict) and "error" in got:
            pytest.fail(f"rank {obs['rank']}: scenario {name} raised {got['error']}\n"
                        f"{got['traceback']}")
        out.append(got)
    return out


# -- refused before any mutation, in this process (no torch.distributed) -------------------------


@pytest.fixture
def single_process() -> None:
    assert not dist.is_initialized(), "these tests need a process without torch.distributed"


def test_world_size_two_without_torch_distributed_is_refused_before_any_mutation(single_process):
    pipeline = get_spec(st.FIXTURE).build()
    before = st.tensor_state(pipeline)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(_allgather_config(2), platform=platform, timeout_s=5.0)
    with pytest.raises(RuntimeError) as info:
        backend.enable(pipeline)
    message = str(info.value)
    assert "data_parallel_size" in message and "= 2" in message, message
    assert "torchrun --nproc-per-node 2" in message and "1 rank(s)" in message, message
    assert st.untouched(pipeline, before, backend, platform) == []
    assert backend.plan is None and backend.last_steps == []
    platform.close()


def test_process_group_without_init_is_refused_before_any_mutation(single_process):
    pipeline = get_spec(st.FIXTURE).build()
    before = st.tensor_state(pipeline)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(_allgather_config(1), platform=platform, timeout_s=5.0,
                                  process_group=object())
    with pytest.raises(RuntimeError) as info:
        backend.enable(pipeline)
    message = str(info.value)
    assert "process_group was given" in message and "init_process_group" in message, message
    assert st.untouched(pipeline, before, backend, platform) == []
    assert backend.plan is None and backend.last_steps == []
    platform.close()


def test_torchrun_entry_help_runs_without_ranks():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "offload_ref.distributed", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for option in ("--pipeline", "--spec", "--transfer", "--resident-layers", "--steps",
                   "--timeout", "--json"):
        assert option in done.stdout, (option, done.stdout)
    assert "torchrun --nproc-per-node N -m offload_ref.distributed" in done.stdout
    assert time.monotonic() - start < 30.0


# -- two spawned ranks, one spawn ---------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    start = time.monotonic()
    observed = run_ranks(st.two_rank_batch, 2, timeout_s=90.0)
    assert time.monotonic() - start < 45.0
    return observed


@pytest.mark.distributed
def test_world_size_one_with_allgather_across_two_ranks_is_refused_on_both(two_ranks):
    for obs in _scenario(two_ranks, "world_size_one"):
        assert obs["raised"] == "RuntimeError", obs
        assert "weight_transfer='allgather' across 2 ranks" in obs["message"], obs
        assert "data_parallel_size (OffloadConfig.world_size) = 2, got 1" in obs["message"]
        assert obs["problems"] == []


@pytest.mark.distributed
def test_a_block_skipped_on_every_rank_under_allgather_is_exact(two_ranks):
    """An outside review: skip-layer guidance under AllGather failed on both ranks with a
    StreamOrderError (on CUDA, a copy racing the previous gather into the same slot)."""
    for obs in _scenario(two_ranks, "skipped_block"):
        assert obs["equal"] == [True, True, True, True], obs


@pytest.mark.distributed
def test_generations_after_a_ctrl_c_inside_an_allgather_block_are_exact(two_ranks):
    """Issue 25: Ctrl-C inside a streamed block under AllGather, then a new generation, raised
    StreamOrderError on both ranks (recovery ordered compute after the copy stream only; the
    last writer of a slot is the gather on the communication stream)."""
    for obs in _scenario(two_ranks, "interrupted_allgather"):
        assert obs["errors"] == [], obs
        assert obs["equal"] == [True] * 6, obs
        assert obs["device_bytes"] == 0


@pytest.mark.distributed
def test_a_rank_whose_plan_is_skipped_makes_every_rank_raise(two_ranks):
    """Issue 25: rank 1's DiT had no blocks (its plan skipped) and it ran un-offloaded with no
    error while rank 0 raised.  Now rank 1 raises before any collective, rank 0 at its first
    round, both naming rank 1 and the skip reason, and neither changed anything."""
    rank0, rank1 = _scenario(two_ranks, "skipped_rank")
    assert rank1["first"]["raised"] == "OffloadTopologyError", rank1
    assert "rank 1 of 2" in rank1["first"]["message"]
    assert "plan is skipped (nothing to stream" in rank1["first"]["message"]
    assert rank0["first"]["raised"] == "OffloadEnableError", rank0
    assert "rank 1: OffloadTopologyError" in rank0["first"]["message"]
    assert "plan is skipped" in rank0["first"]["message"]
    assert rank0["problems"] == [] and rank1["problems"] == []


@pytest.mark.distributed
def test_ranks_making_different_calls_raise_instead_of_mixing_blocks(two_ranks):
    """An outside review: one DiT call more on rank 0 paired its gathers with rank 1's
    disable, and both went on with mixed blocks (Note [Gather tags])."""
    for obs in _scenario(two_ranks, "asymmetric_calls"):
        assert obs["errors"], obs
        assert all("OffloadScheduleError" in e and "rank 0: block" in e and "rank 1: block" in e
                   for e in obs["errors"]), obs


@pytest.mark.distributed
def test_weights_that_differ_between_ranks_are_refused_on_every_rank(two_ranks):
    """AllGather rebuilds each block from every rank's shard: if one rank's weights differ, the
    blocks would silently mix both, so enable fails on every rank and changes nothing."""
    for obs in _scenario(two_ranks, "different_weights"):
        assert obs["raised"] == "OffloadEnableError", obs
        assert "checksum of the AllGather-streamed weights" in obs["message"], obs
        assert obs["problems"] == []


@pytest.mark.distributed
def test_a_rank_refused_alone_makes_its_peer_fail_at_once_and_the_retry_pairs_up(two_ranks):
    """Rank 1 alone has data_parallel_size 1: its refusal reaches rank 0's enable at once
    (naming rank 1 and its error), and the next enable of both ranks is one round again (a
    refusal that took no round would pair rank 1's retry with rank 0's failed enable)."""
    rank0, rank1 = _scenario(two_ranks, "asymmetric_config")
    assert rank1["first"]["raised"] == "RuntimeError"
    assert "data_parallel_size" in rank1["first"]["message"]
    first = rank0["first"]
    assert first["raised"] == "OffloadEnableError", first
    assert "rank 1: RuntimeError: weight_transfer='allgather'" in first["message"], first
    assert first["seconds"] < 1.5, first  # its rendezvous timeout is 2 s
    for obs in (rank0, rank1):
        assert obs["problems"] == []
        assert obs["retry_enabled"] == ["True", "True"], obs["retry"]
        assert torch.equal(obs["retry_output"], obs["retry_reference"])


@pytest.mark.distributed
def test_state_dict_under_allgather_names_the_fix_and_works_after_disable(two_ranks):
    for obs in _scenario(two_ranks, "state_dict"):
        assert obs["collective_bytes"] > 0  # it was streaming with AllGather
        for key in ("while_enabled", "pipeline_while_enabled"):
            got = obs[key]
            assert got["raised"] == "RuntimeError", got
            assert "AllGather" in got["message"] and "1/2" in got["message"], got
            assert "backend.disable() on every rank" in got["message"], got
            assert "weight_transfer='rank-local'" in got["message"], got
        after = obs["after_disable"]
        assert after["raised"] is None, after
        assert after["keys_equal"] and after["differs"] == [], after


@pytest.mark.distributed
def test_edit_weights_under_allgather_matches_an_edited_unoffloaded_pipeline(two_ranks):
    for obs in _scenario(two_ranks, "edit_weights"):
        assert not obs["enabled_inside"] and obs["enabled_after"]
        assert obs["transports"] == ["allgather"] and obs["gathered"] > 0
        assert torch.equal(obs["before_edit"], obs["unedited"])
        assert not torch.equal(obs["reference"], obs["unedited"])  # the edit matters
        assert torch.equal(obs["output"], obs["reference"])
        assert obs["state_differs"] == []  # disable restores the edited weights


@pytest.mark.distributed
def test_pipelines_enabled_in_opposite_orders(two_ranks):
    """Rank 0 enables flux2 then sd3, rank 1 sd3 then flux2: enable issues no collective, so
    nothing hangs; each enable meets the other rank's enable of the other pipeline at the
    agreement, so both fail at once on both ranks, naming the rings, rolled back.  Two
    pipelines with one schedule enabled in opposite orders agree (their gathers match)."""
    ranks = _scenario(two_ranks, "enable_orders")
    flux2 = "transformer.transformer_blocks+transformer.single_transformer_blocks x5 allgather"
    for rank, obs in enumerate(ranks):
        assert obs["seconds"] < 2.5, obs["seconds"]  # the agreement timeout is 5 s
        for name in ("A", "B"):
            got = obs[f"enable_{name}"]
            assert got["raised"] == "OffloadEnableError", got
            assert "ranks disagree on the ring schedule" in got["message"], got
            assert "in the same order" in got["message"], got
            assert flux2 in got["message"] and "transformer.transformer_blocks x3" in \
                got["message"], got
            assert "rolled back" in got["message"]
        assert obs["untouched_A"] == [] and obs["untouched_B"] == []
        assert obs["same_order"]["raised"] is None, obs["same_order"]
        assert torch.equal(obs["same_order_output"], obs["same_order_reference"])
        assert [e["raised"] for e in obs["same_kind"]] == [None, None], obs["same_kind"]
        assert torch.equal(obs["same_kind_output"], obs["same_order_reference"])


@pytest.mark.distributed
def test_torchrun_entry_run_rank_matches_and_reports_both_transfers(two_ranks):
    ranks = _scenario(two_ranks, "cli")
    block_bytes = _block_bytes(get_spec(st.FIXTURE).build())
    for rank, obs in enumerate(ranks):
        for transfer in ("allgather", "rank-local"):
            got = obs[transfer]
            assert got["raised"] is None, got
            result = got["value"]
            assert result["rank"] == rank and result["world"] == 2
            assert result["transfer"] == transfer and result["pipeline"] == st.FIXTURE
            assert result["bitwise_equal"] is True, result
            assert got["json"] == result
            line = re.fullmatch(
                rf"\[rank {rank}/2\] {st.FIXTURE} {transfer}: host block bytes "
                rf"{result['host_block_bytes']} \(\+{result['host_padding_bytes']} padding\), "
                rf"peak device bytes {result['peak_device_bytes']}, step [0-9.]+ ms resident vs "
                rf"[0-9.]+ ms offloaded, gathered {result['gathered_bytes_per_generation']} bytes "
                r"per generation, output equals the single-process reference\n", got["printed"])
            assert line, got["printed"]
        gathered, local = obs["allgather"]["value"], obs["rank-local"]["value"]
        assert local["host_block_bytes"] == block_bytes
        assert local["gathered_bytes_per_generation"] == 0
        assert gathered["gathered_bytes_per_generation"] > 0
        half = local["host_block_bytes"] / 2
        assert abs(gathered["host_block_bytes"] - half) <= 0.02 * half, (gathered, local)
    assert sum(o["allgather"]["value"]["host_block_bytes"] for o in ranks) == block_bytes


# -- three ranks --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_allgather_across_three_ranks_matches_with_one_third_shards():
    """Each rank's shard of a block is ceil(image / 3) rounded up to 64 bytes, zero past the
    image; slots are three shards; outputs match each rank's reference (cosmos3: two rings,
    bfloat16 and float32)."""
    start = time.monotonic()
    ranks = run_ranks(st.three_ranks, 3, timeout_s=90.0)
    assert time.monotonic() - start < 45.0
    block_bytes = ranks[0]["block_bytes"]
    held = 0
    for rank, obs in enumerate(ranks):
        assert obs["world"] == 3 and obs["alignment"] == ALIGNMENT
        assert torch.equal(obs["output"], obs["reference"]), rank
        assert obs["restored_differs"] == []
        assert obs["stats"]["collective_bytes"] > 0
        assert len(obs["rings"]) == 2
        shard_total = 0
        for label, ring in obs["rings"].items():
            assert ring["transport"] == "allgather", label
            expected = [-(-(-(-image // 3)) // ALIGNMENT) * ALIGNMENT for image in ring["images"]]
            assert ring["shard_numel"] == expected, (label, ring, expected)
            assert ring["nonzero_padding"] == [0] * len(expected), label
            assert ring["slot_bytes"] == 3 * max(expected), (label, ring)
            assert ring["slots"] == [3 * max(expected)] * 2, (label, ring)
            shard_total += sum(expected)
        stats = obs["stats"]
        assert stats["host_bytes"] + stats["host_padding_bytes"] == shard_total, stats
        assert stats["host_bytes"] <= block_bytes / 3 * 1.05, (stats, block_bytes)
        held += stats["host_bytes"]
    assert held == block_bytes  # every block byte once, across the three ranks


# -- mmap-loaded weights stream without anonymous copies ---------------------------------------


@pytest.mark.distributed
@pytest.mark.skipif(anonymous_rss_bytes() is None, reason="needs RssAnon (/proc/self/status)")
def test_mmap_loaded_dit_streams_rank_local_without_anonymous_memory(tmp_path):
    """A meta-built DiT of ~32 MB in 64 blocks, loaded with load_safetensors and streamed
    rank-local (one forward) grows RssAnon by at most 5% of its weights (two slots are 3%; plus
    the allocator's slack, ``MMAP_RSS_SLACK``); the same DiT built on the CPU grows it by at least
    90%."""
    path, warm = str(tmp_path / "dit.safetensors"), str(tmp_path / "warm.safetensors")
    st.save_mmap_twin(path)
    st.save_mmap_twin(warm, 2)
    [obs] = run_ranks(st.mmap_rss, 1, args=(path, warm), timeout_s=90.0)
    weights, blocks = obs["weight_bytes"], obs["block_bytes"]
    assert 30 * 2**20 < weights < 40 * 2**20
    assert obs["report_file_backed_bytes"] == weights
    stats = obs["stats"]
    assert stats["file_backed_bytes"] == blocks and stats["host_bytes"] == blocks, stats
    assert stats["swaps"] >= st.MMAP_BLOCKS
    assert obs["mmap_growth"] <= 0.05 * weights + st.MMAP_RSS_SLACK, (obs["mmap_growth"], weights)
    assert obs["cpu_stats"]["file_backed_bytes"] == 0
    assert obs["cpu_growth"] >= 0.9 * weights, (obs["cpu_growth"], weights)
    assert torch.equal(obs["mmap_output"], obs["cpu_output"])


@pytest.mark.distributed
@pytest.mark.skipif(anonymous_rss_bytes() is None, reason="needs RssAnon (/proc/self/status)")
def test_the_anonymous_memory_bound_fails_for_a_host_copy_of_the_blocks(tmp_path):
    """The bound above, slack included, against a ring that copies every mmap-loaded block to
    the host (``map_files=False``): it is exceeded, so the test above can fail."""
    path, warm = str(tmp_path / "dit.safetensors"), str(tmp_path / "warm.safetensors")
    st.save_mmap_twin(path)
    st.save_mmap_twin(warm, 2)
    [obs] = run_ranks(st.mmap_rss, 1, args=(path, warm, False), timeout_s=90.0)
    weights = obs["weight_bytes"]
    assert obs["mmap_growth"] > 0.05 * weights + st.MMAP_RSS_SLACK, (obs["mmap_growth"], weights)


def test_the_launcher_compares_non_tensor_outputs_leaf_by_leaf():
    """An outside review: `python -m offload_ref.distributed` printed "DIFFERS FROM" and exited 1
    for any output that is not a tensor (a diffusers output object, a dict)."""
    import numpy as np

    from offload_ref.distributed.__main__ import _outputs_equal

    t = torch.arange(6.0).view(2, 3)
    assert _outputs_equal({"images": t}, {"images": t.clone()})
    assert _outputs_equal((t, np.ones(3)), (t.clone(), np.ones(3)))
    assert not _outputs_equal({"images": t}, {"images": t + 1})
    assert not _outputs_equal({"images": t}, {"latents": t})
