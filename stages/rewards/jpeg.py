"""JPEG compressibility (DDPO, Black et al. 2024, section 6.1): minus the JPEG size in kB at quality 95 (the
``quality`` option sets another)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image
from pydantic import Field

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions

#: DDPO's encoding quality.
JPEG_QUALITY = 95


class JpegOptions(RewardOptions):
    quality: int = Field(JPEG_QUALITY, ge=1, le=100, description="JPEG quality the images are encoded at (PIL).")


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """``-size_kB(JPEG(image, quality))``, quality 95 by default (DDPO); float32 ``[B]``, higher = more
    compressible."""

    name = "jpeg_compressibility"
    Options = JpegOptions
    parameters = 0  # no model

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        sizes = []
        for image in images:
            buf = io.BytesIO()
            Image.fromarray(image).save(buf, format="JPEG", quality=self.options.quality)
            sizes.append(buf.tell() / 1000.0)
        return -np.asarray(sizes, dtype=np.float32)
