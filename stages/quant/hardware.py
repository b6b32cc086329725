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

from .nvfp4 import layer_eligible

#: Rows (the product of all input dims but the last) a quantized Transformer Engine GEMM takes: TE asserts
#: ``rows % 8 == 0`` for FP8 (``transformer_engine/pytorch/utils.py``, ``assert_dim_for_fp8_exec``) and NVFP4's
#: fast path wants ``rows % 32 == 0``.
TE_ROW_MULTIPLE = {"fp8": 8, "nvfp4": 32}
#: ``(in_features, out_features)`` multiples a layer needs to become a TE Linear (K % 16 and N % 8 for FP8;
#: K and N % 32 for NVFP4's fast path and its reference GEMM).
TE_DIM_MULTIPLE = {"fp8": (16, 8), "nvfp4": (32, 32)}


def te_takes(in_features: int, out_features: int, precision: str) -> bool:
    """Whether a Linear of this shape can run quantized in Transformer Engine at ``precision`` (the one rule;
    a layer that cannot stays in bf16)."""
    k, n = TE_DIM_MULTIPLE[precision]
    return in_features % k == 0 and out_features % n == 0


class RowPadded(nn.Module):
    """``linear`` over inputs ``[..., K]`` flattened to ``[rows, K]`` and zero-padded to a multiple of ``multiple``
    rows; the output is sliced back to ``rows`` and reshaped to ``[..., N]``.

    Zero rows do not move an amax (per tensor or per row) and their outputs are dropped, so with per-call or
    per-row activation scales the result equals the unpadded call's (tested around the emulated quantizer). A
    Conv 1x1 (``[B, C, H, W]``) runs channels-last as a Linear over C."""

    def __init__(self, linear: nn.Module, multiple: int, conv: bool = False) -> None:
        super().__init__()
        self.linear, self.multiple, self.conv = linear, multiple, conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv:
            return self._rows(x.movedim(1, -1)).movedim(-1, 1)
        return self._rows(x)

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> RowPadded:
        """Write ``weight`` (``[out, in]`` or ``[out, in, 1, 1]``) into the wrapped layer in place: its own
        ``requantize_`` (``FakeQuantLinear``), else ``weight.copy_`` (a Transformer Engine quantized weight
        re-quantizes on copy). Returns ``self``."""
        target = self.linear
        if hasattr(target, "requantize_"):
            target.requantize_(weight)
        else:
            target.weight.copy_(weight.reshape(target.weight.shape))
        return self

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        n = rows.shape[0]
        pad = (-n) % self.multiple
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, k)])
        out = self.linear(rows)
        return out[:n].reshape(*lead, out.shape[-1])


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


def te_recipe(precision: str, recipe: Any = None) -> Any:
    """The Transformer Engine recipe of ``precision`` (TE >= 2.9; ``recipe`` the ``transformer_engine.common.recipe``
    module, imported when None).

    * ``nvfp4``: ``NVFP4BlockScaling`` with 1x16 weight blocks along K as in ``nvfp4_emulated`` and DESIGN 2
      (TE's default is 16x16 2-D weight blocks), no random Hadamard transform, no stochastic rounding: TE's own
      plain recipe (``tests/pytorch/test_sanity.py``); where TE has it (>= 2.16), ``row_scaled_activation=True``:
      one activation amax per row (token), so a sample does not depend on its batch mates (older TE scales
      activations per call; ``explore.activation_scale=call`` emulates that); and where TE has it (>= 2.20),
      ``nvfp4_4over6="none"``: every block maps its amax to E2M1's 6, never the adaptive map-to-4 choice.
    * ``fp8``: ``Float8CurrentScaling(E4M3)`` with the forward GEMM's split (FP32) accumulation (the recipe's
      default, ``use_split_accumulator=False``, is TE's fast accumulation), activations per call, and the exact
      scale ``amax / 448`` of ``fp8_emulated`` (``use_power_2_scales=False``).

    Every field that changes the numbers is passed, none left to its default: TE reads those defaults from
    ``NVTE_*`` environment variables when its recipe module is imported (``NVTE_NVFP4_DISABLE_RHT``,
    ``NVTE_NVFP4_4OVER6``, ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``, ...), so an environment set for
    training elsewhere would otherwise make the hardware copy differ from its emulation.

    Raises:
        ValueError: another precision. ImportError: no Transformer Engine.
    """
    if recipe is None:
        from transformer_engine.common import recipe

    if precision == "nvfp4":
        return recipe.NVFP4BlockScaling(
            disable_2d_quantization=True,
            disable_rht=True,
            disable_stochastic_rounding=True,
            **_where_te_has(recipe.NVFP4BlockScaling, row_scaled_activation=True, nvfp4_4over6="none"),
        )
    if precision == "fp8":
        return recipe.Float8CurrentScaling(
            fp8_format=recipe.Format.E4M3,
            fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=True),
            **_where_te_has(recipe.Float8CurrentScaling, use_power_2_scales=False),
        )
    raise ValueError(f"hardware precision must be nvfp4 or fp8, got {precision!r}")


