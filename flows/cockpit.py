"""What the Prefect UI shows of a campaign: tags that tell campaigns apart, clean state after a crash, and each
iteration's rankings and summary as Prefect artifacts.

Everything here is bookkeeping on the Prefect API, never the source of truth: the run store's manifests decide
what is committed. So every call is best effort: a Prefect API that refuses one logs a warning and the campaign
goes on.

- Every flow run and task run of a campaign carries the tag ``solrl-run:<run id>`` (and the campaign's own flow
  run ``solrl-preset:<preset>``), so the runs list filters by run and shows which preset a run trains.
- A process killed mid-stage (``kill -9``, an out-of-memory kill, a lost node) leaves its task runs "Running"
  forever: Prefect only learns that the flow run's process died. Holding the run's lock, the next attempt (the
  UI's Retry or ``solrl resume``) knows no other process runs this solrl run, so it marks what the dead attempt
  left running as Crashed, except the subflow-tracking task run Prefect uses to re-enter the interrupted
  iteration's flow run (no duplicate iteration subflow).
- Iterations whose stages are all committed are not entered again; Prefect's key for the next iteration's
  subflow is reserved as if they were, so a retry re-enters the interrupted iteration's flow run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from uuid import UUID

#: Tag prefixes (Prefect tags: free text; shown as chips in the runs lists).
RUN_TAG, PRESET_TAG = "solrl-run:", "solrl-preset:"


def run_tag(run_id: str) -> str:
    return f"{RUN_TAG}{run_id}"


def artifact_key(run_id: str, kind: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) for ``kind`` of run ``run_id``: one key per
    campaign and kind, so the Artifacts page shows each campaign's latest version."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    return f"{slug}-{kind}"


def _current_flow_run_id() -> UUID | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None


def tag_flow_run(tags: Sequence[str], logger: logging.Logger) -> None:
    """Add ``tags`` to the current flow run (a deployment's run gets the deployment's tags only)."""
    from prefect.client.orchestration import get_client

    flow_run_id = _current_flow_run_id()
    if flow_run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run_id)
            wanted = list(dict.fromkeys([*current.tags, *tags]))
            if wanted != list(current.tags):
                client.update_flow_run(flow_run_id, tags=wanted)
    except Exception as exc:  # noqa: BLE001 - bookkeeping only (module doc)
        logger.warning("could not tag flow run %s (%s: %s)", flow_run_id, exc.__class__.__name__, exc)


def clear_dead_attempt(run_id: str, logger: logging.Logger) -> int:
    """Mark Crashed every flow run and task run of ``run_id`` that an earlier attempt left Pending or Running.

    Call only while holding the run's lock (``solrl.storage.runs.run_lock``): then no other live process runs
    stages of this run, so whatever Prefect still shows running belongs to a process that died. Spared: the
    current flow run and its parents, the subflow-tracking task runs of the current flow run and their subflow
    runs: Prefect re-enters a subflow run left Running under a Running tracking task run (the UI's Retry of the
    same flow run), and the campaign enters that iteration next; its dead stage task runs are marked. Returns
    how many runs were marked.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
        TaskRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    current = _current_flow_run_id()
    live = [StateType.PENDING, StateType.RUNNING]
    message = (
        f"the process running this attempt of solrl run {run_id} died; marked crashed by the next attempt, "
        "which continues from the run store's committed stages"
    )
    marked = 0
    try:
        with get_client(sync_client=True) as client:
            spared: set[UUID] = set()
            flow_run_id = current
            while flow_run_id is not None:  # the current flow run and its parents
                spared.add(flow_run_id)
                parent = client.read_flow_run(flow_run_id).parent_task_run_id
                flow_run_id = client.read_task_run(parent).flow_run_id if parent else None
            tagged = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)])), limit=200
            )
            # Tracking task runs of subflows in any state: the runner may have marked a subflow already.
            tracking = {fr.parent_task_run_id for fr in tagged if fr.parent_task_run_id is not None}
            flow_runs = [fr for fr in tagged if fr.state is not None and fr.state.type in live]
            task_runs = client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    tags=TaskRunFilterTags(all_=[run_tag(run_id)]),
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=live)),
                ),
                limit=200,
            )
            reentered = {t.id for t in task_runs if t.id in tracking and t.flow_run_id in spared}
            for task_run in task_runs:
                if task_run.id in reentered:
                    continue
                client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
                marked += 1
            for flow_run in flow_runs:
                if flow_run.id in spared or flow_run.parent_task_run_id in reentered:
                    continue
                client.set_flow_run_state(flow_run.id, Crashed(message=message), force=True)
                marked += 1
    except Exception as exc:  # noqa: BLE001 - bookkeeping only (module doc)
        logger.warning("could not clear the runs a dead attempt left running (%s: %s)", exc.__class__.__name__, exc)
    if marked:
        logger.info("marked %d flow or task run(s) that a dead attempt of %s left running as Crashed", marked, run_id)
    return marked


