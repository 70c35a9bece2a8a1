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


_NEEDS_TWO_BLOCKS = ("check_block_claimed_by_two_components_is_rejected",
                     "check_plan_block_attrs_beat_class_attributes",
                     "check_resident_layers_leaving_one_streaming_block_are_rejected",
                     "check_tensors_aliasing_a_block_belong_to_its_ring")


def test_checks_that_need_two_blocks_do_not_apply_to_a_dit_with_none() -> None:
    spec = _author_spec("zero_block_author", 0, ("layer_wise", "distributed_layer_wise"))
    assert not iter_cases([spec], checks=_NEEDS_TWO_BLOCKS, include_global=False)
    # They still apply to the same pipeline with its four blocks.
    four = _author_spec("four_block_author", 4, ("layer_wise", "distributed_layer_wise"))
    assert {c.id for c, _, _ in iter_cases([four], checks=_NEEDS_TWO_BLOCKS)} == set(
        _NEEDS_TWO_BLOCKS)


def test_plan_checks_on_a_dit_with_no_blocks_neither_crash_nor_name_kit_helpers() -> None:
    spec = _author_spec("zero_block_author", 0, ("layer_wise", "distributed_layer_wise"))
    results = run_checks([spec], checks=_plan_checks(), include_global=False)
    assert results
    for r in results:
        for text in ("IndexError", "got -1", "_kit_plan_blocks", "kit_twin"):
            assert text not in r.message, (str(r.id), r.message)
    # The pipeline is still red: a layer strategy needs two blocks, and the resolver says so.
    assert any("at least two blocks" in r.message for r in results)
