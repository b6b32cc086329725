"""Seeds, initial noise and the flow-matching Euler ODE sampler.

A candidate is fully determined by (prompt, seed, policy version, sampler,
steps, precision) (DESIGN 1): its initial noise comes from a per-sample
``torch.Generator`` seeded with its own seed, never from a shared generator,
so a kept seed regenerates from the same noise in the BF16 policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

#: Seeds are drawn in [0, 2^63) so they fit int64 columns in Zarr and Parquet.
_SEED_BITS = 63

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def derive_seed(run_seed: int, *path: int | str) -> int:
    """A 63-bit seed from the run seed and a path, e.g. ``(iteration, prompt_index, candidate_index)``.

    Stable across processes and Python versions (sha256, not ``hash``).
    """
    key = "/".join(str(p) for p in (run_seed, *path)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> (64 - _SEED_BITS)


def initial_noise(seeds: Sequence[int], shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise ``float32 [len(seeds), *shape]``, row i drawn from a generator seeded ``seeds[i]``.

    Drawn on the CPU, then moved, so a seed gives the same noise on every device.
    """
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        rows.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device)


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


def batched(n: int, batch_size: int) -> list[slice]:
    """Slices covering ``range(n)`` in chunks of at most ``batch_size``."""
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
