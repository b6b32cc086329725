"""A local vision-language judge: a Qwen2.5-VL-class model asked whether an image or a video matches its prompt.

The score is read from the judge's next-token distribution, not from sampled text: the probabilities of the
first token of each allowed answer (``answers``, e.g. ``Yes``/``No`` or ``1``..``5``), renormalised over those
answers, weight the answers' values,

    r = sum_a softmax(logits[t(a)])_a * value(a),

which is P(yes) for ``{Yes: 1, No: 0}`` (VQAScore, Lin et al. 2024) and the expected grade for a scale (Q-Align's
probability-weighted levels, Wu et al. 2024). UnifiedReward (Wang et al. 2025) and VisualQuality-R1 (Wu et al.
2025) are Qwen2.5-VL judges of this kind that answer in words; their checkpoints load here, read by their answer
tokens' probabilities rather than by parsing the text. The checkpoint (``model_path``, e.g.
``CodeGoat24/UnifiedReward-qwen-7b`` or ``Qwen/Qwen2.5-VL-7B-Instruct``) is loaded with transformers'
``AutoModelForImageTextToText`` and ``AutoProcessor``, and its own chat template builds the question. With
``rationale: true`` the judge also answers in words (greedy, ``max_new_tokens``), stored as the ``rationale`` column
of the rewards table.

A video (``[F, H, W, 3]``) is given to the judge as a video of ``video_frames`` frames spread evenly over it; an
image as an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field, field_validator

from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward, RewardOptions, Scores, local

#: The default question: ``{prompt}`` is replaced by the sample's prompt.
QUESTION = (
    'Does this {media} match the description "{prompt}" well, with good quality? Answer with one word, Yes or No.'
)


#: Qwen2.5-VL-7B-Instruct's architecture (its ``config.json``), which UnifiedReward-qwen-7b fine-tunes:
#: 8,292,166,656 parameters (``VLMJudge.parameters``; tests/test_vlm_judge.py counts them).
QWEN2_5_VL_7B: dict[str, Any] = {
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


class VLMJudgeOptions(RewardOptions):
    model_path: str = Field(
        "CodeGoat24/UnifiedReward-qwen-7b",
        description="The judge: a local folder of a Qwen2.5-VL-class checkpoint (e.g. UnifiedReward-qwen-7b) that "
        "transformers' AutoModelForImageTextToText and AutoProcessor load.",
    )
    question: str = Field(
        QUESTION,
        description="What the judge is asked about each sample; {prompt} is its prompt, {media} 'image' or 'video'.",
    )
    answers: dict[str, float] = Field(
        default_factory=lambda: {"Yes": 1.0, "No": 0.0},
        min_length=2,
        description="Allowed answers and their values: the reward is the values weighted by the judge's "
        "probabilities of the answers' first tokens, renormalised over them (e.g. {'1': 1, ..., '5': 5}).",
    )
    rationale: bool = Field(False, description="Also store the judge's answer in words (the rationale column).")
    max_new_tokens: int = Field(64, ge=1, description="Tokens of a rationale (greedy decoding).")
    video_frames: int = Field(8, ge=2, description="Frames of a video shown to the judge, spread evenly over it.")
    max_pixels: int | None = Field(
        None, ge=28 * 28, description="Pixels an image or video frame is resized to at most (null: the checkpoint's)."
    )
    batch_size: int = Field(8, ge=1, description="Samples per forward pass of the judge.")

    @field_validator("question")
    @classmethod
    def _names_the_prompt(cls, question: str) -> str:
        if "{prompt}" not in question:
            raise ValueError("the question must contain {prompt}, where each sample's prompt goes")
        return question


@register_reward("vlm_judge")
class VLMJudge(Reward):
    """A Qwen2.5-VL-class judge's answer probabilities as a reward: float32 ``[B]`` in the range of the answers'
    values (``[0, 1]`` for Yes/No), higher is better; with ``rationale``, a ``rationale`` column of strings."""

    name = "vlm_judge"
    Options = VLMJudgeOptions
    inputs = "video"  # images arrive as one-frame videos and are shown as images
    columns = ("rationale",)
    published = "https://huggingface.co/CodeGoat24/UnifiedReward-qwen-7b (or any Qwen2.5-VL checkpoint)"
    requires: ClassVar[tuple[str, ...]] = ("transformers",)
    #: Qwen2.5-VL-7B (UnifiedReward-qwen-7b): 8.29 B parameters, vision tower included.
    parameters = 8_292_166_656
    options: VLMJudgeOptions

    def __init__(self, options: VLMJudgeOptions | None = None, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        super().__init__(options, device)
        path = local(self.options.model_path)
        sizes: dict[str, Any] = {} if self.options.max_pixels is None else {"max_pixels": self.options.max_pixels}
        self.processor = AutoProcessor.from_pretrained(path, **sizes)
        self.processor.tokenizer.padding_side = "left"  # the next token is the last position of every row
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        tokenizer = self.processor.tokenizer
        first = [tokenizer.encode(answer, add_special_tokens=False)[:1] for answer in self.options.answers]
        if any(not ids for ids in first) or len({ids[0] for ids in first}) < len(first):
            raise ValueError(
                f"reward vlm_judge: the answers {list(self.options.answers)} must start with distinct tokens of "
                f"the judge's tokenizer; choose answers that do (e.g. Yes/No, 1..5)"
            )
        self.answer_ids = torch.tensor([ids[0] for ids in first])
        self.values = torch.tensor(list(self.options.answers.values()), dtype=torch.float32)

    @classmethod
    def benchmark_options(cls, root: Path) -> dict[str, Any]:
        """Qwen2.5-VL-7B (``QWEN2_5_VL_7B``) at random bf16 weights (16.6 GB on disk and in memory) with a small
        local processor (``tiny_components.qwen2_5_vl_processor``, at most 448 x 448 pixels)."""
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from solrl.stages.models.tiny_components import qwen2_5_vl_processor

        out = root / "qwen2.5-vl-7b"
        processor, ids = qwen2_5_vl_processor(max_pixels=448 * 448)
        processor.save_pretrained(out)
        text = {
            **QWEN2_5_VL_7B["text_config"],
            "eos_token_id": ids["eos_token_id"],
            "pad_token_id": ids["pad_token_id"],
        }
        config = Qwen2_5_VLConfig(
            **{**QWEN2_5_VL_7B, "text_config": text},
            **{k: v for k, v in ids.items() if k not in ("eos_token_id", "pad_token_id")},
        )
        Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).save_pretrained(out)
        return {"model_path": str(out), "dtype": "bfloat16"}

    @classmethod
    def weight_files(cls, options: RewardOptions) -> dict[str, str | None]:
        return {"model_path": getattr(options, "model_path", None)}

    def _inputs(self, videos: np.ndarray, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's batch: one user turn per sample (its image or video, then the question), the
        checkpoint's chat template, left-padded."""
        media = "image" if videos.shape[1] == 1 else "video"
        texts = [
            self.processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": media},
                            {"type": "text", "text": self.options.question.format(prompt=prompt, media=media)},
                        ],
                    }
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            for prompt in prompts
        ]
        if media == "image":
            return self.processor(text=texts, images=list(videos[:, 0]), return_tensors="pt", padding=True)
        frames = np.unique(np.linspace(0, videos.shape[1] - 1, self.options.video_frames).round().astype(int))
        clips = [clip[frames] for clip in videos]
        return self.processor(
            text=texts,
            videos=clips,
            return_tensors="pt",
            padding=True,
            do_sample_frames=False,
            cap_pixels_per_frame=True,  # qwen-vl-utils' per-frame cap, as the judges were trained
            fps=2.0,  # qwen-vl-utils' default frame rate, which sets the judge's temporal positions
        )

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> Scores:
        """One batch: uint8 videos ``[b, F, H, W, 3]`` (``F == 1``: images) -> ``Scores`` of ``[b]``."""
        batch = self._inputs(images, prompts).to(self.device)
        logits = self.model(**batch).logits[:, -1].float().cpu()  # [b, vocab], the answer's first token
        probabilities = logits[:, self.answer_ids].softmax(dim=-1)  # [b, answers]
        scores = Scores(probabilities @ self.values)
        if self.options.rationale:
            out = self.model.generate(**batch, max_new_tokens=self.options.max_new_tokens, do_sample=False)
            new = out[:, batch["input_ids"].shape[1] :]
            scores.columns["rationale"] = [
                t.strip() for t in self.processor.batch_decode(new, skip_special_tokens=True)
            ]
        return scores
