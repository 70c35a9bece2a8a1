"""The kit turns a diffusers pipeline's tqdm bars off (issue 36): a spec whose factory leaves them
on would otherwise print a bar per generation, hundreds per ``offload-ref check``."""

from __future__ import annotations

import pytest

from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.runner import run_checks

pytest.importorskip("diffusers")


def _build_with_bars(seed: int = 0):  # noqa: ANN202
    from offload_ref.fixtures.diffusers_dit import build_dit

    pipeline = build_dit(seed)
    pipeline.set_progress_bar_config(disable=False)  # as a stock pipeline comes
    return pipeline


def _inputs(seed: int = 0) -> dict:
    from offload_ref.fixtures.diffusers_dit import dit_inputs

    return dit_inputs(seed)


SPEC = PipelineSpec(name="bars", factory=_build_with_bars, inputs=_inputs,
                    strategies=("layer_wise",))


def test_a_built_pipeline_has_its_bars_off() -> None:
    assert _build_with_bars()._progress_bar_config == {"disable": False}
    assert SPEC.build()._progress_bar_config["disable"] is True


def test_a_kit_run_draws_no_bar(capfd) -> None:
    results = run_checks([SPEC], checks=["check_offloaded_output_matches_reference_bitwise"],
                         strategies=["layer_wise"], include_global=False)
    assert results and all(r.ok for r in results), results
    err = capfd.readouterr().err
    assert "it/s" not in err and "s/it" not in err, err[-2000:]


def test_a_pipeline_without_the_setter_is_left_as_built() -> None:
    spec = PipelineSpec(name="plain", factory=lambda seed=0: object(), inputs=lambda seed=0: {})
    assert type(spec.build()) is object
