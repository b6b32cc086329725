"""The run store: ``<root>/<run_id>/run.json`` plus one folder per iteration (DESIGN 4)."""

from __future__ import annotations

import json
import re
import secrets
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from solrl import __version__
from solrl.config import ConfigError, RunConfig, config_digest, validate_config
from solrl.storage.lease import DEFAULT_TTL, LEASE, Lease, LeaseHeld
from solrl.storage.mirror import RunPlace, locate, run_folder
from solrl.storage.stage import MANIFEST, write_json_atomic
from solrl.storage.store import Store, StoreError

RUN_FILE = "run.json"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RUN_ID_CHARACTERS = "ASCII letters, digits, '.', '_' or '-', beginning with a letter or digit"


def solrl_command(*words: object) -> str:
    """A ``solrl`` command line that an error or summary suggests, each word quoted for a POSIX shell where it
    needs it, so that it runs as pasted: ``solrl_command("resume", "r1", "--store", "/data/my runs")`` is
    ``solrl resume r1 --store '/data/my runs'``."""
    return shlex.join(["solrl", *map(str, words)])


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
    #: Iterations whose guard stop (``campaign.on_guard=stop``) a user let the run continue past
    #: (``solrl resume --past-guard``); a guard streak counts only evaluations after the last of them.
    guards_passed: tuple[int, ...] = ()

    @property
    def place(self) -> RunPlace:
        """Where the run lives: its store, key, this machine's folder and, while a lock holds it, its lease."""
        return locate(self.run_dir)

    @property
    def store(self) -> str:
        """The run store as ``--store`` takes it: a local folder's absolute path, or an object store's URL. For an
        object store ``run_dir`` is this machine's mirror of the run (``solrl.storage.mirror``)."""
        return self.place.store.address


def open_store(root: str | Path) -> Store:
    """The store ``storage.root`` (or ``--store``) names. Makes no request.

    Raises:
        ConfigError: (``StoreError``) a URI that cannot name a store.
    """
    return Store.open(root)


def _write_run_file(store: Store, run_dir: Path, data: dict, *, create: bool, tag: str | None = None) -> None:
    """Write ``run.json``: to the store (create-only, or over the version of tag ``tag``), then its mirror copy.

    Raises:
        ConfigError: the run exists already (``create``), or ``run.json`` changed since it was read.
        OSError: the store refused the write.
    """
    if store.local:
        if create and (run_dir / RUN_FILE).exists():
            raise ConfigError(f"run {run_dir.name!r} already exists")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / RUN_FILE, data)
        return
    raw = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    key = f"{run_dir.name}/{RUN_FILE}"
    written = store.create(key, raw) if create else store.replace_if(key, raw, tag or "")
    if written is None:
        raise ConfigError(f"{store.url(key)} {'exists already' if create else 'changed while it was rewritten'}")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / RUN_FILE, data)


def new_run_id(name: str) -> str:
    """``<name>-<UTC yyyymmdd-hhmmss>-<4 hex>``, for a run made without a run id (``name``: the config's).

    Raises:
        ConfigError: ``name`` cannot begin a run id (``check_run_id``); the message blames the config's name.
    """
    run_id = f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    if not _RUN_ID.match(run_id):
        longest = 128 - len(run_id) + len(name)
        raise ConfigError(
            f"config name {name!r} begins the ids of runs made without --run-id, so it must be 1-{longest} "
            f"{_RUN_ID_CHARACTERS}; set name, or give --run-id"
        )
    return run_id


def check_run_id(run_id: str) -> str:
    """Raises ConfigError unless ``run_id`` is a safe folder name."""
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"run id {run_id!r} must be 1-128 {_RUN_ID_CHARACTERS}")
    return run_id


