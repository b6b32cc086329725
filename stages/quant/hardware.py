"""Hardware explore backends: Transformer Engine NVFP4 (Blackwell) and FP8 (Ada / Hopper / Blackwell).

Thin on purpose: the layers chosen are exactly those the emulated backends quantize
(:func:`eligible_layers`, the Sol-RL skip rule); each becomes a ``transformer_engine.pytorch.Linear``
with the same weights, and the whole network runs under TE's autocast with the
``NVFP4BlockScaling`` recipe (true 16-element NVFP4, E4M3 block scales, FP32 tensor scale; not the
per-tensor ``DelayedScaling`` of the Sol-RL release) or ``Float8CurrentScaling(E4M3)``.

Not verified on hardware yet: no CI machine has a GPU (see README, "What is verified where").
``solrl.stages.quant.availability.check_precision`` refuses these precisions at config load where they cannot run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .nvfp4 import eligible_layers


class _Conv1x1AsLinear(nn.Module):
    """A 1x1 conv as a Linear over channels: ``[B, C, H, W]`` -> channels-last -> Linear -> back."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.movedim(1, -1)).movedim(-1, 1)


class _UnderAutocast(nn.Module):
    """Runs ``net`` under Transformer Engine's quantized autocast with ``recipe``."""

    def __init__(self, net: nn.Module, recipe: Any) -> None:
        super().__init__()
        self.net, self.recipe = net, recipe

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import transformer_engine.pytorch as te

        if hasattr(te, "autocast"):  # TE >= 2.8
            ctx = te.autocast(enabled=True, recipe=self.recipe)
        else:  # pragma: no cover - older TE
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)
        with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
            return self.net(*args, **kwargs)


def te_explore_copy(net: nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> nn.Module:
    """Turn ``net`` (a merged, plain copy of the rollout transformer) into a TE-quantized explore copy.

    Args:
        net: modified in place (eligible layers replaced); moved to CUDA in bfloat16.
        precision: ``nvfp4`` or ``fp8``.

    Returns:
        a module with ``net``'s call signature that runs under TE autocast.

    Raises:
        ImportError: Transformer Engine is missing (``pip install 'solrl[gpu]'``). ValueError: bad precision.
    """
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    if precision == "nvfp4":
        chosen = recipe.NVFP4BlockScaling()
    elif precision == "fp8":
        chosen = recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3)
    else:
        raise ValueError(f"hardware precision must be nvfp4 or fp8, got {precision!r}")
    net = net.to("cuda", torch.bfloat16)
    for name, module in eligible_layers(net, fmt="nvfp4", skip=skip, min_dim=min_dim):
        weight = module.weight.detach()
        out_f, in_f = weight.shape[0], weight.shape[1]
        linear = te.Linear(in_f, out_f, bias=module.bias is not None, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            linear.weight.copy_(weight.reshape(out_f, in_f))
            if module.bias is not None:
                linear.bias.copy_(module.bias.detach())
        replacement = _Conv1x1AsLinear(linear) if isinstance(module, nn.Conv2d) else linear
        parent_name, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent_name) if parent_name else net, child, replacement)
    return _UnderAutocast(net.eval().requires_grad_(False), chosen)
