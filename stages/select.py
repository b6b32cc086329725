"""Stage 3, select: keep the most contrastive seeds of each pool (best k/2 and worst k/2 by explore reward)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.stages.context import StageContext
from solrl.stages.grid import save_grid
from solrl.stages.score import REWARDS, total_rewards
from solrl.stages.selection import pool_ranks, select_seeds
from solrl.storage.arrays import read_arrays
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table, write_table

SELECTION = "selection.parquet"
GRID = "best_worst.png"


def select(ctx: StageContext, out: Path) -> StageOutput:
    """Write ``selection.parquet`` (group, slot, prompt_index, prompt, candidate_index, seed, rank,
    explore_reward, kept_as) and ``best_worst.png`` (kept candidates of the first prompts, best left)."""
    cfg = ctx.cfg.select
    explore_dir, _ = require(ctx.run_dir, ctx.iteration, "explore")
    score_dir, _ = require(ctx.run_dir, ctx.iteration, "score_explore")
    pool, attrs = read_arrays(explore_dir / "candidates.zarr")
    P, N = pool["seeds"].shape
    rewards = total_rewards(read_table(score_dir / REWARDS), np.broadcast_to(np.arange(N), (P, N)))
    index, kept_as = select_seeds(rewards, cfg.k, cfg.strategy, seed=ctx.seed("select"))  # [P, k]
    ranks = pool_ranks(rewards)
    rows = np.arange(P)[:, None]
    table = pd.DataFrame({
        "group": np.repeat(np.arange(P), cfg.k), "slot": np.tile(np.arange(cfg.k), P),
        "prompt_index": np.repeat(pool["prompt_index"], cfg.k),
        "prompt": np.repeat(np.array(attrs["prompts"], dtype=object), cfg.k),
        "candidate_index": index.reshape(-1), "seed": pool["seeds"][rows, index].reshape(-1),
        "rank": ranks[rows, index].reshape(-1), "explore_reward": rewards[rows, index].reshape(-1),
        "kept_as": kept_as.reshape(-1),
    })
    write_table(out / SELECTION, table)
    shown = min(ctx.cfg.tracking.grid_prompts, P)
    if shown:  # rows: prompts; columns: kept seeds, best first, a red rule before the worst
        save_grid(pool["images"][rows[:shown], index[:shown]], out / GRID, row_labels=attrs["prompts"][:shown],
                  column_labels=["best"] + [""] * (cfg.k // 2 - 1) + ["worst"] if cfg.strategy == "best_worst"
                  else (), split=cfg.k // 2 if cfg.strategy == "best_worst" else None)
    kept = rewards[rows, index]
    return StageOutput(metrics={"select/kept_reward_mean": float(kept.mean()),
                                "select/kept_reward_spread": float((kept.max(1) - kept.min(1)).mean())})
