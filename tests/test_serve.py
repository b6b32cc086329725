"""``solrl serve`` against a real ``prefect server start`` on loopback: a campaign triggered through the Prefect
API with parameters runs to completion; a run that failed in iteration 2, retried as the Prefect UI's Retry
button does (same flow run), continues without recomputing a committed stage."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import TINY, tiny_config

from solrl.stages.pipeline import campaign_plan
from solrl.storage.stage import FAULT_ENV, read_manifest

pytestmark = pytest.mark.slow

#: The tiny run's overrides, as the UI form's ``overrides`` list (iterations come as their own parameter).
OVERRIDES = [o for o in TINY if not o.startswith("campaign.iterations")] + ["campaign.stage_retries=0"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never answered")


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Prefect server and two `solrl serve` processes: deployment ``served`` and deployment ``faulty``,
    whose runs fail in iteration 2 right after select commits (``SOLRL_FAULT``), once."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
    env.pop(FAULT_ENV, None)
    prefect_cli = str(Path(sys.executable).with_name("prefect"))
    logs = home / "logs"
    logs.mkdir()
    server = subprocess.Popen(
        [prefect_cli, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=open(logs / "server.log", "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    serves: list[subprocess.Popen] = []
    try:
        _wait_healthy(api, server)
        solrl = [sys.executable, "-m", "solrl.cli", "serve"]
        for name, extra in (("served", {}), ("faulty", {FAULT_ENV: "2:select:committed:raise"})):
            serves.append(
                subprocess.Popen(
                    [*solrl, "--name", name],
                    env={**env, **extra},
                    stdout=open(logs / f"serve-{name}.log", "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        yield {"api": api, "home": str(home), "logs": str(logs), "env": env}
    finally:
        for proc in [*serves, server]:
            proc.terminate()
        for proc in [*serves, server]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


@contextlib.contextmanager
def _client(prefect: dict[str, str]):
    """A sync Prefect client of the test's server (settings first: the client reads them when made)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect["api"], PREFECT_HOME: prefect["home"]}):
        with get_client(sync_client=True) as client:
            yield client


def _deployment_ready(client, name: str, timeout: float = 120):
    deadline = time.time() + timeout
    while True:
        try:
            return client.read_deployment_by_name(f"sol-rl/{name}")
        except Exception:
            assert time.time() < deadline, f"deployment sol-rl/{name} never appeared"
            time.sleep(0.5)


def _wait_final(client, flow_run_id, timeout: float = 600):
    deadline = time.time() + timeout
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert time.time() < deadline, f"flow run still {run.state}"
        time.sleep(0.5)


def _logs(prefect: dict[str, str]) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(Path(prefect["logs"]).glob("*.log")))


def test_a_campaign_triggered_through_the_api_with_parameters_runs_to_completion(prefect, tmp_path: Path):
    store = tmp_path / "store"
    with _client(prefect) as client:
        deployment = _deployment_ready(client, "served")
        form = deployment.parameter_openapi_schema["properties"]
        assert {"config", "overrides", "iterations", "run_id", "store"} <= set(form)
        assert form["iterations"]["anyOf"][0]["minimum"] == 1  # validated by the UI form and the API
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "ENQUEUE"  # solrl serve --on-busy wait
        flow_run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"overrides": OVERRIDES, "iterations": 2, "run_id": "served", "store": str(store)},
        )
        second = client.create_flow_run_from_deployment(  # triggered while the first runs: it must wait
            deployment.id, parameters={"overrides": OVERRIDES, "iterations": 1, "store": str(tmp_path / "second")}
        )
        final, queued = _wait_final(client, flow_run.id), _wait_final(client, second.id)
        assert final.state.is_completed(), f"{final.state}\n{_logs(prefect)}"
        assert queued.state.is_completed(), f"{queued.state}\n{_logs(prefect)}"
        first_span, second_span = sorted([(final.start_time, final.end_time), (queued.start_time, queued.end_time)])
        assert first_span[1] <= second_span[0], "two campaigns of one deployment ran at once"
    for iteration, stages in campaign_plan(tiny_config(store)):
        for stage in stages:
            assert read_manifest(store / "served", iteration, stage, verify=True), (iteration, stage)


def test_a_run_failed_in_iteration_2_and_retried_from_the_ui_does_not_redo_committed_stages(prefect, tmp_path):
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    store = tmp_path / "store"
    with _client(prefect) as client:
        deployment = _deployment_ready(client, "faulty")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"overrides": OVERRIDES, "iterations": 2, "store": str(store)}
        )
        failed = _wait_final(client, flow_run.id)
        assert failed.state.is_failed(), f"{failed.state}\n{_logs(prefect)}"
        (run_dir,) = [p.parent for p in store.glob("*/run.json")]
        assert run_dir.name == f"tiny-digits-{str(flow_run.id)[:8]}"
        plan = campaign_plan(tiny_config(store))
        committed = {
            (i, s): m.created for i, stages in plan for s in stages if (m := read_manifest(run_dir, i, s)) is not None
        }
        assert (2, "select") in committed and (2, "regenerate") not in committed and (1, "checkpoint") in committed

        # The Prefect UI's Retry button: the same flow run, set to AwaitingRetry.
        client.set_flow_run_state(
            flow_run.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=True
        )
        retried = _wait_final(client, flow_run.id)
        assert retried.state.is_completed(), f"{retried.state}\n{_logs(prefect)}"
        assert retried.id == flow_run.id and retried.run_count >= 2
    assert [p.parent for p in store.glob("*/run.json")] == [run_dir]  # the same solrl run, continued
    for (iteration, stage), created in committed.items():
        assert read_manifest(run_dir, iteration, stage).created == created, f"{stage}[{iteration}] was redone"
    for iteration, stages in plan:
        for stage in stages:
            assert read_manifest(run_dir, iteration, stage, verify=True), (iteration, stage)
    shutil.rmtree(store)


def test_the_prefect_yaml_deploys_to_a_work_pool_whose_worker_runs_the_campaign(prefect, tmp_path: Path):
    """The README's path for a server with workers: work pool, `prefect deploy --all` of the repo's
    prefect.yaml, a process worker, a triggered campaign."""
    env, root = prefect["env"], Path(__file__).resolve().parents[1]
    prefect_cli = str(Path(sys.executable).with_name("prefect"))
    for command in (["work-pool", "create", "solrl", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
        done = subprocess.run([prefect_cli, *command], env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    worker = subprocess.Popen(
        [prefect_cli, "worker", "start", "--pool", "solrl"],
        env=env,
        cwd=tmp_path,
        stdout=open(Path(prefect["logs"]) / "worker.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with _client(prefect) as client:
            deployment = _deployment_ready(client, "campaign")
            assert deployment.work_pool_name == "solrl" and deployment.entrypoint == "solrl.flows.deployment.sol_rl"
            flow_run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"overrides": OVERRIDES, "iterations": 1, "store": str(tmp_path / "store")}
            )
            final = _wait_final(client, flow_run.id)
            assert final.state.is_completed(), f"{final.state}\n{_logs(prefect)}"
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    (run_dir,) = [p.parent for p in (tmp_path / "store").glob("*/run.json")]
    assert read_manifest(run_dir, 1, "checkpoint", verify=True)
