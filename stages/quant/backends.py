"""Explore backends: the network that samples for the rollout policy at a given precision (DESIGN 2).

Each backend registers under its ``explore.precision`` name:

| name | where | network |
| --- | --- | --- |
| ``bf16`` | anywhere | the peft transformer with the ``rollout`` adapter active (bf16 autocast on CUDA, fp32 on CPU) |
| ``nvfp4_emulated`` | anywhere | a merged copy, Linear / 1x1-conv layers fake-quantized W4A4 in NVFP4 |
| ``fp8_emulated`` | anywhere | the same, W8A8 in per-tensor FP8 E4M3 |
| ``nvfp4`` | Blackwell + Transformer Engine | the same layers as TE Linears under ``NVFP4BlockScaling`` |
| ``fp8`` | Ada / Hopper / Blackwell + TE | the same layers as TE Linears under ``Float8CurrentScaling(E4M3)`` |
| ``torchao_fp8`` | Ada, Hopper, Blackwell | the same Linears, torchao's ``Float8DynamicActivationFloat8WeightConfig`` |
| ``torchao_nvfp4`` | Blackwell | the same Linears, torchao's ``NVFP4DynamicActivationNVFP4WeightConfig`` |

Layers follow the Sol-RL skip rule: the model adapter's skip list, plus ``max(in, out) <= min_dim``. Whether
a backend runs on this machine is its ``unavailable_reason``, checked where work starts (``solrl run``,
``solrl resume``, the flow) and again when the network is built; never by the config schema.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from solrl.registry import EXPLORE_BACKENDS, register_explore_backend
from solrl.stages.models.policy import Policy, merged_copy_of, owned_bytes
from solrl.stages.quant.ao import ao_dtype_error
from solrl.stages.quant.availability import check_precision, unavailable_reason
from solrl.stages.quant.nvfp4 import FakeQuantLinear, layer_eligible, quantize_model_
from solrl.stages.sampling.compiled import CompileStats, compiled_blocks

#: Where a low-precision explore copy stays between the stages that sample with it (``explore.keep_copy``):
#: on the device (no rebuild, no transfer; it stays resident through score, regenerate and update), in host
#: memory (moved back and synced at the next explore), or nowhere (rebuilt at the next explore).
KEEP_COPY = ("device", "host", "none")


class ExploreBackend:
    """One explore precision. Subclasses implement ``network``."""

    name: ClassVar[str]
    #: Whether the samples are low precision (a proxy for ranking, never a training target).
    low_precision: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend runs on this machine, else why not (one sentence)."""
        return unavailable_reason(cls.name)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """Raises ValueError where the ``RunConfig`` asks this backend for something it cannot do (pure: the
        machine is ``unavailable_reason``'s business). The default accepts every config."""

    @classmethod
    def eager_layer(cls, module: nn.Module) -> bool:
        """Whether ``module`` runs eager inside a compiled block (compiled around): layers dynamo cannot trace."""
        return False

    @classmethod
    def copy_bytes(cls, transformer: nn.Module, skip: tuple[str, ...] = (), min_dim: int = 0) -> int:
        """Bytes the explore copy of the peft ``transformer`` holds beyond the policy itself (the memory plan's
        "explore copy"; ``transformer`` may live on the meta device). The BF16 backend samples the policy: 0."""
        return 0

    @classmethod
    @contextmanager
    def network(
        cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample", keep_copy: str = "device"
    ) -> Iterator[nn.Module]:
        """The rollout policy's sampling network at this precision, ``(x, ...) -> velocity``; ``activation_scale``
        (``sample`` or ``call``) applies to the emulated backends (Transformer Engine scales per call, or per
        row); ``keep_copy`` (``KEEP_COPY``) is where a low-precision copy stays once the context exits."""
        raise NotImplementedError
        yield


@register_explore_backend("bf16")
class BF16(ExploreBackend):
    """The full-precision rollout policy (the BF16 rollout-scaling baseline, and every regeneration)."""

    name = "bf16"
    low_precision = False

    @classmethod
    @contextmanager
    def network(
        cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample", keep_copy: str = "device"
    ) -> Iterator[nn.Module]:
        with policy.using("rollout") as net:
            yield net


