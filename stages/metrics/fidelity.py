"""Proxy fidelity: does the low-precision explore copy rank candidates as the BF16 policy would? (DESIGN 2)

Sol-RL reports, FP4 vs BF16 on the same seeds, Spearman 0.90-0.94, Kendall ~0.8 and top-12 of 96 agreement
~93% (arXiv 2604.06916, Table 3). Here the pairs are the kept seeds of each prompt (explore reward, reward of
the BF16 regeneration); since the kept seeds are the pool's extremes these figures overstate full-pool
agreement (the full-pool audit comes with issue 3).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import kendalltau, spearmanr


def group_agreement(explore: np.ndarray, bf16: np.ndarray) -> list[dict[str, float]]:
    """Per prompt group: Spearman rho, Kendall tau (NaN when either side has no spread) and the fraction of
    the explore top half that is also in the BF16 top half.

    Args:
        explore: float ``[P, k]`` explore rewards of the kept seeds (row = prompt group).
        bf16: float ``[P, k]`` BF16 rewards of the same seeds.

    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    explore, bf16 = np.asarray(explore, float), np.asarray(bf16, float)
    if explore.shape != bf16.shape or explore.ndim != 2:
        raise ValueError(f"paired rewards must share a [P, k] shape, got {explore.shape} and {bf16.shape}")
    half = max(1, explore.shape[1] // 2)
    rows = []
    for e, b in zip(explore, bf16):
        spread = np.ptp(e) > 0 and np.ptp(b) > 0
        top_e = set(np.argsort(-e, kind="stable")[:half])
        top_b = set(np.argsort(-b, kind="stable")[:half])
        rows.append(
            {
                "spearman": float(spearmanr(e, b).statistic) if spread else float("nan"),
                "kendall": float(kendalltau(e, b).statistic) if spread else float("nan"),
                "top_half_match": len(top_e & top_b) / half,
            }
        )
    return rows


def rank_agreement(explore: np.ndarray, bf16: np.ndarray) -> dict[str, float]:
    """``group_agreement`` averaged over groups (groups without spread left out of rho and tau; NaN if none)."""
    rows = group_agreement(explore, bf16)
    out = {}
    for key in ("spearman", "kendall", "top_half_match"):
        values = [r[key] for r in rows if not np.isnan(r[key])]
        out[key] = float(np.mean(values)) if values else float("nan")
    return out


def pool_agreement(
    explore: np.ndarray, bf16: np.ndarray, k: int, tops: tuple[int, ...] = (4, 8, 12)
) -> dict[str, float]:
    """Full-pool agreement of explore and BF16 rewards of the same seeds (the unbiased audit; paper Table 3).

    Args:
        explore: float ``[P, N]`` explore rewards of every candidate of P pools.
        bf16: float ``[P, N]`` BF16 rewards of the same candidates.
        k: kept per prompt by best_worst (k/2 best, k/2 worst).
        tops: n for the top-n / bottom-n figures (those with ``n <= N / 2``).

    Returns:
        ``spearman``, ``kendall`` (mean over prompts); ``top{n}_match``: fraction of the explore top-n also in the
        BF16 top-n; ``bottom{n}_false_inclusion``: fraction of the explore bottom-n *not* in the BF16 bottom-n;
        ``best_true_rank`` / ``worst_true_rank``: mean BF16 rank (1 = best) of the k/2 seeds best_worst keeps as
        best / worst, beside ``*_perfect`` and ``random_rank`` references (paper: 6.5 / 90.5 and 48.5 for 12 of 96).
    """
    explore, bf16 = np.asarray(explore, float), np.asarray(bf16, float)
    if explore.shape != bf16.shape or explore.ndim != 2:
        raise ValueError(f"rewards must share a [P, N] shape, got {explore.shape} and {bf16.shape}")
    P, N = explore.shape
    half = k // 2
    out: dict[str, float] = {
        "spearman": float(np.nanmean([spearmanr(e, b).statistic for e, b in zip(explore, bf16)])),
        "kendall": float(np.nanmean([kendalltau(e, b).statistic for e, b in zip(explore, bf16)])),
    }
    order_e = np.argsort(-explore, axis=1, kind="stable")  # [P, N] best first
    order_b = np.argsort(-bf16, axis=1, kind="stable")
    for n in sorted({*tops, half}):
        if not 1 <= n <= N // 2:
            continue
        top = np.mean([len(set(e[:n]) & set(b[:n])) / n for e, b in zip(order_e, order_b)])
        bottom = np.mean([len(set(e[-n:]) & set(b[-n:])) / n for e, b in zip(order_e, order_b)])
        out[f"top{n}_match"] = float(top)
        out[f"bottom{n}_false_inclusion"] = float(1 - bottom)
    true_rank = np.empty_like(order_b)
    np.put_along_axis(true_rank, order_b, np.arange(1, N + 1)[None].repeat(P, 0), axis=1)  # rank by BF16
    rows = np.arange(P)[:, None]
    out["best_true_rank"] = float(true_rank[rows, order_e[:, :half]].mean())
    out["worst_true_rank"] = float(true_rank[rows, order_e[:, N - half :]].mean())
    out["best_perfect"], out["worst_perfect"] = (half + 1) / 2, N - (half - 1) / 2
    out["random_rank"] = (N + 1) / 2
    return out
