"""Digit alignment: the probability a digit classifier gives the prompted digit (GenEval-like).

``digit_alignment`` uses the classifier trained as the training reward;
``digit_evaluator`` the independently trained evaluator (other architecture
and seed), so that evaluation is not the training reward alone (DESIGN 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from solrl.registry import register_reward
from solrl.stages.models import tiny_digits as td
from solrl.stages.models.tiny_digits import TINY_DIGITS_WEIGHTS
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions


@register_reward("digit_alignment")
class DigitAlignment(Reward):
    """p(prompted digit | image) from the frozen training classifier; float32 ``[B]`` in [0, 1].

    Args:
        weights_dir: folder with the classifier safetensors (default: shipped weights).

    Raises:
        ValueError (call): a prompt names no digit, or images are not uint8 ``[B, H, W, 3]``.
    """

    name = "digit_alignment"
    parameters = 38_282  # the two-conv classifier (tests/test_memory.py counts it)
    backbone: type[torch.nn.Module] = td.DigitClassifier
    weights_file = "classifier.safetensors"

    def __init__(
        self, options: RewardOptions | None = None, device: torch.device | str = "cpu", weights_dir: Path | None = None
    ) -> None:
        super().__init__(options, device)
        self.net = self.backbone()
        self.net.load_state_dict(load_file((weights_dir or TINY_DIGITS_WEIGHTS) / self.weights_file))
        self.net.to(self.device).eval().requires_grad_(False)

    @classmethod
    def check_prompts(cls, prompts: Sequence[str], field: str) -> None:
        for prompt in prompts:
            try:
                td.prompt_digit(prompt)
            except ValueError:
                raise ValueError(
                    f"{field}: prompt {prompt!r} names no digit, which reward {cls.name} needs; "
                    f"name one (zero..nine or 0..9) or use other rewards"
                ) from None

    @classmethod
    def benchmark_inputs(cls, count: int, size: int = 512) -> tuple[np.ndarray, list[str]]:
        images, _ = super().benchmark_inputs(count, size)
        return images, ["a photo of a handwritten digit seven"] * count

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        target = torch.tensor([td.prompt_digit(p) for p in prompts], device=self.device)
        probs = self.net(td.images_to_model_input(images).to(self.device)).softmax(-1)  # [B, 10]
        return probs[torch.arange(len(prompts), device=self.device), target].float().cpu().numpy()


@register_reward("digit_evaluator")
class DigitEvaluator(DigitAlignment):
    """The independently trained evaluator (other architecture and seed), for evaluation (DESIGN 5)."""

    name = "digit_evaluator"
    parameters = 31_402
    backbone = td.DigitEvaluator
    weights_file = "evaluator.safetensors"
