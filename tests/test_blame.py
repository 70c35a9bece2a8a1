"""The placement diagnosis blames the right party (issue 33, item 3).

An offloader that does not move or load a tensor while it is enabled is blamed, with the tensor's
path and kind and the offloader's name, not the pipeline; a pipeline that keeps a tensor across
calls, or runs a block around its hooks, is blamed under any offloader; a hook registered after
the offloader's is named with the weight it read; and no cause contradicts itself.  The pipelines
and offloaders are in tests/blame_cases.py.
"""

from __future__ import annotations

import inspect
import re
import warnings
from functools import lru_cache

import pytest

from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import simple_offloader
from offload_ref.platform import simulated

import blame_cases  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

PARITY = "check_offloaded_output_matches_reference_bitwise"
CYCLES = "check_enable_disable_cycles_match_the_reference"
OFFLOADER_DEFECT = "an offloader defect, not the pipeline's"
OFFLOADERS = {"params_only": blame_cases.params_only, "blocks_only": blame_cases.blocks_only,
              "hooks_remove_themselves": blame_cases.hooks_remove_themselves,
              "simple": simple_offloader}


@lru_cache(maxsize=None)
def _message(pipeline: str, offloader: str, strategy: str, check: str) -> tuple[str, str]:
    """(outcome, message) of one case; each scenario runs once per session."""
    impl = (DEFAULT_IMPLEMENTATION if offloader == "offload_ref" else
            offloader_implementation(OFFLOADERS[offloader], name=f"blame_cases:{offloader}"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [result] = run_checks([blame_cases.spec_of(pipeline, (strategy,))], checks=[check],
                              include_global=False, impl=impl)
    return result.outcome, result.message


def _cause(message: str) -> str:
    return "\n".join(line.strip() for line in message.splitlines()
                     if line.strip().startswith("diagnosis: cause:"))


#: (pipeline, offloader, strategy, check) -> what the cause must say: the offloader at fault
OFFLOADER_AT_FAULT = {
    # a non-persistent buffer the offloader never moves (it moves parameters and state_dict())
    ("correct", "params_only", "layer_wise", PARITY): [
        "blame_cases:params_only did not load transformer.blocks.0.freqs (non-persistent buffer, "
        "on cpu), although transformer.blocks.0 was called through its hooks",
        "Non-persistent buffers are not in state_dict()"],
    ("correct", "params_only", "model_level", PARITY): [
        "blame_cases:params_only did not load transformer.blocks.0.freqs (non-persistent buffer, "
        "on cpu), although transformer was called through its hooks"],
    # the DiT's state outside its blocks, which the offloader neither moves nor hooks
    ("correct", "blocks_only", "layer_wise", PARITY): [
        "blame_cases:blocks_only neither moved transformer.proj_in.weight (parameter, on cpu) "
        "at enable() nor put a hook on any module that holds it",
        "it hooked transformer.blocks.0, transformer.blocks.1, transformer.blocks.2"],
    # hooks that remove themselves after their first call
    ("correct", "hooks_remove_themselves", "layer_wise", PARITY): [
        "blame_cases:hooks_remove_themselves installed forward pre-hook "
        "HooksRemoveThemselves.enable.<locals>.once", "on transformer.blocks.0 at enable(), and "
        "it was gone in generation 1 while it still said is_enabled() True"],
    ("correct", "hooks_remove_themselves", "model_level", PARITY): [
        "on text_encoder at enable(), and it was gone in generation 2"],
}

#: the pipeline at fault, under a correct foreign offloader and under offload-ref
PIPELINE_AT_FAULT = {
    ("global_cache", "simple", "model_level", CYCLES): [
        "after disable() the pipeline computes on cpu", "but it used a tensor on hpu:0 "
        "(torch.linspace(...) at tests/blame_cases.py", "in generation 1): a tensor kept across "
        "calls", "key such caches by device"],
    ("global_cache", "offload_ref", "model_level", CYCLES): [
        "after disable() the pipeline computes on cpu", "a tensor kept across calls"],
    ("keeps_table", "simple", "model_level", CYCLES): [
        "transformer.table is a tensor the pipeline keeps across calls as a plain attribute of "
        "transformer", "made on hpu:0 by generation 1"],
    ("calls_block_forward", "simple", "layer_wise", PARITY): [
        "the pipeline ran transformer.blocks.0 through transformer.blocks.0.forward(...) (called "
        "at tests/blame_cases.py", "which bypasses the hooks blame_cases:simple put on "
        "transformer.blocks.0", "Fix: call the module"],
}


@pytest.mark.parametrize("case", sorted(OFFLOADER_AT_FAULT), ids=lambda c: "-".join(c[:3]))
def test_an_offloader_that_does_not_move_a_tensor_is_blamed(case) -> None:
    outcome, message = _message(*case)
    cause = _cause(message)
    assert outcome == "error" and cause, message
    for text in OFFLOADER_AT_FAULT[case]:
        assert text in cause, (text, cause)
    assert OFFLOADER_DEFECT in cause, cause
    # the party at fault comes first: the conformance table shows a cause's first 150 characters
    assert cause.startswith(f"diagnosis: cause: blame_cases:{case[1]} "), cause
    # before: "after disable() the weights are back on ... key caches by device" (the pipeline)
    assert "after disable()" not in cause and "key such caches" not in cause, cause
    # and the tensor it did not move is named as off the device while the offloader is enabled
    assert f"with blame_cases:{case[1]} enabled" in message, message


@pytest.mark.parametrize("case", sorted(PIPELINE_AT_FAULT), ids=lambda c: "-".join(c[:3]))
def test_a_pipeline_at_fault_is_blamed_under_any_offloader(case) -> None:
    outcome, message = _message(*case)
    cause = _cause(message)
    assert outcome == "error" and cause, message
    for text in PIPELINE_AT_FAULT[case]:
        assert text in cause, (text, cause)
    assert "offloader defect" not in cause, cause


def test_the_correct_pipeline_passes_under_each_offloader_it_was_written_for() -> None:
    """The controls: the pipeline of every case above is correct under a correct offloader."""
    for strategy in ("model_level", "layer_wise"):
        for offloader in ("simple", "offload_ref"):
            assert _message("correct", offloader, strategy, PARITY)[0] == "passed"
    # offload-ref keeps a block's weights loaded until its last hook ran (Note [Outermost hooks])
    assert _message("hooks_after_enable", "offload_ref", "layer_wise", PARITY)[0] == "passed"


def test_a_hook_registered_after_enable_is_named_with_the_weight_it_read() -> None:
    """Before: "the hooks of block ... did not run: it ran through its method
    _wrapped_call_impl()", which is false: the block ran through its hooks, and a hook
    registered after the offloader's read the weight after the offloader had parked it."""
    outcome, message = _message("hooks_after_enable", "simple", "layer_wise", PARITY)
    cause = _cause(message)
    lines, first = inspect.getsourcelines(blame_cases.read_block_weight)
    read = first + next(k for k, line in enumerate(lines) if "module.lin.weight" in line)
    for text in (f"the forward hook read_block_weight (tests/blame_cases.py:{first}) of "
                 "transformer.blocks.1 read transformer.blocks.1.lin.weight at "
                 f"tests/blame_cases.py:{read}, not transformer.blocks.1's forward",
                 "registered after blame_cases:simple's own hooks",
                 "register the hook before enable()"):
        assert text in cause, (text, cause)
    assert "_wrapped_call_impl" not in message and "_call_impl" not in cause, message


def test_diffusers_dit_part_after_the_block_loop_blames_block_level_group_offloading() -> None:
    """The published table said of diffusers' block-level group offloading, while enabled:
    "after disable() the weights are back on cpu, but the pipeline used a tensor on hpu:0".
    diffusers' DiT runs transformer_blocks[0].norm1.emb after its block loop, through the part's
    __call__; the offloader hooks only the blocks, so it never loads it for that call."""
    pytest.importorskip("diffusers")
    from offload_ref.contracts.offloader import load_offloader
    from offload_ref.fixtures.diffusers_dit import DIT_SPEC

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [result] = run_checks([DIT_SPEC], checks=[PARITY], strategies=["layer_wise"],
                              include_global=False,
                              impl=load_offloader("offload_ref.peers:diffusers_group_offload_block"))
    cause = _cause(result.message)
    assert cause.startswith("diagnosis: cause: offload_ref.peers:diffusers_group_offload_block "
                            "did not load "), cause  # the party first: a table cuts the rest
    for text in ("for a call of transformer.transformer_blocks.0.norm1.emb.timestep_embedder."
                 "linear_1 made on its own, outside a call of transformer.transformer_blocks.0",
                 "it loads transformer.transformer_blocks.0's weights only in the hooks it put on "
                 "transformer.transformer_blocks.0", "An offloader defect"):
        assert text in cause, (text, cause)
    assert "after disable()" not in cause, cause
    assert contradictions(result.message) == [], result.message


# -- no message contradicts itself ---------------------------------------------------------------

_DEVICE = r"(?:cpu|meta|[a-z]+:\d+)"
#: (what contradicts, a pattern whose two groups name the same device where they must differ)
_SAME_SIDES = [
    ("back on X ... a tensor on X", rf"back on ({_DEVICE})\b.*?used a tensor on ({_DEVICE})\b"),
    ("computes on X ... a tensor on X", rf"computes on ({_DEVICE})\b.*?used a tensor on "
                                        rf"({_DEVICE})\b"),
    ("made on X ... the weights/tensors on X", rf"made (?:its tensor|tensors) on ({_DEVICE})\b"
                                                rf"[^.]*?were on ({_DEVICE})\b"),
    ("(kind, on X) was still off X", rf"\(\w[\w -]*, on ({_DEVICE})\) was still off "
                                     rf"({_DEVICE})\b"),
    ("on X, not on X", rf"\bon ({_DEVICE}), not on ({_DEVICE})\b"),
]


def contradictions(message: str) -> list[str]:
    """What in a failure's diagnosis contradicts itself or the scenario it ran in."""
    found = []
    for line in message.splitlines():
        for what, pattern in _SAME_SIDES:
            for match in re.finditer(pattern, line):
                if match.group(1) == match.group(2):
                    found.append(f"{what}: {match.group(0)[:160]}")
    placement = next((ln for ln in message.splitlines() if "diagnosis: placement:" in ln), "")
    cause = _cause(message)
    enabled = re.search(r"in generation \d+ \((enabled|re-enabled)", placement)
    if enabled and "after disable()" in cause:
        found.append("an 'after disable()' cause for a generation run with offload enabled")
    if re.search(r"in generation \d+ \(after disable\(\)\)", placement) and \
            OFFLOADER_DEFECT in cause:
        found.append("an offloader defect blamed for a generation run with offload disabled")
    return found


def test_the_contradiction_scan_finds_the_published_contradictions() -> None:
    """The scan must fail on what the kit said before (docs/peers.md, issue 33)."""
    published = ("  diagnosis: placement: linear at x.py:1 in forward, run by module m (call 2) "
                 "in generation 1 (enabled), mixed ...\n  diagnosis: cause: after disable() the "
                 "weights are back on cpu, but the pipeline used a tensor on hpu:0 (...)")
    assert contradictions(published) == [
        "an 'after disable()' cause for a generation run with offload enabled"]
    assert contradictions("  diagnosis: cause: after disable() the weights are back on hpu:0, "
                          "but the pipeline used a tensor on hpu:0 (x)")[0].startswith(
        "back on X ... a tensor on X")
    assert contradictions("  diagnosis: cause: y (parameter, on cpu) was still off cpu inside")


def test_no_cause_contradicts_itself() -> None:
    """Every scenario of this module, and two of tests/placement_pipelines.py's bug classes
    under offload-ref (a table cached across a disable, a component run around its hooks),
    scanned."""
    from placement_pipelines import spec_of

    scenarios = [*OFFLOADER_AT_FAULT, *PIPELINE_AT_FAULT,
                 ("hooks_after_enable", "simple", "layer_wise", PARITY)]
    bad = {c: found for c in scenarios if (found := contradictions(_message(*c)[1]))}
    for name, strategy, check in (("caches_table", "model_level", CYCLES),
                                  ("calls_transformer_forward", "model_level", PARITY)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            [result] = run_checks([spec_of(name, (strategy,))], checks=[check],
                                  include_global=False)
        assert _cause(result.message), result.message
        if found := contradictions(result.message):
            bad[(name, strategy)] = found
    assert not bad, bad
