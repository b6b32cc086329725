"""Prefect flows: one Sol-RL iteration (a persisted task per stage) and the campaign over iterations.

Wiring only. Each task runs ``solrl.stages.pipeline.run_stage``, which commits the stage's outputs atomically
and skips a stage whose committed manifest matches its inputs hash: the cache key is (run id, iteration,
stage, inputs hash), kept in the run store, not in the Prefect database, so a campaign run again after a
crash resumes at the first stage without a manifest. Prefect's own result cache is off (``NO_CACHE``) so the
manifest is the one source of truth. Prefect runs on its embedded server unless ``PREFECT_API_URL`` is set.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from solrl.flows.progress import current as current_progress
from solrl.flows.progress import start as start_progress
from solrl.flows.runners import shard_submit_options, shard_task_runner
from solrl.stages.context import StageContext
from solrl.stages.pipeline import ITERATION, STAGES, campaign_plan, run_shard, run_stage, stage_shards
from solrl.stages.runnable import check_runnable
from solrl.stages.sharding import Shard
from solrl.storage.html_report import write_report
from solrl.storage.runs import open_run, run_lock
from solrl.storage.stage import stage_dir
from solrl.storage.tracking import Tracker

#: Logged to MLflow per iteration, by stage: (file or folder in the stage folder, artifact folder).
_ARTIFACTS = {
    "select": ("best_worst.png", "best_worst"),
    "evaluate": ("samples.png", "eval_samples"),
    "checkpoint": (".", "checkpoints"),
}


@task(task_run_name="{stage}[{iteration}]", cache_policy=NO_CACHE, persist_result=False, retry_delay_seconds=2)
def stage_task(store: str, run_id: str, iteration: int, stage: str) -> dict:
    """Run (or skip) one stage; returns its manifest as a dict."""
    run = open_run(store, run_id)
    ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
    manifest, skipped = run_stage(ctx, stage)
    logger = get_run_logger()
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
    task_run_name="{stage}[{iteration}] shard {index}/{count}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retry_delay_seconds=2,
)
def shard_task(store: str, run_id: str, iteration: int, stage: str, index: int, count: int) -> bool:
    """Run (or skip) shard ``index`` of ``count`` of a sharded stage (its prompts only, committed on its own, so
    a failed shard is retried alone); returns whether it was skipped."""
    run = open_run(store, run_id)
    ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
    manifest, skipped = run_shard(ctx, stage, Shard(index, count))
    if not skipped:
        get_run_logger().info(
            "iteration %d %s shard %d/%d: committed in %.2f s", iteration, stage, index + 1, count, manifest.seconds
        )
    return skipped


_TRACKERS: dict[str, Tracker] = {}


def _tracker(run) -> Tracker:
    """One MLflow tracker per run and process: opening MLflow's sqlite store costs about 0.7 s, which every
    iteration subflow paid before (8% of a tiny-digits iteration, ``bench/overhead.py``)."""
    key = str(run.run_dir)
    if key not in _TRACKERS:
        _TRACKERS[key] = Tracker(run)
    return _TRACKERS[key]


def _run_and_track(
    store: str, run_id: str, iteration: int, stage: str, tracker: Tracker, retries: int, parallel: bool = False
) -> dict:
    """Run (or skip) a stage, then log its artifacts and metrics to MLflow unless they already are: a process
    killed between the stage's commit and its logging is caught up on resume. ``seconds/<stage>``, logged in
    the last batch after the artifacts, marks the stage as logged."""
    progress = current_progress()
    if progress is not None:
        progress.stage_started(iteration, stage)
    run = open_run(store, run_id)
    shards = stage_shards(StageContext(run.config, run.run_dir, run_id, iteration, run.config_hash), STAGES[stage])
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
    timing = f"seconds/{stage}"
    if not result["skipped"] or not tracker.has_metric(timing, iteration):
        if stage in _ARTIFACTS:
            name, folder = _ARTIFACTS[stage]
            path = stage_dir(tracker.run_dir, iteration, stage) / name
            if path.exists():
                tracker.log_artifact(path, f"{folder}/iter_{iteration:06d}")
        tracker.log_metrics({**manifest["metrics"], timing: manifest["seconds"]}, step=iteration)
    return result


@flow(name="sol-rl-iteration", flow_run_name="{run_id}-iter{iteration}")
def sol_rl_iteration(
    store: str, run_id: str, iteration: int, stages: list[str], parallel_shards: bool = False
) -> dict[str, float]:
    """One Sol-RL iteration: its due ``stages`` in order (explore -> score -> select -> regenerate -> score ->
    [audit] -> update -> checkpoint -> [evaluate]); with ``parallel_shards``, a sharded stage's shards are
    submitted at once to the flow's task runner (``flows.runners``).

    Returns the metrics of the stages (skipped stages contribute their recorded metrics too).
    """
    run = open_run(store, run_id)
    tracker = _tracker(run)
    retries = run.config.campaign.stage_retries
    metrics: dict[str, float] = {}
    for stage in stages:
        result = _run_and_track(store, run_id, iteration, stage, tracker, retries, parallel_shards)
        metrics.update(result["manifest"]["metrics"])
    return metrics


def _log_report(run, tracker: Tracker) -> None:
    """The HTML report page and its figures to MLflow (``report/``), as ``solrl report --html`` writes them."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="solrl-report-") as tmp:
        for path in write_report(run, [s.name for s in ITERATION], campaign_plan(run.config), Path(tmp)):
            tracker.log_artifact(path, "report")


