"""Offload topology: what a model declares (:class:`OffloadPlan`) and what the offloader will do
(:class:`ResolvedOffloadPlan`, from the pure :func:`resolve_offload_plan`).

Note [Resolution is pure]
    ``resolve_offload_plan`` moves no tensor, installs no hook, writes no attribute and reads no
    process group: multi-rank facts come from :class:`OffloadConfig`.  Every topology error is
    raised here, so a pipeline the offloader cannot serve is rejected before its first component
    is placed.  Backends consume the resolved plan alone; they never rediscover containers by name.

Note [Ownership by identity]
    Blocks are identified by object identity, tensors by storage.  A block reachable from two
    components is rejected ("claimed by both").  A tensor of the ring's owner outside the blocks
    that shares storage with one block's tensor is recorded as a ring alias and travels with that
    block.  A block tensor that something else also uses (a second block, another component: a
    tied weight) is recorded in ``BlockStack.shared`` and kept resident once.  Either way no
    storage ever gets two masters or two independent device copies.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .config import ENCODER_KINDS, OffloadConfig, OffloadStrategy, WeightTransfer
from .host import ALLOCATOR_ALIGNMENT, padded_span_bytes, storage_key
from .discovery import (
    _MISSING,
    ModuleCycleError,
    OffloadDeclarationWarning,
    discover_components,
    get_submodule_path,
    require_acyclic,
    supports_model_cpu_offload,
)

__all__ = [
    "AutoCandidate",
    "AutoChoice",
    "BlockStack",
    "OffloadPlan",
    "OffloadTopologyError",
    "ResolvedComponent",
    "ResolvedOffloadPlan",
    "RingAlias",
    "auto_candidates",
    "encoder_kind",
    "head_candidates",
    "named_tensors",
    "owned_tensors",
    "pipeline_state",
    "resolve_offload_plan",
    "staging_budget_error",
    "selectable_components",
]


class OffloadTopologyError(ValueError):
    """The pipeline's declarations cannot serve the requested strategy.

    The message names the dotted path and what to declare.
    """


def _frozen_map(mapping: Mapping | None, value_kind: str) -> Mapping:
    result = {}
    for key, value in dict(mapping or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"OffloadPlan: keys must be dotted paths (str), got {key!r}")
        if value_kind == "tuple":
            value = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(v, str) for v in value):
                raise TypeError(f"OffloadPlan[{key!r}] must be attribute names, got {value!r}")
        elif not isinstance(value, str):
            raise TypeError(f"OffloadPlan[{key!r}] must be an attribute name, got {value!r}")
        result[key] = value
    return MappingProxyType(result)


def _head_map(mapping: Any) -> Mapping[str, int]:
    """``OffloadPlan.layerwise_resident_layers``: dotted DiT path -> a non-negative int."""
    where = "OffloadPlan.layerwise_resident_layers"
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{where} = {mapping!r}: must be a mapping of DiT path to a number of "
                        "leading blocks, e.g. {'transformer': 2}")
    result = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys must be dotted DiT paths (str), got {key!r}")
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}[{key!r}] = {value!r}: must be an int >= 0 (the number of "
                             "leading blocks kept on the device)")
        result[key] = value
    return MappingProxyType(result)


@dataclass(frozen=True)
class OffloadPlan:
    """Model-declared offload topology (a class attribute ``_offload_plan`` of the pipeline).

    * ``block_attrs``: DiT path -> ordered block containers (beats ``_layerwise_offload_blocks_attrs``);
    * ``encoder_block_attrs``: encoder path -> block containers that stream during conditioning;
    * ``offload_submodules``: path of a DiT submodule that owns its residency -> its container;
    * ``resident_dit_paths``: DiTs that may keep ``resident_layers`` leading blocks on the device
      under distributed layerwise (the config's ``LayerOptions.resident_layers`` says how many);
    * ``layerwise_resident_layers``: DiT path -> how many leading blocks stay on the device under
      plain layerwise offload (a resident head: placed once at enable, never hooked; the rest
      stream, at least two of them).  ``strategy="auto"`` chooses its own head (Note [Auto mode]);
    * ``on_demand_component_paths``: components whose residency the pipeline manages through
      ``load_to_device()`` / ``offload_to_cpu()``;
    * ``encoder_dlo_weight_replication``: encoders whose loaded weights are identical on every rank
      (required before their blocks may be sharded and rebuilt by AllGather);
    * ``encoder_component_types``: encoder path -> its kind, ``"text_encoder"`` or
      ``"image_encoder"`` (the config names it selects it by); undeclared encoders take their kind
      from the path's last name (see :func:`encoder_kind`).

    Paths are dotted, relative to the pipeline; container names are relative to their owner.
    """

    block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    encoder_block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    offload_submodules: Mapping[str, str] = field(default_factory=dict)
    resident_dit_paths: tuple[str, ...] = ()
    on_demand_component_paths: tuple[str, ...] = ()
    encoder_dlo_weight_replication: tuple[str, ...] = ()
    encoder_component_types: Mapping[str, str] = field(default_factory=dict)
    layerwise_resident_layers: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_attrs", _frozen_map(self.block_attrs, "tuple"))
        object.__setattr__(
            self, "encoder_block_attrs", _frozen_map(self.encoder_block_attrs, "tuple")
        )
        object.__setattr__(self, "offload_submodules", _frozen_map(self.offload_submodules, "str"))
        kinds = _frozen_map(self.encoder_component_types, "str")
        for path, kind in kinds.items():
            if kind not in ENCODER_KINDS:
                raise ValueError(
                    f"OffloadPlan.encoder_component_types maps encoder {path!r} to unknown "
                    f"component {kind!r}; accepted: {list(ENCODER_KINDS)}"
                )
        object.__setattr__(self, "encoder_component_types", kinds)
        object.__setattr__(self, "layerwise_resident_layers",
                           _head_map(self.layerwise_resident_layers))
        for name in ("resident_dit_paths", "on_demand_component_paths",
                     "encoder_dlo_weight_replication"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:
        return hash((
            tuple(self.block_attrs.items()), tuple(self.encoder_block_attrs.items()),
            tuple(self.offload_submodules.items()), self.resident_dit_paths,
            self.on_demand_component_paths, self.encoder_dlo_weight_replication,
            tuple(self.encoder_component_types.items()),
            tuple(self.layerwise_resident_layers.items()),
        ))


@dataclass(frozen=True)
class RingAlias:
    """A tensor outside the blocks that shares storage with a streamed block's tensor."""

    path: str  # qualified name of the aliasing parameter/buffer, relative to the pipeline
    block_path: str  # the block whose host master owns the storage
    tensor_path: str  # the block tensor it aliases


@dataclass(frozen=True, eq=False)
class BlockStack:
    """One ring of blocks streamed in order (the concatenation of its containers)."""

    owner_path: str
    container_paths: tuple[str, ...]
    blocks: tuple[nn.Module, ...]
    block_paths: tuple[str, ...]
    #: Leading blocks kept on the device, never streamed nor hooked (``OffloadPlan.
    #: layerwise_resident_layers``, or ``resident_layers`` under distributed layerwise).
    resident_head: int = 0
    transfer: WeightTransfer = WeightTransfer.RANK_LOCAL
    aliases: tuple[RingAlias, ...] = ()
    #: Block tensors also used outside their block (another block, another component): kept
    #: resident once instead of streamed with two masters.
    shared: tuple[str, ...] = ()

    @property
    def streamed_blocks(self) -> tuple[nn.Module, ...]:
        return self.blocks[self.resident_head:]

    def _key(self) -> tuple:
        return (self.owner_path, self.container_paths, tuple(map(id, self.blocks)),
                self.block_paths, self.resident_head, self.transfer, self.aliases, self.shared)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockStack) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True, eq=False)
