"""Issue 33, items 2 and 5: the kit runs a generation in the pipeline's own grad mode (a pipeline
that forgot ``@torch.no_grad()`` fails, naming the component and the cost), and it hands an
offloader device 1 (an offloader that ignores the device index fails, naming the tensor that
landed on device 0)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.case import CheckCase, kit_device, on_device_index
from offload_ref.contracts.mutants.misuse import flux2_without_no_grad
from offload_ref.contracts.mutants.protocol import ignores_the_device_index
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import SimpleOffloader, simple_offloader
from offload_ref.fixtures import get_spec

from device_helpers import SIMULATED  # noqa: E402 (tests/ is on sys.path)

GRAD = "check_generation_in_the_pipelines_own_grad_mode_records_no_graph"
INDEX = "check_offloader_keeps_to_the_device_index_it_was_given"
STRATEGIES = ("model_level", "layer_wise")


def _run(spec: PipelineSpec, check: str, impl: Any = None) -> list[Any]:
    kwargs = {} if impl is None else {"impl": impl}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks([spec], checks=[check], strategies=STRATEGIES, include_global=False,
                          **kwargs)


def _without_no_grad() -> PipelineSpec:
    import dataclasses

    return dataclasses.replace(get_spec("flux2"), factory=flux2_without_no_grad)


class _ServesGradMode(SimpleOffloader):
    """The plain protocol offloader without its autograd refusal: it serves a grad-mode call (as
    an offloader that never thought of autograd does), so the graph is recorded."""

    def _enter(self, unit: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():  # its refusal asks torch.is_grad_enabled()
            super()._enter(unit, args, kwargs)


def serves_grad_mode(device: torch.device, strategy: str) -> SimpleOffloader:
    return _ServesGradMode(device, strategy)


# -- item 2: the pipeline's own grad mode --------------------------------------------------------


def test_a_plain_call_of_a_pipeline_without_no_grad_is_refused_by_offload_ref() -> None:
    results = _run(_without_no_grad(), GRAD)
    assert [r.outcome for r in results] == ["failed", "failed"], [r.message for r in results]
    by = {r.id.strategy: r.message for r in results}
    assert {r.severity for r in results} == {"error"}
    for message in by.values():
        assert "OffloadAutogradError" in message and "@torch.no_grad()" in message
        assert "requires grad" in message
    # the component the refusal came from
    assert "text_encoder runs with autograd recording" in by["model_level"]
    assert "raised inside transformer" in by["layer_wise"]


def test_a_plain_call_without_no_grad_refused_by_a_foreign_offloader_names_its_refusal() -> None:
    impl = offloader_implementation(simple_offloader, name="simple_offloader")
    results = _run(_without_no_grad(), GRAD, impl)
    assert [r.outcome for r in results] == ["failed", "failed"], [r.message for r in results]
    by = {r.id.strategy: r for r in results}
    assert "raised inside text_encoder RuntimeError: SimpleOffloader:" in by["model_level"].message
    assert "raised inside transformer RuntimeError: SimpleOffloader:" in by["layer_wise"].message
    for r in results:
        assert "A user calling the pipeline gets this refusal" in r.message
        assert r.severity == "error"


def test_a_plain_call_without_no_grad_under_a_foreign_offloader_reports_the_memory_held() -> None:
    impl = offloader_implementation(serves_grad_mode, name="tests:serves_grad_mode")
    results = _run(_without_no_grad(), GRAD, impl)
    assert [r.outcome for r in results] == ["failed", "failed"], [r.message for r in results]
    for r in results:
        assert "recorded an autograd graph in text_encoder, transformer" in r.message, r.message
        assert "for a backward nobody runs" in r.message
        assert "its output requires grad" in r.message
        assert "bytes (" in r.message and "on the device)" in r.message
        assert r.severity == "memory"


@pytest.mark.parametrize("offloader", [None, simple_offloader, serves_grad_mode])
def test_a_pipeline_with_no_grad_passes_in_its_own_grad_mode(offloader: Any) -> None:
    """flux2's __call__ has @torch.no_grad(); with its weights unfrozen it must still pass."""
    import dataclasses

    def unfrozen(seed: int = 0) -> Any:
        from offload_ref.fixtures.flux2 import build_pipeline

        return build_pipeline(seed).requires_grad_(True)

    impl = None if offloader is None else offloader_implementation(offloader)
    spec = dataclasses.replace(get_spec("flux2"), factory=unfrozen)
    results = _run(spec, GRAD, impl)
    assert [r.outcome for r in results] == ["passed", "passed"], [r.message for r in results]


def test_case_run_grad_modes() -> None:
    case = CheckCase(get_spec("flux2"), None)
    seen = []

    class Probe:
        def __call__(self) -> torch.Tensor:
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            return torch.zeros(1)

    with torch.no_grad():  # "own" is a plain call's mode, whatever the caller's
        for mode in ("inference", "no_grad", "own"):
            case.run(Probe(), {}, grad_mode=mode)
    assert seen == [(False, True), (False, False), (True, False)]
    with pytest.raises(ValueError, match="grad_mode='train'"):
        case.run(Probe(), {}, grad_mode="train")


# -- item 5: device 1 ----------------------------------------------------------------------------

needs_two_devices = pytest.mark.skipif(
    not SIMULATED, reason="single-device mode: there is no device index to vary")


@needs_two_devices
def test_the_kit_device_and_offload_refs_platform_follow_the_index() -> None:
    from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION

    assert kit_device().index == 0
    with on_device_index(1) as device:
        assert device == kit_device() == torch.device("hpu", 1)
        platform = DEFAULT_IMPLEMENTATION.make_platform()
        try:
            assert platform.device == torch.device("hpu", 1)
        finally:
            platform.close()
    assert kit_device().index == 0


@needs_two_devices
def test_an_offloader_that_ignores_the_device_index_fails_naming_the_tensor() -> None:
    impl = offloader_implementation(ignores_the_device_index, name="ignores_the_device_index")
    results = _run(get_spec("flux2"), INDEX, impl)
    assert [r.outcome for r in results] == ["failed", "failed"], [r.message for r in results]
    for r in results:
        assert "landed on hpu:0 instead of hpu:1" in r.message, r.message
        assert "the offloader was given hpu:1" in r.message
        assert r.severity in ("error", "memory")


@needs_two_devices
@pytest.mark.parametrize("offloader", [None, simple_offloader])
def test_offloaders_that_keep_to_the_index_pass_on_device_1(offloader: Any) -> None:
    impl = None if offloader is None else offloader_implementation(offloader)
    results = _run(get_spec("flux2"), INDEX, impl)
    assert [r.outcome for r in results] == ["passed", "passed"], [r.message for r in results]
