"""Image grids for humans: best and worst candidates, evaluation samples."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from solrl.stages.metrics.video import frame_strip

#: Pixels per line of the label font (``_font``), for layout.
_LINE_H = 15


@lru_cache(maxsize=1)
def _font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans at 12 px (shipped with matplotlib, a dependency): PIL's default font at its small default
    size runs words together once a browser scales the PNG down ("the digitnine")."""
    try:
        import matplotlib

        return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"), 12)
    except (ImportError, OSError):
        return ImageFont.load_default(size=12)


def _width(text: str) -> int:
    return int(np.ceil(_font().getlength(text)))


#: The most characters of a label drawn: a longer one (a prompt of a paragraph, or of megabytes, which PIL refuses
#: to draw) ends in an ellipsis; the full text is in the stage's tables.
MAX_LABEL = 120


def _label(text: str) -> str:
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1].rstrip() + "…"


#: The longest side of a tile in a grid, in pixels: small images are upscaled ``scale`` x up to it, a published
#: 1024 px image is shown downscaled to it (a grid of 4 x 24 full-size tiles upscaled 4 x was a 93 MB PNG that
#: took 25 s to write, issue 36).
MAX_TILE = 256


def tile_shape(h: int, w: int, scale: int) -> tuple[int, int]:
    """The (height, width) a ``h x w`` image is drawn at: ``scale`` x when that fits in ``MAX_TILE``, else its
    aspect ratio with the longer side ``MAX_TILE``."""
    if max(h, w) * scale <= MAX_TILE:
        return h * scale, w * scale
    factor = MAX_TILE / max(h, w)
    return max(1, round(h * factor)), max(1, round(w * factor))


def _tile(image: np.ndarray, shape: tuple[int, int]) -> Image.Image:
    """``image`` at ``shape`` (height, width): nearest neighbour up (pixels stay visible), box filter down."""
    tile = Image.fromarray(image)
    down = shape[0] < image.shape[0]
    return tile.resize((shape[1], shape[0]), Image.BOX if down else Image.NEAREST)


def save_grid(
    images: np.ndarray,
    path: Path,
    *,
    row_labels: Sequence[str] = (),
    column_labels: Sequence[str] = (),
    scores: np.ndarray | None = None,
    split: int | None = None,
    scale: int = 4,
    pad: int = 2,
) -> None:
    """Save uint8 ``[rows, cols, H, W, 3]`` as one labelled PNG, each image drawn at ``tile_shape`` (upscaled
    ``scale`` x, nearest, up to ``MAX_TILE`` pixels; larger images downscaled to it); videos
    ``[rows, cols, F, H, W, 3]`` are shown as frame strips (``solrl.stages.metrics.video.frame_strip``).

    Args:
        row_labels: text left of each row (e.g. the prompt); column_labels: text above each column (e.g.
            best / worst), each cut to ``MAX_LABEL`` characters; scores: float ``[rows, cols]`` written under each
            image (e.g. its reward); split: draw a red rule before this column (e.g. between the kept best and
            worst).
    """
    if images.ndim == 6:
        images = frame_strip(images)
    row_labels, column_labels = [_label(s) for s in row_labels], [_label(s) for s in column_labels]
    rows, cols, h0, w0, _ = images.shape
    h, w = tile_shape(h0, w0, scale)
    font = _font()
    below = _LINE_H if scores is not None else 0
    hh, ww = h + pad + below, max(w, _width("0.000") + 2) + pad
    left = (max((_width(s) for s in row_labels), default=0) + 3 * pad) if row_labels else 0
    top = (_LINE_H + pad) if column_labels else 0
    canvas = Image.new("RGB", (left + cols * ww + pad, top + rows * hh + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        y = top + pad + r * hh
        if r < len(row_labels):
            draw.text((pad, y + (h - _LINE_H) // 2), row_labels[r], fill="black", font=font)
        for c in range(cols):
            canvas.paste(_tile(images[r, c], (h, w)), (left + pad + c * ww, y))
            if scores is not None:
                draw.text((left + pad + c * ww, y + h), f"{scores[r, c]:.3f}", fill="dimgray", font=font)
    for c, label in enumerate(column_labels[:cols]):
        draw.text((left + pad + c * ww, 1), label, fill="black", font=font)
    if split is not None and 0 < split < cols:
        x = left + split * ww
        draw.line([(x, top), (x, canvas.height)], fill="red", width=pad)
    canvas.save(path)


#: Border colours of kept seeds in ``save_pool_grid``.
KEPT_COLOURS = {"best": (0, 160, 0), "worst": (220, 0, 0), "random": (0, 90, 220)}


def save_pool_grid(
    images: np.ndarray,
    rewards: np.ndarray,
    candidates: np.ndarray,
    kept_as: Sequence[str | None],
    path: Path,
    *,
    title: str = "",
    columns: int = 8,
    scale: int = 4,
) -> None:
    """Save a whole candidate pool as one PNG, in the order given (``solrl show`` passes best first).

    Each tile is labelled ``#rank reward`` above and its candidate index in the pool below; kept seeds get a
    thick border, green for ``best``, red for ``worst`` (``KEPT_COLOURS``); ``title`` (e.g. the prompt) and a
    legend head the page.

    Args:
        images: uint8 ``[N, H, W, 3]`` (videos ``[N, F, H, W, 3]``: frame strips, fewer per row). rewards: float
            ``[N]``. candidates: int ``[N]``. kept_as: ``N`` labels, None for a candidate that was not kept.
            columns: tiles per row.
    """
    if images.ndim == 5:
        images = frame_strip(images)
        columns = max(1, columns // 4)
    n, h0, w0, _ = images.shape
    h, w = tile_shape(h0, w0, scale)
    border, label_h = max(2, scale), _LINE_H + 2
    tile_w = max(w + 2 * border, _width("#100: 0.000") + 4)
    tile_h = h + 2 * border + 2 * label_h
    rows = -(-n // columns)
    head = 2 * _LINE_H + 6
    width = max(columns * (tile_w + 4) + 4, _width(title) + 8)
    canvas = Image.new("RGB", (width, head + rows * (tile_h + 4) + 4), "white")
    draw = ImageDraw.Draw(canvas)
    font = _font()
    draw.text((4, 2), title, fill="black", font=font)
    x = 4
    for label, colour in KEPT_COLOURS.items():
        if label in kept_as:
            draw.rectangle([x, _LINE_H + 6, x + 8, _LINE_H + 14], fill=colour)
            draw.text((x + 12, _LINE_H + 4), f"kept {label}", fill="black", font=font)
            x += 20 + _width(f"kept {label}")
    for i in range(n):
        r, c = divmod(i, columns)
        x0, y0 = 4 + c * (tile_w + 4), head + r * (tile_h + 4)
        draw.text((x0, y0), f"#{i + 1}: {rewards[i]:.3f}", fill="black", font=font)
        box = (x0, y0 + label_h, x0 + w + 2 * border - 1, y0 + label_h + h + 2 * border - 1)
        if kept_as[i] is not None:
            draw.rectangle(box, fill=KEPT_COLOURS.get(str(kept_as[i]), (0, 0, 0)))
        canvas.paste(_tile(images[i], (h, w)), (x0 + border, y0 + label_h + border))
        draw.text((x0, y0 + label_h + h + 2 * border + 1), f"cand {int(candidates[i])}", fill="dimgray", font=font)
    canvas.save(path)
