"""Explore seconds per image of each CPU-runnable explore precision at a published width (issue 35).

The preset's transformer at its published width (``solrl.stages.models.random_pipeline``: the published config,
depth cut to ``--blocks`` blocks of each kind, random bfloat16 weights), loaded as the product loads it
(``model.dtype=bfloat16`` on CPU) under a LoRA policy, samples one explore batch of the preset's resolution with
random conditioning of the published text encoders' widths, through the product's explore network
(``rollout_network``) for each precision: bf16 (the policy itself), the packed NVFP4 emulation and the FP8
emulation (per-sample activation scales, the default). Each precision is timed over ``--repeats`` forward passes
after a warm-up, in one process, one after the other; seconds per image = seconds per forward x the preset's
explore steps / batch. The table also gives each copy's build seconds and the bytes it holds beyond the policy.

    .venv/bin/python bench/explore_precision.py                          # sd35-medium, 1 block, 512 px, batch 2
    .venv/bin/python bench/explore_precision.py --preset flux1-dev --blocks 2

Not a hardware number: the emulated backends decode each weight per call on CPU; a GPU runs ``nvfp4`` / ``fp8``
through Transformer Engine (``bench/gpu_smoke.py``, ``bench/gpu_explore.py``).
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

PRECISIONS = ("bf16", "nvfp4_emulated", "fp8_emulated")


def main() -> None:
    from solrl.config import load_config
    from solrl.stages.models import load_model
    from solrl.stages.models.policy import Policy
    from solrl.stages.models.random_pipeline import write_random_pipeline
    from solrl.stages.quant.backends import rollout_network

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="sd35-medium")
    parser.add_argument("--blocks", type=int, default=1, help="Transformer blocks kept of each kind.")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "explore-precision.md")
    args = parser.parse_args()

    published = load_config(args.preset)
    rows = []
    with tempfile.TemporaryDirectory(prefix="solrl-explore-precision-") as tmp:
        weights = write_random_pipeline(
            published.model, Path(tmp) / "weights", blocks=args.blocks, dtype=torch.bfloat16
        )
        overrides = [f"model.path={weights}", "model.device=cpu", "model.dtype=bfloat16", f"storage.root={tmp}"]
        cfg = load_config(args.preset, overrides)
        model = load_model(cfg.model, torch.device("cpu"))
        policy = Policy(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha, seed=0)
        torch.manual_seed(0)
        cond = {
            k: torch.randn_like(v) if v.is_floating_point() else v
            for k, v in model.conditioning_like(args.batch).items()
        }
        x = torch.randn(args.batch, *model.latent_shape, dtype=torch.bfloat16)
        sigma = torch.full((args.batch,), 0.7)
        steps = cfg.explore.steps
        for precision in PRECISIONS:
            start = time.perf_counter()
            with torch.no_grad(), rollout_network(policy, precision, cfg.explore.min_dim) as net:
                build = time.perf_counter() - start
                held = 0 if precision == "bf16" else policy.owned_bytes(net)
                policy.model.velocity(net, x, sigma, cond)  # warm-up
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    policy.model.velocity(net, x, sigma, cond)
                    seconds.append(time.perf_counter() - start)
            forward = statistics.median(seconds)
            rows.append((precision, forward, forward * steps / args.batch, build, held))
            policy.explore_copies.clear()
        named = policy.transformer.named_parameters()
        lora_free = sum(p.nbytes for n, p in named if "lora_" not in n)

    base = rows[0][2]
    threads = torch.get_num_threads()
    lines = [
        f"# Explore seconds per image by precision: {args.preset}, {args.blocks} block(s) of each kind",
        "",
        f"{datetime.now():%Y-%m-%d}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{threads} torch threads, torch {torch.__version__}; {cfg.model.resolution} px, batch {args.batch}, "
        f"{steps} explore steps, median of {args.repeats} forwards after a warm-up, one run.",
        f"Command: `.venv/bin/python bench/explore_precision.py --preset {args.preset} --blocks {args.blocks} "
        f"--batch {args.batch} --repeats {args.repeats}`",
        "",
        "| precision | s per forward | s per image | x bf16 | copy build s | copy MiB beyond the policy |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for precision, forward, per_image, build, held in rows:
        lines.append(
            f"| {precision} | {forward:.3f} | {per_image:.3f} | {per_image / base:.2f} | {build:.2f} | "
            f"{held / 2**20:.1f} |"
        )
    lines += ["", f"The transformer (this depth) holds {lora_free / 2**20:.1f} MiB in bf16."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
