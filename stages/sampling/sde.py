"""The Flow-GRPO SDE sampling step and its Gaussian log-probability.

Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", section 4.2, eq. 9-12)
turns the deterministic flow-matching ODE into an SDE with the same marginals, so each sampling step is a
Gaussian policy whose log-probability a PPO-style ratio can use. With sigma the current noise level,
``dt = sigma_next - sigma < 0`` and velocity ``v``::

    s(sigma) = a * sqrt(sigma / (1 - sigma))                       (noise level a; DESIGN 1: a = 0.7)
    mu       = x + [v + s^2 / (2 sigma) * (x + (1 - sigma) v)] dt  (eq. 12)
    x_next   = mu + s * sqrt(-dt) * eps,   eps ~ N(0, I)

At ``sigma = 1`` the schedule's first step would divide by zero; as in the Flow-GRPO code, ``sigma`` is
replaced there by the next grid value in the denominator (``SIGMA_ONE_SUBSTITUTE``).
"""

from __future__ import annotations

import math

import torch

#: log(sqrt(2 pi)), the Gaussian normaliser per element.
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def sde_std(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float) -> torch.Tensor:
    """Per-sample standard deviation ``s(sigma) sqrt(-dt)`` of the step's Gaussian, float32 ``[B]``.

    ``sigma_max`` (the largest sigma below 1 on the grid) stands in for sigma in ``1 - sigma`` when
    ``sigma == 1`` (Flow-GRPO code).
    """
    sigma, sigma_next = sigma.float(), sigma_next.float()
    denom = 1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_max), sigma)
    s = noise_level * torch.sqrt(sigma / denom)
    return s * torch.sqrt(sigma - sigma_next)


def sde_mean(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float,
    sigma_max: float,
) -> torch.Tensor:
    """Mean ``mu`` of the SDE step (eq. 12), float32, shape of ``x`` ``[B, C, h, w]``; sigma ``[B]``."""
    shape = (-1, *([1] * (x.ndim - 1)))
    sigma_b, dt = sigma.float().reshape(shape), (sigma_next - sigma).float().reshape(shape)
    denom = 1 - torch.where(sigma_b >= 1, torch.full_like(sigma_b, sigma_max), sigma_b)
    s2 = noise_level**2 * sigma_b / denom
    x, v = x.float(), v.float()
    return x + (v + s2 / (2 * sigma_b) * (x + (1 - sigma_b) * v)) * dt


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``sample`` under ``N(mean, std^2 I)``, averaged over all but the batch dim (Flow-GRPO
    convention), computed in float32. sample, mean ``[B, ...]``; std ``[B]``; returns ``[B]``."""
    shape = (-1, *([1] * (sample.ndim - 1)))
    std_b = std.float().reshape(shape)
    z = (sample.float() - mean.float()) / std_b
    return (-0.5 * z**2 - torch.log(std_b) - _LOG_SQRT_2PI).mean(dim=tuple(range(1, sample.ndim)))


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise: torch.Tensor,
    noise_level: float,
    sigma_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SDE step: ``(x_next, log_prob)``; ``noise`` is the step's standard normal draw ``eps``.

    With ``noise_level = 0`` this is exactly the Euler ODE step ``x + (sigma_next - sigma) v``; the step is then
    deterministic, its density undefined, and ``log_prob`` is returned as zeros.
    """
    mean = sde_mean(x, v, sigma, sigma_next, noise_level, sigma_max)
    std = sde_std(sigma, sigma_next, noise_level, sigma_max)
    x_next = mean + std.reshape(-1, *([1] * (x.ndim - 1))) * noise.float()
    log_prob = gaussian_log_prob(x_next, mean, std) if noise_level > 0 else torch.zeros(x.shape[0], device=x.device)
    return x_next, log_prob
