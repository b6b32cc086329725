"""Stage 6, update: group-relative advantages from the BF16 rewards, then the policy loss (``train.loss``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from solrl.config import ConfigError
from solrl.registry import LOSSES
from solrl.stages.context import StageContext
from solrl.stages.losses.advantages import Advantages, group_advantages, prompt_history_advantages
from solrl.stages.losses.base import Batch
from solrl.stages.models.policy import ADAPTERS, Policy
from solrl.stages.sampling.samplers import batched, seed_noise
from solrl.stages.sharding import Shard
from solrl.storage.artifacts import (
    RegeneratedRewards,
    RewardStats,
    Samples,
    StartingPolicy,
    TrainedState,
    UpdateMetrics,
)
from solrl.storage.checkpoints import optimizer_from_tensors, optimizer_to_tensors
from solrl.storage.stage import StageOutput


def advantages(
    ctx: StageContext, prompts: list[str], rewards: np.ndarray, stats: RewardStats | None, out: Path | None
) -> Advantages:
    """The advantages ``[P, k]`` of this iteration's rewards under ``train.advantage_stats``.

    ``per_prompt`` continues the buffers ``stats`` the previous iteration's update committed (None at iteration
    1, or when that update used group statistics) and commits the updated buffers as this stage's
    ``RewardStats`` (into ``out``; None: not written, on the ranks of a multi-process update but the first),
    so the tracker's state is part of the run: resumable and auditable.
    """
    tc = ctx.cfg.train
    if tc.advantage_stats == "group":
        return group_advantages(rewards, global_std=tc.global_std, clip=tc.adv_clip_max)
    adv, updated = prompt_history_advantages(
        rewards,
        prompts,
        stats.history() if stats else {},
        buffer_size=tc.stat_buffer,
        min_count=tc.stat_min_count,
        global_std=tc.global_std,
        clip=tc.adv_clip_max,
    )
    if out is not None:
        RewardStats(
            pd.DataFrame(
                {"prompt": [p for p, v in updated.items() for _ in v], "reward": np.concatenate(list(updated.values()))}
            )
        ).write(out)
    return adv


def load_batch(ctx: StageContext, policy: Policy, samples: Samples, advantages: np.ndarray) -> Batch:
    """Flatten the group samples ``[P, k, ...]`` into a ``Batch`` of B = P * k on the device."""
    device, model = ctx.device, policy.model
    P, k = samples.seeds.shape
    cond = model.encode([samples.prompts[p] for p in range(P) for _ in range(k)])

    def flat(a: np.ndarray | None) -> torch.Tensor | None:  # [P, k, ...] -> [B, ...] on the device
        return None if a is None else torch.from_numpy(np.asarray(a)).reshape(P * k, *a.shape[2:]).to(device)

    seeds = torch.from_numpy(np.asarray(samples.seeds, dtype=np.int64).reshape(-1))
    trajectory = flat(samples.trajectory)
    noise = None  # GRPO-Guard recovers the rollout means from the seeds' draws: drawn once per update
    if LOSSES.get(ctx.cfg.train.loss).draws_seed_noise(ctx.cfg) and trajectory is not None:
        noise = seed_noise(seeds.tolist(), tuple(trajectory.shape[2:]), trajectory.shape[1], device)
    return Batch(
        flat(samples.latents),
        torch.from_numpy(advantages.reshape(-1)).to(device),
        cond,
        model.sigmas(ctx.cfg.regenerate.steps),
        trajectory,
        flat(samples.log_probs),
        [bool(s) for s in samples.attrs["sde_steps"]],
        seeds,
        noise,
    )


def update(
    ctx: StageContext,
    out: Path,
    samples: Samples,
    rewards: RegeneratedRewards,
    stats: RewardStats | None,
    start: StartingPolicy | None,
) -> StageOutput:
    """The update stage: ``train_policy`` in this process, or in several (``solrl.stages.distributed``), which
    write the same outputs into ``out``: with ``train.nproc_per_node`` > 1 under torchrun, with
    ``train.launcher=ray`` as Ray Train's ``train.workers`` workers.

    Raises:
        FloatingPointError: a non-finite gradient norm. RuntimeError: a process of the update failed.
    """
    if ctx.cfg.train.nproc_per_node > 1 or ctx.cfg.train.launcher == "ray":
        from solrl.stages.distributed import launch_update

        return launch_update(ctx, out)
    return train_policy(ctx, out, samples, rewards, stats, start)


def train_policy(
    ctx: StageContext,
    out: Path | None,
    samples: Samples,
    rewards: RegeneratedRewards,
    stats: RewardStats | None,
    start: StartingPolicy | None,
    rank: int = 0,
    world: int = 1,
) -> StageOutput:
    """``train.optimizer_steps`` AdamW steps of the policy loss (a registered ``train.loss``) on the group
    samples, starting from the policy, optimizer and step of ``start``.

    Each step trains a random ``timestep_fraction`` of the loss's trainable steps (nft: the regenerate sigma
    grid; flow_grpo: the SDE steps of the stored trajectories, i.e. the window for the fast variant),
    accumulating gradients over timesteps and micro-batches, clips the grad norm, steps, then moves the rollout
    policy (``d`` from the loss: nft ``min(decay_rate * step, decay_max)``, flow_grpo 0) and the EMA toward the
    policy. Before the first step it measures how far the rollout is from on-policy
    (``train/on_policy_max_dev``: nft ``max|v_theta - v_old|``, flow_grpo ``max|log_prob - old_log_prob|``).
    Writes ``TrainedState`` (adapters, optimizer, rng, state), ``UpdateMetrics`` (one row per step) and, with
    ``train.advantage_stats=per_prompt``, ``RewardStats`` into ``out`` (None: nothing written).

    With ``world`` > 1 (an initialised ``torch.distributed`` process group; ``solrl.stages.distributed``) this
    process computes rows ``Shard(rank, world)`` of every micro-batch, and the gradients, loss terms and
    on-policy deviation are all-reduced before each step, as DDP does: every process then takes the same step.
    The random draws are the one-process draws, so the result equals one process's within float tolerance.

    Raises:
        FloatingPointError: a non-finite gradient norm.
    """
    policy = ctx.load_policy(start)
    if world > 1 and ctx.cfg.train.parallel == "fsdp":
        from solrl.stages.context import release_policies
        from solrl.stages.distributed import shard_policy

        release_policies()  # the sharded model is this update's alone: no later stage of the process reuses it
        shard_policy(policy)
    with _checkpointing(policy, ctx.cfg.train.gradient_checkpointing):
        return _train(ctx, out, policy, samples, rewards, stats, start, rank, world)


def _checked_terms(
    name: str, result: Any, step: int, t_index: int
) -> tuple[torch.Tensor | None, dict[str, float], float]:
    """A loss's ``terms`` return value (``PolicyLoss.terms``) checked before backward, so that a plug-in's mistake
    is named as the loss's, not as a diverged policy or a bare autograd error.

    Raises:
        TypeError: not (scalar loss tensor with grad or None, dict of numbers, number).
        FloatingPointError: the loss is NaN or inf.
    """
    where = f"train.loss={name}: terms() at optimizer step {step + 1}, timestep index {t_index}"
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"{where} returned {type(result).__name__}, not (loss, terms, on-policy deviation)")
    loss, terms, deviation = result
    if loss is not None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"{where} returned a loss of {shape}, not a scalar tensor")
        if not loss.requires_grad:
            raise TypeError(f"{where} returned a loss with no gradient (detached, or computed under no_grad)")
        if not torch.isfinite(loss.detach()).all():
            raise FloatingPointError(
                f"{where} returned loss {loss.item()}: the policy diverged (lower train.lr, check the rewards) or "
                "the loss computes it wrongly"
            )
    if not isinstance(terms, dict) or not all(isinstance(v, int | float) for v in terms.values()):
        raise TypeError(f"{where} returned terms {str(terms)[:100]}, not a dict of numbers")
    if not isinstance(deviation, int | float):
        raise TypeError(f"{where} returned on-policy deviation {str(deviation)[:100]}, not a number")
    return loss, terms, float(deviation)


@contextmanager
def _checkpointing(policy: Policy, enabled: bool) -> Iterator[None]:
    """Gradient checkpointing of the policy's transformer for the duration (the loaded policy is reused by the
    stages that sample, which never take gradients)."""
    net = policy.transformer
    if not enabled:
        yield
        return
    if not getattr(net, "_supports_gradient_checkpointing", False):
        raise ConfigError(
            f"train.gradient_checkpointing=true: the {type(net).__name__} of model.family="
            f"{policy.model.name} does not support gradient checkpointing; set it to false"
        )
    net.enable_gradient_checkpointing()
    try:
        yield
    finally:
        net.disable_gradient_checkpointing()


def _train(
    ctx: StageContext,
    out: Path | None,
    policy: Policy,
    samples: Samples,
    rewards: RegeneratedRewards,
    stats: RewardStats | None,
    start: StartingPolicy | None,
    rank: int,
    world: int,
) -> StageOutput:
    """``train_policy``'s steps on the loaded ``policy``."""
    tc, loss_fn = ctx.cfg.train, LOSSES.get(ctx.cfg.train.loss)
    sharded = world > 1 and tc.parallel == "fsdp"
    adv = advantages(
        ctx, samples.prompts, rewards.totals(samples.candidate_index, ctx.cfg.reward.normalize), stats, out
    )
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)
    if start is not None:
        optimizer_from_tensors(opt, start.sections["optimizer"], start.state["optimizer_param_groups"])
    step = int(start.state["global_step"]) if start is not None else 0
    batch = load_batch(ctx, policy, samples, adv.values)
    trainable = loss_fn.trainable_steps(batch)
    n_t = max(1, round(tc.timestep_fraction * len(trainable)))
    g = torch.Generator().manual_seed(ctx.seed("update"))
    B = batch.x0.shape[0]
    rows, on_policy_dev = [], None
    norms = list(start.state.get("grad_norms", [])) if start is not None else []  # the running window
    skipped = 0
    for _ in range(tc.optimizer_steps):
        opt.zero_grad(set_to_none=True)
        chosen = torch.randperm(len(trainable), generator=g)[:n_t].tolist()
        acc: dict[str, float] = {}
        for t_index in (trainable[i] for i in chosen):
            for mb in batched(B, tc.micro_batch):
                part = _rows(mb, rank, world)
                share = part.stop - part.start
                if sharded and not share:
                    # FSDP gathers each block in every process at once: a process with no row of this micro-batch
                    # still runs the forwards and backward, on the micro-batch's first row at weight 0.
                    part = slice(mb.start, mb.start + 1)
                loss, terms, deviation = _checked_terms(
                    ctx.cfg.train.loss, loss_fn.terms(policy, batch, t_index, mb, g, ctx.cfg, part), step, t_index
                )
                if loss is None:  # no row of this micro-batch is this process's
                    continue
                if not rows:  # before any update in this iteration
                    on_policy_dev = max(on_policy_dev or 0.0, deviation)
                weight = share / B / n_t
                (loss * weight).backward()
                for key, value in [("loss", loss.item()), *terms.items()]:
                    acc[key] = acc.get(key, 0.0) + value * weight
        if world > 1:
            # FSDP reduce-scatters the gradients in backward; the terms and the deviation are summed here.
            grads = [] if sharded else params
            acc, deviation_max = _all_reduce(grads, acc, (on_policy_dev or 0.0) if not rows else None, ctx.device)
            if not rows:
                on_policy_dev = deviation_max
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)  # FSDP: the norm of the whole gradient
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        if not np.isfinite(grad_norm):
            raise FloatingPointError(
                f"iteration {ctx.iteration}: non-finite grad norm {grad_norm}; lower train.lr or check the rewards"
            )
        if is_spike(grad_norm, norms, tc.spike_factor):
            skipped += 1
            opt.zero_grad(set_to_none=True)
            rows.append({"optimizer_step": step, **acc, "grad_norm": grad_norm, "rollout_decay": 0.0, "skipped": 1})
            continue
        norms = [*norms, grad_norm][-tc.spike_window :]
        opt.step()
        step += 1
        decay = loss_fn.rollout_decay(step, tc)
        policy.blend_("rollout", "policy", decay)
        policy.blend_("ema", "policy", tc.ema_decay)
        rows.append({"optimizer_step": step, **acc, "grad_norm": grad_norm, "rollout_decay": decay, "skipped": 0})

    if out is None and not sharded:
        return StageOutput()
    # FSDP: every process gathers the adapters and the optimizer state whole, together; the first one writes them.
    adapters = {name: policy.state_dict(name) for name in ADAPTERS}
    tensors, groups = optimizer_to_tensors(opt)
    if out is None:
        return StageOutput()
    TrainedState(
        {**adapters, "optimizer": tensors, "rng": {"update": g.get_state()}},
        {"global_step": step, "optimizer_param_groups": groups, "grad_norms": norms},
    ).write(out)
    table = pd.DataFrame(rows)
    UpdateMetrics(table).write(out)
    trained = table[table["skipped"] == 0]
    metrics = {  # the means of the steps taken (none when every step was skipped)
        f"train/{c}": float(trained[c].mean())
        for c in table.columns
        if c not in ("optimizer_step", "skipped") and len(trained)
    }
    metrics |= {
        "train/adv_abs_mean": float(np.abs(adv.values).mean()),
        "train/zero_std_ratio": adv.zero_std_ratio,
        "train/on_policy_max_dev": float(on_policy_dev or 0.0),
        "train/global_step": step,
        "train/skipped_steps": skipped,
    }
    warnings = []
    if skipped:
        median = float(np.median(norms)) if norms else float("nan")
        warnings.append(
            f"skipped {skipped} of {tc.optimizer_steps} optimizer steps whose grad norm (max "
            f"{table.loc[table.skipped == 1, 'grad_norm'].max():.3g}) exceeded train.spike_factor="
            f"{tc.spike_factor} x the running median {median:.3g}; check the rewards of this iteration"
        )
    bound = loss_fn.on_policy_bound
    if bound is not None and (on_policy_dev or 0.0) > bound:
        warnings.append(
            f"train/on_policy_max_dev {on_policy_dev:.4f} exceeds {bound} for the on-policy loss {tc.loss}: the "
            f"samples did not come from the policy being trained"
            + (
                " (regenerate.enabled=false trains on the explore copy's samples)"
                if not ctx.cfg.regenerate.enabled
                else ""
            )
        )
    info: dict = {"warnings": warnings}
    if world > 1:  # the layout, as the manifest shows it: FSDP's count of parameters it holds sharded
        sharded_params = sum(hasattr(p, "device_mesh") for p in policy.transformer.parameters())
        info["layout"] = {"parallel": tc.parallel, "processes": world, "sharded_parameters": sharded_params}
    return StageOutput(metrics=metrics, info=info)


