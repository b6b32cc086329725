"""The ``solrl`` command line: run, resume and list Sol-RL campaigns.

Bad input (missing or malformed config, unknown key, odd ``k``, unreadable prompt file, unknown precision,
unknown run) is one line on stderr, exit code 2, and nothing written.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from solrl.config import (
    ConfigError,
    RunConfig,
    list_presets,
    load_config,
    refuse_ignored_settings,
    validate_config,
)
from solrl.weights import check_published_weights

if TYPE_CHECKING:
    import pandas as pd  # imported where a command needs it: not at start-up

    from solrl.storage.runs import Run

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Sol-RL: FP4 explore, BF16 train. RL post-training of text-to-image flow models.",
)

StoreOption = Annotated[str, typer.Option("--store", help="Run store (the config's storage.root).")]
ConfigArgument = Annotated[
    str | None, typer.Argument(help=f"Preset name ({', '.join(list_presets())}) or YAML path.", show_default=False)
]
ForceOption = Annotated[
    bool,
    typer.Option(
        "--force", help="Start even where the memory plan does not fit the device (`solrl plan` shows the plan)."
    ),
]


#: The largest ``solrl plan --gpu`` taken, in GiB: far above any accelerator's memory, below sizes that mean a typo.
MAX_DEVICE_GIB = 4096.0


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"solrl: error: {message}", err=True)
    raise typer.Exit(code)


def _command(*words: object) -> str:
    from solrl.storage.runs import solrl_command

    return solrl_command(*words)


def _redo_hint(run_id: str, store: str, what: str) -> str:
    """How to recompute ``what`` (``it``, ``them``: stages that fail verification): uncommit, then resume."""
    return (
        f"`{_command('verify', run_id, '--store', store, '--redo')}` uncommits {what} and `solrl resume` redoes {what}"
    )


def _quiet_environment() -> None:
    """Defaults for a local, offline run; anything the user set wins. On a terminal, Prefect's console shows
    warnings only (the live progress line replaces its per-stage lines; the Prefect UI still gets them)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.stderr.isatty():
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so the same unwinding runs: the
    current stage's temporary folder is removed, MLflow and Prefect record the stop, the temporary Prefect
    server is stopped."""

    signal = signal.SIGTERM


_terminated = False
_interrupted = False


def stopped_by_signal() -> bool:
    """Whether this process's Ctrl-C or SIGTERM handler has fired: an exception unwinding now may be a library's
    wrapping of that stop (a Ctrl-C landing while Prefect sets up a task run surfaces as its ``ValueError``)."""
    return _interrupted or _terminated


def _stop_exit(exc: BaseException) -> int | None:
    """The exit status of the stop ``exc`` is, wraps or unwinds after (143 SIGTERM, 130 Ctrl-C), else None. While
    a flow runs Prefect's SIGTERM handler, not solrl's, takes the signal; it hands the signal back to solrl's
    unless its own crash handler fails first, so the exception chain is read too (``stop_signal``)."""
    from solrl.processes import stop_signal

    found = stop_signal(exc)
    if _terminated or found == signal.SIGTERM:
        return 143
    if _interrupted or found == signal.SIGINT:
        return 130
    return None


def _raise_terminated(signum: int, frame: object) -> None:
    global _terminated
    _terminated = True
    raise Terminated()


def _raise_interrupted(signum: int, frame: object) -> None:
    """Ctrl-C: Python's KeyboardInterrupt, remembered, since one that lands while Prefect sets up a task run
    surfaces as Prefect's own ``ValueError: Task run is not set`` (its crash handler fails in turn)."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt()


@contextlib.contextmanager
def _stoppable(resume: list[str]) -> Iterator[None]:
    """SIGTERM (exit 143) and Ctrl-C (exit 130) while a command checks and creates its run, before the campaign
    starts: one line, with how to continue when ``resume`` holds ``[run_id, store]`` and that run exists. A
    SIGTERM that lands inside a library (an import, a serializer) may surface wrapped in another exception: the
    flag tells."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except typer.Exit:
        raise
    except BaseException as exc:
        code = _stop_exit(exc)
        if code is None:
            raise
        created = resume and (Path(resume[1]) / resume[0] / "run.json").exists()
        _stopped(code, f"continue with `{_command('resume', resume[0], '--store', resume[1])}`" if created else "")


#: The exit statuses of a command a stop signal ended (``_stopped``): Ctrl-C, SIGTERM.
STOP_EXITS = (130, 143)


def _stopped(code: int, hint: str) -> None:
    """End a command that a stop signal interrupted: one line (``terminated (SIGTERM)`` for 143, ``interrupted``
    for 130, then ``hint`` when given) and exit status ``code``; ``main`` then bounds the process's exit."""
    _fail(("terminated (SIGTERM)" if code == 143 else "interrupted") + (f"; {hint}" if hint else ""), code)


def _start_prefect_early() -> None:
    """Start the temporary Prefect server in the background (unless PREFECT_API_URL is set) while the flow's
    modules load."""
    _quiet_environment()
    from solrl.flows.server import start_early

    start_early()


def _launch(store: str, run_id: str) -> None:
    _quiet_environment()
    from solrl.flows.progress import enable_live, plain_console
    from solrl.flows.server import prefect_api
    from solrl.flows.sol_rl import campaign

    enable_live(sys.stderr.isatty())
    signal.signal(signal.SIGTERM, _raise_terminated)  # also for callers without _stoppable
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell has it ignored
        signal.signal(signal.SIGINT, _raise_interrupted)
    resume = f"continue with `{_command('resume', run_id, '--store', store)}`"
    try:
        with prefect_api() as temporary, plain_console(links=temporary is None):  # not Prefect's routine lines
            campaign(store, run_id)
    except ConfigError as exc:
        _fail(str(exc))
    except BaseException as exc:  # the flow already logged the traceback
        code = _stop_exit(exc)  # a stop, even one a library wrapped in its own exception
        if code is not None:
            _stopped(code, resume)
        if not isinstance(exc, Exception):
            raise
        from solrl.processes import disk_full, repeated_on_resume
        from solrl.storage.lease import LeaseLost
        from solrl.storage.stage import StageChanged

        if isinstance(exc, LeaseLost):  # not retried (flows.sol_rl): the process that took the run over goes on
            _fail(
                f"{exc.__class__.__name__}: {exc}\n  stages committed before are kept; the process that took the run "
                f"over continues it (`{_command('ls', '--store', store)}` shows it running)",
                1,
            )
        if (full := disk_full(exc)) is not None:  # not retried (flows.sol_rl): say where space is short
            _fail(
                f"a disk is full: {full.__class__.__name__}: {full}\n  free space: {_free_space(store)}\n"
                f"  committed stages are kept; free some, then {resume}",
                1,
            )
        if (same := repeated_on_resume(exc)) is not None:  # not retried either: a resume alone fails the same way
            if isinstance(same, StageChanged):
                how = f"`solrl resume` alone would read the changed file again: `verify --redo` first, then {resume}"
            else:
                verify = _command("verify", run_id, "--store", store)
                how = (
                    "`solrl resume` would compute the same again (a run keeps the config, weights and seeds it began "
                    f"with; `{verify}` checks that its stored files are intact): start a new run with the setting "
                    "changed, `solrl run CONFIG --set section.key=value`"
                )
                if last := _last_checkpoint(store, run_id):
                    export = _command("export", run_id, "--store", store, "--out", "FOLDER")
                    how += f"; `{export}` takes its last checkpoint (iteration {last})"
            _fail(f"{same.__class__.__name__}: {same}\n  committed stages are kept, but {how}", 1)
        _fail(
            f"{exc.__class__.__name__}: {exc}\n  committed stages are kept; {resume}",
            1,
        )
    stop = _guard_stop(store, run_id)
    _report(store, run_id, "finished" if stop is None else "stopped by its guard")
    if stop is not None:  # not an error: the campaign ended where it was told to
        from solrl.stages.guards import GUARD_STOP_EXIT

        typer.echo(f"solrl: {stop}", err=True)
        raise typer.Exit(GUARD_STOP_EXIT)


