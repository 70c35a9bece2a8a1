"""The checks of a pipeline without a DiT (A.5, A.6; H.5's skipped rank too) make the kit's
pipeline one by emptying ``_dit_modules`` on the instance.  A pipeline declaring a resident head
(``OffloadPlan.layerwise_resident_layers``, as model-authors §2 shows) then kept a head naming a
DiT that the kit had removed, and the resolver's refusal ("declare 'transformer' in
_dit_modules") was reported as the author's error (found by two outside model authors, on
Mochi and QwenImage).  ``declare_no_dit`` drops the head with the DiT."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery, execution_device
from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.facts import declare_no_dit
from offload_ref.contracts.runner import run_checks


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class _HeadPipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ["blocks"]},
                                layerwise_resident_layers={"transformer": 1})

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(8, 8)
        self.transformer = _Dit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.text_encoder(x.to(execution_device(self))))


def _inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(1, 8, generator=torch.Generator().manual_seed(seed))}


SPEC = PipelineSpec(name="resident_head", factory=lambda: _HeadPipe().eval(), inputs=_inputs,
                    strategies=("model_level", "layer_wise"))
NO_DIT_CHECKS = ["check_legacy_topology_without_dit_is_a_recorded_noop",
                 "check_model_level_without_dit_is_rejected"]


def test_the_no_dit_checks_pass_on_a_pipeline_that_declares_a_resident_head():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([SPEC], checks=NO_DIT_CHECKS, include_global=False)
    assert len(results) == 3  # A.6 under both strategies, A.5 under model level
    assert all(r.outcome == "passed" for r in results), [(str(r.id), r.message) for r in results]


def test_declare_no_dit_drops_the_head_on_the_instance_only():
    pipe = _HeadPipe()
    declare_no_dit(pipe)
    assert pipe._dit_modules == [] and _HeadPipe._dit_modules == ["transformer"]
    assert pipe._offload_plan.layerwise_resident_layers == {}
    assert pipe._offload_plan.block_attrs == _HeadPipe._offload_plan.block_attrs
    assert _HeadPipe._offload_plan.layerwise_resident_layers == {"transformer": 1}


def test_a_head_naming_no_dit_is_still_refused_when_the_author_declares_it():
    from offload_ref import OffloadTopologyError
    from offload_ref.plan import resolve_offload_plan
    from offload_ref.config import OffloadConfig

    pipe = _HeadPipe()
    pipe.__dict__["_dit_modules"] = []  # the author's own pipeline, head and all
    with pytest.raises(OffloadTopologyError, match="layerwise_resident_layers names 'transformer'"):
        resolve_offload_plan(pipe, OffloadConfig(strategy="layer_wise"))
