"""Convergence of Sol-RL and its baselines on tiny-digits, in one harness (the paper's Figure 2 in our terms).

Runs each preset (sol-rl, bf16-scaling, naive-fp4, diffusionnft with the DiffusionNFT loss; sol-rl-flow-grpo
and flow-grpo with the Flow-GRPO loss) for the same number of iterations with
several run seeds, through the same stage functions the Prefect flow runs (``solrl.stages.pipeline``; no
Prefect or MLflow here, so the timings are the stages'), and reports held-out alignment (training classifier
and the independent evaluator) and sample diversity against iteration and against cumulative training
seconds (evaluation excluded), plus the per-stage time split of an iteration.

    .venv/bin/python bench/convergence.py --iterations 20 --seeds 0 1 2 --out bench/results
    .venv/bin/python bench/convergence.py --from-csv bench/results/convergence.csv --out bench/results  # re-render

Runs that share the machine (several at once, to finish sooner) have metrics but no meaningful seconds; a short
run of every preset on an idle machine then gives the seconds (``--idle-timing``):

    .venv/bin/python bench/convergence.py --iterations 3 --seeds 0 --out bench/results/idle-timing
    .venv/bin/python bench/convergence.py --from-csv bench/results/convergence.csv \
        --idle-timing bench/results/idle-timing/convergence.csv --out bench/results

A ``--variant NAME=PRESET:KEY=VALUE;KEY=VALUE`` adds a row that runs ``PRESET`` with those overrides under its
own name (the reward-hacking defences of ``bench/results/defences.md`` were measured this way):

    .venv/bin/python bench/convergence.py --presets sol-rl --variant "kl-0.01=sol-rl:train.kl_beta=0.01" \
        --iterations 20 --seeds 0 1 2 --out bench/results/defences
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

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
from solrl.stages.pipeline import ITERATION, campaign_plan, run_stage
from solrl.storage.report import collect_metrics
from solrl.storage.runs import create_run

PRESETS = (
    "sol-rl",
    "sol-rl-unregularised",
    "bf16-scaling",
    "naive-fp4",
    "diffusionnft",
    "sol-rl-flow-grpo",
    "flow-grpo",
)
TRAIN_STAGES = ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update", "checkpoint")
EVALS = ("eval/digit_alignment", "eval/digit_evaluator", "eval/diversity", "eval/grid_energy")
#: Guards reported relative to each seed's starting policy (iteration 0): diversity as a change, grid energy as
#: a multiple (issue 12's targets: diversity within 15%, grid energy within 10%).
RELATIVE = ("eval/diversity", "eval/grid_energy")


def stage_columns(frame: pd.DataFrame) -> list[str]:
    """The ``seconds/<stage>`` columns of the training stages present in ``frame``, in run order."""
    return [f"seconds/{s}" for s in TRAIN_STAGES if f"seconds/{s}" in frame]


def parse_variant(text: str) -> tuple[str, str, tuple[str, ...]]:
    """``NAME=PRESET:KEY=VALUE;KEY=VALUE`` -> ``(NAME, PRESET, overrides)``.

    Raises:
        argparse.ArgumentTypeError: ``text`` lacks the ``NAME=PRESET:`` head.
    """
    name, sep, rest = text.partition("=")
    preset, colon, overrides = rest.partition(":")
    if not (sep and colon and name and preset):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=PRESET:KEY=VALUE;KEY=VALUE")
    return name, preset, tuple(o for o in overrides.split(";") if o)


def run_one(
    preset: str,
    seed: int,
    iterations: int,
    store: Path,
    overrides: tuple[str, ...] = (),
    label: str | None = None,
    grids: Path | None = None,
) -> pd.DataFrame:
    """One run of ``preset`` (plus ``--set`` style ``overrides``) through the stage functions; returns its
    per-iteration metrics with cumulative ``train_seconds``, its rows named ``label`` (default: the preset).
    With ``grids``, the first and last evaluation grids are copied there as ``<label>-seed<seed>-iter<N>.png``."""
    cfg = load_config(
        preset,
        [
            f"campaign.seed={seed}",
            f"campaign.iterations={iterations}",
            f"storage.root={store}",
            "fidelity.audit_every=0",
            *overrides,
        ],
    )
    label = label or preset
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in label)  # a variant name may hold '+'
    run = create_run(cfg, f"{safe}-seed{seed}")
    for iteration, stages in campaign_plan(cfg):
        ctx = StageContext(cfg, run.run_dir, run.run_id, iteration)
        for stage in stages:
            run_stage(ctx, stage)
        print(f"  {label} seed {seed} iteration {iteration}/{iterations}", flush=True)
    if grids is not None:
        grids.mkdir(parents=True, exist_ok=True)
        for iteration in (0, iterations):
            png = run.run_dir / f"iter_{iteration:06d}" / "evaluate" / "samples.png"
            shutil.copyfile(png, grids / f"{safe}-seed{seed}-iter{iteration:03d}.png")
    frame = collect_metrics(run.run_dir, tuple(s.name for s in ITERATION))
    seconds = frame[stage_columns(frame)].fillna(0).sum(axis=1)
    frame["train_seconds"] = seconds.cumsum()
    frame["preset"], frame["seed"] = label, seed
    return frame


def fmt(values: pd.Series, spec: str = ".3f", suffix: str = "") -> str:
    """mean +- std over seeds."""
    mean = f"{values.mean():{spec}}{suffix}"
    return f"{mean} +- {values.std():{spec.lstrip('+')}}{suffix}" if len(values) > 1 else mean


def relative(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with ``<metric>/rel`` columns: each RELATIVE metric divided by the same preset and seed's
    iteration-0 value (1.0 = unchanged)."""
    frame = frame.copy()
    for metric in RELATIVE:
        if metric in frame:
            start = frame[frame.iteration == 0].set_index(["preset", "seed"])[metric]
            base = pd.Series(list(zip(frame.preset, frame.seed)), index=frame.index).map(start)
            frame[f"{metric}/rel"] = frame[metric] / base
    return frame


