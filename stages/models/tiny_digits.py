"""tiny-digits: a real diffusers text-to-image transformer small enough for a 2-core CPU (DESIGN 5).

Data are scikit-learn's bundled UCI handwritten digits (1,797 8x8 images,
labels 0-9, no download), upsampled bilinearly to 16x16, one channel, in
[-1, 1], split 80/20 stratified. The policy is a ``SanaTransformer2DModel``
working directly in pixel space (the "VAE" is the identity), conditioned by a
small word-level text encoder built here. Two digit classifiers of different
architectures and seeds give the training reward (``DigitClassifier``) and an
independent evaluator (``DigitEvaluator``): the training reward alone can be
gamed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from solrl.config import ModelConfig, RunConfig
from solrl.registry import register_model
from solrl.stages.models.adapter import Conditioning, ModelAdapter

if TYPE_CHECKING:
    from diffusers import SanaTransformer2DModel

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: Words the tiny text encoder knows; anything else maps to <unk>.
VOCAB = ("<pad>", "<unk>", "a", "the", "handwritten", "digit", "number", "hand", "drawn", "written", "of", *DIGIT_WORDS)
MAX_TOKENS = 6
TEXT_DIM = 32  # caption_channels of the transformer
IMAGE_SIZE = 16

#: Constructor arguments of the tiny SanaTransformer2DModel (~256k parameters).
TRANSFORMER_CONFIG = dict(
    in_channels=1,
    out_channels=1,
    num_attention_heads=2,
    attention_head_dim=32,
    num_layers=3,
    num_cross_attention_heads=2,
    cross_attention_head_dim=32,
    cross_attention_dim=64,  # must equal heads x head dim: the caption projection maps to it
    caption_channels=TEXT_DIM,
    mlp_ratio=2.5,
    sample_size=IMAGE_SIZE,
    patch_size=2,
    interpolation_scale=1.0,  # the default (None) gives no positional embedding
)


def build_transformer() -> SanaTransformer2DModel:
    """A freshly initialised tiny-digits policy transformer (a real diffusers class)."""
    from diffusers import SanaTransformer2DModel

    return SanaTransformer2DModel(**TRANSFORMER_CONFIG)


def prompt_digit(prompt: str) -> int:
    """The digit a prompt asks for: the last digit word or numeral in it.

    Raises:
        ValueError: the prompt names no digit.
    """
    found = [
        DIGIT_WORDS.index(w) if w in DIGIT_WORDS else int(w)
        for w in re.findall(r"[a-z]+|\d", prompt.lower())
        if w in DIGIT_WORDS or w.isdigit()
    ]
    if not found:
        raise ValueError(f"prompt {prompt!r} names no digit (zero..nine or 0..9)")
    return found[-1]


def tokenize(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Word-level tokenisation.

    Returns:
        ids ``int64 [B, MAX_TOKENS]`` (0 = pad) and mask ``int64 [B, MAX_TOKENS]`` (1 = token).
    """
    ids = torch.zeros(len(prompts), MAX_TOKENS, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        words = re.findall(r"[a-z]+|\d", prompt.lower())[:MAX_TOKENS]
        for j, w in enumerate(words):
            ids[i, j] = VOCAB.index(w) if w in VOCAB else 1
    return ids, (ids != 0).long()


class TinyTextEncoder(nn.Module):
    """Learned word and position embeddings and an MLP: ids ``[B, L]`` -> ``float32 [B, L, TEXT_DIM]``."""

    def __init__(self, dim: int = TEXT_DIM) -> None:
        super().__init__()
        self.tokens = nn.Embedding(len(VOCAB), dim)
        self.positions = nn.Parameter(torch.zeros(MAX_TOKENS, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions[: ids.shape[1]]  # [B, L, D]
        return h + self.mlp(h)


class DigitClassifier(nn.Module):
    """Training reward backbone: two 3x3 conv blocks. ``[B, 1, 16, 16]`` in [-1, 1] -> logits ``[B, 10]``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # [B, 16, 8, 8]
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # [B, 32, 4, 4]
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitEvaluator(nn.Module):
    """Independent evaluator: strided 5x5 convs, GELU, average pooling (other architecture, other seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 24, 5, stride=2, padding=2),
            nn.GELU(),  # [B, 24, 8, 8]
            nn.Conv2d(24, 48, 5, stride=2, padding=2),
            nn.GELU(),  # [B, 48, 4, 4]
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(48 * 4, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_digits_16() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits at 16x16 in [-1, 1], stratified 80/20 split (random_state 0).

    Returns:
        x_train ``float32 [N, 1, 16, 16]``, y_train ``int64 [N]``, x_test, y_test.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # [N, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False) * 2 - 1
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x.numpy(), y, test_size=0.2, stratify=y, random_state=0)
    return x_tr, y_tr, x_te, y_te


def images_to_model_input(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` images -> float32 ``[B, 1, 16, 16]`` grey in [-1, 1] (the classifiers' input)."""
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"expected uint8 images [B, H, W, 3], got {x.dtype} {tuple(x.shape)}")
    x = x.float().mean(-1, keepdim=True).permute(0, 3, 1, 2) / 127.5 - 1  # [B, 1, H, W]
    if x.shape[-1] != IMAGE_SIZE or x.shape[-2] != IMAGE_SIZE:
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x


def latents_to_images(latents: torch.Tensor) -> np.ndarray:
    """Decode: pixel-space latents ``[B, 1, 16, 16]`` (float, [-1, 1]) -> uint8 ``[B, 16, 16, 3]``."""
    x = ((latents.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [B, 1, H, W]
    return x.permute(0, 2, 3, 1).expand(-1, -1, -1, 3).cpu().numpy().copy()


#: Weights shipped with solrl (few MB), rebuilt by ``solrl pretrain-tiny-digits``.
TINY_DIGITS_WEIGHTS = Path(__file__).parent / "weights" / "tiny-digits"


@register_model("tiny-digits")
@dataclass
class TinyDigits(ModelAdapter):
    """The CPU model shipped with solrl: a ``SanaTransformer2DModel`` in pixel space (the "VAE" is the
    identity) with its own word-level text encoder. ``model.path`` null = the shipped weights, else a folder
    written by ``solrl pretrain-tiny-digits --out``."""

    name: ClassVar[str] = "tiny-digits"
    weights_hint: ClassVar[str] = "shipped with solrl; rebuild with `solrl pretrain-tiny-digits --out DIR`"
    pipeline_class: ClassVar[str] = "SanaPipeline"  # its transformer is a Sana one; the text encoder is its own
    stock_pipeline: ClassVar[bool] = False  # 1 channel, no VAE, its own word-level text encoder
    # Attention and the 1x1 feed-forward convs; the 3x3 depthwise conv is left out (peft cannot merge into it).
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0", "conv_inverted", "conv_point")
    explore_skip: ClassVar[tuple[str, ...]] = ("patch_embed", "time_embed", "caption_projection", "proj_out", "norm")
    repeated_blocks: ClassVar[tuple[str, ...]] = ("SanaTransformerBlock",)

    text_encoder: nn.Module = None  # type: ignore[assignment]

    @classmethod
    def weights_dir(cls, cfg: ModelConfig) -> Path:
        return Path(cfg.path).expanduser() if cfg.path else TINY_DIGITS_WEIGHTS

    @classmethod
    def required_files(cls, cfg: ModelConfig) -> tuple[str, ...]:
        return (
            "transformer/config.json",
            "transformer/diffusion_pytorch_model.safetensors",
            "text_encoder.safetensors",
        )

    @classmethod
    def load(cls, cfg: ModelConfig, device: torch.device, *, text_encoders: bool = True) -> TinyDigits:
        root = cls.weights_dir(cfg)
        from diffusers import SanaTransformer2DModel

        dtype = torch.float32 if cfg.dtype == "auto" else getattr(torch, cfg.dtype)  # a CPU model: float32 by default
        # torch_dtype, not .to(dtype): diffusers warns on every cast by .to() of a model class declaring
        # _keep_in_fp32_modules, even an empty list.
        transformer = SanaTransformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype).to(device)
        text_encoder = None
        if text_encoders:
            text_encoder = TinyTextEncoder()
            text_encoder.load_state_dict(load_file(root / "text_encoder.safetensors"))
            text_encoder.to(device, dtype).eval().requires_grad_(False)
        adapter = cls(
            transformer=transformer,
            device=device,
            latent_shape=(1, IMAGE_SIZE, IMAGE_SIZE),
            shift=cfg.sampler_shift,
            solver=cfg.solver,
            grid_period=int(transformer.config.patch_size),  # pixel space: no VAE
            text_encoder=text_encoder,
        )
        if not text_encoders:
            adapter.release_text_encoders()
        return adapter

    @classmethod
    def meta_adapter(
        cls, cfg: ModelConfig, dtype: torch.dtype, *, blocks: int | dict[str, int] | None = None, device: str = "meta"
    ) -> tuple[TinyDigits, str, int]:
        """The adapter over the transformer built from its config on the meta device (``solrl.stages.memory``)."""
        from diffusers import SanaTransformer2DModel

        from solrl.stages.models.diffusers_family import quiet_diffusers
        from solrl.stages.models.published import safetensors_parameters_file

        dtype = torch.float32  # ``load`` keeps the shipped float32 weights on every device
        root = cls.weights_dir(cfg)
        if not (root / "transformer" / "config.json").is_file():  # else diffusers takes the folder for a hub id
            cls.check_runnable(cfg)  # raises ConfigError naming the missing file and how to rebuild the weights
        config = SanaTransformer2DModel.load_config(root / "transformer")
        if blocks is not None:
            config["num_layers"] = min(
                blocks if isinstance(blocks, int) else blocks["num_layers"], config["num_layers"]
            )
        with torch.device(device), quiet_diffusers():
            transformer = SanaTransformer2DModel.from_config(config).to(dtype)
        transformer.eval().requires_grad_(False)
        adapter = cls(
            transformer=transformer,
            device=torch.device(device),
            latent_shape=(1, IMAGE_SIZE, IMAGE_SIZE),
            shift=cfg.sampler_shift,
            solver=cfg.solver,
            grid_period=int(transformer.config.patch_size),
        )
        adapter._released = True
        size = torch.empty((), dtype=dtype).element_size()
        return adapter, str(root), size * safetensors_parameters_file(root / "text_encoder.safetensors")

    def conditioning_like(self, batch: int) -> Conditioning:
        """``_encode``'s shapes and dtypes, zero, on the adapter's device (the memory plan)."""
        return {
            "emb": torch.zeros(batch, MAX_TOKENS, TEXT_DIM, device=self.device),
            "mask": torch.ones(batch, MAX_TOKENS, dtype=torch.int64, device=self.device),
        }

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        super().validate_config(cfg)
        if cfg.model.resolution not in (None, IMAGE_SIZE):
            raise ValueError(
                f"model.resolution={cfg.model.resolution}: tiny-digits is {IMAGE_SIZE}x{IMAGE_SIZE} pixels; "
                f"set model.resolution=null"
            )

    @classmethod
    def ignored_settings(cls, cfg: RunConfig) -> list[str]:
        found = super().ignored_settings(cfg)
        if cfg.model.max_sequence_length is not None:
            found.append(
                f"model.max_sequence_length={cfg.model.max_sequence_length}: tiny-digits' text encoder reads "
                f"{MAX_TOKENS} tokens, always; remove it"
            )
        return found

    def text_encoders(self) -> dict[str, nn.Module | None]:
        return {"text_encoder": self.text_encoder}

    @classmethod
    def architecture(cls, cfg: ModelConfig) -> dict[str, Any]:
        """The transformer's diffusers config and the text encoder's dimensions."""
        return super().architecture(cfg) | {
            "text_encoder": {"vocab": len(VOCAB), "dim": TEXT_DIM, "max_tokens": MAX_TOKENS}
        }

    def _encode(self, prompts: list[str]) -> Conditioning:
        """``emb`` float32 ``[B, MAX_TOKENS, TEXT_DIM]`` and ``mask`` int64 ``[B, MAX_TOKENS]``."""
        ids, mask = tokenize(prompts)
        return {"emb": self.text_encoder(ids.to(self.device)).float(), "mask": mask.to(self.device)}

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        return latents_to_images(latents)

    def velocity(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``net``'s velocity at ``x [B, 1, 16, 16]``, ``sigma [B]`` (timestep = 1000 sigma, as in pretraining)."""
        return net(
            hidden_states=x,
            encoder_hidden_states=cond["emb"],
            timestep=sigma * 1000.0,
            encoder_attention_mask=cond["mask"],
            return_dict=False,
        )[0]
