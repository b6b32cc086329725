"""Atomic stage commits, manifests, and the array/table/checkpoint formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from solrl.storage.artifacts import CandidatePool, RewardStats
from solrl.storage.checkpoints import load_checkpoint, optimizer_from_tensors, optimizer_to_tensors, save_checkpoint
from solrl.storage.stage import (
    MANIFEST,
    StageNotCommitted,
    StageOutput,
    commit,
    output_dir,
    read_manifest,
    require,
    run_or_skip,
    stage_dir,
)


def _write_two_files(out: Path) -> StageOutput:
    (out / "a.txt").write_text("alpha")
    (out / "sub").mkdir()
    (out / "sub" / "b.bin").write_bytes(b"\x00" * 10)
    return StageOutput(metrics={"m": 1.5}, info={"note": "x"})


def test_commit_writes_files_then_manifest_with_sizes_and_checksums(tmp_path: Path):
    manifest = commit(tmp_path, "r", 1, "explore", "key1", _write_two_files)
    directory = stage_dir(tmp_path, 1, "explore")
    assert sorted(manifest.files) == ["a.txt", "sub/b.bin"]
    assert manifest.files["sub/b.bin"].size == 10
    on_disk = json.loads((directory / MANIFEST).read_text())
    assert on_disk["inputs_hash"] == "key1" and on_disk["metrics"] == {"m": 1.5}
    assert read_manifest(tmp_path, 1, "explore", verify=True) == manifest
    assert not list(directory.parent.glob(".explore.tmp-*"))
    assert manifest.prefix == "" and output_dir(tmp_path, 1, "explore") == require(tmp_path, 1, "explore")[0]
    assert output_dir(tmp_path, 1, "explore") == directory  # a local store keeps the files in the stage folder


def test_readers_follow_the_attempt_folder_a_manifest_names_and_no_other(tmp_path: Path):
    """An object store's stage commits an attempt prefix inside the stage folder (issue 17): readers find the
    files there, and refuse a manifest whose prefix leaves the stage folder."""
    manifest = commit(tmp_path, "r", 1, "explore", "k", _write_two_files)
    directory = stage_dir(tmp_path, 1, "explore")
    (directory / "a-0123456789ab").mkdir()
    for name in ("a.txt", "sub"):
        (directory / name).rename(directory / "a-0123456789ab" / name)
    assert read_manifest(tmp_path, 1, "explore") is None  # the files are not where the manifest says
    moved = {**manifest.model_dump(mode="json"), "prefix": "a-0123456789ab"}
    (directory / MANIFEST).write_text(json.dumps(moved))
    assert read_manifest(tmp_path, 1, "explore", verify=True).prefix == "a-0123456789ab"
    assert require(tmp_path, 1, "explore")[0] == output_dir(tmp_path, 1, "explore") == directory / "a-0123456789ab"
    (directory.parent / "elsewhere").mkdir()
    for prefix in ("../elsewhere", ".", "..", "a-0123456789ab/../.."):
        (directory / MANIFEST).write_text(json.dumps({**moved, "prefix": prefix, "files": {}}))
        assert read_manifest(tmp_path, 1, "explore") is None, prefix
    with pytest.raises(StageNotCommitted, match="in .*: its _MANIFEST.json is not this stage's"):
        output_dir(tmp_path, 1, "explore")


def test_a_crash_inside_a_stage_commits_nothing_and_leaves_no_temp(tmp_path: Path):
    def crash(out: Path) -> StageOutput:
        (out / "half.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        commit(tmp_path, "r", 1, "explore", "k", crash)
    assert read_manifest(tmp_path, 1, "explore") is None
    assert not stage_dir(tmp_path, 1, "explore").exists()
    assert list(stage_dir(tmp_path, 1, "explore").parent.iterdir()) == []


def test_a_directory_without_manifest_is_never_read(tmp_path: Path):
    commit(tmp_path, "r", 1, "explore", "k", _write_two_files)
    (stage_dir(tmp_path, 1, "explore") / MANIFEST).unlink()  # as if killed before the manifest
    assert read_manifest(tmp_path, 1, "explore") is None
    with pytest.raises(StageNotCommitted, match=r"stage 'explore' in .*: not committed \(no _MANIFEST.json\)"):
        require(tmp_path, 1, "explore")
    (stage_dir(tmp_path, 1, "explore") / MANIFEST).write_text("{")  # torn, as no commit writes it
    with pytest.raises(StageNotCommitted, match="in .*: its _MANIFEST.json is unreadable"):
        require(tmp_path, 1, "explore")


def test_a_truncated_file_invalidates_the_stage(tmp_path: Path):
    commit(tmp_path, "r", 1, "explore", "k", _write_two_files)
    (stage_dir(tmp_path, 1, "explore") / "a.txt").write_text("alp")
    assert read_manifest(tmp_path, 1, "explore") is None
    with pytest.raises(
        StageNotCommitted, match="a file changed since it was committed .*; `solrl resume` recomputes it"
    ):
        require(tmp_path, 1, "explore")  # not "no valid manifest": the manifest is whole


def test_corrupt_content_of_same_size_is_caught_by_verify(tmp_path: Path):
    commit(tmp_path, "r", 1, "explore", "k", _write_two_files)
    (stage_dir(tmp_path, 1, "explore") / "a.txt").write_text("ALPHA")
    assert read_manifest(tmp_path, 1, "explore") is not None
    assert read_manifest(tmp_path, 1, "explore", verify=True) is None


def test_run_or_skip_reuses_a_matching_manifest_and_redoes_a_changed_one(tmp_path: Path):
    calls = []

    def write(out: Path) -> StageOutput:
        calls.append(out)
        return _write_two_files(out)

    first, skipped = run_or_skip(tmp_path, "r", 2, "select", "k1", write)
    assert not skipped
    again, skipped = run_or_skip(tmp_path, "r", 2, "select", "k1", write)
    assert skipped and again == first and len(calls) == 1
    changed, skipped = run_or_skip(tmp_path, "r", 2, "select", "k2", write)
    assert not skipped and changed.inputs_hash == "k2" and len(calls) == 2


def _pool(prompts: int = 2) -> CandidatePool:
    images = np.random.default_rng(0).integers(0, 255, (prompts, 3, 4, 4, 3), dtype=np.uint8)
    seeds = np.arange(prompts * 3, dtype=np.int64).reshape(prompts, 3)
    return CandidatePool(
        images=images,
        seeds=seeds,
        prompt_index=np.arange(prompts, dtype=np.int64),
        attrs={"prompts": ["a", "b"][:prompts], "precision": "bf16"},
    )


def test_candidate_pool_round_trip(tmp_path: Path):
    pool = _pool()
    pool.write(tmp_path)
    again = CandidatePool.read(tmp_path / CandidatePool.filename)
    np.testing.assert_array_equal(again.images, pool.images)
    np.testing.assert_array_equal(again.seeds, pool.seeds)
    assert again.seeds.dtype == np.int64 and again.prompts == ["a", "b"] and again.latents is None


def test_every_zarr_array_has_named_dimensions_and_one_prompt_per_chunk(tmp_path: Path):
    import zarr

    _pool().write(tmp_path)
    group = zarr.open_group(str(tmp_path / CandidatePool.filename), mode="r")
    images = group["images"]
    assert images.metadata.dimension_names == ("prompt", "candidate", "y", "x", "rgb")
    assert images.chunks == (1, 3, 4, 4, 3)
    assert group["seeds"].metadata.dimension_names == ("prompt", "candidate")


def test_zarr_artifact_refuses_disagreeing_prompt_axes_and_missing_arrays(tmp_path: Path):
    pool = _pool()
    with pytest.raises(ValueError, match="disagree on the prompt axis"):
        CandidatePool(images=pool.images, seeds=pool.seeds[:1], prompt_index=pool.prompt_index).write(tmp_path)
    with pytest.raises(ValueError, match=r"required arrays missing: \['seeds'\]"):
        CandidatePool(images=pool.images, prompt_index=pool.prompt_index).write(tmp_path)


def test_table_artifact_round_trip_and_schema(tmp_path: Path):
    frame = pd.DataFrame({"prompt": ["a", "b"], "reward": np.array([0.5, 0.25], np.float32)})
    RewardStats(frame).write(tmp_path)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / RewardStats.filename), frame)
    pd.testing.assert_frame_equal(RewardStats.read(tmp_path / RewardStats.filename).frame, frame)
    with pytest.raises(ValueError, match=r"RewardStats: columns missing: \['reward'\]"):
        RewardStats(frame[["prompt"]])


def test_checkpoint_and_optimizer_state_round_trip(tmp_path: Path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    opt.step()
    tensors, groups = optimizer_to_tensors(opt)
    save_checkpoint(
        tmp_path / "ck",
        {"optimizer": tensors, "policy": {"w": params[0].detach()}},
        {"global_step": 1, "optimizer_param_groups": groups},
    )
    sections, state = load_checkpoint(tmp_path / "ck")
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5.0)
    optimizer_from_tensors(fresh, sections["optimizer"], state["optimizer_param_groups"])
    assert fresh.param_groups[0]["lr"] == 1e-3
    for a, b in zip(opt.state_dict()["state"].values(), fresh.state_dict()["state"].values()):
        for key in a:
            torch.testing.assert_close(torch.as_tensor(a[key]), torch.as_tensor(b[key]))
    torch.testing.assert_close(sections["policy"]["w"], params[0].detach())


def test_a_checkpoint_changed_in_place_is_refused_when_read_not_trained_on(tmp_path: Path):
    """A breaker's finding: a checkpoint's LoRA bytes changed at the same size were read by the next iteration
    (readers checked sizes) and trained on, silently. Checkpoints are hashed when read, as the small tables are."""
    from conftest import flip_middle_byte

    from solrl.storage.artifacts import Checkpoint
    from solrl.storage.stage import StageOutput

    def write(out: Path) -> StageOutput:
        Checkpoint({"policy": {"w": torch.arange(4096.0)}}, {"global_step": 1}).write(out)
        return StageOutput(metrics={}, info={})

    commit(tmp_path, "r", 1, "checkpoint", "k", write)
    assert torch.equal(Checkpoint.load(tmp_path, 1).sections["policy"]["w"], torch.arange(4096.0))
    flip_middle_byte(stage_dir(tmp_path, 1, "checkpoint") / "policy.safetensors")
    assert read_manifest(tmp_path, 1, "checkpoint") is not None  # the size is the same
    with pytest.raises(
        StageNotCommitted, match=r"policy.safetensors changed since it was committed \(sha256\); `solrl"
    ) as refused:
        Checkpoint.load(tmp_path, 1)
    # Its manifest stands, so neither a retry nor a resume alone gets past it: `solrl run` names `verify --redo`
    # (tests/test_cli.py), and the stage task is not retried.
    from types import SimpleNamespace

    from solrl.flows.sol_rl import _worth_retrying
    from solrl.processes import repeated_on_resume
    from solrl.storage.stage import StageChanged

    assert isinstance(refused.value, StageChanged) and repeated_on_resume(refused.value) is refused.value
    assert not _worth_retrying(None, None, SimpleNamespace(data=refused.value))


def test_open_run_detects_an_edited_config_but_accepts_an_older_schema(tmp_path: Path):
    from conftest import tiny_config

    from solrl.config import ConfigError, config_digest
    from solrl.storage.runs import create_run, open_run

    run = create_run(tiny_config(tmp_path), "r1")
    path = run.run_dir / "run.json"
    data = json.loads(path.read_text())
    # A run written by an older solrl, before the fidelity section existed: its hash covers what it wrote.
    del data["config"]["fidelity"]
    data["config_hash"] = config_digest(data["config"])
    path.write_text(json.dumps(data))
    reopened = open_run(tmp_path, "r1")
    assert reopened.config_hash == data["config_hash"] != reopened.config.digest()
    data["config"]["explore"]["pool_size"] = 16  # a hand edit
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="the file was edited"):
        open_run(tmp_path, "r1")


def test_a_run_whose_prompt_files_were_edited_opens_but_is_refused_where_work_starts(tmp_path: Path):
    from conftest import tiny_config

    from solrl.config import ConfigError
    from solrl.stages.runnable import check_runnable
    from solrl.storage.runs import create_run, open_run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the digit one\nthe digit two\n")
    create_run(tiny_config(tmp_path / "store", f"campaign.prompts_file={prompts}"), "p1")
    prompts.write_text("the digit one\nthe digit three\n")
    run = open_run(tmp_path / "store", "p1")  # reading a run (ls, report) needs nothing else
    with pytest.raises(
        ConfigError,
        match=rf"prompts changed since the run was created: campaign.prompts_file \({prompts}\) "
        r"or campaign.eval_prompts_file \(prompts/tiny-digits-eval.txt\) holds other prompts now",
    ):
        check_runnable(run.config, run.prompts_sha256)
    prompts.unlink()
    assert open_run(tmp_path / "store", "p1").run_id == "p1"
    prompts.write_text("the digit one\nthe digit two\n")  # restored: the run can continue
    check_runnable(run.config, run.prompts_sha256)


def test_a_same_size_corruption_is_found_by_verification_and_redone_once_uncommitted(tmp_path: Path):
    """Readers check sizes; the sha256 computed at the commit is checked on demand (issue 36: hash once)."""
    from solrl.storage.stage import uncommit, verify_run

    commit(tmp_path, "r", 1, "explore", "k", _write_two_files)
    (stage_dir(tmp_path, 1, "explore") / "a.txt").write_text("ALPHA")  # same size, other bytes
    assert require(tmp_path, 1, "explore") and read_manifest(tmp_path, 1, "explore", verify=True) is None
    assert [(m.iteration, m.stage, m.file, m.problem) for m in verify_run(tmp_path)] == [
        (1, "explore", "a.txt", "sha256")
    ]
    uncommit(tmp_path, 1, "explore")
    with pytest.raises(StageNotCommitted):
        require(tmp_path, 1, "explore")
    manifest, skipped = run_or_skip(tmp_path, "r", 1, "explore", "k", _write_two_files)
    assert not skipped and (stage_dir(tmp_path, 1, "explore") / "a.txt").read_text() == "alpha"
    assert require(tmp_path, 1, "explore")[1] == manifest and verify_run(tmp_path) == []


def test_a_run_json_of_the_wrong_shape_is_a_config_error_and_ls_lists_it_as_unreadable(tmp_path: Path):
    from solrl.config import ConfigError
    from solrl.storage.runs import list_runs, open_run

    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "run.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a solrl run file"):
        open_run(tmp_path, "odd")
    assert [(r["run_id"], r["model"]) for r in list_runs(tmp_path)] == [("odd", "run.json unreadable")]


def test_two_runs_in_two_stores_in_one_process_log_to_their_own_mlflow_databases(tmp_path: Path):
    from conftest import tiny_config

    from solrl.storage.runs import create_run
    from solrl.storage.tracking import Tracker

    first = Tracker(create_run(tiny_config(tmp_path / "a"), "one"))
    second = Tracker(create_run(tiny_config(tmp_path / "b"), "two"))
    assert first.uri.endswith(f"{tmp_path / 'a'}/mlflow.db") and second.uri.endswith(f"{tmp_path / 'b'}/mlflow.db")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    for tracker in (first, second):
        experiment = tracker.client.get_experiment_by_name("solrl")
        assert len(tracker.client.search_runs(experiment.experiment_id)) == 1


def test_the_run_config_is_logged_whole_in_batches_of_mlflows_hundred_params(tmp_path: Path):
    """One request per parameter cost a campaign about 20 s at its start against the stack's MLflow server (basic
    auth checks each request's password); ``test_stack`` asserts that server saw no ``log-parameter`` request."""
    from conftest import tiny_config
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    from solrl.storage.runs import create_run
    from solrl.storage.tracking import Tracker, _flatten, _log_params

    run = create_run(tiny_config(tmp_path), "params")
    tracker = Tracker(run)
    logged = tracker.client.get_run(tracker.mlflow_run_id).data.params
    expected = _flatten(run.config.model_dump(mode="json", exclude={"base_dir"}))
    assert logged == {k: str(v) for k, v in expected.items()} | {"config_hash": run.config_hash}
    # More than two batches, the last one short, and a value over MLflow's limit cut to it.
    many = {f"p{i:03d}": i for i in range(2 * MAX_PARAMS_TAGS_PER_BATCH + 7)} | {"long": "x" * 7000}
    other = tracker.client.create_run(tracker.experiment_id).info.run_id
    _log_params(tracker.client, other, many)
    logged = tracker.client.get_run(other).data.params
    assert logged == {k: str(v) for k, v in many.items()} | {"long": "x" * MAX_PARAM_VAL_LENGTH}


