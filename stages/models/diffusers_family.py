"""The common part of the families loaded as a diffusers pipeline folder (SANA, FLUX.1, SD3.5, Z-Image, ...).

The pipeline object is kept for what diffusers already does exactly: ``encode_prompt`` (each family's prompt
handling: tokenizers, complex human instruction, CLIP pooling, T5) and the VAE. Sampling, the policy's LoRA
and the low-precision explore copy are solrl's; the transformer is the pipeline's, so the exported LoRA
loads back into the same pipeline class.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from solrl.config import ConfigError, ModelConfig, RunConfig
from solrl.stages.models.adapter import ModelAdapter
from solrl.storage.stage import plain_modes
from solrl.weights import PIPELINE_FILES, PublishedWeights, hub_download, pipeline_dir, published_weights

#: Images decoded per VAE call (bounds the decoder's activation memory at 1024 px).
DECODE_BATCH = 8


def quiet_loading() -> None:
    """No per-file progress bars from diffusers and transformers while solrl loads or builds a pipeline (the
    campaign's own log says what is loading)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def weights_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 weights on CUDA (BF16 train, DESIGN 1), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def solrl_cache() -> Path:
    """Where solrl keeps what it builds once per machine (the tiny families): ``$SOLRL_CACHE`` or
    ``~/.cache/solrl``."""
    return Path(os.environ.get("SOLRL_CACHE", "~/.cache/solrl")).expanduser()


@dataclass
class DiffusersFamily(ModelAdapter):
    """A family whose weights are a diffusers pipeline folder (``model_index.json`` and component folders)."""

    #: Published weights (a hub id; built-in families take it from ``solrl.weights.PUBLISHED``).
    hub_id: ClassVar[str] = ""
    default_resolution: ClassVar[int]
    #: Pixels per latent token along a side for the published VAE and patch size: resolutions are multiples.
    resolution_multiple: ClassVar[int]
    default_max_sequence_length: ClassVar[int]
    #: The most text tokens the text encoder was trained for.
    max_sequence_length_limit: ClassVar[int]
    #: Pipeline attributes holding the text encoders (released after the prompts are encoded).
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)

    pipe: Any = None
    resolution: int = 0
    max_sequence_length: int = 0
    guidance: float = 1.0

    # -- class level ---------------------------------------------------------------------------------------------
    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        resolution, multiple = cfg.model.resolution or cls.default_resolution, cls.resolution_multiple
        if resolution % multiple:
            raise ValueError(
                f"model.resolution={resolution} must be a multiple of {multiple} for {cls.name} (VAE downsampling "
                f"x patch size); e.g. {max(multiple, resolution // multiple * multiple)}"
            )
        length, limit = cfg.model.max_sequence_length, cls.max_sequence_length_limit
        if length is not None and length > limit:
            raise ValueError(
                f"model.max_sequence_length={length} exceeds the {limit} tokens {cls.name}'s text encoder takes; "
                f"set at most {limit} (null = {cls.default_max_sequence_length})"
            )

    @classmethod
    def weights_dir(cls, cfg: ModelConfig) -> Path:
        """``model.path`` as a local folder; a hub id resolves to the local hub cache (never downloaded here
        while ``HF_HUB_OFFLINE=1``)."""
        if cfg.path is None:
            raise ConfigError(
                f"model.family={cls.name} needs model.path: a diffusers-format folder or hub id; "
                f"weights: {cls.weights_hint}"
            )
        return pipeline_dir(cfg.path)

    @classmethod
    def required_files(cls, cfg: ModelConfig) -> tuple[str, ...]:
        return PIPELINE_FILES

    @classmethod
    def check_runnable(cls, cfg: ModelConfig) -> None:
        """The weights files (locally or in the hub cache); a hub id not cached is fine only when online
        (``solrl.weights``, which checks the published families before torch is imported)."""
        published = published_weights(cls.name, cfg.path)  # a published variant names its own source
        hint = published.hint if published is not None else cls.weights_hint
        PublishedWeights(cls.hub_id, hint, cls.required_files(cfg)).check(cls.name, cfg.path)

    @classmethod
    def load(cls, cfg: ModelConfig, device: torch.device, *, text_encoders: bool = True) -> DiffusersFamily:
        import diffusers

        quiet_loading()
        source = cfg.path if hub_download(cfg.path) else cls.weights_dir(cfg)  # a hub id downloads (online only)
        skipped = {} if text_encoders else dict.fromkeys(cls.text_encoder_names)  # None: diffusers loads nothing
        pipe = getattr(diffusers, cls.pipeline_class).from_pretrained(source, dtype=weights_dtype(device), **skipped)
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        pipe.transformer.eval().requires_grad_(False)
        resolution = cfg.resolution or cls.default_resolution
        factor = cls.latent_factor(pipe)
        if resolution % factor:
            raise ConfigError(
                f"model.resolution={resolution} must be a multiple of {factor} for {cls.name} "
                f"(VAE downsampling x patch size)"
            )
        adapter = cls(
            transformer=pipe.transformer,
            device=device,
            latent_shape=cls.latent_shape_of(pipe, resolution),
            shift=cfg.sampler_shift,
            solver=cfg.solver,
            grid_period=factor,
            pipe=pipe,
            resolution=resolution,
            max_sequence_length=cfg.max_sequence_length or cls.default_max_sequence_length,
            guidance=cfg.guidance,
        )
        if not text_encoders:
            adapter.release_text_encoders()
        return adapter

    @classmethod
    def vae_scale_factor(cls, pipe: Any) -> int:
        return int(pipe.vae_scale_factor)

    @classmethod
    def latent_factor(cls, pipe: Any) -> int:
        """Pixels per latent token along a side: the VAE's downsampling times the transformer's patch size."""
        return cls.vae_scale_factor(pipe) * int(pipe.transformer.config.patch_size)

    @classmethod
    def latent_shape_of(cls, pipe: Any, resolution: int) -> tuple[int, int, int]:
        side = resolution // cls.vae_scale_factor(pipe)
        return int(pipe.transformer.config.in_channels), side, side

    @classmethod
    def build_tiny(cls, out: Path) -> None:
        """Write a tiny random-weight pipeline of this family's real classes to ``out`` (tiny families)."""
        raise NotImplementedError

    # -- instance level --------------------------------------------------------------------------------------------
    def text_encoders(self) -> dict[str, nn.Module | None]:
        return {name: getattr(self.pipe, name) for name in self.text_encoder_names}

    def _drop_text_encoders(self) -> None:
        for name in self.text_encoder_names:
            setattr(self.pipe, name, None)

    def pipeline_sigmas(self, steps: int, image_seq_len: int) -> torch.Tensor:
        """The grid of the flow pipelines that shift by image size (FLUX.1, Qwen-Image, Z-Image):
        ``linspace(1, 1/steps, steps)`` through the pipeline's own scheduler with ``mu = calculate_shift(
        image_seq_len)`` (used only where the scheduler shifts dynamically; otherwise its static ``shift``), then 0.

        Args:
            image_seq_len: the transformer's image tokens per sample (latent positions / patch area).

        Returns:
            float32 ``[steps + 1]``, 1 -> 0, on the adapter's device.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=mu, device="cpu")
        return scheduler.sigmas.float().to(self.device)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """The family's ``vae_decode`` in batches of ``DECODE_BATCH``, clamped to [-1, 1], to uint8 ``[B, H, W, 3]``
        (videos ``[B, F, H, W, 3]``)."""
        images = []
        for chunk in latents.split(DECODE_BATCH):
            image = self.vae_decode(chunk.to(self.device, self.pipe.vae.dtype)).float().clamp(-1, 1)
            images.append(((image + 1) * 127.5).round().to(torch.uint8).movedim(1, -1).cpu())
        return torch.cat(images).numpy()

    def vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents ``[b, *latent_shape]`` (on the device, in the VAE's dtype) to pixels ``[b, 3, H, W]`` (videos
        ``[b, 3, F, H, W]``) in about [-1, 1]: ``vae.decode(z / scaling_factor + shift_factor)``, the pipelines'
        formula; families whose VAE normalises otherwise override it."""
        vae = self.pipe.vae
        scaling, shift = vae.config.scaling_factor, getattr(vae.config, "shift_factor", None) or 0.0
        return vae.decode(z / scaling + shift, return_dict=False)[0]


