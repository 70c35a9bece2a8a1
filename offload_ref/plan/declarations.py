"""What a model declares: :class:`OffloadPlan` (its validated, frozen fields) and
:class:`OffloadTopologyError`, plus what the declarations alone imply (:func:`encoder_kind`,
:func:`selectable_components`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..config import ENCODER_KINDS, OffloadStrategy
from ..discovery import discover_components


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


def _head_map(mapping: Any) -> Mapping[str, int | tuple[int, ...]]:
    """``OffloadPlan.layerwise_resident_layers``: dotted DiT path -> a non-negative int (how many
    blocks stay resident) or a tuple of block indices (exactly which; normalized sorted)."""
    where = "OffloadPlan.layerwise_resident_layers"
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{where} = {mapping!r}: must be a mapping of DiT path to a number of "
                        "resident blocks or a tuple of their indices, e.g. {'transformer': 2}")
    result: dict[str, int | tuple[int, ...]] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys must be dotted DiT paths (str), got {key!r}")
        if isinstance(value, (tuple, list)):
            if not all(type(i) is int and i >= 0 for i in value):
                raise ValueError(f"{where}[{key!r}] = {value!r}: block indices must be ints >= 0")
            if len(set(value)) != len(value):
                raise ValueError(f"{where}[{key!r}] = {value!r}: a block index is repeated")
            result[key] = tuple(sorted(value))
            continue
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}[{key!r}] = {value!r}: must be an int >= 0 (the number of "
                             "blocks kept on the device) or a tuple of block indices")
        result[key] = value
    return MappingProxyType(result)


#: ``OffloadPlan.layerwise_resident_policy`` values (Note [Resident blocks] in plan/resolver.py).
RESIDENT_POLICIES = ("leading", "strided")


def _policy_map(mapping: Any) -> Mapping[str, str]:
    where = "OffloadPlan.layerwise_resident_policy"
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{where} = {mapping!r}: must be a mapping of DiT path to one of "
                        f"{list(RESIDENT_POLICIES)}")
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys must be dotted DiT paths (str), got {key!r}")
        if value not in RESIDENT_POLICIES:
            raise ValueError(f"{where}[{key!r}] = {value!r}: must be one of "
                             f"{list(RESIDENT_POLICIES)}")
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class OffloadPlan:
    """Model-declared offload topology (a class attribute ``_offload_plan`` of the pipeline).

    * ``block_attrs``: DiT path -> ordered block containers (beats ``_layerwise_offload_blocks_attrs``);
    * ``encoder_block_attrs``: encoder path -> block containers that stream during conditioning;
    * ``offload_submodules``: path of a DiT submodule that owns its residency -> its container;
    * ``resident_dit_paths``: DiTs that may keep ``resident_layers`` leading blocks on the device
      under distributed layerwise (the config's ``LayerOptions.resident_layers`` says how many);
    * ``layerwise_resident_layers``: DiT path -> how many blocks stay on the device under plain
      layerwise offload (placed once at enable, never hooked; the rest stream, at least two of
      them), or a tuple of exactly which block indices.  ``strategy="auto"`` chooses its own head
      (Note [Auto mode] in plan/auto.py);
    * ``layerwise_resident_policy``: DiT path -> where a *count* of resident blocks sits:
      ``"leading"`` (the first blocks: a resident head; the default) or ``"strided"`` (spread
      through the ring, block ``floor(i * n / r + 1/2)`` for i < r), Note [Resident blocks] in
      plan/resolver.py;
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
    layerwise_resident_layers: Mapping[str, int | tuple[int, ...]] = field(default_factory=dict)
    layerwise_resident_policy: Mapping[str, str] = field(default_factory=dict)

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
        object.__setattr__(self, "layerwise_resident_policy",
                           _policy_map(self.layerwise_resident_policy))
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
            tuple(self.layerwise_resident_policy.items()),
        ))


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