def test_a_damaged_tracking_file_starts_a_new_mlflow_run_instead_of_failing_the_resume(tmp_path: Path, caplog):
    """tracking.json is written atomically, but a hand-edited or damaged one made every resume fail with a bare
    JSONDecodeError (and Prefect's tracebacks)."""
    import json

    from conftest import tiny_config

    from solrl.storage.runs import create_run
    from solrl.storage.tracking import TRACKING_FILE, Tracker

    run = create_run(tiny_config(tmp_path), "damaged-tracking")
    first = Tracker(run).mlflow_run_id
    (run.run_dir / TRACKING_FILE).write_text("garbage")
    second = Tracker(run)
    assert second.mlflow_run_id != first and "tracking.json is unreadable (JSONDecodeError)" in caplog.text
    assert json.loads((run.run_dir / TRACKING_FILE).read_text())["mlflow_run_id"] == second.mlflow_run_id
    assert Tracker(run).mlflow_run_id == second.mlflow_run_id  # and later resumes continue that one


def test_two_processes_starting_runs_in_a_new_store_at_once_both_get_an_mlflow_run(tmp_path: Path):
    import subprocess
    import sys

    code = (
        "import sys; from conftest import tiny_config; from solrl.storage.runs import create_run; "
        "from solrl.storage.tracking import Tracker; "
        "t = Tracker(create_run(tiny_config(sys.argv[1]), sys.argv[2])); t.finish(); print('ok')"
    )
    store = tmp_path / "fresh"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(store), f"r{i}"],
            cwd=Path(__file__).parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{store}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("solrl").experiment_id)
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1"] and {r.info.status for r in runs} == {"FINISHED"}
    assert not list(store.glob(".mlflow*.tmp-*"))


