"""Digit alignment: the probability a digit classifier gives the prompted digit (GenEval-like).

``digit_alignment`` uses the classifier trained as the training reward;
``digit_evaluator`` the independently trained evaluator (other architecture
and seed), so that evaluation is not the training reward alone (DESIGN 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from solrl.stages.models import tiny_digits as td
from solrl.stages.models.adapter import TINY_DIGITS_WEIGHTS

_BACKBONES = {
    "digit_alignment": (td.DigitClassifier, "classifier.safetensors"),
    "digit_evaluator": (td.DigitEvaluator, "evaluator.safetensors"),
}


class DigitAlignment:
    """p(prompted digit | image) from a frozen classifier; float32 ``[B]`` in [0, 1].

    Args:
        name: ``digit_alignment`` (training classifier) or ``digit_evaluator``.
        weights_dir: folder with the classifier safetensors (default: shipped weights).

    Raises:
        ValueError (call): a prompt names no digit, or images are not uint8 ``[B, H, W, 3]``.
    """

    def __init__(self, name: str = "digit_alignment", device: torch.device | str = "cpu",
                 weights_dir: Path | None = None) -> None:
        cls, filename = _BACKBONES[name]
        self.name = name
        self.device = torch.device(device)
        self.net = cls()
        self.net.load_state_dict(load_file((weights_dir or TINY_DIGITS_WEIGHTS) / filename))
        self.net.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: Sequence[str], metadata: dict[str, Any] | None = None,
                 ) -> np.ndarray:
        target = torch.tensor([td.prompt_digit(p) for p in prompts], device=self.device)
        probs = self.net(td.images_to_model_input(images).to(self.device)).softmax(-1)  # [B, 10]
        return probs[torch.arange(len(prompts), device=self.device), target].float().cpu().numpy()
