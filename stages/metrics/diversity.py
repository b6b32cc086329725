"""Sample diversity: how different a policy's samples of one prompt are (a guard against reward hacking)."""

from __future__ import annotations

import numpy as np


def pairwise_diversity(images: np.ndarray) -> float:
    """Mean over prompts of the mean pairwise RMS pixel distance between a prompt's samples.

    Args:
        images: uint8 ``[P, S, H, W, 3]`` (S seeds per prompt, S >= 2).

    Returns:
        diversity in [0, 1] pixel units (0 = all samples of a prompt identical).
    """
    x = images.astype(np.float64).reshape(images.shape[0], images.shape[1], -1) / 255.0  # [P, S, D]
    d = np.sqrt(((x[:, :, None] - x[:, None]) ** 2).mean(-1))  # [P, S, S]
    S = x.shape[1]
    return float((d.sum((1, 2)) / (S * (S - 1))).mean()) if S > 1 else 0.0
