"""Z-Image (``ZImageTransformer2DModel``, a single-stream DiT; Qwen3 text encoder; ``AutoencoderKL``) and its tiny
CPU twin.

The transformer takes lists: one latent ``[C, 1, h, w]`` and one caption ``[L_i, D]`` per sample, the caption
being the Qwen3 hidden states (second to last layer) of the prompt's real tokens in Qwen's chat template
(``ZImagePipeline.encode_prompt``). The adapter keeps each caption padded to ``model.max_sequence_length`` with a
mask, so embeddings cache and batch like every family's, and hands the transformer the masked rows, exactly as
the pipeline does. Z-Image's time runs the other way: the transformer is given ``1 - sigma`` and predicts
``x0 - eps``, so the velocity is its negated output (``ZImagePipeline.__call__``). The sigma grid is the
pipeline's: ``linspace(1, 1/steps, steps)`` through the published scheduler (a static shift of 3 for
Z-Image-Turbo; ``mu`` of the image's token count where a scheduler shifts dynamically).

No peer publishes an NVFP4 rule for Z-Image; solrl's is the issue-19 rule: the attention and MLP projections of
every block (refiners included) are quantized, the patch, caption and time embedders, the adaLN modulation and
the final layer stay in high precision. The LoRA targets are Flow-Factory's for Z-Image: the attention and the
SwiGLU MLP (``w1``, ``w2``, ``w3``).
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


@register_model("z-image")
@dataclass
class ZImage(DiffusersFamily):
    """Z-Image from a diffusers-format folder (e.g. ``Tongyi-MAI/Z-Image-Turbo``)."""

    name: ClassVar[str] = "z-image"
    hub_id: ClassVar[str] = "Tongyi-MAI/Z-Image-Turbo"
    weights_hint: ClassVar[str] = "https://huggingface.co/Tongyi-MAI/Z-Image-Turbo (Apache-2.0)"
    published_variants: ClassVar[tuple[tuple[str, str], ...]] = (
        ("Tongyi-MAI/Z-Image", "https://huggingface.co/Tongyi-MAI/Z-Image (Apache-2.0)"),
    )
    pipeline_class: ClassVar[str] = "ZImagePipeline"
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    explore_skip: ClassVar[tuple[str, ...]] = (
        "all_x_embedder",
        "cap_embedder",
        "t_embedder",
        "siglip_embedder",
        "adaLN_modulation",
        "all_final_layer",
    )
    default_resolution: ClassVar[int] = 1024
    default_max_sequence_length: ClassVar[int] = 512  # ZImagePipeline's default
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 1024
    depth_keys: ClassVar[tuple[str, ...]] = ("n_layers",)
    text_width_key: ClassVar[str] = "cap_feat_dim"
    text_mask: ClassVar[bool] = True
    #: The transformer's patch size (``all_patch_size``: the pipelines use 2).
    patch_size: ClassVar[int] = 2

    @classmethod
    def latent_factor(cls, pipe: Any) -> int:
        return cls.vae_scale_factor(pipe) * cls.patch_size

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]``: each prompt's caption features (``ZImagePipeline.encode_prompt``, no CFG),
        zero-padded to ``L = model.max_sequence_length``; ``mask`` int64 ``[B, L]``, 1 on the caption's rows."""
        captions, _ = self.pipe.encode_prompt(
            prompt=list(prompts),  # the pipeline rewrites its list in place (chat template)
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        length, width = self.max_sequence_length, captions[0].shape[-1]
        emb = captions[0].new_zeros(len(captions), length, width)
        mask = torch.zeros(len(captions), length, dtype=torch.int64, device=self.device)
        for i, caption in enumerate(captions):
            emb[i, : len(caption)] = caption
            mask[i, : len(caption)] = 1
        return {"emb": emb, "mask": mask}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at latents ``x [B, C, h, w]``, ``sigma [B]``: the transformer gets the list of
        ``[C, 1, h, w]`` latents, time ``1 - sigma`` and each caption's masked rows; its output, stacked, is
        ``x0 - eps``, so the velocity is its negation."""
        dtype = self.transformer.dtype
        latents = list(x.to(dtype).unsqueeze(2).unbind(0))  # B x [C, 1, h, w]
        emb = cond["emb"].to(dtype)
        if emb.device.type == "meta":  # the memory plan's shapes: every caption row kept
            captions = list(emb.unbind(0))
        else:
            captions = [e[mask.bool()] for e, mask in zip(emb, cond["mask"], strict=True)]
        out = net(latents, 1 - sigma.float(), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def sigmas(self, steps: int) -> torch.Tensor:
        """ZImagePipeline's grid through the pipeline's own scheduler; float32 ``[steps + 1]``."""
        _, h, w = self.latent_shape
        return self.pipeline_sigmas(steps, (h // self.patch_size) * (w // self.patch_size))

    #: ``ZImagePipeline`` guides whenever ``guidance_scale > 0``.
    stock_call_kwargs: ClassVar[dict[str, Any]] = {"guidance_scale": 0.0}


@tiny_twin
@dataclass
class TinyZImage(TinyFamily, ZImage):
    """A tiny random Z-Image of the real classes (1 refiner and 1 main block, 32 px, a 2-layer Qwen3): the
    plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-z-image"
    default_resolution: ClassVar[int] = 32
    resolution_multiple: ClassVar[int] = 4  # the tiny VAE downsamples by 2
    #: The chat template takes about 30 of the tiny byte-level tokenizer's tokens before the prompt's own.
    default_max_sequence_length: ClassVar[int] = 96

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.ZImageTransformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import ZImageTransformer2DModel

        torch.manual_seed(0)
        return ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=1,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            qk_norm=True,
            cap_feat_dim=32,
            axes_dims=[8, 4, 4],
            axes_lens=[512, 32, 32],
        )  # cap_feat_dim = the Qwen3 width; axes_dims sum to the head size (32 / 2)

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        from solrl.stages.models.tiny_components import autoencoder_kl, qwen3_encoder, qwen_tokenizer

        tokenizer = qwen_tokenizer()
        ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's: static shift 3
            vae=autoencoder_kl(0.3611, 0.1159, latent_channels=16),  # the published VAE's scaling and shift
            text_encoder=qwen3_encoder(tokenizer, hidden=32),
            tokenizer=tokenizer,
            transformer=cls.tiny_transformer(),
        ).save_pretrained(out)
