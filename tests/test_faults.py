"""Fault injection: SIGKILL at every stage boundary and in the middle of every stage's writes, then resume.

One chain of processes: each runs the campaign through the stage functions (what the Prefect tasks call) and
kills itself at its kill point (``SOLRL_FAULT``, the commit hook of ``fault_injection``); the next resumes
where it died and dies at the next point; the last finishes. Every kill point of the campaign plan is hit in
turn, in order: for every stage of every iteration, ``write`` (in the middle of the stage's writes: after its
first file, before the rest and the commit), ``renamed`` (folder in place, manifest not written) and
``committed`` (the stage boundary). The finished run must equal an uninterrupted one, file for file.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import zarr
from conftest import CHILD_PRELOAD, tiny_config
from fault_injection import FAULT_ENV

from solrl.stages.pipeline import campaign_plan
from solrl.storage.stage import COMMIT_POINTS, read_manifest

pytestmark = pytest.mark.slow

RUN_ID = "faults"


def campaign(store: str, fault: str | None) -> None:
    """Create or resume run ``faults`` in ``store`` and run its whole plan, stage by stage (in a child)."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run, open_run

    torch.set_num_threads(1)
    if fault is None:
        os.environ.pop(FAULT_ENV, None)
    else:
        os.environ[FAULT_ENV] = fault
    cfg = tiny_config(Path(store))
    run = open_run(store, RUN_ID) if (Path(store) / RUN_ID).exists() else create_run(cfg, RUN_ID)
    for iteration, stages in campaign_plan(run.config):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            run_stage(ctx, stage)


def run_in_child(store: Path, fault: str | None) -> int | None:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(CHILD_PRELOAD)
    child = context.Process(target=campaign, args=(str(store), fault))
    child.start()
    child.join(timeout=600)
    return child.exitcode


def outputs(run_dir: Path) -> dict[str, object]:
    """Every Parquet table (as a DataFrame), every Zarr array and every checkpoint tensor of a run."""
    from safetensors.torch import load_file

    found: dict[str, object] = {}
    for path in sorted(run_dir.rglob("*.parquet")):
        found[str(path.relative_to(run_dir))] = pd.read_parquet(path)
    for path in sorted(run_dir.rglob("*.zarr")):
        for name, array in zarr.open_group(str(path), mode="r").arrays():
            found[f"{path.relative_to(run_dir)}/{name}"] = np.asarray(array[...])
    for path in sorted(run_dir.rglob("*.safetensors")):
        for name, tensor in load_file(path).items():
            found[f"{path.relative_to(run_dir)}:{name}"] = tensor
    return found


def test_sigkill_at_every_kill_point_then_resume_equals_an_uninterrupted_run(tmp_path: Path):
    assert run_in_child(tmp_path / "reference", None) == 0
    plan = campaign_plan(tiny_config(tmp_path))
    kill_points = [f"{i}:{stage}:{point}" for i, stages in plan for stage in stages for point in COMMIT_POINTS]
    chain = tmp_path / "chain"
    for point in kill_points:
        assert run_in_child(chain, point) == -9, f"{point}: the process was not killed there"
        iteration, stage, where = point.split(":")
        committed = read_manifest(chain / RUN_ID, int(iteration), stage) is not None
        assert committed == (where == "committed"), point
    assert run_in_child(chain, None) == 0

    run_dir = chain / RUN_ID
    leftovers = [p for p in run_dir.rglob(".*") if ".tmp-" in p.name or ".trash-" in p.name]
    assert leftovers == []
    for iteration, stages in plan:
        for stage in stages:
            assert read_manifest(run_dir, iteration, stage, verify=True), (iteration, stage)
    expected, got = outputs(tmp_path / "reference" / RUN_ID), outputs(run_dir)
    assert sorted(got) == sorted(expected)
    assert any(k.startswith("iter_000002/checkpoint") for k in got)
    for key, value in expected.items():
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(got[key], value, obj=key)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key)
