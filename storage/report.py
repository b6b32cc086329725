"""Per-iteration metrics of a run, read back from its committed manifests (no MLflow needed)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from solrl.storage.stage import read_manifest


def collect_metrics(run_dir: Path, stages: tuple[str, ...]) -> pd.DataFrame:
    """One row per iteration with a committed stage: every metric of ``stages``' manifests and
    ``seconds/<stage>``. Iteration 0 holds the evaluation of the starting policy."""
    rows = []
    for directory in sorted(Path(run_dir).glob("iter_*")):
        iteration = int(directory.name.removeprefix("iter_"))
        row: dict[str, float] = {}
        for stage in stages:
            manifest = read_manifest(run_dir, iteration, stage)
            if manifest is not None:
                row.update(manifest.metrics)
                row[f"seconds/{stage}"] = manifest.seconds
        if row:
            rows.append({"iteration": iteration, **row})
    return pd.DataFrame(rows)
