"""Image grids for humans: best and worst candidates, evaluation samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def save_grid(images: np.ndarray, path: Path, scale: int = 4, pad: int = 2) -> None:
    """Save uint8 ``[rows, cols, H, W, 3]`` as one PNG, each image upscaled ``scale`` x (nearest)."""
    rows, cols, h, w, _ = images.shape
    hh, ww = h * scale + pad, w * scale + pad
    canvas = np.full((rows * hh + pad, cols * ww + pad, 3), 255, dtype=np.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = images[r, c].repeat(scale, 0).repeat(scale, 1)
            canvas[pad + r * hh: pad + r * hh + h * scale, pad + c * ww: pad + c * ww + w * scale] = tile
    Image.fromarray(canvas).save(path)
