"""The server stack of a team, natively on loopback: a throwaway PostgreSQL cluster (Debian's ``postgresql``,
``max_connections=20``), the Prefect server on it with its API auth string, the MLflow tracking server on it with
basic auth and its artifacts proxied to the S3 server (moto's), the run store on that S3 server, and two Prefect
process workers from the repo's ``prefect.yaml``. Campaigns are triggered through the Prefect API, as the UI
does.

One stack and one pair of campaigns (the ``campaigns`` fixture) for the module's tests:
- unauthenticated requests to the Prefect and MLflow servers are refused (401), a foreign Host header too (403);
- two triggers of the one-GPU deployment never overlap although two workers poll: a 1-iteration campaign whose
  MLflow server is restarted in the middle, then one of ``campaign.shards=8`` against the 20 connections; both
  complete on workers with every stage committed on S3, each MLflow run FINISHED with each (key, step) logged
  exactly once, and no server logs a pool or connection error;
- the second campaign's worker is SIGKILLed with its flow run mid-campaign: the flow run is marked Crashed
  (``docker/automations.yaml`` notices the missing heartbeats), and the UI's Retry resumes it on the other worker
  at the first uncommitted stage;
- no secret of the stack is in the run store, the logs, MLflow or the flow runs' parameters.
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
from conftest import UI_OVERRIDES, free_port, moto_server, postgres_server, wait_healthy

from solrl.stages.pipeline import campaign_plan
from solrl.storage.runs import open_run
from solrl.storage.stage import MANIFEST, read_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The automation's window in the tests: twice the workers' heartbeat (30 s, Prefect's least), so a flow-run process
#: starved of the two cores for half a minute is not taken for dead.
CRASH_WITHIN = 60


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
        self.logs.mkdir(parents=True)
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
        wait_healthy(f"{self.mlflow}/health", self.procs["mlflow"], log)

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
    with running_stack(tmp_path_factory.mktemp("stack")) as stack, pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        for name, value in stack.client_env.items():  # this process reads the run store and MLflow too
            env.setenv(name, value)
        yield stack


@contextlib.contextmanager
def running_stack(
    home: Path, workers: tuple[str, ...] = ("worker-a", "worker-b"), worker_threads: int | None = 1
) -> Iterator[Stack]:
    """The stack, started in ``home`` (logs in ``home/logs``) and stopped at the end, with ``workers`` each
    running its flow runs on ``worker_threads`` threads (None: torch's default); ``bench/overhead.py`` runs a
    campaign on it too. ``Stack.client_env`` is the environment of a user of its run store and MLflow."""
    import boto3

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
    # The servers' connection pools, a queued campaign's wait and MLflow's job runner (off) as docker/compose.yaml
    # ships them.
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    pools = {
        service: {k: v for k, v in compose[service]["environment"].items() if k.startswith(prefixes)}
        for service, prefixes in (
            ("prefect-server", ("PREFECT_SERVER_DATABASE_SQLALCHEMY_", "PREFECT_SERVER_DEPLOYMENTS_")),
            ("mlflow", ("MLFLOW_SQLALCHEMYSTORE_", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION")),
        )
    }
    with contextlib.ExitStack() as closing:
        pg = closing.enter_context(postgres_server(("prefect", "mlflow"), max_connections=20))
        stack.secrets["postgres"] = pg["password"]
        stack.pg_log, stack.pg = Path(pg["log"]), pg
        endpoint = closing.enter_context(moto_server())
        aws["AWS_ENDPOINT_URL"] = endpoint
        stack.client_env = aws | {
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": stack.secrets["mlflow"],
        }
        stack.bucket = f"solrl-{secrets.token_hex(6)}"
        stack.s3 = boto3.client("s3", endpoint_url=endpoint, **_boto(aws))
        stack.s3.create_bucket(Bucket=stack.bucket)
        db = f"{pg['user']}:{pg['password']}@{pg['host']}:{pg['port']}"

        # The Prefect server on PostgreSQL, its API behind the auth string.
        port = free_port()
        stack.api = f"http://127.0.0.1:{port}/api"
        server_env = (
            base
            | {
                "PREFECT_HOME": str(home / "prefect-server"),
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{db}/prefect",
                "PREFECT_SERVER_API_AUTH_STRING": stack.auth_string,
                "PREFECT_LOGGING_LEVEL": "WARNING",
            }
            | pools["prefect-server"]
        )
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
                "MLFLOW_WORKERS": "1",  # not 4 server processes on two cores
                "MLFLOW_AUTH_ADMIN_USERNAME": "admin",
                "MLFLOW_AUTH_ADMIN_PASSWORD": stack.secrets["mlflow"],
                "MLFLOW_FLASK_SERVER_SECRET_KEY": stack.secrets["mlflow-key"],
            }
            | pools["mlflow"]
        )
        stack.start_mlflow()
        closing.callback(lambda: _stop(stack.procs["mlflow"]))
        wait_healthy(f"{stack.api}/health", stack.procs["prefect-server"], log)

        # The work pool, prefect.yaml's deployment and the crashed-worker automation, as docker/compose.yaml's
        # deploy service makes them; the automation's window cut to CRASH_WITHIN for the test.
        user = base | {"PREFECT_API_URL": stack.api, "PREFECT_API_AUTH_STRING": stack.auth_string}
        user["PREFECT_HOME"] = str(home / "prefect-user")
        automations = yaml.safe_load((ROOT / "docker" / "automations.yaml").read_text())
        automations["automations"][0]["trigger"]["within"] = CRASH_WITHIN
        (home / "automations.yaml").write_text(yaml.safe_dump(automations))
        for command in (
            ["work-pool", "create", "solrl", "--type", "process", "--overwrite"],
            ["--no-prompt", "deploy", "--all"],  # the repo's prefect.yaml
            ["automation", "create", "--from-file", str(home / "automations.yaml")],
        ):
            done = subprocess.run(
                [prefect_cli, *command], env=user, cwd=ROOT, capture_output=True, text=True, timeout=300
            )
            if done.returncode != 0:
                raise RuntimeError(f"prefect {' '.join(command)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")

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
            }
        )
        if worker_threads is None:
            stack.worker_env.pop("OMP_NUM_THREADS", None)
        else:
            stack.worker_env["OMP_NUM_THREADS"] = str(worker_threads)
        for name in workers:
            stack.start_worker(name)
            # Idle at the end, a worker is given docker's 10 s stop grace: one that SIGINT left waiting kept a
            # run of this module 60 s longer.
            closing.callback(lambda name=name: _stop(stack.procs[name], timeout=10))
        yield stack


def _boto(aws: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": aws["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": aws["AWS_SECRET_ACCESS_KEY"]}


def _wait_state(client, flow_run_id, done, what: str, stack: Stack, timeout: float = 900):
    """The flow run once ``done(run)`` holds (polled each second)."""
    deadline = time.time() + timeout
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and done(run):
            return run
        assert time.time() < deadline, f"flow run still {run.state}, not {what}\n{stack.tail()}"
        time.sleep(1)


def _wait_final(client, flow_run_id, stack: Stack, timeout: float = 900):
    return _wait_state(client, flow_run_id, lambda r: r.state.is_final(), "final", stack, timeout)


def _committed(store: str, run_id: str) -> dict[tuple[int, str], str]:
    """When each committed stage of the run was committed, by (iteration, stage)."""
    run = open_run(store, run_id)
    return {
        (i, s): m.created
        for i, stages in campaign_plan(run.config)
        for s in stages
        if (m := read_manifest(run.run_dir, i, s)) is not None
    }


def _on_store(stack: Stack, key: str) -> bool:
    return bool(stack.s3.list_objects_v2(Bucket=stack.bucket, Prefix=key).get("KeyCount"))


def _runner_of(stack: Stack, flow_run) -> str:
    """The worker whose process tree holds the flow run's process (its ``infrastructure_pid`` is host:pid)."""
    pid = int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1])
    for name in ("worker-a", "worker-b"):
        worker = psutil.Process(stack.procs[name].pid)
        if pid in {p.pid for p in worker.children(recursive=True)}:
            return name
    raise AssertionError(f"no worker runs pid {pid}")


