"""``solrl serve`` against a real ``prefect server start`` on loopback: a campaign triggered through the Prefect
API with parameters runs to completion, named and tagged so that a list tells campaigns apart, with each
iteration's rankings and summary as artifacts and a described parameter form; a run SIGKILLed mid-update,
retried as the Prefect UI's Retry button does (same flow run), continues without recomputing a committed stage,
leaves no task run "Running" and no duplicate iteration subflow. The repo's ``prefect.yaml`` with process workers
is ``tests/test_stack.py``'s (a Prefect server on PostgreSQL, two workers, a killed worker retried)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY, free_port, tiny_config, wait_healthy
from fault_injection import FAULT_ENV, fault_env

from solrl.stages.pipeline import campaign_plan
from solrl.storage.stage import read_manifest

pytestmark = pytest.mark.slow

#: The tiny run's overrides, as the UI form's ``overrides`` list (iterations come as their own parameter).
OVERRIDES = [o for o in TINY if not o.startswith("campaign.iterations")] + ["campaign.stage_retries=0"]


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Prefect server and two `solrl serve` processes: deployment ``served`` and deployment ``faulty``,
    whose flow-run process SIGKILLs itself in iteration 2 while update writes (``fault_injection``), once."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the flow runs' own log lines reach the API (the tests read them)
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
        wait_healthy(f"{api}/health", server)
        solrl = [sys.executable, "-m", "solrl.cli", "serve"]
        once = fault_env("2:update:write", once=home / "fault-fired")
        for name, extra in (("served", {}), ("faulty", once)):
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


def _tagged(client, run_id: str) -> tuple[list, list]:
    """(flow runs, task runs) carrying the campaign's tag ``solrl-run:<run_id>``."""
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

    tag = {"all_": [f"solrl-run:{run_id}"]}
    flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tag), limit=200)
    task_runs = client.read_task_runs(task_run_filter=TaskRunFilter(tags=tag), limit=200)
    return flow_runs, task_runs


