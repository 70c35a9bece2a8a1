"""Bad input gets a clear error, and nothing changes (issue 9; catalogue §J.7).

Each test failed on the code before its fix: a raw RecursionError, a 15-megabyte message, a
string flag read as True, a mapping read as "no offload", a sparse buffer reported as a tensor
subclass, a ``__slots__`` pipeline reported as a member_descriptor, a non-weak-referenceable
pipeline left half offloaded."""

from __future__ import annotations

import copy
import types
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
from offload_ref.config import LayerOptions, OffloadStrategy
from offload_ref.plan import OffloadTopologyError, pipeline_state, resolve_offload_plan
from offload_ref.platform import CpuPlatform
from device_helpers import on_device, resident  # noqa: E402 (tests/ is on sys.path)

LAYER_WISE = OffloadStrategy.LAYER_WISE
STRATEGIES = ("model_level", "layer_wise")


def _deep(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# -- config: the constructor names the field -------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, mentions", [
    (dict(strategy=3), ValueError, "OffloadConfig.strategy = 3"),
    (dict(strategy=None), ValueError, "OffloadConfig.strategy"),
    (dict(components=5), TypeError, "OffloadConfig.components = 5"),
    (dict(strategy="layer_wise", components=True), TypeError, "OffloadConfig.components"),
    (dict(strategy="layer_wise", components={"dit": True}), TypeError,
     "OffloadConfig.components"),
    (dict(strategy="layer_wise", components=(1,)), TypeError, "OffloadConfig.components"),
    (dict(strategy="layer_wise", layer_options=5), TypeError, "OffloadConfig.layer_options"),
    (dict(strategy="layer_wise", layer_options={"dit": 3}), TypeError,
     "OffloadConfig.layer_options['dit']"),
    (dict(strategy="layer_wise", layer_options={"dit": {"prefetch": 1}}), ValueError,
     "OffloadConfig.layer_options['dit']: unknown option"),
    (dict(strategy="distributed_layer_wise", layer_options={"dit": {"weight_transfer": "x"}}),
     ValueError, "weight_transfer"),
    (dict(use_hsdp="false"), TypeError, "OffloadConfig.use_hsdp = 'false'"),
    (dict(use_hsdp=[True]), TypeError, "OffloadConfig.use_hsdp"),
    (dict(use_hsdp=1), TypeError, "OffloadConfig.use_hsdp"),
    (dict(explicit="no"), TypeError, "OffloadConfig.explicit"),
    (dict(pin_memory="false"), TypeError, "OffloadConfig.pin_memory"),
    (dict(world_size=True), ValueError, "OffloadConfig.world_size"),
])
def test_constructor_errors_name_the_field(kwargs, error, mentions) -> None:
    with pytest.raises(error) as info:
        OffloadConfig(**kwargs)
    assert mentions in str(info.value), str(info.value)


def test_components_as_one_string_is_rejected_like_the_compact_parser() -> None:
    for components in ("dit", "dit,text_encoder"):
        with pytest.raises(TypeError, match="OffloadConfig.components"):
            OffloadConfig(strategy=LAYER_WISE, components=components)
        with pytest.raises(TypeError, match="components"):
            OffloadConfig.from_mapping({"mode": "layer", "components": components})


def test_a_frozen_config_is_always_hashable() -> None:
    """A list flag used to build a config whose hash() raised."""
    with pytest.raises(TypeError, match="use_hsdp"):
        hash(OffloadConfig(use_hsdp=[True]))


def test_layer_options_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"LayerOptions.weight_transfer = \['allgather'\]"):
        LayerOptions(["allgather"])  # type: ignore[arg-type]


# -- config: boolean flags are booleans ------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "False", "0", [True], 1, 0.0])
def test_from_mapping_use_hsdp_must_be_a_bool(value) -> None:
    with pytest.raises(TypeError) as info:
        OffloadConfig.from_mapping({"mode": "layer", "components": ["dit"]}, use_hsdp=value)
    assert "use_hsdp" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, "2", 2.0, True])
