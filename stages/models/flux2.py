"""FLUX.2 (``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``): klein (4B, 9B; a Qwen3 text encoder) and dev (32B;
Mistral-3, the guidance embedding), and their tiny CPU twins.

FLUX.2 samples in a normalised, patchified latent space: the VAE's latents in 2x2 patches ``[4C, H/16, W/16]``
(for a VAE that downsamples by 8), standardised by the VAE's batch-norm running statistics. Samplers and losses
see that space as ``[B, 4C, h, w]``; the transformer sees it as tokens ``[B, h w, 4C]`` with 4-axis position ids
(``Flux2KleinPipeline._pack_latents``, ``_prepare_latent_ids``), at timestep sigma; decoding undoes the
normalisation and the patching before ``vae.decode``. The prompt is the Qwen3 hidden states of three layers
(9, 18 and 27 for the published 4B and 9B) concatenated per token, padded to ``model.max_sequence_length`` as the
pipeline pads them (``Flux2KleinPipeline.encode_prompt``); FLUX.2-dev's is Mistral-3's layers 10, 20 and 30 of
the prompt after the pipeline's system message (``Flux2Pipeline.encode_prompt``), and its transformer embeds the
guidance (``model.guidance``; the pipeline's default is 4). The sigma grid is the pipeline's:
``linspace(1, 1/steps, steps)`` shifted by ``compute_empirical_mu`` of the token count and the step count, so an
explore grid of fewer steps is shifted as the pipeline would shift it.

LoRA targets: both streams' attention and MLPs in the double blocks, and the fused QKV-MLP input and output of
the single blocks (Flow-Factory's FLUX.2 targets). They are one regex: the single blocks' ``attn.to_out`` is a
Linear, the double blocks' a ModuleList, so no suffix names the one without the other. NVFP4 follows the issue-19
rule, as no peer publishes one: the block projections are quantized; the image and text embedders, the
time-guidance embedding, the shared modulation layers, ``norm_out`` and ``proj_out`` stay in high precision.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily

_DOUBLE = r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|ff(_context)?\.linear_(in|out)"


def tiny_flux2_transformer(guidance_embeds: bool):  # -> diffusers.Flux2Transformer2DModel
    """The tiny twins' random transformer: 1 double + 1 single block of 2 heads of 16, seeded. ``in_channels`` is 4x
    the tiny VAE's latent channels; ``joint_attention_dim`` 3 layers x the tiny text encoders' width of 16."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=guidance_embeds,
    )