@pytest.fixture(scope="module")
def campaigns(stack: Stack) -> dict:
    """Two campaigns of the one-GPU deployment through the API, the second triggered while the first runs:
    - ``first``, 1 iteration; the MLflow server is stopped once its explore[1] is on the store and started
      again 3 s later;
    - ``second``, 1 iteration of ``campaign.shards=8`` (8 task runs at once, over 50 in all, against 20
      connections; a second iteration cost 45 s and added only more of the same); once its
      regenerate[1] is committed, the worker running it is SIGKILLed with its flow-run process (the node is
      gone), the automation marks the flow run Crashed, and the UI's Retry sends it to the other worker.
    Returns the flow runs, run ids, the killed and surviving workers, and the stages committed before the kill."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    store = f"s3://{stack.bucket}/runs"
    out: dict = {"store": store}
    with stack.client() as client:
        deployment = client.read_deployment_by_name("sol-rl/campaign")

        def trigger(iterations: int, *extra: str):
            parameters = {"overrides": [*UI_OVERRIDES, *extra], "iterations": iterations, "store": store}
            return client.create_flow_run_from_deployment(deployment.id, parameters=parameters)

        first = trigger(1)
        _wait_state(client, first.id, lambda r: r.state.is_running(), "running", stack)
        # A shard per prompt; pools of 4 and no audit, as the shards and their task runs are what it is for.
        many = ("campaign.prompts_per_iteration=8", "explore.pool_size=4", "select.k=2", "fidelity.audit_every=0")
        second = trigger(1, "campaign.shards=8", *many)
        first_id, second_id = (f"tiny-digits-{str(r.id)[:8]}" for r in (first, second))
        _wait_state(client, first.id, lambda r: _on_store(stack, f"runs/{first_id}/iter_000001/explore/"), "", stack)
        _stop(stack.procs["mlflow"], timeout=30)
        time.sleep(3)  # the campaign logs while its MLflow server is down
        stack.start_mlflow()
        out["first"] = _wait_final(client, first.id, stack)

        regenerated = f"runs/{second_id}/iter_000001/regenerate/{MANIFEST}"
        running = _wait_state(
            client, second.id, lambda r: bool(r.infrastructure_pid) and _on_store(stack, regenerated), "", stack
        )
        out["killed"] = _runner_of(stack, running)
        out["survivor"] = ({"worker-a", "worker-b"} - {out["killed"]}).pop()
        worker = psutil.Process(stack.procs[out["killed"]].pid)
        for proc in [worker, *worker.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        stack.procs[out["killed"]].wait()
        out["before_kill"] = _committed(store, second_id)
        out["crashed"] = _wait_final(client, second.id, stack, timeout=CRASH_WITHIN + 120)  # from the heartbeats
        client.set_flow_run_state(  # the Prefect UI's Retry button: the same flow run, AwaitingRetry
            second.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=True
        )
        out["second"] = _wait_final(client, second.id, stack)
    out["ids"] = {"first": first_id, "second": second_id}
    return out


def test_the_servers_refuse_requests_without_credentials(stack: Stack):
    # A minute per request: MLflow's first authenticated one (its user store, a PBKDF2 check) outlasted httpx's
    # 5 s default while the rest of the suite loaded the two cores.
    http = httpx.Client(timeout=60)
    refused = http.post(f"{stack.api}/flows/filter", json={})
    assert refused.status_code == 401
    wrong = http.post(f"{stack.api}/flows/filter", json={}, auth=("solrl", "not-it"))
    assert wrong.status_code == 401
    user, password = stack.auth_string.split(":", 1)
    assert http.post(f"{stack.api}/flows/filter", json={}, auth=(user, password)).status_code == 200
    search = f"{stack.mlflow}/api/2.0/mlflow/experiments/search"
    assert http.post(search, json={"max_results": 1}).status_code == 401
    assert http.post(search, json={"max_results": 1}, auth=("admin", "not-it")).status_code == 401
    assert http.post(search, json={"max_results": 1}, auth=("admin", stack.secrets["mlflow"])).status_code == 200
    # MLflow >= 3.5 checks the Host header (DNS rebinding): a name it was not given is refused, credentials or not.
    rebound = http.post(
        search,
        json={"max_results": 1},
        auth=("admin", stack.secrets["mlflow"]),
        headers={"Host": "attacker.example"},
    )
    assert rebound.status_code == 403, rebound.status_code
    http.close()


def test_the_campaigns_ran_on_the_workers_one_at_a_time_and_committed_every_stage_on_s3(stack: Stack, campaigns):
    first, second = campaigns["first"], campaigns["second"]
    assert first.state.is_completed(), f"{first.state}\n{stack.tail()}"
    assert second.state.is_completed(), f"{second.state}\n{stack.tail()}"
    assert first.end_time <= second.start_time, "two campaigns of the one-GPU deployment ran at once"
    assert first.work_pool_name == second.work_pool_name == "solrl"
    assert str(first.id) in stack.log_text() and str(second.id) in stack.log_text()  # a worker submitted each
    for name in ("first", "second"):
        run = open_run(campaigns["store"], campaigns["ids"][name])
        assert run.config.campaign.iterations == 1
        for iteration, stages in campaign_plan(run.config):
            for stage in stages:
                assert read_manifest(run.run_dir, iteration, stage, verify=True), (name, iteration, stage)


def test_each_mlflow_run_is_finished_with_every_metric_once_despite_the_server_restart(stack: Stack, campaigns):
    """Proxy mode: the runs' artifact URIs are ``mlflow-artifacts:``, and the artifacts are on S3 under the
    server's destination. The restart lost nothing and doubled nothing."""
    mlflow = stack.mlflow_client()
    server_log = (stack.logs / "mlflow.log").read_text()
    assert server_log.count("Uvicorn running on") == 2, "MLflow was not restarted"
    # The config's parameters in batches: one request each cost a campaign about 20 s here (a password check each).
    assert "/runs/log-parameter" not in server_log and "/runs/log-batch" in server_log
    listed = [o["Key"] for o in stack.s3.list_objects_v2(Bucket=stack.bucket, Prefix="mlflow/").get("Contents", [])]
    for name in ("first", "second"):
        run = open_run(campaigns["store"], campaigns["ids"][name])
        experiment = mlflow.get_experiment_by_name(run.config.tracking.experiment)
        (found,) = mlflow.search_runs([experiment.experiment_id], f"tags.`solrl.run_id` = '{run.run_id}'")
        assert found.info.status == "FINISHED"
        assert found.data.params["config_hash"] == run.config_hash and len(found.data.params) > 50
        assert found.info.artifact_uri.startswith("mlflow-artifacts:"), found.info.artifact_uri
        assert any(found.info.run_id in key for key in listed), "no artifact of the run reached S3"
        logged = _logged(stack, found.info.run_id)  # (key, step) -> rows in MLflow's tracking store
        for iteration, stages in campaign_plan(run.config):
            for stage in stages:
                assert (f"seconds/{stage}", iteration) in logged, (name, stage, iteration)
        assert set(found.data.metrics) == {key for key, _ in logged}
        twice = {pair: rows for pair, rows in logged.items() if rows != 1}
        assert not twice, f"logged more than once: {twice}"


