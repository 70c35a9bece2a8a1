"""The kit's preflight (issue 11 item 6) and pipelines that are not ``nn.Module``.

Under test: a spec the kit cannot drive is reported once, before any check runs, in one line
naming the spec, the object and the fix, and its checks are visibly not run, while the other
specs of the run pass (``run_checks`` and the pytest route, ``check_params``); a factory or
inputs taking no arguments just works; a pipeline returning a diffusers-style output (an
``OrderedDict`` subclass) and a plain-object pipeline (components as attributes, not an
``nn.Module``) pass the whole kit; the library treats an undeclared module attribute of a plain
object as pipeline state, as it does a child of an ``nn.Module`` pipeline.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.backends import get_offload_backend
from offload_ref.config import OffloadConfig
from offload_ref.contracts.pytest_support import check_params
from offload_ref.contracts.registry import CheckFailure
from offload_ref.contracts.runner import failed_preflight, iter_cases, run_checks
from offload_ref.contracts.spec import PipelineSpec
from offload_ref.fixtures import get_spec
from offload_ref.fixtures._common import (
    AutoencoderDecoder,
    TextEncoder,
    build,
    local_seed,
    patchify,
    seeded_randn,
    timesteps,
    unpatchify,
)
from offload_ref.fixtures._mmdit import DIM, LATENT_CHANNELS, LATENT_SIZE
from offload_ref.fixtures.flux2 import Flux2Pipeline, Flux2Transformer2DModel, make_inputs
from offload_ref.plan import pipeline_state
from offload_ref.platform import CpuPlatform

_GOOD = get_spec("flux2")
# Cheap checks; the second has an `applies` predicate (it builds the pipeline to decide).
_CHEAP = ["check_plan_resolution_is_pure", "check_vae_selection_without_lifecycle_is_rejected"]
_STRATEGIES = ["model_level", "layer_wise"]


# -- bad specs ----------------------------------------------------------------------------------


def needs_path(path, seed=0):
    raise AssertionError("never called: it needs an argument")


def factory_raises(seed=0):
    raise RuntimeError("checkpoint not found")


def tuple_inputs(seed=0):
    return (make_inputs(seed),)


class _Image:
    """Not a tensor: a PIL-like image object."""


class _ImagePipeline(Flux2Pipeline):
    def forward(self, **inputs: Any) -> Any:
        return {"images": [_Image()]}


def image_pipeline(seed=0):
    return build(_ImagePipeline, seed)


_fresh_seeds = itertools.count(100)


def unseeded_pipeline(seed=0):
    """Ignores ``seed``: each build has other weights."""
    return build(Flux2Pipeline, next(_fresh_seeds))


class _Opaque:
    """Callable, but holds its weights where no one can find them."""

    def __init__(self) -> None:
        self._weights = {"w": torch.ones(2)}

    def __call__(self, **inputs: Any) -> torch.Tensor:
        return self._weights["w"] * 2


def opaque_pipeline(seed=0):
    return _Opaque()


_BAD = {
    "factory needs an argument": (
        PipelineSpec("bad", needs_path, make_inputs),
        [r"^spec 'bad': factory test_kit_preflight:needs_path needs argument\(s\) path; it must "
         r"take no arguments or only seed= \(wrap it in one that does\)$"]),
    "factory not callable": (
        PipelineSpec("bad", "offload_ref.fixtures:SPECS", make_inputs),
        [r"^spec 'bad': factory offload_ref.fixtures:SPECS is a tuple, not callable; pass a "
         r"callable returning a fresh pipeline$"]),
    "inputs need an argument": (
        PipelineSpec("bad", _GOOD.factory, needs_path),
        [r"^spec 'bad': inputs test_kit_preflight:needs_path needs argument\(s\) path"]),
    "building raises": (
        PipelineSpec("bad", factory_raises, make_inputs),
        [r"^spec 'bad': building the pipeline with factory test_kit_preflight:factory_raises "
         r"raised RuntimeError: checkpoint not found; fix the factory"]),
    "inputs return a tuple": (
        PipelineSpec("bad", _GOOD.factory, tuple_inputs),
        [r"^spec 'bad': inputs test_kit_preflight:tuple_inputs returned a tuple, not a mapping; "
         r"return a dict of keyword arguments"]),
    "uncomparable output": (
        PipelineSpec("bad", image_pipeline, make_inputs),
        [r"^spec 'bad': the output of _ImagePipeline cannot be compared: output\['images'\]\[0\] "
         r"is a test_kit_preflight._Image: .*return tensors"]),
    "non-deterministic reference": (
        PipelineSpec("bad", unseeded_pipeline, make_inputs),
        [r"^spec 'bad': two fresh builds and runs of seed=0 differ \(second run: output differs "
         r"from the first run: .*\); .*seed every random draw"]),
    "pipeline kind": (
        PipelineSpec("bad", opaque_pipeline, make_inputs),
        [r"^spec 'bad': the pipeline, a test_kit_preflight._Opaque, is neither an nn.Module nor "
         r"an object with discoverable components; declare its nn.Module attributes in "
         r"_dit_modules"]),
}


@pytest.mark.parametrize("problem", list(_BAD))
def test_each_problem_is_one_line_and_good_specs_still_run(problem) -> None:
    bad, patterns = _BAD[problem]
    results = run_checks([_GOOD, bad], checks=_CHEAP, strategies=_STRATEGIES,
                         include_global=False)
    mine = [r for r in results if r.id.spec == "bad"]
    assert [(r.id.check, r.id.strategy, r.outcome) for r in mine] == [
        ("preflight", None, "error")], mine
    lines = mine[0].message.splitlines()
    assert len(lines) == len(patterns) + 1, lines
    for line, pattern in zip(lines, patterns):
        assert re.search(pattern, line), line
    assert lines[-1] == "the checks of bad were not run"
    assert "--check" not in mine[0].id.repro()  # "preflight" is no check to select
    good = [r for r in results if r.id.spec == _GOOD.name]
    assert len(good) == 4 and all(r.outcome == "passed" for r in good), good
    assert list(failed_preflight([_GOOD, bad])) == [bad]


def test_a_failed_spec_gets_no_cases_and_no_applies() -> None:
    built = []

    def counting(seed=0):
        built.append(seed)
        raise RuntimeError("no weights")

    bad = PipelineSpec("bad", counting, make_inputs)
    cases = iter_cases([bad])  # every check, `applies` predicates included
    assert not [c for c in cases if c[1] is not None]
    assert built == [0]  # the one preflight build; no predicate built it again
    iter_cases([bad])
    assert built == [0]  # cached per spec


def test_pytest_route_gives_one_preflight_param() -> None:
    bad, patterns = _BAD["inputs return a tuple"]
    params = check_params([_GOOD, bad], checks=_CHEAP, strategies=_STRATEGIES,
                          include_global=False)
    ids = [p.id for p in params]
    assert [i for i in ids if "bad" in i] == ["preflight-bad"]
    assert len(ids) == 5
    body = params[ids.index("preflight-bad")].values[0]
    with pytest.raises(CheckFailure) as err:
        body()
    lines = str(err.value).splitlines()
    assert re.search(patterns[0], lines[0]) and lines[1] == "the checks of bad were not run"


# -- friendlier: no arguments at all ------------------------------------------------------------


def zero_arg_factory():
    """Draws its weights from the global RNG: reproducible only if the kit seeds it."""
    pipeline = Flux2Pipeline()
    return pipeline.eval().requires_grad_(False)


def zero_arg_inputs():
    return make_inputs(0)


def test_factory_and_inputs_without_arguments_just_work() -> None:
    spec = PipelineSpec("noargs", zero_arg_factory, zero_arg_inputs)
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    results = run_checks([spec], checks=_CHEAP, strategies=_STRATEGIES, include_global=False)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    assert [r.outcome for r in results] == ["passed"] * 4, results
    a, b = spec.build(), PipelineSpec("other", zero_arg_factory, zero_arg_inputs, seed=1).build()
    assert not torch.equal(a.vae.conv_out.weight, b.vae.conv_out.weight)  # seeded by spec.seed


# -- pipelines the whole kit must accept ---------------------------------------------------------


class PipelineOutput(OrderedDict):
    """Like diffusers' ``BaseOutput``: an ``OrderedDict`` subclass with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _DictPipeline(Flux2Pipeline):
    def forward(self, **inputs: Any) -> PipelineOutput:
        images = super().forward(**inputs)
        return PipelineOutput(images=images, nsfw=[False])


