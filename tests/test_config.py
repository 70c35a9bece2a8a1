"""Unit tests of offload_ref/config.py: the OffloadConfig constructor, the legacy translation and
the compact parser (properties with hypothesis)."""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_ref.config import (
    COMPONENTS,
    LayerOptions,
    OffloadConfig,
    OffloadStrategy,
    WeightTransfer,
)

NONE = OffloadStrategy.NONE
MODEL_LEVEL = OffloadStrategy.MODEL_LEVEL
LAYER_WISE = OffloadStrategy.LAYER_WISE
DLO = OffloadStrategy.DISTRIBUTED_LAYER_WISE
HYPOTHESIS = settings(derandomize=True, max_examples=50, deadline=None)


# -- constructor -----------------------------------------------------------------------------------


def test_default_config_is_off() -> None:
    config = OffloadConfig()
    assert config.strategy is NONE and not config.enabled
    assert config.components == () and config.pin_memory is True
    assert config.world_size == 1 and config.use_hsdp is False and config.explicit is True
    assert dict(config.layer_options) == {}
    assert config.options_for("dit") == LayerOptions()


def test_strategy_accepts_its_string_value() -> None:
    assert OffloadConfig(strategy="layer_wise").strategy is LAYER_WISE
    with pytest.raises(ValueError):
        OffloadConfig(strategy="layerwise")


@pytest.mark.parametrize("strategy, default", [
    (MODEL_LEVEL, ("dit", "text_encoder", "image_encoder")),  # every encoder kind, never "vae"
    (LAYER_WISE, ("dit",)),
    (DLO, ("dit",)),
])
def test_empty_components_take_the_strategy_default(strategy, default) -> None:
    config = OffloadConfig(strategy=strategy)
    assert config.components == default
    assert all(config.selects(c) for c in default)


def test_components_are_canonically_ordered() -> None:
    a = OffloadConfig(strategy=MODEL_LEVEL, components=("text_encoder", "dit"))
    b = OffloadConfig(strategy=MODEL_LEVEL, components=["dit", "text_encoder"])
    assert a.components == ("dit", "text_encoder") and a == b and hash(a) == hash(b)


@pytest.mark.parametrize("components, error", [
    ("dit", TypeError),
    (b"dit", TypeError),
    (None, TypeError),
    (("scheduler",), ValueError),
    ((" dit ",), ValueError),
    (("dit", "dit"), ValueError),
])
def test_constructor_rejects_bad_components(components, error) -> None:
    with pytest.raises(error, match="components"):
        OffloadConfig(strategy=LAYER_WISE, components=components)


@pytest.mark.parametrize("pin", [1, 0, "yes", None])
def test_constructor_rejects_non_bool_pin_memory(pin) -> None:
    with pytest.raises(TypeError, match="pin_memory"):
        OffloadConfig(strategy=LAYER_WISE, pin_memory=pin)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True, "2"])
def test_constructor_rejects_bad_world_size(world_size) -> None:
    with pytest.raises(ValueError, match="world_size"):
        OffloadConfig(world_size=world_size)


def test_constructor_layer_options_accept_mappings_and_objects() -> None:
    a = OffloadConfig(strategy=DLO, layer_options={"dit": {"weight_transfer": "allgather"}})
    b = OffloadConfig(strategy=DLO, layer_options={"dit": LayerOptions(WeightTransfer.ALLGATHER)})
    assert a == b and hash(a) == hash(b)
    assert a.options_for("dit").weight_transfer is WeightTransfer.ALLGATHER
    assert a.options_for("text_encoder") == LayerOptions()


def test_constructor_rejects_layer_options_for_unselected_component() -> None:
    with pytest.raises(ValueError, match="text_encoder"):
        OffloadConfig(strategy=LAYER_WISE, components=("dit",),
                      layer_options={"text_encoder": {}})


def test_constructor_rejects_layer_options_with_model_level() -> None:
    with pytest.raises(ValueError, match="model_level"):
        OffloadConfig(strategy=MODEL_LEVEL, layer_options={"dit": {}})


@pytest.mark.parametrize("options", [
    {"weight_transfer": "allgather"},
    {"weight_transfer": "rank-local", "resident_layers": 1},
])
def test_constructor_rejects_dlo_options_without_dlo_strategy(options) -> None:
    with pytest.raises(ValueError, match="distributed_layer_wise"):
        OffloadConfig(strategy=LAYER_WISE, layer_options={"dit": options})


