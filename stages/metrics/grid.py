"""Image grids for humans: best and worst candidates, evaluation samples."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

#: Pixels per character of PIL's built-in bitmap font (about 6 wide, 11 high).
_CHAR_W, _LINE_H = 6, 11


def save_grid(
    images: np.ndarray,
    path: Path,
    *,
    row_labels: Sequence[str] = (),
    column_labels: Sequence[str] = (),
    split: int | None = None,
    scale: int = 4,
    pad: int = 2,
) -> None:
    """Save uint8 ``[rows, cols, H, W, 3]`` as one labelled PNG, each image upscaled ``scale`` x (nearest).

    Args:
        row_labels: text left of each row (e.g. the prompt); column_labels: text above each column (e.g. the
            reward); split: draw a red rule before this column (e.g. between the kept best and worst).
    """
    rows, cols, h, w, _ = images.shape
    hh, ww = h * scale + pad, w * scale + pad
    left = (max((len(s) for s in row_labels), default=0) * _CHAR_W + 2 * pad) if row_labels else 0
    top = (_LINE_H + pad) if column_labels else 0
    canvas = Image.new("RGB", (left + cols * ww + pad, top + rows * hh + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        y = top + pad + r * hh
        if r < len(row_labels):
            draw.text((pad, y + (h * scale - _LINE_H) // 2), row_labels[r], fill="black")
        for c in range(cols):
            tile = Image.fromarray(images[r, c]).resize((w * scale, h * scale), Image.NEAREST)
            canvas.paste(tile, (left + pad + c * ww, y))
    for c, label in enumerate(column_labels[:cols]):
        draw.text((left + pad + c * ww, 1), label, fill="black")
    if split is not None and 0 < split < cols:
        x = left + split * ww
        draw.line([(x, top), (x, canvas.height)], fill="red", width=pad)
    canvas.save(path)
