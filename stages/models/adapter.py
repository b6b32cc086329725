"""The model adapter: what the stages need from a diffusers text-to-image family.

An adapter holds the policy transformer, the frozen text encoder (with a
prompt-embedding cache), the decoder from latents to uint8 images, the
flow-matching sigma schedule, the LoRA target modules and the NVFP4 skip list.
A family is a ``ModelFamily`` plug-in registered under its ``model.family``
name (``solrl.registry.register_model``); ``load`` builds its ``ModelAdapter``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from solrl.config import ConfigError, ModelConfig, RunConfig
from solrl.registry import MODELS


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available else cpu. Raises ConfigError for cuda on a machine without it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device=cuda but torch sees no CUDA device; set model.device=cpu or auto")
    return torch.device(name)


@contextmanager
def compute_precision(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA (BF16 train); float32 on CPU, where bf16 matmuls are slow and not the target."""
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with ctx:
        yield


@dataclass
class ModelAdapter:
    """One model family, loaded. ``transformer`` is the policy network (LoRA is added by ``Policy``)."""

    family: str
    transformer: nn.Module
    text_encoder: nn.Module
    tokenize: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]
    decode_fn: Callable[[torch.Tensor], np.ndarray]
    latent_shape: tuple[int, int, int]  # (C, h, w)
    lora_targets: tuple[str, ...]
    nvfp4_skip: tuple[str, ...]
    shift: float
    device: torch.device
    _cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt embeddings ``float32 [B, L, D]`` and mask ``int64 [B, L]``, cached per prompt."""
        missing = sorted({p for p in prompts if p not in self._cache})
        if missing:
            ids, mask = self.tokenize(missing)
            with torch.no_grad():
                emb = self.text_encoder(ids.to(self.device)).float()
            for i, p in enumerate(missing):
                self._cache[p] = (emb[i], mask[i].to(self.device))
        emb = torch.stack([self._cache[p][0] for p in prompts])
        mask = torch.stack([self._cache[p][1] for p in prompts])
        return emb, mask

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]``."""
        return self.decode_fn(latents)

    def sigmas(self, steps: int) -> torch.Tensor:
        """The sampling sigma grid ``float32 [steps + 1]``, 1 -> 0, from FlowMatchEulerDiscreteScheduler(shift)."""
        scheduler = FlowMatchEulerDiscreteScheduler(shift=self.shift)
        scheduler.set_timesteps(steps, device="cpu")
        return scheduler.sigmas.float().to(self.device)

    def velocity(
        self, model: nn.Module, x: torch.Tensor, sigma: torch.Tensor, emb: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Predicted flow velocity ``v ~ eps - x0`` for ``x [B, C, h, w]`` at ``sigma [B]`` (timestep = 1000 sigma)."""
        out = model(
            hidden_states=x,
            encoder_hidden_states=emb,
            timestep=sigma * 1000.0,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        return out


class ModelFamily:
    """One model family as a plug-in (``solrl.registry.register_model``): how to check, load and describe it.

    Subclasses set ``name`` and ``weights_hint`` and implement ``load``; ``validate_config`` (pure: what a
    valid config of this family is, anywhere) and ``check_runnable`` (this machine: weights present) default
    to no checks.
    """

    name: ClassVar[str]
    #: Where the weights are published, for the missing-weights error.
    weights_hint: ClassVar[str] = ""
    #: The diffusers pipeline class of the family (its LoRA loader reads the exported LoRA).
    pipeline_class: ClassVar[str]

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        """Family-specific rules of a valid config (pure). Raises ValueError naming the value and the fix."""

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
    def load(cls, cfg: ModelConfig, device: torch.device) -> ModelAdapter:
        raise NotImplementedError

    @classmethod
    def architecture(cls, cfg: ModelConfig) -> dict[str, Any]:
        """What a checkpoint records to describe the model it belongs to (configs of the trained modules)."""
        return {}


def model_family(cfg: ModelConfig) -> type[ModelFamily]:
    """The registered family of ``cfg.family``. Raises ValueError for an unknown family."""
    return MODELS.get(cfg.family)


def load_model(cfg: ModelConfig, device: torch.device) -> ModelAdapter:
    """Build the adapter of ``cfg.family`` with weights from ``cfg.path`` (checked first).

    Raises:
        ConfigError: the weights folder lacks a file the family needs.
    """
    family = model_family(cfg)
    family.check_runnable(cfg)
    return family.load(cfg, device)
