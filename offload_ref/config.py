"""Offload configuration: one immutable policy object, parsed once.

Two inputs produce an :class:`OffloadConfig`:

* the legacy boolean flags of a diffusion config (``enable_cpu_offload``,
  ``enable_layerwise_offload``, ``enable_distributed_layerwise_offload`` and the ``dlo_*`` tuning),
  which keep their historical priority (distributed layerwise > layerwise > model-level);
* the compact mapping ``diffusion_offload_config``::

      {"mode": "layer",
       "components": ["dit", "text_encoder"],
       "layer_options": {"dit": {"weight_transfer": "allgather", "resident_layers": 0}},
       "pin_memory": True}

or, letting the plan pick the strategy for a device budget (docs/strategies.md, "Auto mode")::

      {"mode": "auto", "device_budget_bytes": 8 * 2**30}

Every error names the offending key, the value it got and the values it accepts.  The legacy flags
are translated once into a config with ``explicit=False`` (the historical "warn and skip" topology
rules); a compact mapping yields ``explicit=True`` (every declaration problem is an error).
"""

from __future__ import annotations

import difflib
import enum
import itertools
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "COMPONENTS",
    "ENCODER_KINDS",
    "LayerOptions",
    "OffloadConfig",
    "OffloadStrategy",
    "WeightTransfer",
]


class OffloadStrategy(str, enum.Enum):
    """Which backend owns a pipeline's offload hooks."""

    NONE = "none"
    MODEL_LEVEL = "model_level"
    LAYER_WISE = "layer_wise"
    DISTRIBUTED_LAYER_WISE = "distributed_layer_wise"
    #: Picks none, model_level or layer_wise (with or without encoder rings) at enable, by the
    #: plan's predicted peak device bytes against ``OffloadConfig.device_budget_bytes``.
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def served(cls) -> tuple[OffloadStrategy, ...]:
        """The strategies a backend class of their own serves (``backends/strategies.py``'s
        table; ``tests/test_config.py`` keeps the two equal), in declaration order: what the
        kit checks and the CLI's ``--strategy`` offers.  ``none`` offloads nothing; ``auto``
        picks one of these."""
        return tuple(s for s in cls if s not in (cls.NONE, cls.AUTO))


class WeightTransfer(str, enum.Enum):
    """How a streamed component's weights reach the device in distributed layerwise mode."""

    ALLGATHER = "allgather"  # each rank keeps 1/world of every block; AllGather rebuilds it
    RANK_LOCAL = "rank-local"  # each rank streams its own full copy

    def __str__(self) -> str:
        return self.value


#: Component names a config may select.  ``"dit"`` is every declared DiT; ``"text_encoder"`` and
#: ``"image_encoder"`` are the encoders of that kind (see ``OffloadPlan.encoder_component_types``);
#: ``"vae"`` hands the VAEs to the lifecycle the pipeline declares (never selected by default).
COMPONENTS: tuple[str, ...] = ("dit", "text_encoder", "image_encoder", "vae")
#: Encoder kinds (a subset of :data:`COMPONENTS`).
ENCODER_KINDS: tuple[str, ...] = ("text_encoder", "image_encoder")
#: What model-level offload selects when nothing is named: every DiT and every encoder.
_MODEL_LEVEL_DEFAULT: tuple[str, ...] = ("dit", *ENCODER_KINDS)
_MODES = ("module", "layer", "auto")
_TOP_LEVEL_KEYS = ("mode", "components", "layer_options", "pin_memory", "device_budget_bytes")
_LAYER_OPTION_KEYS = ("weight_transfer", "resident_layers")
_VAE_OPTIONS = ("layer_options['vae'] is not accepted: a selected VAE follows the lifecycle its "
                "pipeline declares (load_to_device / offload_to_cpu), it does not stream; "
                "remove layer_options['vae']")
_LEGACY_DLO_DEFAULTS = {"dlo_use_allgather": True, "dlo_resident_layers": 0}
#: The longest value an error message quotes; longer ones are abbreviated with "...".
_MAX_REPR = 200


