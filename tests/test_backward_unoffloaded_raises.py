"""J.5 compares gradients through an offloaded component with the un-offloaded ones.  A model
whose own backward raises (it writes in place into a tensor autograd saved, as diffusers'
CogVideoX RoPE writes into a view of the query) has nothing to compare with: the check does not
apply, with the model's error as the reason, instead of reporting that error as raised into the
user's generation (found by an outside model author on CogVideoX)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery, execution_device
from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.runner import run_checks

J5 = "check_backward_is_exact_or_refused_at_forward"


class _Block(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.q(x))  # tanh saves its output for the backward
        h = h.mul_(2) if self.in_place else h * 2
        return h + x


class _Dit(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(in_place) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ["blocks"]})

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.text_encoder = _Block(in_place)
        self.transformer = _Dit(in_place)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.text_encoder(x.to(execution_device(self))))


def _inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))}


def _result(in_place: bool, strategy: str):
    spec = PipelineSpec(name=f"in_place_{in_place}",
                        factory=lambda: _Pipe(in_place).eval().requires_grad_(False),
                        inputs=_inputs, strategies=(strategy,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([spec], checks=[J5], include_global=False)
    return result


def test_a_model_whose_own_backward_raises_is_not_judged():
    for strategy in ("model_level", "layer_wise"):
        result = _result(True, strategy)
        assert result.outcome == "not_applicable", (strategy, result.outcome, result.message)
        assert "the un-offloaded model's backward raises" in result.message
        assert "modified by an inplace operation" in result.message


def test_the_same_model_without_the_in_place_write_is_judged():
    for strategy in ("model_level", "layer_wise"):
        result = _result(False, strategy)
        assert result.outcome == "passed", (strategy, result.outcome, result.message)
