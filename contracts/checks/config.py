"""Catalogue §G: configuration (legacy flag priority, compact schema, conflicts, HSDP).

Every check here is global (it needs no pipeline) and reaches the configuration only through the
implementation under test: ``case.impl.config_from_mapping(mapping, world_size=..., use_hsdp=...)``
and ``case.impl.config_from_od_config(obj)``, so the kit's own tests can swap in broken parsers.

A rejection must raise the exception type the schema prescribes, with a message that names the
offending key, the value it got and the values it accepts.  TypeError is for a value of the wrong
container or key type (a non-mapping, non-string keys, a non-bool flag, components given as a
string).  ValueError is for everything else, including numeric fields of the wrong type
(``resident_layers=1.0`` or ``"2"``), as vLLM-Omni's parser does.
"""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace
from typing import Any

from offload_ref.config import OffloadStrategy

from ..registry import check, fail
from ..facts import expect_error

NONE = OffloadStrategy.NONE
MODEL_LEVEL = OffloadStrategy.MODEL_LEVEL
LAYER_WISE = OffloadStrategy.LAYER_WISE
DLO = OffloadStrategy.DISTRIBUTED_LAYER_WISE

COMPONENT_NAMES = ("dit", "text_encoder", "image_encoder", "vae")
LAYER_OPTION_COMPONENTS = ("dit", "text_encoder", "image_encoder")  # a VAE takes no options
TOP_LEVEL_KEYS = ("mode", "components", "layer_options", "pin_memory")
OPTION_KEYS = ("weight_transfer", "resident_layers")


# -- access to the implementation under test ------------------------------------------------------


def _parse(case: Any, mapping: Any, *, world_size: int = 1, use_hsdp: bool = False) -> Any:
    # A deep copy: the parser must not depend on (or be able to alter) the caller's mapping.
    return case.impl.config_from_mapping(copy.deepcopy(mapping), world_size=world_size,
                                         use_hsdp=use_hsdp)


def _od(**attrs: Any) -> SimpleNamespace:
    """A diffusion config object with only the given attributes (the rest take defaults)."""
    return SimpleNamespace(**attrs)


def _from_od(case: Any, od: SimpleNamespace) -> Any:
    return case.impl.config_from_od_config(copy.deepcopy(od))


def _describe_od(od: SimpleNamespace) -> str:
    return f"config_from_od_config({', '.join(f'{k}={v!r}' for k, v in vars(od).items())})"


def _strategy(config: Any) -> OffloadStrategy | str:
    value = getattr(config, "strategy", None)
    try:
        return OffloadStrategy(value)
    except ValueError:
        return repr(value)


def _rejects(case: Any, mapping: Any, exc: type[BaseException], mentions: tuple[str, ...], *,
             world_size: int = 1, use_hsdp: bool = False) -> None:
    what = f"config_from_mapping({mapping!r}, world_size={world_size}, use_hsdp={use_hsdp})"
    expect_error(what, lambda: _parse(case, mapping, world_size=world_size, use_hsdp=use_hsdp),
                 types=(exc,), mentions=mentions)


def _od_rejects(case: Any, od: SimpleNamespace, exc: type[BaseException],
                mentions: tuple[str, ...]) -> None:
    expect_error(_describe_od(od), lambda: _from_od(case, od), types=(exc,), mentions=mentions)


def _layer(components: list[str] | None = None, **layer_options: Any) -> dict[str, Any]:
    mapping: dict[str, Any] = {"mode": "layer", "components": components or ["dit"]}
    if layer_options:
        mapping["layer_options"] = layer_options
    return mapping


