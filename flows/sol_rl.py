"""Prefect flows: one Sol-RL iteration (a persisted task per stage) and the campaign over iterations.

Wiring only. Each task runs ``solrl.stages.pipeline.run_stage``, which commits the stage's outputs atomically
and skips a stage whose committed manifest matches its inputs hash: the cache key is (run id, iteration,
stage, inputs hash), kept in the run store, not in the Prefect database, so a campaign run again after a
crash resumes at the first stage without a manifest. Prefect's own result cache is off (``NO_CACHE``) so the
manifest is the one source of truth. Prefect runs on its embedded server unless ``PREFECT_API_URL`` is set.

Nesting: the campaign's flow run (``sol-rl-campaign``, or the deployment's ``sol-rl``) holds the starting
policy's evaluation as tasks and one subflow run per iteration (``<run id>-iter<N>``) whose task runs are the
stages. A campaign run again (the UI's Retry, ``solrl resume``) enters no flow or task run for what is
committed before its first pending stage: it logs what it skipped, catches MLflow up, and marks what a dead
attempt left running as Crashed (``solrl.flows.cockpit``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from solrl.flows import cockpit
from solrl.flows.progress import current as current_progress
from solrl.flows.progress import stage_notes
from solrl.flows.progress import start as start_progress
from solrl.flows.runners import shard_submit_options, shard_task_runner
from solrl.processes import disk_full, repeated_on_resume, stop_signal
from solrl.stages.context import StageContext
from solrl.stages.guards import GuardTrip, guard_trip
from solrl.stages.memory import UNCHECKED
from solrl.stages.pipeline import (
    ITERATION,
    STAGES,
    campaign_plan,
    first_pending,
    restore_pruned_inputs,
    run_shard,
    run_stage,
    stage_shards,
)
from solrl.stages.runnable import check_ready
from solrl.stages.sharding import Shard
from solrl.storage.artifacts import EvalSamples, Selection
from solrl.storage.html_report import REPORT_DIR, write_report
from solrl.storage.mirror import publish_folder
from solrl.storage.retention import after_iteration, pool_fate, prune_run
from solrl.storage.runs import Run, open_run, run_lock
from solrl.storage.stage import read_manifest, require, stage_dir
from solrl.storage.tracking import Tracker

#: Logged to MLflow per iteration, by stage: (file or folder in the stage folder, artifact folder).
_ARTIFACTS = {
    "select": (Selection.grid, "best_worst"),
    "evaluate": (EvalSamples.grid, "eval_samples"),
    "checkpoint": (".", "checkpoints"),
}


def _worth_retrying(task, task_run, state) -> bool:
    """Prefect's ``retry_condition_fn`` of the stage and shard tasks: a stage that failed because a disk is full
    (``solrl.processes.disk_full``) is not run again 2 s later on a disk as full (an update of hours, for
    nothing): the campaign fails at once, and ``solrl run`` says where space is short. Nor is one that failed on
    what its inputs determine: a reward's unusable scores (``RewardError``), or what ``repeated_on_resume`` names
    (a NaN loss or gradient norm, NaN samples, a committed input whose bytes changed), nor one whose process lost
    the run's lease (``LeaseLost``: another process runs it now)."""
    from solrl.stages.rewards.base import RewardError
    from solrl.storage.lease import LeaseLost

    error = state.data
    if isinstance(error, RewardError | LeaseLost):
        return False
    return not (isinstance(error, BaseException) and (disk_full(error) or repeated_on_resume(error)) is not None)


