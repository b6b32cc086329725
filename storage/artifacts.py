"""Typed stage outputs (DESIGN 3, "typed artifacts"; as trl's DDPO pipeline outputs).

Each class is one file or folder a stage commits: it owns the stage and file name, the schema (Zarr array
dimensions, Parquet columns), and its read and write. A stage function declares what it reads by the types of
its parameters (``pool: CandidatePool``); ``solrl.stages.pipeline`` resolves them, and the stage's cache
key follows from the same declaration, so no file name is typed twice and no read is declared twice.

``offset`` places an artifact relative to the iteration of the stage that reads it: ``StartingPolicy`` is the
previous iteration's checkpoint (none at iteration 1: the base model), ``TrainedPolicy`` this iteration's
(none at iteration 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zarr

from solrl.storage.checkpoints import load_checkpoint, save_checkpoint
from solrl.storage.mirror import locate
from solrl.storage.stage import (
    FileEntry,
    StageManifest,
    changed_file,
    commit_point,
    fetch_file,
    file_sha256,
    prune,
    read_manifest,
    record_written,
    require,
    sha256_bytes,
    stage_dir,
)

A = TypeVar("A", bound="Artifact")
Z = TypeVar("Z", bound="ZarrArtifact")


class Artifact:
    """Base of every stage output. Subclasses set ``stage`` and ``filename`` and implement read/write."""

    stage: ClassVar[str]
    filename: ClassVar[str]
    #: Read from iteration ``reader's iteration + offset``.
    offset: ClassVar[int] = 0
    #: The first iteration that has this artifact; earlier, a reader gets None (e.g. no checkpoint before 1).
    first_iteration: ClassVar[int] = 0
    #: Whether ``load`` hashes the artifact's file against its manifest before reading it: the small tables (a
    #: few kB, so a changed byte never reaches a ranking) and the checkpoints (the LoRA adapters and optimizer
    #: state, so a changed byte never trains on; a second or so at published sizes). Pools and samples are Zarr
    #: stores whose files are hashed as they are read, but their images, checked by size only
    #: (``ZarrArtifact.unhashed``); ``solrl verify`` re-hashes everything on demand.
    verify_on_read: ClassVar[bool] = False

    @classmethod
    def source_iteration(cls, iteration: int) -> int | None:
        """The iteration this artifact is read from by a stage of ``iteration``; None when there is none."""
        source = iteration + cls.offset
        return source if source >= cls.first_iteration else None

    @classmethod
    def manifest(cls, run_dir: Path, iteration: int) -> StageManifest | None:
        """The manifest of the committed stage holding this artifact for a reader at ``iteration`` (cache keys)."""
        source = cls.source_iteration(iteration)
        return None if source is None else read_manifest(run_dir, source, cls.stage)

    @classmethod
    def path(cls, run_dir: Path, iteration: int) -> Path:
        """Where the artifact of ``iteration`` (its own iteration, no offset) lives."""
        return stage_dir(run_dir, iteration, cls.stage) / cls.filename

    @classmethod
    def load(cls: type[A], run_dir: Path, iteration: int) -> A | None:
        """Read the artifact for a reader at ``iteration`` (sizes checked; its file hashed with
        ``verify_on_read``); None before ``first_iteration``.

        Raises:
            StageNotCommitted: its stage has no valid manifest (or its file changed, with ``verify_on_read``).
        """
        source = cls.source_iteration(iteration)
        if source is None:
            return None
        directory, _ = require(run_dir, source, cls.stage, verify=cls.filename if cls.verify_on_read else None)
        return cls.read(directory / cls.filename)

    @classmethod
    def read(cls: type[A], path: Path) -> A:
        raise NotImplementedError

    def write(self, out: Path) -> None:
        """Write into the stage's (temporary) output folder ``out``."""
        raise NotImplementedError


# -- Zarr artifacts ---------------------------------------------------------------------------------------------


#: Bytes a Zarr chunk aims at: a prompt's candidates are chunked together up to this size, so a reader that wants
#: a few candidates (the kept seeds, a reward batch) reads little more than those, and a small pool keeps one
#: chunk (file) per prompt.
CHUNK_BYTES = 4 << 20


