"""A memory failure of an offloader judged through the protocol says where the bytes are: the
streamed blocks or swapped components whose tensors stayed on the device, or that none of the
pipeline's tensors is there and the offloader holds the bytes itself (an outside engine author:
"peak device bytes ... exceed" and "N bytes are still allocated" named no tensor)."""

from __future__ import annotations

import warnings

from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import BROKEN
from offload_ref.fixtures import get_spec


def _result(broken: str, check: str, strategy: str):
    factory, _ = BROKEN[broken]
    impl = offloader_implementation(factory, name=broken, validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([get_spec("flux2")], checks=[check], strategies=(strategy,),
                               include_global=False, impl=impl)
    return result


def test_a_peak_over_the_bound_names_the_blocks_left_on_the_device():
    result = _result("simple_keeps_everything", "check_peak_device_bytes_stay_within_the_plan_bound",
                     "layer_wise")
    assert result.outcome == "failed", (result.outcome, result.message)
    assert "streamed blocks have tensors on the device" in result.message, result.message
    assert "transformer.transformer_blocks.0" in result.message


def test_bytes_held_after_disable_with_no_pipeline_tensor_there_are_the_offloaders():
    result = _result("simple_interrupt_leak",
                     "check_generation_after_an_interrupt_is_exact",
                     "layer_wise")
    assert result.outcome == "failed", (result.outcome, result.message)
    assert "none of the pipeline's tensors is there: the offloader holds those bytes itself" \
        in result.message, result.message
