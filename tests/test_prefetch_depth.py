"""Deeper prefetch under plain layerwise (Note [Prefetch depth] in offload_ref/backends/ring.py):
``prefetch_depth`` d gives each ring d + 1 slots and keeps the d blocks predicted next in them,
one copy per block, bit-exact, with the extra slots in the predicted peak."""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.backends.predictor import CallOrderPredictor
from offload_ref.fixtures import get_spec
from offload_ref.plan import resolve_offload_plan
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

LAYER = OffloadConfig(strategy="layer_wise", components=("dit",))


def _generate(spec, pipeline):
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


@pytest.mark.parametrize("device", ["kit", "cpu"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_keeps_the_next_blocks_in_slots_bit_exact_and_predicted(depth, device) -> None:
    spec = get_spec("flux2")  # eight blocks over two containers, one ring
    if device == "kit":
        want = _generate(spec, resident(spec.build()))
        platform = CpuPlatform()
    else:
        want = _generate(spec, spec.build())
        platform = CpuPlatform(device="cpu")
    pipeline = spec.build()
    backend = get_offload_backend(LAYER, platform=platform)
    backend.prefetch_depth = depth
    seen: list[tuple[int, list[int]]] = []
    try:
        backend.enable(pipeline)
        (ring,) = backend.rings
        n = len(ring.blocks)
        assert ring.num_slots == depth + 1 == ring.plan.slots
        # What is in the slots when each block starts (a pre-hook registered after the ring's).
        handles = [b.register_forward_pre_hook(
            lambda _m, _a, k=k: seen.append((k, ring.materialized()))) for k, b in
            enumerate(ring.blocks)]
        got = [_generate(spec, pipeline) for _ in range(3)]
        for h in handles:
            h.remove()
        for out in got:
            assert torch.equal(getattr(out, "images", out), getattr(want, "images", want))
        stats = backend.stats()
        assert stats.peak_device_bytes == backend.plan.predicted_device_bytes()
        calls = len(seen)
        # One copy per block call, plus the blocks left in slots for the next pass, and none
        # synchronous: each was prefetched.
        assert stats.swaps == calls + depth and stats.sync_recoveries == 0
        for k, there in seen:
            # The running block (its copy issued `depth` blocks ago) and the next depth - 1
            # blocks of the plain order (wrap-around) are in slots when k starts.
            want_there = {(k + i) % n for i in range(depth)}
            assert want_there <= set(there), (k, there)
            assert len(there) <= depth + 1
        assert sorted(ring.materialized()) == list(range(depth))  # between passes
        if depth > 1:
            one = resolve_offload_plan(spec.build(), LAYER, alignment=platform.alignment)
            extra = backend.plan.predicted_device_bytes() - one.predicted_device_bytes()
            assert extra == (depth - 1) * ring.slot_bytes > 0
            assert f"prefetch depth {depth}" in backend.plan.describe()
    finally:
        backend.disable()
        platform.close()
    assert backend.stats().peak_device_bytes == 0


@pytest.mark.parametrize("depth,why", [(0, "int >= 1"), (-1, "int >= 1"), ("2", "int >= 1"),
                                       (True, "int >= 1")])
def test_a_bad_depth_is_refused_before_any_change(depth, why) -> None:
    spec = get_spec("flux2")
    pipeline = spec.build()
    before = {n: t.data_ptr() for n, t in pipeline.transformer.named_parameters()}
    backend = get_offload_backend(LAYER, platform=CpuPlatform(device="cpu"))
    backend.prefetch_depth = depth
    with pytest.raises(ValueError, match=why):
        backend.enable(pipeline)
    assert {n: t.data_ptr() for n, t in pipeline.transformer.named_parameters()} == before
    assert not any(b._forward_pre_hooks for b in pipeline.transformer.transformer_blocks)


@pytest.mark.parametrize("config", [OffloadConfig(strategy="model_level"),
                                    OffloadConfig(strategy="auto", device_budget_bytes=2**30)],
                         ids=["model_level", "auto"])
def test_depth_is_refused_outside_plain_layerwise(config) -> None:
    pipeline = get_spec("flux2").build()
    with pytest.raises(ValueError, match="applies to strategy 'layer_wise' only"):
        resolve_offload_plan(pipeline, config, prefetch_depth=2)


def test_ahead_continues_the_observed_order() -> None:
    p = CallOrderPredictor(5)
    assert p.ahead(p.call(0), 3) == [1, 2, 3]  # nothing learned: k + 1, wrap-around
    order = [0, 2, 4, 0, 2, 4]  # a skipping caller
    for k in order:
        q = p.call(k)
    assert q == 0 and p.ahead(q, 3) == [0, 2, 4]
    assert p.ahead(q, 5) == [0, 2, 4, 0, 2]
    q = p.call(0)
    assert p.ahead(q, 2) == [2, 4]