@task(
    task_run_name="{stage}[{iteration}]",
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_delay_seconds=2,
    retry_condition_fn=_worth_retrying,
)
def stage_task(store: str, run_id: str, iteration: int, stage: str) -> dict:
    """Run (or skip) one stage; returns its manifest as a dict."""
    run = open_run(store, run_id)
    ctx = StageContext.of(run, iteration)
    logger = get_run_logger()
    with stage_notes(logger):
        manifest, skipped = run_stage(ctx, stage)
    if skipped:
        logger.info(
            "iteration %d %s: committed manifest matches inputs %s, skipped",
            iteration,
            stage,
            manifest.inputs_hash[:12],
        )
    else:
        logger.info("iteration %d %s: committed in %.2f s", iteration, stage, manifest.seconds)
        for warning in manifest.info.get("warnings", []):
            logger.warning("iteration %d %s: %s", iteration, stage, warning)
    return {"manifest": manifest.model_dump(mode="json"), "skipped": skipped}


@task(
    task_run_name="{stage}[{iteration}] shard {index:03d}-of-{count:03d}",  # the shard's folder (Shard.name)
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_delay_seconds=2,
    retry_condition_fn=_worth_retrying,
)
def shard_task(store: str, run_id: str, iteration: int, stage: str, index: int, count: int) -> bool:
    """Run (or skip) shard ``index`` of ``count`` of a sharded stage (its prompts only, committed on its own, so
    a failed shard is retried alone); returns whether it was skipped."""
    run = open_run(store, run_id)
    ctx = StageContext.of(run, iteration)
    logger = get_run_logger()
    shard = Shard(index, count, STAGES[stage].block(ctx.cfg))
    with stage_notes(logger):
        manifest, skipped = run_shard(ctx, stage, shard)
    if not skipped:
        logger.info("iteration %d %s shard %s: committed in %.2f s", iteration, stage, shard.name, manifest.seconds)
    return skipped


_TRACKERS: dict[str, Tracker] = {}


def _tracker(run) -> Tracker:
    """One MLflow tracker per run and process: opening MLflow's sqlite store costs about 0.7 s, which every
    iteration subflow paid before (8% of an iteration of the default preset, ``bench/overhead.py``)."""
    key = str(run.run_dir)
    if key not in _TRACKERS:
        _TRACKERS[key] = Tracker(run)
    return _TRACKERS[key]


def _log_stage(tracker: Tracker, iteration: int, stage: str, manifest: dict, skipped: bool) -> None:
    """Log a stage's artifacts and metrics to MLflow unless they already are: a process killed between the
    stage's commit and its logging is caught up on resume. ``seconds/<stage>``, logged in the last batch after
    the artifacts, marks the stage as logged."""
    timing = f"seconds/{stage}"
    if skipped and tracker.has_metric(timing, iteration):
        return
    if stage in _ARTIFACTS:
        name, folder = _ARTIFACTS[stage]
        path = stage_dir(tracker.run_dir, iteration, stage) / manifest.get("prefix", "") / name
        if not path.exists() and manifest.get("prefix"):  # committed on another machine: fetch into the mirror
            path = require(tracker.run_dir, iteration, stage)[0] / name
        if path.exists():
            tracker.log_artifact(path, f"{folder}/iter_{iteration:06d}")
            if path.suffix == ".png":  # also MLflow's image view, with a step slider over the iterations
                tracker.log_image(path, folder, iteration)
    tracker.log_metrics({**manifest["metrics"], timing: manifest["seconds"]}, step=iteration)


def _catch_up(run: Run, iteration: int, stages: list[str], tracker: Tracker) -> dict[str, float]:
    """Stages committed before the campaign's first pending stage: no task run, only MLflow caught up and the
    progress counted. Returns their metrics."""
    progress = current_progress()
    metrics: dict[str, float] = {}
    for stage in stages:
        manifest = read_manifest(run.run_dir, iteration, stage)
        assert manifest is not None, f"{stage}[{iteration}] was committed a moment ago"  # first_pending says so
        data = manifest.model_dump(mode="json")
        _log_stage(tracker, iteration, stage, data, skipped=True)
        if progress is not None:
            progress.stage_done(iteration, stage, manifest.seconds, True, manifest.metrics)
        metrics |= manifest.metrics
    return metrics


