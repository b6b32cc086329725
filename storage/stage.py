"""Stage directories, their manifests, and the atomic commit protocol (DESIGN 4).

A stage writes into a temporary sibling (``iter_000003/.explore.tmp-<uuid>``),
which is renamed into place when complete; ``_MANIFEST.json`` (files, sizes,
sha256 checksums, inputs hash, metrics) is written last, itself through a
temporary file and ``os.replace``. A stage directory without a valid manifest
does not exist: readers refuse it, and a re-run deletes and redoes it. Resume
trusts manifests, not memory: ``run_or_skip`` returns the committed manifest
when its inputs hash matches, whatever happened to the Prefect database.

Readers find a stage's files where its manifest says: in the stage folder
itself, or, where the manifest names one (``prefix``), in an attempt folder
inside it. An object store has no rename, so its stage attempts write under
a prefix of their own and commit by the manifest alone (issue 17); a local
store renames and keeps the paths that DuckDB, xarray and the README's
snippets open directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from solrl.processes import RepeatsOnResume
from solrl.storage.mirror import RunPlace, locate
from solrl.storage.store import Store, fsync_dir

MANIFEST = "_MANIFEST.json"
#: An attempt's prefix on an object store: ``a-`` and 12 hex digits (``commit``).
_ATTEMPT = re.compile(r"^a-[0-9a-f]{12}$")

#: The points of a stage's commit where ``commit_hooks`` are called: ``write`` (the stage has written its first file
#: into its temporary folder), ``renamed`` (the folder is in place, or uploaded, its manifest not yet written) and
#: ``committed`` (the manifest is written, the next stage not begun). A multi-process update also calls them with
#: ``rank<r>`` in its process r, after it joined the process group and before it trains.
COMMIT_POINTS = ("write", "renamed", "committed")
#: Called as ``hook(iteration, stage, point)`` when the stage this process is committing reaches ``point``. A hook
#: may raise (the commit is abandoned, as on any error) or end the process (a kill, which a resume must survive):
#: the tests' fault injection is one, installed by a plug-in module (``SOLRL_PLUGINS``, ``tests/fault_injection.py``).
commit_hooks: list[Callable[[int, str, str], None]] = []
_committing: tuple[int, str] | None = None


def commit_point(point: str, where: tuple[int, str] | None = None) -> None:
    """Call ``commit_hooks`` at ``point`` of the commit under way in this process, or of ``where`` (iteration,
    stage) given; nothing when neither. The plug-in modules are imported first (``solrl.registry.load_plugins``),
    so a hook installed by one is in place in every process a run starts.

    Raises:
        Exception: whatever a hook raises (the tests' fault injection raises ``RuntimeError``).
    """
    where = where or _committing
    if where is None:
        return
    from solrl.registry import load_plugins

    load_plugins()
    for hook in list(commit_hooks):
        hook(where[0], where[1], point)


class StageNotCommitted(FileNotFoundError):
    """A stage output was asked for but has no valid manifest (never ran, crashed, or was tampered with)."""


class StageChanged(RepeatsOnResume, StageNotCommitted):
    """A committed stage's file has other bytes than its manifest's sha256 (changed in place at the same size):
    its manifest still stands, so a resume would skip the stage and fail on it again; ``solrl verify --redo``
    uncommits it and the stages that read it."""


class FileEntry(BaseModel):
    size: int
    sha256: str


class StageManifest(BaseModel):
    """What a committed stage wrote, from which inputs, and what it measured."""

    run_id: str
    iteration: int
    stage: str
    inputs_hash: str
    files: dict[str, FileEntry]
    metrics: dict[str, float] = {}
    info: dict[str, Any] = {}
    seconds: float = 0.0
    created: str = ""
    #: The attempt folder, inside the stage's folder, that holds ``files``; "" (a local store) for the stage's
    #: folder itself.
    prefix: str = ""
    #: The machine that computed the stage (``current_node``); "" for runs made before it was recorded.
    node: str = ""
    #: Folders of ``files`` removed since the commit (``prune``: what a pool keeps, ``storage.keep_pools``): their
    #: entries stay in ``files`` as the record of what was there (and in ``digest``), but readers neither expect
    #: nor read them. Folder -> why, e.g. ``{"candidates.zarr/images": "storage.pool=latents"}``.
    pruned: dict[str, str] = {}
    #: Files of ``files`` that ``prune`` rewrote (a Zarr group's metadata, so it no longer lists a pruned array):
    #: their entries now; ``files`` keeps the committed ones.
    rewritten: dict[str, FileEntry] = {}

    def is_pruned(self, rel: str) -> bool:
        """Whether file ``rel`` of ``files`` lies in a pruned folder."""
        return any(rel == folder or rel.startswith(f"{folder}/") for folder in self.pruned)

    def holds(self, folder: str) -> bool:
        """Whether ``folder`` (or the file of that name) has files in ``files`` and is not pruned."""
        return folder not in self.pruned and any(rel == folder or rel.startswith(f"{folder}/") for rel in self.files)

    def present(self) -> dict[str, FileEntry]:
        """What the stage's folder holds now: the entries of ``files`` not pruned, as ``rewritten`` where
        rewritten."""
        return {rel: self.rewritten.get(rel, e) for rel, e in self.files.items() if not self.is_pruned(rel)}

    def digest(self) -> str:
        """sha256 over the inputs hash and every file checksum: what downstream stages hash as their input."""
        payload = json.dumps(
            {"inputs": self.inputs_hash, "files": {k: v.sha256 for k, v in self.files.items()}}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class StageOutput:
    """What a stage function returns besides its files: scalar metrics and small JSON info."""

    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def current_node() -> str:
    """The machine this process runs on: ``ray:<node id>`` inside a Ray cluster (its simulated nodes share a
    host name), else the host name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        with contextlib.suppress(Exception):
            return f"ray:{ray.get_runtime_context().get_node_id()}"
    return socket.gethostname()


def iteration_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / f"iter_{iteration:06d}"


def stage_dir(run_dir: Path, iteration: int, stage: str) -> Path:
    return iteration_dir(run_dir, iteration) / stage


def inputs_hash(
    run_id: str, iteration: int, stage: str, config_digest: str, upstream: dict[str, StageManifest | None]
) -> str:
    """The cache key of a stage: (run id, iteration, stage, config hash, upstream manifest digests)."""
    payload = {
        "run_id": run_id,
        "iteration": iteration,
        "stage": stage,
        "config": config_digest,
        "upstream": {k: (m.digest() if m else None) for k, m in sorted(upstream.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _process_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def plain_modes(root: Path) -> None:
    """Give ``root`` (a file, or a folder and everything under it) the permission bits a plain ``open`` or
    ``mkdir`` gives under the process umask. safetensors writes its files 0600 and ``tempfile.mkdtemp`` makes
    folders 0700: a store's checkpoints, an exported LoRA or a built tiny model would otherwise be unreadable
    to the other users of a shared machine."""
    mask = _process_umask()
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


#: sha256 and size of files as they were written (``record_written``), by absolute path: what a commit takes
#: instead of reading a file back to hash it.
_WRITTEN: dict[str, FileEntry] = {}


def record_written(path: Path, entry: FileEntry) -> None:
    """Record the size and sha256 of the bytes just written to ``path`` (a writer that hashes as it writes: the
    Zarr stores of ``solrl.storage.artifacts``; or a file moved whole from a committed folder, with its entry
    there). The commit of the folder holding ``path`` uses it instead of reading the file back; a file of
    another size than recorded is hashed from disk."""
    _WRITTEN[str(Path(path).absolute())] = entry


def sha256_bytes(data: bytes | memoryview) -> FileEntry:
    """The entry (size, sha256) of ``data``."""
    return FileEntry(
        size=len(data) if isinstance(data, bytes) else data.nbytes, sha256=hashlib.sha256(data).hexdigest()
    )


def _fsync_tree(root: Path) -> dict[str, FileEntry]:
    """fsync every file under ``root`` and return their entries (posix relative paths): hashed as they were
    written where recorded (``record_written``), else read back and hashed."""
    entries = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        size = path.stat().st_size
        written = _WRITTEN.pop(str(path.absolute()), None)
        if written is None or written.size != size:
            written = FileEntry(size=size, sha256=file_sha256(path))
        entries[path.relative_to(root).as_posix()] = written
    return entries


def _forget_written(root: Path) -> None:
    prefix = f"{Path(root).absolute()}/"
    for key in [k for k in _WRITTEN if k.startswith(prefix)]:
        del _WRITTEN[key]


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, with its suffix (a writer that picks its format by it still does), which
    replaces ``path`` once the block ends without error: a full disk or a crash leaves the earlier file whole, or
    none, never half of one. The temporary file is removed whatever happens.

    Raises:
        OSError: what writing or replacing raised (the earlier ``path`` is untouched).
    """
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file, fsync and ``os.replace``: readers see old or new, never half."""
    with replaced_atomically(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def _local_manifest(directory: Path, iteration: int, stage: str) -> StageManifest | str:
    """The manifest in a local stage ``directory`` when it parses, names this stage and iteration, and its attempt
    prefix stays inside the folder; else why not, in a few words (``why_not_committed``). Files are not looked at."""
    try:
        manifest = StageManifest.model_validate_json((directory / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"not committed (no {MANIFEST})"
    except (OSError, ValueError):
        return f"its {MANIFEST} is unreadable"
    # a prefix that leaves the stage's folder is not one this module wrote
    if (
        manifest.stage != stage
        or manifest.iteration != iteration
        or "/" in manifest.prefix
        or (manifest.prefix.startswith("."))
    ):
        return f"its {MANIFEST} is not this stage's"
    return manifest


def read_manifest(
    run_dir: Path,
    iteration: int,
    stage: str,
    *,
    verify: bool = False,
    fetch: bool = False,
    defer: Callable[[str], bool] | None = None,
) -> StageManifest | None:
    """The stage's manifest if the stage is committed, else None.

    Committed means: ``_MANIFEST.json`` parses, names this stage and iteration, and every file it lists exists
    in the folder it names, with its recorded size, and, with ``verify=True``, its recorded sha256. A file's
    sha256 is computed once, when its stage commits it (``commit``); readers check sizes, and the bytes are
    hashed again only where they arrive from elsewhere (a mirror's download) or on demand (``verify=True``,
    ``verify_run``, ``solrl verify``).

    For a run of an object store (``solrl.storage.mirror``) the manifest is read from the store every time and
    sizes are checked against one listing of its attempt's prefix; ``fetch=True`` also downloads into the mirror
    what it lacks (or holds at another size), each download checked against its sha256; ``verify=True`` hashes
    every mirrored file as well and fetches again those that differ. ``defer(file)``: files ``fetch`` leaves on
    the store, for a reader that fetches them when it needs them (``fetch_file``; a pool's chunks).
    """
    directory = stage_dir(run_dir, iteration, stage)
    if (place := locate(run_dir)).mirrored:
        return _read_remote_manifest(place.store, place.key, run_dir, iteration, stage, verify, fetch, defer)
    manifest = _local_manifest(directory, iteration, stage)
    if isinstance(manifest, str):
        return None
    folder = directory / manifest.prefix
    for rel, entry in manifest.present().items():
        path = folder / rel
        try:
            if path.stat().st_size != entry.size or (verify and file_sha256(path) != entry.sha256):
                return None
        except OSError:
            return None
    return manifest


def why_not_committed(run_dir: Path, iteration: int, stage: str) -> str:
    """Why ``read_manifest`` does not accept a stage's manifest, in a few words: ``not committed`` (no manifest),
    ``its _MANIFEST.json is unreadable``, ``its _MANIFEST.json is not this stage's``, or ``a file changed since it
    was committed`` (missing or of another size). A run on an object store says ``no valid manifest``."""
    if locate(run_dir).mirrored:
        return "no valid manifest"
    manifest = _local_manifest(stage_dir(run_dir, iteration, stage), iteration, stage)
    return (
        manifest if isinstance(manifest, str) else "a file changed since it was committed (missing or of another size)"
    )


def not_committed(run_dir: Path, iteration: int, stage: str) -> StageNotCommitted:
    """The error for a stage whose manifest ``read_manifest`` did not accept, saying why (``why_not_committed``)."""
    why = why_not_committed(run_dir, iteration, stage)
    return StageNotCommitted(f"iteration {iteration} stage {stage!r} in {run_dir}: {why}; `solrl resume` recomputes it")


def committed_key(run_dir: Path, iteration: int, stage: str) -> tuple[Store, str]:
    """Where the committed files of a stage lie in the run's store, for readers that open them in place (pyarrow,
    zarr-python, xarray; ``Store.arrow_filesystem``, ``Store.zarr_store``): the store and the key of the folder
    the stage's manifest names (its attempt prefix on an object store). Follows the manifest, never a listing.

    Raises:
        StageNotCommitted: the stage has no valid manifest.
    """
    manifest = read_manifest(run_dir, iteration, stage)
    if manifest is None:
        raise not_committed(run_dir, iteration, stage)
    place = locate(run_dir)
    folder = stage_dir(Path(place.key), iteration, stage) / manifest.prefix
    return place.store, folder.as_posix()


def _stage_key(run_key: str, run_dir: Path, directory: Path) -> str:
    return f"{run_key}/{directory.relative_to(run_dir).as_posix()}"


def _read_remote_manifest(
    store: Store,
    run_key: str,
    run_dir: Path,
    iteration: int,
    stage: str,
    verify: bool,
    fetch: bool,
    defer: Callable[[str], bool] | None = None,
) -> StageManifest | None:
    """``read_manifest`` for a mirrored run: the store's manifest, its mirror copy refreshed."""
    directory = stage_dir(run_dir, iteration, stage)
    key = _stage_key(run_key, run_dir, directory)
    try:
        raw = store.read_bytes(f"{key}/{MANIFEST}")
    except FileNotFoundError:
        (directory / MANIFEST).unlink(missing_ok=True)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / MANIFEST).is_file() or (directory / MANIFEST).read_bytes() != raw:
        tmp = directory / f".{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(raw)
        os.replace(tmp, directory / MANIFEST)  # the mirror shows what the store holds, readable or not
    try:
        manifest = StageManifest.model_validate_json(raw)
    except ValueError:
        return None
    if manifest.stage != stage or manifest.iteration != iteration or not _ATTEMPT.match(manifest.prefix):
        return None
    attempt = f"{key}/{manifest.prefix}"
    if not (verify or fetch):
        sizes = store.sizes(attempt)
        return manifest if all(sizes.get(rel) == entry.size for rel, entry in manifest.present().items()) else None
    folder = directory / manifest.prefix
    present = manifest.present()
    deferred = {rel for rel in present if defer(rel)} if defer is not None and not verify else set()
    if deferred:
        sizes = store.sizes(attempt)  # what is left on the store is checked there, by size
        if any(sizes.get(rel) != present[rel].size for rel in deferred):
            return None
    for rel, entry in present.items():
        if rel in deferred:
            continue
        path = folder / rel
        if path.is_file() and path.stat().st_size == entry.size and (not verify or file_sha256(path) == entry.sha256):
            continue  # written here (hashed at its commit) or fetched here (hashed on arrival) before
        if not _fetch(store, f"{attempt}/{rel}", path, entry):
            return None
    return manifest


def _fetch(store: Store, key: str, path: Path, entry: FileEntry) -> bool:
    """Download ``key`` to ``path``; whether it arrived with the size and sha256 of ``entry`` (a file that does
    not is removed)."""
    try:
        store.get_file(key, path)
    except FileNotFoundError:
        return False
    if path.stat().st_size != entry.size or file_sha256(path) != entry.sha256:
        path.unlink(missing_ok=True)
        return False
    return True


def fetch_file(run_dir: Path, iteration: int, stage: str, manifest: StageManifest, rel: str) -> bool:
    """Bring file ``rel`` of a committed stage of a mirrored run into the mirror, checked against its sha256 (a
    file a reader deferred: ``read_manifest(defer=...)``). True when it is there now; False for a local run or
    a file the manifest does not list or whose download does not match."""
    place = locate(run_dir)
    entry = manifest.present().get(rel)
    if not place.mirrored or entry is None:
        return False
    directory = stage_dir(run_dir, iteration, stage)
    path = directory / manifest.prefix / rel
    if path.is_file() and path.stat().st_size == entry.size:
        return True
    key = f"{_stage_key(place.key, run_dir, directory)}/{manifest.prefix}/{rel}"
    return _fetch(place.store, key, path, entry)


def output_dir(run_dir: Path, iteration: int, stage: str) -> Path:
    """The folder holding the files of the stage's committed attempt, as its manifest names it (sizes checked;
    nothing fetched into a mirror: ``require`` fetches).

    Raises:
        StageNotCommitted: the stage has no valid manifest.
    """
    manifest = read_manifest(run_dir, iteration, stage)
    if manifest is None:
        raise not_committed(run_dir, iteration, stage)
    return stage_dir(run_dir, iteration, stage) / manifest.prefix


def require(
    run_dir: Path,
    iteration: int,
    stage: str,
    *,
    verify: str | None = None,
    defer: Callable[[str], bool] | None = None,
) -> tuple[Path, StageManifest]:
    """The output folder and manifest of a committed stage, for reading its outputs: sizes checked against the
    manifest (checksums were computed when the stage committed them; ``verify_run`` re-hashes on demand), and
    for a mirrored run the files this machine lacks fetched, each download checked against its sha256.
    ``verify``: a file or folder of the stage whose files are hashed as well (a small table or a checkpoint about
    to be read; ``.``: every file of the stage).
    ``defer``: files of a mirrored run left on the store until the reader fetches them (``fetch_file``).

    Raises:
        StageNotCommitted: the stage has no valid manifest, or a file is missing or of another size (or, once
            fetched from an object store, fails its checksum); its folder must not be read.
        StageChanged: (a ``StageNotCommitted``) a ``verify`` file fails its checksum.
    """
    manifest = read_manifest(run_dir, iteration, stage, fetch=True, defer=defer)
    if manifest is None:
        raise not_committed(run_dir, iteration, stage)
    folder = stage_dir(run_dir, iteration, stage) / manifest.prefix
    if verify is not None:
        for rel, entry in manifest.present().items():
            inside = verify == "." or rel == verify or rel.startswith(f"{verify}/")
            if inside and file_sha256(folder / rel) != entry.sha256:
                raise changed_file(run_dir, iteration, stage, rel)
    return folder, manifest


def changed_file(run_dir: Path, iteration: int, stage: str, rel: str) -> StageChanged:
    """The error for file ``rel`` of a committed stage whose bytes no longer match its manifest's sha256, with the
    command that uncommits it (``solrl verify --redo``)."""
    redo = shlex.join(["solrl", "verify", run_dir.name, "--store", locate(run_dir).store.address, "--redo"])
    return StageChanged(
        f"iteration {iteration} stage {stage!r}: {rel} changed since it was committed (sha256); "
        f"`{redo}` uncommits it and every stage that read it"
    )


def remove_dir(path: Path) -> None:
    """Remove an uncommitted stage directory: rename it aside first so a crash never half-deletes in place."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def commit(
    run_dir: Path,
    run_id: str,
    iteration: int,
    stage: str,
    key: str,
    write: Callable[[Path], StageOutput],
    prior_seconds: float = 0.0,
) -> StageManifest:
    """Run ``write(tmp_dir)`` and commit what it wrote as the stage's output.

    Steps: write into a fresh temporary sibling; fsync; move any previous (uncommitted or stale) directory
    aside; rename the temporary directory into place; write the manifest last. On any exception the
    temporary directory is removed and nothing is committed. The manifest's ``seconds`` are the commit's plus
    ``prior_seconds`` (a sharded stage's shards).

    Raises:
        LeaseLost: (``RunPlace.check_lease``, while ``run_lock`` holds the run's lease) this process no
            longer holds the run, which another process took over after this one stalled; nothing is replaced.
    """
    global _committing
    final = stage_dir(run_dir, iteration, stage)
    place = locate(run_dir)
    if place.mirrored:
        stage_key = _stage_key(place.key, run_dir, final)
        replaced = place.store.tag(f"{stage_key}/{MANIFEST}")  # the commit replaces exactly this manifest, or none
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    start = time.perf_counter()
    _committing = (iteration, stage)
    prefix = f"a-{uuid.uuid4().hex[:12]}" if place.mirrored else ""
    try:
        output = write(tmp)
        plain_modes(tmp)
        files = _fsync_tree(tmp)
        manifest = StageManifest(
            run_id=run_id,
            iteration=iteration,
            stage=stage,
            inputs_hash=key,
            files=files,
            metrics={k: float(v) for k, v in output.metrics.items()},
            info=output.info,
            seconds=round(time.perf_counter() - start + prior_seconds, 4),
            created=datetime.now(timezone.utc).isoformat(),
            prefix=prefix,
            node=current_node(),
        )
        if place.mirrored:
            _publish(place, stage_key, tmp, manifest, replaced)
            remove_dir(final)
            final.mkdir()
            os.replace(tmp, final / prefix)  # the mirror: the committed attempt, where readers look for it
        else:
            place.check_lease()
            remove_dir(final)
            os.replace(tmp, final)
            commit_point("renamed")
    except BaseException:
        _committing = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _forget_written(tmp)
    try:
        write_json_atomic(final / MANIFEST, manifest.model_dump(mode="json"))
        commit_point("committed")
    finally:
        _committing = None
    return manifest


class StageCommitLost(RuntimeError):
    """Another writer committed the stage between this attempt's start and its manifest write (object stores)."""


def _publish(place: RunPlace, stage_key: str, folder: Path, manifest: StageManifest, replaced: str | None) -> None:
    """Commit ``folder`` as ``manifest`` on an object store: upload it under the attempt's own prefix, then write
    the manifest conditionally: create-only where there was none, else only over the manifest of tag
    ``replaced``. Of racing writers one wins; a loser removes its prefix, which no manifest names. Attempts the
    new manifest does not name are removed after it (readers never list, so one left by a kill is never read).

    Raises:
        StageCommitLost: another writer's manifest won. LeaseLost: (``place.check_lease``) this process lost the run.
    """
    store = place.store
    attempt = f"{stage_key}/{manifest.prefix}"
    try:
        store.put_folder(folder, attempt)
        commit_point("renamed")  # every file uploaded, the manifest not written
        place.check_lease()
        data = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True).encode() + b"\n"
        key = f"{stage_key}/{MANIFEST}"
        won = store.create(key, data) if replaced is None else store.replace_if(key, data, replaced)
        if won is None:
            raise StageCommitLost(f"{store.url(key)} was committed by another writer first; this attempt is dropped")
    except BaseException:
        with contextlib.suppress(Exception):
            store.delete(attempt)
        raise
    for name in store.ls(stage_key):
        if name != MANIFEST and name != manifest.prefix and _ATTEMPT.match(name):
            store.delete(f"{stage_key}/{name}")


def remove_stage_tree(run_dir: Path, relative: str) -> None:
    """Remove ``<run_dir>/<relative>`` (a sharded stage's shards, once merged): from the store first for a
    mirrored run, then from this machine."""
    if (place := locate(run_dir)).mirrored:
        place.store.delete(f"{place.key}/{relative}")
    remove_dir(Path(run_dir) / relative)


def run_or_skip(
    run_dir: Path,
    run_id: str,
    iteration: int,
    stage: str,
    key: str,
    write: Callable[[Path], StageOutput],
    prior_seconds: float = 0.0,
) -> tuple[StageManifest, bool]:
    """Commit the stage unless a committed manifest with inputs hash ``key`` exists.

    Returns:
        (manifest, skipped): skipped is True when the committed output was reused.
    """
    existing = read_manifest(run_dir, iteration, stage)  # a missing or truncated output is redone
    if existing is not None and existing.inputs_hash == key:
        return existing, True
    return commit(run_dir, run_id, iteration, stage, key, write, prior_seconds), False


@dataclass(frozen=True)
class Mismatch:
    """A committed file whose bytes no longer match its manifest (``verify_run``)."""

    iteration: int
    stage: str
    file: str
    #: ``missing``, ``size`` (another size than recorded), ``sha256`` (same size, other bytes) or
    #: ``unreadable (<why>)`` (it cannot be read: a folder in its place, no permission, an I/O error).
    problem: str


def committed_stages(run_dir: Path) -> list[tuple[int, str]]:
    """Every (iteration, stage) folder of the run holding a manifest, in iteration then name order (a mirrored
    run: as the object store lists them)."""
    if (place := locate(run_dir)).mirrored:
        store, run_key = place.store, place.key
        found = []
        for name in sorted(store.ls(run_key)):
            if re.fullmatch(r"iter_\d{6}", name):
                found += [
                    (int(name[5:]), stage)
                    for stage in sorted(store.ls(f"{run_key}/{name}"))
                    if store.exists(f"{run_key}/{name}/{stage}/{MANIFEST}")
                ]
        return found
    return [
        (int(path.parent.parent.name[5:]), path.parent.name)
        for path in sorted(Path(run_dir).glob(f"iter_[0-9][0-9][0-9][0-9][0-9][0-9]/*/{MANIFEST}"))
    ]


def verify_run(run_dir: Path, on_file: Callable[[int, str, str], None] | None = None) -> list[Mismatch]:
    """Re-hash every file of every committed stage of a run against its manifest (``solrl verify``): the one
    full read of a run's bytes, on demand. A mirrored run's files are hashed as the object store holds them
    (streamed, not kept). ``on_file(iteration, stage, file)`` is called before each file (progress).

    Returns:
        the files that differ or cannot be read, in run order; a stage whose manifest is unreadable gives one
        ``Mismatch`` with file ``_MANIFEST.json`` and problem ``unreadable``.
    """
    place = locate(run_dir)
    found: list[Mismatch] = []
    for iteration, stage in committed_stages(run_dir):
        directory = stage_dir(run_dir, iteration, stage)
        try:
            if place.mirrored:
                key = _stage_key(place.key, run_dir, directory)
                raw = place.store.read_bytes(f"{key}/{MANIFEST}").decode("utf-8")
            else:
                raw = (directory / MANIFEST).read_text(encoding="utf-8")
            manifest = StageManifest.model_validate_json(raw)
        except (OSError, ValueError):
            found.append(Mismatch(iteration, stage, MANIFEST, "unreadable"))
            continue
        for rel, entry in manifest.present().items():
            if on_file is not None:
                on_file(iteration, stage, rel)
            try:
                if place.mirrored:
                    size, digest = _store_sha256(place.store, f"{key}/{manifest.prefix}/{rel}")
                else:
                    path = directory / manifest.prefix / rel
                    size, digest = path.stat().st_size, file_sha256(path)
            except FileNotFoundError:
                found.append(Mismatch(iteration, stage, rel, "missing"))
                continue
            except OSError as exc:  # a folder in its place, a link loop, no permission, a disk's I/O error
                found.append(Mismatch(iteration, stage, rel, f"unreadable ({exc.strerror or exc})"))
                continue
            if size != entry.size:
                found.append(Mismatch(iteration, stage, rel, "size"))
            elif digest != entry.sha256:
                found.append(Mismatch(iteration, stage, rel, "sha256"))
    return found


def _store_sha256(store: Store, key: str) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with store.fs.open(store.path(key), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def uncommit(run_dir: Path, iteration: int, stage: str) -> None:
    """Remove a stage's manifest, so the stage no longer exists and the next resume redoes it (``solrl verify
    --redo``); its files stay until that commit replaces the folder."""
    directory = stage_dir(run_dir, iteration, stage)
    if (place := locate(run_dir)).mirrored:
        place.store.delete(f"{_stage_key(place.key, run_dir, directory)}/{MANIFEST}")
    (directory / MANIFEST).unlink(missing_ok=True)


def prune(
    run_dir: Path,
    iteration: int,
    stage: str,
    folders: dict[str, str],
    rewrite: dict[str, Callable[[bytes], bytes]] | None = None,
) -> int:
    """Remove folders of a committed stage's files (what a pool keeps, ``storage.keep_pools``) and record them in
    its manifest's ``pruned``, keeping every file's entry: the manifest still says what was there, its digest
    (and so every downstream cache key) is unchanged, and readers no longer expect the files. ``rewrite`` edits
    files that describe the removed ones (a Zarr group's consolidated metadata), recorded in ``rewritten``.
    Order: the rewritten files, the manifest, then the removals; a crash between the first two leaves a file of
    another size than its manifest says (the stage is redone on resume, never read wrong), and after the
    manifest only files no reader expects. Folders already pruned, or not in the stage, are skipped.

    Args:
        folders: folder relative to the stage's files (``candidates.zarr/images``) -> why it was removed.
        rewrite: file relative to the stage's files -> its new bytes from its current ones.

    Returns:
        the bytes removed (from the manifest's sizes).

    Raises:
        StageNotCommitted: the stage has no valid manifest.
    """
    manifest = read_manifest(run_dir, iteration, stage)
    if manifest is None:
        raise not_committed(run_dir, iteration, stage)
    new = {folder: why for folder, why in folders.items() if manifest.holds(folder)}
    if not new:
        return 0
    before = sum(e.size for e in manifest.present().values())
    directory = stage_dir(run_dir, iteration, stage)
    folder = directory / manifest.prefix
    place = locate(run_dir)
    attempt = f"{_stage_key(place.key, run_dir, directory)}/{manifest.prefix}" if place.mirrored else ""
    rewritten = dict(manifest.rewritten)
    for rel, edit in (rewrite or {}).items():
        if place.mirrored:
            data = edit(place.store.read_bytes(f"{attempt}/{rel}"))
            place.store.write_bytes(f"{attempt}/{rel}", data)
            (folder / rel).unlink(missing_ok=True)  # fetched again, at its new size, by the next reader
        else:
            data = edit((folder / rel).read_bytes())
            tmp = (folder / rel).with_name(f".{Path(rel).name}.tmp-{uuid.uuid4().hex[:8]}")
            tmp.write_bytes(data)
            os.replace(tmp, folder / rel)
        rewritten[rel] = FileEntry(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    updated = manifest.model_copy(update={"pruned": {**manifest.pruned, **new}, "rewritten": rewritten})
    data = updated.model_dump(mode="json")
    if place.mirrored:
        store = place.store
        store.write_bytes(
            f"{attempt.rsplit('/', 1)[0]}/{MANIFEST}", json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"
        )
        for name in new:
            store.delete(f"{attempt}/{name}")
        (directory / MANIFEST).unlink(missing_ok=True)  # refreshed from the store at the next read
    else:
        write_json_atomic(directory / MANIFEST, data)
    for name in new:
        path = folder / name
        if path.is_dir():
            remove_dir(path)
        elif path.exists():
            path.unlink()
    return before - sum(e.size for e in updated.present().values())
