"""A failed parity check says why (issue 11 item 10): the first module whose output diverged from
the reference, the first differing elements by index, and -- for NaN under layerwise -- the
tensors read while their block was not loaded.  A passing check runs no diagnosis at all."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
from offload_ref.contracts.mutants import backend_with, with_ring
from offload_ref.contracts.runner import run_checks
from offload_ref.fixtures import get_spec

BITWISE = "check_offloaded_output_matches_reference_bitwise"
BROKEN = 2  # the index in the ring of the block the broken backends get wrong


def _run(ring: type[BlockRing] | None, check: str = BITWISE, pipeline: str = "flux2"):
    impl = DEFAULT_IMPLEMENTATION
    if ring is not None:
        impl = impl.replace(name=ring.__name__, make_backend=backend_with(
            LayerWiseOffloadBackend=with_ring(ring)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [result] = run_checks([get_spec(pipeline)], checks=[check], strategies=["layer_wise"],
                              impl=impl, include_global=False)
    return result


class _CorruptsOneBlock(BlockRing):
    """Block BROKEN's host master is off by one in every element: whenever it streams in, it
    computes with wrong weights (finite ones)."""

    def prepare(self, txn, pipeline):
        super().prepare(txn, pipeline)
        for flat in self.groups[BROKEN].master.flats.values():
            if flat.dtype.is_floating_point and flat.numel():
                flat.add_(1)


class _LeavesOneBlockOnPlaceholders(BlockRing):
    """Block BROKEN is loaded into its slot but its tensors stay bound to NaN placeholders, so
    its modules read NaN stand-ins.  The stand-ins are the ring's placeholders copied to the
    device: the ring's own are host tensors, which a forward on the device cannot read at all
    where host and device differ (torch's same-device error, not NaN)."""

    def before(self, k, frame=None):
        super().before(k, frame)
        if k == BROKEN:
            self._rebind(k, [v.to(self.platform.device) for v in self._placeholder_views(k)])


def _block_path(pipeline: str = "flux2") -> str:
    """The dotted path of the block at index BROKEN of the pipeline's (one) ring."""
    from offload_ref.config import OffloadConfig, OffloadStrategy
    from offload_ref.plan import resolve_offload_plan, selectable_components

    pipe = get_spec(pipeline).build()
    strategy = OffloadStrategy("layer_wise")
    plan = resolve_offload_plan(pipe, OffloadConfig(
        strategy=strategy, components=selectable_components(pipe, strategy)))
    [stack] = [s for c in plan.components for s in c.rings]
    return stack.block_paths[BROKEN]


def test_corrupted_block_is_named_as_the_first_diverging_module() -> None:
    result = _run(_CorruptsOneBlock)
    assert result.outcome == "failed", result.message
    block = _block_path()
    m = re.search(r"first diverging module: (\S+) \((\w+), call 1\)", result.message)
    assert m, result.message
    assert m.group(1).startswith(block + "."), (block, result.message)
    assert "its inputs were equal to the reference's" in result.message
    # the first differing elements, by multi-dimensional index, with got / want values
    assert re.search(r"first at \[\d+, \d+(, \d+)*\] got -?[\d.e+-]+, want -?[\d.e+-]+",
                     result.message), result.message
    assert "elements differ, max abs diff" in result.message
    assert "NaN" not in result.message  # finite wrong weights: no tensor is blamed


def test_nan_names_the_tensor_read_outside_its_block() -> None:
    result = _run(_LeavesOneBlockOnPlaceholders)
    assert result.outcome == "failed", result.message
    block = _block_path()
    m = re.search(r"(" + re.escape(block) + r"\.\S+) was read by (\S+) \(call \d+\) at \S+ in "
                  r"\w+ while it was a placeholder: block " + re.escape(block) + r" was not loaded",
                  result.message)
    assert m, result.message
    tensor, reader = m.groups()
    assert tensor.endswith((".weight", ".bias")) and tensor.startswith(reader + "."), m.groups()
    assert re.search(r"first diverging module: " + re.escape(block) + r"\.", result.message)
    assert "got nan, want" in result.message


def test_a_passing_check_runs_no_diagnosis(monkeypatch) -> None:
    from offload_ref.contracts import case as case_module

    calls = []
    real = case_module.diagnose
    monkeypatch.setattr(case_module, "diagnose", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = _run(None)
    assert result.outcome == "passed", result.message
    assert calls == [], "the diagnosis ran although the outputs matched"
    # the broken backend does reach it, through the same path
    failed = _run(_CorruptsOneBlock)
    assert failed.outcome == "failed" and calls == [1], failed.message


def test_a_difference_the_rerun_does_not_reproduce_is_reported_as_such() -> None:
    from offload_ref.config import OffloadStrategy
    from offload_ref.contracts.case import CheckCase
    from offload_ref.contracts.registry import CheckFailure

    case = CheckCase(get_spec("flux2"), OffloadStrategy("layer_wise"))
    try:
        reference = case.reference()
        pipeline = case.build()
        backend = case.backend()
        backend.enable(pipeline)
        got = case.run(pipeline)
        with torch.inference_mode():
            got.view(-1)[3] += 1  # a one-off difference: the rerun is exact
        with pytest.raises(CheckFailure) as failure:
            case.compare("run", got, reference)
        backend.disable()
    finally:
        case.close()
    message = str(failure.value)
    assert "1 of 192 elements differ" in message and "first at [0, 0, 0, 3] got" in message
    assert "the difference did not reproduce" in message and "first diverging" not in message


def test_a_module_called_in_one_run_only_is_named() -> None:
    from offload_ref.contracts.diagnosis import _Call, _first_divergence

    x = [("", torch.zeros(2))]
    want = [_Call("enc", 1, "Linear", x, x), _Call("dit", 1, "DiT", x, x)]
    got = [_Call("enc", 1, "Linear", x, x), _Call("enc", 2, "Linear", x, x),
           _Call("dit", 1, "DiT", x, x)]
    text, first = _first_divergence(got, want)
    assert first is None
    assert text.startswith("enc (Linear) was called 2 time(s) or more under offloading but 1 "
                           "time(s) in the reference"), text
    text, first = _first_divergence(want, got)
    assert text.startswith("enc (Linear) was called 2 time(s) or more in the reference but 1 "
                           "time(s) under offloading"), text
