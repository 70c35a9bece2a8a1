"""Pinned staging for file-backed rank-local rings (Note [Pinned staging] in
offload_ref/backends/staging.py): a fixed pool of staging slots, filled in the background,
each reused only after the copy that read it; its size and budget are OffloadConfig fields."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend, load_safetensors
from offload_ref.backends import staging as staging_module
from offload_ref.distributed import _backend_selftest as st
from offload_ref.plan import OffloadTopologyError, resolve_offload_plan
from offload_ref.platform import CpuPlatform, StreamOrderError, get_platform
from device_helpers import SIMULATED  # noqa: E402 (tests/ is on sys.path)

BLOCKS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("staging") / "dit.safetensors"
    st.save_mmap_twin(str(path), BLOCKS)
    return path


@pytest.fixture(scope="module")
def want() -> torch.Tensor:
    with torch.inference_mode():
        return st.mmap_twin(BLOCKS)(st.mmap_input())


def _loaded(path: Path):
    with torch.device("meta"):
        pipeline = st.MmapPipeline(BLOCKS).eval().requires_grad_(False)
    load_safetensors(pipeline.transformer, str(path))
    return pipeline


def _layer(**kw) -> OffloadConfig:
    return OffloadConfig(strategy="layer_wise", **kw)


def _generate(pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(st.mmap_input()).cpu()


def _slot_bytes(checkpoint: Path) -> int:
    """One staging slot: the slot image of the largest file-backed block."""
    platform = CpuPlatform()
    backend = get_offload_backend(_layer(staging_slots=2), platform=platform)
    pipeline = _loaded(checkpoint)  # held: a collected pipeline disables its backend
    backend.enable(pipeline)
    slot = backend._staging.slot_bytes
    backend.disable()
    platform.close()
    return slot


def _staging_threads() -> list[threading.Thread]:
    """The staging threads alive (one per process at most: Note [Pinned staging])."""
    return [t for t in threading.enumerate() if t.name == "offload-ref-staging"]


@pytest.mark.parametrize("slots", [2, 3])
def test_file_backed_blocks_stream_through_the_pool_exactly(checkpoint, want, slots) -> None:
    platform = CpuPlatform(race_amplifier=True)  # the stream-order checker sees the pool
    pipeline = _loaded(checkpoint)
    backend = get_offload_backend(_layer(staging_slots=slots), platform=platform)
    backend.enable(pipeline)
    try:
        pool = backend._staging
        assert pool is not None and pool.n == slots
        for _ in range(3):
            assert torch.equal(_generate(pipeline), want)
        stats = backend.stats()
        fills = stats.staging_hits + stats.staging_misses
        assert fills == stats.swaps  # every fill of a file-backed block went through the pool
        assert stats.staging_misses <= 2, stats  # the first block; the rest staged in advance
        assert stats.staging_pool_bytes == slots * pool.slot_bytes
        assert stats.staging_bytes >= stats.h2d_bytes
        assert stats.staging_wait_ns >= 0 and stats.sync_recoveries == 0
        assert not platform.hazards
    finally:
        backend.disable()
    assert platform.memory_allocated() == 0 and platform.host_allocated() == 0
    assert len(_staging_threads()) <= 1  # one staging thread per process, idle
    platform.close()


def test_a_slot_reused_before_its_copys_event_is_caught_by_the_order_checker(
        checkpoint, monkeypatch) -> None:
    """The CPU platform checks the pool's order (order_host): a staging that overwrites a slot
    without waiting for the event of the copy that read it is a StreamOrderError."""
    class Hasty(staging_module.StagingPool):
        def _after_reader(self, p: int) -> None:
            pass  # no wait for the slot's read event

    from offload_ref.backends import layerwise

    monkeypatch.setattr(layerwise, "StagingPool", Hasty)
    platform = CpuPlatform(race_amplifier=True)
    pipeline = _loaded(checkpoint)
    backend = get_offload_backend(_layer(staging_slots=2), platform=platform)
    backend.enable(pipeline)
    with pytest.raises(RuntimeError) as info:
        for _ in range(3):
            _generate(pipeline)
    assert platform.hazards and isinstance(platform.hazards[0], StreamOrderError)
    assert "host allocation" in str(platform.hazards[0])
    chain, exc = [], info.value
    while exc is not None:
        chain.append(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    assert "StreamOrderError" in chain, chain
    platform.hazards.clear()
    try:
        backend.disable()
    except Exception:  # noqa: BLE001 - the broken pool's failure may surface again here
        pass
    platform.close()


@pytest.mark.skipif(not SIMULATED, reason="the pinned path needs the simulated accelerator")
def test_the_pool_is_pinned_and_on_by_default_where_the_platform_pins(checkpoint, want) -> None:
    platform = get_platform("hpu:0")
    assert platform.pin_memory_supported
    pipeline = _loaded(checkpoint)
    backend = get_offload_backend(_layer(), platform=platform)
    backend.enable(pipeline)
    try:
        pool = backend._staging
        assert pool is not None and pool.n == 2  # the default
        assert all(slot.buffer.is_pinned() for slot in pool.slots)
        for _ in range(2):
            assert torch.equal(_generate(pipeline), want)
        stats = backend.stats()
        assert stats.pinned_bytes >= stats.staging_pool_bytes > 0
        assert stats.staging_hits > stats.staging_misses
    finally:
        backend.disable()
    assert len(_staging_threads()) <= 1  # one staging thread per process, idle


def test_no_pool_where_nothing_is_pinned_or_nothing_is_file_backed(checkpoint) -> None:
    platform = CpuPlatform()  # pins nothing: the default leaves the pool off
    for pipeline, config in ((_loaded(checkpoint), _layer()),
                             (st.mmap_twin(BLOCKS), _layer(staging_slots=2)),
                             (_loaded(checkpoint), _layer(staging_slots=0))):
        backend = get_offload_backend(config, platform=platform)
        backend.enable(pipeline)
        assert backend._staging is None
        _generate(pipeline)
        assert backend.stats().staging_hits == backend.stats().staging_misses == 0
        backend.disable()
    platform.close()


def test_a_budget_bounds_the_pool_and_one_below_two_slots_is_refused_before_any_change(
        checkpoint, want) -> None:
    slot = _slot_bytes(checkpoint)
    platform = CpuPlatform()
    pipeline = _loaded(checkpoint)
    backend = get_offload_backend(_layer(staging_slots=4, staging_budget_bytes=3 * slot + 1),
                                  platform=platform)
    backend.enable(pipeline)
    assert backend._staging.n == 3  # four asked, three fit
    assert torch.equal(_generate(pipeline), want)
    backend.disable()
    backend = get_offload_backend(_layer(staging_budget_bytes=2 * slot), platform=platform)
    backend.enable(pipeline)
    assert backend._staging.n == 2  # no slot count: as many as the budget holds
    backend.disable()
    before = {n: (t.data_ptr(), t.device) for n, t in pipeline.state_dict().items()}
    backend = get_offload_backend(_layer(staging_budget_bytes=2 * slot - 1), platform=platform)
    with pytest.raises(OffloadTopologyError) as info:
        backend.enable(pipeline)
    message = str(info.value)
    assert "OffloadConfig.staging_budget_bytes" in message
    assert str(2 * slot - 1) in message and f"{slot} bytes each" in message
    assert str(2 * slot) in message and "staging_slots=0" in message
    assert not backend.is_enabled() and platform.memory_allocated() == 0
    assert platform.host_allocated() == 0
    assert {n: (t.data_ptr(), t.device) for n, t in pipeline.state_dict().items()} == before
    # a budget for a pipeline with no file-backed block constrains nothing
    resolve_offload_plan(st.mmap_twin(BLOCKS), _layer(staging_budget_bytes=1))
    platform.close()


@pytest.mark.parametrize("kw,mentions", [
    ({"staging_slots": 1}, "must be an int >= 2"),
    ({"staging_slots": -2}, "must be an int >= 2"),
    ({"staging_slots": True}, "must be an int >= 2"),
    ({"staging_budget_bytes": 0}, "must be a positive int"),
    ({"staging_slots": 0, "staging_budget_bytes": 10}, "a budget for a pool that is off"),
])
def test_staging_fields_are_validated(kw, mentions) -> None:
    with pytest.raises(ValueError, match=mentions):
        _layer(**kw)
    with pytest.raises(ValueError, match="apply to the layer strategies"):
        OffloadConfig(strategy="model_level", staging_slots=2)


def test_an_interrupt_inside_a_block_leaves_the_pool_usable(checkpoint, want) -> None:
    platform = CpuPlatform(race_amplifier=True)
    pipeline = _loaded(checkpoint)
    backend = get_offload_backend(_layer(staging_slots=2), platform=platform)
    backend.enable(pipeline)
    block = pipeline.transformer.blocks[3]

    def interrupt(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = block.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        _generate(pipeline)
    for _ in range(2):
        assert torch.equal(_generate(pipeline), want)
    assert not platform.hazards
    backend.disable()
    assert platform.memory_allocated() == 0 and platform.host_allocated() == 0
    platform.close()


def test_the_pool_leaves_no_anonymous_memory_beyond_itself(tmp_path) -> None:
    """As the mmap test, with a pool of two slots: RssAnon grows by at most 5% of the weights
    plus the pool (and the allocator's slack, ``MMAP_RSS_SLACK``)."""
    from offload_ref.distributed import run_ranks

    path, warm = str(tmp_path / "dit.safetensors"), str(tmp_path / "warm.safetensors")
    st.save_mmap_twin(path)
    st.save_mmap_twin(warm, 2)
    [obs] = run_ranks(st.mmap_rss, 1, args=(path, warm, True, 2), timeout_s=90.0)
    weights, stats = obs["weight_bytes"], obs["stats"]
    pool = stats["staging_pool_bytes"]
    assert pool > 0 and stats["staging_hits"] > 0, stats
    bound = 0.05 * weights + pool + st.MMAP_RSS_SLACK
    assert obs["mmap_growth"] <= bound, (obs["mmap_growth"], weights, pool)
    assert torch.equal(obs["mmap_output"], obs["cpu_output"])
