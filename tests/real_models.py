"""Tiny pipelines around REAL model classes (diffusers / transformers), written the way an outside
model author would, using only offload_ref's public names.

Nothing here is loaded from a hub: every model is built from a tiny config under a fixed seed
(``HF_HUB_OFFLINE=1``).  Each pipeline is an ``nn.Module`` that declares its components with
``SupportsComponentDiscovery`` and its blocks with ``OffloadPlan(block_attrs=...)`` (the diffusers
classes are not edited), and whose ``forward(**inputs)`` runs

    text encoder(s) -> a few scheduler steps calling the real DiT / UNet -> ``vae.decode``

and returns a tensor.  The schedulers are diffusers' own (plain objects, not modules).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch
from torch import nn

from offload_ref import OffloadPlan, SupportsComponentDiscovery
from offload_ref.contracts import PipelineSpec

__all__ = ["SPECS", "make_inputs"]

VOCAB = 99
PROMPT_LEN = 8
STEPS = 2
TEXT_DIM = 32


# -- building --------------------------------------------------------------------------------------


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)  # host only: builds on the host
        yield


def _finish(module: nn.Module, seed: int) -> nn.Module:
    """Eval mode, frozen, and every parameter perturbed with seeded noise: diffusers zero-inits
    some projections and norms start at ones, and a weight lost in transit must change the
    output."""
    module.eval()
    module.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                p.add_((0.02 * noise).to(p.dtype))
    return module


def _clip(hidden: int = TEXT_DIM) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=37,
                            num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=PROMPT_LEN, projection_dim=hidden)
    return CLIPTextModel(config)


def _t5(d_model: int = TEXT_DIM, umt5: bool = False) -> nn.Module:
    if umt5:
        from transformers import UMT5Config as Config, UMT5EncoderModel as Model
    else:
        from transformers import T5Config as Config, T5EncoderModel as Model
    config = Config(vocab_size=VOCAB, d_model=d_model, d_kv=8, d_ff=37, num_layers=2,
                    num_heads=4, relative_attention_num_buckets=8)
    return Model(config)


def _vae(latent_channels: int = 4) -> nn.Module:
    from diffusers import AutoencoderKL

    # One resolution level: the decoder keeps its mid-block attention and resnets, with few
    # tensors (the kit's lifecycle checks cost time per tensor).
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=("DownEncoderBlock2D",),
                         up_block_types=("UpDecoderBlock2D",),
                         block_out_channels=(8,), layers_per_block=1, norm_num_groups=4,
                         sample_size=8)


def make_inputs(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": torch.randint(1, VOCAB, (1, PROMPT_LEN), generator=g),
            "generator_seed": seed, "num_inference_steps": STEPS}


class _Pipeline(nn.Module, SupportsComponentDiscovery):
    """encode -> scheduler loop -> vae.decode.  Subclasses implement encode / predict."""

    latent_shape: ClassVar[tuple[int, ...]]

    def _device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def encode(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def predict(self, latents: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        raise NotImplementedError

    def set_timesteps(self, steps: int, device: torch.device) -> None:
        self.scheduler.set_timesteps(steps, device=device)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents / self.vae.config.scaling_factor).sample

    @torch.no_grad()
    def forward(self, *, prompt_ids: torch.Tensor, generator_seed: int,
                num_inference_steps: int) -> torch.Tensor:
        device = self._device()
        cond = self.encode(prompt_ids.to(device))
        g = torch.Generator().manual_seed(generator_seed)
        latents = torch.randn(self.latent_shape, generator=g).to(device)
        self.set_timesteps(num_inference_steps, device)
        for t in self.scheduler.timesteps:
            velocity = self.predict(latents, t, cond)
            latents = self.scheduler.step(velocity.float(), t, latents, return_dict=False)[0]
        return self.decode(latents)


# -- FLUX.1: CLIP (pooled) + T5 (sequence) -> FluxTransformer2DModel (two block containers) -------


class FluxPipeline(_Pipeline):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder", "text_encoder_2"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("transformer_blocks", "single_transformer_blocks")},
        # Both encoders stream their layers while conditioning (CLIP: encoder.layers; T5:
        # encoder.block, whose block 0 alone owns the relative attention bias).
        encoder_block_attrs={"text_encoder": ("encoder.layers",),
                             "text_encoder_2": ("encoder.block",)},
    )
    latent_shape = (1, 4, 8, 8)  # 4 latent channels, 8x8 -> 16 tokens of 4*2*2 after packing

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

        self.text_encoder = _clip()
        self.text_encoder_2 = _t5()
        self.transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=3,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
        ).to(dtype)
        self.vae = _vae()
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        self.dtype_ = dtype

    def encode(self, ids):
        pooled = self.text_encoder(ids).pooler_output
        seq = self.text_encoder_2(ids).last_hidden_state
        return {"pooled": pooled, "seq": seq}

    def predict(self, latents, t, cond):
        b, c, h, w = latents.shape
        packed = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        packed = packed.reshape(b, (h // 2) * (w // 2), c * 4)
        img_ids = torch.zeros(h // 2, w // 2, 3, device=latents.device)
        img_ids[..., 1] += torch.arange(h // 2, device=latents.device)[:, None]
        img_ids[..., 2] += torch.arange(w // 2, device=latents.device)[None, :]
        txt_ids = torch.zeros(cond["seq"].shape[1], 3, device=latents.device)
        dt = self.dtype_
        out = self.transformer(
            hidden_states=packed.to(dt), encoder_hidden_states=cond["seq"].to(dt),
            pooled_projections=cond["pooled"].to(dt),
            timestep=(t / 1000).expand(b).to(dt), img_ids=img_ids.reshape(-1, 3),
            txt_ids=txt_ids, guidance=torch.full((b,), 3.5, device=latents.device, dtype=dt),
            return_dict=False,
        )[0].float()
        out = out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, h, w)


# -- SD3: CLIP + T5 -> SD3Transformer2DModel (last block context_pre_only: heterogeneous ring) -----


class SD3Pipeline(_Pipeline):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder", "text_encoder_3"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("transformer_blocks",)},
        encoder_block_attrs={"text_encoder": ("encoder.layers",),
                             "text_encoder_3": ("encoder.block",)},
    )
    latent_shape = (1, 4, 8, 8)
    #: Skip-layer guidance (SD3.5): a third DiT call per step that skips these blocks through
    #: diffusers' own ``skip_layers`` argument (the skipped blocks' hooks never fire).
    slg_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        self.text_encoder = _clip()
        self.text_encoder_3 = _t5()
        self.transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, caption_projection_dim=16,
            pooled_projection_dim=TEXT_DIM, out_channels=4, pos_embed_max_size=8,
            dual_attention_layers=(0,), qk_norm="rms_norm",
        )
        self.vae = _vae()
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    def encode(self, ids):
        pooled = self.text_encoder(ids).pooler_output
        seq = self.text_encoder_3(ids).last_hidden_state
        return {"pooled": pooled, "seq": seq}

    def predict(self, latents, t, cond):
        # Classifier-free guidance as two DiT calls per step (the ring wraps around twice).
        uncond = self.transformer(hidden_states=latents, encoder_hidden_states=torch.zeros_like(
            cond["seq"]), pooled_projections=torch.zeros_like(cond["pooled"]),
            timestep=t.expand(1), return_dict=False)[0]
        text = self.transformer(hidden_states=latents, encoder_hidden_states=cond["seq"],
                                pooled_projections=cond["pooled"], timestep=t.expand(1),
                                return_dict=False)[0]
        guided = uncond + 4.0 * (text - uncond)
        if self.slg_layers:
            skipped = self.transformer(hidden_states=latents, encoder_hidden_states=cond["seq"],
                                       pooled_projections=cond["pooled"], timestep=t.expand(1),
                                       skip_layers=list(self.slg_layers), return_dict=False)[0]
            guided = guided + 2.8 * (text - skipped)
        return guided


# -- Wan 2.1: UMT5 -> WanTransformer3DModel (RoPE buffers in non-block state) ---------------


class WanPipeline(_Pipeline):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)},
                                encoder_block_attrs={"text_encoder": ("encoder.block",)})
    latent_shape = (1, 4, 1, 8, 8)  # (B, C, frames, H, W)

    def __init__(self) -> None:
        super().__init__()
        from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

        self.text_encoder = _t5(umt5=True)
        self.transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=3,
            rope_max_seq_len=32,
        )
        self.vae = _vae()
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)

    def encode(self, ids):
        return {"seq": self.text_encoder(ids).last_hidden_state}

    def predict(self, latents, t, cond):
        return self.transformer(hidden_states=latents, timestep=t.expand(1),
                                encoder_hidden_states=cond["seq"], return_dict=False)[0]

    def decode(self, latents):
        return super().decode(latents[:, :, 0])


# -- SD 1.x: CLIP -> UNet2DConditionModel (one ring: down_blocks, mid_block, up_blocks) -----


class SDPipeline(_Pipeline):
    _dit_modules = ["unet"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(
        # mid_block is a single module: one block of the ring, between the two containers.
        block_attrs={"unet": ("down_blocks", "mid_block", "up_blocks")},
        encoder_block_attrs={"text_encoder": ("encoder.layers",)},
    )
    latent_shape = (1, 4, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DDIMScheduler, UNet2DConditionModel

        self.text_encoder = _clip()
        self.unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=TEXT_DIM,
            attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        self.vae = _vae()
        self.scheduler = DDIMScheduler(num_train_timesteps=1000)

    def encode(self, ids):
        return {"seq": self.text_encoder(ids).last_hidden_state}

    def predict(self, latents, t, cond):
        return self.unet(latents, t, encoder_hidden_states=cond["seq"], return_dict=False)[0]


# -- encoders called the way SD3 and SDXL call them: output_hidden_states=True -----------------
# transformers (5.x) then installs forward hooks on the encoder's layers on the first such call:
# the model's own lazy state, which no offloader may be blamed for (issue 23).


class SD3HiddenStatesPipeline(SD3Pipeline):
    """SD3's own encoding: CLIP's penultimate hidden states next to T5's, CLIP's pooled output."""

    def encode(self, ids):
        clip = self.text_encoder(ids, output_hidden_states=True)
        t5 = self.text_encoder_3(ids, output_hidden_states=True)
        seq = torch.cat([clip.hidden_states[-2], t5.last_hidden_state], dim=1)
        return {"pooled": clip.pooler_output, "seq": seq}


class SDXLStylePipeline(SDPipeline):
    """SDXL's encoding: the penultimate hidden states of CLIP as cross-attention context."""

    def encode(self, ids):
        return {"seq": self.text_encoder(ids, output_hidden_states=True).hidden_states[-2]}


