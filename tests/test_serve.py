"""``solrl serve`` against a real ``prefect server start`` on loopback, with one pair of campaigns (the
``campaigns`` fixture) for the module's tests: two campaigns triggered through the Prefect API with parameters,
the second while the first runs, run one at a time to completion, named and tagged so that a list tells them
apart, with each iteration's rankings and summary as artifacts and a described parameter form. The first is
SIGKILLed mid-update and retried as the Prefect UI's Retry button does (same flow run): it continues without
recomputing a committed stage, leaves no task run "Running" and no duplicate iteration subflow. The repo's
``prefect.yaml`` with process workers is ``tests/test_stack.py``'s (a Prefect server on PostgreSQL, two workers,
a killed worker retried)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import UI_OVERRIDES, free_port, tiny_config, wait_healthy
from fault_injection import FAULT_ENV, fault_env

from solrl.stages.pipeline import campaign_plan
from solrl.storage.stage import read_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Prefect server and `solrl serve --name served`, whose flow-run process SIGKILLs itself in iteration 2
    while update writes (``fault_injection``), once."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the flow runs' own log lines reach the API (the tests read them)
    env.pop(FAULT_ENV, None)
    env["PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS"] = "2"  # a queued trigger's poll (30 s default)
    # The runner's look for scheduled flow runs (10 s default), as test_stack's workers query each 2 s: a trigger
    # and the Retry each waited up to 10 s to start.
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"
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
    serve = None
    try:
        wait_healthy(f"{api}/health", server)
        serve = subprocess.Popen(
            [sys.executable, "-m", "solrl.cli", "serve", "--name", "served"],
            env={**env, **fault_env("2:update:write", once=home / "fault-fired")},
            stdout=open(logs / "serve.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        yield {"api": api, "home": str(home), "logs": str(logs), "env": env}
    finally:
        # The server last: a flow-run process that is ending sends its last log lines to it, and waits for them.
        for proc in (serve, server):
            if proc is None:
                continue
            proc.terminate()
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


def _wait_until(client, flow_run_id, done, what: str, prefect: dict[str, str], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not done(client.read_flow_run(flow_run_id).state):
        assert time.time() < deadline, f"{what}\n{_logs(prefect)}"
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


def _running_spans(client, flow_run_id) -> list[tuple]:
    """(start, end) of each time the flow run was Running, from its state history."""
    from prefect.client.schemas.objects import StateType

    states = sorted(client.read_flow_run_states(flow_run_id), key=lambda st: st.timestamp)
    return [(a.timestamp, b.timestamp) for a, b in zip(states, states[1:]) if a.type == StateType.RUNNING]


@pytest.fixture(scope="module")
def campaigns(prefect, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two campaigns of deployment ``served``, triggered through the API as the UI does:
    - ``first``: 2 iterations, the form's Run Name ``lr-sweep-1``, no run id (the flow run's is used). Its flow-run
      process is SIGKILLed while update[2] writes; once it is Crashed and ``second`` runs, the UI's Retry continues
      it (same flow run), after ``second`` as the deployment runs one campaign at a time;
    - ``second``: 1 iteration, run id ``served``, triggered while ``first`` runs: it waits for the slot.
    Returns the deployment, both final flow runs, the crashed state of ``first`` with its stale task runs and the
    stages it had committed, and the store."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    store = tmp_path_factory.mktemp("store")
    out: dict = {"store": store}
    with _client(prefect) as client:
        deployment = out["deployment"] = _deployment_ready(client, "served")
        first = client.create_flow_run_from_deployment(
            deployment.id,
            name="lr-sweep-1",  # the form's Run Name
            parameters={"overrides": UI_OVERRIDES, "iterations": 2, "store": str(store)},
        )
        _wait_until(client, first.id, lambda state: state.is_running(), "the first campaign never started", prefect)
        second = client.create_flow_run_from_deployment(  # triggered while the first runs: it must wait
            deployment.id,
            parameters={"overrides": UI_OVERRIDES, "iterations": 1, "run_id": "served", "store": str(store)},
        )
        out["crashed"] = _wait_final(client, first.id)
        run_id = out["first_id"] = f"tiny-digits-{str(first.id)[:8]}"
        plan = campaign_plan(tiny_config(store))
        out["committed"] = {
            (i, s): m.created
            for i, stages in plan
            for s in stages
            if (m := read_manifest(store / run_id, i, s)) is not None
        }
        out["stale"] = [tr.name for tr in _tagged(client, run_id)[1] if tr.state.type == StateType.RUNNING]
        started = lambda state: state.is_running() or state.is_final()  # noqa: E731
        _wait_until(client, second.id, started, "the queued campaign never started", prefect)
        client.set_flow_run_state(  # the Prefect UI's Retry button: the same flow run, AwaitingRetry
            first.id, State(type=StateType.SCHEDULED, name="AwaitingRetry", message="Retry from the UI"), force=True
        )
        out["second"], out["first"] = _wait_final(client, second.id), _wait_final(client, first.id)
        out["spans"] = {name: _running_spans(client, r.id) for name, r in (("first", first), ("second", second))}
        again = client.create_flow_run_from_deployment(  # the complete run again, asking for more iterations
            deployment.id,
            parameters={
                "overrides": UI_OVERRIDES,
                "base_overrides": ["campaign.iterations=5"],  # as `solrl serve --set` fills it in
                "iterations": 3,
                "run_id": "served",
                "store": str(store),
            },
        )
        out["again"] = _wait_final(client, again.id)
        out["again_logs"] = _flow_run_logs(client, again.id)
    return out


def _flow_run_logs(client, flow_run_id) -> str:
    from prefect.client.schemas.filters import LogFilter

    return "\n".join(m.message for m in client.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]})))


def test_the_form_describes_every_parameter_and_one_campaign_runs_at_a_time(campaigns):
    """The UI form describes and validates every parameter; a trigger while a campaign runs waits for it, and so
    does a retry: no two Running spans of the deployment's flow runs overlap."""
    deployment = campaigns["deployment"]
    form = deployment.parameter_openapi_schema["properties"]
    assert {"config", "overrides", "base_overrides", "iterations", "run_id", "store", "past_guard"} == set(form)
    for name, field in form.items():
        assert len(field.get("description") or "") > 20, f"the UI form does not describe {name!r}"
    assert form["iterations"]["anyOf"][0]["minimum"] == 1  # validated by the UI form and the API
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == "ENQUEUE"  # solrl serve --on-busy wait
    spans = campaigns["spans"]
    assert len(spans["first"]) == 2 and len(spans["second"]) == 1, spans  # killed and retried; once
    ordered = sorted([*spans["first"], *spans["second"]])
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])), f"two campaigns ran at once: {ordered}"
    assert ordered[1] == spans["second"][0], ordered  # the queued trigger ran before the retry


