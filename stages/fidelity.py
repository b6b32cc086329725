"""Proxy fidelity: does the low-precision explore copy rank candidates as the BF16 policy would? (DESIGN 2)

Sol-RL reports, FP4 vs BF16 on the same seeds, Spearman 0.90-0.94, Kendall ~0.8 and top-12 of 96 agreement
~93% (arXiv 2604.06916, Table 3). Here the pairs are the kept seeds of each prompt (explore reward, reward of
the BF16 regeneration); since the kept seeds are the pool's extremes these figures overstate full-pool
agreement (the full-pool audit comes with issue 3).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import kendalltau, spearmanr


def rank_agreement(explore: np.ndarray, bf16: np.ndarray) -> dict[str, float]:
    """Agreement of explore and BF16 rewards of the same seeds, per prompt, averaged.

    Args:
        explore, bf16: float ``[P, k]`` paired rewards (row = prompt group).

    Returns:
        ``spearman``, ``kendall`` (mean over prompts with any spread in both; NaN if none) and ``top_half_match``:
        the fraction of each group's explore top half that is also in its BF16 top half.
    """
    explore, bf16 = np.asarray(explore, float), np.asarray(bf16, float)
    if explore.shape != bf16.shape or explore.ndim != 2:
        raise ValueError(f"paired rewards must share a [P, k] shape, got {explore.shape} and {bf16.shape}")
    rho, tau, match = [], [], []
    half = max(1, explore.shape[1] // 2)
    for e, b in zip(explore, bf16):
        if np.ptp(e) > 0 and np.ptp(b) > 0:
            rho.append(spearmanr(e, b).statistic)
            tau.append(kendalltau(e, b).statistic)
        top_e = set(np.argsort(-e, kind="stable")[:half])
        top_b = set(np.argsort(-b, kind="stable")[:half])
        match.append(len(top_e & top_b) / half)
    return {"spearman": float(np.mean(rho)) if rho else float("nan"),
            "kendall": float(np.mean(tau)) if tau else float("nan"),
            "top_half_match": float(np.mean(match))}
