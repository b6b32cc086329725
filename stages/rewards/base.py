"""The reward interface, the registry and weighted scoring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from solrl.registry import REWARDS


class RewardError(ValueError):
    """A reward returned something unusable (NaN, wrong shape): the stage stops, nothing is written."""


class Reward:
    """One signature for every reward: images uint8 ``[B, H, W, 3]`` + prompts + metadata -> float32 ``[B]``,
    higher is better. A reward registers under its name (``solrl.registry.register_reward``), is built with
    ``reward(device=...)``, and checks the prompts it can score (``check_prompts``, where work starts)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @classmethod
    def check_prompts(cls, prompts: Sequence[str], field: str) -> None:
        """Raises ValueError naming the first prompt this reward cannot score (default: any prompt is fine)."""

    def __call__(
        self,
        images: np.ndarray,
        prompts: Sequence[str],
        metadata: dict[str, Any] | None = None,
    ) -> np.ndarray:
        """images uint8 ``[B, H, W, 3]``, ``len(prompts) == B`` -> float32 ``[B]``."""
        raise NotImplementedError


def build_reward(name: str, device: torch.device | str = "cpu") -> Reward:
    """Instantiate the reward registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered rewards).
    """
    return REWARDS.get(name)(device=device)


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
        raise RewardError(
            f"reward {reward.name!r} returned {values[bad[0]]} for prompt {prompts[bad[0]]!r} "
            f"({bad.size} non-finite of {values.size}); fix the reward or its inputs"
        )
    return values


def score_all(
    rewards: dict[str, tuple[Reward, float]], images: np.ndarray, prompts: Sequence[str]
) -> dict[str, np.ndarray]:
    """Score images with every reward. ``rewards``: name -> (reward, weight). Returns name -> float32 ``[B]``."""
    return {name: checked(reward, images, prompts) for name, (reward, _) in rewards.items()}
