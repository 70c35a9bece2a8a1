"""What the offloader will do: the resolved types (:class:`ResolvedOffloadPlan`, its components
(:class:`ResolvedComponent`, each with a :class:`ComponentRole`) and their rings
(:class:`RingPlan`, with :class:`RingAlias` entries)), and what ``strategy="auto"`` weighed
(:class:`AutoCandidate`, :class:`AutoChoice`); with the tensors a resolved component owns
(:func:`owned_tensors`) and a ring block streams."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ..config import OffloadConfig, OffloadStrategy, WeightTransfer
from ..host import ALLOCATOR_ALIGNMENT
from .tree import _nbytes_of, _tensors, named_tensors


class ComponentRole(str, Enum):
    """What a resolved component is to the offloader (``ResolvedComponent.role``), named as the
    pipeline declares it (``_dit_modules``, ``_encoder_modules``, ``_vae_modules``,
    ``_resident_modules``).  A ``str``: a member equals, hashes and formats as its value, so
    ``role == "dit"``, a dict keyed by ``"dit"``, ``f"{role}"``, ``str(role)`` and ``json.dumps``
    all see ``"dit"``."""

    DIT = "dit"
    ENCODER = "encoder"
    VAE = "vae"
    RESIDENT = "resident"

    def __str__(self) -> str:  # not "ComponentRole.DIT" (the default of a mixed-in Enum)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class RingAlias:
    """A tensor outside the blocks that shares storage with a streamed block's tensor."""

    path: str  # qualified name of the aliasing parameter/buffer, relative to the pipeline
    block_path: str  # the block whose host master owns the storage
    tensor_path: str  # the block tensor it aliases


@dataclass(frozen=True, eq=False)
class RingPlan:
    """One ring of the plan: blocks streamed in order (the concatenation of its containers),
    which a backend serves with a :class:`~offload_ref.backends.ring.BlockRing`."""

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
    #: Blocks copied ahead of the running one (plain layerwise's ``prefetch_depth``): the ring
    #: has ``prefetch_depth + 1`` slots (Note [Prefetch depth] in backends/ring.py).
    prefetch_depth: int = 1
    #: Resident blocks that are not a leading head (``layerwise_resident_policy="strided"``, or
    #: an explicit tuple of indices): block indices, sorted; ``()`` when ``resident_head`` says
    #: it all (Note [Resident blocks] in plan/resolver.py).
    resident_blocks: tuple[int, ...] = ()

    @property
    def resident_indices(self) -> tuple[int, ...]:
        """Indices of the blocks kept on the device (the head's, or ``resident_blocks``)."""
        return self.resident_blocks or tuple(range(self.resident_head))

    @property
    def streamed_paths(self) -> tuple[str, ...]:
        """Paths of the streamed blocks, in ring order (``streamed_blocks``' paths)."""
        if not self.resident_blocks:
            return self.block_paths[self.resident_head:]
        kept = set(self.resident_blocks)
        return tuple(p for i, p in enumerate(self.block_paths) if i not in kept)

    @property
    def slots(self) -> int:
        """Device slots of the ring: the running block's and one per block fetched ahead."""
        return self.prefetch_depth + 1

    @property
    def streamed_blocks(self) -> tuple[nn.Module, ...]:
        if not self.resident_blocks:
            return self.blocks[self.resident_head:]
        kept = set(self.resident_blocks)
        return tuple(b for i, b in enumerate(self.blocks) if i not in kept)

    def _key(self) -> tuple:
        return (self.owner_path, self.container_paths, tuple(map(id, self.blocks)),
                self.block_paths, self.resident_head, self.transfer, self.aliases, self.shared,
                self.prefetch_depth, self.resident_blocks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RingPlan) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


BlockStack = RingPlan  # old name, kept for one release


