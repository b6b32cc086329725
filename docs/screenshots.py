"""The site's screenshots, from a real tiny-digits campaign: ``make screenshots`` (a few minutes on 2 cores).

Starts a Prefect server and ``solrl serve`` on loopback, triggers one campaign through the deployment as the UI's
*Run* button does, serves its MLflow store with ``mlflow server``, then photographs in headless Chromium (Debian's
``chromium`` package):

- ``prefect-flow-run.png``: an iteration's flow run, its stages as task runs;
- ``prefect-rankings.png``: the iteration's rankings artifact;
- ``prefect-form.png``: the deployment's custom-run form;
- ``report.png``: the campaign's HTML report;
- ``mlflow-run.png``: the MLflow run's metrics;
- ``best-worst.png``: the last iteration's kept seeds, as the select stage drew them;
- ``show-pool.png``: ``solrl show`` of one prompt's pool (written by solrl itself, not photographed).

Everything runs in a temporary folder and on free loopback ports; nothing outside ``--out`` is written.

    .venv/bin/python docs/screenshots.py --out docs/images/screenshots
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
#: The campaign photographed: tiny-digits, small enough to finish in about a minute.
ITERATIONS = 5
#: No full-pool audit (its single points would fill the report's and MLflow's first screen).
OVERRIDES = ["campaign.prompts_per_iteration=4", "tracking.report_every=1", "fidelity.audit_every=0"]
RUN_ID = "docs-demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.time() > deadline:
                raise TimeoutError(f"{url} did not answer in {timeout:.0f} s") from None
            time.sleep(0.5)


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise SystemExit("screenshots need Debian's chromium: apt-get install chromium")
    return found


def photograph(url: str, out: Path, width: int = 1400, height: int = 900, wait_ms: int = 15000) -> None:
    """A ``width`` x ``height`` screenshot of ``url`` after ``wait_ms`` of (virtual) time for the page's scripts."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--use-angle=swiftshader",
                "--enable-unsafe-swiftshader",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--hide-scrollbars",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
    if not out.exists() or out.stat().st_size < 10_000:
        raise RuntimeError(f"chromium wrote no useful screenshot of {url}")
    print(f"wrote {out}")


def campaign(api: str, env: dict[str, str], store: Path, logs: Path) -> dict[str, str]:
    """Serve the deployment, trigger one campaign through it, wait for it; the ids the screenshots need."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter

    os.environ["PREFECT_API_URL"] = api
    serve = [str(BIN / "solrl"), "serve", "tiny-digits", "--limit", "1", "--on-busy", "wait"]
    with process(serve, env, logs / "serve.log"), get_client(sync_client=True) as client:
        deadline = time.time() + 180
        while True:
            try:
                deployment = client.read_deployment_by_name("sol-rl/campaign")
                break
            except Exception:
                if time.time() > deadline:
                    raise TimeoutError("deployment sol-rl/campaign never appeared") from None
                time.sleep(0.5)
        parameters = {"overrides": OVERRIDES, "iterations": ITERATIONS, "run_id": RUN_ID, "store": str(store)}
        top = client.create_flow_run_from_deployment(deployment.id, name="docs-demo", parameters=parameters)
        deadline = time.time() + 900
        while not (run := client.read_flow_run(top.id)).state.is_final():
            if time.time() > deadline:
                raise TimeoutError(f"the campaign is still {run.state}")
            time.sleep(1)
        if not run.state.is_completed():
            raise RuntimeError(f"the campaign ended {run.state}; see {logs / 'serve.log'}")
        iteration = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [f"{RUN_ID}-iter{ITERATIONS}"]}))
        rankings = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": [f"{RUN_ID}-rankings"]}))
        return {
            "deployment": str(deployment.id),
            "iteration": str(iteration[0].id),
            "rankings": str(sorted(rankings, key=lambda a: a.created)[-1].id),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images/screenshots"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    chromium()  # refuse before any work
    with tempfile.TemporaryDirectory(prefix="solrl-screenshots-") as tmp:
        work = Path(tmp)
        logs = work / "logs"
        logs.mkdir()
        store = work / "runs"
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {
            **os.environ,
            "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
        os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL")})
        server = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        with process(server, env, logs / "prefect.log") as prefect:
            wait_for(f"{api}/health", prefect)
            ids = campaign(api, env, store, logs)
            ui = f"http://127.0.0.1:{port}"
            photograph(f"{ui}/runs/flow-run/{ids['iteration']}", out / "prefect-flow-run.png", wait_ms=30000)
            photograph(f"{ui}/artifacts/artifact/{ids['rankings']}", out / "prefect-rankings.png", width=1600)
            photograph(f"{ui}/deployments/deployment/{ids['deployment']}/run", out / "prefect-form.png", height=1100)

        run_dir = store / RUN_ID
        photograph((run_dir / "report" / "report.html").as_uri(), out / "report.png", height=1500, wait_ms=5000)
        # The last iteration's kept seeds, as the select stage drew them (and the report embeds them).
        shutil.copyfile(run_dir / f"iter_{ITERATIONS:06d}" / "select" / "best_worst.png", out / "best-worst.png")

        tracking = json.loads((run_dir / "tracking.json").read_text())
        mlflow_port = free_port()
        mlflow_env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        mlflow = [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{store / 'mlflow.db'}",
        ]
        with process(mlflow, mlflow_env, logs / "mlflow.log") as server:
            ui = f"http://127.0.0.1:{mlflow_port}"
            wait_for(f"{ui}/health", server)
            experiment, run = tracking["experiment_id"], tracking["mlflow_run_id"]
            # ?workflowType=machine_learning: MLflow 3's Model training view (its UI opens in the GenAI view first)
            page = f"{ui}/#/experiments/{experiment}/runs/{run}/model-metrics?workflowType=machine_learning"
            photograph(page, out / "mlflow-run.png", width=1800, height=1100)

        subprocess.run(
            [str(BIN / "solrl"), "show", RUN_ID, "--store", str(store), "--iteration", str(ITERATIONS)]
            + ["--prompt", "0", "--out", str(out / "show-pool.png")],
            env=env,
            check=True,
        )


if __name__ == "__main__":
    main()
