"""The model adapter: what the stages need from a diffusers text-to-image family.

An adapter holds the policy transformer, the frozen text encoder(s) (with a
prompt-embedding cache), the decoder from latents to uint8 images, the
flow-matching sigma schedule, the LoRA target modules and the NVFP4 skip list.
Each family is one ``ModelAdapter`` subclass registered under its
``model.family`` name (``solrl.registry.register_model``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from solrl.config import ConfigError, ModelConfig, RunConfig, registered_family
from solrl.storage.fingerprint import folder_fingerprint
from solrl.storage.stage import file_sha256, plain_modes, replaced_atomically

#: What a text encoder gives the transformer for a batch of prompts: name -> tensor ``[B, ...]``.
Conditioning = dict[str, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available else cpu. Raises ConfigError for cuda on a machine without it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device=cuda but torch sees no CUDA device; set model.device=cpu or auto")
    return torch.device(name)


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks: every module of a ``ModuleList`` attribute of the model itself (FLUX's
    ``transformer_blocks`` and ``single_transformer_blocks``, SANA's ``transformer_blocks``, ...): the units the
    memory plan counts and FSDP shards."""
    found = []
    for child in transformer.children():
        if isinstance(child, nn.ModuleList):
            found.extend(child)
    return found


def weights_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """The weights' dtype for ``model.dtype``: ``auto`` = bfloat16 on CUDA (BF16 train, DESIGN 1), float32 on CPU.

    Raises:
        ValueError: ``dtype`` is not auto, bfloat16 or float32 (the config schema refuses it first).
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"model.dtype={dtype!r}: choose auto, bfloat16 or float32")
    return getattr(torch, dtype)


@contextmanager
def compute_precision(device: torch.device, dtype: torch.dtype | None = None) -> Iterator[None]:
    """bf16 autocast on CUDA (BF16 train), and on CPU where the weights are bfloat16 (``model.dtype=bfloat16``);
    float32 otherwise (CPU's default, where bf16 matmuls are slow and not the target).

    Args:
        device: where the computation runs.
        dtype: the weights' dtype (the transformer's); None = float32 weights.
    """
    bf16 = device.type == "cuda" or dtype == torch.bfloat16
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
        yield


def _digest_file(cache: Path) -> Path:
    """Where a prompt-embedding cache's sha256 is kept: ``<cache>.sha256``."""
    return cache.with_name(cache.name + ".sha256")


