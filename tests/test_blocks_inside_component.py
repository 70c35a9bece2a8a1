"""Note [Blocks inside their component] (offload_ref/backends/layerwise.py): a streamed block
called from inside its DiT's forward takes no call-guard entry of its own (the DiT's component
entry refuses every other thread); every other block call enters the guard as before."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_ref import OffloadConcurrencyError, OffloadConfig
from offload_ref.backends.call_guard import CallGuard
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.fixtures import get_spec
from offload_ref.platform import get_platform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)


class _CountingGuard(CallGuard):
    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.entered: list[str] = []

    def enter(self, label, frame):
        self.entered.append(label)
        return super().enter(label, frame)


class _Counted(LayerWiseOffloadBackend):
    call_guard_class = _CountingGuard


def _generate(spec, pipeline):
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _enabled():
    """flux2's resident output, and a flux2 pipeline enabled under layerwise with a counting
    guard."""
    spec = get_spec("flux2")
    reference = _generate(spec, resident(spec.build()))
    pipeline = spec.build()
    backend = _Counted(OffloadConfig(strategy="layer_wise"), get_platform())
    backend.enable(pipeline)
    return spec, reference, pipeline, backend


def test_blocks_inside_the_dit_take_no_entry_and_a_direct_call_does():
    spec, reference, pipeline, backend = _enabled()
    try:
        guard = backend._guard
        assert torch.equal(_generate(spec, pipeline), reference)
        blocks = [label for label in guard.entered if "transformer_blocks." in label]
        assert blocks == [], blocks[:3]  # every block ran inside the DiT's component entry
        assert not guard._inside and not guard._components  # nothing left behind
        block = pipeline.transformer.transformer_blocks[1]
        with pytest.raises(TypeError):  # no arguments: its forward fails after the pre-hook
            block()
        assert guard.entered[-1] == "transformer.transformer_blocks.1"  # outside the DiT
        assert not guard._inside  # the failed call's post-hook left the guard
        assert torch.equal(_generate(spec, pipeline), reference)
    finally:
        backend.disable()


class _Pause:
    """Holds the first thread inside block 0's forward until released."""

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, module, args):
        if threading.current_thread().name == "first" and not self.inside.is_set():
            self.inside.set()
            self.release.wait(timeout=30)


@pytest.mark.parametrize("target", ["transformer_blocks.1", "transformer_blocks.0.attn.to_q"])
def test_another_threads_direct_call_is_refused_while_the_dit_runs(target):
    # Thread B calls a block, or a part of the very block thread A is inside, directly while A
    # runs the DiT: A's component entry refuses it (before, B's own block entry did).
    spec, reference, pipeline, backend = _enabled()
    pause = _Pause()
    handle = pipeline.transformer.transformer_blocks[0].register_forward_pre_hook(pause)
    result = {}

    def first():
        try:
            result["out"] = _generate(spec, pipeline)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=first, name="first", daemon=True)
    try:
        thread.start()
        assert pause.inside.wait(timeout=30)
        module = pipeline.transformer.get_submodule(target)
        with pytest.raises(OffloadConcurrencyError, match="one thread at a time"):
            module(torch.zeros(1))
    finally:
        pause.release.set()
        thread.join(timeout=30)
        handle.remove()
    try:
        assert "error" not in result, result.get("error")
        assert torch.equal(result["out"], reference)  # the first thread's generation is exact
        assert torch.equal(_generate(spec, pipeline), reference)
    finally:
        backend.disable()


def test_an_interrupt_inside_a_block_leaves_no_shortcut_behind():
    # A Ctrl-C inside block 0 skips the DiT's post-hook: its component frame stays recorded.
    # A block called directly afterwards is not inside that frame and enters the guard.
    spec, reference, pipeline, backend = _enabled()
    try:
        guard = backend._guard

        def interrupt(module, args):
            raise KeyboardInterrupt

        handle = pipeline.transformer.transformer_blocks[0].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            _generate(spec, pipeline)
        handle.remove()
        before = len(guard.entered)
        with pytest.raises(TypeError):
            pipeline.transformer.transformer_blocks[1]()
        assert guard.entered[before:] == ["transformer.transformer_blocks.1"]
        assert torch.equal(_generate(spec, pipeline), reference)
    finally:
        backend.disable()