@dataclass(frozen=True, eq=False)
class ResolvedComponent:
    path: str
    module: nn.Module
    role: ComponentRole  # a plain str ("dit", ...) is accepted and becomes its member
    selected: bool  # offloaded by the strategy (otherwise kept on the device)
    on_demand: bool = False  # residency owned by the pipeline (load_to_device / offload_to_cpu)
    rings: tuple[RingPlan, ...] = ()  # its rings, one RingPlan each
    kind: str = ""  # the config name that selects it: "dit", "text_encoder", "image_encoder", ...
    #: Paths of the other components inside this one's module tree: their tensors follow their
    #: own rule (a resident nested in a DiT stays on the device while the DiT swaps).
    nested: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", ComponentRole(self.role))
        if not self.kind:
            object.__setattr__(self, "kind", self.role.value)

    @property
    def stacks(self) -> tuple[RingPlan, ...]:
        """The old name of :attr:`rings`, kept for one release."""
        return self.rings

    def _key(self) -> tuple:
        return (self.path, id(self.module), self.role, self.selected, self.on_demand, self.rings,
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
    # predicted peak device bytes, padding included (see predict_device_bytes)
    device_bytes_bound: int = 0
    #: the host buffers enable() allocates, ``(what, bytes)``, requested sizes (Note [Host
    #: bytes] in prediction.py); None where the pipeline's own offload allocates (split model)
    host_allocations: tuple[tuple[str, int], ...] | None = ()
    alignment: int = ALLOCATOR_ALIGNMENT  # the platform's alignment the prediction assumes
    world_size: int = 1  # ranks an AllGather ring shards across (distributed layerwise)
    #: ``strategy="auto"``: the choice this plan is (``strategy`` is the chosen one; ``NONE``
    #: with no skip_reason means every weight resident on the device).
    auto: AutoChoice | None = None

    def by_role(self, role: ComponentRole | str) -> tuple[ResolvedComponent, ...]:
        return tuple(c for c in self.components if c.role == role)

    @property
    def dits(self) -> tuple[ResolvedComponent, ...]:
        return self.by_role(ComponentRole.DIT)

    @property
    def encoders(self) -> tuple[ResolvedComponent, ...]:
        return self.by_role(ComponentRole.ENCODER)

    @property
    def rings(self) -> tuple[RingPlan, ...]:
        """Every component's rings, in component order."""
        return tuple(s for c in self.components for s in c.rings)

    @property
    def stacks(self) -> tuple[RingPlan, ...]:
        """The old name of :attr:`rings`, kept for one release."""
        return self.rings

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
            # One level of parentheses: "encoder, kind text_encoder", not "encoder (text_encoder)".
            flags = [c.role] if c.kind == c.role else [c.role, f"kind {c.kind}"]
            flags.append("offloaded" if c.selected else "resident")
            if c.on_demand:
                flags.append("on-demand")
            if c.nested:
                flags.append(f"nested {', '.join(c.nested)} not in its group")
            lines.append(f"  {c.path} ({', '.join(flags)}): {_nbytes_of(c.module)} bytes")
            for s in c.rings:
                sizes = [_nbytes_of(b) for b in s.blocks]
                lines.append(
                    f"    ring {'+'.join(s.container_paths)}: {len(s.blocks)} blocks, largest "
                    f"{max(sizes)} bytes, "
                    + (f"resident blocks {list(s.resident_blocks)}" if s.resident_blocks
                       else f"resident head {s.resident_head}") + ", transfer "
                    f"{s.transfer.value}"
                    + (f", prefetch depth {s.prefetch_depth}" if s.prefetch_depth != 1 else "")
                )
                for a in s.aliases:
                    lines.append(f"      alias {a.path} -> {a.tensor_path}")
                for name in s.shared:
                    lines.append(f"      shared (kept resident) {name}")
        if self.components:
            lines.append(f"predicted peak device bytes: {self.predicted_device_bytes()} "
                         f"(of which {self.other_state_bytes} outside every component; tensors "
                         f"in {self.alignment}-byte aligned regions)")
        if self.components or self.delegated:
            host = self.predicted_host_bytes()
            lines.append("predicted host bytes: " + (
                "not predicted (the pipeline's own enable_omni_model_cpu_offload allocates)"
                if host is None else
                f"{host} in {len(self.host_allocations or ())} host master buffers (requested "
                "sizes; a pinned staging pool for file-backed blocks comes on top)"))
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    def predicted_host_bytes(self) -> int | None:
        """Host bytes ``enable()`` allocates for the host masters, computed when the plan was
        resolved (Note [Host bytes] in prediction.py): ``platform.host_allocated()`` after
        ``enable()`` on a platform with the same ``alignment``; None for a split model, whose
        own offload allocates."""
        if self.host_allocations is None:
            return None
        return sum(n for _, n in self.host_allocations)

    def predicted_device_bytes(self) -> int:
        """The strategy's residency bound, computed when the plan was resolved (before any
        tensor moved): see :func:`~offload_ref.plan.predict_device_bytes`.  It equals
        ``stats().peak_device_bytes`` after a generation on a platform with the same
        ``alignment``."""
        return self.device_bytes_bound


def owned_tensors(plan: ResolvedOffloadPlan,
                  comp: ResolvedComponent) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, tensor)`` of ``comp``'s own tensors: its module's, minus those of the
    components nested in it (``comp.nested``), which follow their own rule."""
    inner: set[int] = set()
    for path in comp.nested:
        inner.update(id(t) for t in _tensors(plan.component(path).module))
    return [(name, t) for name, t in named_tensors(comp.module, comp.path) if id(t) not in inner]


def _streamed_tensors(ring: RingPlan, k: int) -> list[torch.Tensor]:
    """Block k's tensors that its ring streams (its shared ones stay resident)."""
    shared = set(ring.shared)
    path = ring.streamed_paths[k]
    return [t for name, t in named_tensors(ring.streamed_blocks[k], path) if name not in shared]