def cells(rows: pd.DataFrame) -> str:
    """The metric cells of one table row: alignment, evaluator, diversity (change vs start), grid energy
    (multiple of start)."""
    out = [fmt(rows[m]) if m in rows else "n/a" for m in EVALS[:2]]
    diversity, grid = (f"{m}/rel" for m in RELATIVE)
    out.append(
        f"{fmt(rows[EVALS[2]])} ({fmt((rows[diversity] - 1) * 100, '+.0f', '%')})" if diversity in rows else "n/a"
    )
    out.append(f"{fmt(rows[EVALS[3]], '.5f')} ({fmt(rows[grid], '.1f', 'x')})" if grid in rows else "n/a")
    return " | ".join(out)


def stage_split(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per iteration of each training stage, one row per preset (the paper's Figure 2)."""
    split = frame[frame.iteration > 0].groupby("preset", sort=False)[stage_columns(frame)].mean()
    split.columns = [c.removeprefix("seconds/") for c in split.columns]
    return split


def plot(frame: pd.DataFrame, path: Path, seconds: bool = True) -> None:
    """Evaluation metrics against iteration (mean +- std over seeds) and, with ``seconds``, against training
    seconds, and the per-stage time split of an iteration as stacked bars; one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in EVALS if m in frame]  # CSVs of earlier runs lack the grid energy
    fig = plt.figure(figsize=(5 * len(shown), 10.5 if seconds else 4))
    grid = fig.add_gridspec(3 if seconds else 1, len(shown))
    for col, metric in enumerate(shown):
        by_iteration = fig.add_subplot(grid[0, col])
        by_seconds = fig.add_subplot(grid[1, col]) if seconds else None
        for preset, group in frame.groupby("preset", sort=False):
            stats = group.groupby("iteration")[metric].agg(["mean", "std"]).reset_index()
            (line,) = by_iteration.plot(stats["iteration"], stats["mean"], label=preset)
            by_iteration.fill_between(
                stats["iteration"],
                stats["mean"] - stats["std"].fillna(0),
                stats["mean"] + stats["std"].fillna(0),
                alpha=0.2,
                color=line.get_color(),
            )
            if by_seconds is not None:
                timed = group.groupby("iteration")[[metric, "train_seconds"]].mean()
                by_seconds.plot(timed["train_seconds"], timed[metric], label=preset)
        by_iteration.set(title=metric, xlabel="iteration")
        if by_seconds is not None:
            by_seconds.set(title=metric, xlabel="training seconds (evaluation excluded)")
        for ax in (by_iteration, by_seconds):
            if ax is not None:
                ax.grid(alpha=0.3)
        if col == 0:
            by_iteration.legend(fontsize=8)
    if not seconds:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    bars = fig.add_subplot(grid[2, :])
    split = stage_split(frame)
    left = np.zeros(len(split))
    for stage in split.columns:
        bars.barh(split.index, split[stage], left=left, label=stage)
        left += split[stage].to_numpy(np.float64)
    bars.invert_yaxis()
    bars.set(title="seconds per iteration, by stage", xlabel="seconds")
    bars.legend(ncol=len(split.columns), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def seconds_to_reach(group: pd.DataFrame, metric: str, target: float, column: str = "train_seconds") -> float:
    """Cumulative training seconds (or ``column``) at the first iteration where ``metric`` >= ``target`` (nan if
    never)."""
    hit = group[(group.iteration > 0) & (group[metric] >= target)]
    return float(hit.sort_values("iteration")[column].iloc[0]) if len(hit) else float("nan")


def idle_seconds(idle: pd.DataFrame) -> pd.DataFrame:
    """Training seconds of each preset in ``idle`` (a short run on an idle machine, at least 2 iterations):
    ``first``, iteration 1's (it loads and warms up the models), and ``steady``, the mean of the later ones."""
    train = idle[idle.iteration > 0].copy()
    train["spent"] = train[stage_columns(train)].fillna(0).sum(axis=1)
    first = train[train.iteration == 1].groupby("preset")["spent"].mean()
    steady = train[train.iteration > 1].groupby("preset")["spent"].mean()
    return pd.DataFrame({"first": first, "steady": steady})


def report(frame: pd.DataFrame, target: float, seconds: bool = True, idle: pd.DataFrame | None = None) -> str:
    """The markdown tables: final alignment / diversity per preset, time to ``target`` evaluator alignment,
    and the per-stage time split. ``seconds=False`` (runs that shared the machine, whose timings mean nothing)
    gives iterations to the target instead and no time split. With ``idle`` (a short run of the same presets on
    an idle machine), the metrics come from ``frame`` and the seconds from ``idle``: seconds per iteration, and
    seconds to the target as each run's iterations to it times its preset's idle seconds per iteration."""
    if idle is not None:
        return _report_idle_timed(relative(frame), target, idle)
    frame = relative(frame)
    iterations = int(frame.iteration.max())
    presets = list(dict.fromkeys(frame.preset))
    seeds = sorted(frame.seed.unique().tolist())
    last, first = frame[frame.iteration == iterations], frame[frame.iteration == 0]
    timing = (
        f"train s / iteration | train s to evaluator >= {target}" if seconds else f"iterations to evaluator >= {target}"
    )
    lines = [
        f"tiny-digits, {iterations} iterations, seeds {seeds}; mean +- std over seeds; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + ("" if seconds else "; timings omitted (the runs shared the machine)"),
        "",
        f"| preset | runs | alignment | evaluator | diversity (vs start) | grid energy (x start) | {timing} (runs "
        f"reaching it) |",
        "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if seconds else ""),
        f"| start (iteration 0) | {first.seed.nunique()} | " + cells(first) + (" | | |" if seconds else " | |"),
    ]
    for preset in presets:
        rows, runs = last[last.preset == preset], frame[frame.preset == preset]
        column = "train_seconds" if seconds else "iteration"
        reach = pd.Series([seconds_to_reach(g, EVALS[1], target, column) for _, g in runs.groupby("seed")])
        reached = (
            f"{reach.mean():.{0 if seconds else 1}f} ({reach.notna().sum()}/{len(reach)})"
            if reach.notna().any()
            else f"never (0/{len(reach)})"
        )
        per_iter = runs.groupby("seed")["train_seconds"].max() / iterations
        timed = f" | {per_iter.mean():.2f}" if seconds else ""
        lines.append(f"| {preset} | {len(rows)} | " + cells(rows) + f"{timed} | {reached} |")
    if not seconds:
        return "\n".join(lines)
    return "\n".join(lines + split_table(frame, "Seconds per stage per iteration (mean):"))


def split_table(frame: pd.DataFrame, title: str) -> list[str]:
    """The markdown lines of ``stage_split(frame)`` under ``title``."""
    split = stage_split(frame)
    lines = ["", title, "", "| preset | " + " | ".join(split.columns) + " |", "|" + " --- |" * (len(split.columns) + 1)]
    for preset, row in split.iterrows():
        lines.append(f"| {preset} | " + " | ".join(f"{v:.2f}" for v in row.to_numpy(np.float64)) + " |")
    return lines


def _report_idle_timed(frame: pd.DataFrame, target: float, idle: pd.DataFrame) -> str:
    timing = idle_seconds(idle)
    iterations = int(frame.iteration.max())
    first, last = frame[frame.iteration == 0], frame[frame.iteration == iterations]
    lines = [
        f"tiny-digits, {iterations} iterations, seeds {sorted(frame.seed.unique().tolist())}; mean +- std over "
        f"seeds; machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. The metrics are "
        f"from runs that shared the machine; the seconds from an idle {int(idle.iteration.max())}-iteration run "
        f"of each preset (seed(s) {sorted(idle.seed.unique().tolist())}): seconds to the target = the idle "
        f"first iteration's seconds + (a run's iterations to it - 1) x the idle later iterations' mean.",
        "",
        f"| preset | runs | alignment | evaluator | diversity (vs start) | grid energy (x start) | iterations to "
        f"evaluator >= {target} (runs reaching it) | train s / iteration (idle, after the first) | train s to "
        f"evaluator >= {target} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| start (iteration 0) | {first.seed.nunique()} | " + cells(first) + " | | | |",
    ]
    for preset in dict.fromkeys(frame.preset):
        rows, runs = last[last.preset == preset], frame[frame.preset == preset]
        reach = pd.Series([seconds_to_reach(g, EVALS[1], target, "iteration") for _, g in runs.groupby("seed")])
        known = preset in timing.index
        if reach.notna().any():
            reached = f"{reach.mean():.1f} ({reach.notna().sum()}/{len(reach)})"
            timed = "n/a"
            if known:
                first, steady = timing.loc[preset, "first"], timing.loc[preset, "steady"]
                timed = f"{(first + (reach.dropna() - 1) * steady).mean():.0f}"
        else:
            reached, timed = f"never (0/{len(reach)})", "never"
        spent = f"{timing.loc[preset, 'steady']:.2f}" if known else "n/a"
        lines.append(f"| {preset} | {len(rows)} | " + cells(rows) + f" | {reached} | {spent} | {timed} |")
    return "\n".join(lines + split_table(idle, "Seconds per stage per iteration on the idle machine (mean):"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override applied to every preset (repeatable)",
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME=PRESET:KEY=VALUE;KEY=VALUE",
        help="an extra row: PRESET with its own overrides, named NAME (repeatable)",
    )
    parser.add_argument(
        "--grids", type=Path, default=None, help="copy each run's first and last evaluation grid into this folder"
    )
    parser.add_argument(
        "--no-seconds",
        dest="seconds",
        action="store_false",
        help="no timing columns (for runs that shared the machine): iterations to the target instead",
    )
    parser.add_argument("--target", type=float, default=0.8, help="evaluator alignment for the time-to column")
    parser.add_argument(
        "--idle-timing",
        type=Path,
        default=None,
        help="the convergence.csv of a short run of the same presets on an idle machine: the table's seconds "
        "come from it (for metrics from runs that shared the machine)",
    )
    parser.add_argument(
        "--from-csv",
        type=Path,
        default=None,
        help="re-render the table and plot from a convergence.csv (e.g. of an interrupted bench)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_csv is not None:
        frame = pd.read_csv(args.from_csv)
    else:
        store = Path(tempfile.mkdtemp(prefix="solrl-convergence-"))
        frames = []
        try:
            runs = [(preset, preset, ()) for preset in args.presets] + args.variants
            for label, preset, own in runs:
                for seed in args.seeds:
                    overrides = (*args.overrides, *own)
                    frames.append(run_one(preset, seed, args.iterations, store, overrides, label, args.grids))
                    # Written after every run, so a long bench that dies keeps what it measured.
                    pd.concat(frames, ignore_index=True).to_csv(args.out / "convergence.csv", index=False)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        frame = pd.concat(frames, ignore_index=True)
    idle = pd.read_csv(args.idle_timing) if args.idle_timing is not None else None
    plot(frame, args.out / "convergence.png", args.seconds and idle is None)
    table = report(frame, args.target, args.seconds, idle)
    (args.out / "convergence.md").write_text(table + "\n")
    print(table)
    written = [args.out / "convergence.md", args.out / "convergence.png"]
    written += [] if args.from_csv is not None else [args.out / "convergence.csv"]
    print("\nwrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