class ResolvedComponent:
    path: str
    module: nn.Module
    role: str  # "dit" | "encoder" | "vae" | "resident"
    selected: bool  # offloaded by the strategy (otherwise kept on the device)
    on_demand: bool = False  # residency owned by the pipeline (load_to_device / offload_to_cpu)
    stacks: tuple[BlockStack, ...] = ()
    kind: str = ""  # the config name that selects it: "dit", "text_encoder", "image_encoder", ...
    #: Paths of the other components inside this one's module tree: their tensors follow their
    #: own rule (a resident nested in a DiT stays on the device while the DiT swaps).
    nested: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", self.role)

    def _key(self) -> tuple:
        return (self.path, id(self.module), self.role, self.selected, self.on_demand, self.stacks,
                self.kind, self.nested)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResolvedComponent) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class AutoCandidate:
    """One strategy ``strategy="auto"`` considers: its concrete config, its predicted peak device
    bytes (None when it cannot serve the pipeline, or its peak cannot be predicted: ``reason``)."""

    name: str  # "none", "model_level", "layer_wise" or "layer_wise+encoders"
    config: OffloadConfig
    predicted: int | None
    reason: str = ""
    #: Layer strategies: the resident head of each DiT ring, as (path, leading blocks) pairs,
    #: replacing the model's ``layerwise_resident_layers`` (``()``: no head); None elsewhere.
    heads: tuple[tuple[str, int], ...] | None = None

    def label(self) -> str:
        if self.name == "none":
            return "none (every weight resident)"
        kept = [f"{path}: {k}" for path, k in self.heads or () if k]
        head = f"; resident head {', '.join(kept)}" if kept else ""
        return f"{self.name} ({', '.join(self.config.components)}{head})"

    @property
    def resident_heads(self) -> dict[str, int] | None:
        """The heads as ``resolve_offload_plan(resident_heads=...)`` takes them."""
        return None if self.heads is None else dict(self.heads)


@dataclass(frozen=True)
class AutoChoice:
    """What ``strategy="auto"`` chose for a budget, and every strategy it weighed."""

    budget: int
    chosen: str
    candidates: tuple[AutoCandidate, ...]
    #: The chosen layer strategy with each resident head it weighed (k = 0, 1, ...); the
    #: largest whose prediction fits is ``picked``.  Empty for other strategies.
    heads: tuple[AutoCandidate, ...] = ()

    @property
    def picked(self) -> AutoCandidate:
        """The candidate enable builds: the chosen strategy, with its resident head."""
        fitting = [c for c in self.heads if c.predicted is not None
                   and c.predicted <= self.budget]
        if fitting:
            return fitting[-1]
        return next(c for c in self.candidates if c.name == self.chosen)

    def describe(self) -> list[str]:
        picked = self.picked
        lines = [f"auto: picked {picked.label()} (predicted peak {picked.predicted} bytes <= "
                 f"budget {self.budget})"]
        if self.heads:
            k = self.heads.index(picked)
            more = (f"; a head of {k + 1} would need {self.heads[k + 1].predicted} bytes"
                    if k + 1 < len(self.heads) else "; no larger head leaves two blocks "
                    "streaming")
            lines.append(f"  resident head: {k} leading block(s) of each DiT ring kept on the "
                         f"device{more}")
        for c in self.candidates:
            if c.predicted is None:
                verdict = f"not achievable: {c.reason}"
            elif c.name == self.chosen:
                verdict = f"{c.predicted} bytes  <- picked"
            elif c.predicted > self.budget:
                verdict = f"would need {c.predicted} bytes (over budget)"
            else:
                verdict = f"{c.predicted} bytes (fits; a coarser strategy was picked)"
            lines.append(f"  {c.label()}: {verdict}")
        return lines


@dataclass(frozen=True)
class ResolvedOffloadPlan:
    """What a backend will do to a pipeline.  ``skip_reason`` set means: nothing at all."""

    strategy: OffloadStrategy
    components: tuple[ResolvedComponent, ...] = ()
    skip_reason: str | None = None
    delegated: bool = False  # split model: the pipeline's enable_omni_model_cpu_offload owns it
    warnings: tuple[str, ...] = ()
    other_state_bytes: int = 0  # parameters/buffers of the pipeline outside every component
    device_bytes_bound: int = 0  # predicted peak device bytes, padding included (see _predict)
    alignment: int = ALLOCATOR_ALIGNMENT  # the platform's alignment the prediction assumes
    world_size: int = 1  # ranks an AllGather ring shards across (distributed layerwise)
    #: ``strategy="auto"``: the choice this plan is (``strategy`` is the chosen one; ``NONE``
    #: with no skip_reason means every weight resident on the device).
    auto: AutoChoice | None = None

    def by_role(self, role: str) -> tuple[ResolvedComponent, ...]:
        return tuple(c for c in self.components if c.role == role)

    @property
    def dits(self) -> tuple[ResolvedComponent, ...]:
        return self.by_role("dit")

    @property
    def encoders(self) -> tuple[ResolvedComponent, ...]:
        return self.by_role("encoder")

    @property
    def stacks(self) -> tuple[BlockStack, ...]:
        return tuple(s for c in self.components for s in c.stacks)

    def component(self, path: str) -> ResolvedComponent:
        for c in self.components:
            if c.path == path:
                return c
        raise KeyError(path)

    def describe(self) -> str:
        """A human-readable account of the topology (used by ``offload-ref plan``)."""
        lines = list(self.auto.describe()) if self.auto is not None else []
        lines.append(f"strategy: {self.strategy.value}")
        if self.strategy is OffloadStrategy.NONE and self.skip_reason is None:
            lines.append(f"every weight resident on the device: predicted peak device bytes: "
                         f"{self.predicted_device_bytes()} (tensors in {self.alignment}-byte "
                         "aligned regions)")
        if self.skip_reason:
            lines.append(f"skipped: {self.skip_reason}")
        if self.delegated:
            lines.append("delegated to the pipeline's enable_omni_model_cpu_offload")
        for c in self.components:
            flags = [c.role if c.kind == c.role else f"{c.role} ({c.kind})",
                     "offloaded" if c.selected else "resident"]
            if c.on_demand:
                flags.append("on-demand")
            if c.nested:
                flags.append(f"nested {', '.join(c.nested)} not in its group")
            lines.append(f"  {c.path} ({', '.join(flags)}): {_nbytes_of(c.module)} bytes")
            for s in c.stacks:
                sizes = [_nbytes_of(b) for b in s.blocks]
                lines.append(
                    f"    ring {'+'.join(s.container_paths)}: {len(s.blocks)} blocks, largest "
                    f"{max(sizes)} bytes, resident head {s.resident_head}, transfer "
                    f"{s.transfer.value}"
                )
                for a in s.aliases:
                    lines.append(f"      alias {a.path} -> {a.tensor_path}")
                for name in s.shared:
                    lines.append(f"      shared (kept resident) {name}")
        if self.components:
            lines.append(f"predicted peak device bytes: {self.predicted_device_bytes()} "
                         f"(of which {self.other_state_bytes} outside every component; tensors "
                         f"in {self.alignment}-byte aligned regions)")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def predicted_device_bytes(self) -> int:
        """The strategy's residency bound, computed when the plan was resolved (before any
        tensor moved): see :func:`_predict`.  It equals ``stats().peak_device_bytes`` after a
        generation on a platform with the same ``alignment``."""
        return self.device_bytes_bound


def _predict(plan: ResolvedOffloadPlan) -> int:
    """Model level keeps the resident state plus the largest swap group (one DiT, or the
    encoders); layerwise keeps everything but the streamed blocks, plus two of each ring's
    largest block.  A swap group is its component's own tensors (:func:`owned_tensors`);
    pipeline-managed (on-demand) components hold no bytes of ours, but their rings do.  Bytes
    are storage spans, counted once however many paths reach them, each in its aligned region
    (the bytes a host master or device copy allocates, padding included)."""
    if not plan.components:
        return plan.other_state_bytes
    a = plan.alignment
    placed = [c for c in plan.components if not c.on_demand]
    if plan.strategy is OffloadStrategy.MODEL_LEVEL:
        swapped = [c for c in placed if c.selected and c.role in ("dit", "encoder")]
        kept = _span_bytes(_tensors(*(c.module for c in placed if c not in swapped)), a)
        groups = [_span_bytes((t for _, t in owned_tensors(plan, c)), a)
                  for c in swapped if c.role == "dit"]
        groups.append(_span_bytes((t for c in swapped if c.role == "encoder"
                                   for _, t in owned_tensors(plan, c)), a))
        return plan.other_state_bytes + kept + max(groups)
    held = _tensors(*(c.module for c in placed))
    held_ids = {id(t) for t in held}
    rings = [s for s in plan.stacks if len(s.streamed_blocks) >= 2]
    # One walk per block: its streamed tensors serve both its slot size and the streamed total.
    block_tensors = [[_streamed_tensors(s, k) for k in range(len(s.streamed_blocks))]
                     for s in rings]
    per_block = [[_span_bytes(ts, a) for ts in blocks] for blocks in block_tensors]
    streamed = _span_bytes([t for blocks in block_tensors for ts in blocks for t in ts
                            if id(t) in held_ids], a)
    return (plan.other_state_bytes + _span_bytes(held, a) - streamed
            + sum(2 * _slot_bytes(max(sizes), s.transfer, plan.world_size, a)
                  for s, sizes in zip(rings, per_block)))