def _rows(mb: slice, rank: int, world: int) -> slice:
    """Process ``rank``'s rows of micro-batch ``mb``: block ``rank`` of ``world`` contiguous blocks."""
    if world == 1:
        return mb
    block = Shard(rank, world).positions(mb.stop - mb.start)
    return slice(mb.start + block.start, mb.start + block.stop)


def _all_reduce(
    params: list[torch.nn.Parameter], acc: dict[str, float], deviation: float | None, device: torch.device
) -> tuple[dict[str, float], float | None]:
    """Sum the gradients of ``params`` (none under FSDP, which reduced them in backward) and the weighted loss
    terms over the processes (each holds its rows' share), and take the largest on-policy deviation; returns
    (terms, deviation). Gradients travel as one flat buffer; ``device`` is the process group's (NCCL: its GPU)."""
    import torch.distributed as dist

    if params:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, grad in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, list(acc))  # a process with no rows has no keys
    keys = sorted({k for ks in gathered for k in ks})  # the same order in every process
    terms = torch.tensor([acc.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(terms)
    if deviation is not None:
        largest = torch.tensor([deviation], dtype=torch.float64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        deviation = float(largest.item())
    summed = dict(zip(keys, terms.tolist(), strict=True))
    first_seen = next((ks for ks in gathered if ks), [])  # the one-process column order (loss, then the terms)
    return {k: summed[k] for k in [*first_seen, *(k for k in keys if k not in first_seen)]}, deviation


def is_spike(grad_norm: float, history: list[float], factor: float | None, min_history: int = 4) -> bool:
    """Whether ``grad_norm`` (before clipping) exceeds ``factor`` x the median of ``history``, the norms of the
    last steps taken; never with ``factor`` None or fewer than ``min_history`` norms. Skipping the updates of a
    loss spike follows large-model practice (PaLM, Chowdhery et al. 2022, section 5.1, skipped the batches
    around each spike); here the unit is one optimizer step."""
    if factor is None or len(history) < min_history:
        return False
    return grad_norm > factor * float(np.median(history))