def _last_checkpoint(store: str, run_id: str) -> int:
    """The iteration of the run's last committed checkpoint; 0 when it has none (or cannot be opened)."""
    from solrl.storage.retention import latest_checkpoint
    from solrl.storage.runs import open_run

    try:
        run_ = open_run(store, run_id)
    except (ConfigError, OSError):
        return 0
    return latest_checkpoint(run_.run_dir, run_.config.campaign.iterations)


def _free_space(store: str) -> str:
    """The free space of each file system this machine's solrl writes to, with what it holds there: the run store
    (a local one), the cache (``SOLRL_CACHE``: models, an object store's mirrors), Prefect's home (its database)
    and the temporary folder. For example ``832.0 kB on run store /mnt/runs; 41.2 GB on cache ~/.cache/solrl,
    Prefect home ~/.prefect, temp /tmp``."""
    import shutil
    import tempfile

    from prefect.settings import PREFECT_HOME
    from rich.filesize import decimal

    from solrl.storage.mirror import cache_root
    from solrl.storage.store import Store

    places = [
        ("cache", cache_root()),
        ("Prefect home", Path(PREFECT_HOME.value())),
        ("temp", Path(tempfile.gettempdir())),
    ]
    opened = Store.open(store)
    if opened.local:
        places.insert(0, ("run store", Path(opened.root)))
    systems: dict[int, tuple[Path, list[str]]] = {}
    for label, path in places:
        existing = path
        while not existing.exists() and existing != existing.parent:  # not made yet: where it would be
            existing = existing.parent
        with contextlib.suppress(OSError):  # what cannot be looked at is left out of an error message
            systems.setdefault(existing.stat().st_dev, (existing, []))[1].append(f"{label} {path}")
    free = {at: shutil.disk_usage(at).free for at, _ in systems.values()}
    return "; ".join(f"{decimal(free[at])} on {', '.join(held)}" for at, held in systems.values())


def _guard_stop(store: str, run_id: str) -> str | None:
    """Why ``campaign.on_guard=stop`` ended the run's campaign (None: it did not).

    Raises:
        ConfigError: the run cannot be opened.
    """
    from solrl.storage.runs import open_run

    run = open_run(store, run_id)
    trip = _guard_trip(run)
    return None if trip is None else trip.message(run_id, run.store)


def _guard_trip(run):
    """``stages.guards.run_guard_trip``, imported only for a run that can stop at a guard (pandas, pyarrow)."""
    if run.config.campaign.on_guard != "stop":
        return None
    from solrl.stages.guards import run_guard_trip

    return run_guard_trip(run)


def _report(store: str, run_id: str, outcome: str = "finished") -> None:
    import json

    from solrl.stages.guards import evaluation_summary
    from solrl.storage.html_report import REPORT_DIR
    from solrl.storage.runs import open_run
    from solrl.storage.tracking import TRACKING_FILE, experiment_url, tracking_uri

    run = open_run(store, run_id)
    summary = evaluation_summary(run.run_dir, run.config.campaign.iterations)
    uri = tracking_uri(run.config, run.run_dir.parent)
    try:
        experiment = json.loads((run.run_dir / TRACKING_FILE).read_text())["experiment_id"]
    except (OSError, ValueError, KeyError):
        experiment = "0"
    # A server the run already used is named; with none, the command that serves the run's local records.
    if uri.startswith(("http://", "https://")):
        mlflow_ui = f"{experiment_url(uri, experiment)}"
    else:  # one server process and no GenAI job workers (MLflow's default starts about ten processes)
        mlflow_ui = (
            f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1 --backend-store-uri {shlex.quote(uri)}\n"
            f"              (then {experiment_url('http://127.0.0.1:5000', experiment)})"
        )
    api = os.environ.get("PREFECT_API_URL")
    if api:
        prefect_ui = f"{api.removesuffix('/').removesuffix('/api')}   (the server of PREFECT_API_URL)"
    else:
        home = os.environ.get("PREFECT_HOME")  # Prefect's default, unquoted so that the shell expands its ~
        prefect_home = "~/.prefect" if home is None else shlex.quote(home)
        prefect_ui = f"PREFECT_HOME={prefect_home} prefect server start   (then http://127.0.0.1:4200)"
    mirrored = run.place.mirrored  # an object store's run, worked on through a mirror here
    if run.config.tracking.report:
        page = f"{run.run_dir / REPORT_DIR / 'report.html'}"
    else:
        page = f"none written (tracking.report: false): {_command('report', run_id, '--store', run.store)} --html FILE"
    typer.echo(
        f"\nrun {run_id} {outcome}; results in {run.store}/{run_id}"
        + (f" (this machine's copy: {run.run_dir})" if mirrored else "")
        + "\n"
        + (f"  evaluated:  {summary}\n" if summary else "")
        + f"  per-iteration stages: {run.run_dir}/iter_*/<stage>/ (Zarr pools, Parquet tables, checkpoint)\n"
        f"  report:     {page}\n"
        f"  table:      {_command('report', run_id, '--store', run.store)}\n"
        f"  LoRA:       {_command('export', run_id, '--store', run.store)} --out <folder>\n"
        f"  MLflow UI:  {mlflow_ui}\n"
        f"  Prefect UI: {prefect_ui}"
    )


def _check_ready(
    cfg: RunConfig, force: bool, prompts_sha256: str | None = None, weights: dict[str, str] | None = None
) -> str:
    """``solrl.stages.runnable.check_ready``: this machine runs ``cfg``, and its memory plan fits the device;
    ``force`` also lets the campaign flow past the plan (``SOLRL_FORCE_MEMORY``), and is said at once on stderr.
    Returns the plan's line for stdout, once the run has started: an error after the plan stays the one line on
    stderr.

    Raises:
        ConfigError: as ``check_runnable``; MemoryPlanError (a ConfigError) where the plan does not fit the device
        and ``force`` is not set.
    """
    from solrl.stages.memory import FORCE_ENV, UNCHECKED
    from solrl.stages.runnable import check_ready

    if force:
        os.environ[FORCE_ENV] = "1"
    line = check_ready(cfg, prompts_sha256, weights)
    if (force and "forced past" in line) or UNCHECKED in line:
        typer.echo(f"solrl: warning: {line}", err=True)
    return line


@app.command()
def plan(
    config: ConfigArgument = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (YAML value).")] = None,
    gpu: Annotated[
        list[str] | None,
        typer.Option(
            "--gpu",
            help="Plan for a device of this many GiB, as CUDA reports it, or for h100, h200 or b200 (repeatable; "
            "default those three: 79.6, 140.4 and 179.1 GiB, since a card's size in GB is not its size in GiB).",
        ),
    ] = None,
) -> None:
    """Print the memory plan of a config: per stage, what one device holds at its peak, and whether it fits.

    Measured on PyTorch's meta device from the transformer's and VAE's configs (the weights folder's, else the
    published configs solrl ships): no weights are read and no GPU is needed."""
    _quiet_environment()  # before anything imports huggingface_hub, which reads HF_HUB_OFFLINE once
    from solrl.stages.memory import GPU_SIZES, a_or_an

    cards = {name.split()[0].lower(): (name, gib) for name, gib in GPU_SIZES.items()}
    sizes = []
    for given in gpu or []:
        if given.strip().lower() in cards:
            name, gib = cards[given.strip().lower()]
            sizes.append((f"{a_or_an(name)} {name} ({gib:.1f} GiB)", gib))
            continue
        try:
            gib = float(given)
        except ValueError:
            gib = math.nan
        if not (math.isfinite(gib) and 0 < gib <= MAX_DEVICE_GIB):
            _fail(
                f"--gpu {given}: a device's memory is a number of GiB above 0 and at most {MAX_DEVICE_GIB:g}, "
                f"or one of {', '.join(cards)}"
            )
        sizes.append((f"{a_or_an(f'{gib:g}')} {gib:g} GiB device", gib))
    try:
        cfg = load_config(config, set_ or [])
        import torch

        from solrl.stages.memory import GIB, cached_measure, fix_summary, format_plan, make_plan
        from solrl.stages.models.adapter import weights_dtype

        dtype = weights_dtype(torch.device("cuda"), cfg.model.dtype)  # as a run on a GPU holds them
        footprint = cached_measure(cfg, dtype)
    except ConfigError as exc:
        _fail(str(exc))
    except NotImplementedError as exc:
        _fail(str(exc))
    try:  # not the plan's business, but a run of this config would stop at it: said before the plan
        cfg.prompt_sets()
    except ConfigError as exc:
        typer.echo(f"solrl: warning: {exc}; `solrl run` refuses this config until it is fixed", err=True)
    for warning in cfg.prompt_warnings():
        typer.echo(f"solrl: warning: {warning}", err=True)
    sizes = sizes or [(f"{a_or_an(name)} {name} ({gib:.1f} GiB)", gib) for name, gib in GPU_SIZES.items()]
    try:
        plans = [(device, make_plan(cfg, footprint, int(gib * GIB))) for device, gib in sizes]
    except ConfigError as exc:  # e.g. a reward plug-in that declares no parameter count
        _fail(str(exc))
    for device, p in plans:
        typer.echo(format_plan(p, f"{cfg.name} on {device}, {footprint.weights_dtype or dtype} weights"))
        found = fix_summary(cfg, p)
        typer.echo(
            f"largest explore batch {p.largest_explore_batch}, largest micro-batch {p.largest_micro_batch}"
            + (f"; fix: {found}" if found else "")
            + "\n"
        )


