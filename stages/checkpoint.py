"""Stage 7, checkpoint: the self-describing snapshot the next iteration (and ``solrl resume``) starts from."""

from __future__ import annotations

from pathlib import Path

from solrl import __version__
from solrl.stages.context import StageContext
from solrl.stages.models import model_family
from solrl.stages.models.lora import save_diffusers_lora
from solrl.storage.artifacts import Checkpoint, TrainedState
from solrl.storage.stage import StageOutput

#: Sub-folder of the checkpoint holding the policy LoRA in diffusers' format.
LORA_FOLDER = "lora"


def checkpoint(ctx: StageContext, out: Path, trained: TrainedState) -> StageOutput:
    """Write ``policy``, ``rollout``, ``ema``, ``optimizer``, ``rng`` safetensors and ``state.json``
    (iteration, global step, optimizer groups, config hash, model family and source, its architecture as the family's
    adapter describes it, solrl version), and the policy LoRA in diffusers' format in ``lora/``
    (``pytorch_lora_weights.safetensors``: a stock pipeline's ``load_lora_weights`` loads it)."""
    state = {
        **trained.state,
        "iteration": ctx.iteration,
        "run_id": ctx.run_id,
        "config_hash": ctx.config_key,
        "model_family": ctx.cfg.model.family,
        "model_source": ctx.cfg.model.source,
        "model_path": ctx.cfg.model.path,
        "lora": {"rank": ctx.cfg.model.lora_rank, "alpha": ctx.cfg.model.lora_alpha},
        "architecture": model_family(ctx.cfg.model).architecture(ctx.cfg.model),
        "solrl_version": __version__,
    }
    Checkpoint(trained.sections, state).write(out)
    family = model_family(ctx.cfg.model)
    save_diffusers_lora(ctx.load_policy(trained), "policy", family.pipeline_class, out / LORA_FOLDER)
    return StageOutput(info={"global_step": state["global_step"]})