#: Valid compact configurations covering every strategy and option (used by the value checks).
VALID_MAPPINGS: tuple[dict[str, Any], ...] = (
    {"mode": "module", "components": ["dit", "text_encoder"]},
    {"mode": "module", "components": ["text_encoder"], "pin_memory": False},
    _layer(),
    _layer(["dit", "text_encoder"], dit={"weight_transfer": "rank-local"}),
    _layer(dit={"weight_transfer": "allgather"}),
    _layer(["dit", "text_encoder"], dit={"weight_transfer": "rank-local", "resident_layers": 2},
           text_encoder={"weight_transfer": "allgather"}),
)


# -- legacy flags ---------------------------------------------------------------------------------


@check("G", scope="global")
def check_config_legacy_flags_follow_priority(case) -> None:
    """Legacy flags: distributed layerwise > layerwise > model-level; each alone selects its
    strategy; all off (or absent) selects NONE."""
    table = [
        (dict(), NONE),
        (dict(enable_cpu_offload=False, enable_layerwise_offload=False,
              enable_distributed_layerwise_offload=False), NONE),
        (dict(enable_cpu_offload=True), MODEL_LEVEL),
        (dict(enable_layerwise_offload=True), LAYER_WISE),
        (dict(enable_distributed_layerwise_offload=True), DLO),
        (dict(enable_cpu_offload=True, enable_layerwise_offload=True), LAYER_WISE),
        (dict(enable_cpu_offload=True, enable_distributed_layerwise_offload=True), DLO),
        (dict(enable_layerwise_offload=True, enable_distributed_layerwise_offload=True), DLO),
        (dict(enable_cpu_offload=True, enable_layerwise_offload=True,
              enable_distributed_layerwise_offload=True), DLO),
    ]
    problems = []
    for attrs, expected in table:
        od = _od(**attrs)
        got = _strategy(_from_od(case, od))
        if got != expected:
            problems.append(f"{_describe_od(od)}.strategy: expected {expected}, got {got}")
    if problems:
        fail("legacy flag priority violated: " + "; ".join(problems))


@check("G", scope="global")
def check_config_legacy_resident_layers_with_allgather_are_rejected(case) -> None:
    """Legacy ``dlo_resident_layers`` with ``dlo_use_allgather=True`` is rejected with a message
    asking for rank-local transfer (``dlo_use_allgather=False``); with rank-local it is accepted."""
    for attrs in (dict(dlo_resident_layers=2),
                  dict(dlo_resident_layers=1, dlo_use_allgather=True)):
        _od_rejects(case, _od(enable_distributed_layerwise_offload=True, **attrs), ValueError,
                    ("dlo_resident_layers", "dlo_use_allgather=False", "rank-local"))
    od = _od(enable_distributed_layerwise_offload=True, dlo_resident_layers=2,
             dlo_use_allgather=False)
    got = _strategy(_from_od(case, od))
    if got != DLO:
        fail(f"{_describe_od(od)}.strategy: expected {DLO}, got {got}")


# -- compact mapping: values ----------------------------------------------------------------------


@check("G", scope="global")
def check_config_compact_mode_selects_strategy(case) -> None:
    """mode "module" selects model_level; "layer" selects layer_wise, or distributed_layer_wise
    when any component uses AllGather or resident layers (same through the od_config path)."""
    table = [
        ({"mode": "module", "components": ["dit"]}, MODEL_LEVEL),
        ({"mode": "module", "components": ["dit", "text_encoder"]}, MODEL_LEVEL),
        (_layer(), LAYER_WISE),
        (_layer(["dit", "text_encoder"]), LAYER_WISE),
        (_layer(dit={"weight_transfer": "rank-local", "resident_layers": 0}), LAYER_WISE),
        (_layer(dit={"weight_transfer": "allgather"}), DLO),
        (_layer(["dit", "text_encoder"], text_encoder={"weight_transfer": "allgather"}), DLO),
        (_layer(dit={"weight_transfer": "rank-local", "resident_layers": 2}), DLO),
    ]
    problems = []
    for mapping, expected in table:
        got = _strategy(_parse(case, mapping))
        if got != expected:
            problems.append(f"config_from_mapping({mapping!r}).strategy: expected {expected}, "
                            f"got {got}")
        od = _od(diffusion_offload_config=mapping)
        got = _strategy(_from_od(case, od))
        if got != expected:
            problems.append(f"{_describe_od(od)}.strategy: expected {expected}, got {got}")
    if problems:
        fail("compact mode selects the wrong strategy: " + "; ".join(problems))