def _schema(database: Path) -> tuple[list, list]:
    """The tables, indexes and triggers of a sqlite file, each statement's lines sorted (MLflow's migrations
    write a table's constraints in another order from one build to the next), and its Alembic revision."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(database)) as connection:
        rows = connection.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        revision = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    return [(kind, name, sorted(line.strip(" ,") for line in (sql or "").splitlines())) for kind, name, sql in rows], (
        revision
    )


def test_a_new_stores_mlflow_database_is_a_copy_of_the_cached_schema_and_a_damaged_one_is_built_again(
    tmp_path: Path, monkeypatch
):
    """Building MLflow's schema took 1 to 2 s for each new store (35 of them in the tests: 62 s); a copy of one
    built per machine takes milliseconds. Garbage in the template's place, or a template MLflow will not open,
    costs a build, never a run; so does a cache that cannot be written."""
    import contextlib
    import sqlite3

    import mlflow
    from conftest import tiny_config

    from solrl.storage.runs import create_run
    from solrl.storage.tracking import Tracker, _build_schema, schema_template

    monkeypatch.setenv("SOLRL_CACHE", str(tmp_path / "cache"))

    def one_run(store: str) -> None:
        tracker = Tracker(create_run(tiny_config(tmp_path / store), "r"))
        assert [r.info.run_name for r in tracker.client.search_runs(tracker.experiment_id)] == ["r"]
        assert not list((tmp_path / store).glob(".mlflow*.tmp-*"))

    one_run("a")
    template = tmp_path / "cache" / "mlflow" / f"schema-{mlflow.__version__}.db"
    assert schema_template() == template
    _build_schema(tmp_path / "built.db")
    assert _schema(tmp_path / "a" / "mlflow.db") == _schema(tmp_path / "built.db")  # as MLflow builds it

    template.write_bytes(b"not a database")
    one_run("b")
    assert _schema(template) == _schema(tmp_path / "built.db")  # built again
    with contextlib.closing(sqlite3.connect(template)) as connection, connection:
        connection.execute("UPDATE alembic_version SET version_num = 'f00'")  # a revision MLflow does not know
    one_run("c")
    assert not template.exists()  # removed: the next store builds it again
    assert _schema(tmp_path / "c" / "mlflow.db") == _schema(tmp_path / "built.db")

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SOLRL_CACHE", str(tmp_path / "a-file" / "cache"))
    assert schema_template() is None
    one_run("d")


def test_a_lease_holder_that_exited_and_was_not_reaped_yet_is_not_alive():
    """A run killed with SIGKILL stays a zombie until its parent reaps it: a resume at once was refused as
    "being written by another process", naming the dead pid."""
    import socket
    import subprocess
    import time

    from solrl.storage.lease import _process_start, holder_alive

    child = subprocess.Popen(["sleep", "0.5"])
    holder = {"host": socket.gethostname(), "pid": child.pid, "start": _process_start(child.pid)}
    try:
        assert holder["start"] is not None and holder_alive(holder) is True
        deadline = time.monotonic() + 10
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert holder_alive(holder) is False
    finally:
        child.wait()


def test_a_process_whose_run_lease_was_taken_commits_nothing(tmp_path: Path):
    """The run lock is a lease (``solrl.storage.lease``): when another holder takes it over (this process
    stalled past its term), the next renewal notices, the stage commit refuses before replacing anything, and so
    does the lock's end. The lease is the run's (its ``RunPlace``): another run of the same process commits."""
    import time

    from solrl.storage.lease import LEASE, LeaseLost
    from solrl.storage.mirror import locate
    from solrl.storage.runs import run_lock
    from solrl.storage.store import Store

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    kept = commit(run_dir, "r", 1, "explore", "k", _write_two_files)
    lock_ended = pytest.raises(LeaseLost, match="was taken by")  # a block that lost it does not end as if it held it
    with lock_ended, run_lock(run_dir, ttl=0.6):
        store = Store.open(tmp_path)
        record = json.loads(store.read_bytes(f"r/{LEASE}"))
        record["holder"] = {**record["holder"], "host": "elsewhere", "token": "successor"}
        store.write_bytes(f"r/{LEASE}", json.dumps(record).encode())  # the successor's takeover
        time.sleep(0.5)  # past a renewal (every ttl / 3)
        with pytest.raises(LeaseLost, match="was taken by pid .* on elsewhere"):
            commit(run_dir, "r", 1, "explore", "k2", _write_two_files)
        other = tmp_path / "other"  # another run of this process: the lost lease is run r's, not the process's
        assert commit(other, "other", 1, "explore", "k", _write_two_files).stage == "explore"
    assert read_manifest(run_dir, 1, "explore", verify=True) == kept
    assert json.loads(store.read_bytes(f"r/{LEASE}"))["holder"]["token"] == "successor"  # left as it is
    assert locate(run_dir).lease is None  # released with the lock
