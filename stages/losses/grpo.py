"""The Flow-GRPO policy loss (Liu et al. 2025, eq. 8; PPO clipping, Schulman et al. 2017, eq. 7), with the
GRPO-Guard option (Wang et al. 2025, arXiv 2510.22319: RatioNorm and gradient reweighting).

Per sampling step t of a stored SDE trajectory, with the log-prob ``log pi_theta(x_{t+1} | x_t)`` recomputed
now and the one stored at rollout (``old``)::

    ratio = exp(log_prob - old_log_prob)
    L_clip = mean[ max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)) ]
    L_kl   = mean[ ||mu_theta - mu_ref||^2 / (2 std^2) ]   (KL of the two step Gaussians, same std)
    L      = L_clip + kl_beta * L_kl

GRPO-Guard (``train.loss_options.grpo_guard``). A step is the Gaussian ``N(mu, std^2 I)``, ``std = s(sigma)
sqrt(-dt)``, and the rollout drew ``x_{t+1} = mu_old + std eps``. With ``Delta = mu_theta - mu_old`` the
per-element-mean log-ratio is ``mean(eps Delta) / std - mean(Delta^2) / (2 std^2)``: its mean is below 0 (the
second term) and its spread scales as ``1 / std``, which differs by orders of magnitude across timesteps, so a
single clip range clips positive-advantage samples too late at some steps and never at others (the paper's
analysis). The guard:

    b_t         = mean(Delta^2) / (2 std^2)                            (RatioNorm: the mean-shift term)
    log ratio_t = (log_prob - old_log_prob + b_t) * std                 (centred, and scaled to one spread)
                = mean(eps Delta)                                       (the same, in closed form)
    L_clip      = mean[ max(-A ratio_t, -A clamp(ratio_t, 1 - eps, 1 + eps)) / |dt| ]   (gradient reweighting)

``Delta`` is ``dt (1 + a^2 / 2) (v_theta - v_old)`` under Flow-GRPO's ``s(sigma)``, so the gradient of the
normalised log-ratio scales with ``|dt|``; the ``1 / |dt|`` weight equalises it over the noise levels (the
paper's gradient reweighting; the same form as Flow-Factory's and verl-omni's GRPO-Guard losses). ``mu_old`` is
not stored: the step noises come from each sample's seed (``seed_noise``, drawn on the CPU, so the same on
every device), so ``mu_old = x_{t+1} - std eps`` exactly up to rounding, and it is checked against the stored
``old_log_prob``. The normalised ratio moves about ``std`` times less than the raw one: a clip range tuned
without the guard is too wide with it.
"""

from __future__ import annotations

import torch
from pydantic import Field

from solrl.config import RunConfig
from solrl.registry import register_loss
from solrl.stages.losses.base import Batch, LossOptions, PolicyLoss
from solrl.stages.models.adapter import compute_precision, select_rows
from solrl.stages.models.policy import Policy
from solrl.stages.sampling.samplers import seed_noise
from solrl.stages.sampling.sde import gaussian_log_prob, sde_mean, sde_std