@check("G", scope="global")
def check_config_compact_components_are_carried_through(case) -> None:
    """The selected components are exactly the ones listed (in any order, each once)."""
    table = [
        {"mode": "module", "components": ["text_encoder"]},
        {"mode": "module", "components": ["dit"]},
        {"mode": "module", "components": ["text_encoder", "dit"]},
        _layer(["dit"]),
        _layer(["text_encoder", "dit"]),
        _layer(["text_encoder"]),
    ]
    problems = []
    for mapping in table:
        got = tuple(getattr(_parse(case, mapping), "components", ()))
        if sorted(got) != sorted(mapping["components"]):
            problems.append(f"config_from_mapping({mapping!r}).components: expected "
                            f"{mapping['components']}, got {list(got)}")
    if problems:
        fail("compact components not carried through: " + "; ".join(problems))


@check("G", scope="global")
def check_config_compact_pin_memory_defaults_to_true_and_can_be_overridden(case) -> None:
    """``pin_memory`` defaults to True and takes the value given."""
    problems = []
    for base in ({"mode": "module", "components": ["dit"]}, _layer(),
                 _layer(dit={"weight_transfer": "allgather"})):
        for given, expected in ((None, True), (True, True), (False, False)):
            mapping = dict(base)
            if given is not None:
                mapping["pin_memory"] = given
            got = getattr(_parse(case, mapping), "pin_memory", None)
            if got is not expected:
                problems.append(f"config_from_mapping({mapping!r}).pin_memory: expected "
                                f"{expected}, got {got!r}")
    if problems:
        fail("compact pin_memory wrong: " + "; ".join(problems))


# -- the result as a value ------------------------------------------------------------------------


def _valid_configs(case: Any) -> list[tuple[str, Any]]:
    out = [(f"config_from_mapping({m!r})", _parse(case, m)) for m in VALID_MAPPINGS]
    for od in (_od(enable_cpu_offload=True), _od(enable_layerwise_offload=True),
               _od(enable_distributed_layerwise_offload=True),
               _od(enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
                   dlo_resident_layers=1)):
        out.append((_describe_od(od), _from_od(case, od)))
    return out


@check("G", scope="global")
def check_config_result_is_frozen(case) -> None:
    """Assigning any attribute of a parsed config raises and changes nothing."""
    for what, config in _valid_configs(case):
        for name, value in (("strategy", NONE), ("pin_memory", "changed"),
                            ("components", ("changed",))):
            before = getattr(config, name, None)
            try:
                setattr(config, name, value)
            except Exception:
                pass
            else:
                fail(f"{what}: assigning .{name} = {value!r} did not raise (was {before!r}, "
                     f"now {getattr(config, name, None)!r})")
            if getattr(config, name, None) != before:
                fail(f"{what}: failed assignment of .{name} still changed it: {before!r} -> "
                     f"{getattr(config, name, None)!r}")


@check("G", scope="global")
def check_config_result_is_hashable_and_equal_for_equal_inputs(case) -> None:
    """Equal inputs give equal configs with equal hashes; different inputs give different
    configs."""
    first, second = _valid_configs(case), _valid_configs(case)
    for (what, a), (_, b) in zip(first, second):
        try:
            ha, hb = hash(a), hash(b)
        except TypeError as exc:
            fail(f"{what}: the config is not hashable: {exc}", severity="error")
        if a != b:
            fail(f"{what}: two parses of the same input differ: {a!r} != {b!r}")
        if ha != hb:
            fail(f"{what}: equal configs hash differently: {ha} != {hb}")
        if len({a, b}) != 1:
            fail(f"{what}: equal configs are two set members")
    for i, (what_a, a) in enumerate(first[:len(VALID_MAPPINGS)]):
        for what_b, b in first[i + 1:len(VALID_MAPPINGS)]:
            if a == b:
                fail(f"different inputs give equal configs: {what_a} == {what_b} ({a!r})")