def _where_te_has(recipe_class: type, **fields: Any) -> dict[str, Any]:
    """The ``fields`` that this Transformer Engine's ``recipe_class`` (a dataclass) has; later versions add some."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(recipe_class)}
    return {name: value for name, value in fields.items() if name in known}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def te_weight_bytes(in_features: int, out_features: int, precision: str) -> int:
    """Bytes of one weight ``[out, in]`` quantized by Transformer Engine for the forward only (row-wise usage:
    ``quantized_model_init`` under ``no_grad``). NVFP4: E2M1 data ``out * in / 2`` plus E4M3 block scales padded
    to ``[round_up(out, 128), round_up(in / 16, 4)]`` (``NVFP4Quantizer.get_scale_shape``) plus an FP32 amax;
    FP8: one byte a weight plus an FP32 ``scale_inv``."""
    if precision == "nvfp4":
        return out_features * in_features // 2 + _round_up(out_features, 128) * _round_up(in_features // 16, 4) + 4
    return out_features * in_features + 4


def te_copy_bytes(transformer: nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> int:
    """Bytes a :func:`te_explore_copy` of the peft ``transformer`` holds beyond the policy, counted from shapes
    (``te_weight_bytes`` and a bf16 bias per TE layer, a bf16 merged weight per LoRA layer TE cannot take).
    Transformer Engine's workspaces and its per-module metadata (a few scalars) are not counted."""
    from solrl.stages.models.policy import counted_copy_bytes

    def quantized_bytes(name: str, layer: nn.Module) -> int | None:
        dims = _te_dims(name, layer, skip, min_dim)
        if dims is None or not te_takes(*dims, precision):
            return None
        bias = getattr(layer, "bias", None)
        return te_weight_bytes(*dims, precision) + (0 if bias is None else bias.numel() * 2)

    return counted_copy_bytes(transformer, quantized_bytes)


def _te_dims(name: str, layer: nn.Module, skip: tuple[str, ...], min_dim: int) -> tuple[int, int] | None:
    """``(in, out)`` of a layer the explore skip rule quantizes, else None."""
    if not layer_eligible(name, layer, fmt="nvfp4", skip=skip, min_dim=min_dim):
        return None
    weight = layer.weight
    return weight.shape[1], weight.shape[0]


def te_explore_copy(transformer: nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> nn.Module:
    """A Transformer Engine explore copy of the peft ``transformer``'s ``rollout`` adapter (``merged_copy_of``).

    Each layer the skip rule quantizes and TE can take (``te_takes``) becomes a ``te.Linear`` built under
    ``torch.no_grad()`` and ``te.quantized_model_init(recipe=...)``: it holds only the quantized weight, row-wise
    (no bf16 weight, no transposed copy), into which the merged weight is written with ``copy_`` (TE quantizes
    on copy, so ``Policy.sync_merged_copy_`` refreshes the copy in place after each update); wrapped in
    :class:`RowPadded`. Everything else is shared with the policy or merged in bf16.

    Args:
        transformer: the policy's peft transformer, on CUDA in bfloat16 (not modified).
        precision: ``nvfp4`` or ``fp8``.

    Returns:
        a module with the transformer's call signature that runs under TE autocast with ``te_recipe``.

    Raises:
        ImportError: Transformer Engine is missing (``availability.TE_INSTALL``). ValueError: bad precision, or
        the transformer is not on CUDA.
    """
    import transformer_engine.pytorch as te

    from solrl.stages.models.policy import merged_copy_of

    chosen = te_recipe(precision)
    device = next(transformer.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"a Transformer Engine explore copy needs the policy on CUDA, it is on {device}")

    def te_layer(name: str, layer: nn.Module, weight: torch.Tensor) -> nn.Module | None:
        dims = _te_dims(name, layer, skip, min_dim)
        if dims is None or not te_takes(*dims, precision):
            return None
        in_f, out_f = dims
        with torch.no_grad(), te.quantized_model_init(enabled=True, recipe=chosen):
            linear = te.Linear(in_f, out_f, bias=layer.bias is not None, params_dtype=torch.bfloat16, device=device)
        padded = RowPadded(linear, TE_ROW_MULTIPLE[precision], conv=isinstance(layer, nn.Conv2d))
        padded.requantize_(weight)
        if layer.bias is not None:
            with torch.no_grad():
                linear.bias.copy_(layer.bias.detach())
        return padded

    net = merged_copy_of(transformer, "rollout", te_layer)
    for name, layer in list(net.named_modules()):  # the eligible layers LoRA does not target (TE's are skipped)
        replacement = te_layer(name, layer, layer.weight) if name else None
        if replacement is not None:
            parent_name, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent_name) if parent_name else net, child, replacement)
    return _UnderAutocast(net.eval().requires_grad_(False), chosen)
