"""Rewards: uint8 images ``[B, H, W, 3]`` + prompts + metadata -> float32 ``[B]``, higher is better (DESIGN 6)."""

from solrl.stages.rewards.base import Reward, RewardError, build_reward, score_all

__all__ = ["Reward", "RewardError", "build_reward", "score_all"]
