"""The Flow-GRPO policy loss (Liu et al. 2025, eq. 8; PPO clipping, Schulman et al. 2017, eq. 7).

Per sampling step t of a stored SDE trajectory, with the log-prob ``log pi_theta(x_{t+1} | x_t)`` recomputed
now and the one stored at rollout (``old``)::

    ratio = exp(log_prob - old_log_prob)
    L_clip = mean[ max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)) ]
    L_kl   = mean[ ||mu_theta - mu_ref||^2 / (2 std^2) ]   (KL of the two step Gaussians, same std)
    L      = L_clip + kl_beta * L_kl
"""

from __future__ import annotations

import torch

#: Log-ratios are clamped here before ``exp`` so one bad step cannot overflow (the clip makes them irrelevant).
MAX_LOG_RATIO = 20.0


def grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *, clip_range: float,
              mean: torch.Tensor | None = None, ref_mean: torch.Tensor | None = None,
              std: torch.Tensor | None = None, kl_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss for one step of a batch of trajectories.

    Args:
        log_prob: ``[B]`` recomputed step log-prob (with grad); old_log_prob: ``[B]`` stored at rollout.
        advantages: ``[B]``.
        clip_range: PPO epsilon (> 0; Flow-GRPO / DESIGN: 1e-4).
        mean, ref_mean: step means ``[B, ...]`` of the policy and the reference (adapter off), for the KL term.
        std: ``[B]`` the step std; kl_beta: weight of the KL term (0 disables it).

    Returns:
        (scalar loss, detached terms: policy_loss, kl, clip_fraction, ratio_mean, approx_kl).

    Raises:
        ValueError: ``clip_range <= 0``, or ``kl_beta > 0`` without mean, ref_mean and std.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    log_ratio = (log_prob.float() - old_log_prob.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl = torch.zeros((), device=log_prob.device)
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("kl_beta > 0 needs the step means of the policy and the reference and the step std")
        dims = tuple(range(1, mean.ndim))
        kl = ((mean.float() - ref_mean.float()) ** 2).mean(dim=dims) / (2 * std.float() ** 2)
        kl = kl.mean()
    loss = policy_loss + kl_beta * kl
    with torch.no_grad():
        terms = {"policy_loss": policy_loss.item(), "kl": kl.item(),
                 "clip_fraction": ((ratio - 1).abs() > clip_range).float().mean().item(),
                 "ratio_mean": ratio.mean().item(), "approx_kl": (0.5 * log_ratio**2).mean().item()}
    return loss, terms
