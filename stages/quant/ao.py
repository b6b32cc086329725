"""torchao explore backends: torchao's own inference quantization of the explore copy's Linear layers.

* ``torchao_fp8`` (compute capability >= 8.9: Ada, Hopper, Blackwell):
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``, E4M3 weights with one scale per output row
  and activations with one scale per token (a sample does not depend on its batch mates).
* ``torchao_nvfp4`` (compute capability >= 10.0: Blackwell):
  ``NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=True)``, NVFP4 weights and activations
  (16-element E4M3 block scales and an FP32 tensor scale; the activations' per call).

Layers follow the Sol-RL skip rule as the other backends' do; torchao quantizes ``nn.Linear`` only, so a 1x1
conv (SANA's feed-forward) stays in bf16. The quantized weights are torchao tensor subclasses that
``torch.compile`` traces (no graph break by design, unlike Transformer Engine's modules). torchao refuses both on
CPU ("Float8 dynamic quantization requires CUDA compute capability >= 8.9"), and so does ``solrl run``. With those
checks lifted, ``tests/test_torchao.py`` runs both copies on CPU: FP8 on torch's CPU kernel for torchao's GEMM,
NVFP4 with its block-scaled GEMM computed by definition. The GPU kernels are ``bench/gpu_smoke.py``'s to check.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from .nvfp4 import NVFP4_BLOCK, layer_eligible

#: The torchao configs' import paths, by precision (``ao_config``).
AO_CONFIGS = {
    "torchao_fp8": "torchao.quantization.Float8DynamicActivationFloat8WeightConfig",
    "torchao_nvfp4": "torchao.prototype.mx_formats.NVFP4DynamicActivationNVFP4WeightConfig",
}


def ao_config(precision: str) -> Any:
    """torchao's inference config of ``precision`` (the table above).

    Raises:
        ValueError: another precision. ImportError: torchao lacks the config.
    """
    if precision == "torchao_fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        # set_inductor_config=False: torchao's default sets process-wide Inductor options (coordinate-descent
        # tuning among them) when it quantizes, which would change how the BF16 policy's regenerate and update
        # compile in this process, and not in a resumed one that never built the explore copy.
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if precision == "torchao_nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        # use_triton_kernel=False: torchao's default quantizes activations with MSLK's Triton kernel (torchao >= 0.17),
        # a package solrl does not install, which torchao asserts at the first quantize; torch's own
        # ``nvfp4_quantize`` is the reference solrl's emulation equals bit for bit, and Inductor fuses it when
        # explore.compile is set.
        return NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=True, use_triton_kernel=False)
    raise ValueError(f"torchao precision must be torchao_fp8 or torchao_nvfp4, got {precision!r}")


def ao_reason() -> str | None:
    """None when torchao's configs import, else why not."""
    try:
        ao_config("torchao_fp8")
        ao_config("torchao_nvfp4")
    except Exception as exc:  # an old torchao, or one whose C++ extension does not load
        return f"torchao's inference configs do not import ({exc.__class__.__name__}: {exc})"
    return None


def ao_dtype_error(precision: str, dtype: str) -> str:
    """The one-line refusal of ``precision`` for weights of ``dtype`` (torchao's per-row FP8 takes bf16 only)."""
    return (
        f"explore.precision={precision} quantizes bfloat16 weights only (torchao's per-row FP8), and the policy's "
        f"weights are {dtype}: set model.dtype=bfloat16 (auto is bfloat16 on CUDA) or explore.precision=fp8"
    )


