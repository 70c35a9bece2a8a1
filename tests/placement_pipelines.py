"""Pipelines with one placement bug each (tests/test_placement.py).  Each passes the kit when
host and device are both the CPU, and breaks a GPU generation: on the simulated accelerator it
fails with torch's same-device error."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload_ref import execution_device
from offload_ref.contracts import PipelineSpec
from offload_ref.fixtures._common import (TextEncoder, build, modulate, patchify, prompt_inputs,
                                          timesteps, unpatchify)
from offload_ref.fixtures._mmdit import JointTransformerBlock
from offload_ref.fixtures.sd3 import (CLIP_DIM, TIED_BLOCK, SD3Transformer2DModel,
                                      StableDiffusion3Pipeline)


class HostInputsPipeline(StableDiffusion3Pipeline):
    """Bug: the prompt and the noise stay on the host (the pipeline never moves its inputs)."""

    def execution_device(self) -> torch.device:
        return torch.device("cpu")


class DeviceFromOffloadedComponentPipeline(StableDiffusion3Pipeline):
    """Bug: the execution device is read from the transformer, which model-level offload parks on
    the host between its calls (diffusers' ``self.device`` without hooks)."""

    def execution_device(self) -> torch.device:
        return next(self.transformer.parameters()).device


class AdapterPipeline(StableDiffusion3Pipeline):
    """Correct as it is; an ``adapter`` module attached later (a LoRA-like add-on) is applied to
    the transformer's output."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        out = super().predict(latents, sigma, step, cond)
        adapter = self.__dict__.get("_modules", {}).get("adapter")
        return out if adapter is None else out + adapter(out)


class AttachesAdapterInItsCall(AdapterPipeline):
    """Attaches its ``adapter`` during its first call, while offload is enabled."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        if "adapter" not in self._modules:
            adapter = torch.nn.Linear(latents.shape[-1], latents.shape[-1])
            with torch.no_grad():
                adapter.weight.fill_(0.01), adapter.bias.zero_()
            self.adapter = adapter.to(latents.device)
        return super().predict(latents, sigma, step, cond)


def build_attaches_adapter(seed: int = 0) -> AttachesAdapterInItsCall:
    return build(AttachesAdapterInItsCall, seed)


def _spec(name: str, cls: str) -> PipelineSpec:
    return PipelineSpec(name=name, factory=f"{__name__}:build_{cls}",
                        inputs=f"{__name__}:make_inputs",
                        strategies=("model_level", "layer_wise"))


def build_host_inputs(seed: int = 0) -> HostInputsPipeline:
    return build(HostInputsPipeline, seed)


def build_device_from_offloaded(seed: int = 0) -> DeviceFromOffloadedComponentPipeline:
    return build(DeviceFromOffloadedComponentPipeline, seed)


def build_adapter(seed: int = 0) -> AdapterPipeline:
    return build(AdapterPipeline, seed)


def make_inputs(seed: int = 0) -> dict[str, Any]:
    return prompt_inputs(seed)


HOST_INPUTS = _spec("host_inputs", "host_inputs")
DEVICE_FROM_OFFLOADED = _spec("device_from_offloaded", "device_from_offloaded")


# -- one pipeline per class of placement bug (issue 22) -----------------------------------------
# Each computes exactly like StableDiffusion3Pipeline when host and device are one device, and
# breaks (or silently changes) a generation where they differ.  BUGS maps a name to the class and
# the strategies under which it breaks a GPU generation.


class _Encoder(TextEncoder):
    """A text encoder with a second entry point, as transformers' ``get_text_features``."""

    def encode(self, input_ids: torch.Tensor) -> Any:
        return self.forward(input_ids)


class _CachingBlock(JointTransformerBlock):
    """Keeps a view of its own weight on the module after its first call (class 5)."""

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                rope: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        if "gate_row" not in self.__dict__:
            self.gate_row = self.img_mod.weight[0]  # a view of a streamed weight, kept
        context, hidden = super().forward(hidden, context, temb, rope)
        return context, hidden + 0.01 * self.gate_row[: hidden.shape[-1]]


class _Transformer(SD3Transformer2DModel):
    """SD3's DiT with its block loop written out, so that each bug below can change one line."""

    def __init__(self, block: type[nn.Module] = JointTransformerBlock) -> None:
        super().__init__()
        if block is not JointTransformerBlock:
            self.transformer_blocks = nn.ModuleList(block() for _ in self.transformer_blocks)
            tied = self.transformer_blocks[TIED_BLOCK].attn.to_q.weight
            self.register_buffer("tied_view", tied.data[1], persistent=False)

    def run_block(self, block: nn.Module, *args: Any) -> Any:
        return block(*args)

    def after_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.context_embedder(encoder_hidden_states)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                timestep: torch.Tensor, **extra: Any) -> torch.Tensor:
        hidden = self.embed_image(hidden_states)
        context = self.embed_context(encoder_hidden_states)
        temb = self.embed_time(timestep, **extra)
        for block in self.transformer_blocks:
            context, hidden = self.run_block(block, hidden, context, temb)
        hidden = self.after_blocks(hidden)
        shift, scale = self.norm_out_mod(F.silu(temb))[:, None].chunk(2, dim=-1)
        return self.proj_out(modulate(self.norm_out(hidden), shift, scale))