def _logged(stack: Stack, mlflow_run_id: str) -> dict[tuple[str, int], int]:
    """How many metric rows MLflow's PostgreSQL store holds for each (key, step) of the run: one query, where
    the API would take a history request per key."""
    import psycopg2

    pg = stack.pg
    connection = psycopg2.connect(
        host=pg["host"], port=pg["port"], user=pg["user"], password=pg["password"], dbname="mlflow"
    )
    try:
        with connection.cursor() as cursor:
            query = "SELECT key, step, count(*) FROM metrics WHERE run_uuid = %s GROUP BY key, step"
            cursor.execute(query, (mlflow_run_id,))
            return {(key, step): rows for key, step, rows in cursor.fetchall()}
    finally:
        connection.close()


def test_dozens_of_task_runs_against_twenty_connections_give_no_pool_or_connection_error(stack: Stack, campaigns):
    """Prefect #6492 and #17344: a server's connection pool against a small ``max_connections``."""
    run = open_run(campaigns["store"], campaigns["ids"]["second"])
    assert run.config.campaign.shards == 8
    from prefect.client.schemas.filters import FlowRunFilter

    tasks: list = []
    with stack.client() as client:  # the campaign's flow run, its iteration subflows, and their task runs
        tag = {"all_": [f"solrl-run:{run.run_id}"]}
        flow_runs = FlowRunFilter(
            id={"any_": [r.id for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tag))]}
        )
        while page := client.read_task_runs(flow_run_filter=flow_runs, limit=200, offset=len(tasks)):  # 200 a page
            tasks.extend(page)
    shard_runs = {t.name for t in tasks if " shard " in t.name}
    for stage in ("evaluate[0]", "explore[1]", "regenerate[1]", "evaluate[1]"):  # each sharded stage as 8 task runs
        assert {f"{stage} shard {i:03d}-of-008" for i in range(8)} <= shard_runs, sorted(shard_runs)
    assert len(tasks) >= 50, len(tasks)
    errors = re.compile(r"QueuePool limit|TooManyConnections|too many clients|remaining connection slots", re.I)
    for name, text in (("a server", stack.log_text()), ("PostgreSQL", stack.pg_log.read_text())):
        found = errors.search(text)
        assert not found, f"{name} logged a pool or connection error: {text[found.start() - 1500 : found.end() + 500]}"


