"""Stage 4, regenerate: sample exactly the kept seeds again with the full-precision (BF16) rollout policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.stages.context import StageContext
from solrl.stages.quant.backends import sampling_network
from solrl.stages.sampling.compiled import compile_metrics
from solrl.stages.sampling.rollout import generate, trajectory_arrays
from solrl.stages.sharding import WHOLE, Shard
from solrl.storage.artifacts import CandidatePool, Samples, Selection, StartingPolicy
from solrl.storage.stage import StageOutput

#: Arrays of a candidate pool that the update may train on, copied for the kept seeds without regeneration.
_TRAINABLE = ("images", "latents", "trajectory", "log_probs")


def regenerate(
    ctx: StageContext,
    out: Path,
    selection: Selection,
    pool: CandidatePool,
    start: StartingPolicy | None,
    *,
    shard: Shard = WHOLE,
) -> StageOutput:
    """Regenerate the kept seeds at ``regenerate.steps`` in BF16 (float32 on CPU) with the rollout policy
    ``start``.

    Writes ``Samples``: images uint8 ``[P, k, H, W, 3]``, latents float32 ``[P, k, C, h, w]`` (the final clean
    sample the NFT loss re-noises), seeds and candidate_index int64 ``[P, k]``, prompt_index ``[P]``; for SDE
    rollouts (``train.loss=flow_grpo``) also the trajectory float32 ``[P, k, S + 1, C, h, w]`` and the per-step
    log-probs float32 ``[P, k, S]`` (fp32, the "old" log-probs of the PPO ratio). With
    ``regenerate.enabled=false`` nothing is sampled: the kept explore samples are copied (the naive-FP4,
    BF16-scaling and DiffusionNFT baselines train on their rollouts directly). With ``shard``, only that shard's
    groups (``P`` of them).
    """
    ordered = selection.ordered
    P, k = selection.shape
    positions = np.asarray(shard.positions(P), dtype=np.int64)
    ordered = ordered[ordered["group"].isin(positions)]
    P = len(positions)
    kept = ordered["candidate_index"].to_numpy(np.int64).reshape(P, k)
    if ctx.cfg.regenerate.enabled:
        policy = ctx.load_policy(start)
        noise_level = ctx.cfg.sde_noise_level()
        with sampling_network(policy, "bf16", compile=ctx.cfg.regenerate.compile, mode=ctx.cfg.model.compile_mode) as (
            net,
            compiled,
        ):
            traj = generate(
                policy.model,
                net,
                ordered["prompt"].tolist(),
                ordered["seed"].tolist(),
                ctx.cfg.regenerate.steps,
                ctx.cfg.regenerate.batch_size,
                desc="regenerate bf16",
                noise_level=noise_level,
                sde_window=ctx.cfg.regenerate.sde_window,
            )
        images = policy.model.decode(traj.samples)
        arrays = {"images": images.reshape(P, k, *images.shape[1:]), **trajectory_arrays(traj, (P, k), noise_level > 0)}
        precision, sde_steps = "bf16", traj.sde.tolist()
        metrics = compile_metrics("regenerate", compiled)
    else:
        rows = positions[:, None]
        arrays = {name: getattr(pool, name)[rows, kept] for name in _TRAINABLE if getattr(pool, name) is not None}
        precision, sde_steps = pool.attrs["precision"], pool.attrs["sde_steps"]
        metrics = {}
    groups = ordered.groupby("group", sort=True)
    Samples(
        **arrays,
        seeds=ordered["seed"].to_numpy(np.int64).reshape(P, k),
        candidate_index=kept,
        prompt_index=groups["prompt_index"].first().to_numpy(np.int64),
        attrs={
            "prompts": groups["prompt"].first().tolist(),
            "steps": ctx.cfg.regenerate.steps,
            "precision": precision,
            "policy_version": ctx.iteration - 1,
            "noise_level": ctx.cfg.sde_noise_level(),
            "sde_steps": sde_steps,
            "regenerated": ctx.cfg.regenerate.enabled,
        },
    ).write(out)
    return StageOutput(metrics=metrics, info={"samples": P * k, "precision": precision})
