"""Note [Deferred interrupts]: a real Ctrl-C (SIGINT) during ``enable()`` or ``disable()``.

An outside review (round 2) interrupted both at every line: a KeyboardInterrupt while disable
removed hooks gave NaN generations afterwards, one in the model-level swapper's release left a
pipeline that failed every call and every disable, one between a hook's registration and its
undo entry left a hook that made every later enable fail.  SIGINT is now recorded during those
sections: disable runs to its end and then raises, enable rolls back at a safe point.  Each
test sends a real signal from inside the section."""

from __future__ import annotations

import signal
import threading

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, backend_of, get_offload_backend
from offload_ref.backends import groups as groups_module
from offload_ref.fixtures import get_spec
from offload_ref.hooks import HookRegistry, hook_names
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="SIGINT is delivered to the main thread only")

SPEC = get_spec("flux2")


def _run(pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**SPEC.make_inputs())


def _signal_on_call(monkeypatch, owner, name: str, call: int, *, after: bool = False
                    ) -> list[int]:
    """Send SIGINT to this process from inside the ``call``-th call of ``owner.name`` (as it
    starts, or ``after`` it did its work: just before the caller's next line)."""
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call and not after:
            signal.raise_signal(signal.SIGINT)
        out = original(*args, **kwargs)
        if calls[0] == call and after:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _plain(pipeline: nn.Module) -> None:
    assert backend_of(pipeline) is None
    assert all(type(p) is nn.Parameter for p in pipeline.parameters())
    assert all(type(b) is torch.Tensor for b in pipeline.buffers())
    hooked = [n for n, m in pipeline.named_modules() if hook_names(m)]
    assert not hooked, hooked


def _recovered(backend, platform: CpuPlatform, pipeline: nn.Module,
               reference: torch.Tensor) -> None:
    """After the interrupted call: disabled, plain, nothing held, exact, and it can be offloaded
    again exactly (``reference``: the output on the host, for the disabled pipeline; enabled, it
    computes on the device and matches the whole pipeline there)."""
    assert not backend.is_enabled()
    _plain(pipeline)
    assert platform.memory_allocated() == 0 and platform.host_allocated() == 0
    assert torch.equal(_run(pipeline), reference)  # both on the host
    backend.enable(pipeline)
    assert torch.equal(_run(pipeline), _run(resident(SPEC.build())))  # both on the device
    backend.disable()


@pytest.mark.parametrize("strategy,owner,name,call", [
    ("layer_wise", HookRegistry, "remove_hook", 13),  # the review's NaN generations
    ("model_level", groups_module.ComponentSwapper, "release", 1),  # its bricked pipeline
    ("model_level", HookRegistry, "remove_hook", 2),
])
def test_ctrl_c_during_disable_finishes_the_disable_then_raises(monkeypatch, strategy, owner,
                                                                name, call) -> None:
    reference = _run(SPEC.build())
    pipeline = SPEC.build()
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    _run(pipeline)
    calls = _signal_on_call(monkeypatch, owner, name, call)
    with pytest.raises(KeyboardInterrupt):
        backend.disable()
    assert calls[0] >= call, "the signal was sent inside disable"
    monkeypatch.undo()
    _recovered(backend, platform, pipeline, reference)


@pytest.mark.parametrize("strategy,owner,name,call", [
    ("layer_wise", HookRegistry, "register_hook", 2),  # the review's leaked hook
    ("layer_wise", groups_module.Layout, "pack_into", 2),  # while host masters are copied
    ("model_level", groups_module.Layout, "pack_into", 1),
])
def test_ctrl_c_during_enable_rolls_it_back(monkeypatch, strategy, owner, name, call) -> None:
    reference = _run(SPEC.build())
    pipeline = SPEC.build()
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    calls = _signal_on_call(monkeypatch, owner, name, call, after=True)
    with pytest.raises(KeyboardInterrupt):
        backend.enable(pipeline)
    assert calls[0] >= call, "the signal was sent inside enable"
    monkeypatch.undo()
    _recovered(backend, platform, pipeline, reference)


def test_the_handler_is_restored_and_generation_stays_interruptible() -> None:
    before = signal.getsignal(signal.SIGINT)
    pipeline = SPEC.build()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=CpuPlatform())
    backend.enable(pipeline)
    assert signal.getsignal(signal.SIGINT) is before
    block = backend.rings[0].blocks[1]
    handle = block.register_forward_pre_hook(
        lambda m, a: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):  # not deferred: a generation stops at once
        _run(pipeline)
    handle.remove()
    backend.disable()
    assert signal.getsignal(signal.SIGINT) is before
