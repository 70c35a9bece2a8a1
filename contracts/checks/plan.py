"""Catalogue §A: plan resolution (pure, repeatable, declared, validated before mutation)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from offload_ref.config import LayerOptions, OffloadConfig, OffloadStrategy, WeightTransfer
from offload_ref.discovery import FALLBACK_NAMES, discover_components, get_submodule_path
from offload_ref.plan import OffloadPlan, resolve_offload_plan

from ..registry import CheckNotApplicable, check, fail
from ..facts import (
    count_forward_calls,
    declare_no_dit,
    dit_blocks,
    dit_containers,
    expect_error,
    first_dit,
    module_tensors,
    snapshot,
    storage_key,
)

LAYER = ("layer_wise", "distributed_layer_wise")


def with_plan(pipeline: Any, **changes: Any) -> None:
    """Give this pipeline instance its own OffloadPlan (the class keeps its declaration)."""
    base = getattr(pipeline, "_offload_plan", None) or OffloadPlan()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(OffloadPlan)}
    for key, value in changes.items():
        if isinstance(fields.get(key), dict) or hasattr(fields.get(key), "items"):
            merged = dict(fields[key])
            merged.update(value)
            value = merged
        fields[key] = value
    pipeline.__dict__["_offload_plan"] = OffloadPlan(**fields)


def _resolve_and_expect_rejection(case, pipeline, config, what, mentions) -> None:
    before = snapshot(pipeline, values=True)
    expect_error(what, lambda: case.resolve(pipeline, config), mentions=mentions)
    problems = before.diff(snapshot(pipeline, values=True))
    if problems:
        fail(f"{what}: the pipeline changed although resolution failed: {problems[:5]}")


def _plan_signature(plan: Any) -> Any:
    comps = []
    for c in plan.components:
        rings = [
            (s.owner_path, s.container_paths, tuple(id(b) for b in s.blocks), s.block_paths,
             s.resident_indices, str(s.transfer), tuple(a.path for a in s.aliases))
            for s in c.rings
        ]
        comps.append((c.path, id(c.module), c.role, c.selected, c.on_demand, tuple(rings)))
    return (str(plan.strategy), plan.skip_reason, plan.delegated, tuple(comps))


@check("A.1")
def check_plan_resolution_is_pure(case) -> None:
    """Resolving moves no tensor, adds no attribute or hook, runs no forward, touches no
    process group."""
    pipeline = case.build()
    before = snapshot(pipeline, values=True)
    with count_forward_calls() as calls:
        case.resolve(pipeline)
    problems = before.diff(snapshot(pipeline, values=True))
    if calls:
        problems.append(f"forward ran during resolution: {calls[:5]}")
    if problems:
        fail(f"resolve_offload_plan mutated {type(pipeline).__name__}: {problems[:8]}")


@check("A.2")
def check_plan_resolution_is_repeatable(case) -> None:
    """Resolving twice gives equal plans: paths, selection, on-demand flags, blocks, order."""
    pipeline = case.build()
    first, second = case.resolve(pipeline), case.resolve(pipeline)
    a, b = _plan_signature(first), _plan_signature(second)
    if a != b:
        fail(f"two resolutions of {type(pipeline).__name__} differ:\n  {a}\n  {b}")
    if first != second:
        fail("two resolutions have equal contents but do not compare equal")


@check("A.3", strategies=LAYER, requires=("dit_blocks>=2",))
def check_plan_block_attrs_beat_class_attributes(case) -> None:
    """OffloadPlan.block_attrs wins over the DiT's _layerwise_offload_blocks_attrs."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    declared = [f"{path}.{c}" for c in dit_containers(pipeline, path, dit)]
    blocks = dit_blocks(pipeline, path, dit)
    # A second container with the same blocks in reverse order, declared only by the plan.
    dit._kit_plan_blocks = nn.ModuleList(list(reversed(blocks)))
    with_plan(pipeline, block_attrs={path: ("_kit_plan_blocks",)})
    what = (f"DiT {path!r} with OffloadPlan.block_attrs pointed at a container the check adds, "
            f"holding the blocks of {declared} in reverse order")
    try:
        plan = case.resolve(pipeline)
    except Exception as exc:
        fail(f"{what}: resolution failed: {type(exc).__name__}: {exc}", severity="error")
    rings = [s for s in plan.rings if s.owner_path == path]
    if not rings:
        fail(f"{what}: no ring resolved for the DiT")
    got = [id(b) for b in rings[0].blocks]
    want = [id(b) for b in reversed(blocks)]
    if got != want:
        fail(f"{what}: OffloadPlan.block_attrs must win, but the ring resolved from "
             f"{list(rings[0].container_paths)} in another order")
    if rings[0].container_paths != (f"{path}._kit_plan_blocks",):
        fail(f"{what}: OffloadPlan.block_attrs must win, but the ring records containers "
             f"{list(rings[0].container_paths)}")


