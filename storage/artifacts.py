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

import warnings
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
from solrl.storage.stage import StageManifest, fault_point, read_manifest, require, stage_dir

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
        """Read the artifact for a reader at ``iteration`` (checksums verified); None before ``first_iteration``.

        Raises:
            StageNotCommitted: its stage has no valid manifest.
        """
        source = cls.source_iteration(iteration)
        if source is None:
            return None
        directory, _ = require(run_dir, source, cls.stage)
        return cls.read(directory / cls.filename)

    @classmethod
    def read(cls: type[A], path: Path) -> A:
        raise NotImplementedError

    def write(self, out: Path) -> None:
        """Write into the stage's (temporary) output folder ``out``."""
        raise NotImplementedError


# -- Zarr artifacts ---------------------------------------------------------------------------------------------


@dataclass
class ZarrArtifact(Artifact):
    """Arrays sharing a leading prompt axis, one Zarr group, chunked one prompt per chunk (so a shard of
    prompts writes its own region; videos one video per chunk), every array with named dimensions (xarray opens
    the store)."""

    #: array name -> dimension names; arrays may be absent (None) unless listed in ``required``.
    dims: ClassVar[dict[str, tuple[str, ...]]]
    required: ClassVar[tuple[str, ...]]
    attrs: dict[str, Any] = field(default_factory=dict)

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
        group = zarr.open_group(str(out / self.filename), mode="w-")
        for name, data in arrays.items():
            data = np.ascontiguousarray(data)
            dims = with_frames(self.dims[name], data.ndim)
            if len(dims) != data.ndim:
                raise ValueError(f"{type(self).__name__}.{name}: shape {data.shape} does not match dims {dims}")
            chunks = (1, *data.shape[1:]) if data.ndim > 1 else data.shape
            if "frame" in dims or "latent_frame" in dims:  # a prompt's pool of 81-frame videos is gigabytes
                chunks = (1, 1, *data.shape[2:])  # one video per chunk
            array = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks, dimension_names=dims)
            array[...] = data
            fault_point("write")  # test-only: a kill between two arrays of one store
        group.attrs.update(self.attrs)
        with warnings.catch_warnings():  # zarr notes that v3 consolidation is an extension; xarray reads it
            warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
            zarr.consolidate_metadata(str(out / self.filename))

    @classmethod
    def read(cls: type[A], path: Path) -> A:
        group = zarr.open_group(str(path), mode="r")
        arrays = {name: np.asarray(array[...]) for name, array in group.arrays()}
        return cls(attrs=dict(group.attrs), **{name: arrays.get(name) for name in cls.dims})  # type: ignore[call-arg]

    @property
    def prompts(self) -> list[str]:
        return list(self.attrs["prompts"])

    def take(self: Z, positions: range) -> Z:
        """The same artifact for the prompts at ``positions`` only (every array's leading axis; attrs
        ``prompts`` likewise): one shard's view of a stage's input."""
        index = list(positions)
        attrs = dict(self.attrs)
        if "prompts" in attrs:
            attrs["prompts"] = [self.prompts[i] for i in index]
        return type(self)(attrs=attrs, **{name: array[index] for name, array in self.arrays().items()})

    @classmethod
    def concat(cls: type[Z], parts: list[Z]) -> Z:
        """One artifact from shards of the prompt axis, in order: every array concatenated along axis 0, attrs
        ``prompts`` concatenated, the other attrs from the first part (the same in every shard).

        Raises:
            ValueError: no parts, or parts that do not hold the same arrays.
        """
        if not parts:
            raise ValueError(f"{cls.__name__}.concat: no parts")
        names = [sorted(part.arrays()) for part in parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"{cls.__name__}.concat: the parts hold different arrays: {names}")
        arrays = {name: np.concatenate([part.arrays()[name] for part in parts]) for name in names[0]}
        attrs = dict(parts[0].attrs)
        if "prompts" in attrs:
            attrs["prompts"] = [p for part in parts for p in part.prompts]
        return cls(attrs=attrs, **arrays)  # type: ignore[call-arg]


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
    frame: pd.DataFrame

    def __post_init__(self) -> None:
        missing = [c for c in self.columns if c not in self.frame.columns]
        if missing:
            raise ValueError(f"{type(self).__name__}: columns missing: {missing}")

    def write(self, out: Path) -> None:
        pq.write_table(pa.Table.from_pandas(self.frame, preserve_index=False), out / self.filename)
        fault_point("write")

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
        directory, _ = require(run_dir, source, cls.stage)
        return cls.read(directory / cls.filename) if (directory / cls.filename).exists() else None

    def history(self) -> dict[str, np.ndarray]:
        return {p: g["reward"].to_numpy(np.float64) for p, g in self.frame.groupby("prompt", sort=False)}


@dataclass
class EvalMetrics(TableArtifact):
    """Per evaluation prompt and reward: the mean over the fixed seeds."""

    stage: ClassVar[str] = "evaluate"
    filename: ClassVar[str] = "metrics.parquet"
    columns: ClassVar[tuple[str, ...]] = ("prompt", "reward", "mean")


# -- checkpoints ------------------------------------------------------------------------------------------------


@dataclass
class CheckpointArtifact(Artifact):
    """A folder of named safetensors sections plus ``state.json`` (``solrl.storage.checkpoints``)."""

    sections: dict[str, dict[str, torch.Tensor]]
    state: dict[str, Any]

    def write(self, out: Path) -> None:
        save_checkpoint(out / self.filename, self.sections, self.state)
        fault_point("write")

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
