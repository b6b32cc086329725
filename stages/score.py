"""Stages 2 and 5, score: reward every image of a pool (explore candidates or regenerated samples)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.stages.context import StageContext
from solrl.stages.metrics.fidelity import group_agreement, rank_agreement
from solrl.stages.rewards import build_reward, release_rewards, score_all
from solrl.storage.artifacts import CandidatePool, ExploreRewards, FidelityTable, RegeneratedRewards, Samples, Selection
from solrl.storage.stage import StageOutput


def score_images(
    ctx: StageContext,
    images: np.ndarray,
    prompts: list[str],
    names: dict[str, float],
    metadata: list[dict] | None = None,
) -> dict[str, np.ndarray]:
    """Rewards of uint8 ``[B, H, W, 3]`` images (and each image's prompt metadata, if any): name -> float32
    ``[B]``, each reward built with its ``reward.models`` options (once per process), those not kept loaded
    freed afterwards. RewardError on NaN."""
    models = ctx.cfg.reward.models
    rewards = {name: (build_reward(name, ctx.device, models.get(name)), weight) for name, weight in names.items()}
    try:
        return score_all(rewards, images, prompts, metadata)
    finally:
        release_rewards(list(names))


def rewards_table(
    pool: CandidatePool, candidate_index: np.ndarray, values: dict[str, np.ndarray], weights: dict[str, float]
) -> pd.DataFrame:
    """Long table: one row per (candidate, reward): group, prompt_index, prompt, candidate_index, seed, reward,
    value, weight, weighted (= value * weight), precision. ``candidate_index`` int ``[P, N]``."""
    P, N = pool.seeds.shape
    frames = []
    for name, value in values.items():
        frames.append(
            pd.DataFrame(
                {
                    "group": np.repeat(np.arange(P), N),
                    "prompt_index": np.repeat(pool.prompt_index, N),
                    "prompt": np.repeat(np.array(pool.prompts, dtype=object), N),
                    "candidate_index": candidate_index.reshape(-1).astype(np.int64),
                    "seed": pool.seeds.reshape(-1),
                    "reward": name,
                    "value": value.astype(np.float32),
                    "weight": np.float32(weights[name]),
                    "weighted": (value * weights[name]).astype(np.float32),
                    "precision": pool.attrs["precision"],
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def _score_pool(ctx: StageContext, pool: CandidatePool) -> dict[str, np.ndarray]:
    P, N = pool.seeds.shape
    prompts = [pool.prompts[p] for p in range(P) for _ in range(N)]
    images = pool.images.reshape(P * N, *pool.images.shape[2:])
    return score_images(ctx, images, prompts, ctx.cfg.reward.weights, ctx.train_metadata(pool.prompt_index, N))


def _summary(prefix: str, total: np.ndarray) -> dict[str, float]:
    return {
        f"{prefix}/reward_mean": float(total.mean()),
        f"{prefix}/reward_std": float(total.std()),
        f"{prefix}/reward_max": float(total.max()),
        f"{prefix}/reward_min": float(total.min()),
    }


def score_explore(ctx: StageContext, out: Path, pool: CandidatePool) -> StageOutput:
    """Reward the explore candidate pool with the training reward(s). Writes ``ExploreRewards``."""
    P, N = pool.seeds.shape
    candidates = np.broadcast_to(np.arange(N), (P, N))
    rewards = ExploreRewards(rewards_table(pool, candidates, _score_pool(ctx, pool), ctx.cfg.reward.weights))
    rewards.write(out)
    return StageOutput(metrics=_summary("explore", rewards.totals(candidates)))


def score_regenerate(ctx: StageContext, out: Path, samples: Samples, selection: Selection) -> StageOutput:
    """Reward the BF16 regenerations; these rewards make the advantages. Also logs proxy fidelity: explore vs
    BF16 rewards of the same kept seeds (DESIGN 2). Writes ``RegeneratedRewards`` and ``FidelityTable``."""
    P, k = samples.seeds.shape
    rewards = RegeneratedRewards(
        rewards_table(samples, samples.candidate_index, _score_pool(ctx, samples), ctx.cfg.reward.weights)
    )
    rewards.write(out)
    # Paired explore rewards of the kept seeds, in the regenerated order.
    explore_kept = selection.ordered["explore_reward"].to_numpy(np.float32).reshape(P, k)
    bf16 = rewards.totals(samples.candidate_index)
    per_group = pd.DataFrame(group_agreement(explore_kept, bf16))
    per_group.insert(0, "prompt", samples.prompts)
    per_group.insert(0, "group", np.arange(P))
    FidelityTable(per_group).write(out)
    fidelity = rank_agreement(explore_kept, bf16)
    metrics = _summary("regenerate", bf16) | {f"fidelity/{k_}": v for k_, v in fidelity.items()}
    metrics["fidelity/explore_minus_bf16"] = float((explore_kept - bf16).mean())
    warnings = []
    bound = ctx.cfg.fidelity.min_spearman
    if bound is not None and not fidelity["spearman"] >= bound:
        action = (
            "the next iteration explores in bf16"
            if ctx.cfg.fidelity.on_low == "bf16"
            else "explore stays as configured (fidelity.on_low=warn)"
        )
        warnings.append(
            f"proxy fidelity Spearman {fidelity['spearman']:.3f} is below fidelity.min_spearman={bound}; {action}"
        )
    return StageOutput(metrics=metrics, info={"warnings": warnings})
