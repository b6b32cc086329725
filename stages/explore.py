"""Stage 1, explore: sample the candidate pool with the low-precision copy of the rollout policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.stages.context import StageContext
from solrl.stages.rollout import generate, rollout_network
from solrl.storage.arrays import write_arrays
from solrl.storage.stage import StageOutput

POOL = "candidates.zarr"


def explore(ctx: StageContext, out: Path) -> StageOutput:
    """Draw ``pool_size`` seeds per prompt and sample each with the explore copy (``explore.precision``).

    Writes ``candidates.zarr``: images uint8 ``[P, N, H, W, 3]``, seeds int64 ``[P, N]``, prompt_index int64
    ``[P]``; attrs: prompts, precision, steps, policy_version. Seeds derive from (run seed, iteration,
    prompt position, candidate index).
    """
    cfg = ctx.cfg.explore
    prompt_index, prompts = ctx.iteration_prompts()
    P, N = len(prompts), cfg.pool_size
    seeds = np.array([[ctx.seed("explore", p, n) for n in range(N)] for p in range(P)], dtype=np.int64)
    policy, _, _ = ctx.load_policy()
    flat_prompts = [prompts[p] for p in range(P) for _ in range(N)]
    with rollout_network(policy, cfg.precision, cfg.min_dim) as net:
        latents = generate(policy.model, net, flat_prompts, seeds.reshape(-1).tolist(), cfg.steps,
                           cfg.batch_size, desc=f"explore {cfg.precision}")
    images = policy.model.decode(latents)  # [P*N, H, W, 3]
    write_arrays(out / POOL, {"images": images.reshape(P, N, *images.shape[1:]), "seeds": seeds,
                              "prompt_index": prompt_index},
                 attrs={"prompts": prompts, "precision": cfg.precision, "steps": cfg.steps,
                        "policy_version": ctx.iteration - 1})
    return StageOutput(info={"precision": cfg.precision, "prompts": P, "pool_size": N})