def create_run(cfg: RunConfig, run_id: str | None = None, weights: dict[str, str] | None = None) -> Run:
    """Create ``<storage.root>/<run_id>/run.json`` (atomically), recording the config, the prompts' digest and
    the weights' fingerprint ``weights`` (``solrl.storage.fingerprint``; a resume refuses weights that changed).

    Raises:
        ConfigError: bad run id, a run of that id already exists (use ``solrl resume``), its folder holds files
            but no ``run.json``, or the store cannot be written (read-only, full, or not a folder).
    """
    run_id = check_run_id(run_id or new_run_id(cfg.name))
    store = open_store(cfg.storage.root)
    where = store.address
    store.check(write=True)  # an object store that cannot be used fails here, in one line, with nothing written
    if store.exists(f"{run_id}/{RUN_FILE}"):
        raise ConfigError(
            f"run {run_id!r} already exists in {where}; continue it with "
            f"`{solrl_command('resume', run_id, '--store', where)}`"
        )
    prompts = cfg.prompts_digest()
    try:
        if store.ls(run_id):  # a run's folder whose run.json is gone: its stages would pass for the new run's
            raise ConfigError(
                f"{where}/{run_id} holds files but no {RUN_FILE}, so it is no run solrl can continue, and a new run "
                f"there would take its committed stages for its own; move the folder away or pick another run id"
            )
        run_dir = run_folder(store, run_id)
        _write_run_file(
            store,
            run_dir,
            {
                "run_id": run_id,
                "config": cfg.model_dump(mode="json"),
                "config_hash": cfg.digest(),
                "prompts_sha256": prompts,
                "weights": weights,
                "solrl_version": __version__,
                "created": datetime.now(timezone.utc).isoformat(),
            },
            create=True,
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot create run {run_id!r} in {where} ({exc.strerror or exc}); set storage.root to a writable "
            f"folder or object store"
        ) from None
    return Run(run_id, run_dir, cfg, cfg.digest(), prompts, weights)


def open_run(root: str | Path, run_id: str) -> Run:
    """Open an existing run; its config comes from ``run.json``, never from the current presets. Reads nothing
    else and checks nothing about this machine, so any machine can list, inspect and report any run (whether
    it can also *continue* the run is ``solrl.stages.runnable.check_runnable``).

    Raises:
        ConfigError: no such run, or an unreadable or edited ``run.json``.
    """
    store = open_store(root)
    if "/" in run_id.rstrip("/") and (Path(run_id) / RUN_FILE).is_file():  # a run folder's path, given as its id
        folder = Path(run_id.rstrip("/"))
        raise ConfigError(
            f"run id {run_id!r} is a run's folder; give its store and its id: {folder.name} --store {folder.parent}"
        )
    key = f"{check_run_id(run_id)}/{RUN_FILE}"
    shown = store.root + f"/{key}" if store.local else store.url(key)
    try:
        raw = store.read_bytes(key)
        data = json.loads(raw)
    except FileNotFoundError:
        store.check(write=False)  # no such run, or a store that cannot be reached at all
        if store.local and (Path(store.root) / RUN_FILE).is_file():  # --store named the run's own folder
            there = Path(store.root)
            raise ConfigError(
                f"no run {run_id!r} in {store.address}: that folder is run {there.name!r} itself; its store is "
                f"--store {there.parent}"
            ) from None
        known = ", ".join(r["run_id"] for r in list_runs(root)[-5:]) or "none"
        raise ConfigError(
            f"no run {run_id!r} in {store.address} (recent: {known}); see `{solrl_command('ls', '--store', root)}`"
        ) from None
    except (OSError, ValueError) as exc:
        if not (store.local or isinstance(exc, ValueError)):
            raise StoreError(store.explain(exc)) from None
        if isinstance(exc, NotADirectoryError) and Path(store.root).is_file():  # --store named a file
            raise ConfigError(f"store {store.root} is not a folder; give the folder that holds the runs") from None
        raise ConfigError(f"{shown} is unreadable ({exc})") from exc
    except Exception as exc:  # botocore's and aiohttp's own errors: an object store that does not answer
        raise StoreError(store.explain(exc)) from None
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict) and "config_hash" in data):
        raise ConfigError(f"{shown} is not a solrl run file (no config and config_hash)")
    if config_digest(data["config"]) != data.get("config_hash"):
        raise ConfigError(f"{shown}: config does not match its recorded hash; the file was edited")
    cfg = validate_config(data["config"], plugins=False)
    run_dir = run_folder(store, run_id)
    if not store.local:  # the mirror's copy, for the tools that open the run folder
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / RUN_FILE).is_file() or (run_dir / RUN_FILE).read_bytes() != raw:
            write_json_atomic(run_dir / RUN_FILE, data)
    weights = data.get("weights")
    passed = data.get("guards_passed", [])
    if not (isinstance(passed, list) and all(type(i) is int and i >= 1 for i in passed)):
        raise ConfigError(f"{shown}: guards_passed must be a list of iterations, not {passed!r}; the file was edited")
    return Run(run_id, run_dir, cfg, data["config_hash"], data.get("prompts_sha256"), weights, tuple(passed))


