"""Pipelines with one placement bug each (tests/test_placement.py).  Each passes the kit when
host and device are both the CPU, and breaks a GPU generation: on the simulated accelerator it
fails with torch's same-device error."""

from __future__ import annotations

from typing import Any

import torch

from offload_ref.contracts import PipelineSpec
from offload_ref.fixtures._common import build, prompt_inputs
from offload_ref.fixtures.sd3 import StableDiffusion3Pipeline


class HostInputsPipeline(StableDiffusion3Pipeline):
    """Bug: the prompt and the noise stay on the host (the pipeline never moves its inputs)."""

    def execution_device(self) -> torch.device:
        return torch.device("cpu")


class DeviceFromOffloadedComponentPipeline(StableDiffusion3Pipeline):
    """Bug: the execution device is read from the transformer, which model-level offload parks on
    the host between its calls (diffusers' ``self.device`` without hooks)."""

    def execution_device(self) -> torch.device:
        return next(self.transformer.parameters()).device


class AdapterPipeline(StableDiffusion3Pipeline):
    """Correct as it is; an ``adapter`` module attached later (a LoRA-like add-on) is applied to
    the transformer's output."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        out = super().predict(latents, sigma, step, cond)
        adapter = self.__dict__.get("_modules", {}).get("adapter")
        return out if adapter is None else out + adapter(out)


class AttachesAdapterInItsCall(AdapterPipeline):
    """Attaches its ``adapter`` during its first call, while offload is enabled."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        if "adapter" not in self._modules:
            adapter = torch.nn.Linear(latents.shape[-1], latents.shape[-1])
            with torch.no_grad():
                adapter.weight.fill_(0.01), adapter.bias.zero_()
            self.adapter = adapter.to(latents.device)
        return super().predict(latents, sigma, step, cond)


def build_attaches_adapter(seed: int = 0) -> AttachesAdapterInItsCall:
    return build(AttachesAdapterInItsCall, seed)


def _spec(name: str, cls: str) -> PipelineSpec:
    return PipelineSpec(name=name, factory=f"{__name__}:build_{cls}",
                        inputs=f"{__name__}:make_inputs",
                        strategies=("model_level", "layer_wise"))


def build_host_inputs(seed: int = 0) -> HostInputsPipeline:
    return build(HostInputsPipeline, seed)


def build_device_from_offloaded(seed: int = 0) -> DeviceFromOffloadedComponentPipeline:
    return build(DeviceFromOffloadedComponentPipeline, seed)


def build_adapter(seed: int = 0) -> AdapterPipeline:
    return build(AdapterPipeline, seed)


def make_inputs(seed: int = 0) -> dict[str, Any]:
    return prompt_inputs(seed)


HOST_INPUTS = _spec("host_inputs", "host_inputs")
DEVICE_FROM_OFFLOADED = _spec("device_from_offloaded", "device_from_offloaded")
