"""Pipeline-parallel stages (issue 38, item 3; Note [Pipeline-parallel stages] in
offload_ref/plan/resolver.py): a DiT's block list keeps its full length on every stage, the other
stages' blocks are placeholders without tensors (vLLM's ``PPMissingLayer``), and the ring streams
the stage's own blocks only, wrapping around them from the first pass.

The five discovery cases of vLLM-Omni PR #6456, through the public API: the first stage, the
last stage (wrap-around), placeholders without ``start_layer``/``end_layer``, an unrelated
``start_layer``/``end_layer`` beside two containers, and the distributed backend's last stage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_ref import (OffloadConfig, OffloadPlan, OffloadTopologyError,
                         SupportsComponentDiscovery, get_offload_backend, resolve_offload_plan)
from offload_ref.platform import CpuPlatform

DIM = 8
N = 8


class PPMissingLayer(nn.Identity):
    """vLLM's placeholder for a block of another pipeline stage."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


def _stage_list(local: range, n: int = N) -> nn.ModuleList:
    return nn.ModuleList(_Block() if i in local else PPMissingLayer() for i in range(n))


class _StageDit(nn.Module):
    """One stage's DiT: blocks ``start_layer .. end_layer - 1`` are its own (``with_range``:
    whether it carries the two attributes)."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, local: range, with_range: bool = True) -> None:
        super().__init__()
        self.local = local
        if with_range:
            self.start_layer, self.end_layer = local.start, local.stop
        self.blocks = _stage_list(local)
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.local:
            x = self.blocks[i](x)
        return self.proj_out(x)


class _TwoContainerDit(nn.Module):
    """Dual-stream blocks (all local) and single-stream blocks (this stage's slice), with a
    ``start_layer``/``end_layer`` that means something else (a window of the dual blocks)."""

    _layerwise_offload_blocks_attrs = ["double_blocks", "single_blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.start_layer, self.end_layer = 0, 2  # not the stage's slice of either list
        self.double_blocks = nn.ModuleList(_Block() for _ in range(3))
        self.single_local = range(2, 5)
        self.single_blocks = _stage_list(self.single_local, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.double_blocks:
            x = block(x)
        for i in self.single_local:
            x = self.single_blocks[i](x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []
    _resident_modules: list[str] = []

    def __init__(self, dit: nn.Module) -> None:
        super().__init__()
        self.transformer = dit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


def _build(make) -> _Pipe:
    torch.manual_seed(0)
    return _Pipe(make()).eval().requires_grad_(False)


_LAYERWISE = OffloadConfig(strategy="layer_wise", components=("dit",))


def _ring_paths(pipe: _Pipe, config: OffloadConfig = _LAYERWISE) -> list[tuple[str, ...]]:
    plan = resolve_offload_plan(pipe, config)
    return [stack.block_paths for c in plan.components for stack in c.rings]


def _paths(container: str, indices) -> tuple[str, ...]:
    return tuple(f"transformer.{container}.{i}" for i in indices)


def _streams_exactly_and_wraps_around(pipe: _Pipe) -> None:
    """Three generations offloaded equal the resident output bit for bit, and no block after
    the very first is loaded synchronously: the ring's prefetch wraps around the stage."""
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = pipe(x)
    platform = CpuPlatform()
    backend = get_offload_backend(_LAYERWISE, platform=platform)
    backend.enable(pipe)
    try:
        with torch.no_grad():
            got = [pipe(x.to(platform.device)).cpu() for _ in range(3)]
        stats = backend.stats()
    finally:
        backend.disable()
        platform.close()
    assert all(torch.equal(g, want) for g in got)
    assert stats.sync_recoveries == 0, stats


def test_first_stage_streams_its_own_blocks() -> None:
    pipe = _build(lambda: _StageDit(range(0, 4)))
    assert _ring_paths(pipe) == [_paths("blocks", range(0, 4))]
    _streams_exactly_and_wraps_around(pipe)


def test_last_stage_wraps_around_its_slice() -> None:
    """Before: the ring held all eight entries, predicted a placeholder after block 7, and loaded
    block 4 synchronously at the start of the next pass (2 synchronous loads in 3 passes)."""
    pipe = _build(lambda: _StageDit(range(4, 8)))
    assert _ring_paths(pipe) == [_paths("blocks", range(4, 8))]
    _streams_exactly_and_wraps_around(pipe)


def test_placeholders_without_start_and_end_are_left_out() -> None:
    pipe = _build(lambda: _StageDit(range(3, 6), with_range=False))
    assert not hasattr(pipe.transformer, "start_layer")
    assert _ring_paths(pipe) == [_paths("blocks", range(3, 6))]
    _streams_exactly_and_wraps_around(pipe)


def test_an_unrelated_start_and_end_slices_no_container() -> None:
    """Each declared container on its own: the dual blocks keep all three although
    ``start_layer``/``end_layer`` say 0..2, the single blocks lose their placeholders."""
    pipe = _build(_TwoContainerDit)
    assert _ring_paths(pipe) == [_paths("double_blocks", range(3))
                                 + _paths("single_blocks", range(2, 5))]
    _streams_exactly_and_wraps_around(pipe)


def test_the_distributed_backends_last_stage() -> None:
    pipe = _build(lambda: _StageDit(range(4, 8)))
    config = OffloadConfig(strategy="distributed_layer_wise", components=("dit",), world_size=2)
    assert _ring_paths(pipe, config) == [_paths("blocks", range(4, 8))]


def test_resident_blocks_count_the_stages_own_blocks() -> None:
    """A resident count or index set counts the ring's blocks: index 0 is the stage's first."""
    pipe = _build(lambda: _StageDit(range(4, 8)))
    pipe._offload_plan = OffloadPlan(layerwise_resident_layers={"transformer": 1})
    [stack] = [s for c in resolve_offload_plan(pipe, _LAYERWISE).components for s in c.rings]
    assert stack.streamed_paths == _paths("blocks", range(5, 8))
    pipe._offload_plan = OffloadPlan(layerwise_resident_layers={"transformer": (4,)})
    with pytest.raises(OffloadTopologyError, match="names block"):
        resolve_offload_plan(pipe, _LAYERWISE)


def test_a_stage_with_one_block_of_its_own_is_refused_by_the_two_block_rule() -> None:
    pipe = _build(lambda: _StageDit(range(7, 8)))
    with pytest.raises(OffloadTopologyError, match="at least two blocks"):
        resolve_offload_plan(pipe, OffloadConfig(strategy="layer_wise", components=("dit",),
                                                 explicit=True))


class _DevicePipe(_Pipe):
    """The stage pipeline as the kit runs it: inputs moved to the execution device."""

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from offload_ref import execution_device

        return self.transformer(x.to(execution_device(self)))


def _last_stage(seed: int = 0) -> _DevicePipe:
    torch.manual_seed(seed)
    return _DevicePipe(_StageDit(range(4, 8))).eval().requires_grad_(False)


def _stage_inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(2, DIM, generator=torch.Generator().manual_seed(seed))}


def test_the_kit_counts_a_stages_own_blocks() -> None:
    """Before: the kit's checks took a container's entries for its blocks, placeholders
    included, and failed a correct offloader on a last stage three times (a resident head of 6
    of "8" blocks, a twin DiT of two placeholders, a reversed container compared with
    placeholders in it)."""
    from offload_ref.contracts import PipelineSpec
    from offload_ref.contracts.runner import run_checks

    spec = PipelineSpec("pp_last_stage", _last_stage, _stage_inputs, strategies=("layer_wise",))
    results = run_checks([spec], include_global=False, checks=[
        "check_block_claimed_by_two_components_is_rejected",
        "check_plan_block_attrs_beat_class_attributes",
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_offloaded_output_matches_reference_bitwise"])
    assert [r.outcome for r in results] == ["passed"] * 4, [
        (r.id.check, r.outcome, r.message[:300]) for r in results]