class Base(StableDiffusion3Pipeline):
    """Correct: SD3's pipeline with the DiT above and encoders with an ``encode`` method."""

    transformer_class: type[nn.Module] = _Transformer
    #: a component the transformer keeps an unregistered reference to, as ``_<name>``
    back_reference: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.transformer = self.transformer_class()
        self.text_encoder = _Encoder(CLIP_DIM, pooled_dim=CLIP_DIM)
        if self.back_reference is not None:  # kept out of _modules (no cycle, no second owner)
            object.__setattr__(self.transformer, f"_{self.back_reference}",
                               getattr(self, self.back_reference))


class Correct(Base):
    """Correct, with every placement decision spelled out: the execution device from
    ``offload_ref.execution_device``, noise from a host generator then moved."""

    def execution_device(self) -> torch.device:
        return execution_device(self)

    @torch.no_grad()
    def forward(self, *, generator_seed: int, num_inference_steps: int, **inputs: Any
                ) -> torch.Tensor:
        device = self.execution_device()
        cond = self.encode(device, **inputs)
        latents = self.noise(generator_seed, device)
        for step in range(num_inference_steps):
            sigma, nxt = 1 - step / num_inference_steps, 1 - (step + 1) / num_inference_steps
            latents = latents + (nxt - sigma) * self.predict(latents, sigma, step, cond)
        return self.vae(latents)


    def noise(self, seed: int, device: torch.device) -> torch.Tensor:
        host = torch.Generator("cpu").manual_seed(seed)
        return torch.randn(self.latent_shape, generator=host).to(device)


class Guidance(Base):
    """Correct: classifier-free guidance, so every block runs twice per step."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        uncond = {k: torch.zeros_like(v) for k, v in cond.items()}
        c = super().predict(latents, sigma, step, cond)
        u = super().predict(latents, sigma, step, uncond)
        return u + 2.0 * (c - u)


# 1. the execution device taken from an offloaded component

class DeviceFromBlockWeight(Base):
    def execution_device(self) -> torch.device:
        return self.transformer.transformer_blocks[-1].attn.to_q.weight.device


class DeviceFromFirstComponent(Base):
    def execution_device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device


class DiffusersStyleDevice(Base):
    """diffusers' ``DiffusionPipeline.device``: the first component's first parameter."""

    @property
    def device(self) -> torch.device:
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"):
            for p in getattr(self, name).parameters():
                return p.device
        return torch.device("cpu")

    def execution_device(self) -> torch.device:
        return self.device


# 2. a weight of an offloaded component read outside its forward

class AddsDitBiasToContext(Base):
    def encode(self, device: torch.device, **inputs: Any) -> dict[str, Any]:
        cond = super().encode(device, **inputs)
        bias = self.transformer.context_embedder.bias
        cond["encoder_hidden_states"] = cond["encoder_hidden_states"] + 0.1 * bias
        return cond


class ReadsFirstBlockWeight(Base):
    """Reads a streamed block's weight from the pipeline's code: under layerwise it is bound to
    whatever the ring holds then (block 0 is being prefetched for the next step)."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        bias = self.transformer.transformer_blocks[0].img_mod.bias[: latents.shape[1]]
        return super().predict(latents, sigma, step, cond) + 0.01 * bias[:, None, None]


