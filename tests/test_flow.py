"""The whole pipeline through Prefect: a 2-iteration campaign, its MLflow record, a re-run that skips
everything, and SIGKILL mid-iteration followed by ``solrl resume``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY, temporary_server_env, tiny_config

from solrl.stages.pipeline import ITERATION, campaign_plan
from solrl.storage.runs import create_run, list_runs
from solrl.storage.stage import read_manifest, stage_dir

pytestmark = pytest.mark.slow


def _committed(run_dir: Path, iterations: int) -> dict[tuple[int, str], str]:
    cfg = tiny_config(run_dir.parent, f"campaign.iterations={iterations}")
    found = {(i, stage): read_manifest(run_dir, i, stage) for i, stages in campaign_plan(cfg) for stage in stages}
    assert all(found.values()), [k for k, v in found.items() if v is None]
    return {k: v.created for k, v in found.items()}


def test_two_iteration_campaign_commits_every_stage_logs_mlflow_and_reruns_as_skips(tiny_campaign):
    import mlflow

    from solrl.flows.sol_rl import campaign
    from solrl.storage.tracking import tracking_uri

    run = tiny_campaign
    cfg = run.config
    created = _committed(run.run_dir, 2)

    client = mlflow.MlflowClient(tracking_uri(cfg, run.run_dir.parent))
    (mlflow_run,) = client.search_runs(client.get_experiment_by_name("solrl").experiment_id)
    history = client.get_metric_history(mlflow_run.info.run_id, "eval/digit_alignment")
    assert sorted(m.step for m in history) == [0, 1, 2]
    for key in (
        "explore/reward_mean",
        "regenerate/reward_std",
        "fidelity/spearman",
        "train/loss",
        "seconds/explore",
        "eval/diversity",
        "audit/best_true_rank",
    ):
        assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, key)], key
    artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}
    assert {"best_worst", "eval_samples", "checkpoints"} <= artifacts
    checkpoint = {a.path for a in client.list_artifacts(mlflow_run.info.run_id, "checkpoints/iter_000002")}
    assert "checkpoints/iter_000002/state.json" in checkpoint and "checkpoints/iter_000002/_MANIFEST.json" in checkpoint
    assert mlflow_run.data.tags["solrl.run_id"] == "flow"
    assert mlflow_run.data.params["explore.precision"] == "nvfp4_emulated"
    # MLflow's model-training view, not its GenAI one: the experiment kind tag, the grids in its image view,
    # the report beside them.
    assert client.get_experiment_by_name("solrl").tags["mlflow.experimentKind"] == "custom_model_development"
    assert {"images", "report"} <= artifacts
    images = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(mlflow_run.info.run_id, "images")}
    assert any(name.startswith("best_worst") for name in images) and any(n.startswith("eval_samples") for n in images)
    assert (run.run_dir / "report" / "report.html").is_file()  # the run store's copy, linked from the Prefect UI

    campaign(str(run.run_dir.parent), run.run_id)  # everything committed: a re-run changes nothing
    assert _committed(run.run_dir, 2) == created
    rerun = client.get_metric_history(mlflow_run.info.run_id, "eval/digit_alignment")
    assert sorted(m.step for m in rerun) == [0, 1, 2]  # skipped stages are not logged twice
    assert (1, "audit") not in created and (2, "audit") in created  # fidelity.audit_every=2
    listed = list_runs(run.run_dir.parent)[0]
    # The last stage committed, not explore's manifest, which pruning the pool rewrote after the iteration.
    assert listed["iterations_done"] == 2 and listed["last_stage"] == "iter 2: evaluate", listed
    assert listed["complete"] and not listed["running"]
    assert listed["model"] == "tiny-digits"


def test_sigkill_mid_iteration_then_resume_completes_and_skips_committed_stages(tmp_path: Path):
    store = tmp_path / "store"
    env = temporary_server_env(PYTHONUNBUFFERED="1", PREFECT_LOGGING_LEVEL="INFO")  # solrl's own server
    solrl = [sys.executable, "-m", "solrl.cli"]
    overrides = [a for o in [*TINY, "campaign.iterations=1", f"storage.root={store}"] for a in ("--set", o)]
    proc = subprocess.Popen(
        [*solrl, "run", *overrides, "--run-id", "killme"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    run_dir = store / "killme"
    deadline = time.time() + 240
    try:
        while read_manifest(run_dir, 1, "select") is None:  # wait until iteration 1 is half done
            assert proc.poll() is None, "solrl run ended before it could be killed"
            assert time.time() < deadline, "iteration 1 never reached select"
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("uvicorn" in " ".join(c.cmdline()) for c in children)
        os.kill(proc.pid, signal.SIGKILL)  # solrl alone: its temporary Prefect server must not outlive it
        proc.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "a child outlived solrl's SIGKILL"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert read_manifest(run_dir, 1, "checkpoint") is None  # killed mid-iteration
    done_before = {s.name for s in ITERATION if read_manifest(run_dir, 1, s.name)}
    assert {"explore", "score_explore", "select"} <= done_before

    result = subprocess.run(
        [*solrl, "resume", "killme", "--store", str(store)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    kept = [s.name for s in ITERATION if s.name in done_before]
    assert f"iteration 1: {', '.join(kept)} committed by an earlier attempt" in log  # no task run for them
    assert "committed stages are kept and not recomputed" in log and "continuing at " in log
    _committed(run_dir, 1)
    leftovers = [p for p in run_dir.rglob(".*") if ".tmp-" in p.name or ".trash-" in p.name]
    assert leftovers == []
    assert stage_dir(run_dir, 1, "checkpoint").exists()


def test_a_stage_committed_but_never_logged_is_logged_when_resumed(tmp_path: Path):
    # The process died after the stage's commit and before its MLflow logging: the next run catches up, once.
    from solrl.flows.sol_rl import _run_and_track
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import open_run
    from solrl.storage.tracking import Tracker

    run = create_run(tiny_config(tmp_path / "store"), "unlogged")
    run_stage(StageContext(run.config, run.run_dir, run.run_id, 0, run.config_hash), "evaluate")
    tracker = Tracker(open_run(run.run_dir.parent, run.run_id))
    assert not tracker.has_metric("seconds/evaluate", 0)
    for _ in range(2):
        result = _run_and_track(str(run.run_dir.parent), run.run_id, 0, "evaluate", tracker, retries=0)
        assert result["skipped"]
    history = tracker.client.get_metric_history(tracker.mlflow_run_id, "eval/digit_alignment")
    assert [m.step for m in history] == [0]
    assert tracker.has_metric("seconds/evaluate", 0)
    artifacts = {a.path for a in tracker.client.list_artifacts(tracker.mlflow_run_id, "eval_samples")}
    assert artifacts == {"eval_samples/iter_000000"}


def test_two_first_runs_started_together_each_with_a_new_prefect_home_and_one_new_store_both_finish(tmp_path: Path):
    """Issue 10's first-start and same-moment failures, through the command line: each process starts a
    temporary Prefect server on a new database while the other loads (a busy machine), both create MLflow's
    schema in a store that does not exist yet."""
    import mlflow

    store = tmp_path / "new-store"
    overrides = [a for o in [*TINY, "campaign.iterations=1", f"storage.root={store}"] for a in ("--set", o)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "solrl.cli", "run", *overrides, "--run-id", f"first{i}"],
            env=temporary_server_env(PREFECT_HOME=str(tmp_path / f"prefect{i}")),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("solrl").experiment_id)
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    for r in runs:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "eval/digit_alignment")] == [0, 1]


def test_a_full_disk_fails_the_stage_at_once_says_where_space_is_short_and_the_resume_finishes(tmp_path, monkeypatch):
    """A write that finds the disk full (``OSError`` ENOSPC, here injected once at update[1]'s write) is not
    retried: a retry 2 s later would find the disk as full, after recomputing the stage. Here the fault fires
    once, so a retry would have succeeded and the run finished: it must fail instead. The error names the full
    disk and the free space of each file system solrl writes to; nothing committed is lost, and the resume
    finishes the run."""
    from fault_injection import fault_env
    from typer.testing import CliRunner

    from solrl.cli import app

    store = tmp_path / "store"
    sets = [a for o in [*TINY, "campaign.iterations=1", f"storage.root={store}"] for a in ("--set", o)]
    for name, value in fault_env("1:update:write:enospc", once=tmp_path / "fault-fired").items():
        monkeypatch.setenv(name, value)  # this process imported the plug-in (conftest): PYTHONPATH is harmless
    failed = CliRunner().invoke(app, ["run", *sets, "--run-id", "full"])
    assert failed.exit_code == 1, failed.output
    assert (tmp_path / "fault-fired").exists()
    line = [ln for ln in failed.stderr.splitlines() if ln.startswith("solrl: error: ")][-1]
    assert line.startswith("solrl: error: a disk is full: OSError: [Errno 28] No space left on device"), line
    free = failed.stderr.split("free space: ")[1].splitlines()[0]  # one file system here: store, cache, ...
    assert re.fullmatch(rf"[0-9.]+ [kMGT]?B on run store {store}, cache .+, Prefect home .+, temp .+", free), free
    assert f"free some, then continue with `solrl resume full --store {store}`" in failed.stderr
    committed = {s.name for s in ITERATION if read_manifest(store / "full", 1, s.name)}
    assert "score_regenerate" in committed and "update" not in committed

    resumed = CliRunner().invoke(app, ["resume", "full", "--store", str(store)])
    assert resumed.exit_code == 0, resumed.output
    _committed(store / "full", 1)


def test_a_process_that_loses_the_run_lease_stops_at_the_next_stage_unretried_and_does_not_say_finished(
    tmp_path, monkeypatch
):
    """A resume that stalled past its lease's term while another process took the run over (found by the breaker:
    ``kill -STOP`` it, resume elsewhere, ``kill -CONT``): its next stage failed with ``LeaseLost``, Prefect retried
    it, the retry skipped what the other process had committed, and the campaign ended "finished", exit 0. Now the
    next stage refuses before it cleans, computes or skips, is not retried, and the command exits 1 naming the
    takeover. Also: ``resume`` holds the lease from its checks on (the flow joins it), so no second resume starts
    Prefect in between."""
    import json

    from typer.testing import CliRunner

    import solrl.cli as cli
    import solrl.flows.sol_rl as sol_rl
    from solrl.cli import app
    from solrl.storage.lease import LEASE, LeaseLost
    from solrl.storage.mirror import locate
    from solrl.storage.runs import run_holder
    from solrl.storage.stage import commit_hooks

    store = tmp_path / "store"
    run = create_run(tiny_config(store, "campaign.iterations=1"), "lost")
    holders: list[str | None] = []

    def take_over(iteration: int, stage: str, point: str) -> None:  # another host's resume, after a stall here
        if (iteration, stage, point) != (0, "evaluate", "committed"):
            return
        holders.append(run_holder(run.run_dir))
        lease = locate(run.run_dir).lease
        record = json.loads((run.run_dir / LEASE).read_text())
        record["holder"] = {**record["holder"], "host": "elsewhere", "pid": 4321, "token": "successor"}
        (run.run_dir / LEASE).write_text(json.dumps(record))
        with contextlib.suppress(LeaseLost):
            lease.renew()  # what the renewal thread finds at its next turn

    entered: list[tuple[int, str]] = []
    run_stage = sol_rl.run_stage

    def counted(ctx, name):
        entered.append((ctx.iteration, name))
        return run_stage(ctx, name)

    monkeypatch.setattr(sol_rl, "run_stage", counted)
    start_prefect = cli._start_prefect_early

    def starting() -> None:
        holders.append(run_holder(run.run_dir))
        start_prefect()

    monkeypatch.setattr(cli, "_start_prefect_early", starting)
    commit_hooks.append(take_over)
    try:
        result = CliRunner().invoke(app, ["resume", "lost", "--store", str(store)])
    finally:
        commit_hooks.remove(take_over)
    assert len(holders) == 2 and None not in holders  # held before Prefect started, and while the campaign ran
    assert result.exit_code == 1, result.output
    assert "finished" not in result.stdout
    error = [ln for ln in result.stderr.splitlines() if ln.startswith("solrl: error: ")][-1]
    assert error.startswith("solrl: error: LeaseLost: ") and "taken by pid 4321 on elsewhere" in error, error
    assert "the process that took the run over continues it" in result.stderr
    assert entered == [(0, "evaluate"), (1, "explore")]  # explore refused once, not retried (stage_retries=1)
    assert read_manifest(run.run_dir, 1, "explore") is None
    assert json.loads((run.run_dir / LEASE).read_text())["holder"]["token"] == "successor"  # left to its holder
    assert locate(run.run_dir).lease is None


def test_a_full_disk_is_told_from_other_errors_through_the_exception_chain():
    import errno
    import sqlite3

    from solrl.processes import disk_full

    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(full) is full
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full(quota) is quota
    try:  # how MLflow's store raises it: SQLAlchemy's error wrapping sqlite3's
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as exc:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full [SQL: INSERT ...]") from exc
    except RuntimeError as wrapped:
        assert disk_full(wrapped) is wrapped
    try:
        try:
            raise full
        except OSError:
            raise ValueError("Task run is not set")  # noqa: B904 - an error raised while handling it
    except ValueError as during:
        assert disk_full(during) is full
    for other in (OSError(errno.EACCES, "Permission denied"), FileNotFoundError("x"), RuntimeError("boom")):
        assert disk_full(other) is None
    # safetensors keeps only the OS's text (a breaker's finding, on a 3 MB tmpfs: a checkpoint on a full disk was
    # retried and ended in a generic error), as its Rust side formats an io::Error.
    from safetensors import SafetensorError

    full_checkpoint = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert disk_full(full_checkpoint) is full_checkpoint