def test_from_mapping_world_size_must_be_an_int(value) -> None:
    with pytest.raises(ValueError, match="world_size"):
        OffloadConfig.from_mapping({"mode": "layer", "components": ["dit"]}, world_size=value)


@pytest.mark.parametrize("flag", ["enable_cpu_offload", "enable_layerwise_offload",
                                  "enable_distributed_layerwise_offload", "pin_cpu_memory",
                                  "dlo_use_allgather", "use_hsdp"])
@pytest.mark.parametrize("value", ["false", [True]])
def test_legacy_boolean_flags_must_be_bools(flag, value) -> None:
    for od in (types.SimpleNamespace(**{flag: value}), {flag: value}):
        with pytest.raises(TypeError) as info:
            OffloadConfig.from_od_config(od)
        assert flag in str(info.value), str(info.value)


# -- config: a mapping given as a diffusion config -------------------------------------------------


def test_from_od_config_reads_a_mappings_keys_as_attributes() -> None:
    mapping = {"enable_layerwise_offload": True, "pin_cpu_memory": False, "model": "x/y",
               "dtype": "bfloat16"}  # unrelated keys are ignored, as an object's attributes are
    config = OffloadConfig.from_od_config(mapping)
    assert config == OffloadConfig.from_od_config(types.SimpleNamespace(**mapping))
    assert config.strategy is LAYER_WISE and config.pin_memory is False
    compact = {"diffusion_offload_config": {"mode": "module", "components": ["dit"]},
               "parallel_config": {"data_parallel_size": 2}}
    assert OffloadConfig.from_od_config(compact) == OffloadConfig.from_mapping(
        compact["diffusion_offload_config"], world_size=2)


@pytest.mark.parametrize("key, hint", [
    ("enable_layerwise_ofload", "enable_layerwise_offload"),  # a near miss
    ("use_hsdb", "use_hsdp"),
    ("enable_sequential_offload", None),  # an offload setting we do not have
    ("dlo_prefetch", None),
])
def test_from_od_config_mapping_rejects_unknown_offload_keys(key, hint) -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_od_config({key: True})
    message = str(info.value)
    assert repr(key) in message and "enable_layerwise_offload" in message
    if hint:
        assert f"did you mean {hint!r}" in message


def test_from_od_config_mapping_rejects_non_string_keys() -> None:
    with pytest.raises(TypeError, match="keys must be attribute names"):
        OffloadConfig.from_od_config({1: True})


# -- config: error messages stay short -------------------------------------------------------------


def test_deeply_nested_value_gets_an_error_not_a_recursion_error() -> None:
    for mapping in ({"mode": "layer", "components": _deep(5000)},
                    {"mode": _deep(5000), "components": ["dit"]},
                    {"mode": "layer", "components": ["dit"],
                     "layer_options": {"dit": {"weight_transfer": _deep(5000)}}}):
        with pytest.raises((TypeError, ValueError)) as info:
            OffloadConfig.from_mapping(mapping)
        assert len(str(info.value)) < 1000
    with pytest.raises(TypeError, match="OffloadConfig.components") as info:
        OffloadConfig(strategy=LAYER_WISE, components=_deep(5000))
    assert len(str(info.value)) < 1000


@pytest.mark.parametrize("mapping", [
    {"mode": "layer", "components": list(range(5_000_000))},
    {"mode": "layer", "components": ["dit"] * 5_000_000},
    {"mode": "x" * 5_000_000, "components": ["dit"]},
    {"mode": "layer", "components": ["dit"], "pin_memory": list(range(5_000_000))},
    {"mode": "layer", "components": ["dit"], ("k",) * 1_000_000: 1},
])
def test_error_messages_quote_huge_values_abbreviated(mapping) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        OffloadConfig.from_mapping(mapping)
    assert len(str(info.value)) < 1000, len(str(info.value))


def test_short_values_are_still_quoted_exactly() -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_mapping({"mode": "layer", "components": ["dit", "text-encoder"]})
    assert "['dit', 'text-encoder']" in str(info.value)
    options = {"weight_transfer": "allgather", "resident_layers": 2}
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_mapping({"mode": "layer", "components": ["dit"],
                                    "layer_options": {"dit": options}})
    assert repr(options) in str(info.value)  # insertion order, as repr() prints it


