"""A resident head under plain layerwise offload: ``OffloadPlan.layerwise_resident_layers``
keeps a DiT's first k blocks on the device (placed once at enable, never hooked) while the rest
stream; ``strategy="auto"`` fills a budget between layerwise's and model level's peaks with the
largest head whose predicted peak fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.cli import main
from offload_ref.fixtures import get_spec
from offload_ref.plan import (
    OffloadPlan,
    OffloadTopologyError,
    auto_candidates,
    head_candidates,
    resolve_offload_plan,
)
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

LAYER = OffloadConfig(strategy="layer_wise", components=("dit",))


def _qwen(head: dict | None = None):
    """qwen_image (four DiT blocks), with an instance-level plan declaring ``head``."""
    pipeline = get_spec("qwen_image").build()
    if head is not None:
        plan = dataclasses.replace(type(pipeline)._offload_plan, layerwise_resident_layers=head)
        pipeline.__dict__["_offload_plan"] = plan
    return pipeline


def _reference():
    spec = get_spec("qwen_image")
    with torch.inference_mode():
        return resident(spec.build())(**spec.make_inputs())


def _generate(pipeline):
    with torch.inference_mode():
        return pipeline(**get_spec("qwen_image").make_inputs())


def _pointers(blocks) -> list[int]:
    return [t.data_ptr() for b in blocks for t in [*b.parameters(), *b.buffers()]]


@pytest.mark.parametrize("k", [1, 2])
def test_declared_head_is_placed_once_unhooked_and_predicted(k) -> None:
    want = _reference()
    pipeline = _qwen({"transformer": k})
    blocks = pipeline.transformer.transformer_blocks
    platform = CpuPlatform()
    backend = get_offload_backend(LAYER, platform=platform)
    try:
        for _cycle in range(2):
            backend.enable(pipeline)
            (stack,) = backend.plan.rings
            assert stack.resident_head == k
            assert f"resident head {k}" in backend.plan.describe()
            head, streamed = list(blocks)[:k], list(blocks)[k:]
            assert all(platform.is_resident(t) for b in head for t in b.parameters())
            assert not any(b._forward_pre_hooks or b._forward_hooks for b in head)
            assert all(b._forward_pre_hooks for b in streamed)
            pointers = _pointers(head)
            for _ in range(2):
                assert torch.equal(_generate(pipeline), want)
                assert _pointers(head) == pointers
                # the ring wraps from the last block to the first streamed one
                assert backend.materialized_blocks() == {stack.container_paths[0]: [0]}
                assert backend.rings[0].blocks[0] is blocks[k]
            stats = backend.stats()
            assert stats.peak_device_bytes == backend.plan.predicted_device_bytes()
            backend.disable()
    finally:
        backend.disable()
        platform.close()
    assert platform.memory_allocated() == 0


def test_the_head_counts_in_the_prediction() -> None:
    preds = [resolve_offload_plan(_qwen({"transformer": k}), LAYER).predicted_device_bytes()
             for k in (0, 1, 2)]
    block = preds[1] - preds[0]
    assert block > 0 and preds[2] - preds[1] == block  # four equal blocks: one block each


@pytest.mark.parametrize("value,exc,mentions", [
    (-1, ValueError, "must be an int >= 0"),
    (True, ValueError, "must be an int >= 0"),
    (1.5, ValueError, "must be an int >= 0"),
    ("2", ValueError, "must be an int >= 0"),
])
def test_bad_head_values_are_refused_at_declaration(value, exc, mentions) -> None:
    with pytest.raises(exc) as info:
        OffloadPlan(layerwise_resident_layers={"transformer": value})
    assert "OffloadPlan.layerwise_resident_layers['transformer']" in str(info.value)
    assert mentions in str(info.value)
    with pytest.raises(TypeError, match="layerwise_resident_layers"):
        OffloadPlan(layerwise_resident_layers=[("transformer", 1)])


@pytest.mark.parametrize("head,mentions", [
    ({"transformer": 3}, ("layerwise_resident_layers['transformer'] = 3", "leaves 1 of the 4",
                          "at most 2")),
    ({"transformer": 9}, ("leaves 0 of the 4", "at most 2")),
    ({"transfomer": 1}, ("layerwise_resident_layers names 'transfomer'",
                         "did you mean 'transformer'")),
    ({"text_encoder": 1}, ("layerwise_resident_layers names 'text_encoder'", "no DiT")),
])
def test_bad_heads_are_refused_before_any_change(head, mentions) -> None:
    pipeline = _qwen(head)
    before = {n: (t.data_ptr(), t.device) for n, t in pipeline.transformer.state_dict().items()}
    platform = CpuPlatform()
    backend = get_offload_backend(LAYER, platform=platform)
    with pytest.raises(OffloadTopologyError) as info:
        backend.enable(pipeline)
    for text in mentions:
        assert text in str(info.value)
    assert not backend.is_enabled() and platform.memory_allocated() == 0
    after = {n: (t.data_ptr(), t.device) for n, t in pipeline.transformer.state_dict().items()}
    assert after == before
    assert not any(m._forward_pre_hooks for m in pipeline.transformer.modules())


def test_model_level_ignores_a_valid_head_and_distributed_keeps_its_own_option() -> None:
    pipeline = _qwen({"transformer": 1})
    plan = resolve_offload_plan(pipeline, OffloadConfig(strategy="model_level"))
    assert plan.skip_reason is None and not plan.rings
    dlo = OffloadConfig(strategy="distributed_layer_wise", components=("dit",))
    assert [s.resident_head for s in resolve_offload_plan(pipeline, dlo).rings] == [0]


# -- auto ------------------------------------------------------------------------------------


def _auto(budget: int) -> OffloadConfig:
    return OffloadConfig(strategy="auto", device_budget_bytes=budget)


def test_auto_fills_the_budget_with_the_largest_head_that_fits() -> None:
    pipeline = _qwen()
    cands = {c.name: c for c in auto_candidates(pipeline)}
    heads = head_candidates(pipeline, cands["layer_wise"])
    assert [dict(h.heads)["transformer"] for h in heads] == [0, 1, 2]
    assert heads[0].predicted == cands["layer_wise"].predicted
    assert heads[0].predicted < heads[1].predicted < cands["model_level"].predicted
    want = _reference()
    for budget, k in [(heads[1].predicted - 1, 0), (heads[1].predicted, 1),
                      (cands["model_level"].predicted - 1, 1)]:
        pipeline = _qwen({"transformer": 2})  # auto weighs its own heads, not the declaration
        platform = CpuPlatform()
        backend = get_offload_backend(_auto(budget), platform=platform)
        try:
            backend.enable(pipeline)
            assert dict(backend.chosen.heads) == {"transformer": k}
            assert [s.resident_head for s in backend.delegate.plan.rings] == [k]
            assert torch.equal(_generate(pipeline), want)
            stats = backend.stats()
            assert stats.peak_device_bytes <= budget
            assert stats.peak_device_bytes == backend.plan.predicted_device_bytes()
        finally:
            backend.disable()
            platform.close()


def test_cli_plan_shows_the_head_auto_chose(capsys) -> None:
    pipeline = _qwen()
    cands = {c.name: c for c in auto_candidates(pipeline)}
    budget = cands["model_level"].predicted - 1
    assert main(["plan", "--pipeline", "qwen_image", "--strategy", "auto",
                 "--device-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "auto: picked layer_wise (dit; resident head transformer: 1)" in out
    assert "resident head: 1 leading block(s)" in out and "a head of 2 would need" in out
    assert "resident head 1, transfer rank-local" in out