@app.command()
def run(
    config: ConfigArgument = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (YAML value).")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Name of the run (default: preset-time-hex).")] = None,
    store: Annotated[
        str | None,
        typer.Option("--store", help="Run store: the same as --set storage.root=STORE (default: the config's)."),
    ] = None,
    force: ForceOption = False,
) -> None:
    """Start a new campaign from a preset (default tiny-digits)."""
    made: list[str] = []  # [run id, store] once the run exists
    _quiet_environment()  # before the checks: they must see the HF_HUB_OFFLINE the run will load weights with
    overrides = [*(set_ or []), *([f"storage.root={store}"] if store is not None else [])]
    with _stoppable(made):
        try:
            cfg = load_config(config, overrides, plugins=False)  # the schema: nothing imports torch yet
            check_published_weights(cfg.model)  # so a missing download fails at once
            cfg = validate_config(cfg.model_dump(mode="json"))  # the plug-ins' own rules
            refuse_ignored_settings(cfg)  # a new run's: a stored run resumes with what it began with
            from solrl.stages.models import model_family
            from solrl.storage.runs import check_run_id, create_run, new_run_id, open_store

            run_id = check_run_id(new_run_id(cfg.name) if run_id is None else run_id)  # "" is refused, not replaced
            memory = _check_ready(cfg, force)
            store = open_store(cfg.storage.root)
            store.check(write=True)  # an object store that cannot be used: one line, nothing written anywhere
            _start_prefect_early()  # after the checks: bad input exits at once, with no server to stop
            made += [run_id, store.address]  # the hint, once run.json exists
            created = create_run(cfg, run_id, weights=model_family(cfg.model).weights_fingerprint(cfg.model))
        except ConfigError as exc:
            _fail(str(exc))
        from solrl.stages.pipeline import shard_warnings

        for warning in [*cfg.warnings(), *cfg.prompt_warnings(), *shard_warnings(cfg)]:
            typer.echo(f"solrl: warning: {warning}", err=True)
        typer.echo(
            f"run {created.run_id}: {cfg.campaign.iterations} iteration{'s' * (cfg.campaign.iterations != 1)}, "
            f"explore {cfg.explore.precision} "
            f"pool {cfg.explore.pool_size} -> keep {cfg.select.k}, store {created.store}\n{memory}"
        )
        from solrl.storage.runs import run_lock

        try:  # taken before Prefect starts, as `resume` does, and held to the end; the flow joins it
            with run_lock(created.run_dir):
                _launch(created.store, created.run_id)  # its own ConfigErrors it turns into one line itself
        except ConfigError as exc:
            _fail(str(exc))


@app.command()
def serve(
    config: Annotated[
        str, typer.Argument(help="Preset or YAML path: the default parameters of triggered and scheduled runs.")
    ] = "tiny-digits",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Default override (section.key=value).")] = None,
    name: Annotated[str, typer.Option(help="Deployment name (the UI shows sol-rl/<name>).")] = "campaign",
    cron: Annotated[str | None, typer.Option(help="Cron schedule of new campaigns, e.g. '0 2 * * *'.")] = None,
    interval: Annotated[
        float | None, typer.Option(min=1, help="Interval schedule of new campaigns, in seconds.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Campaigns of this deployment running at once.")] = 1,
    on_busy: Annotated[
        str, typer.Option(help="A trigger over the limit: wait (queued until a slot frees) or refuse (cancelled).")
    ] = "wait",
) -> None:
    """Serve the campaign flow as a Prefect deployment: trigger, schedule and retry campaigns from the Prefect UI.

    Needs a Prefect server (PREFECT_API_URL): start one with `prefect server start`, then
    `PREFECT_API_URL=http://127.0.0.1:4200/api solrl serve`. Runs execute on this machine, one process each.
    """
    if on_busy not in ("wait", "refuse"):
        _fail(f"--on-busy {on_busy!r}: choose wait or refuse")
    if cron is not None and interval is not None:
        _fail("give --cron or --interval, not both")
    if cron is not None:  # Prefect's own check, before the server's: a typo is said first
        from prefect.client.schemas.schedules import CronSchedule
        from pydantic import ValidationError

        try:
            CronSchedule(cron=cron)
        except ValidationError as exc:
            _fail(f"--cron {cron!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}")
    try:
        cfg = load_config(config, set_ or [])
    except ConfigError as exc:
        _fail(str(exc))
    _quiet_environment()
    if not os.environ.get("PREFECT_API_URL"):
        _fail(
            "solrl serve needs a Prefect server: start one with `prefect server start` and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (a temporary server would vanish with this process)"
        )
    if "/" in name:
        _fail(f"--name {name!r}: a deployment name cannot contain '/'")
    import httpx

    api = os.environ["PREFECT_API_URL"].rstrip("/")
    try:
        httpx.get(f"{api}/health", timeout=10).raise_for_status()
    except (httpx.HTTPError, ValueError) as exc:
        _fail(f"PREFECT_API_URL={api}: no Prefect server answers there ({exc.__class__.__name__}: {exc})")
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType
    from pydantic import ValidationError

    from solrl.flows.deployment import sol_rl

    strategy = ConcurrencyLimitStrategy.ENQUEUE if on_busy == "wait" else ConcurrencyLimitStrategy.CANCEL_NEW
    schedule = (
        f"; a new campaign at cron '{cron}' (UTC)"
        if cron
        else f"; a new campaign every {interval:g} s"
        if interval
        else ""
    )
    typer.echo(
        f"serving sol-rl/{name} (default config {cfg.name}, at most {limit} at once, {on_busy} when busy{schedule}); "
        f"trigger from the Prefect UI or `prefect deployment run 'sol-rl/{name}'`",
        err=True,
    )
    try:
        sol_rl.serve(
            name=name,
            parameters={"config": config, "base_overrides": list(set_ or [])},
            cron=cron,
            interval=interval,
            global_limit=ConcurrencyLimitConfig(limit=limit, collision_strategy=strategy),
            entrypoint_type=EntrypointType.MODULE_PATH,
            print_starting_message=False,
        )
    except ValidationError as exc:  # a schedule Prefect refuses (e.g. --cron 'not a cron')
        _fail("; ".join(f"{'.'.join(map(str, e['loc'])) or 'schedule'}: {e['msg']}" for e in exc.errors()))
    except (ValueError, httpx.HTTPError) as exc:
        _fail(f"{exc.__class__.__name__}: {exc}")


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="The run to continue.")],
    store: StoreOption = "runs",
    shards: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Continue with this many prompt shards (campaign.shards: the same results, warned where a shard "
            "count must split a batch).",
        ),
    ] = None,
    force: ForceOption = False,
    past_guard: Annotated[
        bool,
        typer.Option(
            "--past-guard",
            help="Continue a run that campaign.on_guard=stop ended, past that stop (recorded in run.json); a new "
            "streak of alarms after it stops the run again.",
        ),
    ] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", hidden=True)] = None,
) -> None:
    """Continue a run: committed stages are skipped, the first stage without a manifest runs next."""
    if set_:  # taken only to say why: a resume that read it would no longer compute what the run began
        _fail(
            f"--set {set_[0]}: a run resumes with the config it began with (run.json), so its committed stages "
            "stay valid; more iterations or another setting is a new run: `solrl run CONFIG --set section.key=value` "
            "(--shards and --past-guard are what a resume takes)"
        )
    _quiet_environment()  # before the checks (HF_HUB_OFFLINE)
    with _stoppable([run_id, store]), contextlib.ExitStack() as held:
        try:
            from solrl.storage.runs import open_run, run_lock, set_shards

            run_ = open_run(store, run_id)
            check_published_weights(run_.config.model)  # before torch is imported
            memory = _check_ready(run_.config, force, run_.prompts_sha256, run_.weights)
            # Refused now, not after Prefect has started, when another process runs it; held until the campaign
            # ends (the flow's own run_lock finds it held), so no other resume starts in between.
            held.enter_context(run_lock(run_.run_dir))
            if shards is not None:
                set_shards(store, run_id, shards)
                run_ = open_run(store, run_id)
                from solrl.stages.pipeline import shard_warnings

                for warning in shard_warnings(run_.config):
                    typer.echo(f"solrl: warning: {warning}", err=True)
            if past_guard:
                from solrl.stages.guards import pass_guard_stop

                try:
                    stop = pass_guard_stop(run_)
                except ConfigError as exc:
                    _fail(f"--past-guard: {exc}")
                run_ = open_run(store, run_id)
                typer.echo(
                    f"passing the guard stop at iteration {stop.iteration} ({stop.measure}), recorded in run.json; "
                    "a new streak of alarms after it stops the run again"
                )
        except ConfigError as exc:
            _fail(str(exc))
        from solrl.stages.context import StageContext
        from solrl.stages.pipeline import first_pending

        pending = first_pending(StageContext.of(run_, 0))
        # A campaign killed after its last commit, before its report and MLflow's end: the campaign finishes them
        # (every stage skipped, its inputs matching).
        unreported = pending is None and not _ended(run_)
        if pending is None and not unreported:
            from solrl.storage.retention import prune_run

            # a campaign killed after its last stage and before its final prune: the prune is all it lacks
            freed = prune_run(run_.config, run_.run_dir)
            pruned = f" {freed / 2**20:.1f} MiB of pool data pruned (storage.pool, keep_pools)." if freed else ""
            typer.echo(
                f"run {run_id} is complete ({run_.config.campaign.iterations} "
                f"iteration{'s' * (run_.config.campaign.iterations != 1)} committed); "
                f"nothing to do.{pruned} See `{_command('report', run_id, '--store', store)}`."
            )
            return
        _start_prefect_early()
        end = "its report" if run_.config.tracking.report else "its end"
        where = f"{end} (every stage committed)" if unreported else f"iteration {pending[0]}, stage {pending[1]}"
        typer.echo(f"resuming run {run_id} at {where}\n{memory}")
        _launch(run_.store, run_id)