def write_embedding_cache(cache: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a run's prompt-embedding cache (``ModelAdapter.precompute``'s layout: ``<i>/<name>`` per sorted unique
    prompt ``i``) atomically, then its sha256 beside it (``<cache>.sha256``), which ``precompute`` checks before
    reading the file: a file without it, or changed since, is encoded again.

    Raises:
        OSError: a write failed (a full disk); a cache left without its digest is a miss, never read.
    """
    cache.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(cache) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        plain_modes(tmp)
        digest = file_sha256(tmp)
    with replaced_atomically(_digest_file(cache)) as tmp:
        tmp.write_text(digest + "\n", encoding="utf-8")
        plain_modes(tmp)


class EmbeddingCacheMiss(RuntimeError):
    """The prompt-embedding cache cannot serve a model loaded without its text encoders (load them and retry)."""


@dataclass
class ModelAdapter:
    """One model family as a plug-in (``solrl.registry.register_model``), and, once loaded, what the stages need
    from it.

    Class level (no weights needed): ``validate_config`` (pure: what a valid config of this family is,
    anywhere), ``check_runnable`` (this machine: the weights files are there), ``architecture`` (what a
    checkpoint records), ``load`` (build the adapter on a device). Instance level: ``encode`` prompts to the
    transformer's conditioning (cached per prompt), ``velocity`` of a network at ``(x, sigma)``, ``decode``
    latents to uint8 images, ``sigmas`` of the sampler. Subclasses set the class attributes and implement
    ``load``, ``_encode``, ``decode`` and ``velocity``.
    """

    name: ClassVar[str]
    #: Where the weights are published, for the missing-weights error.
    weights_hint: ClassVar[str] = ""
    #: The diffusers pipeline class of the family (its LoRA loader reads the exported LoRA).
    pipeline_class: ClassVar[str]
    #: Whether ``pipeline_class`` can load the family's weights whole (a stock pipeline samples with the exported
    #: LoRA); False where only the transformer is that class's (``solrl export`` then says to load the LoRA onto
    #: the transformer).
    stock_pipeline: ClassVar[bool] = True
    #: peft ``target_modules`` of the policy LoRA: module-name suffixes, or one regex that a module's whole qualified
    #: name must match (where a suffix would also name a module peft cannot wrap, e.g. FLUX.2's ``attn.to_out``).
    lora_targets: ClassVar[tuple[str, ...] | str]
    #: Module-name fragments the low-precision explore copy leaves in high precision (Sol-RL skip rules).
    explore_skip: ClassVar[tuple[str, ...]]
    #: Class names of the transformer's repeated blocks, compiled by ``explore.compile`` / ``regenerate.compile``
    #: where the diffusers class declares no ``_repeated_blocks`` of its own (SANA, SD3).
    repeated_blocks: ClassVar[tuple[str, ...]] = ()

    transformer: nn.Module
    device: torch.device
    #: Latent shape of one sample as the transformer and the samplers see it: ``(C, h, w)``, or ``(C, F', h, w)``
    #: for a video family.
    latent_shape: tuple[int, ...]
    #: ``FlowMatchEulerDiscreteScheduler`` shift of the sigma schedule.
    shift: float
    #: ODE solver of every rollout (``model.solver``): ``euler`` or ``dpm2``.
    solver: str = "euler"
    #: Pixels per latent token along a side (patch size x VAE downsampling): the period of grid artifacts.
    grid_period: int = 0
    #: Frames per sample of a video family (``decode`` gives ``[B, F, H, W, 3]``); 0 for an image family.
    frames: int = 0
    _cache: dict[str, Conditioning] = field(default_factory=dict, init=False, repr=False)
    _released: bool = field(default=False, init=False, repr=False)

    # -- class level: checks that need no weights loaded -------------------------------------------------------
    #: Whether the family samples videos (``model.num_frames`` applies).
    video: ClassVar[bool] = False
    #: Whether the transformer embeds a guidance value (``model.guidance`` applies: FLUX.1-dev, FLUX.2-dev).
    guidance_embedding: ClassVar[bool] = False

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        """Family-specific rules of a valid config (pure). Raises ValueError naming the value and the fix."""
        if cfg.model.num_frames is not None and not cls.video:
            raise ValueError(
                f"model.num_frames={cfg.model.num_frames}: {cls.name} is an image family; model.num_frames is for "
                f"video families (wan); remove it"
            )

    @classmethod
    def ignored_settings(cls, cfg: RunConfig) -> list[str]:
        """Settings of ``cfg`` this family ignores (they would change a new run's config hash and nothing else),
        each as a message naming the value and the fix (``solrl.config.refuse_ignored_settings``)."""
        if cfg.model.guidance != 1.0 and not cls.guidance_embedding:
            return [
                f"model.guidance={cfg.model.guidance:g}: the {cfg.model.family} family's transformer embeds no "
                "guidance value, so it would change nothing (solrl samples without classifier-free guidance); "
                "remove it (it applies to the flux and flux2 families, which embed one)"
            ]
        return []

    @classmethod
    def for_source(cls, source: str) -> type[ModelAdapter]:
        """The adapter class of ``model.source``: this family for ``weights``; for ``tiny``, its tiny twin (the
        family's own classes at tiny widths with random weights, built on first use; a subclass marked with
        ``tiny_twin`` beside the family's class).

        Raises:
            ConfigError: ``source`` is ``tiny`` and the family has no tiny twin.
        """
        if source != "tiny":
            return cls
        twin = vars(cls).get("_tiny_twin")
        if twin is None:
            raise ConfigError(f"model.source=tiny: model family {cls.name} has no tiny twin; set model.source=weights")
        return twin

    @classmethod
    def weights_dir(cls, cfg: ModelConfig) -> Path:
        """The weights folder ``model.path`` names (expanded)."""
        if cfg.path is None:
            raise ConfigError(
                f"model.family={cls.name} needs model.path (a diffusers-format folder); weights: {cls.weights_hint}"
            )
        return Path(cfg.path).expanduser()

    @classmethod
    def required_files(cls, cfg: ModelConfig) -> tuple[str, ...]:
        """Files (relative to the weights folder) that must exist before any work starts."""
        return ()

    @classmethod
    def check_runnable(cls, cfg: ModelConfig) -> None:
        """Raises ConfigError naming the first missing weights file and where the weights are published."""
        root = cls.weights_dir(cfg)
        for rel in cls.required_files(cfg):
            if not (root / rel).exists():
                where = f"; weights: {cls.weights_hint}" if cls.weights_hint else ""
                raise ConfigError(f"model.path: {root / rel} is missing ({cls.name} weights){where}")

    @classmethod
    def weights_fingerprint(cls, cfg: ModelConfig) -> dict[str, str] | None:
        """The fingerprint of the weights folder (``solrl.storage.fingerprint``) that a run records and a resume
        compares; None when the folder does not exist yet (a tiny model built on first use, a hub download)."""
        try:
            root = cls.weights_dir(cfg)
        except ConfigError:
            return None
        return folder_fingerprint(root) or None

    @classmethod
    def load(cls, cfg: ModelConfig, device: torch.device, *, text_encoders: bool = True) -> ModelAdapter:
        """Build the adapter with the weights of ``cfg.path`` on ``device``.

        ``text_encoders=False`` leaves the text encoders unloaded (their weights are never read): the adapter
        starts released, and its prompts must come from an embedding cache (``precompute``)."""
        raise NotImplementedError

    @classmethod
    def architecture(cls, cfg: ModelConfig) -> dict[str, Any]:
        """What a checkpoint records to describe the model it belongs to: the transformer's diffusers config."""
        path = cls.weights_dir(cfg) / "transformer" / "config.json"
        return {"transformer": json.loads(path.read_text(encoding="utf-8"))}

    @classmethod
    def meta_adapter(
        cls, cfg: ModelConfig, dtype: torch.dtype, *, blocks: int | dict[str, int] | None = None, device: str = "meta"
    ) -> tuple[ModelAdapter, str, int]:
        """The adapter over the family's transformer (and VAE) built on the meta device in ``dtype``, for the memory
        plan (``solrl.stages.memory``): ``(adapter, where its configs came from, text encoders' bytes)``;
        ``blocks`` keeps that many repeated blocks of each kind (a mapping: of the named config keys);
        ``device="cpu"``: the same with random weights.

        Raises:
            NotImplementedError: the family cannot be planned (a third-party family that does not implement it).
        """
        raise NotImplementedError(f"model family {cls.name} implements no memory plan (meta_adapter)")

    def conditioning_like(self, batch: int) -> Conditioning:
        """Conditioning of ``batch`` prompts with ``_encode``'s keys, shapes and dtypes (values zero), on the
        adapter's device: the memory plan measures with it, no text encoder loaded."""
        raise NotImplementedError(f"model family {self.name} implements no memory plan (conditioning_like)")

    # -- instance level ----------------------------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> Conditioning:
        """The conditioning of ``prompts`` (uncached): name -> tensor with a leading batch axis ``[B, ...]``."""
        raise NotImplementedError

    def text_encoders(self) -> dict[str, nn.Module | None]:
        """The frozen text encoders by attribute name (``release_text_encoders`` drops them)."""
        return {}

    def _drop_text_encoders(self) -> None:
        """Drop the references ``text_encoders`` names (subclasses holding them elsewhere override)."""
        for name in self.text_encoders():
            setattr(self, name, None)

    def encode(self, prompts: list[str]) -> Conditioning:
        """The transformer's conditioning of ``prompts``, cached per prompt: name -> ``[B, ...]`` on the device
        (e.g. ``emb`` float32 ``[B, L, D]``, ``mask`` int64 ``[B, L]``, ``pooled`` ``[B, D']``).

        Raises:
            KeyError: a prompt outside the cached set after ``release_text_encoders``.
        """
        missing = sorted({p for p in prompts if p not in self._cache})
        if missing and self._released:
            raise KeyError(f"prompt {missing[0]!r} was not encoded before the text encoders were released")
        if missing:
            with torch.no_grad():
                fresh = self._encode(missing)
            for i, p in enumerate(missing):
                self._cache[p] = {k: v[i] for k, v in fresh.items()}
        return {k: torch.stack([self._cache[p][k] for p in prompts]) for k in self._cache[prompts[0]]}

    def precompute(self, prompts: list[str], cache: Path | None = None) -> None:
        """Encode every prompt of a run once, then release the text encoders (DESIGN 5: prompt embeddings are
        computed once per prompt set).

        With ``cache`` (a ``.safetensors`` file in the run store, named by the prompts and the model), the
        embeddings are read from it when present, else computed and written there atomically, so a resumed run
        does not encode its prompts again (``load(text_encoders=False)`` then skips loading the text encoders at
        all). The file's sha256 is written beside it (``<cache>.sha256``) once it is in place, and checked before
        it is read: a file changed since (a breaker's finding: every stage read it, no manifest covered it), one
        without its digest, or an unreadable one is a miss.

        Raises:
            EmbeddingCacheMiss: the text encoders are not loaded and ``cache`` is missing or unreadable.
        """
        unique = sorted(set(prompts))
        if cache is None or not (cache.exists() and self._load_embeddings(cache, unique)):
            if self._released:
                raise EmbeddingCacheMiss(f"{cache}: no usable prompt embeddings, and the text encoders are not loaded")
            self.encode(unique)
            if cache is not None:
                write_embedding_cache(
                    cache,
                    {f"{i}/{name}": value for i, p in enumerate(unique) for name, value in self._cache[p].items()},
                )
        self.release_text_encoders()

    def _load_embeddings(self, cache: Path, prompts: list[str]) -> bool:
        """Fill the prompt cache from ``cache``; False (nothing loaded) when the file is unreadable, differs from
        its recorded sha256 (or has none) or does not hold these prompts, so the embeddings are computed again and
        the file rewritten."""
        try:
            if _digest_file(cache).read_text(encoding="utf-8").strip() != file_sha256(cache):
                return False
            tensors = load_file(cache, device=str(self.device))
            names = sorted({key.split("/", 1)[1] for key in tensors})
            loaded = {p: {name: tensors[f"{i}/{name}"] for name in names} for i, p in enumerate(prompts)}
        except Exception:  # a truncated or foreign file is a cache miss, never trusted
            return False
        self._cache.update(loaded)
        return True

    def release_text_encoders(self) -> None:
        """Free the text encoders: only cached prompts can be encoded from now on."""
        self._drop_text_encoders()
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents ``[B, *latent_shape]`` -> uint8 images ``[B, H, W, 3]`` (videos ``[B, F, H, W, 3]``)."""
        raise NotImplementedError

    def sigmas(self, steps: int) -> torch.Tensor:
        """The sampling sigma grid ``float32 [steps + 1]``, 1 -> 0, from FlowMatchEulerDiscreteScheduler(shift)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(shift=self.shift)
        scheduler.set_timesteps(steps, device="cpu")
        return scheduler.sigmas.float().to(self.device)

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Predicted flow velocity ``v ~ eps - x0`` of ``net`` for ``x [B, C, h, w]`` at ``sigma [B]``."""
        raise NotImplementedError


def select_rows(cond: Conditioning, index: slice | torch.Tensor) -> Conditioning:
    """The rows ``index`` of every tensor of a conditioning."""
    return {k: v[index] for k, v in cond.items()}


def model_family(cfg: ModelConfig) -> type[ModelAdapter]:
    """The adapter class of ``cfg.family`` from ``cfg.source``: the registered family, or its tiny twin
    (``ModelAdapter.for_source``).

    Raises:
        ConfigError: an unknown family, or ``source=tiny`` for a family without a tiny twin.
    """
    return registered_family(cfg.family).for_source(cfg.source)  # an old tiny twin's name is told its model


def tiny_twin(twin: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: ``twin`` is the tiny twin (``model.source: tiny``) of the nearest of its bases that is not a
    tiny twin itself (``TinySD3(TinyFamily, SD3)`` is ``sd3``'s). Returns ``twin``.

    Raises:
        TypeError: no base of ``twin`` is a model family, or that family has another tiny twin.
    """
    family = next(
        (
            base
            for base in twin.__mro__[1:]
            if issubclass(base, ModelAdapter) and base is not ModelAdapter and "_twin_of" not in vars(base)
        ),
        None,
    )
    if family is None:
        raise TypeError(f"{twin.__name__} has no model family among its bases to be the tiny twin of")
    if vars(family).get("_tiny_twin", twin) is not twin:  # as register_model refuses a name taken
        raise TypeError(f"{family.name} already has a tiny twin, {vars(family)['_tiny_twin'].__name__}")
    family._tiny_twin = twin  # type: ignore[attr-defined]
    twin._twin_of = family  # type: ignore[attr-defined]
    return twin


def load_model(cfg: ModelConfig, device: torch.device, *, text_encoders: bool = True) -> ModelAdapter:
    """Build the adapter of ``cfg.family`` with weights from ``cfg.path`` (checked first); without its text
    encoders when ``text_encoders`` is False (``ModelAdapter.load``).

    Raises:
        ConfigError: the weights folder lacks a file the family needs.
    """
    family = model_family(cfg)
    family.check_runnable(cfg)
    return family.load(cfg, device, text_encoders=text_encoders)
