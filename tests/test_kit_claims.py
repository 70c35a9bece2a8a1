"""Case generation honours what a spec claims, and checks that need a shape the pipeline lacks
do not apply (issue 11 items 4 and 7)."""

from __future__ import annotations

import dataclasses

from torch import nn

from offload_ref.contracts.runner import iter_cases, load_catalogue, run_checks
from offload_ref.fixtures import get_spec
from offload_ref.fixtures.qwen_image import build_pipeline as _build_qwen_image


def _with_blocks(count: int):
    def factory(seed: int = 0) -> nn.Module:
        pipeline = _build_qwen_image(seed)
        blocks = list(pipeline.transformer.transformer_blocks)[:count]
        pipeline.transformer.transformer_blocks = nn.ModuleList(blocks)
        return pipeline

    return factory


def _author_spec(name: str, blocks: int, strategies: tuple[str, ...]):
    return dataclasses.replace(get_spec("qwen_image"), name=name, factory=_with_blocks(blocks),
                               strategies=strategies)


def _plan_checks() -> list[str]:
    return sorted(i.id for i in load_catalogue().values()
                  if i.scope == "spec" and i.section.startswith("A"))


def test_a_model_level_only_spec_gets_no_layer_cases_and_passes_its_resolution_cases() -> None:
    spec = _author_spec("one_block_author", 1, ("model_level",))
    cases = iter_cases([spec], checks=_plan_checks(), include_global=False)
    strategies = {strategy for _, _, strategy in cases}
    assert strategies == {"model_level"}, sorted(str(s) for s in strategies)
    results = run_checks([spec], checks=_plan_checks(), include_global=False)
    assert results
    bad = [(str(r.id), r.outcome, r.message) for r in results if not r.ok]
    assert not bad, bad


def test_only_claimed_strategies_are_generated_for_any_check() -> None:
    spec = _author_spec("layer_only_author", 4, ("layer_wise",))
    cases = iter_cases([spec], include_global=False)
    assert {strategy for _, _, strategy in cases} == {"layer_wise"}
