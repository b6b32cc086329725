"""Can this machine run a config? Checked where work starts (``solrl run``, ``solrl resume``, the campaign
flow), never by the config schema, so any machine can list, inspect and report any run (DESIGN 3)."""

from __future__ import annotations

import importlib.util

import torch

from solrl.config import ConfigError, RunConfig, validate_config
from solrl.registry import EXPLORE_BACKENDS
from solrl.stages.cluster import check_ray_address
from solrl.stages.models import model_family, resolve_device
from solrl.stages.quant.availability import runnable_precisions
from solrl.stages.rewards.base import reward_class, reward_options
from solrl.storage.fingerprint import changed_files


def check_runnable(cfg: RunConfig, prompts_sha256: str | None = None, weights: dict[str, str] | None = None) -> None:
    """Check, before any work, that this machine can run ``cfg``.

    Checks: the model family's weights files; ``model.device`` (and a GPU per torchrun process); the task
    runner's Prefect integration, Ray Train for ``train.launcher=ray``, and that a Ray cluster's address
    answers; the explore backend on this hardware; the prompt files readable and scorable by every configured
    reward; with ``prompts_sha256`` (a run's recorded digest),
    that the prompt files still hold the prompts the run's committed stages used; with ``weights`` (a run's
    recorded fingerprint, ``storage.fingerprint``), that the weights folder still holds the same files.

    Raises:
        ConfigError: one line naming what is missing and the fix.
    """
    validate_config(cfg.model_dump(mode="json"))  # the plug-ins, which reading a stored run skips
    family = model_family(cfg.model)
    family.check_runnable(cfg.model)
    if weights:
        changed = changed_files(weights, family.weights_fingerprint(cfg.model) or {})
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise ConfigError(
                f"the model weights in {family.weights_dir(cfg.model)} changed since the run was created "
                f"({shown}), and its committed stages used the old weights; restore them or start a new run"
            )
    device = resolve_device(cfg.model.device)
    nproc = cfg.train.nproc_per_node
    if device.type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"train.nproc_per_node={nproc} needs a GPU per process; this machine has {torch.cuda.device_count()}"
        )
    runner = cfg.campaign.task_runner
    if runner != "local" and importlib.util.find_spec(f"prefect_{runner}") is None:
        raise ConfigError(f"campaign.task_runner={runner} needs prefect-{runner}: pip install 'solrl[distributed]'")
    if cfg.train.launcher == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("train.launcher=ray needs Ray Train: pip install 'solrl[distributed]'")
    check_ray_address(cfg)
    reason = EXPLORE_BACKENDS.get(cfg.explore.precision).unavailable_reason()
    if reason is not None:
        stored = (  # a stored run (its prompts' digest is recorded) keeps the precision it began with
            "; a run resumes with the precision it began with, so resume it where that runs (ls, inspect, show and "
            "report read it anywhere)"
            if prompts_sha256 is not None
            else ""
        )
        raise ConfigError(
            f"explore.precision={cfg.explore.precision} cannot run here: {reason}; this machine runs: "
            f"{', '.join(runnable_precisions())}{stored}"
        )
    train, evaluation = (prompt_set.prompts for prompt_set in cfg.prompt_sets())
    for name in sorted({*cfg.reward.weights, *cfg.reward.evaluate}):
        reward_class(name, cfg.reward.models).check_runnable(reward_options(name, cfg.reward.models), name)
    try:
        for name in cfg.reward.weights:
            reward_class(name, cfg.reward.models).check_prompts(train, "campaign.prompts_file")
        for name in {*cfg.reward.weights, *cfg.reward.evaluate}:
            reward_class(name, cfg.reward.models).check_prompts(evaluation, "campaign.eval_prompts_file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if prompts_sha256 is not None and cfg.prompts_digest() != prompts_sha256:
        files = f"campaign.prompts_file ({cfg.campaign.prompts_file})" + (
            f" or campaign.eval_prompts_file ({cfg.campaign.eval_prompts_file})"
            if cfg.campaign.eval_prompts_file is not None
            else ""
        )
        raise ConfigError(  # the run records one digest of both lists, so which file changed is not known
            f"the prompts changed since the run was created: {files} holds other prompts now, and the run's "
            "committed stages used the old ones; restore the file or start a new run"
        )


def check_ready(cfg: RunConfig, prompts_sha256: str | None = None, weights: dict[str, str] | None = None) -> str:
    """Everything checked before a run's work starts, in one place (``solrl run``, ``solrl resume``, the campaign
    flow): ``check_runnable``, then the memory plan against the device (``solrl.stages.memory.check_memory``, which
    ``$SOLRL_FORCE_MEMORY`` lets past).

    Returns:
        the memory plan's line for the log.

    Raises:
        ConfigError: as ``check_runnable``; ``MemoryPlanError`` (a ConfigError) where the plan does not fit.
    """
    from solrl.stages.memory import check_memory

    check_runnable(cfg, prompts_sha256, weights)
    return check_memory(cfg)
