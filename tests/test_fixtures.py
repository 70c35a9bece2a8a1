"""The fixture pipelines themselves: registry, determinism, speed, declarations, and the tricky
shapes each one documents (see ``offload_ref.fixtures`` and Note [Fixture pipelines]).

These tests run no offload backend (except Cosmos3's own delegated swap): they check that the
fixtures are what the conformance kit assumes they are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.config import OffloadConfig
from offload_ref.discovery import discover_components
from offload_ref.fixtures import SPECS, get_spec
from offload_ref.plan import OffloadPlan, ResolvedOffloadPlan, resolve_offload_plan
from offload_ref.plan.tree import tensor_leaves, wrapper_inner
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

SPEC_IDS = [spec.name for spec in SPECS]
LAYERWISE_SPECS = [s for s in SPECS if s.supports("layer_wise")]
MODEL_LEVEL_SPECS = [s for s in SPECS if s.supports("model_level")]
DISTRIBUTED_SPECS = [s for s in SPECS if s.supports("distributed_layer_wise")]

# The seeds' "Supported Models" table: model-level where it has a tick, layerwise for every
# architecture; distributed layerwise wherever layerwise streams (the table ticks Cosmos3; the
# strategy is the same ring with another transport, and catalogue §H runs on every streaming
# fixture).
EXPECTED_STRATEGIES = {
    "bagel": ("layer_wise", "distributed_layer_wise"),
    "cosmos3": ("model_level", "layer_wise", "distributed_layer_wise"),
    "flux2": ("model_level", "layer_wise", "distributed_layer_wise"),
    "longcat_image": ("layer_wise", "distributed_layer_wise"),
    "nextstep": ("layer_wise", "distributed_layer_wise"),
    "ovis_image": ("layer_wise", "distributed_layer_wise"),
    "qwen_image": ("model_level", "layer_wise", "distributed_layer_wise"),
    "quantized_dit": ("model_level", "layer_wise", "distributed_layer_wise"),
    "sd3": ("layer_wise", "distributed_layer_wise"),
    "sdxl": ("model_level", "layer_wise", "distributed_layer_wise"),
    "soulx_singer": ("model_level", "layer_wise", "distributed_layer_wise"),
    "wan22_i2v": ("model_level", "layer_wise", "distributed_layer_wise"),
    "wan22_t2v": ("model_level", "layer_wise", "distributed_layer_wise"),
}

# How many times each DiT ring runs per generation with the default inputs (3 steps): the phase
# pattern of the original (CFG doubles SDXL; Wan2.2 switches experts after the first step;
# Cosmos3's reasoner runs once).
EXPECTED_RING_PASSES = {
    "bagel": {"language_model.model": 3},
    "cosmos3": {"transformer": 3, "transformer.language_model": 1},
    "flux2": {"transformer": 3},
    "longcat_image": {"transformer": 3},
    "nextstep": {"model": 3},
    "ovis_image": {"transformer": 3},
    "qwen_image": {"transformer": 3},
    "quantized_dit": {"transformer": 3},
    "sd3": {"transformer": 3},
    "sdxl": {"unet": 6},
    "soulx_singer": {"cfm_decoder.model.diff_estimator": 3},
    "wan22_i2v": {"transformer": 1, "transformer_2": 2},
    "wan22_t2v": {"transformer": 1, "transformer_2": 2},
}

EXPECTED_RING_LENGTHS = {
    "bagel": {"language_model.model": 4},
    "cosmos3": {"transformer": 3, "transformer.language_model": 3},
    "flux2": {"transformer": 5},
    "longcat_image": {"transformer": 4},
    "nextstep": {"model": 4},
    "ovis_image": {"transformer": 3},
    "qwen_image": {"transformer": 4},
    "quantized_dit": {"transformer": 4},
    "sd3": {"transformer": 3},
    "sdxl": {"unet": 6},
    "soulx_singer": {"cfm_decoder.model.diff_estimator": 5},
    "wan22_i2v": {"transformer": 2, "transformer_2": 3},
    "wan22_t2v": {"transformer": 3, "transformer_2": 2},
}

# Which fixture carries which shape that breaks naive offloaders (as their docstrings say).
DOCUMENTED_SHAPES = {
    "non_persistent_buffer_in_block": {"nextstep", "soulx_singer"},
    "non_persistent_buffer_in_non_block_dit_state": {
        "bagel", "cosmos3", "flux2", "soulx_singer", "wan22_i2v", "wan22_t2v"},
    "non_contiguous_parameter_in_block": {"longcat_image", "quantized_dit"},
    "wrapper_subclass_weight_in_block": {"quantized_dit"},
    "float8_weight_in_block": {"quantized_dit"},
    "wrapper_subclass_weight_in_non_block_dit_state": {"quantized_dit"},
    "block_with_several_dtypes": {"soulx_singer"},
    "dit_parameter_aliasing_a_block_parameter": {"qwen_image"},
    "non_block_view_of_block_storage": {"sd3"},
    "heterogeneous_block_sizes_in_one_ring": {"flux2", "longcat_image", "ovis_image", "sdxl"},
    "two_dit_rings": {"cosmos3", "wan22_i2v", "wan22_t2v"},
    "odd_ring_length": {
        "cosmos3", "flux2", "ovis_image", "sd3", "soulx_singer", "wan22_i2v", "wan22_t2v"},
    "even_ring_length": {
        "bagel", "longcat_image", "nextstep", "qwen_image", "sdxl", "wan22_i2v", "wan22_t2v"},
    "parameters_in_several_dtypes": {"cosmos3", "soulx_singer"},
    "tensor_smaller_than_its_storage": {"sd3", "soulx_singer"},
    "resident_nested_in_a_dit": {"soulx_singer"},
}


@pytest.fixture(autouse=True, scope="module")
def _single_intra_op_thread() -> Iterator[None]:
    """The fixtures' ops are tiny: intra-op threads only add OpenMP wake-ups, and on a loaded
    machine each wake-up can cost a scheduler quantum (hundreds of ms per generation)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- helpers -------------------------------------------------------------------------------------