def decode_wan_vae(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z * latents_std + latents_mean)`` with the per-channel statistics of a Wan-style VAE
    (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``), as WanPipeline and QwenImagePipeline decode:
    ``[b, C, F, h, w]`` to ``[b, 3, F', H, W]``."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
    std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
    return vae.decode(z * std + mean, return_dict=False)[0]


def build_once(family: type[DiffusersFamily], out: Path) -> Path:
    """Build ``family``'s tiny pipeline into ``out`` unless it is there; atomic (a sibling folder renamed into
    place), so concurrent first runs and a killed build never leave a half-written model."""
    if (out / "model_index.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    quiet_loading()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        family.build_tiny(tmp)
        plain_modes(tmp)  # mkdtemp made it 0700
        try:
            os.replace(tmp, out)
        except OSError:  # another process built it first
            if not (out / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


#: Bumped whenever a tiny family's builder changes, so a machine's cached tiny models are rebuilt.
TINY_VERSION = 1


class TinyFamily:
    """Mixin of the tiny families: weights built on first use in the solrl cache (or at ``model.path``)."""

    weights_hint: ClassVar[str] = "built on first use (random weights) in $SOLRL_CACHE or ~/.cache/solrl"

    @classmethod
    def weights_dir(cls, cfg: ModelConfig) -> Path:
        default = solrl_cache() / "models" / f"{cls.name}-v{TINY_VERSION}"  # type: ignore[attr-defined]
        return Path(cfg.path).expanduser() if cfg.path else default

    @classmethod
    def check_runnable(cls, cfg: ModelConfig) -> None:
        """A missing tiny model is built by ``load``: its cache folder must then be creatable (it is created
        here, before any run is)."""
        out = cls.weights_dir(cfg)
        if (out / "model_index.json").exists():
            return
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            probe = Path(tempfile.mkdtemp(prefix=".probe-", dir=out.parent))
            probe.rmdir()
        except OSError as exc:
            raise ConfigError(
                f"the tiny model {cls.name} is built on first use in {out}, which cannot be written "  # type: ignore[attr-defined]
                f"({exc.strerror or exc}); set SOLRL_CACHE (or model.path) to a writable folder"
            ) from None

    @classmethod
    def load(cls, cfg: ModelConfig, device: torch.device, *, text_encoders: bool = True) -> DiffusersFamily:
        build_once(cls, cls.weights_dir(cfg))  # type: ignore[arg-type]
        return super().load(cfg, device, text_encoders=text_encoders)  # type: ignore[misc]
