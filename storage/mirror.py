"""A run of an object store, worked on through a mirror folder on this machine (issue 17).

Stage functions, Zarr, Parquet and safetensors read and write files; an object store has none. A run whose
store is an object store is worked on in a mirror folder on this machine,
``$SOLRL_CACHE/stores/<16 hex of the store URL>/<run_id>/`` (``~/.cache/solrl`` without ``SOLRL_CACHE``). The
store stays the truth: every manifest and ``run.json`` is read from it, every commit goes to it
(``solrl.storage.stage``), and the mirror only holds copies of the files this machine wrote or fetched, each
checked against its manifest's sha256 before it is used. Deleting a mirror loses nothing.

Where a run lives is one object, its ``RunPlace``: the store that holds it, its key there, the folder this machine
works in, and the lease of the process holding the run. ``run_folder`` records the place of every run this process
opens (``solrl.storage.runs.open_run``, ``create_run``), and everything after it looks the place up by the folder
(``locate``). Another process is handed the store and the run id (a shard task, a torchrun or Ray Train worker),
never a folder, and opens the run itself: no code finds out again where a run lives.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from solrl.storage.store import Store

if TYPE_CHECKING:
    from solrl.storage.lease import Lease

STORE_MARKER = ".store.json"


def cache_root() -> Path:
    """``$SOLRL_CACHE``, else ``~/.cache/solrl``: what this machine keeps for itself."""
    return Path(os.environ.get("SOLRL_CACHE", "~/.cache/solrl")).expanduser()


@dataclass
class RunPlace:
    """Where a run lives: ``store`` holds it under ``key`` (the truth), and this machine reads and writes it in
    ``folder`` (the run's own folder in a local store, its mirror for an object store). ``lease`` is the run's
    lease while this process holds it (``solrl.storage.runs.run_lock``), checked before each commit of the run's
    stages (``check_lease``)."""

    folder: Path
    store: Store
    key: str
    lease: Lease | None = None

    @property
    def mirrored(self) -> bool:
        """Whether the run is on an object store, worked on through a mirror here."""
        return not self.store.local

    def check_lease(self) -> None:
        """Before a commit: nothing unless this process holds the run's lease (``run_lock``).

        Raises:
            LeaseLost: the lease this process held was taken over (``solrl.storage.lease.Lease.check``).
        """
        if self.lease is not None:
            self.lease.check()


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
    """The place of run folder ``run_dir``, as ``run_folder`` recorded it when this process opened the run; a folder
    of a local store that this process did not open is a run of that store (its parent folder).

    Raises:
        ValueError: ``run_dir`` is an object store run's mirror that this process did not open: its files are only
            this machine's copies, and the run is opened from its store (``open_run(store, run_id)``).
    """
    key = str(run_dir)
    if key not in _PLACES:
        folder = Path(run_dir)
        if (folder.parent / STORE_MARKER).exists():
            raise ValueError(
                f"{folder} is a mirror of an object store's run, not a run store: open the run from its store "
                f"(open_run(store, {folder.name!r}))"
            )
        _PLACES[key] = RunPlace(folder, Store.open(folder.parent), folder.name)
    return _PLACES[key]


def publish_folder(run_dir: Path, relative: str) -> None:
    """Copy ``<run_dir>/<relative>`` (a folder no stage commits, such as the HTML report) to the object store a
    mirrored run belongs to, file by file; nothing for a run of a local store.

    Raises:
        OSError: the store refused a write.
    """
    place = locate(run_dir)
    if place.mirrored:
        place.store.put_folder(Path(run_dir) / relative, f"{place.key}/{relative}")
