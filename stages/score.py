"""Stages 2 and 5, score: reward every image of a pool (explore candidates or regenerated samples)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.stages.context import StageContext
from solrl.stages.fidelity import group_agreement, rank_agreement
from solrl.stages.rewards import build_reward, score_all
from solrl.storage.arrays import read_arrays
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table, write_table

REWARDS = "rewards.parquet"
FIDELITY = "fidelity.parquet"


def score_images(ctx: StageContext, images: np.ndarray, prompts: list[str], names: dict[str, float]
                 ) -> dict[str, np.ndarray]:
    """Rewards of uint8 ``[B, H, W, 3]`` images: name -> float32 ``[B]``. RewardError on NaN."""
    rewards = {name: (build_reward(name, ctx.device), weight) for name, weight in names.items()}
    return score_all(rewards, images, prompts)


def rewards_table(pool: dict[str, np.ndarray], prompts: list[str], values: dict[str, np.ndarray],
                  weights: dict[str, float], precision: str) -> pd.DataFrame:
    """Long table: one row per (candidate, reward): group, prompt_index, candidate_index, seed, reward, value,
    weight, weighted (= value * weight), precision."""
    seeds = pool["seeds"]  # [P, N]
    P, N = seeds.shape
    candidate = pool.get("candidate_index", np.broadcast_to(np.arange(N), (P, N)))
    frames = []
    for name, value in values.items():
        frames.append(pd.DataFrame({
            "group": np.repeat(np.arange(P), N), "prompt_index": np.repeat(pool["prompt_index"], N),
            "prompt": np.repeat(np.array(prompts, dtype=object), N),
            "candidate_index": candidate.reshape(-1).astype(np.int64), "seed": seeds.reshape(-1),
            "reward": name, "value": value.astype(np.float32), "weight": np.float32(weights[name]),
            "weighted": (value * weights[name]).astype(np.float32), "precision": precision,
        }))
    return pd.concat(frames, ignore_index=True)


def total_rewards(table: pd.DataFrame, candidate_index: np.ndarray) -> np.ndarray:
    """Weighted reward (sum over rewards) of each candidate of a pool, from a rewards table.

    Args:
        table: a ``rewards.parquet`` table (one row per candidate and reward).
        candidate_index: int ``[P, N]``, the pool's candidate indices in the order wanted.

    Returns:
        float32 ``[P, N]``; ``[p, j]`` is the total of group ``p``'s candidate ``candidate_index[p, j]``.
    """
    totals = table.groupby(["group", "candidate_index"])["weighted"].sum()
    P, N = candidate_index.shape
    keys = pd.MultiIndex.from_arrays([np.repeat(np.arange(P), N), candidate_index.reshape(-1)])
    return totals.reindex(keys).to_numpy(np.float32).reshape(P, N)


def _summary(prefix: str, total: np.ndarray) -> dict[str, float]:
    return {f"{prefix}/reward_mean": float(total.mean()), f"{prefix}/reward_std": float(total.std()),
            f"{prefix}/reward_max": float(total.max()), f"{prefix}/reward_min": float(total.min())}


def score_explore(ctx: StageContext, out: Path) -> StageOutput:
    """Reward the explore candidate pool with the training reward(s). Writes ``rewards.parquet``."""
    directory, _ = require(ctx.run_dir, ctx.iteration, "explore")
    pool, attrs = read_arrays(directory / "candidates.zarr")
    P, N = pool["seeds"].shape
    prompts = [attrs["prompts"][p] for p in range(P) for _ in range(N)]
    values = score_images(ctx, pool["images"].reshape(P * N, *pool["images"].shape[2:]), prompts,
                          ctx.cfg.reward.weights)
    table = rewards_table(pool, attrs["prompts"], values, ctx.cfg.reward.weights, attrs["precision"])
    write_table(out / REWARDS, table)
    return StageOutput(metrics=_summary("explore", total_rewards(table, np.broadcast_to(np.arange(N), (P, N)))))


def score_regenerate(ctx: StageContext, out: Path) -> StageOutput:
    """Reward the BF16 regenerations; these rewards make the advantages. Also logs proxy fidelity: explore vs
    BF16 rewards of the same kept seeds (DESIGN 2)."""
    directory, _ = require(ctx.run_dir, ctx.iteration, "regenerate")
    pool, attrs = read_arrays(directory / "samples.zarr")
    P, k = pool["seeds"].shape
    prompts = [attrs["prompts"][p] for p in range(P) for _ in range(k)]
    values = score_images(ctx, pool["images"].reshape(P * k, *pool["images"].shape[2:]), prompts,
                          ctx.cfg.reward.weights)
    table = rewards_table(pool, attrs["prompts"], values, ctx.cfg.reward.weights, attrs["precision"])
    write_table(out / REWARDS, table)
    # Paired explore rewards of the kept seeds, in the regenerated order.
    select_dir, _ = require(ctx.run_dir, ctx.iteration, "select")
    selection = read_table(select_dir / "selection.parquet").sort_values(["group", "slot"])
    explore_kept = selection["explore_reward"].to_numpy(np.float32).reshape(P, k)
    bf16 = total_rewards(table, pool["candidate_index"])
    per_group = pd.DataFrame(group_agreement(explore_kept, bf16))
    per_group.insert(0, "prompt", attrs["prompts"])
    per_group.insert(0, "group", np.arange(P))
    write_table(out / FIDELITY, per_group)
    fidelity = rank_agreement(explore_kept, bf16)
    metrics = _summary("regenerate", bf16) | {f"fidelity/{k_}": v for k_, v in fidelity.items()}
    metrics["fidelity/explore_minus_bf16"] = float((explore_kept - bf16).mean())
    warnings = []
    bound = ctx.cfg.fidelity.min_spearman
    if bound is not None and not fidelity["spearman"] >= bound:
        action = ("the next iteration explores in bf16" if ctx.cfg.fidelity.on_low == "bf16"
                  else "explore stays as configured (fidelity.on_low=warn)")
        warnings.append(f"proxy fidelity Spearman {fidelity['spearman']:.3f} is below fidelity.min_spearman="
                        f"{bound}; {action}")
    return StageOutput(metrics=metrics, info={"warnings": warnings})