def ao_takes(name: str, layer: nn.Module, skip: tuple[str, ...], min_dim: int) -> bool:
    """Whether torchao quantizes this layer: an ``nn.Linear`` the skip rule quantizes with ``in`` and ``out`` % 16
    (torchao's NVFP4 handler raises otherwise; ``torch._scaled_mm`` wants K and N % 16 for FP8)."""
    if not isinstance(layer, nn.Linear) or layer.in_features % 16 or layer.out_features % 16:
        return False
    return layer_eligible(name, layer, fmt="nvfp4", skip=skip, min_dim=min_dim)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def ao_weight_bytes(in_features: int, out_features: int, precision: str) -> int:
    """Bytes of one weight ``[out, in]`` quantized by torchao: FP8 one byte a weight plus an FP32 scale per row;
    NVFP4 E2M1 data ``out * in / 2``, E4M3 block scales in the swizzled layout torchao stores, padded to
    ``[round_up(out, 128), round_up(in / 16, 4)]``, and an FP32 tensor scale."""
    if precision == "torchao_fp8":
        return out_features * in_features + 4 * out_features
    blocks = _round_up(out_features, 128) * _round_up(in_features // NVFP4_BLOCK, 4)
    return out_features * in_features // 2 + blocks + 4


def ao_copy_bytes(transformer: nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> int:
    """Bytes an :func:`ao_explore_copy` of the peft ``transformer`` holds beyond the policy, counted from shapes
    (torchao refuses to build its tensors without a GPU; the count equals a built copy's bytes, tested with the
    refusal lifted): ``ao_weight_bytes`` per quantized layer, a merged weight in the policy's dtype per LoRA layer
    torchao does not quantize."""
    from solrl.stages.models.policy import counted_copy_bytes

    def quantized_bytes(name: str, layer: nn.Module) -> int | None:
        if not ao_takes(name, layer, skip, min_dim):
            return None
        return ao_weight_bytes(layer.in_features, layer.out_features, precision)

    return counted_copy_bytes(transformer, quantized_bytes)


def _contiguous_input(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook: torchao's NVFP4 linear takes contiguous inputs only (torchao 0.18), on any device. A
    transposed 3-D input (SD3's joint-attention outputs, SANA's attention output and cross-attention query)
    decomposes to ``aten.expand``, which ``NVFP4Tensor`` does not implement; a transposed 2-D one fails its
    contiguity assertion."""
    return (args[0].contiguous(), *args[1:])


def _quantized(layer: nn.Module, weight: torch.Tensor, config: Any) -> nn.Module:
    """``layer`` (kept: its bias, its class) with ``weight`` quantized by torchao, in place."""
    from torchao.quantization import quantize_

    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    quantize_(layer, config)
    return layer


@torch.no_grad()
def ao_explore_copy(transformer: nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> nn.Module:
    """A torchao explore copy of the peft ``transformer``'s ``rollout`` adapter (``merged_copy_of``): each
    LoRA-wrapped layer torchao takes is quantized from its merged weight, one at a time, the other eligible Linears
    from the shared base weights (their module objects are the copy's own, so the policy is not touched).
    ``net.ao_layers`` names the quantized layers (``ao_sync_``).

    Raises:
        ValueError: bad precision; ``torchao_fp8`` of weights not in bfloat16 (torchao asserts it).
        ImportError: torchao lacks the config. AssertionError (torchao's): no GPU of the capability the config
        needs.
    """
    from solrl.stages.models.policy import copy_layers, merged_copy_of

    config = ao_config(precision)
    if precision == "torchao_fp8":
        dtypes = {
            layer.weight.dtype for name, layer, _ in copy_layers(transformer) if ao_takes(name, layer, skip, min_dim)
        }
        if dtypes - {torch.bfloat16}:
            raise ValueError(
                ao_dtype_error(precision, ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)))
            )
    quantized: set[str] = set()

    def convert(name: str, layer: nn.Module, weight: torch.Tensor) -> nn.Module | None:
        if not ao_takes(name, layer, skip, min_dim):
            return None
        quantized.add(name)
        return _quantized(copy.deepcopy(layer, {id(layer.weight): None, id(layer.bias): layer.bias}), weight, config)

    net = merged_copy_of(transformer, "rollout", convert)
    for name, layer in list(net.named_modules()):
        if name and name not in quantized and ao_takes(name, layer, skip, min_dim):
            _quantized(layer, layer.weight, config)
            quantized.add(name)
    if precision == "torchao_nvfp4":
        for name in quantized:
            net.get_submodule(name).register_forward_pre_hook(_contiguous_input)
    if not quantized:
        warnings.warn(
            f"{precision}: no layer of this transformer is an nn.Linear the skip rule quantizes (torchao takes "
            "Linears only, in and out % 16): the explore copy runs in bf16",
            stacklevel=2,
        )
    net.ao_layers = frozenset(quantized)
    return net


def ao_sync_(policy: Any, net: nn.Module, precision: str) -> int:
    """Re-quantize the current merged rollout weights into ``net`` (an :func:`ao_explore_copy`) layer by layer
    (``Policy.sync_merged_copy_``); layers left in bf16 are copied. Returns the layers written."""
    config = ao_config(precision)

    def write(name: str, target: nn.Module, weight: torch.Tensor) -> None:
        if name in net.ao_layers:
            _quantized(target, weight, config)
        else:
            target.weight.copy_(weight)

    return policy.sync_merged_copy_(net, "rollout", write)
