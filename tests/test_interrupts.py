"""Interrupts and faults (issue 9, catalogue §J.1-2): a KeyboardInterrupt inside a block or
inside the offloader's own hook work, a failed swap, a fault on the copy stream.  torch runs
``always_call`` forward hooks for ``Exception`` only, so a ``BaseException`` skips our post-hooks.
Each test failed on the code before its fix."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn

import offload_ref
import offload_ref.platform.cpu as cpu_platform
from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform, StreamOrderError
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)


def _generate(spec, pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _reference(spec) -> torch.Tensor:
    """The un-offloaded output: the whole pipeline on the device, where an offloaded run
    computes (compared there, bit for bit)."""
    return _generate(spec, resident(spec.build()))


def _interrupt_inside(block: nn.Module) -> None:
    """Raise KeyboardInterrupt once, inside ``block``'s forward (from its first submodule)."""
    sub = next(block.children())

    def hook(module, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = sub.register_forward_pre_hook(hook)


# -- 1. Ctrl-C inside a block ----------------------------------------------------------------


def test_interrupts_inside_blocks_leave_the_ring_exact_and_prefetching() -> None:
    spec = get_spec("flux2")
    reference = _reference(spec)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    pipeline = spec.build()
    backend.enable(pipeline)
    ring = backend.rings[0]

    def recoveries_of_one_generation() -> int:
        before = backend.stats().sync_recoveries
        assert torch.equal(_generate(spec, pipeline), reference)
        return backend.stats().sync_recoveries - before

    clean = [recoveries_of_one_generation() for _ in range(2)]
    for j in (1, 3, 3, 0):  # a second interrupt in another block used to wedge the ring
        _interrupt_inside(ring.blocks[j])
        with pytest.raises(KeyboardInterrupt):
            _generate(spec, pipeline)
        # The next pass starts cold (its first block was never prefetched: one load), then
        # prefetches exactly as a clean run does.
        assert recoveries_of_one_generation() <= clean[-1] + 1
        assert recoveries_of_one_generation() == clean[-1]
        assert ring.running == []
    assert not platform.hazards
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.inner(y) if self.inner is not None else y


class _Dit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.blocks[1].__dict__["inner"] = self.blocks[3]  # block 1 calls block 3 (nested)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:3]:
            x = block(x)
        return x


class _Pipe(nn.Module, offload_ref.SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(8, 8)
        self.transformer = _Dit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(offload_ref.execution_device(self))  # inputs go where the pipeline computes
        return self.transformer(self.text_encoder(x))


def _pipe() -> _Pipe:
    torch.manual_seed(0)
    return _Pipe()


@pytest.mark.parametrize("where", [1, 3], ids=["outer", "nested"])
def test_an_interrupt_inside_a_nested_block_call_recovers(where: int) -> None:
    pipeline, x = _pipe(), torch.randn(2, 8)
    with torch.inference_mode():
        reference = resident(_pipe())(x)  # the same weights, whole on the device
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    backend.enable(pipeline)
    for _ in range(3):
        _interrupt_inside(pipeline.transformer.blocks[where])
        with pytest.raises(KeyboardInterrupt), torch.inference_mode():
            pipeline(x)
        for _ in range(2):
            with torch.inference_mode():
                assert torch.equal(pipeline(x), reference)
    assert not platform.hazards
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


# -- 2. Ctrl-C inside the offloader's own hook work (a deterministic line-event fuzz) ----------

_PACKAGE = os.path.dirname(offload_ref.__file__) + os.sep
# The platform plays the device runtime: its calls are atomic to the offloader, as CUDA's are.
_RUNTIME = os.path.join(_PACKAGE, "platform") + os.sep


class _LineInterrupter:
    """Counts line events in the offloader's frames; raises KeyboardInterrupt at the ``at``-th,
    or with ``line=(filename, lineno)`` at the first line event of that line."""

    def __init__(self, at: int | None, *, line: tuple[str, int] | None = None) -> None:
        self.at = at
        self.line = line
        self.count = 0

    def _global(self, frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and not name.startswith(_RUNTIME):
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt(f"line event {self.at}")
            if self.line is not None and (frame.f_code.co_filename, frame.f_lineno) == self.line:
                self.line = None
                self.at = self.count  # fired: ``at`` says where
                raise KeyboardInterrupt(f"line {frame.f_lineno}")
        return self._local

    def __enter__(self) -> _LineInterrupter:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.settrace(None)


def _interrupt_everywhere(generate, reference: torch.Tensor, positions: int,
                          check=lambda where: None) -> None:
    """Interrupt ``generate()`` at ``positions`` line events spread over the offloader's work
    of one generation; after each, a generation must be exact and ``check(where)`` pass."""
    with _LineInterrupter(None) as counter:
        assert torch.equal(generate(), reference)
    total = counter.count
    assert total > positions
    interrupted = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about silenced always_call hook errors
        for i in range(positions):
            at = 1 + i * (total - 1) // (positions - 1)
            try:
                with _LineInterrupter(at):
                    generate()
            except KeyboardInterrupt:
                interrupted += 1
            where = f"interrupt at line event {at} of {total}"
            try:
                out = generate()
            except StreamOrderError as exc:
                pytest.fail(f"{where}: {exc}")
            assert torch.equal(out, reference), where
            check(where)
    assert interrupted >= positions * 9 // 10


@pytest.mark.parametrize("name,strategy,positions", [("flux2", "layer_wise", 100),
                                                     ("wan22_t2v", "model_level", 80)])
def test_an_interrupt_at_any_line_of_the_hook_work_is_recovered(name: str, strategy: str,
                                                                 positions: int) -> None:
    spec = get_spec(name)
    reference = _reference(spec)
    platform = CpuPlatform(race_amplifier=True, max_delay_s=0.0005)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    pipeline = spec.build()
    backend.enable(pipeline)
    _interrupt_everywhere(lambda: _generate(spec, pipeline), reference, positions)
    assert not platform.hazards, platform.hazards[:1]
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


def test_an_interrupted_call_order_update_is_repaired() -> None:
    """Found by the fuzz above at 600 positions: an interrupt inside ``observe`` (or the trim
    of its history) left a match index past the end, so every later prediction raised."""
    from offload_ref.backends.predictor import CallOrderPredictor

    calls = [0, 1, 2] * 10  # a cap of 24 calls: the history is trimmed on the way
    predictor = CallOrderPredictor(3, history=8)
    with _LineInterrupter(None) as counter:
        for k in calls:
            predictor.observe(k)
    for at in range(1, counter.count + 1):
        predictor = CallOrderPredictor(3, history=8)
        with pytest.raises(KeyboardInterrupt), _LineInterrupter(at):
            for k in calls:
                predictor.observe(k)
        predictor.repair()
        misses = 0
        for i, k in enumerate([0, 1, 2] * 8):  # an irregular history is relearned, no error
            predictor.observe(k)
            misses += i >= 18 and predictor.predict(k) != (k + 1) % 3
        assert misses == 0, at


# -- 3. a failed or interrupted swap leaks nothing -----------------------------------------------


def _failing_once(exc: BaseException, real, *, after: int = 0):
    calls = []

    def fn(*args, **kwargs):
        calls.append(args)
        if len(calls) == after + 1:
            raise exc
        return real(*args, **kwargs)

    return fn


def test_an_interrupted_model_level_offload_leaks_no_device_buffer() -> None:
    spec = get_spec("wan22_t2v")
    reference = _reference(spec)
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=platform)
    pipeline = spec.build()
    backend.enable(pipeline)
    _generate(spec, pipeline)
    real = platform.discard
    platform.discard = _failing_once(KeyboardInterrupt(), real)  # inside the next offload
    with pytest.raises(KeyboardInterrupt):
        _generate(spec, pipeline)
    platform.discard = real
    assert torch.equal(_generate(spec, pipeline), reference)
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


@pytest.mark.parametrize("strategy", ["layer_wise", "model_level"])
def test_an_interrupted_enable_leaks_nothing_and_can_be_retried(strategy: str) -> None:
    spec = get_spec("flux2")
    reference = _reference(spec)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    steps: list[str] = []
    backend.fault_injector = lambda index, label: steps.append(label)
    pipeline = spec.build()
    backend.enable(pipeline)
    backend.disable()
    for k in range(len(steps)):
        def interrupt(index: int, label: str, k: int = k) -> None:
            if index == k:
                raise KeyboardInterrupt(label)

        backend.fault_injector = interrupt
        with pytest.raises(KeyboardInterrupt):
            backend.enable(pipeline)
        assert not backend.is_enabled()
        assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0), steps[k]
    backend.fault_injector = None
    backend.enable(pipeline)
    assert torch.equal(_generate(spec, pipeline), reference)
    backend.disable()
    platform.close()


# -- 4. a fault on the copy stream surfaces once; a re-enable starts clean --------------------


def test_a_copy_stream_fault_surfaces_and_a_re_enable_starts_clean(monkeypatch) -> None:
    spec = get_spec("flux2")
    reference = _reference(spec)
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    pipeline = spec.build()
    backend.enable(pipeline)
    real = cpu_platform._plain_copy
    calls = []

    def faulty(dst, src):
        calls.append(dst)
        if len(calls) == 3:
            def fail() -> None:
                raise RuntimeError("injected copy fault")

            return fail
        return real(dst, src)

    monkeypatch.setattr(cpu_platform, "_plain_copy", faulty)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="injected copy fault"):
            _generate(spec, pipeline)  # loudly, at the generation where it happened
    monkeypatch.setattr(cpu_platform, "_plain_copy", real)
    backend.disable()  # the fault was already reported: disable succeeds
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    backend.enable(pipeline)
    for _ in range(2):
        assert torch.equal(_generate(spec, pipeline), reference)
    backend.disable()
    platform.close()