def chunk_shape(shape: tuple[int, ...], itemsize: int, dims: tuple[str, ...]) -> tuple[int, ...]:
    """The chunks of an array of a Zarr artifact: one prompt per chunk along the leading axis; along the second
    axis (candidates, slots, samples) as many as fit in ``CHUNK_BYTES`` (at least one); a video array one video
    per chunk. The chunk only depends on the array's shape, so the same data always gives the same files."""
    if len(shape) < 2:
        return tuple(shape)
    if "frame" in dims or "latent_frame" in dims:  # a prompt's pool of 81-frame videos is gigabytes
        return (1, 1, *shape[2:])
    per_item = itemsize * int(np.prod(shape[2:], dtype=np.int64))
    return (1, max(1, min(shape[1], CHUNK_BYTES // max(per_item, 1))), *shape[2:])


class LazyArray:
    """A Zarr array of a committed artifact, read only where it is indexed (issue 36): ``shape``, ``dtype`` and
    ``ndim`` without reading; ``array[key]`` reads only the chunks ``key`` touches and returns numpy, for integer
    and slice keys and for integer-array keys on the leading axes (numpy's broadcasting, e.g.
    ``pool.images[rows, kept]`` with rows ``[P, 1]`` and kept ``[P, k]``); ``np.asarray(array)`` reads it whole."""

    def __init__(self, array: zarr.Array) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self) -> Any:
        return iter(np.asarray(self))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = np.asarray(self.array[...])
        return data if dtype is None else data.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> np.ndarray:
        keys = key if isinstance(key, tuple) else (key,)
        arrays = [k for k in keys if isinstance(k, np.ndarray | list)]
        if not arrays:
            return np.asarray(self.array[key])
        fancy = 0
        while fancy < len(keys) and isinstance(keys[fancy], np.ndarray | list):
            fancy += 1
        rest = keys[fancy:]
        if len(arrays) != fancy or any(not (isinstance(k, slice) and k == slice(None)) for k in rest):
            return np.asarray(self)[key]  # a selection Zarr cannot take: read whole, index in numpy
        coords = np.broadcast_arrays(*(np.asarray(k, dtype=np.int64) for k in keys[:fancy]))
        shape = coords[0].shape
        if coords[0].size == 0:
            return np.empty((*shape, *self.shape[fancy:]), self.dtype)
        flat = [np.where(c < 0, c + n, c).reshape(-1) for c, n in zip(coords, self.shape)]
        out = np.empty((flat[0].size, *self.shape[fancy:]), self.dtype)
        for first in np.unique(flat[0]):  # one leading index at a time: its chunks only
            where = np.flatnonzero(flat[0] == first)
            others = [np.unique(f[where], return_inverse=True) for f in flat[1:]]
            block = np.asarray(self.array.get_orthogonal_selection((int(first), *(u for u, _ in others))))
            out[where] = block[tuple(inverse for _, inverse in others)] if others else block
        return out.reshape(*shape, *self.shape[fancy:])


@dataclass
class ZarrArtifact(Artifact):
    """Arrays sharing a leading prompt axis, one Zarr group, chunked one prompt per chunk along the leading axis
    (so a shard of prompts writes its own region) and a few candidates along the second (``chunk_shape``), every
    array with named dimensions (xarray opens the store).

    ``read`` opens the group lazily: the arrays named in ``lazy`` (the images and latents: a pool at published
    size is gigabytes) are ``LazyArray`` views that read only what is indexed, the others (seeds, indices) are
    read whole. A stage that produces its arrays a few prompts at a time writes them as it goes through
    ``writer`` (``ZarrWriter``)."""

    #: array name -> dimension names; arrays may be absent (None) unless listed in ``required``.
    dims: ClassVar[dict[str, tuple[str, ...]]]
    required: ClassVar[tuple[str, ...]]
    #: The arrays ``read`` leaves in the store until indexed (``LazyArray``); the only ones ``prune`` removes.
    lazy: ClassVar[tuple[str, ...]] = ("images", "latents", "trajectory")
    #: The arrays whose files ``load`` does not hash as Zarr reads them (``CheckingStore``), only checks by size:
    #: the images, the bulk of a pool (about 14 GiB a published iteration, some 14 s of sha256 on a core), which
    #: rewards score. Every other file (the metadata, seeds, indices, and the latents, trajectories and log-probs
    #: that the update trains on) is hashed when read, so a changed byte never trains on.
    unhashed: ClassVar[tuple[str, ...]] = ("images",)
    attrs: dict[str, Any] = field(default_factory=dict)
    #: Arrays removed since the commit (``solrl.storage.retention``), name -> why; they read as None.
    pruned: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls: type[A], run_dir: Path, iteration: int) -> A | None:
        """``Artifact.load``, the arrays the stage's manifest records as pruned set to None (and named in
        ``pruned``)."""
        source = cls.source_iteration(iteration)
        if source is None:
            return None
        chunks = f"{cls.filename}/"

        def is_chunk(rel: str) -> bool:  # a mirrored run's chunk files come when indexed (CheckingStore)
            return rel.startswith(chunks) and "/c/" in rel

        directory, manifest = require(run_dir, source, cls.stage, defer=is_chunk)
        unhashed = tuple(f"{name}/" for name in cls.unhashed)
        files = {key: e.sha256 for rel, e in manifest.present().items() if (key := rel.removeprefix(chunks)) != rel}
        metadata = {key: digest for key, digest in files.items() if key.endswith("zarr.json")}
        sha256 = {key: d for key, d in files.items() if key not in metadata and not key.startswith(unhashed)}

        def fetch(key: str) -> None:
            fetch_file(run_dir, source, cls.stage, manifest, f"{cls.filename}/{key}")

        def changed(key: str) -> Exception:
            return changed_file(run_dir, source, cls.stage, f"{cls.filename}/{key}")

        for key, digest in metadata.items():  # hashed before Zarr opens it: Zarr takes a FileNotFoundError (which
            # StageChanged is) while it opens a group or an array for "not there", and would say only that
            if file_sha256(directory / cls.filename / key) != digest:
                raise changed(key)
        mirrored = locate(run_dir).mirrored
        store = CheckingStore(str(directory / cls.filename), sha256, changed, fetch if mirrored else None)
        artifact = cls.read(directory / cls.filename, store)
        for name in cls.dims:
            why = manifest.pruned.get(f"{cls.filename}/{name}")
            if why is not None:
                setattr(artifact, name, None)
                artifact.pruned[name] = why  # type: ignore[attr-defined]
        return artifact

    @classmethod
    def array_folder(cls, name: str) -> str:
        """Where array ``name`` lies among the stage's files (what ``prune`` removes)."""
        return f"{cls.filename}/{name}"

    @classmethod
    def prune_arrays(cls, run_dir: Path, iteration: int, names: dict[str, str]) -> int:
        """Remove arrays ``names`` (name -> why) of the committed artifact of ``iteration`` (``stage.prune``), and
        the group's consolidated metadata's entries for them, so xarray and zarr-python see the arrays gone rather
        than read them as their fill value. Returns the bytes removed."""

        def without(raw: bytes) -> bytes:
            meta = json.loads(raw)
            for name in names:
                meta.get("consolidated_metadata", {}).get("metadata", {}).pop(name, None)
            return json.dumps(meta, indent=2).encode()

        folders = {cls.array_folder(name): why for name, why in names.items()}
        return prune(run_dir, iteration, cls.stage, folders, {f"{cls.filename}/zarr.json": without})

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in self.dims and getattr(self, f.name) is not None
        }

    def write(self, out: Path) -> None:
        arrays = self.arrays()
        missing = [name for name in self.required if name not in arrays]
        if missing:
            raise ValueError(f"{type(self).__name__}: required arrays missing: {missing}")
        lead = {a.shape[0] for a in arrays.values()}
        if len(lead) > 1:
            raise ValueError(
                f"{type(self).__name__}: arrays disagree on the prompt axis: "
                f"{ {k: v.shape for k, v in arrays.items()} }"
            )
        with self.writer(out, lead.pop(), self.attrs) as writer:
            writer.put(0, **arrays)

    @classmethod
    def writer(cls, out: Path, prompts: int, attrs: dict[str, Any]) -> ZarrWriter:
        """A writer of this artifact into the stage's (temporary) folder ``out`` for ``prompts`` prompts, filled
        region by region (``ZarrWriter.put``)."""
        return ZarrWriter(cls, out / cls.filename, prompts, attrs)

    @classmethod
    def read(cls: type[A], path: Path, store: zarr.storage.LocalStore | None = None) -> A:
        """The artifact in the Zarr group at ``path`` (through ``store``, a store over it, when given)."""
        group = zarr.open_group(store if store is not None else str(path), mode="r")
        arrays = {
            name: LazyArray(array) if name in cls.lazy else np.asarray(array[...]) for name, array in group.arrays()
        }
        return cls(attrs=dict(group.attrs), **{name: arrays.get(name) for name in cls.dims})  # type: ignore[call-arg]

    @property
    def prompts(self) -> list[str]:
        return list(self.attrs["prompts"])

    def take(self: Z, positions: range) -> Z:
        """The same artifact for the prompts at ``positions`` only (every array's leading axis, read from the
        store for those prompts alone; attrs ``prompts`` likewise): one shard's view of a stage's input."""
        index = list(positions)
        attrs = dict(self.attrs)
        if "prompts" in attrs:
            attrs["prompts"] = [self.prompts[i] for i in index]
        return type(self)(attrs=attrs, **{name: array[np.asarray(index)] for name, array in self.arrays().items()})

    @classmethod
    def concat(cls: type[Z], parts: list[Z]) -> Z:
        """One artifact from shards of the prompt axis, in order: every array concatenated along axis 0, attrs
        ``prompts`` concatenated, the other attrs from the first part (the same in every shard).

        Raises:
            ValueError: no parts, or parts that do not hold the same arrays.
        """
        attrs = cls._concat_attrs(parts)
        names = sorted(parts[0].arrays())
        arrays = {name: np.concatenate([np.asarray(part.arrays()[name]) for part in parts]) for name in names}
        return cls(attrs=attrs, **arrays)  # type: ignore[call-arg]

    @classmethod
    def _concat_attrs(cls, parts: list[ZarrArtifact]) -> dict[str, Any]:
        """The attrs of the concatenation of ``parts`` (``concat``), after checking they hold the same arrays.

        Raises:
            ValueError: no parts, or parts that do not hold the same arrays.
        """
        if not parts:
            raise ValueError(f"{cls.__name__}.concat: no parts")
        names = [sorted(part.arrays()) for part in parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"{cls.__name__}.concat: the parts hold different arrays: {names}")
        attrs = dict(parts[0].attrs)
        if "prompts" in attrs:
            attrs["prompts"] = [p for part in parts for p in part.prompts]
        return attrs

    @classmethod
    def write_concat(
        cls, out: Path, parts: list[ZarrArtifact], files: list[dict[str, FileEntry]] | None = None
    ) -> None:
        """Write the concatenation of shards' artifacts (``concat``) without holding it in memory: the big
        (lazy) arrays of each part are moved in chunk file by chunk file where the part is a committed local
        store chunked alike (``ZarrWriter.move``: neither read nor written again; the part's store is left
        without them), else copied a prompt at a time; the small arrays are written.

        Args:
            files: per part, its stage's files as its manifest records them (so moved files keep their
                checksums without being hashed again).

        Raises:
            ValueError: no parts, or parts that do not hold the same arrays.
        """
        attrs = cls._concat_attrs(parts)
        total = sum(len(part.prompts) for part in parts)
        with cls.writer(out, total, attrs) as writer:
            start = 0
            for i, part in enumerate(parts):
                count = len(part.prompts)
                for name, array in part.arrays().items():
                    entries = {
                        rel.removeprefix(f"{cls.filename}/"): entry
                        for rel, entry in (files[i] if files else {}).items()
                    }
                    if isinstance(array, LazyArray) and writer.move(start, name, array, entries):
                        continue
                    for begin in range(count):  # a prompt at a time: one prompt's pool in memory
                        writer.put(start + begin, **{name: array[begin : begin + 1]})
                start += count


