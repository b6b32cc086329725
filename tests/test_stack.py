"""The server stack of a team, natively on loopback: a throwaway PostgreSQL cluster (Debian's ``postgresql``,
``max_connections=20``), the Prefect server on it with its API auth string, the MLflow tracking server on it with
basic auth and its artifacts proxied to the S3 server (moto's), the run store on that S3 server, and two Prefect
process workers from the repo's ``prefect.yaml``. Campaigns are triggered through the Prefect API, as the UI
does.

One stack for the module; the tests run in order and the last one kills a worker:
- unauthenticated requests to the Prefect and MLflow servers are refused (401), and the campaign with credentials
  works;
- two triggers of the one-GPU deployment never overlap although two workers poll; the first is a 2-iteration
  campaign whose MLflow server is restarted in the middle, the second ``campaign.shards=8`` over 3 iterations
  against the 20 connections; both complete on workers, every stage is committed on S3, each MLflow run is
  FINISHED with each (key, step) logged exactly once, and no server logged a pool or connection error;
- no secret of the stack is in the run store, the logs, MLflow or the flow runs' parameters;
- a worker SIGKILLed mid-campaign (its flow-run process with it) leaves the flow run Crashed (docker/automations.yaml
  notices the missing heartbeats); the UI's Retry resumes it on the other worker at the first uncommitted stage.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from conftest import TINY, free_port, moto_server, postgres_server

from solrl.stages.pipeline import campaign_plan
from solrl.storage.runs import open_run
from solrl.storage.stage import read_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The tiny run's overrides as the UI form's ``overrides`` list (iterations come as their own parameter).
OVERRIDES = [o for o in TINY if not o.startswith("campaign.iterations")] + ["campaign.stage_retries=0"]
#: The automation's window in the tests: the workers' heartbeat (30 s, Prefect's least) plus 10 s.
CRASH_WITHIN = 40


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[:3]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never answered:\n{log.read_text()[-3000:]}")


def _start(args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        env=env,
        cwd=cwd,
        stdout=open(log, "a"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL of the process group (a worker's flow runs with it) after ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Stack:
    """The running stack: its servers' URLs, the secrets, each process, and the environment of a user."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen] = {}
        self.secrets: dict[str, str] = {}

    def log_text(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.logs.glob("*.log")))

    def tail(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.logs.glob("*.log"))
        )

    def start_mlflow(self) -> None:
        log = self.logs / "mlflow.log"
        self.procs["mlflow"] = _start(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.mlflow_port),
                "--app-name",
                "basic-auth",
            ],
            self.mlflow_env,
            log,
        )
        _wait(f"{self.mlflow}/health", self.procs["mlflow"], log)

    def start_worker(self, name: str) -> None:
        command = [str(BIN / "prefect"), "worker", "start", "--pool", "solrl", "--type", "process", "--name", name]
        self.procs[name] = _start(command, self.worker_env, self.logs / f"{name}.log", cwd=self.home)

    @contextlib.contextmanager
    def client(self):
        """A sync Prefect client of the stack's server, with the auth string (settings first: read when made)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_HOME, temporary_settings

        updates = {PREFECT_API_URL: self.api, PREFECT_API_AUTH_STRING: self.auth_string, PREFECT_HOME: str(self.home)}
        with temporary_settings(updates=updates), get_client(sync_client=True) as client:
            yield client

    def mlflow_client(self):
        """An MLflow client of the stack's server (the fixture set this process's MLflow credentials)."""
        import mlflow

        return mlflow.MlflowClient(tracking_uri=self.mlflow)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import boto3

    home = tmp_path_factory.mktemp("stack")
    stack = Stack(home)
    s3_key, s3_secret = "AKIASTACK" + secrets.token_hex(6).upper(), secrets.token_hex(20)
    stack.auth_string = f"solrl:{secrets.token_hex(12)}"
    stack.secrets = {"s3": s3_secret, "prefect": stack.auth_string, "mlflow": secrets.token_hex(12)}
    stack.secrets["mlflow-key"] = secrets.token_hex(16)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_", "MLFLOW_"))}
    base |= {"PYTHONUNBUFFERED": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    aws = {
        "AWS_ACCESS_KEY_ID": s3_key,
        "AWS_SECRET_ACCESS_KEY": s3_secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with contextlib.ExitStack() as closing:
        user_env = closing.enter_context(pytest.MonkeyPatch.context())  # this process reads the run store too
        pg = closing.enter_context(postgres_server(("prefect", "mlflow"), max_connections=20))
        stack.secrets["postgres"] = pg["password"]
        stack.pg_log = Path(pg["log"])
        endpoint = closing.enter_context(moto_server())
        aws["AWS_ENDPOINT_URL"] = endpoint
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            user_env.delenv(name, raising=False)
        for name, value in aws.items():
            user_env.setenv(name, value)
        user_env.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        user_env.setenv("MLFLOW_TRACKING_PASSWORD", stack.secrets["mlflow"])
        stack.bucket = f"solrl-{secrets.token_hex(6)}"
        boto3.client("s3", endpoint_url=endpoint, **_boto(aws)).create_bucket(Bucket=stack.bucket)
        stack.s3 = boto3.client("s3", endpoint_url=endpoint, **_boto(aws))
        db = f"{pg['user']}:{pg['password']}@{pg['host']}:{pg['port']}"

        # The Prefect server on PostgreSQL, its API behind the auth string.
        port = free_port()
        stack.api = f"http://127.0.0.1:{port}/api"
        server_env = base | {
            "PREFECT_HOME": str(home / "prefect-server"),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{db}/prefect",
            "PREFECT_SERVER_API_AUTH_STRING": stack.auth_string,
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
        log = stack.logs / "prefect-server.log"
        prefect_cli = str(BIN / "prefect")
        stack.procs["prefect-server"] = _start(
            [prefect_cli, "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env, log
        )
        closing.callback(lambda: _stop(stack.procs["prefect-server"]))

        # MLflow on PostgreSQL, basic auth, artifacts proxied to S3 (the server alone holds the S3 keys).
        stack.mlflow_port = free_port()
        stack.mlflow = f"http://127.0.0.1:{stack.mlflow_port}"
        auth_ini = home / "mlflow-auth.ini"
        text = (ROOT / "docker" / "mlflow-auth.ini").read_text()
        auth_ini.write_text(text.replace("sqlite:////var/lib/mlflow/", f"sqlite:///{home}/"))
        stack.mlflow_env = (
            base
            | aws
            | {
                "MLFLOW_BACKEND_STORE_URI": f"postgresql+psycopg2://{db}/mlflow",
                "MLFLOW_ARTIFACTS_DESTINATION": f"s3://{stack.bucket}/mlflow",
                "MLFLOW_SERVER_ALLOWED_HOSTS": f"127.0.0.1:{stack.mlflow_port},localhost:{stack.mlflow_port}",
                "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
                "MLFLOW_AUTH_ADMIN_USERNAME": "admin",
                "MLFLOW_AUTH_ADMIN_PASSWORD": stack.secrets["mlflow"],
                "MLFLOW_FLASK_SERVER_SECRET_KEY": stack.secrets["mlflow-key"],
            }
        )
        stack.start_mlflow()
        closing.callback(lambda: _stop(stack.procs["mlflow"]))
        _wait(f"{stack.api}/health", stack.procs["prefect-server"], log)

        # The work pool, prefect.yaml's deployment and the crashed-worker automation, as docker/compose.yaml's
        # deploy service makes them; the automation's window cut to CRASH_WITHIN for the test.
        user = base | {"PREFECT_API_URL": stack.api, "PREFECT_API_AUTH_STRING": stack.auth_string}
        user["PREFECT_HOME"] = str(home / "prefect-user")
        automations = yaml.safe_load((ROOT / "docker" / "automations.yaml").read_text())
        automations["automations"][0]["trigger"]["within"] = CRASH_WITHIN
        (home / "automations.yaml").write_text(yaml.safe_dump(automations))
        for command, cwd in (
            (["work-pool", "create", "solrl", "--type", "process", "--overwrite"], ROOT),
            (["--no-prompt", "deploy", "--all"], ROOT),
            (["automation", "create", "--from-file", str(home / "automations.yaml")], ROOT),
        ):
            done = subprocess.run(
                [prefect_cli, *command], env=user, cwd=cwd, capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

        # Two process workers: what a GPU node runs (docker/compose.yaml's worker environment).
        stack.worker_env = (
            user
            | aws
            | {
                "PREFECT_HOME": str(home / "prefect-worker"),
                "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
                "PREFECT_WORKER_QUERY_SECONDS": "2",
                "PREFECT_LOGGING_LEVEL": "INFO",
                "MLFLOW_TRACKING_URI": stack.mlflow,
                "MLFLOW_TRACKING_USERNAME": "admin",
                "MLFLOW_TRACKING_PASSWORD": stack.secrets["mlflow"],
                "SOLRL_CACHE": str(home / "cache"),
                "OMP_NUM_THREADS": "1",
            }
        )
        for name in ("worker-a", "worker-b"):
            stack.start_worker(name)
            closing.callback(lambda name=name: _stop(stack.procs[name]))
        yield stack


def _boto(aws: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": aws["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": aws["AWS_SECRET_ACCESS_KEY"]}


def _wait_final(client, flow_run_id, timeout: float = 900):
    deadline = time.time() + timeout
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert time.time() < deadline, f"flow run still {run.state}"
        time.sleep(1)


def _trigger(client, store: str, iterations: int, *extra: str):
    deployment = client.read_deployment_by_name("sol-rl/campaign")
    return client.create_flow_run_from_deployment(
        deployment.id, parameters={"overrides": [*OVERRIDES, *extra], "iterations": iterations, "store": store}
    )


def _committed(stack: Stack, store: str, run_id: str) -> dict[tuple[int, str], str]:
    run = open_run(store, run_id)
    return {
        (i, s): m.created
        for i, stages in campaign_plan(run.config)
        for s in stages
        if (m := read_manifest(run.run_dir, i, s)) is not None
    }


def _metric_steps(client, mlflow_run_id: str) -> dict[str, list[int]]:
    run = client.get_run(mlflow_run_id)
    return {k: sorted(m.step for m in client.get_metric_history(mlflow_run_id, k)) for k in run.data.metrics}


def test_the_servers_refuse_requests_without_credentials(stack: Stack):
    refused = httpx.post(f"{stack.api}/flows/filter", json={})
    assert refused.status_code == 401
    wrong = httpx.post(f"{stack.api}/flows/filter", json={}, auth=("solrl", "not-it"))
    assert wrong.status_code == 401
    user, password = stack.auth_string.split(":", 1)
    assert httpx.post(f"{stack.api}/flows/filter", json={}, auth=(user, password)).status_code == 200
    search = f"{stack.mlflow}/api/2.0/mlflow/experiments/search"
    assert httpx.post(search, json={"max_results": 1}).status_code == 401
    assert httpx.post(search, json={"max_results": 1}, auth=("admin", "not-it")).status_code == 401
    assert httpx.post(search, json={"max_results": 1}, auth=("admin", stack.secrets["mlflow"])).status_code == 200
    # MLflow >= 3.5 checks the Host header (DNS rebinding): a name it was not given is refused, credentials or not.
    rebound = httpx.post(
        search,
        json={"max_results": 1},
        auth=("admin", stack.secrets["mlflow"]),
        headers={"Host": "attacker.example"},
    )
    assert rebound.status_code == 403, rebound.status_code


def test_two_campaigns_on_two_workers_never_overlap_and_survive_an_mlflow_restart(stack: Stack):
    store = f"s3://{stack.bucket}/runs"
    with stack.client() as client:
        first = _trigger(client, store, 2)
        second = _trigger(client, store, 3, "campaign.shards=8")
        first_id = f"tiny-digits-{str(first.id)[:8]}"
        # Restart the MLflow server once the first campaign has logged its first stage to it.
        deadline = time.time() + 600
        while not _committed_explore(stack, first_id):
            assert time.time() < deadline and client.read_flow_run(first.id).state.is_final() is False, stack.tail()
            time.sleep(0.5)
        _stop(stack.procs["mlflow"], timeout=30)
        time.sleep(3)  # the server is down while the campaign logs
        stack.start_mlflow()
        final, queued = _wait_final(client, first.id), _wait_final(client, second.id)
        assert final.state.is_completed(), f"{final.state}\n{stack.tail()}"
        assert queued.state.is_completed(), f"{queued.state}\n{stack.tail()}"
        spans = sorted([(final.start_time, final.end_time), (queued.start_time, queued.end_time)])
        assert spans[0][1] <= spans[1][0], "two campaigns of the one-GPU deployment ran at once"
        assert final.work_pool_name == "solrl" and queued.work_pool_name == "solrl"
    workers = stack.log_text()
    assert str(first.id) in workers and str(second.id) in workers  # a worker submitted each
    second_id = f"tiny-digits-{str(second.id)[:8]}"
    mlflow = stack.mlflow_client()
    for run_id, iterations in ((first_id, 2), (second_id, 3)):
        run = open_run(store, run_id)
        assert run.config.campaign.iterations == iterations
        for iteration, stages in campaign_plan(run.config):
            for stage in stages:
                assert read_manifest(run.run_dir, iteration, stage, verify=True), (run_id, iteration, stage)
        (found,) = mlflow.search_runs(
            [mlflow.get_experiment_by_name(run.config.tracking.experiment).experiment_id],
            f"tags.`solrl.run_id` = '{run_id}'",
        )
        assert found.info.status == "FINISHED"
        assert found.info.artifact_uri.startswith("mlflow-artifacts:"), found.info.artifact_uri  # proxied
        steps = _metric_steps(mlflow, found.info.run_id)
        for iteration, stages in campaign_plan(run.config):
            for stage in stages:
                assert iteration in steps[f"seconds/{stage}"], (run_id, stage, iteration)
        twice = {k: s for k, s in steps.items() if len(s) != len(set(s))}
        assert not twice, f"logged more than once: {twice}"
        listed = stack.s3.list_objects_v2(Bucket=stack.bucket, Prefix="mlflow/")
        assert any(found.info.run_id in o["Key"] for o in listed.get("Contents", [])), "no artifact reached S3"
    shards = run.config.campaign.shards
    assert shards == 8
    errors = re.compile(r"QueuePool limit|TooManyConnections|too many clients|remaining connection slots", re.I)
    assert not errors.search(stack.log_text()), "a pool or connection error"
    assert not errors.search(stack.pg_log.read_text()), "PostgreSQL refused a connection"


def _committed_explore(stack: Stack, run_id: str) -> bool:
    return bool(
        stack.s3.list_objects_v2(Bucket=stack.bucket, Prefix=f"runs/{run_id}/iter_000001/explore/").get("KeyCount")
    )


def test_no_secret_of_the_stack_is_in_the_store_the_logs_mlflow_or_the_flow_runs(stack: Stack):
    """After the campaigns above: the S3 bucket (run store and MLflow artifacts), every process's log, the flow
    runs' logs and parameters in Prefect, and the MLflow runs' params and tags hold none of the stack's secrets."""
    found = []
    values = {name: value.encode() for name, value in stack.secrets.items()}
    values["prefect-password"] = stack.auth_string.split(":", 1)[1].encode()

    def search(where: str, data: bytes) -> None:
        found.extend(f"{name} in {where}" for name, value in values.items() if value in data)

    keys = [
        o["Key"]
        for page in stack.s3.get_paginator("list_objects_v2").paginate(Bucket=stack.bucket)
        for o in page.get("Contents", [])
    ]
    assert any(k.startswith("runs/") for k in keys) and any(k.startswith("mlflow/") for k in keys)
    for key in keys:
        search(f"s3://{stack.bucket}/{key}", stack.s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read())
    for path in stack.logs.glob("*.log"):
        search(str(path), path.read_bytes())
    for path in (stack.home / "cache").rglob("*"):  # the workers' mirrors of the run store
        if path.is_file():
            search(str(path), path.read_bytes())
    from prefect.client.schemas.filters import LogFilter

    with stack.client() as client:
        runs = client.read_flow_runs(limit=200)
        assert runs
        for run in runs:
            search(f"flow run {run.name} parameters", repr(run.parameters).encode())
            logs = client.read_logs(LogFilter(flow_run_id={"any_": [run.id]}))
            search(f"flow run {run.name} logs", "\n".join(m.message for m in logs).encode())
    mlflow = stack.mlflow_client()
    for experiment in mlflow.search_experiments():
        for run in mlflow.search_runs([experiment.experiment_id]):
            search(f"MLflow run {run.info.run_name}", repr((run.data.params, run.data.tags)).encode())
    assert found == []


