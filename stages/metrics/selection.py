"""Which seeds of each candidate pool are regenerated and trained on (Sol-RL step 3)."""

from __future__ import annotations

import numpy as np

STRATEGIES = ("best_worst", "top_k", "random")


def select_seeds(
    rewards: np.ndarray, k: int, strategy: str = "best_worst", seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Pick ``k`` candidates per prompt from explore rewards.

    ``best_worst`` (Sol-RL, the default) keeps the ``k/2`` highest and ``k/2`` lowest rewards of each pool: the
    most contrastive seeds. ``top_k`` keeps the ``k`` highest, ``random`` ``k`` uniformly (ablations).
    Ties are broken by candidate index (stable sort), so selection is deterministic.

    Args:
        rewards: float ``[P, N]`` explore rewards (higher is better), all finite.
        k: kept per prompt; ``k <= N``, and even for ``best_worst``.
        strategy: one of ``STRATEGIES``.
        seed: seeds ``random``.

    Returns:
        indices ``int64 [P, k]`` into the pool (best first, then worst from the bottom up for best_worst),
        and labels ``[P, k]`` of ``"best"`` / ``"worst"`` (``"random"`` for random).

    Raises:
        ValueError: bad shape, non-finite reward, ``k`` out of range or odd for best_worst, unknown strategy.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, N], got shape {rewards.shape}")
    if not np.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; the score stage should have refused them")
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, pool size {n}]")
    order = np.argsort(-rewards, axis=1, kind="stable")  # [P, N], best first
    if strategy == "best_worst":
        if k % 2:
            raise ValueError(f"best_worst needs an even k, got {k}")
        index = np.concatenate([order[:, : k // 2], order[:, ::-1][:, : k // 2]], axis=1)
        labels = np.array(["best"] * (k // 2) + ["worst"] * (k // 2))
    elif strategy == "top_k":
        index, labels = order[:, :k], np.array(["best"] * k)
    elif strategy == "random":
        rng = np.random.default_rng(seed)
        index = np.stack([rng.choice(n, size=k, replace=False) for _ in range(rewards.shape[0])])
        labels = np.array(["random"] * k)
    else:
        raise ValueError(f"unknown selection strategy {strategy!r}; use one of {STRATEGIES}")
    return index.astype(np.int64), np.broadcast_to(labels, index.shape).copy()


def pool_ranks(rewards: np.ndarray) -> np.ndarray:
    """Rank of each candidate within its pool, 1 = highest reward: int64 ``[P, N]``."""
    order = np.argsort(-np.asarray(rewards), axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(1, order.shape[1] + 1)[None].repeat(order.shape[0], 0), axis=1)
    return ranks.astype(np.int64)
