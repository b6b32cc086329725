"""Convergence of Sol-RL and its baselines on tiny-digits, in one harness (the paper's Figure 2 in our terms).

Runs each preset (sol-rl, bf16-scaling, naive-fp4, diffusionnft with the DiffusionNFT loss; sol-rl-flow-grpo
and flow-grpo with the Flow-GRPO loss) for the same number of iterations with
several run seeds, through the same stage functions the Prefect flow runs (``solrl.stages.pipeline``; no
Prefect or MLflow here, so the timings are the stages'), and reports held-out alignment (training classifier
and the independent evaluator) and sample diversity against iteration and against cumulative training
seconds (evaluation excluded), plus the per-stage time split of an iteration.

    .venv/bin/python bench/convergence.py --iterations 20 --seeds 0 1 2 --out bench/results
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from solrl.config import load_config
from solrl.stages.context import StageContext
from solrl.stages.pipeline import ITERATION, run_stage, stage_due
from solrl.storage.report import collect_metrics
from solrl.storage.runs import create_run

PRESETS = ("sol-rl", "bf16-scaling", "naive-fp4", "diffusionnft", "sol-rl-flow-grpo", "flow-grpo")
TRAIN_STAGES = ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update", "checkpoint")
EVALS = ("eval/digit_alignment", "eval/digit_evaluator", "eval/diversity")


def run_one(preset: str, seed: int, iterations: int, store: Path, overrides: tuple[str, ...] = ()) -> pd.DataFrame:
    """One run of ``preset`` (plus ``--set`` style ``overrides``) through the stage functions; returns its
    per-iteration metrics with cumulative ``train_seconds``."""
    cfg = load_config(preset, [f"campaign.seed={seed}", f"campaign.iterations={iterations}",
                               f"storage.root={store}", "fidelity.audit_every=0", *overrides])
    run = create_run(cfg, f"{preset}-seed{seed}")
    run_stage(StageContext(cfg, run.run_dir, run.run_id, 0), "evaluate")
    for iteration in range(1, iterations + 1):
        ctx = StageContext(cfg, run.run_dir, run.run_id, iteration)
        for stage in ITERATION:
            if stage_due(cfg, stage.name, iteration):
                run_stage(ctx, stage.name)
        print(f"  {preset} seed {seed} iteration {iteration}/{iterations}", flush=True)
    frame = collect_metrics(run.run_dir, tuple(s.name for s in ITERATION))
    seconds = frame[[f"seconds/{s}" for s in TRAIN_STAGES if f"seconds/{s}" in frame]].fillna(0).sum(axis=1)
    frame["train_seconds"] = seconds.cumsum()
    frame["preset"], frame["seed"] = preset, seed
    return frame


def fmt(values: pd.Series) -> str:
    """mean +- std over seeds."""
    return f"{values.mean():.3f} +- {values.std():.3f}" if len(values) > 1 else f"{values.mean():.3f}"


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(EVALS), figsize=(5 * len(EVALS), 7))
    for col, metric in enumerate(EVALS):
        for preset, group in frame.groupby("preset", sort=False):
            by_iter = group.groupby("iteration")[metric].agg(["mean", "std"]).reset_index()
            line, = axes[0, col].plot(by_iter["iteration"], by_iter["mean"], label=preset)
            axes[0, col].fill_between(by_iter["iteration"], by_iter["mean"] - by_iter["std"].fillna(0),
                                      by_iter["mean"] + by_iter["std"].fillna(0), alpha=0.2, color=line.get_color())
            by_time = group.groupby("iteration")[[metric, "train_seconds"]].mean()
            axes[1, col].plot(by_time["train_seconds"], by_time[metric], label=preset)
        axes[0, col].set(title=metric, xlabel="iteration")
        axes[1, col].set(title=metric, xlabel="training seconds (evaluation excluded)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override applied to every preset (repeatable)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="solrl-convergence-"))
    frames = []
    try:
        for preset in args.presets:
            for seed in args.seeds:
                frames.append(run_one(preset, seed, args.iterations, store, tuple(args.overrides)))
                # Written after every run, so a long bench that dies keeps what it measured.
                pd.concat(frames, ignore_index=True).to_csv(args.out / "convergence.csv", index=False)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    frame = pd.concat(frames, ignore_index=True)
    plot(frame, args.out / "convergence.png")

    last = frame[frame.iteration == args.iterations]
    first = frame[frame.iteration == 0]
    lines = [f"tiny-digits, {args.iterations} iterations, seeds {args.seeds}; mean +- std over seeds; machine: "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}", "",
             "| preset | alignment | evaluator | diversity | train s / iteration |", "| --- | --- | --- | --- | --- |"]
    lines.append(f"| start (iteration 0) | {fmt(first[EVALS[0]])} | {fmt(first[EVALS[1]])} | "
                 f"{fmt(first[EVALS[2]])} | |")
    for preset in args.presets:
        rows, all_rows = last[last.preset == preset], frame[(frame.preset == preset) & (frame.iteration > 0)]
        per_iter = all_rows.groupby("seed")["train_seconds"].max() / args.iterations
        lines.append(f"| {preset} | {fmt(rows[EVALS[0]])} | {fmt(rows[EVALS[1]])} | {fmt(rows[EVALS[2]])} | "
                     f"{per_iter.mean():.2f} |")
    split = frame[frame.iteration > 0].groupby("preset", sort=False)[
        [f"seconds/{s}" for s in TRAIN_STAGES if f"seconds/{s}" in frame]].mean()
    split.columns = [c.removeprefix("seconds/") for c in split.columns]
    lines += ["", "Seconds per stage per iteration (mean):", "",
              "| preset | " + " | ".join(split.columns) + " |", "|" + " --- |" * (len(split.columns) + 1)]
    for preset, row in split.iterrows():
        lines.append(f"| {preset} | " + " | ".join(f"{v:.2f}" for v in row.to_numpy(np.float64)) + " |")
    table = "\n".join(lines)
    (args.out / "convergence.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {args.out / 'convergence.md'}, {args.out / 'convergence.png'}, {args.out / 'convergence.csv'}")


if __name__ == "__main__":
    main()