def _run_and_track(
    store: str, run_id: str, iteration: int, stage: str, tracker: Tracker, retries: int, parallel: bool = False
) -> dict:
    """Run (or skip) a stage as a task run, then log it to MLflow (``_log_stage``)."""
    progress = current_progress()
    if progress is not None:
        progress.stage_started(iteration, stage)
    run = open_run(store, run_id)
    shards = stage_shards(StageContext.of(run, iteration), STAGES[stage])
    task = shard_task.with_options(retries=retries)
    if len(shards) > 1 and parallel:  # at once, on the flow's task runner (Dask, Ray: a process per shard)
        with shard_submit_options(run.config):
            futures = [task.submit(store, run_id, iteration, stage, s.index, s.count) for s in shards]
        for future in futures:
            future.result()  # the first shard that failed (after its retries) fails the stage
    elif len(shards) > 1:  # in order, in this process (one model in memory: threads would share it)
        for shard in shards:
            task(store, run_id, iteration, stage, shard.index, shard.count)
    result = stage_task.with_options(retries=retries)(store, run_id, iteration, stage)
    manifest = result["manifest"]
    if progress is not None:
        progress.stage_done(iteration, stage, manifest["seconds"], result["skipped"], manifest["metrics"])
    _log_stage(tracker, iteration, stage, manifest, result["skipped"])
    return result


def _write_report(run: Run) -> Path:
    """Rewrite the run store's HTML report and its figures (``<run>/report/``, uploaded too when the store is an
    object store); returns the page on this machine."""
    page = write_report(run, [s.name for s in ITERATION], campaign_plan(run.config), run.run_dir / REPORT_DIR)[0]
    publish_folder(run.run_dir, REPORT_DIR)
    return page


@flow(name="sol-rl-iteration", flow_run_name="{run_id}-iter{iteration}")
def sol_rl_iteration(
    store: str, run_id: str, iteration: int, stages: list[str], parallel_shards: bool = False, committed: int = 0
) -> dict[str, float]:
    """One Sol-RL iteration: its due ``stages`` in order (explore -> score -> select -> regenerate -> score ->
    [audit] -> update -> checkpoint -> [evaluate]); with ``parallel_shards``, a sharded stage's shards are
    submitted at once to the flow's task runner (``flows.runners``). The first ``committed`` stages were committed
    by an earlier attempt: they get no task run. Publishes the iteration's rankings, summary and (when due) the
    report link as Prefect artifacts.

    Returns the metrics of the stages (skipped stages contribute their recorded metrics too).
    """
    run = open_run(store, run_id)
    tracker = _tracker(run)
    retries = run.config.campaign.stage_retries
    logger = get_run_logger()
    if committed:
        logger.info(
            "iteration %d: %s committed by an earlier attempt (their manifests match their inputs): not run again",
            iteration,
            ", ".join(stages[:committed]),
        )
    metrics = _catch_up(run, iteration, stages[:committed], tracker)
    for stage in stages[committed:]:
        result = _run_and_track(store, run_id, iteration, stage, tracker, retries, parallel_shards)
        metrics.update(result["manifest"]["metrics"])
    every = run.config.tracking.report_every  # the campaign's end writes its own (``_log_report``)
    due = run.config.tracking.report and bool(every) and iteration % every == 0
    due = due and iteration < run.config.campaign.iterations
    trip = _guard_trip(run, iteration, stages)
    cockpit.publish_iteration(
        run.run_dir,
        run_id,
        iteration,
        stages,
        logger,
        report=_write_report(run) if due else None,
        pool_fate=pool_fate(run.config, iteration),
        stop=trip.message(run_id, run.store) if trip is not None else None,
    )
    return metrics


def _log_report(run, tracker: Tracker, logger) -> None:
    """The HTML report page and its figures into the run store (``<run>/report/``) and to MLflow
    (``report/``), as ``solrl report --html`` writes them; its link as the campaign's report artifact."""
    page = _write_report(run)
    for path in sorted(page.parent.iterdir()):
        tracker.log_artifact(path, "report")
    cockpit.link_report(run.run_id, page, "the campaign finished", logger)


