"""`offload-ref bench --spec` takes any pipeline the kit takes (an nn.Module, a diffusers pipeline,
a plain object holding modules), counts layerwise block calls on the backend's own rings, and
reports a pipeline it cannot measure in one `error:` line with exit status 1 (a bad reference:
2, as `offload-ref check` does)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from torch import nn

from offload_ref.bench import BenchSpecError, run_spec_bench
from offload_ref.cli import main
from offload_ref.contracts import PipelineSpec

DIM, BLOCKS = 16, 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class _Transformer(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class PlainPipeline:
    """A diffusers-style pipeline: a plain object, its components attributes (no named_modules)."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]

    def __init__(self) -> None:
        self.text_encoder = nn.Linear(DIM, DIM).eval().requires_grad_(False)
        self.transformer = _Transformer().eval().requires_grad_(False)
        self.vae = nn.Linear(DIM, DIM).eval().requires_grad_(False)

    def __call__(self, *, x: torch.Tensor, steps: int) -> torch.Tensor:
        # the VAE stays on the device under every strategy: where the pipeline computes
        x = self.text_encoder(x.to(self.vae.weight.device))
        for _ in range(steps):
            x = self.transformer(x)
        return self.vae(x)


def plain(seed: int = 0) -> PlainPipeline:
    torch.manual_seed(seed)
    return PlainPipeline()


def inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(2, DIM, generator=torch.Generator().manual_seed(seed)), "steps": 2}


def factory_raises(seed: int = 0) -> PlainPipeline:
    raise ValueError("no checkpoint at /nowhere")


def factory_exits(seed: int = 0) -> PlainPipeline:
    raise SystemExit(0)


def inputs_break_the_call(seed: int = 0) -> dict:
    return {"x": torch.randn(2, DIM + 1), "steps": 1}


PLAIN = PipelineSpec("plain", f"{__name__}:plain", f"{__name__}:inputs")


def test_a_plain_object_pipeline_is_measured_under_both_strategies() -> None:
    result = run_spec_bench(PLAIN, repeats=1)
    assert set(result["generation_s"]) == {"resident", "model_level", "layer_wise"}
    assert result["not_run"] == {}
    # two steps through a three-block ring: every streamed block call is counted
    assert result["layerwise_block_calls"] == 2 * BLOCKS
    assert all(s > 0 for s in result["enable_s"].values())


