"""The deployment ``solrl serve`` serves: start or continue a campaign with parameters typed for the Prefect UI.

No ``from __future__ import annotations`` here: Prefect builds the UI form and validates a triggered run's
parameters from these annotations at run time, and pydantic must see them evaluated.
"""

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from pydantic import Field

from solrl.flows.sol_rl import campaign
from solrl.stages.runnable import check_runnable


@flow(name="sol-rl", flow_run_name="{config}")
def sol_rl(
    config: Annotated[str, Field(description="Preset name (configs/*.yaml) or a YAML path on the serving machine.")] = (
        "tiny-digits"
    ),
    overrides: Annotated[
        list[str], Field(description="section.key=value overrides, as solrl run --set takes them.")
    ] = [],  # noqa: B006 - Prefect copies parameters per run; a list shows as a list field in the UI form
    base_overrides: Annotated[
        list[str], Field(description="The served config's overrides (solrl serve --set), applied before overrides.")
    ] = [],  # noqa: B006
    iterations: Annotated[int | None, Field(ge=1, description="campaign.iterations (empty: the config's).")] = None,
    run_id: Annotated[
        str | None,
        Field(description="Continue this run if it exists, else start it under this id (empty: a new id)."),
    ] = None,
    store: Annotated[str | None, Field(description="Run store folder (empty: the config's storage.root).")] = None,
) -> dict[str, float]:
    """Start or continue a Sol-RL campaign: the flow ``solrl serve`` serves as a deployment, whose parameters the
    Prefect UI shows as a form.

    A run id that exists in the store is continued exactly as ``solrl resume`` continues it (its stored config
    wins; ``config``, ``overrides`` and ``iterations`` are then ignored, with a warning). Without a run id the
    run is named after the preset and this flow run's id, so a retry of the same flow run (the Prefect UI's
    Retry) finds the run its first attempt created and continues it: no committed stage is recomputed.

    Raises:
        ConfigError: a bad config or override, or this machine cannot run it.
    """
    from prefect.runtime import flow_run

    from solrl.config import load_config
    from solrl.stages.models import model_family
    from solrl.storage.runs import RUN_FILE, create_run

    logger = get_run_logger()
    extra = [*base_overrides, *overrides, *([f"campaign.iterations={iterations}"] if iterations else [])]
    cfg = load_config(config, [*extra, *([f"storage.root={store}"] if store else [])])
    root = Path(cfg.storage.root).expanduser().resolve()
    run_id = run_id or f"{cfg.name}-{str(flow_run.get_id())[:8]}"
    if (root / run_id / RUN_FILE).exists():
        if extra:
            logger.warning("run %s exists: continuing it with its stored config; ignored %s", run_id, extra)
        logger.info("continuing run %s in %s", run_id, root)
    else:
        check_runnable(cfg)
        create_run(cfg, run_id, weights=model_family(cfg.model).weights_fingerprint(cfg.model))
        logger.info("created run %s in %s", run_id, root)
    return campaign(str(root), run_id)
