"""Stage 6, update: group-relative advantages from the BF16 rewards, then the DiffusionNFT policy loss."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from solrl.config import TrainConfig
from solrl.stages.context import StageContext, compute_precision
from solrl.stages.losses.advantages import Advantages, group_advantages, prompt_history_advantages
from solrl.stages.losses.grpo import grpo_loss
from solrl.stages.losses.nft import nft_loss
from solrl.stages.policy import ADAPTERS, Policy
from solrl.stages.regenerate import SAMPLES
from solrl.stages.sampling import batched
from solrl.stages.sde import gaussian_log_prob, sde_mean, sde_std
from solrl.stages.score import REWARDS, total_rewards
from solrl.storage.arrays import read_arrays
from solrl.storage.checkpoints import optimizer_from_tensors, optimizer_to_tensors, save_checkpoint
from solrl.storage.stage import StageOutput, require
from solrl.storage.tables import read_table, write_table

TRAINED = "trained"
METRICS = "metrics.parquet"
#: The per-prompt reward buffers after this iteration (``train.advantage_stats=per_prompt``): prompt, reward.
REWARD_STATS = "reward_stats.parquet"
#: Samples per forward/backward pass of the update (gradient accumulation over micro-batches and timesteps).
MICRO_BATCH = 64


def regenerated_rewards(ctx: StageContext) -> tuple[dict[str, np.ndarray], dict, list[str], np.ndarray]:
    """The regenerated pool, its attrs, its prompts, and its weighted rewards float32 ``[P, k]`` in pool order."""
    regen_dir, _ = require(ctx.run_dir, ctx.iteration, "regenerate")
    score_dir, _ = require(ctx.run_dir, ctx.iteration, "score_regenerate")
    pool, attrs = read_arrays(regen_dir / SAMPLES)
    rewards = total_rewards(read_table(score_dir / REWARDS), pool["candidate_index"])
    return pool, attrs, attrs["prompts"], rewards


def advantages(ctx: StageContext, prompts: list[str], rewards: np.ndarray, out: Path) -> Advantages:
    """The advantages ``[P, k]`` of this iteration's rewards under ``train.advantage_stats``.

    ``per_prompt`` continues the buffers the previous iteration's update committed (empty at iteration 1, or
    when that update used group statistics) and commits the updated buffers to ``out/reward_stats.parquet``, so
    the tracker's state is part of the run: resumable and auditable.
    """
    tc = ctx.cfg.train
    if tc.advantage_stats == "group":
        return group_advantages(rewards, global_std=tc.global_std, clip=tc.adv_clip_max)
    history: dict[str, np.ndarray] = {}
    if ctx.iteration > 1:
        previous, _ = require(ctx.run_dir, ctx.iteration - 1, "update")
        if (previous / REWARD_STATS).exists():
            table = read_table(previous / REWARD_STATS)
            history = {p: g["reward"].to_numpy(np.float64) for p, g in table.groupby("prompt", sort=False)}
    adv, updated = prompt_history_advantages(rewards, prompts, history, buffer_size=tc.stat_buffer,
                                             min_count=tc.stat_min_count, global_std=tc.global_std,
                                             clip=tc.adv_clip_max)
    write_table(out / REWARD_STATS, pd.DataFrame({"prompt": [p for p, v in updated.items() for _ in v],
                                                  "reward": np.concatenate(list(updated.values()))}))
    return adv


@dataclass
class Batch:
    """The regenerated group samples of one update, flattened to B = P * k, on the device."""

    x0: torch.Tensor  # float32 [B, C, h, w], the clean samples
    advantages: torch.Tensor  # float32 [B]
    emb: torch.Tensor  # [B, L, D] prompt embeddings
    mask: torch.Tensor  # [B, L]
    sigmas: torch.Tensor  # [S + 1] the sampling grid
    trajectory: torch.Tensor | None  # float32 [B, S + 1, C, h, w] (flow_grpo)
    old_log_probs: torch.Tensor | None  # float32 [B, S] (flow_grpo)
    trainable_steps: list[int]  # indices t of the steps the loss may train (x_t -> x_{t+1})


def _nft_terms(policy: Policy, batch: Batch, t_index: int, mb: slice, g: torch.Generator, tc: TrainConfig
               ) -> tuple[torch.Tensor, dict[str, float], float]:
    """NFT loss of micro-batch ``mb`` re-noised at ``sigmas[t_index]``; returns (loss, terms, |v_theta - v_old|)."""
    x0 = batch.x0[mb]
    t = batch.sigmas[t_index].expand(x0.shape[0])
    eps = torch.randn(x0.shape, generator=g).to(x0.device)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    emb, mask = batch.emb[mb], batch.mask[mb]
    with compute_precision(x0.device):
        v_theta = policy.velocity("policy", x_t, t, emb, mask)
        with torch.no_grad():
            v_old = policy.velocity("rollout", x_t, t, emb, mask)
            v_ref = policy.velocity("reference", x_t, t, emb, mask) if tc.kl_beta else None
    loss, terms = nft_loss(v_theta.float(), v_old.float(), None if v_ref is None else v_ref.float(), x_t, x0, t,
                           batch.advantages[mb], beta=tc.beta, adv_clip_max=tc.adv_clip_max, kl_beta=tc.kl_beta)
    return loss, terms, (v_theta.detach().float() - v_old.float()).abs().max().item()


def _grpo_terms(policy: Policy, batch: Batch, t_index: int, mb: slice, noise_level: float, tc: TrainConfig
                ) -> tuple[torch.Tensor, dict[str, float], float]:
    """Flow-GRPO loss of stored step ``x_t -> x_{t+1}``; returns (loss, terms, |log_prob - old_log_prob|)."""
    assert batch.trajectory is not None and batch.old_log_probs is not None
    x_t, x_next = batch.trajectory[mb, t_index], batch.trajectory[mb, t_index + 1]
    n = x_t.shape[0]
    sigma, sigma_next = batch.sigmas[t_index].expand(n), batch.sigmas[t_index + 1].expand(n)
    sigma_max = float(batch.sigmas[1])
    emb, mask = batch.emb[mb], batch.mask[mb]
    with compute_precision(x_t.device):
        v = policy.velocity("policy", x_t, sigma, emb, mask)
        with torch.no_grad():
            v_ref = policy.velocity("reference", x_t, sigma, emb, mask) if tc.kl_beta else None
    mean = sde_mean(x_t, v, sigma, sigma_next, noise_level, sigma_max)
    std = sde_std(sigma, sigma_next, noise_level, sigma_max)
    log_prob = gaussian_log_prob(x_next, mean, std)  # fp32
    ref_mean = None if v_ref is None else sde_mean(x_t, v_ref, sigma, sigma_next, noise_level, sigma_max)
    old = batch.old_log_probs[mb, t_index]
    loss, terms = grpo_loss(log_prob, old, batch.advantages[mb], clip_range=tc.clip_range, mean=mean,
                            ref_mean=ref_mean, std=std, kl_beta=tc.kl_beta)
    return loss, terms, (log_prob.detach() - old).abs().max().item()


def load_batch(ctx: StageContext, policy: Policy, pool: dict[str, np.ndarray], attrs: dict, prompts: list[str],
               advantages: np.ndarray) -> Batch:
    """Flatten the regenerated pool into a ``Batch`` on the device."""
    device, model = ctx.device, policy.model
    P, k = pool["seeds"].shape
    emb, mask = model.encode([prompts[p] for p in range(P) for _ in range(k)])
    sigmas = model.sigmas(ctx.cfg.regenerate.steps)

    def flat(a: np.ndarray) -> torch.Tensor:  # [P, k, ...] -> [B, ...] on the device
        return torch.from_numpy(a).reshape(P * k, *a.shape[2:]).to(device)

    if ctx.cfg.train.loss == "flow_grpo":
        if "trajectory" not in pool:
            raise ValueError(f"iteration {ctx.iteration}: train.loss=flow_grpo but the regenerate stage stored no "
                             f"SDE trajectory; rerun regenerate with regenerate.noise_level > 0")
        steps = [i for i, sde in enumerate(attrs["sde_steps"]) if sde]
        return Batch(flat(pool["latents"]), torch.from_numpy(advantages.reshape(-1)).to(device), emb, mask, sigmas,
                     flat(pool["trajectory"]), flat(pool["log_probs"]), steps)
    # NFT re-noises the clean sample at the sampler's timesteps (sigma = 0 dropped).
    return Batch(flat(pool["latents"]), torch.from_numpy(advantages.reshape(-1)).to(device), emb, mask, sigmas,
                 None, None, list(range(len(sigmas) - 1)))


def update(ctx: StageContext, out: Path) -> StageOutput:
    """``train.optimizer_steps`` AdamW steps of the policy loss (``nft`` or ``flow_grpo``) on the regenerated
    samples.

    Each step trains a random ``timestep_fraction`` of the trainable steps (nft: the regenerate sigma grid;
    flow_grpo: the SDE steps of the stored trajectories, i.e. the window for the fast variant), accumulating
    gradients over timesteps and micro-batches, clips the grad norm, steps, then moves the rollout policy
    (nft: ``d = min(decay_rate * step, decay_max)``; flow_grpo: the rollout policy is the policy, d = 0) and the
    EMA toward the policy. Before the first step it measures how far the rollout is from on-policy
    (``train/on_policy_max_dev``: nft ``max|v_theta - v_old|``, flow_grpo ``max|log_prob - old_log_prob|``).
    Writes ``trained/`` (adapters, optimizer, rng, state), ``metrics.parquet`` (one row per step) and, with
    ``train.advantage_stats=per_prompt``, ``reward_stats.parquet`` (the per-prompt reward buffers).
    """
    tc = ctx.cfg.train
    pool, attrs, prompts, rewards = regenerated_rewards(ctx)
    adv = advantages(ctx, prompts, rewards, out)
    policy, sections, state = ctx.load_policy()
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)
    if "optimizer" in sections:
        optimizer_from_tensors(opt, sections["optimizer"], state["optimizer_param_groups"])
    step = int(state.get("global_step", 0))
    batch = load_batch(ctx, policy, pool, attrs, prompts, adv.values)
    n_t = max(1, round(tc.timestep_fraction * len(batch.trainable_steps)))
    g = torch.Generator().manual_seed(ctx.seed("update"))
    B = batch.x0.shape[0]
    noise_level = ctx.cfg.sde_noise_level()
    rows, on_policy_dev = [], None
    for _ in range(tc.optimizer_steps):
        opt.zero_grad(set_to_none=True)
        chosen = torch.randperm(len(batch.trainable_steps), generator=g)[:n_t].tolist()
        acc: dict[str, float] = {}
        for t_index in (batch.trainable_steps[i] for i in chosen):
            for mb in batched(B, MICRO_BATCH):
                if tc.loss == "nft":
                    loss, terms, deviation = _nft_terms(policy, batch, t_index, mb, g, tc)
                else:
                    loss, terms, deviation = _grpo_terms(policy, batch, t_index, mb, noise_level, tc)
                if not rows:  # before any update in this iteration
                    on_policy_dev = max(on_policy_dev or 0.0, deviation)
                weight = (mb.stop - mb.start) / B / n_t
                (loss * weight).backward()
                for key, value in [("loss", loss.item()), *terms.items()]:
                    acc[key] = acc.get(key, 0.0) + value * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip).item()
        if not np.isfinite(grad_norm):
            raise FloatingPointError(f"iteration {ctx.iteration}: non-finite grad norm {grad_norm}; "
                                     f"lower train.lr or check the rewards")
        opt.step()
        step += 1
        decay = min(tc.decay_rate * step, tc.decay_max) if tc.loss == "nft" else 0.0
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
