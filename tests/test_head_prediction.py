"""With a resident head (``OffloadPlan.layerwise_resident_layers``) of any size, the measured peak
device bytes equal ``predicted_device_bytes()`` exactly, and the output equals the reference: on
fixtures, and on plain-object pipelines whose state the prediction once missed (an undeclared
module attribute, counted by the backend but not predicted) or whose DiT is reached through a
non-module attribute (its non-block state and head were left on the host, though predicted on
the device)."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.plan import OffloadPlan
from offload_ref.platform import CpuPlatform
from offload_ref.contracts.case import move_to_device
from device_helpers import DEVICE, resident  # noqa: E402 (tests/ is on sys.path)
from test_bench_spec import DIM, PlainPipeline, _Transformer, inputs  # noqa: E402


class WithHelper(PlainPipeline):
    """A plain-object pipeline with an undeclared module attribute: pipeline state, placed on the
    device under every strategy."""

    def __init__(self) -> None:
        super().__init__()
        self.helper = nn.Linear(3, 5).eval().requires_grad_(False)

    def __call__(self, **kw):
        return super().__call__(**kw) * self.helper.weight.sum()


class ThroughNamespace:
    """A plain-object pipeline whose DiT is declared at ``parts.transformer``, ``parts`` being no
    module (discovery follows the dotted path; the tree walk does not)."""

    _dit_modules = ["parts.transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]

    def __init__(self) -> None:
        self.text_encoder = nn.Linear(DIM, DIM).eval().requires_grad_(False)
        self.parts = types.SimpleNamespace(transformer=_Transformer().eval().requires_grad_(False))
        self.vae = nn.Linear(DIM, DIM).eval().requires_grad_(False)

    def __call__(self, *, x: torch.Tensor, steps: int) -> torch.Tensor:
        x = self.text_encoder(x.to(self.vae.weight.device))
        for _ in range(steps):
            x = self.parts.transformer(x)
        return self.vae(x)


def _reference(pipeline):
    """The whole pipeline on the device (the kit's walk, like the library's tree walk, does not
    follow ``parts``: that DiT is moved by hand)."""
    parts = getattr(pipeline, "parts", None)
    if parts is not None:
        move_to_device(parts.transformer, DEVICE)
    return resident(pipeline)


def _plain(cls):
    def build():
        torch.manual_seed(0)
        return cls()
    return build, inputs


def _fixture(name: str):
    spec = get_spec(name)
    return spec.build, spec.make_inputs


PIPELINES = {
    "flux2": (_fixture("flux2"), "transformer", (0, 1, 2, 3)),
    "qwen_image": (_fixture("qwen_image"), "transformer", (1, 2)),
    "plain": (_plain(PlainPipeline), "transformer", (0, 1)),
    "plain_with_helper": (_plain(WithHelper), "transformer", (0, 1)),
    "through_namespace": (_plain(ThroughNamespace), "parts.transformer", (0, 1)),
}
CASES = [(name, k) for name, (_, _, heads) in PIPELINES.items() for k in heads]


def _with_head(pipeline, path: str, k: int):
    if k:
        plan = getattr(type(pipeline), "_offload_plan", None) or OffloadPlan()
        pipeline.__dict__["_offload_plan"] = dataclasses.replace(
            plan, layerwise_resident_layers={path: k})
    return pipeline


@pytest.mark.parametrize("device", ["kit", "cpu"])
@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-head{k}" for n, k in CASES])
def test_measured_peak_equals_the_prediction(name: str, k: int, device: str) -> None:
    (build, make_inputs), path, _ = PIPELINES[name]
    with torch.inference_mode():
        want = _reference(build())(**make_inputs()) if device == "kit" else build()(**make_inputs())
    platform = CpuPlatform() if device == "kit" else CpuPlatform(device="cpu")
    pipeline = _with_head(build(), path, k)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a head on a small ring warns of what it keeps
            backend.enable(pipeline)
        assert [s.resident_head for s in backend.plan.rings][:1] == [k]
        with torch.inference_mode():
            got = pipeline(**make_inputs())
        got = getattr(got, "images", got)
        want_t = getattr(want, "images", want)
        assert torch.equal(got, want_t)
        assert backend.stats().peak_device_bytes == backend.plan.predicted_device_bytes()
    finally:
        backend.disable()
        platform.close()
