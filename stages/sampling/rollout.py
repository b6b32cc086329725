"""Sampling prompts x seeds with a given network: shared by explore, regenerate and evaluate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from solrl.processes import RepeatsOnResume
from solrl.stages.models import ModelAdapter
from solrl.stages.models.adapter import Conditioning, compute_precision
from solrl.stages.sampling.samplers import Trajectory, batched, initial_noise, sample_ode_with, sample_sde, seed_noise


class NonFiniteSamples(RepeatsOnResume, ValueError):
    """Sampling gave NaN or inf latents: the stage stops and commits nothing (a pool of them would be scored,
    ranked and trained on as if it were images)."""


@torch.no_grad()
def generate(
    model: ModelAdapter,
    net: nn.Module,
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    batch_size: int,
    desc: str = "sampling",
    *,
    noise_level: float = 0.0,
    sde_window: tuple[int, int] | None = None,
) -> Trajectory:
    """Sample one image per (prompt, seed) pair: Euler ODE, or the Flow-GRPO SDE when ``noise_level > 0``.

    Args:
        net: the velocity network (a peft transformer with an adapter active, or a quantized copy).
        prompts, seeds: equal length B; seed i fixes sample i's initial noise and its SDE step noises.
        noise_level, sde_window: see ``sample_sde``; 0 = ODE.

    Returns:
        the trajectories on the CPU (``latents[:, -1]``: the samples, float32 ``[B, C, h, w]``); for the ODE
        only the first and last latents are kept (``latents [B, 2, C, h, w]``, no log-probs).

    Raises:
        NonFiniteSamples: a sample's final latents hold NaN or inf (named by ``desc``, its seed and prompt).
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    sigmas = model.sigmas(steps)
    parts = []
    chunks = batched(len(prompts), batch_size)
    # disable=None: no bar where stderr is not a terminal (a log file, CI), as the campaign's own progress does
    for chunk in tqdm(chunks, desc=desc, unit="batch", disable=True if len(chunks) < 4 else None, leave=False):
        cond = model.encode(list(prompts[chunk]))

        def velocity(x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning = cond) -> torch.Tensor:
            with compute_precision(model.device, model.transformer.dtype):
                return model.velocity(net, x, sigma, cond)

        if noise_level > 0:
            noise = seed_noise(seeds[chunk], model.latent_shape, steps + 1, model.device)
            traj = sample_sde(velocity, noise, sigmas, noise_level, sde_window)
            part = Trajectory(traj.latents.cpu(), traj.log_probs.cpu(), traj.sde)
        else:
            noise = initial_noise(seeds[chunk], model.latent_shape, model.device)
            final = sample_ode_with(model.solver)(velocity, noise, sigmas)
            part = Trajectory(
                torch.stack([noise, final], 1).cpu(), torch.zeros(len(final), 0), torch.zeros(steps, dtype=torch.bool)
            )
        finite = torch.isfinite(part.samples.flatten(1)).all(1)
        if not finite.all():
            bad = [chunk.start + int(i) for i in torch.nonzero(~finite).flatten()]
            raise NonFiniteSamples(
                f"{desc}: {len(bad)} of {len(finite)} samples in a batch came out NaN or inf (first: seed "
                f"{seeds[bad[0]]}, prompt {prompts[bad[0]]!r}); nothing is committed. The network sampling them "
                "diverged: a low-precision backend (explore.precision) or the policy's weights"
            )
        parts.append(part)
    return Trajectory(torch.cat([p.latents for p in parts]), torch.cat([p.log_probs for p in parts]), parts[0].sde)


def trajectory_arrays(traj: Trajectory, groups: tuple[int, int], sde: bool) -> dict[str, np.ndarray]:
    """What the update needs of ``B = P * k`` rollouts, as ``[P, k, ...]`` arrays: the final latents float32
    ``[P, k, C, h, w]`` and, for SDE rollouts, the trajectory ``[P, k, S + 1, C, h, w]`` and log-probs
    ``[P, k, S]``."""
    arrays = {"latents": traj.samples.numpy().astype(np.float32).reshape(*groups, *traj.samples.shape[1:])}
    if sde:
        arrays["trajectory"] = traj.latents.numpy().astype(np.float32).reshape(*groups, *traj.latents.shape[1:])
        arrays["log_probs"] = traj.log_probs.numpy().astype(np.float32).reshape(*groups, -1)
    return arrays