@check("G", scope="global")
def check_config_result_survives_pickle_round_trip(case) -> None:
    """``pickle.loads(pickle.dumps(config))`` equals the config (and hashes the same)."""
    for what, config in _valid_configs(case):
        try:
            restored = pickle.loads(pickle.dumps(config))
        except Exception as exc:
            fail(f"{what}: pickle round trip raised {type(exc).__name__}: {exc}",
                 severity="error")
        if restored != config:
            fail(f"{what}: pickle round trip changed the config: {config!r} -> {restored!r}")
        try:
            hashes = hash(config), hash(restored)
        except TypeError:  # hashability is check_config_result_is_hashable_and_equal_...'s
            continue
        if hashes[0] != hashes[1]:
            fail(f"{what}: pickle round trip changed the hash: {hashes[0]} -> {hashes[1]}")


# -- compact mapping: schema errors ---------------------------------------------------------------


@check("G", scope="global")
def check_config_compact_non_mapping_is_rejected(case) -> None:
    """A compact config that is not a mapping is a TypeError listing the accepted keys."""
    for value in ("layer", ["mode", "layer"], [("mode", "layer"), ("components", ["dit"])], 3):
        _rejects(case, value, TypeError, ("diffusion_offload_config", repr(value)) + TOP_LEVEL_KEYS)


@check("G", scope="global")
def check_config_compact_non_string_keys_are_rejected(case) -> None:
    """Non-string keys at the top level, in layer_options and in a component's options are a
    TypeError naming the key and listing the accepted keys."""
    _rejects(case, {"mode": "layer", "components": ["dit"], 12345: True}, TypeError,
             ("12345",) + TOP_LEVEL_KEYS)
    _rejects(case, _layer() | {"layer_options": {67890: {}}}, TypeError,
             ("layer_options", "67890") + COMPONENT_NAMES)
    _rejects(case, _layer() | {"layer_options": {"dit": {24680: "allgather"}}}, TypeError,
             ("layer_options", "24680") + OPTION_KEYS)


@check("G", scope="global")
def check_config_compact_unknown_top_level_key_is_rejected(case) -> None:
    """An unknown top-level key is a ValueError naming it and listing the accepted keys."""
    for key in ("modes", "Components", "weight_transfer", "dlo_use_allgather"):
        _rejects(case, _layer() | {key: "layer"}, ValueError, (key,) + TOP_LEVEL_KEYS)


@check("G", scope="global")
def check_config_compact_missing_mode_or_components_is_rejected(case) -> None:
    """A missing ``mode`` or ``components`` is a ValueError naming the key and its accepted
    values."""
    _rejects(case, {"components": ["dit"]}, ValueError, ("mode", "module", "layer"))
    _rejects(case, {"mode": "layer"}, ValueError, ("components",) + COMPONENT_NAMES)
    _rejects(case, {"mode": "module", "pin_memory": True}, ValueError,
             ("components",) + COMPONENT_NAMES)


@check("G", scope="global")
def check_config_compact_invalid_mode_is_rejected(case) -> None:
    """A non-string mode is a TypeError, an unknown one a ValueError; both name the mode and
    list "module" and "layer"."""
    for mode in (1, ["layer"], None, True):
        _rejects(case, {"mode": mode, "components": ["dit"]}, TypeError,
                 ("mode", repr(mode), "'module'", "'layer'"))
    for mode in ("sequential", "Layer", "model_level", "layer_wise", ""):
        _rejects(case, {"mode": mode, "components": ["dit"]}, ValueError,
                 ("mode", repr(mode), "'module'", "'layer'"))