@check("A.3", requires=("not delegates_model_level",))
def check_declared_components_beat_attribute_scan(case) -> None:
    """Declared components are used as declared; a well-known but undeclared name is ignored."""
    pipeline = case.build()
    decoy_role = {"dit": "dits", "encoder": "encoders", "vae": "vaes"}
    added = []
    for role, names in FALLBACK_NAMES.items():
        for name in names:
            if get_submodule_path(pipeline, name) is not None and hasattr(pipeline, name):
                continue
            setattr(pipeline, name, nn.Linear(2, 2))
            added.append((decoy_role[role], name))
            break
    config = case.config(components=("dit", "text_encoder")) \
        if case.strategy is OffloadStrategy.MODEL_LEVEL else case.config()
    plan = case.resolve(pipeline, config)
    paths = {c.path for c in plan.components}
    leaked = [name for _, name in added if name in paths]
    if leaked:
        fail(f"undeclared attributes {leaked} joined the plan of {type(pipeline).__name__}, "
             "which declares its components")


@check("A.3", strategies=("model_level", "layer_wise"), requires=("not delegates_model_level",))
def check_attribute_scan_warns_once_per_pipeline_class(case) -> None:
    """A pipeline without declarations is scanned by name, with one warning per class."""
    source = case.build()
    found = discover_components(source)
    # named after the author's class: resolver messages about the copy must make sense to them
    undeclared = type(f"{type(source).__name__}WithoutDeclarations", (nn.Module,), {})
    names = {"dits": ("transformer", "transformer_2"), "encoders": ("text_encoder",),
             "vaes": ("vae",)}

    def make() -> nn.Module:
        pipe = undeclared()
        for role, attrs in names.items():
            for attr, (_, module) in zip(attrs, getattr(found, role)):
                setattr(pipe, attr, module)
        return pipe

    config = case.config(explicit=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):
                case.resolve(make(), config)
        except ValueError as exc:
            fail(f"{type(source).__name__} with its declarations removed (its components under "
                 f"the well-known names {sorted(a for v in names.values() for a in v)}) does not "
                 f"resolve: {exc}", severity="error")
    scans = [w for w in caught if "declares no components" in str(w.message)
             or "Declare _dit_modules" in str(w.message)]
    if len(scans) != 1:
        fail(f"expected exactly one fallback-scan warning for two resolutions of one class, got "
             f"{len(scans)}: {[str(w.message)[:80] for w in caught]}")
    scanned = discover_components(make(), warn=lambda message: None)
    if not scanned.dits or scanned.dits[0][1] is not found.dits[0][1]:
        fail("the attribute scan did not find the DiT exposed as 'transformer'")


