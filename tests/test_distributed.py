"""The update under torchrun (issue 11): 2 processes on gloo train the same weights as one process, and a
process killed mid-update leaves nothing committed; the resumed update gives the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import tiny_config
from fault_injection import FAULT_ENV, fault_env

from solrl.stages.context import StageContext
from solrl.stages.distributed import OUTPUT_FILE, launch_update
from solrl.stages.pipeline import run_stage
from solrl.storage.artifacts import TrainedState, UpdateMetrics
from solrl.storage.runs import create_run
from solrl.storage.stage import read_manifest, stage_dir

pytestmark = pytest.mark.slow

#: Three prompts x k 4 = 12 rows in micro-batches of 5: the two processes get unequal shares (3 + 2, 1 + 1).
LAYOUT = ("campaign.prompts_per_iteration=3", "train.micro_batch=5")


def _trained(directory: Path) -> dict[str, torch.Tensor]:
    state = TrainedState.read(directory / TrainedState.filename)
    return {f"{section}/{name}": t for section, tensors in state.sections.items() for name, t in tensors.items()}


def assert_same_update(got: Path, expected: Path, lr: float = 5e-4, steps: int = 2) -> None:
    """The per-step loss terms and grad norms within 1e-5 relative; the trained tensors as
    ``assert_close_trained``."""
    assert_close_trained(_trained(got), _trained(expected), lr, steps)
    pd.testing.assert_frame_equal(
        UpdateMetrics.read(got / UpdateMetrics.filename).frame,
        UpdateMetrics.read(expected / UpdateMetrics.filename).frame,
        check_exact=False,
        rtol=1e-5,
        atol=1e-5,  # "loss terms within 1e-5": absolute, for terms near zero (a flow_grpo ratio term of -3e-9)
    )


def assert_close_trained(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float, steps: int) -> None:
    """Trained tensors (adapters, optimizer state) of a multi-process update against one process's: within 1e-6,
    except that AdamW normalises every element's step to about ``lr``, so an element whose gradient is nearly zero
    (a cancelling sum) turns a float-rounding difference of the summation order into a visible one. Measured on
    the torchrun test: 46 of 195,900 elements over 1e-6, the largest 2.6e-5 (5% of lr). Allowed: under 0.1% of
    the elements, each within 0.1 x lr x ``steps`` (the optimizer steps behind the tensors)."""
    assert sorted(a) == sorted(b)
    total = loose = 0
    for key in b:
        if not b[key].dtype.is_floating_point:
            assert torch.equal(a[key], b[key]), key
            continue
        difference = (a[key] - b[key]).abs()
        assert difference.max() <= 0.1 * lr * steps, key
        total, loose = total + difference.numel(), loose + int((difference > 1e-6).sum())
    assert loose < 1e-3 * total, f"{loose} of {total} weights differ by more than 1e-6"


def killed_rank_then_resumed(ctx: StageContext, monkeypatch, failure: str):
    """Process 2 of 2 of ``ctx``'s update killed after it joined: the stage fails with ``failure``, commits
    nothing and leaves no temporary folder; then the update run again. Returns ``run_stage``'s answer."""
    for name, value in fault_env(f"{ctx.iteration}:update:rank1").items():  # for torchrun's or Ray's workers
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=failure):
        run_stage(ctx, "update")
    assert read_manifest(ctx.run_dir, ctx.iteration, "update") is None
    assert not [p for p in stage_dir(ctx.run_dir, ctx.iteration, "update").parent.iterdir() if ".tmp-" in p.name]
    monkeypatch.delenv(FAULT_ENV)
    return run_stage(ctx, "update")


def test_two_processes_on_gloo_train_what_one_process_trains_ddp_or_fsdp_and_a_killed_process_commits_nothing(
    tmp_path: Path, monkeypatch
):
    """DDP-style (the whole model in each process, gradients all-reduced) trains what one process trains. So does
    FSDP2 (``train.parallel=fsdp``: the base and the LoRA sharded, here with gradient checkpointing) at iteration 2,
    which starts from iteration 1's checkpoint (AdamW's moments cut to each process's shard, gathered whole again
    into the checkpoint); an FSDP process killed after joining commits nothing, and the update run again gives
    the same weights."""
    cfg = tiny_config(tmp_path, *LAYOUT)
    run = create_run(cfg, "ddp")
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update"):
        run_stage(ctx, stage)  # one process
    reference = tmp_path / "one-process"
    shutil.copytree(stage_dir(run.run_dir, 1, "update"), reference)

    two = StageContext(tiny_config(tmp_path, *LAYOUT, "train.nproc_per_node=2"), run.run_dir, run.run_id, 1)
    assert two.config_key == run.config_hash  # the process count is layout, outside the config hash
    out = tmp_path / "two-processes"
    out.mkdir()
    output = launch_update(two, out)
    assert not (out / OUTPUT_FILE).exists() and output.metrics["train/global_step"] == 2
    assert output.info["layout"] == {"parallel": "ddp", "processes": 2, "sharded_parameters": 0}
    assert_same_update(out, reference)

    run_stage(ctx, "checkpoint")
    second = StageContext(run.config, run.run_dir, run.run_id, 2, run.config_hash)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update"):
        run_stage(second, stage)  # one process
    one = stage_dir(run.run_dir, 2, "update")
    reference = tmp_path / "one-process-2"
    shutil.copytree(one, reference)
    manifest = read_manifest(run.run_dir, 2, "update")
    shutil.rmtree(one)
    sharded_cfg = tiny_config(
        tmp_path, *LAYOUT, "train.nproc_per_node=2", "train.parallel=fsdp", "train.gradient_checkpointing=true"
    )
    sharded = StageContext(sharded_cfg, run.run_dir, run.run_id, 2)
    assert sharded.config_key == run.config_hash  # FSDP and checkpointing are layout too
    # FSDP process 2 of 2 killed after joining: torchrun stops the other, the stage commits nothing and leaves no
    # temporary folder; the update run again gives the same weights.
    resumed, skipped = killed_rank_then_resumed(sharded, monkeypatch, "update under torchrun \\(2 processes\\) failed")
    assert not skipped and resumed.inputs_hash == manifest.inputs_hash
    assert resumed.info["layout"]["parallel"] == "fsdp" and resumed.info["layout"]["sharded_parameters"] > 0
    assert resumed.metrics["train/global_step"] == 4
    assert_same_update(one, reference, steps=4)  # the LoRA and AdamW's moments whole: the one-process checkpoint


