"""The Sol-RL iteration as an ordered table of stages, the campaign plan, and how one stage is run or skipped.

No Prefect here: ``solrl.flows`` wraps ``run_stage`` in tasks. A stage function's signature is
``fn(ctx, out, *inputs) -> StageOutput``; the types of its inputs are typed artifacts
(``solrl.storage.artifacts``), which say where each input lives. ``run_stage`` reads them and passes them in,
and the stage's inputs hash covers the run id, iteration, stage, config hash and the digests of exactly those
artifacts' manifests, so a re-run skips the stages whose committed output still matches their inputs and
redoes everything downstream of a change.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from solrl.config import ConfigError, RunConfig
from solrl.stages.audit import audit, audit_due, audit_prompts, reduce_audit
from solrl.stages.checkpoint import checkpoint
from solrl.stages.context import StageContext
from solrl.stages.evaluate import evaluate, evaluation_due, reduce_evaluate
from solrl.stages.explore import explore
from solrl.stages.regenerate import regenerate
from solrl.stages.score import (
    reduce_score_explore,
    reduce_score_regenerate,
    reward_batches,
    score_explore,
    score_regenerate,
)
from solrl.stages.select import select
from solrl.stages.sharding import Shard, prompts_per_part
from solrl.stages.update import update
from solrl.storage.artifacts import (
    Artifact,
    AuditPool,
    CandidatePool,
    EvalSamples,
    ExploreRewards,
    RegeneratedRewards,
    Samples,
)
from solrl.storage.mirror import locate
from solrl.storage.stage import (
    StageManifest,
    StageOutput,
    inputs_hash,
    iteration_dir,
    read_manifest,
    remove_stage_tree,
    require,
    run_or_skip,
    uncommit,
)


def _artifact_type(annotation: object) -> type[Artifact] | None:
    """``CandidatePool`` or ``StartingPolicy | None`` -> the artifact class; anything else -> None."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    found = [c for c in candidates if isinstance(c, type) and issubclass(c, Artifact)]
    return found[0] if found else None


@dataclass(frozen=True)
class Stage:
    """One stage: its name and function; what it reads is the function's typed parameters.

    A stage with ``sharded`` (the artifact each shard writes) takes a keyword ``shard`` and may run as
    ``campaign.shards`` shards of its prompts, each committed on its own, then one reduce (``run_stage``)."""

    name: str
    fn: Callable[..., StageOutput]
    #: The artifact each shard writes (None: the stage does not shard).
    sharded: type[Artifact] | None = None
    #: ``reduce(ctx, out, folders, *inputs)`` writes the stage from its shards' committed folders and returns its
    #: output; None: the shards' ``sharded`` Zarr artifacts are concatenated and their outputs merged.
    reduce: Callable[..., StageOutput] | None = None
    #: How many prompts the stage splits (shards are at most one per prompt): the iteration's by default.
    prompts: Callable[[RunConfig], int] = lambda cfg: cfg.campaign.prompts_per_iteration
    #: ``due(cfg, iteration)``: whether the stage runs at that iteration (every iteration by default).
    due: Callable[[RunConfig, int], bool] = lambda cfg, iteration: True
    #: The prompts of one batching block (``Shard.block``): a shard holding whole blocks holds whole batches.
    block: Callable[[RunConfig], int] = lambda cfg: 1

    @cached_property
    def reads(self) -> tuple[type[Artifact], ...]:
        """The artifact types of ``fn``'s positional parameters after ``(ctx, out)``, in order."""
        hints = typing.get_type_hints(self.fn)
        reads = []
        for param in [
            p.name
            for p in list(inspect.signature(self.fn).parameters.values())[2:]
            if p.kind is not inspect.Parameter.KEYWORD_ONLY
        ]:
            artifact = _artifact_type(hints.get(param))
            if artifact is None:
                raise TypeError(f"stage {self.name}: parameter {param!r} is not annotated with a typed artifact")
            reads.append(artifact)
        return tuple(reads)


