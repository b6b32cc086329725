"""Rewards: uint8 images ``[B, H, W, 3]`` + prompts + metadata -> float32 ``[B]``, higher is better (DESIGN 6).

Each reward is a ``Reward`` plug-in registered under its name; a reward module here registers by being here
(``solrl.registry.scan``) and is imported when its name is used.
"""

from solrl.stages.rewards.base import (
    Reward,
    RewardError,
    RewardOptions,
    Scores,
    build_reward,
    release_rewards,
    reward_options,
    score_all,
)

__all__ = [
    "Reward",
    "RewardError",
    "RewardOptions",
    "Scores",
    "build_reward",
    "release_rewards",
    "reward_options",
    "score_all",
]