def reserve_subflow_key(subflow) -> None:
    """Advance the current flow run's call counter of ``subflow`` as calling it would, without a flow run.

    Prefect identifies a subflow call by (parent flow run, subflow, call number), and re-enters an interrupted
    subflow run on a retry only when the call numbers line up. A campaign that skips its committed iterations
    reserves their numbers here. Uses Prefect's own key function (``prefect._internal.engine``); where that is
    missing the retry still runs correctly, only as a new iteration flow run.
    """
    try:
        from prefect import Task
        from prefect._internal.engine import dynamic_key_for_task_run
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None:
            return
        tracking = Task(name=subflow.name, fn=subflow.fn, version=subflow.version)
        dynamic_key_for_task_run(context=ctx, task=tracking)
    except Exception:  # noqa: BLE001, S110 - a Prefect without these internals: see the docstring
        pass


def publish_iteration(
    run_dir: Path,
    run_id: str,
    iteration: int,
    stages: Sequence[str],
    logger: logging.Logger,
    *,
    report: Path | None = None,
    pool_fate: str | None = None,
    stop: str | None = None,
) -> None:
    """The iteration's artifacts, on the current flow run: ``<run>-rankings`` (a table of the kept seeds of every
    prompt: rank, explore reward against BF16 reward), ``<run>-summary`` (markdown: proxy fidelity, guards and the
    guard ``stop`` that ends the campaign here, evaluation, stage seconds, where the pool is stored and what
    retention will remove of it, ``pool_fate``) and, when ``report`` was written, ``<run>-report`` (a link to the
    HTML page). One key per campaign and kind: the Artifacts page lists each key's latest version."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from solrl.storage.stage import read_manifest
    from solrl.storage.summary import rankings, summary_markdown

    try:
        where = f"iteration {iteration} of {run_id}"
        if read_manifest(run_dir, iteration, "select") is not None:
            create_table_artifact(
                rankings(run_dir, iteration),
                key=artifact_key(run_id, "rankings"),
                description=f"Kept seeds per prompt, {where}: explore rank and reward against the BF16 reward",
            )
        line = f"HTML report (iteration {iteration}): `{report.resolve().as_uri()}`" if report else None
        create_markdown_artifact(
            summary_markdown(run_dir, run_id, iteration, stages, report=line, pool_fate=pool_fate, stop=stop),
            key=artifact_key(run_id, "summary"),
            description=f"Summary of {where}",
        )
    except Exception as exc:  # noqa: BLE001 - bookkeeping only (module doc)
        logger.warning("could not publish the artifacts of %s (%s: %s)", where, exc.__class__.__name__, exc)
    if report is not None:
        link_report(run_id, report, f"iteration {iteration}", logger)


def link_report(run_id: str, page: Path, when: str, logger: logging.Logger) -> None:
    """The ``<run>-report`` link artifact to the HTML ``page``, as of ``when`` (e.g. ``iteration 5``)."""
    from prefect.artifacts import create_link_artifact

    try:
        create_link_artifact(
            page.resolve().as_uri(),
            link_text=f"{run_id} report",
            key=artifact_key(run_id, "report"),
            description=f"The HTML report of {run_id}, {when}",
        )
    except Exception as exc:  # noqa: BLE001 - bookkeeping only (module doc)
        logger.warning("could not publish the report link of %s (%s: %s)", run_id, exc.__class__.__name__, exc)