def _bf16_block(cfg: RunConfig, per_prompt: int, rewards: list[str]) -> int:
    """The batching block of a stage that samples ``per_prompt`` samples a prompt in BF16 (batches of
    ``regenerate.batch_size``), decodes them (chunks of ``DECODE_BATCH``) and scores them with ``rewards``."""
    from solrl.stages.models.diffusers_family import DECODE_BATCH

    return prompts_per_part(per_prompt, [cfg.regenerate.batch_size, DECODE_BATCH, *reward_batches(cfg, rewards)])


# Each sharded stage's batching block, in prompts (``Stage.block``): the fewest prompts whose samples fill whole
# batches of every size it samples, decodes or scores in (``prompts_per_part``; counted per image, so a video's
# frames only make a block a multiple of the least one). Explore decodes each part it samples: its sampling batch
# sets its block.
def _explore_block(cfg: RunConfig) -> int:
    return prompts_per_part(cfg.explore.pool_size, [cfg.explore.batch_size])


def _score_explore_block(cfg: RunConfig) -> int:
    return prompts_per_part(cfg.explore.pool_size, reward_batches(cfg, cfg.reward.weights))


def _regenerate_block(cfg: RunConfig) -> int:
    return _bf16_block(cfg, cfg.select.k, []) if cfg.regenerate.enabled else 1  # else the kept samples are copied


def _score_regenerate_block(cfg: RunConfig) -> int:
    return prompts_per_part(cfg.select.k, reward_batches(cfg, cfg.reward.weights))


def _audit_block(cfg: RunConfig) -> int:
    return _bf16_block(cfg, cfg.explore.pool_size, list(cfg.reward.weights))


def _evaluate_block(cfg: RunConfig) -> int:
    return _bf16_block(cfg, cfg.campaign.eval_seeds, list(dict.fromkeys([*cfg.reward.weights, *cfg.reward.evaluate])))


ITERATION: tuple[Stage, ...] = (
    Stage("explore", explore, CandidatePool, block=_explore_block),
    Stage("score_explore", score_explore, ExploreRewards, reduce_score_explore, block=_score_explore_block),
    Stage("select", select),
    Stage("regenerate", regenerate, Samples, block=_regenerate_block),
    Stage(
        "score_regenerate",
        score_regenerate,
        RegeneratedRewards,
        reduce_score_regenerate,
        block=_score_regenerate_block,
    ),
    Stage("audit", audit, AuditPool, reduce_audit, audit_prompts, audit_due, block=_audit_block),
    Stage("update", update),
    Stage("checkpoint", checkpoint),
    Stage(
        "evaluate",
        evaluate,
        EvalSamples,
        reduce_evaluate,
        lambda cfg: len(cfg.eval_prompts()),
        evaluation_due,
        block=_evaluate_block,
    ),
)
STAGES = {stage.name: stage for stage in ITERATION}


def stage_due(cfg: RunConfig, name: str, iteration: int) -> bool:
    """Whether stage ``name`` runs at ``iteration``: as the stage says (``Stage.due``: the audit every
    ``fidelity.audit_every`` iterations, evaluation every ``campaign.eval_every`` and at 0, the rest always)."""
    return STAGES[name].due(cfg, iteration)


def campaign_plan(cfg: RunConfig) -> list[tuple[int, list[str]]]:
    """The whole campaign in run order: ``[(0, ["evaluate"]), (1, [stages due at 1]), ...]``; iteration 0 is
    the evaluation of the starting policy. The one place the order of a campaign is written."""
    plan = [(0, ["evaluate"])]
    for iteration in range(1, cfg.campaign.iterations + 1):
        plan.append((iteration, [s.name for s in ITERATION if stage_due(cfg, s.name, iteration)]))
    return plan


