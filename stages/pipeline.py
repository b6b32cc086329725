"""The Sol-RL iteration as an ordered table of stages, and how one stage is run or skipped.

No Prefect here: ``solrl.flows`` wraps ``run_stage`` in tasks. Each stage's inputs hash covers the run id,
iteration, stage, config hash and the digests of the manifests it reads, so a re-run skips exactly the stages
whose committed output still matches their inputs, and redoes everything downstream of a change.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from solrl.stages.audit import audit
from solrl.stages.checkpoint import checkpoint
from solrl.config import RunConfig
from solrl.stages.context import StageContext
from solrl.stages.evaluate import evaluate
from solrl.stages.explore import explore
from solrl.stages.regenerate import regenerate
from solrl.stages.score import score_explore, score_regenerate
from solrl.stages.select import select
from solrl.stages.update import update
from solrl.storage.stage import StageManifest, StageOutput, inputs_hash, iteration_dir, read_manifest, run_or_skip


@dataclass(frozen=True)
class Stage:
    name: str
    fn: Callable[[StageContext, Path], StageOutput]
    reads: tuple[str, ...]  # stages of the same iteration whose outputs it reads
    reads_policy: bool  # reads the previous iteration's checkpoint (the policy it starts from)


ITERATION: tuple[Stage, ...] = (
    Stage("explore", explore, (), True),
    Stage("score_explore", score_explore, ("explore",), False),
    Stage("select", select, ("explore", "score_explore"), False),
    Stage("regenerate", regenerate, ("explore", "select"), True),
    Stage("score_regenerate", score_regenerate, ("regenerate", "select"), False),
    Stage("audit", audit, ("explore", "score_explore"), True),
    Stage("update", update, ("regenerate", "score_regenerate"), True),
    Stage("checkpoint", checkpoint, ("update",), False),
    Stage("evaluate", evaluate, ("checkpoint",), False),
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


def stage_key(ctx: StageContext, stage: Stage) -> str:
    """The inputs hash of ``stage`` at ``ctx.iteration`` (see module doc)."""
    upstream: dict[str, StageManifest | None] = {name: read_manifest(ctx.run_dir, ctx.iteration, name)
                                                 for name in stage.reads}
    if stage.reads_policy or stage.name == "evaluate":
        previous = ctx.iteration - 1 if stage.name != "evaluate" else ctx.iteration
        upstream["policy"] = read_manifest(ctx.run_dir, previous, "checkpoint") if previous >= 1 else None
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
        KeyError: unknown stage. StageNotCommitted: an upstream stage has no valid manifest.
    """
    stage = STAGES[name]
    clean_stale(ctx, name)
    return run_or_skip(ctx.run_dir, ctx.run_id, ctx.iteration, name, stage_key(ctx, stage),
                       lambda out: stage.fn(ctx, out))


def first_pending(ctx0: StageContext) -> tuple[int, str] | None:
    """The first (iteration, stage) of the campaign whose committed output is missing or stale, in run order
    (the starting evaluation, then each iteration's due stages); None when the whole campaign is committed.
    ``ctx0`` is the run's context at iteration 0."""
    plan = [(0, "evaluate")] + [(i, s.name) for i in range(1, ctx0.cfg.campaign.iterations + 1) for s in ITERATION
                                if stage_due(ctx0.cfg, s.name, i)]
    for iteration, name in plan:
        ctx = replace(ctx0, iteration=iteration)
        manifest = read_manifest(ctx.run_dir, iteration, name)
        if manifest is None or manifest.inputs_hash != stage_key(ctx, STAGES[name]):
            return iteration, name
    return None