def _stop_status(exc: BaseException) -> str:
    """The MLflow status of a campaign unwinding with ``exc``: KILLED for a stop, else FAILED. A stop is Ctrl-C or
    SIGTERM (which Prefect raises as its TerminationSignal), or any exception raised while handling one, or after
    solrl's signal handler fired: a stop landing inside Prefect's task setup surfaces as its own ``ValueError``."""
    if stop_signal(exc) is not None:  # the stop itself, or an error raised while handling it
        return "KILLED"
    cli = sys.modules.get("solrl.cli")  # its handlers are installed only where the CLI runs the campaign
    return "KILLED" if cli is not None and cli.stopped_by_signal() else "FAILED"


def _mark_stopped(tracker: Tracker, status: str, logger) -> None:
    """Best effort: the stop that is unwinding wins. A signal that lands inside an MLflow write can leave its
    sqlite database locked by the interrupted transaction (seen under SIGTERM on a busy machine); the status
    then stays RUNNING, and the next resume sets it anyway."""
    try:
        tracker.finish(status)
    except Exception as exc:  # noqa: BLE001 - never mask the stop being raised
        logger.warning("could not mark the MLflow run %s (%s: %s)", status, exc.__class__.__name__, exc)


def _skipped_line(plan: list[tuple[int, list[str]]], pending: tuple[int, str] | None) -> str | None:
    """solrl's own words for what a continued campaign does not recompute (None for a fresh campaign)."""
    counts = {i: _committed_count(i, stages, pending) for i, stages in plan}
    done = sum(counts.values())
    if not done:
        return None
    full = [i for i, stages in plan if counts[i] == len(stages)]
    where = "the whole campaign is committed" if pending is None else f"continuing at {pending[1]}[{pending[0]}]"
    return (
        f"{done} committed stages are kept and not recomputed (iterations fully committed: "
        f"{_ranges(full) or 'none'}); solrl trusts the run store's manifests, not Prefect's results, so what Prefect's "
        f"Retry dialog says of task runs without a persisted result does not apply; {where}"
    )


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def campaign_name(run: Run) -> str:
    """The name of a campaign's flow run: the run id, and the preset when the id does not start with it."""
    return run.run_id if run.run_id.startswith(run.config.name) else f"{run.run_id} ({run.config.name})"


def _campaign_flow_run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    return campaign_name(open_run(parameters["store"], parameters["run_id"]))


