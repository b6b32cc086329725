"""Grid artifacts: how much of an image's energy sits at the transformer's patch period.

RL against a learned reward can teach a patch-based transformer a texture at its patch period (a
checkerboard on tiny-digits; grid artifacts on real models) that the reward does not penalise. An image
whose rows and columns repeat every ``period`` pixels (the patch size times the VAE's downsampling: the pixel
size of one latent token) has its spectral energy on the lattice of frequencies ``(a, b) * N / period``; this
metric is the fraction of the non-DC power of the (grey) image on that lattice, the constant row and column
excluded. White noise puts about ``(period^2 - 1) / (H W)`` there; a pure period-``period`` pattern 1.
"""

from __future__ import annotations

import numpy as np


def grid_energy(images: np.ndarray, period: int) -> np.ndarray:
    """Fraction of each image's non-DC spectral power at the harmonics of ``period``.

    Args:
        images: uint8 ``[B, H, W, 3]`` (cropped to multiples of ``period``), or videos ``[B, F, H, W, 3]``
            (each frame measured, the video's value their mean).
        period: the grid period in pixels (>= 2).

    Returns:
        float32 ``[B]`` in [0, 1].

    Raises:
        ValueError: ``period < 2`` or an image smaller than one period.
    """
    if period < 2:
        raise ValueError(f"period must be >= 2 pixels, got {period}")
    if images.ndim == 5:
        B, F = images.shape[:2]
        return grid_energy(images.reshape(B * F, *images.shape[2:]), period).reshape(B, F).mean(1)
    B, H, W, _ = images.shape
    h, w = H // period * period, W // period * period
    if not h or not w:
        raise ValueError(f"images of {H}x{W} pixels are smaller than one period of {period}")
    grey = images[:, :h, :w].astype(np.float64).mean(-1)  # [B, h, w]
    power = np.abs(np.fft.fft2(grey - grey.mean((1, 2), keepdims=True))) ** 2  # [B, h, w], DC removed
    lattice = np.zeros((h, w), dtype=bool)
    lattice[:: h // period, :: w // period] = True  # frequencies (a h/period, b w/period)
    lattice[0, 0] = False
    total = power.sum((1, 2))
    on_grid = power[:, lattice].sum(1)
    return np.where(total > 0, on_grid / np.maximum(total, 1e-30), 0.0).astype(np.float32)
