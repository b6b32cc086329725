"""One iteration in a few lines, from its committed files: the kept seeds of every prompt with their ranks and
rewards, and a markdown summary (proxy fidelity, guards, evaluation, stage seconds, where the pool is stored).

The campaign flow publishes both as Prefect artifacts of the iteration's flow run (``solrl.flows.cockpit``), so
the Prefect UI shows rankings without ``solrl inspect``. Only small tables are read (the selection and the
regenerated rewards) and manifests without their checksums: the stages were just committed by the same process,
and the candidate pool itself, the large file, is only named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from solrl.storage.artifacts import CandidatePool, FidelityTable, RegeneratedRewards, Selection
from solrl.storage.audit import selection_table
from solrl.storage.stage import StageManifest, read_manifest, stage_dir

#: Metric prefixes of the summary's sections, in order.
SECTIONS = (
    ("Proxy fidelity (explore vs BF16 ranking of the kept seeds)", ("fidelity/",)),
    ("Full-pool audit (every candidate regenerated in BF16)", ("audit/",)),
    ("Evaluation (held-out prompts, fixed seeds)", ("eval/",)),
    ("Training", ("explore/reward_mean", "regenerate/reward_mean", "train/")),
)


def rankings(run_dir: Path, iteration: int) -> list[dict[str, object]]:
    """The kept seeds of ``iteration``, one row per (prompt, slot), best first: prompt, kept_as, seed (a decimal
    string, exact in a browser), explore rank in the pool (1 = best), explore reward, BF16 reward (None until
    score_regenerate is committed, or when nothing was regenerated) and the BF16 rank within the prompt's kept
    group (1 = best). Floats rounded to 4 decimals for display.

    Raises:
        StageNotCommitted: select is not committed.
    """
    regenerated = (
        RegeneratedRewards.load(run_dir, iteration)
        if read_manifest(run_dir, iteration, "score_regenerate") is not None
        else None
    )
    table = selection_table(Selection.load(run_dir, iteration), regenerated)
    if "bf16_reward" in table:
        table["bf16_rank"] = table.groupby("group")["bf16_reward"].rank(ascending=False, method="min")
    rows = []
    for record in table.to_dict("records"):
        rows.append(
            {
                "prompt": record["prompt"],
                "kept_as": record["kept_as"],
                # A string: seeds are int64 (up to 2^63), and the Prefect UI's JavaScript reads JSON numbers as
                # doubles, so an int above 2^53 would show rounded (8647285256395037271 as 8647285256395037000).
                "seed": str(int(record["seed"])),
                "explore_rank": int(record["rank"]),
                "explore_reward": round(float(record["explore_reward"]), 4),
                "bf16_reward": _rounded(record.get("bf16_reward")),
                "bf16_rank_in_group": None if _rounded(record.get("bf16_rank")) is None else int(record["bf16_rank"]),
            }
        )
    return rows


def _rounded(value: object) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(float(value), 4)


def _table(metrics: Mapping[str, float], prefixes: Sequence[str]) -> list[str]:
    keys = [k for k in metrics if any(k == p or (p.endswith("/") and k.startswith(p)) for p in prefixes)]
    return ["| metric | value |", "| --- | --- |", *(f"| `{k}` | {metrics[k]:.4g} |" for k in keys)] if keys else []


def summary_markdown(
    run_dir: Path,
    run_id: str,
    iteration: int,
    stages: Sequence[str],
    *,
    store_uri: str | None = None,
    report: str | None = None,
    pool_fate: str | None = None,
    stop: str | None = None,
) -> str:
    """A markdown page for ``iteration`` of ``run_id``: each section of ``SECTIONS`` that has metrics, the guard
    warnings the stages recorded, the seconds of each committed stage of ``stages``, the per-prompt proxy
    fidelity and where the candidate pool is stored (``store_uri``: the run folder's URI, default its file URI).
    ``report``: a line saying where the HTML report is, when one was written. ``pool_fate``: what retention will
    remove of the pool (``solrl.storage.retention.pool_fate``). ``stop``: the guard stop that ends the campaign at
    this iteration (``GuardTrip.message``), first under Guards."""
    manifests: dict[str, StageManifest] = {
        s: m for s in stages if (m := read_manifest(run_dir, iteration, s)) is not None
    }
    metrics = {k: v for m in manifests.values() for k, v in m.metrics.items()}
    base = store_uri or run_dir.resolve().as_uri()
    lines = [f"# {run_id}, iteration {iteration}", ""]
    missing = [s for s in stages if s not in manifests]
    lines.append(
        f"Stages committed: {len(manifests)} of {len(stages)}"
        + (f" (not committed: {', '.join(missing)})." if missing else ".")
    )
    warnings = [f"- **{s}**: {w}" for s, m in manifests.items() for w in m.info.get("warnings", [])]
    fidelity = FidelityTable.load(run_dir, iteration).frame if "score_regenerate" in manifests else None
    guarded = "diversity, grid energy" + (
        "; proxy fidelity not measured" if fidelity is not None and fidelity.empty else ", proxy fidelity"
    )
    stopped = [f"**The campaign stops here.** {stop}", ""] if stop else []
    quiet = [] if stop else [f"No guard tripped ({guarded})."]
    lines += ["", "## Guards", "", *stopped] + (warnings or quiet)
    for title, prefixes in SECTIONS:
        table = _table(metrics, prefixes)
        if table:
            lines += ["", f"## {title}", "", *table]
    if fidelity is not None:
        if fidelity.empty:
            lines += ["", f"## {SECTIONS[0][0]}", "", f"Not measured: {FidelityTable.not_measured}."]
        else:
            lines += ["", "### Per prompt", "", _markdown_frame(fidelity.drop(columns=["group"]))]
    if manifests:
        lines += ["", "## Seconds per stage", "", "| stage | seconds |", "| --- | --- |"]
        lines += [f"| {s} | {m.seconds:.2f} |" for s, m in manifests.items()]
    lines += ["", "## Stored", ""]
    if "explore" in manifests:
        pool = stage_dir(run_dir, iteration, "explore") / CandidatePool.filename
        fate = f"; {pool_fate}" if pool_fate else ""
        lines.append(f"- candidate pool: `{base}/{pool.relative_to(run_dir).as_posix()}`{fate}")
    lines.append(f"- run store: `{base}`")
    lines.append(f"- audit from a shell: `solrl inspect {run_id} --iteration {iteration}`")
    if report:
        lines.append(f"- {report}")
    return "\n".join(lines) + "\n"


def _markdown_frame(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "| " + " | ".join("---" for _ in frame.columns) + " |"
    body = [
        "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |"
        for row in frame.itertuples(index=False)
    ]
    return "\n".join([header, rule, *body])
