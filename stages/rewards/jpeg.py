"""JPEG compressibility (DDPO, Black et al. 2024, section 6.1): minus the JPEG size in kB at quality 95."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from solrl.registry import register_reward
from solrl.stages.rewards.base import Reward

JPEG_QUALITY = 95


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """``-size_kB(JPEG(image, quality=95))``; float32 ``[B]``, higher = more compressible."""

    name = "jpeg_compressibility"

    def __call__(
        self,
        images: np.ndarray,
        prompts: Sequence[str],
        metadata: dict[str, Any] | None = None,
    ) -> np.ndarray:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 images [B, H, W, 3], got {images.dtype} {images.shape}")
        sizes = []
        for image in images:
            buf = io.BytesIO()
            Image.fromarray(image).save(buf, format="JPEG", quality=JPEG_QUALITY)
            sizes.append(buf.tell() / 1000.0)
        return -np.asarray(sizes, dtype=np.float32)