class _Emulated(ExploreBackend):
    fmt: ClassVar[str]

    @classmethod
    def copy_bytes(cls, transformer: nn.Module, skip: tuple[str, ...] = (), min_dim: int = 0) -> int:
        """Measured: the copy is built (on ``transformer``'s device, the meta device for the plan) and the bytes
        of its own tensors (packed codes, block scales, tensor scales, merged layers left in high precision)
        summed; shared frozen tensors count 0."""
        net = emulated_copy(transformer, cls.fmt, skip, min_dim, "sample", which=_first_adapter(transformer))
        return owned_bytes(net, transformer)

    @classmethod
    @contextmanager
    def network(
        cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample", keep_copy: str = "device"
    ) -> Iterator[nn.Module]:
        net = explore_copy(policy, cls.name, min_dim, activation_scale)
        try:
            yield net
        finally:
            _release(policy, (cls.name, min_dim, activation_scale), keep_copy)


@register_explore_backend("nvfp4_emulated")
class NVFP4Emulated(_Emulated):
    """W4A4 fake quantization with exact NVFP4 numerics (E2M1 values, 16-element E4M3 block scales, FP32 tensor
    scale; ``solrl.stages.quant.nvfp4``); for fidelity, tests and ablations anywhere, not speed."""

    name, fmt = "nvfp4_emulated", "nvfp4"


@register_explore_backend("fp8_emulated")
class FP8Emulated(_Emulated):
    """W8A8 fake quantization in per-tensor FP8 E4M3."""

    name, fmt = "fp8_emulated", "fp8"


class _OnDevice(ExploreBackend):
    """A hardware copy cached per policy: built once (``build``), then synced in place after each update
    (``sync``). Its quantized weights live on the GPU only: ``keep_copy=host`` frees it as ``none`` does (it is
    rebuilt at the next explore)."""

    @classmethod
    def build(cls, policy: Policy, min_dim: int) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def sync(cls, policy: Policy, net: nn.Module) -> None:
        raise NotImplementedError

    @classmethod
    @contextmanager
    def network(
        cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample", keep_copy: str = "device"
    ) -> Iterator[nn.Module]:
        check_precision(cls.name)
        start = time.perf_counter()
        key = (cls.name, min_dim, "device")
        net = policy.explore_copies.get(key)
        if net is None:
            net = policy.explore_copies[key] = cls.build(policy, min_dim)
        else:
            cls.sync(policy, net)
        policy.explore_sync_seconds = time.perf_counter() - start
        try:
            yield net
        finally:
            _release(policy, key, "none" if keep_copy == "host" else keep_copy)


class _TransformerEngine(_OnDevice):
    @classmethod
    def eager_layer(cls, module: nn.Module) -> bool:
        """Transformer Engine's modules. Whether dynamo traces ``te.Linear`` under ``te.autocast`` is not verified
        here (no GPU), so they run eager inside the compiled block: it graph-breaks around each of them and
        compiles attention, norms and the rest."""
        return type(module).__module__.startswith("transformer_engine")

    @classmethod
    def copy_bytes(cls, transformer: nn.Module, skip: tuple[str, ...] = (), min_dim: int = 0) -> int:
        """Counted (no GPU is needed to plan): Transformer Engine's storage of each quantized weight built under
        ``quantized_model_init`` without grad (row-wise data and scales only), its bias, and the merged layers TE
        cannot take (``solrl.stages.quant.hardware.te_copy_bytes``)."""
        from solrl.stages.quant.hardware import te_copy_bytes

        return te_copy_bytes(transformer, cls.name, skip, min_dim)

    @classmethod
    def build(cls, policy: Policy, min_dim: int) -> nn.Module:
        """``te_explore_copy`` of the rollout policy."""
        from solrl.stages.quant.hardware import te_explore_copy

        return te_explore_copy(policy.transformer, cls.name, policy.model.explore_skip, min_dim)

    @classmethod
    def sync(cls, policy: Policy, net: nn.Module) -> None:
        """``copy_`` into each quantized weight (TE re-quantizes on copy)."""
        policy.sync_merged_copy_(net.net, "rollout")


@register_explore_backend("nvfp4")
class NVFP4(_TransformerEngine):
    """True NVFP4 on Blackwell through Transformer Engine's ``NVFP4BlockScaling`` recipe."""

    name = "nvfp4"


@register_explore_backend("fp8")
class FP8(_TransformerEngine):
    """FP8 E4M3 on Ada, Hopper or Blackwell through Transformer Engine (current scaling)."""

    name = "fp8"