def test_constructor_rejects_resident_layers_with_allgather() -> None:
    with pytest.raises(ValueError, match="rank-local"):
        OffloadConfig(strategy=DLO, layer_options={"dit": {"weight_transfer": "allgather",
                                                           "resident_layers": 2}})


def test_constructor_rejects_resident_layers_outside_dit() -> None:
    with pytest.raises(ValueError, match="only supported for 'dit'"):
        OffloadConfig(strategy=DLO, components=("dit", "text_encoder"),
                      layer_options={"text_encoder": {"weight_transfer": "rank-local",
                                                      "resident_layers": 1}})


def test_constructor_rejects_hsdp_with_allgather_only() -> None:
    with pytest.raises(ValueError, match="HSDP"):
        OffloadConfig(strategy=DLO, use_hsdp=True, world_size=2,
                      layer_options={"dit": {"weight_transfer": "allgather"}})
    config = OffloadConfig(strategy=DLO, use_hsdp=True, world_size=2,
                           layer_options={"dit": {"weight_transfer": "rank-local",
                                                  "resident_layers": 1}})
    assert config.use_hsdp and config.options_for("dit").resident_layers == 1


@pytest.mark.parametrize("resident", [-1, 1.0, True, "1"])
def test_layer_options_reject_bad_resident_layers(resident) -> None:
    with pytest.raises(ValueError, match="resident_layers"):
        LayerOptions(WeightTransfer.RANK_LOCAL, resident)


def test_layer_options_reject_unknown_transfer() -> None:
    with pytest.raises(ValueError):
        LayerOptions("rank_local")


