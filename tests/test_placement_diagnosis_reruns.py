"""The placement diagnosis of a device error reruns what the check did and names the party:

* a device error after ``disable()`` that an offloader caused by leaving a weight on the device
  names the offloader: the diagnosis knows where the pipeline was built with each tensor (an
  outside engine author: it said it "cannot tell which party placed them");
* a check that enabled a config of its own (auto mode at a budget) is rerun with that config,
  not the row's strategy (an outside model author: "not reproduced" on the layer_wise row of
  the auto check, whose budget had picked model level)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery
from offload_ref.contracts import PipelineSpec

from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import BROKEN
from offload_ref.fixtures import get_spec


def test_a_weight_disable_left_on_the_device_is_blamed_on_the_offloader():
    factory, _ = BROKEN["simple_forgets_a_device"]
    impl = offloader_implementation(factory, name="simple_forgets_a_device", validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([get_spec("flux2")],
                               checks=["check_enable_disable_cycles_match_the_reference"],
                               strategies=("model_level",), include_global=False, impl=impl)
    assert result.outcome in ("failed", "error"), (result.outcome, result.message)
    assert "but the pipeline was built with it on cpu" in result.message, result.message
    assert "disable() did not put it back" in result.message
    assert "At fault: the offloader" in result.message
    assert "cannot tell which party placed them" not in result.message


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class _DeviceFromTheDit(nn.Module, SupportsComponentDiscovery):
    """Takes its device from a DiT weight: where a strategy parks the DiT, the input lands on
    the host (the author's slip the diagnosis must name)."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ["blocks"]})

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(8, 8)
        self.transformer = _Dit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.text_encoder(x.to(self.transformer.proj.weight.device))
        return self.transformer(x)


def _inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(1, 8, generator=torch.Generator().manual_seed(seed))}


def test_a_device_error_under_auto_mode_is_rerun_with_the_auto_config():
    spec = PipelineSpec(name="device_from_the_dit", factory=lambda: _DeviceFromTheDit().eval(),
                        inputs=_inputs, strategies=("layer_wise",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([spec], checks=[
            "check_auto_mode_measured_peak_never_exceeds_the_budget"], include_global=False)
    assert result.outcome in ("failed", "error"), (result.outcome, result.message)
    assert "not reproduced" not in result.message, result.message
    assert "Its device came from a weight the offloader had moved off the device" in \
        result.message, result.message
