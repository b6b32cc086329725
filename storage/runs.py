"""The run store: ``<root>/<run_id>/run.json`` plus one folder per iteration (DESIGN 4)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from solrl import __version__
from solrl.config import ConfigError, RunConfig, config_digest, validate_config
from solrl.storage import stage
from solrl.storage.lease import DEFAULT_TTL, LEASE, Lease, LeaseHeld
from solrl.storage.stage import MANIFEST, write_json_atomic
from solrl.storage.store import Store

RUN_FILE = "run.json"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Run:
    """A run on disk: its id, folder and (validated) config."""

    run_id: str
    run_dir: Path
    config: RunConfig
    #: The hash recorded at creation: stage cache keys use it, so a solrl upgrade that adds config fields
    #: with defaults does not invalidate the stages a run already committed.
    config_hash: str
    #: sha256 of the prompt lists at creation (``RunConfig.prompts_digest``); None for runs made before it.
    prompts_sha256: str | None = None
    #: ``storage.fingerprint.folder_fingerprint`` of the model weights at creation; None when not recorded.
    weights: dict[str, str] | None = None


def new_run_id(name: str) -> str:
    """``<preset>-<UTC yyyymmdd-hhmmss>-<4 hex>``."""
    return f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    """Raises ConfigError unless ``run_id`` is a safe folder name."""
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"run id {run_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return run_id


def create_run(cfg: RunConfig, run_id: str | None = None, weights: dict[str, str] | None = None) -> Run:
    """Create ``<storage.root>/<run_id>/run.json`` (atomically), recording the config, the prompts' digest and
    the weights' fingerprint ``weights`` (``solrl.storage.fingerprint``; a resume refuses weights that changed).

    Raises:
        ConfigError: bad run id, a run of that id already exists (use ``solrl resume``), or the store cannot be
            written (read-only, full, or not a folder).
    """
    run_id = check_run_id(run_id or new_run_id(cfg.name))
    run_dir = Path(cfg.storage.root).expanduser().resolve() / run_id
    if (run_dir / RUN_FILE).exists():
        raise ConfigError(
            f"run {run_id!r} already exists in {run_dir.parent}; continue it with `solrl resume {run_id} --store "
            f"{run_dir.parent}`"
        )
    prompts = cfg.prompts_digest()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            run_dir / RUN_FILE,
            {
                "run_id": run_id,
                "config": cfg.model_dump(mode="json"),
                "config_hash": cfg.digest(),
                "prompts_sha256": prompts,
                "weights": weights,
                "solrl_version": __version__,
                "created": datetime.now(timezone.utc).isoformat(),
            },
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot create run {run_id!r} in {run_dir.parent} ({exc.strerror or exc}); set "
            f"storage.root to a writable folder"
        ) from None
    return Run(run_id, run_dir, cfg, cfg.digest(), prompts, weights)


def open_run(root: str | Path, run_id: str) -> Run:
    """Open an existing run; its config comes from ``run.json``, never from the current presets. Reads nothing
    else and checks nothing about this machine, so any machine can list, inspect and report any run (whether
    it can also *continue* the run is ``solrl.stages.runnable.check_runnable``).

    Raises:
        ConfigError: no such run, or an unreadable or edited ``run.json``.
    """
    run_dir = Path(root).expanduser().resolve() / check_run_id(run_id)
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(r["run_id"] for r in list_runs(root)[-5:]) or "none"
        raise ConfigError(f"no run {run_id!r} in {run_dir.parent} (recent: {known}); see `solrl ls`") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{run_dir / RUN_FILE} is unreadable ({exc})") from exc
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict) and "config_hash" in data):
        raise ConfigError(f"{run_dir / RUN_FILE} is not a solrl run file (no config and config_hash)")
    if config_digest(data["config"]) != data.get("config_hash"):
        raise ConfigError(f"{run_dir / RUN_FILE}: config does not match its recorded hash; the file was edited")
    cfg = validate_config(data["config"], plugins=False)
    return Run(run_id, run_dir, cfg, data["config_hash"], data.get("prompts_sha256"), data.get("weights"))


def set_shards(root: str | Path, run_id: str, shards: int) -> None:
    """Record a new ``campaign.shards`` in the run's ``run.json`` (atomically; the caller holds no other writer).

    The shard count lays the work out without changing any result (``solrl.config.LAYOUT_FIELDS``), so the
    config hash and every committed stage stay valid: a run killed with 2 shards may resume with 4.

    Raises:
        ConfigError: no such run, an unreadable ``run.json``, or ``shards < 1``.
    """
    if shards < 1:
        raise ConfigError(f"--shards {shards}: give at least 1")
    run = open_run(root, run_id)
    if run.config.campaign.shards == shards:
        return
    path = run.run_dir / RUN_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    data["config"]["campaign"]["shards"] = shards
    if config_digest(data["config"]) != data["config_hash"]:  # the layout field is outside the hash
        raise ConfigError(f"{path}: changing campaign.shards would change the config hash")
    write_json_atomic(path, data)


def list_runs(root: str | Path) -> list[dict[str, object]]:
    """Summaries of the runs under ``root``, oldest first: id, created, iterations committed."""
    rows = []
    for run_file in sorted(Path(root).expanduser().glob(f"*/{RUN_FILE}")):
        try:
            data = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not (isinstance(data, dict) and isinstance(data.get("config", {}), dict)):
            continue
        iterations = sorted(run_file.parent.glob("iter_*"))
        done = [d for d in iterations if (d / "checkpoint" / MANIFEST).exists()]
        last = ""
        if iterations:  # the newest committed stage, e.g. "iter 3: select"
            committed = sorted((p.stat().st_mtime, p.parent.name) for p in iterations[-1].glob(f"*/{MANIFEST}"))
            last = f"iter {int(iterations[-1].name[5:])}: {committed[-1][1]}" if committed else ""
        config = data.get("config", {})
        rows.append(
            {
                "run_id": data.get("run_id", run_file.parent.name),
                "created": data.get("created", ""),
                "iterations_done": len(done),
                "iterations": config.get("campaign", {}).get("iterations", "?"),
                "last_stage": last,
                "explore": "{precision} pool {pool_size}".format(
                    **{"precision": "?", "pool_size": "?", **config.get("explore", {})}
                ),
                "path": str(run_file.parent),
            }
        )
    return sorted(rows, key=lambda r: str(r["created"]))


@contextmanager
def run_lock(run_dir: Path, ttl: float = DEFAULT_TTL) -> Iterator[None]:
    """Hold the run's lease (``<run_dir>/_LEASE.json``, ``solrl.storage.lease``) for the ``with`` block: renewed
    in the background, checked before every stage commit of this process, free at once when its holder dies on
    this host and after ``ttl`` seconds when it dies elsewhere.

    Raises:
        ConfigError: another live process holds the run.
    """
    run_dir = Path(run_dir)
    lease = Lease(Store.open(run_dir.parent), f"{run_dir.name}/{LEASE}", ttl)
    try:
        lease.acquire()
    except LeaseHeld as exc:
        raise ConfigError(
            f"run {run_dir.name!r} is being written by another process ({exc}); wait for it or stop it (a lease "
            f"whose holder died elsewhere runs out by itself), then `solrl resume {run_dir.name} --store "
            f"{run_dir.parent}`"
        ) from None
    stage.commit_guard = lease.check
    try:
        yield
    finally:
        stage.commit_guard = None
        lease.release()
