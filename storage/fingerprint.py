"""Cheap fingerprints of large weight folders, so a resumed run refuses weights that changed under it.

Reading tens of GB on every ``solrl resume`` is not an option; a file's fingerprint is its size and the
sha256 of ``SAMPLES`` blocks of ``BLOCK`` bytes at evenly spaced offsets (the first and last block included).
That catches a file replaced, re-saved, fine-tuned in place, truncated or extended; it can miss an edit of a
few bytes between two sampled blocks of a file of the same size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BLOCK = 64 * 1024
SAMPLES = 16


def file_fingerprint(path: Path) -> str:
    """``"<size>:<sha256 of the sampled blocks>"`` of one file (symlinks followed, as in a hub cache)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= BLOCK * SAMPLES:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek((size - BLOCK) * i // (SAMPLES - 1))
                digest.update(f.read(BLOCK))
    return f"{size}:{digest.hexdigest()}"


def folder_fingerprint(root: Path) -> dict[str, str]:
    """``{relative posix path: file_fingerprint}`` of every non-hidden file under ``root``; ``{}`` when
    ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for directory, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                path = Path(directory) / name
                found[path.relative_to(root).as_posix()] = file_fingerprint(path)
    return found


def changed_files(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Paths added, removed or changed between two ``folder_fingerprint`` results, sorted."""
    return sorted(p for p in recorded.keys() | current.keys() if recorded.get(p) != current.get(p))
