"""Stage 4, regenerate: sample exactly the kept seeds again with the full-precision (BF16) rollout policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.stages.context import StageContext
from solrl.stages.explore import POOL
from solrl.stages.rollout import generate, rollout_network, trajectory_arrays
from solrl.stages.select import SELECTION
from solrl.storage.arrays import read_arrays, write_arrays
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table

SAMPLES = "samples.zarr"


def regenerate(ctx: StageContext, out: Path) -> StageOutput:
    """Regenerate the kept seeds at ``regenerate.steps`` in BF16 (float32 on CPU).

    Writes ``samples.zarr``: images uint8 ``[P, k, H, W, 3]``, latents float32 ``[P, k, C, h, w]`` (the final
    clean sample the NFT loss re-noises), seeds and candidate_index int64 ``[P, k]``, prompt_index ``[P]``;
    with ``train.loss=flow_grpo`` (SDE sampling) also the trajectory float32 ``[P, k, S + 1, C, h, w]`` and the
    per-step log-probs float32 ``[P, k, S]`` (fp32, the "old" log-probs of the PPO ratio); attrs precision,
    sde_steps. With ``regenerate.enabled=false`` nothing is sampled: the kept explore samples are copied
    (the naive-FP4, BF16-scaling and DiffusionNFT baselines train on their rollouts directly).
    """
    select_dir, _ = require(ctx.run_dir, ctx.iteration, "select")
    selection = read_table(select_dir / SELECTION).sort_values(["group", "slot"])
    P, k = int(selection["group"].max()) + 1, int(selection["slot"].max()) + 1
    kept = selection["candidate_index"].to_numpy(np.int64).reshape(P, k)
    if ctx.cfg.regenerate.enabled:
        policy, _, _ = ctx.load_policy()
        sde = ctx.cfg.sde_noise_level() > 0
        with rollout_network(policy, "bf16") as net:
            traj = generate(policy.model, net, selection["prompt"].tolist(), selection["seed"].tolist(),
                            ctx.cfg.regenerate.steps, ctx.cfg.regenerate.batch_size, desc="regenerate bf16",
                            noise_level=ctx.cfg.sde_noise_level(), sde_window=ctx.cfg.regenerate.sde_window)
        images = policy.model.decode(traj.samples)
        arrays = {"images": images.reshape(P, k, *images.shape[1:]), **trajectory_arrays(traj, (P, k), sde)}
        precision, sde_steps = "bf16", traj.sde.tolist()
    else:
        explore_dir, _ = require(ctx.run_dir, ctx.iteration, "explore")
        pool, attrs = read_arrays(explore_dir / POOL)
        rows = np.arange(P)[:, None]
        arrays = {name: pool[name][rows, kept] for name in ("images", "latents", "trajectory", "log_probs")
                  if name in pool}
        precision, sde_steps = attrs["precision"], attrs["sde_steps"]
    write_arrays(out / SAMPLES, {
        **arrays,
        "seeds": selection["seed"].to_numpy(np.int64).reshape(P, k),
        "candidate_index": kept,
        "prompt_index": selection.groupby("group", sort=True)["prompt_index"].first().to_numpy(np.int64),
    }, attrs={"prompts": selection.groupby("group", sort=True)["prompt"].first().tolist(),
              "steps": ctx.cfg.regenerate.steps, "precision": precision, "policy_version": ctx.iteration - 1,
              "noise_level": ctx.cfg.sde_noise_level(), "sde_steps": sde_steps,
              "regenerated": ctx.cfg.regenerate.enabled})
    return StageOutput(info={"samples": P * k, "precision": precision})