#: Log-ratios are clamped here before ``exp`` so one bad step cannot overflow (the clip makes them irrelevant).
MAX_LOG_RATIO = 20.0
#: Largest |log-prob of x_{t+1} under the recovered rollout mean - the stored old log-prob| (nats per element)
#: accepted before GRPO-Guard refuses the trajectory: float32 rounding of ``x_{t+1} - std eps`` stays orders of
#: magnitude below it; a trajectory not sampled from its seeds' noise is far above it.
OLD_MEAN_TOLERANCE = 1e-3


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    old_mean: torch.Tensor | None = None,
    dt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss for one step of a batch of trajectories; GRPO-Guard when ``old_mean`` is
    given (module docstring: RatioNorm, then the ``1 / |dt|`` gradient reweighting).

    Args:
        log_prob: ``[B]`` recomputed step log-prob (with grad), float32 nats, the mean over elements;
            old_log_prob: ``[B]`` stored at rollout.
        advantages: ``[B]``.
        clip_range: PPO epsilon (> 0; Flow-GRPO, DESIGN 1: 1e-4).
        mean: the policy's step means ``[B, ...]`` (with grad); ref_mean: the reference's (adapter off), for the
            KL term.
        std: ``[B]`` the step std ``s(sigma) sqrt(-dt)``; kl_beta: weight of the KL term (0 disables it).
        old_mean: ``[B, ...]`` the rollout policy's step means: turns GRPO-Guard on (needs mean, std and dt).
        dt: ``[B]`` the step's ``sigma - sigma_next`` (> 0), for GRPO-Guard's reweighting.

    Returns:
        (scalar loss, detached terms: policy_loss, kl, clip_fraction, ratio_mean, approx_kl, ratio_shift, the
        mean of ``b_t std`` added to the scaled log-ratio by RatioNorm: 0 without the guard).

    Raises:
        ValueError: ``clip_range <= 0``, ``kl_beta > 0`` without mean, ref_mean and std, or ``old_mean``
            without mean, std and a positive dt.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    log_ratio = log_prob.float() - old_log_prob.float()
    weight = torch.ones_like(log_ratio)
    shift = torch.zeros_like(log_ratio)
    if old_mean is not None:
        if mean is None or std is None or dt is None or not bool((dt > 0).all()):
            raise ValueError("GRPO-Guard needs the policy's step means, the step std and a positive dt")
        dims = tuple(range(1, mean.ndim))
        scale = std.float()
        bias = ((mean.float() - old_mean.float()) ** 2).mean(dim=dims) / (2 * scale**2)  # b_t, [B]
        log_ratio = (log_ratio + bias) * scale
        shift = (bias * scale).detach()
        weight = 1 / dt.float()
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = (weight * torch.maximum(unclipped, clipped)).mean()
    kl = torch.zeros((), device=log_prob.device)
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("kl_beta > 0 needs the step means of the policy and the reference and the step std")
        dims = tuple(range(1, mean.ndim))
        kl = ((mean.float() - ref_mean.float()) ** 2).mean(dim=dims) / (2 * std.float() ** 2)
        kl = kl.mean()
    loss = policy_loss + kl_beta * kl
    with torch.no_grad():
        terms = {
            "policy_loss": policy_loss.item(),
            "kl": kl.item(),
            "clip_fraction": ((ratio - 1).abs() > clip_range).float().mean().item(),
            "ratio_mean": ratio.mean().item(),
            "approx_kl": (0.5 * log_ratio**2).mean().item(),
            "ratio_shift": shift.mean().item(),
        }
    return loss, terms


class FlowGRPOOptions(LossOptions):
    clip_range: float = Field(1e-4, gt=0, description="PPO ratio clip epsilon (Flow-GRPO: 1e-4).")
    grpo_guard: bool = Field(
        False,
        description="GRPO-Guard (arXiv 2510.22319): the importance ratio centred and scaled per timestep "
        "(RatioNorm) and each step's loss weighted by 1/|dt| (gradient reweighting). The normalised ratio moves "
        "about std times less, so it wants a smaller clip_range.",
    )


