"""Scoring throughput (images/s) of every reward at its published architecture, on this machine.

The backbones are built at their published sizes with random weights (no hub: the numbers are speed, not
scores): PickScore (CLIP ViT-H/14, transformers), CLIPScore and the aesthetic predictor (CLIP ViT-L/14),
HPSv2.1 (open_clip ViT-H-14), OCR (RapidOCR's shipped PP-OCR models on ONNX Runtime), JPEG compressibility,
and the tiny-digits classifiers. Images are 512 x 512 uint8 (noise, or rendered text for OCR), prompts
GenEval-style, one warm-up batch, then ``--batches`` timed batches of ``--batch`` images.

    OMP_NUM_THREADS=2 .venv/bin/python bench/rewards.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/rewards.py --rewards ocr jpeg_compressibility --batch 4
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from safetensors.torch import save_file

from solrl.stages.rewards import build_reward
from solrl.stages.rewards.clip import AestheticHead

#: transformers CLIPConfig sizes of the published backbones (OpenAI ViT-L/14; LAION ViT-H/14, PickScore's base).
CLIP_SIZES = {
    "vit-l-14": dict(
        text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
        ),
        projection_dim=768,
    ),
    "vit-h-14": dict(
        text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        vision=dict(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
        ),
        projection_dim=1024,
    ),
}


def build_clip(size: str, root: Path) -> str:
    """A random CLIPModel of ``size`` with a CLIPProcessor (224 px; a small local tokenizer), saved to ``root``."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from solrl.stages.models.tiny_components import clip_model, clip_tokenizer

    spec = CLIP_SIZES[size]
    tokenizer = clip_tokenizer()
    model = clip_model(tokenizer, spec["text"], spec["vision"], spec["projection_dim"], vocab_size=49408)
    model.save_pretrained(root / size)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(root / size)
    return str(root / size)


def options(name: str, root: Path) -> dict:
    """Options building ``name`` at its published architecture (random weights under ``root``)."""
    if name == "pickscore":
        return {"path": build_clip("vit-h-14", root) if not (root / "vit-h-14").exists() else str(root / "vit-h-14")}
    if name in ("clipscore", "aesthetic"):
        path = str(root / "vit-l-14") if (root / "vit-l-14").exists() else build_clip("vit-l-14", root)
        if name == "clipscore":
            return {"path": path}
        save_file(AestheticHead(768).state_dict(), root / "head.safetensors")
        return {"path": path, "head": str(root / "head.safetensors")}
    if name == "hpsv2":
        import open_clip

        model = open_clip.create_model("ViT-H-14", pretrained=None)
        save_file(model.state_dict(), root / "hps.safetensors")
        return {"checkpoint": str(root / "hps.safetensors")}
    return {}


def images_for(name: str, count: int) -> tuple[np.ndarray, list[str]]:
    if name == "ocr":
        texts = ["Spring Collection", "Forever Yours", "Open Late", "Fresh Bread"]
        images = []
        for i in range(count):
            image = Image.new("RGB", (512, 512), "white")
            ImageDraw.Draw(image).text((24, 230), texts[i % 4], fill="black", font=ImageFont.load_default(size=44))
            images.append(np.asarray(image))
        return np.stack(images), [f'a sign that reads "{texts[i % 4]}"' for i in range(count)]
    rng = np.random.default_rng(0)
    prompts = ["a photo of a handwritten digit seven" if name.startswith("digit") else "a photo of a red apple"]
    return rng.integers(0, 256, (count, 512, 512, 3), dtype=np.uint8), prompts * count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rewards",
        nargs="+",
        default=["jpeg_compressibility", "digit_alignment", "ocr", "aesthetic", "clipscore", "pickscore", "hpsv2"],
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="solrl-bench-rewards-") as tmp:
        for name in args.rewards:
            start = time.perf_counter()
            reward = build_reward(name, device, {**options(name, Path(tmp)), "batch_size": args.batch})
            built = time.perf_counter() - start
            images, prompts = images_for(name, args.batch)
            reward(images, prompts)  # warm-up
            start = time.perf_counter()
            for _ in range(args.batches):
                reward(images, prompts)
            seconds = time.perf_counter() - start
            rows.append(f"| {name} | {args.batch * args.batches / seconds:.2f} | {built:.1f} |")
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}"
    table = "\n".join(
        [
            f"Reward throughput, 512 x 512 uint8 images, batch {args.batch}; {name}, {os.cpu_count()} CPUs, "
            f"torch threads {torch.get_num_threads()}; torch {torch.__version__}",
            "",
            "| reward | images/s | build s (random weights, published size) |",
            "| --- | --- | --- |",
            *rows,
        ]
    )
    print("\n" + table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "rewards.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