@app.command("ls")
def list_(store: StoreOption = "runs") -> None:
    """List the runs in the store."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from solrl.storage.runs import list_runs, open_store

    try:
        opened = open_store(store)
        where = opened.describe()
        if opened.local and not Path(opened.root).is_dir():  # a typo must not read as an empty store
            what = "is not a folder" if Path(opened.root).exists() else "does not exist (a store's first run makes it)"
            _fail(f"no run store at {opened.root}: it {what}")
        rows = list_runs(store)
    except ConfigError as exc:
        _fail(str(exc))
    if not rows:
        typer.echo(f"no runs in {where}")
        return
    table = Table(title=f"runs in {where}", box=box.SIMPLE_HEAD)
    table.add_column("run id", no_wrap=True, min_width=max(len(str(r["run_id"])) for r in rows))
    # Short headers and light rules, so that the cells fold at their spaces, not inside a date, at 80 columns.
    for name in ("created (UTC)", "model", "iterations", "state", "explore"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(
            str(row["run_id"]),
            str(row["created"])[:19].replace("T", " "),
            str(row["model"]),
            f"{row['iterations_done']}/{row['iterations']}",
            _run_state(store, row),
            str(row["explore"]),
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a file: rich's 80 columns would fold the cells for no reader's sake
        console = Console(width=max(console.width, 160))
    console.print(table)


def _run_state(store: str, row: dict[str, object]) -> str:
    """How far a run of ``list_runs`` got: ``complete``, ``running (iter 3: select)``, ``guard stop (iter 3:
    evaluate)`` (``campaign.on_guard=stop`` ended it; ``solrl resume --past-guard`` continues it), ``stopped after
    iter 3: select`` (``solrl resume`` continues it), ``no stage committed``, or ``unreadable`` (a ``run.json`` the
    commands refuse); "" for a damaged ``run.json``, which the model column names."""
    last = str(row["last_stage"])
    if row["complete"]:
        return "complete"
    if row["running"]:
        return f"running ({last})" if last else "running"
    if row["iterations"] == "?":
        return ""  # a damaged run.json: the model column says so
    if not last:
        return "no stage committed"
    from solrl.storage.runs import open_run

    try:
        run = open_run(store, str(row["run_id"]))
        trip = _guard_trip(run)
    except ConfigError:  # a run.json edited by hand: the commands that open the run say what
        return "unreadable (solrl inspect says why)"
    if trip is not None:  # a stop holds while everything up to it is committed (`verify --redo` uncommits)
        from solrl.stages.context import StageContext
        from solrl.stages.pipeline import first_pending

        pending = first_pending(StageContext.of(run, 0))
        if pending is None or pending[0] > trip.iteration:
            return f"guard stop ({last})"
    return f"stopped after {last}"


def _output_target(option: str, given: str | None, suffixes: tuple[str, ...], default_name: str) -> tuple[Path, bool]:
    """Where a command writes ``option``'s file, checked before any work or any file is written: ``(given, False)``
    for a file with one of ``suffixes``, or ``(given, True)`` for a folder (one that exists, or any path written with
    a trailing slash), to hold ``default_name``; ``(Path(), True)`` when ``given`` is None. Fails the command with a
    message otherwise."""
    if given is None:
        return Path(), True
    article = "an" if suffixes[0] == ".html" else "a"
    if not given.strip():
        _fail(f"{option} is empty: give {article} {suffixes[0]} file or a folder")
    path = Path(given).expanduser()
    as_folder = given.endswith(("/", os.sep)) or path.is_dir()
    folder = path if as_folder else path.parent
    if not folder.is_dir():
        gone = "is not a folder" if folder.exists() else "does not exist"
        _fail(f"{option} {given}: {'it' if as_folder else f'its folder {folder}'} {gone}")
    if not as_folder and path.suffix.lower() not in suffixes:
        _fail(f"{option} {given}: give {article} {suffixes[0]} file (or a folder, for {default_name})")
    return path, as_folder


def _ended(run_: Run) -> bool:
    """Whether the campaign's end ran: its HTML report is in the run store (``_reported``) or, where
    ``tracking.report`` is false, its MLflow run is FINISHED (``False`` where MLflow cannot tell)."""
    if run_.config.tracking.report:
        return _reported(run_.run_dir)
    import json

    import mlflow

    from solrl.storage.tracking import TRACKING_FILE

    try:
        stored = json.loads((run_.run_dir / TRACKING_FILE).read_text())
        client = mlflow.MlflowClient(tracking_uri=stored["tracking_uri"])
        return client.get_run(stored["mlflow_run_id"]).info.status == "FINISHED"
    except Exception:  # no record, another shape, an unreachable server: the campaign's end runs again
        return False


def _reported(run_dir: Path) -> bool:
    """Whether the campaign's HTML report is in the run store (``<run>/report/report.html``; on the object store
    for a mirrored run, whose mirror on this machine may lack it)."""
    from solrl.storage.html_report import REPORT_DIR
    from solrl.storage.mirror import locate

    place = locate(run_dir)
    if place.mirrored:
        return place.store.exists(f"{place.key}/{REPORT_DIR}/report.html")
    return (run_dir / REPORT_DIR / "report.html").is_file()


def _outside_run(option: str, path: Path | None, run_dir: Path) -> None:
    """Fail the command where ``path`` (what it writes) lies inside the run's own folder: it would replace committed
    files there at their size, which only ``solrl verify`` notices (a breaker's finding: ``export --out`` into a
    checkpoint folder replaced its LoRA)."""
    if path is None:
        return
    resolved, run = path.expanduser().resolve(), run_dir.resolve()
    if resolved == run or run in resolved.parents:
        _fail(
            f"{option} {path}: inside run {run_dir.name}'s own folder, whose committed files it would replace; "
            "write elsewhere"
        )


def _report_output(option: str, given: str | None, default_name: str, suffixes: tuple[str, ...]) -> Path | None:
    """``report``'s ``--html`` or ``--plot`` file (``_output_target``), None when not asked for."""
    if given is None:
        return None
    path, as_folder = _output_target(option, given, suffixes, default_name)
    return path / default_name if as_folder else path


