"""A run of an object store, worked on through a mirror folder on this machine (issue 17).

Stage functions, Zarr, Parquet and safetensors read and write files; an object store has none. A run whose
store is an object store is worked on in a mirror folder on this machine,
``$SOLRL_CACHE/stores/<16 hex of the store URL>/<run_id>/`` (``~/.cache/solrl`` without ``SOLRL_CACHE``). The
store stays the truth: every manifest and ``run.json`` is read from it, every commit goes to it
(``solrl.storage.stage``), and the mirror only holds copies of the files this machine wrote or fetched, each
checked against its manifest's sha256 before it is used. Deleting a mirror loses nothing.

Where a run lives is one object, its ``RunPlace``: the store that holds it, its key there, the folder this machine
works in, and the commit guard of the process holding its lease. ``run_folder`` records the place of every run it
opens; a process handed only a folder (a shard task, a torchrun worker) finds it once from the mirror's root,
which holds ``.store.json`` naming the store, and ``locate`` keeps it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from solrl.storage.store import Store

STORE_MARKER = ".store.json"


def cache_root() -> Path:
    """``$SOLRL_CACHE``, else ``~/.cache/solrl``: what this machine keeps for itself."""
    return Path(os.environ.get("SOLRL_CACHE", "~/.cache/solrl")).expanduser()


@dataclass
class RunPlace:
    """Where a run lives: ``store`` holds it under ``key`` (the truth), and this machine reads and writes it in
    ``folder`` (the run's own folder in a local store, its mirror for an object store). ``guard`` is called before
    each commit of the run's stages while this process holds its lease (``solrl.storage.runs.run_lock``); it
    raises ``LeaseLost`` once the lease was taken over."""

    folder: Path
    store: Store
    key: str
    guard: Callable[[], None] | None = None

    @property
    def mirrored(self) -> bool:
        """Whether the run is on an object store, worked on through a mirror here."""
        return not self.store.local


#: The place of every run folder this process opened or was handed (``locate``), by its folder.
_PLACES: dict[str, RunPlace] = {}


def run_folder(store: Store, run_id: str) -> Path:
    """The folder this machine reads and writes run ``run_id`` of ``store`` in: the run's own folder in a local
    store, its mirror for an object store (made, with its marker, on first use). Records the run's place.

    Raises:
        OSError: the cache folder cannot be written.
    """
    if store.local:
        folder = Path(store.root) / run_id
    else:
        mirror = cache_root() / "stores" / hashlib.sha256(store.uri.encode()).hexdigest()[:16]
        marker = mirror / STORE_MARKER
        if not marker.exists():
            mirror.mkdir(parents=True, exist_ok=True)
            tmp = mirror / f".{STORE_MARKER}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps({"uri": store.uri}) + "\n")
            os.replace(tmp, marker)
        folder = mirror / run_id
    place = _PLACES.get(str(folder))
    if place is None or place.store.uri != store.uri:
        _PLACES[str(folder)] = RunPlace(folder, store, run_id)
    return folder


def locate(run_dir: Path) -> RunPlace:
    """The place of run folder ``run_dir``: as ``run_folder`` recorded it, else found once from the folder (a
    mirror's root names its object store; any other folder is a run of the local store that holds it)."""
    key = str(run_dir)
    if key not in _PLACES:
        folder = Path(run_dir)
        store = _mirrored_store(str(folder.parent)) or Store.open(folder.parent)
        _PLACES[key] = RunPlace(folder, store, folder.name)
    return _PLACES[key]


@functools.lru_cache(maxsize=64)
def _mirrored_store(parent: str) -> Store | None:
    try:
        uri = json.loads((Path(parent) / STORE_MARKER).read_text())["uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Store.open(uri)


def publish_folder(run_dir: Path, relative: str) -> None:
    """Copy ``<run_dir>/<relative>`` (a folder no stage commits, such as the HTML report) to the object store a
    mirrored run belongs to, file by file; nothing for a run of a local store.

    Raises:
        OSError: the store refused a write.
    """
    place = locate(run_dir)
    if place.mirrored:
        place.store.put_folder(Path(run_dir) / relative, f"{place.key}/{relative}")
