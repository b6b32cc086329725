"""SANA (``SanaTransformer2DModel``, ``AutoencoderDC``, Gemma-2 text encoder) and its tiny CPU twin.

Sol-RL's SANA-1600M settings (``docs/published.md``): 1024 px, Euler ODE ("flow"), LoRA on the attention
projections (self-attention qkv/out and cross-attention), NVFP4 skipping the embedders, the final layer, the
self-attention qkv and Linear layers with ``max(in, out) <= 2240`` (``explore.min_dim`` in the preset).
Prompts go through SANA's complex human instruction, as ``SanaPipeline`` does by default.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily


@register_model("sana")
@dataclass
class Sana(DiffusersFamily):
    """SANA from a diffusers-format folder (e.g. ``Efficient-Large-Model/Sana_1600M_1024px_diffusers``)."""

    name: ClassVar[str] = "sana"
    hub_id: ClassVar[str] = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
    weights_hint: ClassVar[str] = "https://huggingface.co/Efficient-Large-Model/Sana_1600M_1024px_diffusers"
    pipeline_class: ClassVar[str] = "SanaPipeline"
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")  # attn1 and attn2
    repeated_blocks: ClassVar[tuple[str, ...]] = ("SanaTransformerBlock",)
    explore_skip: ClassVar[tuple[str, ...]] = (
        "patch_embed",
        "time_embed",
        "caption_projection",
        "proj_out",
        "norm",
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
    )
    default_resolution: ClassVar[int] = 1024
    default_max_sequence_length: ClassVar[int] = 300
    resolution_multiple: ClassVar[int] = 32
    max_sequence_length_limit: ClassVar[int] = 1024
    text_width_key: ClassVar[str] = "caption_channels"
    text_mask: ClassVar[bool] = True
    #: Prepend SANA's complex human instruction to every prompt (SanaPipeline's default).
    complex_human_instruction: ClassVar[bool] = True

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]`` (Gemma-2 last hidden state of the instruction + prompt, L kept tokens) and
        ``mask`` ``[B, L]``, by ``SanaPipeline.encode_prompt`` (no classifier-free guidance: Sol-RL samples with
        guidance 1)."""
        instruction = None
        if self.complex_human_instruction:
            instruction = inspect.signature(type(self.pipe).__call__).parameters["complex_human_instruction"].default
        emb, mask, _, _ = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            clean_caption=False,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=instruction,
        )
        return {"emb": emb, "mask": mask}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s flow velocity at latents ``x [B, C, h, w]``, ``sigma [B]`` (timestep = 1000 sigma x the
        transformer's ``timestep_scale``, as ``SanaPipeline``)."""
        scale = getattr(self.transformer.config, "timestep_scale", 1.0)
        return net(
            x.to(self.transformer.dtype),
            encoder_hidden_states=cond["emb"],
            encoder_attention_mask=cond["mask"],
            timestep=sigma * 1000.0 * scale,
            return_dict=False,
        )[0]

    #: ``SanaPipeline`` snaps the size to its aspect-ratio bins unless told not to.
    stock_call_kwargs: ClassVar[dict[str, Any]] = {"guidance_scale": 1.0, "use_resolution_binning": False}


@tiny_twin
@dataclass
class TinySana(TinyFamily, Sana):
    """A tiny random SANA of the real classes (2 layers, 32 px, 4-channel DC-AE, 2-layer Gemma-2): the plumbing
    on CPU, not learning."""

    name: ClassVar[str] = "tiny-sana"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 2  # the tiny VAE downsamples by 2
    default_max_sequence_length: ClassVar[int] = 16

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.SanaTransformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import SanaTransformer2DModel

        torch.manual_seed(0)
        return SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=16,
            num_cross_attention_heads=2,
            cross_attention_head_dim=16,
            cross_attention_dim=32,
            caption_channels=32,
            sample_size=32,
            mlp_ratio=2.5,
        )  # cross_attention_dim = heads x head dim; caption_channels = the Gemma-2 width

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline

        from solrl.stages.models.tiny_components import gemma2_encoder, gemma_tokenizer

        tokenizer = gemma_tokenizer()
        text_encoder = gemma2_encoder(tokenizer, hidden=32)
        transformer = cls.tiny_transformer()
        torch.manual_seed(0)
        vae = AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            downsample_block_type="conv",
            upsample_block_type="interpolate",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        )
        SanaPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=transformer,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        ).save_pretrained(out)
