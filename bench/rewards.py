"""Scoring throughput (images/s) of every registered reward at its published architecture, on this machine.

Each reward builds itself at its published size with random weights (``Reward.benchmark_options``; no hub: the
numbers are speed, not scores) and makes its own inputs (``Reward.benchmark_inputs``: 512 x 512 uint8 images and
prompts it can score, e.g. rendered signs for OCR), so a new reward is measured without an edit here. A reward
that cannot be built without downloads is listed with the reason. One warm-up batch, then ``--batches`` timed
batches of ``--batch`` images. The VLM judge (Qwen2.5-VL-7B) needs about 17 GB of memory and disk in bf16.

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

import torch

from solrl.registry import REWARDS
from solrl.stages.rewards import build_reward


def measure(name: str, root: Path, batch: int, batches: int, device: torch.device) -> str:
    """One table row: ``name``'s images/s over ``batches`` batches of ``batch`` after a warm-up, and its build s."""
    cls = REWARDS.get(name)
    try:
        options = cls.benchmark_options(root)
    except NotImplementedError as exc:
        return f"| {name} | not measured: {exc} | |"
    start = time.perf_counter()
    reward = build_reward(name, device, {**options, "batch_size": batch})
    built = time.perf_counter() - start
    images, prompts = cls.benchmark_inputs(batch)
    reward(images, prompts)  # warm-up
    start = time.perf_counter()
    for _ in range(batches):
        reward(images, prompts)
    seconds = time.perf_counter() - start
    return f"| {name} | {batch * batches / seconds:.2f} | {built:.1f} |"


def main(argv: list[str] | None = None) -> str:
    """Measure the rewards, print the table (and write it to ``$OUT/rewards.md`` when ``OUT`` is set); returns it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewards", nargs="+", default=REWARDS.names(), help="default: every registered reward")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="solrl-bench-rewards-") as tmp:
        for name in args.rewards:
            rows.append(measure(name, Path(tmp), args.batch, args.batches, device))
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}"
    table = "\n".join(
        [
            f"Reward throughput, 512 x 512 uint8 images, batch {args.batch}; {name}, {os.cpu_count()} CPUs, "
            f"torch threads {torch.get_num_threads()}; torch {torch.__version__}",
            "",
            "| reward | images/s | load s (published size, random weights) |",
            "| --- | --- | --- |",
            *rows,
        ]
    )
    print("\n" + table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "rewards.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
