"""What a run keeps of its pools (issue 36): ``storage.pool`` and the retention rule ``storage.keep_pools``.

An iteration's candidate pool is written whole (score and select read every image) and its regenerated samples
feed the update; once the iteration's checkpoint is committed no stage of the campaign reads them again. Then:

- ``storage.pool`` says what every pool keeps: ``full`` (every image), ``latents`` (every candidate's final
  latents, decoded by ``solrl show`` and the report when a person asks; the images are dropped) or ``rankings``
  (no pixels and no latents);
- ``storage.keep_pools`` says which iterations keep their pool data at all (the last N and every Mth); outside it
  the explore pool's images, latents and trajectories and the regenerated samples' likewise are removed.

Removal goes through ``solrl.storage.stage.prune``: a manifest keeps the record of every file that was there (its
digest, and so every cache key downstream, unchanged), the seeds, indices, rewards, rankings, selections,
checkpoints and evaluations are never touched, and an iteration whose checkpoint is not committed is left whole,
so whatever a resume still needs is there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from solrl.config import RunConfig
from solrl.storage.artifacts import CandidatePool, Samples, ZarrArtifact
from solrl.storage.stage import StageManifest, read_manifest

#: Why a folder was pruned, as ``StageManifest.pruned`` records it.
POOL_MODE = "storage.pool={mode}"
RETENTION = "storage.keep_pools"


def kept(cfg: RunConfig, iteration: int, latest: int) -> bool:
    """Whether ``iteration`` keeps its pool data under ``storage.keep_pools`` when ``latest`` is the last
    iteration with a committed checkpoint."""
    rule = cfg.storage.keep_pools
    if rule.last is None:
        return True
    return iteration > latest - rule.last or (rule.every > 0 and iteration % rule.every == 0)


def _arrays(artifact: type[ZarrArtifact], manifest: StageManifest, names: Iterable[str], why: str) -> dict[str, str]:
    """The arrays ``names`` that ``manifest`` holds and has not pruned, each with ``why``."""
    return {name: why for name in names if manifest.holds(artifact.array_folder(name))}


def planned(
    cfg: RunConfig, run_dir: Path, iteration: int, latest: int, by: str | None = None
) -> dict[str, dict[str, str]]:
    """What retention removes of ``iteration`` now: stage -> {array: why}; nothing while its checkpoint is not
    committed. ``latest``: the last iteration with a committed checkpoint. ``by``: the command applying the rule
    when it is not the campaign's own (``solrl prune``, whose options may differ from the run's settings): the
    reasons then name it and the rule's values."""
    if iteration < 1 or read_manifest(run_dir, iteration, "checkpoint") is None:
        return {}
    rule, mode = cfg.storage.keep_pools, cfg.storage.pool
    retention = RETENTION if by is None else f"{by} ({RETENTION} last={rule.last} every={rule.every})"
    pool_mode = POOL_MODE.format(mode=mode) if by is None else f"{by} ({POOL_MODE.format(mode=mode)})"
    plan: dict[str, dict[str, str]] = {}
    explore = read_manifest(run_dir, iteration, CandidatePool.stage)
    keep = kept(cfg, iteration, latest)
    if explore is not None:
        if not keep:
            names, why = CandidatePool.lazy, retention
        elif mode == "rankings":
            names, why = CandidatePool.lazy, pool_mode
        elif mode == "latents" and explore.holds(CandidatePool.array_folder("latents")):
            names, why = ("images",), pool_mode  # a pool without latents keeps its images
        else:
            names, why = (), ""
        if arrays := _arrays(CandidatePool, explore, names, why):
            plan[CandidatePool.stage] = arrays
    if not keep and (samples := read_manifest(run_dir, iteration, Samples.stage)) is not None:
        if arrays := _arrays(Samples, samples, Samples.lazy, retention):
            plan[Samples.stage] = arrays
    return plan


def pool_fate(cfg: RunConfig, iteration: int) -> str | None:
    """What ``storage.pool`` and ``storage.keep_pools`` will remove of ``iteration``'s candidate pool, in words, as
    the iteration's summary says it while the pool is still whole; None when the pool is kept whole."""
    rule, mode = cfg.storage.keep_pools, cfg.storage.pool
    fates = {
        "latents": "its images once this iteration's checkpoint is committed (every candidate's final latents "
        "stay: `solrl show` decodes them)",
        "rankings": "its images, and any latents, once this iteration's checkpoint is committed (its rewards and "
        "rankings stay)",
    }
    parts = [f"{POOL_MODE.format(mode=mode)} removes {fates[mode]}"] if mode in fates else []
    if not kept(cfg, iteration, cfg.campaign.iterations):  # outside keep_pools at the campaign's last checkpoint
        what = "the rest of it" if parts else "its images, latents and trajectories"
        parts.append(
            f"{RETENTION} (last={rule.last}, every={rule.every}) removes {what} once iteration "
            f"{iteration + rule.last}'s checkpoint is committed"
        )
    return "; ".join(parts) or None


def latest_checkpoint(run_dir: Path, iterations: int) -> int:
    """The last iteration (at most ``iterations``) with a committed checkpoint; 0 when none."""
    for iteration in range(iterations, 0, -1):
        if read_manifest(run_dir, iteration, "checkpoint") is not None:
            return iteration
    return 0


def apply_retention(
    cfg: RunConfig, run_dir: Path, iterations: Iterable[int], latest: int, by: str | None = None
) -> int:
    """Prune what ``storage.pool`` and ``storage.keep_pools`` say of ``iterations`` (``planned``, with ``by``),
    the caller holding the run's lock. Returns the bytes removed."""
    artifacts = {CandidatePool.stage: CandidatePool, Samples.stage: Samples}
    freed = 0
    for iteration in iterations:
        for stage, arrays in planned(cfg, run_dir, iteration, latest, by).items():
            freed += artifacts[stage].prune_arrays(run_dir, iteration, arrays)
    return freed


def after_iteration(cfg: RunConfig, run_dir: Path, iteration: int) -> int:
    """Retention once ``iteration``'s checkpoint is committed: its own pool (``storage.pool``) and the iteration
    that has just left ``keep_pools``'s window. Returns the bytes removed."""
    rule = cfg.storage.keep_pools
    touched = {iteration}
    if rule.last is not None:
        touched.add(iteration - rule.last)
    return apply_retention(cfg, run_dir, sorted(i for i in touched if i >= 1), iteration)


def prune_run(cfg: RunConfig, run_dir: Path, by: str | None = None) -> int:
    """Retention over every iteration of a run (``solrl prune``, ``by="solrl prune"``; a campaign's start, where
    the settings may have changed since). Returns the bytes removed."""
    latest = latest_checkpoint(run_dir, cfg.campaign.iterations)
    return apply_retention(cfg, run_dir, range(1, latest + 1), latest, by)
