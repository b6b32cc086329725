"""The Sol-RL iteration as an ordered table of stages, the campaign plan, and how one stage is run or skipped.

No Prefect here: ``solrl.flows`` wraps ``run_stage`` in tasks. A stage function's signature is
``fn(ctx, out, *inputs) -> StageOutput``; the types of its inputs are typed artifacts
(``solrl.storage.artifacts``), which say where each input lives. ``run_stage`` reads them and passes them in,
and the stage's inputs hash covers the run id, iteration, stage, config hash and the digests of exactly those
artifacts' manifests, so a re-run skips the stages whose committed output still matches their inputs and
redoes everything downstream of a change.
"""

from __future__ import annotations

import inspect
import shutil
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from solrl.config import RunConfig
from solrl.stages.audit import audit
from solrl.stages.checkpoint import checkpoint
from solrl.stages.context import StageContext
from solrl.stages.evaluate import evaluate
from solrl.stages.explore import explore
from solrl.stages.regenerate import regenerate
from solrl.stages.score import score_explore, score_regenerate
from solrl.stages.select import select
from solrl.stages.update import update
from solrl.storage.artifacts import Artifact
from solrl.storage.stage import StageManifest, StageOutput, inputs_hash, iteration_dir, read_manifest, run_or_skip


def _artifact_type(annotation: object) -> type[Artifact] | None:
    """``CandidatePool`` or ``StartingPolicy | None`` -> the artifact class; anything else -> None."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    found = [c for c in candidates if isinstance(c, type) and issubclass(c, Artifact)]
    return found[0] if found else None


@dataclass(frozen=True)
class Stage:
    """One stage: its name and function; what it reads is the function's typed parameters."""

    name: str
    fn: Callable[..., StageOutput]

    @cached_property
    def reads(self) -> tuple[type[Artifact], ...]:
        """The artifact types of ``fn``'s parameters after ``(ctx, out)``, in order."""
        hints = typing.get_type_hints(self.fn)
        reads = []
        for param in list(inspect.signature(self.fn).parameters)[2:]:
            artifact = _artifact_type(hints.get(param))
            if artifact is None:
                raise TypeError(f"stage {self.name}: parameter {param!r} is not annotated with a typed artifact")
            reads.append(artifact)
        return tuple(reads)


ITERATION: tuple[Stage, ...] = (
    Stage("explore", explore),
    Stage("score_explore", score_explore),
    Stage("select", select),
    Stage("regenerate", regenerate),
    Stage("score_regenerate", score_regenerate),
    Stage("audit", audit),
    Stage("update", update),
    Stage("checkpoint", checkpoint),
    Stage("evaluate", evaluate),
)
STAGES = {stage.name: stage for stage in ITERATION}


def stage_due(cfg: RunConfig, name: str, iteration: int) -> bool:
    """Whether stage ``name`` runs at ``iteration``: the audit every ``fidelity.audit_every`` iterations,
    evaluation every ``campaign.eval_every`` (and always at 0, the starting policy), the rest always."""
    if name == "audit":
        return cfg.fidelity.audit_every > 0 and iteration % cfg.fidelity.audit_every == 0
    if name == "evaluate":
        return iteration % cfg.campaign.eval_every == 0
    return True


def campaign_plan(cfg: RunConfig) -> list[tuple[int, list[str]]]:
    """The whole campaign in run order: ``[(0, ["evaluate"]), (1, [stages due at 1]), ...]``; iteration 0 is
    the evaluation of the starting policy. The one place the order of a campaign is written."""
    plan = [(0, ["evaluate"])]
    for iteration in range(1, cfg.campaign.iterations + 1):
        plan.append((iteration, [s.name for s in ITERATION if stage_due(cfg, s.name, iteration)]))
    return plan


def _upstream_key(artifact: type[Artifact]) -> str:
    return artifact.stage if artifact.offset == 0 else f"{artifact.stage}[{artifact.offset:+d}]"


def stage_key(ctx: StageContext, stage: Stage) -> str:
    """The inputs hash of ``stage`` at ``ctx.iteration`` (see module doc)."""
    upstream: dict[str, StageManifest | None] = {
        _upstream_key(artifact): artifact.manifest(ctx.run_dir, ctx.iteration) for artifact in stage.reads
    }
    return inputs_hash(ctx.run_id, ctx.iteration, stage.name, ctx.config_key, upstream)


def clean_stale(ctx: StageContext, name: str) -> None:
    """Remove temporary and trash folders a killed process left for this stage (the caller holds the run lock)."""
    parent = iteration_dir(ctx.run_dir, ctx.iteration)
    for path in list(parent.glob(f".{name}.tmp-*")) + list(parent.glob(f".{name}.trash-*")):
        shutil.rmtree(path, ignore_errors=True)


def run_stage(ctx: StageContext, name: str) -> tuple[StageManifest, bool]:
    """Run stage ``name`` of ``ctx.iteration`` unless its committed manifest matches its inputs.

    Returns:
        (manifest, skipped).

    Raises:
        KeyError: unknown stage. StageNotCommitted: an input's stage has no valid manifest.
    """
    stage = STAGES[name]
    clean_stale(ctx, name)

    def write(out: Path) -> StageOutput:
        inputs = [artifact.load(ctx.run_dir, ctx.iteration) for artifact in stage.reads]
        return stage.fn(ctx, out, *inputs)

    return run_or_skip(ctx.run_dir, ctx.run_id, ctx.iteration, name, stage_key(ctx, stage), write)


def first_pending(ctx0: StageContext) -> tuple[int, str] | None:
    """The first (iteration, stage) of the campaign plan whose committed output is missing, stale or fails its
    checksums; None when the whole campaign is committed. ``ctx0`` is the run's context at iteration 0."""
    for iteration, names in campaign_plan(ctx0.cfg):
        ctx = replace(ctx0, iteration=iteration)
        for name in names:
            manifest = read_manifest(ctx.run_dir, iteration, name, verify=True)
            if manifest is None or manifest.inputs_hash != stage_key(ctx, STAGES[name]):
                return iteration, name
    return None
