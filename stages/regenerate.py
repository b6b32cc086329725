"""Stage 4, regenerate: sample exactly the kept seeds again with the full-precision (BF16) rollout policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.stages.context import StageContext
from solrl.stages.rollout import generate, rollout_network
from solrl.stages.select import SELECTION
from solrl.storage.arrays import write_arrays
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table

SAMPLES = "samples.zarr"


def regenerate(ctx: StageContext, out: Path) -> StageOutput:
    """Regenerate the kept seeds at ``regenerate.steps`` in BF16 (float32 on CPU).

    Writes ``samples.zarr``: images uint8 ``[P, k, H, W, 3]``, latents float32 ``[P, k, C, h, w]`` (the final
    clean sample the NFT loss re-noises), seeds and candidate_index int64 ``[P, k]``, prompt_index ``[P]``;
    with ``train.loss=flow_grpo`` (SDE sampling) also the trajectory float32 ``[P, k, S + 1, C, h, w]`` and the
    per-step log-probs float32 ``[P, k, S]`` (fp32, the "old" log-probs of the PPO ratio), attr ``sde_steps``.
    """
    select_dir, _ = require(ctx.run_dir, ctx.iteration, "select")
    selection = read_table(select_dir / SELECTION).sort_values(["group", "slot"])
    P, k = int(selection["group"].max()) + 1, int(selection["slot"].max()) + 1
    prompts = selection.groupby("group", sort=True)["prompt"].first().tolist()
    policy, _, _ = ctx.load_policy()
    noise_level = ctx.cfg.sde_noise_level()
    with rollout_network(policy, "bf16") as net:
        traj = generate(policy.model, net, selection["prompt"].tolist(), selection["seed"].tolist(),
                        ctx.cfg.regenerate.steps, ctx.cfg.regenerate.batch_size, desc="regenerate bf16",
                        noise_level=noise_level, sde_window=ctx.cfg.regenerate.sde_window)
    latents = traj.samples
    images = policy.model.decode(latents)
    trajectory = {}
    if noise_level > 0:
        trajectory = {"trajectory": traj.latents.numpy().reshape(P, k, *traj.latents.shape[1:]),
                      "log_probs": traj.log_probs.numpy().astype(np.float32).reshape(P, k, -1)}
    write_arrays(out / SAMPLES, {
        **trajectory,
        "images": images.reshape(P, k, *images.shape[1:]),
        "latents": latents.numpy().astype(np.float32).reshape(P, k, *latents.shape[1:]),
        "seeds": selection["seed"].to_numpy(np.int64).reshape(P, k),
        "candidate_index": selection["candidate_index"].to_numpy(np.int64).reshape(P, k),
        "prompt_index": selection.groupby("group", sort=True)["prompt_index"].first().to_numpy(np.int64),
    }, attrs={"prompts": prompts, "steps": ctx.cfg.regenerate.steps, "precision": "bf16",
              "policy_version": ctx.iteration - 1, "noise_level": noise_level, "sde_steps": traj.sde.tolist()})
    return StageOutput(info={"samples": P * k})