@app.command()
def report(
    run_id: Annotated[str, typer.Argument(help="The run to summarise.")],
    store: StoreOption = "runs",
    plot: Annotated[
        str | None, typer.Option(help="Also save the evaluation curves as a PNG here (a .png file, or a folder).")
    ] = None,
    html: Annotated[
        str | None,
        typer.Option(
            "--html", help="Also write one self-contained HTML report page here (an .html file, or a folder)."
        ),
    ] = None,
) -> None:
    """Per-iteration table of a run (evaluation, rewards, fidelity, seconds), from its manifests."""
    from rich.console import Console
    from rich.table import Table

    from solrl.stages.pipeline import ITERATION
    from solrl.storage.report import collect_metrics
    from solrl.storage.runs import open_run
    from solrl.storage.stage import replaced_atomically

    try:
        run_ = open_run(store, run_id)
    except ConfigError as exc:
        _fail(str(exc))
    html_path = _report_output("--html", html, f"{run_id}-report.html", (".html", ".htm"))
    plot_path = _report_output("--plot", plot, f"{run_id}-curves.png", (".png",))  # matplotlib goes by the suffix
    _outside_run("--html", html_path, run_.run_dir)
    _outside_run("--plot", plot_path, run_.run_dir)
    frame = collect_metrics(run_.run_dir, tuple(s.name for s in ITERATION))
    if frame.empty:
        _fail(f"run {run_id} has no committed stage yet")
    guards = ("eval/diversity", "eval/grid_energy")
    evaluations = sorted(c for c in frame if c.startswith("eval/") and c not in guards)  # every reward
    columns = [
        c
        for c in (
            *evaluations,
            *guards,
            "explore/reward_mean",
            "regenerate/reward_mean",
            "fidelity/spearman",
            "fidelity/kendall",
            "train/loss",
        )
        if c in frame
    ]
    frame["seconds/iteration"] = (
        frame.filter(like="seconds/").drop(columns="seconds/evaluate", errors="ignore").sum(axis=1)
    )
    table = Table(
        "iter", *[c.split("/", 1)[1] if c.startswith("eval/") else c for c in columns], "s/iter", title=f"run {run_id}"
    )
    for _, row in frame.iterrows():
        table.add_row(
            str(int(row["iteration"])),
            *["" if math.isnan(row[c]) else f"{row[c]:.4f}" for c in columns],  # NaN: not logged
            f"{row['seconds/iteration']:.1f}" if row["iteration"] > 0 else "",  # iteration 0 only evaluates
        )
    Console(width=200).print(table)
    if plot_path is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        evals = [c for c in frame if c.startswith("eval/")]
        fig, axes = plt.subplots(1, len(evals), figsize=(4 * len(evals), 3.2), squeeze=False)
        for ax, column in zip(axes[0], evals):
            data = frame[["iteration", column]].dropna()
            ax.plot(data["iteration"], data[column], marker="o", ms=3)
            ax.set_title(column)
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        try:
            with replaced_atomically(plot_path) as tmp:
                fig.savefig(tmp, dpi=110)
        except OSError as exc:
            _fail(f"--plot {plot_path}: cannot write the PNG there ({exc.strerror or exc})")
        typer.echo(f"curves saved to {plot_path}")
    from solrl.stages.pipeline import campaign_plan
    from solrl.storage.audit import broken_manifests

    if html_path is not None:
        from solrl.storage.html_report import render_html

        try:
            with replaced_atomically(html_path) as tmp:  # a full disk leaves an earlier page whole
                tmp.write_text(
                    render_html(run_, [s.name for s in ITERATION], campaign_plan(run_.config)), encoding="utf-8"
                )
        except OSError as exc:
            _fail(f"--html {html_path}: cannot write the page there ({exc.strerror or exc})")
        typer.echo(f"report page written to {html_path}")
    broken = broken_manifests(run_.run_dir, campaign_plan(run_.config))
    if broken:
        from solrl.storage.stage import why_not_committed

        _fail(
            "; ".join(f"iteration {i}: {stage}: {why_not_committed(run_.run_dir, i, stage)}" for i, stage in broken)
            + f"; left out of the table above, and `{_command('resume', run_id, '--store', store)}` recomputes them"
        )


def _open_iteration(store: str, run_id: str, iteration: int | None):
    """The run and the iteration to look at (default: the last with a committed stage); exit 2 when the run
    or the iteration does not exist."""
    from solrl.stages.pipeline import campaign_plan
    from solrl.storage.runs import open_run
    from solrl.storage.stage import read_manifest

    try:
        run_ = open_run(store, run_id)
    except ConfigError as exc:
        _fail(str(exc))
    plan = dict(campaign_plan(run_.config))
    if iteration is None:
        begun = [i for i, stages in plan.items() if any(read_manifest(run_.run_dir, i, s) for s in stages)]
        iteration = begun[-1] if begun else 0
    if iteration not in plan:
        _fail(
            f"run {run_id} has no iteration {iteration}: its campaign has iterations 0 (the starting policy's "
            f"evaluation) to {run_.config.campaign.iterations}"
        )
    return run_, iteration, plan[iteration]