def test_the_repositorys_diffusers_sd3_spec_is_measured(capsys: pytest.CaptureFixture) -> None:
    rc = main(["bench", "--spec", "offload_ref.fixtures.diffusers_dit:SD3_SPEC", "--repeats", "1",
               "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    [result] = json.loads(captured.out)["pipelines"]
    assert result["pipeline"] == "diffusers_sd3"
    assert set(result["generation_s"]) == {"resident", "model_level", "layer_wise"}
    assert result["layerwise_block_calls"] > 0


@pytest.mark.parametrize("factory,inputs_ref,needles", [
    ("factory_raises", "inputs", ["its factory", "ValueError: no checkpoint at /nowhere"]),
    ("factory_exits", "inputs", ["its factory", "SystemExit: 0"]),
    ("plain", "inputs_break_the_call", ["a generation", "RuntimeError"]),
], ids=["raises", "system_exit", "generation_fails"])
def test_a_pipeline_that_cannot_be_measured_is_one_error_line(
        capsys: pytest.CaptureFixture, factory: str, inputs_ref: str, needles: list[str]) -> None:
    spec = PipelineSpec("broken", f"{__name__}:{factory}", f"{__name__}:{inputs_ref}")
    with pytest.raises(BenchSpecError) as info:
        run_spec_bench(spec, repeats=1)
    message = str(info.value)
    assert message.startswith("broken: ") and "\n" not in message
    for needle in needles:
        assert needle in message, message
    module = sys.modules[__name__]
    module.BROKEN = spec
    try:
        rc = main(["bench", "--spec", f"{__name__}:BROKEN", "--repeats", "1"])
    finally:
        del module.BROKEN
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines == [f"offload-ref bench: error: {message}"], captured.err


def test_a_reference_that_does_not_resolve_exits_2(capsys: pytest.CaptureFixture) -> None:
    rc = main(["bench", "--spec", f"{__name__}:NO_SUCH_SPEC"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith("offload-ref bench: error: --spec ")
    assert len(captured.err.strip().splitlines()) == 1


def _fake_samples(layer_wise_ms: float, jitter_ms: float, seen: list[int]):
    """``_interleaved_samples`` returning made-up timings (recording torch's thread count)."""
    def fake(fns, repeats, sync):
        seen.append(torch.get_num_threads())
        for fn in fns.values():  # the generations still run once (the backends serve them)
            fn()
        base = {"resident": 4.0, "model_level": 5.0, "layer_wise": layer_wise_ms}
        return {n: [1e-3 * (base[n] + jitter_ms * (i % 3 - 1)) for i in range(repeats)]
                for n in fns}
    return fake


def test_a_negative_or_noisy_overhead_is_never_printed_as_a_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: '-201.1 us extra per block call' (layerwise measured faster than resident on a
    loaded machine) and no thread pinning (the figures depended on the cores free then)."""
    import offload_ref.bench as bench

    seen: list[int] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # layerwise "faster" than resident (noise), then slower by less than the spread
        for layer_wise_ms, jitter_ms in ((2.9, 0.1), (4.05, 0.5)):
            monkeypatch.setattr(bench, "_interleaved_samples",
                                _fake_samples(layer_wise_ms, jitter_ms, seen))
            result = run_spec_bench(PLAIN, repeats=5)
            assert torch.get_num_threads() == 2  # restored
            assert result["layerwise_extra_below_noise"] is True
            assert result["layerwise_extra_us_per_block_call"] is None
            text = bench.format_spec_bench(result)
            line = text.splitlines()[-1]
            assert "below the noise of this run" in line and "spread" in line, text
            assert "us extra per block call" not in text, text
            assert not re.search(r"-\d", text), text  # no negative figure anywhere
        # a difference well above the spread is a figure: (6.0 - 4.0) ms over 2 * BLOCKS calls
        monkeypatch.setattr(bench, "_interleaved_samples", _fake_samples(6.0, 0.1, seen))
        result = run_spec_bench(PLAIN, repeats=5)
        assert result["layerwise_extra_us_per_block_call"] == pytest.approx(2e3 / (2 * BLOCKS))
        assert f"{2e3 / (2 * BLOCKS):.1f} us extra per block call" in \
            bench.format_spec_bench(result)
    finally:
        torch.set_num_threads(previous)
    assert seen == [1, 1, 1]  # pinned while measuring, as --peers and --growth


def test_the_text_says_the_thread_count_and_the_load_average(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--spec", f"{__name__}:PLAIN", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "torch threads: 1, load average " in out.splitlines()[0], out
    assert "spread (interquartile range of the generations): resident " in out, out
    assert main(["bench", "--spec", f"{__name__}:PLAIN", "--repeats", "1", "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["torch_threads"] == 1 and len(machine["load_average"]) == 3


def factory_interrupts(seed: int = 0) -> PlainPipeline:
    raise KeyboardInterrupt


def test_a_factorys_own_keyboard_interrupt_and_an_exit_on_import_are_error_lines(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Before: the factory's KeyboardInterrupt went up as a raw traceback (as if the user had
    pressed Ctrl-C), and a module exiting on import ended the command with its exit code."""
    module = sys.modules[__name__]
    module.INTERRUPTS = PipelineSpec("interrupts", f"{__name__}:factory_interrupts",
                                     f"{__name__}:inputs")
    try:
        rc = main(["bench", "--spec", f"{__name__}:INTERRUPTS", "--repeats", "1"])
    finally:
        del module.INTERRUPTS
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.strip().splitlines() == [
        "offload-ref bench: error: interrupts: its factory (the resident pipeline) raised "
        "KeyboardInterrupt: (no message)"], err
    (tmp_path / "bench_exits_on_import.py").write_text("raise SystemExit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["bench", "--spec", "bench_exits_on_import:SPEC"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload-ref bench: error: --spec 'bench_exits_on_import:SPEC': "
                          "loading it raised SystemExit(0) (at "), err
