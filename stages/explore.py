"""Stage 1, explore: sample the candidate pool with the low-precision copy of the rollout policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.stages.context import StageContext
from solrl.stages.rollout import generate, rollout_network, trajectory_arrays
from solrl.storage.arrays import write_arrays
from solrl.storage.stage import StageOutput, read_manifest

POOL = "candidates.zarr"


def explore_precision(ctx: StageContext) -> tuple[str, list[str]]:
    """The precision this iteration explores in: ``explore.precision``, unless the previous iteration's proxy
    fidelity fell below ``fidelity.min_spearman`` with ``fidelity.on_low=bf16`` (then ``bf16``, with a warning)."""
    configured, bound = ctx.cfg.explore.precision, ctx.cfg.fidelity.min_spearman
    if bound is None or ctx.cfg.fidelity.on_low != "bf16" or ctx.iteration <= 1 or configured == "bf16":
        return configured, []
    previous = read_manifest(ctx.run_dir, ctx.iteration - 1, "score_regenerate")
    rho = previous.metrics.get("fidelity/spearman", float("nan")) if previous else float("nan")
    if rho >= bound:
        return configured, []
    return "bf16", [f"iteration {ctx.iteration - 1} proxy fidelity Spearman {rho:.3f} < {bound}: exploring in bf16 "
                    f"instead of {configured} this iteration"]


def explore(ctx: StageContext, out: Path) -> StageOutput:
    """Draw ``pool_size`` seeds per prompt and sample each with the explore copy (``explore.precision``).

    Writes ``candidates.zarr``: images uint8 ``[P, N, H, W, 3]``, seeds int64 ``[P, N]``, prompt_index int64
    ``[P]``; attrs: prompts, precision, steps, policy_version, sde_steps. With ``regenerate.enabled=false`` (the
    baselines that train on the explore samples) also the final latents float32 ``[P, N, C, h, w]`` and, for
    flow_grpo, the trajectories and log-probs. Seeds derive from (run seed, iteration, prompt position,
    candidate index).
    """
    cfg = ctx.cfg.explore
    precision, warnings = explore_precision(ctx)
    prompt_index, prompts = ctx.iteration_prompts()
    P, N = len(prompts), cfg.pool_size
    seeds = np.array([[ctx.seed("explore", p, n) for n in range(N)] for p in range(P)], dtype=np.int64)
    policy, _, _ = ctx.load_policy()
    flat_prompts = [prompts[p] for p in range(P) for _ in range(N)]
    policy.explore_sync_seconds = 0.0
    with rollout_network(policy, precision, cfg.min_dim) as net:
        traj = generate(policy.model, net, flat_prompts, seeds.reshape(-1).tolist(), cfg.steps, cfg.batch_size,
                        desc=f"explore {precision}", noise_level=ctx.cfg.sde_noise_level(),
                        sde_window=ctx.cfg.regenerate.sde_window if cfg.steps == ctx.cfg.regenerate.steps else None)
    images = policy.model.decode(traj.samples)  # [P*N, H, W, 3]
    arrays = {"images": images.reshape(P, N, *images.shape[1:]), "seeds": seeds, "prompt_index": prompt_index}
    if not ctx.cfg.regenerate.enabled:  # the update trains on these samples: keep what it needs
        arrays |= trajectory_arrays(traj, (P, N), ctx.cfg.sde_noise_level() > 0)
    write_arrays(out / POOL, arrays, attrs={"prompts": prompts, "precision": precision, "steps": cfg.steps,
                                            "policy_version": ctx.iteration - 1, "sde_steps": traj.sde.tolist()})
    # Seconds to build (first iteration in this process) or sync in place (later) the quantized copy.
    return StageOutput(metrics={"explore/sync_seconds": policy.explore_sync_seconds,
                                "explore/low_precision": precision != "bf16"},
                       info={"precision": precision, "prompts": P, "pool_size": N, "warnings": warnings})