@register_model("flux2-klein")
@dataclass
class Flux2Klein(DiffusersFamily):
    """FLUX.2-klein from a diffusers-format folder (e.g. ``black-forest-labs/FLUX.2-klein-4B``)."""

    name: ClassVar[str] = "flux2-klein"
    hub_id: ClassVar[str] = "black-forest-labs/FLUX.2-klein-4B"
    weights_hint: ClassVar[str] = "https://huggingface.co/black-forest-labs/FLUX.2-klein-4B (Apache-2.0)"
    published_variants: ClassVar[tuple[tuple[str, str], ...]] = (
        (
            "black-forest-labs/FLUX.2-klein-9B",
            "https://huggingface.co/black-forest-labs/FLUX.2-klein-9B (gated: accept the FLUX non-commercial licence)",
        ),
    )
    pipeline_class: ClassVar[str] = "Flux2KleinPipeline"
    lora_targets: ClassVar[str] = (
        rf"transformer_blocks\.\d+\.({_DOUBLE})|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"
    )
    explore_skip: ClassVar[tuple[str, ...]] = (
        "x_embedder",
        "context_embedder",
        "time_guidance_embed",
        "modulation",
        "norm_out",
        "proj_out",
    )
    default_resolution: ClassVar[int] = 1024
    default_max_sequence_length: ClassVar[int] = 512  # Flux2KleinPipeline's default
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 512  # the pipeline's tokenizer_max_length
    depth_keys: ClassVar[tuple[str, ...]] = ("num_layers", "num_single_layers")
    #: The Qwen3 layers whose hidden states make the prompt embedding (the pipeline's default).
    text_encoder_out_layers: ClassVar[tuple[int, ...]] = (9, 18, 27)

    @classmethod
    def latent_factor(cls, pipe: Any) -> int:
        return cls.vae_scale_factor(pipe) * 2  # 2x2 patches

    @classmethod
    def latent_shape_of(cls, pipe: Any, resolution: int) -> tuple[int, int, int]:
        side = resolution // cls.latent_factor(pipe)
        return int(pipe.transformer.config.in_channels), side, side

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, 3D]``: the Qwen3 hidden states of ``text_encoder_out_layers`` per token, padded to
        ``L = model.max_sequence_length`` (``Flux2KleinPipeline.encode_prompt``)."""
        emb, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return {"emb": emb}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at patchified latents ``x [B, C, h, w]``, ``sigma [B]``: tokens ``[B, h w, C]``
        with their position ids, timestep sigma, guidance ``model.guidance`` where the transformer embeds one;
        back to ``[B, C, h, w]``."""
        B, C, h, w = x.shape
        dtype = self.transformer.dtype
        pipe = type(self.pipe)
        guidance = (
            torch.full((B,), self.guidance, device=x.device, dtype=torch.float32)
            if self.transformer.config.guidance_embeds
            else None
        )
        out = net(
            hidden_states=pipe._pack_latents(x.to(dtype)),  # [B, h w, C]
            timestep=sigma.to(dtype),
            guidance=guidance,
            encoder_hidden_states=cond["emb"].to(dtype),
            txt_ids=pipe._prepare_text_ids(cond["emb"]).to(x.device),
            img_ids=pipe._prepare_latent_ids(x).to(x.device),
            return_dict=False,
        )[0]
        return out.permute(0, 2, 1).reshape(B, C, h, w)

    def sigmas(self, steps: int) -> torch.Tensor:
        """Flux2KleinPipeline's grid: ``linspace(1, 1/steps, steps)`` (the scheduler's own where it sets
        ``use_flow_sigmas``) with ``mu = compute_empirical_mu(h w, steps)``, then 0; float32 ``[steps + 1]``."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        _, h, w = self.latent_shape
        compute_empirical_mu = importlib.import_module(type(self.pipe).__module__).compute_empirical_mu
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=steps)
        if scheduler.config.get("use_flow_sigmas"):
            scheduler.set_timesteps(steps, mu=mu, device="cpu")
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=mu, device="cpu")
        return scheduler.sigmas.float().to(self.device)

    def vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """The pipeline's decode: ``z * sqrt(bn.running_var + eps) + bn.running_mean``, unpatchified
        (``_unpatchify_latents``), ``vae.decode``: ``[b, 4C, h, w]`` to ``[b, 3, H, W]``."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return vae.decode(type(self.pipe)._unpatchify_latents(z * std + mean), return_dict=False)[0]

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """``Flux2KleinPipeline`` returns de-normalised, unpatchified latents: patchified and normalised back here
        by the VAE's batch-norm statistics, into the policy's sampling space."""
        out = self._stock_out(pipe, prompt, noise, steps)
        mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        return (type(pipe)._patchify_latents(out) - mean) / std

    def _stock_out(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        return self.stock_call(pipe, prompt, noise, steps, text_encoder_out_layers=self.text_encoder_out_layers).images


@tiny_twin
@dataclass
class TinyFlux2(TinyFamily, Flux2Klein):
    """A tiny random FLUX.2-klein of the real classes (1 double + 1 single block, 32 px, a 3-layer Qwen3): the
    plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-flux2"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 4  # the tiny VAE downsamples by 2
    #: The chat template takes about 30 of the tiny byte-level tokenizer's tokens before the prompt's own.
    default_max_sequence_length: ClassVar[int] = 96
    text_encoder_out_layers: ClassVar[tuple[int, ...]] = (1, 2, 3)

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.Flux2Transformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        return tiny_flux2_transformer(guidance_embeds=False)

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

        from solrl.stages.models.tiny_components import flux2_vae, qwen3_encoder, qwen_tokenizer

        tokenizer = qwen_tokenizer()
        Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential"
            ),  # dynamic and exponential, as the FLUX.2 pipelines expect (mu from compute_empirical_mu); not checked
            # against the published scheduler_config.json, which the real family reads at run time
            vae=flux2_vae(),
            text_encoder=qwen3_encoder(tokenizer, hidden=16, layers=3, lm_head=True),
            tokenizer=tokenizer,
            transformer=cls.tiny_transformer(),
            is_distilled=True,
        ).save_pretrained(out)


@register_model("flux2")
@dataclass
class Flux2(Flux2Klein):
    """FLUX.2-dev from a diffusers-format folder (``black-forest-labs/FLUX.2-dev``)."""

    name: ClassVar[str] = "flux2"
    hub_id: ClassVar[str] = "black-forest-labs/FLUX.2-dev"
    weights_hint: ClassVar[str] = (
        "https://huggingface.co/black-forest-labs/FLUX.2-dev (gated: accept the FLUX non-commercial licence)"
    )
    published_variants: ClassVar[tuple[tuple[str, str], ...]] = ()  # not FLUX.2-klein's
    pipeline_class: ClassVar[str] = "Flux2Pipeline"
    guidance_embedding: ClassVar[bool] = True
    #: The Mistral-3 layers whose hidden states make the prompt embedding (the pipeline's default).
    text_encoder_out_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)

    def _encode(self, prompts: list[str]) -> Conditioning:
        """As FLUX.2-klein's, through ``Flux2Pipeline.encode_prompt``, without the warning transformers logs on
        every call: the pipeline passes the processor's padding options as keyword arguments."""
        from transformers.utils import logging as transformers_logging

        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            return super()._encode(prompts)
        finally:
            transformers_logging.set_verbosity(verbosity)

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """``Flux2Pipeline`` (dev) returns the sampling space's tokens ``[1, h w, C]``."""
        return self._stock_out(pipe, prompt, noise, steps).permute(0, 2, 1).reshape(noise.shape)


@tiny_twin
@dataclass
class TinyFlux2Dev(TinyFamily, Flux2):
    """A tiny random FLUX.2-dev of the real classes (1 double + 1 single block with the guidance embedding, 32 px,
    a 3-layer Mistral-3 with a Pixtral processor): the plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-flux2-dev"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 4
    #: The pipeline's system message takes about 180 of the tiny byte-level tokenizer's tokens before the prompt's.
    default_max_sequence_length: ClassVar[int] = 320
    text_encoder_out_layers: ClassVar[tuple[int, ...]] = (1, 2, 3)

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.Flux2Transformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        return tiny_flux2_transformer(guidance_embeds=True)

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

        from solrl.stages.models.tiny_components import flux2_vae, mistral3_encoder, pixtral_processor

        processor = pixtral_processor()
        Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
            vae=flux2_vae(),
            text_encoder=mistral3_encoder(processor.tokenizer, hidden=16, layers=3),
            tokenizer=processor,
            transformer=cls.tiny_transformer(),
        ).save_pretrained(out)