def test_a_killed_worker_leaves_its_run_crashed_and_the_retry_resumes_on_the_other_worker(stack: Stack, campaigns):
    """No committed stage recomputed: every manifest committed before the kill is the one the run ends with."""
    assert campaigns["crashed"].state.is_crashed(), f"{campaigns['crashed'].state}\n{stack.tail()}"
    assert campaigns["second"].run_count >= 2
    flow_run_id = str(campaigns["second"].id)
    survivor = (stack.logs / f"{campaigns['survivor']}.log").read_text()
    assert f"submitting flow run '{flow_run_id}'" in survivor  # the other worker ran the retry
    before = campaigns["before_kill"]
    assert (1, "regenerate") in before and (1, "evaluate") not in before  # the retry had stages to run
    after = _committed(campaigns["store"], campaigns["ids"]["second"])
    for key, created in before.items():
        assert after[key] == created, f"{key} was recomputed"


def test_no_secret_of_the_stack_is_in_the_store_the_logs_mlflow_or_the_flow_runs(stack: Stack, campaigns):
    """After the campaigns: the S3 bucket (run store and MLflow artifacts), every process's log, the workers'
    mirrors, the flow runs' logs and parameters in Prefect, and the MLflow runs' params and tags hold none of the
    stack's secrets."""
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
        assert len(runs) >= 2
        for run in runs:
            search(f"flow run {run.name} parameters", repr(run.parameters).encode())
            logs = client.read_logs(LogFilter(flow_run_id={"any_": [run.id]}))
            search(f"flow run {run.name} logs", "\n".join(m.message for m in logs).encode())
    mlflow = stack.mlflow_client()
    for experiment in mlflow.search_experiments():
        for run in mlflow.search_runs([experiment.experiment_id]):
            search(f"MLflow run {run.info.run_name}", repr((run.data.params, run.data.tags)).encode())
    assert found == []
