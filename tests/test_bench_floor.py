"""The per-block floor of ``offload-ref bench`` (Note [Per-block floor] in
offload_ref/bench_floor.py) computes what the resident model computes and binds blocks as a
layerwise ring does; ``per_block_overhead`` times it beside the inline platform."""

from __future__ import annotations

import pytest
import torch

from offload_ref.backends.rebind_guard import RUNNING_PARAMETER
from offload_ref.bench import per_block_overhead
from offload_ref.bench_floor import floor_hooks
from offload_ref.fixtures.many_blocks import build_pipeline, make_input


@pytest.mark.parametrize("tensors_per_block", [1, 3])
def test_the_floor_computes_the_resident_output_and_streams_its_blocks(tensors_per_block):
    resident = build_pipeline(0, 6, tensors_per_block=tensors_per_block)
    floor = build_pipeline(0, 6, tensors_per_block=tensors_per_block)
    handles = floor_hooks(list(floor.transformer.blocks))
    x = make_input(0)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(floor.transformer(x), resident.transformer(x))
    blocks = floor.transformer.blocks
    # Between forwards block 0 (predicted next) is in a slot, every other block on NaN.
    assert torch.equal(blocks[0].fc.weight, resident.transformer.blocks[0].fc.weight)
    for block in blocks[1:]:
        assert torch.isnan(block.fc.weight).all() and torch.isnan(block.fc.bias).all()
        assert type(block.fc.weight) is RUNNING_PARAMETER
    # The hooks the layerwise backend installs: block pre and post, a pre-hook on the part.
    assert len(handles) == 3 * len(blocks)
    assert all(len(b.fc._forward_pre_hooks) == 1 for b in blocks)


def test_the_floor_refuses_blocks_of_mixed_dtypes():
    pipe = build_pipeline(0, 2)
    pipe.transformer.blocks[1].fc.to(torch.float64)
    with pytest.raises(ValueError, match="one dtype per block"):
        floor_hooks(list(pipe.transformer.blocks))


def test_per_block_overhead_times_the_floor_beside_the_inline_platform():
    out = per_block_overhead(blocks=4, repeats=1)
    assert set(out) == {"resident", "floor", "inline", "cpu"}
    for row in out.values():
        assert row["step_s"] > 0 and row["step_cpu_s"] >= 0
    assert out["resident"]["per_block_overhead_us"] == 0.0
