"""Which checks apply is decided from one frozen traits record per (spec, strategy)
(``contracts/traits.py``, computed by ``contracts/checks/_traits.py``): the checks name what they
require (``@check(..., requires=...)``), a requirement naming no trait fails when the check is
registered, and a check registered outside the kit with an ``applies=`` predicate still works.
"""

from __future__ import annotations

import dataclasses

import pytest

from offload_ref.contracts.checks import _traits
from offload_ref.contracts.checks._traits import traits_of
from offload_ref.contracts.registry import CATALOGUE, NotApplicable, check
from offload_ref.contracts.runner import load_catalogue, plan_cases
from offload_ref.contracts.spec import load_object
from offload_ref.contracts.traits import (TRAITS, Missing, PipelineTraits, needs_of, parse,
                                          unmet)
from offload_ref.fixtures import get_spec

_BUILDS: list[int] = []


def _counted(name: str, base: str = "flux2") -> object:
    """A copy of fixture ``base`` named ``name`` whose factory counts its builds in _BUILDS."""
    spec = get_spec(base)
    factory = load_object(spec.factory)

    def build(seed: int = 0):
        _BUILDS.append(seed)
        return factory(seed=seed)

    return dataclasses.replace(spec, name=name, factory=build)


@pytest.fixture
def registered():
    """Remove the checks a test registers from the catalogue afterwards."""
    load_catalogue()
    before = dict(CATALOGUE)
    yield
    for key in set(CATALOGUE) - set(before):
        del CATALOGUE[key]
    CATALOGUE.update(before)


# -- the record ----------------------------------------------------------------------------------


