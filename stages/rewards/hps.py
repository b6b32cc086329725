"""HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): open_clip ViT-H-14 fine-tuned on human preferences.

As the HPSv2 scorer (``hpsv2/img_score.py``; Flow-GRPO's ``hpsv2_scorer.py``): the model's validation
transform (resize the shortest side to 224 with bicubic interpolation, center crop, CLIP mean and std), its
BPE tokenizer (shipped with open-clip-torch), unit-norm image and text features, and the score is their
cosine (the diagonal of ``image_features @ text_features.T``), about 0.2-0.35. The architecture is built by
open_clip without pretrained weights, then the HPS checkpoint (``HPS_v2.1_compressed.pt``, its
``state_dict``) is loaded from ``reward.models.hpsv2.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions
from solrl.stages.rewards.clip import load_weights


class HPSOptions(RewardOptions):
    checkpoint: str = Field(description="HPS_v2.1_compressed.pt (or a .safetensors of its state_dict).")
    architecture: str = Field("ViT-H-14", description="open_clip model name of the backbone.")


@register_reward("hpsv2")
class HPSv2(Reward):
    """HPSv2.1: cosine of open_clip ViT-H-14 image and text features with the HPS checkpoint."""

    name = "hpsv2"
    parameters = 986_000_000  # open_clip ViT-H-14
    Options = HPSOptions
    published = "https://huggingface.co/xswu/HPSv2 (HPS_v2.1_compressed.pt)"
    requires = ("open_clip",)

    def __init__(self, options: HPSOptions | None = None, device: torch.device | str = "cpu") -> None:
        import open_clip

        super().__init__(options, device)
        assert isinstance(self.options, HPSOptions)
        model, _, preprocess = open_clip.create_model_and_transforms(self.options.architecture, pretrained=None)
        model.load_state_dict(load_weights(self.options.checkpoint))
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(self.options.architecture)

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        import open_clip
        from safetensors.torch import save_file

        model = open_clip.create_model(HPSOptions.model_fields["architecture"].default, pretrained=None)
        save_file(model.state_dict(), root / "hps.safetensors")
        return {"checkpoint": str(root / "hps.safetensors")}

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        assert isinstance(options, HPSOptions)
        return {"checkpoint": options.checkpoint}

    def features(self, images: np.ndarray, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm image and text features float32 ``[B, D]``."""
        from PIL import Image

        pixels = torch.stack([self.preprocess(Image.fromarray(image)) for image in images])
        image = self.model.encode_image(pixels.to(self.device, self.dtype), normalize=True)
        text = self.model.encode_text(self.tokenizer(list(prompts)).to(self.device), normalize=True)
        return image.float(), text.float()

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> torch.Tensor:
        image, text = self.features(images, prompts)
        return (image * text).sum(-1)