@check("G", scope="global")
def check_config_compact_components_of_wrong_type_are_rejected(case) -> None:
    """components as a string, a mapping, a non-collection or with a non-string entry is a
    TypeError naming components and listing the accepted names."""
    for components in ("dit", "dit,text_encoder", {"dit": True}, 1, None, ["dit", 1],
                       [b"dit"]):
        _rejects(case, {"mode": "layer", "components": components}, TypeError,
                 ("components", repr(components)) + COMPONENT_NAMES)


@check("G", scope="global")
def check_config_compact_empty_or_unknown_components_are_rejected(case) -> None:
    """Empty components, unknown names (" dit ", "text-encoder", "scheduler", ...) and
    duplicates are a ValueError naming components, the value and the accepted names."""
    for components in ([], [" dit "], ["text-encoder"], ["dit", "text-encoder"], ["scheduler"],
                       ["DiT"], ["image-encoder"], ["VAE"]):
        for mode in ("module", "layer"):
            _rejects(case, {"mode": mode, "components": components}, ValueError,
                     ("components", repr(components)) + COMPONENT_NAMES)
    _rejects(case, _layer(["dit", "dit"]), ValueError, ("components", "['dit', 'dit']"))


@check("G", scope="global")
def check_config_compact_layer_options_of_wrong_type_are_rejected(case) -> None:
    """layer_options that is not a mapping, or a component's options that are not a mapping,
    is a TypeError naming layer_options and listing the accepted option keys."""
    for options in (["dit"], "dit", 1):
        _rejects(case, _layer() | {"layer_options": options}, TypeError,
                 ("layer_options", repr(options)) + OPTION_KEYS)
    for value in ("allgather", ["allgather"], 0):
        _rejects(case, _layer() | {"layer_options": {"dit": value}}, TypeError,
                 ("layer_options", "'dit'", repr(value)) + OPTION_KEYS)


@check("G", scope="global")
def check_config_compact_layer_options_for_unselected_component_are_rejected(case) -> None:
    """Options for a component not listed in components (or not a component at all) are a
    ValueError naming the component and the selection."""
    _rejects(case, _layer(["dit"], text_encoder={"weight_transfer": "allgather"}), ValueError,
             ("layer_options", "text_encoder", "components", "dit"))
    _rejects(case, _layer(["text_encoder"], dit={}), ValueError,
             ("layer_options", "'dit'", "components", "text_encoder"))
    _rejects(case, _layer(["dit"], scheduler={}), ValueError,
             ("layer_options", "scheduler") + COMPONENT_NAMES)
    _rejects(case, _layer(["dit", "vae"], vae={}), ValueError, ("layer_options", "'vae'"))


@check("G", scope="global")
def check_config_compact_layer_options_with_module_mode_are_rejected(case) -> None:
    """Any layer_options with mode "module" is a ValueError naming layer_options and the mode
    it requires."""
    for options in ({"dit": {}}, {"dit": {"weight_transfer": "rank-local"}},
                    {"text_encoder": {"weight_transfer": "allgather"}}):
        mapping = {"mode": "module", "components": ["dit", "text_encoder"],
                   "layer_options": options}
        _rejects(case, mapping, ValueError, ("layer_options", "mode", "'layer'", "'module'"))


@check("G", scope="global")
def check_config_compact_unknown_layer_option_is_rejected(case) -> None:
    """An unknown option key is a ValueError naming it and listing the accepted option keys."""
    for key in ("prefetch", "resident", "weight-transfer", "pin_memory"):
        _rejects(case, _layer(dit={key: 1}), ValueError, ("layer_options", key) + OPTION_KEYS)


