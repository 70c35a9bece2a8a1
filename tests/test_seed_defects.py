"""Defects found by re-running the seeds' own test cases against offload-ref's public API
(issue 8, section 3).  Each test failed on the code before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, SupportsComponentDiscovery, get_offload_backend
from offload_ref.platform import CpuPlatform


class _Dit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))
        if torch.float64 in dtypes:  # a second dtype: a second flat buffer per load
            self.register_buffer("scale64", torch.ones(10, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__()
        self.transformer = _Dit(dtypes)
        self.text_encoder = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.text_encoder(x))


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict(keep_vars=True).items()}


# -- 1. a failed component load releases what it allocated ------------------------------------


def _failing_after(n: int, exc: BaseException, real):
    calls = []

    def fn(*args, **kwargs):
        calls.append(args)
        if len(calls) > n:
            raise exc
        return real(*args, **kwargs)

    return fn


@pytest.mark.parametrize("exc", [RuntimeError("copy failed"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_failed_model_level_load_releases_its_device_buffers(exc: BaseException) -> None:
    torch.manual_seed(0)
    pipeline, x = _Pipe(), torch.randn(2, 10)
    reference = pipeline(x).detach()
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=platform)
    backend.enable(pipeline)
    baseline = platform.memory_allocated()
    real = platform.copy_
    platform.copy_ = _failing_after(0, exc, real)
    with pytest.raises(type(exc)):
        pipeline(x)  # the encoder's load fails
    platform.copy_ = real
    assert platform.memory_allocated() == baseline, "the failed load kept its device buffers"
    assert backend.loaded_components() == ()
    assert not any(platform.is_resident(p) for p in pipeline.text_encoder.parameters())
    with torch.inference_mode():
        assert torch.equal(pipeline(x), reference)  # the next generation recovers
    backend.disable()
    assert platform.memory_allocated() == 0
    platform.close()


def test_allocation_failure_on_a_second_dtype_releases_the_first() -> None:
    torch.manual_seed(0)
    pipeline, x = _Pipe(dtypes=(torch.float32, torch.float64)), torch.randn(2, 10)
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=platform)
    backend.enable(pipeline)
    baseline = platform.memory_allocated()
    with torch.inference_mode():
        pipeline.text_encoder(x)  # the encoder is resident now; the DiT (two dtypes) is next
    real = platform.empty
    platform.empty = _failing_after(1, MemoryError("device out of memory"), real)
    with pytest.raises(MemoryError):
        pipeline.transformer(x)
    platform.empty = real
    assert platform.memory_allocated() == baseline, "the first dtype's buffer leaked"
    assert not any(platform.is_resident(t) for t in pipeline.transformer.state_dict().values())
    backend.disable()
    assert platform.memory_allocated() == 0
    platform.close()


class _SplitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from offload_ref import ComponentGroups

        self.reasoner = nn.Linear(10, 10)
        self.generator = nn.Linear(10, 10)
        self.groups = ComponentGroups({"reasoner": [self.reasoner],
                                       "generator": [self.generator]})


@pytest.mark.parametrize("exc", [RuntimeError("pinning failed"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_interrupted_component_groups_enable_rolls_back(exc: BaseException) -> None:
    torch.manual_seed(0)
    model = _SplitModel()
    before = _values(model)
    ids = {n: id(t) for n, t in model.state_dict(keep_vars=True).items()}
    platform = CpuPlatform()
    real = platform.host_empty
    platform.host_empty = _failing_after(1, exc, real)  # the second group's master fails
    with pytest.raises((type(exc), RuntimeError)) as info:
        model.groups.enable(platform=platform)
    assert isinstance(info.value, type(exc)) or isinstance(info.value.__cause__, type(exc))
    platform.host_empty = real
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    assert not model.groups.enabled
    after = model.state_dict(keep_vars=True)
    assert {n: id(t) for n, t in after.items()} == ids
    assert all(torch.equal(before[n], after[n]) for n in before)
    model.groups.enable(platform=platform)  # retryable
    model.groups.disable()
    platform.close()


def test_failed_component_groups_swap_in_releases_its_device_buffers() -> None:
    model = _SplitModel()
    platform = CpuPlatform()
    model.groups.enable(platform=platform)
    real = platform.copy_
    platform.copy_ = _failing_after(0, KeyboardInterrupt(), real)
    with pytest.raises(KeyboardInterrupt):
        with model.groups.context("reasoner"):
            pass
    platform.copy_ = real
    assert platform.memory_allocated() == 0
    assert model.groups.active() is None
    model.groups.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()
