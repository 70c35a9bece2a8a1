"""``OffloadConfig(strategy="auto", device_budget_bytes=N)``: the coarsest strategy whose predicted
peak device bytes fit the budget (none -> model level -> layerwise -> layerwise with encoder
rings), chosen before any mutation; the measured peak never exceeds the budget."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.backends import backend_of
from offload_ref.cli import main
from offload_ref.config import OffloadStrategy
from offload_ref.fixtures import get_spec
from offload_ref.plan import (
    AutoCandidate,
    OffloadTopologyError,
    auto_candidates,
    choose_auto,
    resolve_offload_plan,
)
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)


def _auto(budget: int, **kw) -> OffloadConfig:
    return OffloadConfig(strategy="auto", device_budget_bytes=budget, **kw)


# -- config ----------------------------------------------------------------------------------------


def test_auto_config_is_a_strategy_with_a_budget() -> None:
    config = _auto(1000)
    assert config.strategy is OffloadStrategy.AUTO
    assert config.device_budget_bytes == 1000
    assert config.components == ()
    assert config.enabled
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config) == hash(_auto(1000)) and config != _auto(1001)


@pytest.mark.parametrize("budget", [0, -5, 1.5, "100", True, None])
def test_auto_budget_must_be_a_positive_int(budget) -> None:
    with pytest.raises(ValueError, match="device_budget_bytes"):
        OffloadConfig(strategy="auto", device_budget_bytes=budget)


def test_budget_without_auto_is_rejected() -> None:
    with pytest.raises(ValueError, match="strategy='auto'"):
        OffloadConfig(strategy="layer_wise", device_budget_bytes=1000)


def test_auto_rejects_what_it_chooses_itself() -> None:
    with pytest.raises(ValueError, match="components"):
        _auto(1000, components=("dit",))
    with pytest.raises(ValueError, match="world_size"):
        _auto(1000, world_size=2)


def test_compact_mapping_mode_auto() -> None:
    config = OffloadConfig.from_mapping({"mode": "auto", "device_budget_bytes": 4096})
    assert config == _auto(4096)
    config = OffloadConfig.from_mapping({"mode": "auto", "device_budget_bytes": 4096,
                                         "pin_memory": False})
    assert config.pin_memory is False
    od = OffloadConfig.from_od_config(
        {"diffusion_offload_config": {"mode": "auto", "device_budget_bytes": 4096}})
    assert od == _auto(4096)


@pytest.mark.parametrize("mapping,exc,mentions", [
    ({"mode": "auto"}, ValueError, "device_budget_bytes"),
    ({"mode": "auto", "device_budget_bytes": 0}, ValueError, "device_budget_bytes"),
    ({"mode": "auto", "device_budget_bytes": "1"}, ValueError, "device_budget_bytes"),
    ({"mode": "auto", "device_budget_bytes": False}, ValueError, "device_budget_bytes"),
    ({"mode": "auto", "device_budget_bytes": 10, "components": ["dit"]}, ValueError,
     "components"),
    ({"mode": "layer", "components": ["dit"], "device_budget_bytes": 10}, ValueError,
     "mode='auto'"),
])
def test_compact_mapping_mode_auto_errors(mapping, exc, mentions) -> None:
    with pytest.raises(exc, match=mentions):
        OffloadConfig.from_mapping(mapping)


# -- the choice --------------------------------------------------------------------------------------


def _predictions(pipeline) -> dict[str, int]:
    return {c.name: c.predicted for c in auto_candidates(pipeline) if c.predicted is not None}


def test_candidates_are_ordered_coarsest_first() -> None:
    cands = auto_candidates(get_spec("wan22_t2v").build())
    assert [c.name for c in cands] == ["none", "model_level", "layer_wise",
                                      "layer_wise+encoders"]
    assert all(c.predicted is not None for c in cands)
    assert cands[3].config.components == ("dit", "text_encoder")
    flux = auto_candidates(get_spec("flux2").build())
    assert [c.name for c in flux] == ["none", "model_level", "layer_wise"]
    preds = [c.predicted for c in flux]
    assert preds == sorted(preds, reverse=True) and len(set(preds)) == 3


@pytest.mark.parametrize("index", [0, 1, 2])
def test_auto_picks_the_coarsest_strategy_that_fits(index) -> None:
    pipeline = get_spec("flux2").build()
    cands = auto_candidates(pipeline)
    for budget in (cands[index].predicted, cands[index].predicted + 1):
        plan = resolve_offload_plan(pipeline, _auto(budget))
        assert plan.auto is not None and plan.auto.chosen == cands[index].name
        assert plan.strategy.value == cands[index].config.strategy.value
        assert plan.predicted_device_bytes() == cands[index].predicted <= budget
        text = plan.describe()
        assert f"auto: picked {cands[index].name}" in text
        for c in cands:
            assert str(c.predicted) in text


def test_coarser_strategy_wins_even_when_a_finer_one_needs_more() -> None:
    # wan22: model level (one DiT at a time) needs less than layerwise (2-block rings save
    # nothing), so a budget at layerwise's prediction picks model level, the coarser one.
    pipeline = get_spec("wan22_t2v").build()
    preds = _predictions(pipeline)
    assert preds["model_level"] < preds["layer_wise"]
    plan = resolve_offload_plan(pipeline, _auto(preds["layer_wise"]))
    assert plan.auto.chosen == "model_level"


def test_choice_order_and_ties() -> None:
    def cand(name, predicted):
        return AutoCandidate(name, OffloadConfig(), predicted, "" if predicted else "no")

    cands = [cand("none", 100), cand("model_level", None), cand("layer_wise", 50),
             cand("layer_wise+encoders", 50)]
    assert choose_auto(cands, 100).name == "none"
    assert choose_auto(cands, 99).name == "layer_wise"  # a tie goes to the coarser
    cands[2] = cand("layer_wise", 70)
    assert choose_auto(cands, 69).name == "layer_wise+encoders"
    with pytest.raises(OffloadTopologyError, match="49.*50 bytes"):
        choose_auto(cands, 49)


def test_auto_rejects_a_budget_below_every_strategy() -> None:
    pipeline = get_spec("wan22_t2v").build()
    smallest = min(_predictions(pipeline).values())
    with pytest.raises(OffloadTopologyError) as info:
        resolve_offload_plan(pipeline, _auto(smallest - 1))
    message = str(info.value)
    assert str(smallest - 1) in message and str(smallest) in message
    assert "layer_wise+encoders" in message and "raise the budget" in message


def test_unachievable_strategies_are_skipped_with_their_reason() -> None:
    pipeline = get_spec("flux2").build()  # one encoder without blocks: no encoder rings
    names = {c.name: c for c in auto_candidates(pipeline)}
    assert "layer_wise+encoders" not in names or names["layer_wise+encoders"].predicted is None
    cosmos = {c.name: c for c in auto_candidates(get_spec("cosmos3").build())}
    assert cosmos["model_level"].predicted is None  # delegated: no prediction
    assert "delegated" in cosmos["model_level"].reason


# -- the backend ------------------------------------------------------------------------------------


BACKEND_CASES = [("flux2", 0), ("flux2", 1), ("flux2", 2), ("wan22_t2v", 1), ("wan22_t2v", 3)]


@pytest.mark.parametrize("name,index", BACKEND_CASES)
def test_auto_backend_measured_peak_stays_within_the_budget(name, index) -> None:
    spec = get_spec(name)
    reference = resident(spec.build())
    with torch.inference_mode():
        want = reference(**spec.make_inputs())
    pipeline = spec.build()
    platform = CpuPlatform()
    budget = auto_candidates(pipeline, alignment=platform.alignment)[index].predicted
    backend = get_offload_backend(_auto(budget), platform=platform)
    try:
        backend.enable(pipeline)
        assert backend_of(pipeline) is not None
        with torch.inference_mode():
            got = pipeline(**spec.make_inputs())
        stats = backend.stats()
        assert 0 < stats.peak_device_weight_bytes <= stats.peak_device_bytes <= budget
        assert stats.peak_device_bytes == backend.plan.predicted_device_bytes()
        assert torch.equal(got, want)
    finally:
        backend.disable()
        platform.close()
    assert backend_of(pipeline) is None
    assert backend.stats().peak_device_bytes == 0


def test_auto_backend_rejects_before_mutation() -> None:
    pipeline = get_spec("wan22_t2v").build()
    before = {n: (t.data_ptr(), t.device) for n, t in pipeline.state_dict().items()}
    smallest = min(_predictions(pipeline).values())
    backend = get_offload_backend(_auto(smallest - 1), platform=CpuPlatform())
    with pytest.raises(OffloadTopologyError):
        backend.enable(pipeline)
    assert backend_of(pipeline) is None and not backend.is_enabled()
    assert before == {n: (t.data_ptr(), t.device) for n, t in pipeline.state_dict().items()}


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_plan_shows_the_auto_choice(capsys) -> None:
    pipeline = get_spec("flux2").build()
    layer = {c.name: c.predicted for c in auto_candidates(pipeline)}["layer_wise"]
    assert main(["plan", "--pipeline", "flux2", "--strategy", "auto",
                 "--device-budget", str(layer)]) == 0
    out = capsys.readouterr().out
    assert "auto: picked layer_wise" in out and str(layer) in out


def test_cli_plan_exits_1_when_a_plan_is_rejected(capsys) -> None:
    """So that CI can gate on it (before: "rejected" and exit 0)."""
    assert main(["plan", "--pipeline", "flux2", "--strategy", "auto",
                 "--device-budget", "1"]) == 1
    captured = capsys.readouterr()
    assert "rejected: strategy='auto': no strategy fits" in captured.out
    assert "1 plan(s) rejected" in captured.err


def test_cli_device_budget_needs_auto(capsys) -> None:
    assert main(["plan", "--pipeline", "wan22_t2v", "--device-budget", "10"]) == 2
    assert main(["plan", "--pipeline", "wan22_t2v", "--strategy", "auto"]) == 2


def flux2_with_a_weightless_vae(seed: int = 0) -> nn.Module:
    """flux2 whose VAE holds no weights: under model level nothing is on the device until the
    first forward loads a component."""
    from offload_ref.fixtures.flux2 import build_pipeline

    pipeline = build_pipeline(seed)
    pipeline.vae = nn.Identity()
    return pipeline


def test_the_kit_auto_check_passes_a_pipeline_that_holds_nothing_before_its_first_forward() -> None:
    """An outside review: §A.8 failed this correct pipeline ("model_level held no device weight
    bytes") at a budget where it only enabled, without generating."""
    from offload_ref.contracts import PipelineSpec
    from offload_ref.contracts.runner import run_checks

    spec = PipelineSpec(name="flux2_weightless_vae",
                        factory="test_auto_mode:flux2_with_a_weightless_vae",
                        inputs="offload_ref.fixtures.flux2:make_inputs",
                        strategies=("model_level", "layer_wise"))
    results = run_checks([spec], checks=["check_auto_mode_measured_peak_never_exceeds_the_budget"],
                         include_global=False)
    assert results and all(r.ok for r in results), [(r.outcome, r.message[:300]) for r in results]


def test_a_rejected_budget_suggests_declaring_blocks_only_where_layerwise_did_not_resolve(
) -> None:
    """sd3 declares its DiT's blocks; its layerwise plan predicts more than model level's, so
    the fix is the budget, not a declaration it already has."""
    def cand(name, predicted):
        return AutoCandidate(name, OffloadConfig(), predicted, "" if predicted else "no")

    with pytest.raises(OffloadTopologyError) as declared:
        choose_auto([cand("none", 100), cand("model_level", 60), cand("layer_wise", 70)], 50)
    assert "declare the DiT's blocks" not in str(declared.value)
    assert "layerwise already streams the DiT's blocks and predicts 70 bytes" in str(declared.value)
    with pytest.raises(OffloadTopologyError) as undeclared:
        choose_auto([cand("none", 100), cand("model_level", 60), cand("layer_wise", None)], 50)
    assert "declare the DiT's blocks" in str(undeclared.value)