@check("A.4")
def check_dotted_paths_resolve_nested_components(case) -> None:
    """Dotted paths reach nested components: the same pipeline one level down resolves to the
    same modules and blocks under prefixed paths."""
    inner = case.build()
    flat_plan = case.resolve(inner)

    def prefixed(name: str) -> list[str]:
        return [f"inner.{p}" for p in getattr(inner, name, None) or []]

    attrs = {n: prefixed(n) for n in ("_dit_modules", "_encoder_modules", "_vae_modules",
                                      "_resident_modules")}
    base_plan = getattr(inner, "_offload_plan", None)
    if base_plan is not None:
        attrs["_offload_plan"] = OffloadPlan(
            block_attrs={f"inner.{k}": v for k, v in base_plan.block_attrs.items()},
            encoder_block_attrs={f"inner.{k}": v for k, v in base_plan.encoder_block_attrs.items()},
            offload_submodules={f"inner.{k}": v for k, v in base_plan.offload_submodules.items()},
            resident_dit_paths=tuple(f"inner.{p}" for p in base_plan.resident_dit_paths),
            on_demand_component_paths=tuple(
                f"inner.{p}" for p in base_plan.on_demand_component_paths),
            encoder_dlo_weight_replication=tuple(
                f"inner.{p}" for p in base_plan.encoder_dlo_weight_replication),
        )
    for name in ("enable_omni_model_cpu_offload", "disable_omni_model_cpu_offload"):
        if callable(getattr(inner, name, None)):
            attrs[name] = lambda self, _n=name, **kw: getattr(self.inner, _n)(**kw)
    outer_cls = type(f"{type(inner).__name__}OneLevelDown", (nn.Module,), attrs)
    outer = outer_cls()
    outer.inner = inner
    nested_plan = case.resolve(outer)
    want = [(f"inner.{c.path}", id(c.module), c.role, c.selected,
             [[id(b) for b in s.blocks] for s in c.rings]) for c in flat_plan.components]
    got = [(c.path, id(c.module), c.role, c.selected,
            [[id(b) for b in s.blocks] for s in c.rings]) for c in nested_plan.components]
    if want != got:
        fail(f"nested resolution differs: expected {[w[0] for w in want]}, got "
             f"{[g[0] for g in got]} (or different modules/blocks)")


@check("A.5", strategies=("model_level",), requires=("not delegates_model_level",))
def check_model_level_without_dit_is_rejected(case) -> None:
    """An explicit model-level selection on a pipeline with no DiT fails before mutation."""
    pipeline = case.build()
    declare_no_dit(pipeline)
    _resolve_and_expect_rejection(case, pipeline, case.config(), "model-level without a DiT",
                                  ("_dit_modules",))


@check("A.5", strategies=("model_level",), requires=("not delegates_model_level",))
def check_model_level_without_encoder_is_rejected(case) -> None:
    """An explicit model-level selection with no encoder stage to swap against fails."""
    pipeline = case.build()
    pipeline.__dict__["_encoder_modules"] = []
    _resolve_and_expect_rejection(case, pipeline, case.config(),
                                  "model-level without an encoder", ("_encoder_modules",))


@check("A.5", strategies=LAYER)
def check_single_block_dit_is_rejected(case) -> None:
    """A layer strategy on a DiT with fewer than two blocks fails, naming the DiT."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    dit._kit_one_block = nn.ModuleList(dit_blocks(pipeline, path, dit)[:1])
    with_plan(pipeline, block_attrs={path: ("_kit_one_block",)})
    _resolve_and_expect_rejection(case, pipeline, case.config(), "a one-block DiT",
                                  (path, "at least two"))


@check("A.5", strategies=LAYER)
def check_missing_block_container_is_rejected(case) -> None:
    """A declared block container that does not exist fails, naming the container path."""
    pipeline = case.build()
    path, _ = first_dit(pipeline)
    with_plan(pipeline, block_attrs={path: ("kit_missing_blocks",)})
    _resolve_and_expect_rejection(case, pipeline, case.config(), "a missing container",
                                  (f"{path}.kit_missing_blocks",))


@check("A.5", strategies=LAYER, requires=("dit_blocks>=2",))
def check_block_claimed_by_two_components_is_rejected(case) -> None:
    """One block reachable from two components is rejected ("claimed by both")."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    twin = nn.Module()
    twin.blocks = nn.ModuleList(dit_blocks(pipeline, path, dit)[:2])
    pipeline.kit_twin = twin
    pipeline.__dict__["_dit_modules"] = list(getattr(pipeline, "_dit_modules", [])) + ["kit_twin"]
    with_plan(pipeline, block_attrs={"kit_twin": ("blocks",)})
    _resolve_and_expect_rejection(
        case, pipeline, case.config(),
        f"the first two blocks of DiT {path!r} also declared as the blocks of a second DiT "
        "the check adds (at 'kit_twin')", ("claimed by both", "kit_twin"))