def test_two_processes_train_what_one_trains_with_the_flow_grpo_loss_too(tmp_path: Path):
    """Flow-GRPO trains on stored SDE trajectories (no random draw in the loss): each process's rows only."""
    grpo = (*LAYOUT, "train.loss=flow_grpo", "regenerate.noise_level=0.7", "train.lr=3e-3")
    grpo = (*grpo, "train.loss_options={clip_range: 1e-3}")
    run = create_run(tiny_config(tmp_path, *grpo), "ddp-grpo")
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update"):
        run_stage(ctx, stage)
    two = StageContext(tiny_config(tmp_path, *grpo, "train.nproc_per_node=2"), run.run_dir, run.run_id, 1)
    out = tmp_path / "two-processes"
    out.mkdir()
    launch_update(two, out)
    assert_same_update(out, stage_dir(run.run_dir, 1, "update"), lr=3e-3, steps=2)


def test_two_ray_train_workers_train_what_one_process_trains_and_a_killed_worker_commits_nothing(
    tmp_path: Path, monkeypatch
):
    """``train.launcher=ray`` on a local Ray instance started for the update (the 2-node test in
    ``test_object_store`` runs it across nodes), here with ``train.parallel=fsdp``: the two workers' weights equal
    one process's within the torchrun tolerances, and a worker killed after joining fails the stage, which commits
    nothing. Another Ray cluster runs on this machine meanwhile, as a ``ray start`` would: without
    ``address="local"``, ``ray.init`` joins the cluster it last started (``/tmp/ray/ray_current_cluster``) and
    refuses the local instance's CPU count."""
    from ray.cluster_utils import Cluster

    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        _ray_train_update_then_kill(tmp_path, monkeypatch)
    finally:
        other.shutdown()


def _ray_train_update_then_kill(tmp_path: Path, monkeypatch) -> None:
    cfg = tiny_config(tmp_path, *LAYOUT)
    run = create_run(cfg, "ray-train")
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update"):
        run_stage(ctx, stage)
    manifest = read_manifest(run.run_dir, 1, "update")
    reference = tmp_path / "one-process"
    shutil.copytree(stage_dir(run.run_dir, 1, "update"), reference)
    shutil.rmtree(stage_dir(run.run_dir, 1, "update"))

    ray_cfg = tiny_config(tmp_path, *LAYOUT, "train.launcher=ray", "train.workers=2", "train.parallel=fsdp")
    two = StageContext(ray_cfg, run.run_dir, run.run_id, 1, run.config_hash)
    # the local Ray instance's workers inherit the fault from this process's environment
    trained, skipped = killed_rank_then_resumed(two, monkeypatch, "update on Ray Train \\(2 workers\\) failed")
    assert not skipped and trained.inputs_hash == manifest.inputs_hash
    assert len(trained.info["nodes"]) == 2 and all(n.startswith("ray:") for n in trained.info["nodes"])
    assert trained.info["layout"]["parallel"] == "fsdp" and trained.info["layout"]["sharded_parameters"] > 0
    assert (
        trained.metrics["train/global_step"] == 2 and not (stage_dir(run.run_dir, 1, "update") / OUTPUT_FILE).exists()
    )
    assert_same_update(stage_dir(run.run_dir, 1, "update"), reference)


def test_the_torchrun_processes_die_with_the_stage_that_launched_them(tmp_path: Path):
    """SIGKILL of the process running the update (a killed solrl, a lost Prefect worker): torchrun stops, and
    stops its workers; nothing keeps training into a dead commit. (Two things stop it: the kernel's SIGTERM,
    PR_SET_PDEATHSIG, and its output pipe breaking; either alone passes this test, the first in about 10 s.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    run = create_run(tiny_config(tmp_path, *LAYOUT, "train.nproc_per_node=2"), "orphans")
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate"):
        run_stage(ctx, stage)
    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from solrl.storage.runs import open_run\nfrom solrl.stages.context import StageContext\n"
        "from solrl.stages.pipeline import run_stage\n"
        f"run = open_run({str(tmp_path)!r}, 'orphans')\n"
        "run_stage(StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash), 'update')\n"
    )
    stage = subprocess.Popen([sys.executable, "-c", script])

    def workers() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "solrl.stages.distributed" in cmdline and str(tmp_path) in cmdline:
                found.append(proc)
        return found

    deadline = time.monotonic() + 120
    while len(workers()) < 3 and time.monotonic() < deadline:  # torchrun and its 2 workers
        time.sleep(0.2)
    assert len(workers()) >= 3, "torchrun did not start its workers"
    os.kill(stage.pid, signal.SIGKILL)
    stage.wait()
    gone, alive = psutil.wait_procs(workers(), timeout=30)
    assert not alive, [p.pid for p in alive]
    assert read_manifest(run.run_dir, 1, "update") is None
