"""A campaign whose run store is an S3 bucket (moto's server on loopback): the same results as on a local folder,
the same commands on it, and the commit protocol of an object store (attempt prefixes, conditional manifests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import temporary_server_env, tiny_config
from typer.testing import CliRunner

from solrl.cli import app
from solrl.stages.context import StageContext
from solrl.stages.pipeline import campaign_plan, run_stage
from solrl.storage.mirror import locate, run_folder
from solrl.storage.runs import create_run, list_runs, open_run
from solrl.storage.stage import MANIFEST, StageOutput, commit, read_manifest, require, stage_dir
from solrl.storage.store import Store

runner = CliRunner()


#: One prompt's pool per explore batch, so a shard of the Ray test samples exactly the batches the one-process run
#: does: on a CPU whose float32 kernels round a row differently in another batch (this 2-core Xeon's), a last-bit
#: difference that puts an activation on the other side of an E2M1 rounding boundary moves that candidate's
#: whole image (14 grey levels seen), which no tolerance of the BF16 stages should hide.
POOL_BATCHES = ("explore.batch_size=8",)


def run_campaign(root: str, *extra: str) -> Path:
    """A 2-iteration tiny-digits run ``same`` in ``root`` through the stage functions; returns its run folder."""
    run = create_run(tiny_config(Path("/unused"), f"storage.root={root}", *POOL_BATCHES, *extra), "same")
    for iteration, stages in campaign_plan(run.config):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            run_stage(ctx, stage)
    return run.run_dir


def checksums(run_dir: Path) -> dict[tuple[int, str, str], object]:
    """The sha256 of every committed file of the run, by (iteration, stage, file), checksums verified; a
    checkpoint's ``state.json`` as its content less the config hash (``storage.root`` is part of the config)."""
    found: dict[tuple[int, str, str], object] = {}
    for iteration, stages in campaign_plan(open_run(*_store_and_id(run_dir)).config):
        for stage in stages:
            folder, manifest = require(run_dir, iteration, stage)
            found.update({(iteration, stage, rel): entry.sha256 for rel, entry in manifest.files.items()})
            if stage == "checkpoint":
                state = json.loads((folder / "state.json").read_text())
                found[(iteration, stage, "state.json")] = {k: v for k, v in state.items() if k != "config_hash"}
    return found


def _store_and_id(run_dir: Path) -> tuple[str, str]:
    return locate(run_dir).store.address, run_dir.name


@pytest.fixture(scope="module")
def s3_and_local(s3_server: str, tmp_path_factory: pytest.TempPathFactory):
    """One campaign on S3 and the same on a local folder, shared by the tests that only read them."""
    with pytest.MonkeyPatch.context() as env:
        bucket = _s3_user(env, s3_server)
        local = run_campaign(str(tmp_path_factory.mktemp("local") / "runs"))
        on_s3 = run_campaign(f"s3://{bucket}/team/runs")
        yield on_s3, local, f"s3://{bucket}/team/runs", env


def _s3_user(env: pytest.MonkeyPatch, endpoint: str) -> str:
    import uuid

    import boto3

    env.setenv("AWS_ACCESS_KEY_ID", "AKIASOLRLTESTKEY0000")
    env.setenv("AWS_SECRET_ACCESS_KEY", "solrl-test-secret-0000000000000000000000")
    env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    env.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"solrl-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


def test_a_campaign_on_s3_equals_the_local_one_file_for_file(s3_and_local):
    on_s3, local, root, _ = s3_and_local
    assert locate(on_s3).mirrored and not locate(local).mirrored
    expected = checksums(local)
    assert len(expected) > 20 and checksums(on_s3) == expected
    # On the store: the run file, and each stage's manifest beside the one attempt it names (no other).
    store = Store.open(root)
    assert json.loads(store.read_bytes("same/run.json"))["run_id"] == "same"
    for iteration, stage, _ in expected:
        key = f"same/iter_{iteration:06d}/{stage}"
        manifest = json.loads(store.read_bytes(f"{key}/{MANIFEST}"))
        assert sorted(store.ls(key)) == sorted([MANIFEST, manifest["prefix"]]), key
    assert [r["run_id"] for r in list_runs(root)] == ["same"] and list_runs(root)[0]["iterations_done"] == 2


