"""Audit a run from its stored files alone: the state of every stage, and per iteration the candidate pool's
reward distribution per prompt, the kept seeds with their explore and BF16 rewards, the proxy-fidelity figures
and the stage timings (``solrl inspect``, ``solrl show``).

Nothing here trusts a folder without a valid manifest: a stage is ``committed`` (manifest and sizes hold; for
the stages whose tables are read here, checksums too), ``corrupted`` (a manifest is there but unreadable, or a
file fails its size or sha256), ``incomplete`` (a folder or temporary folder without a manifest: a process died
while writing it) or ``missing``. Only committed stages are read. The pools and samples are not hashed here
(``solrl verify`` re-hashes a whole run on demand).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import pandas as pd

from solrl.storage.artifacts import (
    AuditPool,
    CandidatePool,
    ExploreRewards,
    FidelityTable,
    RegeneratedRewards,
    Selection,
    TableArtifact,
)
from solrl.storage.stage import MANIFEST, StageManifest, StageNotCommitted, iteration_dir, read_manifest, stage_dir

StageState = Literal["committed", "corrupted", "incomplete", "missing"]
T = TypeVar("T", bound=TableArtifact)


#: The stages whose Parquet tables ``audit_iteration`` reads: small, and hashed before they are read.
READ_TABLES = ("score_explore", "select", "score_regenerate", "audit")


def stage_state(
    run_dir: Path, iteration: int, stage: str, *, verify: bool = False
) -> tuple[StageState, StageManifest | None]:
    """The state of one stage (module doc) and its manifest when committed; sizes are checked, and with
    ``verify`` checksums too."""
    manifest = read_manifest(run_dir, iteration, stage, verify=verify)
    if manifest is not None:
        return "committed", manifest
    directory = stage_dir(run_dir, iteration, stage)
    if (directory / MANIFEST).exists():
        return "corrupted", None
    parent = iteration_dir(run_dir, iteration)
    if directory.exists() or any(parent.glob(f".{stage}.tmp-*")):
        return "incomplete", None
    return "missing", None


def candidate_totals(rewards: ExploreRewards) -> pd.DataFrame:
    """One row per (group, candidate): group, prompt, candidate_index, seed, reward (the weighted sum)."""
    frame = rewards.frame
    return (
        frame.groupby(["group", "candidate_index"], sort=True)
        .agg(prompt=("prompt", "first"), seed=("seed", "first"), reward=("weighted", "sum"))
        .reset_index()
    )


def pool_summary(rewards: ExploreRewards) -> pd.DataFrame:
    """The reward distribution of each prompt's candidate pool: group, prompt, candidates, mean, std, min,
    median, max of the weighted reward (float64)."""
    totals = candidate_totals(rewards)
    return (
        totals.groupby("group", sort=True)
        .agg(
            prompt=("prompt", "first"),
            candidates=("reward", "size"),
            mean=("reward", "mean"),
            std=("reward", "std"),
            min=("reward", "min"),
            median=("reward", "median"),
            max=("reward", "max"),
        )
        .reset_index()
    )


def selection_table(selection: Selection, regenerated: RegeneratedRewards | None) -> pd.DataFrame:
    """The kept seeds, one row per (group, slot): group, prompt, slot, kept_as, seed, candidate_index, rank (in
    the pool, 1 = best), explore_reward and, when the regeneration was scored, bf16_reward (not with
    ``regenerate.enabled=false`` and a low-precision explore: the rewards scored then are the explore samples')."""
    table = selection.ordered[
        ["group", "prompt", "slot", "kept_as", "seed", "candidate_index", "rank", "explore_reward"]
    ].reset_index(drop=True)
    if regenerated is not None and set(regenerated.frame["precision"]) == {"bf16"}:
        bf16 = candidate_totals(regenerated)[["group", "candidate_index", "reward"]]
        table = table.merge(bf16.rename(columns={"reward": "bf16_reward"}), on=["group", "candidate_index"], how="left")
    return table


@dataclass
class IterationAudit:
    """What the stored files say about one iteration (``audit_iteration``)."""

    iteration: int
    states: dict[str, StageState]
    manifests: dict[str, StageManifest] = field(default_factory=dict)
    pool: pd.DataFrame | None = None
    selection: pd.DataFrame | None = None
    fidelity: pd.DataFrame | None = None
    audit_pool: pd.DataFrame | None = None

    @property
    def metrics(self) -> dict[str, float]:
        """Every metric of the committed stages' manifests."""
        return {k: v for m in self.manifests.values() for k, v in m.metrics.items()}

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per committed stage, in run order."""
        return {stage: m.seconds for stage, m in self.manifests.items()}


def audit_iteration(run_dir: Path, iteration: int, due: Sequence[str]) -> IterationAudit:
    """Read what exists of ``iteration``: the state of each ``due`` stage and the tables of the committed ones.

    Args:
        run_dir: the run's folder. due: the stages the campaign plan runs at this iteration, in order.
    """
    states: dict[str, StageState] = {}
    manifests: dict[str, StageManifest] = {}
    for stage in due:
        states[stage], manifest = stage_state(run_dir, iteration, stage, verify=stage in READ_TABLES)
        if manifest is not None:
            manifests[stage] = manifest
    found = IterationAudit(iteration, states, manifests)

    def table(artifact: type[T]) -> T | None:  # its stage was verified (READ_TABLES) just now: read, not load
        if artifact.stage not in manifests:
            return None
        return artifact.read(
            stage_dir(run_dir, iteration, artifact.stage) / manifests[artifact.stage].prefix / artifact.filename
        )

    explore_rewards, regenerated = table(ExploreRewards), table(RegeneratedRewards)
    if explore_rewards is not None:
        found.pool = pool_summary(explore_rewards)
    if (selection := table(Selection)) is not None:
        found.selection = selection_table(selection, regenerated)
    if (fidelity := table(FidelityTable)) is not None:
        found.fidelity = fidelity.frame
    if (pool := table(AuditPool)) is not None:
        found.audit_pool = pool.frame
    return found


@dataclass
class PoolView:
    """One prompt's whole candidate pool ordered by explore reward (best first), for ``solrl show``."""

    prompt: str
    group: int  # the prompt's index in the iteration
    images: np.ndarray  # uint8 [N, H, W, 3] (videos [N, F, H, W, 3]), best first
    rewards: np.ndarray  # float64 [N]
    seeds: np.ndarray  # int64 [N]
    candidates: np.ndarray  # int64 [N], the candidate index in the pool
    kept_as: list[str | None]  # "best" / "worst" for the kept seeds, else None
    #: Where ``kept_as`` comes from: the committed select stage, or none is marked because select is
    #: "not committed" (not run yet) or "fails verification" (a manifest or file that does not hold).
    selection: Literal["committed", "not committed", "fails verification"] = "committed"


class PoolPruned(LookupError):
    """The pool's images (and latents) were removed by ``storage.pool`` / ``storage.keep_pools``; the message
    says so in one line and what still shows the iteration."""


def pool_view(
    run_dir: Path, iteration: int, prompt: str, decode: Callable[[np.ndarray], np.ndarray] | None = None
) -> PoolView:
    """The pool of the prompt named by ``prompt``: its group index in the iteration, its exact text, or a
    substring of exactly one prompt's text. A pool kept as latents (``storage.pool=latents``) is drawn from its
    latents through ``decode`` (float32 ``[n, C, h, w]`` -> uint8 ``[n, H, W, 3]``, the run's model).

    Raises:
        StageNotCommitted: explore or score_explore of ``iteration`` is not committed (or fails verification).
        PoolPruned: the pool's images are gone (and its latents, or no ``decode`` was given).
        LookupError: ``prompt`` names no prompt of the iteration, or several.

    A select stage that is not committed, or fails verification, is no error: ``selection`` says so and no seed
    is marked kept.
    """
    pool = CandidatePool.load(run_dir, iteration)
    if pool.images is None and (pool.latents is None or decode is None):
        images, latents = pool.pruned.get("images", "pruning"), pool.pruned.get("latents")
        if latents is None or latents == images:  # each array named with what pruned it
            what = f"its images{'' if latents is None else ' and latents'} were pruned by {images}"
        else:
            what = f"its images were pruned by {images} and its latents by {latents}"
        raise PoolPruned(
            f"iteration {iteration}'s candidate pool: {what}; no images"
            + ("" if pool.latents is None else " (its latents remain: decode them with the run's model)")
            + "; regenerating a seed with its checkpoint redraws it, and its rewards, ranks and kept seeds remain"
        )
    totals = candidate_totals(ExploreRewards.load(run_dir, iteration))
    prompts = pool.prompts
    if prompt.isdigit() and int(prompt) < len(prompts):
        group = int(prompt)
    elif prompt in prompts:
        group = prompts.index(prompt)
    else:
        matches = [i for i, text in enumerate(prompts) if prompt.lower() in text.lower()]
        if len(matches) != 1:
            listed = "; ".join(f"{i}: {t}" for i, t in enumerate(prompts))
            what = "no prompt" if not matches else f"{len(matches)} prompts"
            raise LookupError(f"{prompt!r} matches {what} of iteration {iteration} (give an index or text): {listed}")
        group = matches[0]
    rows = totals[totals["group"] == group].sort_values("reward", ascending=False, kind="stable")
    index = rows["candidate_index"].to_numpy(np.int64)
    kept: dict[int, str] = {}
    selection = "committed"
    try:
        chosen = Selection.load(run_dir, iteration)
    except StageNotCommitted:  # the pool is still drawn, its kept seeds unmarked: the caller says why
        written = (stage_dir(run_dir, iteration, "select") / MANIFEST).exists()
        selection = "fails verification" if written else "not committed"
    else:
        assert chosen is not None  # a pool exists from iteration 1 on, as do selections
        rows_kept = chosen.frame[chosen.frame["group"] == group]
        kept = dict(zip(rows_kept["candidate_index"].astype(int), rows_kept["kept_as"].astype(str)))
    if pool.images is not None:
        images = pool.images[group][index]
    else:
        assert pool.latents is not None and decode is not None
        images = decode(pool.latents[group][index])
    return PoolView(
        prompt=prompts[group],
        group=group,
        images=images,
        rewards=rows["reward"].to_numpy(np.float64),
        seeds=pool.seeds[group][index],
        candidates=index,
        kept_as=[kept.get(int(i)) for i in index],
        selection=selection,
    )


def broken_manifests(run_dir: Path, plan: Sequence[tuple[int, Sequence[str]]]) -> list[tuple[int, str]]:
    """The (iteration, stage) of ``plan`` whose ``_MANIFEST.json`` exists but does not hold: unreadable, or a
    listed file missing or of another size. Cheap (no checksums), for ``solrl report``."""
    return [
        (iteration, stage)
        for iteration, stages in plan
        for stage in stages
        if (stage_dir(run_dir, iteration, stage) / MANIFEST).exists()
        and read_manifest(run_dir, iteration, stage) is None
    ]
