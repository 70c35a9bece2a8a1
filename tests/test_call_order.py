"""The layerwise ring's call-order predictor."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from offload_ref.backends.predictor import CallOrderPredictor


def _misses(predictor: CallOrderPredictor, calls: list[int]) -> list[int]:
    """Indices i where the prediction made after calls[i-1] was not calls[i]."""
    misses, expected = [], None
    for i, k in enumerate(calls):
        if expected is not None and expected != k:
            misses.append(i)
        predictor.observe(k)
        expected = predictor.predict(k)
    return misses


def test_plain_passes_need_no_history() -> None:
    assert _misses(CallOrderPredictor(4), [0, 1, 2, 3] * 5) == []


def test_skip_layer_guidance_is_learned_after_one_step() -> None:
    step = [0, 1, 2, 0, 1, 2, 0, 2]
    misses = _misses(CallOrderPredictor(3), step * 6)
    assert all(i < 2 * len(step) for i in misses), misses


def test_a_new_order_is_relearned() -> None:
    calls = [0, 1, 2, 3] * 4 + [0, 2, 3] * 4
    misses = _misses(CallOrderPredictor(4), calls)
    assert all(i < 16 + 2 * 3 for i in misses), misses


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(3, 6))
def test_any_periodic_order_is_exact_from_its_third_period(period: list[int], reps: int) -> None:
    calls = period * reps
    misses = _misses(CallOrderPredictor(6, window=32), calls)
    assert all(i < 2 * len(period) + 1 for i in misses), (period, misses)


def test_history_is_bounded_and_prediction_survives_trimming() -> None:
    predictor = CallOrderPredictor(3, history=64)
    step = [0, 1, 2, 0, 2]
    misses = _misses(predictor, step * 100)
    assert len(predictor.history) <= 64 + 1
    assert all(i < 3 * len(step) for i in misses), misses
