"""Residency policies for plain layerwise (Note [Resident blocks] in offload_ref/plan/resolver.py,
issue 38 item 2): ``OffloadPlan.layerwise_resident_layers`` takes a count or a tuple of block
indices, ``layerwise_resident_policy`` places a count ``"leading"`` (a head) or ``"strided"``.
Every block is resident or streamed, once; outputs are byte-identical across policies and
counts; the ring streams exactly the other blocks, in order, wrapping around; the measured
peak equals the prediction."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.plan import OffloadPlan, OffloadTopologyError, resolve_offload_plan
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

LAYER = OffloadConfig(strategy="layer_wise", components=("dit",))


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(0.01 * (i + 1))

    def forward(self, x):
        return x + self.fc(x)


class DiT(nn.Module):
    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Pipe(nn.Module):
    _dit_modules = ("transformer",)

    def __init__(self, n: int, kept, policy: str | None = None) -> None:
        super().__init__()
        self.transformer = DiT(n)
        self._offload_plan = OffloadPlan(
            layerwise_resident_layers={"transformer": kept},
            layerwise_resident_policy={"transformer": policy} if policy else {})


def _resident_set(n: int, kept, policy: str | None) -> set[int]:
    (stack,) = resolve_offload_plan(Pipe(n, kept, policy), LAYER).rings
    streamed = [stack.block_paths.index(p) for p in stack.streamed_paths]
    resident = set(stack.resident_indices)
    # the partition: every block once, either resident or streamed, the streamed in order
    assert sorted(resident | set(streamed)) == list(range(n)), (n, kept, policy)
    assert not resident & set(streamed) and streamed == sorted(streamed)
    assert [stack.blocks[i] for i in streamed] == list(stack.streamed_blocks)
    return resident


@pytest.mark.parametrize("policy", ["leading", "strided"])
def test_every_block_is_resident_or_streamed_once_for_every_small_ring(policy) -> None:
    for n in range(2, 13):
        for r in range(0, n - 1):  # at least two stream
            got = _resident_set(n, r, policy)
            assert len(got) == r, (n, r, policy, got)
            if policy == "leading":
                assert got == set(range(r))
            elif r:
                assert 0 in got  # spread from the first block on, evenly
                gaps = sorted(got) + [n]
                steps = [b - a for a, b in zip(gaps, gaps[1:])]
                assert max(steps) - min(steps) <= 1, (n, r, sorted(got))
        with pytest.raises(OffloadTopologyError, match="streams at least two"):
            _resident_set(n, n - 1, policy)


@pytest.mark.parametrize("n,r,want", [(8, 2, {0, 4}), (8, 3, {0, 3, 5}), (12, 4, {0, 3, 6, 9}),
                                      (10, 3, {0, 3, 7}), (5, 2, {0, 3})])
def test_strided_schedules_are_pinned(n, r, want) -> None:
    assert _resident_set(n, r, "strided") == want


def test_an_explicit_set_is_kept_and_bad_sets_are_refused() -> None:
    assert _resident_set(8, (1, 6), None) == {1, 6}
    assert _resident_set(8, (0, 1), None) == {0, 1}  # a leading set is a head
    (stack,) = resolve_offload_plan(Pipe(8, (0, 1)), LAYER).rings
    assert stack.resident_head == 2 and stack.resident_blocks == ()
    with pytest.raises(OffloadTopologyError, match=r"names block\(s\) \[9\]"):
        _resident_set(8, (2, 9), None)
    with pytest.raises(ValueError, match="repeated"):
        OffloadPlan(layerwise_resident_layers={"transformer": (1, 1)})
    with pytest.raises(ValueError, match="must be one of"):
        OffloadPlan(layerwise_resident_policy={"transformer": "middle"})
    with pytest.raises(OffloadTopologyError, match="layerwise_resident_policy names 'dit'"):
        p = Pipe(8, 2)
        p._offload_plan = dataclasses.replace(p._offload_plan,
                                              layerwise_resident_policy={"dit": "strided"})
        resolve_offload_plan(p, LAYER)


def _flux2(kept, policy):
    pipeline = get_spec("flux2").build()
    plan = getattr(type(pipeline), "_offload_plan", None) or OffloadPlan()
    pipeline.__dict__["_offload_plan"] = dataclasses.replace(
        plan, layerwise_resident_layers={"transformer": kept},
        layerwise_resident_policy={"transformer": policy} if policy else {})
    return pipeline


@pytest.mark.parametrize("kept,policy", [(0, None), (2, "leading"), (2, "strided"),
                                         (3, "strided"), ((1, 3), None)])
def test_outputs_are_byte_identical_and_the_peak_is_predicted(kept, policy) -> None:
    spec = get_spec("flux2")  # five blocks over two containers, one ring
    with torch.inference_mode():
        want = resident(spec.build())(**spec.make_inputs())
    pipeline = _flux2(kept, policy)
    platform = CpuPlatform()
    backend = get_offload_backend(LAYER, platform=platform)
    calls: list[int] = []
    try:
        backend.enable(pipeline)
        (stack,) = backend.plan.rings
        (ring,) = backend.rings
        streamed = [stack.block_paths.index(p) for p in stack.streamed_paths]
        kept_set = set(stack.resident_indices)
        blocks = list(stack.blocks)
        assert all(not blocks[i]._forward_pre_hooks for i in kept_set)  # placed, never hooked
        assert all(platform.is_resident(t) for i in kept_set for t in blocks[i].parameters())
        handles = [blocks[i].register_forward_pre_hook(
            lambda m, a, i=i: calls.append(i)) for i in streamed]
        for _ in range(2):
            with torch.inference_mode():
                got = pipeline(**spec.make_inputs())
            assert torch.equal(getattr(got, "images", got), getattr(want, "images", want))
        for h in handles:
            h.remove()
        assert calls[:len(streamed)] == streamed  # the ring runs exactly the streamed blocks
        assert ring.materialized() == [0]  # wrapped around to the first streamed block
        assert backend.stats().sync_recoveries == 0
        assert backend.stats().peak_device_bytes == backend.plan.predicted_device_bytes()
        if isinstance(kept, tuple) or policy == "strided":
            assert "resident blocks" in backend.plan.describe()
    finally:
        backend.disable()
        platform.close()