def set_shards(root: str | Path, run_id: str, shards: int) -> None:
    """Record a new ``campaign.shards`` in the run's ``run.json`` (atomically; the caller holds no other writer).

    The shard count lays the work out without changing what is computed (``solrl.config.LAYOUT_FIELDS``), so the
    config hash and every committed stage stay valid: a run killed with 2 shards may resume with 4.

    Raises:
        ConfigError: no such run, an unreadable ``run.json``, or ``shards < 1``.
    """
    if shards < 1:
        raise ConfigError(f"--shards {shards}: give at least 1")
    run = open_run(root, run_id)
    if run.config.campaign.shards == shards:
        return
    store = open_store(root)
    key = f"{run_id}/{RUN_FILE}"
    tag = store.tag(key)
    data = json.loads(store.read_bytes(key))
    data["config"]["campaign"]["shards"] = shards
    if config_digest(data["config"]) != data["config_hash"]:  # the layout field is outside the hash
        raise ConfigError(f"{store.url(key)}: changing campaign.shards would change the config hash")
    _write_run_file(store, run.run_dir, data, create=False, tag=tag)


def pass_guard(run: Run, iteration: int) -> None:
    """Record in ``run``'s ``run.json`` (atomically; the caller holds the run's lease) that its guard stop at
    ``iteration`` is passed: the campaign continues, and a guard stops it again only for a new streak of alarms
    after ``iteration`` (``Run.guards_passed``). The config and its hash are unchanged, so every committed stage
    stays valid; the record stays, for an audit of the run.

    Raises:
        ConfigError: an unreadable ``run.json``.
    """
    if iteration in run.guards_passed:
        return
    store = run.place.store
    key = f"{run.place.key}/{RUN_FILE}"
    tag = store.tag(key)
    data = json.loads(store.read_bytes(key))
    data["guards_passed"] = sorted({*run.guards_passed, iteration})
    _write_run_file(store, run.run_dir, data, create=False, tag=tag)


def _commit_time(store: Store, key: str) -> str | None:
    """The ``created`` time a stage manifest records, None when it is unreadable (torn, or not a manifest): such
    a stage is not committed, and ``inspect`` names it."""
    try:
        data = json.loads(store.read_bytes(key))
    except (OSError, ValueError):
        return None
    return str(data.get("created", "")) if isinstance(data, dict) else None


def list_runs(root: str | Path) -> list[dict[str, object]]:
    """Summaries of the runs under ``root``, oldest first: id, created, model family (and ``(tiny twin)`` for
    ``model.source: tiny``), iterations committed (manifests present, not verified), the newest committed stage,
    whether a live process holds the run (``running``) and whether its campaign's last stage, the final evaluation,
    is committed (``complete``), and where the run is (its folder, or its URL in an object store).

    Raises:
        ConfigError: (``StoreError``) an object store that cannot be listed.
    """
    store = open_store(root)
    rows: list[dict[str, object]] = []
    for run_id in store.ls():
        if not store.exists(f"{run_id}/{RUN_FILE}"):
            continue  # not a run: MLflow's database and folder, anything else kept beside the runs
        where = store.path(run_id) if store.local else store.url(run_id)
        try:
            data = json.loads(store.read_bytes(f"{run_id}/{RUN_FILE}"))
        except (OSError, ValueError):
            data = None
        readable = isinstance(data, dict) and isinstance(data.get("config"), dict)
        if not (readable and config_digest(data["config"]) == data.get("config_hash")):
            # Listed, not hidden: inspect and resume name the damaged file; ls must not make the run look gone,
            # nor show what a hand-edited config says (every other command refuses it).
            rows.append(
                {
                    "run_id": run_id,
                    "created": "",
                    "iterations_done": "?",
                    "iterations": "?",
                    "model": f"{RUN_FILE} " + ("edited (config hash)" if readable else "unreadable"),
                    "last_stage": "",
                    "running": False,
                    "complete": False,
                    "explore": "",
                    "path": where,
                }
            )
            continue
        iterations = sorted(name for name in store.ls(run_id) if name.startswith("iter_"))
        done = [i for i in iterations if store.exists(f"{run_id}/{i}/checkpoint/{MANIFEST}")]
        last = ""
        if iterations:  # the newest committed stage, e.g. "iter 3: select"
            newest = f"{run_id}/{iterations[-1]}"
            committed = sorted(  # by the commit time a manifest records: pruning a pool rewrites its manifest later
                (created, name)
                for name in store.ls(newest)
                if store.exists(f"{newest}/{name}/{MANIFEST}")
                and (created := _commit_time(store, f"{newest}/{name}/{MANIFEST}")) is not None
            )
            last = f"iter {int(iterations[-1][5:])}: {committed[-1][1]}" if committed else ""
        config = data.get("config", {})
        model = config.get("model", {})
        campaign = config.get("campaign", {})
        final = f"{run_id}/iter_{int(campaign.get('iterations', 0)):06d}/evaluate/{MANIFEST}"  # a campaign's last stage
        rows.append(
            {
                "run_id": run_id,  # the folder's name, which every command takes (a copied run's is not run.json's)
                "created": data.get("created", ""),
                "iterations_done": len(done),
                "iterations": config.get("campaign", {}).get("iterations", "?"),
                "model": str(model.get("family", "?")) + (" (tiny twin)" if model.get("source") == "tiny" else ""),
                "last_stage": last,
                "running": Lease(store, f"{run_id}/{LEASE}").held_by() is not None,
                "complete": store.exists(final) and _commit_time(store, final) is not None,
                "explore": "{precision} pool {pool_size}".format(
                    **{"precision": "?", "pool_size": "?", **config.get("explore", {})}
                ),
                "path": where,
            }
        )
    return sorted(rows, key=lambda r: str(r["created"]))


