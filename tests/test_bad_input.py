"""Bad input gets a clear error, and nothing changes (issue 9; CONTRACTS.md §J.7).

Each test failed on the code before its fix: a raw RecursionError, a 15-megabyte message, a
string flag read as True, a mapping read as "no offload", a sparse buffer reported as a tensor
subclass, a ``__slots__`` pipeline reported as a member_descriptor, a non-weak-referenceable
pipeline left half offloaded."""

from __future__ import annotations

import types

import pytest
from offload_ref import OffloadConfig
from offload_ref.config import LayerOptions, OffloadStrategy

LAYER_WISE = OffloadStrategy.LAYER_WISE


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
