"""Group-relative advantages (GRPO; Shao et al. 2024, eq. 3; Flow-GRPO; DESIGN 1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Added to the std so a near-constant group does not blow up (Flow-GRPO / Sol-RL code use 1e-4).
ADV_EPS = 1e-4
#: A group whose reward spread is below this carries no learning signal.
ZERO_STD = 1e-6


@dataclass(frozen=True)
class Advantages:
    values: np.ndarray  # float32 [P, k]
    zero_std_ratio: float  # fraction of groups with no reward spread (contribute nothing)


def group_advantages(rewards: np.ndarray, *, global_std: bool = True, clip: float = 5.0) -> Advantages:
    """``A_i = (r_i - mean_group(r)) / (std + 1e-4)``, clipped to ``[-clip, clip]``.

    Args:
        rewards: float ``[P, k]``, one row per prompt group (the regenerated samples' rewards).
        global_std: divide by the std over the whole batch (Sol-RL default) instead of each group's.
        clip: ``adv_clip_max``.

    Returns:
        advantages float32 ``[P, k]`` (zero for groups with no spread) and the zero-spread group ratio.

    Raises:
        ValueError: not 2-D, or non-finite rewards.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [P, k], got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf")
    centred = r - r.mean(axis=1, keepdims=True)  # [P, k]
    group_std = r.std(axis=1, keepdims=True)  # [P, 1]
    std = r.std() if global_std else group_std
    adv = np.clip(centred / (std + ADV_EPS), -clip, clip)
    zero = group_std[:, 0] < ZERO_STD
    adv[zero] = 0.0
    return Advantages(adv.astype(np.float32), float(zero.mean()))
