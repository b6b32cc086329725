"""FLUX.1-dev (``FluxTransformer2DModel`` with the guidance embedding, CLIP + T5, ``AutoencoderKL``) and its tiny
CPU twin.

Samplers and losses see unpacked latents ``[B, C, h, w]``; the adapter packs them into FLUX's 2x2 patch tokens
``[B, h/2 * w/2, 4C]`` with their position ids around each transformer call (``FluxPipeline._pack_latents``,
``_unpack_latents``, ``_prepare_latent_image_ids``). The sigma schedule shifts with the image size
(``calculate_shift``, as ``FluxPipeline``). Sol-RL's FLUX settings (``docs/published.md``): 512 px, ``dpm2``,
LoRA on ``to_q/k/v/out.0``, NVFP4 skipping the x/context embedders, the time-text embedding, ``norm_out`` and
Linear layers with ``max(in, out) <= 1000``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily


@register_model("flux")
@dataclass
class Flux(DiffusersFamily):
    """FLUX.1 from a diffusers-format folder (e.g. ``black-forest-labs/FLUX.1-dev``)."""

    name: ClassVar[str] = "flux"
    hub_id: ClassVar[str] = "black-forest-labs/FLUX.1-dev"
    weights_hint: ClassVar[str] = "https://huggingface.co/black-forest-labs/FLUX.1-dev (gated: accept the licence)"
    pipeline_class: ClassVar[str] = "FluxPipeline"
    guidance_embedding: ClassVar[bool] = True
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    explore_skip: ClassVar[tuple[str, ...]] = ("x_embedder", "context_embedder", "time_text_embed", "norm_out")
    default_resolution: ClassVar[int] = 512
    default_max_sequence_length: ClassVar[int] = 512
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 512
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    depth_keys: ClassVar[tuple[str, ...]] = ("num_layers", "num_single_layers")
    pooled_width_key: ClassVar[str | None] = "pooled_projection_dim"

    @classmethod
    def latent_factor(cls, pipe: Any) -> int:
        return cls.vae_scale_factor(pipe) * 2  # 2x2 packing

    @classmethod
    def latent_shape_of(cls, pipe: Any, resolution: int) -> tuple[int, int, int]:
        side = resolution // cls.vae_scale_factor(pipe)
        return int(pipe.transformer.config.in_channels) // 4, side, side

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]`` (T5) and ``pooled`` ``[B, D']`` (CLIP pooler output), by
        ``FluxPipeline.encode_prompt``."""
        emb, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"emb": emb, "pooled": pooled}

    def sigmas(self, steps: int) -> torch.Tensor:
        """FluxPipeline's grid: ``linspace(1, 1/steps, steps)`` shifted by ``mu`` of the image's token count
        (``pipeline_sigmas``), then 0; float32 ``[steps + 1]``."""
        _, h, w = self.latent_shape
        return self.pipeline_sigmas(steps, (h // 2) * (w // 2))

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at unpacked latents ``x [B, C, h, w]``, ``sigma [B]``: packed to ``[B, hw/4, 4C]``,
        timestep = sigma (the transformer scales by 1000), guidance ``model.guidance``; unpacked again."""
        B, C, h, w = x.shape
        dtype = self.transformer.dtype
        packed = type(self.pipe)._pack_latents(x.to(dtype), B, C, h, w)  # [B, h/2 * w/2, 4C]
        img_ids = type(self.pipe)._prepare_latent_image_ids(B, h // 2, w // 2, x.device, dtype)  # [hw/4, 3]
        txt_ids = torch.zeros(cond["emb"].shape[1], 3, device=x.device, dtype=dtype)
        guidance = (
            torch.full((B,), self.guidance, device=x.device, dtype=torch.float32)
            if self.transformer.config.guidance_embeds
            else None
        )
        out = net(
            hidden_states=packed,
            timestep=sigma.to(dtype),
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["emb"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        vsf = self.vae_scale_factor(self.pipe)
        return type(self.pipe)._unpack_latents(out, h * vsf, w * vsf, vsf)  # [B, C, h, w]

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """``FluxPipeline`` takes and returns packed 2x2 tokens: ``noise`` is packed, the result unpacked."""
        _, C, h, w = noise.shape
        packed = type(pipe)._pack_latents(noise, 1, C, h, w)
        out = self.stock_call(pipe, prompt, packed, steps).images
        factor = pipe.vae_scale_factor
        return type(pipe)._unpack_latents(out, h * factor, w * factor, factor)


@tiny_twin
@dataclass
class TinyFlux(TinyFamily, Flux):
    """A tiny random FLUX.1-dev of the real classes (1 double + 1 single block, guidance embedding, 32 px): the
    plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-flux"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 4  # the tiny VAE downsamples by 2
    default_max_sequence_length: ClassVar[int] = 16

    #: The tiny transformer's widths (1 double + 1 single block), shared by the twins of FLUX.1's derivatives.
    tiny_widths: ClassVar[dict[str, Any]] = {
        "patch_size": 1,
        "in_channels": 16,  # 4 x the VAE's latent channels
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # the T5 width
        "axes_dims_rope": [4, 4, 8],
    }

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.FluxTransformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        return FluxTransformer2DModel(**cls.tiny_widths, pooled_projection_dim=32, guidance_embeds=True)  # CLIP width

    @classmethod
    def tiny_scheduler(cls):  # -> diffusers.FlowMatchEulerDiscreteScheduler
        """FLUX.1's scheduler config: dynamic shifting 0.5 -> 1.15 over 256 -> 4096 image tokens."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import FluxPipeline

        from solrl.stages.models.tiny_components import (
            autoencoder_kl,
            clip_text_model,
            clip_tokenizer,
            t5_encoder,
            t5_tokenizer,
        )

        tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
        text_encoder = clip_text_model(tokenizer, hidden=32)
        text_encoder_2 = t5_encoder(tokenizer_2, d_model=32)
        vae = autoencoder_kl(0.3611, 0.1159)  # the published VAE's scaling and shift factors
        transformer = cls.tiny_transformer()
        scheduler = cls.tiny_scheduler()
        FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            transformer=transformer,
            image_encoder=None,
            feature_extractor=None,
        ).save_pretrained(out)