def _mark_stopped(tracker: Tracker, status: str, logger) -> None:
    """Best effort: the stop that is unwinding wins. A signal that lands inside an MLflow write can leave its
    sqlite database locked by the interrupted transaction (seen under SIGTERM on a busy machine); the status
    then stays RUNNING, and the next resume sets it anyway."""
    try:
        tracker.finish(status)
    except Exception as exc:  # noqa: BLE001 - never mask the stop being raised
        logger.warning("could not mark the MLflow run %s (%s: %s)", status, exc.__class__.__name__, exc)


@flow(name="sol-rl-campaign", flow_run_name="{run_id}")
def campaign(store: str, run_id: str) -> dict[str, float]:
    """All iterations of a run, after evaluating the starting policy (iteration 0), in the order of
    ``campaign_plan``. Resumable: run it again and committed stages are skipped. Checks first that this machine
    can run the config (``check_runnable``: ConfigError otherwise), and holds the run's lock so two processes
    never write one run."""
    run = open_run(store, run_id)
    check_runnable(run.config, run.prompts_sha256, run.weights)
    logger = get_run_logger()
    for warning in run.config.warnings():
        logger.warning(warning)
    (_, start), *iterations = campaign_plan(run.config)
    with run_lock(run.run_dir), shard_task_runner(run.config) as runner:
        iteration_flow = sol_rl_iteration if runner is None else sol_rl_iteration.with_options(task_runner=runner)
        tracker = _tracker(run)
        metrics: dict[str, float] = {}
        progress = start_progress(campaign_plan(run.config))
        try:
            for stage in start:
                result = _run_and_track(store, run_id, 0, stage, tracker, run.config.campaign.stage_retries)
                metrics |= result["manifest"]["metrics"]
            for iteration, stages in iterations:
                # No heartbeat thread per iteration subflow: the campaign's own heartbeat already tells the server
                # this process lives, and each subflow's thread cost up to 1 s to join at its end.
                with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                    metrics = iteration_flow(store, run_id, iteration, stages, runner is not None)
                logger.info(progress.summary(iteration))
        except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C; SIGTERM (Prefect raises its TerminationSignal)
            _mark_stopped(tracker, "KILLED", logger)
            raise
        except BaseException:
            _mark_stopped(tracker, "FAILED", logger)
            raise
        finally:
            progress.close()
        _log_report(run, tracker)
        tracker.finish()
    return metrics