def _runner_of(stack: Stack, flow_run) -> str:
    """The worker whose process tree holds the flow run's process (its ``infrastructure_pid`` is host:pid)."""
    pid = int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1])
    for name in ("worker-a", "worker-b"):
        worker = psutil.Process(stack.procs[name].pid)
        if pid in {p.pid for p in worker.children(recursive=True)}:
            return name
    raise AssertionError(f"no worker runs pid {pid}")


def test_a_worker_killed_mid_campaign_crashes_its_run_and_a_retry_resumes_on_the_other_worker(stack: Stack):
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    store = f"s3://{stack.bucket}/runs"
    with stack.client() as client:
        flow_run = _trigger(client, store, 2)
        run_id = f"tiny-digits-{str(flow_run.id)[:8]}"
        deadline = time.time() + 600
        while True:  # until iteration 1's regenerate is committed: a campaign well under way
            run = client.read_flow_run(flow_run.id)
            assert not run.state.is_final() and time.time() < deadline, f"{run.state}\n{stack.tail()}"
            if run.infrastructure_pid and stack.s3.list_objects_v2(
                Bucket=stack.bucket, Prefix=f"runs/{run_id}/iter_000001/regenerate/_MANIFEST.json"
            ).get("KeyCount"):
                break
            time.sleep(0.5)
        victim = _runner_of(stack, run)
        survivor = ({"worker-a", "worker-b"} - {victim}).pop()
        worker = psutil.Process(stack.procs[victim].pid)
        for proc in [worker, *worker.children(recursive=True)]:  # the node is gone: the worker and its flow run
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        stack.procs[victim].wait()
        committed = _committed(stack, store, run_id)
        assert (1, "regenerate") in committed and (2, "checkpoint") not in committed

        crashed = _wait_final(client, flow_run.id, timeout=CRASH_WITHIN + 120)  # the automation, on heartbeats
        assert crashed.state.is_crashed(), f"{crashed.state}\n{stack.tail()}"
        client.set_flow_run_state(  # the Prefect UI's Retry button: the same flow run, AwaitingRetry
            flow_run.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=True
        )
        retried = _wait_final(client, flow_run.id)
        assert retried.state.is_completed(), f"{retried.state}\n{stack.tail()}"
        assert retried.run_count >= 2
    assert str(flow_run.id) in (stack.logs / f"{survivor}.log").read_text()  # the other worker ran the retry
    after = _committed(stack, store, run_id)
    for key, created in committed.items():
        assert after[key] == created, f"{key} was recomputed"
    run = open_run(store, run_id)
    for iteration, stages in campaign_plan(run.config):
        for stage in stages:
            assert read_manifest(run.run_dir, iteration, stage, verify=True), (iteration, stage)