# -- pipelines -------------------------------------------------------------------------------------


class _Dit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Dit()
        self.text_encoder = nn.Linear(4, 4)


def _state(pipeline) -> dict:
    """Identity, storage and values of every tensor, and the hooks, of a (possibly non-module)
    pipeline's components (taken without walking a cycle: call it before adding one)."""
    roots = [("", pipeline)] if isinstance(pipeline, nn.Module) else [
        ("transformer.", pipeline.transformer), ("text_encoder.", pipeline.text_encoder)]
    out = {}
    for prefix, root in roots:
        for name, t in list(root.named_parameters()) + list(root.named_buffers()):
            dense = t.layout is torch.strided
            out[prefix + name] = (id(t), t.layout, t.untyped_storage().data_ptr() if dense else 0,
                                  t.detach().clone() if dense else t.to_dense().clone())
        for name, m in root.named_modules():
            out[f"hooks {prefix}{name}"] = (len(m._forward_pre_hooks), len(m._forward_hooks),
                                            sorted(k for k in vars(m) if k.startswith("_offload")))
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith("hooks"):
            assert a[key] == b[key], key
        else:
            assert a[key][:3] == b[key][:3] and torch.equal(a[key][3], b[key][3]), key


def _enable_is_rejected_cleanly(pipeline, strategy: str, error, match: str,
                                before: dict | None = None) -> None:
    """``enable`` raises ``error`` before any mutation: no hooks, no bytes, same tensors."""
    before = _state(pipeline) if before is None else before
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    with pytest.raises(error, match=match):
        backend.enable(pipeline)
    assert not backend.is_enabled() and backend.last_steps == []
    assert platform.memory_allocated() == 0 and platform.pinned_bytes() == 0
    return before


# -- non-strided tensors ---------------------------------------------------------------------------


_LAYOUTS = {
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.to_sparse_csr(),
}
if torch.backends.mkldnn.is_available():
    _LAYOUTS["mkldnn"] = lambda t: t.to_mkldnn()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("where", ["transformer.blocks.1", "text_encoder", ""])
def test_non_strided_buffer_is_rejected_by_the_resolver(strategy, layout, where) -> None:
    pipeline = _Pipe()
    owner = pipeline.get_submodule(where) if where else pipeline
    owner.register_buffer("kit_sparse", _LAYOUTS[layout](torch.eye(4)))
    path = f"{where}.kit_sparse" if where else "kit_sparse"
    config = OffloadConfig(strategy=strategy)
    with pytest.raises(OffloadTopologyError) as info:
        resolve_offload_plan(pipeline, config)
    message = str(info.value)
    assert repr(path) in message and "to_dense()" in message, message
    assert "torch." + layout.replace("mkldnn", "_mkldnn") in message, message
    _same(_enable_is_rejected_cleanly(pipeline, strategy, OffloadTopologyError, "to_dense"),
          _state(pipeline))


def test_sparse_parameter_of_a_non_module_pipeline_is_rejected() -> None:
    pipeline = types.SimpleNamespace(transformer=_Dit(), text_encoder=nn.Linear(4, 4))
    pipeline.transformer.blocks[0].extra = nn.Parameter(torch.eye(4).to_sparse(),
                                                        requires_grad=False)
    with pytest.raises(OffloadTopologyError, match=r"'transformer.blocks.0.extra'.*sparse"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolve_offload_plan(pipeline, OffloadConfig(strategy=LAYER_WISE))


# -- cyclic module graphs --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("child, ancestor, cycle", [
    ("transformer.blocks.2", "transformer", "'transformer.blocks.2.kit_loop' -> 'transformer'"),
    ("text_encoder", "", "'text_encoder.kit_loop' -> '' (the pipeline)"),
    ("transformer.blocks.0", "transformer.blocks.0",
     "'transformer.blocks.0.kit_loop' -> 'transformer.blocks.0'"),
])
def test_cyclic_module_graph_is_rejected_naming_the_cycle(strategy, child, ancestor,
                                                          cycle) -> None:
    pipeline = _Pipe()
    before = _state(pipeline)
    target = pipeline.get_submodule(ancestor) if ancestor else pipeline
    pipeline.get_submodule(child)._modules["kit_loop"] = target
    with pytest.raises(OffloadTopologyError) as info:
        resolve_offload_plan(pipeline, OffloadConfig(strategy=strategy))
    assert cycle in str(info.value) and "cycle" in str(info.value), str(info.value)
    _enable_is_rejected_cleanly(pipeline, strategy, OffloadTopologyError, "cycle", before)
    del pipeline.get_submodule(child)._modules["kit_loop"]
    _same(before, _state(pipeline))


