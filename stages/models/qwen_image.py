"""Qwen-Image (``QwenImageTransformer2DModel``, a 60-block MMDiT; Qwen2.5-VL text encoder; ``AutoencoderKLQwenImage``)
and its tiny CPU twin.

Prompts go through ``QwenImagePipeline.encode_prompt``: the prompt in the pipeline's chat template (a system turn
asking to describe the image), the Qwen2.5-VL last hidden states with the template's first tokens dropped. The
adapter keeps each prompt's rows zero-padded to ``model.max_sequence_length`` with a mask, so embeddings cache and
batch like every family's; each transformer call trims the padding to the batch's longest prompt, as the pipeline
pads to it. Samplers see unpacked latents ``[B, C, h, w]``; the transformer sees FLUX-style 2x2 patch tokens
``[B, h/2 * w/2, 4C]`` (``QwenImagePipeline._pack_latents``) at timestep sigma. The VAE is a video VAE: latents
gain a frame axis of 1 and are de-normalised by the VAE's per-channel ``latents_mean`` and ``latents_std`` before
decoding. The sigma grid is the pipeline's: ``linspace(1, 1/steps, steps)`` shifted by ``mu`` of the image token
count (``calculate_shift``).

LoRA targets: the joint attention (image and text projections) and both streams' MLPs, Flow-Factory's Qwen-Image
targets (its ``img_mlp.net.2.proj`` matches no module; ``net.2`` is the Linear). NVFP4 follows the issue-19 rule,
as no peer publishes one: the attention and MLP projections are quantized; the image/text input projections, the
text norm, the time embedding, the per-block modulation (``img_mod``, ``txt_mod``), ``norm_out`` and ``proj_out``
stay in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily, decode_wan_vae


@register_model("qwen-image")
@dataclass
class QwenImage(DiffusersFamily):
    """Qwen-Image from a diffusers-format folder (e.g. ``Qwen/Qwen-Image``)."""

    name: ClassVar[str] = "qwen-image"
    hub_id: ClassVar[str] = "Qwen/Qwen-Image"
    weights_hint: ClassVar[str] = "https://huggingface.co/Qwen/Qwen-Image (Apache-2.0)"
    pipeline_class: ClassVar[str] = "QwenImagePipeline"
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    explore_skip: ClassVar[tuple[str, ...]] = (
        "img_in",
        "txt_in",
        "txt_norm",
        "time_text_embed",
        "img_mod",
        "txt_mod",
        "norm_out",
        "proj_out",
    )
    default_resolution: ClassVar[int] = 1024
    default_max_sequence_length: ClassVar[int] = 512  # QwenImagePipeline's default
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 1024  # QwenImagePipeline.check_inputs
    text_mask: ClassVar[bool] = True

    @classmethod
    def latent_shape_of(cls, pipe: Any, resolution: int) -> tuple[int, int, int]:
        side = resolution // cls.vae_scale_factor(pipe)
        return int(pipe.transformer.config.in_channels) // 4, side, side

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]``: each prompt's Qwen2.5-VL features (``QwenImagePipeline.encode_prompt``),
        zero-padded to ``L = model.max_sequence_length``; ``mask`` int64 ``[B, L]``, 1 on the prompt's rows."""
        emb, mask = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # every prompt fills the batch's length
            mask = torch.ones(emb.shape[:2], dtype=torch.int64, device=emb.device)
        pad = self.max_sequence_length - emb.shape[1]
        return {
            "emb": torch.nn.functional.pad(emb, (0, 0, 0, pad)),
            "mask": torch.nn.functional.pad(mask.to(torch.int64), (0, pad)),
        }

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at unpacked latents ``x [B, C, h, w]``, ``sigma [B]``: packed to ``[B, hw/4, 4C]``,
        timestep sigma, the prompts' rows up to the batch's longest (no mask when none is padded, as the
        pipeline); unpacked again."""
        B, C, h, w = x.shape
        dtype = self.transformer.dtype
        meta = cond["mask"].device.type == "meta"  # the memory plan's shapes: every token kept
        length = cond["mask"].shape[1] if meta else int(cond["mask"].sum(dim=1).max())
        emb, mask = cond["emb"][:, :length].to(dtype), cond["mask"][:, :length]
        out = net(
            hidden_states=type(self.pipe)._pack_latents(x.to(dtype), B, C, h, w),
            timestep=sigma.to(dtype),
            encoder_hidden_states=emb,
            encoder_hidden_states_mask=None if meta or bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2)]] * B,
            return_dict=False,
        )[0]
        vsf = self.vae_scale_factor(self.pipe)
        return type(self.pipe)._unpack_latents(out, h * vsf, w * vsf, vsf).squeeze(2)  # [B, C, h, w]

    def sigmas(self, steps: int) -> torch.Tensor:
        """QwenImagePipeline's grid (``pipeline_sigmas`` of the packed token count); float32 ``[steps + 1]``."""
        _, h, w = self.latent_shape
        return self.pipeline_sigmas(steps, (h // 2) * (w // 2))

    def vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """``vae.decode(z * latents_std + latents_mean)`` on a frame axis of 1 (QwenImagePipeline's formula):
        ``[b, C, h, w]`` to ``[b, 3, H, W]``."""
        return decode_wan_vae(self.pipe.vae, z.unsqueeze(2))[:, :, 0]

    #: ``QwenImagePipeline``'s true CFG is off without a ``true_cfg_scale``; its guidance embedding is unused.
    stock_call_kwargs: ClassVar[dict[str, Any]] = {"guidance_scale": None}

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """Packed 2x2 tokens in and out, as FLUX.1; the pipeline's latents carry a frame axis of 1."""
        _, C, h, w = noise.shape
        packed = type(pipe)._pack_latents(noise, 1, C, h, w)
        out = self.stock_call(pipe, prompt, packed, steps).images
        factor = pipe.vae_scale_factor
        return type(pipe)._unpack_latents(out, h * factor, w * factor, factor).squeeze(2)


@tiny_twin
@dataclass
class TinyQwenImage(TinyFamily, QwenImage):
    """A tiny random Qwen-Image of the real classes (2 blocks, 32 px, a 2-layer Qwen2.5-VL, a 4-channel video
    VAE): the plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-qwen-image"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 8  # the tiny VAE downsamples by 4
    #: The tiny byte-level tokenizer spends about 100 tokens on the template's system turn beyond the 34 that the
    #: pipeline drops (the published tokenizer's count), so prompts need this much room.
    default_max_sequence_length: ClassVar[int] = 224

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.QwenImageTransformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import QwenImageTransformer2DModel

        torch.manual_seed(0)
        return QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        )  # in_channels = 4 x the VAE's z_dim; joint = the text encoder's width

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        from solrl.stages.models.tiny_components import qwen2_5_vl, qwen_tokenizer

        tokenizer = qwen_tokenizer()
        torch.manual_seed(0)
        vae = AutoencoderKLQwenImage(
            base_dim=24,
            z_dim=4,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.05, 0.0],
            latents_std=[1.5, 2.0, 1.8, 2.5],
        )
        text_encoder = qwen2_5_vl(
            len(tokenizer),
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            {  # the vision tokens lie outside the tiny vocabulary: a text prompt never holds one
                "image_token_id": len(tokenizer) + 3,
                "video_token_id": len(tokenizer) + 4,
                "vision_start_token_id": len(tokenizer) + 1,
                "vision_end_token_id": len(tokenizer) + 2,
            },
        )
        QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(
                shift=1.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=0.9,
                base_image_seq_len=256,
                max_image_seq_len=8192,
                shift_terminal=0.02,
                time_shift_type="exponential",
            ),  # Qwen-Image's scheduler_config.json as recalled (not checked against the file, which the real
            # family reads at run time): exponential dynamic shift 0.5 -> 0.9 over 256 -> 8192 tokens, terminal 0.02
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=cls.tiny_transformer(),
        ).save_pretrained(out)