class _ShortRepr(reprlib.Repr):
    """``repr`` abbreviated: a bounded nesting depth, a few items per container, mappings in
    insertion order (as ``repr`` shows them)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 4, 80, 80, 40
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = 8

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        if len(x) > self.maxdict:
            items.append("...")
        return "{" + ", ".join(items) + "}"


_SHORT_REPR = _ShortRepr()


def _r(value: Any) -> str:
    """The ``repr`` an error message quotes: short values as ``repr`` gives them, deep or huge
    ones abbreviated (never a RecursionError, never megabytes of message)."""
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails still gets an error message
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR - 3] + "..."


def _require_bool(name: str, value: Any) -> None:
    """Flags are real booleans: ``"false"`` is truthy, and a list would make the frozen config
    unhashable."""
    if type(value) is not bool:
        raise TypeError(f"{name} = {_r(value)}: must be True or False")


@dataclass(frozen=True)
class LayerOptions:
    """Per-component options of ``mode="layer"``."""

    weight_transfer: WeightTransfer = WeightTransfer.RANK_LOCAL
    resident_layers: int = 0

    def __post_init__(self) -> None:
        accepted = [t.value for t in WeightTransfer]
        transfer = self.weight_transfer
        if not isinstance(transfer, str) or transfer not in accepted:
            raise ValueError(
                f"LayerOptions.weight_transfer = {_r(transfer)}: accepted: {accepted}"
            )
        object.__setattr__(self, "weight_transfer", WeightTransfer(transfer))
        if type(self.resident_layers) is not int or self.resident_layers < 0:
            raise ValueError(
                f"LayerOptions.resident_layers must be a non-negative int, got "
                f"{_r(self.resident_layers)}"
            )


def _layer_options(name: Any, opts: Any) -> LayerOptions:
    """One entry of ``OffloadConfig.layer_options``: a LayerOptions or a mapping of its fields."""
    where = f"OffloadConfig.layer_options[{_r(name)}]"
    if isinstance(opts, LayerOptions):
        return opts
    if not isinstance(opts, Mapping):
        raise TypeError(
            f"{where} = {_r(opts)}: must be a LayerOptions or a mapping with keys "
            f"{list(_LAYER_OPTION_KEYS)}"
        )
    bad = [k for k in opts if k not in _LAYER_OPTION_KEYS]
    if bad:
        raise ValueError(f"{where}: unknown option(s) {_r(bad)}; accepted: "
                         f"{list(_LAYER_OPTION_KEYS)}")
    try:
        return LayerOptions(**opts)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class OffloadConfig:
    """The offload policy of one pipeline (immutable, hashable, picklable).

    ``components`` is the explicit selection (a subset of :data:`COMPONENTS`); it is empty only for
    ``OffloadStrategy.NONE``.  ``explicit`` says whether the selection was asked for (compact
    config or a direct constructor call) or derived from legacy flags, which keep the historical
    lenient topology rules (a pipeline without a DiT is a recorded no-op instead of an error).

    Every constructor error names the field (``OffloadConfig.<field>``), the value it got
    (abbreviated) and what it accepts.  Flags are real booleans; ``world_size`` is an int;
    ``components`` is a collection of names, never a single string (as in the compact mapping).
    """

    strategy: OffloadStrategy = OffloadStrategy.NONE
    components: tuple[str, ...] = ()
    pin_memory: bool = True
    layer_options: Mapping[str, LayerOptions] = field(default_factory=dict)
    world_size: int = 1
    use_hsdp: bool = False
    explicit: bool = True
    #: ``strategy="auto"`` only: the most device bytes (padding included) the chosen strategy's
    #: predicted peak may reach (see ``offload_ref.plan.auto_candidates``).
    device_budget_bytes: int | None = None
    #: Layer strategies, blocks served from file pages (mmap-loaded weights, Note [Pinned
    #: staging] in backends/staging.py): how many pinned staging slots the fills stage through
    #: (an int >= 2; 0: copy from the file pages directly; None: 2 where the platform pins
    #: memory and ``pin_memory`` is on, else 0).
    staging_slots: int | None = None
    #: ... and the most bytes the staging pool may hold (None: ``staging_slots`` slots of the
    #: largest file-backed block); it must hold two slots.
    staging_budget_bytes: int | None = None
    #: The most host bytes ``enable()`` may allocate for host masters, each pinned one as the
    #: platform locks it (Note [Host budget] in host.py): a positive int, or None: the room left
    #: in the process's memory cgroup less a margin of 1/16 of its limit, when it runs under a
    #: limit (else no budget).  ``enable()`` refuses a plan over it before any allocation.
    host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        strategies = [s.value for s in OffloadStrategy]
        if not isinstance(self.strategy, str) or self.strategy not in strategies:
            raise ValueError(
                f"OffloadConfig.strategy = {_r(self.strategy)}: unknown strategy; accepted: "
                f"{strategies}"
            )
        strategy = OffloadStrategy(self.strategy)
        object.__setattr__(self, "strategy", strategy)
        components = self.components
        if isinstance(components, (str, bytes, Mapping)) or not isinstance(
            components, (list, tuple, set, frozenset)
        ):
            raise TypeError(
                f"OffloadConfig.components = {_r(components)}: must be a tuple of names from "
                f"{list(COMPONENTS)}"
            )
        components = tuple(components)
        for c in components:
            if not isinstance(c, str):
                raise TypeError(
                    f"OffloadConfig.components = {_r(components)}: entries must be strings, got "
                    f"{_r(c)}; accepted: {list(COMPONENTS)}"
                )
        if strategy is OffloadStrategy.AUTO and components:
            raise ValueError(
                f"OffloadConfig.components = {_r(components)}: strategy='auto' picks the "
                "components with the strategy; drop components, or name an explicit strategy"
            )
        if strategy not in (OffloadStrategy.NONE, OffloadStrategy.AUTO) and not components:
            components = ("dit",) if strategy is not OffloadStrategy.MODEL_LEVEL \
                else _MODEL_LEVEL_DEFAULT
        unknown = [c for c in components if c not in COMPONENTS]
        if unknown:
            raise ValueError(
                f"OffloadConfig.components: unknown component(s) {_r(unknown)}; accepted: "
                f"{list(COMPONENTS)}"
            )
        if len(set(components)) != len(components):
            raise ValueError(
                f"OffloadConfig.components lists a component twice: {_r(components)}")
        # Canonical order so equal selections compare (and hash) equal.
        object.__setattr__(self, "components", tuple(c for c in COMPONENTS if c in components))
        for name in ("pin_memory", "use_hsdp", "explicit"):
            _require_bool(f"OffloadConfig.{name}", getattr(self, name))
        if not isinstance(self.layer_options, Mapping):
            raise TypeError(
                f"OffloadConfig.layer_options = {_r(self.layer_options)}: must be a mapping of "
                f"component name to LayerOptions (or a mapping with keys "
                f"{list(_LAYER_OPTION_KEYS)})"
            )
        options = {}
        for name, opts in dict(self.layer_options).items():
            if name not in self.components:
                raise ValueError(
                    f"OffloadConfig.layer_options[{_r(name)}] requires selecting the same "
                    f"component in components (selected: {list(self.components)})"
                )
            options[name] = _layer_options(name, opts)
        if options and strategy is OffloadStrategy.MODEL_LEVEL:
            raise ValueError("OffloadConfig.layer_options requires a layer strategy, not "
                             "model_level")
        object.__setattr__(self, "layer_options", MappingProxyType(options))
        if type(self.world_size) is not int or self.world_size < 1:
            raise ValueError(
                f"OffloadConfig.world_size must be an int >= 1, got {_r(self.world_size)}")
        _check_budget("OffloadConfig.device_budget_bytes", self.device_budget_bytes, strategy)
        _check_staging(self.staging_slots, self.staging_budget_bytes, strategy)
        if self.host_budget_bytes is not None and (type(self.host_budget_bytes) is not int
                                                   or self.host_budget_bytes < 1):
            raise ValueError(f"OffloadConfig.host_budget_bytes = {_r(self.host_budget_bytes)}: "
                             "must be a positive int (bytes) or None (the container's limit)")
        if strategy is OffloadStrategy.AUTO and self.world_size != 1:
            raise ValueError(
                f"OffloadConfig.world_size = {self.world_size}: strategy='auto' chooses among "
                "the single-process strategies (none, model_level, layer_wise); with several "
                "ranks name distributed_layer_wise explicitly"
            )
        for name, opts in options.items():
            if opts.resident_layers and opts.weight_transfer is WeightTransfer.ALLGATHER:
                raise ValueError(
                    f"layer_options[{name!r}]: resident_layers={opts.resident_layers} cannot be "
                    "combined with weight_transfer='allgather'; use weight_transfer='rank-local'"
                )
            if opts.resident_layers and name != "dit":
                raise ValueError(
                    f"layer_options[{name!r}].resident_layers is only supported for 'dit'"
                )
            if name == "vae":
                raise ValueError(_VAE_OPTIONS)
            needs_dlo = opts.weight_transfer is WeightTransfer.ALLGATHER or opts.resident_layers
            if needs_dlo and strategy is not OffloadStrategy.DISTRIBUTED_LAYER_WISE:
                raise ValueError(
                    f"layer_options[{name!r}] ({opts}) needs the distributed_layer_wise strategy, "
                    f"got {strategy.value}"
                )
        if self.use_hsdp and strategy is OffloadStrategy.DISTRIBUTED_LAYER_WISE and any(
            o.weight_transfer is WeightTransfer.ALLGATHER for o in options.values()
        ):
            raise ValueError(
                "distributed layerwise offload with weight_transfer='allgather' is incompatible "
                "with HSDP (weights would be sharded twice); use weight_transfer='rank-local' or "
                "disable HSDP"
            )

    # -- queries -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.strategy is not OffloadStrategy.NONE

    def selects(self, component: str) -> bool:
        return component in self.components

    def options_for(self, component: str) -> LayerOptions:
        return self.layer_options.get(component, LayerOptions())

    def __hash__(self) -> int:
        return hash(
            (
                self.strategy,
                self.components,
                self.pin_memory,
                tuple(sorted(self.layer_options.items())),
                self.world_size,
                self.use_hsdp,
                self.explicit,
                self.device_budget_bytes,
                self.staging_slots,
                self.staging_budget_bytes,
                self.host_budget_bytes,
            )
        )

    def __reduce__(self):  # MappingProxyType does not pickle
        return (
            _rebuild,
            (
                self.strategy,
                self.components,
                self.pin_memory,
                dict(self.layer_options),
                self.world_size,
                self.use_hsdp,
                self.explicit,
                self.device_budget_bytes,
                self.staging_slots,
                self.staging_budget_bytes,
                self.host_budget_bytes,
            ),
        )

    # -- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_od_config(cls, od_config: Any) -> OffloadConfig:
        """Build the config from a diffusion config object (any object with the attributes), or
        a mapping of the same names.

        Missing attributes (and ``None``) take their defaults.  A mapping's keys are read as the
        attributes: keys unrelated to offloading are ignored, as an object's other attributes
        are, but a key that looks like an offload setting (it contains "offload", starts with
        "dlo_", or nearly spells a known key) and is not one is rejected (a typo would otherwise
        silently select no offload).
        See the module docstring for the schema.
        """
        return _from_od_config(od_config)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], *, world_size: int = 1, use_hsdp: bool = False
    ) -> OffloadConfig:
        """Parse a compact ``diffusion_offload_config`` mapping (full schema validation)."""
        return _parse_compact(mapping, world_size=world_size, use_hsdp=use_hsdp)


def _rebuild(strategy, components, pin_memory, layer_options, world_size, use_hsdp, explicit,
             device_budget_bytes=None, staging_slots=None, staging_budget_bytes=None,
             host_budget_bytes=None):
    return OffloadConfig(
        strategy=strategy,
        components=components,
        pin_memory=pin_memory,
        layer_options=layer_options,
        world_size=world_size,
        use_hsdp=use_hsdp,
        explicit=explicit,
        device_budget_bytes=device_budget_bytes,
        staging_slots=staging_slots,
        staging_budget_bytes=staging_budget_bytes,
        host_budget_bytes=host_budget_bytes,
    )


def _check_budget(name: str, budget: Any, strategy: OffloadStrategy) -> None:
    """``device_budget_bytes``: a positive int (never a bool), with ``strategy='auto'`` only."""
    if strategy is OffloadStrategy.AUTO and budget is None:
        raise ValueError(f"{name} is required with strategy='auto' (mode='auto'): the most "
                         "device bytes the chosen strategy may hold, a positive int")
    if budget is None:
        return
    if type(budget) is not int or budget < 1:
        raise ValueError(f"{name} = {_r(budget)}: must be a positive int (bytes)")
    if strategy is not OffloadStrategy.AUTO:
        raise ValueError(
            f"{name} = {budget}: a device budget applies to strategy='auto' (mode='auto') "
            f"only, got strategy {strategy.value}; use strategy='auto', or drop the budget"
        )


def _check_staging(slots: Any, budget: Any, strategy: OffloadStrategy) -> None:
    """``staging_slots`` (None, 0, or an int >= 2) and ``staging_budget_bytes`` (None or a
    positive int), with a layer strategy (or auto, which may pick one)."""
    if slots is not None and (type(slots) is not int or slots < 0 or slots == 1):
        raise ValueError(
            f"OffloadConfig.staging_slots = {_r(slots)}: must be an int >= 2 (one slot is "
            "filled while the copy reads the other), 0 to copy from the file pages directly, "
            "or None for the platform's default")
    if budget is not None and (type(budget) is not int or budget < 1):
        raise ValueError(f"OffloadConfig.staging_budget_bytes = {_r(budget)}: must be a "
                         "positive int (bytes)")
    if budget is not None and slots == 0:
        raise ValueError(f"OffloadConfig.staging_budget_bytes = {budget} with staging_slots=0: "
                         "a budget for a pool that is off; drop one of them")
    if (slots or budget is not None) and strategy in (OffloadStrategy.NONE,
                                                      OffloadStrategy.MODEL_LEVEL):
        raise ValueError(
            f"OffloadConfig.staging_slots / staging_budget_bytes apply to the layer strategies "
            f"(file-backed blocks stream through the pool), got strategy {strategy.value}")


def _key(path: str, value: Any) -> str:
    return f"diffusion_offload_config{path} = {_r(value)}"


def _require_str_keys(mapping: Mapping, path: str, accepted: list[str]) -> None:
    for k in mapping:
        if not isinstance(k, str):
            raise TypeError(
                f"{_key(path, mapping)}: keys must be strings, got key {_r(k)}; accepted: "
                f"{accepted}"
            )


def _parse_compact(mapping: Any, *, world_size: int, use_hsdp: bool) -> OffloadConfig:
    _require_bool("use_hsdp", use_hsdp)
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size = {_r(world_size)}: must be an int >= 1")
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{_key('', mapping)}: must be a mapping with keys {list(_TOP_LEVEL_KEYS)}")
    _require_str_keys(mapping, "", list(_TOP_LEVEL_KEYS))
    unknown = sorted(set(mapping) - set(_TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(
            f"diffusion_offload_config: unknown key(s) {_r(unknown)}; accepted: "
            f"{list(_TOP_LEVEL_KEYS)}"
        )
    for required, accepted in (("mode", list(_MODES)), ("components", list(COMPONENTS))):
        if required == "components" and mapping.get("mode") == "auto":
            continue
        if required not in mapping:
            raise ValueError(
                f"diffusion_offload_config: missing required key {_r(required)} "
                f"(accepted values: {accepted})"
            )

    mode = mapping["mode"]
    if not isinstance(mode, str):
        raise TypeError(f"{_key('[mode]', mode)}: must be a string, one of {list(_MODES)}")
    if mode not in _MODES:
        raise ValueError(f"{_key('[mode]', mode)}: unknown mode; accepted: {list(_MODES)}")
    budget = mapping.get("device_budget_bytes")
    if "device_budget_bytes" in mapping and mode != "auto":
        raise ValueError(f"{_key('[device_budget_bytes]', budget)}: a device budget requires "
                         f"mode='auto' (got mode={_r(mode)}); drop it or use mode='auto'")
    if mode == "auto":
        if "components" in mapping:
            raise ValueError(f"{_key('[components]', mapping['components'])}: mode='auto' "
                             "picks the components with the strategy; drop components")
        if "layer_options" in mapping:
            raise ValueError(f"{_key('[layer_options]', mapping['layer_options'])}: "
                             "layer_options requires mode='layer' (got mode='auto')")
        if "device_budget_bytes" not in mapping:
            raise ValueError("diffusion_offload_config: mode='auto' requires the key "
                             "'device_budget_bytes' (a positive int: the most device bytes "
                             "the chosen strategy may hold)")
        if type(budget) is not int or budget < 1:
            raise ValueError(f"{_key('[device_budget_bytes]', budget)}: must be a positive int "
                             "(bytes)")
        pin_memory = mapping.get("pin_memory", True)
        if type(pin_memory) is not bool:
            raise TypeError(f"{_key('[pin_memory]', pin_memory)}: must be True or False")
        return OffloadConfig(strategy=OffloadStrategy.AUTO, pin_memory=pin_memory,
                             world_size=world_size, use_hsdp=use_hsdp, explicit=True,
                             device_budget_bytes=budget)

    components = mapping["components"]
    if isinstance(components, (str, bytes, Mapping)) or not isinstance(
        components, (list, tuple)
    ):
        raise TypeError(
            f"{_key('[components]', components)}: must be a non-empty list of names from "
            f"{list(COMPONENTS)}"
        )
    for c in components:
        if not isinstance(c, str):
            raise TypeError(
                f"{_key('[components]', components)}: entries must be strings, got {_r(c)}; "
                f"accepted: {list(COMPONENTS)}"
            )
    if not components:
        raise ValueError(
            f"{_key('[components]', components)}: must not be empty; accepted names: "
            f"{list(COMPONENTS)}"
        )
    for c in components:
        if c not in COMPONENTS:
            raise ValueError(
                f"{_key('[components]', components)}: unknown component {_r(c)}; accepted: "
                f"{list(COMPONENTS)}"
            )
    if len(set(components)) != len(components):
        raise ValueError(f"{_key('[components]', components)}: a component is listed twice")

    raw_options = mapping.get("layer_options", {})
    if not isinstance(raw_options, Mapping):
        raise TypeError(
            f"{_key('[layer_options]', raw_options)}: must be a mapping of component name to "
            f"options {list(_LAYER_OPTION_KEYS)}"
        )
    _require_str_keys(raw_options, "[layer_options]", list(COMPONENTS))
    if raw_options and mode != "layer":
        raise ValueError(
            f"{_key('[layer_options]', dict(raw_options))}: layer_options requires "
            f"mode='layer' (got mode={_r(mode)})"
        )
    options: dict[str, LayerOptions] = {}
    for name, opts in raw_options.items():
        path = f"[layer_options][{_r(name)}]"
        if name not in COMPONENTS:
            raise ValueError(f"{_key(path, opts)}: unknown component; accepted: {list(COMPONENTS)}")
        if name not in components:
            raise ValueError(
                f"{_key(path, opts)}: requires selecting the same component in components "
                f"(selected: {list(components)})"
            )
        if name == "vae":
            raise ValueError(f"{_key(path, opts)}: {_VAE_OPTIONS}")
        if not isinstance(opts, Mapping):
            raise TypeError(
                f"{_key(path, opts)}: must be a mapping with keys {list(_LAYER_OPTION_KEYS)}"
            )
        _require_str_keys(opts, path, list(_LAYER_OPTION_KEYS))
        bad = sorted(set(opts) - set(_LAYER_OPTION_KEYS))
        if bad:
            raise ValueError(
                f"{_key(path, dict(opts))}: unknown option(s) {_r(bad)}; accepted: "
                f"{list(_LAYER_OPTION_KEYS)}"
            )
        transfer = opts.get("weight_transfer", WeightTransfer.RANK_LOCAL.value)
        accepted_transfers = [t.value for t in WeightTransfer]
        if not isinstance(transfer, str) or transfer not in accepted_transfers:
            raise ValueError(
                f"{_key(path + '[weight_transfer]', transfer)}: accepted: {accepted_transfers}"
            )
        resident = opts.get("resident_layers", 0)
        if type(resident) is not int or resident < 0:
            raise ValueError(
                f"{_key(path + '[resident_layers]', resident)}: must be an int >= 0"
            )
        if resident and name != "dit":
            raise ValueError(
                f"{_key(path + '[resident_layers]', resident)}: resident_layers is only "
                "accepted for 'dit'"
            )
        if resident and transfer == WeightTransfer.ALLGATHER.value:
            raise ValueError(
                f"{_key(path, dict(opts))}: resident_layers cannot be combined with "
                "weight_transfer='allgather'; use weight_transfer='rank-local'"
            )
        options[name] = LayerOptions(WeightTransfer(transfer), resident)

    pin_memory = mapping.get("pin_memory", True)
    if type(pin_memory) is not bool:
        raise TypeError(f"{_key('[pin_memory]', pin_memory)}: must be True or False")

    if mode == "module":
        strategy = OffloadStrategy.MODEL_LEVEL
    elif any(
        o.weight_transfer is WeightTransfer.ALLGATHER or o.resident_layers for o in options.values()
    ):
        strategy = OffloadStrategy.DISTRIBUTED_LAYER_WISE
    else:
        strategy = OffloadStrategy.LAYER_WISE
    return OffloadConfig(
        strategy=strategy,
        components=tuple(components),
        pin_memory=pin_memory,
        layer_options=options,
        world_size=world_size,
        use_hsdp=use_hsdp,
        explicit=True,
    )


def _flag(od_config: Any, name: str, default: Any) -> Any:
    value = getattr(od_config, name, default)
    return default if value is None else value


_BOOL_FLAGS = ("enable_cpu_offload", "enable_layerwise_offload",
               "enable_distributed_layerwise_offload", "pin_cpu_memory", "dlo_use_allgather",
               "use_hsdp")


def _check_bool_flags(od_config: Any) -> None:
    """A string such as "false" is truthy: legacy flags must be real booleans (or None)."""
    for name in _BOOL_FLAGS:
        value = getattr(od_config, name, None)
        if value is not None and type(value) is not bool:
            raise TypeError(f"{name} = {_r(value)}: must be True, False or None")


def _legacy_strategy(od_config: Any) -> OffloadStrategy:
    if _flag(od_config, "enable_distributed_layerwise_offload", False):
        return OffloadStrategy.DISTRIBUTED_LAYER_WISE
    if _flag(od_config, "enable_layerwise_offload", False):
        return OffloadStrategy.LAYER_WISE
    if _flag(od_config, "enable_cpu_offload", False):
        return OffloadStrategy.MODEL_LEVEL
    return OffloadStrategy.NONE


def _parallel_flag(od_config: Any, name: str, default: Any) -> Any:
    """``od_config.<name>`` or ``od_config.parallel_config.<name>`` (vLLM-Omni's
    DiffusionParallelConfig: an object or a mapping); both set and different is a
    contradiction, never a silent choice."""
    top = getattr(od_config, name, None)
    nested_config = getattr(od_config, "parallel_config", None)
    if isinstance(nested_config, Mapping):
        nested = nested_config.get(name)
    else:
        nested = getattr(nested_config, name, None) if nested_config is not None else None
    if nested is not None and name == "use_hsdp" and type(nested) is not bool:
        raise TypeError(f"parallel_config.use_hsdp = {_r(nested)}: must be True, False or None")
    if top is not None and nested is not None and top != nested:
        raise ValueError(
            f"{name} = {_r(top)} contradicts parallel_config.{name} = {_r(nested)}; set it in one "
            "place (parallel_config) or give both the same value"
        )
    value = top if top is not None else nested
    return default if value is None else value


#: Keys of a mapping given as a diffusion config that look like offload settings (so a key
#: that does not match a known one is a typo, not an unrelated setting of the model).
_OD_KEYS = (*_BOOL_FLAGS, "dlo_resident_layers", "data_parallel_size", "parallel_config",
            "diffusion_offload_config")


class _MappingAttributes:
    """A mapping given as a diffusion config, read as an object: its keys are the attributes.

    Keys unrelated to offloading (a model path, a dtype, ...) are ignored, as the other attributes
    of a config object are; a key that looks like an offload setting (it contains "offload",
    starts with "dlo_", or nearly spells a known key) but is not one is a typo and is
    rejected."""

    def __init__(self, mapping: Mapping) -> None:
        for key in mapping:
            if not isinstance(key, str):
                raise TypeError(
                    f"from_od_config: the mapping's keys must be attribute names (strings), got "
                    f"key {_r(key)}"
                )
            if key in _OD_KEYS:
                continue
            close = difflib.get_close_matches(key, _OD_KEYS, n=1, cutoff=0.85)
            if close or "offload" in key.lower() or key.startswith("dlo_"):
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"from_od_config: unknown offload key {_r(key)}{hint}; accepted: "
                    f"{list(_OD_KEYS)}"
                )
        self.__dict__.update(mapping)


def _from_od_config(od_config: Any) -> OffloadConfig:
    if isinstance(od_config, Mapping):
        od_config = _MappingAttributes(od_config)
    _check_bool_flags(od_config)
    world_size = _parallel_flag(od_config, "data_parallel_size", 1)
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"data_parallel_size = {_r(world_size)}: must be an int >= 1")
    use_hsdp = _parallel_flag(od_config, "use_hsdp", False)  # a bool (checked above)
    legacy_strategy = _legacy_strategy(od_config)
    use_allgather = _flag(od_config, "dlo_use_allgather", True)
    resident = _flag(od_config, "dlo_resident_layers", 0)
    if type(use_allgather) is not bool:
        raise TypeError(f"dlo_use_allgather = {_r(use_allgather)}: must be True or False")
    if type(resident) is not int or resident < 0:
        raise ValueError(f"dlo_resident_layers = {_r(resident)}: must be an int >= 0")

    compact = getattr(od_config, "diffusion_offload_config", None)
    if compact is not None:
        config = _parse_compact(compact, world_size=world_size, use_hsdp=use_hsdp)
        if legacy_strategy is not OffloadStrategy.NONE and legacy_strategy is not config.strategy:
            flag = {
                OffloadStrategy.DISTRIBUTED_LAYER_WISE: "enable_distributed_layerwise_offload",
                OffloadStrategy.LAYER_WISE: "enable_layerwise_offload",
                OffloadStrategy.MODEL_LEVEL: "enable_cpu_offload",
            }[legacy_strategy]
            raise ValueError(
                f"diffusion_offload_config (strategy {config.strategy.value}) cannot be combined "
                f"with the legacy flag {flag}=True (strategy {legacy_strategy.value}); remove "
                "the legacy flag"
            )
        non_default = [
            f"{name}={_r(_flag(od_config, name, default))}"
            for name, default in _LEGACY_DLO_DEFAULTS.items()
            if _flag(od_config, name, default) != default
        ]
        if non_default:
            raise ValueError(
                f"diffusion_offload_config cannot be combined with legacy DLO tuning "
                f"{', '.join(non_default)}; express it as layer_options "
                "{'dit': {'weight_transfer': ..., 'resident_layers': ...}}"
            )
        if "pin_memory" not in compact and getattr(od_config, "pin_cpu_memory", None) is False:
            return _rebuild(
                config.strategy, config.components, False, dict(config.layer_options),
                config.world_size, config.use_hsdp, config.explicit, config.device_budget_bytes,
            )
        return config

    pin_memory = _flag(od_config, "pin_cpu_memory", True)
    if type(pin_memory) is not bool:
        raise TypeError(f"pin_cpu_memory = {_r(pin_memory)}: must be True or False")
    if legacy_strategy is OffloadStrategy.NONE:
        return OffloadConfig(world_size=world_size, use_hsdp=use_hsdp, pin_memory=pin_memory,
                             explicit=False)
    if legacy_strategy is OffloadStrategy.MODEL_LEVEL:
        return OffloadConfig(
            strategy=legacy_strategy, components=_MODEL_LEVEL_DEFAULT, pin_memory=pin_memory,
            world_size=world_size, use_hsdp=use_hsdp, explicit=False,
        )
    if legacy_strategy is OffloadStrategy.LAYER_WISE:
        return OffloadConfig(
            strategy=legacy_strategy, components=("dit",), pin_memory=pin_memory,
            world_size=world_size, use_hsdp=use_hsdp, explicit=False,
        )
    if resident and use_allgather:
        raise ValueError(
            f"dlo_resident_layers={resident} cannot be combined with dlo_use_allgather=True; "
            "use rank-local transfer (dlo_use_allgather=False, CLI --dlo-no-use-allgather)"
        )
    if use_hsdp and use_allgather:
        raise ValueError(
            "enable_distributed_layerwise_offload with dlo_use_allgather=True is incompatible "
            "with HSDP (use_hsdp=True): weights would be sharded twice; set "
            "dlo_use_allgather=False or disable HSDP"
        )
    transfer = WeightTransfer.ALLGATHER if use_allgather else WeightTransfer.RANK_LOCAL
    return OffloadConfig(
        strategy=legacy_strategy,
        components=("dit",),
        pin_memory=pin_memory,
        layer_options={"dit": LayerOptions(transfer, resident)},
        world_size=world_size,
        use_hsdp=use_hsdp,
        explicit=False,
    )
