"""The §G configuration suite proves itself: each deliberately broken parser (a mutant) makes an
exact, hard-coded set of checks fail, every §G check is killed by at least one mutant, and the real
implementation passes them all."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from offload_ref.config import OffloadConfig, OffloadStrategy, _rebuild
from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION, Implementation
from offload_ref.contracts.runner import load_catalogue, run_checks

REAL_MAPPING = DEFAULT_IMPLEMENTATION.config_from_mapping
REAL_OD = DEFAULT_IMPLEMENTATION.config_from_od_config


def g_check_ids() -> list[str]:
    return sorted(info.id for info in load_catalogue().values() if info.section == "G")


def failing(impl: Implementation) -> set[str]:
    results = run_checks([], checks=g_check_ids(), impl=impl)
    return {r.id.check for r in results if r.outcome in ("failed", "error")}


def _fields(config: OffloadConfig) -> dict[str, Any]:
    return dict(strategy=config.strategy, components=config.components,
                pin_memory=config.pin_memory, layer_options=dict(config.layer_options),
                world_size=config.world_size, use_hsdp=config.use_hsdp,
                explicit=config.explicit)


def _with(od: Any, **changes: Any) -> Any:
    if isinstance(od, Mapping):  # a diffusion config given as a mapping
        return {**od, **changes}
    return SimpleNamespace(**{**vars(od), **changes})


def _wrap_results(post: Callable[[OffloadConfig], Any]) -> Implementation:
    """Both entry points, with every returned config passed through ``post``."""

    def mapping(m: Any, *, world_size: int = 1, use_hsdp: bool = False) -> Any:
        return post(REAL_MAPPING(m, world_size=world_size, use_hsdp=use_hsdp))

    def od_config(od: Any) -> Any:
        return post(REAL_OD(od))

    return DEFAULT_IMPLEMENTATION.replace(config_from_mapping=mapping,
                                          config_from_od_config=od_config)


# -- (a) no schema validation: anything that raises becomes a default layerwise config ------------


def _lenient(fn: Callable[..., OffloadConfig]) -> Callable[..., OffloadConfig]:
    def parse(*args: Any, **kwargs: Any) -> OffloadConfig:
        try:
            return fn(*args, **kwargs)
        except Exception:
            return OffloadConfig(strategy=OffloadStrategy.LAYER_WISE, components=("dit",))

    return parse


NO_VALIDATION = DEFAULT_IMPLEMENTATION.replace(config_from_mapping=_lenient(REAL_MAPPING),
                                               config_from_od_config=_lenient(REAL_OD))


# -- (b) legacy priority inverted: model-level beats the layerwise flags --------------------------


def _inverted_priority(od: Any) -> OffloadConfig:
    if getattr(od, "diffusion_offload_config", None) is None and getattr(
            od, "enable_cpu_offload", False) is True:
        return OffloadConfig(strategy=OffloadStrategy.MODEL_LEVEL,
                             components=("dit", "text_encoder"), explicit=False)
    return REAL_OD(od)


INVERTED_PRIORITY = DEFAULT_IMPLEMENTATION.replace(config_from_od_config=_inverted_priority)


# -- (c) a compact config silently ignores every legacy flag and the legacy DLO tuning ------------


def _compact_ignores_legacy(od: Any) -> OffloadConfig:
    compact = getattr(od, "diffusion_offload_config", None)
    if compact is None:
        return REAL_OD(od)
    return REAL_MAPPING(compact, world_size=getattr(od, "data_parallel_size", None) or 1,
                        use_hsdp=bool(getattr(od, "use_hsdp", False)))


COMPACT_IGNORES_LEGACY = DEFAULT_IMPLEMENTATION.replace(
    config_from_od_config=_compact_ignores_legacy)


# -- (d) DLO + HSDP + AllGather accepted (the HSDP flag is set after validation) ------------------


def _hsdp_mapping(m: Any, *, world_size: int = 1, use_hsdp: bool = False) -> OffloadConfig:
    config = REAL_MAPPING(m, world_size=world_size, use_hsdp=False)
    object.__setattr__(config, "use_hsdp", use_hsdp)
    return config


def _hsdp_od(od: Any) -> OffloadConfig:
    config = REAL_OD(_with(od, use_hsdp=False))
    object.__setattr__(config, "use_hsdp", bool(getattr(od, "use_hsdp", False)))
    return config


HSDP_ALLGATHER_ACCEPTED = DEFAULT_IMPLEMENTATION.replace(config_from_mapping=_hsdp_mapping,
                                                         config_from_od_config=_hsdp_od)


# -- (e) error messages that name nothing (the exception type is kept) ----------------------------


def _anonymous_errors(fn: Callable[..., OffloadConfig]) -> Callable[..., OffloadConfig]:
    def parse(*args: Any, **kwargs: Any) -> OffloadConfig:
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)("invalid config") from None

    return parse


ANONYMOUS_ERRORS = DEFAULT_IMPLEMENTATION.replace(
    config_from_mapping=_anonymous_errors(REAL_MAPPING),
    config_from_od_config=_anonymous_errors(REAL_OD))


# -- (f) every error becomes a ValueError (the message is kept, the type is lost) -----------------


def _all_value_errors(fn: Callable[..., OffloadConfig]) -> Callable[..., OffloadConfig]:
    def parse(*args: Any, **kwargs: Any) -> OffloadConfig:
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None

    return parse


ALL_VALUE_ERRORS = DEFAULT_IMPLEMENTATION.replace(
    config_from_mapping=_all_value_errors(REAL_MAPPING),
    config_from_od_config=_all_value_errors(REAL_OD))


# -- (g) the strategy follows the mode only: layer options never select distributed layerwise -----


def _mode_only(m: Any, *, world_size: int = 1, use_hsdp: bool = False) -> OffloadConfig:
    config = REAL_MAPPING(m, world_size=world_size, use_hsdp=use_hsdp)
    if config.strategy is OffloadStrategy.DISTRIBUTED_LAYER_WISE:
        return _rebuild(OffloadStrategy.LAYER_WISE, config.components, config.pin_memory, {},
                        world_size, use_hsdp, True)
    return config


MODE_ONLY_STRATEGY = DEFAULT_IMPLEMENTATION.replace(config_from_mapping=_mode_only)


# -- (h) components ignored: the strategy's default selection is used ----------------------------


def _default_components(config: OffloadConfig) -> OffloadConfig:
    fields = _fields(config)
    default = (("dit", "text_encoder") if config.strategy is OffloadStrategy.MODEL_LEVEL
               else ("dit",))
    fields["components"] = default
    fields["layer_options"] = {k: v for k, v in fields["layer_options"].items() if k in default}
    return OffloadConfig(**fields)


IGNORES_COMPONENTS = DEFAULT_IMPLEMENTATION.replace(
    config_from_mapping=_wrap_results(_default_components).config_from_mapping)


# -- (i) pin_memory ignored: always pinned --------------------------------------------------------


def _always_pinned(config: OffloadConfig) -> OffloadConfig:
    return OffloadConfig(**{**_fields(config), "pin_memory": True})


IGNORES_PIN_MEMORY = DEFAULT_IMPLEMENTATION.replace(
    config_from_mapping=_wrap_results(_always_pinned).config_from_mapping)


# -- (j) a mutable result (a plain namespace: assignable, unhashable) -----------------------------


MUTABLE_RESULT = _wrap_results(lambda config: SimpleNamespace(**_fields(config)))


# -- (k) identity hash (equal configs hash differently); pickling loses the class ----------------


class _IdentityHashConfig(OffloadConfig):
    __hash__ = object.__hash__


IDENTITY_HASH = _wrap_results(lambda config: _IdentityHashConfig(**_fields(config)))


# -- (l) lossy pickle: layer options and pin_memory are dropped by __reduce__ ---------------------


class _LossyPickleConfig(OffloadConfig):
    def __reduce__(self):
        return (_LossyPickleConfig, (self.strategy, self.components, True, {}, self.world_size,
                                     self.use_hsdp, self.explicit))


LOSSY_PICKLE = _wrap_results(lambda config: _LossyPickleConfig(**_fields(config)))


# -- (m) any distributed layerwise config under HSDP is rejected, rank-local included -------------


def _reject_hsdp(config: OffloadConfig) -> OffloadConfig:
    if config.use_hsdp and config.strategy is OffloadStrategy.DISTRIBUTED_LAYER_WISE:
        raise ValueError("distributed layerwise offload is incompatible with HSDP")
    return config


REJECTS_HSDP_RANK_LOCAL = _wrap_results(_reject_hsdp)


# -- (n) legacy resident layers with AllGather silently switched to rank-local --------------------


def _silent_rank_local(od: Any) -> OffloadConfig:
    if (getattr(od, "diffusion_offload_config", None) is None
            and getattr(od, "dlo_resident_layers", 0)
            and getattr(od, "dlo_use_allgather", True)):
        od = _with(od, dlo_use_allgather=False)
    return REAL_OD(od)


SILENT_RANK_LOCAL = DEFAULT_IMPLEMENTATION.replace(config_from_od_config=_silent_rank_local)


# -- (o) a nested parallel_config is ignored (the seeds' DiffusionParallelConfig shape) ------------


def _ignores_parallel_config(od: Any) -> OffloadConfig:
    return REAL_OD(_with(od, parallel_config=None))


IGNORES_PARALLEL_CONFIG = DEFAULT_IMPLEMENTATION.replace(
    config_from_od_config=_ignores_parallel_config)


# -- (p) error messages quote the whole input (full repr: deep values recurse, huge ones are huge) --


def _quotes_whole_input(m: Any, *, world_size: int = 1, use_hsdp: bool = False) -> OffloadConfig:
    try:
        return REAL_MAPPING(m, world_size=world_size, use_hsdp=use_hsdp)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (in {m!r})") from None


UNBOUNDED_MESSAGES = DEFAULT_IMPLEMENTATION.replace(config_from_mapping=_quotes_whole_input)


# -- (q) flags read by truthiness: "false" is True, [True] is True -------------------------------

_FLAGS = ("enable_cpu_offload", "enable_layerwise_offload", "enable_distributed_layerwise_offload",
          "pin_cpu_memory", "dlo_use_allgather", "use_hsdp")


def _truthy_mapping(m: Any, *, world_size: int = 1, use_hsdp: Any = False) -> OffloadConfig:
    return REAL_MAPPING(m, world_size=world_size, use_hsdp=bool(use_hsdp))


def _truthy_od(od: Any) -> OffloadConfig:
    if isinstance(od, Mapping):
        return REAL_OD(od)
    return REAL_OD(_with(od, **{f: bool(getattr(od, f)) for f in _FLAGS
                                if getattr(od, f, None) is not None}))


TRUTHY_FLAGS = DEFAULT_IMPLEMENTATION.replace(config_from_mapping=_truthy_mapping,
                                              config_from_od_config=_truthy_od)


# -- (r) a mapping given as the diffusion config is read as an object without the attributes ------


def _mapping_is_empty(od: Any) -> OffloadConfig:
    return REAL_OD(SimpleNamespace() if isinstance(od, Mapping) else od)


OD_MAPPING_IGNORED = DEFAULT_IMPLEMENTATION.replace(config_from_od_config=_mapping_is_empty)


# -- expected kills -------------------------------------------------------------------------------

REJECTIONS = {
    "check_config_boolean_flags_must_be_bools",
    "check_config_error_messages_are_bounded",
    "check_config_od_config_mapping_is_read_as_attributes",
    "check_config_compact_components_of_wrong_type_are_rejected",
    "check_config_compact_empty_or_unknown_components_are_rejected",
    "check_config_compact_invalid_mode_is_rejected",
    "check_config_compact_invalid_resident_layers_are_rejected",
    "check_config_compact_layer_options_for_unselected_component_are_rejected",
    "check_config_compact_layer_options_of_wrong_type_are_rejected",
    "check_config_compact_layer_options_with_module_mode_are_rejected",
    "check_config_compact_missing_mode_or_components_is_rejected",
    "check_config_compact_non_bool_pin_memory_is_rejected",
    "check_config_compact_non_mapping_is_rejected",
    "check_config_compact_non_string_keys_are_rejected",
    "check_config_compact_resident_layers_outside_dit_are_rejected",
    "check_config_compact_resident_layers_with_allgather_are_rejected",
    "check_config_compact_unknown_layer_option_is_rejected",
    "check_config_compact_unknown_top_level_key_is_rejected",
    "check_config_compact_unknown_weight_transfer_is_rejected",
    "check_config_compact_with_conflicting_legacy_strategy_is_rejected",
    "check_config_compact_with_legacy_dlo_tuning_is_rejected",
    "check_config_dlo_with_hsdp_and_allgather_is_rejected",
    "check_config_legacy_resident_layers_with_allgather_are_rejected",
    "check_config_nested_parallel_config_is_read_and_contradictions_rejected",
}

TYPE_ERROR_CHECKS = {
    "check_config_boolean_flags_must_be_bools",
    "check_config_compact_components_of_wrong_type_are_rejected",
    "check_config_compact_invalid_mode_is_rejected",
    "check_config_compact_layer_options_of_wrong_type_are_rejected",
    "check_config_compact_non_bool_pin_memory_is_rejected",
    "check_config_compact_non_mapping_is_rejected",
    "check_config_compact_non_string_keys_are_rejected",
}

MUTANTS: dict[str, tuple[Implementation, set[str]]] = {
    "no_validation": (NO_VALIDATION, REJECTIONS),
    "inverted_priority": (INVERTED_PRIORITY, {"check_config_legacy_flags_follow_priority"}),
    "compact_ignores_legacy": (COMPACT_IGNORES_LEGACY, {
        "check_config_compact_with_conflicting_legacy_strategy_is_rejected",
        "check_config_compact_with_legacy_dlo_tuning_is_rejected",
    }),
    "hsdp_allgather_accepted": (HSDP_ALLGATHER_ACCEPTED, {  # the flag also skips its type check
        "check_config_boolean_flags_must_be_bools",
        "check_config_dlo_with_hsdp_and_allgather_is_rejected",
        "check_config_nested_parallel_config_is_read_and_contradictions_rejected",
    }),
    "anonymous_errors": (ANONYMOUS_ERRORS, REJECTIONS),
    "all_value_errors": (ALL_VALUE_ERRORS, TYPE_ERROR_CHECKS),
    "mode_only_strategy": (MODE_ONLY_STRATEGY, {
        "check_config_compact_mode_selects_strategy",
        "check_config_compact_resident_layers_with_allgather_are_rejected",
        "check_config_compact_with_legacy_dlo_tuning_is_rejected",
        "check_config_dlo_with_hsdp_and_rank_local_is_accepted",
        "check_config_result_is_hashable_and_equal_for_equal_inputs",
    }),
    "ignores_components": (IGNORES_COMPONENTS, {
        "check_config_compact_components_are_carried_through",
    }),
    "ignores_pin_memory": (IGNORES_PIN_MEMORY, {
        "check_config_compact_pin_memory_defaults_to_true_and_can_be_overridden",
    }),
    "mutable_result": (MUTABLE_RESULT, {
        "check_config_result_is_frozen",
        "check_config_result_is_hashable_and_equal_for_equal_inputs",
    }),
    "identity_hash": (IDENTITY_HASH, {
        "check_config_result_is_hashable_and_equal_for_equal_inputs",
        "check_config_result_survives_pickle_round_trip",
    }),
    "lossy_pickle": (LOSSY_PICKLE, {"check_config_result_survives_pickle_round_trip"}),
    "rejects_hsdp_rank_local": (REJECTS_HSDP_RANK_LOCAL, {
        "check_config_dlo_with_hsdp_and_rank_local_is_accepted",
        "check_config_nested_parallel_config_is_read_and_contradictions_rejected",
    }),
    "ignores_parallel_config": (IGNORES_PARALLEL_CONFIG, {
        "check_config_nested_parallel_config_is_read_and_contradictions_rejected",
    }),
    "silent_rank_local": (SILENT_RANK_LOCAL, {
        "check_config_legacy_resident_layers_with_allgather_are_rejected",
    }),
    "unbounded_error_messages": (UNBOUNDED_MESSAGES, {
        "check_config_error_messages_are_bounded",
    }),
    "truthy_flags": (TRUTHY_FLAGS, {"check_config_boolean_flags_must_be_bools"}),
    "od_mapping_ignored": (OD_MAPPING_IGNORED, {
        "check_config_od_config_mapping_is_read_as_attributes",
    }),
}


def test_real_implementation_passes_every_g_check() -> None:
    results = run_checks([], checks=g_check_ids())
    bad = {str(r.id): r.message for r in results if not r.ok}
    assert not bad, bad
    assert len(results) == len(g_check_ids())


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_fails_exactly_the_expected_checks(name: str) -> None:
    impl, expected = MUTANTS[name]
    assert set(expected) <= set(g_check_ids()), sorted(set(expected) - set(g_check_ids()))
    got = failing(impl)
    assert got == expected, (f"{name}: unexpectedly failing {sorted(got - expected)}, "
                             f"unexpectedly passing {sorted(expected - got)}")


def test_every_g_check_is_killed_by_some_mutant() -> None:
    killed = set().union(*(expected for _, expected in MUTANTS.values()))
    assert set(g_check_ids()) - killed == set(), (
        f"§G checks no mutant kills: {sorted(set(g_check_ids()) - killed)}")


def test_g_checks_are_global_and_named_by_subject() -> None:
    for info in load_catalogue().values():
        if info.section == "G":
            assert info.scope == "global", info.id
            assert info.id.startswith("check_config_"), info.id
            assert info.title, f"{info.id} has no docstring title"


def test_mutants_reject_nothing_the_real_parser_accepts_for_plain_inputs() -> None:
    """Sanity: the wrappers are transparent on an ordinary valid mapping (the mutation is the
    only difference)."""
    mapping: Mapping[str, Any] = {"mode": "layer", "components": ["dit"]}
    for name, (impl, _) in MUTANTS.items():
        config = impl.config_from_mapping(dict(mapping), world_size=1, use_hsdp=False)
        assert config.strategy == OffloadStrategy.LAYER_WISE, name
