"""Proxy fidelity of the explore copy on tiny-digits: precision x explore steps vs the BF16 reference.

For every (precision, explore steps), the same seeds (pool of --pool per prompt) are sampled by the explore
copy and by the full-precision rollout policy at --ref-steps (the regenerate setting); both are scored with the
training reward and their rankings compared per prompt (paper, arXiv 2604.06916, Table 3: Kendall tau,
Spearman rho, top-4/8/12 match, bottom false inclusion; mean true BF16 rank of the seeds kept as best/worst).

    .venv/bin/python bench/fidelity.py                       # base tiny-digits policy, pool 96, k 24
    .venv/bin/python bench/fidelity.py --checkpoint runs/<run>/iter_000010/checkpoint
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

from solrl.config import load_config
from solrl.stages.context import StageContext
from solrl.stages.metrics.fidelity import pool_agreement
from solrl.stages.quant.backends import rollout_network
from solrl.stages.rewards import build_reward
from solrl.stages.sampling.rollout import generate
from solrl.stages.sampling.samplers import derive_seed
from solrl.storage.artifacts import Checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=96)
    parser.add_argument("--k", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=10, help="first N evaluation prompts (digits)")
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 6, 8, 10])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8_emulated", "nvfp4_emulated"])
    parser.add_argument(
        "--activation-scales",
        nargs="+",
        default=["sample"],
        choices=["sample", "call"],
        help="emulated precisions: one activation tensor scale per sample, or per forward call",
    )
    parser.add_argument("--batch", type=int, default=256, help="samples per forward call")
    parser.add_argument("--ref-steps", type=int, default=10)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a run's checkpoint folder (default: base)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()

    cfg = load_config()
    scratch = Path(tempfile.mkdtemp(prefix="solrl-bench-fidelity-"))  # the prompt-embedding cache goes here
    ctx = StageContext(cfg, scratch, "bench", 1)
    policy = ctx.load_policy(Checkpoint.read(args.checkpoint) if args.checkpoint else None)
    reward = build_reward("digit_alignment")
    prompts = cfg.eval_prompts()[: args.prompts]
    flat = [p for p in prompts for _ in range(args.pool)]
    seeds = [derive_seed(7, "fidelity-bench", i) for i in range(len(flat))]

    def sample(precision: str, steps: int, scale: str = "sample") -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        with rollout_network(policy, precision, 0, scale) as net:
            latents = generate(policy.model, net, flat, seeds, steps, args.batch, desc=f"{precision} {steps}").samples
        seconds = time.perf_counter() - start
        return reward(policy.model.decode(latents), flat).reshape(len(prompts), args.pool), seconds

    reference, ref_seconds = sample("bf16", args.ref_steps)
    header = (
        "| precision | activation scale | steps | Kendall tau | Spearman rho | top-4 / 8 / 12 match "
        "| bottom-12 false incl. "
        f"| true rank best / worst {args.k // 2} | s (pool) |"
    )
    lines = [header, "|" + " --- |" * 9]
    runs = [(p, s) for p in args.precisions for s in (args.activation_scales if p.endswith("_emulated") else ["-"])]
    for precision, scale in runs:
        for steps in args.steps:
            rewards, seconds = sample(precision, steps, scale if scale != "-" else "sample")
            a = pool_agreement(rewards, reference, args.k)
            tops = " / ".join(f"{100 * a.get(f'top{n}_match', float('nan')):.1f}" for n in (4, 8, 12))
            lines.append(
                f"| {precision} | {scale} | {steps} | {a['kendall']:.3f} | {a['spearman']:.3f} | {tops}% | "
                f"{100 * a.get('bottom12_false_inclusion', float('nan')):.1f}% | "
                f"{a['best_true_rank']:.1f} / {a['worst_true_rank']:.1f} | {seconds:.1f} |"
            )
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}"
    )
    notes = (
        f"\ntiny-digits {'base policy' if args.checkpoint is None else args.checkpoint}; {len(prompts)} prompts "
        f"x pool {args.pool}, {args.batch} samples per forward call; reference bf16 (float32 on CPU) "
        f"{args.ref_steps} steps ({ref_seconds:.1f} s); "
        f"perfect ranks {a['best_perfect']:.1f} / {a['worst_perfect']:.1f}, random {a['random_rank']:.1f}; "
        f"machine: {machine}"
    )
    table = "\n".join(lines) + "\n" + notes
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