@check("A.5", strategies=LAYER, requires=("has_vae",))
def check_on_demand_component_without_lifecycle_is_rejected(case) -> None:
    """An on-demand component must implement load_to_device() and offload_to_cpu()."""
    pipeline = case.build()
    found = discover_components(pipeline)
    path, module = found.vaes[0]
    if callable(getattr(module, "load_to_device", None)):
        fail(f"precondition: {path!r} already implements load_to_device")
    with_plan(pipeline, on_demand_component_paths=(path,))
    _resolve_and_expect_rejection(case, pipeline, case.config(), "an on-demand VAE without "
                                  "a lifecycle", (path, "load_to_device", "offload_to_cpu"))


def encoder_block_list_of(pipeline: Any) -> tuple[str, str] | None:
    for path, module in discover_components(pipeline).encoders:
        for name, sub in module.named_modules():
            if name and isinstance(sub, nn.ModuleList) and len(sub) >= 2:
                return path, name
    return None


@check("A.5", strategies=("distributed_layer_wise",), requires=("encoder_block_list",))
def check_encoder_allgather_requires_declared_replication(case) -> None:
    """Encoder AllGather (world > 1) needs OffloadPlan.encoder_dlo_weight_replication."""
    pipeline = case.build()
    path, container = encoder_block_list_of(pipeline)
    with_plan(pipeline, encoder_block_attrs={path: (container,)})
    config = OffloadConfig(
        strategy=OffloadStrategy.DISTRIBUTED_LAYER_WISE, components=("dit", "text_encoder"),
        layer_options={"text_encoder": LayerOptions(WeightTransfer.ALLGATHER)}, world_size=2)
    _resolve_and_expect_rejection(case, pipeline, config, "encoder AllGather without "
                                  "declared replication", (path, "encoder_dlo_weight_replication"))


def _dlo_resident_config(resident: int) -> OffloadConfig:
    return OffloadConfig(
        strategy=OffloadStrategy.DISTRIBUTED_LAYER_WISE, components=("dit",),
        layer_options={"dit": LayerOptions(WeightTransfer.RANK_LOCAL, resident)})


@check("A.5", strategies=("distributed_layer_wise",))
def check_resident_layers_need_a_resident_dit_path(case) -> None:
    """resident_layers without the DiT in OffloadPlan.resident_dit_paths is rejected."""
    pipeline = case.build()
    path, _ = first_dit(pipeline)
    with_plan(pipeline, resident_dit_paths=())
    _resolve_and_expect_rejection(case, pipeline, _dlo_resident_config(1),
                                  "resident layers without a resident DiT path",
                                  (path, "resident_dit_paths"))


