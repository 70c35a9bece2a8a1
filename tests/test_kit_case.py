"""What a :class:`CheckCase` builds: ``config()`` selects what the pipeline as built offers,
read off the case's first build instead of a build of its own."""

from __future__ import annotations

import dataclasses

from offload_ref.config import OffloadStrategy
from offload_ref.contracts.case import CheckCase
from offload_ref.fixtures import get_spec


def _counting_case(strategy: str) -> tuple[CheckCase, list[int]]:
    spec = get_spec("wan22_i2v")
    builds: list[int] = []

    def factory(seed: int = 0):
        builds.append(seed)
        return spec.build()

    return CheckCase(dataclasses.replace(spec, factory=factory), OffloadStrategy(strategy)), builds


def test_config_builds_no_pipeline_after_the_case_built_one() -> None:
    case, builds = _counting_case("model_level")
    case.build()
    assert case.config().components == ("dit", "text_encoder", "image_encoder")
    assert len(builds) == 1, builds


def test_config_selects_from_the_pipeline_as_built_whatever_the_check_did_to_it() -> None:
    """A check that changes its pipeline before asking for the config (plan checks remove or
    add components) gets the selection of the pipeline as the factory builds it, as when the
    config read a build of its own."""
    want = ("dit", "text_encoder", "image_encoder")
    for strategy in ("model_level", "layer_wise"):
        case, _ = _counting_case(strategy)
        pipeline = case.build()
        del pipeline.image_encoder  # selected from the pipeline as it is: the image encoder goes
        assert case.config().components == want, strategy
        unbuilt, _ = _counting_case(strategy)  # no build before: config builds its own
        assert unbuilt.config().components == want, strategy