def _artifacts(client, key: str) -> list:
    """Every version of artifact ``key``, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter

    found = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": [key]}))
    return sorted(found, key=lambda a: a.created)


def test_a_campaign_triggered_through_the_api_with_parameters_runs_to_completion(prefect, tmp_path: Path):
    """Also: the form describes every parameter; a Run Name given in the form is kept; the flow runs tell the
    campaigns apart (tags, iteration subflow names); each iteration publishes its rankings and summary."""
    store = tmp_path / "store"
    with _client(prefect) as client:
        deployment = _deployment_ready(client, "served")
        form = deployment.parameter_openapi_schema["properties"]
        assert {"config", "overrides", "base_overrides", "iterations", "run_id", "store"} == set(form)
        for name, field in form.items():
            assert len(field.get("description") or "") > 20, f"the UI form does not describe {name!r}"
        assert form["iterations"]["anyOf"][0]["minimum"] == 1  # validated by the UI form and the API
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "ENQUEUE"  # solrl serve --on-busy wait
        flow_run = client.create_flow_run_from_deployment(
            deployment.id,
            name="lr-sweep-1",  # the form's Run Name
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

        second_id = f"tiny-digits-{str(second.id)[:8]}"
        assert final.name == "lr-sweep-1" and queued.name != final.name  # the given name is kept
        assert {"solrl-run:served", "solrl-preset:tiny-digits"} <= set(final.tags)
        assert {f"solrl-run:{second_id}", "solrl-preset:tiny-digits"} <= set(queued.tags)
        for top, run_id, iterations in ((final, "served", 2), (queued, second_id, 1)):
            flow_runs, task_runs = _tagged(client, run_id)
            subflows = sorted(fr.name for fr in flow_runs if fr.id != top.id)
            assert subflows == [f"{run_id}-iter{i}" for i in range(1, iterations + 1)]  # one click from the top
            assert all(fr.parent_task_run_id is not None for fr in flow_runs if fr.id != top.id)
            assert "evaluate[0]" in {tr.name for tr in task_runs if tr.flow_run_id == top.id}
        iteration_runs = {fr.name: fr.id for fr in _tagged(client, "served")[0]}

        tables, summaries = _artifacts(client, "served-rankings"), _artifacts(client, "served-summary")
        assert [a.flow_run_id for a in tables] == [iteration_runs["served-iter1"], iteration_runs["served-iter2"]]
        assert [a.flow_run_id for a in summaries] == [a.flow_run_id for a in tables]
        rows = json.loads(tables[-1].data) if isinstance(tables[-1].data, str) else tables[-1].data
        assert len(rows) == 2 * 4  # 2 prompts x 4 kept seeds
        assert {"prompt", "kept_as", "seed", "explore_rank", "explore_reward", "bf16_reward"} <= set(rows[0])
        assert {r["kept_as"] for r in rows} == {"best", "worst"}
        assert all(isinstance(r["bf16_reward"], float) for r in rows)
        text = summaries[-1].data
        for part in (
            "served, iteration 2",
            "## Guards",
            "Proxy fidelity",
            "fidelity/spearman",
            "Evaluation",
            "eval/digit_alignment",
            "Seconds per stage",
            "candidates.zarr",
            (store / "served").as_uri(),
        ):
            assert part in text, part
        (report,) = _artifacts(client, "served-report")  # the campaign's end (report_every 5 > 2 iterations)
        assert report.data == f"[served report]({(store / 'served' / 'report' / 'report.html').as_uri()})"
        latest = {a.key for a in client.read_latest_artifacts()}
        assert {"served-rankings", "served-summary", f"{second_id}-summary"} <= latest
    for iteration, stages in campaign_plan(tiny_config(store)):
        for stage in stages:
            assert read_manifest(store / "served", iteration, stage, verify=True), (iteration, stage)


def test_a_run_killed_mid_update_and_retried_from_the_ui_leaves_no_stale_state(prefect, tmp_path):
    """SIGKILL of the flow-run process while update[2] writes; the UI's Retry continues the run: no committed
    stage redone, the dead update[2] task run marked Crashed (none left Running), one subflow per iteration, and
    the log says in solrl's words what was kept."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    store = tmp_path / "store"
    with _client(prefect) as client:
        deployment = _deployment_ready(client, "faulty")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"overrides": OVERRIDES, "iterations": 2, "store": str(store)}
        )
        killed = _wait_final(client, flow_run.id)
        assert killed.state.is_crashed(), f"{killed.state}\n{_logs(prefect)}"
        (run_dir,) = [p.parent for p in store.glob("*/run.json")]
        run_id = run_dir.name
        assert run_id == f"tiny-digits-{str(flow_run.id)[:8]}"
        plan = campaign_plan(tiny_config(store))
        committed = {
            (i, s): m.created for i, stages in plan for s in stages if (m := read_manifest(run_dir, i, s)) is not None
        }
        assert (2, "score_regenerate") in committed and (2, "update") not in committed
        stale = [tr.name for tr in _tagged(client, run_id)[1] if tr.state.type == StateType.RUNNING]
        assert "update[2]" in stale  # what Prefect alone leaves behind

        # The Prefect UI's Retry button: the same flow run, set to AwaitingRetry.
        client.set_flow_run_state(
            flow_run.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=True
        )
        retried = _wait_final(client, flow_run.id)
        assert retried.state.is_completed(), f"{retried.state}\n{_logs(prefect)}"
        assert retried.id == flow_run.id and retried.run_count >= 2
        flow_runs, task_runs = _tagged(client, run_id)
        assert not [r.name for r in [*flow_runs, *task_runs] if not r.state.is_final()], "left running"
        subflows = sorted(fr.name for fr in flow_runs if fr.id != flow_run.id)
        detail = [(fr.name, fr.state.type.value, fr.parent_task_run_id) for fr in flow_runs]
        detail += [(tr.name, tr.state.type.value, tr.id, tr.dynamic_key) for tr in task_runs]
        assert subflows == [f"{run_id}-iter1", f"{run_id}-iter2"], detail  # iteration 2 re-entered, not doubled
        updates = sorted((tr.name, tr.state.type.value) for tr in task_runs if tr.name == "update[2]")
        assert updates == [("update[2]", "COMPLETED"), ("update[2]", "CRASHED")]
        names = [tr.name for tr in task_runs]
        assert names.count("explore[2]") == 1 and names.count("explore[1]") == 1  # committed: no task run again
        from prefect.client.schemas.filters import LogFilter

        logs = "\n".join(m.message for m in client.read_logs(LogFilter(flow_run_id={"any_": [flow_run.id]})))
        assert "committed stages are kept and not recomputed" in logs and "continuing at update[2]" in logs
        assert "ignored" not in logs  # nothing the retry was given would change the stored config
    assert [p.parent for p in store.glob("*/run.json")] == [run_dir]  # the same solrl run, continued
    for (iteration, stage), created in committed.items():
        assert read_manifest(run_dir, iteration, stage).created == created, f"{stage}[{iteration}] was redone"
    for iteration, stages in plan:
        for stage in stages:
            assert read_manifest(run_dir, iteration, stage, verify=True), (iteration, stage)
    shutil.rmtree(store)