@check("G", scope="global")
def check_config_compact_unknown_weight_transfer_is_rejected(case) -> None:
    """An unknown weight_transfer ("rank_local", "AllGather", ...) is a ValueError naming
    weight_transfer, the value and the accepted transfers."""
    for transfer in ("rank_local", "AllGather", "all-gather", "ranklocal", ""):
        for component in LAYER_OPTION_COMPONENTS:
            mapping = _layer(list(COMPONENT_NAMES), **{component: {"weight_transfer": transfer}})
            _rejects(case, mapping, ValueError,
                     ("weight_transfer", repr(transfer), "'allgather'", "'rank-local'"))


@check("G", scope="global")
def check_config_compact_invalid_resident_layers_are_rejected(case) -> None:
    """A negative or non-int resident_layers (1.0, True, "2") is a ValueError naming
    resident_layers, the value and the accepted range."""
    for resident in (-1, -5, 1.0, True, False, "2", None):
        mapping = _layer(dit={"weight_transfer": "rank-local", "resident_layers": resident})
        _rejects(case, mapping, ValueError, ("resident_layers", repr(resident), "int"))


@check("G", scope="global")
def check_config_compact_resident_layers_outside_dit_are_rejected(case) -> None:
    """resident_layers on text_encoder is a ValueError naming the component and "dit"."""
    for resident in (1, 3):
        mapping = _layer(["dit", "text_encoder"],
                         text_encoder={"weight_transfer": "rank-local",
                                       "resident_layers": resident})
        _rejects(case, mapping, ValueError, ("resident_layers", "text_encoder", "'dit'"))


@check("G", scope="global")
def check_config_compact_resident_layers_with_allgather_are_rejected(case) -> None:
    """dit resident_layers with weight_transfer "allgather" is a ValueError asking for
    "rank-local"; with "rank-local" it is accepted."""
    for resident in (1, 4):
        _rejects(case, _layer(dit={"weight_transfer": "allgather", "resident_layers": resident}),
                 ValueError, ("resident_layers", "allgather", "rank-local"))
    mapping = _layer(dit={"weight_transfer": "rank-local", "resident_layers": 4})
    got = _strategy(_parse(case, mapping))
    if got != DLO:
        fail(f"config_from_mapping({mapping!r}).strategy: expected {DLO}, got {got}")


@check("G", scope="global")
def check_config_compact_non_bool_pin_memory_is_rejected(case) -> None:
    """pin_memory that is not exactly True or False (1, 0, "true", None) is a TypeError naming
    pin_memory, the value and the accepted values."""
    for pin in (1, 0, "true", "False", None, 1.0):
        _rejects(case, _layer() | {"pin_memory": pin}, TypeError,
                 ("pin_memory", repr(pin), "True", "False"))


# -- compact + legacy -----------------------------------------------------------------------------


@check("G", scope="global")
def check_config_compact_with_conflicting_legacy_strategy_is_rejected(case) -> None:
    """A compact config with a legacy flag implying another strategy is a ValueError naming the
    flag and diffusion_offload_config."""
    table = [
        ({"mode": "module", "components": ["dit"]}, "enable_layerwise_offload"),
        ({"mode": "module", "components": ["dit"]}, "enable_distributed_layerwise_offload"),
        (_layer(), "enable_cpu_offload"),
        (_layer(), "enable_distributed_layerwise_offload"),
        (_layer(dit={"weight_transfer": "allgather"}), "enable_cpu_offload"),
        (_layer(dit={"weight_transfer": "allgather"}), "enable_layerwise_offload"),
    ]
    for mapping, flag in table:
        _od_rejects(case, _od(diffusion_offload_config=mapping, **{flag: True}), ValueError,
                    (flag, "diffusion_offload_config"))


