"""The DiffusionNFT policy loss (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with
Forward Process", eq. 6-8 and Algorithm 1; the loss the Sol-RL code trains with; DESIGN 1).

Re-noise a clean sample ``x_t = (1 - t) x0 + t eps``. With the trained velocity ``v_theta``, the rollout
("old") velocity ``v_old`` and the reference ``v_ref``::

    v+ = beta v_theta + (1 - beta) v_old          (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta          (implicit negative policy)
    x0_hat(v) = x_t - t v
    r  = clamp(clip(A) / adv_clip_max / 2 + 0.5, 0, 1)   (optimality probability from the advantage)
    L  = adv_clip_max * mean[ r ||x0_hat(v+) - x0||^2 / w+ / beta + (1 - r) ||x0_hat(v-) - x0||^2 / w- / beta ]
         + kl_beta * mean ||v_theta - v_ref||^2

``w = mean|x0_hat - x0|`` per sample, detached and floored at ``W_FLOOR`` (adaptive x0 weighting).
"""

from __future__ import annotations

import torch
from pydantic import Field

from solrl.config import RunConfig, TrainConfig
from solrl.registry import register_loss
from solrl.stages.losses.base import Batch, LossOptions, PolicyLoss
from solrl.stages.models.adapter import compute_precision, select_rows
from solrl.stages.models.policy import Policy

#: Floor of the adaptive weight, so a near-perfect prediction does not divide by ~0 (DiffusionNFT code).
W_FLOOR = 1e-5


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor | None,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The NFT loss for one batch at one timestep per sample.

    Args:
        v_theta: trained velocity, ``[B, C, h, w]``, with grad.
        v_old: rollout velocity, same shape, no grad.
        v_ref: reference velocity (adapter disabled) or None when ``kl_beta == 0``.
        x_t: re-noised sample; x0: the clean rollout sample; both ``[B, C, h, w]``.
        t: sigma in (0, 1], ``[B]``.
        advantages: ``[B]`` (already normalised; clipped here).

    Returns:
        (scalar loss, detached terms: policy_loss, kl, r_mean, x0_mse).
    """
    dims = tuple(range(1, x0.ndim))
    tb = t.reshape(-1, *([1] * (x0.ndim - 1))).to(v_theta.dtype)  # [B, 1, 1, 1]
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    x0_pos, x0_neg = x_t - tb * v_pos, x_t - tb * v_neg  # [B, C, h, w]
    with torch.no_grad():
        w_pos = (x0_pos - x0).abs().mean(dim=dims, keepdim=True).clamp_min(W_FLOOR)
        w_neg = (x0_neg - x0).abs().mean(dim=dims, keepdim=True).clamp_min(W_FLOOR)
    pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)  # [B]
    neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)
    r = (advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2 + 0.5).clamp(0, 1).to(pos.dtype)
    policy_loss = adv_clip_max * (r * pos / beta + (1 - r) * neg / beta).mean()
    kl = ((v_theta - v_ref) ** 2).mean() if v_ref is not None else torch.zeros((), device=v_theta.device)
    loss = policy_loss + kl_beta * kl
    terms = {
        "policy_loss": policy_loss.item(),
        "kl": kl.item(),
        "r_mean": r.mean().item(),
        "x0_mse": ((x_t - tb * v_theta - x0) ** 2).mean().item(),
    }
    return loss, terms


class NFTOptions(LossOptions):
    beta: float = Field(1.0, gt=0, description="NFT guidance strength beta (DiffusionNFT).")
    decay_rate: float = Field(
        0.001, ge=0, description="Rollout-policy decay d = min(decay_rate * step, decay_max) (Algorithm 1)."
    )
    decay_max: float = Field(0.5, ge=0, lt=1, description="Upper bound of the rollout-policy decay d.")


@register_loss("nft")
class NFT(PolicyLoss):
    """DiffusionNFT on ODE rollouts (what the Sol-RL code trains): re-noise the clean sample at the sampler's
    timesteps (sigma = 0 dropped); the rollout policy moves toward the policy with
    ``d = min(decay_rate * step, decay_max)`` (DiffusionNFT Algorithm 1)."""

    name = "nft"
    Options = NFTOptions

    @classmethod
    def trainable_steps(cls, batch: Batch) -> list[int]:
        return list(range(len(batch.sigmas) - 1))

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
        """NFT loss of micro-batch ``mb`` (rows ``part`` of it) re-noised at ``sigmas[t_index]``; deviation
        ``max|v_theta - v_old|``."""
        tc = cfg.train
        part = mb if part is None else part
        eps = torch.randn(batch.x0[mb].shape, generator=generator)  # the whole micro-batch's draw, every layout
        if part.stop <= part.start:
            return None, {}, 0.0
        x0 = batch.x0[part]
        eps = eps[part.start - mb.start : part.stop - mb.start].to(x0.device)
        t = batch.sigmas[t_index].expand(x0.shape[0])
        tb = t.reshape(-1, *([1] * (x0.ndim - 1)))  # [B, 1, ...]: images and videos
        x_t = (1 - tb) * x0 + tb * eps
        cond = select_rows(batch.cond, part)
        with compute_precision(x0.device, policy.transformer.dtype):
            v_theta = policy.velocity("policy", x_t, t, cond)
            with torch.no_grad():
                v_old = policy.velocity("rollout", x_t, t, cond)
                v_ref = policy.velocity("reference", x_t, t, cond) if tc.kl_beta else None
        loss, terms = nft_loss(
            v_theta.float(),
            v_old.float(),
            None if v_ref is None else v_ref.float(),
            x_t,
            x0,
            t,
            batch.advantages[part],
            beta=cls.options(tc).beta,
            adv_clip_max=tc.adv_clip_max,
            kl_beta=tc.kl_beta,
        )
        return loss, terms, (v_theta.detach().float() - v_old.float()).abs().max().item()

    @classmethod
    def rollout_decay(cls, step: int, tc: TrainConfig) -> float:
        options = cls.options(tc)
        return min(options.decay_rate * step, options.decay_max)
