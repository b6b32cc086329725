"""Checkpoints: named tensor sections as safetensors, plus ``state.json``.

Sections (torchtitan/nanoGPT style, self-describing): ``policy``, ``rollout``,
``ema`` (LoRA adapters), ``optimizer`` (AdamW moments, flattened) and ``rng``
(generator states), each ``<section>.safetensors``; ``state.json`` holds the
iteration, optimizer step, optimizer hyper-parameters, config hash and the
model architecture. No pickle anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE = "state.json"


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Flatten an optimizer state dict: tensors ``state.<param index>.<key>`` and JSON param groups.

    The state of sharded parameters (FSDP2's DTensors) is gathered whole (``full_tensor``), so the checkpoint is
    the one a single process writes; every process of the group must then call this together."""
    sd = optimizer.state_dict()
    tensors = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensors[f"state.{index}.{key}"] = torch.as_tensor(whole).detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], param_groups: list[dict[str, Any]]
) -> None:
    """Inverse of ``optimizer_to_tensors``; the optimizer must hold the same parameters in the same order. A
    sharded parameter's state (FSDP2's DTensor parameters) is cut to this process's shard of it, as the parameter
    is (every process holds the whole checkpoint, so nothing is sent)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        param = params[int(index)]
        if hasattr(param, "device_mesh") and value.shape == param.shape:  # the moments, not AdamW's scalar step
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def save_checkpoint(directory: Path, sections: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
    """Write each section to ``<section>.safetensors`` and ``state`` to ``state.json`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, tensors in sections.items():
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, directory / f"{name}.safetensors")
    (directory / STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_checkpoint(directory: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a checkpoint written by ``save_checkpoint``: (sections, state)."""
    state = json.loads((directory / STATE).read_text(encoding="utf-8"))
    sections = {p.stem: load_file(p) for p in sorted(directory.glob("*.safetensors"))}
    return sections, state
