"""Chroma (``ChromaTransformer2DModel``: FLUX.1-schnell's MMDiT, 8.9 B parameters, with its per-block modulations
computed by a small "distilled guidance" network instead of the time-text embedding; T5-XXL only; ``AutoencoderKL``)
and its tiny CPU twin. Apache-2.0 weights: ``lodestones/Chroma1-HD``.

It differs from FLUX.1 (``flux.py``) where ``ChromaPipeline`` does: the prompt is T5's alone, with no CLIP pooled
vector and no guidance embedding, and its token mask reaches the transformer, keeping the text tokens and the
first padding token (``ChromaPipeline._get_t5_prompt_embeds``), with every image token after them
(``_prepare_attention_mask``). The mask is given as bool, which ``scaled_dot_product_attention`` reads as
keep/drop, so the padding tokens are hidden as in the reference implementation (``lodestone-rock/flow``) and
ComfyUI; diffusers' pipeline passes it in the embeddings' float dtype, which SDPA adds to the attention scores
instead, hiding nothing (diffusers issues 11724, 12116, 13619). The export check calls the stock pipeline with its
own prompt embedding and the bool mask (``stock_call``), so the two sample alike. Latents are packed into 2x2
tokens and the sigma grid shifts with the image size, as FLUX.1's. Sol-RL publishes no Chroma settings: the preset
keeps its FLUX.1-dev ones (512 px, ``dpm2``, LoRA on the attention, NVFP4 leaving the embedders, the modulation
network, ``norm_out`` and Linear layers with ``max(in, out) <= 1000`` in high precision).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.flux import Flux, TinyFlux

# diffusers' own ChromaTransformer2DModel builds FluxPosEmbed from the module it deprecates, so every Chroma
# transformer made (the plan's meta one included) warned the user of a diffusers internal they cannot change.
warnings.filterwarnings("ignore", message="`FluxPosEmbed` is deprecated", category=FutureWarning)


@register_model("chroma")
@dataclass
class Chroma(Flux):
    """Chroma from a diffusers-format folder (e.g. ``lodestones/Chroma1-HD``)."""

    name: ClassVar[str] = "chroma"
    hub_id: ClassVar[str] = "lodestones/Chroma1-HD"
    weights_hint: ClassVar[str] = "https://huggingface.co/lodestones/Chroma1-HD (Apache-2.0)"
    pipeline_class: ClassVar[str] = "ChromaPipeline"
    guidance_embedding: ClassVar[bool] = False  # the distilled guidance network takes the timestep only
    explore_skip: ClassVar[tuple[str, ...]] = ("x_embedder", "context_embedder", "distilled_guidance_layer", "norm_out")
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    pooled_width_key: ClassVar[str | None] = None
    text_mask: ClassVar[bool] = True

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]`` (T5, computed with its token mask) and ``mask`` int64 ``[B, L]`` (1 for the text
        tokens and the first padding token), by ``ChromaPipeline.encode_prompt`` without a negative prompt."""
        emb, _, mask, *_ = self.pipe.encode_prompt(
            prompt=prompts,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"emb": emb, "mask": mask.long()}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at unpacked latents ``x [B, C, h, w]``, ``sigma [B]``: packed to ``[B, hw/4, 4C]``,
        timestep = sigma, the bool text mask followed by every image token; unpacked again."""
        B, C, h, w = x.shape
        dtype = self.transformer.dtype
        pipe = type(self.pipe)
        packed = pipe._pack_latents(x.to(dtype), B, C, h, w)  # [B, h/2 * w/2, 4C]
        img_ids = pipe._prepare_latent_image_ids(B, h // 2, w // 2, x.device, dtype)  # [hw/4, 3]
        txt_ids = torch.zeros(cond["emb"].shape[1], 3, device=x.device, dtype=dtype)
        image = torch.ones(B, packed.shape[1], device=x.device, dtype=torch.bool)
        mask = torch.cat([cond["mask"].bool(), image], dim=1)  # [B, L + hw/4], True = attended
        out = net(
            hidden_states=packed,
            timestep=sigma.to(dtype),
            encoder_hidden_states=cond["emb"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            attention_mask=mask,
            return_dict=False,
        )[0]
        vsf = self.vae_scale_factor(self.pipe)
        return pipe._unpack_latents(out, h * vsf, w * vsf, vsf)  # [B, C, h, w]

    def stock_call(self, pipe: Any, prompt: str, latents: torch.Tensor, steps: int, **extra: Any) -> Any:
        """``ChromaPipeline`` on its own embedding of ``prompt`` with the token mask as bool (see the module
        docstring), so it masks the padding tokens as ``velocity`` does."""
        emb, _, mask, *_ = pipe.encode_prompt(
            prompt=[prompt],
            device=latents.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return super().stock_call(pipe, None, latents, steps, prompt_embeds=emb, prompt_attention_mask=mask.bool())


@tiny_twin
@dataclass
class TinyChroma(TinyFlux, Chroma):
    """A tiny random Chroma of the real classes (tiny-flux's widths and tiny components, a 1-layer modulation
    network, 32 px): the plumbing on CPU, not learning."""

    name: ClassVar[str] = "tiny-chroma"

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.ChromaTransformer2DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import ChromaTransformer2DModel

        torch.manual_seed(0)
        return ChromaTransformer2DModel(
            **cls.tiny_widths, approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=1
        )

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import ChromaPipeline

        from solrl.stages.models.tiny_components import autoencoder_kl, t5_encoder, t5_tokenizer

        tokenizer = t5_tokenizer()
        ChromaPipeline(
            scheduler=cls.tiny_scheduler(),
            vae=autoencoder_kl(0.3611, 0.1159),  # FLUX.1's VAE, which Chroma uses
            text_encoder=t5_encoder(tokenizer, d_model=32),
            tokenizer=tokenizer,
            transformer=cls.tiny_transformer(),
            image_encoder=None,
            feature_extractor=None,
        ).save_pretrained(out)