def dict_pipeline(seed=0):
    return build(_DictPipeline, seed)


class PlainFlux2:
    """A diffusers-style pipeline: a plain object whose components are attributes, returning a
    ``BaseOutput``-like mapping."""

    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]

    def __init__(self) -> None:
        self.text_encoder = TextEncoder(DIM)
        self.transformer = Flux2Transformer2DModel()
        self.vae = AutoencoderDecoder(LATENT_CHANNELS)
        self.guidance_scale = 4.0
        for module in (self.text_encoder, self.transformer, self.vae):
            module.eval().requires_grad_(False)

    def __call__(self, *, generator_seed: int, num_inference_steps: int,
                 prompt_ids: torch.Tensor) -> PipelineOutput:
        device = next(self.vae.parameters()).device
        context = self.text_encoder(prompt_ids.to(device))
        guidance = torch.full((1,), 1000.0 * self.guidance_scale, device=device)
        shape = (1, LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)
        latents = seeded_randn(shape, generator_seed, device)
        sigmas = [1.0 - i / num_inference_steps for i in range(num_inference_steps + 1)]
        for step in range(num_inference_steps):
            out = self.transformer(patchify(latents), encoder_hidden_states=context,
                                   timestep=timesteps(sigmas[step], device), guidance=guidance)
            velocity = unpatchify(out, LATENT_SIZE, LATENT_SIZE)
            latents = latents + (sigmas[step + 1] - sigmas[step]) * velocity.float()
        return PipelineOutput(images=self.vae(latents))  # as diffusers' pipelines return


