"""Defects found by re-running the seeds' own test cases against offload-ref's public API
(issue 8, section 3).  Each test failed on the code before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from offload_ref import (
    OffloadConfig,
    SupportsComponentDiscovery,
    execution_device,
    get_offload_backend,
)
from offload_ref.platform import CpuPlatform
from device_helpers import on_device, resident  # noqa: E402 (tests/ is on sys.path)


@pytest.fixture(autouse=True)
def _inference_without_autograd():
    """These pipelines are called directly, as inference; with grad mode on, the offloaded
    forward would be refused before the defects under test are reached (Note [Autograd])."""
    with torch.no_grad():
        yield


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
        x = x.to(execution_device(self))  # inputs go where the pipeline computes
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
        assert torch.equal(pipeline(x), on_device(reference))  # the next generation recovers
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
    x = x.to(platform.device)
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


# -- 3. an explicitly selected component that does not exist is rejected by the resolver -------


class _DitOnly(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Dit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


@pytest.mark.parametrize("strategy", ["layer_wise", "model_level"])
def test_selecting_a_missing_encoder_is_rejected_by_the_resolver(strategy: str) -> None:
    from offload_ref import OffloadTopologyError, resolve_offload_plan

    config = OffloadConfig(strategy=strategy, components=("dit", "text_encoder"))
    with pytest.raises(OffloadTopologyError, match="_encoder_modules") as info:
        resolve_offload_plan(_DitOnly(), config)
    if strategy == "layer_wise":
        assert "'text_encoder'" in str(info.value)
    # Selecting only what exists still works.
    resolve_offload_plan(_DitOnly(), OffloadConfig(strategy="layer_wise", components=("dit",)))


# -- 4. legacy layerwise leaves a pipeline-managed encoder to the pipeline -------------------


class _ManagedEncoder(nn.Linear):
    def load_to_device(self) -> None:  # the pipeline's own lifecycle (not exercised here)
        pass

    def offload_to_cpu(self) -> None:
        pass


class _OnDemandEncoderPipe(_Pipe):
    from offload_ref import OffloadPlan as _Plan

    _offload_plan = _Plan(on_demand_component_paths=("text_encoder",))
    del _Plan

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = _ManagedEncoder(10, 10)


def test_legacy_layerwise_leaves_an_on_demand_encoder_to_the_pipeline() -> None:
    from types import SimpleNamespace

    from offload_ref import resolve_offload_plan

    config = OffloadConfig.from_od_config(SimpleNamespace(enable_layerwise_offload=True))
    assert config.components == ("dit",) and not config.explicit
    pipeline = _OnDemandEncoderPipe()
    encoder = resolve_offload_plan(pipeline, config).component("text_encoder")
    assert (encoder.on_demand, encoder.selected) == (True, False)
    platform = CpuPlatform()
    backend = get_offload_backend(config, platform=platform)
    backend.enable(pipeline)
    placed = [n for n, p in pipeline.text_encoder.named_parameters() if platform.is_resident(p)]
    assert placed == [], f"the pipeline-managed encoder was placed on the device: {placed}"
    backend.disable()
    platform.close()


# -- 5. the fallback scan finds one module under two encoder names once ----------------------


class _Undeclared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Dit()
        encoder = nn.Linear(10, 10)
        self.text_encoder = encoder
        self.text_encoder_2 = encoder  # one module, two well-known names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(execution_device(self))
        return self.transformer(self.text_encoder_2(self.text_encoder(x)))


def test_fallback_scan_deduplicates_a_module_found_under_two_names() -> None:
    from offload_ref.discovery import discover_components

    pipeline = _Undeclared()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = discover_components(pipeline)
    assert [p for p, _ in found.encoders] == ["text_encoder"]
    torch.manual_seed(0)
    x = torch.randn(2, 10)
    with torch.inference_mode():
        reference = pipeline(x)
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=platform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend.enable(pipeline)
    with torch.inference_mode():
        assert torch.equal(pipeline(x), on_device(reference))
    backend.disable()
    platform.close()


def test_a_module_declared_twice_is_still_rejected() -> None:
    from offload_ref.discovery import discover_components

    class Declared(_Undeclared, SupportsComponentDiscovery):
        _dit_modules = ["transformer"]
        _encoder_modules = ["text_encoder", "text_encoder_2"]

    with pytest.raises(ValueError, match="already declared as 'text_encoder'"):
        discover_components(Declared())


# -- 6. tensor subclasses without readable storage are rejected before mutation --------------


class _Wrapper(torch.Tensor):
    """A minimal wrapper subclass: no storage of its own, every op runs on ``elem``."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   device=elem.device)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        unwrap = lambda x: x.elem if isinstance(x, _Wrapper) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: _Wrapper(x) if isinstance(x, torch.Tensor) else x, out)


