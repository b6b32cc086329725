"""Evaluation: held-out alignment of the BF16 rollout policy (or its EMA, ``campaign.eval_adapter``) on fixed prompts
and seeds, every reward, and sample diversity (the training reward alone can be gamed: DESIGN 5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.config import RunConfig
from solrl.stages.context import StageContext
from solrl.stages.guards import evaluation_alarms
from solrl.stages.metrics.diversity import pairwise_diversity
from solrl.stages.metrics.grid import save_grid
from solrl.stages.metrics.grid_artifacts import grid_energy
from solrl.stages.metrics.video import temporal_change
from solrl.stages.quant.backends import sampling_network
from solrl.stages.rewards.base import Scores
from solrl.stages.sampling.compiled import compile_metrics
from solrl.stages.sampling.rollout import generate
from solrl.stages.sampling.samplers import derive_seed
from solrl.stages.score import score_images, with_columns
from solrl.stages.sharding import WHOLE, Shard
from solrl.storage.artifacts import EvalMetrics, EvalSamples, EvalScores, TrainedPolicy
from solrl.storage.stage import StageOutput, read_manifest

GRID = EvalSamples.grid


def evaluation_due(cfg: RunConfig, iteration: int) -> bool:
    """Whether the evaluation runs at ``iteration``: every ``campaign.eval_every`` iterations, at 0 (the
    starting policy) and at the last (the policy the campaign ends with)."""
    return iteration % cfg.campaign.eval_every == 0 or iteration == cfg.campaign.iterations


def evaluate(ctx: StageContext, out: Path, trained: TrainedPolicy | None, *, shard: Shard = WHOLE) -> StageOutput:
    """Sample every evaluation prompt with ``campaign.eval_seeds`` fixed seeds (the same every iteration) at
    ``campaign.eval_steps`` (default ``regenerate.steps``) with the ``campaign.eval_adapter`` (the rollout policy,
    its EMA or the policy) of this iteration's checkpoint ``trained`` (iteration 0: the base model), and score
    them with every reward of ``reward.evaluate`` and ``reward.weights`` (the trained ones are always reported).

    Writes ``EvalSamples`` (images ``[P, S, H, W, 3]``, videos ``[P, S, F, H, W, 3]``, seeds), ``EvalMetrics``
    (per prompt and reward), ``EvalScores`` (per sample and reward, with the rewards' extra columns) and
    ``samples.png``. With ``shard``, only its prompts' samples and tables (``reduce_evaluate`` does the rest).
    """
    evaluation = ctx.cfg.prompt_sets()[1]
    positions = shard.positions(len(evaluation.prompts))
    prompts = [evaluation.prompts[p] for p in positions]
    S = ctx.cfg.campaign.eval_seeds
    seeds = np.array(
        [[derive_seed(ctx.cfg.campaign.seed, "eval", p, s) for s in range(S)] for p in positions], dtype=np.int64
    )
    policy = ctx.load_policy(trained)
    flat = [p for p in prompts for _ in range(S)]
    with sampling_network(
        policy,
        "bf16",
        compile=ctx.cfg.regenerate.compile,
        mode=ctx.cfg.model.compile_mode,
        adapter=ctx.cfg.campaign.eval_adapter,
    ) as (net, compiled):
        samples = generate(
            policy.model,
            net,
            flat,
            seeds.reshape(-1).tolist(),
            ctx.cfg.campaign.eval_steps or ctx.cfg.regenerate.steps,
            ctx.cfg.regenerate.batch_size,
            desc="evaluate",
        ).samples  # deterministic ODE
    images = policy.model.decode(samples)
    grid = images.reshape(len(prompts), S, *images.shape[1:])
    metadata = [evaluation.metadata[p] for p in positions for _ in range(S)] if evaluation.has_metadata() else None
    scores = score_images(ctx, images, flat, dict.fromkeys(eval_rewards(ctx), 1.0), metadata, group_size=S)
    values = {name: scored.values for name, scored in scores.items()}
    drawn = EvalSamples(
        images=grid,
        seeds=seeds,
        prompt_index=np.asarray(positions, dtype=np.int64),
        attrs={"prompts": prompts, "policy_version": ctx.iteration, "grid_period": policy.model.grid_period},
    )
    table = EvalMetrics(
        pd.DataFrame(
            [
                {"prompt": prompts[p], "reward": name, "mean": float(v.reshape(len(prompts), S)[p].mean())}
                for name, v in values.items()
                for p in range(len(prompts))
            ]
        )
    )
    drawn.write(out)
    table.write(out)
    _per_sample(prompts, seeds, scores).write(out)
    if shard.count > 1:
        return StageOutput(metrics=compile_metrics("evaluate", compiled))
    summary = _summary(ctx, out, drawn, table)
    summary.metrics.update(compile_metrics("evaluate", compiled))
    return summary


def eval_rewards(ctx: StageContext) -> list[str]:
    """The rewards an evaluation reports, in order: the trained ones, then ``reward.evaluate``."""
    return list(dict.fromkeys([*ctx.cfg.reward.weights, *ctx.cfg.reward.evaluate]))


def reduce_evaluate(ctx: StageContext, out: Path, folders: list[Path], trained: TrainedPolicy | None) -> StageOutput:
    """The evaluate stage from its shards' folders (``solrl.stages.pipeline.run_stage``): their samples and tables
    concatenated (the tables in the whole stage's order: by reward, then prompt), then the grid and metrics."""
    drawn = EvalSamples.concat([EvalSamples.read(folder / EvalSamples.filename) for folder in folders])
    order = {name: i for i, name in enumerate(eval_rewards(ctx))}

    def merged(kind: type[EvalMetrics] | type[EvalScores]) -> pd.DataFrame:
        frame = pd.concat([kind.read(folder / kind.filename).frame for folder in folders])
        return frame.sort_values("reward", key=lambda r: r.map(order), kind="stable", ignore_index=True)

    table = EvalMetrics(merged(EvalMetrics))
    drawn.write(out)
    table.write(out)
    EvalScores(merged(EvalScores)).write(out)
    return _summary(ctx, out, drawn, table)


def _per_sample(prompts: list[str], seeds: np.ndarray, scores: dict[str, Scores]) -> EvalScores:
    """One row per (sample, reward) of ``P`` prompts with seeds int ``[P, S]``: prompt, sample (the slot), seed,
    reward, value, then the rewards' extra columns (empty where a reward has none).

    Raises:
        ValueError: a reward's extra column has the name of one of the table's own.
    """
    P, S = seeds.shape
    frames = []
    for name, scored in scores.items():
        frame = pd.DataFrame(
            {
                "prompt": np.repeat(np.array(prompts, dtype=object), S),
                "sample": np.tile(np.arange(S, dtype=np.int64), P),
                "seed": seeds.reshape(-1).astype(np.int64),
                "reward": name,
                "value": scored.values.astype(np.float32),
            }
        )
        frames.append(with_columns(frame, name, scored, "evaluation table"))
    return EvalScores(pd.concat(frames, ignore_index=True))


def _summary(ctx: StageContext, out: Path, drawn: EvalSamples, table: EvalMetrics) -> StageOutput:
    """The grid picture, the metrics (each reward's mean over prompts of the per-prompt means, diversity, grid
    energy, and for videos the frame-to-frame change) and the reward-hacking warnings of a whole evaluation."""
    prompts, grid = drawn.prompts, drawn.images
    first = eval_rewards(ctx)[0]  # a trained reward: each row says its mean over the row's seeds
    row_means = table.frame[table.frame["reward"] == first].groupby("prompt", sort=False)["mean"].first()
    labels = [f"{p}  ({first} {row_means[p]:.3f})" if p in row_means else p for p in prompts]
    save_grid(grid, out / GRID, row_labels=labels)
    means = table.frame.groupby("reward", sort=False)["mean"]
    metrics = {f"eval/{name}": float(values.to_numpy(np.float64).mean()) for name, values in means}
    metrics["eval/diversity"] = pairwise_diversity(grid)
    if grid.ndim == 6 and grid.shape[2] >= 2:  # videos: the temporal guard's measure (none for one frame)
        metrics["eval/temporal_change"] = float(temporal_change(grid.reshape(-1, *grid.shape[2:])).mean())
    period = int(drawn.attrs["grid_period"])
    if period >= 2:
        metrics["eval/grid_energy"] = float(grid_energy(grid.reshape(-1, *grid.shape[2:]), period).mean())
    start = read_manifest(ctx.run_dir, 0, "evaluate") if ctx.iteration > 0 else None
    alarms = evaluation_alarms(metrics, start.metrics if start else None, ctx.iteration, ctx.cfg.campaign, period)
    warnings = [alarm.message for alarm in alarms]
    return StageOutput(metrics=metrics, info={"warnings": warnings, "grid_period": period})
