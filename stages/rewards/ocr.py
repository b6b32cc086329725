"""OCR accuracy: does the image show the text the prompt quotes? (Flow-GRPO's OCR reward.)

As Flow-GRPO's ``ocr.py``: the target is the text between the first pair of double quotes of the prompt (or
the sample's ``text`` metadata); both it and the text read from the image are lower-cased with spaces
removed; the reward is 1 when the target appears in the read text, else ``1 - min(d, n) / n`` with ``d`` the
Levenshtein distance between read and target text and ``n`` the target length. The OCR engine is RapidOCR
(PaddleOCR's PP-OCR models on ONNX Runtime) whose model files ship inside the ``rapidocr-onnxruntime`` wheel,
so it runs offline; Flow-GRPO uses PaddleOCR itself. A failing OCR call is an error, never a score of 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or None."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def _normalised(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_accuracy(read: str, target: str) -> float:
    """``1`` if the target is in the read text, else ``1 - min(levenshtein, len) / len`` (lower case, no spaces).

    Raises:
        ValueError: an empty target.
    """
    from rapidfuzz.distance import Levenshtein

    target, read = _normalised(target), _normalised(read)
    if not target:
        raise ValueError("the OCR target text is empty")
    if target in read:
        return 1.0
    return 1.0 - min(Levenshtein.distance(read, target), len(target)) / len(target)


@register_reward("ocr")
class OCR(Reward):
    """OCR accuracy of the quoted text, in [0, 1]."""

    name = "ocr"
    parameters = 0  # RapidOCR's ONNX models run on the CPU (onnxruntime): nothing on the device
    requires = ("rapidocr_onnxruntime", "rapidfuzz")

    def __init__(self, options: RewardOptions | None = None, device: Any = "cpu") -> None:
        from rapidocr_onnxruntime import RapidOCR

        super().__init__(options, device)
        self.engine = RapidOCR()

    @classmethod
    def check_prompts(cls, prompts: Sequence[str], field: str) -> None:
        for prompt in prompts:
            if not quoted_text(prompt):
                raise ValueError(f'{field}: prompt {prompt!r} quotes no text ("..."), which reward ocr needs')

    @classmethod
    def benchmark_inputs(cls, count: int, size: int = 512) -> tuple[np.ndarray, list[str]]:
        """Signs of four short texts rendered in black on white, and prompts quoting them."""
        from PIL import Image, ImageDraw, ImageFont

        texts = ["Spring Collection", "Forever Yours", "Open Late", "Fresh Bread"]
        images = []
        for i in range(count):
            image = Image.new("RGB", (size, size), "white")
            font = ImageFont.load_default(size=size // 12)
            ImageDraw.Draw(image).text((size // 20, size * 9 // 20), texts[i % 4], fill="black", font=font)
            images.append(np.asarray(image))
        return np.stack(images), [f'a sign that reads "{texts[i % 4]}"' for i in range(count)]

    def read(self, image: np.ndarray) -> str:
        """The text RapidOCR reads in a uint8 RGB image ``[H, W, 3]``, its lines joined (as Flow-GRPO joins
        PaddleOCR's)."""
        result, _ = self.engine(np.ascontiguousarray(image[..., ::-1]))  # the engine takes BGR like OpenCV
        return "".join(text for _, text, confidence in (result or []) if float(confidence) > 0)

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        scores = []
        for i, (image, prompt) in enumerate(zip(images, prompts)):
            target = (metadata[i].get("text") if metadata else None) or quoted_text(prompt)
            if not target:
                raise ValueError(f"reward ocr: prompt {prompt!r} quotes no text to read")
            scores.append(ocr_accuracy(self.read(image), target))
        return np.asarray(scores, np.float32)
