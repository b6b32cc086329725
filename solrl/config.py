"""The run configuration: one pydantic model per section, validated at load.

A run is described by a YAML preset (``configs/*.yaml``) plus ``--set
section.key=value`` overrides. Unknown keys are an error, and cross-field rules
(``k`` even and ``<= pool_size``, ...) are checked here, at load, with messages
that name the value and the fix. Model family, rewards, explore precision and
loss are names of registered plug-ins (``solrl.registry``), each of which checks
its own rules. The schema is pure: it says what a valid config is on any
machine. Whether this machine can run it (CUDA, Transformer Engine, weights and
prompt files present) is checked where work starts
(``solrl.stages.runnable.check_runnable``), so any machine can list, inspect and
report any run. Runtime objects (models, devices, generators) are built *from*
the config, never stored in it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
import os
import re
import shlex
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from solrl.configs import DEFAULT as DEFAULT_PRESET
from solrl.prompts import PromptFileError, PromptSet, read_prompt_set, split

SelectStrategy = Literal["best_worst", "top_k", "random"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the value and the fix."""


# Bounds far above any published setting (Sol-RL: pools of 96, 48 prompts an iteration, 40 steps) that keep a typo
# (pool_size: 1e23) from a run that sits in its first stage for ever drawing seeds.
MAX_POOL_SIZE = 4096  #: candidates (or evaluation seeds) per prompt
MAX_STEPS = 1000  #: sampling steps: a flow model's training schedule has 1000 timesteps
MAX_PROMPTS = 65536  #: training prompts per iteration
#: RL iterations of a campaign: the presets run at most 300; planning 10^8 took minutes and gigabytes before work.
MAX_ITERATIONS = 100_000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML ``true``/``yes`` is not a number: pydantic would read it as 1 (``explore.steps: yes``)."""
        field = cls.model_fields[info.field_name] if info.field_name else None
        if (
            field is None
            or field.annotation is bool
            or field.annotation == dict[str, Any]  # a plug-in's options: its own model checks them
            or (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
        ):
            return value
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
        if not any(isinstance(item, bool) for item in items):
            return value
        if _takes_numbers(field.annotation):
            raise ValueError(
                f"expected a number but got {value!r}: YAML reads true/false/yes/no/on/off as "
                f"booleans; write a number (or null where the key allows it)"
            )
        choices = _literal_choices(field.annotation) or _registered_names(cls.__name__, info.field_name)
        raise ValueError(
            f"expected a name but got {value!r}: YAML reads true/false/yes/no/on/off as booleans; put the word in "
            "quotes" + (f" (one of {', '.join(map(repr, choices))})" if choices else "")
        )


#: The name fields whose values a plug-in registry holds: (section class, field) -> the registry in solrl.registry.
_REGISTRY_FIELDS = {
    ("ModelConfig", "family"): "MODELS",
    ("ExploreConfig", "precision"): "EXPLORE_BACKENDS",
    ("TrainConfig", "loss"): "LOSSES",
}


def _registered_names(section: str, field: str) -> list[str]:
    """The registered names a registry-backed name field takes (``_REGISTRY_FIELDS``), else []; [] too when the
    plug-ins fail to load (the registry's own lookup says why)."""
    import solrl.registry

    registry = _REGISTRY_FIELDS.get((section, field))
    try:
        return getattr(solrl.registry, registry).names() if registry else []
    except ValueError:
        return []


def _takes_numbers(annotation: Any) -> bool:
    """Whether a field's type holds an int or a float anywhere (``int | None``, ``tuple[int, int]``,
    ``dict[str, float]``); a ``Literal``'s values are not types."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) is Literal:
        return False
    return any(_takes_numbers(arg) for arg in typing.get_args(annotation))


def _literal_choices(annotation: Any) -> list[Any]:
    """The values of the ``Literal`` in a field's type (``Literal['warn', 'stop'] | None``), else []."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [choice for arg in typing.get_args(annotation) for choice in _literal_choices(arg)]


#: The base of a config section and of a plug-in's options model: unknown keys refused, frozen, no NaN or inf, and
#: no YAML boolean read as a number.
ConfigSection = _Section


class ModelConfig(_Section):
    """Which model family the policy is, where its weights are, and its LoRA."""

    family: str = Field(
        default_factory=lambda: _preset_default("model", "family"),
        description="Registered model family (DESIGN 5; docs: Models).",
    )
    path: str | None = Field(
        None,
        description="Diffusers-format weights folder (or a hub id where the user is online and has the weights); "
        "null = the family's default (shipped with solrl, built on first use in the solrl cache, or its hub id).",
    )
    source: Literal["weights", "tiny"] = Field(
        "weights",
        description="weights = the family's weights (model.path, or its default); tiny = the family's tiny twin: its "
        "own diffusers classes at tiny widths with random weights, built on first use in the solrl cache (or in the "
        "folder model.path names; a hub id there is the real checkpoint and is not used), which runs the whole flow "
        "on a CPU in minutes: the plumbing, not learning (docs: Models).",
    )
    resolution: int | None = Field(
        None, ge=8, description="Image height and width in pixels; null = the family's default."
    )
    sampler_shift: float = Field(
        2.0,
        gt=0,
        description="FlowMatchEulerDiscreteScheduler shift of the sigma schedule (FLUX.1 shifts "
        "dynamically with the image size instead).",
    )
    solver: Literal["euler", "dpm2"] = Field(
        "euler",
        description="ODE solver of every rollout: euler (first order) or dpm2 (DPM-Solver++(2M), second "
        "order, one model call per step; Sol-RL's FLUX.1 and SD3.5 configs).",
    )
    guidance: float = Field(
        1.0,
        ge=0,
        description="Guidance-embedding value of a transformer that embeds one (FLUX.1-dev, FLUX.2-dev; Sol-RL "
        "samples without CFG); any value but 1.0 is refused for a family that embeds none.",
    )
    max_sequence_length: int | None = Field(
        None, ge=1, description="Text tokens of the (T5 / Gemma) text encoder; null = the family's default."
    )
    num_frames: int | None = Field(
        None,
        ge=1,
        description="Frames per video of a video family (Wan: 4k + 1); null = the family's default. Refused for "
        "an image family.",
    )
    lora_rank: int = Field(8, ge=1, description="LoRA rank of the trained policy adapter (peft).")
    lora_alpha: float = Field(8.0, gt=0, description="LoRA alpha (scaling = alpha / rank).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Weights dtype of the transformer, VAE and text encoders: auto = bfloat16 on CUDA (BF16 train), "
        "float32 on CPU (a family may keep float32 everywhere). bfloat16 on CPU runs the published precision anywhere "
        "(slower there; bench/published_size.py), computing under bf16 autocast as on CUDA.",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile mode of the sampling copies that explore.compile / regenerate.compile compile "
        "(the Sol-RL release: max-autotune-no-cudagraphs).",
    )


class ExploreConfig(_Section):
    """Step 1: sample the candidate pool with the low-precision rollout copy."""

    precision: str = Field(
        default_factory=lambda: _preset_default("explore", "precision"),
        description="Registered explore backend, the numerics of the explore copy (DESIGN 2; docs: Explore "
        "precisions and hardware, which says where each runs).",
    )
    steps: int = Field(6, ge=1, le=MAX_STEPS, description="Euler ODE steps for explore sampling.")
    pool_size: int = Field(32, ge=2, le=MAX_POOL_SIZE, description="Candidates (seeds) per prompt.")
    batch_size: int = Field(256, ge=1, description="Samples per forward pass.")
    min_dim: int = Field(0, ge=0, description="Layers with max(in, out) <= min_dim stay high precision (Sol-RL rule).")
    activation_scale: Literal["sample", "call"] = Field(
        "sample",
        description="Emulated backends: one activation tensor scale per sample (a candidate's scales do not depend "
        "on the batch it was sampled in; a CPU whose float32 GEMM rounds a row by its batch still moves a value "
        "across an E2M1 rounding boundary now and then) or per forward call (the whole batch's amax, as "
        "Transformer Engine does).",
    )
    keep_copy: Literal["device", "host", "none"] = Field(
        "host",
        description="Where the low-precision explore copy stays outside explore: host (moved to CPU memory, moved "
        "back and synced at the next explore; the GPU holds it during explore only), device (resident through score, "
        "regenerate and update; no transfer), none (freed, rebuilt at the next explore). Transformer Engine copies "
        "live on the GPU only: host frees them as none does. Changes no result.",
    )
    compile: bool = Field(
        False,
        description="Sample with the explore copy's transformer blocks compiled (torch.compile, model.compile_mode); "
        "the first iteration pays the compile. See the README for where it pays.",
    )


class SelectConfig(_Section):
    """Step 3: which seeds of each pool are regenerated and trained on."""

    strategy: SelectStrategy = Field("best_worst", description="best_worst keeps k/2 best and k/2 worst per prompt.")
    k: int = Field(8, ge=2, description="Seeds kept per prompt (the group size of the update).")


class RegenerateConfig(_Section):
    """Step 4: regenerate the kept seeds with the full-precision rollout policy."""

    enabled: bool = Field(
        True, description="false: train on the explore samples themselves (the naive-FP4 and BF16-scaling ablations)."
    )
    steps: int = Field(10, ge=1, le=MAX_STEPS, description="Sampling steps (also the training timestep grid).")
    batch_size: int = Field(256, ge=1, description="Samples per forward pass.")
    noise_level: float = Field(
        0.7,
        ge=0,
        description="SDE noise level a of the rollouts, for a loss that trains on SDE log-probs (the loss says "
        "whether it does; 0 = ODE only).",
    )
    sde_window: tuple[int, int] | None = Field(
        None,
        description="For a loss on SDE log-probs, the 'fast' schedule: SDE on steps [start, end), ODE elsewhere, "
        "train the window only.",
    )
    compile: bool = Field(
        False,
        description="Sample with the BF16 rollout's transformer blocks compiled (torch.compile, model.compile_mode): "
        "regeneration, the audit and the evaluation, which share that network. The update stays eager.",
    )


class TrainConfig(_Section):
    """Step 6: the policy update (a registered policy loss, DESIGN 1)."""

    loss: str = Field(
        default_factory=lambda: _preset_default("train", "loss"),
        description="Registered policy loss (DESIGN 1; docs: losses).",
    )
    loss_options: dict[str, Any] = Field(
        default_factory=dict,
        description="The loss's own options, validated by the loss (its Options; docs: losses); a stored config "
        "holds every one, resolved.",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay of the LoRA parameters.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon (added to the second-moment root).")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    optimizer_steps: int = Field(4, ge=1, description="Optimizer steps per iteration.")
    micro_batch: int = Field(
        64, ge=1, description="Samples per forward/backward pass of the update (gradients accumulate over them)."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Processes of the update (torchrun --nproc-per-node; DDP-style gradient all-reduce, NCCL on GPUs "
        "with one GPU per process, gloo on CPU). Layout only: the trained weights equal one process's within float "
        "tolerance.",
    )
    launcher: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="How a multi-process update starts: torchrun = train.nproc_per_node processes on this node; "
        "ray = train.workers workers of Ray Train's TorchTrainer on the nodes of a Ray cluster (the cluster at "
        "campaign.task_runner_address when campaign.task_runner=ray, else RAY_ADDRESS, else a local one), gloo "
        "on CPU, NCCL with one GPU per worker. Layout only.",
    )
    workers: int = Field(
        1,
        ge=1,
        description="train.launcher=ray: Ray Train workers of the update (ScalingConfig.num_workers), each with one "
        "GPU on CUDA, else one CPU. Layout only, as train.nproc_per_node.",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How a multi-process update (train.nproc_per_node or train.workers > 1) holds the model: ddp = "
        "every process holds the whole transformer and its LoRA and the gradients are all-reduced (DDP-style); fsdp "
        "= FSDP2 (torch.distributed.fsdp.fully_shard) shards the frozen base and the LoRA, their gradients and "
        "AdamW's moments over the processes, each block gathered only while it computes (models too big to "
        "replicate: `solrl plan`). Layout only: the trained weights are the same within float rounding; one "
        "process ignores it.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block in backward instead of keeping its activations (diffusers' "
        "enable_gradient_checkpointing): the update's activation memory drops to about the blocks' inputs, for "
        "about one more forward of compute. Layout only: the trained weights are the same.",
    )
    timestep_fraction: float = Field(
        0.6, gt=0, le=1, description="Fraction of the sampling timesteps trained per step."
    )
    kl_beta: float = Field(1e-4, ge=0, description="Weight of ||v_theta - v_ref||^2 (reference = adapter off).")
    adv_clip_max: float = Field(5.0, gt=0, description="Advantages are clipped to +-adv_clip_max.")
    global_std: bool = Field(True, description="Normalise advantages by the batch std instead of the group std.")
    advantage_stats: Literal["group", "per_prompt"] = Field(
        "group",
        description="group: centre on this iteration's group mean (GRPO); per_prompt: on a per-prompt "
        "buffer of rewards kept across iterations (DDPO's stat tracker; persisted in update/reward_stats.parquet).",
    )
    stat_buffer: int = Field(32, ge=1, description="per_prompt: rewards kept per prompt.")
    stat_min_count: int = Field(16, ge=1, description="per_prompt: below this many, use the batch statistics.")
    ema_decay: float = Field(0.9, ge=0, lt=1, description="EMA of the policy adapter, for evaluation.")
    spike_factor: float | None = Field(
        10.0,
        gt=1,
        description="Skip (and count, and warn about) an optimizer step whose grad norm before clipping exceeds "
        "this multiple of the median of the last spike_window steps' norms; null = never skip.",
    )
    spike_window: int = Field(32, ge=4, description="Grad norms kept for spike_factor's running median.")


#: The loss options that were ``train`` fields before ``train.loss_options`` (issue 37), with their defaults then: a
#: stored config or a YAML that has them is read with them moved into ``train.loss_options``, where the loss's
#: ``Options`` does not know one at its old default it is dropped (it was never used).
LEGACY_LOSS_OPTIONS: dict[str, Any] = {
    "clip_range": 1e-4,
    "grpo_guard": False,
    "beta": 1.0,
    "decay_rate": 0.001,
    "decay_max": 0.5,
}


def migrate_train(train: dict[str, Any]) -> dict[str, Any]:
    """A ``train`` section with its legacy loss options (``LEGACY_LOSS_OPTIONS``) moved into ``loss_options``
    (a new mapping; ``loss_options`` given explicitly wins)."""
    legacy = {k: train[k] for k in LEGACY_LOSS_OPTIONS if k in train}
    if not legacy:
        return train
    rest = {k: v for k, v in train.items() if k not in LEGACY_LOSS_OPTIONS}
    return rest | {"loss_options": legacy | dict(train.get("loss_options") or {})}


def loss_option_values(options: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """``train.loss_options`` as a loss with option ``fields`` validates them: a legacy option it does not have is
    dropped at its old default (a stored config of before ``loss_options`` held every loss's), kept otherwise (so
    the loss refuses it)."""
    return {
        k: v for k, v in options.items() if k in fields or k not in LEGACY_LOSS_OPTIONS or v != LEGACY_LOSS_OPTIONS[k]
    }


#: The key of a ``reward.models`` entry naming the registered reward it is an instance of.
REWARD_TYPE = "type"
#: The evaluation's own measures, logged beside the rewards as ``eval/<name>`` (``stages/evaluate.py``): no reward
#: instance may take one of these names.
EVAL_MEASURES = ("diversity", "grid_energy", "temporal_change")
#: What a reward instance's name may hold: it becomes an MLflow metric name (``eval/<name>``) and a table value.
_INSTANCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def reward_type(name: str, models: dict[str, dict[str, Any]]) -> str:
    """The registered reward that ``name`` is an instance of: its ``reward.models`` entry's ``type``, else
    ``name`` itself."""
    return models.get(name, {}).get(REWARD_TYPE, name)


def reward_option_values(name: str, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``name``'s options as its reward validates them: its ``reward.models`` entry without the ``type``."""
    return {k: v for k, v in models.get(name, {}).items() if k != REWARD_TYPE}


class RewardConfig(_Section):
    """Training reward (weighted sum) and the rewards evaluation reports."""

    weights: dict[str, float] = Field(
        default_factory=lambda: _preset_default("reward", "weights"), description="reward name -> weight"
    )
    evaluate: list[str] = Field(
        default_factory=lambda: _preset_default("reward", "evaluate"),
        description="Rewards logged on the held-out evaluation samples.",
    )
    models: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="reward name -> its options (weights paths, device, dtype, batch_size, keep_loaded), each "
        "validated by the reward itself. A name may be an instance of a registered reward named by its 'type' "
        "(judge_a: {type: <registered reward>, path: ...}), so one reward can score a run twice, configured "
        "differently.",
    )
    normalize: Literal["none", "group"] = Field(
        "none",
        description="none: the weighted sum of raw rewards; group: each reward standardised within its group (a "
        "prompt's pool when selecting, its kept samples for advantages) before weighting (multi-reward "
        "advantages, as the peers do).",
    )
    video: Literal["mean", "min"] = Field(
        "mean",
        description="How an image reward scores a video (a video family): each scored frame is rewarded as an "
        "image, and the video's reward is their mean (as the peers score videos with PickScore and HPS) or their "
        "minimum (its worst frame).",
    )
    frame_stride: int = Field(
        1, ge=1, description="Video rewards score every frame_stride-th frame, the first included (1 = every frame)."
    )

    @field_validator("models")
    @classmethod
    def _instances(cls, models: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """An instance's ``type`` is a name, and its own name one MLflow and the tables can carry."""
        for name, entry in models.items():
            if REWARD_TYPE not in entry:
                continue
            kind = entry[REWARD_TYPE]
            if not isinstance(kind, str) or not kind:
                raise ValueError(f"{name}.{REWARD_TYPE} must name a registered reward, got {kind!r}")
            if not _INSTANCE_NAME.fullmatch(name) or name.startswith(".") or name in EVAL_MEASURES:
                raise ValueError(
                    f"{name!r} cannot name a reward instance: use letters, digits, '_', '-' and '.', not starting "
                    f"with '.', and none of the evaluation's own measures ({', '.join(EVAL_MEASURES)})"
                )
        return models

    def type_of(self, name: str) -> str:
        """The registered reward that ``name`` (in ``weights``, ``evaluate`` or ``models``) is an instance of: its
        ``models`` entry's ``type``, else the name itself."""
        return reward_type(name, self.models)

    def options_of(self, name: str) -> dict[str, Any]:
        """``name``'s options as its reward validates them: its ``models`` entry without the ``type``."""
        return reward_option_values(name, self.models)


class FidelityConfig(_Section):
    """Proxy-fidelity monitor: does the explore copy rank like the BF16 policy? (DESIGN 2)"""

    audit_every: int = Field(5, ge=0, description="Every N iterations regenerate whole pools in BF16 (0 = never).")
    audit_prompts: int = Field(2, ge=1, description="Pools (prompts) regenerated in full by an audit.")
    min_spearman: float | None = Field(
        None, ge=-1, le=1, description="Bound on the kept-seed Spearman rho; below it, warn or fall back."
    )
    on_low: Literal["warn", "bf16"] = Field(
        "warn", description="Below min_spearman: warn only, or also explore in bf16 the next iteration."
    )


class KeepPools(_Section):
    """Which iterations keep their pool data (``storage.keep_pools``, issue 36); the rest are pruned once their
    checkpoint is committed."""

    last: int | None = Field(
        None,
        ge=0,
        description="Keep the pools of the last N iterations with a committed checkpoint; null = keep every pool.",
    )
    every: int = Field(0, ge=0, description="Also keep the pools of every Mth iteration (M, 2M, ...); 0 = none.")


class StorageConfig(_Section):
    root: str = Field("runs", description="Run store: <root>/<run_id>/ holds every stage output.")
    pool: Literal["full", "latents", "rankings"] = Field(
        "latents",
        description="What an iteration's candidate pool keeps once its checkpoint is committed: full = every "
        "candidate's image; latents = every candidate's final latents (solrl show and the report decode them with "
        "the run's model when asked; SANA's 1024 px latent is 1/24 of its image's bytes), images dropped; "
        "rankings = neither (the rewards, ranks and selection tables are always kept). The rest of the "
        "iteration reads the full pool before it is pruned.",
    )
    keep_pools: KeepPools = Field(
        default_factory=KeepPools,
        description="Retention: iterations outside it lose their pool data (explore's images, latents and "
        "trajectories, regenerate's likewise) once their checkpoint is committed; manifests, rewards, selections, "
        "checkpoints and evaluations are always kept. Applied after each iteration and by `solrl prune`.",
    )


class TrackingConfig(_Section):
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; null = sqlite file in the run store.")
    experiment: str = Field("solrl", description="MLflow experiment the run logs to (created when missing).")
    grid_prompts: int = Field(4, ge=0, description="Prompts shown in the per-iteration best/worst image grid.")
    report_every: int = Field(
        5,
        ge=0,
        description="Rewrite the run store's HTML report (<run>/report/) every N iterations and link it from the "
        "Prefect UI; 0 = only when the campaign ends. About 2 s per report for the default preset on 2 cores.",
    )
    report: bool = Field(
        True,
        description="Write the HTML report into the run store (every report_every iterations and when the campaign "
        "ends), log it to MLflow and link it from the Prefect UI. false = none, e.g. for a sweep of short runs "
        "compared in MLflow; `solrl report RUN --html` writes the page later from the stored run.",
    )


class CampaignConfig(_Section):
    """The run as a whole: iterations, prompts, seeds, evaluation."""

    iterations: int = Field(
        20, ge=1, le=MAX_ITERATIONS, description="RL iterations of the campaign (each: explore ... checkpoint)."
    )
    prompts_per_iteration: int = Field(
        8,
        ge=1,
        le=MAX_PROMPTS,
        description="Training prompts drawn per iteration (each gets its own candidate pool and group).",
    )
    prompts_file: str = Field(
        default_factory=lambda: _preset_default("campaign", "prompts_file"),
        description="Plain text (one prompt a line) or JSONL (a prompt and its metadata a line); a relative path "
        "is the preset's (beside it, else shipped with solrl), or, given with --set, first the current folder's.",
    )
    eval_prompts_file: str | None = Field(
        default_factory=lambda: _preset_default("campaign", "eval_prompts_file"),
        description="Held-out evaluation prompts; null = a fixed split of prompts_file (campaign.eval_fraction).",
    )
    eval_fraction: float = Field(
        0.1, gt=0, lt=1, description="With eval_prompts_file null: the fraction of prompts_file held out (by hash)."
    )
    eval_seeds: int = Field(8, ge=1, le=MAX_POOL_SIZE, description="Fixed seeds per evaluation prompt.")
    eval_every: int = Field(
        1, ge=1, description="Evaluate the rollout policy every N iterations, before the first and after the last."
    )
    eval_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Sampling steps of the evaluation; null = regenerate.steps."
    )
    eval_adapter: Literal["rollout", "ema", "policy"] = Field(
        "rollout",
        description="The policy the evaluation samples: the rollout policy (what explore and regenerate sample), "
        "the EMA of the policy (train.ema_decay), or the policy itself.",
    )
    seed: int = Field(42, ge=0, description="Run seed; every candidate seed derives from it.")
    stage_retries: int = Field(1, ge=0, description="Prefect retries of a failed stage task.")
    shards: int = Field(
        1,
        ge=1,
        description="Prompt shards of the generating and scoring stages (explore, score_explore, regenerate, "
        "score_regenerate, audit, evaluate): each shard is its own task and committed folder, then one reduce "
        "writes the stage (at most one shard per prompt). Layout only: results and cache keys do not depend on it, "
        "so `solrl resume --shards N` may change it.",
    )
    on_guard: Literal["warn", "stop"] = Field(
        "warn",
        description="A reward-hacking or proxy-fidelity alarm (diversity, grid energy, temporal change of videos, "
        "proxy fidelity): warn = log it "
        "and go on; stop = end the campaign at the checkpoint of the evaluation that completes guard_patience "
        "alarmed evaluations of one measure in a row (exit code 3, naming the measure and the last checkpoint "
        "before the alarm).",
    )
    guard_patience: int = Field(
        2, ge=1, description="on_guard=stop: evaluations in a row one measure must alarm at before the campaign stops."
    )
    guard_diversity: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Diversity alarm: an evaluation's sample diversity below this fraction of the starting policy's "
        "(DESIGN 5 saw about 30% less diversity in visibly blurrier samples at a high reward).",
    )
    guard_grid_factor: float = Field(
        3.0,
        gt=1,
        description="Grid alarm: grid-artifact energy (spectral power at the patch period) above this multiple of "
        "the starting policy's, and above guard_grid_min.",
    )
    guard_grid_min: float = Field(
        0.01,
        ge=0,
        description="Grid alarm: the energy below which it never fires (the default preset starts near 0.0005, so the "
        "multiple alone would fire early; its unregularised run ends near 0.01, visibly checkered).",
    )
    guard_temporal_factor: float = Field(
        1.5,
        gt=1,
        description="Temporal alarm (video families): the evaluation's frame-to-frame change (mean absolute pixel "
        "difference of consecutive frames) above this multiple of the starting policy's: per-frame rewards gamed "
        "with flicker.",
    )
    task_runner: Literal["local", "dask", "ray"] = Field(
        "local",
        description="Where shard tasks run: local = in order, in the campaign's process; dask or ray = at once, on "
        "that engine's cluster (campaign.task_runner_address, or a local one with a worker process per shard). "
        "Layout only.",
    )
    task_runner_address: str | None = Field(
        None,
        description="An existing cluster for task_runner dask (scheduler, e.g. tcp://10.0.0.5:8786) or ray (e.g. "
        "ray://10.0.0.5:10001 or auto); null = a local cluster started for the campaign.",
    )


class RunConfig(_Section):
    """A whole run. ``base_dir`` is where relative prompt files resolve (the preset's folder)."""

    name: str = Field(
        default_factory=lambda: _preset_default(None, "name"),
        description="The preset's name (the default prefix of run ids).",
    )
    base_dir: str = Field("", description="Set by the loader: folder of the preset, for relative paths.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    explore: ExploreConfig = Field(default_factory=ExploreConfig)
    select: SelectConfig = Field(default_factory=SelectConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    fidelity: FidelityConfig = Field(default_factory=FidelityConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    campaign: CampaignConfig = Field(default_factory=CampaignConfig)

    def warnings(self) -> list[str]:
        """Settings that are valid but that a user should know about before a long run (pure)."""
        from solrl.registry import EXPLORE_BACKENDS, LOSSES

        found = []
        low_precision = EXPLORE_BACKENDS.declared(self.explore.precision, "low_precision", True)
        if not self.regenerate.enabled and low_precision:
            found.append(
                f"regenerate.enabled=false with explore.precision={self.explore.precision}: the policy trains on "
                f"the quantized explore samples (the naive-FP4 ablation), so its update is off-policy"
                + LOSSES.declared(self.train.loss, "off_policy_note", "")
                + ". Sol-RL regenerates the kept seeds in BF16 (regenerate.enabled=true)."
            )
        if not self.regenerate.enabled and self.fidelity.min_spearman is not None:
            found.append(
                f"fidelity.min_spearman={self.fidelity.min_spearman} with regenerate.enabled=false: nothing is "
                "regenerated in BF16, so proxy fidelity is not measured and neither the bound nor "
                f"fidelity.on_low={self.fidelity.on_low} ever acts"
            )
        return found

    @model_validator(mode="before")
    @classmethod
    def _loss_options(cls, data: Any, info: ValidationInfo) -> Any:
        """``train.loss_options`` resolved by the loss: validated by its ``Options`` and stored with every option,
        so a config naming none and one naming the defaults are one config, with one hash. A config written before
        ``train.loss_options`` (a stored run, an old YAML) has its loss options moved there first
        (``migrate_train``). Without plug-ins (a stored run read for a report) they are only moved."""
        if not (isinstance(data, dict) and isinstance(data.get("train"), dict)):
            return data
        train = migrate_train(data["train"])
        from solrl.registry import LOSSES

        name = train.get("loss", _preset_default("train", "loss"))
        plugins = not (info.context and info.context.get("plugins") is False)
        if plugins and isinstance(name, str) and name in LOSSES and isinstance(train.get("loss_options", {}), dict):
            Options = LOSSES.get(name).Options
            given = loss_option_values(train.get("loss_options") or {}, set(Options.model_fields))
            try:
                train = {**train, "loss_options": Options.model_validate(given).model_dump(mode="json")}
            except ValidationError as exc:
                raise ValueError(_describe_errors(exc, "train.loss_options.", Options)) from None
        return {**data, "train": train}

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> RunConfig:
        if not all(0 <= b < 1 for b in self.train.betas):
            raise ValueError(
                f"train.betas={list(self.train.betas)} must both be in [0, 1); AdamW's default is [0.9, 0.999]"
            )
        if self.train.stat_min_count > self.train.stat_buffer:
            raise ValueError(
                f"train.stat_min_count={self.train.stat_min_count} exceeds train.stat_buffer="
                f"{self.train.stat_buffer}, so the per-prompt statistics would never be used; set "
                f"train.stat_min_count <= {self.train.stat_buffer}"
            )
        tc = self.train
        if tc.launcher == "torchrun" and tc.workers != 1:
            raise ValueError(
                f"train.workers={tc.workers} counts Ray Train workers (train.launcher=ray); torchrun starts "
                f"train.nproc_per_node processes: set train.launcher=ray or train.nproc_per_node={tc.workers}"
            )
        if tc.launcher == "ray" and tc.nproc_per_node != 1:
            raise ValueError(
                f"train.nproc_per_node={tc.nproc_per_node} counts torchrun processes; Ray Train starts train.workers "
                f"workers: set train.workers={tc.nproc_per_node} (and train.nproc_per_node=1)"
            )
        k, pool = self.select.k, self.explore.pool_size
        if k % 2 and self.select.strategy == "best_worst":
            raise ValueError(f"select.k={k} must be even for best_worst (k/2 best + k/2 worst); set select.k={k + 1}")
        if k > pool:
            raise ValueError(
                f"select.k={k} exceeds explore.pool_size={pool}; set select.k <= {pool} or raise pool_size"
            )
        window = self.regenerate.sde_window
        if window is not None and not 0 <= window[0] < window[1] <= self.regenerate.steps - 1:
            raise ValueError(
                f"regenerate.sde_window={list(window)} must satisfy 0 <= start < end <= "
                f"regenerate.steps - 1 = {self.regenerate.steps - 1} (the last step is ODE)"
            )
        if not self.reward.weights:
            raise ValueError("reward.weights is empty; give at least one registered reward and its weight")
        # Plug-in names, then each plug-in's own rules (pure: nothing here looks at the machine). A stored run is
        # read without them (context plugins=False): its plug-ins may not be installed where it is reported.
        if info.context and info.context.get("plugins") is False:
            return self
        # Not where a stored run is read (above): a run made before this rule still lists and reports.
        if not any(self.reward.weights.values()):  # every advantage 0: the policy never moves
            raise ValueError(
                f"reward.weights={dict(self.reward.weights)} are all 0, so every advantage is 0 and the policy "
                "never changes; give a reward a non-zero weight (a reward only to watch goes in reward.evaluate)"
            )
        from solrl.registry import EXPLORE_BACKENDS, LOSSES, REWARDS

        registered_family(self.model.family).for_source(self.model.source).validate_config(self)
        _registered(EXPLORE_BACKENDS, self.explore.precision, "explore.precision").validate_config(self)
        loss = _registered(LOSSES, self.train.loss, "train.loss")
        if missing := getattr(loss, "missing", list)():
            raise ValueError(
                f"train.loss={self.train.loss}: {loss.__module__}.{loss.__qualname__} does not define "
                f"{' or '.join(missing)}, which every loss defines (solrl.stages.losses.PolicyLoss; the extending "
                "guide's loss page)"
            )
        loss.validate_config(self)
        rewards = self.reward
        for name in rewards.weights:
            _registered(REWARDS, rewards.type_of(name), "reward.weights")
        for name in rewards.evaluate:
            _registered(REWARDS, rewards.type_of(name), "reward.evaluate")
        for name in sorted({*rewards.weights, *rewards.evaluate, *rewards.models}):
            where = f"reward.models.{name}.type" if REWARD_TYPE in rewards.models.get(name, {}) else "reward.models"
            if rewards.type_of(name) != name and name in REWARDS:
                raise ValueError(
                    f"reward.models.{name}: {name!r} is a registered reward, so it cannot name an instance of "
                    f"{rewards.type_of(name)!r} (its scores would be reported as {name}); name the instance otherwise"
                )
            reward = _registered(REWARDS, rewards.type_of(name), where)
            try:
                reward.options_for(rewards.options_of(name))
            except ValidationError as exc:
                message = _describe_errors(exc, f"reward.models.{name}.", reward.Options)
                if getattr(reward, "published", None) and any(e["type"] == "missing" for e in exc.errors()):
                    message += f"; published weights: {reward.published}"
                raise ValueError(message) from None
        return self

    # -- derived values (never mutated: computed from the config) --------------
    def resolve(self, path: str) -> Path:
        """A config path made absolute: relative paths resolve against the preset's folder, then against the
        presets shipped with solrl (so a user YAML can name a shipped ``prompts/`` file)."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        local = Path(self.base_dir) / p
        shipped = preset_dir() / p
        return shipped if not local.exists() and shipped.exists() else local

    def sde_noise_level(self) -> float:
        """The SDE noise level rollouts sample with, as the loss asks (``PolicyLoss.noise_level``):
        ``regenerate.noise_level`` for a loss on SDE log-probs, 0 (the ODE) for one that is solver-agnostic."""
        from solrl.registry import LOSSES

        return LOSSES.get(self.train.loss).noise_level(self)

    def prompt_sets(self) -> tuple[PromptSet, PromptSet]:
        """(training, evaluation) prompt sets: the two files, or the fixed split of ``prompts_file``.

        Raises:
            ConfigError: a prompt file is missing, unreadable, malformed or empty, or the split leaves a side empty.
        """
        train = self._read_prompts("campaign.prompts_file", self.campaign.prompts_file)
        try:
            if self.campaign.eval_prompts_file is None:
                return split(train, self.campaign.eval_fraction, "campaign.prompts_file")
        except PromptFileError as exc:
            raise ConfigError(str(exc)) from None
        return train, self._read_prompts("campaign.eval_prompts_file", self.campaign.eval_prompts_file)

    def _read_prompts(self, field: str, given: str) -> PromptSet:
        """The prompt file ``given`` of ``field``, read; a missing one named with every place it was looked for.

        Raises:
            ConfigError: the file is missing, unreadable, malformed or empty.
        """
        path = self.resolve(given)
        try:
            return read_prompt_set(path, field)
        except PromptFileError as exc:
            if path.exists() or Path(given).expanduser().is_absolute():
                raise ConfigError(str(exc)) from None
            places = " or ".join(map(str, dict.fromkeys([Path(self.base_dir) / given, preset_dir() / given])))
            raise ConfigError(
                f"{field}: no prompt file {given!r}: looked for beside the preset and among solrl's shipped ones "
                f"({places}); a path given with --set is first looked for in the current folder "
                f"({Path.cwd() / given})"
            ) from None

    def prompt_warnings(self) -> list[str]:
        """What a user should know of the prompt files before a long run (they are read; [] where they cannot be:
        ``prompt_sets`` says why)."""
        try:
            train = self.prompt_sets()[0].prompts
        except ConfigError:
            return []
        count = self.campaign.prompts_per_iteration
        if count <= len(train):
            return []
        return [
            f"campaign.prompts_per_iteration={count} but the training prompts number {len(train)}: each iteration "
            f"draws its {count} with replacement, so some come twice and some not at all; give more prompts or set "
            f"campaign.prompts_per_iteration <= {len(train)}"
        ]

    def train_prompts(self) -> list[str]:
        return self.prompt_sets()[0].prompts

    def eval_prompts(self) -> list[str]:
        return self.prompt_sets()[1].prompts

    def digest(self) -> str:
        """sha256 of the canonical JSON of the config (``base_dir`` excluded): the config hash."""
        return config_digest(self.model_dump(mode="json"))

    def prompts_digest(self) -> str:
        """sha256 of the training and evaluation prompt lists the prompt files hold now (a run records it, so
        files edited after the run started are caught before a resume mixes old and new prompts)."""
        train, evaluation = self.prompt_sets()
        payload: dict[str, Any] = {"train": train.prompts, "eval": evaluation.prompts}
        if train.has_metadata() or evaluation.has_metadata():  # plain-text sets keep their earlier digest
            payload |= {"train_metadata": train.metadata, "eval_metadata": evaluation.metadata}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _registered(registry: Any, name: str, field: str) -> Any:
    """The plug-in ``name`` of ``registry``; ConfigError naming the field and the registered names, then the
    nearest name (a typo), if any, and where a plug-in is looked for (a run made with a plug-in, resumed where it
    is not importable: a near built-in name alone sent such a user to the wrong plug-in)."""
    if name not in registry:
        names = registry.names()
        near = difflib.get_close_matches(name, names, n=1)
        where = (
            f"a plug-in {registry.kind} is imported from SOLRL_PLUGINS or an installed package's solrl.plugins "
            "entry point"
        )
        hint = f"did you mean {near[0]!r}? If not, {where}" if near else where
        raise ConfigError(f"{field}: unknown {registry.kind} {name!r}; registered: {', '.join(names)}; {hint}")
    entry = registry.get(name)
    declared = getattr(entry, "name", name)
    if isinstance(declared, str) and declared != name:  # the tables use the registered name, messages this one
        raise ConfigError(
            f"{field}: {registry.kind} {name!r} is registered as {name!r} but its class says name = {declared!r}; "
            "give both the same name"
        )
    return entry


#: Config fields that lay the work out without changing what is computed: not part of the config hash, so a run
#: may be resumed with other values (``campaign.shards``; bit for bit where its shards hold whole batches,
#: ``solrl.stages.pipeline.shard_warnings``).
LAYOUT_FIELDS = (
    ("campaign", "shards"),
    ("explore", "keep_copy"),
    ("campaign", "task_runner"),
    ("campaign", "task_runner_address"),
    ("train", "nproc_per_node"),
    ("train", "launcher"),
    ("train", "workers"),
    ("train", "parallel"),
    ("train", "gradient_checkpointing"),
    ("tracking", "report_every"),
    ("tracking", "report"),
    ("storage", "pool"),
    ("storage", "keep_pools"),
)


#: Fields added after runs were recorded, with the value that reproduces those runs: at that value a field is left
#: out of the config hash, so a config that does not use it keeps the hash it had before the field existed.
UNHASHED_DEFAULTS = {("model", "source"): "weights"}


def without_unhashed(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` of config section ``section`` less each of ``UNHASHED_DEFAULTS`` at its value: what any digest of
    the section hashes (the config hash, the prompt-embedding cache's name), so it is the one taken before such a
    field existed."""
    drop = {key for (name, key), value in UNHASHED_DEFAULTS.items() if name == section and values.get(key) == value}
    return {k: v for k, v in values.items() if k not in drop}


def registered_family(family: str) -> Any:
    """The adapter class registered as ``model.family`` ``family``. A name no plug-in registers is refused, naming the
    registered ones; a preset's name (as the tiny twins were named before ``model.source``) is answered with the
    preset's model.

    Raises:
        ConfigError: ``family`` is not registered.
    """
    from solrl.registry import MODELS

    if family not in MODELS and family in list_presets():
        model = load_config(family, plugins=False).model
        raise ConfigError(
            f"model.family: {family!r} is a preset, not a family; its model is model.family={model.family} "
            f"model.source={model.source}"
        )
    return _registered(MODELS, family, "model.family")


def config_digest(data: dict[str, Any]) -> str:
    """sha256 of a config mapping's canonical JSON, ``base_dir`` and ``LAYOUT_FIELDS`` excluded, and each of
    ``UNHASHED_DEFAULTS`` at its value (``RunConfig.digest`` of a dump)."""
    payload = {k: v for k, v in data.items() if k != "base_dir"}
    for section, key in LAYOUT_FIELDS:
        if isinstance(payload.get(section), dict):
            payload[section] = {k: v for k, v in payload[section].items() if k != key}
    for section in {section for section, _ in UNHASHED_DEFAULTS}:
        if isinstance(payload.get(section), dict):
            payload[section] = without_unhashed(section, payload[section])
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def preset_dir() -> Path:
    """The folder of the presets shipped with solrl (``configs/``)."""
    return Path(str(resources.files("solrl.configs")))


@functools.cache
def _default_preset() -> dict[str, Any]:
    """The default preset (``configs.DEFAULT``) as read, the presets it extends merged in."""
    return _read_preset(_preset_path(DEFAULT_PRESET))


def _preset_default(section: str | None, key: str) -> Any:
    """A schema default that names a plug-in or shipped data: the default preset's value of ``section.key`` (a
    top-level key with ``section`` None), a copy.

    Raises:
        ConfigError: the default preset does not set it (a preset shipped broken).
    """
    data = _default_preset()
    try:
        return copy.deepcopy(data[section][key] if section else data[key])
    except (KeyError, TypeError):
        where = f"{section}.{key}" if section else key
        raise ConfigError(f"the default preset {DEFAULT_PRESET!r} does not set {where}") from None


def list_presets() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set explore.pool_size=64")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:  # PyYAML's message spans lines; its problem and column fit in one
        mark = getattr(exc, "problem_mark", None)
        where = f" at character {mark.column + 1}" if mark is not None and mark.line == 0 else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"--set {item!r}: value {raw!r} is not valid YAML ({problem}{where}); a string YAML cannot read goes "
            f"in double quotes: --set {shlex.quote(f'{key.strip()}={json.dumps(raw)}')}"
        ) from exc
    return path, value


def _apply_override(data: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    node = data
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node = nxt
    node[path[-1]] = value


def _known_keys(loc: tuple, root: type[BaseModel]) -> list[str]:
    """The field names of the config section at ``loc`` of ``root`` (() = the top level)."""
    model: type[BaseModel] = root
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    names = [name for name in model.model_fields if name != "base_dir"]
    if not loc and root is RunConfig:  # a preset file's own key, resolved before validation
        names.append(f"{EXTENDS} (a preset file's base)")
    return names


def _describe_errors(exc: ValidationError, prefix: str = "", root: type[BaseModel] | None = None) -> str:
    """pydantic's errors as ``section.key: what is wrong`` parts joined by ``; `` (keys under ``prefix``,
    known keys looked up from ``root``, default RunConfig)."""
    parts = []
    for err in exc.errors():
        loc = prefix + ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key; known keys here: {', '.join(_known_keys(err['loc'][:-1], root or RunConfig))}"
        elif err["type"] == "missing" and (description := _field_description(err["loc"], root or RunConfig)):
            msg = f"{msg} ({description.rstrip('.')})"
        elif "input" in err and err["type"] not in ("value_error",) and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _field_description(loc: tuple[Any, ...], root: type[BaseModel]) -> str | None:
    """The description of the field at ``loc`` under ``root`` (None where there is none or ``loc`` leaves the
    models)."""
    model: Any = root
    field = None
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = field.annotation
    return field.description if field is not None else None


def _format_validation_error(exc: ValidationError) -> str:
    return "invalid config: " + _describe_errors(exc)


#: The key of a preset naming the preset it extends (``extends: sana-1600m``): resolved when the preset is read,
#: never part of a config (a run stores the resolved config).
EXTENDS = "extends"


def _preset_path(source: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file of ``source``: an existing path (relative to ``relative_to`` when given), else a preset name
    shipped in ``configs/``.

    Raises:
        ConfigError: neither exists.
    """
    path = Path(source)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    preset = preset_dir() / f"{source}.yaml"
    if not path.exists() and (not path.suffix or preset.exists()):  # a preset name may hold a dot: wan21-t2v-1.3b
        path = preset
        if not path.exists():
            presets = list_presets()
            near = difflib.get_close_matches(str(source), presets, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"no preset or file named {str(source)!r}; {hint}presets: {', '.join(presets)}")
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, so
    ``explore: {pool_size: 8}`` with a second ``pool_size: 16`` ran with 16 and said nothing)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged below, its keys overridable
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _ExtendsError(ConfigError):
    """A preset's ``extends`` cannot be resolved; the message names the extending file."""


def _read_preset(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping a preset file describes, with the presets it ``extends`` merged under it.

    A preset inherits every section of the preset it extends key by key; a key it sets replaces the inherited
    value whole (``reward.weights: {a: 1.0}`` is the whole weights mapping, not one more entry). ``extends``
    names a shipped preset or a YAML path relative to the extending file.

    Raises:
        ConfigError: unreadable or malformed YAML, not a mapping, a missing base, or a cycle of ``extends``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config {str(path)!r} ({exc.__class__.__name__}: {exc})") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        problem = f": {exc.problem}" if getattr(exc, "problem", None) else ""
        raise ConfigError(f"config {str(path)!r} is not valid YAML{where}{problem}") from exc
    if data is None:  # empty, or only comments: a file cut short or the wrong one, not a wish for the defaults
        raise ConfigError(
            f"config {str(path)!r} is empty; a config sets sections (explore:, train:, ...), usually below "
            f"`{EXTENDS}: <preset>`, and with no config solrl runs the default preset {DEFAULT_PRESET!r}"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config {str(path)!r} must be a mapping of sections, got {type(data).__name__}")
    base = data.pop(EXTENDS, None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise _ExtendsError(f"config {str(path)!r}: extends must name a preset or a YAML path, got {base!r}")
    try:
        base_path = _preset_path(Path(base).expanduser(), relative_to=path.resolve().parent)
        here, there = path.resolve(), base_path.resolve()
    except (ConfigError, OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise _ExtendsError(f"config {str(path)!r} extends {base!r}: {exc}") from None
    chain = (*chain, here)
    if there in chain:
        cycle = " -> ".join(os.path.relpath(p, chain[0].parent) for p in (*chain, there))
        raise _ExtendsError(f"config {str(path)!r}: extends makes a cycle ({cycle}); remove one of the extends")
    try:
        merged = _read_preset(base_path, chain)
    except _ExtendsError:  # said by a preset further down the chain, which it names
        raise
    except ConfigError as exc:  # the base itself cannot be read: named with the preset that extends it
        raise _ExtendsError(f"config {str(path)!r} extends {base!r}: {exc}") from None
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}  # a section: its keys one by one
        else:
            merged[key] = value
    return merged


def load_config(
    source: str | Path | None = None, overrides: list[str] | None = None, *, plugins: bool = True
) -> RunConfig:
    """Load a preset (a name from ``configs/`` or a YAML path, with the presets it ``extends``), apply ``--set``
    overrides, validate.

    Args:
        source: preset name (``sol-rl``), a YAML file path, or None for the default preset (``configs.DEFAULT``).
        overrides: ``section.key=value`` strings; values are parsed as YAML.
        plugins: False checks the schema only, not the plug-in names and rules (``validate_config``): no
            plug-in package, hence no torch, is imported.

    Raises:
        ConfigError: missing/malformed file, unknown key, bad value, a cross-field rule broken, a missing preset to
            extend or a cycle of them; one line naming the problem and the fix.
    """
    path = _preset_path(source or DEFAULT_PRESET)
    data = _read_preset(path)
    for item in overrides or []:
        keys, value = _parse_override(item)
        if keys[0] == EXTENDS:
            raise ConfigError(
                f"--set {item!r}: {EXTENDS} is a preset file's key, read before any --set; name the preset to start "
                f"from instead (solrl run {value} --set ...)"
            )
        if keys in (["campaign", "prompts_file"], ["campaign", "eval_prompts_file"]) and isinstance(value, str):
            # A file named on the command line is first the one it names from here (then the preset's, shipped).
            here = Path(value).expanduser()
            if not here.is_absolute() and here.exists():
                value = str(here.resolve())
        _apply_override(data, keys, value, item)
    data["base_dir"] = str(path.resolve().parent)
    try:
        cfg = validate_config(data, plugins=plugins)
    except ConfigError as exc:
        _say_how_to_quote_on_a_command_line(exc, overrides or [])
        raise
    if plugins:  # a new run's config (a stored one is read from run.json, never through here)
        refuse_ignored_settings(cfg)
    return cfg


def _say_how_to_quote_on_a_command_line(exc: ConfigError, overrides: list[str]) -> None:
    """A name YAML read as a boolean from ``--set key=off`` is quoted once for YAML and once for the shell, which
    drops a single layer (``--set key="off"`` reaches solrl as ``key=off``): raise ``exc`` saying so.

    Raises:
        ConfigError: ``exc`` with the command-line spelling, when such an override caused it.
    """
    for item in overrides:
        keys, value = _parse_override(item)
        key = ".".join(keys)
        if isinstance(value, bool) and f"{key}: expected a name" in str(exc):
            word = item.split("=", 1)[1].strip()
            if len(keys) == 2 and keys[0] in RunConfig.model_fields:  # a name of a known set: only one of them
                section = RunConfig.model_fields[keys[0]].annotation
                field = getattr(section, "model_fields", {}).get(keys[1])
                if field is not None:
                    names = _literal_choices(field.annotation) or _registered_names(section.__name__, keys[1])
                    if names and word not in names:
                        return
            raise ConfigError(
                f"{exc}; the shell drops one layer of quotes, so on a command line write --set \"{key}='{word}'\""
            ) from exc


def refuse_ignored_settings(cfg: RunConfig) -> None:
    """Refuse, for a new run, a setting its family or loss would ignore (it would change the config hash and
    nothing else): the family's ``ignored_settings``, and ``regenerate.sde_window`` with a loss that samples with the
    ODE. Not applied to a stored run, which resumes with the config it began with.

    Raises:
        ConfigError: the first such setting, naming it and the fix.
    """
    from solrl.registry import LOSSES

    found = registered_family(cfg.model.family).for_source(cfg.model.source).ignored_settings(cfg)
    window = cfg.regenerate.sde_window
    if window is not None and LOSSES.get(cfg.train.loss).noise_level(cfg) == 0:
        found.append(
            f"regenerate.sde_window={list(window)}: train.loss={cfg.train.loss} samples with the ODE (no SDE "
            "log-probs), so the window would change nothing; remove it (it applies to a loss on SDE log-probs)"
        )
    if found:
        raise ConfigError(f"invalid config: {found[0]}")


def changed_by(cfg: RunConfig, overrides: list[str]) -> list[str]:
    """The ``section.key=value`` overrides that would change ``cfg``, each applied alone (``storage.root`` compared
    as a resolved path): what a continued run, which keeps its stored config, really ignores.

    Raises:
        ConfigError: a malformed override, or one that makes the config invalid.
    """
    current = cfg.model_dump(mode="json")
    changed = []
    for item in overrides:
        keys, value = _parse_override(item)
        data = copy.deepcopy(current)
        _apply_override(data, keys, value, item)
        if keys == ["storage", "root"]:
            same = Path(str(value)).expanduser().resolve() == Path(cfg.storage.root).expanduser().resolve()
        else:
            same = validate_config(data, plugins=False).model_dump(mode="json") == current
        if not same:
            changed.append(item)
    return changed


def validate_config(data: dict[str, Any], *, plugins: bool = True) -> RunConfig:
    """Validate a config mapping (e.g. ``run.json``'s) into a RunConfig; ConfigError on failure.

    ``plugins=False`` checks the schema only, not the plug-in names and rules: for reading a stored run on a
    machine that lacks some of its plug-ins (``ls``, ``report``); ``check_runnable`` checks them before work.
    """
    if plugins:  # a broken plug-in module is its own error, not the config's
        from solrl.registry import load_plugins

        load_plugins()
    try:
        cfg = RunConfig.model_validate(data, context={"plugins": plugins})
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    return cfg
