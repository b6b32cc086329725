"""SD3.5 (``SD3Transformer2DModel``, two CLIP + T5, ``AutoencoderKL``) and its tiny CPU twin.

Sol-RL's SD3.5-Large settings (``docs/published.md``): 1024 px, ``dpm2``, LoRA on the attention including the
context projections (``add_*``), NVFP4 skipping the position and context embedders, the time-text embedding,
``norm_out``, ``norm1``, ``ff_context`` and Linear layers with ``max(in, out) <= 2432``. SD3.5-Medium (the
``sd35-medium`` preset: DiffusionNFT's and Flow-GRPO's model) is the same family at 512 px, with MMDiT-X blocks
(a second attention in its first 13 blocks, ``dual_attention_layers``) that the tiny twin has too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily


@register_model("sd3")
@dataclass
class SD3(DiffusersFamily):
    """SD3 / SD3.5 from a diffusers-format folder (e.g. ``stabilityai/stable-diffusion-3.5-large``)."""

    name: ClassVar[str] = "sd3"
    hub_id: ClassVar[str] = "stabilityai/stable-diffusion-3.5-large"
    weights_hint: ClassVar[str] = (
        "https://huggingface.co/stabilityai/stable-diffusion-3.5-large (gated: accept the licence)"
    )
    published_variants: ClassVar[tuple[tuple[str, str], ...]] = (
        (
            "stabilityai/stable-diffusion-3.5-medium",
            "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium (gated: accept the licence)",
        ),
    )
    pipeline_class: ClassVar[str] = "StableDiffusion3Pipeline"
    #: The joint attention of every block, its context projections (``add_*``) included, as Sol-RL, DiffusionNFT and
    #: Flow-GRPO train SD3.5. ``attn.`` keeps SD3.5-Medium's second attention (``attn2`` of its MMDiT-X blocks)
    #: frozen, as those peers do; SD3.5-Large has no ``attn2``.
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    )
    repeated_blocks: ClassVar[tuple[str, ...]] = ("JointTransformerBlock",)
    explore_skip: ClassVar[tuple[str, ...]] = (
        "pos_embed",
        "context_embedder",
        "time_text_embed",
        "norm_out",
        "norm1",
        "ff_context",
    )
    default_resolution: ClassVar[int] = 1024
    default_max_sequence_length: ClassVar[int] = 256
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 512
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    pooled_width_key: ClassVar[str | None] = "pooled_projection_dim"
    extra_text_tokens: ClassVar[int] = 77  # the two CLIPs' tokens ahead of T5's

    @classmethod
    def cut_depth(cls, config: dict, original: dict) -> None:
        """SD3.5-medium's MMDiT-X blocks (``dual_attention_layers``, 13 of 24) kept in proportion to the depth
        kept (at least one while any is), the first ones, so that a cut model has both kinds of block and the
        depth check's extrapolation from it meets the full depth's mix."""
        layers = sorted(i for i in original.get("dual_attention_layers") or () if i < original["num_layers"])
        kept = round(len(layers) * config["num_layers"] / original["num_layers"]) if layers else 0
        config["dual_attention_layers"] = tuple(layers[: max(kept, 1 if layers else 0)])

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, 77 + L, D]`` (the two CLIPs' penultimate states, padded to the T5 width, then T5) and
        ``pooled`` ``[B, D1 + D2]`` (the CLIP projections), by ``StableDiffusion3Pipeline.encode_prompt``."""
        emb, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"emb": emb, "pooled": pooled}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at latents ``x [B, C, h, w]``, ``sigma [B]`` (timestep = 1000 sigma)."""
        dtype = self.transformer.dtype
        return net(
            hidden_states=x.to(dtype),
            timestep=(sigma * 1000.0).to(dtype),
            encoder_hidden_states=cond["emb"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]


@tiny_twin
@dataclass
class TinySD3(TinyFamily, SD3):
    """A tiny random SD3.5 of the real classes (2 blocks, one dual-attention, 32 px): the plumbing on CPU, not
    learning."""

    name: ClassVar[str] = "tiny-sd3"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 4  # the tiny VAE downsamples by 2
    default_max_sequence_length: ClassVar[int] = 16
    max_resolution: ClassVar[int | None] = 128  # pos_embed_max_size 32 x patch 2 x the tiny VAE's 2

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.SD3Transformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import SD3Transformer2DModel

        torch.manual_seed(0)
        return SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            caption_projection_dim=32,
            joint_attention_dim=64,
            pooled_projection_dim=48,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
        )  # joint = T5 width; pooled = the two CLIP projections

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import (
            FlowMatchEulerDiscreteScheduler,
            StableDiffusion3Pipeline,
        )

        from solrl.stages.models.tiny_components import (
            autoencoder_kl,
            clip_text_model,
            clip_tokenizer,
            t5_encoder,
            t5_tokenizer,
        )

        tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()
        text_encoder = clip_text_model(tokenizer, hidden=16, projection=16, seed=0)  # "CLIP-L"
        text_encoder_2 = clip_text_model(tokenizer_2, hidden=32, projection=32, seed=1, act="gelu")  # "CLIP-G"
        text_encoder_3 = t5_encoder(tokenizer_3, d_model=64)  # >= 16 + 32: SD3 pads the CLIP states to it
        vae = autoencoder_kl(1.5305, 0.0609)  # the published VAE's scaling and shift factors
        transformer = cls.tiny_transformer()
        StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
            image_encoder=None,
            feature_extractor=None,
        ).save_pretrained(out)
