"""A real diffusers ``DiffusionPipeline`` (``DiTPipeline`` from tiny configs) declared for
offload-ref the way docs/model-authors.md shows it: a plain object, not an ``nn.Module``, whose
output is an ``ImagePipelineOutput`` holding a numpy array.

It found a defect the fixtures never showed: diffusers' DiT reads ``transformer_blocks[0].norm1.emb``
again after its block loop, outside block 0's forward (see Note [Block parts] in
offload_ref/backends/ring.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch
from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

from offload_ref import OffloadPlan, SupportsComponentDiscovery
from offload_ref.contracts import PipelineSpec

__all__ = ["DIT_SPEC", "DeclaredDiTPipeline", "build_dit", "dit_inputs"]


class DeclaredDiTPipeline(SupportsComponentDiscovery, DiTPipeline):
    _dit_modules = ["transformer"]
    _vae_modules = ["vae"]
    _offload_plan = OffloadPlan(block_attrs={"transformer": ["transformer_blocks"]})


def build_dit(seed: int = 0) -> DeclaredDiTPipeline:
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)  # host only: builds on the host
        transformer = DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
            num_layers=3, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
            norm_num_groups=1)
        vae = AutoencoderKL(block_out_channels=(8,), layers_per_block=1, latent_channels=4,
                            norm_num_groups=8, down_block_types=("DownEncoderBlock2D",),
                            up_block_types=("UpDecoderBlock2D",))
    pipe = DeclaredDiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae):
        module.eval().requires_grad_(False)
    return pipe


def dit_inputs(seed: int = 0) -> dict:
    return {"class_labels": [1], "num_inference_steps": 2, "output_type": "np",
            "generator": torch.Generator().manual_seed(seed)}


DIT_SPEC = PipelineSpec(name="diffusers_dit", factory=f"{__name__}:build_dit",
                        inputs=f"{__name__}:dit_inputs", strategies=("layer_wise",))