def test_the_commands_work_on_the_s3_run(s3_and_local, tmp_path: Path):
    on_s3, _, root, _ = s3_and_local
    listed = runner.invoke(app, ["ls", "--store", root])
    assert listed.exit_code == 0 and "same" in listed.output, listed.output
    page = tmp_path / "report.html"
    reported = runner.invoke(app, ["report", "same", "--store", root, "--html", str(page)])
    assert reported.exit_code == 0, reported.output
    assert "best and worst, iteration 2" in page.read_text()
    inspected = runner.invoke(app, ["inspect", "same", "--store", root, "--iteration", "2"])
    assert inspected.exit_code == 0 and "run same, iteration 2" in inspected.output, inspected.output
    out = tmp_path / "pool.png"
    shown = runner.invoke(
        app, ["show", "same", "--store", root, "--iteration", "1", "--prompt", "0", "--out", str(out)]
    )
    assert shown.exit_code == 0 and out.stat().st_size > 0, shown.output
    exported = runner.invoke(app, ["export", "same", "--store", root, "--out", str(tmp_path / "lora")])
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_pyarrow_and_zarr_read_the_committed_stages_in_place_on_the_store(s3_and_local):
    """A reader with no mirror, as an auditor's notebook: pyarrow's own S3 filesystem (the endpoint passed on)
    and zarr-python's fsspec store open the committed attempt the manifest names, equal to the local run."""
    import numpy as np
    import pandas as pd
    import pyarrow.fs
    import pyarrow.parquet as pq
    import xarray as xr
    import zarr

    from solrl.storage.stage import committed_key

    on_s3, local, _, _ = s3_and_local
    store, key = committed_key(on_s3, 1, "score_explore")
    filesystem = store.arrow_filesystem()
    assert isinstance(filesystem, pyarrow.fs.S3FileSystem) and "/a-" in key
    got = pq.read_table(store.path(f"{key}/rewards.parquet"), filesystem=filesystem).to_pandas()
    pd.testing.assert_frame_equal(got, pd.read_parquet(local / "iter_000001/score_explore/rewards.parquet"))
    store, key = committed_key(on_s3, 1, "explore")
    pool = zarr.open_group(store.zarr_store(f"{key}/candidates.zarr"), mode="r")
    expected = zarr.open_group(str(local / "iter_000001/explore/candidates.zarr"), mode="r")
    assert sorted(pool.array_keys()) == sorted(expected.array_keys())
    for name in expected.array_keys():
        np.testing.assert_array_equal(pool[name][...], expected[name][...])
    assert xr.open_zarr(store.zarr_store(f"{key}/candidates.zarr"))["images"].shape == expected["images"].shape
    local_store, local_key = committed_key(local, 1, "explore")  # a local folder: the same calls
    assert zarr.open_group(local_store.zarr_store(f"{local_key}/candidates.zarr"), mode="r")["seeds"].shape


def test_a_mirror_that_lost_or_changed_files_is_refetched_from_the_store(s3_and_local):
    on_s3, _, _, _ = s3_and_local
    folder, manifest = require(on_s3, 1, "select")
    (folder / "selection.parquet").unlink()
    (folder / "best_worst.png").write_bytes(b"edited in the cache")
    again, same = require(on_s3, 1, "select")
    assert same == manifest and (again / "selection.parquet").is_file()
    assert (again / "best_worst.png").stat().st_size == manifest.files["best_worst.png"].size


def _two_files(out: Path) -> StageOutput:
    (out / "a.txt").write_text("alpha")
    return StageOutput(metrics={"m": 1.0})


def test_a_corrupted_object_or_manifest_on_the_store_is_never_trusted(s3_and_local):
    on_s3, _, root, _ = s3_and_local
    store = locate(on_s3).store
    run_dir = run_folder(store, "commit-tests")
    commit(run_dir, "commit-tests", 1, "explore", "k", _two_files)
    key = "commit-tests/iter_000001/explore"
    manifest = read_manifest(run_dir, 1, "explore", verify=True)
    store.write_bytes(f"{key}/{manifest.prefix}/a.txt", b"ALPHA")  # same size, other bytes, on the store
    (stage_dir(run_dir, 1, "explore") / manifest.prefix / "a.txt").unlink()  # and not in the mirror
    assert read_manifest(run_dir, 1, "explore") is not None  # sizes hold
    assert read_manifest(run_dir, 1, "explore", verify=True) is None
    store.write_bytes(f"{key}/{MANIFEST}", b"{not json")
    assert read_manifest(run_dir, 1, "explore") is None
    redone = commit(run_dir, "commit-tests", 1, "explore", "k", _two_files)  # over the unreadable manifest
    assert read_manifest(run_dir, 1, "explore", verify=True) == redone
    assert sorted(store.ls(key)) == sorted([MANIFEST, redone.prefix])  # the older attempt is gone