class _TorchAO(_OnDevice):
    """torchao's inference quantization (``solrl.stages.quant.ao``): compile-friendly tensor subclasses."""

    @classmethod
    def copy_bytes(cls, transformer: nn.Module, skip: tuple[str, ...] = (), min_dim: int = 0) -> int:
        """Counted from shapes (``solrl.stages.quant.ao.ao_copy_bytes``): torchao builds its tensors on a GPU only."""
        from solrl.stages.quant.ao import ao_copy_bytes

        return ao_copy_bytes(transformer, cls.name, skip, min_dim)

    @classmethod
    def build(cls, policy: Policy, min_dim: int) -> nn.Module:
        """``ao_explore_copy`` of the rollout policy."""
        from solrl.stages.quant.ao import ao_explore_copy

        return ao_explore_copy(policy.transformer, cls.name, policy.model.explore_skip, min_dim)

    @classmethod
    def sync(cls, policy: Policy, net: nn.Module) -> None:
        """Re-quantize each quantized layer's merged weight (``ao_sync_``)."""
        from solrl.stages.quant.ao import ao_sync_

        ao_sync_(policy, net, cls.name)


@register_explore_backend("torchao_fp8")
class TorchAOFP8(_TorchAO):
    """FP8 E4M3 W8A8 through torchao (per-row weight scales, per-token activation scales) on Ada, Hopper or
    Blackwell."""

    name = "torchao_fp8"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """torchao's per-row FP8 quantizes bfloat16 weights only (``Float8DynamicActivationFloat8WeightConfig`` with
        ``PerRow`` asserts ``weight.dtype == torch.bfloat16``), so ``model.dtype=float32`` is refused here, before
        the first explore; ``auto`` is bfloat16 on CUDA."""
        if cfg.model.dtype == "float32":
            raise ValueError(ao_dtype_error(cls.name, "float32"))


@register_explore_backend("torchao_nvfp4")
class TorchAONVFP4(_TorchAO):
    """NVFP4 W4A4 through torchao's ``NVFP4DynamicActivationNVFP4WeightConfig`` on Blackwell."""

    name = "torchao_nvfp4"


def _first_adapter(transformer: nn.Module) -> str:
    config = getattr(transformer, "peft_config", None) or {}
    return "rollout" if "rollout" in config else next(iter(config), "reference")


def emulated_copy(
    transformer: nn.Module,
    fmt: str,
    skip: tuple[str, ...] = (),
    min_dim: int = 0,
    activation_scale: str = "sample",
    which: str = "rollout",
) -> nn.Module:
    """The packed fake-quantized explore copy of the peft ``transformer``'s adapter ``which``
    (``merged_copy_of``): each eligible LoRA-wrapped layer is encoded straight from its merged weight, one layer at
    a time, the other eligible layers from the shared base weights; everything else is shared with the policy.

    Raises:
        ValueError: unknown ``fmt`` or ``activation_scale``; non-finite weights.
    """

    def convert(name: str, base: nn.Module, weight: torch.Tensor) -> nn.Module | None:
        if layer_eligible(name, base, fmt=fmt, skip=skip, min_dim=min_dim):
            return FakeQuantLinear(base, fmt, activation_scale, weight=weight)
        return None

    net = merged_copy_of(transformer, which, convert)  # type: ignore[arg-type]
    quantize_model_(net, fmt=fmt, skip=skip, min_dim=min_dim, activation_scale=activation_scale)
    return net


def explore_copy(policy: Policy, precision: str, min_dim: int = 0, activation_scale: str = "sample") -> nn.Module:
    """The fake-quantized explore copy of the rollout policy (:func:`emulated_copy`), built once per ``Policy``
    object and then kept in sync in place: each later call re-encodes the current merged rollout weights into it
    (weight sync, no model rebuild), after moving it back to the policy's device if ``keep_copy=host`` moved it
    out. ``policy.explore_sync_seconds`` holds the last build or sync time.

    Raises:
        ValueError: ``precision`` is not an emulated backend.
    """
    backend = EXPLORE_BACKENDS.get(precision)
    if not issubclass(backend, _Emulated):
        raise ValueError(f"{precision!r} is not an emulated explore precision")
    start = time.perf_counter()
    key = (precision, min_dim, activation_scale)
    net = policy.explore_copies.get(key)
    if net is None:
        net = emulated_copy(policy.transformer, backend.fmt, policy.model.explore_skip, min_dim, activation_scale)
        policy.explore_copies[key] = net
    else:
        move_owned_(net, policy.transformer, _device_of(policy.transformer))
        policy.sync_merged_copy_(net, "rollout")  # quantized layers re-encoded in place
    policy.explore_sync_seconds = time.perf_counter() - start
    return net


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def move_owned_(net: nn.Module, source: nn.Module, device: torch.device | str) -> int:
    """Move ``net``'s own parameters and buffers (not those shared with ``source``) to ``device``, in place in
    ``net`` (each module's entry replaced). Returns the bytes moved."""
    shared = {id(t) for t in [*source.parameters(), *source.buffers()]}
    device, moved = torch.device(device), 0
    for module in net.modules():
        for tensors in (module._parameters, module._buffers):
            for key, t in tensors.items():
                if t is None or id(t) in shared or t.device == device:
                    continue
                data = t.detach().to(device)
                tensors[key] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                moved += t.nbytes
    return moved