class _LoRA(nn.Module):
    def __init__(self, base: nn.Module, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        with torch.no_grad():
            self.down.weight.fill_(0.01), self.up.weight.fill_(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class AttachesHostAdapterToABlock(Base):
    """Wraps a block's projection in a LoRA on its first call, while offloaded, and leaves the
    adapter where it was made: on the host."""

    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        attn = self.transformer.transformer_blocks[1].attn
        if not isinstance(attn.to_out, _LoRA):
            attn.to_out = _LoRA(attn.to_out)
        return super().predict(latents, sigma, step, cond)


class _CallsEncoderModuleTransformer(_Transformer):
    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        norm = self._text_encoder_3.final_norm  # another component's module, called from here
        return super().embed_context(norm(encoder_hidden_states))


class DitCallsEncoderModule(Base):
    transformer_class = _CallsEncoderModuleTransformer
    back_reference = "text_encoder_3"


class GeneratorOnExecutionDevice(Correct):
    """Correct: noise from a generator on the execution device (the device's own RNG)."""

    def noise(self, seed: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device).manual_seed(seed)
        return torch.randn(self.latent_shape, generator=generator, device=device)


class _BackReferenceTransformer(_Transformer):
    def embed_context(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        table = self._text_encoder.embed_tokens.weight  # through an unregistered back reference
        return super().embed_context(encoder_hidden_states) + 0.1 * table[:2].flatten()


class DitReadsEncoderTable(Base):
    transformer_class = _BackReferenceTransformer
    back_reference = "text_encoder"


# 3. a component run through an entry point other than its forward

class EncodesThroughEntryPoint(Base):
    def encode(self, device: torch.device, *, prompt_ids: torch.Tensor) -> dict[str, Any]:
        ids = prompt_ids.to(device)
        clip_l, pooled_l = self.text_encoder.encode(ids)  # the bug: not text_encoder(ids)
        clip_g, pooled_g = self.text_encoder_2(ids)
        t5 = self.text_encoder_3(ids)
        context = torch.cat([torch.cat([clip_l, clip_g], dim=-1), t5], dim=1)
        return {"encoder_hidden_states": context,
                "pooled_projections": torch.cat([pooled_l, pooled_g], dim=-1)}


class CallsTransformerForward(Base):
    def predict(self, latents: torch.Tensor, sigma: float, step: int, cond: Any) -> torch.Tensor:
        height, width = latents.shape[-2:]
        out = self.transformer.forward(patchify(latents),  # the bug: not self.transformer(...)
                                       timestep=timesteps(sigma, latents.device), **cond)
        return unpatchify(out, height, width)


# 5. a tensor cached across calls

class _ViewCachingTransformer(_Transformer):
    def __init__(self) -> None:
        super().__init__(_CachingBlock)


class CachesWeightView(Base):
    transformer_class = _ViewCachingTransformer


class _TableCachingTransformer(_Transformer):
    """Caches a position table (as RoPE tables are) as a plain attribute on its first call."""

    def embed_image(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if "table" not in self.__dict__:
            n = hidden_states.shape[1]
            self.table = torch.arange(n, device=hidden_states.device)[:, None] / n
        return super().embed_image(hidden_states) + 0.1 * self.table


class CachesTable(Base):
    transformer_class = _TableCachingTransformer


# 6. a generator on an offloaded component's device

class GeneratorOnComponentDevice(Correct):
    def noise(self, seed: int, device: torch.device) -> torch.Tensor:
        gen_device = next(self.transformer.parameters()).device  # the bug
        generator = torch.Generator(gen_device).manual_seed(seed)
        return torch.randn(self.latent_shape, generator=generator, device=gen_device).to(device)


# 7. blocks that run without their hooks

class _ForwardCallTransformer(_Transformer):
    def run_block(self, block: nn.Module, *args: Any) -> Any:
        return block.forward(*args)  # the bug: bypasses the block's hooks


class CallsBlockForward(Base):
    transformer_class = _ForwardCallTransformer


class _PartAfterLoopTransformer(_Transformer):
    def after_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer_blocks[-1].norm(hidden)  # the bug: a block part, after the loop


class CallsBlockPartAfterLoop(Base):
    transformer_class = _PartAfterLoopTransformer


ML, LW = ("model_level",), ("layer_wise",)
BOTH = ML + LW
#: name -> (class, the strategies under which it breaks a GPU generation; empty: correct)
PIPELINES: dict[str, tuple[type[nn.Module], tuple[str, ...]]] = {
    "correct": (Correct, ()),
    "guidance": (Guidance, ()),
    "generator_on_execution_device": (GeneratorOnExecutionDevice, ()),
    "device_from_offloaded": (DeviceFromOffloadedComponentPipeline, ML),
    "device_from_block_weight": (DeviceFromBlockWeight, BOTH),
    "device_from_first_component": (DeviceFromFirstComponent, ML),
    "diffusers_style_device": (DiffusersStyleDevice, ML),
    "adds_dit_bias_to_context": (AddsDitBiasToContext, ML),
    "dit_reads_encoder_table": (DitReadsEncoderTable, ML),
    "reads_first_block_weight": (ReadsFirstBlockWeight, BOTH),
    "attaches_host_adapter_to_a_block": (AttachesHostAdapterToABlock, BOTH),
    "dit_calls_encoder_module": (DitCallsEncoderModule, ML),
    "encodes_through_entry_point": (EncodesThroughEntryPoint, ML),
    "calls_transformer_forward": (CallsTransformerForward, ML),
    "caches_weight_view": (CachesWeightView, LW),
    "caches_table": (CachesTable, BOTH),
    "generator_on_component_device": (GeneratorOnComponentDevice, ML),
    "calls_block_forward": (CallsBlockForward, LW),
    "calls_block_part_after_loop": (CallsBlockPartAfterLoop, LW),
}


def build_named(name: str, seed: int = 0) -> nn.Module:
    return build(PIPELINES[name][0], seed)


def spec_of(name: str, strategies: tuple[str, ...] = BOTH) -> PipelineSpec:
    """The kit's spec for ``PIPELINES[name]`` (factories bound through this module)."""
    return PipelineSpec(name=name, factory=f"{__name__}:build_{name}",
                        inputs=f"{__name__}:make_inputs", strategies=strategies)


def __getattr__(attr: str) -> Any:  # build_<name> for every PIPELINES entry
    if attr.startswith("build_") and attr[len("build_"):] in PIPELINES:
        return functools.partial(build_named, attr[len("build_"):])
    raise AttributeError(attr)