def campaign_on(root: str, env: dict[str, str], fault: str | None, threads: int) -> None:
    """Create or resume run ``same`` in ``root`` and run its whole plan (in a child: its environment is set here,
    the forkserver having started before the test set it)."""
    import torch
    from fault_injection import FAULT_ENV

    torch.set_num_threads(threads)  # the reference run's: the trained weights depend on the GEMM's reduction order
    os.environ.update(env)
    os.environ.pop(FAULT_ENV, None)
    if fault is not None:
        os.environ[FAULT_ENV] = fault
    cfg = tiny_config(Path("/unused"), f"storage.root={root}", *POOL_BATCHES)
    store = Store.open(root)
    run = open_run(root, "same") if store.exists("same/run.json") else create_run(cfg, "same")
    for iteration, stages in campaign_plan(run.config):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            run_stage(ctx, stage)


@pytest.mark.slow
def test_a_kill_at_each_fault_point_of_explore_and_update_then_resume_equals_the_run(s3_and_local, tmp_path: Path):
    import multiprocessing

    from conftest import CHILD_PRELOAD

    from solrl.storage.stage import COMMIT_POINTS

    _, local, root, _ = s3_and_local
    root = root.replace("/team/runs", "/faults/runs")
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    env |= {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "SOLRL_CACHE": str(tmp_path / "node-cache")}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(CHILD_PRELOAD)

    def child(fault: str | None) -> int | None:
        import torch

        process = context.Process(target=campaign_on, args=(root, env, fault, torch.get_num_threads()))
        process.start()
        process.join(timeout=600)
        return process.exitcode

    store = Store.open(root)
    for point in [f"1:{stage}:{where}" for stage in ("explore", "update") for where in COMMIT_POINTS]:
        assert child(point) == -9, f"{point}: the process was not killed there"
        iteration, stage, where = point.split(":")
        key = f"same/iter_{int(iteration):06d}/{stage}"
        committed = store.exists(f"{key}/{MANIFEST}")
        assert committed == (where == "committed"), point
        if where == "renamed":  # uploaded, not committed: an attempt no manifest names, which nothing reads
            assert [n for n in store.ls(key) if n.startswith("a-")], point
    assert child(None) == 0
    assert list((Path(env["SOLRL_CACHE"]) / "stores").glob("*/same"))  # the children worked in their own mirror
    assert checksums(open_run(root, "same").run_dir) == checksums(local)  # read here from the store
    for iteration, stages in campaign_plan(open_run(root, "same").config):
        for stage in stages:  # one manifest and the one attempt it names: no attempt of a killed try is left
            key = f"same/iter_{iteration:06d}/{stage}"
            named = json.loads(store.read_bytes(f"{key}/{MANIFEST}"))["prefix"]
            assert sorted(store.ls(key)) == sorted([MANIFEST, named]), key


def test_two_writers_racing_for_one_stage_one_manifest_wins(s3_and_local):
    """Eight writers commit one stage at once, each with its own client: one manifest wins, the others fail
    with ``StageCommitLost`` and remove their attempt, and a reader finds exactly the winner's files."""
    import threading

    from solrl.storage.stage import StageCommitLost

    on_s3, _, _, _ = s3_and_local
    run_dir = run_folder(locate(on_s3).store, "race")
    outcomes: list[object] = [None] * 8
    start = threading.Barrier(8)

    def write(i: int) -> None:
        def files(out: Path) -> StageOutput:
            start.wait()  # every writer has read the (absent) manifest's tag before any commits
            (out / "writer.txt").write_text(f"writer {i}")
            return StageOutput(metrics={"writer": float(i)})

        try:
            outcomes[i] = commit(run_dir, "race", 1, "explore", "k", files)
        except StageCommitLost as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(winners) == 1 and all(isinstance(o, StageCommitLost) or o is winners[0] for o in outcomes)
    folder, manifest = require(run_dir, 1, "explore")
    assert manifest.prefix == winners[0].prefix
    assert (folder / "writer.txt").read_text() == f"writer {int(manifest.metrics['writer'])}"
    store = locate(run_dir).store
    assert sorted(store.ls("race/iter_000001/explore")) == sorted([MANIFEST, manifest.prefix])


