"""Placement bugs (Contract P.1): each passes when host and device are both the CPU and fails on
the default, the simulated accelerator, with torch's same-device error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.platform import CpuPlatform, simulated

from offload_ref.fixtures._mmdit import LATENT_SIZE

from placement_pipelines import build_adapter, make_inputs  # noqa: E402 (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
SAME_DEVICE = "Expected all tensors to be on the same device"
needs_sim = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")


def _check(spec: str, strategy: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.run(
        [sys.executable, "-m", "offload_ref.cli", "check", f"placement_pipelines:{spec}",
         "--strategy", strategy, "--check", "check_offloaded_output_matches_reference_bitwise",
         *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@needs_sim
@pytest.mark.parametrize("spec,strategy", [("HOST_INPUTS", "layer_wise"),
                                           ("DEVICE_FROM_OFFLOADED", "model_level")])
def test_placement_bug_passes_on_one_device_and_fails_where_host_and_device_differ(
        spec: str, strategy: str) -> None:
    single = _check(spec, strategy, "--single-device")
    assert single.returncode == 0, single.stdout + single.stderr
    assert "PLACEMENT CHECKS OFF" in single.stdout
    default = _check(spec, strategy)
    assert default.returncode == 1, default.stdout + default.stderr
    assert "placement checks ON" in default.stdout
    assert SAME_DEVICE in default.stdout, default.stdout


@needs_sim
@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_a_parameter_added_after_enable_meets_the_device_weights(strategy: str) -> None:
    def generate(platform_device: str) -> None:
        pipeline = build_adapter()
        platform = CpuPlatform(device=platform_device)
        backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
        backend.enable(pipeline)
        try:
            pipeline.adapter = nn.Linear(LATENT_SIZE, LATENT_SIZE)  # after enable, on the host
            with torch.inference_mode():
                pipeline(**make_inputs())
        finally:
            backend.disable()
            platform.close()

    generate("cpu")  # one device: passes silently
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        generate("hpu:0")


@needs_sim
@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_execution_device_is_the_backends_device_while_offloaded(strategy: str) -> None:
    from offload_ref import execution_device
    from offload_ref.contracts.case import move_to_device

    pipeline = build_adapter()
    assert execution_device(pipeline) == torch.device("cpu")
    assert execution_device(move_to_device(build_adapter(), torch.device("hpu", 0))) == \
        torch.device("hpu", 0)
    platform = CpuPlatform(device="hpu:0")
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    try:
        assert execution_device(pipeline) == torch.device("hpu", 0)
    finally:
        backend.disable()
        platform.close()
    assert execution_device(pipeline) == torch.device("cpu")


@needs_sim
@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_a_stock_diffusers_execution_device_is_the_device_while_offloaded(strategy: str) -> None:
    """docs/model-authors.md §8: diffusers' own ``_execution_device`` (no accelerate hook) gives
    the backend's device, because a component stays there (the VAE under model level)."""
    pytest.importorskip("diffusers")
    from offload_ref.fixtures.diffusers_dit import build_sd3

    pipeline = build_sd3()
    assert pipeline._execution_device == torch.device("cpu")
    platform = CpuPlatform(device="hpu:0")
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    try:
        assert pipeline._execution_device == torch.device("hpu", 0)
        parked = [n for n, m in pipeline.components.items() if isinstance(m, nn.Module)
                  and next(m.parameters()).device.type == "cpu"]
        assert parked == (["text_encoder", "transformer"] if strategy == "model_level" else [])
    finally:
        backend.disable()
        platform.close()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_the_kit_names_a_module_attached_during_a_call(strategy: str) -> None:
    """Before: the views check crashed with KeyError on the new tensor (issue 22, class 4)."""
    import warnings

    from offload_ref.contracts import PipelineSpec
    from offload_ref.contracts.runner import run_checks

    spec = PipelineSpec(name="attaches_adapter",
                        factory="placement_pipelines:build_attaches_adapter",
                        inputs="placement_pipelines:make_inputs", strategies=(strategy,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([spec], checks=["check_views_keep_strides_and_sharing"],
                             include_global=False)
    assert [r.outcome for r in results] == ["failed"], [(r.outcome, r.message) for r in results]
    assert "adapter.bias was added after enable()" in results[0].message
    assert "edit_weights()" in results[0].message


class _ForwardCallingDit(torch.nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.forward(x)  # the bug: bypasses the block's hooks
        return x


class ForwardCallingPipeline(torch.nn.Module):
    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _ForwardCallingDit()

    def forward(self) -> torch.Tensor:
        from offload_ref import execution_device

        return self.transformer(torch.ones(1, 8, device=execution_device(self)))


def test_blocks_called_through_forward_are_named_with_the_fix() -> None:
    """Before: "only 0 of 4 streamed blocks ran", with no word of why (issue 22, class 7).  On
    one device the blocks compute with whatever they are bound to, and the check names them and
    the fix; where host and device differ it is torch's same-device error (the kit does not yet
    diagnose that by cause: issue 22)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    args = [sys.executable, "-m", "offload_ref.cli", "check", "test_placement:FORWARD_CALLS",
            "--strategy", "layer_wise", "--check",
            "check_layerwise_keeps_at_most_two_blocks_resident"]
    single = subprocess.run([*args, "--single-device"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 1, single.stdout + single.stderr
    assert "transformer.blocks.0" in single.stdout and "block.forward(...)" in single.stdout, (
        single.stdout)
    if simulated.available():
        default = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=300)
        assert default.returncode == 1 and SAME_DEVICE in default.stdout, default.stdout


def _no_inputs(seed: int = 0) -> dict:
    return {}


def _forward_calls_spec():
    from offload_ref.contracts import PipelineSpec

    return PipelineSpec(name="forward_calls", factory="test_placement:ForwardCallingPipeline",
                        inputs="test_placement:_no_inputs", strategies=("layer_wise",))


FORWARD_CALLS = _forward_calls_spec()  # the spec the CLI loads


# -- issue 22: every class of placement bug fails with its cause named --------------------------

PARITY = "check_offloaded_output_matches_reference_bitwise"
CYCLES = "check_enable_disable_cycles_match_the_reference"
RESIDENCY = "check_layerwise_keeps_at_most_two_blocks_resident"

#: pipeline (tests/placement_pipelines.py) -> (strategy, the check, what its message must say)
CAUSES = {
    "device_from_offloaded": ("model_level", PARITY, [
        "read transformer.position_embedding.device -> cpu", "parked on the host",
        "offload_ref.execution_device(pipeline)"]),
    "device_from_block_weight": ("layer_wise", PARITY, [
        "transformer.transformer_blocks.2.attn.to_q.weight.device -> cpu",
        "a placeholder: block transformer.transformer_blocks.2 was not loaded",
        "offload_ref.execution_device(pipeline)"]),
    "device_from_first_component": ("model_level", PARITY, [
        "in execution_device read text_encoder.embed_tokens.weight.device -> cpu",
        "parked on the host: text_encoder was not loaded"]),
    "diffusers_style_device": ("model_level", PARITY, [
        "in device read text_encoder.embed_tokens.weight.device -> cpu"]),
    "adds_dit_bias_to_context": ("model_level", PARITY, [
        "transformer.context_embedder.bias belongs to transformer",
        "read by the pipeline's own code at tests/placement_pipelines.py",
        "read a component's weights only inside its own forward"]),
    "dit_reads_encoder_table": ("model_level", PARITY, [
        "text_encoder.embed_tokens.weight belongs to text_encoder",
        "read by module transformer (call 1)", "object.__setattr__"]),
    "reads_first_block_weight": ("layer_wise", PARITY, [
        "transformer.transformer_blocks.0.img_mod.bias was read by the pipeline's own code at "
        "tests/placement_pipelines.py", "bound to a ring slot outside its block's call"]),
    "attaches_host_adapter_to_a_block": ("layer_wise", PARITY, [
        "transformer.transformer_blocks.1.attn.to_out.down.weight was added to the pipeline "
        "after enable()", "`with backend.edit_weights(): ...`"]),
    "dit_calls_encoder_module": ("model_level", PARITY, [
        "transformer called text_encoder_3.final_norm, a module of text_encoder_3, from its own "
        "forward", "compute that result in the pipeline before"]),
    "encodes_through_entry_point": ("model_level", PARITY, [
        "the forward hook of text_encoder never fired", "text_encoder.encode(...)",
        'backend.use_component("text_encoder")']),
    "calls_transformer_forward": ("model_level", PARITY, [
        "the forward hook of transformer never fired", "transformer.forward(...)",
        'backend.use_component("transformer")']),
    "caches_weight_view": ("layer_wise", PARITY, [
        "transformer.transformer_blocks.0.gate_row is a tensor kept on a module across calls",
        "transformer.transformer_blocks.0.img_mod.weight", "take them inside forward"]),
    "caches_table": ("model_level", CYCLES, [
        "transformer.table is a tensor the pipeline keeps across calls as a plain attribute of "
        "transformer (not a registered buffer)",
        "made on hpu:0 by generation 1", "register_buffer"]),
    "generator_on_component_device": ("model_level", PARITY, [
        "used a generator on cpu", "a generator on hpu:0", ".device -> cpu",
        'torch.Generator("cpu")']),
    "calls_block_forward": ("layer_wise", RESIDENCY, [
        "transformer.transformer_blocks.0 ran through transformer.transformer_blocks.0.forward"
        "(...)", "which bypasses its hooks", "call the block itself, block(...)"]),
}


def _results(name: str, strategies: tuple[str, ...], checks: list[str] | None):
    import warnings

    from offload_ref.contracts.runner import run_checks
    from placement_pipelines import spec_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks([spec_of(name, strategies)], checks=checks, include_global=False)


def test_every_bug_class_is_listed() -> None:
    from placement_pipelines import PIPELINES

    assert set(CAUSES) | {"calls_block_part_after_loop"} == {
        n for n, (_, broken) in PIPELINES.items() if broken}


@needs_sim
@pytest.mark.parametrize("name", sorted(CAUSES))
def test_a_placement_bug_fails_with_its_cause_and_fix(name: str) -> None:
    strategy, check, says = CAUSES[name]
    [result] = _results(name, (strategy,), [check])
    assert result.outcome in ("failed", "error"), (result.outcome, result.message)
    for text in says:
        assert text in result.message, (text, result.message)


@needs_sim
@pytest.mark.parametrize("name", ["correct", "guidance", "generator_on_execution_device"])
def test_correct_pipelines_pass_the_whole_kit(name: str) -> None:
    """Execution device from offload_ref.execution_device, noise from a host generator, every
    component through __call__; and one whose blocks run twice per step (guidance).  The three
    share one class of modules (``Base``) and differ in their call only, so the checks that
    repeat a whole enable (a fault at every step, 100 cycles) run on the first of them."""
    from offload_ref.contracts.checks.lifecycle import REPEATED_ENABLE_CHECKS
    from offload_ref.contracts.runner import load_catalogue

    checks = None if name == "correct" else sorted(
        i.id for i in load_catalogue().values()
        if i.scope == "spec" and i.id not in REPEATED_ENABLE_CHECKS)
    results = _results(name, ("model_level", "layer_wise"), checks)
    bad = [(str(r.id), r.message[:400]) for r in results if not r.ok]
    assert not bad, bad
    assert sum(r.outcome == "passed" for r in results) > 60


@needs_sim
def test_the_diagnosis_runs_once_per_cause_and_is_printed_once() -> None:
    """One bug fails many checks; the diagnosis runs once and the report prints it once, then
    lists the other cases it failed."""
    import io

    import offload_ref.contracts.runner as runner
    from offload_ref.contracts.report import render, rows_from_results

    calls = []
    real = runner.diagnose_device_error
    runner._PLACEMENT_DIAGNOSES.clear()
    try:
        runner.diagnose_device_error = lambda case: calls.append(1) or real(case)
        results = _results("calls_transformer_forward", ("model_level",),
                           [PARITY, CYCLES, "check_second_disable_is_a_noop"])
    finally:
        runner.diagnose_device_error = real
    failing = [r for r in results if r.outcome in ("failed", "error")]
    assert len(failing) >= 2 and len(calls) == 1, (len(failing), calls)
    assert all("the forward hook of transformer never fired" in r.message for r in failing)
    out = io.StringIO()
    render(rows_from_results(results), out=out)
    text = out.getvalue()
    assert text.count("the forward hook of transformer never fired") == 1, text
    assert "the same diagnosis in" in text and "reproduce: offload-ref check" in text, text


class _SkipsOneLoad:
    """A deliberately broken model-level backend: its hook never loads text_encoder_3."""

    @staticmethod
    def make_backend(config, platform):
        from offload_ref.backends.model_level import ModelLevelOffloadBackend

        class Broken(ModelLevelOffloadBackend):
            def activate(self, comp):
                if comp.path != "text_encoder_3":
                    super().activate(comp)

        return Broken(config, platform=platform)


@needs_sim
def test_an_offloader_that_does_not_load_is_blamed_not_the_pipeline() -> None:
    """The diagnosis must not send an author after a bug of the offloader under test."""
    import warnings

    from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
    from offload_ref.contracts.runner import run_checks
    from placement_pipelines import spec_of

    impl = DEFAULT_IMPLEMENTATION.replace(name="skips_one_load",
                                          make_backend=_SkipsOneLoad.make_backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [result] = run_checks([spec_of("correct", ("model_level",))], checks=[PARITY],
                              include_global=False, impl=impl)
    assert result.outcome == "error", result.message
    assert "text_encoder_3 was called through its hooks, yet" in result.message, result.message
    assert "an offloader defect, not the pipeline's" in result.message
    assert "Fix:" not in result.message.split("diagnosis: cause:", 1)[1]


@needs_sim
def test_a_block_part_called_after_the_loop_is_named_where_the_offloader_hooks_only_blocks(
        monkeypatch) -> None:
    """offload-ref serves a part called on its own through the part's hooks (Note [Block parts]
    in ring.py; diffusers' DiT does it), so its residency check passes it; an offloader that
    hooks only the block computes with placeholders there, and the diagnosis says why."""
    from offload_ref.backends import layerwise

    [passing] = _results("calls_block_part_after_loop", ("layer_wise",), [RESIDENCY, ])
    assert passing.outcome == "passed", passing.message
    monkeypatch.setattr(layerwise, "_block_parts", lambda block, blocks: [])
    [result] = _results("calls_block_part_after_loop", ("layer_wise",), [PARITY])
    assert result.outcome == "error", result.message
    for text in ("the hooks of block transformer.transformer_blocks.2 did not run",
                 "its part transformer.transformer_blocks.2.norm was called on its own",
                 "call the block itself"):
        assert text in result.message, (text, result.message)


def check_kit_test_device_failure(case) -> None:
    """Fails (CheckFailure, not an error) with the device error of an offloaded generation."""
    from offload_ref.contracts.registry import fail

    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    try:
        case.run(pipeline)
    except RuntimeError as exc:
        fail(f"the generation raised {exc}")
    finally:
        backend.disable()


@needs_sim
def test_the_pytest_route_keeps_the_diagnosis_of_a_failed_check(monkeypatch) -> None:
    """A check that fails with a device error in its message gets the placement diagnosis as a
    note; the failure the pytest route re-raises must carry it (before: dropped)."""
    import dataclasses

    import offload_ref.contracts.runner as runner
    from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
    from offload_ref.contracts.pytest_support import BoundCheck
    from offload_ref.contracts.registry import CATALOGUE, CheckFailure
    from placement_pipelines import spec_of

    runner.load_catalogue()
    info = dataclasses.replace(CATALOGUE[PARITY], id="check_kit_test_device_failure",
                               func=check_kit_test_device_failure)
    monkeypatch.setitem(CATALOGUE, info.id, info)
    runner._PLACEMENT_DIAGNOSES.clear()
    bound = BoundCheck(info, spec_of("calls_transformer_forward", ("model_level",)),
                       "model_level", DEFAULT_IMPLEMENTATION)
    with pytest.raises(CheckFailure) as raised:
        bound()
    assert "the generation raised" in str(raised.value), raised.value
    assert "the forward hook of transformer never fired" in str(raised.value), raised.value