@register_loss("flow_grpo")
class FlowGRPO(PolicyLoss):
    """Flow-GRPO: PPO-clipped log-probs of stored SDE steps; the rollout policy is the policy (d = 0)."""

    name = "flow_grpo"
    Options = FlowGRPOOptions
    off_policy_note = "; Flow-GRPO's ratio compares the policy with the quantized copy's log-probs"
    #: max |log_prob - old_log_prob| (nats) before the first step: 0 when the samples come from the policy
    #: itself, up to kernel rounding; 0.05 was measured training on NVFP4 explore samples.
    on_policy_bound = 0.01

    @classmethod
    def draws_seed_noise(cls, cfg: RunConfig) -> bool:
        """GRPO-Guard recovers the rollout means from the seeds' draws."""
        return cls.options(cfg.train).grpo_guard

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        if cfg.model.solver != "euler":
            raise ValueError(
                f"train.loss=flow_grpo samples with the Euler-based Flow-GRPO SDE, so model.solver="
                f"{cfg.model.solver} cannot apply; set model.solver=euler or train.loss=nft"
            )
        if cfg.regenerate.noise_level <= 0:
            raise ValueError(
                "train.loss=flow_grpo needs an SDE sampler but regenerate.noise_level=0 samples "
                "with the ODE only; set regenerate.noise_level=0.7 (Flow-GRPO) or use train.loss=nft"
            )
        if cfg.regenerate.steps < 2:
            raise ValueError(
                f"train.loss=flow_grpo needs regenerate.steps >= 2: with "
                f"regenerate.steps={cfg.regenerate.steps} the only step lands on sigma 0, which is "
                f"deterministic, so there is nothing to train; set regenerate.steps=10"
            )
        if not cfg.regenerate.enabled and cfg.explore.steps != cfg.regenerate.steps:
            raise ValueError(
                f"train.loss=flow_grpo with regenerate.enabled=false trains on the explore "
                f"trajectories, so explore.steps={cfg.explore.steps} must equal "
                f"regenerate.steps={cfg.regenerate.steps}"
            )

    @classmethod
    def noise_level(cls, cfg: RunConfig) -> float:
        return cfg.regenerate.noise_level

    @classmethod
    def trainable_steps(cls, batch: Batch) -> list[int]:
        if batch.trajectory is None or batch.old_log_probs is None:
            raise ValueError(
                "train.loss=flow_grpo but the rollouts stored no SDE trajectory; rerun them with "
                "regenerate.noise_level > 0"
            )
        return [i for i, sde in enumerate(batch.sde_steps) if sde]

    @classmethod
    def terms(
        cls,
        policy: Policy,
        batch: Batch,
        t_index: int,
        mb: slice,
        generator: torch.Generator,
        cfg: RunConfig,
        part: slice | None = None,
    ) -> tuple[torch.Tensor | None, dict[str, float], float]:
        """Flow-GRPO loss of stored step ``x_t -> x_{t+1}`` for micro-batch ``mb`` (rows ``part`` of it; no random
        draws); deviation ``max|log_prob - old_log_prob|``."""
        assert batch.trajectory is not None and batch.old_log_probs is not None
        tc, noise_level = cfg.train, cls.noise_level(cfg)
        mb = mb if part is None else part
        if mb.stop <= mb.start:
            return None, {}, 0.0
        x_t, x_next = batch.trajectory[mb, t_index], batch.trajectory[mb, t_index + 1]
        n = x_t.shape[0]
        sigma, sigma_next = batch.sigmas[t_index].expand(n), batch.sigmas[t_index + 1].expand(n)
        sigma_max = float(batch.sigmas[1])
        cond = select_rows(batch.cond, mb)
        with compute_precision(x_t.device, policy.transformer.dtype):
            v = policy.velocity("policy", x_t, sigma, cond)
            with torch.no_grad():
                v_ref = policy.velocity("reference", x_t, sigma, cond) if tc.kl_beta else None
        mean = sde_mean(x_t, v, sigma, sigma_next, noise_level, sigma_max)
        std = sde_std(sigma, sigma_next, noise_level, sigma_max)
        log_prob = gaussian_log_prob(x_next, mean, std)  # fp32
        ref_mean = None if v_ref is None else sde_mean(x_t, v_ref, sigma, sigma_next, noise_level, sigma_max)
        old = batch.old_log_probs[mb, t_index]
        options = cls.options(tc)
        old_mean = rollout_mean(batch, mb, t_index, std, old) if options.grpo_guard else None
        loss, terms = grpo_loss(
            log_prob,
            old,
            batch.advantages[mb],
            clip_range=options.clip_range,
            mean=mean,
            ref_mean=ref_mean,
            std=std,
            kl_beta=tc.kl_beta,
            old_mean=old_mean,
            dt=(sigma - sigma_next).float(),
        )
        return loss, terms, (log_prob.detach() - old).abs().max().item()


def rollout_mean(
    batch: Batch, rows: slice, t_index: int, std: torch.Tensor, old_log_prob: torch.Tensor
) -> torch.Tensor:
    """The rollout policy's mean ``mu_old`` of step ``t_index`` for ``rows`` of ``batch``, float32 ``[n, C, h, w]``:
    ``x_{t+1} - std eps``, with ``eps`` the step's draw of each sample's seed (``seed_noise``, drawn as
    ``sample_sde`` drew it; ``batch.noise`` when the update drew them already).

    Raises:
        ValueError: the batch has no seeds.
        RuntimeError: the recovered mean does not reproduce the stored old log-probs within
            ``OLD_MEAN_TOLERANCE`` (the trajectory was not sampled from its seeds' noise).
    """
    if batch.seeds is None or batch.trajectory is None:
        raise ValueError("train.loss_options.grpo_guard needs each sample's seed and its stored SDE trajectory")
    x_next = batch.trajectory[rows, t_index + 1]
    if batch.noise is not None:  # drawn once for the update (``load_batch``)
        eps = batch.noise[rows, t_index + 1]
    else:
        steps = batch.trajectory.shape[1]  # S + 1 draws: the initial noise, then one per step
        eps = seed_noise(batch.seeds[rows].tolist(), tuple(x_next.shape[1:]), steps, x_next.device)[:, t_index + 1]
    old_mean = x_next.float() - std.float().reshape(-1, *([1] * (x_next.ndim - 1))) * eps
    deviation = (gaussian_log_prob(x_next, old_mean, std) - old_log_prob.float()).abs().max().item()
    if not deviation <= OLD_MEAN_TOLERANCE:
        raise RuntimeError(
            f"train.loss_options.grpo_guard: the rollout mean recovered from the seeds' noise at step {t_index} gives "
            f"log-probs {deviation:.3g} nats from the stored ones (tolerance {OLD_MEAN_TOLERANCE}): these trajectories "
            f"were not sampled from their seeds' noise by solrl's SDE sampler; rerun the stage that sampled them"
        )
    return old_mean
