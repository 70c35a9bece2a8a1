"""A block's own torch hooks run inside the offloader's (Note [Outermost hooks] in layerwise.py).

A forward hook registered after ``enable`` and a pre-hook registered before it both read the
block's weights; without the ordering they read the NaN placeholders of layerwise offload.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import host, resident  # noqa: E402 (tests/ is on sys.path)


def _blocks(pipeline: nn.Module) -> list[nn.Module]:
    return list(pipeline.transformer.transformer_blocks)


def _first_weight(module: nn.Module) -> torch.Tensor:
    return next(p for p in module.parameters() if p.is_floating_point())


def _post(module: nn.Module, args: tuple, output: torch.Tensor):
    if isinstance(output, tuple):
        return (output[0] + _first_weight(module).mean(), *output[1:])
    return output + _first_weight(module).mean()


def _pre(module: nn.Module, args: tuple):
    return (args[0] * (1 + _first_weight(module).mean()), *args[1:])


def _register(pipeline: nn.Module, kind: str) -> None:
    for block in _blocks(pipeline):
        if kind == "forward hook":
            block.register_forward_hook(_post)
        else:
            block.register_forward_pre_hook(_pre)


def _backend(strategy: str):
    platform = CpuPlatform(race_amplifier=True)
    if strategy == "layer_wise, prefetch off":  # every block is on placeholders until its load
        return LayerWiseOffloadBackend(OffloadConfig(strategy="layer_wise"), platform,
                                       prefetch=False)
    return get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)


@pytest.mark.parametrize("strategy", ["layer_wise", "layer_wise, prefetch off", "model_level"])
@pytest.mark.parametrize("kind,when", [("forward hook", "after"), ("forward hook", "before"),
                                       ("pre-hook", "before"), ("pre-hook", "after")])
def test_a_blocks_own_hooks_read_its_true_weights(strategy: str, kind: str, when: str) -> None:
    spec = get_spec("flux2")
    reference = resident(spec.build())
    _register(reference, kind)
    with torch.inference_mode():
        want = reference(**spec.make_inputs())
    pipeline = spec.build()
    backend = _backend(strategy)
    if when == "before":
        _register(pipeline, kind)
    backend.enable(pipeline)
    try:
        if when == "after":
            _register(pipeline, kind)
        for _ in range(2):
            with torch.inference_mode():
                got = pipeline(**spec.make_inputs())
            assert torch.equal(got, want), f"a block's {kind} registered {when} enable " \
                "read other weights than the block's"
    finally:
        backend.disable()
    with torch.inference_mode():  # disabled: on the host again
        assert torch.equal(pipeline(**spec.make_inputs()), host(want))


def test_a_hook_marked_after_offload_sees_what_the_offloader_leaves() -> None:
    """``offload_ref.hooks.after_offload``: an observer registered after enable runs after the
    layerwise post-hook, so it sees the block released (no slot storage left)."""
    from offload_ref.hooks import after_offload

    spec = get_spec("flux2")
    pipeline = spec.build()
    platform = CpuPlatform()
    backend = LayerWiseOffloadBackend(OffloadConfig(strategy="layer_wise"), platform)
    backend.enable(pipeline)
    seen: dict[str, list[bool]] = {"inside": [], "after": []}

    def inside(module: nn.Module, args: tuple, output: object) -> None:
        seen["inside"].append(platform.is_resident(_first_weight(module)))

    def after(module: nn.Module, args: tuple, output: object) -> None:
        seen["after"].append(platform.is_resident(_first_weight(module)))

    try:
        for block in _blocks(pipeline):
            block.register_forward_hook(after_offload(after))
            block.register_forward_hook(inside)
        with torch.inference_mode():
            pipeline(**spec.make_inputs())
    finally:
        backend.disable()
    assert seen["inside"] and all(seen["inside"]), "an unmarked hook runs with the weights placed"
    assert seen["after"] and not any(seen["after"]), "a marked hook runs after the release"