def plain_pipeline(seed=0):
    with local_seed(seed):
        return PlainFlux2()


@pytest.mark.slow
@pytest.mark.parametrize("factory", [dict_pipeline, plain_pipeline], ids=["dict", "plain"])
def test_whole_kit_passes(factory) -> None:
    spec = PipelineSpec("mine", factory, make_inputs, strategies=tuple(_STRATEGIES))
    results = run_checks([spec], strategies=_STRATEGIES, include_global=False)
    bad = [f"{r.id}: {r.outcome}: {r.message.splitlines()[0] if r.message else ''}"
           for r in results if not r.ok]
    assert not bad, bad
    assert len(results) > 60


# -- the library: a plain object's undeclared module attribute is pipeline state --------------


def test_plain_pipeline_state_includes_undeclared_module_attributes() -> None:
    pipeline = plain_pipeline()
    pipeline.guidance_embedder = nn.Linear(4, 4).requires_grad_(False)  # declared nowhere
    components = [pipeline.text_encoder, pipeline.transformer, pipeline.vae]
    names = [n for n, _ in pipeline_state(pipeline, components)]
    assert names == ["guidance_embedder.weight", "guidance_embedder.bias"]
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=platform)
    backend.enable(pipeline)
    try:  # kept on the device with the rest of the resident state, as an nn.Module's child is
        assert all(platform.is_resident(t) for t in pipeline.guidance_embedder.parameters())
    finally:
        backend.disable()


def test_a_strategy_whose_plan_does_not_resolve_is_one_root_cause_not_a_crash() -> None:
    """Undeclared DiT blocks: model level runs every check; layerwise reports the resolver's
    message once and runs none of its checks (before: 37 failures, kit crashes among them)."""
    import io
    import warnings

    from offload_ref.contracts import PipelineSpec
    from offload_ref.contracts.report import render, rows_from_results
    from offload_ref.contracts.runner import run_checks

    spec = PipelineSpec(name="undeclared_blocks", factory="real_models:build_sd3_undeclared_blocks",
                        inputs="real_models:make_inputs", strategies=("model_level", "layer_wise"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([spec], include_global=False)
    bad = [r for r in results if not r.ok]
    assert [str(r.id) for r in bad] == ["preflight-undeclared_blocks-layer_wise"], [
        (str(r.id), r.message[:200]) for r in bad]
    assert "has no streamable layerwise-offload blocks" in bad[0].message
    assert "OffloadPlan(block_attrs=" in bad[0].message
    layerwise = [r for r in results if r.id.strategy == "layer_wise" and r.id.check != "preflight"]
    assert layerwise and all(r.outcome == "not_applicable" and "does not resolve" in r.message
                             for r in layerwise)
    assert any(r.outcome == "passed" for r in results if r.id.strategy == "model_level")
    out = io.StringIO()
    render(rows_from_results(results), out=out)
    assert out.getvalue().count("has no streamable layerwise-offload blocks") == 1, out.getvalue()
