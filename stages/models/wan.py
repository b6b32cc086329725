"""Wan2.1 text-to-video (``WanTransformer3DModel``; UMT5 text encoder; ``AutoencoderKLWan``) and its tiny CPU twin.

A sample is a video: latents ``[C, F', h, w]`` with ``F' = (F - 1) / 4 + 1`` latent frames for ``F`` frames
(``model.num_frames``; the VAE compresses time by 4 and space by 8), decoded to uint8 ``[F, H, W, 3]``. The
transformer takes the latents as they are, the timestep ``1000 sigma`` (as the scheduler's timesteps, integer
where the pipeline's scheduler makes them integer: UniPC does), and the UMT5 states of the prompt padded with zeros
to ``model.max_sequence_length`` (``WanPipeline.encode_prompt``); it predicts the flow velocity. Decoding
de-normalises by the VAE's per-channel ``latents_mean`` and ``latents_std``, as the pipeline. The sigma grid is the
pipeline scheduler's own (``set_timesteps(steps)``): UniPC's shifted flow sigmas for the published Wan2.1
(``flow_shift`` 3 at 480p), which solrl integrates with its own solver (``model.solver``). Frames are square
(``model.resolution``); Wan is published at 480 x 832 and 720 x 1280.

LoRA targets are Flow-Factory's and flow_grpo's for Wan: self- and cross-attention and the FFN. NVFP4 follows the
issue-19 rule, as no peer publishes one: the block projections are quantized; the patch embedding, the time and
text embedders (``condition_embedder``), ``norm_out`` and ``proj_out`` stay in high precision. Wan2.2's second
expert (``transformer_2``, ``boundary_ratio``) is not supported: one transformer carries the policy's LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.config import ConfigError, ModelConfig, RunConfig
from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, tiny_twin
from solrl.stages.models.diffusers_family import DiffusersFamily, TinyFamily, decode_wan_vae


@register_model("wan")
@dataclass
class Wan(DiffusersFamily):
    """Wan2.1 text-to-video from a diffusers-format folder (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``)."""

    name: ClassVar[str] = "wan"
    video: ClassVar[bool] = True
    hub_id: ClassVar[str] = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    weights_hint: ClassVar[str] = "https://huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers (Apache-2.0)"
    published_variants: ClassVar[tuple[tuple[str, str], ...]] = (
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "https://huggingface.co/Wan-AI/Wan2.1-T2V-14B-Diffusers (Apache-2.0)"),
    )
    pipeline_class: ClassVar[str] = "WanPipeline"
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    )
    explore_skip: ClassVar[tuple[str, ...]] = ("patch_embedding", "condition_embedder", "norm_out", "proj_out")
    default_resolution: ClassVar[int] = 480
    default_max_sequence_length: ClassVar[int] = 512  # WanPipeline's default
    resolution_multiple: ClassVar[int] = 16
    max_sequence_length_limit: ClassVar[int] = 512
    text_width_key: ClassVar[str] = "text_dim"
    #: Frames per video (Wan2.1's published 81: 5 s at 16 fps).
    default_num_frames: ClassVar[int] = 81
    #: Frames per latent frame of the VAE (after the first).
    temporal_factor: ClassVar[int] = 4

    #: Whether the pipeline's scheduler gives the transformer integer timesteps (UniPC does).
    integer_timesteps: bool = False

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        frames = cfg.model.num_frames or cls.default_num_frames
        if (frames - 1) % cls.temporal_factor:
            fit = (frames - 1) // cls.temporal_factor * cls.temporal_factor + 1
            raise ValueError(
                f"model.num_frames={frames}: {cls.name} needs 4k + 1 frames (its VAE compresses time by "
                f"{cls.temporal_factor} after the first frame); e.g. {max(fit, 1)} or {fit + cls.temporal_factor}"
            )

        stride = cfg.reward.frame_stride
        if stride > 1 and stride >= frames:
            raise ValueError(
                f"reward.frame_stride={stride} with model.num_frames={frames} scores the first frame only; set it "
                f"below {frames} (1 = every frame)"
            )

    @classmethod
    def vae_scale_factor(cls, pipe: Any) -> int:
        return int(pipe.vae_scale_factor_spatial)

    @classmethod
    def latent_factor(cls, pipe: Any) -> int:
        return cls.vae_scale_factor(pipe) * int(pipe.transformer.config.patch_size[1])

    @classmethod
    def from_pipe(cls, cfg: ModelConfig, pipe: Any, device: torch.device) -> Wan:
        adapter = super().from_pipe(cfg, pipe, device)
        assert isinstance(adapter, Wan)
        frames = cfg.num_frames or cls.default_num_frames
        temporal = int(adapter.pipe.vae_scale_factor_temporal)
        if (frames - 1) % temporal:
            raise ConfigError(f"model.num_frames={frames} must be 4k + 1 for {cls.name} (temporal factor {temporal})")
        channels, h, w = adapter.latent_shape
        adapter.latent_shape = (channels, (frames - 1) // temporal + 1, h, w)
        adapter.frames = frames
        scheduler = type(adapter.pipe.scheduler).from_config(adapter.pipe.scheduler.config)
        scheduler.set_timesteps(2, device="cpu")
        adapter.integer_timesteps = not scheduler.timesteps.is_floating_point()
        return adapter

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` ``[B, L, D]``: the UMT5 states of each prompt, zero-padded to ``L = model.max_sequence_length``
        (``WanPipeline.encode_prompt``, no CFG)."""
        emb, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"emb": emb}

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at video latents ``x [B, C, F', h, w]``, ``sigma [B]``; timestep ``1000 sigma``
        (truncated to an integer where the pipeline's scheduler does)."""
        dtype = self.transformer.dtype
        timestep = sigma.float() * self.pipe.scheduler.config.num_train_timesteps
        if self.integer_timesteps:
            timestep = timestep.long()
        return net(
            hidden_states=x.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["emb"].to(dtype),
            return_dict=False,
        )[0]

    def sigmas(self, steps: int) -> torch.Tensor:
        """The pipeline scheduler's grid for ``steps`` steps (``set_timesteps(steps)``), ending at 0; float32
        ``[steps + 1]``."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(steps, device="cpu")
        sigmas = scheduler.sigmas.float()
        if len(sigmas) != steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(f"{type(scheduler).__name__} gives {len(sigmas)} sigmas ending at {float(sigmas[-1])}")
        return sigmas.to(self.device)

    def vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """``vae.decode(z * latents_std + latents_mean)`` (WanPipeline's formula): ``[b, C, F', h, w]`` to videos
        ``[b, 3, F, H, W]``."""
        return decode_wan_vae(self.pipe.vae, z)

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """``WanPipeline`` returns the latents as ``frames``, and takes the frame count."""
        return self.stock_call(pipe, prompt, noise, steps, num_frames=self.frames).frames


@tiny_twin
@dataclass
class TinyWan(TinyFamily, Wan):
    """A tiny random Wan2.1 of the real classes (2 blocks, 32 px, 5 frames, a 2-layer UMT5): the plumbing on CPU,
    not learning. Its pipeline's scheduler is ``FlowMatchEulerDiscreteScheduler`` (shift 3, the published
    ``flow_shift``), so the stock pipeline's Euler sampling is the policy's, step for step."""

    name: ClassVar[str] = "tiny-wan"
    default_resolution: ClassVar[int] = 32
    default_max_sequence_length: ClassVar[int] = 32
    default_num_frames: ClassVar[int] = 5

    @classmethod
    def tiny_transformer(cls):  # -> diffusers.WanTransformer3DModel
        """The tiny random transformer of this family (seeded: the same weights on every machine)."""
        from diffusers import WanTransformer3DModel

        torch.manual_seed(0)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )  # in_channels = the VAE's z_dim; text_dim = the UMT5 width

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
        from transformers import UMT5Config, UMT5EncoderModel

        from solrl.stages.models.tiny_components import t5_tokenizer

        tokenizer = t5_tokenizer()
        torch.manual_seed(0)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                feed_forward_proj="gated-gelu",
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        ).eval()
        WanPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            transformer=cls.tiny_transformer(),
        ).save_pretrained(out)