def test_config_is_frozen_and_its_options_read_only() -> None:
    config = OffloadConfig(strategy=DLO, layer_options={"dit": {"weight_transfer": "allgather"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pin_memory = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.layer_options["text_encoder"] = LayerOptions()  # type: ignore[index]


def test_constructor_does_not_keep_a_reference_to_the_callers_options() -> None:
    options = {"dit": {"weight_transfer": "allgather"}}
    config = OffloadConfig(strategy=DLO, layer_options=options)
    options["text_encoder"] = {}
    assert set(config.layer_options) == {"dit"}


def test_strategy_and_transfer_print_as_their_values() -> None:
    assert str(DLO) == "distributed_layer_wise" and str(WeightTransfer.RANK_LOCAL) == "rank-local"


# -- from_od_config --------------------------------------------------------------------------------


class _Bare:
    """A diffusion config object with none of the attributes."""


def test_from_od_config_defaults_for_a_bare_object() -> None:
    config = OffloadConfig.from_od_config(_Bare())
    assert config == OffloadConfig(explicit=False)
    assert config.strategy is NONE and config.pin_memory is True and config.world_size == 1
    assert config.explicit is False


def test_from_od_config_treats_none_attributes_as_missing() -> None:
    od = SimpleNamespace(enable_cpu_offload=None, enable_layerwise_offload=None,
                         enable_distributed_layerwise_offload=None, pin_cpu_memory=None,
                         dlo_use_allgather=None, dlo_resident_layers=None,
                         data_parallel_size=None, use_hsdp=None, diffusion_offload_config=None)
    assert OffloadConfig.from_od_config(od) == OffloadConfig(explicit=False)


@pytest.mark.parametrize("attrs, strategy, components", [
    (dict(enable_cpu_offload=True), MODEL_LEVEL, ("dit", "text_encoder", "image_encoder")),
    (dict(enable_layerwise_offload=True), LAYER_WISE, ("dit",)),
    (dict(enable_distributed_layerwise_offload=True), DLO, ("dit",)),
    (dict(enable_cpu_offload=True, enable_layerwise_offload=True), LAYER_WISE, ("dit",)),
    (dict(enable_cpu_offload=True, enable_layerwise_offload=True,
          enable_distributed_layerwise_offload=True), DLO, ("dit",)),
])
def test_from_od_config_legacy_flags(attrs, strategy, components) -> None:
    config = OffloadConfig.from_od_config(SimpleNamespace(**attrs))
    assert config.strategy is strategy and config.components == components
    assert config.explicit is False


def test_from_od_config_legacy_dlo_tuning() -> None:
    default = OffloadConfig.from_od_config(
        SimpleNamespace(enable_distributed_layerwise_offload=True))
    assert default.options_for("dit") == LayerOptions(WeightTransfer.ALLGATHER, 0)
    tuned = OffloadConfig.from_od_config(SimpleNamespace(
        enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
        dlo_resident_layers=3, pin_cpu_memory=False, data_parallel_size=2))
    assert tuned.options_for("dit") == LayerOptions(WeightTransfer.RANK_LOCAL, 3)
    assert tuned.pin_memory is False and tuned.world_size == 2


@pytest.mark.parametrize("attrs, error, match", [
    (dict(data_parallel_size=0), ValueError, "data_parallel_size"),
    (dict(data_parallel_size=2.0), ValueError, "data_parallel_size"),
    (dict(dlo_use_allgather=1), TypeError, "dlo_use_allgather"),
    (dict(dlo_resident_layers=-1), ValueError, "dlo_resident_layers"),
    (dict(dlo_resident_layers=1.5), ValueError, "dlo_resident_layers"),
    (dict(pin_cpu_memory=1, enable_cpu_offload=True), TypeError, "pin_cpu_memory"),
    (dict(enable_distributed_layerwise_offload=True, dlo_resident_layers=1), ValueError,
     "dlo_use_allgather=False"),
    (dict(enable_distributed_layerwise_offload=True, use_hsdp=True), ValueError, "HSDP"),
])
def test_from_od_config_rejects_bad_legacy_values(attrs, error, match) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig.from_od_config(SimpleNamespace(**attrs))


def test_from_od_config_compact_matches_from_mapping() -> None:
    mapping = {"mode": "layer", "components": ["dit"],
               "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    od = SimpleNamespace(diffusion_offload_config=mapping, data_parallel_size=4,
                         enable_distributed_layerwise_offload=True)
    assert OffloadConfig.from_od_config(od) == OffloadConfig.from_mapping(mapping, world_size=4)


def test_from_od_config_compact_takes_pin_cpu_memory_unless_given() -> None:
    mapping = {"mode": "module", "components": ["dit"]}
    od = SimpleNamespace(diffusion_offload_config=mapping, pin_cpu_memory=False)
    assert OffloadConfig.from_od_config(od).pin_memory is False
    od = SimpleNamespace(diffusion_offload_config={**mapping, "pin_memory": True},
                         pin_cpu_memory=False)
    assert OffloadConfig.from_od_config(od).pin_memory is True


@pytest.mark.parametrize("attrs, mentions", [
    (dict(enable_cpu_offload=True), "enable_cpu_offload"),
    (dict(dlo_use_allgather=False), "dlo_use_allgather"),
    (dict(dlo_resident_layers=1), "dlo_resident_layers"),
])
def test_from_od_config_compact_rejects_legacy_conflicts(attrs, mentions) -> None:
    od = SimpleNamespace(diffusion_offload_config={"mode": "layer", "components": ["dit"]},
                         **attrs)
    with pytest.raises(ValueError, match=mentions) as info:
        OffloadConfig.from_od_config(od)
    assert "diffusion_offload_config" in str(info.value)


# -- from_mapping ----------------------------------------------------------------------------------


def test_from_mapping_does_not_mutate_its_input() -> None:
    mapping = {"mode": "layer", "components": ["text_encoder", "dit"],
               "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    before = repr(mapping)
    OffloadConfig.from_mapping(mapping)
    assert repr(mapping) == before


def test_from_mapping_accepts_any_mapping_type() -> None:
    from types import MappingProxyType

    mapping = MappingProxyType({"mode": "layer", "components": ("dit",)})
    assert OffloadConfig.from_mapping(mapping).strategy is LAYER_WISE


@pytest.mark.parametrize("mapping, error, mentions", [
    ({"components": ["dit"]}, ValueError, ["'mode'", "'module'", "'layer'"]),
    ({"mode": "layer"}, ValueError, ["'components'", "'dit'", "'text_encoder'"]),
    ({"mode": "layer", "components": ["dit", 3]}, TypeError, ["components", "'text_encoder'"]),
    ({"mode": "layer", "components": ["dit"], 7: 1}, TypeError, ["7", "'pin_memory'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {7: {}}}, TypeError,
     ["layer_options", "'text_encoder'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {7: 1}}}, TypeError,
     ["layer_options", "'weight_transfer'", "'resident_layers'"]),
])
def test_from_mapping_errors_name_the_key_and_accepted_values(mapping, error, mentions) -> None:
    with pytest.raises(error) as info:
        OffloadConfig.from_mapping(mapping)
    for text in mentions:
        assert text in str(info.value), (text, str(info.value))


# -- properties ------------------------------------------------------------------------------------


@st.composite
def valid_mappings(draw):
    mode = draw(st.sampled_from(["module", "layer"]))
    components = draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=2, unique=True))
    mapping = {"mode": mode, "components": draw(st.sampled_from([components, tuple(components)]))}
    if mode == "layer" and draw(st.booleans()):
        options = {}
        optionable = [c for c in components if c != "vae"]  # a VAE takes no layer options
        for name in draw(st.lists(st.sampled_from(optionable), unique=True)) if optionable else []:
            opts = {}
            transfer = draw(st.sampled_from([None, "allgather", "rank-local"]))
            if transfer is not None:
                opts["weight_transfer"] = transfer
            if name == "dit" and transfer != "allgather" and draw(st.booleans()):
                opts["resident_layers"] = draw(st.integers(0, 8))
            options[name] = opts
        mapping["layer_options"] = options
    if draw(st.booleans()):
        mapping["pin_memory"] = draw(st.booleans())
    return mapping


def _expected_strategy(mapping) -> OffloadStrategy:
    if mapping["mode"] == "module":
        return MODEL_LEVEL
    options = mapping.get("layer_options", {}).values()
    if any(o.get("weight_transfer") == "allgather" or o.get("resident_layers") for o in options):
        return DLO
    return LAYER_WISE


@HYPOTHESIS
@given(valid_mappings(), st.integers(1, 8))
def test_valid_compact_mappings_parse_and_round_trip(mapping, world_size) -> None:
    config = OffloadConfig.from_mapping(mapping, world_size=world_size)
    assert config.strategy is _expected_strategy(mapping)
    assert set(config.components) == set(mapping["components"])
    assert config.pin_memory is mapping.get("pin_memory", True)
    assert config.world_size == world_size and config.explicit is True
    for name, opts in mapping.get("layer_options", {}).items():
        got = config.options_for(name)
        assert got.weight_transfer.value == opts.get("weight_transfer", "rank-local")
        assert got.resident_layers == opts.get("resident_layers", 0)
    restored = pickle.loads(pickle.dumps(config))
    assert restored == config and hash(restored) == hash(config)
    assert OffloadConfig.from_mapping(dict(mapping), world_size=world_size) == config
    # The same mapping through a diffusion config object gives the same config.
    od = SimpleNamespace(diffusion_offload_config=mapping, data_parallel_size=world_size)
    assert OffloadConfig.from_od_config(od) == config


_EXTRA_KEYS = st.one_of(
    st.text(min_size=0, max_size=12).filter(
        lambda k: k not in ("mode", "components", "layer_options", "pin_memory")),
    st.sampled_from(["Mode", "component", "layer-options", "pin_cpu_memory",
                     "dlo_use_allgather", " mode"]),
)


@HYPOTHESIS
@given(valid_mappings(), _EXTRA_KEYS, st.one_of(st.none(), st.booleans(), st.integers(),
                                                 st.text(max_size=5)))
def test_an_unknown_top_level_key_is_rejected(mapping, key, value) -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_mapping({**mapping, key: value})
    message = str(info.value)
    assert repr(key) in message
    for accepted in ("mode", "components", "layer_options", "pin_memory"):
        assert accepted in message


def test_the_served_strategies_are_the_backend_table() -> None:
    """Adding a strategy: its enum member, its backend in backends/strategies.py; the kit's
    strategies and the CLI's --strategy choices follow from both (docs/architecture.md, "How to
    add")."""
    from offload_ref.backends.strategies import BACKENDS
    from offload_ref.contracts.registry import ALL_STRATEGIES

    assert OffloadStrategy.served() == tuple(BACKENDS)
    assert ALL_STRATEGIES == tuple(s.value for s in BACKENDS)