def _release(policy: Policy, key: tuple[str, int, str], keep_copy: str) -> None:
    """Apply ``keep_copy`` to the cached copy ``key`` once its stage stops sampling with it."""
    if keep_copy not in KEEP_COPY:
        raise ValueError(f"explore.keep_copy must be one of {KEEP_COPY}, got {keep_copy!r}")
    net = policy.explore_copies.get(key)
    if net is None or keep_copy == "device":
        return
    if keep_copy == "none":
        del policy.explore_copies[key]
    else:
        move_owned_(net, policy.transformer, "cpu")


def quantized_layers(net: nn.Module) -> int:
    """How many layers of the sampling network ``net`` compute quantized, as solrl's own backends build them: the
    emulated copies' ``FakeQuantLinear``, Transformer Engine's ``RowPadded`` layers, a torchao copy's
    ``ao_layers`` (0 for bf16; a plug-in backend's layers are its own, and not counted)."""
    from solrl.stages.quant.hardware import RowPadded

    ao = sum(len(m.ao_layers) for m in net.modules() if hasattr(m, "ao_layers"))
    return ao + sum(isinstance(m, (FakeQuantLinear, RowPadded)) for m in net.modules())


def rollout_network(
    policy: Policy, precision: str, min_dim: int = 0, activation_scale: str = "sample", keep_copy: str = "device"
) -> AbstractContextManager[nn.Module]:
    """The network that samples for the rollout policy at ``precision`` (a registered explore backend);
    ``keep_copy`` (``KEEP_COPY``) is where its low-precision copy stays once the context exits.

    Raises:
        ValueError: unknown precision or ``keep_copy``, or a hardware precision this machine cannot run.
    """
    if keep_copy not in KEEP_COPY:  # before any work: checked again where the copy is released
        raise ValueError(f"explore.keep_copy must be one of {KEEP_COPY}, got {keep_copy!r}")
    return EXPLORE_BACKENDS.get(precision).network(policy, min_dim, activation_scale, keep_copy)


@contextmanager
def sampling_network(
    policy: Policy,
    precision: str,
    *,
    compile: bool = False,
    mode: str = "default",
    min_dim: int = 0,
    activation_scale: str = "sample",
    adapter: str = "rollout",
    keep_copy: str = "device",
) -> Iterator[tuple[nn.Module, CompileStats | None]]:
    """``rollout_network`` with, when ``compile``, its transformer's repeated blocks compiled for the duration
    (``solrl.stages.sampling.compiled.compiled_blocks``; the backend's ``eager_layer`` compiled around). Yields
    ``(network, stats)``; stats is None without compile, and complete once the context exits. ``adapter``
    (``rollout``, ``ema`` or ``policy``; full precision only) samples another of the policy's adapters;
    ``keep_copy`` as in ``rollout_network``.

    Raises:
        ValueError: as ``rollout_network``; an unknown ``mode``; a transformer with no repeated blocks; an adapter
        other than the rollout at a low precision.
    """
    backend = EXPLORE_BACKENDS.get(precision)
    if adapter != "rollout" and backend.low_precision:
        raise ValueError(f"the {precision} explore copy samples the rollout policy only, not the {adapter} adapter")
    network = (
        rollout_network(policy, precision, min_dim, activation_scale, keep_copy)
        if adapter == "rollout"
        else policy.using(adapter)
    )
    with network as net:
        if not compile:
            yield net, None
            return
        what = "BF16 rollout" if precision == "bf16" else f"{precision} explore copy"
        with compiled_blocks(
            net, mode, fallback=policy.model.repeated_blocks, eager=backend.eager_layer, what=what
        ) as stats:
            yield net, stats