@app.command()
def inspect(
    run_id: Annotated[str, typer.Argument(help="The run to audit.")],
    iteration: Annotated[
        int | None, typer.Option(help="Iteration (default: the last one with a committed stage).")
    ] = None,
    store: StoreOption = "runs",
) -> None:
    """Audit one iteration from its stored files: stage states and timings, the candidate pool's reward
    distribution per prompt, the kept seeds (explore vs BF16 reward) and the proxy-fidelity figures."""
    from rich.console import Console
    from rich.table import Table

    from solrl.storage.artifacts import CandidatePool, FidelityTable
    from solrl.storage.audit import audit_iteration

    run_, iteration, due = _open_iteration(store, run_id, iteration)
    found = audit_iteration(run_.run_dir, iteration, due)
    console = Console(width=200)

    def show(title: str, frame: pd.DataFrame | None, missing: str, empty: str = "") -> None:
        if frame is None:
            console.print(f"[bold]{title}[/bold]: not available ({missing})\n")
            return
        if frame.empty and empty:
            console.print(f"[bold]{title}[/bold]: {empty}\n")
            return
        table = Table(title=title, title_justify="left")
        for column in frame.columns:
            table.add_column(str(column), overflow="fold", max_width=48 if column == "prompt" else None)
        for row in frame.itertuples(index=False):
            table.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
        console.print(table)

    console.print(f"run {run_id}, iteration {iteration}", style="italic", soft_wrap=True)  # wider than the table
    stages = Table("stage", "state", "seconds")
    for stage, state in found.states.items():
        seconds = found.seconds.get(stage)
        colour = {"committed": "green", "corrupted": "red", "incomplete": "yellow"}.get(state, "dim")
        stages.add_row(stage, f"[{colour}]{state}[/{colour}]", f"{seconds:.2f}" if seconds is not None else "")
    console.print(stages)

    def state_of(stage: str) -> str:
        return found.states.get(stage) or f"not run at iteration {iteration}"

    show("candidate pool: weighted reward per prompt", found.pool, f"score_explore {state_of('score_explore')}")
    if (explore := found.manifests.get("explore")) is not None and explore.pruned:
        by: dict[str, list[str]] = {}  # why -> arrays, each array with its own reason
        for folder, why in sorted(explore.pruned.items()):
            by.setdefault(why, []).append(folder.rsplit("/", 1)[-1])
        gone = [name for names in by.values() for name in names]
        # a pool sampled under storage.pool=rankings never wrote its latents: none were pruned, none remain
        latents_kept = "latents" not in gone and explore.holds(CandidatePool.array_folder("latents"))
        see = f"`{_command('show', run_id, '--iteration', iteration, '--prompt', 0, '--store', store)}`"
        console.print(
            "candidate pool: "
            + "; ".join(f"{' and '.join(names)} pruned by {why}" for why, names in by.items())
            + "; "
            + (f"its latents remain: {see} decodes them" if latents_kept else "rankings above remain")
        )
    show("kept seeds", found.selection, f"select {state_of('select')}")
    show(
        "proxy fidelity per prompt (kept seeds)",
        found.fidelity,
        f"score_regenerate {state_of('score_regenerate')}",
        empty=f"not measured ({FidelityTable.not_measured})",
    )
    if found.audit_pool is not None:
        console.print(f"audit: {found.audit_pool['group'].nunique()} whole pools regenerated in BF16 (audit/*)")
    figures = {k: v for k, v in found.metrics.items() if k.startswith(("fidelity/", "audit/", "select/"))}
    if figures:
        console.print("fidelity figures: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(figures.items())))
    missing = [s for s, state in found.states.items() if state in ("missing", "incomplete")]
    from solrl.storage.runs import run_holder

    running = run_holder(run_.run_dir) is not None  # read, not taken: inspect writes nothing
    if missing and running:
        console.print(f"not committed yet: {', '.join(missing)}; another process is running this run now")
    elif missing:
        console.print(
            f"not committed: {', '.join(missing)}; `{_command('resume', run_id, '--store', store)}` runs them"
        )
    corrupted = [s for s, state in found.states.items() if state == "corrupted"]
    if corrupted:
        _fail(
            f"run {run_id} iteration {iteration}: {', '.join(corrupted)} "
            f"{'fails' if len(corrupted) == 1 else 'fail'} verification (a manifest is unreadable "
            f"or a file changed since it was committed); their files are not shown. "
            f"`{_command('verify', run_id, '--store', store, '--redo')}` uncommits every stage whose files changed, "
            "and `solrl resume` then recomputes them"
        )


@app.command()
def verify(
    run_id: Annotated[str, typer.Argument(help="The run to verify.")],
    redo: Annotated[
        bool,
        typer.Option(
            "--redo",
            help="Uncommit every stage with a changed file and every committed stage that read it, so `solrl resume` "
            "redoes them.",
        ),
    ] = False,
    store: StoreOption = "runs",
) -> None:
    """Re-hash every committed file of a run against its manifest and name any that differ or cannot be read, and
    any stage not committed before a committed one (exit 1).

    A file's sha256 is computed once, when its stage commits it; campaigns and audits then hash the small tables,
    the checkpoints and the pools' and samples' Zarr files they read, images excepted, and resumes check sizes, so
    this is where a flipped byte in an image, or in a file no stage reads again, is found."""
    from rich.progress import Progress

    from solrl.storage.runs import open_run, run_lock
    from solrl.storage.stage import committed_stages, uncommit, verify_run

    try:
        run_ = open_run(store, run_id)
    except ConfigError as exc:
        _fail(str(exc))
    stages = committed_stages(run_.run_dir)
    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("verifying", total=len(stages))
        seen: set[tuple[int, str]] = set()

        def advance(iteration: int, stage: str, file: str) -> None:
            if (iteration, stage) not in seen:
                seen.add((iteration, stage))
                progress.update(task, completed=len(seen), description=f"iteration {iteration} {stage}")

        found = verify_run(run_.run_dir, advance)
    from solrl.stages.pipeline import uncommitted_gaps

    gaps = uncommitted_gaps(run_.config, set(stages))
    resume = _command("resume", run_id, "--store", store)
    if gaps:
        shown = ", ".join(f"iteration {i} {s}" for i, s in gaps[:8]) + (" ..." if len(gaps) > 8 else "")
        typer.echo(
            f"not committed, though a later stage is: {shown} (uncommitted by `verify --redo`, or deleted); "
            f"`{resume}` recomputes {'it' if len(gaps) == 1 else 'them'}"
        )
    if not found:
        if gaps:
            raise typer.Exit(1)
        typer.echo(f"run {run_id}: every file of its {len(stages)} committed stages matches its manifest")
        return
    problems = {"size": "another size than committed", "sha256": "other bytes than committed (sha256)"}
    for bad in found:
        typer.echo(f"iteration {bad.iteration} {bad.stage}: {bad.file}: {problems.get(bad.problem, bad.problem)}")
    changed = sorted({(bad.iteration, bad.stage) for bad in found})
    if redo:
        from solrl.stages.pipeline import downstream_of

        # A later stage may have read the changed bytes (readers check sizes, not hashes): it goes too.
        readers = [key for key in downstream_of(run_.config, set(changed)) if key in stages]
        try:
            with run_lock(run_.run_dir, then=("verify", "--redo")):
                for iteration, stage in [*changed, *readers]:
                    uncommit(run_.run_dir, iteration, stage)
        except ConfigError as exc:
            _fail(str(exc))
        also = f" and the {len(readers)} committed stage(s) that read them" if readers else ""
        typer.echo(f"{len(changed)} stage(s) uncommitted{also}; `{resume}` recomputes them")
    else:
        redo_command = _command("verify", run_id, "--store", store, "--redo")
        typer.echo(f"{len(changed)} stage(s) changed; `{redo_command}` uncommits them")
    raise typer.Exit(1)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="The run.")],
    iteration: Annotated[int, typer.Option(help="Iteration whose candidate pool to draw.")],
    prompt: Annotated[str, typer.Option(help="The prompt: its index in the iteration, its text, or a unique part.")],
    out: Annotated[
        str | None, typer.Option(help="PNG (or folder) to write (default: <run>-iter<N>-prompt<i>.png).")
    ] = None,
    store: StoreOption = "runs",
) -> None:
    """Draw one prompt's whole candidate pool, ordered by explore reward, the kept seeds marked."""
    import numpy as np

    from solrl.stages.metrics.grid import save_pool_grid
    from solrl.storage.audit import PoolPruned, pool_view
    from solrl.storage.stage import StageNotCommitted, replaced_atomically

    run_, iteration, stages = _open_iteration(store, run_id, iteration)
    if "explore" not in stages:
        _fail(f"run {run_id}: iteration {iteration} only evaluates the starting policy; it has no candidate pool")
    target, into_folder = _output_target("--out", out, (".png",), f"{run_id}-iter{iteration}-prompt<i>.png")
    _outside_run("--out", target if out is not None else None, run_.run_dir)
    decoded = []

    def decode(latents: np.ndarray) -> np.ndarray:
        """The pool's latents through the run's model (a pool kept as latents, ``storage.pool=latents``)."""
        import torch

        from solrl.stages.models import load_model, resolve_device
        from solrl.stages.runnable import check_runnable

        check_runnable(run_.config, run_.prompts_sha256, run_.weights)
        model = load_model(run_.config.model, resolve_device(run_.config.model.device), text_encoders=False)
        decoded.append(run_.config.model.family)
        with torch.no_grad():
            tensor = torch.from_numpy(np.ascontiguousarray(latents)).to(model.device, model.transformer.dtype)
            return model.decode(tensor)

    try:
        view = pool_view(run_.run_dir, iteration, prompt, decode)
    except StageNotCommitted as exc:  # its message names the stage: explore or score_explore
        _fail(
            f"run {run_id}: no verified candidate pool and rewards ({exc}); "
            f"`{_command('inspect', run_id, '--iteration', iteration, '--store', store)}` shows the stages' state"
        )
    except PoolPruned as exc:
        _fail(f"run {run_id}: {exc}: `{_command('inspect', run_id, '--iteration', iteration, '--store', store)}`")
    except ConfigError as exc:
        _fail(
            f"run {run_id} iteration {iteration}: the pool is kept as latents and this machine cannot decode them: "
            f"{exc}"
        )
    except LookupError as exc:
        _fail(str(exc))
    out_path = target / f"{run_id}-iter{iteration}-prompt{view.group}.png" if into_folder else target
    kept = sum(k is not None for k in view.kept_as)
    try:
        with replaced_atomically(out_path) as tmp:  # a full disk leaves an earlier picture whole
            save_pool_grid(
                view.images,
                view.rewards,
                view.candidates,
                view.kept_as,
                tmp,
                title=f"{run_id} iteration {iteration}: {view.prompt} ({len(view.rewards)} candidates, {kept} kept)",
            )
    except OSError as exc:
        _fail(f"--out {out_path}: cannot write the PNG there ({exc.strerror or exc})")
    how = f", decoded from its latents by the {decoded[0]} model" if decoded else ""
    typer.echo(f"pool of {view.prompt!r} ({len(view.rewards)} candidates, {kept} kept{how}) written to {out_path}")
    if view.selection != "committed":
        redo = f"; {_redo_hint(run_id, store, 'it')}" if view.selection == "fails verification" else ""
        typer.echo(
            f"solrl: warning: iteration {iteration}'s select stage "
            f"{'is ' * (view.selection == 'not committed')}{view.selection}, so no seed is marked kept{redo}",
            err=True,
        )