@check("G", scope="global")
def check_config_compact_with_legacy_dlo_tuning_is_rejected(case) -> None:
    """A compact config with non-default legacy DLO tuning (dlo_use_allgather=False,
    dlo_resident_layers > 0) is a ValueError naming the legacy option; the defaults pass."""
    for mapping in (_layer(), _layer(dit={"weight_transfer": "allgather"}),
                    _layer(dit={"weight_transfer": "rank-local", "resident_layers": 1})):
        for attrs, option in ((dict(dlo_use_allgather=False), "dlo_use_allgather"),
                              (dict(dlo_resident_layers=2), "dlo_resident_layers"),
                              (dict(dlo_use_allgather=False, dlo_resident_layers=1),
                               "dlo_resident_layers")):
            _od_rejects(case, _od(diffusion_offload_config=mapping, **attrs), ValueError,
                        (option, "diffusion_offload_config"))
        od = _od(diffusion_offload_config=mapping, dlo_use_allgather=True, dlo_resident_layers=0)
        got, expected = _from_od(case, od), _parse(case, mapping)
        if got != expected:
            fail(f"{_describe_od(od)}: default legacy DLO tuning changed the config: expected "
                 f"{expected!r}, got {got!r}")


# -- HSDP -----------------------------------------------------------------------------------------


@check("G", scope="global")
def check_config_dlo_with_hsdp_and_allgather_is_rejected(case) -> None:
    """Distributed layerwise offload with any AllGather component under HSDP is a ValueError
    mentioning HSDP (compact through both entry points, and the legacy flag)."""
    for mapping in (_layer(dit={"weight_transfer": "allgather"}),
                    _layer(["dit", "text_encoder"], dit={"weight_transfer": "rank-local",
                                                         "resident_layers": 1},
                           text_encoder={"weight_transfer": "allgather"})):
        _rejects(case, mapping, ValueError, ("HSDP", "allgather"), world_size=2, use_hsdp=True)
        _od_rejects(case, _od(diffusion_offload_config=mapping, use_hsdp=True,
                              data_parallel_size=2), ValueError, ("HSDP",))
    for attrs in (dict(), dict(dlo_use_allgather=True)):
        _od_rejects(case, _od(enable_distributed_layerwise_offload=True, use_hsdp=True,
                              data_parallel_size=2, **attrs), ValueError,
                    ("HSDP", "dlo_use_allgather"))


@check("G", scope="global")
def check_config_dlo_with_hsdp_and_rank_local_is_accepted(case) -> None:
    """Distributed layerwise offload with rank-local transfer is accepted under HSDP."""
    mapping = _layer(dit={"weight_transfer": "rank-local", "resident_layers": 1})
    attempts = [
        (f"config_from_mapping({mapping!r}, world_size=2, use_hsdp=True)",
         lambda: _parse(case, mapping, world_size=2, use_hsdp=True)),
    ]
    for od in (_od(diffusion_offload_config=mapping, use_hsdp=True, data_parallel_size=2),
               _od(enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
                   use_hsdp=True, data_parallel_size=2),
               _od(enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
                   dlo_resident_layers=2, use_hsdp=True)):
        attempts.append((_describe_od(od), lambda od=od: _from_od(case, od)))
    for what, parse in attempts:
        try:
            config = parse()
        except Exception as exc:
            fail(f"{what}: HSDP with rank-local transfer was rejected: "
                 f"{type(exc).__name__}: {exc}", severity="error")
        got = _strategy(config)
        if got != DLO:
            fail(f"{what}.strategy: expected {DLO}, got {got}")