@check("A.5", strategies=("distributed_layer_wise",), requires=("dit_blocks>=2",))
def check_resident_layers_leaving_one_streaming_block_are_rejected(case) -> None:
    """resident_layers that leave exactly one streaming block are rejected."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    n = len(dit_blocks(pipeline, path, dit))
    with_plan(pipeline, resident_dit_paths=(path,))
    _resolve_and_expect_rejection(case, pipeline, _dlo_resident_config(n - 1),
                                  f"resident_layers={n - 1} of the {n} blocks of DiT {path!r}",
                                  (path, "only one streaming block"))


@check("A.6", strategies=("model_level", "layer_wise"), requires=("not delegates_model_level",))
def check_legacy_topology_without_dit_is_a_recorded_noop(case) -> None:
    """Legacy flags on a pipeline without a DiT: skip_reason recorded, nothing placed."""
    pipeline = case.build()
    declare_no_dit(pipeline)
    flag = {"model_level": "enable_cpu_offload", "layer_wise": "enable_layerwise_offload"}
    od_config = type("KitOdConfig", (), {flag[case.strategy.value]: True})()
    config = case.impl.config_from_od_config(od_config)
    if config.explicit:
        fail(f"legacy flag {flag[case.strategy.value]} produced an explicit selection")
    plan = case.resolve(pipeline, config)
    if not plan.skip_reason:
        fail(f"legacy topology without a DiT must record skip_reason, got plan {plan}")
    before = snapshot(pipeline, values=True)
    platform = case.platform()
    backend = case.backend(config, platform)
    backend.enable(pipeline)
    problems = before.diff(snapshot(pipeline, values=True))
    if backend.is_enabled() or problems or platform.memory_allocated():
        fail(f"a skipped plan must place nothing: enabled={backend.is_enabled()}, device bytes="
             f"{platform.memory_allocated()}, changes={problems[:5]}")


@check("A.7", strategies=LAYER, requires=("dit_blocks>=2",))
def check_tensors_aliasing_a_block_belong_to_its_ring(case) -> None:
    """A DiT tensor outside the blocks that shares storage with a block tensor is a ring alias
    (placement by identity, not by attribute name)."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    blocks = dit_blocks(pipeline, path, dit)
    containers = dit_containers(pipeline, path, dit)
    declared = [f"{path}.{c}" for c in containers]
    # a tensor with storage to view: a wrapper subclass's inner tensor, not the wrapper (its
    # view would be a plain tensor of its dequantized value: Note [Wrapper subclasses])
    target_name, target = next(
        ((n, t) for n, t in module_tensors(blocks[-1]) if t.numel() > 1), (None, None))
    if target is None:
        fail(f"precondition: the last block of {declared} has no tensor of two or more "
             "elements for the check to alias")
    dit.register_buffer("_kit_alias", target.data.view(-1)[1:], persistent=False)
    plan = case.resolve(pipeline)
    aliases = {a.path: a for s in plan.rings for a in s.aliases}
    want = f"{path}._kit_alias"
    block_tensor = f"{target_name} of the last block of {declared}"
    if want not in aliases:
        fail(f"a buffer the check adds to DiT {path!r} (at {want!r}) views the storage of "
             f"{block_tensor}, but the plan does not record it as a ring alias "
             f"(recorded: {sorted(aliases)})")
    if not aliases[want].block_path.startswith(f"{path}.{containers[-1]}"):
        fail(f"a buffer the check adds to DiT {path!r} viewing {block_tensor} is attributed "
             f"to {aliases[want].block_path}, not to that block")
    # Every pre-existing alias of the fixture is found too.
    block_storages = {storage_key(b) for blk in blocks for _, b in module_tensors(blk)}
    for name, t in module_tensors(dit, remove_duplicate=False):
        if not t.numel() or any(name.startswith(f"{c}.") for c in containers):
            continue
        if storage_key(t) in block_storages:
            if f"{path}.{name}" not in aliases:
                fail(f"{path}.{name} shares storage with a block tensor but is not a ring alias")


@check("A.5", strategies=LAYER)
def check_resident_inside_a_streamed_block_is_rejected(case) -> None:
    """A component declared inside a streamed block (a resident submodule of a block) is
    rejected, naming it: a block streams whole, so nothing inside it can stay resident."""
    pipeline = case.build()
    ring = next((s for s in case.resolve(pipeline).rings if len(s.streamed_blocks) >= 2), None)
    if ring is None:
        fail("precondition: the plan streams no ring")
    block, block_path = ring.blocks[-1], ring.block_paths[-1]
    name = next((n for n, m in block.named_modules() if n and any(True for _ in m.parameters())),
                None)
    if name is None:
        fail(f"precondition: block {block_path!r} has no submodule with parameters")
    path = f"{block_path}.{name}"
    pipeline.__dict__["_resident_modules"] = list(
        getattr(pipeline, "_resident_modules", []) or []) + [path]
    _resolve_and_expect_rejection(case, pipeline, case.config(), "a resident inside a block",
                                  (path, block_path, "_resident_modules"))


