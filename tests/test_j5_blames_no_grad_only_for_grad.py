"""J.5 (a generation in the pipeline's own grad mode) blames a missing ``torch.no_grad()`` only
for an exception that grad mode caused: raised at a forward entered with grad mode on, and
offload-ref's ``OffloadAutogradError`` or an exception the same generation under ``no_grad``
does not raise.  Any other exception (an offloader's defect) is the case's error, reported as it
is, without the no_grad advice -- on a pipeline that decorates ``__call__`` with
``@torch.no_grad()`` (grad mode is off where the exception is raised) and on one without it
(the exception is raised under ``no_grad`` too).  The refusal counts the trainable weights of the
component it came from, not the pipeline's."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import torch

from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.mutants.misuse import flux2_without_no_grad
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import SimpleOffloader, simple_offloader
from offload_ref.fixtures import get_spec

GRAD = "check_generation_in_the_pipelines_own_grad_mode_records_no_graph"
STRATEGIES = ("model_level", "layer_wise")
ADVICE = "decorate its __call__"


class _FullSlots(SimpleOffloader):
    """An offloader defect that has nothing to do with grad mode: every load is refused."""

    def _enter(self, unit: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError(f"FullSlots: no free slot to load {unit.name}")


def full_slots(device: torch.device, strategy: str) -> SimpleOffloader:
    return _FullSlots(device, strategy)


def _run(spec: PipelineSpec, impl: Any = None) -> dict[str, Any]:
    kwargs = {} if impl is None else {"impl": impl}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([spec], checks=[GRAD], strategies=STRATEGIES,
                             include_global=False, **kwargs)
    return {r.id.strategy: r for r in results}


def _unfrozen_with_no_grad(seed: int = 0) -> Any:
    """flux2 as built (its __call__ has @torch.no_grad()), with every weight requiring grad."""
    from offload_ref.fixtures.flux2 import build_pipeline

    return build_pipeline(seed).requires_grad_(True)


def test_an_offloader_error_under_a_pipeline_with_no_grad_is_no_missing_no_grad() -> None:
    spec = dataclasses.replace(get_spec("flux2"), factory=_unfrozen_with_no_grad)
    impl = offloader_implementation(full_slots, name="tests:full_slots", validate=False)
    for strategy, r in _run(spec, impl).items():
        assert r.outcome == "error", (strategy, r.outcome, r.message)
        assert "FullSlots: no free slot" in r.message
        assert ADVICE not in r.message and "gets this refusal" not in r.message, r.message
        assert "grad mode was off at" in r.message and "no missing torch.no_grad()" in r.message
        assert r.severity == "error"


def test_an_offloader_error_under_a_pipeline_without_no_grad_is_no_missing_no_grad() -> None:
    """Grad mode is on here, but the offloader raises under no_grad too: not a refusal of grad."""
    spec = dataclasses.replace(get_spec("flux2"), factory=flux2_without_no_grad)
    impl = offloader_implementation(full_slots, name="tests:full_slots", validate=False)
    for strategy, r in _run(spec, impl).items():
        assert r.outcome == "error", (strategy, r.outcome, r.message)
        assert ADVICE not in r.message, r.message
        assert "under torch.no_grad() raises too" in r.message, r.message


def test_a_foreign_refusal_of_grad_counts_the_components_own_weights() -> None:
    spec = dataclasses.replace(get_spec("flux2"), factory=flux2_without_no_grad)
    impl = offloader_implementation(simple_offloader, name="simple_offloader")
    pipeline = flux2_without_no_grad()
    for strategy, r in _run(spec, impl).items():
        assert r.outcome == "failed" and ADVICE in r.message, (strategy, r.message)
        component = "text_encoder" if strategy == "model_level" else "transformer"
        own = sum(1 for n, p in pipeline.named_parameters()
                  if p.requires_grad and n.startswith(component + "."))
        total = sum(1 for p in pipeline.parameters() if p.requires_grad)
        assert own < total
        found = re.search(r"; (\d+) of (\S+)'s weights require grad \(e\.g\. \['(\S+)'", r.message)
        assert found is not None, r.message
        assert (int(found.group(1)), found.group(2)) == (own, component), r.message
        assert found.group(3).startswith(component + "."), r.message
        assert "of its weights" not in r.message
