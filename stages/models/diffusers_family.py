"""The common part of the families loaded as a diffusers pipeline folder (SANA, FLUX.1, SD3.5, Z-Image, ...).

The pipeline object is kept for what diffusers already does exactly: ``encode_prompt`` (each family's prompt
handling: tokenizers, complex human instruction, CLIP pooling, T5) and the VAE. Sampling, the policy's LoRA
and the low-precision explore copy are solrl's; the transformer is the pipeline's, so the exported LoRA
loads back into the same pipeline class.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from solrl.config import ConfigError, ModelConfig, RunConfig
from solrl.stages.models.adapter import Conditioning, ModelAdapter, weights_dtype
from solrl.storage.stage import plain_modes
from solrl.weights import HUB_ID, PIPELINE_FILES, PublishedWeights, hub_download, pipeline_dir, published_weights

#: Images decoded per VAE call (bounds the decoder's activation memory at 1024 px).
DECODE_BATCH = 8


def quiet_loading() -> None:
    """No per-file progress bars from diffusers and transformers while solrl loads or builds a pipeline (the
    campaign's own log says what is loading)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


@contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers' warnings silenced for the duration: casting a model built from its config (it warns about
    modules to keep in float32 even when it names none), a tiny twin's prompt truncation."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)


def solrl_cache() -> Path:
    """Where solrl keeps what it builds once per machine (the tiny twins): ``$SOLRL_CACHE`` or
    ``~/.cache/solrl``."""
    return Path(os.environ.get("SOLRL_CACHE", "~/.cache/solrl")).expanduser()