@app.command()
def prune(
    run_id: Annotated[str, typer.Argument(help="The run to prune.")],
    pool: Annotated[
        str | None, typer.Option(help="What every pool keeps: full, latents or rankings (default: the run's).")
    ] = None,
    keep_last: Annotated[
        int | None, typer.Option(min=0, help="Keep the pool data of the last N iterations (default: the run's).")
    ] = None,
    keep_every: Annotated[int | None, typer.Option(min=0, help="Also keep every Mth iteration's (0 = none).")] = None,
    store: StoreOption = "runs",
) -> None:
    """Remove pool data as storage.pool and storage.keep_pools say (the run's settings, or these).

    Explore's images, latents and trajectories and regenerate's likewise, of iterations whose checkpoint is
    committed. Manifests keep the record of what was there; rankings, rewards, selections, checkpoints and
    evaluations stay, and the run resumes and reports as before. A campaign applies the same rule after every
    iteration."""
    from solrl.storage.retention import prune_run
    from solrl.storage.runs import open_run, run_lock

    try:
        run_ = open_run(store, run_id)
        storage = run_.config.storage.model_dump()
        if pool is not None:
            storage["pool"] = pool
        if keep_last is not None:
            storage["keep_pools"]["last"] = keep_last
        if keep_every is not None:
            storage["keep_pools"]["every"] = keep_every
        cfg = run_.config.model_copy(update={"storage": type(run_.config.storage).model_validate(storage)})
        given = {"--pool": pool, "--keep-last": keep_last, "--keep-every": keep_every}
        again = ("prune", *(word for option, value in given.items() if value is not None for word in (option, value)))
        with run_lock(run_.run_dir, then=again):
            freed = prune_run(cfg, run_.run_dir, by="solrl prune")
    except ConfigError as exc:
        _fail(str(exc))
    except ValueError:  # pydantic's, for a bad --pool (typer checks the counts)
        _fail(f"--pool {pool!r}: give full, latents or rankings")
    rule = cfg.storage.keep_pools
    does = {
        "full": "keeps every pool whole",
        "latents": "removes each pool's images",
        "rankings": "removes each pool's images and latents",
    }
    rules = f"storage.pool={cfg.storage.pool} {does[cfg.storage.pool]}"
    if rule.last is not None:
        spared = [f"the last {rule.last}"] * bool(rule.last) + [f"every {rule.every}th"] * bool(rule.every)
        scope = f"all iterations but {' and '.join(spared)}" if spared else "every iteration"
        rules += f"; keep_pools removes the pool data of {scope}"
    typer.echo(
        f"run {run_id}: {freed / 2**20:.1f} MiB of pool data removed ({rules})"
        + ("; pruning never adds back what an earlier rule removed" if not freed else "")
    )
    from solrl.storage.audit import broken_manifests

    plan = [(i, ("explore", "regenerate")) for i in range(1, cfg.campaign.iterations + 1)]
    if broken := broken_manifests(run_.run_dir, plan):  # never pruned: not taken for pruned, either
        typer.echo(
            "solrl: warning: left as they are, failing verification (a manifest unreadable or a file of another "
            f"size): {', '.join(f'iteration {i} {stage}' for i, stage in broken)}; "
            f"{_redo_hint(run_id, store, 'them')}",
            err=True,
        )