def test_an_interrupt_at_any_line_of_an_outside_part_call_is_recovered() -> None:
    # The model calls a part of block 0 after its block loop (Note [Block parts] in ring.py);
    # a KeyboardInterrupt at any line of the offloader's work, the one-shot post-hook of that
    # call included (Note [One-shot part post-hooks] in layerwise.py), leaves the next
    # generation exact and no post-hook behind.
    from test_backend_edges import _forward_hooks, _submodule_pipe

    x, labels = torch.randn(2, 16), torch.tensor([1, 7])
    with torch.inference_mode():
        reference = resident(_submodule_pipe())(x, labels)
    platform = CpuPlatform(race_amplifier=True, max_delay_s=0.0005)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    pipeline = _submodule_pipe()
    backend.enable(pipeline)
    enabled = _forward_hooks(pipeline)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return pipeline(x, labels)

    def no_hook_left(where: str) -> None:
        assert _forward_hooks(pipeline) == enabled, where

    _interrupt_everywhere(generate, reference, 60, no_hook_left)
    assert not platform.hazards, platform.hazards[:1]
    backend.disable()
    assert _forward_hooks(pipeline) == 0
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


def test_an_interrupt_right_after_registering_a_one_shot_leaks_no_hook() -> None:
    # The first line event after a one-shot post-hook is registered: the call will not run, so
    # the pre-hook's own handler must remove the hook.
    import inspect

    from offload_ref.backends import layerwise
    from test_backend_edges import _enabled_submodule_pipe, _forward_hooks

    lines, first = inspect.getsourcelines(layerwise.LayerWisePartHook.pre_forward)
    lineno = first + next(i for i, line in enumerate(lines) if "refuse_autograd(" in line)
    (x, labels), reference, platform, backend, pipeline = _enabled_submodule_pipe()
    enabled = _forward_hooks(pipeline)
    interrupter = _LineInterrupter(None, line=(inspect.getsourcefile(layerwise), lineno))
    with pytest.raises(KeyboardInterrupt), interrupter, torch.inference_mode():
        pipeline(x, labels)
    assert interrupter.at is not None  # it fired on that line
    with torch.inference_mode():
        assert torch.equal(pipeline(x, labels), reference)
    assert _forward_hooks(pipeline) == enabled
    backend.disable()
    assert _forward_hooks(pipeline) == 0
    platform.close()
