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


def prompt_history_advantages(
    rewards: np.ndarray,
    prompts: list[str],
    history: dict[str, np.ndarray],
    *,
    buffer_size: int,
    min_count: int,
    global_std: bool = True,
    clip: float = 5.0,
) -> tuple[Advantages, dict[str, np.ndarray]]:
    """Advantages against per-prompt reward statistics kept across iterations (DDPO's per-prompt stat
    tracker; Black et al. 2023, "Training Diffusion Models with Reinforcement Learning", section 4.3 and its
    reference code).

    Each prompt's buffer is its last ``buffer_size`` rewards: ``history[prompt]`` (older iterations, oldest
    first) followed by this iteration's rewards of every group with that prompt. With at least ``min_count``
    rewards in the buffer, ``A_i = (r_i - mean(buffer)) / (std + 1e-4)``, where std is the buffer's (or the
    whole batch's with ``global_std``); below ``min_count`` the batch mean and std stand in, as in DDPO. A
    group whose statistics have no spread (std < 1e-6) carries no signal: its advantages are 0 and it counts in
    ``zero_std_ratio``. Clipped to ``[-clip, clip]``.

    Args:
        rewards: float ``[P, k]``, one row per group.
        prompts: the ``P`` group prompts (repeats allowed).
        history: prompt -> float ``[n]`` older rewards, oldest first (not modified).
        buffer_size: the tracker's window (rewards kept per prompt).
        min_count: the count below which batch statistics are used.

    Returns:
        (advantages float32 ``[P, k]``, the updated history: every prompt's last ``buffer_size`` rewards).

    Raises:
        ValueError: not 2-D, ``len(prompts) != P``, non-finite rewards, or ``min_count > buffer_size``.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or len(prompts) != r.shape[0]:
        raise ValueError(
            f"rewards must be [P, k] with one prompt per row, got shape {r.shape} and {len(prompts)} prompts"
        )
    if not np.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf")
    if not 1 <= min_count <= buffer_size:
        raise ValueError(f"need 1 <= min_count <= buffer_size, got min_count={min_count}, buffer_size={buffer_size}")
    updated = dict(history)
    for prompt in dict.fromkeys(prompts):  # unique, in first-seen order
        rows = [p for p, name in enumerate(prompts) if name == prompt]
        updated[prompt] = np.concatenate([np.asarray(history.get(prompt, ()), np.float64), r[rows].reshape(-1)])[
            -buffer_size:
        ]
    adv = np.zeros_like(r)
    zero = np.zeros(r.shape[0], dtype=bool)
    for p, prompt in enumerate(prompts):
        buffer = updated[prompt]
        population = buffer if len(buffer) >= min_count else r
        spread = population.std()
        zero[p] = spread < ZERO_STD
        if not zero[p]:
            adv[p] = (r[p] - population.mean()) / ((r.std() if global_std else spread) + ADV_EPS)
    adv = np.clip(adv, -clip, clip)
    return Advantages(adv.astype(np.float32), float(zero.mean())), updated