@app.command()
def export(
    run_id: Annotated[str, typer.Argument(help="The run whose trained LoRA to export.")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write pytorch_lora_weights.safetensors into.")],
    iteration: Annotated[
        int | None, typer.Option(help="Checkpoint iteration (default: the last committed one).")
    ] = None,
    adapter: Annotated[str, typer.Option(help="policy, rollout or ema.")] = "policy",
    store: StoreOption = "runs",
) -> None:
    """Write a checkpoint's LoRA in diffusers' format, for a stock pipeline's load_lora_weights."""
    from solrl.stages.context import StageContext
    from solrl.stages.models import model_family
    from solrl.stages.models.lora import LORA_WEIGHTS, save_diffusers_lora
    from solrl.stages.models.policy import ADAPTERS
    from solrl.stages.pipeline import uncommitted_gaps
    from solrl.storage.artifacts import Checkpoint
    from solrl.storage.audit import broken_manifests
    from solrl.storage.runs import open_run
    from solrl.storage.stage import StageNotCommitted, committed_stages, read_manifest

    if adapter not in ADAPTERS:
        _fail(f"--adapter {adapter!r}: choose one of {', '.join(ADAPTERS)}")
    if out.exists() and not out.is_dir():
        _fail(f"--out {out}: is a file; give a folder (the LoRA is written into it as {LORA_WEIGHTS})")
    try:
        run_ = open_run(store, run_id)
        family = model_family(run_.config.model)
        family.check_runnable(run_.config.model)  # the base weights the LoRA applies to
    except ConfigError as exc:
        _fail(str(exc))
    _outside_run("--out", out, run_.run_dir)
    iterations = range(1, run_.config.campaign.iterations + 1)
    committed = [i for i in iterations if read_manifest(run_.run_dir, i, "checkpoint")]
    uncommitted = [(i, ("checkpoint",)) for i in iterations if i not in committed]  # each manifest read once
    damaged = [i for i, _ in broken_manifests(run_.run_dir, uncommitted)]

    def fails_verification(at: int) -> str:
        return (
            f"the checkpoint of iteration {at} fails verification (its manifest is unreadable, or a file changed "
            f"since it was committed); `{_command('resume', run_id, '--store', store)}` recomputes it"
        )

    if iteration is None:
        if not committed:
            resume = _command("resume", run_id, "--store", store)
            _fail(
                f"run {run_id} has no committed checkpoint"
                + (f"; {fails_verification(damaged[-1])}" if damaged else f" yet; `{resume}` continues it")
            )
        iteration = committed[-1]
        if damaged and damaged[-1] > iteration:  # the newest is not the one exported: said, not hidden
            typer.echo(
                f"solrl: warning: {fails_verification(damaged[-1])}; exporting iteration {iteration}, the last "
                "checkpoint that holds",
                err=True,
            )
        elif gaps := [
            i for i, s in uncommitted_gaps(run_.config, set(committed_stages(run_.run_dir))) if s == "checkpoint"
        ]:
            typer.echo(  # uncommitted (verify --redo) or deleted, a later stage still committed
                f"solrl: warning: the checkpoint of iteration {gaps[0]} is not committed, though later stages are "
                f"(uncommitted by `verify --redo`, or deleted); `{_command('resume', run_id, '--store', store)}` "
                f"recomputes it; exporting iteration {iteration}, the last committed checkpoint",
                err=True,
            )
    elif iteration in damaged:
        _fail(f"run {run_id}: {fails_verification(iteration)}")
    elif iteration not in committed:
        _fail(
            f"run {run_id} has no committed checkpoint at iteration {iteration}; committed: "
            f"{', '.join(map(str, committed)) or 'none'}"
        )
    if read_manifest(run_.run_dir, iteration, "checkpoint", verify=True) is None:  # hashed: the weights leave here
        _fail(
            f"run {run_id}: the checkpoint of iteration {iteration} fails verification (a file's bytes changed since "
            f"it was committed); `{_command('verify', run_id, '--store', store, '--redo')}` uncommits it and "
            "`solrl resume` recomputes it"
        )
    cfg = run_.config.model_copy(update={"model": run_.config.model.model_copy(update={"device": "cpu"})})
    context = StageContext(cfg, run_.run_dir, run_id, iteration)
    try:
        checkpoint = Checkpoint.load(run_.run_dir, iteration)
    except StageNotCommitted:  # changed since it was listed above
        _fail(f"run {run_id}: {fails_verification(iteration)}")
    policy = context.load_policy(checkpoint, encode_prompts=False)
    replaced = " (it replaced the file there)" if (out / LORA_WEIGHTS).exists() else ""
    from safetensors import SafetensorError

    try:
        path = save_diffusers_lora(policy, adapter, family.pipeline_class, out)
    except OSError as exc:
        _fail(f"--out {out}: cannot write the LoRA there ({exc.strerror or exc})")
    except SafetensorError as exc:  # safetensors' writer: an I/O error (read-only, a folder of the file's name)
        _fail(f"--out {out}: cannot write the LoRA there ({str(exc).removeprefix('Error while serializing: ')})")
    if family.stock_pipeline:
        how = f"{family.pipeline_class}.from_pretrained(...).load_lora_weights({str(out)!r})"
    else:  # no stock pipeline samples this family: the LoRA goes onto its transformer
        how = (
            f"<the transformer>.load_lora_adapter({str(out)!r}, weight_name={path.name!r}, prefix='transformer') "
            f"({family.name} has no stock diffusers pipeline; its transformer is a {family.pipeline_class}'s, "
            f"in {family.weights_dir(cfg.model) / 'transformer'})"
        )
    if family.guidance_embedding:  # the stock pipeline's own default differs: say what the policy sampled with
        how += f"\n  sample as the policy did with guidance_scale={cfg.model.guidance:g} (the embedded guidance)"
    typer.echo(
        f"{adapter} LoRA of run {run_id} iteration {iteration} written to {path}{replaced}\n  load it with {how}"
    )


@app.command("reward-server")
def reward_server(
    name: Annotated[str, typer.Argument(help="A registered reward (pickscore, hpsv2, ocr, ...).")],
    options: Annotated[
        str, typer.Option(help="The reward's options as YAML/JSON, e.g. '{path: /models/clip}'.")
    ] = "{}",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: a free one, printed).")] = 8765,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
) -> None:
    """Serve a reward over HTTP, for runs whose reward.models.NAME.url points here."""
    import socket

    import torch
    import yaml

    _quiet_environment()
    from pydantic import ValidationError

    from solrl.registry import REWARDS
    from solrl.stages.models import resolve_device
    from solrl.stages.rewards import build_reward
    from solrl.stages.rewards.remote import TOKEN_ENV, create_app, reward_token

    try:
        torch.device("cpu" if device == "auto" else device)
    except RuntimeError:
        _fail(f"--device {device!r}: give auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        _fail(f"--device {device}: torch sees no CUDA device on this machine; give --device cpu or auto")
    try:  # the address first, before a reward model loads for minutes: a port in use fails at once
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as exc:  # socket.gaierror (a name that does not resolve) included
        _fail(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})")
    port = listener.getsockname()[1]  # the one the system chose for --port 0
    try:
        parsed = yaml.safe_load(options) or {}
        if not isinstance(parsed, dict) or parsed.get("url"):
            raise ValueError("--options must be a mapping of the reward's own options (no url)")
        validated = REWARDS.get(name).Options.model_validate(parsed)
        REWARDS.get(name).check_runnable(validated)
        reward = build_reward(name, resolve_device(device) if device == "auto" else torch.device(device), parsed)
    except ValidationError as exc:
        _fail("; ".join(f"--options {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    except (ValueError, ConfigError, yaml.YAMLError) as exc:
        _fail(str(exc))
    import uvicorn

    token = reward_token()
    access = f"bearer token of {TOKEN_ENV} required" if token else f"no token: set {TOKEN_ENV} to require one"
    typer.echo(f"serving reward {name} on http://{host}:{port} (POST /score, GET /health; {access})", err=True)
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(
            f"solrl: warning: --host {host} serves beyond loopback and {TOKEN_ENV} is unset: anyone who reaches "
            f"the port may score",
            err=True,
        )
    uvicorn.Server(uvicorn.Config(create_app(reward, token), host=host, port=port, log_level="warning")).run(
        sockets=[listener]
    )


@app.command("plugins")
def plugins() -> None:
    """List every registered model family, reward, explore precision and loss, and where each comes from: solrl's
    own module, or a plug-in's (``SOLRL_PLUGINS``, or an installed package's ``solrl.plugins`` entry point)."""
    from rich.console import Console
    from rich.table import Table

    from solrl.registry import EXPLORE_BACKENDS, LOSSES, MODELS, REWARDS

    table = Table("kind", "name", "from", box=None, pad_edge=False)
    try:
        for registry in (MODELS, REWARDS, EXPLORE_BACKENDS, LOSSES):
            for name in registry.names():
                built_in = registry.index().get(name)
                where = built_in.module if built_in else f"{registry.get(name).__module__} (plug-in)"
                table.add_row(registry.kind, name, where)
    except ConfigError as exc:  # a plug-in module that fails to import
        _fail(str(exc))
    Console(width=max(100, Console().width), soft_wrap=True).print(table)


@app.command("pretrain-tiny-digits")
def pretrain_tiny_digits(
    steps: Annotated[int, typer.Option(help="Generator pretraining steps (sets how much room RL has).")] = 170,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("stages/models/weights/tiny-digits"),
    seed: int = 0,
) -> None:
    """Train the tiny-digits classifiers and generator from scikit-learn's digits (the shipped weights)."""
    from solrl.stages.models.tiny_digits_pretrain import pretrain

    pretrain(out, steps=steps, seed=seed)


def main() -> None:  # pragma: no cover - the console script's process
    """The ``solrl`` console script: the typer app, and, where a stop signal ended the command, an exit that takes at
    most ``solrl.processes.EXIT_GRACE_S`` whatever a library's exit handler waits on (``exit_within``). Only here,
    in a process that is about to end: an in-process caller of ``app`` (a test's ``CliRunner``) is never ended."""
    try:
        app()
    except SystemExit as exit_:
        if exit_.code in STOP_EXITS:
            from solrl.processes import exit_within

            exit_within(exit_.code)
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