def test_cycle_inside_a_component_of_a_non_module_pipeline_is_rejected() -> None:
    pipeline = types.SimpleNamespace(transformer=_Dit(), text_encoder=nn.Linear(4, 4))
    pipeline.transformer.blocks[1]._modules["kit_loop"] = pipeline.transformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OffloadTopologyError, match="'transformer.blocks.1.kit_loop'"):
            resolve_offload_plan(pipeline, OffloadConfig(strategy=LAYER_WISE))


def test_pipeline_state_rejects_a_cycle() -> None:
    pipeline = _Pipe()
    pipeline.text_encoder._modules["kit_loop"] = pipeline
    with pytest.raises(OffloadTopologyError, match="'text_encoder.kit_loop'"):
        pipeline_state(pipeline, [])


def test_a_module_shared_by_two_parents_is_not_a_cycle() -> None:
    pipeline = _Pipe()
    pipeline.shared_head = pipeline.text_encoder  # two paths to one module: a DAG, not a cycle
    plan = resolve_offload_plan(pipeline, OffloadConfig(strategy="model_level"))
    assert plan.dits and plan.encoders


# -- pipelines that are not plain objects ----------------------------------------------------------


class _SlotsPipe:  # declares its components without the mixin (which would add a __dict__)
    __slots__ = ("transformer", "text_encoder", "unset")
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        # Frozen, as inference pipelines are (a grad-mode forward through offloaded weights
        # that require grad is refused, Note [Autograd]).
        self.transformer = _Dit().requires_grad_(False)
        self.text_encoder = nn.Linear(4, 4).requires_grad_(False)


class _OwnableSlotsPipe(_SlotsPipe):
    __slots__ = ("__dict__", "__weakref__")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_slots_pipeline_is_resolved_from_its_slot_values(strategy) -> None:
    pipeline = _SlotsPipe()
    plan = resolve_offload_plan(pipeline, OffloadConfig(strategy=strategy))
    assert plan.component("transformer").module is pipeline.transformer
    assert plan.component("text_encoder").module is pipeline.text_encoder