def _run(pipe: nn.Module, spec: Any, **overrides: Any) -> torch.Tensor:
    inputs = spec.make_inputs()
    inputs.update(overrides)
    return pipe(**inputs)


def _layerwise_plan(pipe: nn.Module) -> ResolvedOffloadPlan:
    return resolve_offload_plan(pipe, OffloadConfig(strategy="layer_wise"))


def _dit_paths(pipe: nn.Module) -> list[str]:
    """Every declared DiT path, including nested ones that discovery folds into their parent."""
    return list(type(pipe)._dit_modules)


def _declared_containers(pipe: nn.Module) -> list[tuple[str, Any]]:
    """(dotted path, object) of every block container the pipeline declares, by any route."""
    plan = getattr(pipe, "_offload_plan", None) or OffloadPlan()
    found = []

    def add(owner_path: str, names: Any) -> None:
        owner = pipe.get_submodule(owner_path)
        for name in names:
            found.append((f"{owner_path}.{name}", owner.get_submodule(name)))

    for path in _dit_paths(pipe):
        dit = pipe.get_submodule(path)
        names = plan.block_attrs.get(path, getattr(dit, "_layerwise_offload_blocks_attrs", ()))
        add(path, names)
    for path, names in plan.encoder_block_attrs.items():
        add(path, names)
    for path, name in plan.offload_submodules.items():
        add(path, [name])
    return found


@contextmanager
def _perturbed(tensor: torch.Tensor) -> Iterator[None]:
    """``tensor`` += 1 in place for the block, restored bit-exactly afterwards (a wrapper
    subclass: its first inner tensor; a float8 tensor, which has no arithmetic: its bits)."""
    tensor = tensor_leaves("", tensor)[0][1]
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    saved = tensor.detach().clone()
    with torch.no_grad():
        tensor.add_(1)
    try:
        yield
    finally:
        with torch.no_grad():
            tensor.copy_(saved)