@dataclass
class DiffusersFamily(ModelAdapter):
    """A family whose weights are a diffusers pipeline folder (``model_index.json`` and component folders)."""

    #: Published weights: the hub id (with ``weights_hint`` and ``published_variants``, literals the registry reads
    #: without importing the adapter, for the weights check before torch; ``solrl.weights.published_weights``).
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
        pipe = getattr(diffusers, cls.pipeline_class).from_pretrained(
            source, dtype=weights_dtype(device, cfg.dtype), **skipped
        )
        pipe.set_progress_bar_config(disable=True)
        pipe.to(device)
        adapter = cls.from_pipe(cfg, pipe, device)
        if not text_encoders:
            adapter.release_text_encoders()
        return adapter

    @classmethod
    def from_pipe(cls, cfg: ModelConfig, pipe: Any, device: torch.device) -> DiffusersFamily:
        """The adapter of a built pipeline ``pipe`` (its transformer frozen): ``load``'s, and the memory plan's
        pipeline of meta tensors (``solrl.stages.memory``).

        Raises:
            ConfigError: ``model.resolution`` is not a multiple of the VAE downsampling x patch size.
        """
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
        return adapter

    # -- the memory plan: the pipeline on the meta device ------------------------------------------------------
    #: Transformer config keys counting its repeated blocks (``meta_adapter(blocks=...)`` cuts each to that many).
    depth_keys: ClassVar[tuple[str, ...]] = ("num_layers",)
    #: Transformer config key giving the width of the text embedding ``emb`` it takes.
    text_width_key: ClassVar[str] = "joint_attention_dim"
    #: Transformer config key of the pooled text embedding's width (``pooled``), if the family takes one.
    pooled_width_key: ClassVar[str | None] = None
    #: Whether the conditioning carries a token ``mask`` int64 ``[B, L]``.
    text_mask: ClassVar[bool] = False
    #: Text tokens ahead of ``model.max_sequence_length`` in ``emb`` (SD3: the 77 CLIP tokens).
    extra_text_tokens: ClassVar[int] = 0

    @classmethod
    def pipeline_configs(cls, cfg: ModelConfig) -> tuple[dict[str, Any], str]:
        """The pipeline's component configs and where they come from: ``model.path``'s own when its transformer and
        VAE configs are there (text encoders counted from their safetensors headers), else the published configs
        shipped with solrl (``solrl/stages/models/published/``, by the pipeline's hub id).

        Returns:
            ``({"transformer": {"class", "config"}, "vae": {...}, "scheduler": {...} | None, "text_encoders":
            {name: parameters}}, source)``.

        Raises:
            ConfigError: neither is available.
        """
        from solrl.stages.models.published import read_folder, read_published

        folder = cls.weights_dir(cfg) if cfg.path or issubclass(cls, TinyFamily) else None
        if folder is not None and (folder / "transformer" / "config.json").is_file():
            return read_folder(folder), str(folder)
        published = read_published(cfg.path or cls.hub_id)
        if published is None:
            raise ConfigError(
                f"no configs to plan {cls.name}'s memory with: {folder or cfg.path} has no transformer/config.json, "
                f"and solrl ships no published configs for {cfg.path or cls.hub_id!r}"
            )
        return published, f"published configs of {cfg.path or cls.hub_id}"

    @classmethod
    def meta_adapter(
        cls, cfg: ModelConfig, dtype: torch.dtype, *, blocks: int | dict[str, int] | None = None, device: str = "meta"
    ) -> tuple[DiffusersFamily, str, int]:
        """The family's adapter over a pipeline of meta tensors (the transformer and VAE built from their configs
        in ``dtype``, no text encoder), for ``solrl.stages.memory``; ``blocks`` cuts every ``depth_keys`` count to
        that many (a mapping: the named ones). ``device="cpu"`` builds the same pipeline with random weights, for
        the benchmarks that check the meta counts against real tensors.

        Returns:
            ``(adapter, where the configs came from, text encoders' parameter bytes in dtype)``.
        """
        import inspect

        import diffusers

        if issubclass(cls, TinyFamily):
            build_once(cls, cls.weights_dir(cfg))  # type: ignore[arg-type]
        configs, source = cls.pipeline_configs(cfg)
        original = configs["transformer"]["config"]
        transformer_config = dict(original)
        if blocks is not None:
            cuts = blocks if isinstance(blocks, dict) else dict.fromkeys(cls.depth_keys, blocks)
            for key, count in cuts.items():
                transformer_config[key] = min(count, int(transformer_config[key]))
            cls.cut_depth(transformer_config, original)
        with torch.device(device), quiet_diffusers():
            transformer = getattr(diffusers, configs["transformer"]["class"]).from_config(transformer_config)
            vae = getattr(diffusers, configs["vae"]["class"]).from_config(configs["vae"]["config"])
            transformer.to(dtype)
            vae.to(dtype)
        scheduler = configs.get("scheduler")
        scheduler = (
            getattr(diffusers, scheduler["class"]).from_config(scheduler["config"])
            if scheduler
            else diffusers.FlowMatchEulerDiscreteScheduler()
        )
        pipeline = getattr(diffusers, cls.pipeline_class)
        wanted = [n for n in inspect.signature(pipeline.__init__).parameters if n != "self"]
        given = {"transformer": transformer, "vae": vae, "scheduler": scheduler}
        pipe = pipeline(**{name: given.get(name) for name in wanted})
        adapter = cls.from_pipe(cfg, pipe, torch.device(device))
        adapter._released = True
        size = torch.empty((), dtype=dtype).element_size()
        return adapter, source, size * sum(configs["text_encoders"].values())

    @classmethod
    def cut_depth(cls, config: dict[str, Any], original: dict[str, Any]) -> None:
        """Keep the rest of a transformer config consistent after ``depth_keys`` were cut (``config``, in place)
        from ``original``, the full-depth config."""

    def conditioning_like(self, batch: int) -> Conditioning:
        """Conditioning of ``batch`` prompts with the keys, shapes and dtypes ``_encode`` gives (every text token
        kept, values zero), on the adapter's device: what the memory plan measures with, no text encoder loaded."""
        config, dtype = self.transformer.config, self.transformer.dtype
        length = self.max_sequence_length + self.extra_text_tokens
        cond = {"emb": torch.zeros(batch, length, int(config[self.text_width_key]), device=self.device, dtype=dtype)}
        if self.pooled_width_key:
            cond["pooled"] = torch.zeros(batch, int(config[self.pooled_width_key]), device=self.device, dtype=dtype)
        if self.text_mask:
            cond["mask"] = torch.ones(batch, length, device=self.device, dtype=torch.int64)
        return cond

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
        """Write a tiny random-weight pipeline of this family's real classes to ``out`` (tiny twins)."""
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

        if steps == 1:
            # One step from pure noise: every shift maps sigma 1 to 1. The scheduler's terminal stretch
            # (``shift_terminal``: Qwen-Image's 0.02) divides by 1 - sigma_last = 0 there and gives NaN.
            return torch.tensor([1.0, 0.0], device=self.device)
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

    #: Keyword arguments of the stock pipeline's ``__call__`` that make it sample as the policy does: no
    #: classifier-free guidance (Sol-RL samples with guidance 1), plus any family-specific switch.
    stock_call_kwargs: ClassVar[dict[str, Any]] = {"guidance_scale": 1.0}

    def stock_call(self, pipe: Any, prompt: str, latents: torch.Tensor, steps: int, **extra: Any) -> Any:
        """``pipe(...)`` (the family's stock diffusers pipeline) on ``prompt`` from ``latents`` in ``steps`` steps at
        this model's resolution, text length and embedded guidance (``model.guidance``, where the transformer
        embeds one), returning latents (``output_type="latent"``); ``extra`` adds keyword arguments."""
        return pipe(
            prompt=prompt,
            latents=latents,
            height=self.resolution,
            width=self.resolution,
            num_inference_steps=steps,
            max_sequence_length=self.max_sequence_length,
            output_type="latent",
            # A guidance-embedding pipeline's guidance_scale is the embedded value (model.guidance), not CFG.
            **(self.stock_call_kwargs | ({"guidance_scale": self.guidance} if self.guidance_embedding else {})),
            **extra,
        )

    def stock_pipeline_latents(self, pipe: Any, prompt: str, noise: torch.Tensor, steps: int) -> torch.Tensor:
        """What the family's stock diffusers pipeline (``pipeline_class``, e.g. with the exported LoRA loaded)
        samples for ``prompt`` from ``noise`` in ``steps`` steps without classifier-free guidance: its final
        latents in the policy's sampling space, to compare with the policy's own samples (with ``model.solver``
        euler, as the pipelines' flow-matching schedulers step). The export test checks every family this way.

        Args:
            pipe: the stock pipeline, on the policy's device.
            noise: float ``[1, *latent_shape]``, the policy's initial noise of one seed (``initial_noise``).

        Returns:
            float ``[1, *latent_shape]``.
        """
        return self.stock_call(pipe, prompt, noise, steps).images

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """The family's ``vae_decode`` in batches of ``DECODE_BATCH``, clamped to [-1, 1], to uint8 ``[B, H, W, 3]``
        (videos ``[B, F, H, W, 3]``).

        Raises:
            ValueError: the images are not ``model.resolution`` pixels a side: the family's latent geometry
                (``vae_scale_factor``) is not its VAE's (a plug-in family whose pipeline hard-codes the factor).
        """
        images = []
        for chunk in latents.split(DECODE_BATCH):
            image = self.vae_decode(chunk.to(self.device, self.pipe.vae.dtype)).float().clamp(-1, 1)
            images.append(((image + 1) * 127.5).round().to(torch.uint8).movedim(1, -1).cpu())
        decoded = torch.cat(images).numpy()
        side = decoded.shape[-3:-1]
        if self.resolution and side != (self.resolution, self.resolution):
            factor = self.vae_scale_factor(self.pipe)
            raise ValueError(
                f"model family {self.name} decoded {side[1]}x{side[0]} images at model.resolution={self.resolution}: "
                f"its latents {tuple(self.latent_shape)} come from vae_scale_factor={factor}, which is not its "
                "VAE's downsampling; override vae_scale_factor (or latent_shape_of) in the family"
            )
        return decoded

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
        (tmp / TINY_MARKER).write_text(json.dumps({"twin": family.name, "version": TINY_VERSION}) + "\n")
        plain_modes(tmp)  # mkdtemp made it 0700
        try:
            os.replace(tmp, out)
        except OSError:  # another process built it first
            if not (out / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


#: Bumped whenever a tiny twin's builder changes, so a machine's cached tiny models are rebuilt.
TINY_VERSION = 1
#: The file ``build_once`` writes into a tiny twin's folder: a folder without it holds weights solrl did not build.
TINY_MARKER = "solrl-tiny-twin.json"


class TinyFamily:
    """Mixin of the tiny twins (``model.source: tiny``): weights built on first use in the solrl cache, in the
    folder ``<name>-v<TINY_VERSION>``, or at ``model.path`` when that names a folder and not a hub id (a published
    preset's hub id is its real checkpoint, not where its twin goes)."""

    weights_hint: ClassVar[str] = "built on first use (random weights) in $SOLRL_CACHE or ~/.cache/solrl"
    #: The largest ``model.resolution`` the tiny transformer takes (its position table), or None for no limit.
    max_resolution: ClassVar[int | None] = None

    def _encode(self, prompts: list[str]) -> Conditioning:
        """The family's encoding, without diffusers' truncation warning: a twin's tokenizers have tiny vocabularies
        (a T5 twin's spells most words letter by letter), so its few tokens cut nearly every prompt, and every
        run of a twin printed it. A real family keeps the warning."""
        with quiet_diffusers():
            return super()._encode(prompts)  # type: ignore[misc]

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)  # type: ignore[misc]
        resolution = cfg.model.resolution
        if cls.max_resolution is not None and resolution is not None and resolution > cls.max_resolution:
            raise ValueError(
                f"model.resolution={resolution} is more than the {cls.max_resolution} px {cls.name}, "  # type: ignore[attr-defined]
                f"the tiny twin (model.source=tiny), takes; set model.resolution=null (its default) or at most "
                f"{cls.max_resolution}"
            )

    @classmethod
    def weights_dir(cls, cfg: ModelConfig) -> Path:
        path = Path(cfg.path).expanduser() if cfg.path else None
        if path is not None and (path.exists() or not HUB_ID.match(str(cfg.path))):
            return path
        return solrl_cache() / "models" / f"{cls.name}-v{TINY_VERSION}"  # type: ignore[attr-defined]

    @classmethod
    def check_runnable(cls, cfg: ModelConfig) -> None:
        """A missing tiny model is built by ``load``: its folder must then be creatable (it is created here, before
        any run is). A folder at ``model.path`` that holds a pipeline solrl did not build as a tiny twin (real
        weights) is refused: ``load`` would read it as the twin.

        Raises:
            ConfigError: the folder cannot be written, or ``model.path`` holds other weights.
        """
        out = cls.weights_dir(cfg)
        if (out / "model_index.json").exists():
            if cfg.path and out == Path(cfg.path).expanduser() and not (out / TINY_MARKER).exists():
                raise ConfigError(
                    f"model.path={cfg.path} holds a pipeline that is not a tiny twin solrl built; with "
                    f"model.source=tiny, model.path is where the twin is built: set model.path=null (the solrl "
                    f"cache) or a new folder"
                )
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