@check("A.5", strategies=("model_level",), requires=("not delegates_model_level",))
def check_tensor_in_two_model_level_groups_is_rejected(case) -> None:
    """Model level moves each DiT, each encoder and the resident state separately: pipeline
    state sharing storage with a swapped DiT is rejected by the resolver, naming both."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    subs = {id(m) for m in dit.modules()}
    inner = {id(t) for c in case.resolve(pipeline).components
             if c.module is not dit and id(c.module) in subs for _, t in module_tensors(c.module)}
    # a tensor with storage to tie: a wrapper subclass's inner tensor (Note [Wrapper subclasses])
    tensor = next(t for _, t in module_tensors(dit) if t.numel() > 1 and id(t) not in inner)
    holder = pipeline
    if not isinstance(pipeline, nn.Module):  # a plain object: its module attributes are its state
        holder = pipeline.kit_state = nn.Module()
    holder.register_buffer("_kit_tied", tensor.data.view(-1)[:1], persistent=False)
    _resolve_and_expect_rejection(case, pipeline, case.config(), "a storage in two groups",
                                  ("_kit_tied", path, "one offload group"))


@check("A.5", requires=("has_vae", "not delegates_model_level"),
       needs="a declared VAE in a pipeline that does not delegate model level")
def check_vae_selection_without_lifecycle_is_rejected(case) -> None:
    """Selecting "vae" without a declared pipeline-managed lifecycle is rejected, naming the
    VAE and what to declare."""
    pipeline = case.build()
    path, module = discover_components(pipeline).vaes[0]
    if path in getattr(getattr(pipeline, "_offload_plan", None), "on_demand_component_paths", ()):
        fail(f"precondition: {path!r} is already declared on-demand")
    config = case.config(components=tuple(case.config().components) + ("vae",))
    _resolve_and_expect_rejection(case, pipeline, config, "a VAE selected without a lifecycle",
                                  (repr(path), "on_demand_component_paths", "load_to_device"))


# -- J.7: unsupported tensors and graphs are rejected by the resolver, before anything changes ----


#: Strategies with a backend to enable (distributed layerwise resolves, but is not built yet).
_BUILT = ("model_level", "layer_wise")


def _rejected_before_any_change(case, pipeline, before, what: str, mentions) -> None:
    """Resolution and enable both raise (ValueError, naming ``mentions``); enable leaves no
    device or pinned bytes and no hook, and the backend stays disabled."""
    expect_error(f"resolving {what}", lambda: case.resolve(pipeline), mentions=mentions)
    platform = case.platform()
    backend = case.backend(case.config(), platform)
    expect_error(f"enable on {what}", lambda: backend.enable(pipeline),
                 types=(ValueError, TypeError, RuntimeError), mentions=mentions)
    if backend.is_enabled() or platform.memory_allocated() or platform.pinned_bytes():
        fail(f"enable on {what} left enabled={backend.is_enabled()}, device bytes="
             f"{platform.memory_allocated()}, pinned bytes={platform.pinned_bytes()}")


def _last_block(pipeline: nn.Module, path: str, dit: nn.Module) -> nn.Module:
    """The DiT's last declared block; a DiT that declares none (enough for model level): its
    last submodule."""
    blocks = dit_blocks(pipeline, path, dit)
    return blocks[-1] if blocks else list(dit.modules())[-1]


@check("J.7", strategies=_BUILT)
def check_sparse_buffer_is_rejected_before_mutation(case) -> None:
    """A sparse buffer in a DiT block is rejected by the resolver, naming its path and the fix
    (.to_dense()); enable changes nothing (a split model that delegates model level too)."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    block = _last_block(pipeline, path, dit)
    before = snapshot(pipeline, values=True)
    block.register_buffer("_kit_sparse", torch.eye(4).to_sparse(), persistent=False)
    qual = next(f"{path}.{n}" for n, b in dit.named_buffers() if b is block._kit_sparse)
    try:
        _rejected_before_any_change(case, pipeline, before, "a sparse buffer",
                                    (qual, "to_dense"))
    finally:
        del block._buffers["_kit_sparse"]
    problems = before.diff(snapshot(pipeline, values=True))
    if problems:
        fail(f"the pipeline changed although a sparse buffer was rejected: {problems[:5]}")