class SD3UndeclaredBlocksPipeline(SD3Pipeline):
    """An author's slip: the DiT's blocks are not declared (fine for model level, not for
    layerwise).  Not in SPECS: tests/test_kit_preflight.py checks it has one root cause."""

    _offload_plan = OffloadPlan(encoder_block_attrs=SD3Pipeline._offload_plan.encoder_block_attrs)


# -- specs -----------------------------------------------------------------------------------------


def _builder(cls: Callable[..., nn.Module], **kwargs: Any) -> Callable[..., nn.Module]:
    def build(seed: int = 0) -> nn.Module:
        with _seeded(seed):
            pipe = cls(**kwargs)
        return _finish(pipe, seed)

    build.__name__ = f"build_{cls.__name__}"
    return build


build_flux = _builder(FluxPipeline)
build_flux_bf16 = _builder(FluxPipeline, dtype=torch.bfloat16)
build_sd3 = _builder(SD3Pipeline)
build_sd3_slg = _builder(type("SD3SLGPipeline", (SD3Pipeline,), {"slg_layers": (1,)}))
build_wan = _builder(WanPipeline)
build_sd = _builder(SDPipeline)
build_sd3_hidden_states = _builder(SD3HiddenStatesPipeline)
build_sdxl_style = _builder(SDXLStylePipeline)
build_sd3_undeclared_blocks = _builder(SD3UndeclaredBlocksPipeline)

_HERE = __name__
SPECS = [
    PipelineSpec(name=name, factory=f"{_HERE}:{factory}", inputs=f"{_HERE}:make_inputs",
                 strategies=("model_level", "layer_wise"), description=description)
    for name, factory, description in [
        ("real_flux", "build_flux", "diffusers FluxTransformer2DModel + CLIP + T5"),
        ("real_flux_bf16", "build_flux_bf16", "bf16 FLUX DiT, fp32 encoders"),
        ("real_sd3", "build_sd3", "diffusers SD3Transformer2DModel + CLIP + T5, CFG"),
        ("real_sd3_slg", "build_sd3_slg", "SD3 with skip-layer guidance (diffusers skip_layers)"),
        ("real_wan", "build_wan", "diffusers WanTransformer3DModel + UMT5"),
        ("real_sd", "build_sd", "diffusers UNet2DConditionModel + CLIP"),
        ("real_sd3_hidden_states", "build_sd3_hidden_states",
         "SD3 encoding its prompt as SD3 does (output_hidden_states=True: lazy model hooks)"),
        ("real_sdxl_style", "build_sdxl_style",
         "UNet with CLIP's penultimate hidden states (output_hidden_states=True), as SDXL"),
    ]
]
