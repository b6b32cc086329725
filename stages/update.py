"""Stage 6, update: group-relative advantages from the BF16 rewards, then the DiffusionNFT policy loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from solrl.stages.context import StageContext, compute_precision
from solrl.stages.losses.advantages import group_advantages
from solrl.stages.losses.nft import nft_loss
from solrl.stages.policy import ADAPTERS
from solrl.stages.regenerate import SAMPLES
from solrl.stages.sampling import batched
from solrl.stages.score import REWARDS, total_rewards
from solrl.storage.arrays import read_arrays
from solrl.storage.checkpoints import optimizer_from_tensors, optimizer_to_tensors, save_checkpoint
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table, write_table

TRAINED = "trained"
METRICS = "metrics.parquet"
#: Samples per forward/backward pass of the update (gradient accumulation over micro-batches and timesteps).
MICRO_BATCH = 64


def regenerated_rewards(ctx: StageContext) -> tuple[dict[str, np.ndarray], list[str], np.ndarray]:
    """The regenerated pool, its prompts, and its weighted rewards float32 ``[P, k]`` in pool order."""
    regen_dir, _ = require(ctx.run_dir, ctx.iteration, "regenerate")
    score_dir, _ = require(ctx.run_dir, ctx.iteration, "score_regenerate")
    pool, attrs = read_arrays(regen_dir / SAMPLES)
    rewards = total_rewards(read_table(score_dir / REWARDS), pool["candidate_index"])
    return pool, attrs["prompts"], rewards


def update(ctx: StageContext, out: Path) -> StageOutput:
    """``train.optimizer_steps`` AdamW steps of the NFT loss on the regenerated samples.

    Each step trains a random ``timestep_fraction`` of the regenerate sigma grid, accumulating gradients over
    timesteps and micro-batches, clips the grad norm, steps, then moves the rollout policy
    (``d = min(decay_rate * step, decay_max)``) and the EMA toward the policy.
    Writes ``trained/`` (adapters, optimizer, rng, state) and ``metrics.parquet`` (one row per step).
    """
    tc = ctx.cfg.train
    pool, prompts, rewards = regenerated_rewards(ctx)
    P, k = rewards.shape
    adv = group_advantages(rewards, global_std=tc.global_std, clip=tc.adv_clip_max)
    policy, sections, state = ctx.load_policy()
    model, device = policy.model, ctx.device
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)
    if "optimizer" in sections:
        optimizer_from_tensors(opt, sections["optimizer"], state["optimizer_param_groups"])
    step = int(state.get("global_step", 0))

    x0 = torch.from_numpy(pool["latents"]).reshape(P * k, *pool["latents"].shape[2:]).to(device)  # [B, C, h, w]
    advantages = torch.from_numpy(adv.values.reshape(-1)).to(device)  # [B]
    emb, mask = model.encode([prompts[p] for p in range(P) for _ in range(k)])
    sigmas = model.sigmas(ctx.cfg.regenerate.steps)[:-1]  # [T], the sampler's timesteps (sigma = 0 dropped)
    n_t = max(1, round(tc.timestep_fraction * len(sigmas)))
    g = torch.Generator().manual_seed(ctx.seed("update"))
    B = x0.shape[0]
    rows, on_policy_dev = [], None
    for _ in range(tc.optimizer_steps):
        opt.zero_grad(set_to_none=True)
        timesteps = torch.randperm(len(sigmas), generator=g)[:n_t]
        acc: dict[str, float] = {}
        for ti in timesteps.tolist():
            for mb in batched(B, MICRO_BATCH):
                n = mb.stop - mb.start
                t = sigmas[ti].expand(n)
                eps = torch.randn(x0[mb].shape, generator=g).to(device)
                x_t = (1 - t[:, None, None, None]) * x0[mb] + t[:, None, None, None] * eps
                with compute_precision(device):
                    v_theta = policy.velocity("policy", x_t, t, emb[mb], mask[mb])
                    with torch.no_grad():
                        v_old = policy.velocity("rollout", x_t, t, emb[mb], mask[mb])
                        v_ref = policy.velocity("reference", x_t, t, emb[mb], mask[mb]) if tc.kl_beta else None
                if on_policy_dev is None:  # before any update in this iteration: v_theta vs v_old
                    on_policy_dev = (v_theta.detach() - v_old).abs().max().item()
                loss, terms = nft_loss(v_theta.float(), v_old.float(), None if v_ref is None else v_ref.float(),
                                       x_t, x0[mb], t, advantages[mb], beta=tc.beta,
                                       adv_clip_max=tc.adv_clip_max, kl_beta=tc.kl_beta)
                (loss * (n / B / n_t)).backward()
                for key, value in terms.items() | {("loss", loss.item())}:
                    acc[key] = acc.get(key, 0.0) + value * n / B / n_t
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip).item()
        if not np.isfinite(grad_norm):
            raise FloatingPointError(f"iteration {ctx.iteration}: non-finite grad norm {grad_norm}; "
                                     f"lower train.lr or check the rewards")
        opt.step()
        step += 1
        decay = min(tc.decay_rate * step, tc.decay_max)
        policy.blend_("rollout", "policy", decay)
        policy.blend_("ema", "policy", tc.ema_decay)
        rows.append({"optimizer_step": step, **acc, "grad_norm": grad_norm, "rollout_decay": decay})

    tensors, groups = optimizer_to_tensors(opt)
    save_checkpoint(out / TRAINED, {**{name: policy.state_dict(name) for name in ADAPTERS},
                                     "optimizer": tensors, "rng": {"update": g.get_state()}},
                    {"global_step": step, "optimizer_param_groups": groups})
    table = pd.DataFrame(rows)
    write_table(out / METRICS, table)
    metrics = {f"train/{c}": float(table[c].mean()) for c in table.columns if c != "optimizer_step"}
    metrics |= {"train/adv_abs_mean": float(np.abs(adv.values).mean()), "train/zero_std_ratio": adv.zero_std_ratio,
                "train/on_policy_max_dev": float(on_policy_dev or 0.0), "train/global_step": step}
    return StageOutput(metrics=metrics)