def _run_lease(place: RunPlace, ttl: float = DEFAULT_TTL) -> Lease:
    """The lease object of the run at ``place`` (``<run_dir>/_LEASE.json`` in its store)."""
    return Lease(place.store, f"{place.key}/{LEASE}", ttl)


def run_holder(run_dir: Path) -> str | None:
    """The live process holding the run's lease (``pid P on H for another S s``), or None; writes nothing (the
    lease is read, not taken), so it answers on a read-only store and never races a starting ``resume``."""
    return _run_lease(locate(Path(run_dir))).held_by()


@contextmanager
def run_lock(
    run_dir: Path, ttl: float = DEFAULT_TTL, *, then: tuple[object, ...] = ("resume",), join: bool = False
) -> Iterator[None]:
    """Hold the run's lease (``<run_dir>/_LEASE.json``, ``solrl.storage.lease``) for the ``with`` block: renewed
    in the background, checked before every stage commit of this process, free at once when its holder dies on
    this host and after ``ttl`` seconds when it dies elsewhere. ``then``: the command a refusal suggests once the
    holder is gone (``solrl <then[0]> <run id> --store <store> <then[1:]>``), the one that was refused.

    ``join``: where this process holds the run's lease already (the command line takes it before Prefect starts and
    the campaign flow joins it), the block uses that lease and its holder releases it; without ``join`` a second
    ``run_lock`` of the same run in one process is refused like another process's.

    Raises:
        ConfigError: another live process holds the run; the lease cannot be written (a read-only or full store).
        LeaseLost: (when the block ends without an error) the lease ran out while this process stalled and another
            process took the run over: what this process did after that must not read as a finished campaign.
    """
    run_dir = Path(run_dir)
    place = locate(run_dir)
    if join and place.lease is not None:
        yield
        place.lease.check()
        return
    store = place.store
    lease = _run_lease(place, ttl)
    try:
        lease.acquire()
    except LeaseHeld as exc:
        raise ConfigError(
            f"run {run_dir.name!r} is being written by another process ({exc}); wait for it or stop it (a lease "
            f"whose holder died elsewhere runs out by itself), then "
            f"`{solrl_command(then[0], run_dir.name, '--store', store.address, *then[1:])}`"
        ) from None
    except (OSError, StoreError) as exc:  # a read-only or full store: nothing of the run can be written either
        raise ConfigError(
            f"run {run_dir.name!r}: cannot write its lease in {store.address} ({exc.__class__.__name__}: {exc}); "
            "resuming or pruning a run needs a store this process can write"
        ) from None
    place.lease = lease
    try:
        yield
        lease.check()
    finally:
        place.lease = None
        lease.release()