@check("J.7", strategies=_BUILT)
def check_cyclic_module_graph_is_rejected_before_mutation(case) -> None:
    """A DiT registered as a child of its own last block (a cycle) is rejected by the resolver,
    naming the back edge; nothing recurses forever and enable changes nothing (a split model
    that delegates model level too)."""
    pipeline = case.build()
    path, dit = first_dit(pipeline)
    block = _last_block(pipeline, path, dit)
    block_path = next(f"{path}.{n}" for n, m in dit.named_modules() if m is block)
    before = snapshot(pipeline, values=True)
    block._modules["_kit_loop"] = dit
    try:
        _rejected_before_any_change(case, pipeline, before, "a cyclic module graph",
                                    (f"{block_path}._kit_loop", repr(path), "cycle"))
    finally:
        del block._modules["_kit_loop"]
    problems = before.diff(snapshot(pipeline, values=True))
    if problems:
        fail(f"the pipeline changed although a cyclic graph was rejected: {problems[:5]}")


def _auto_config(budget: int) -> OffloadConfig:
    return OffloadConfig(strategy="auto", device_budget_bytes=budget)


@check("A.8", strategies=("layer_wise",))
def check_auto_mode_measured_peak_never_exceeds_the_budget(case) -> None:
    """``strategy="auto"``: for budgets at and 1 byte above each strategy's predicted peak, enable
    picks the coarsest strategy that fits (none, model level, layerwise, layerwise with encoder
    rings), one generation matches the reference, and the measured peak device bytes never
    exceed the budget; a budget below every prediction is rejected before any mutation, naming
    the smallest achievable peak."""
    from offload_ref.plan import auto_candidates

    want = case.reference()
    platform = case.platform()
    candidates = auto_candidates(case.build(), alignment=platform.alignment)
    feasible = [c for c in candidates if c.predicted is not None]
    if not feasible:
        fail(f"auto mode: no strategy has a predicted peak: {candidates}")
    budgets = sorted({b for c in feasible for b in (c.predicted, c.predicted + 1)})
    generated: set[str] = set()
    for budget in budgets:  # ascending: each strategy first comes up at its tightest budget
        expected = next(c for c in candidates if c.predicted is not None and c.predicted <= budget)
        what = f"strategy='auto', device_budget_bytes={budget}"
        # One generation per strategy, at the tightest budget that picks it (a looser budget
        # that picks it again is checked at enable: its choice and the peak so far).
        generate = expected.name not in generated
        backend, stats, _ = _auto_at(case, platform, budget, expected, want if generate else None)
        generated.add(expected.name)
        chosen = getattr(backend, "chosen", None)
        if chosen is None or chosen.name != expected.name:
            fail(f"{what}: auto picked {getattr(chosen, 'name', None)!r}; the coarsest strategy "
                 f"that fits is {expected.label()} (predicted {expected.predicted} bytes)")
        # A generation ran: something was on the device.  At enable alone, a pipeline whose
        # components all start on the host (no VAE or resident state) holds nothing yet.
        if generate and not stats.peak_device_weight_bytes:
            fail(f"{what}: {expected.name} held no device weight bytes during a generation")
    smallest = min(c.predicted for c in feasible)
    pipeline = case.build()
    before = snapshot(pipeline, values=True)
    backend = case.backend(_auto_config(smallest - 1), platform)
    what = f"strategy='auto', device_budget_bytes={smallest - 1} (below every prediction)"
    try:
        expect_error(what, lambda: backend.enable(pipeline), mentions=(str(smallest - 1),
                                                                       str(smallest)))
    finally:
        backend.disable()
    problems = before.diff(snapshot(pipeline, values=True))
    if problems:
        fail(f"{what}: the pipeline changed although enable was rejected: {problems[:5]}")


@check("A.8", strategies=("layer_wise",), requires=("dit_blocks>=3",),
       needs="a DiT with three or more declared blocks (a head of one leaves two streaming)")
