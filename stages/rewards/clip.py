"""Rewards on CLIP embeddings (transformers ``CLIPModel``): PickScore, CLIPScore and the LAION aesthetic predictor.

Each reproduces its published scoring code (cited per class); weights come from local folders named in
``reward.models.<name>`` (never downloaded here). Images go through the model's own ``CLIPProcessor``
(resize the shortest side, center crop, normalise with the CLIP mean and std), text through its tokenizer
(77 tokens, truncated).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions, local


class CLIPOptions(RewardOptions):
    path: str = Field(description="Folder of the CLIP model (transformers CLIPModel, save_pretrained format).")
    processor: str | None = Field(None, description="Folder of its CLIPProcessor; null = path.")


def _projected(output: torch.Tensor | object) -> torch.Tensor:
    """The projected embedding of ``get_image_features`` / ``get_text_features`` (a tensor in transformers 4, the
    ``pooler_output`` of a model output in transformers 5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]


class CLIPReward(Reward):
    """A reward computed from the unit-norm CLIP embeddings of images and prompts."""

    Options = CLIPOptions

    def __init__(self, options: CLIPOptions | None = None, device: torch.device | str = "cpu") -> None:
        from transformers import CLIPModel, CLIPProcessor

        super().__init__(options, device)
        assert isinstance(self.options, CLIPOptions)
        self.model = CLIPModel.from_pretrained(local(self.options.path), dtype=self.dtype).to(self.device)
        self.model.eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(local(self.options.processor or self.options.path))

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        assert isinstance(options, CLIPOptions)
        return {"path": options.path, "processor": options.processor}

    def image_embeddings(self, images: np.ndarray) -> torch.Tensor:
        """Unit-norm image embeddings float32 ``[B, D]`` of uint8 images ``[B, H, W, 3]``."""
        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"]
        features = _projected(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
        return F.normalize(features.float(), dim=-1)

    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """Unit-norm text embeddings float32 ``[B, D]`` (77 tokens at most, padded within the batch: CLIP pools
        at the end token under a causal mask, so padding does not change a prompt's embedding)."""
        tokens = self.processor(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        return F.normalize(_projected(self.model.get_text_features(**tokens)).float(), dim=-1)


def _clip_sizes(text: tuple[int, int, int], vision: tuple[int, int, int], projection: int) -> dict[str, Any]:
    """transformers ``CLIPConfig`` sizes from (width, layers, heads) of each tower (MLP 4 x width; 224 px images in
    14 px patches) and the projection width."""

    def tower(width: int, layers: int, heads: int) -> dict[str, int]:
        return dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers, num_attention_heads=heads)

    return dict(
        text=tower(*text), vision=tower(*vision) | dict(image_size=224, patch_size=14), projection_dim=projection
    )


#: The published backbones: OpenAI ViT-L/14 (CLIPScore, the aesthetic predictor) and LAION ViT-H/14 (PickScore's
#: base); tests/test_rewards.py checks their parameter counts against the rewards' ``parameters``.
PUBLISHED_CLIP = {
    "vit-l-14": _clip_sizes(text=(768, 12, 12), vision=(1024, 24, 16), projection=768),
    "vit-h-14": _clip_sizes(text=(1024, 24, 16), vision=(1280, 32, 16), projection=1024),
}


def published_clip(size: str, root: Path) -> str:
    """A ``CLIPModel`` of ``PUBLISHED_CLIP[size]`` at random weights with a ``CLIPProcessor`` (224 px, a small local
    tokenizer over CLIP's 49,408-token vocabulary size), saved to ``root / size`` once; returns that folder."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from solrl.stages.models.tiny_components import clip_model, clip_tokenizer

    out = root / size
    if not (out / "config.json").exists():
        spec = PUBLISHED_CLIP[size]
        tokenizer = clip_tokenizer()
        model = clip_model(tokenizer, spec["text"], spec["vision"], spec["projection_dim"], vocab_size=49408)
        model.save_pretrained(out)
        CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(out)
    return str(out)


@register_reward("pickscore")
class PickScore(CLIPReward):
    """PickScore (Kirstain et al. 2023, "Pick-a-Pic", section 4 and the model card's inference code):
    ``logit_scale.exp() * cos(E_text, E_image)``, about 18-24 for real images. The model is
    ``yuvalkirstain/PickScore_v1`` with the processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``
    (``reward.models.pickscore.processor``). Flow-GRPO and DiffusionNFT divide it by 26 (a weight of 1/26
    reproduces their scale; the advantages are standardised either way)."""

    name = "pickscore"
    parameters = 986_000_000  # CLIP ViT-H/14
    published = "https://huggingface.co/yuvalkirstain/PickScore_v1 (processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        return {"path": published_clip("vit-h-14", root)}

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> torch.Tensor:
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1)  # [B]
        return self.model.logit_scale.exp().float() * cosine


@register_reward("clipscore")
class CLIPScore(CLIPReward):
    """CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning",
    eq. 1): ``2.5 * max(cos(E_image, E_text), 0)`` with CLIP ViT-L/14 (``openai/clip-vit-large-patch14``). Flow-GRPO's
    clip scorer instead reports ``logit_scale.exp() * cos / 30``, a monotone rescaling for non-negative
    cosines."""

    name = "clipscore"
    parameters = 428_000_000  # CLIP ViT-L/14
    published = "https://huggingface.co/openai/clip-vit-large-patch14"

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        return {"path": published_clip("vit-l-14", root)}

    #: ``w`` of CLIPScore (Hessel et al. 2021): rescales cosines, which rarely exceed 0.4, toward [0, 1].
    WEIGHT = 2.5

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> torch.Tensor:
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1)
        return self.WEIGHT * cosine.clamp_min(0)


class AestheticOptions(CLIPOptions):
    head: str = Field(description="The predictor's MLP weights (sac+logos+ava1-l14-linearMSE.pth or .safetensors).")


class AestheticHead(nn.Module):
    """The LAION improved aesthetic predictor's MLP over unit-norm CLIP ViT-L/14 image embeddings (768 -> 1);
    its dropout layers are inert at inference (``eval``)."""

    def __init__(self, dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


@register_reward("aesthetic")
class Aesthetic(CLIPReward):
    """The LAION aesthetic predictor (christophschuhmann/improved-aesthetic-predictor, ``simple_inference.py``;
    the DDPO and Flow-GRPO aesthetic scorers): its MLP on the unit-norm CLIP ViT-L/14 image embedding, a 1-10
    rating; prompts are not used."""

    name = "aesthetic"
    parameters = 428_000_000  # CLIP ViT-L/14 and its MLP head
    Options = AestheticOptions
    published = (
        "https://github.com/christophschuhmann/improved-aesthetic-predictor (head) and "
        "https://huggingface.co/openai/clip-vit-large-patch14 (CLIP)"
    )

    def __init__(self, options: AestheticOptions | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(options, device)
        assert isinstance(self.options, AestheticOptions)
        self.head = AestheticHead(int(self.model.config.projection_dim))
        self.head.load_state_dict(load_weights(self.options.head))
        self.head.to(self.device, self.dtype).eval().requires_grad_(False)

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        from safetensors.torch import save_file

        save_file(AestheticHead(PUBLISHED_CLIP["vit-l-14"]["projection_dim"]).state_dict(), root / "head.safetensors")
        return {"path": published_clip("vit-l-14", root), "head": str(root / "head.safetensors")}

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        assert isinstance(options, AestheticOptions)
        return {**super().weight_files(options), "head": options.head}

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> torch.Tensor:
        return self.head(self.image_embeddings(images).to(self.dtype)).float().squeeze(-1)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors``, or from a PyTorch file holding only tensors (``torch.load`` with
    ``weights_only=True``: no pickled code runs)."""
    path = local(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state
