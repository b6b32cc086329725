"""The model adapter: what the stages need from a diffusers text-to-image family.

An adapter holds the policy transformer, the frozen text encoder (with a
prompt-embedding cache), the decoder from latents to uint8 images, the
flow-matching sigma schedule, the LoRA target modules and the NVFP4 skip list.
Only tiny-digits ships in this release; SANA, FLUX.1 and SD3.5 adapters plug
in here with the same fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel
from safetensors.torch import load_file
from torch import nn

from solrl.config import ModelConfig
from solrl.stages.models import tiny_digits

#: Weights shipped with solrl (few MB), rebuilt by ``solrl pretrain-tiny-digits``.
TINY_DIGITS_WEIGHTS = Path(__file__).parent / "weights" / "tiny-digits"


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available else cpu. Raises ValueError for cuda on a machine without it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device=cuda but torch sees no CUDA device; set model.device=cpu or auto")
    return torch.device(name)


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

    def velocity(self, model: nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                 emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Predicted flow velocity ``v ~ eps - x0`` for ``x [B, C, h, w]`` at ``sigma [B]`` (timestep = 1000 sigma)."""
        out = model(hidden_states=x, encoder_hidden_states=emb, timestep=sigma * 1000.0,
                    encoder_attention_mask=mask, return_dict=False)[0]
        return out


def load_model(cfg: ModelConfig, device: torch.device) -> ModelAdapter:
    """Build the adapter of ``cfg.family`` with weights from ``cfg.path`` (or the shipped ones).

    Raises:
        FileNotFoundError: the weights folder lacks a file the family needs.
    """
    if cfg.family != "tiny-digits":  # pragma: no cover - the schema admits only tiny-digits for now
        raise ValueError(f"unknown model family {cfg.family!r}")
    root = Path(cfg.path).expanduser() if cfg.path else TINY_DIGITS_WEIGHTS
    for rel in ("transformer/config.json", "text_encoder.safetensors"):
        if not (root / rel).exists():
            raise FileNotFoundError(f"tiny-digits weights: {root / rel} is missing; run `solrl pretrain-tiny-digits`")
    transformer = SanaTransformer2DModel.from_pretrained(root / "transformer").to(device)
    text_encoder = tiny_digits.TinyTextEncoder()
    text_encoder.load_state_dict(load_file(root / "text_encoder.safetensors"))
    text_encoder.to(device).eval().requires_grad_(False)
    return ModelAdapter(
        family="tiny-digits",
        transformer=transformer,
        text_encoder=text_encoder,
        tokenize=tiny_digits.tokenize,
        decode_fn=tiny_digits.latents_to_images,
        latent_shape=(1, tiny_digits.IMAGE_SIZE, tiny_digits.IMAGE_SIZE),
        # Attention and the 1x1 feed-forward convs; the 3x3 depthwise conv is left out
        # (peft cannot merge LoRA into it).
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "conv_inverted", "conv_point"),
        nvfp4_skip=("patch_embed", "time_embed", "caption_projection", "proj_out", "norm"),
        shift=cfg.sampler_shift,
        device=device,
    )
