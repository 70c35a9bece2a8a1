"""F.2 between passes, on a DiT whose forward calls its declared containers in another order
than declared (found by an outside model author on Lumina2 with its refiners declared in
``__init__`` order): the ring learns the call order, so after a generation the block kept on
the device is the one each pass calls first, not block 0 of the declaration."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery, execution_device
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing
from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION
from offload_ref.contracts.mutants._declare import backend_with, with_ring
from offload_ref.contracts.runner import run_checks

F2 = "check_layerwise_materializes_only_block_zero_between_passes"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(_Block() for _ in range(2))  # declared first,
        self.second = nn.ModuleList(_Block() for _ in range(2))  # called first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.second, *self.first]:
            x = block(x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("first", "second")})

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(8, 8)
        self.transformer = _Dit()

    def forward(self, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
        x = self.text_encoder(x.to(execution_device(self)))
        for _ in range(steps):
            x = self.transformer(x)
        return x


def _build() -> _Pipe:  # called under torch.manual_seed(seed) by the kit
    return _Pipe().eval().requires_grad_(False)


def _inputs(seed: int = 0) -> dict:
    return {"x": torch.randn(1, 8, generator=torch.Generator().manual_seed(seed))}


SPEC = PipelineSpec(name="declared_out_of_call_order", factory=_build, inputs=_inputs,
                    strategies=("layer_wise",))


class _WrapsToDeclaredZero(BlockRing):
    """Prefetches declared block 0 after the last block of a pass, whatever the call order."""

    def after(self, k):
        super().after(k)
        calls = self.order.history
        if len(calls) % len(self.blocks) == 0 and self.slot_of[0] is None:
            self._load(0, self._recovery_slot(0))  # and drop the block predicted first
            for s, slot in enumerate(self.slots):
                if slot.occupant not in (None, 0):
                    self.evict(s)


def _run(impl=DEFAULT_IMPLEMENTATION):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([SPEC], checks=[F2], include_global=False, impl=impl)
    return result


def test_the_block_each_pass_calls_first_stays_on_the_device():
    result = _run()
    assert result.outcome == "passed", result.message


def test_a_ring_that_wraps_to_declared_block_zero_fails_and_is_told_the_call_order():
    impl = DEFAULT_IMPLEMENTATION.replace(
        name="wraps_to_declared_zero",
        make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_WrapsToDeclaredZero)))
    result = _run(impl)
    assert result.outcome == "failed", result.message
    assert "expected exactly [2]" in result.message
    assert "transformer.second.0" in result.message
    assert "another order than they are declared" in result.message


class _SkipsOnItsFirstStep(nn.Module):
    """Declared order = call order, but the first step of each generation skips block 0 (a
    cache that has nothing to reuse yet): the passes differ, so which block the ring holds after
    a generation is the predictor's business; exactly one (an outside re-review: the check
    expected block 1 there, and blamed the container order)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(_Block() for _ in range(2))
        self.second = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        blocks = [*self.first, *self.second]
        for block in blocks[1:] if step == 0 else blocks:
            x = block(x)
        return x


class _SkipPipe(_Pipe):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = _SkipsOnItsFirstStep()

    def forward(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        x = self.text_encoder(x.to(execution_device(self)))
        for step in range(steps):
            x = self.transformer(x, step)
        return x


def test_passes_that_differ_ask_for_exactly_one_block():
    spec = PipelineSpec(name="skips_on_its_first_step", factory=lambda: _SkipPipe().eval(),
                        inputs=_inputs, strategies=("layer_wise",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([spec], checks=[F2], include_global=False)
    assert result.outcome == "passed", result.message
