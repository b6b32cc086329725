"""Stage 7, checkpoint: the self-describing snapshot the next iteration (and ``solrl resume``) starts from."""

from __future__ import annotations

import json
from pathlib import Path

from solrl import __version__
from solrl.stages.context import StageContext
from solrl.stages.models.adapter import TINY_DIGITS_WEIGHTS
from solrl.stages.update import TRAINED
from solrl.storage.checkpoints import load_checkpoint, save_checkpoint
from solrl.storage.stage import StageOutput, require


def checkpoint(ctx: StageContext, out: Path) -> StageOutput:
    """Write ``policy``, ``rollout``, ``ema``, ``optimizer``, ``rng`` safetensors and ``state.json``
    (iteration, global step, optimizer groups, config hash, model family and architecture, solrl version)."""
    update_dir, _ = require(ctx.run_dir, ctx.iteration, "update")
    sections, state = load_checkpoint(update_dir / TRAINED)
    weights = Path(ctx.cfg.model.path).expanduser() if ctx.cfg.model.path else TINY_DIGITS_WEIGHTS
    architecture = json.loads((weights / "transformer" / "config.json").read_text(encoding="utf-8"))
    state = {**state, "iteration": ctx.iteration, "run_id": ctx.run_id, "config_hash": ctx.config_key,
             "model_family": ctx.cfg.model.family, "model_path": ctx.cfg.model.path,
             "lora": {"rank": ctx.cfg.model.lora_rank, "alpha": ctx.cfg.model.lora_alpha},
             "architecture": architecture, "solrl_version": __version__}
    save_checkpoint(out, sections, state)
    return StageOutput(info={"global_step": state["global_step"]})