def _tensor_at(root: nn.Module, path: str) -> torch.Tensor:
    module_path, _, leaf = path.rpartition(".")
    return getattr(root.get_submodule(module_path), leaf)


def _non_persistent_buffers(module: nn.Module) -> list[str]:
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for name in sub._non_persistent_buffers_set
        if sub._buffers.get(name) is not None
    ]


def _non_block_tensors(owner: nn.Module,
                       blocks: set[int]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, non_persistent) of the tensors of ``owner`` outside the given blocks."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, bool]]:
        if id(module) in blocks:
            return
        for name, p in module._parameters.items():
            if p is not None:
                yield f"{prefix}{name}", p, False
        for name, b in module._buffers.items():
            if b is not None:
                yield f"{prefix}{name}", b, name in module._non_persistent_buffers_set
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(owner, "")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@cache
def _shape_inventory() -> dict[str, set[str]]:
    """For each shape of DOCUMENTED_SHAPES, the fixtures that actually carry it."""
    inventory: dict[str, set[str]] = {shape: set() for shape in DOCUMENTED_SHAPES}
    for spec in LAYERWISE_SPECS:
        pipe = spec.build()
        plan = _layerwise_plan(pipe)
        if len({p.dtype for p in pipe.parameters()}) > 1:
            inventory["parameters_in_several_dtypes"].add(spec.name)
        if any(t.untyped_storage().nbytes() > t.numel() * t.element_size()
               for p in (*pipe.parameters(), *pipe.buffers()) for _, t in tensor_leaves("", p)):
            inventory["tensor_smaller_than_its_storage"].add(spec.name)
        if any(c.role == "resident" for d in plan.dits for c in plan.components
               if c.path in d.nested):
            inventory["resident_nested_in_a_dit"].add(spec.name)
        dit_stacks = [s for c in plan.dits for s in c.rings]
        if len(dit_stacks) >= 2:
            inventory["two_dit_rings"].add(spec.name)
        for stack in dit_stacks:
            parity = "odd" if len(stack.blocks) % 2 else "even"
            inventory[f"{parity}_ring_length"].add(spec.name)
            if len({_nbytes(b) for b in stack.blocks}) > 1:
                inventory["heterogeneous_block_sizes_in_one_ring"].add(spec.name)
            block_params: dict[int, str] = {}
            block_storages: set[int] = set()
            for block in stack.blocks:
                if _non_persistent_buffers(block):
                    inventory["non_persistent_buffer_in_block"].add(spec.name)
                if len({p.dtype for p in block.parameters()}) > 1:
                    inventory["block_with_several_dtypes"].add(spec.name)
                for p in block.parameters():
                    block_params[id(p)] = spec.name
                    if wrapper_inner(p) is not None:
                        inventory["wrapper_subclass_weight_in_block"].add(spec.name)
                    for _, leaf in tensor_leaves("", p):
                        block_storages.add(leaf.untyped_storage().data_ptr())
                        if leaf.dtype == torch.float8_e4m3fn:
                            inventory["float8_weight_in_block"].add(spec.name)
                    if not p.is_contiguous():
                        inventory["non_contiguous_parameter_in_block"].add(spec.name)
            owner = pipe.get_submodule(stack.owner_path)
            in_blocks = {id(b) for b in stack.blocks}
            for _name, tensor, non_persistent in _non_block_tensors(owner, in_blocks):
                if wrapper_inner(tensor) is not None:
                    inventory["wrapper_subclass_weight_in_non_block_dit_state"].add(spec.name)
                    continue
                if isinstance(tensor, nn.Parameter) and id(tensor) in block_params:
                    inventory["dit_parameter_aliasing_a_block_parameter"].add(spec.name)
                elif (tensor.untyped_storage().data_ptr() in block_storages
                      and not isinstance(tensor, nn.Parameter)):
                    inventory["non_block_view_of_block_storage"].add(spec.name)
                if non_persistent:
                    inventory["non_persistent_buffer_in_non_block_dit_state"].add(spec.name)
    return inventory