def test_both_campaigns_complete_named_tagged_and_committed(prefect, campaigns):
    """A Run Name given in the form is kept; the flow runs tell the campaigns apart (tags, iteration subflow
    names); every stage of both is committed and verifies."""
    first, second, store = campaigns["first"], campaigns["second"], campaigns["store"]
    assert first.state.is_completed(), f"{first.state}\n{_logs(prefect)}"
    assert second.state.is_completed(), f"{second.state}\n{_logs(prefect)}"
    first_id = campaigns["first_id"]
    assert first.name == "lr-sweep-1" and second.name != first.name  # the given name is kept
    assert {f"solrl-run:{first_id}", "solrl-preset:tiny-digits"} <= set(first.tags)
    assert {"solrl-run:served", "solrl-preset:tiny-digits"} <= set(second.tags)
    with _client(prefect) as client:
        for top, run_id, iterations in ((first, first_id, 2), (second, "served", 1)):
            flow_runs, task_runs = _tagged(client, run_id)
            flow_runs = [fr for fr in flow_runs if fr.id != campaigns["again"].id]  # a later trigger of "served"
            subflows = sorted(fr.name for fr in flow_runs if fr.id != top.id)
            assert subflows == [f"{run_id}-iter{i}" for i in range(1, iterations + 1)]  # one click from the top
            assert all(fr.parent_task_run_id is not None for fr in flow_runs if fr.id != top.id)
            assert "evaluate[0]" in {tr.name for tr in task_runs if tr.flow_run_id == top.id}
    assert sorted(p.parent.name for p in store.glob("*/run.json")) == sorted([first_id, "served"])
    for run_id, iterations in ((first_id, 2), ("served", 1)):
        for iteration, stages in campaign_plan(tiny_config(store, f"campaign.iterations={iterations}")):
            for stage in stages:
                assert read_manifest(store / run_id, iteration, stage, verify=True), (run_id, iteration, stage)


