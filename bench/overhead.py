"""What orchestration costs: the same tiny-digits campaign through the Prefect flow and as a plain loop.

Both run the same stage functions (``solrl.stages.pipeline.run_stage``) on the same config, each in a fresh
process: ``loop`` calls them in ``campaign_plan`` order with nothing around them; ``flow`` is what ``solrl
run`` does (solrl's temporary Prefect server, the campaign flow with a task per stage and a subflow per
iteration, the run lock, MLflow logging of every stage's metrics and artifacts, the report at the end).
From the committed manifests (each stage's ``seconds`` and commit time) the table gives, per mode: seconds
from process start to the first stage (the flow with a new ``PREFECT_HOME`` and with a used one), wall seconds
per iteration (between the last commits of consecutive iterations, evaluation included), stage seconds per
iteration, and what the flow adds per iteration.

    .venv/bin/python bench/overhead.py --iterations 5            # about 3 minutes on 2 idle cores
    .venv/bin/python bench/overhead.py --iterations 5 --stack    # also on the server stack (Debian's postgresql)
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

SETTINGS = ["fidelity.audit_every=0"]


def child(mode: str, store: Path, iterations: int, started: float) -> None:
    """Run the campaign in this process (``mode`` loop or flow); print a JSON line of its timings."""
    if mode == "flow":  # as solrl run does: the temporary Prefect server starts while the rest loads
        from solrl.flows.server import start_early

        start_early()
    from solrl.config import load_config
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import campaign_plan, run_stage
    from solrl.storage.runs import create_run

    cfg = load_config("tiny-digits", [*SETTINGS, f"campaign.iterations={iterations}", f"storage.root={store}"])
    run = create_run(cfg, mode)
    if mode == "loop":
        for iteration, stages in campaign_plan(cfg):
            ctx = StageContext(cfg, run.run_dir, run.run_id, iteration, run.config_hash)
            for stage in stages:
                run_stage(ctx, stage)
    else:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        from solrl.flows.server import prefect_api
        from solrl.flows.sol_rl import campaign

        with prefect_api():
            campaign(str(run.run_dir.parent), run.run_id)
    print(json.dumps({"mode": mode, **timings(run.run_dir, cfg, started, time.time())}))


def timings(run_dir: Path, cfg, started: float, ended: float) -> dict[str, float]:
    """The table's columns for the finished run in ``run_dir``, from its manifests (each stage's seconds and
    commit time); ``started`` and ``ended`` in seconds since the epoch."""
    from solrl.stages.pipeline import campaign_plan
    from solrl.storage.stage import read_manifest

    iterations = cfg.campaign.iterations
    plan = campaign_plan(cfg)
    first = read_manifest(run_dir, 0, "evaluate")
    commits, seconds = {}, {}
    for iteration, stages in plan:
        manifests = [read_manifest(run_dir, iteration, s) for s in stages]
        commits[iteration] = max(datetime.fromisoformat(m.created).timestamp() for m in manifests)
        seconds[iteration] = sum(m.seconds for m in manifests)
    first_start = datetime.fromisoformat(first.created).timestamp() - first.seconds
    walls = [commits[i] - commits[i - 1] for i in range(1, iterations + 1)]
    return {
        "to_first_stage": first_start - started,
        "wall_per_iteration": sum(walls) / len(walls),
        "stage_per_iteration": sum(seconds[i] for i in range(1, iterations + 1)) / iterations,
        "after_last_stage": ended - commits[iterations],
        "total": ended - started,
    }


def on_the_stack(iterations: int, home: Path) -> dict[str, float]:
    """The campaign on the server stack of ``tests/test_stack.py`` (PostgreSQL, the Prefect server on it, MLflow
    on it with S3 artifacts, the run store on moto's S3 server), run by one process worker; triggered through
    the Prefect API, timed from the trigger to the flow run's end."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_stack import running_stack

    from solrl.config import load_config
    from solrl.storage.runs import open_run

    with running_stack(home, workers=("worker",), worker_threads=None) as stack:
        os.environ.update(stack.client_env)
        store = f"s3://{stack.bucket}/runs"
        with stack.client() as client:
            deployment = client.read_deployment_by_name("sol-rl/campaign")
            started = time.time()
            parameters = {"overrides": SETTINGS, "iterations": iterations, "store": store, "run_id": "stack"}
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
            while not (flow_run := client.read_flow_run(flow_run.id)).state.is_final():
                time.sleep(0.5)
            if not flow_run.state.is_completed():
                raise RuntimeError(f"the campaign on the stack ended {flow_run.state}:\n{stack.tail()}")
        run = open_run(store, "stack")
        cfg = load_config("tiny-digits", [*SETTINGS, f"campaign.iterations={iterations}", f"storage.root={store}"])
        return timings(run.run_dir, cfg, started, flow_run.end_time.timestamp())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument(
        "--stack", action="store_true", help="also the server stack (PostgreSQL, Prefect server, MLflow, S3, a worker)"
    )
    parser.add_argument("--child", choices=["loop", "flow"], help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.store, args.iterations, args.started)
        return
    results = {}
    # "flow, new Prefect home": its database is created and migrated first; "flow, used Prefect home": again.
    modes = (("loop", "loop"), ("flow, new Prefect home", "flow"), ("flow, used Prefect home", "flow"))
    with tempfile.TemporaryDirectory(prefix="solrl-overhead-") as tmp:
        env = {**os.environ, "PREFECT_HOME": str(Path(tmp) / "prefect"), "HF_HUB_OFFLINE": "1"}
        env.pop("PREFECT_API_URL", None)
        for index, (label, mode) in enumerate(modes):
            store = str(Path(tmp) / f"runs-{index}")
            command = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--store",
                store,
                "--iterations",
                str(args.iterations),
            ]
            started = time.time()
            out = subprocess.run(
                [*command, "--started", repr(started)], env=env, capture_output=True, text=True, check=True
            ).stdout
            results[label] = json.loads(out.strip().splitlines()[-1])
        if args.stack:
            results["flow on the server stack, a worker"] = on_the_stack(args.iterations, Path(tmp) / "stack")
    loop, flow = results["loop"], results["flow, used Prefect home"]
    # What the flow adds per iteration: its wall time beyond the stages' own seconds, less the loop's (the
    # stage seconds themselves differ between two runs by noise of the same size).
    added = (flow["wall_per_iteration"] - flow["stage_per_iteration"]) - (
        loop["wall_per_iteration"] - loop["stage_per_iteration"]
    )
    print(
        f"tiny-digits, {args.iterations} iterations (+ the starting evaluation), a fresh process per mode; "
        f"machine: {platform.machine()}, {os.cpu_count()} cores\n\n"
        "| mode | s to first stage | wall s / iteration | stage s / iteration | s after last stage | total s |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    for label, r in results.items():
        print(
            f"| {label} | {r['to_first_stage']:.1f} | {r['wall_per_iteration']:.2f} | "
            f"{r['stage_per_iteration']:.2f} | {r['after_last_stage']:.1f} | {r['total']:.1f} |"
        )
    print(
        f"\nwith a used Prefect home the flow adds {added:.2f} s per iteration beyond the stages' seconds "
        f"({added / loop['wall_per_iteration']:.1%} of the loop's iteration), "
        f"{flow['to_first_stage'] - loop['to_first_stage']:.1f} s before the first stage and "
        f"{flow['after_last_stage']:.1f} s after the last"
    )
    if args.stack:
        stack = results["flow on the server stack, a worker"]
        ratio = stack["wall_per_iteration"] / flow["wall_per_iteration"]
        print(
            f"on the server stack (timed from the API trigger) an iteration takes {stack['wall_per_iteration']:.2f} s "
            f"against {flow['wall_per_iteration']:.2f} s embedded ({ratio:.2f}x), "
            f"and the trigger reaches the first stage in {stack['to_first_stage']:.1f} s"
        )


if __name__ == "__main__":
    main()