# -- registry ------------------------------------------------------------------------------------


def test_registry_lists_one_fixture_per_architecture_sorted() -> None:
    assert sorted(EXPECTED_STRATEGIES) == SPEC_IDS, SPEC_IDS
    for spec in SPECS:
        assert spec.strategies == EXPECTED_STRATEGIES[spec.name], spec.name
        assert spec.factory.startswith("offload_ref.fixtures."), spec.factory
        assert spec.inputs.startswith("offload_ref.fixtures."), spec.inputs
        assert spec.description, spec.name


def test_get_spec_unknown_name_lists_the_fixtures() -> None:
    assert get_spec("sdxl").name == "sdxl"
    with pytest.raises(KeyError) as info:
        get_spec("sdxl_turbo")
    for name in SPEC_IDS:
        assert name in str(info.value)


# -- every fixture -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_build_leaves_global_rng_untouched(spec: Any) -> None:
    before = torch.random.get_rng_state()
    spec.build()
    spec.make_inputs()
    assert torch.equal(before, torch.random.get_rng_state()), spec.name


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_pipeline_is_frozen_in_eval_mode_on_cpu(spec: Any) -> None:
    pipe = spec.build()
    assert isinstance(pipe, nn.Module)
    assert not any(m.training for m in pipe.modules()), spec.name
    assert not any(p.requires_grad for p in pipe.parameters()), spec.name
    assert {t.device.type for t in (*pipe.parameters(), *pipe.buffers())} == {"cpu"}
    inputs = spec.make_inputs()
    assert isinstance(inputs["num_inference_steps"], int) and inputs["num_inference_steps"] >= 2


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_output_is_deterministic_across_fresh_builds_and_finite(spec: Any) -> None:
    first = _run(spec.build(), spec)
    second = _run(spec.build(), spec)
    assert isinstance(first, torch.Tensor)
    assert torch.isfinite(first).all(), spec.name
    assert torch.equal(first, second), f"{spec.name}: two fresh builds disagree"
    other_noise = _run(spec.build(), spec, generator_seed=spec.seed + 1)
    assert not torch.equal(first, other_noise), f"{spec.name}: output ignores the noise seed"


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_generation_runtime_after_warmup(spec: Any) -> None:
    pipe = spec.build()
    _run(pipe, spec)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        _run(pipe, spec)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"{spec.name}: {1e3 * median:.1f} ms per generation (median of 3, 1 thread)")
    assert median < 0.5, f"{spec.name}: {median:.3f} s per generation"


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_declared_components_resolve_to_modules(spec: Any) -> None:
    pipe = spec.build()
    found = discover_components(pipe)
    assert found.declared, spec.name
    assert found.missing == (), f"{spec.name}: declared paths not found: {found.missing}"
    assert found.dits and found.vaes, spec.name
    cls = type(pipe)
    for role in ("_dit_modules", "_encoder_modules", "_vae_modules", "_resident_modules"):
        for path in getattr(cls, role):
            assert isinstance(pipe.get_submodule(path), nn.Module), (spec.name, role, path)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_declared_block_containers_hold_at_least_two_blocks(spec: Any) -> None:
    pipe = spec.build()
    containers = _declared_containers(pipe)
    assert containers, f"{spec.name}: no block container declared"
    for path, container in containers:
        assert isinstance(container, nn.ModuleList), (spec.name, path, type(container))
        assert len(container) >= 2, (spec.name, path, len(container))


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_components_run_through_call_and_blocks_in_ring_order(spec: Any) -> None:
    """Pre-hooks on components fire, and every ring runs whole and in order, as many times as
    the original's phase pattern says (EXPECTED_RING_PASSES)."""
    pipe = spec.build()
    plan = _layerwise_plan(pipe)
    events: list[tuple[str, int]] = []
    component_calls: dict[str, int] = {}
    handles = []
    for stack in plan.rings:
        for index, block in enumerate(stack.blocks):
            handles.append(block.register_forward_pre_hook(
                lambda m, a, key=(stack.owner_path, index): events.append(key)))
    found = discover_components(pipe)
    for path, module in (*found.dits, *found.encoders, *found.vaes):
        handles.append(module.register_forward_pre_hook(
            lambda m, a, path=path: component_calls.__setitem__(
                path, component_calls.get(path, 0) + 1)))
    try:
        _run(pipe, spec)
    finally:
        for handle in handles:
            handle.remove()
    for path, _ in (*found.dits, *found.encoders, *found.vaes):
        assert component_calls.get(path, 0) >= 1, f"{spec.name}: {path} never called via __call__"
    for path, _ in found.vaes:
        assert component_calls[path] == 1, (spec.name, path, component_calls[path])
    passes = {}
    for stack in plan.rings:
        order = [i for owner, i in events if owner == stack.owner_path]
        n = len(stack.blocks)
        assert order and len(order) % n == 0, (spec.name, stack.owner_path, order)
        assert order == list(range(n)) * (len(order) // n), (spec.name, stack.owner_path, order)
        passes[stack.owner_path] = len(order) // n
    assert passes == EXPECTED_RING_PASSES[spec.name], spec.name


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_every_streamed_block_and_tricky_tensor_affects_the_output(spec: Any) -> None:
    """A backend that streams the wrong bytes must be caught by output parity: perturbing any
    block (and every non-persistent buffer, alias or odd-strided tensor) changes the output."""
    pipe = spec.build()
    plan = _layerwise_plan(pipe)
    reference = _run(pipe, spec)
    probes: list[tuple[str, torch.Tensor]] = []
    for stack in plan.rings:
        for path, block in zip(stack.block_paths, stack.blocks, strict=True):
            name, first = next(iter(block.named_parameters()))
            probes.append((f"{path}.{name}", first))
            probes += [(f"{path}.{n}", p) for n, p in block.named_parameters()
                       if not p.is_contiguous() or p.dtype != first.dtype]
            probes += [(f"{path}.{n}", block.get_buffer(n))
                       for n in _non_persistent_buffers(block)]
        probes += [(alias.path, _tensor_at(pipe, alias.path)) for alias in stack.aliases]
    for path, tensor in probes:
        with _perturbed(tensor):
            changed = not torch.equal(_run(pipe, spec), reference)
        assert changed, f"{spec.name}: perturbing {path} does not change the output"
    assert torch.equal(_run(pipe, spec), reference), f"{spec.name}: perturbation not undone"


# -- plans ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", LAYERWISE_SPECS, ids=[s.name for s in LAYERWISE_SPECS])
def test_layerwise_plan_resolves_to_the_documented_rings(spec: Any) -> None:
    plan = _layerwise_plan(spec.build())
    assert plan.skip_reason is None and not plan.warnings, (spec.name, plan.warnings)
    lengths = {s.owner_path: len(s.blocks) for s in plan.rings}
    assert lengths == EXPECTED_RING_LENGTHS[spec.name], (spec.name, lengths)


@pytest.mark.parametrize("spec", MODEL_LEVEL_SPECS, ids=[s.name for s in MODEL_LEVEL_SPECS])
def test_model_level_plan_resolves(spec: Any) -> None:
    plan = resolve_offload_plan(spec.build(), OffloadConfig(strategy="model_level"))
    if spec.name == "cosmos3":  # split model: the pipeline's own enable_omni_model_cpu_offload
        assert plan.delegated and not plan.components
        return
    assert not plan.delegated and not plan.warnings, (spec.name, plan.warnings)
    assert any(c.selected for c in plan.dits) and any(c.selected for c in plan.encoders)
    assert all(not c.selected for c in plan.by_role("vae"))


def _resident_dit_paths(spec: Any) -> set[str]:
    declared = getattr(type(spec.build()), "_offload_plan", None)
    return set(getattr(declared, "resident_dit_paths", ()))


# Resident head layers only where the pipeline declares a resident DiT (elsewhere they are
# rejected: check_resident_layers_need_a_resident_dit_path).
_DLO_CASES = [(spec, {"weight_transfer": "allgather"}) for spec in DISTRIBUTED_SPECS] + [
    (spec, {"weight_transfer": "rank-local", "resident_layers": 1})
    for spec in DISTRIBUTED_SPECS if _resident_dit_paths(spec)]


@pytest.mark.parametrize("spec,options", _DLO_CASES, ids=[
    f"{o['weight_transfer']}{'-resident' if o.get('resident_layers') else ''}-{s.name}"
    for s, o in _DLO_CASES])
def test_distributed_layerwise_plan_resolves(spec: Any, options: dict[str, Any]) -> None:
    resident_dits = _resident_dit_paths(spec)
    config = OffloadConfig(strategy="distributed_layer_wise", world_size=2,
                           layer_options={"dit": options})
    plan = resolve_offload_plan(spec.build(), config)
    assert not plan.warnings, plan.warnings
    assert {s.owner_path: len(s.blocks) for s in plan.rings} == EXPECTED_RING_LENGTHS[spec.name]
    heads = {s.owner_path: s.resident_head for s in plan.rings}
    for owner, head in heads.items():
        expected = options.get("resident_layers", 0) if owner in resident_dits else 0
        assert head == expected, (owner, heads)


@pytest.mark.parametrize("name,encoders", [
    ("wan22_t2v", {"text_encoder": 2}),
    ("wan22_i2v", {"text_encoder": 2, "image_encoder": 2}),
])
def test_encoder_block_stacks_resolve_when_the_encoder_is_selected(
        name: str, encoders: dict[str, int]) -> None:
    plan = resolve_offload_plan(
        get_spec(name).build(),
        OffloadConfig(strategy="layer_wise",
                      components=("dit", "text_encoder", "image_encoder")))
    assert {c.path: len(c.rings[0].blocks) for c in plan.encoders} == encoders
    assert all(c.selected for c in plan.encoders)


@pytest.mark.parametrize("shape", sorted(DOCUMENTED_SHAPES))
def test_fixtures_carry_the_documented_shape(shape: str) -> None:
    carriers = _shape_inventory()[shape]
    missing = DOCUMENTED_SHAPES[shape] - carriers
    assert not missing, f"{shape}: documented on {sorted(missing)} but not found there"


def test_aliases_are_recorded_in_the_plan() -> None:
    qwen = get_spec("qwen_image").build()
    block_weight = qwen.transformer.transformer_blocks[1].norm.weight
    assert qwen.transformer._parameters["shared_scale"] is block_weight
    (stack,) = _layerwise_plan(qwen).rings
    assert [(a.path, a.block_path) for a in stack.aliases] == [
        ("transformer.shared_scale", "transformer.transformer_blocks.1")]

    sd3 = get_spec("sd3").build()
    view = sd3.transformer.tied_view
    weight = sd3.transformer.transformer_blocks[2].attn.to_q.weight
    assert not isinstance(view, nn.Parameter) and view.storage_offset() == weight.shape[1]
    assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert "tied_view" not in sd3.transformer.state_dict()
    (stack,) = _layerwise_plan(sd3).rings
    assert [(a.path, a.block_path) for a in stack.aliases] == [
        ("transformer.tied_view", "transformer.transformer_blocks.2")]


# -- Cosmos3: the split model --------------------------------------------------------------------


@pytest.mark.parametrize("steps", [2, 5])
def test_cosmos3_reasoner_runs_once_and_generator_every_step(steps: int) -> None:
    spec = get_spec("cosmos3")
    pipe = spec.build()
    for _ in range(2):  # counters restart with every generation
        _run(pipe, spec, num_inference_steps=steps)
        assert pipe.transformer.reasoner_calls == 1
        assert pipe.transformer.generator_calls == steps


def test_cosmos3_unknown_component_raises_value_error() -> None:
    transformer = get_spec("cosmos3").build().transformer
    with pytest.raises(ValueError, match="bogus"), transformer._offload_context("bogus"):
        pass
    for name in ("reasoner", "generator"):  # no-ops while offload is disabled
        with transformer._offload_context(name):
            pass


def test_cosmos3_component_groups_partition_the_transformer() -> None:
    transformer = get_spec("cosmos3").build().transformer
    groups = transformer._offload_groups
    owners: dict[int, list[str]] = {}
    members = [(name, m) for name in groups.names for m in groups._groups[name]]
    members += [("resident", m) for m in groups._resident]
    for owner, module in members:
        for tensor in (*module.parameters(), *module.buffers()):
            owners.setdefault(id(tensor), []).append(owner)
    for name, tensor in (*transformer.named_parameters(), *transformer.named_buffers()):
        assert len(owners.get(id(tensor), [])) == 1, (name, owners.get(id(tensor)))


def test_cosmos3_delegated_model_offload_matches_reference() -> None:
    spec = get_spec("cosmos3")
    reference = _run(spec.build(), spec)  # on the host, for the disabled pipeline
    on_device = _run(resident(spec.build()), spec)  # the reference of the offloaded runs
    pipe = spec.build()
    with pytest.raises(ValueError, match="dit"):
        pipe.enable_omni_model_cpu_offload(device="cpu", pin_memory=False,
                                           components=("text_encoder",))
    pipe.enable_omni_model_cpu_offload(device="cpu", pin_memory=False, components=("dit",))
    try:
        assert pipe.transformer._offload_groups.enabled
        assert torch.equal(_run(pipe, spec), on_device)
        assert pipe.transformer._offload_groups.active() == "generator"
        assert (pipe.transformer.reasoner_calls, pipe.transformer.generator_calls) == (1, 3)
    finally:
        pipe.disable_omni_model_cpu_offload()
    assert not pipe.transformer._offload_groups.enabled
    assert torch.equal(_run(pipe, spec), reference)


_BUILD_THEN_ASK = """
import torch
from offload_ref.fixtures import SPECS, heavy, many_blocks
from offload_ref.fixtures._common import local_seed
from offload_ref.platform import simulated

for spec in SPECS:
    spec.build(); spec.make_inputs()
heavy.build_pipeline(0); many_blocks.build_pipeline(0, 4)
state = torch.random.get_rng_state()
with local_seed(7):
    a = torch.randn(3)
assert torch.equal(torch.random.get_rng_state(), state), "local_seed left the CPU RNG moved"
with local_seed(7):
    assert torch.equal(torch.randn(3), a), "local_seed is not reproducible"
print("loadable" if simulated.available() else simulated.unavailable_reason())
"""


def test_building_a_fixture_leaves_the_simulated_accelerator_loadable(tmp_path) -> None:
    """A fixture built before ``get_offload_backend(device="cpu")`` (the README's example) must not
    make torch look up its accelerator hooks (``torch.random.fork_rng`` does): the simulated
    accelerator could no longer register, and the run would turn single-device."""
    import os
    import subprocess
    import sys

    from offload_ref.platform import simulated

    if not simulated.available():
        pytest.skip(f"the simulated accelerator is not available: {simulated.unavailable_reason()}")
    proc = subprocess.run([sys.executable, "-c", _BUILD_THEN_ASK], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "OFFLOAD_REF_SIM": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "loadable", proc.stdout + proc.stderr[-2000:]