def _assert_rejected_before_mutation(pipeline: nn.Module, path: str) -> None:
    from offload_ref import OffloadTopologyError, resolve_offload_plan

    ids = {n: id(t) for n, t in pipeline.state_dict(keep_vars=True).items()}
    for strategy in ("model_level", "layer_wise"):
        config = OffloadConfig(strategy=strategy)
        with pytest.raises(OffloadTopologyError, match=path.replace(".", r"\.")) as info:
            resolve_offload_plan(pipeline, config)
        assert "full_tensor" in str(info.value)  # says what to do
        platform = CpuPlatform()
        backend = get_offload_backend(config, platform=platform)
        with pytest.raises(OffloadTopologyError):
            backend.enable(pipeline)
        assert not backend.is_enabled()
        assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
        platform.close()
    assert {n: id(t) for n, t in pipeline.state_dict(keep_vars=True).items()} == ids


def test_wrapper_subclass_parameter_is_rejected_naming_its_path() -> None:
    pipeline = _Pipe()
    block = pipeline.transformer.blocks[1]
    block.weight = nn.Parameter(_Wrapper(block.weight.detach().clone()), requires_grad=False)
    _assert_rejected_before_mutation(pipeline, "transformer.blocks.1.weight")


def test_dtensor_parameter_is_rejected_naming_its_path(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed import FileStore
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        pipeline = _Pipe()
        encoder = pipeline.text_encoder
        encoder.weight = nn.Parameter(
            distribute_tensor(encoder.weight.detach(), mesh, [Replicate()]))
        _assert_rejected_before_mutation(pipeline, "text_encoder.weight")
    finally:
        dist.destroy_process_group()


# -- 7. a nested parallel_config is read, and contradictions are rejected --------------------


@pytest.mark.parametrize("nested", [
    pytest.param(lambda: __import__("types").SimpleNamespace(use_hsdp=True, data_parallel_size=4),
                 id="attributes"),
    pytest.param(lambda: {"use_hsdp": True, "data_parallel_size": 4}, id="mapping"),
])
def test_nested_parallel_config_is_read(nested) -> None:
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="HSDP"):  # the seeds' shape, with AllGather
        OffloadConfig.from_od_config(SimpleNamespace(
            enable_distributed_layerwise_offload=True, dlo_use_allgather=True,
            parallel_config=nested()))
    config = OffloadConfig.from_od_config(SimpleNamespace(
        enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
        parallel_config=nested()))
    assert (config.world_size, config.use_hsdp) == (4, True)


def test_nested_and_top_level_parallel_facts_must_agree() -> None:
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"data_parallel_size = 2 contradicts "
                                         r"parallel_config\.data_parallel_size = 4"):
        OffloadConfig.from_od_config(SimpleNamespace(
            enable_layerwise_offload=True, data_parallel_size=2,
            parallel_config=SimpleNamespace(data_parallel_size=4)))
    agreeing = OffloadConfig.from_od_config(SimpleNamespace(
        enable_layerwise_offload=True, data_parallel_size=4,
        parallel_config=SimpleNamespace(data_parallel_size=4, use_hsdp=None)))
    assert (agreeing.world_size, agreeing.use_hsdp) == (4, False)


# -- 2. a pipeline built under torch.inference_mode() survives enable and disable -------------


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_pipeline_built_under_inference_mode_works_enabled_and_after_disable(strategy) -> None:
    from offload_ref.fixtures import get_spec

    spec = get_spec("flux2")
    with torch.inference_mode():
        reference = spec.build()(**spec.make_inputs())  # on the host, for the disabled pipeline
        on_the_device = resident(spec.build())(**spec.make_inputs())  # for the enabled one
        pipeline = spec.build()
    ids = {n: id(t) for n, t in pipeline.state_dict(keep_vars=True).items()}
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    with torch.inference_mode():
        assert torch.equal(pipeline(**spec.make_inputs()), on_the_device)
    with torch.no_grad():  # outside inference mode too
        assert torch.equal(pipeline(**spec.make_inputs()), on_the_device)
    backend.disable()
    after = pipeline.state_dict(keep_vars=True)
    assert {n: id(t) for n, t in after.items()} == ids  # the same Parameter objects
    assert all(t.is_inference() for t in after.values() if t.numel())
    with torch.inference_mode():
        assert torch.equal(pipeline(**spec.make_inputs()), reference)
    backend.enable(pipeline)  # and again
    with torch.inference_mode():
        assert torch.equal(pipeline(**spec.make_inputs()), on_the_device)
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_failed_enable_restores_inference_tensors_exactly(strategy) -> None:
    from offload_ref import OffloadEnableError
    from offload_ref.fixtures import get_spec

    spec = get_spec("flux2")
    with torch.inference_mode():
        pipeline = spec.build()
        reference = pipeline(**spec.make_inputs())
    before = {n: (id(t), t.data_ptr()) for n, t in pipeline.state_dict(keep_vars=True).items()}
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())

    def fault(step: int, label: str) -> None:
        if label.startswith("hook"):  # after every rebind
            raise RuntimeError("injected")

    backend.fault_injector = fault
    with pytest.raises(OffloadEnableError):
        backend.enable(pipeline)
    after = pipeline.state_dict(keep_vars=True)
    assert {n: (id(t), t.data_ptr()) for n, t in after.items()} == before
    assert all(t.is_inference() for t in after.values() if t.numel())
    with torch.inference_mode():
        assert torch.equal(pipeline(**spec.make_inputs()), reference)  # both on the host