@check("G", scope="global")
def check_config_nested_parallel_config_is_read_and_contradictions_rejected(case) -> None:
    """The parallel facts of a nested ``parallel_config`` (vLLM-Omni's DiffusionParallelConfig,
    an object or a mapping) count like the top-level attributes; a contradiction between the
    two is a ValueError naming both keys."""
    for nested in (SimpleNamespace(use_hsdp=True, data_parallel_size=4),
                   {"use_hsdp": True, "data_parallel_size": 4}):
        _od_rejects(case, _od(enable_distributed_layerwise_offload=True, dlo_use_allgather=True,
                              parallel_config=nested), ValueError, ("HSDP",))
        od = _od(enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
                 parallel_config=nested)
        config = _from_od(case, od)
        got = (getattr(config, "world_size", None), getattr(config, "use_hsdp", None))
        if got != (4, True):
            fail(f"{_describe_od(od)}: (world_size, use_hsdp) expected (4, True), got {got}")
    _od_rejects(case, _od(enable_layerwise_offload=True, data_parallel_size=2,
                          parallel_config=SimpleNamespace(data_parallel_size=4)), ValueError,
                ("data_parallel_size", "parallel_config.data_parallel_size"))
    _od_rejects(case, _od(enable_layerwise_offload=True, use_hsdp=False,
                          parallel_config={"use_hsdp": True}), ValueError,
                ("use_hsdp", "parallel_config.use_hsdp"))


# -- bad values of any type (catalogue §J.7) ---------------------------------------------------


def _deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@check("G", scope="global")
def check_config_error_messages_are_bounded(case) -> None:
    """A deeply nested or huge value gets an ordinary TypeError/ValueError naming the key, with
    the value abbreviated (no RecursionError while formatting it, no megabyte messages)."""
    for what, mapping in (
        ("components nested 3000 deep", {"mode": "layer", "components": _deep_list(3000)}),
        ("components of 1,000,000 ints", {"mode": "layer", "components": list(range(10**6))}),
        ("a mode of 1,000,000 characters", {"mode": "m" * 10**6, "components": ["dit"]}),
    ):
        key = "components" if "components" in what else "mode"
        # Not through _parse: deepcopy itself would recurse too deep.
        exc = expect_error(f"config_from_mapping({what})",
                           lambda mapping=mapping: case.impl.config_from_mapping(
                               mapping, world_size=1, use_hsdp=False),
                           types=(TypeError, ValueError), mentions=(key,))
        if len(str(exc)) > 1000:
            fail(f"config_from_mapping({what}): the error message is {len(str(exc))} characters; "
                 "abbreviate long values")


@check("G", scope="global")
def check_config_boolean_flags_must_be_bools(case) -> None:
    """A flag that is not exactly True or False ("false" is truthy, a list is unhashable) is a
    TypeError naming the flag and the value, through both entry points."""
    for value in ("false", [True]):
        _rejects(case, _layer(), TypeError, ("use_hsdp", repr(value)), use_hsdp=value)
        for flag in ("enable_cpu_offload", "enable_layerwise_offload",
                     "enable_distributed_layerwise_offload", "pin_cpu_memory",
                     "dlo_use_allgather", "use_hsdp"):
            _od_rejects(case, _od(**{flag: value}), TypeError, (flag, repr(value)))


@check("G", scope="global")
def check_config_od_config_mapping_is_read_as_attributes(case) -> None:
    """A mapping given as the diffusion config is read key by key, like an object's attributes
    (unrelated keys ignored); an unknown offload-looking key is a ValueError naming it."""
    table = [
        ({"enable_layerwise_offload": True, "model": "org/name"}, LAYER_WISE),
        ({"enable_cpu_offload": True}, MODEL_LEVEL),
        ({"diffusion_offload_config": _layer(dit={"weight_transfer": "allgather"})}, DLO),
        ({"dtype": "bfloat16"}, NONE),
    ]
    for mapping, expected in table:
        got = _strategy(case.impl.config_from_od_config(copy.deepcopy(mapping)))
        if got != expected:
            fail(f"config_from_od_config({mapping!r}).strategy: expected {expected}, got {got}")
    for key in ("enable_layerwise_ofload", "enable_sequential_offload"):
        expect_error(f"config_from_od_config({{{key!r}: True}})",
                     lambda key=key: case.impl.config_from_od_config({key: True}),
                     types=(ValueError,), mentions=(repr(key), "enable_layerwise_offload"))
