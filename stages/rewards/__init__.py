"""Rewards: uint8 images ``[B, H, W, 3]`` + prompts + metadata -> float32 ``[B]``, higher is better (DESIGN 6).

Each reward is a ``Reward`` plug-in registered under its name; importing this package registers the built-in
ones.
"""

from solrl.stages.rewards import clip, digits, hps, imagereward, jpeg, ocr
from solrl.stages.rewards.base import (
    Reward,
    RewardError,
    RewardOptions,
    build_reward,
    release_rewards,
    reward_options,
    score_all,
)

__all__ = [
    "Reward",
    "RewardError",
    "RewardOptions",
    "build_reward",
    "clip",
    "digits",
    "hps",
    "imagereward",
    "jpeg",
    "ocr",
    "release_rewards",
    "reward_options",
    "score_all",
]