def test_each_iteration_publishes_its_rankings_and_summary_and_the_campaign_its_report(prefect, campaigns):
    store, run_id = campaigns["store"], campaigns["first_id"]
    with _client(prefect) as client:
        iteration_runs = {fr.name: fr.id for fr in _tagged(client, run_id)[0]}
        tables, summaries = _artifacts(client, f"{run_id}-rankings"), _artifacts(client, f"{run_id}-summary")
        assert [a.flow_run_id for a in tables] == [iteration_runs[f"{run_id}-iter1"], iteration_runs[f"{run_id}-iter2"]]
        assert [a.flow_run_id for a in summaries] == [a.flow_run_id for a in tables]
        rows = json.loads(tables[-1].data) if isinstance(tables[-1].data, str) else tables[-1].data
        assert len(rows) == 2 * 4  # 2 prompts x 4 kept seeds
        assert {"prompt", "kept_as", "seed", "explore_rank", "explore_reward", "bf16_reward"} <= set(rows[0])
        assert {r["kept_as"] for r in rows} == {"best", "worst"}
        assert all(isinstance(r["bf16_reward"], float) for r in rows)
        text = summaries[-1].data
        for part in (
            f"{run_id}, iteration 2",
            "## Guards",
            "Proxy fidelity",
            "fidelity/spearman",
            "Evaluation",
            "eval/digit_alignment",
            "Seconds per stage",
            "candidates.zarr",
            (store / run_id).as_uri(),
        ):
            assert part in text, part
        (report,) = _artifacts(client, f"{run_id}-report")  # the campaign's end (report_every 5 > 2 iterations)
        assert report.data == f"[{run_id} report]({(store / run_id / 'report' / 'report.html').as_uri()})"
        latest = {a.key for a in client.read_latest_artifacts()}
        assert {f"{run_id}-rankings", f"{run_id}-summary", "served-summary"} <= latest


def test_a_complete_run_triggered_again_says_so_and_names_only_what_this_trigger_set(campaigns):
    """The form's ``iterations`` cannot extend a stored run: a trigger of a complete run says it is complete, and
    the settings it ignores are this trigger's own, not the served ``base_overrides``."""
    again, logs = campaigns["again"], campaigns["again_logs"]
    assert again.state.is_completed(), logs
    assert "ignored ['campaign.iterations=3']" in logs, logs
    assert "run served is complete (1 iteration committed): nothing to do" in logs, logs


def test_a_run_killed_mid_update_and_retried_from_the_ui_leaves_no_stale_state(prefect, campaigns):
    """SIGKILL of the flow-run process while update[2] writes; the UI's Retry continues the run: no committed
    stage redone, the dead update[2] task run marked Crashed (none left Running), one subflow per iteration, and
    the log says in solrl's words what was kept."""

    crashed, first, run_id = campaigns["crashed"], campaigns["first"], campaigns["first_id"]
    assert crashed.state.is_crashed(), f"{crashed.state}\n{_logs(prefect)}"
    committed = campaigns["committed"]
    assert (2, "score_regenerate") in committed and (2, "update") not in committed
    assert "update[2]" in campaigns["stale"]  # what Prefect alone leaves behind
    assert first.id == crashed.id and first.run_count >= 2
    with _client(prefect) as client:
        flow_runs, task_runs = _tagged(client, run_id)
        assert not [r.name for r in [*flow_runs, *task_runs] if not r.state.is_final()], "left running"
        subflows = sorted(fr.name for fr in flow_runs if fr.id != first.id)
        detail = [(fr.name, fr.state.type.value, fr.parent_task_run_id) for fr in flow_runs]
        detail += [(tr.name, tr.state.type.value, tr.id, tr.dynamic_key) for tr in task_runs]
        assert subflows == [f"{run_id}-iter1", f"{run_id}-iter2"], detail  # iteration 2 re-entered, not doubled
        updates = sorted((tr.name, tr.state.type.value) for tr in task_runs if tr.name == "update[2]")
        assert updates == [("update[2]", "COMPLETED"), ("update[2]", "CRASHED")]
        names = [tr.name for tr in task_runs]
        assert names.count("explore[2]") == 1 and names.count("explore[1]") == 1  # committed: no task run again
        logs = _flow_run_logs(client, first.id)
    assert "committed stages are kept and not recomputed" in logs and "continuing at update[2]" in logs
    assert "ignored" not in logs  # nothing the retry was given would change the stored config
    for (iteration, stage), created in committed.items():
        assert read_manifest(campaigns["store"] / run_id, iteration, stage).created == created, f"{stage} redone"