def check_auto_mode_fills_the_budget_with_a_resident_head(case) -> None:
    """``strategy="auto"`` with a budget between layerwise's peak and the next coarser
    strategy's keeps the largest resident head whose predicted peak fits: at each head's
    predicted peak and one byte below the next head's, enable keeps that head (the DiT ring's
    leading blocks resident, unhooked), one generation matches the reference, and the measured
    peak device bytes never exceed the budget."""
    from offload_ref.plan import auto_candidates, head_candidates

    platform = case.platform()
    a = platform.alignment
    candidates = auto_candidates(case.build(), alignment=a)
    layer = next((c for c in candidates if c.name == "layer_wise"), None)
    if layer is None or layer.predicted is None:
        fail(f"auto mode: layerwise has no predicted peak: {layer}")
    coarser = [c.predicted for c in candidates[:candidates.index(layer)]
               if c.predicted is not None]
    limit = min(coarser, default=None)  # a budget from here on picks a coarser strategy
    heads = head_candidates(case.build(), layer, alignment=a)
    if not heads or heads[0].predicted != layer.predicted:
        fail(f"auto mode: the head candidates of layerwise ({[h.predicted for h in heads]}) do "
             f"not start at layerwise's prediction without a head ({layer.predicted})")
    budgets = set()
    for i, h in enumerate(heads):
        budgets.add(h.predicted)
        if i + 1 < len(heads):
            budgets.add(heads[i + 1].predicted - 1)
    budgets = sorted(b for b in budgets if b >= layer.predicted and (limit is None or b < limit))
    if not any(b >= h.predicted for b in budgets for h in heads[1:]):
        raise CheckNotApplicable(
            f"no budget picks layerwise with a resident head: with a head of one block "
            f"layerwise would need {heads[1].predicted} bytes of device memory (its predicted "
            f"peak), and from {limit} bytes on auto picks a coarser strategy")
    base = resolve_offload_plan(case.build(), layer.config, resident_heads={})
    rings = {s.owner_path: s.block_paths for s in base.rings
             if s.owner_path in dict(heads[-1].heads)}
    want = case.reference()
    generated: set[tuple] = set()
    for budget in budgets:
        expected = [h for h in heads if h.predicted <= budget][-1]  # the largest that fits
        what = f"strategy='auto', device_budget_bytes={budget}"
        generate = expected.heads not in generated
        _, _, kept = _auto_at(
            case, platform, budget, expected, want if generate else None,
            observe=lambda pipeline: {p: _leading_unhooked(pipeline, rings[p], platform)
                                      for p in rings})
        generated.add(expected.heads)
        if kept != dict(expected.heads):
            fail(f"{what}: auto kept {kept} leading block(s) resident and unhooked; the "
                 f"largest head that fits is {expected.label()} (predicted "
                 f"{expected.predicted} bytes)")


def _auto_at(case: Any, platform: Any, budget: int, expected: Any, want: Any,
             observe: Any = lambda pipeline: None) -> tuple[Any, Any, Any]:
    """Enable ``strategy="auto"`` at ``budget`` on a fresh pipeline; one generation compared
    with ``want`` unless it is None; returns the backend, its stats and ``observe(pipeline)``,
    both taken while enabled.  Fails if the measured peak exceeds the budget (``expected``:
    the candidate the budget allows, for the message)."""
    what = f"strategy='auto', device_budget_bytes={budget}"
    pipeline = case.build()
    backend = case.backend(_auto_config(budget), platform)
    try:
        backend.enable(pipeline)
        got = case.run(pipeline) if want is not None else None
        stats = backend.stats()
        seen = observe(pipeline)
        if want is not None:  # while enabled: a parity diagnosis reruns the offloaded pipeline
            case.compare(what, got, want)
    finally:
        backend.disable()
    if stats.peak_device_weight_bytes > budget or stats.peak_device_bytes > budget:
        fail(f"{what}: the measured peak device bytes exceed the budget (weights "
             f"{stats.peak_device_weight_bytes}, with padding {stats.peak_device_bytes}); "
             f"the budget allows {expected.label()} (predicted {expected.predicted})")
    return backend, stats, seen


def _leading_unhooked(pipeline: Any, block_paths: tuple[str, ...], platform: Any) -> int:
    """How many leading blocks of a ring are on the device with no forward hook: its head."""
    k = 0
    for path in block_paths:
        block = get_submodule_path(pipeline, path)
        tensors = [t for _, t in module_tensors(block) if t.numel()]
        if block._forward_pre_hooks or block._forward_hooks or \
                not all(platform.is_resident(t) for t in tensors):
            break
        k += 1
    return k
