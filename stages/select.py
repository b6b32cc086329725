"""Stage 3, select: keep the most contrastive seeds of each pool (best k/2 and worst k/2 by explore reward)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.stages.context import StageContext
from solrl.stages.metrics.grid import save_grid
from solrl.stages.metrics.selection import pool_ranks, select_seeds
from solrl.storage.artifacts import CandidatePool, ExploreRewards, Selection
from solrl.storage.stage import StageOutput

GRID = Selection.grid


def select(ctx: StageContext, out: Path, pool: CandidatePool, scores: ExploreRewards) -> StageOutput:
    """Write the ``Selection`` (group, slot, prompt_index, prompt, candidate_index, seed, rank, explore_reward,
    kept_as) and ``best_worst.png`` (kept candidates of the first prompts, best left).

    Seeds are ranked by the weighted rewards (each standardised within the pool first with
    ``reward.normalize=group``); ``explore_reward`` records the raw weighted sum, comparable with the BF16
    rewards of the regenerated samples (proxy fidelity)."""
    cfg = ctx.cfg.select
    P, N = pool.seeds.shape
    candidates = np.broadcast_to(np.arange(N), (P, N))
    ranking = scores.totals(candidates, ctx.cfg.reward.normalize)
    rewards = scores.totals(candidates)
    index, kept_as = select_seeds(ranking, cfg.k, cfg.strategy, seed=ctx.seed("select"))  # [P, k]
    ranks = pool_ranks(ranking)
    rows = np.arange(P)[:, None]
    Selection(
        pd.DataFrame(
            {
                "group": np.repeat(np.arange(P), cfg.k),
                "slot": np.tile(np.arange(cfg.k), P),
                "prompt_index": np.repeat(pool.prompt_index, cfg.k),
                "prompt": np.repeat(np.array(pool.prompts, dtype=object), cfg.k),
                "candidate_index": index.reshape(-1),
                "seed": pool.seeds[rows, index].reshape(-1),
                "rank": ranks[rows, index].reshape(-1),
                "explore_reward": rewards[rows, index].reshape(-1),
                "kept_as": kept_as.reshape(-1),
            }
        )
    ).write(out)
    shown = min(ctx.cfg.tracking.grid_prompts, P)
    if shown:  # rows: prompts; columns: kept seeds, best first, a red rule before the worst
        best_worst = cfg.strategy == "best_worst"
        save_grid(
            pool.images[rows[:shown], index[:shown]],
            out / GRID,
            row_labels=pool.prompts[:shown],
            column_labels=["best"] + [""] * (cfg.k // 2 - 1) + ["worst"] if best_worst else (),
            scores=rewards[rows[:shown], index[:shown]],
            split=cfg.k // 2 if best_worst else None,
        )
    kept = rewards[rows, index]
    return StageOutput(
        metrics={
            "select/kept_reward_mean": float(kept.mean()),
            "select/kept_reward_spread": float((kept.max(1) - kept.min(1)).mean()),
        }
    )
