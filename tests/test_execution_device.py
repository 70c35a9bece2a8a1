"""``offload_ref.execution_device(pipeline)`` answers the device a pipeline computes on under any
offloader, not only offload-ref's (issue 33, outsider item 2).  Before, with no offload-ref backend
it answered the first parameter's device: under a correct foreign model-level offloader that parks
the transformer on the host between its calls, ``cpu``, and a correct pipeline asking it as the
docs say made its latents on the host and was blamed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref import execution_device
from offload_ref.platform import simulated

needs_sim = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")
DEVICE = torch.device("hpu", 0)


class Pipeline:
    """A plain-object pipeline: a transformer (the offloaded component, listed first) and a VAE
    (kept resident); it asks ``execution_device`` where its latents belong, as the docs say."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer = nn.Linear(4, 4)
        self.vae = nn.Linear(4, 4)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(execution_device(self))
        return self.vae(self.transformer(x)).cpu()


class ModelLevelSwapper:
    """A foreign model-level offloader: the transformer lives on the host and its hooks move it to
    the device around its forward; everything else moves to the device at enable()."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.handles = device, []

    def enable(self, pipeline: Any) -> None:
        pipeline.vae.to(self.device)
        module = pipeline.transformer
        self.handles = [
            module.register_forward_pre_hook(lambda m, a: m.to(self.device) and None),
            module.register_forward_hook(lambda m, a, out: m.to("cpu") and None)]

    def disable(self) -> None:
        for h in self.handles:
            h.remove()


@needs_sim
def test_under_a_foreign_model_level_offloader_the_device_it_computes_on() -> None:
    pipeline = Pipeline()
    x = torch.randn(2, 4)
    expected = Pipeline().__call__(x)  # on the host, un-offloaded
    offloader = ModelLevelSwapper(DEVICE)
    offloader.enable(pipeline)
    try:
        assert pipeline.transformer.weight.device.type == "cpu"  # parked between calls
        assert execution_device(pipeline) == DEVICE
        out = pipeline(x)  # before: x stayed on the host and met the VAE on hpu:0
        assert pipeline.transformer.weight.device.type == "cpu"
    finally:
        offloader.disable()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@needs_sim
def test_a_pipeline_moved_whole_to_the_device_computes_there_under_no_offloader() -> None:
    pipeline = Pipeline()
    pipeline.transformer.to(DEVICE)
    pipeline.vae.to(DEVICE)
    assert execution_device(pipeline) == DEVICE
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to(DEVICE)
    assert execution_device(module) == DEVICE


def test_with_no_offloader_on_the_host_it_is_the_cpu() -> None:
    assert execution_device(Pipeline()) == torch.device("cpu")
    assert execution_device(SimpleNamespace()) == torch.device("cpu")
    assert execution_device(nn.Linear(2, 2, device="meta")) == torch.device("cpu")


@pytest.mark.parametrize("declared", [torch.device("hpu", 1), "hpu:1"])
def test_a_device_an_offloaders_hooks_declare_wins_over_where_tensors_are(declared: Any) -> None:
    """accelerate's hooks (``_hf_hook.execution_device``), as diffusers' sequential CPU offload
    installs them, leave every tensor on the host (or meta): only the hook knows the device."""
    pipeline = Pipeline()
    pipeline.transformer._hf_hook = SimpleNamespace(execution_device=declared)
    assert execution_device(pipeline) == torch.device("hpu", 1)
    pipeline.transformer._hf_hook = SimpleNamespace(
        hooks=[SimpleNamespace(), SimpleNamespace(execution_device=declared)])  # SequentialHook
    assert execution_device(pipeline) == torch.device("hpu", 1)


def test_accelerates_own_hook_class_is_read() -> None:
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    pipeline = Pipeline()
    pipeline.transformer._hf_hook = accelerate_hooks.AlignDevicesHook(
        execution_device=torch.device("hpu", 1))
    assert execution_device(pipeline) == torch.device("hpu", 1)


@needs_sim
def test_diffusers_group_offloading_declares_its_onload_device() -> None:
    pytest.importorskip("diffusers")
    from diffusers.hooks import apply_group_offloading

    pipeline = Pipeline()
    pipeline.transformer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_group_offloading(pipeline.transformer, onload_device=torch.device("hpu", 1),
                           offload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    assert pipeline.transformer[0].weight.device.type == "cpu"
    assert execution_device(pipeline) == torch.device("hpu", 1)