class HashingStore(zarr.storage.LocalStore):
    """zarr-python's local store that hashes every file as it writes it (``solrl.storage.stage.record_written``):
    the stage's commit takes those checksums instead of reading gigabytes of pool back to hash them."""

    async def _set(self, key: str, value: Any, exclusive: bool = False) -> None:
        record_written(self.root / key, sha256_bytes(memoryview(value.as_buffer_like()).cast("B")))
        await super()._set(key, value, exclusive=exclusive)


class CheckingStore(zarr.storage.LocalStore):
    """zarr-python's local store, read-only, over a committed Zarr artifact: every file Zarr reads whole whose key
    ``sha256`` names is hashed against that checksum (the stage's manifest's) before Zarr decodes it, so a file
    changed in place at the same size is an error, not data; hashing what is read anyway costs no extra read.
    Over a mirror folder (``fetch`` given: ``solrl.storage.stage.fetch_file``, checked against its sha256) a
    missing file is fetched when Zarr asks for it, so a shard on another machine downloads only the chunks of the
    prompts it reads.

    Raises:
        StageChanged: (from ``get``, through Zarr's read) ``changed(key)``: a file's bytes differ from its sha256.
    """

    def __init__(
        self,
        root: str,
        sha256: dict[str, str],
        changed: Callable[[str], Exception],
        fetch: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(root, read_only=True)
        self.sha256, self.changed, self.fetch = sha256, changed, fetch

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        if self.fetch is not None and not (self.root / key).is_file():
            await asyncio.to_thread(self.fetch, key)
        value = await super().get(key, prototype, byte_range)
        expected = self.sha256.get(key)
        if value is not None and byte_range is None and expected is not None:
            data = memoryview(value.as_buffer_like()).cast("B")
            entry = await asyncio.to_thread(sha256_bytes, data)  # hashlib lets go of the GIL: chunks hash in parallel
            if entry.sha256 != expected:
                raise self.changed(key)
        return value


class ZarrWriter:
    """Writes a ``ZarrArtifact`` region by region: ``put(start, **arrays)`` writes prompts ``start ..
    start + len`` of each named array, creating an array (chunks ``chunk_shape``) at its first region, from that
    region's dtype and per-prompt shape. ``close`` (or leaving the ``with`` block without an error) checks that
    every required array was written whole, writes the attrs and consolidates the metadata. Used as a context
    manager."""

    def __init__(self, artifact: type[ZarrArtifact], path: Path, prompts: int, attrs: dict[str, Any]) -> None:
        self.artifact, self.path, self.prompts, self.attrs = artifact, path, prompts, attrs
        self.store = HashingStore(str(path))
        self.group = zarr.open_group(store=self.store, mode="w-")
        self.written: dict[str, int] = {}

    def __enter__(self) -> ZarrWriter:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if kind is None:
            self.close()

    def put(self, start: int, **arrays: np.ndarray | None) -> None:
        """Write ``arrays`` (each ``[n, ...]``, the same ``n``) at prompts ``start .. start + n``.

        Raises:
            ValueError: an unknown array name, a shape that disagrees with the dimension names or with the
                array's earlier regions, or a region outside the prompt axis.
        """
        name_of = self.artifact.__name__
        for name, data in arrays.items():
            if data is None:
                continue
            if name not in self.artifact.dims:
                raise ValueError(f"{name_of}: no array {name!r} (arrays: {list(self.artifact.dims)})")
            data = np.ascontiguousarray(data)
            dims = with_frames(self.artifact.dims[name], data.ndim)
            if len(dims) != data.ndim:
                raise ValueError(f"{name_of}.{name}: shape {data.shape} does not match dims {dims}")
            if start < 0 or start + data.shape[0] > self.prompts:
                raise ValueError(f"{name_of}.{name}: prompts {start}..{start + data.shape[0]} of {self.prompts}")
            shape = (self.prompts, *data.shape[1:])
            if name not in self.written:
                self.group.create_array(
                    name,
                    shape=shape,
                    dtype=data.dtype,
                    chunks=chunk_shape(shape, data.dtype.itemsize, dims),
                    dimension_names=dims,
                )
                self.written[name] = 0
            array = self.group[name]
            if tuple(array.shape) != shape or array.dtype != data.dtype:
                raise ValueError(
                    f"{name_of}.{name}: {data.dtype} {data.shape} does not fit {array.dtype} {array.shape}"
                )
            array[start : start + data.shape[0]] = data
            self.written[name] += data.shape[0]
            commit_point("write")  # between two writes of one store: a kill here must leave nothing trusted

    def _array(self, name: str, shape: tuple[int, ...], dtype: np.dtype, dims: tuple[str, ...]) -> zarr.Array:
        """Array ``name`` of the store, created at its first region (``[n, ...]`` of ``shape``, ``dtype``)."""
        full = (self.prompts, *shape[1:])
        if name not in self.written:
            self.group.create_array(
                name, shape=full, dtype=dtype, chunks=chunk_shape(full, dtype.itemsize, dims), dimension_names=dims
            )
            self.written[name] = 0
        array = self.group[name]
        if tuple(array.shape) != full or array.dtype != dtype:
            raise ValueError(
                f"{self.artifact.__name__}.{name}: {dtype} {shape} does not fit {array.dtype} {array.shape}"
            )
        return array

    def move(self, start: int, name: str, source: LazyArray, entries: dict[str, FileEntry]) -> bool:
        """Move the chunk files of ``source`` (array ``name`` of a committed shard's store, its own prompts from 0)
        into prompts ``start ..`` of this store, renamed to their new chunk keys: the shard's bytes become the
        stage's without being read or written again (a sharded stage's reduce). ``entries``: the shard's files
        (relative to the array's folder) as its manifest records them, so the commit need not hash them again.

        Returns:
            False (nothing moved) when the two stores do not chunk alike or lie on other filesystems; then the
            caller copies.
        """
        store = source.array.store
        if not isinstance(store, zarr.storage.LocalStore):
            return False
        dims = with_frames(self.artifact.dims[name], source.ndim)
        target = self._array(name, source.shape, source.dtype, dims)
        if tuple(target.chunks) != tuple(source.array.chunks) or tuple(target.chunks)[0] != 1:
            return False
        folder = Path(str(store.root)) / source.array.path / "c"
        if folder.exists() and os.stat(folder).st_dev != os.stat(self.path).st_dev:
            return False
        for path in sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []:
            key = path.relative_to(folder).parts
            moved = self.path / name / "c" / str(int(key[0]) + start) / Path(*key[1:])
            moved.parent.mkdir(parents=True, exist_ok=True)
            entry = entries.get(path.relative_to(Path(str(store.root))).as_posix())
            os.replace(path, moved)
            if entry is not None:
                record_written(moved, entry)
        self.written[name] += source.shape[0]
        commit_point("write")
        return True

    def close(self) -> None:
        """Finish the store: every required array written whole, the attrs, the consolidated metadata.

        Raises:
            ValueError: a required array missing or not written over every prompt.
        """
        name_of = self.artifact.__name__
        short = {n: w for n, w in self.written.items() if w < self.prompts}
        missing = [n for n in self.artifact.required if n not in self.written]
        if missing or short:
            raise ValueError(f"{name_of}: required arrays missing: {missing}; written short (prompts): {short}")
        self.group.attrs.update(self.attrs)
        with warnings.catch_warnings():  # zarr notes that v3 consolidation is an extension; xarray reads it
            warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
            zarr.consolidate_metadata(self.store)


_IMAGE = ("y", "x", "rgb")
_LATENT = ("latent_channel", "latent_y", "latent_x")


def with_frames(dims: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    """The dimension names of an array that may hold videos: an image array (``..., y, x, rgb``) one axis longer
    than its names has a ``frame`` axis before ``y``; a latent array (``..., latent_channel, latent_y,
    latent_x``) one longer has ``latent_frame`` after ``latent_channel``. Other arrays keep their names."""
    if ndim != len(dims) + 1:
        return dims
    if dims[-3:] == _IMAGE:
        return (*dims[:-3], "frame", *_IMAGE)
    if dims[-3:] == _LATENT:
        return (*dims[:-3], "latent_channel", "latent_frame", "latent_y", "latent_x")
    return dims


@dataclass
class CandidatePool(ZarrArtifact):
    """The explore stage's pool: images uint8 ``[P, N, H, W, 3]`` (videos ``[P, N, F, H, W, 3]``, dimension
    ``frame``; their latents gain ``latent_frame``), seeds int64 ``[P, N]``, prompt_index int64 ``[P]``; when the
    update trains on the pool itself (``regenerate.enabled=false``) also the final latents float32
    ``[P, N, C, h, w]`` and, for SDE rollouts, the trajectory ``[P, N, S + 1, C, h, w]`` and log-probs
    ``[P, N, S]``. attrs: prompts, precision, steps, policy_version, sde_steps."""

    stage: ClassVar[str] = "explore"
    filename: ClassVar[str] = "candidates.zarr"
    dims: ClassVar[dict[str, tuple[str, ...]]] = {
        "images": ("prompt", "candidate", *_IMAGE),
        "seeds": ("prompt", "candidate"),
        "prompt_index": ("prompt",),
        "latents": ("prompt", "candidate", *_LATENT),
        "trajectory": ("prompt", "candidate", "point", *_LATENT),
        "log_probs": ("prompt", "candidate", "step"),
    }
    required: ClassVar[tuple[str, ...]] = ("images", "seeds", "prompt_index")
    images: np.ndarray | None = None
    seeds: np.ndarray | None = None
    prompt_index: np.ndarray | None = None
    latents: np.ndarray | None = None
    trajectory: np.ndarray | None = None
    log_probs: np.ndarray | None = None


@dataclass
class Samples(CandidatePool):
    """The regenerated groups: images uint8 ``[P, k, H, W, 3]``, latents float32 ``[P, k, C, h, w]`` (the clean
    samples the NFT loss re-noises), seeds and candidate_index int64 ``[P, k]``, prompt_index ``[P]``; for SDE
    rollouts the trajectory ``[P, k, S + 1, C, h, w]`` and old log-probs ``[P, k, S]``. attrs: prompts, steps,
    precision, policy_version, noise_level, sde_steps, regenerated."""

    stage: ClassVar[str] = "regenerate"
    filename: ClassVar[str] = "samples.zarr"
    dims: ClassVar[dict[str, tuple[str, ...]]] = {
        "images": ("prompt", "slot", *_IMAGE),
        "seeds": ("prompt", "slot"),
        "candidate_index": ("prompt", "slot"),
        "prompt_index": ("prompt",),
        "latents": ("prompt", "slot", *_LATENT),
        "trajectory": ("prompt", "slot", "point", *_LATENT),
        "log_probs": ("prompt", "slot", "step"),
    }
    required: ClassVar[tuple[str, ...]] = ("images", "seeds", "candidate_index", "prompt_index", "latents")
    candidate_index: np.ndarray | None = None


@dataclass
class EvalSamples(ZarrArtifact):
    """Held-out evaluation samples: images uint8 ``[P, S, H, W, 3]``, seeds int64 ``[P, S]``, prompt_index
    ``[P]``. attrs: prompts, policy_version."""

    stage: ClassVar[str] = "evaluate"
    filename: ClassVar[str] = "samples.zarr"
    #: The picture the evaluate stage draws beside the samples: one row per prompt.
    grid: ClassVar[str] = "samples.png"
    dims: ClassVar[dict[str, tuple[str, ...]]] = {
        "images": ("prompt", "sample", *_IMAGE),
        "seeds": ("prompt", "sample"),
        "prompt_index": ("prompt",),
    }
    required: ClassVar[tuple[str, ...]] = ("images", "seeds", "prompt_index")
    images: np.ndarray | None = None
    seeds: np.ndarray | None = None
    prompt_index: np.ndarray | None = None


# -- Parquet artifacts ------------------------------------------------------------------------------------------


@dataclass
class TableArtifact(Artifact):
    """One Parquet table (plain Arrow: pandas, polars, DuckDB read it) with at least ``columns``."""

    columns: ClassVar[tuple[str, ...]]
    verify_on_read: ClassVar[bool] = True
    frame: pd.DataFrame

    def __post_init__(self) -> None:
        missing = [c for c in self.columns if c not in self.frame.columns]
        if missing:
            raise ValueError(f"{type(self).__name__}: columns missing: {missing}")

    def write(self, out: Path) -> None:
        pq.write_table(pa.Table.from_pandas(self.frame, preserve_index=False), out / self.filename)
        commit_point("write")

    @classmethod
    def read(cls: type[A], path: Path) -> A:
        return cls(pq.read_table(path).to_pandas())  # type: ignore[call-arg]


_REWARD_COLUMNS = (
    "group",
    "prompt_index",
    "prompt",
    "candidate_index",
    "seed",
    "reward",
    "value",
    "weight",
    "weighted",
    "precision",
)


@dataclass
class ExploreRewards(TableArtifact):
    """Rewards of the candidate pool, one row per (candidate, reward)."""

    stage: ClassVar[str] = "score_explore"
    filename: ClassVar[str] = "rewards.parquet"
    columns: ClassVar[tuple[str, ...]] = _REWARD_COLUMNS

    def totals(self, candidate_index: np.ndarray, normalize: str = "none") -> np.ndarray:
        """Weighted reward (sum over rewards) of each candidate.

        With ``normalize="group"`` each reward is first standardised within its group over the candidates
        asked for, ``(r - mean) / (std + 1e-4)`` (0 for a group without spread), then weighted and summed: the
        per-reward normalisation of multi-reward advantages (``reward.normalize``).

        Args:
            candidate_index: int ``[P, N]``, the candidates wanted, per group, in the order wanted.
            normalize: ``none`` or ``group``.

        Returns:
            float32 ``[P, N]``; ``[p, j]`` is the total of group ``p``'s candidate ``candidate_index[p, j]``.
        """
        if normalize == "none":
            totals = self.frame.groupby(["group", "candidate_index"])["weighted"].sum()
            P, N = candidate_index.shape
            keys = pd.MultiIndex.from_arrays([np.repeat(np.arange(P), N), np.asarray(candidate_index).reshape(-1)])
            return totals.reindex(keys).to_numpy(np.float32).reshape(P, N)
        if normalize != "group":
            raise ValueError(f"normalize must be none or group, got {normalize!r}")
        total = np.zeros(np.shape(candidate_index), np.float64)
        for name, weight in self.frame.groupby("reward", sort=True)["weight"].first().items():
            values = self.values(str(name), candidate_index).astype(np.float64)  # [P, N]
            std = values.std(axis=1, keepdims=True)
            standard = np.where(std < 1e-6, 0.0, (values - values.mean(axis=1, keepdims=True)) / (std + 1e-4))
            total += float(weight) * standard
        return total.astype(np.float32)

    def values(self, name: str, candidate_index: np.ndarray) -> np.ndarray:
        """Unweighted values of reward ``name``, float32 ``[P, N]`` in ``candidate_index`` order."""
        table = self.frame[self.frame["reward"] == name].set_index(["group", "candidate_index"])["value"]
        P, N = candidate_index.shape
        keys = pd.MultiIndex.from_arrays([np.repeat(np.arange(P), N), np.asarray(candidate_index).reshape(-1)])
        return table.reindex(keys).to_numpy(np.float32).reshape(P, N)


@dataclass
class RegeneratedRewards(ExploreRewards):
    """Rewards of the regenerated (BF16) samples: these make the advantages."""

    stage: ClassVar[str] = "score_regenerate"


@dataclass
class FidelityTable(TableArtifact):
    """Per prompt group: explore vs BF16 rank agreement of the kept seeds."""

    stage: ClassVar[str] = "score_regenerate"
    filename: ClassVar[str] = "fidelity.parquet"
    columns: ClassVar[tuple[str, ...]] = ("group", "prompt", "spearman", "kendall", "top_half_match")
    #: Why the table is empty when it is (``regenerate.enabled=false``).
    not_measured: ClassVar[str] = (
        "regenerate.enabled=false trains on the explore samples themselves, so there is no BF16 ranking to compare"
    )


@dataclass
class Selection(TableArtifact):
    """The kept seeds: one row per (group, slot), best first then worst from the bottom up."""

    stage: ClassVar[str] = "select"
    filename: ClassVar[str] = "selection.parquet"
    #: The picture the select stage draws beside the table: the kept candidates of the first prompts, best left.
    grid: ClassVar[str] = "best_worst.png"
    columns: ClassVar[tuple[str, ...]] = (
        "group",
        "slot",
        "prompt_index",
        "prompt",
        "candidate_index",
        "seed",
        "rank",
        "explore_reward",
        "kept_as",
    )

    @property
    def ordered(self) -> pd.DataFrame:
        return self.frame.sort_values(["group", "slot"])

    @property
    def shape(self) -> tuple[int, int]:
        """(groups P, kept per group k)."""
        return int(self.frame["group"].max()) + 1, int(self.frame["slot"].max()) + 1


@dataclass
class AuditPool(TableArtifact):
    """Whole pools of a few prompts regenerated in BF16: explore vs BF16 reward and rank of every candidate."""

    stage: ClassVar[str] = "audit"
    filename: ClassVar[str] = "pool.parquet"
    columns: ClassVar[tuple[str, ...]] = (
        "group",
        "prompt",
        "candidate_index",
        "seed",
        "explore_reward",
        "bf16_reward",
        "explore_rank",
        "bf16_rank",
    )


@dataclass
class UpdateMetrics(TableArtifact):
    """One row per optimizer step: loss terms, grad norm, rollout decay."""

    stage: ClassVar[str] = "update"
    filename: ClassVar[str] = "metrics.parquet"
    columns: ClassVar[tuple[str, ...]] = ("optimizer_step", "loss", "grad_norm")


@dataclass
class RewardStats(TableArtifact):
    """The per-prompt reward buffers after an update (``train.advantage_stats=per_prompt``): prompt, reward."""

    stage: ClassVar[str] = "update"
    filename: ClassVar[str] = "reward_stats.parquet"
    columns: ClassVar[tuple[str, ...]] = ("prompt", "reward")
    offset: ClassVar[int] = -1
    first_iteration: ClassVar[int] = 1

    @classmethod
    def load(cls, run_dir: Path, iteration: int) -> RewardStats | None:
        """The previous iteration's buffers; None at iteration 1 or when that update kept none."""
        source = cls.source_iteration(iteration)
        if source is None:
            return None
        directory, _ = require(run_dir, source, cls.stage, verify=cls.filename)
        return cls.read(directory / cls.filename) if (directory / cls.filename).exists() else None

    def history(self) -> dict[str, np.ndarray]:
        return {p: g["reward"].to_numpy(np.float64) for p, g in self.frame.groupby("prompt", sort=False)}


@dataclass
class EvalMetrics(TableArtifact):
    """Per evaluation prompt and reward: the mean over the fixed seeds."""

    stage: ClassVar[str] = "evaluate"
    filename: ClassVar[str] = "metrics.parquet"
    columns: ClassVar[tuple[str, ...]] = ("prompt", "reward", "mean")


@dataclass
class EvalScores(TableArtifact):
    """Per evaluation sample and reward: its value, then the reward's extra columns (e.g. a judge's rationale;
    empty in the rows of a reward without them). ``sample`` is the seed's slot in its prompt's row of the grid."""

    stage: ClassVar[str] = "evaluate"
    filename: ClassVar[str] = "scores.parquet"
    columns: ClassVar[tuple[str, ...]] = ("prompt", "sample", "seed", "reward", "value")


# -- checkpoints ------------------------------------------------------------------------------------------------


@dataclass
class CheckpointArtifact(Artifact):
    """A folder of named safetensors sections plus ``state.json`` (``solrl.storage.checkpoints``)."""

    sections: dict[str, dict[str, torch.Tensor]]
    state: dict[str, Any]
    verify_on_read: ClassVar[bool] = True

    def write(self, out: Path) -> None:
        save_checkpoint(out / self.filename, self.sections, self.state)
        commit_point("write")

    @classmethod
    def read(cls: type[A], path: Path) -> A:
        sections, state = load_checkpoint(path)
        return cls(sections, state)  # type: ignore[call-arg]


@dataclass
class TrainedState(CheckpointArtifact):
    """What the update leaves: adapters (policy, rollout, EMA), optimizer, RNG, global step."""

    stage: ClassVar[str] = "update"
    filename: ClassVar[str] = "trained"


@dataclass
class Checkpoint(CheckpointArtifact):
    """The committed, self-describing checkpoint of an iteration (``checkpoint/``)."""

    stage: ClassVar[str] = "checkpoint"
    filename: ClassVar[str] = "."
    first_iteration: ClassVar[int] = 1


@dataclass
class StartingPolicy(Checkpoint):
    """The checkpoint a stage's policy starts from: the previous iteration's (None at 1: the base model)."""

    offset: ClassVar[int] = -1


@dataclass
class TrainedPolicy(Checkpoint):
    """This iteration's checkpoint (None at iteration 0: the base model), for evaluation."""
