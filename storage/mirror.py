"""A run of an object store, worked on through a mirror folder on this machine (issue 17).

Stage functions, Zarr, Parquet and safetensors read and write files; an object store has none. A run whose
store is an object store is worked on in a mirror folder on this machine,
``$SOLRL_CACHE/stores/<16 hex of the store URL>/<run_id>/`` (``~/.cache/solrl`` without ``SOLRL_CACHE``). The
store stays the truth: every manifest and ``run.json`` is read from it, every commit goes to it
(``solrl.storage.stage``), and the mirror only holds copies of the files this machine wrote or fetched, each
checked against its manifest's sha256 before it is used. Deleting a mirror loses nothing.

The mirror's root holds ``.store.json``, naming the store, so any process of this machine handed a run folder (a
shard task, a torchrun worker) finds the store from the folder alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from solrl.storage.store import Store

STORE_MARKER = ".store.json"


def cache_root() -> Path:
    """``$SOLRL_CACHE``, else ``~/.cache/solrl``: what this machine keeps for itself."""
    return Path(os.environ.get("SOLRL_CACHE", "~/.cache/solrl")).expanduser()


def run_folder(store: Store, run_id: str) -> Path:
    """The folder this machine reads and writes run ``run_id`` of ``store`` in: the run's own folder in a local
    store, its mirror for an object store (made, with its marker, on first use).

    Raises:
        OSError: the cache folder cannot be written.
    """
    if store.local:
        return Path(store.root) / run_id
    mirror = cache_root() / "stores" / hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    marker = mirror / STORE_MARKER
    if not marker.exists():
        mirror.mkdir(parents=True, exist_ok=True)
        tmp = mirror / f".{STORE_MARKER}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"uri": store.uri}) + "\n")
        os.replace(tmp, marker)
    return mirror / run_id


@functools.lru_cache(maxsize=64)
def _mirrored_store(parent: str) -> Store | None:
    try:
        uri = json.loads((Path(parent) / STORE_MARKER).read_text())["uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Store.open(uri)


def remote(run_dir: Path) -> tuple[Store, str] | None:
    """The object store and the run's key in it when ``run_dir`` is a mirror; None for a run of a local store."""
    store = _mirrored_store(str(Path(run_dir).parent))
    return None if store is None else (store, Path(run_dir).name)


def run_store(run_dir: Path) -> tuple[Store, str]:
    """The store a run folder belongs to and the run's key in it: the object store of a mirror (``remote``), else
    the local store that holds the folder."""
    return remote(run_dir) or (Store.open(Path(run_dir).parent), Path(run_dir).name)


def publish_folder(run_dir: Path, relative: str) -> None:
    """Copy ``<run_dir>/<relative>`` (a folder no stage commits, such as the HTML report) to the object store a
    mirrored run belongs to, file by file; nothing for a run of a local store.

    Raises:
        OSError: the store refused a write.
    """
    if (on_store := remote(run_dir)) is not None:
        store, run_key = on_store
        store.put_folder(Path(run_dir) / relative, f"{run_key}/{relative}")
