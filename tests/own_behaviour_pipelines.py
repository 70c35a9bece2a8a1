"""Correct pipelines that change themselves during a generation, as real models do: the kit must
judge an offloader against what the un-offloaded pipeline does, not against the pipeline as
built (tests/test_kit_own_behaviour.py)."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from offload_ref.fixtures.flux2 import Flux2Pipeline, Flux2Transformer2DModel, build_pipeline


class _RecreatingTransformer(Flux2Transformer2DModel):
    """Makes its ``out_scale`` parameter anew at every call (a table recomputed per call, a
    parameter re-created from its config): an edit of it lasts until the next generation, with
    or without offloading."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.out_scale = nn.Parameter(torch.ones(1, device=hidden_states.device),
                                      requires_grad=False)
        return super().forward(hidden_states, *args, **kwargs) * self.out_scale


def build_recreates_a_parameter(seed: int = 0) -> Flux2Pipeline:
    pipeline = build_pipeline(seed)
    pipeline.transformer.__class__ = _RecreatingTransformer
    pipeline.transformer.out_scale = nn.Parameter(torch.ones(1), requires_grad=False)
    return pipeline


def _install_output_hook(mod: nn.Module, args: Any) -> None:
    """On a module's first call, a forward hook that is a local function, as transformers'
    models install their output-capturing hooks: from then on pickle cannot store the module,
    offloaded or not (this pre-hook itself pickles: it is a module-level function)."""
    if not mod.__dict__.get("_output_hook_installed", False):
        def output_capturing_hook(m: nn.Module, a: Any, out: Any) -> None:
            return None
        mod.register_forward_hook(output_capturing_hook)
        mod.__dict__["_output_hook_installed"] = True


def build_hooks_on_first_call(seed: int = 0) -> Flux2Pipeline:
    pipeline = build_pipeline(seed)
    pipeline.vae.register_forward_pre_hook(_install_output_hook)
    return pipeline


def build_locks_on_first_call(seed: int = 0) -> Flux2Pipeline:
    """Every component, and the pipeline, holds a lock after its first call (a lazily made
    cache guarded by one): no copy of it can be made, offloaded or not."""
    pipeline = build_pipeline(seed)

    def lock(mod: nn.Module, args: Any, kwargs: Any = None) -> None:
        if "_cache_lock" not in mod.__dict__:
            mod.__dict__["_cache_lock"] = threading.Lock()

    for module in (pipeline, *pipeline.children()):
        module.register_forward_pre_hook(lock)
    return pipeline


def _cache_on_first_call(mod: nn.Module, args: Any) -> None:
    """A persistent buffer the module registers on its first call (a table sized by the first
    input): the state_dict of the un-offloaded pipeline gains its key after one generation."""
    if "first_call_cache" not in mod._buffers:
        mod.register_buffer("first_call_cache", torch.arange(4.0, device=args[0].device))


def build_caches_on_first_call(seed: int = 0) -> Flux2Pipeline:
    pipeline = build_pipeline(seed)
    pipeline.transformer.register_forward_pre_hook(_cache_on_first_call)
    return pipeline
