"""Small pipelines and offloaders for tests/test_blame.py: each case has one party at fault.

Offloaders at fault (written against the public protocol, like an engine's own): one that moves
parameters but no non-persistent buffer, one that streams the blocks and leaves the DiT's other
state on the host, one whose hooks remove themselves after their first call.  Pipelines at fault,
judged under a correct foreign offloader (:class:`~offload_ref.contracts.simple_offloader.
SimpleOffloader`) and under offload-ref: a module-level cache filled while enabled and used after
``disable()``, a table kept on a module across calls, a block run through ``block.forward``.  And
a pipeline that registers, during its first call (after ``enable()``), a forward hook on a block
that reads the block's weight.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery
from offload_ref.contracts import PipelineSpec
from offload_ref.contracts.simple_offloader import SimpleOffloader, _Unit

DIM = 16
STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)
        # a RoPE-like table: registered, not in state_dict()
        self.register_buffer("freqs", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x)) * self.freqs


class DiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.proj_out = nn.Linear(DIM, DIM)

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x) + cond
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.proj_out(x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.embed(ids)).mean(dim=1, keepdim=True)


class Pipeline(nn.Module, SupportsComponentDiscovery):
    """Correct: inputs on the execution device (the VAE's, which every strategy keeps on the
    device: any offloader's), noise from a host generator, every module called through
    ``__call__``."""

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ["blocks"]})
    transformer_class: ClassVar[type[nn.Module]] = DiT

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = Encoder()
        self.transformer = self.transformer_class()
        self.vae = nn.Linear(DIM, DIM)

    def prepare(self, device: torch.device) -> None:
        """Hook for the subclasses: called at the start of every generation."""

    def forward(self, prompt_ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
        device = self.vae.weight.device
        self.prepare(device)
        cond = self.text_encoder(prompt_ids.to(device))
        g = torch.Generator("cpu").manual_seed(seed)
        x = torch.randn(1, 4, DIM, generator=g).to(device)
        for _ in range(STEPS):
            x = self.transformer(x, cond)
        return self.vae(x)


# -- pipelines at fault --------------------------------------------------------------------------

_CACHE: dict[tuple[int, ...], torch.Tensor] = {}


class _GlobalCacheDiT(DiT):
    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        # a module-level cache keyed by shape only: filled on the device while enabled
        ramp = _CACHE.get(tuple(x.shape))
        if ramp is None:
            ramp = _CACHE[tuple(x.shape)] = torch.linspace(0, 1, x.shape[-1], device=x.device)
        return super().forward(x * ramp, cond)


class GlobalCache(Pipeline):
    """Bug: a cache outside every module, keyed by shape, not device."""

    transformer_class = _GlobalCacheDiT


class _TableDiT(DiT):
    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if "table" not in self.__dict__:  # a plain attribute, made on the first call's device
            self.table = torch.linspace(0, 1, x.shape[-1], device=x.device)
        return super().forward(x * self.table, cond)


class KeepsTable(Pipeline):
    """Bug: a table kept on the transformer as a plain attribute across calls."""

    transformer_class = _TableDiT


class _ForwardCallDiT(DiT):
    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block.forward(x)  # around the block's hooks


class CallsBlockForward(Pipeline):
    """Bug: the DiT runs its blocks through ``block.forward(...)``."""

    transformer_class = _ForwardCallDiT


def read_block_weight(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A user's forward hook: adds a row of the block's weight to its output."""
    return output + 0.01 * module.lin.weight[0]


class HooksAfterEnable(Pipeline):
    """Registers, during its first call (so after ``enable()``), a forward hook on block 1 that
    reads the block's weight (an analysis tool attached lazily)."""

    def prepare(self, device: torch.device) -> None:
        if "hooked" not in self.__dict__:
            self.hooked = True
            self.transformer.blocks[1].register_forward_hook(read_block_weight)


def _inputs(seed: int = 0) -> dict[str, Any]:
    return {"prompt_ids": torch.arange(6).reshape(1, 6) % 32, "seed": seed}


PIPELINES: dict[str, type[Pipeline]] = {
    "correct": Pipeline,
    "global_cache": GlobalCache,
    "keeps_table": KeepsTable,
    "calls_block_forward": CallsBlockForward,
    "hooks_after_enable": HooksAfterEnable,
}


def build(name: str) -> Any:
    def factory(seed: int = 0) -> Pipeline:
        torch.manual_seed(seed)
        _CACHE.clear()
        return PIPELINES[name]()

    return factory


def spec_of(name: str, strategies: tuple[str, ...] = ("model_level", "layer_wise")
            ) -> PipelineSpec:
    return PipelineSpec(name=f"blame_{name}", factory=f"{__name__}:build_{name}",
                        inputs=f"{__name__}:_inputs", strategies=strategies)


for _name in PIPELINES:
    globals()[f"build_{_name}"] = build(_name)


# -- offloaders at fault -------------------------------------------------------------------------


class ParamsOnly(SimpleOffloader):
    """Moves parameters and persistent buffers (what ``state_dict()`` lists), never a
    non-persistent buffer."""

    def enable(self, pipeline: Any) -> None:
        self._non_persistent = {id(m._buffers): set(m._non_persistent_buffers_set)
                                for m in pipeline.modules()}
        super().enable(pipeline)

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        units, rest = super()._units(pipeline)
        for unit in units:
            self._drop(unit)
        return units, rest

    def _drop(self, unit: _Unit) -> None:
        keep = [k for k, (registry, key, is_param) in enumerate(unit.entries)
                if is_param or key not in self._non_persistent.get(id(registry), ())]
        unit.entries = [unit.entries[k] for k in keep]
        unit.host = [unit.host[k] for k in keep]


class BlocksOnly(SimpleOffloader):
    """Layerwise: streams the DiT's blocks and keeps the encoder and the VAE on the device, but
    leaves the DiT's state outside its blocks (``proj_in``, ``proj_out``) on the host."""

    def _units(self, pipeline: Any) -> tuple[list[_Unit], list[nn.Module]]:
        units, rest = super()._units(pipeline)
        blocks = {id(m) for u in units for b in u.modules for m in b.modules()}
        dit = {id(m._parameters) for m in pipeline.transformer.modules() if id(m) not in blocks}
        return units, [m for m in rest if id(m._parameters) not in dit]


class HooksRemoveThemselves(SimpleOffloader):
    """Each unit's pre-hook removes itself after its first call (a one-shot "warm-up" hook)."""

    def enable(self, pipeline: Any) -> None:
        super().enable(pipeline)
        pre = [h for h in self.handles[::2]]
        for handle in pre:
            hooks = _hooks_dict_of(pipeline, handle.id)
            if hooks is None:
                continue
            inner = hooks[handle.id]

            def once(m, args, kwargs, inner=inner, handle=handle):  # noqa: ANN001
                out = inner(m, args, kwargs)
                handle.remove()
                return out

            hooks[handle.id] = once


def _hooks_dict_of(pipeline: nn.Module, hook_id: int) -> Any:
    for module in pipeline.modules():
        if hook_id in module._forward_pre_hooks:
            return module._forward_pre_hooks
    return None


def params_only(device: torch.device, strategy: str) -> SimpleOffloader:
    return ParamsOnly(device, strategy)


def blocks_only(device: torch.device, strategy: str) -> SimpleOffloader:
    if strategy != "layer_wise":
        raise NotImplementedError("blocks_only streams blocks only")
    return BlocksOnly(device, strategy)


def hooks_remove_themselves(device: torch.device, strategy: str) -> SimpleOffloader:
    return HooksRemoveThemselves(device, strategy)
