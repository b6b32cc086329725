"""Fidelity audit: regenerate *whole* candidate pools of a few prompts in BF16 and compare rankings.

The per-iteration fidelity of ``score_regenerate`` uses the kept seeds only, which are the pool's extremes
and overstate agreement; the audit gives the unbiased figures of the paper's Table 3 (rank correlations,
top-n match, bottom-n false inclusion, mean true BF16 rank of the seeds kept as best and worst).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.config import RunConfig
from solrl.stages.context import StageContext
from solrl.stages.metrics.fidelity import pool_agreement
from solrl.stages.metrics.grid_artifacts import grid_energy
from solrl.stages.metrics.selection import pool_ranks
from solrl.stages.quant.backends import sampling_network
from solrl.stages.sampling.compiled import compile_metrics
from solrl.stages.sampling.rollout import generate
from solrl.stages.score import score_images
from solrl.stages.sharding import WHOLE, Shard
from solrl.storage.artifacts import AuditPool, CandidatePool, ExploreRewards, StartingPolicy
from solrl.storage.stage import StageOutput, read_manifest


def audit(
    ctx: StageContext,
    out: Path,
    pool: CandidatePool,
    scores: ExploreRewards,
    start: StartingPolicy | None,
    *,
    shard: Shard = WHOLE,
) -> StageOutput:
    """Regenerate every candidate of the first ``fidelity.audit_prompts`` pools with the BF16 rollout policy at
    ``regenerate.steps``, score them, and compare with the explore rewards.

    Writes ``AuditPool``: group, prompt, candidate_index, seed, explore_reward, bf16_reward, explore_rank,
    bf16_rank (1 = best). With ``shard``, only its share of the audited prompts, and as metrics only the grid
    energy of its regenerations (``reduce_audit`` computes the rest from the whole table).
    """
    P, N = pool.seeds.shape
    A = audit_prompts(ctx.cfg)
    groups = np.asarray(shard.positions(A), dtype=np.int64)
    explore = scores.totals(np.broadcast_to(np.arange(N), (P, N)))[groups]
    prompts = [pool.prompts[p] for p in groups for _ in range(N)]
    policy = ctx.load_policy(start)
    with sampling_network(policy, "bf16", compile=ctx.cfg.regenerate.compile, mode=ctx.cfg.model.compile_mode) as (
        net,
        compiled,
    ):
        samples = generate(
            policy.model,
            net,
            prompts,
            pool.seeds[groups].reshape(-1).tolist(),
            ctx.cfg.regenerate.steps,
            ctx.cfg.regenerate.batch_size,
            desc="audit bf16",
            noise_level=ctx.cfg.sde_noise_level(),
            sde_window=ctx.cfg.regenerate.sde_window,
        ).samples
    metadata = ctx.train_metadata(pool.prompt_index[groups], N)
    images = policy.model.decode(samples)
    scores = score_images(ctx, images, prompts, ctx.cfg.reward.weights, metadata, group_size=N)
    values = {name: scored.values for name, scored in scores.items()}
    bf16 = sum(v * ctx.cfg.reward.weights[name] for name, v in values.items()).reshape(len(groups), N)
    table = AuditPool(
        pd.DataFrame(
            {
                "group": np.repeat(groups, N),
                "prompt": prompts,
                "candidate_index": np.tile(np.arange(N), len(groups)),
                "seed": pool.seeds[groups].reshape(-1),
                "explore_reward": explore.reshape(-1),
                "bf16_reward": bf16.reshape(-1).astype(np.float32),
                "explore_rank": pool_ranks(explore).reshape(-1),
                "bf16_rank": pool_ranks(bf16).reshape(-1),
            }
        )
    )
    table.write(out)
    # Of the BF16 regenerations of whole pools (the mean over prompts of each prompt's mean, for any layout).
    energy = {}
    if policy.model.grid_period >= 2:
        per_prompt = grid_energy(images, policy.model.grid_period).reshape(len(groups), N).mean(1)
        energy = {"audit/grid_energy": float(per_prompt.mean())}
    if shard.count > 1:
        return StageOutput(metrics=energy | compile_metrics("audit", compiled), info={"prompts": len(groups)})
    summary = _summary(ctx, table, energy, pool)
    summary.metrics.update(compile_metrics("audit", compiled))
    return summary


def audit_due(cfg: RunConfig, iteration: int) -> bool:
    """Whether the audit runs at ``iteration``: every ``fidelity.audit_every`` iterations (0: never)."""
    return cfg.fidelity.audit_every > 0 and iteration % cfg.fidelity.audit_every == 0


def audit_prompts(cfg: RunConfig) -> int:
    """How many of an iteration's pools the audit regenerates: ``fidelity.audit_prompts``, at most all."""
    return min(cfg.fidelity.audit_prompts, cfg.campaign.prompts_per_iteration)


def reduce_audit(
    ctx: StageContext,
    out: Path,
    folders: list[Path],
    pool: CandidatePool,
    scores: ExploreRewards,
    start: StartingPolicy | None,
) -> StageOutput:
    """The audit stage from its shards' folders: the tables concatenated, the agreement computed from all of
    them, the grid energy the prompt-weighted mean of the shards'."""
    frame = pd.concat([AuditPool.read(folder / AuditPool.filename).frame for folder in folders], ignore_index=True)
    table = AuditPool(frame)
    table.write(out)
    shards = [read_manifest(ctx.run_dir, ctx.iteration, f"{folder.parent.name}/{folder.name}") for folder in folders]
    energy = {}
    if all(m is not None and "audit/grid_energy" in m.metrics for m in shards):
        weights = np.array([m.info["prompts"] for m in shards], dtype=np.float64)  # type: ignore[union-attr]
        values = np.array([m.metrics["audit/grid_energy"] for m in shards])  # type: ignore[union-attr]
        energy = {"audit/grid_energy": float((weights * values).sum() / weights.sum())}
    return _summary(ctx, table, energy, pool)


def _summary(ctx: StageContext, table: AuditPool, energy: dict[str, float], pool: CandidatePool) -> StageOutput:
    """The unbiased agreement figures of the audited pools (paper, Table 3), from the whole table."""
    N = pool.seeds.shape[1]
    frame = table.frame.sort_values(["group", "candidate_index"])
    explore = frame["explore_reward"].to_numpy(np.float64).reshape(-1, N)
    bf16 = frame["bf16_reward"].to_numpy(np.float64).reshape(-1, N)
    agreement = pool_agreement(explore.astype(np.float32), bf16.astype(np.float32), ctx.cfg.select.k)
    metrics = {f"audit/{key}": value for key, value in agreement.items()} | energy
    return StageOutput(
        metrics=metrics,
        info={"prompts": len(explore), "pool_size": N, "precision": pool.attrs["precision"]},
    )