def staging_budget_error(budget: int, slot_bytes: int) -> str:
    """The refusal of a staging budget that cannot hold two slots (Note [Pinned staging] in
    backends/staging.py)."""
    return (f"OffloadConfig.staging_budget_bytes = {budget} cannot hold two pinned staging "
            f"slots of the largest file-backed block ({slot_bytes} bytes each, "
            f"{2 * slot_bytes} for two): one slot is filled while the copy reads the other.  "
            f"Raise it to at least {2 * slot_bytes}, or set staging_slots=0 to copy from the "
            "file pages directly")


def shard_bytes(image_bytes: int, world: int, alignment: int) -> int:
    """Bytes of each rank's shard of a block whose slot image has ``image_bytes`` bytes, for an
    AllGather across ``world`` ranks: ceil(image / world), rounded up to ``alignment`` (Note
    [AllGather transport] in backends/distributed.py)."""
    if not image_bytes:
        return 0
    share = -(-image_bytes // world)
    return -(-share // alignment) * alignment


def _slot_bytes(image_bytes: int, transfer: WeightTransfer, world: int, alignment: int) -> int:
    """Bytes of one ring slot for the largest block's ``image_bytes``: the image itself, or
    ``world`` shards of it for AllGather."""
    if transfer is not WeightTransfer.ALLGATHER or world == 1:
        return image_bytes
    return world * shard_bytes(image_bytes, world, alignment)


def owned_tensors(plan: ResolvedOffloadPlan,
                  comp: ResolvedComponent) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of ``comp``'s own tensors: its module's, minus those of the
    components nested in it (``comp.nested``), which follow their own rule."""
    inner: set[int] = set()
    for path in comp.nested:
        inner.update(id(t) for t in _tensors(plan.component(path).module))
    return [(name, t) for name, t in named_tensors(comp.module, comp.path) if id(t) not in inner]


def pipeline_state(pipeline: Any, exclude: Iterable[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``pipeline`` outside the ``exclude`` subtrees (what no
    component owns: it stays on the device under every strategy)."""
    if isinstance(pipeline, nn.Module):
        require_acyclic(pipeline, error=OffloadTopologyError)  # the walk below is recursive
    excluded = {id(m) for root in exclude for m in root.modules()}
    out = []

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in excluded:
            return
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is not None:
                    out.append((f"{prefix}{name}", t))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    if isinstance(pipeline, nn.Module):
        walk(pipeline, "")
    else:
        # A plain-object pipeline (diffusers-style): its nn.Module attributes are its tree, so
        # an undeclared module attribute is pipeline state too, as a child of an nn.Module
        # pipeline would be; skipping it would leave it on the host under every strategy.
        for name, module in _module_attributes(pipeline):
            if id(module) not in excluded:
                require_acyclic(module, f"{name}.", error=OffloadTopologyError)
                walk(module, f"{name}.")
    return out


def _module_attributes(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """The nn.Module attributes of a plain-object pipeline: instance attributes, then the values
    of its ``__slots__`` (discovery resolves both)."""
    out = [(n, v) for n, v in getattr(pipeline, "__dict__", {}).items()
           if isinstance(v, nn.Module)]
    seen = {n for n, _ in out}
    for cls in type(pipeline).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in seen and name not in ("__dict__", "__weakref__"):
                value = getattr(pipeline, name, None)
                if isinstance(value, nn.Module):
                    seen.add(name)
                    out.append((name, value))
    return out


def _tensors(*modules: nn.Module) -> list[torch.Tensor]:
    """The distinct parameters and buffers of ``modules``, in the order of ``parameters()``
    then ``buffers()`` per module.  The walk reads the modules' registries directly, as
    ``named_modules`` does: torch's generators cost several times more per module, and the
    resolver walks each component more than once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for module in modules:
        subtree = _subtree(module)
        for registry in ("_parameters", "_buffers"):
            for m in subtree:
                for t in m.__dict__.get(registry, {}).values():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
    return out


def _subtree(module: nn.Module) -> list[nn.Module]:
    """``module.modules()``: each module of the subtree once, in pre-order."""
    out = [module]
    seen = {id(module)}
    stack = [iter(module._modules.values())]
    while stack:
        for child in stack[-1]:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                stack.append(iter(child._modules.values()))
                break
        else:
            stack.pop()
    return out


def _streamed_tensors(stack: BlockStack, k: int) -> list[torch.Tensor]:
    """Block k's tensors that its ring streams (its shared ones stay resident)."""
    shared = set(stack.shared)
    path = stack.block_paths[stack.resident_head + k]
    return [t for name, t in named_tensors(stack.streamed_blocks[k], path) if name not in shared]


def _span_bytes(tensors: Iterable[torch.Tensor], alignment: int) -> int:
    """Bytes a host master of ``tensors`` allocates: per storage (counted once), the aligned
    region of the span its tensors touch (Note [Aligned layout] in host.py)."""
    return padded_span_bytes(tensors, alignment)


def _nbytes_of(*modules: nn.Module) -> int:
    """Bytes of the distinct tensors of ``modules``."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


# -- resolution ------------------------------------------------------------------------------------


class _Resolver:
    def __init__(self, pipeline: Any, config: OffloadConfig,
                 alignment: int = ALLOCATOR_ALIGNMENT,
                 resident_heads: Mapping[str, int] | None = None) -> None:
        self.pipeline = pipeline
        self.config = config
        self.alignment = alignment
        self.cls_name = type(pipeline).__name__
        self.warnings: list[str] = []
        plan = getattr(pipeline, "_offload_plan", None)
        if plan is not None and not isinstance(plan, OffloadPlan):
            raise TypeError(
                f"{self.cls_name}._offload_plan must be an offload_ref.OffloadPlan, got "
                f"{type(plan).__name__}"
            )
        self.plan = plan or OffloadPlan()
        # Plain layerwise's resident heads: the model's declaration, or auto's choice.
        self.heads: Mapping[str, int] = (self.plan.layerwise_resident_layers
                                         if resident_heads is None else resident_heads)
        self.head_source = ("OffloadPlan.layerwise_resident_layers" if resident_heads is None
                            else "the resident head strategy='auto' chose")

    @property
    def explicit(self) -> bool:
        return self.config.explicit

    def fail_or_warn(self, message: str) -> None:
        """Explicit selections turn declaration problems into errors; legacy ones warn."""
        if self.explicit:
            raise OffloadTopologyError(message)
        self.warnings.append(message)
        warnings.warn(message, OffloadDeclarationWarning, stacklevel=4)

    def resolve(self) -> ResolvedOffloadPlan:
        strategy = self.config.strategy
        if strategy is OffloadStrategy.NONE:
            return ResolvedOffloadPlan(strategy, skip_reason="offloading is disabled")
        if strategy is OffloadStrategy.MODEL_LEVEL and supports_model_cpu_offload(self.pipeline):
            self._validate_delegated()
            return ResolvedOffloadPlan(strategy, delegated=True)

        try:
            found = discover_components(self.pipeline, warn=self._warn_scan)
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        for role, path in found.missing:
            wanted = {"dit": "dit", "encoder": "text_encoder"}.get(role)
            message = (
                f"{self.cls_name}: declared {role} path {path!r} does not exist on the pipeline; "
                "fix the declaration in _" + role + "_modules"
            )
            if wanted is not None and self.config.selects(wanted):
                self.fail_or_warn(message)
            else:
                self.warnings.append(message)

        self._reject_unreadable_storage(found)
        self._check_plan_keys(found)  # before a strategy reads them: a typo would be ignored
        if strategy is OffloadStrategy.MODEL_LEVEL:
            components = self._model_level(found)
        else:
            components = self._layerwise(found)
        if isinstance(components, str):
            return ResolvedOffloadPlan(strategy, skip_reason=components,
                                       warnings=tuple(self.warnings))
        components = _with_nested(components)
        self._check_nesting(components)
        self._check_unique_ownership(components)
        if strategy is OffloadStrategy.MODEL_LEVEL:
            self._check_one_group_per_storage(components)
        components = _with_shared(self.pipeline, components)
        self._check_staging_budget(components)
        plan = ResolvedOffloadPlan(strategy, tuple(components), warnings=tuple(self.warnings),
                                   other_state_bytes=_other_state_bytes(
                                       self.pipeline, components, self.alignment),
                                   alignment=self.alignment,
                                   world_size=self.config.world_size)
        return dataclasses.replace(plan, device_bytes_bound=_predict(plan))

    def _check_staging_budget(self, components: list[ResolvedComponent]) -> None:
        """A staging budget must hold two slots of the largest block served from file pages
        (Note [Pinned staging] in backends/staging.py); refused here, before any mutation."""
        budget = self.config.staging_budget_bytes
        if budget is None or self.config.strategy is OffloadStrategy.MODEL_LEVEL:
            return
        from .loading import is_file_backed

        largest = 0
        for c in components:
            for s in c.stacks:
                if len(s.streamed_blocks) < 2 or s.transfer is not WeightTransfer.RANK_LOCAL:
                    continue
                for k in range(len(s.streamed_blocks)):
                    tensors = _streamed_tensors(s, k)
                    if any(t.numel() and is_file_backed(t) for t in tensors):
                        largest = max(largest, _span_bytes(tensors, self.alignment))
        if largest and budget < 2 * largest:
            raise OffloadTopologyError(f"{self.cls_name}: "
                                       f"{staging_budget_error(budget, largest)}")

    def _validate_delegated(self) -> None:
        """A split model's own component groups walk its module tree and copy its tensors as
        any backend does: it gets the same input validation (a cycle, a sparse or unreadable
        tensor named with its path), before its enable_omni_model_cpu_offload mutates it."""
        try:
            found = discover_components(self.pipeline, warn=lambda message: None)
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        self._reject_unreadable_storage(found)

    def _reject_unreadable_storage(self, found) -> None:
        """Tensor subclasses without readable storage (DTensor, other wrapper subclasses) have
        no storage a host master could copy or a rebind could keep: reject them here, before
        anything is placed (the storage-key helpers would crash on them later)."""
        if isinstance(self.pipeline, nn.Module):
            roots = [("", self.pipeline)]
        else:
            roots = [(f"{path}.", module) for group in (found.dits, found.encoders, found.vaes,
                                                        found.residents)
                     for path, module in group]
        for prefix, root in roots:
            for name, t in named_tensors(root, ""):
                if isinstance(t, nn.parameter.UninitializedTensorMixin):
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} is uninitialized (a lazy "
                        f"module such as nn.LazyLinear that has not run yet): its size is not "
                        "known, so no host master or device slot can be planned.  Run one "
                        "forward of the pipeline (or of that module) before enabling offload"
                    )
                if t.layout is not torch.strided:
                    layout = str(t.layout)
                    kind = "sparse" if t.is_sparse or "sparse" in layout else "non-strided"
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} has layout {layout} "
                        f"({kind}); offload-ref offloads dense strided tensors only (a host "
                        "master is a flat copy of a strided storage).  Convert it with "
                        ".to_dense() before enabling offload, or keep it out of the module tree "
                        "(a plain attribute, not a parameter or buffer), where it stays where it "
                        "is (docs/model-authors.md)"
                    )
                if not _has_readable_storage(t):
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} is a {type(t).__name__}, a "
                        "tensor subclass whose storage cannot be read (a DTensor from FSDP/HSDP "
                        "or tensor parallelism, or another wrapper subclass); offload-ref offloads "
                        "plain dense tensors only.  Materialize it before enabling offload (a "
                        "DTensor: .full_tensor() or .to_local()), or do not combine offload with "
                        "sharded parameters (docs/model-authors.md)"
                    )

    def _warn_scan(self, message: str) -> None:
        warnings.warn(message, OffloadDeclarationWarning, stacklevel=5)
        self.warnings.append(message)

    # -- model level ---------------------------------------------------------------------------

    def _model_level(self, found) -> list[ResolvedComponent] | str:
        wants_dit = self.config.selects("dit")
        wants_encoder = any(self.config.selects(kind) for kind in ENCODER_KINDS)
        if not found.dits:
            message = (
                f"{self.cls_name}: model-level offload requires a DiT/transformer module; declare "
                "it in _dit_modules (offload_ref.SupportsComponentDiscovery)"
            )
            if self.explicit:
                raise OffloadTopologyError(message)
            return "no DiT module found; model-level offload has nothing to swap"
        dits_swap_each_other = wants_dit and not wants_encoder and len(found.dits) > 1
        if not found.encoders and self.explicit and not dits_swap_each_other:
            raise OffloadTopologyError(
                f"{self.cls_name}: model-level offload requires an encoder execution stage to "
                "swap against; declare it in _encoder_modules (or select only 'dit' on a "
                "pipeline with at least two DiTs)"
            )
        comps = [ResolvedComponent(p, m, "dit", wants_dit) for p, m in found.dits]
        for p, m in found.encoders:
            kind = self._encoder_kind(p)
            comps.append(ResolvedComponent(p, m, "encoder", self.config.selects(kind), kind=kind))
        comps += self._vaes(found, on_demand=set())
        comps += [ResolvedComponent(p, m, "resident", False) for p, m in found.residents]
        return comps

    # -- kinds and lifecycles ------------------------------------------------------------------

    def _encoder_kind(self, path: str) -> str:
        return encoder_kind(self.plan, path)

    def _vaes(self, found, on_demand: set[str]) -> list[ResolvedComponent]:
        """Selecting ``"vae"`` hands every VAE to the lifecycle its pipeline declares; a VAE
        that is not selected stays on the device (or, listed in ``on_demand``, the pipeline's)."""
        selected = self.config.selects("vae")
        if selected and not found.vaes:
            raise OffloadTopologyError(
                f"{self.cls_name}: No VAE modules found for the 'vae' selection; declare them in "
                "_vae_modules (offload_ref.SupportsComponentDiscovery) or drop 'vae' from "
                "components"
            )
        comps = []
        for path, module in found.vaes:
            if selected:
                if path not in self.plan.on_demand_component_paths:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: selected VAE {path!r} requires a pipeline-managed "
                        f"lifecycle: list {path!r} in OffloadPlan.on_demand_component_paths and "
                        f"implement load_to_device() and offload_to_cpu() on "
                        f"{type(module).__name__}, or drop 'vae' from components"
                    )
                self._require_lifecycle(path, module)
                comps.append(ResolvedComponent(path, module, "vae", True, True))
                continue
            staged = path in on_demand
            if staged:
                self._require_lifecycle(path, module)
            comps.append(ResolvedComponent(path, module, "vae", False, staged))
        return comps

    # -- layerwise -----------------------------------------------------------------------------

    def _layerwise(self, found) -> list[ResolvedComponent] | str:
        wants_dit = self.config.selects("dit")
        wants_encoder = any(self.config.selects(kind) for kind in ENCODER_KINDS)
        if not found.dits:
            if wants_dit and self.explicit:
                raise OffloadTopologyError(
                    f"{self.cls_name}: No DiT/transformer modules found for layerwise offload; "
                    "declare them in _dit_modules (offload_ref.SupportsComponentDiscovery)"
                )
            if not wants_encoder or not self.explicit:
                return "no DiT module found; layerwise offload is a no-op for this pipeline"
        if wants_encoder and self.explicit and not found.encoders:
            raise OffloadTopologyError(
                f"{self.cls_name}: component 'text_encoder' is selected but no text encoder "
                "modules were found; declare them in _encoder_modules "
                "(offload_ref.SupportsComponentDiscovery) or drop 'text_encoder' from components"
            )
        on_demand = set(self.plan.on_demand_component_paths)
        comps: list[ResolvedComponent] = []
        for path, module in found.dits:
            stacks: list[BlockStack] = []
            if wants_dit:
                stacks = self._dit_stacks(path, module)
            comps.append(ResolvedComponent(path, module, "dit", bool(stacks), False, tuple(stacks)))
        for path, module in found.encoders:
            # A pipeline-managed encoder is left to the pipeline whether or not it is selected
            # (as a VAE is): the backend never places it, but streams its declared rings.
            stacks, staged = [], path in on_demand
            if staged:
                self._require_lifecycle(path, module)
            kind = self._encoder_kind(path)
            selected = self.config.selects(kind)
            if selected:
                stacks = self._encoder_stacks(path, module, kind)
                if staged and not stacks and self._transfer(kind) is \
                        WeightTransfer.ALLGATHER and self.config.world_size > 1:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: on-demand encoder {path!r} cannot use AllGather "
                        "without a model-declared streamable block plan; declare "
                        "OffloadPlan.encoder_block_attrs or use weight_transfer='rank-local'"
                    )
                if not stacks and not staged:
                    self.fail_or_warn(
                        f"{self.cls_name}: selected {kind.replace('_', ' ')} {path!r} requires a "
                        "model-declared streamable or on-demand plan; declare "
                        f"OffloadPlan(encoder_block_attrs={{{path!r}: (<container>,)}}) or list "
                        "it in OffloadPlan.on_demand_component_paths"
                    )
            comps.append(ResolvedComponent(path, module, "encoder",
                                           bool(stacks) or (staged and selected),
                                           staged, tuple(stacks), kind))
        comps += self._vaes(found, on_demand)
        for path, module in found.residents:
            comps.append(ResolvedComponent(path, module, "resident", False))
        for path, container in self.plan.offload_submodules.items():
            comps.append(self._submodule(path, container))
        if not self.explicit and not any(c.selected for c in comps):
            return ("nothing to stream: no selected component has a streamable block plan "
                    f"({'; '.join(self.warnings) or 'see the declarations'})")
        if self.explicit and not any(c.selected for c in comps):
            raise OffloadTopologyError(
                f"{self.cls_name}: none of the selected components {list(self.config.components)} "
                "has a model-declared streamable or on-demand plan"
            )
        return comps

    def _transfer(self, component: str) -> WeightTransfer:
        if self.config.strategy is not OffloadStrategy.DISTRIBUTED_LAYER_WISE:
            return WeightTransfer.RANK_LOCAL
        return self.config.options_for(component).weight_transfer

    def _require_lifecycle(self, path: str, module: nn.Module) -> None:
        missing = [
            name for name in ("load_to_device", "offload_to_cpu")
            if not callable(getattr(module, name, None))
        ]
        if missing:
            raise OffloadTopologyError(
                f"{self.cls_name}: on-demand component {path!r} ({type(module).__name__}) must "
                f"implement load_to_device() and offload_to_cpu(); missing: {missing}"
            )

    def _container_names(self, path: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        if path in self.plan.block_attrs:
            return tuple(self.plan.block_attrs[path]), f"OffloadPlan.block_attrs[{path!r}]"
        names = getattr(module, "_layerwise_offload_blocks_attrs", None)
        if names is None:
            single = getattr(module, "_layerwise_offload_blocks_attr", None)
            names = None if single is None else [single]
        if names is None:
            return (), ""
        if isinstance(names, str):
            names = [names]
        return tuple(names), f"{type(module).__name__}._layerwise_offload_blocks_attrs"

    def _blocks_of(
        self, owner_path: str, owner: nn.Module, names: Iterable[str], source: str
    ) -> tuple[list[nn.Module], list[str], list[str]]:
        blocks, block_paths, container_paths = [], [], []
        for name in names:
            container = get_submodule_path(owner, name)
            full = f"{owner_path}.{name}"
            if container is _MISSING or container is None:
                raise OffloadTopologyError(
                    f"{self.cls_name}: container {full!r} declared in {source} does not exist on "
                    f"{type(owner).__name__}; fix the declaration or add the attribute"
                )
            container_paths.append(full)
            if isinstance(container, (nn.ModuleList, nn.Sequential)):
                for i, block in enumerate(container):
                    blocks.append(block)
                    block_paths.append(f"{full}.{i}")
            elif isinstance(container, nn.ModuleDict):
                for key, block in container.items():
                    blocks.append(block)
                    block_paths.append(f"{full}.{key}")
            elif isinstance(container, nn.Module):
                blocks.append(container)  # a single module is one block
                block_paths.append(full)
            else:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {full!r} declared in {source} is a "
                    f"{type(container).__name__}, not a module container; point it at an "
                    "nn.ModuleList of blocks"
                )
        return blocks, block_paths, container_paths

    def _dit_stacks(self, path: str, module: nn.Module) -> list[BlockStack]:
        names, source = self._container_names(path, module)
        if not names:
            self.fail_or_warn(
                f"{self.cls_name}: DiT {path!r} ({type(module).__name__}) has no streamable "
                "layerwise-offload blocks; declare _layerwise_offload_blocks_attrs on "
                f"{type(module).__name__} or OffloadPlan(block_attrs={{{path!r}: (...)}})"
            )
            return []
        blocks, block_paths, container_paths = self._blocks_of(path, module, names, source)
        head = 0
        options = self.config.options_for("dit")
        strategy = self.config.strategy
        if strategy is OffloadStrategy.LAYER_WISE and self.heads.get(path, 0):
            head = self.heads[path]
            if len(blocks) - head < 2:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {self.head_source}[{path!r}] = {head} leaves "
                    f"{max(len(blocks) - head, 0)} of the {len(blocks)} blocks of DiT {path!r} "
                    "streaming; layerwise offload streams at least two; lower it to at most "
                    f"{max(len(blocks) - 2, 0)}"
                )
        if strategy is OffloadStrategy.DISTRIBUTED_LAYER_WISE and options.resident_layers:
            if path not in self.plan.resident_dit_paths:
                self.fail_or_warn(
                    f"{self.cls_name}: resident_layers={options.resident_layers} needs DiT "
                    f"{path!r} in OffloadPlan.resident_dit_paths"
                )
            else:
                head = min(options.resident_layers, len(blocks))
                if len(blocks) - head == 1:
                    if self.explicit:
                        raise OffloadTopologyError(
                            f"{self.cls_name}: DiT {path!r} has {len(blocks)} blocks; "
                            f"resident_layers={options.resident_layers} leaves only one streaming "
                            "block; lower resident_layers or keep every block resident"
                        )
                    head = len(blocks)
        streaming = len(blocks) - head
        if streaming == 0 and head:
            pass  # every block resident: nothing streams, nothing to check
        elif streaming < 2:
            self.fail_or_warn(
                f"{self.cls_name}: layerwise offload requires at least two blocks; DiT {path!r} "
                f"has {len(blocks)} in {list(container_paths)} ({source})"
            )
            return []
        return [self._stack(path, module, container_paths, blocks, block_paths, head,
                            self._transfer("dit"))]

    def _encoder_stacks(self, path: str, module: nn.Module, kind: str) -> list[BlockStack]:
        names = self.plan.encoder_block_attrs.get(path)
        if not names:
            return []
        transfer = self._transfer(kind)
        if transfer is WeightTransfer.ALLGATHER and self.config.world_size > 1 and \
                path not in self.plan.encoder_dlo_weight_replication:
            raise OffloadTopologyError(
                f"{self.cls_name}: encoder {path!r} with weight_transfer='allgather' needs its "
                "loaded weights declared identical on every rank: add it to "
                "OffloadPlan.encoder_dlo_weight_replication, or use weight_transfer='rank-local'"
            )
        stacks = []
        source = f"OffloadPlan.encoder_block_attrs[{path!r}]"
        for name in names:  # each declared encoder container streams as its own ring
            blocks, block_paths, container_paths = self._blocks_of(path, module, [name], source)
            if len(blocks) < 2:
                self.fail_or_warn(
                    f"{self.cls_name}: {container_paths[0]!r} declared in {source} is not a "
                    f"streamable block list (it has {len(blocks)} block)"
                )
                continue
            stacks.append(self._stack(path, module, container_paths, blocks, block_paths, 0,
                                      transfer))
        return stacks

    def _submodule(self, path: str, container: str) -> ResolvedComponent:
        module = get_submodule_path(self.pipeline, path)
        if not isinstance(module, nn.Module):
            raise OffloadTopologyError(
                f"{self.cls_name}: OffloadPlan.offload_submodules names {path!r}, which is not a "
                "module of the pipeline"
            )
        try:
            require_acyclic(module, f"{path}.")
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        target = get_submodule_path(module, container)
        if isinstance(target, (nn.ModuleList, nn.Sequential)) and len(target) >= 2:
            blocks, block_paths, container_paths = self._blocks_of(
                path, module, [container], f"OffloadPlan.offload_submodules[{path!r}]")
            stack = self._stack(path, module, container_paths, blocks, block_paths, 0,
                                self._transfer("dit"))
            return ResolvedComponent(path, module, "dit", True, False, (stack,))
        self.warnings.append(
            f"{self.cls_name}: {path}.{container} is not a streamable block list; {path!r} is "
            "treated as an on-demand component"
        )
        self._require_lifecycle(path, module)
        return ResolvedComponent(path, module, "dit", True, True)

    def _stack(self, owner_path, owner, container_paths, blocks, block_paths, head, transfer):
        aliases = _ring_aliases(owner_path, owner, blocks, block_paths)
        return BlockStack(owner_path, tuple(container_paths), tuple(blocks), tuple(block_paths),
                          head, transfer, aliases)

    # -- declarations and nesting --------------------------------------------------------------

    def _check_plan_keys(self, found) -> None:
        """Every path an :class:`OffloadPlan` field keys on names a discovered component of the
        field's role: a key that names nothing would be ignored, so what it asks for (a ring, a
        resident head, AllGather) would silently not happen.  Keys naming a declared path that
        does not exist were already reported (with the declaration to fix)."""
        missing = {path for _, path in found.missing}
        dits = [p for p, _ in found.dits]
        encoders = [p for p, _ in found.encoders]
        fields = (("block_attrs", self.plan.block_attrs, "DiT", dits, "_dit_modules"),
                  ("resident_dit_paths", self.plan.resident_dit_paths, "DiT", dits,
                   "_dit_modules"),
                  ("encoder_block_attrs", self.plan.encoder_block_attrs, "encoder", encoders,
                   "_encoder_modules"),
                  ("encoder_dlo_weight_replication", self.plan.encoder_dlo_weight_replication,
                   "encoder", encoders, "_encoder_modules"))
        other = {"DiT": ("encoder", encoders), "encoder": ("DiT", dits)}
        # A resident head is new: a key naming no DiT is refused under every config.
        for key in self.plan.layerwise_resident_layers:
            if key not in dits and key not in missing:
                close = difflib.get_close_matches(key, dits, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise OffloadTopologyError(
                    f"{self.cls_name}: OffloadPlan.layerwise_resident_layers names {key!r}, which "
                    f"is no DiT of the pipeline; discovered DiTs: {dits}{hint}.  Fix the key, or "
                    f"declare {key!r} in _dit_modules"
                )
        for name, keys, role, paths, declaration in fields:
            if not paths:
                continue  # no component of the role at all: the strategy reports that (legacy
                # configs record a no-op), with the declaration to fix
            for key in keys:
                if key in paths or key in missing:
                    continue
                close = difflib.get_close_matches(key, paths, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                if key in other[role][1]:
                    hint = f" ({key!r} is an {other[role][0]}, not a {role})"
                self.fail_or_warn(
                    f"{self.cls_name}: OffloadPlan.{name} names {key!r}, which is no {role} of "
                    f"the pipeline; discovered {role}s: {paths}{hint}.  Fix the key, or declare "
                    f"{key!r} in {declaration}"
                )

    def _check_nesting(self, components: list[ResolvedComponent]) -> None:
        """A component inside another component's module tree keeps a residency of its own only
        as a declared resident (or as a part of the same role: a DiT submodule of a DiT).  An
        encoder inside a DiT (or a DiT inside an encoder, or a VAE inside either) would be
        swapped out while the module around it runs, or the other way round: reject it here,
        so what ``plan`` shows is what ``enable`` does."""
        by_path = {c.path: c for c in components}
        for outer in components:
            for path in outer.nested:
                inner = by_path[path]
                if inner.role in ("resident", outer.role):
                    continue
                raise OffloadTopologyError(
                    f"{self.cls_name}: {_ROLE_WORD[inner.role]} {inner.path!r} lies inside the "
                    f"{_ROLE_WORD[outer.role]} {outer.path!r} (one module tree); a component "
                    f"nested in a component of another role must be declared in "
                    f"_resident_modules (it then stays on the "
                    f"device), or drop {inner.path!r} from _{inner.role}_modules (it then "
                    f"follows {outer.path!r}); or move the module out of {outer.path!r}"
                )

    # -- ownership -----------------------------------------------------------------------------

    def _check_unique_ownership(self, components: list[ResolvedComponent]) -> None:
        """A block belongs to one ring.  (Submodules or tensors shared between blocks are
        handled by storage, see Note [Ownership by identity]: a stateless module such as one
        GELU reused by every block is harmless.)"""
        owners: dict[int, str] = {}
        for comp in components:
            for stack in comp.stacks:
                for block, bpath in zip(stack.blocks, stack.block_paths):
                    other = owners.get(id(block))
                    if other is not None and other != bpath:
                        raise OffloadTopologyError(
                            f"{self.cls_name}: block {bpath!r} is claimed by both {other!r} and "
                            f"{bpath!r}; a block may belong to one ring only"
                        )
                    owners[id(block)] = bpath
        # A streamed block must not also be a whole component of another role, nor contain one:
        # a block streams whole, so nothing inside it can keep a residency of its own.
        inside: dict[int, str] = {}  # id of a module strictly inside a streamed block -> block
        for comp in components:
            for stack in comp.stacks:
                for block, bpath in zip(stack.streamed_blocks,
                                        stack.block_paths[stack.resident_head:]):
                    for sub in block.modules():
                        if sub is not block:
                            inside.setdefault(id(sub), bpath)
        for comp in components:
            if id(comp.module) in owners and not comp.stacks:
                raise OffloadTopologyError(
                    f"{self.cls_name}: component {comp.path!r} is claimed by both its own "
                    f"declaration and the ring block {owners[id(comp.module)]!r}"
                )
            if id(comp.module) in inside:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {comp.role} {comp.path!r} lies inside the streamed block "
                    f"{inside[id(comp.module)]!r}; a block streams whole, so nothing inside it "
                    f"can stay {'resident' if comp.role == 'resident' else 'its own component'}: "
                    f"drop {comp.path!r} from _{comp.role}_modules (it then streams with its "
                    "block), or move it out of the block container"
                )

    def _check_one_group_per_storage(self, components: list[ResolvedComponent]) -> None:
        """Model level moves each swap group (one DiT, one encoder) on its own and keeps the
        rest on the device (or leaves it to the pipeline): a storage reachable from two groups
        would need two masters, or two device copies that drift apart."""
        plan = ResolvedOffloadPlan(self.config.strategy, tuple(components))
        claimed: dict[tuple, tuple[str, str]] = {}  # storage -> (tensor path, group)
        resident = "the resident state (kept on the device)"

        def claim(group: str, named: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in named:
                if t is None or not t.numel():
                    continue
                other = claimed.setdefault(_storage_key(t), (name, group))
                if other[1] != group:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: {name} (in {group}) shares storage with {other[0]} "
                        f"(in {other[1]}); a tensor can belong to one offload group only, and "
                        "model-level offload moves these groups separately: untie the tensors, "
                        "or declare both parts as one component"
                    )

        for comp in components:
            if comp.on_demand:
                group = f"pipeline-managed {comp.path!r}"
            elif comp.selected and comp.role in ("dit", "encoder"):
                group = f"swap group {comp.path!r}"
            else:
                group = resident
            claim(group, owned_tensors(plan, comp))
        claim(resident, pipeline_state(self.pipeline, [c.module for c in components]))


_ROLE_WORD = {"dit": "DiT", "encoder": "encoder", "vae": "VAE", "resident": "resident"}


def _with_nested(components: list[ResolvedComponent]) -> list[ResolvedComponent]:
    """Record, per component, the other components inside its module tree (by identity)."""
    out = []
    for comp in components:
        subs = {id(m) for m in comp.module.modules()}
        nested = tuple(c.path for c in components
                       if c.module is not comp.module and id(c.module) in subs)
        out.append(dataclasses.replace(comp, nested=nested) if nested else comp)
    return out


#: Words in an encoder's attribute name that make it an image encoder (CLIP-vision, SigLIP,
#: ViT towers: "image_encoder", "vision_model", "vit", ...).  Everything else is a text encoder,
#: as every encoder was before kinds existed.
_IMAGE_ENCODER_WORDS = ("image", "vision", "vit", "siglip", "visual")


def encoder_kind(plan: OffloadPlan | None, path: str) -> str:
    """``"text_encoder"`` or ``"image_encoder"``: the declaration
    (``OffloadPlan.encoder_component_types``) first, then the path's last name."""
    if plan is not None and path in plan.encoder_component_types:
        return plan.encoder_component_types[path]
    leaf = path.rsplit(".", 1)[-1].lower()
    if any(word in leaf for word in _IMAGE_ENCODER_WORDS):
        return "image_encoder"
    return "text_encoder"


def named_tensors(module: nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` then ``named_buffers`` of ``module`` under ``prefix``, every path
    to a tensor included (``remove_duplicate=False``), None entries skipped; read from the
    registries directly (see :func:`_tensors`)."""
    paths = _named_subtree(module, prefix)
    if paths is None:  # a cycle: torch's own walk reports it (RecursionError), as it did
        paths = list(module.named_modules(prefix=prefix, remove_duplicate=False))
    out = []
    for registry in ("_parameters", "_buffers"):
        for path, m in paths:
            for name, t in m.__dict__.get(registry, {}).items():
                if t is not None:
                    out.append((f"{path}.{name}" if path else name, t))
    return out


def _named_subtree(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]] | None:
    """``named_modules(prefix=prefix, remove_duplicate=False)`` as a list (a module reached by
    two paths is listed under each), or None if a module contains itself."""
    out = [(prefix, module)]
    ancestors = [id(module)]
    stack = [(prefix, iter(module._modules.items()))]
    while stack:
        path, children = stack[-1]
        for name, child in children:
            if child is None:
                continue
            if id(child) in ancestors:
                return None
            child_path = f"{path}.{name}" if path else name
            out.append((child_path, child))
            ancestors.append(id(child))
            stack.append((child_path, iter(child._modules.items())))
            break
        else:
            stack.pop()
            ancestors.pop()
    return out


def _has_readable_storage(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True  # rejected later, with its own message (it was never materialized)
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    if t.is_meta:
        return ("meta", id(t))
    return storage_key(t)


def _ring_aliases(owner_path, owner, blocks, block_paths) -> tuple[RingAlias, ...]:
    """Tensors of ``owner`` outside the blocks that share storage with a block's tensor."""
    in_block: dict[tuple, tuple[str, str]] = {}
    block_tensor_ids: set[int] = set()
    for block, bpath in zip(blocks, block_paths):
        for name, t in named_tensors(block, bpath):
            block_tensor_ids.add(id(t))
            if t.numel():
                in_block.setdefault(_storage_key(t), (bpath, name))
    block_ids = {id(b) for b in blocks}
    aliases = []
    seen: set[str] = set()

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in block_ids:
            return
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is None or not t.numel():
                    continue
                qual = f"{prefix}.{name}"
                hit = in_block.get(_storage_key(t))
                if hit is not None and qual not in seen:
                    seen.add(qual)
                    aliases.append(RingAlias(qual, hit[0], hit[1]))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}")

    walk(owner, owner_path)
    return tuple(aliases)


def _shared_storages(pipeline: Any,
                     components: list[ResolvedComponent]) -> dict[tuple, list[str]]:
    """Storages of streamed-block tensors that something outside their block also uses: another
    block (of any ring), another component, or any other module of the pipeline.  Only the
    ring owner's own non-block tensors are exempt (they are ring aliases).  Modules are told
    apart by identity, so a block or DiT reachable under several paths is one module.  See
    Note [Ownership by identity]."""
    users: dict[tuple, list[str]] = {}  # storage -> tensor paths
    block_of: dict[tuple, set[int]] = {}  # storage -> ids of the blocks holding it
    owner_blocks: dict[int, set[int]] = {}  # ring owner id -> ids of its blocks
    block_ids: set[int] = set()
    for comp in components:
        for stack in comp.stacks:
            owner = get_submodule_path(pipeline, stack.owner_path)
            mine = owner_blocks.setdefault(id(owner), set())
            for block, bpath in zip(stack.blocks, stack.block_paths):
                mine.add(id(block))
                block_ids.add(id(block))
                for name, t in named_tensors(block, bpath):
                    if t.numel():
                        key = _storage_key(t)
                        block_of.setdefault(key, set()).add(id(block))
                        users.setdefault(key, []).append(name)
    shared = {k: sorted(set(v)) for k, v in users.items() if len(block_of[k]) > 1}

    def note(key: tuple, qual: str) -> None:
        shared.setdefault(key, sorted(set(users[key])))
        if qual not in shared[key]:
            shared[key].append(qual)

    def walk(module: nn.Module, prefix: str, visited: set[int], stop: set[int],
             on_tensor: Callable[[tuple, str], None]) -> None:
        if id(module) in visited or id(module) in stop:
            return
        visited.add(id(module))
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                key = _storage_key(t) if t is not None and t.numel() else None
                if key in block_of:
                    on_tensor(key, f"{prefix}{name}")
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", visited, stop, on_tensor)

    # Pass 1: every use outside the ring owners is a sharing use, whatever path reaches it
    # first.  Pass 2: inside an owner (outside its blocks), a tensor of exactly one of that
    # owner's blocks is a ring alias; anything else is sharing.
    owners = {id(get_submodule_path(pipeline, s.owner_path)): s.owner_path
              for c in components for s in c.stacks}
    roots = [(pipeline, "")] if isinstance(pipeline, nn.Module) else [
        (c.module, f"{c.path}.") for c in components]
    outside: set[int] = set()
    for root, prefix in roots:
        walk(root, prefix, outside, block_ids | set(owners), note)
    inside: set[int] = set()
    for owner_id, owner_path in owners.items():
        owner = get_submodule_path(pipeline, owner_path)

        def on_owner_tensor(key: tuple, qual: str, owner_id: int = owner_id) -> None:
            if len(block_of[key]) != 1 or not block_of[key] <= owner_blocks[owner_id]:
                note(key, qual)

        walk(owner, f"{owner_path}.", inside, block_ids | (set(owners) - {owner_id}),
             on_owner_tensor)
    return shared


def _with_shared(pipeline: Any,
                 components: list[ResolvedComponent]) -> list[ResolvedComponent]:
    shared = _shared_storages(pipeline, components)
    if not shared:
        return components
    out = []
    for comp in components:
        stacks = []
        for stack in comp.stacks:
            mine = set()
            for block, bpath in zip(stack.blocks, stack.block_paths):
                for name, t in named_tensors(block, bpath):
                    if t.numel() and _storage_key(t) in shared:
                        mine.add(name)
            if not mine:
                stacks.append(stack)
                continue
            keys = {k for k, names in shared.items() if mine & set(names)}
            aliases = tuple(a for a in stack.aliases
                            if not any(a.tensor_path in shared[k] for k in keys))
            stacks.append(dataclasses.replace(stack, shared=tuple(sorted(mine)),
                                              aliases=aliases))
        out.append(dataclasses.replace(comp, stacks=tuple(stacks)))
    return out


def _other_state_bytes(pipeline: Any, components: list[ResolvedComponent],
                       alignment: int) -> int:
    """Span bytes of the pipeline's tensors reachable from no component (they stay on the
    device whatever the strategy); a view into a component's storage adds only what it touches
    beyond that storage's span."""
    if not isinstance(pipeline, nn.Module):
        return 0
    mine = _tensors(*(c.module for c in components))
    # The same distinct tensors as _tensors(pipeline, *modules), without walking the components
    # twice (a span total does not depend on the order).
    seen = {id(t) for t in mine}
    everything = list(mine)
    everything += [t for t in _tensors(pipeline) if id(t) not in seen]
    return _span_bytes(everything, alignment) - _span_bytes(mine, alignment)


def selectable_components(pipeline: Any, strategy: OffloadStrategy | str) -> tuple[str, ...]:
    """Everything ``pipeline`` lets ``strategy`` offload: model level swaps the DiTs and every
    encoder kind the pipeline has; layer strategies stream the DiTs, and an encoder kind too
    when every encoder of that kind has a streamable (``encoder_block_attrs``) or on-demand
    plan.  ``"vae"`` is never implied (it hands the VAE to the pipeline's own lifecycle).
    Reads only declarations."""
    strategy = OffloadStrategy(strategy)
    plan = getattr(pipeline, "_offload_plan", None)
    plan = plan if isinstance(plan, OffloadPlan) else None
    encoders = discover_components(pipeline, warn=lambda message: None).encoders
    kinds: dict[str, list[str]] = {}
    for path, _ in encoders:
        kinds.setdefault(encoder_kind(plan, path), []).append(path)
    if strategy is OffloadStrategy.MODEL_LEVEL:
        if not kinds:
            return ("dit", "text_encoder")
        return ("dit", *(k for k in ENCODER_KINDS if k in kinds))
    declared = set()
    if plan is not None:
        declared = set(plan.encoder_block_attrs) | set(plan.on_demand_component_paths)
    return ("dit", *(k for k in ENCODER_KINDS
                     if k in kinds and all(p in declared for p in kinds[k])))


def resolve_offload_plan(pipeline: Any, config: OffloadConfig, *,
                         alignment: int = ALLOCATOR_ALIGNMENT,
                         resident_heads: Mapping[str, int] | None = None) -> ResolvedOffloadPlan:
    """Resolve ``pipeline``'s topology for ``config``.  Pure; see Note [Resolution is pure].

    ``alignment`` is the platform's (``Platform.alignment``: 64 bytes on CPU, 256 on CUDA); it
    only enters the predicted peak device bytes (Note [Aligned layout] in host.py).
    ``resident_heads`` (plain layerwise only; DiT path -> leading blocks kept on the device)
    replaces the model's ``OffloadPlan.layerwise_resident_layers``: auto mode passes the head it
    chose (a DiT it does not name keeps no head)."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two (bytes), got {alignment!r}")
    if config.strategy is OffloadStrategy.AUTO:
        return _resolve_auto(pipeline, config, alignment)
    if resident_heads is not None:
        resident_heads = _head_map(resident_heads)
    return _Resolver(pipeline, config, alignment, resident_heads).resolve()


# -- strategy="auto" -------------------------------------------------------------------------------
#
# Note [Auto mode]
#     ``strategy="auto"`` weighs, coarsest first: none (every weight resident), model level (every
#     selectable component swaps), layerwise (the DiTs stream), layerwise with encoder rings
#     (every encoder kind with declared blocks streams too).  Each is resolved purely, as an
#     explicit config, and its predicted peak device bytes (``_predict``, which equals the
#     measured ``stats().peak_device_bytes``) is compared with the budget; the first that fits is
#     the plan.  A strategy that cannot serve the pipeline (no encoder, no blocks) or whose peak
#     cannot be predicted (model level delegated to a split model) is skipped, with its reason.
#     Nothing fitting is an OffloadTopologyError before any mutation.  Layer strategies are
#     weighed without a resident head; when one is chosen, the budget left between its peak and
#     the next coarser strategy's is filled with the largest resident head whose predicted peak
#     fits (``head_candidates``: k leading blocks of every DiT ring, at least two still
#     streaming).  The prediction is not monotone in k (moving the largest block into the head
#     shrinks both slots), so every k is weighed, not searched.


def resident_plan(pipeline: Any, *, alignment: int = ALLOCATOR_ALIGNMENT) -> ResolvedOffloadPlan:
    """The "none" candidate of auto mode: every tensor of the pipeline resident on the device,
    except the components the pipeline manages itself (``on_demand_component_paths``).  Pure."""
    plan = getattr(pipeline, "_offload_plan", None)
    managed = []
    if isinstance(plan, OffloadPlan):
        for path in plan.on_demand_component_paths:
            module = get_submodule_path(pipeline, path)
            if isinstance(module, nn.Module):
                managed.append(module)
    named = resident_state(pipeline, managed)
    total = _span_bytes((t for _, t in named), alignment)
    return ResolvedOffloadPlan(OffloadStrategy.NONE, other_state_bytes=total,
                               device_bytes_bound=total, alignment=alignment)


def resident_state(pipeline: Any,
                   managed: Iterable[nn.Module] = ()) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``pipeline`` outside ``managed``: its state (:func:`pipeline_state`) and
    the discovered components' (a plain-object pipeline may reach one through a non-module)."""
    managed = list(managed)
    named = pipeline_state(pipeline, managed)
    seen = {id(t) for _, t in named}
    excluded = {id(m) for root in managed for m in root.modules()}
    found = discover_components(pipeline, warn=lambda message: None)
    for group in (found.dits, found.encoders, found.vaes, found.residents):
        for path, module in group:
            if id(module) in excluded:
                continue
            for name, t in named_tensors(module, path):
                if id(t) not in seen:
                    seen.add(id(t))
                    named.append((name, t))
    return named


def auto_candidates(pipeline: Any, config: OffloadConfig | None = None, *,
                    alignment: int = ALLOCATOR_ALIGNMENT) -> list[AutoCandidate]:
    """The strategies ``strategy="auto"`` weighs for ``pipeline``, coarsest first, each with its
    predicted peak device bytes or the reason it cannot serve the pipeline (Note [Auto mode]).
    ``config`` (an auto config) lends its ``pin_memory``.  Pure."""
    pin = config.pin_memory if config is not None else True
    cands = [AutoCandidate("none", OffloadConfig(pin_memory=pin),
                           resident_plan(pipeline, alignment=alignment).predicted_device_bytes())]
    layer_all = selectable_components(pipeline, OffloadStrategy.LAYER_WISE)
    configs = [("model_level", OffloadStrategy.MODEL_LEVEL,
                selectable_components(pipeline, OffloadStrategy.MODEL_LEVEL)),
               ("layer_wise", OffloadStrategy.LAYER_WISE, ("dit",))]
    if layer_all != ("dit",):
        configs.append(("layer_wise+encoders", OffloadStrategy.LAYER_WISE, layer_all))
    staging = {} if config is None else {"staging_slots": config.staging_slots,
                                         "staging_budget_bytes": config.staging_budget_bytes}
    for name, strategy, components in configs:
        cfg = OffloadConfig(strategy=strategy, components=components, pin_memory=pin,
                            **(staging if strategy is OffloadStrategy.LAYER_WISE else {}))
        # Layer candidates are weighed without a head; the chosen one then fills the budget
        # with the largest head that fits (head_candidates).
        heads = () if strategy is OffloadStrategy.LAYER_WISE else None
        try:
            with warnings.catch_warnings():  # the chosen plan warns when it is enabled
                warnings.simplefilter("ignore")
                plan = _Resolver(pipeline, cfg, alignment,
                                 None if heads is None else {}).resolve()
        except OffloadTopologyError as exc:
            cands.append(AutoCandidate(name, cfg, None, str(exc)))
            continue
        if plan.delegated:
            cands.append(AutoCandidate(name, cfg, None, "delegated to the pipeline's "
                                       "enable_omni_model_cpu_offload, whose peak the plan "
                                       "cannot predict"))
        elif plan.skip_reason is not None:
            cands.append(AutoCandidate(name, cfg, None, plan.skip_reason))
        else:
            cands.append(AutoCandidate(name, cfg, plan.predicted_device_bytes(), heads=heads))
    return cands


def head_candidates(pipeline: Any, candidate: AutoCandidate, *,
                    alignment: int = ALLOCATOR_ALIGNMENT) -> list[AutoCandidate]:
    """A layer candidate with each resident head auto may keep: k = 0, 1, ... leading blocks of
    every DiT ring (capped per ring so that two blocks still stream), each with its predicted
    peak (Note [Auto mode]).  Empty for a candidate that is not plain layerwise or streams no
    DiT ring.  Pure."""
    if candidate.predicted is None or candidate.config.strategy is not OffloadStrategy.LAYER_WISE:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolver = _Resolver(pipeline, candidate.config, alignment, {})
        base = resolver.resolve()
        # A DiT's own ring (a submodule that owns its residency keeps none: offload_submodules)
        rings = {c.path: len(s.blocks) for c in base.dits for s in c.stacks
                 if len(s.streamed_blocks) >= 2 and c.path not in resolver.plan.offload_submodules}
        if not rings:
            return []
        out = []
        for k in range(max(rings.values()) - 1):
            heads = tuple((path, min(k, n - 2)) for path, n in rings.items())
            plan = base if not k else _Resolver(pipeline, candidate.config, alignment,
                                                dict(heads)).resolve()
            out.append(dataclasses.replace(candidate, predicted=plan.predicted_device_bytes(),
                                           heads=heads))
    return out


def choose_auto(candidates: Iterable[AutoCandidate], budget: int) -> AutoCandidate:
    """The first (coarsest) candidate whose prediction fits ``budget``; an
    OffloadTopologyError naming the smallest achievable peak when none does."""
    candidates = list(candidates)
    for c in candidates:
        if c.predicted is not None and c.predicted <= budget:
            return c
    feasible = [c for c in candidates if c.predicted is not None]
    if not feasible:  # "none" always has a prediction; kept for a mutated candidate list
        raise OffloadTopologyError(f"strategy='auto': no strategy can serve this pipeline: "
                                   f"{'; '.join(f'{c.name}: {c.reason}' for c in candidates)}")
    best = min(feasible, key=lambda c: c.predicted)
    weighed = "; ".join(f"{c.name} {c.predicted}" if c.predicted is not None
                        else f"{c.name} not achievable" for c in candidates)
    if best.name in ("none", "model_level"):
        fix = ("raise the budget, or declare the DiT's blocks (_layerwise_offload_blocks_attrs "
               "or OffloadPlan.block_attrs) so layerwise can stream them")
    elif best.name == "layer_wise":
        fix = ("raise the budget, or declare the encoders' blocks "
               "(OffloadPlan.encoder_block_attrs) so layerwise streams them too")
    else:
        fix = "raise the budget (layerwise with encoder rings is the finest strategy)"
    raise OffloadTopologyError(
        f"strategy='auto': no strategy fits device_budget_bytes={budget}; the smallest "
        f"achievable predicted peak is {best.predicted} bytes ({best.label()}); predicted "
        f"peaks: {weighed}.  Fix: {fix}"
    )


def _resolve_auto(pipeline: Any, config: OffloadConfig, alignment: int) -> ResolvedOffloadPlan:
    budget = config.device_budget_bytes
    assert budget is not None  # OffloadConfig requires it with strategy="auto"
    candidates = auto_candidates(pipeline, config, alignment=alignment)
    chosen = choose_auto(candidates, budget)
    choice = AutoChoice(budget, chosen.name, tuple(candidates),
                        tuple(head_candidates(pipeline, chosen, alignment=alignment)))
    return dataclasses.replace(resolve_candidate(pipeline, choice.picked, alignment=alignment),
                               auto=choice)


def resolve_candidate(pipeline: Any, candidate: AutoCandidate, *,
                      alignment: int = ALLOCATOR_ALIGNMENT) -> ResolvedOffloadPlan:
    """The plan of one auto candidate (the resident plan for "none"), with its resident head."""
    if candidate.name == "none":
        return resident_plan(pipeline, alignment=alignment)
    return _Resolver(pipeline, candidate.config, alignment, candidate.resident_heads).resolve()
