"""Seeds, initial noise and the flow-matching Euler ODE sampler.

A candidate is fully determined by (prompt, seed, policy version, sampler,
steps, precision) (DESIGN 1): its initial noise comes from a per-sample
``torch.Generator`` seeded with its own seed, never from a shared generator,
so a kept seed regenerates from the same noise in the BF16 policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from solrl.stages.sampling.sde import sde_step

#: Seeds are drawn in [0, 2^63) so they fit int64 columns in Zarr and Parquet.
_SEED_BITS = 63

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def derive_seed(run_seed: int, *path: int | str) -> int:
    """A 63-bit seed from the run seed and a path, e.g. ``(iteration, prompt_index, candidate_index)``.

    Stable across processes and Python versions (sha256, not ``hash``).
    """
    key = "/".join(str(p) for p in (run_seed, *path)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> (64 - _SEED_BITS)


def seed_noise(
    seeds: Sequence[int], shape: tuple[int, ...], draws: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard normal draws ``float32 [len(seeds), draws, *shape]``; row i comes from one generator seeded
    ``seeds[i]``: draw 0 is the initial noise, draws 1.. the SDE step noises, in step order.

    Drawn on the CPU, then moved, so a seed gives the same noise on every device and in every batch.
    """
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        rows.append(torch.randn((draws, *shape), generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device)


def initial_noise(seeds: Sequence[int], shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """The initial noise ``float32 [len(seeds), *shape]`` of each seed (draw 0 of ``seed_noise``)."""
    return seed_noise(seeds, shape, 1, device)[:, 0]


@torch.no_grad()
def sample_ode(velocity: VelocityFn, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Integrate the flow ODE ``dx/dsigma = v(x, sigma)`` from sigma = 1 (noise) to 0 with Euler steps.

    Rectified flow (Liu et al. 2022; Esser et al. 2024, eq. 1): ``x_sigma = (1 - sigma) x0 + sigma eps``,
    ``v = eps - x0``; step ``x <- x + (sigma_next - sigma) v``.

    Args:
        velocity: ``(x [B, C, h, w], sigma [B]) -> v [B, C, h, w]``.
        noise: initial ``x_1``, float32 ``[B, C, h, w]``.
        sigmas: decreasing grid ``[S + 1]`` ending at 0 (``ModelAdapter.sigmas``).

    Returns:
        the final sample ``x_0``, float32 ``[B, C, h, w]``.
    """
    x = noise
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(x.shape[0])
        v = velocity(x, sigma).float()
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """Half log-SNR ``lambda = log(alpha / sigma)`` of the rectified flow ``x = (1 - sigma) x0 + sigma eps``
    (alpha = 1 - sigma), float64; -inf at sigma = 1, +inf at sigma = 0."""
    return torch.log1p(-sigma) - torch.log(sigma)


@torch.no_grad()
def sample_dpm2(velocity: VelocityFn, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Integrate the flow ODE with DPM-Solver++(2M): second order, one model call per step.

    DPM-Solver++ (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic
    Models", Algorithm 2, multistep second order, data prediction) with the rectified-flow schedule
    ``alpha = 1 - sigma``; the data prediction of a velocity is ``x0 = x - sigma v``. With
    ``lambda = log(alpha / sigma)``, ``h = lambda_next - lambda``, ``r = h_prev / h``::

        D     = x0 + (x0 - x0_prev) / (2 r)        (first step and last step: D = x0)
        x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D

    The first step (from sigma = 1) is the Euler step; the last (to sigma = 0) returns ``x0``. The same update
    as diffusers' ``DPMSolverMultistepScheduler(solver_order=2, algorithm_type="dpmsolver++",
    prediction_type="flow_prediction", use_flow_sigmas=True, lower_order_final=True)`` on the same sigmas
    (tested); the solver Sol-RL's FLUX.1 and SD3.5 configs call ``dpm2``. Computed in float64.

    Args:
        velocity: ``(x [B, C, h, w], sigma [B]) -> v [B, C, h, w]``.
        noise: initial ``x_1``, float32 ``[B, C, h, w]``.
        sigmas: decreasing grid ``[S + 1]`` from 1 to 0.

    Returns:
        the final sample ``x_0``, float32 ``[B, C, h, w]``.
    """
    x = noise.double()
    grid = sigmas.double()
    lam = _log_snr(grid)
    previous: torch.Tensor | None = None  # x0 of the previous step
    steps = len(sigmas) - 1
    for i in range(steps):
        sigma, sigma_next = grid[i], grid[i + 1]
        v = velocity(x.float(), sigmas[i].expand(x.shape[0])).double()
        x0 = x - sigma * v
        if float(sigma_next) == 0.0:  # lambda = +inf: the update is x0 itself
            x = x0
        else:
            h = lam[i + 1] - lam[i]
            d = x0
            if previous is not None and i < steps - 1:
                r = (lam[i] - lam[i - 1]) / h
                d = x0 + (x0 - previous) / (2 * r)
            x = (sigma_next / sigma) * x - (1 - sigma_next) * torch.expm1(-h) * d
        previous = x0
    return x.float()


def sample_ode_with(solver: str) -> Callable[[VelocityFn, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ODE sampler called ``solver``: ``euler`` (``sample_ode``) or ``dpm2`` (``sample_dpm2``).

    Raises:
        ValueError: unknown solver.
    """
    samplers = {"euler": sample_ode, "dpm2": sample_dpm2}
    if solver not in samplers:
        raise ValueError(f"unknown ODE solver {solver!r}; use one of {sorted(samplers)}")
    return samplers[solver]


@dataclass(frozen=True)
class Trajectory:
    """An SDE (or mixed SDE/ODE) sampling path: what the Flow-GRPO loss needs from a rollout."""

    latents: torch.Tensor  # float32 [B, S + 1, C, h, w]: x at sigmas[0] (noise) ... sigmas[S] (the sample)
    log_probs: torch.Tensor  # float32 [B, S]: log pi(x_{t+1} | x_t) of SDE steps, 0 on ODE steps
    sde: torch.Tensor  # bool [S]: which steps were stochastic

    @property
    def samples(self) -> torch.Tensor:
        """The final samples ``x_0``, float32 ``[B, C, h, w]``."""
        return self.latents[:, -1]


def sde_mask(steps: int, window: tuple[int, int] | None) -> torch.Tensor:
    """bool ``[steps]``: True on the SDE steps, all of them without a window, ``[start, end)`` with one
    (Flow-GRPO-Fast: SDE on a window, ODE elsewhere, train the window only)."""
    mask = torch.zeros(steps, dtype=torch.bool)
    start, end = window if window is not None else (0, steps)
    mask[start:end] = True
    return mask


@torch.no_grad()
def sample_sde(
    velocity: VelocityFn,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    noise_level: float,
    window: tuple[int, int] | None = None,
) -> Trajectory:
    """Sample with the Flow-GRPO SDE step (``solrl.stages.sampling.sde``) on the window's steps, Euler ODE elsewhere.

    Args:
        velocity: ``(x [B, C, h, w], sigma [B]) -> v``.
        noise: ``seed_noise`` draws ``[B, S + 1, C, h, w]``: the initial noise, then one draw per step (drawn
            for every step, used on SDE steps, so a path depends on its seed alone).
        sigmas: ``[S + 1]`` from 1 to 0.
        noise_level: the SDE's ``a`` (> 0).

    Returns:
        the trajectory; ``latents[:, -1]`` is the sample.
    """
    steps = len(sigmas) - 1
    mask = sde_mask(steps, window)
    sigma_max = float(sigmas[1]) if steps > 1 else 0.0
    x = noise[:, 0]
    latents, log_probs = [x], []
    for i in range(steps):
        sigma, sigma_next = sigmas[i].expand(x.shape[0]), sigmas[i + 1].expand(x.shape[0])
        v = velocity(x, sigma).float()
        if mask[i] and float(sigmas[i + 1]) > 0:  # the last step to sigma = 0 is deterministic in the limit
            x, log_prob = sde_step(x, v, sigma, sigma_next, noise[:, i + 1], noise_level, sigma_max)
        else:
            x, log_prob = x + (sigmas[i + 1] - sigmas[i]) * v, torch.zeros(x.shape[0], device=x.device)
            mask[i] = False
        latents.append(x)
        log_probs.append(log_prob)
    return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), mask)


def batched(n: int, batch_size: int) -> list[slice]:
    """Slices covering ``range(n)`` in chunks of at most ``batch_size``."""
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
