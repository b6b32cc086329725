"""The reward interface, the registry and weighted scoring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, get_args

import numpy as np
import torch

from solrl.config import RewardName


class RewardError(ValueError):
    """A reward returned something unusable (NaN, wrong shape): the stage stops, nothing is written."""


class Reward(Protocol):
    """One signature for every reward."""

    name: str

    def __call__(self, images: np.ndarray, prompts: Sequence[str], metadata: dict[str, Any] | None = None,
                 ) -> np.ndarray:
        """images uint8 ``[B, H, W, 3]``, ``len(prompts) == B`` -> float32 ``[B]``."""
        ...


def build_reward(name: RewardName, device: torch.device | str = "cpu") -> Reward:
    """Instantiate the reward called ``name``.

    Raises:
        ValueError: unknown name (the config schema lists the known ones).
    """
    if name in ("digit_alignment", "digit_evaluator"):
        from solrl.stages.rewards.digits import DigitAlignment

        return DigitAlignment(name=name, device=device)
    if name == "jpeg_compressibility":
        from solrl.stages.rewards.jpeg import JpegCompressibility

        return JpegCompressibility()
    raise ValueError(f"unknown reward {name!r}; known: {', '.join(get_args(RewardName))}")


def checked(reward: Reward, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Call ``reward`` and check its output: float32 ``[B]``, all finite.

    Raises:
        RewardError: wrong shape, or a NaN/inf value (naming the first bad prompt).
    """
    values = np.asarray(reward(images, prompts), dtype=np.float32)
    if values.shape != (len(prompts),):
        raise RewardError(f"reward {reward.name!r} returned shape {values.shape}, expected ({len(prompts)},)")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise RewardError(f"reward {reward.name!r} returned {values[bad[0]]} for prompt {prompts[bad[0]]!r} "
                          f"({bad.size} non-finite of {values.size}); fix the reward or its inputs")
    return values


def score_all(rewards: dict[str, tuple[Reward, float]], images: np.ndarray, prompts: Sequence[str]
              ) -> dict[str, np.ndarray]:
    """Score images with every reward. ``rewards``: name -> (reward, weight). Returns name -> float32 ``[B]``."""
    return {name: checked(reward, images, prompts) for name, (reward, _) in rewards.items()}
