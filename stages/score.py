"""Stages 2 and 5, score: reward every image of a pool (explore candidates or regenerated samples)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from solrl.config import RunConfig
from solrl.stages.context import StageContext
from solrl.stages.explore import explored_in
from solrl.stages.guards import fidelity_alarm
from solrl.stages.metrics.fidelity import group_agreement, rank_agreement
from solrl.stages.rewards import Reward, Scores, build_reward, release_rewards, score_all
from solrl.stages.sharding import WHOLE, Shard, prompts_per_part
from solrl.storage.artifacts import CandidatePool, ExploreRewards, FidelityTable, RegeneratedRewards, Samples, Selection
from solrl.storage.stage import StageOutput


def score_images(
    ctx: StageContext,
    images: np.ndarray,
    prompts: list[str],
    names: dict[str, float],
    metadata: list[dict] | None = None,
    *,
    group_size: int | None = None,
    release: bool = True,
) -> dict[str, Scores]:
    """Rewards of uint8 ``[B, H, W, 3]`` images or ``[B, F, H, W, 3]`` videos (and each one's prompt metadata, if
    any; ``group_size`` consecutive images per prompt group, for a group reward, default all): name -> ``Scores``
    (values float32 ``[B]``, and the reward's extra columns), each reward built with its
    ``reward.models`` options (once per process), those not kept loaded freed afterwards unless ``release=False``
    (a caller scoring a pool a few prompts at a time frees them at its end). A reward that takes images scores
    videos through their frames (``score_videos``); one that takes videos or groups gets them whole. RewardError
    on NaN."""
    try:
        models = ctx.cfg.reward.models
        rewards = {name: (build_reward(name, ctx.device, models.get(name)), w) for name, w in names.items()}
        if images.ndim == 5:
            framewise = {name: r for name, r in rewards.items() if r[0].inputs == "image"}
            whole = {name: r for name, r in rewards.items() if r[0].inputs != "image"}
            scored = score_videos(ctx, images, prompts, framewise, metadata) | score_all(
                whole, images, prompts, metadata, group_size
            )
            return {name: scored[name] for name in names}
        return score_all(rewards, images, prompts, metadata, group_size)
    finally:
        if release:
            release_rewards(list(names))


def score_videos(
    ctx: StageContext,
    videos: np.ndarray,
    prompts: list[str],
    rewards: dict[str, tuple[Reward, float]],
    metadata: list[dict] | None = None,
) -> dict[str, Scores]:
    """Rewards of uint8 videos ``[B, F, H, W, 3]`` by image rewards (``rewards``: name -> (reward, weight)): every
    ``reward.frame_stride``-th frame (the first included) is scored as an image with its video's prompt, and a
    video's reward is the ``mean`` or ``min`` of its frames' (``reward.video``), as Flow-GRPO and Flow-Factory
    score Wan videos with PickScore and HPS (frame mean); an extra column is its first frame's. Returns name ->
    ``Scores`` (values float32 ``[B]``)."""
    if not rewards:
        return {}
    frames = videos[:, :: ctx.cfg.reward.frame_stride]  # [B, F', H, W, 3]
    B, F = frames.shape[:2]
    per_frame = score_all(
        rewards,
        frames.reshape(B * F, *frames.shape[2:]),
        [p for p in prompts for _ in range(F)],
        None if metadata is None else [m for m in metadata for _ in range(F)],
    )
    reduce = np.mean if ctx.cfg.reward.video == "mean" else np.min
    first = np.arange(B) * F
    return {
        name: Scores(reduce(s.values.reshape(B, F), axis=1).astype(np.float32), s.take(first).columns)
        for name, s in per_frame.items()
    }


def rewards_table(
    pool: CandidatePool,
    candidate_index: np.ndarray,
    scores: dict[str, Scores],
    weights: dict[str, float],
    groups: range | None = None,
) -> pd.DataFrame:
    """Long table: one row per (candidate, reward): group, prompt_index, prompt, candidate_index, seed, reward,
    value, weight, weighted (= value * weight), precision, then the rewards' extra columns (empty in the rows of a
    reward without them). ``candidate_index`` int ``[P, N]``; ``groups`` the pool's group numbers (default
    ``range(P)``; a shard's positions).

    Raises:
        ValueError: a reward's extra column has the name of one of the table's own.
    """
    P, N = pool.seeds.shape
    groups = range(P) if groups is None else groups
    frames = []
    for name, scored in scores.items():
        value = scored.values
        frame = pd.DataFrame(
            {
                "group": np.repeat(np.asarray(groups, dtype=np.int64), N),
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
        frames.append(with_columns(frame, name, scored, "rewards table"))
    return pd.concat(frames, ignore_index=True)


def with_columns(frame: pd.DataFrame, name: str, scored: Scores, table: str) -> pd.DataFrame:
    """``frame`` (reward ``name``'s rows of ``table``) with the reward's extra columns ``scored.columns`` added,
    one cell per row, kept as Python objects (a rationale's text).

    Raises:
        ValueError: an extra column has the name of one of the table's own.
    """
    for column, cells in scored.columns.items():
        if column in frame.columns:
            raise ValueError(f"reward {name}: its extra column {column!r} is one of the {table}'s own")
        frame[column] = pd.Series(cells, dtype=object)
    return frame


def reward_batches(cfg: RunConfig, names: Iterable[str]) -> list[int]:
    """The batch sizes the rewards ``names`` score in (``batch_size`` of their options; none for a reward
    without one, or that scores whole groups)."""
    from solrl.stages.rewards.base import reward_class, reward_options

    sizes = []
    for name in names:
        if reward_class(name, cfg.reward.models).inputs == "group":
            continue
        size = getattr(reward_options(name, cfg.reward.models), "batch_size", None)
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    return sizes


def _score_pool(ctx: StageContext, pool: CandidatePool) -> dict[str, Scores]:
    """Rewards of every image of ``pool`` (its arrays may be lazy): name -> ``Scores`` of ``P * N`` candidates,
    read and scored ``prompts_per_part`` prompts at a time (whole batches of every reward, whole groups)."""
    P, N = pool.seeds.shape
    names = ctx.cfg.reward.weights
    frames = 1
    if pool.images.ndim == 6:  # videos: the reward sees every frame_stride-th frame of each
        frames = len(range(0, pool.images.shape[2], ctx.cfg.reward.frame_stride))
    step = min(P, prompts_per_part(N * frames, reward_batches(ctx.cfg, names)))
    metadata = ctx.train_metadata(pool.prompt_index, N)
    parts: list[dict[str, Scores]] = []
    try:
        for first in range(0, P, step):
            last = min(first + step, P)
            images = pool.images[first:last]
            parts.append(
                score_images(
                    ctx,
                    images.reshape((last - first) * N, *images.shape[2:]),
                    [pool.prompts[p] for p in range(first, last) for _ in range(N)],
                    names,
                    None if metadata is None else metadata[first * N : last * N],
                    group_size=N,
                    release=False,
                )
            )
            del images
    finally:
        release_rewards(list(names))
    return {name: Scores.join([part[name] for part in parts]) for name in names}


def _summary(prefix: str, total: np.ndarray) -> dict[str, float]:
    return {
        f"{prefix}/reward_mean": float(total.mean()),
        f"{prefix}/reward_std": float(total.std()),
        f"{prefix}/reward_max": float(total.max()),
        f"{prefix}/reward_min": float(total.min()),
    }


def merge_rewards(ctx: StageContext, parts: list[ExploreRewards]) -> pd.DataFrame:
    """The shards' reward tables as the whole stage writes it: by reward (in ``reward.weights`` order), then
    group and candidate as scored."""
    frame = pd.concat([part.frame for part in parts], ignore_index=True)
    order = {name: i for i, name in enumerate(ctx.cfg.reward.weights)}
    return frame.sort_values("reward", key=lambda r: r.map(order), kind="stable", ignore_index=True)


def score_explore(ctx: StageContext, out: Path, pool: CandidatePool, *, shard: Shard = WHOLE) -> StageOutput:
    """Reward the explore candidate pool with the training reward(s). Writes ``ExploreRewards`` (with ``shard``,
    its prompts' rows only, and no metrics: ``reduce_score_explore`` makes them from the whole table)."""
    positions = shard.positions(len(pool.prompts))
    part = pool if shard.count == 1 else pool.take(positions)
    P, N = part.seeds.shape
    candidates = np.broadcast_to(np.arange(N), (P, N))
    table = rewards_table(part, candidates, _score_pool(ctx, part), ctx.cfg.reward.weights, positions)
    rewards = ExploreRewards(table)
    rewards.write(out)
    return StageOutput() if shard.count > 1 else _explore_summary(rewards, pool)


def _explore_summary(rewards: ExploreRewards, pool: CandidatePool) -> StageOutput:
    P, N = pool.seeds.shape
    return StageOutput(metrics=_summary("explore", rewards.totals(np.broadcast_to(np.arange(N), (P, N)))))


def reduce_score_explore(ctx: StageContext, out: Path, folders: list[Path], pool: CandidatePool) -> StageOutput:
    """The score_explore stage from its shards' folders (``solrl.stages.pipeline.run_stage``)."""
    rewards = ExploreRewards(merge_rewards(ctx, [ExploreRewards.read(f / ExploreRewards.filename) for f in folders]))
    rewards.write(out)
    return _explore_summary(rewards, pool)


def score_regenerate(
    ctx: StageContext, out: Path, samples: Samples, selection: Selection, *, shard: Shard = WHOLE
) -> StageOutput:
    """Reward the BF16 regenerations; these rewards make the advantages. Also logs proxy fidelity: explore vs
    BF16 rewards of the same kept seeds (DESIGN 2). Writes ``RegeneratedRewards`` and ``FidelityTable`` (with
    ``shard``, only its prompts' rewards: ``reduce_score_regenerate`` does the rest)."""
    positions = shard.positions(len(samples.prompts))
    part = samples if shard.count == 1 else samples.take(positions)
    table = rewards_table(part, part.candidate_index, _score_pool(ctx, part), ctx.cfg.reward.weights, positions)
    rewards = RegeneratedRewards(table)
    rewards.write(out)
    return StageOutput() if shard.count > 1 else _regenerate_summary(ctx, out, rewards, samples, selection)


def reduce_score_regenerate(
    ctx: StageContext, out: Path, folders: list[Path], samples: Samples, selection: Selection
) -> StageOutput:
    """The score_regenerate stage from its shards' folders (``solrl.stages.pipeline.run_stage``)."""
    parts = [RegeneratedRewards.read(folder / RegeneratedRewards.filename) for folder in folders]
    rewards = RegeneratedRewards(merge_rewards(ctx, parts))
    rewards.write(out)
    return _regenerate_summary(ctx, out, rewards, samples, selection)


def _regenerate_summary(
    ctx: StageContext, out: Path, rewards: RegeneratedRewards, samples: Samples, selection: Selection
) -> StageOutput:
    """The fidelity table and the metrics of the whole regenerated pool's rewards. With
    ``regenerate.enabled=false`` the fidelity table is empty and no ``fidelity/*`` or ``regenerate/*`` metric is
    logged: the samples were not regenerated, so there is no BF16 ranking to compare the explore ranking with."""
    P, k = samples.seeds.shape
    if not ctx.cfg.regenerate.enabled:  # the kept explore samples themselves: no second ranking to compare
        FidelityTable(pd.DataFrame({c: [] for c in FidelityTable.columns})).write(out)
        return StageOutput()  # nor regenerate/* figures: select/kept_reward_mean already is their mean
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
    if (alarm := fidelity_alarm(metrics, ctx.cfg.fidelity.min_spearman, ctx.iteration)) is not None:
        configured = ctx.cfg.explore.precision
        if ctx.cfg.fidelity.on_low != "bf16":
            action = "explore stays as configured (fidelity.on_low=warn)"
        elif explored_in(ctx, ctx.iteration) not in (None, configured):
            action = (
                f"this iteration explored in bf16 (fidelity.on_low=bf16), so the next explores in {configured} again"
            )
        else:
            action = "the next iteration explores in bf16"
        warnings.append(f"{alarm.message}; {action}")
    return StageOutput(metrics=metrics, info={"warnings": warnings})
