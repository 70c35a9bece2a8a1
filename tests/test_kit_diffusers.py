"""The kit on a real diffusers ``DiffusionPipeline`` (plain object, numpy output), as
docs/model-authors.md shows it: every layerwise case passes, and model level, which this
pipeline cannot support (no encoder to swap against), is rejected with the fix named."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from offload_ref import OffloadConfig, get_offload_backend  # noqa: E402
from offload_ref.contracts.runner import run_checks  # noqa: E402
from offload_ref.platform import CpuPlatform  # noqa: E402

from diffusers_pipelines import DIT_SPEC, build_dit, dit_inputs  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_whole_kit_passes_on_a_diffusers_dit_pipeline_under_layerwise() -> None:
    results = run_checks([DIT_SPEC], include_global=False)
    assert len(results) > 30
    bad = [(str(r.id), r.outcome, r.message[:300]) for r in results if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("prefetch_race", [True, False])
def test_diffusers_dit_layerwise_is_bitwise_with_the_race_amplifier(prefetch_race) -> None:
    reference = build_dit()(**dit_inputs())["images"]
    pipe = build_dit()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise", components=("dit",)),
                                  platform=CpuPlatform(race_amplifier=prefetch_race))
    backend.enable(pipe)
    try:
        for _ in range(2):
            with torch.inference_mode():
                out = pipe(**dit_inputs())["images"]
            assert (torch.from_numpy(out) == torch.from_numpy(reference)).all()
    finally:
        backend.disable()


def test_model_level_on_a_pipeline_without_encoder_names_the_fix() -> None:
    pipe = build_dit()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"),
                                  platform=CpuPlatform(race_amplifier=False))
    with pytest.raises(ValueError, match="_encoder_modules"):
        backend.enable(pipe)


_MISUSE_CHECKS = {
    "data_edits_unguarded_layerwise": "check_edits_through_data_are_exact_or_refused",
    "state_dict_returns_placeholders": "check_state_dict_while_enabled_returns_true_weights",
    "edit_weights_in_place_layerwise": "check_edit_weights_round_trip_takes_effect_exactly",
    "backward_not_refused": "check_backward_is_exact_or_refused_at_forward",
    "concurrent_calls_unguarded": "check_second_thread_gets_a_clear_error_or_exact_output",
    "copies_not_refused": "check_copies_of_an_enabled_pipeline_are_refused_or_exact",
    "reads_between_forwards_allowed": "check_reads_through_data_are_true_or_refused",
}


def test_the_misuse_checks_run_on_a_plain_object_pipeline_and_catch_their_mutants() -> None:
    """§J.3-§J.6 and §J.8 see a diffusers pipeline through its nn.Module attributes: they run
    (not "not applicable") and each fails against the mutant it is meant to catch."""
    import warnings

    from offload_ref.contracts.mutants import MUTANTS

    checks = list(_MISUSE_CHECKS.values())
    clean = run_checks([DIT_SPEC], include_global=False, checks=checks, strategies=["layer_wise"])
    assert sorted((str(r.id).split("-")[0], r.outcome) for r in clean) == sorted(
        (c, "passed") for c in checks)
    for name, check in _MISUSE_CHECKS.items():
        mutant = next(m for m in MUTANTS if m.name == name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = run_checks([DIT_SPEC], include_global=False, checks=checks,
                                 strategies=["layer_wise"], impl=mutant.impl)
        failed = {str(r.id).split("-")[0] for r in results if not r.ok}
        assert check in failed and failed <= set(mutant.kills), (name, failed)
