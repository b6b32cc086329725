"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation"): BLIP ViT-L with a preference MLP, through the authors' ``image-reward`` package.

Scores each (prompt, image) pair with ``ImageReward.score(prompt, image)`` (their code: BLIP's 224 px transform,
35 text tokens, the MLP, then ``(r - 0.167) / 1.033``). Behind the ``imagereward`` extra because that package
cannot be installed or loaded offline on solrl's CPU machines: it pins ``timm==0.6.13`` (open-clip-torch 3.3
needs ``timm>=1.0.17``) and ``fairscale==0.4.13``, pulls ``datasets`` and ``accelerate``, downloads
``med_config.json`` unless given a path, and its BLIP builds ``BertTokenizer.from_pretrained("bert-base-uncased")``
from the Hugging Face hub (or its cache) when the model is built. Not exercised by solrl's tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions, local


class ImageRewardOptions(RewardOptions):
    checkpoint: str = Field(description="ImageReward.pt (THUDM/ImageReward).")
    med_config: str = Field(description="med_config.json (THUDM/ImageReward), so nothing is downloaded.")


@register_reward("imagereward")
class ImageRewardScore(Reward):
    """ImageReward v1.0 score of each image for its prompt (about -2 to 2)."""

    name = "imagereward"
    parameters = 450_000_000  # BLIP ViT-L and its BERT text tower
    Options = ImageRewardOptions
    published = (
        "https://huggingface.co/THUDM/ImageReward (ImageReward.pt, med_config.json); its BLIP also needs "
        "bert-base-uncased in the Hugging Face cache; pip install 'solrl[imagereward]'"
    )
    requires = ("ImageReward",)
    extra = "imagereward"

    def __init__(self, options: ImageRewardOptions | None = None, device: Any = "cpu") -> None:
        import ImageReward

        super().__init__(options, device)
        assert isinstance(self.options, ImageRewardOptions)
        self.model = ImageReward.load(
            local(self.options.checkpoint), device=str(self.device), med_config=local(self.options.med_config)
        )
        self.model.eval().requires_grad_(False)

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        raise NotImplementedError("its BLIP loads bert-base-uncased from the Hugging Face hub (module doc)")

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        assert isinstance(options, ImageRewardOptions)
        return {"checkpoint": options.checkpoint, "med_config": options.med_config}

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        from PIL import Image

        return np.asarray([float(self.model.score(p, Image.fromarray(i))) for i, p in zip(images, prompts)], np.float32)