#: Made-up credentials, unlike anything else a run writes: found anywhere, they leaked.
KEY_ID, SECRET = "AKIASOLRLLEAKCHECK42", "solrl-leak-check-secret-9f8e7d6c5b4a"


def _cli_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    # its own temporary Prefect server, whose database in PREFECT_HOME is searched for the credentials
    env = {k: v for k, v in temporary_server_env().items() if not k.startswith("AWS_")}
    env |= {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "SOLRL_CACHE": str(tmp_path / "cache"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "OMP_NUM_THREADS": "1",
    }
    return env


def _solrl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    solrl = [sys.executable, "-m", "solrl.cli"]
    return subprocess.run([*solrl, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_campaign_through_the_cli_on_s3_keeps_the_credentials_out_of_everything(s3_server: str, tmp_path: Path):
    """``solrl run`` with the store on S3, through Prefect and MLflow as a user runs it; then the store, the logs,
    this machine's mirror and MLflow database, and Prefect's database (flow-run parameters) hold no credential."""
    import boto3
    from conftest import REPORT, TINY

    env = _cli_env(s3_server, tmp_path)
    bucket = f"solrl-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET).create_bucket(
        Bucket=bucket
    )
    root = f"s3://{bucket}/runs"
    # One iteration: every kind of place a credential could land (the stages, the report, MLflow, Prefect) is
    # written by then.
    one = [*TINY, REPORT, "campaign.iterations=1", f"storage.root={root}"]
    sets = [item for s in one for item in ("--set", s)]
    ran = _solrl("run", "tiny-digits", *sets, "--run-id", "creds", env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"results in {root}/creds" in ran.stdout
    resumed = _solrl("resume", "creds", "--store", root, env=env)
    assert resumed.returncode == 0 and "nothing to do" in resumed.stdout, resumed.stderr[-2000:]
    logs = ran.stdout + ran.stderr + resumed.stdout + resumed.stderr
    leaked = [where for where in ("logs",) if KEY_ID in logs or SECRET in logs]
    s3 = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page["Contents"]]
    assert "runs/creds/run.json" in keys and "runs/creds/report/report.html" in keys
    for key in keys:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if KEY_ID.encode() in body or SECRET.encode() in body:
            leaked.append(f"s3://{bucket}/{key}")
    local = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    local += [p for p in (tmp_path / "prefect").rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in local) and any(
        p.suffix == ".db" for p in (tmp_path / "prefect").rglob("*")
    )
    for path in local:  # the MLflow and Prefect databases are searched as bytes (params, flow-run parameters)
        data = path.read_bytes()
        if KEY_ID.encode() in data or SECRET.encode() in data:
            leaked.append(str(path))
    assert leaked == []


@pytest.mark.parametrize(
    "case, root, env_change, message",
    [
        (
            "no bucket",
            "s3://solrl-no-such-bucket/runs",
            {},
            "bucket 'solrl-no-such-bucket' of s3://solrl-no-such-bucket/runs does not exist",
        ),
        ("unreachable", None, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "cannot reach the object store for s3://"),
        (
            "no credentials",
            None,
            {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
            "no credentials for s3://",
        ),
        ("credentials in the URI", "s3://AKIAX:topsecret@bucket/runs", {}, "carries credentials"),
    ],
)
@pytest.mark.usefixtures("own_prefect_server")  # checks that solrl started no Prefect server
def test_an_object_store_that_cannot_be_used_is_one_line_and_exit_2_before_any_work(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, root, env_change: dict, message: str
):
    import boto3

    for name, value in {**_cli_env(s3_server, tmp_path), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    bucket = f"solrl-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET).create_bucket(
        Bucket=bucket
    )
    for name, value in env_change.items():
        monkeypatch.delenv(name) if value is None else monkeypatch.setenv(name, value)
    ran = runner.invoke(app, ["run", "tiny-digits", "--set", f"storage.root={root or f's3://{bucket}/runs'}"])
    assert ran.exit_code == 2, (case, ran.output)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], (case, ran.stderr)
    assert "topsecret" not in ran.output and SECRET not in ran.output
    assert not (tmp_path / "cache" / "stores").exists() and not (tmp_path / "prefect").exists()  # nothing written
    s3 = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


@pytest.mark.usefixtures("own_prefect_server")  # checks that solrl started no Prefect server
def test_a_key_the_store_denies_is_one_line_and_exit_2_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A server that checks every request against IAM (moto's, after its first 3 requests: the bucket, a user, its
    key): a user with no policy is denied, and ``solrl run`` says so in one line, with nothing written."""
    import boto3
    from conftest import moto_server

    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as endpoint:
        admin = {"endpoint_url": endpoint, "aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET}
        boto3.client("s3", region_name="us-east-1", **admin).create_bucket(Bucket="solrl-denied")
        iam = boto3.client("iam", region_name="us-east-1", **admin)
        iam.create_user(UserName="no-policy")
        key = iam.create_access_key(UserName="no-policy")["AccessKey"]
        env = _cli_env(endpoint, tmp_path)
        env |= {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        ran = runner.invoke(app, ["run", "tiny-digits", "--set", "storage.root=s3://solrl-denied/runs"])
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert ran.exit_code == 2 and len(lines) == 1, ran.output
    assert lines[0].startswith("solrl: error: access denied to s3://solrl-denied/runs at http://127.0.0.1:"), lines
    assert "the key in use may not read and write there" in lines[0]
    assert key["SecretAccessKey"] not in ran.output
    assert not (tmp_path / "cache" / "stores").exists() and not (tmp_path / "prefect").exists()


def staged_outputs(run_dir: Path) -> dict[str, object]:
    """``test_faults.outputs`` of every committed stage, found through its manifest (checksums verified), keyed
    ``<iteration>/<stage>/<file>``: the same keys for a run of a local folder and of an object store."""
    from test_faults import outputs

    found: dict[str, object] = {}
    for iteration, stages in campaign_plan(open_run(*_store_and_id(run_dir)).config):
        for stage in stages:
            folder, _ = require(run_dir, iteration, stage)
            found.update({f"{iteration}/{stage}/{key}": value for key, value in outputs(folder).items()})
    return found


@pytest.mark.slow
def test_two_shards_on_two_nodes_of_a_ray_cluster_with_the_store_only_on_s3(s3_and_local, tmp_path: Path):
    """A simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``), each node with its own ``SOLRL_CACHE``:
    the shard tasks can share nothing but the S3 store. Each sharded stage's shards ran on the two nodes, and the
    run equals the 1-process local one within the shard tests' tolerances. One iteration: its evaluation already
    samples, on the nodes, the policy that Ray Train updated and the store holds (the second cost 85 s, mostly Ray
    Train's start and the nodes' new worker processes)."""
    import pandas as pd
    import torch
    from ray.cluster_utils import Cluster
    from test_distributed import assert_close_trained
    from test_shards import assert_close_outputs

    from solrl.flows.sol_rl import campaign as prefect_campaign

    _, local, root, _ = s3_and_local
    root = root.replace("/team/runs", "/ray/runs")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for name in ("node-a", "node-b"):
            cluster.add_node(num_cpus=1, env_vars={"SOLRL_CACHE": str(tmp_path / name), "OMP_NUM_THREADS": "1"})
        cluster.wait_for_nodes()
        extra = (
            "campaign.shards=2",
            "campaign.task_runner=ray",
            f"campaign.task_runner_address={cluster.address}",
            "train.launcher=ray",
            "train.workers=2",
            "campaign.iterations=1",
        )
        run = create_run(tiny_config(Path("/unused"), f"storage.root={root}", *POOL_BATCHES, *extra), "same")
        prefect_campaign(root, "same")
        # A store error in a task names the node whose `ray start` environment it has (the campaign's has keys).
        import ray

        from solrl.storage.store import ray_node_note

        ray.init(address=cluster.address, log_to_driver=False, ignore_reinit_error=True)
        try:
            assert ray_node_note() == ""  # the driver
            note = ray.get(ray.remote(num_cpus=1)(ray_node_note).remote())
            assert note.startswith(" (in a Ray task on node ") and "its `ray start` was given" in note, note
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
    for stage in ("explore", "regenerate", "score_explore"):
        nodes = read_manifest(run.run_dir, 1, stage).info["nodes"]
        assert len(nodes) == 2 and len(set(nodes)) == 2 and all(n.startswith("ray:") for n in nodes), nodes
    trained_on = read_manifest(run.run_dir, 1, "update").info["nodes"]  # Ray Train's ranks 0 and 1
    assert len(set(trained_on)) == 2 and set(trained_on) == set(nodes), (trained_on, nodes)
    for name in ("node-a", "node-b"):  # each node fetched its inputs into its own cache, from the store
        assert list((tmp_path / name / "stores").glob("*/same/iter_000001/explore.shards/*/a-*"))
    got = staged_outputs(run.run_dir)
    expected = {k: v for k, v in staged_outputs(local).items() if int(k.split("/")[0]) <= 1}
    pruned = [k for k in expected if k.endswith("/explore/candidates.zarr/images")]  # the flow kept latents only
    assert pruned and not any(k in got for k in pruned)
    expected = {k: v for k, v in expected.items() if k not in pruned}
    trained = [
        k for k, v in expected.items() if isinstance(v, torch.Tensor) and k.split("/")[1] in ("update", "checkpoint")
    ]
    assert trained  # the update's and the checkpoint's tensors: within the torchrun test's tolerances
    assert_close_trained({k: got.pop(k) for k in trained}, {k: expected.pop(k) for k in trained}, lr=5e-4, steps=2)
    assert_close_outputs(got, expected)
    kept = ["group", "slot", "candidate_index", "seed"]
    got = pd.read_parquet(require(run.run_dir, 1, "select")[0] / "selection.parquet")
    pd.testing.assert_frame_equal(
        got[kept], pd.read_parquet(require(local, 1, "select")[0] / "selection.parquet")[kept]
    )


def test_a_reader_on_another_machine_downloads_only_the_chunks_it_indexes(s3_and_local, tmp_path, monkeypatch):
    """A pool opened from the store on a machine with an empty mirror fetches its metadata and, as Zarr asks for
    them, only the chunk files of the prompts read (each checked against its sha256): a shard's own prompts."""
    import numpy as np

    from solrl.storage.artifacts import CandidatePool

    on_s3, local, root, _ = s3_and_local
    monkeypatch.setenv("SOLRL_CACHE", str(tmp_path / "other-machine"))
    run_dir = open_run(root, "same").run_dir
    pool = CandidatePool.load(run_dir, 1)
    folder = require(run_dir, 1, "explore", defer=lambda rel: "/c/" in rel)[0] / "candidates.zarr"
    assert not list((folder / "images" / "c").rglob("*"))  # no pool chunk fetched yet
    second = pool.images[1:2]
    fetched = sorted(
        p.relative_to(folder / "images" / "c").parts[0] for p in (folder / "images" / "c").rglob("*") if p.is_file()
    )
    assert fetched and set(fetched) == {"1"}  # prompt 1's chunks only
    expected = CandidatePool.load(local, 1)
    np.testing.assert_array_equal(second, np.asarray(expected.images)[1:2])
    np.testing.assert_array_equal(pool.seeds, expected.seeds)


def test_a_mirror_folder_this_process_did_not_open_is_refused_not_taken_for_a_run_store(s3_and_local, tmp_path):
    """Issue 37: a run's place is recorded when the process opens it, never worked out again from a folder. A mirror
    handed over bare (as torchrun's workers once got their run) would be read as a local store of copies: refused,
    with the way to open it; the workers are handed the store itself (``Store.address``)."""
    _, _, root, _ = s3_and_local
    opened = open_run(root, "same")
    assert locate(opened.run_dir).mirrored and opened.place.store.address == root
    stray = tmp_path / "elsewhere"  # the same mirror layout, never opened by this process
    stray.mkdir()
    (stray / ".store.json").write_text(json.dumps({"uri": root}))
    with pytest.raises(ValueError, match=r"a mirror of an object store's run.*open_run\(store, 'same'\)"):
        locate(stray / "same")
