"""Fidelity audit: regenerate *whole* candidate pools of a few prompts in BF16 and compare rankings.

The per-iteration fidelity of ``score_regenerate`` uses the kept seeds only, which are the pool's extremes
and overstate agreement; the audit gives the unbiased figures of the paper's Table 3 (rank correlations,
top-n match, bottom-n false inclusion, mean true BF16 rank of the seeds kept as best and worst).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from solrl.stages.context import StageContext
from solrl.stages.metrics.fidelity import pool_agreement
from solrl.stages.metrics.grid_artifacts import grid_energy
from solrl.stages.metrics.selection import pool_ranks
from solrl.stages.quant.backends import rollout_network
from solrl.stages.sampling.rollout import generate
from solrl.stages.score import score_images
from solrl.storage.artifacts import AuditPool, CandidatePool, ExploreRewards, StartingPolicy
from solrl.storage.stage import StageOutput


def audit(
    ctx: StageContext, out: Path, pool: CandidatePool, scores: ExploreRewards, start: StartingPolicy | None
) -> StageOutput:
    """Regenerate every candidate of the first ``fidelity.audit_prompts`` pools with the BF16 rollout policy at
    ``regenerate.steps``, score them, and compare with the explore rewards.

    Writes ``AuditPool``: group, prompt, candidate_index, seed, explore_reward, bf16_reward, explore_rank,
    bf16_rank (1 = best).
    """
    P, N = pool.seeds.shape
    A = min(ctx.cfg.fidelity.audit_prompts, P)
    explore = scores.totals(np.broadcast_to(np.arange(N), (P, N)))[:A]
    prompts = [pool.prompts[p] for p in range(A) for _ in range(N)]
    policy = ctx.load_policy(start)
    with rollout_network(policy, "bf16") as net:
        samples = generate(
            policy.model,
            net,
            prompts,
            pool.seeds[:A].reshape(-1).tolist(),
            ctx.cfg.regenerate.steps,
            ctx.cfg.regenerate.batch_size,
            desc="audit bf16",
            noise_level=ctx.cfg.sde_noise_level(),
            sde_window=ctx.cfg.regenerate.sde_window,
        ).samples
    metadata = ctx.train_metadata(pool.prompt_index[:A], N)
    images = policy.model.decode(samples)
    values = score_images(ctx, images, prompts, ctx.cfg.reward.weights, metadata)
    bf16 = sum(v * ctx.cfg.reward.weights[name] for name, v in values.items()).reshape(A, N)
    AuditPool(
        pd.DataFrame(
            {
                "group": np.repeat(np.arange(A), N),
                "prompt": prompts,
                "candidate_index": np.tile(np.arange(N), A),
                "seed": pool.seeds[:A].reshape(-1),
                "explore_reward": explore.reshape(-1),
                "bf16_reward": bf16.reshape(-1).astype(np.float32),
                "explore_rank": pool_ranks(explore).reshape(-1),
                "bf16_rank": pool_ranks(bf16).reshape(-1),
            }
        )
    ).write(out)
    agreement = pool_agreement(explore, bf16, ctx.cfg.select.k)
    metrics = {f"audit/{key}": value for key, value in agreement.items()}
    if policy.model.grid_period >= 2:  # of the BF16 regenerations of whole pools
        metrics["audit/grid_energy"] = float(grid_energy(images, policy.model.grid_period).mean())
    return StageOutput(
        metrics=metrics,
        info={"prompts": A, "pool_size": N, "precision": pool.attrs["precision"]},
    )
