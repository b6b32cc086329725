"""Guards that act (issue 21): alarms from committed metrics, the sustained-alarm rule, and a campaign that
stops at its first sustained alarm with its own exit code, the last good checkpoint exportable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from solrl.config import load_config
from solrl.stages.guards import GUARD_STOP_EXIT, evaluation_alarms, fidelity_alarm, guard_trip, iteration_alarms
from solrl.storage.stage import MANIFEST, stage_dir


def _commit(run_dir: Path, iteration: int, stage: str, metrics: dict[str, float]) -> None:
    """A committed manifest with no files: all the guards read is its metrics."""
    folder = stage_dir(run_dir, iteration, stage)
    folder.mkdir(parents=True)
    manifest = {"run_id": "r", "iteration": iteration, "stage": stage, "inputs_hash": "x", "files": {}}
    (folder / MANIFEST).write_text(json.dumps({**manifest, "metrics": metrics}))


def _evaluations(run_dir: Path, grid: list[float], diversity: list[float] | None = None) -> None:
    """Iteration 0 (the start: diversity 0.2, grid 0.001), then one evaluation per value of ``grid``."""
    diversity = diversity or [0.2] * len(grid)
    _commit(run_dir, 0, "evaluate", {"eval/diversity": 0.2, "eval/grid_energy": 0.001})
    for i, (g, d) in enumerate(zip(grid, diversity), start=1):
        _commit(run_dir, i, "evaluate", {"eval/diversity": d, "eval/grid_energy": g})


def _cfg(tmp_path: Path, *extra: str):
    return load_config("tiny-digits", [f"storage.root={tmp_path}", "campaign.guard_grid_min=0", *extra])


def test_alarms_compare_with_the_start_and_name_the_measure_and_by_how_much(tmp_path: Path):
    bounds = _cfg(tmp_path).campaign  # diversity below 70% of the start; grid above 3x it (and above 0)
    start = {"eval/diversity": 0.2, "eval/grid_energy": 0.001}
    assert evaluation_alarms({"eval/diversity": 0.15, "eval/grid_energy": 0.0029}, start, 4, bounds) == []
    assert evaluation_alarms({"eval/diversity": 0.1}, None, 0, bounds) == []  # the start itself
    diversity, grid = evaluation_alarms({"eval/diversity": 0.13, "eval/grid_energy": 0.004}, start, 4, bounds, 2)
    assert (diversity.measure, diversity.iteration, diversity.value) == ("diversity", 4, 0.13)
    assert diversity.bound == pytest.approx(0.14) and "35% below the starting policy's 0.2000" in diversity.message
    assert grid.measure == "grid_energy" and "4.0x the starting policy's" in grid.message
    assert "2-pixel patch period" in grid.message
    # A bound just under the start: the message keeps the figures that make it an alarm (it said "0% below ...
    # (alarm below 100% of it").
    close = _cfg(tmp_path, "campaign.guard_diversity=0.999").campaign
    (small,) = evaluation_alarms({"eval/diversity": 0.19964}, start, 4, close)
    assert "0.18% below the starting policy's 0.2000 (alarm below 99.9% of it" in small.message
    assert fidelity_alarm({"fidelity/spearman": 0.5}, None, 3) is None  # no bound set
    assert fidelity_alarm({"fidelity/spearman": 0.8}, 0.7, 3) is None
    low = fidelity_alarm({"fidelity/spearman": 0.5}, 0.7, 3)
    assert low is not None and low.measure == "proxy_fidelity" and "below fidelity.min_spearman=0.7" in low.message


def test_a_measure_must_alarm_at_patience_evaluations_in_a_row(tmp_path: Path):
    run_dir = tmp_path / "r"
    # grid alarms at 2, then 4 and 5 (3x the start is 0.003): 2 alone is not sustained at patience 2
    _evaluations(run_dir, [0.002, 0.004, 0.002, 0.005, 0.006, 0.007])
    cfg = _cfg(tmp_path, "campaign.guard_patience=2")
    assert guard_trip(run_dir, cfg, 4) is None
    trip = guard_trip(run_dir, cfg, 6)
    assert trip is not None and trip.measure == "grid_energy"
    assert trip.evaluated == [4, 5] and trip.iteration == 5 and trip.last_good == 3
    message = trip.message("r", "/store")
    assert "grid_energy alarmed at 2 evaluation(s) in a row (iteration 4, 5; campaign.guard_patience=2)" in message
    assert "ended at iteration 5's checkpoint" in message and "`solrl export r --iteration 3 --store /store`" in message
    first = guard_trip(run_dir, _cfg(tmp_path, "campaign.guard_patience=1"), 6)
    assert first is not None and first.iteration == 2 and first.last_good == 1
    third = guard_trip(run_dir, _cfg(tmp_path, "campaign.guard_patience=3"), 6)
    assert third is not None and third.evaluated == [4, 5, 6] and third.last_good == 3
    assert guard_trip(run_dir, _cfg(tmp_path, "campaign.guard_patience=4"), 6) is None
    # The stop at 5 passed (solrl resume --past-guard): a streak counts only the evaluations after it.
    assert guard_trip(run_dir, cfg, 6, passed=(5,)) is None  # 6 alone is not a streak of 2
    later = guard_trip(run_dir, _cfg(tmp_path, "campaign.guard_patience=1"), 6, passed=(2, 4))
    assert later is not None and later.evaluated == [5] and later.last_good == 4 and later.last_good_passed
    assert "iteration 4 (itself a guard stop, passed with --past-guard): `solrl export" in later.message("r", "/s")
    # An iteration where no stop was (a hand-edited run.json) passes nothing.
    for bogus in ((3,), (4,), (99,)):
        assert guard_trip(run_dir, cfg, 6, passed=bogus) == trip, bogus


def test_the_last_evaluation_is_summarised_against_the_start(tmp_path: Path):
    from solrl.stages.guards import evaluation_summary

    run_dir = tmp_path / "r"
    assert evaluation_summary(run_dir, 3) is None
    _evaluations(run_dir, [0.001, 0.0015], diversity=[0.19, 0.17])
    (stage_dir(run_dir, 2, "evaluate") / MANIFEST).unlink()  # not committed: the last evaluation is 1
    assert (
        evaluation_summary(run_dir, 3)
        == "iteration 1: diversity 0.190 (-5% vs start), grid energy 0.00100 (1.0x start)"
    )
    _evaluations(tmp_path / "same", [0.001], diversity=[0.1999])  # -0.05%: was printed "-0% vs start"
    assert "diversity 0.200 (±0% vs start)" in evaluation_summary(tmp_path / "same", 1)


def test_a_streak_from_the_first_evaluation_leaves_the_starting_policy_and_another_measure_resets_nothing(
    tmp_path: Path,
):
    run_dir = tmp_path / "r"
    # diversity alarms at 1 and 2 (below 0.14), grid only at 2: diversity's streak trips at patience 2
    _evaluations(run_dir, [0.001, 0.005, 0.001], diversity=[0.1, 0.1, 0.2])
    trip = guard_trip(run_dir, _cfg(tmp_path), 3)
    assert trip is not None and trip.measure == "diversity" and trip.last_good == 0
    assert "the starting policy (iteration 0, no checkpoint to export)" in trip.message("r", "/s")


def test_a_proxy_fidelity_alarm_counts_at_the_next_evaluation(tmp_path: Path):
    run_dir = tmp_path / "r"
    _commit(run_dir, 0, "evaluate", {"eval/diversity": 0.2})
    for i in range(1, 5):  # evaluation every 2 iterations: at 2 and 4
        _commit(run_dir, i, "score_regenerate", {"fidelity/spearman": 0.9 if i == 2 else 0.3 if i in (1, 4) else 0.9})
        if i % 2 == 0:
            _commit(run_dir, i, "evaluate", {"eval/diversity": 0.2})
    cfg = _cfg(tmp_path, "fidelity.min_spearman=0.6")
    trip = guard_trip(run_dir, cfg, 4)
    assert trip is not None and trip.measure == "proxy_fidelity"
    assert [a.iteration for a in trip.alarms] == [1, 4] and trip.evaluated == [2, 4] and trip.last_good == 0
    assert GUARD_STOP_EXIT not in (0, 1, 2, 130, 143)  # its own code


@pytest.mark.slow
def test_on_guard_stop_ends_the_unregularised_preset_at_its_first_sustained_alarm_and_its_last_good_checkpoint_exports(
    tmp_path: Path,
):
    """``sol-rl-unregularised`` (lr 1e-3, KL 1e-4) grows a patch-period grid within a few iterations. With the grid
    alarm's floor at 0 (its multiple of the start alone), ``on_guard=stop`` ends the campaign at the evaluation that
    completes 2 alarms in a row: the deployment's flow run in the state "Guard stop" and its summary saying so, exit 3
    at a resume, the measure and the last checkpoint before the alarm named, the MLflow run tagged, no later
    iteration begun. The resume stops at the same place without recomputing anything, and the last good checkpoint
    exports."""
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter
    from typer.testing import CliRunner

    from solrl.cli import app
    from solrl.flows.deployment import sol_rl
    from solrl.stages.pipeline import campaign_plan
    from solrl.storage.runs import open_run
    from solrl.storage.stage import MANIFEST, read_manifest, stage_dir

    store = tmp_path / "store"
    settings = ["campaign.on_guard=stop", "campaign.guard_grid_min=0", "campaign.iterations=4"]
    # Half the preset's prompts, pools and evaluation seeds (91 s -> 62 s alone): the grid energy still goes
    # 0.0006, 0.0013, 0.0035, 0.0036, so the alarm (3x the start) fires at 2 and 3 with the margins of the full size.
    settings += ["tracking.report_every=0", "campaign.prompts_per_iteration=4", "explore.pool_size=16"]
    settings += ["campaign.eval_seeds=4"]
    # Started from the Prefect UI's deployment: its flow run ends in the state "Guard stop", which says how to
    # pass it from the form; `solrl run` and `resume` exit 3 with the same line, naming the command.
    state = sol_rl(config="sol-rl-unregularised", overrides=settings, run_id="u", store=str(store), return_state=True)
    assert state.is_completed() and state.name == "Guard stop", state
    assert state.message.startswith("guard stop (campaign.on_guard=stop): grid_energy alarmed"), state.message
    assert state.message.endswith("--past-guard`; from this form: run_id u with past_guard on"), state.message
    run = open_run(str(store), "u")
    trip = guard_trip(run.run_dir, run.config, run.config.campaign.iterations)
    assert trip is not None and trip.measure == "grid_energy" and len(trip.evaluated) == 2
    stopped, last_good = trip.iteration, trip.last_good
    assert stopped < 4 and 1 <= last_good == trip.evaluated[0] - 1  # measured: alarms at 2 and 3, last good 1
    with get_client(sync_client=True) as client:  # the summary artifacts: the stopped iteration's says so first
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["u-summary"]}))
    summaries = {int(a.data.split("iteration ", 1)[1].split("\n", 1)[0]): a.data for a in found}
    assert sorted(summaries) == list(range(1, stopped + 1))
    guards = summaries[stopped].split("## Guards\n\n", 1)[1]
    assert guards.startswith(f"**The campaign stops here.** {state.message.split('; from this form')[0]}\n")
    assert all("stops here" not in summaries[i] for i in range(1, stopped))
    committed = {
        (i, s): read_manifest(run.run_dir, i, s).created
        for i, stages in campaign_plan(run.config)[: stopped + 1]
        for s in stages
    }
    result = CliRunner().invoke(app, ["resume", "u", "--store", str(store)])  # stops at the same place
    assert result.exit_code == GUARD_STOP_EXIT, result.output
    assert committed == {key: read_manifest(run.run_dir, *key).created for key in committed}  # nothing redone
    line = result.stderr.strip().splitlines()[-1]
    assert state.message == line.removeprefix("solrl: ") + "; from this form: run_id u with past_guard on"
    assert line.startswith("solrl: guard stop (campaign.on_guard=stop): grid_energy alarmed at 2 evaluation(s)")
    assert f"ended at iteration {stopped}'s checkpoint" in line and "x the starting policy's" in line
    assert "2-pixel patch period" in line
    assert f"evaluated:  iteration {stopped}: digit_alignment " in result.stdout and "x start)" in result.stdout
    assert read_manifest(run.run_dir, stopped, "checkpoint") is not None
    assert read_manifest(run.run_dir, stopped + 1, "explore") is None  # nothing of a later iteration
    tracked = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_runs(["1"])[0]
    assert tracked.info.status == "FINISHED" and tracked.data.tags["solrl.guard_stop"].startswith("guard stop")

    assert f"`solrl export u --iteration {last_good} --store {store}`" in line
    exported = CliRunner().invoke(
        app, ["export", "u", "--iteration", str(last_good), "--store", str(store), "--out", str(tmp_path / "lora")]
    )
    assert exported.exit_code == 0, exported.output
    assert f"iteration {last_good} written to" in exported.output and any((tmp_path / "lora").iterdir())

    assert read_manifest(run.run_dir, stopped + 1, "explore") is None
    listed = CliRunner().invoke(app, ["ls", "--store", str(store)], env={"COLUMNS": "200"})
    assert f"guard stop (iter {stopped}: evaluate)" in listed.stdout, listed.output
    manifest = stage_dir(run.run_dir, stopped - 1, "update") / MANIFEST
    manifest.rename(manifest.with_suffix(".aside"))  # as `solrl verify --redo` uncommits it: resume has work first
    listed = CliRunner().invoke(app, ["ls", "--store", str(store)], env={"COLUMNS": "200"})
    assert f"stopped after iter {stopped}: evaluate" in listed.stdout, listed.output
    manifest.with_suffix(".aside").rename(manifest)

    # After a look, the user lets the run go on: the stop is recorded as passed, nothing committed is recomputed,
    # and iteration 4's alarm is a streak of one after it (patience 2: a second would stop the run again, as
    # test_a_measure_must_alarm_at_patience_evaluations_in_a_row shows), so the campaign completes.
    assert line.endswith(f"To continue after a look: `solrl resume u --store {store} --past-guard`")
    passed = CliRunner().invoke(app, ["resume", "u", "--store", str(store), "--past-guard"])
    assert passed.exit_code == 0, passed.output
    assert f"passing the guard stop at iteration {stopped} (grid_energy), recorded in run.json" in passed.stdout
    run = open_run(str(store), "u")
    assert run.guards_passed == (stopped,)
    assert guard_trip(run.run_dir, run.config, 4, run.guards_passed) is None
    assert "grid_energy" in {a.measure for a in iteration_alarms(run.run_dir, run.config, 4)[4]}  # still alarming
    assert committed == {key: read_manifest(run.run_dir, *key).created for key in committed}
    listed = CliRunner().invoke(app, ["ls", "--store", str(store)], env={"COLUMNS": "200"})
    assert " complete " in listed.stdout, listed.output
    tracked = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}").search_runs(["1"])[0]
    assert tracked.data.tags["solrl.guards_passed"] == str(stopped)