def test_the_record_is_frozen_and_has_a_value_for_every_trait() -> None:
    record = traits_of(get_spec("flux2"), "layer_wise")
    assert isinstance(record, PipelineTraits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.has_vae = False  # type: ignore[misc]
    assert record.probed == frozenset(TRAITS)
    assert not record.errors
    assert record.spec == "flux2" and record.strategy == "layer_wise"
    assert isinstance(record.dit_blocks, int) and record.dit_path


def test_the_record_is_computed_once_per_spec_and_strategy() -> None:
    spec = _counted("traits_counted")
    _BUILDS.clear()
    static = {"delegates_model_level", "split_model", "reasoner_and_generator", "has_vae",
              "dit_path", "dit_blocks", "encoder_block_list", "shares_storage"}
    first = traits_of(spec, "model_level", static)
    assert len(_BUILDS) == 1, "the facts read from the pipeline as built share one build"
    assert traits_of(spec, "model_level", static) is first
    full = traits_of(spec, "model_level")  # the rest (the ring and the skip experiment) once
    builds = len(_BUILDS)
    assert {n: getattr(full, n) for n in static} == {n: getattr(first, n) for n in static}
    assert traits_of(spec, "model_level") is full
    assert traits_of(spec, "model_level", {"has_vae"}) is full
    plan_cases([spec])  # planning the whole catalogue asks the same record again
    assert traits_of(spec, "model_level") is full
    after_plan = len(_BUILDS)
    plan_cases([spec])
    assert len(_BUILDS) == after_plan, "a second plan probes nothing again"
    assert builds >= 1
    assert traits_of(spec, "layer_wise") is not full  # another strategy, another record
    assert traits_of(spec, "layer_wise").strategy == "layer_wise"


def test_planning_one_check_probes_only_what_it_requires() -> None:
    spec = _counted("traits_one_check")
    plan_cases([spec], checks=["check_plan_block_attrs_beat_class_attributes"])
    record = _traits._RECORDS[(spec, "layer_wise")]
    assert record.probed == {"dit_blocks", "dit_path"}
    assert record.skippable_block is None  # the skip experiment (a generation) did not run


def test_a_probe_that_raises_fails_only_the_checks_requiring_its_trait(monkeypatch) -> None:
    def broken(pipeline):
        raise RuntimeError("storage probe exploded")

    monkeypatch.setattr(_traits, "storage_groups", broken)
    spec = dataclasses.replace(get_spec("flux2"), name="traits_broken_probe")
    planned = plan_cases([spec], include_global=False, strategies=["model_level"], checks=[
        "check_shared_storage_stays_shared_while_enabled",
        "check_model_level_keeps_one_group_resident"])
    by_check = {c.info.id: c for c in planned}
    shared = by_check["check_shared_storage_stays_shared_while_enabled"]
    assert shared.planning_error == (
        "deciding whether check_shared_storage_stays_shared_while_enabled applies to "
        "traits_broken_probe (it needs tensors that share storage (a tied weight, views or "
        "aliases of one weight)) raised RuntimeError: storage probe exploded")
    resident = by_check["check_model_level_keeps_one_group_resident"]
    assert resident.planning_error is None and resident.not_applicable is None


# -- requirements and their reasons ---------------------------------------------------------------


def test_the_kit_checks_name_requirements_and_no_predicate() -> None:
    catalogue = load_catalogue()
    kit = [i for i in catalogue.values() if i.func.__module__.startswith(
        "offload_ref.contracts.checks.")]
    assert kit and all(i.applies is None for i in kit)
    assert all(i.needs for i in kit if i.requires)
    named = {parse(r).trait for i in kit for r in i.requires}
    assert named <= set(TRAITS)


def test_reasons_and_needs_read_as_before() -> None:
    record = traits_of(get_spec("wan22_i2v"), "layer_wise")
    assert record.dit_blocks == 2
    assert unmet(record, ("dit_blocks>=2",), needs_of(("dit_blocks>=2",))) is None
    assert unmet(record, ("dit_blocks>=3",), "x") == (
        "needs a DiT with 3 or more declared blocks; transformer has 2")
    assert needs_of(("dit_blocks>=2",)) == "a DiT with two or more declared blocks"
    assert needs_of(("not delegates_model_level",)) == (
        "a pipeline that does not delegate model level (SupportsModelCpuOffload)")
    assert needs_of(("importable", "streams_blocks")) == (
        "an importable factory and inputs (module:attr, so that spawned ranks can rebuild the "
        "pipeline) and a DiT ring streaming two or more blocks")
    cosmos = traits_of(get_spec("cosmos3"), "model_level")
    assert cosmos.delegates_model_level and cosmos.split_model
    assert unmet(cosmos, ("not delegates_model_level",), "a pipeline that does not delegate "
                 "model level to its own component groups") == (
        "needs a pipeline that does not delegate model level to its own component groups")
    assert not traits_of(get_spec("cosmos3"), "layer_wise").delegates_model_level


def test_a_missing_trait_gives_its_probe_s_reason() -> None:
    callable_spec = dataclasses.replace(get_spec("flux2"), name="traits_callable",
                                        factory=load_object(get_spec("flux2").factory))
    record = traits_of(callable_spec, "distributed_layer_wise", {"importable"})
    assert isinstance(record.importable, Missing) and not record.importable
    assert unmet(record, ("importable",), "anything") == (
        "needs the factory and inputs as importable module:attr strings (spawned ranks "
        "rebuild the pipeline from them), not callables")
    assert unmet(record, ("not importable",), "anything") is None


def test_a_trait_not_probed_is_never_read_as_false() -> None:
    spec = dataclasses.replace(get_spec("flux2"), name="traits_partial")
    record = traits_of(spec, "layer_wise", {"has_vae"})
    with pytest.raises(ValueError, match="not probed"):
        unmet(record, ("shares_storage",), "x")


# -- registration --------------------------------------------------------------------------------


def test_requiring_an_unknown_trait_fails_at_registration(registered) -> None:
    with pytest.raises(ValueError) as err:
        @check("F.1", requires=("has_vea",))
        def check_kit_test_unknown_trait(case) -> None:
            pass

    message = str(err.value)
    assert message.startswith("check_kit_test_unknown_trait: requirement 'has_vea': unknown "
                              "trait 'has_vea'"), message
    assert "did you mean 'has_vae'?" in message and "dit_blocks" in message, message
    assert "check_kit_test_unknown_trait" not in CATALOGUE


@pytest.mark.parametrize("requires, mentions", [
    (("has_vae>=2",), "'>=' takes a count trait"),
    (("not dit_blocks>=2",), "'>=' takes a count trait"),
    (("has vae",), "expected 'trait', 'not trait' or 'trait>=N'"),
    ("has_vae", "expected a tuple of requirements"),
])
def test_malformed_requirements_fail_at_registration(registered, requires, mentions) -> None:
    with pytest.raises(ValueError, match=mentions):
        @check("F.1", requires=requires)
        def check_kit_test_malformed(case) -> None:
            pass

    assert "check_kit_test_malformed" not in CATALOGUE


def test_a_global_check_cannot_require_traits(registered) -> None:
    with pytest.raises(ValueError, match="requires= is for spec checks"):
        @check("G", scope="global", requires=("has_vae",))
        def check_kit_test_global_requires(case) -> None:
            pass


def test_a_check_with_requires_gets_the_traits_needs_text(registered) -> None:
    @check("F.1", strategies=("model_level",), requires=("has_vae", "not delegates_model_level"))
    def check_kit_test_requires(case) -> None:
        pass

    info = CATALOGUE["check_kit_test_requires"]
    assert info.requires == ("has_vae", "not delegates_model_level")
    assert info.needs == ("a declared VAE and a pipeline that does not delegate model level "
                          "(SupportsModelCpuOffload)")


# -- applies=, kept for checks registered outside the kit ----------------------------------------


def test_an_outside_check_with_applies_still_works(registered) -> None:
    asked = []

    def has_three_heads(spec, strategy):
        asked.append((spec.name, strategy))
        if spec.name == "flux2":
            return NotApplicable("needs three heads; flux2 has one")
        return spec.name == "qwen_image"

    @check("F.1", strategies=("layer_wise",), applies=has_three_heads,
           needs="a pipeline with three heads")
    def check_kit_test_outside_applies(case) -> None:
        pass

    info = CATALOGUE["check_kit_test_outside_applies"]
    assert info.applies is has_three_heads and info.requires == ()
    specs = [get_spec("flux2"), get_spec("qwen_image"), get_spec("sd3")]
    planned = {c.spec.name: c.not_applicable
               for c in plan_cases(specs, checks=[info.id], include_global=False)}
    assert planned == {"flux2": "needs three heads; flux2 has one", "qwen_image": None,
                       "sd3": "needs a pipeline with three heads"}
    assert sorted(asked) == [("flux2", "layer_wise"), ("qwen_image", "layer_wise"),
                             ("sd3", "layer_wise")]


def test_an_applies_check_must_still_say_what_it_needs() -> None:
    with pytest.raises(ValueError, match=r"needs=\.\.\."):
        check("F.1", applies=lambda spec, strategy: True)


def test_requires_is_judged_before_applies(registered) -> None:
    asked = []

    def predicate(spec, strategy):
        asked.append(spec.name)
        return True

    @check("F.1", strategies=("layer_wise",), requires=("dit_blocks>=3",), applies=predicate,
           needs="three blocks and the predicate")
    def check_kit_test_both(case) -> None:
        pass

    planned = {c.spec.name: c.not_applicable for c in plan_cases(
        [get_spec("wan22_i2v"), get_spec("flux2")], checks=["check_kit_test_both"],
        include_global=False)}
    assert planned["wan22_i2v"] == "needs a DiT with 3 or more declared blocks; transformer has 2"
    assert planned["flux2"] is None
    assert asked == ["flux2"]


def test_a_run_resolves_each_spec_and_strategy_once_before_its_cases(monkeypatch) -> None:
    """Note [One plan per run] (contracts/preflight.py): the preflight and the traits share one
    resolution of each (spec, strategy); the cases resolve their own pipelines afterwards."""
    from collections import Counter

    from offload_ref.contracts.runner import RunObserver, run_checks
    from offload_ref.plan import resolver

    resolved: Counter[str] = Counter()
    real = resolver.Resolver.resolve

    def counted(self):
        resolved[self.config.strategy.value] += 1
        return real(self)

    monkeypatch.setattr(resolver.Resolver, "resolve", counted)

    class Stop(Exception):
        pass

    class AtPlanned(RunObserver):
        def planned(self, ids):
            self.ids, self.counts = list(ids), dict(resolved)
            raise Stop  # planning is what this test counts: no case runs

    spec = _counted("resolved_once")
    observer = AtPlanned()
    with pytest.raises(Stop):
        run_checks([spec], include_global=False, observer=observer)
    assert len(observer.ids) > 100  # the whole catalogue was planned: every trait probed
    assert observer.counts == {s: 1 for s in spec.strategies}, observer.counts