def test_unset_slot_is_a_missing_declaration() -> None:
    class Pipe(_SlotsPipe):
        __slots__ = ()
        _encoder_modules = ["text_encoder", "unset"]

    with pytest.raises(OffloadTopologyError, match="'unset' does not exist"):
        resolve_offload_plan(Pipe(), OffloadConfig(strategy="model_level"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_slots_pipeline_with_dict_and_weakref_is_offloaded(strategy) -> None:
    pipeline = _OwnableSlotsPipe()
    x = torch.randn(2, 4)
    twin = resident(copy.deepcopy(pipeline))  # the reference of the offloaded run
    want = twin.transformer(twin.text_encoder(on_device(x)))
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    assert backend.is_enabled()
    got = pipeline.transformer(pipeline.text_encoder(x.to(execution_device(pipeline))))
    torch.testing.assert_close(got, want)
    backend.disable()
    assert not hasattr(pipeline, "_offload_ref_backend")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("make", [
    _SlotsPipe,
    lambda: types.SimpleNamespace(transformer=_Dit().requires_grad_(False),
                                  text_encoder=nn.Linear(4, 4).requires_grad_(False)),
], ids=["slots", "simple_namespace"])
def test_non_weakrefable_pipeline_enable_is_clean_or_supported(strategy, make) -> None:
    """enable used to fail after its commit (the weak reference is taken last): nothing rolled
    back, a block left NaN, and the pipeline marked as owned forever.  Now it is rejected before
    the first mutation, and can be retried (here: by a supported pipeline kind)."""
    pipeline = make()
    x = torch.randn(2, 4)
    want = pipeline.transformer(pipeline.text_encoder(x))  # on the host, for the disabled one
    twin = resident(copy.deepcopy(pipeline))  # the reference of the offloaded run
    want_on_device = twin.transformer(twin.text_encoder(on_device(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SimpleNamespace declares nothing: the scan warns
        before = _state(pipeline)
        platform = CpuPlatform()
        backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
        try:
            backend.enable(pipeline)
        except TypeError as exc:
            assert "weak reference" in str(exc) or "__dict__" in str(exc), str(exc)
            assert type(pipeline).__name__ in str(exc)
            if make is _SlotsPipe:  # the attribute to change, where it is, and to what
                assert "test_bad_input._SlotsPipe.__slots__ (" in str(exc), str(exc)
                assert "test_bad_input.py:" in str(exc)
                assert "('transformer', 'text_encoder', 'unset', '__dict__')" in str(exc)
            assert not backend.is_enabled() and backend.last_steps == []
            assert platform.memory_allocated() == 0
            _same(before, _state(pipeline))
            assert getattr(pipeline, "_offload_ref_backend", None) is None
        else:  # supported: it must work and undo exactly
            assert backend.is_enabled()
            got = pipeline.transformer(pipeline.text_encoder(x.to(execution_device(pipeline))))
            torch.testing.assert_close(got, want_on_device)
            backend.disable()
            assert getattr(pipeline, "_offload_ref_backend", None) is None
    torch.testing.assert_close(pipeline.transformer(pipeline.text_encoder(x)), want)


class _LazyDit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.LazyLinear(4), nn.Linear(4, 4)])


class _LazyPipe(nn.Module):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(3, 3)
        self.transformer = _LazyDit()

    def forward(self) -> torch.Tensor:  # never reaches the lazy block: it stays uninitialized
        return self.text_encoder(torch.ones(1, 3, device=self.text_encoder.weight.device))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_uninitialized_lazy_parameter_is_a_topology_error_naming_it(strategy) -> None:
    """Before: torch's raw ValueError from deep inside the resolver (issue 22, class 8)."""
    pipeline = _LazyPipe()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    with pytest.raises(OffloadTopologyError,
                       match=r"'transformer\.blocks\.0\.weight' is uninitialized.*one forward"):
        backend.enable(pipeline)
    assert not backend.is_enabled()
    pipeline.transformer.blocks[0](torch.zeros(1, 3))  # one forward: now it can be offloaded
    backend.enable(pipeline)
    backend.disable()


def test_a_pipeline_enable_rejects_untouched_is_not_blamed_on_the_offloader() -> None:
    """Before: each rollback check asked "does the backend use a Transaction?" of a pipeline
    the resolver rejected before any mutation (issue 22): the author's topology, not the
    offloader's defect.  Now: one preflight error with the resolver's own message, and the
    checks not run."""
    from offload_ref.contracts import PipelineSpec
    from offload_ref.contracts.runner import run_checks

    spec = PipelineSpec(name="lazy", factory="test_bad_input:_LazyPipe",
                        inputs="test_bad_input:_no_inputs", strategies=("layer_wise",))
    results = run_checks([spec], checks=["check_failed_enable_restores_the_pipeline",
                                         "check_failed_enable_releases_memory_and_chains_the_cause",
                                         "check_failed_enable_can_be_retried"],
                         include_global=False)
    [root] = [r for r in results if r.id.check == "preflight"]
    assert root.outcome == "error" and "is uninitialized" in root.message, root.message
    others = [r for r in results if r is not root]
    assert len(others) == 3
    for r in others:  # not run: the plan does not resolve (one root cause, reported once)
        assert r.outcome == "not_applicable", (r.outcome, r.message)
        assert "Transaction" not in r.message and "does not resolve" in r.message


def _no_inputs(seed: int = 0) -> dict:
    return {}
