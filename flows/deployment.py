"""The deployment ``solrl serve`` serves: start or continue a campaign with parameters typed for the Prefect UI.

No ``from __future__ import annotations`` here: Prefect builds the UI form and validates a triggered run's
parameters from these annotations at run time, and pydantic must see them evaluated. The form's field
descriptions come from the ``Args:`` section of the flow's docstring (Prefect reads parameter descriptions
there, not from ``Annotated[..., Field(description=...)]``); ``tests/test_serve.py`` reads them back from the API.
"""

from typing import Annotated

from prefect import flow, get_run_logger
from prefect.states import State
from pydantic import Field

from solrl.flows.sol_rl import run_campaign
from solrl.stages.runnable import check_runnable


@flow(name="sol-rl")
def sol_rl(
    config: str | None = None,
    overrides: list[str] = [],  # noqa: B006 - Prefect copies parameters per run; a list shows as a list field in the UI form
    base_overrides: list[str] = [],  # noqa: B006
    iterations: Annotated[int | None, Field(ge=1)] = None,
    run_id: str | None = None,
    store: str | None = None,
    past_guard: bool = False,
) -> dict[str, float] | State:
    """Start or continue a Sol-RL campaign (FP4 explore, BF16 train): each iteration is a subflow run whose task
    runs are the persisted stages; its rankings and summary are this run's artifacts.

    A run id that exists in the store is continued exactly as ``solrl resume`` continues it: its stored config
    wins, and any override that would change it is logged as ignored. Without a run id the run is named after
    the preset and this flow run's id, so a Retry of this flow run continues the run its first attempt created:
    no committed stage is recomputed, whatever Prefect's Retry dialog says of task results. This flow run keeps
    the name given in the form; its tags name the solrl run and the preset.

    A campaign that a guard stops (``campaign.on_guard=stop``) ends in the state "Guard stop" (a Completed
    state), whose message says what alarmed, the checkpoint to export, and how to continue past it.

    Args:
        config: Preset name (configs/*.yaml, e.g. sol-rl) or a YAML path on the machine that runs the flow
            (empty: the default preset, as `solrl run` without a preset).
        overrides: Settings of this run, one section.key=value per item, as `solrl run --set` takes them, e.g.
            campaign.prompts_per_iteration=4 or explore.pool_size=64.
        base_overrides: The served config's own overrides (`solrl serve --set ...`), applied before overrides;
            leave as served.
        iterations: campaign.iterations: RL iterations of a new campaign (empty: the config's); a run that
            exists keeps its own.
        run_id: Continue this solrl run if it exists in the store, else start it under this id (empty: a new id,
            preset name and flow run id).
        store: Run store: a folder on the machine that runs the flow, or an object store URL such as
            s3://bucket/runs (empty: the config's storage.root).
        past_guard: Continue the run named by run_id past the guard stop (campaign.on_guard=stop) that ended it,
            as `solrl resume --past-guard` does; a new streak of alarms after it stops the run again.

    Raises:
        ConfigError: a bad config or override, this machine cannot run it, or past_guard for a run that no guard
            stopped.
    """
    from prefect.runtime import flow_run
    from prefect.states import Completed

    from solrl.config import ConfigError, changed_by, load_config
    from solrl.stages.guards import pass_guard_stop, run_guard_trip
    from solrl.stages.models import model_family
    from solrl.storage.runs import RUN_FILE, create_run, open_run, open_store, run_lock

    logger = get_run_logger()
    own = [*overrides, *([f"campaign.iterations={iterations}"] if iterations else [])]  # this trigger's settings
    extra = [*base_overrides, *own]
    cfg = load_config(config, [*extra, *([f"storage.root={store}"] if store else [])])
    store_ = open_store(cfg.storage.root)
    root = store_.address
    run_id = run_id or f"{cfg.name}-{str(flow_run.get_id())[:8]}"
    if store_.exists(f"{run_id}/{RUN_FILE}"):
        run = open_run(root, run_id)
        ignored = changed_by(run.config, own)  # not the served base_overrides: this user set none of them
        if ignored:
            logger.warning("run %s exists: continuing it with its stored config; ignored %s", run_id, ignored)
        from solrl.stages.context import StageContext
        from solrl.stages.pipeline import first_pending

        if first_pending(StageContext.of(run, 0)) is None and not past_guard:
            n = run.config.campaign.iterations
            logger.warning(
                "run %s is complete (%d iteration%s committed): nothing to do; a stored run keeps its "
                "campaign.iterations, so another campaign from its preset needs another run_id",
                run_id,
                n,
                "s" * (n != 1),
            )
        logger.info("continuing run %s in %s", run_id, root)
        if past_guard:
            with run_lock(run.run_dir):
                stop = pass_guard_stop(run)
            logger.info(
                "passing the guard stop at iteration %d (%s), recorded in run.json", stop.iteration, stop.measure
            )
    elif past_guard:
        raise ConfigError(f"past_guard: run {run_id!r} does not exist in {root}; there is no guard stop to pass")
    else:
        check_runnable(cfg)
        create_run(cfg, run_id, weights=model_family(cfg.model).weights_fingerprint(cfg.model))
        logger.info("created run %s in %s", run_id, root)
    metrics = run_campaign(root, run_id)
    trip = run_guard_trip(open_run(root, run_id))
    if trip is None:
        return metrics
    # The flow run's state says it in the UI's run list and on its page; the CLI exits 3 instead.
    message = f"{trip.message(run_id, root)}; from this form: run_id {run_id} with past_guard on"
    return Completed(name="Guard stop", message=message, data=metrics)