def uncommitted_gaps(cfg: RunConfig, committed: set[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (iteration, stage) pairs of the campaign plan that are not committed while a later one is: uncommitted by
    ``solrl verify --redo``, or deleted (a campaign commits its stages in plan order, so its progress leaves none).
    ``committed``: the run's committed pairs (``solrl.storage.stage.committed_stages``)."""
    plan = [(i, s) for i, names in campaign_plan(cfg) for s in names]
    last = max((k for k, key in enumerate(plan) if key in committed), default=-1)
    return [key for key in plan[:last] if key not in committed]


def downstream_of(cfg: RunConfig, changed: set[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (iteration, stage) pairs of the campaign plan that read, directly or through other stages, one of
    ``changed`` (``Stage.reads``, with each artifact's iteration offset), in plan order; ``changed`` not included.

    A stage's readers check its files' sizes, not their bytes (``read_manifest``): a stage whose committed bytes
    changed on disk may have been read as they were, and what read it must be recomputed with it
    (``solrl verify --redo``)."""
    tainted, out = set(changed), []
    for iteration, names in campaign_plan(cfg):
        for name in names:
            if (iteration, name) in tainted:
                continue
            sources = {(a.source_iteration(iteration), a.stage) for a in STAGES[name].reads}
            if sources & tainted:
                tainted.add((iteration, name))
                out.append((iteration, name))
    return out


def _upstream_key(artifact: type[Artifact]) -> str:
    return artifact.stage if artifact.offset == 0 else f"{artifact.stage}[{artifact.offset:+d}]"


def stage_key(ctx: StageContext, stage: Stage) -> str:
    """The inputs hash of ``stage`` at ``ctx.iteration`` (see module doc)."""
    upstream: dict[str, StageManifest | None] = {
        _upstream_key(artifact): artifact.manifest(ctx.run_dir, ctx.iteration) for artifact in stage.reads
    }
    return inputs_hash(ctx.run_id, ctx.iteration, stage.name, ctx.config_key, upstream)


def clean_stale(ctx: StageContext, name: str) -> None:
    """Remove temporary and trash folders a killed process left for this stage and its shards (the caller holds
    the run lock)."""
    parent = iteration_dir(ctx.run_dir, ctx.iteration)
    stale = [*parent.glob(f".{name}.tmp-*"), *parent.glob(f".{name}.trash-*")]
    shards = parent / shards_folder(name)
    stale += [*shards.glob(".*.tmp-*"), *shards.glob(".*.trash-*")]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def shards_folder(name: str) -> str:
    """The folder, in the iteration's folder, holding the committed shards of stage ``name`` until its reduce."""
    return f"{name}.shards"


def stage_shards(ctx: StageContext, stage: Stage) -> list[Shard]:
    """The shards ``stage`` runs as at ``ctx.iteration``: ``campaign.shards`` of them, at most one per prompt, over
    the stage's batching blocks (``Stage.block``); one (the whole stage) for a stage that does not shard."""
    if stage.sharded is None:
        return [Shard()]
    count = min(ctx.cfg.campaign.shards, stage.prompts(ctx.cfg))
    block = stage.block(ctx.cfg)
    return [Shard(index, count, block) for index in range(count)]


#: The sharded stages whose outputs the update trains on (an evaluation's or an audit's last bits change only
#: what they report).
TRAINING_PATH = ("explore", "score_explore", "regenerate", "score_regenerate")


def shard_warnings(cfg: RunConfig) -> list[str]:
    """What ``campaign.shards`` means for the results: one warning naming the stages on the training path whose
    shards must split a batch (fewer batching blocks than shards), so that another shard count can train on other
    last bits; [] where every such shard holds whole batches (or ``campaign.shards`` is 1)."""
    split = []
    for stage in ITERATION:
        if stage.name not in TRAINING_PATH or cfg.campaign.shards == 1:
            continue
        try:
            prompts = stage.prompts(cfg)
        except ConfigError:  # unreadable prompt files: run and resume refuse them on their own
            continue
        count, block = min(cfg.campaign.shards, prompts), stage.block(cfg)
        if count > 1 and Shard(0, count, block).splits_batches(prompts):
            split.append(f"{stage.name} (whole batches every {block} prompts, of {prompts})")
    if not split:
        return []
    return [
        f"campaign.shards={cfg.campaign.shards} splits batches of {', '.join(split)}: where a matrix product rounds "
        "by the batch around a row (many CPUs and GPUs), the results can differ in their last bits from another "
        "shard count's, and a later iteration's low-precision explore can turn that into other kept seeds; "
        "smaller batch sizes or fewer shards keep every batch whole"
    ]


def _shard_key(key: str, shard: Shard) -> str:
    """The inputs hash of ``shard``'s folder: the stage's, its shard, and its block where the shard is laid out
    over blocks of several prompts (the same name then holds other prompts)."""
    block = f":block {shard.block}" if shard.block != 1 else ""
    return hashlib.sha256(f"{key}:{shard.name}{block}".encode()).hexdigest()


def run_shard(ctx: StageContext, name: str, shard: Shard) -> tuple[StageManifest, bool]:
    """Run (or skip) one shard of a sharded stage: its prompts only, committed atomically on its own under
    ``<stage>.shards/<shard>`` (so a failed or killed shard is redone alone). Skipped when the shard, or the
    whole stage, is already committed for the stage's inputs.

    Returns:
        (manifest, skipped): the shard's manifest, or the stage's when the stage is committed.

    Raises:
        LeaseLost: this process held the run's lease and lost it (``RunPlace.check_lease``): it neither cleans,
            computes nor skips on.
    """
    locate(ctx.run_dir).check_lease()
    stage = STAGES[name]
    key = stage_key(ctx, stage)
    committed = read_manifest(ctx.run_dir, ctx.iteration, name)
    if committed is not None and committed.inputs_hash == key:
        return committed, True

    folder = iteration_dir(ctx.run_dir, ctx.iteration) / shards_folder(name)
    for stale in [*folder.glob(f".{shard.name}.tmp-*"), *folder.glob(f".{shard.name}.trash-*")]:  # a killed try's
        shutil.rmtree(stale, ignore_errors=True)
    where = f"{shards_folder(name)}/{shard.name}"
    return run_or_skip(
        ctx.run_dir, ctx.run_id, ctx.iteration, where, _shard_key(key, shard), _writer(ctx, stage, shard)
    )


def _writer(ctx: StageContext, stage: Stage, shard: Shard | None = None) -> Callable[[Path], StageOutput]:
    """``write(out)`` of a stage (or of one shard of it): read its inputs, run its function into ``out``."""

    def write(out: Path) -> StageOutput:
        inputs = [artifact.load(ctx.run_dir, ctx.iteration) for artifact in stage.reads]
        return stage.fn(ctx, out, *inputs) if shard is None else stage.fn(ctx, out, *inputs, shard=shard)

    return write


#: Stage info that counts a shard's share (summed over shards); other info is the same in every shard.
COUNTED_INFO = ("prompts", "samples")


def merge_outputs(manifests: list[StageManifest]) -> StageOutput:
    """The stage output of its shards: ``*seconds`` metrics summed, other metrics from the first shard;
    ``COUNTED_INFO`` summed, warnings joined, other info from the first shard; ``nodes``: the machine that
    computed each shard, in shard order."""
    metrics = dict(manifests[0].metrics)
    for key in metrics:
        if key.endswith("seconds"):
            metrics[key] = sum(m.metrics.get(key, 0.0) for m in manifests)
    info = dict(manifests[0].info)
    for key in info:
        if key == "warnings":
            info[key] = list(dict.fromkeys(w for m in manifests for w in m.info.get(key, [])))
        elif key in COUNTED_INFO:
            info[key] = sum(int(m.info.get(key, 0)) for m in manifests)
    info["shards"] = len(manifests)
    info["nodes"] = [m.node for m in manifests]
    return StageOutput(metrics=metrics, info=info)


def replace_info(output: StageOutput, **info: object) -> StageOutput:
    """``output`` with ``info`` added."""
    return StageOutput(metrics=output.metrics, info={**output.info, **info})


def run_stage(ctx: StageContext, name: str) -> tuple[StageManifest, bool]:
    """Run stage ``name`` of ``ctx.iteration`` unless its committed manifest matches its inputs.

    A sharded stage (``campaign.shards`` > 1) runs its missing shards (``run_shard``; the flow runs each as
    its own task first), then commits the concatenation of their outputs as the stage, then removes the shards.

    Returns:
        (manifest, skipped).

    Raises:
        KeyError: unknown stage. StageNotCommitted: an input's stage has no valid manifest. LeaseLost: this process
            held the run's lease and lost it (``RunPlace.check_lease``): it neither cleans another's temporary
            folders, computes nor skips on.
    """
    locate(ctx.run_dir).check_lease()
    stage = STAGES[name]
    clean_stale(ctx, name)
    shards, key = stage_shards(ctx, stage), stage_key(ctx, stage)
    if len(shards) == 1:
        result = run_or_skip(ctx.run_dir, ctx.run_id, ctx.iteration, name, key, _writer(ctx, stage))
    else:
        done = [run_shard(ctx, name, shard) for shard in shards]
        committed = [manifest for manifest, _ in done if manifest.stage != name]
        artifact = stage.sharded
        assert artifact is not None

        def reduce(out: Path) -> StageOutput:
            folders = [require(ctx.run_dir, ctx.iteration, m.stage)[0] for m in committed]  # checksums verified
            if stage.reduce is not None:
                inputs = [a.load(ctx.run_dir, ctx.iteration) for a in stage.reads]
                output = stage.reduce(ctx, out, folders, *inputs)
                return replace_info(output, shards=len(folders), nodes=[m.node for m in committed])
            parts = [artifact.read(folder / artifact.filename) for folder in folders]
            artifact.write_concat(out, parts, [m.present() for m in committed])
            return merge_outputs(committed)

        seconds = sum(m.seconds for m in committed)
        result = run_or_skip(ctx.run_dir, ctx.run_id, ctx.iteration, name, key, reduce, seconds)
    remove_stage_tree(ctx.run_dir, f"{iteration_dir(ctx.run_dir, ctx.iteration).name}/{shards_folder(name)}")
    return result


def restore_pruned_inputs(ctx0: StageContext) -> list[tuple[int, str]]:
    """Uncommit the producer of every pruned input a stage still to run reads, so the campaign redoes it first.

    Retention (``solrl.storage.retention``) prunes an iteration's pool only once its checkpoint is committed, when
    no stage reads it again; but ``solrl verify --redo``, or a damaged file found on resume, can make a stage of
    such an iteration pending again (score_explore reads the pool's images, update the regenerated samples). Its
    producer (explore, regenerate) is deterministic in its inputs (the same seeds and starting policy give the
    same bytes), so redoing it restores exactly the files its manifest recorded, and every committed stage
    downstream keeps its inputs hash. Call it holding the run's lock, before ``first_pending``.

    Returns:
        The ``(iteration, stage)`` producers uncommitted, in plan order.
    """
    restored: list[tuple[int, str]] = []
    for iteration, names in campaign_plan(ctx0.cfg):
        ctx = replace(ctx0, iteration=iteration)
        for name in names:
            pruned = [
                artifact.stage
                for artifact in STAGES[name].reads
                if artifact.offset == 0
                and artifact.stage in STAGES
                and (iteration, artifact.stage) not in restored
                and (producer := read_manifest(ctx.run_dir, iteration, artifact.stage)) is not None
                and producer.pruned
            ]
            if not pruned:
                continue
            manifest = read_manifest(ctx.run_dir, iteration, name)
            if manifest is not None and manifest.inputs_hash == stage_key(ctx, STAGES[name]):
                continue  # committed for its inputs: it reads nothing again
            for stage in pruned:
                uncommit(ctx.run_dir, iteration, stage)
                restored.append((iteration, stage))
    return restored


def first_pending(ctx0: StageContext) -> tuple[int, str] | None:
    """The first (iteration, stage) of the campaign plan whose committed output is missing, stale, or has a file
    missing or of another size; None when the whole campaign is committed. ``ctx0`` is the run's context at
    iteration 0. Reads manifests and file sizes only: checksums are re-hashed on demand (``solrl verify``)."""
    for iteration, names in campaign_plan(ctx0.cfg):
        ctx = replace(ctx0, iteration=iteration)
        for name in names:
            manifest = read_manifest(ctx.run_dir, iteration, name)
            if manifest is None or manifest.inputs_hash != stage_key(ctx, STAGES[name]):
                return iteration, name
    return None