def run_campaign(store: str, run_id: str) -> dict[str, float]:
    """The body of a campaign, inside the current flow run (``campaign``, or the deployment's ``sol-rl``): all
    iterations of a run, after evaluating the starting policy (iteration 0), in the order of ``campaign_plan``.
    Resumable: run it again and committed stages are skipped. Checks first that this machine can run the config
    and that its memory plan fits the device (``check_ready``), ConfigError otherwise, and holds the run's lock so
    two processes never write one run."""
    run = open_run(store, run_id)
    memory = check_ready(run.config, run.prompts_sha256, run.weights)  # MemoryPlanError where the plan cannot fit
    logger = get_run_logger()
    (logger.warning if UNCHECKED in memory else logger.info)(memory)
    for warning in run.config.warnings():
        logger.warning(warning)
    plan = campaign_plan(run.config)
    (_, start), *iterations = plan
    with run_lock(run.run_dir, join=True), tags(cockpit.run_tag(run_id)), shard_task_runner(run.config) as runner:
        cockpit.tag_flow_run([cockpit.run_tag(run_id), f"{cockpit.PRESET_TAG}{run.config.name}"], logger)
        cockpit.clear_dead_attempt(run_id, logger)
        for iteration, stage in restore_pruned_inputs(StageContext.of(run, 0)):
            logger.info(
                "%s[%d] is redone first: a stage to run reads its output, which retention pruned", stage, iteration
            )
        pending = first_pending(StageContext.of(run, 0))
        if (line := _skipped_line(plan, pending)) is not None:
            logger.info(line)
        iteration_flow = sol_rl_iteration if runner is None else sol_rl_iteration.with_options(task_runner=runner)
        tracker = _tracker(run)
        if run.guards_passed:  # `solrl resume --past-guard`: the stop's solrl.guard_stop tag stays; this says it passed
            tracker.set_tag("solrl.guards_passed", ", ".join(map(str, run.guards_passed)))
        metrics: dict[str, float] = {}
        progress = start_progress(plan)
        try:
            committed = _committed_count(0, start, pending)
            metrics |= _catch_up(run, 0, start[:committed], tracker)
            for stage in start[committed:]:
                result = _run_and_track(store, run_id, 0, stage, tracker, run.config.campaign.stage_retries)
                metrics |= result["manifest"]["metrics"]
            for iteration, stages in iterations:
                committed = _committed_count(iteration, stages, pending)
                if committed == len(stages):
                    metrics = _catch_up(run, iteration, stages, tracker)
                    cockpit.reserve_subflow_key(sol_rl_iteration)
                else:
                    # No heartbeat thread per iteration subflow: the campaign's own heartbeat already tells the
                    # server this process lives, and each subflow's thread cost up to 1 s to join at its end.
                    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                        metrics = iteration_flow(store, run_id, iteration, stages, runner is not None, committed)
                    logger.info(progress.summary(iteration))
                if freed := after_iteration(run.config, run.run_dir, iteration):
                    logger.info(
                        "iteration %d: %.1f MiB of pool data pruned (storage.pool, keep_pools)",
                        iteration,
                        freed / 2**20,
                    )
                if _guard_stopped(run, iteration, stages, tracker, logger):
                    break
        except BaseException as exc:
            _mark_stopped(tracker, _stop_status(exc), logger)
            raise
        finally:
            progress.close()
        if freed := prune_run(run.config, run.run_dir):  # settings changed since earlier iterations ran
            logger.info("%.1f MiB of earlier iterations' pool data pruned (storage.pool, keep_pools)", freed / 2**20)
        if run.config.tracking.report:
            _log_report(run, tracker, logger)
        tracker.finish()
    return metrics


def _guard_trip(run: Run, iteration: int, stages: list[str]) -> GuardTrip | None:
    """The guard streak that ends the campaign after ``iteration`` under ``campaign.on_guard=stop`` (None: none,
    or the run does not stop at guards, or ``stages``, the iteration's, has no evaluation)."""
    if run.config.campaign.on_guard != "stop" or "evaluate" not in stages:
        return None
    return guard_trip(run.run_dir, run.config, iteration, run.guards_passed)


def _guard_stopped(run: Run, iteration: int, stages: list[str], tracker: Tracker, logger) -> bool:
    """Under ``campaign.on_guard=stop``, whether the evaluation of ``iteration`` completed a guard streak
    (``solrl.stages.guards.guard_trip``): then it logs why, tags the MLflow run ``solrl.guard_stop`` and the
    campaign ends here, cleanly. The verdict comes from the run store, so a resume stops at the same place."""
    trip = _guard_trip(run, iteration, stages)
    if trip is None:
        return False
    message = trip.message(run.run_id, run.store)
    logger.warning(message)
    tracker.set_tag("solrl.guard_stop", message)
    return True


def _committed_count(iteration: int, stages: list[str], pending: tuple[int, str] | None) -> int:
    """How many of ``iteration``'s leading ``stages`` come before the campaign's first pending stage."""
    if pending is None or iteration < pending[0]:
        return len(stages)
    if iteration > pending[0]:
        return 0
    return stages.index(pending[1])


@flow(name="sol-rl-campaign", flow_run_name=_campaign_flow_run_name)
def campaign(store: str, run_id: str) -> dict[str, float]:
    """A Sol-RL campaign: ``run_campaign`` as its own flow run, named after the run (``campaign_name``)."""
    return run_campaign(store, run_id)
