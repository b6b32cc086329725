"""Explore backends: the network that samples for the rollout policy at a given precision (DESIGN 2).

Each backend registers under its ``explore.precision`` name:

| name | where | network |
| --- | --- | --- |
| ``bf16`` | anywhere | the peft transformer with the ``rollout`` adapter active (bf16 autocast on CUDA, fp32 on CPU) |
| ``nvfp4_emulated`` | anywhere | a merged copy, Linear / 1x1-conv layers fake-quantized W4A4 in NVFP4 |
| ``fp8_emulated`` | anywhere | the same, W8A8 in per-tensor FP8 E4M3 |
| ``nvfp4`` | Blackwell + Transformer Engine | the same layers as TE Linears under ``NVFP4BlockScaling`` |
| ``fp8`` | Ada / Hopper / Blackwell + TE | the same layers as TE Linears under ``Float8CurrentScaling(E4M3)`` |

Layers follow the Sol-RL skip rule: the model adapter's skip list, plus ``max(in, out) <= min_dim``. Whether
a backend runs on this machine is its ``unavailable_reason``, checked where work starts (``solrl run``,
``solrl resume``, the flow) and again when the network is built; never by the config schema.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import ClassVar

from torch import nn

from solrl.registry import EXPLORE_BACKENDS, register_explore_backend
from solrl.stages.models.policy import Policy
from solrl.stages.quant.availability import check_precision, unavailable_reason
from solrl.stages.quant.nvfp4 import quantize_model_, requantize_model_
from solrl.stages.sampling.compiled import CompileStats, compiled_blocks


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
    def eager_layer(cls, module: nn.Module) -> bool:
        """Whether ``module`` runs eager inside a compiled block (compiled around): layers dynamo cannot trace."""
        return False

    @classmethod
    @contextmanager
    def network(cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample") -> Iterator[nn.Module]:
        """The rollout policy's sampling network at this precision, ``(x, ...) -> velocity``; ``activation_scale``
        (``sample`` or ``call``) applies to the emulated backends (Transformer Engine scales per call)."""
        raise NotImplementedError
        yield


@register_explore_backend("bf16")
class BF16(ExploreBackend):
    """The full-precision rollout policy (the BF16 rollout-scaling baseline, and every regeneration)."""

    name = "bf16"
    low_precision = False

    @classmethod
    @contextmanager
    def network(cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample") -> Iterator[nn.Module]:
        with policy.using("rollout") as net:
            yield net


class _Emulated(ExploreBackend):
    fmt: ClassVar[str]

    @classmethod
    @contextmanager
    def network(cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample") -> Iterator[nn.Module]:
        yield explore_copy(policy, cls.name, min_dim, activation_scale)


@register_explore_backend("nvfp4_emulated")
class NVFP4Emulated(_Emulated):
    """W4A4 fake quantization with exact NVFP4 numerics (E2M1 values, 16-element E4M3 block scales, FP32 tensor
    scale; ``solrl.stages.quant.nvfp4``); for fidelity, tests and ablations anywhere, not speed."""

    name, fmt = "nvfp4_emulated", "nvfp4"


@register_explore_backend("fp8_emulated")
class FP8Emulated(_Emulated):
    """W8A8 fake quantization in per-tensor FP8 E4M3."""

    name, fmt = "fp8_emulated", "fp8"


class _TransformerEngine(ExploreBackend):
    @classmethod
    def eager_layer(cls, module: nn.Module) -> bool:
        """Transformer Engine's modules. Whether dynamo traces ``te.Linear`` under ``te.autocast`` is not verified
        here (no GPU), so they run eager inside the compiled block: it graph-breaks around each of them and
        compiles attention, norms and the rest."""
        return type(module).__module__.startswith("transformer_engine")

    @classmethod
    @contextmanager
    def network(cls, policy: Policy, min_dim: int = 0, activation_scale: str = "sample") -> Iterator[nn.Module]:
        check_precision(cls.name)
        from solrl.stages.quant.hardware import te_explore_copy

        yield te_explore_copy(policy.merged_copy("rollout"), cls.name, policy.model.nvfp4_skip, min_dim)


@register_explore_backend("nvfp4")
class NVFP4(_TransformerEngine):
    """True NVFP4 on Blackwell through Transformer Engine's ``NVFP4BlockScaling`` recipe."""

    name = "nvfp4"


@register_explore_backend("fp8")
class FP8(_TransformerEngine):
    """FP8 E4M3 on Ada, Hopper or Blackwell through Transformer Engine (current scaling)."""

    name = "fp8"


def explore_copy(policy: Policy, precision: str, min_dim: int = 0, activation_scale: str = "sample") -> nn.Module:
    """The fake-quantized explore copy of the rollout policy, built once per ``Policy`` object and then kept in
    sync in place: each later call writes the current merged rollout weights into it and re-quantizes them
    (weight sync, no model rebuild). ``policy.explore_sync_seconds`` holds the last build or sync time.

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
        net = policy.merged_copy("rollout")
        quantize_model_(
            net, fmt=backend.fmt, skip=policy.model.nvfp4_skip, min_dim=min_dim, activation_scale=activation_scale
        )
        policy.explore_copies[key] = net
    else:
        policy.sync_merged_copy_(net, "rollout")
        requantize_model_(net)
    policy.explore_sync_seconds = time.perf_counter() - start
    return net


def rollout_network(
    policy: Policy, precision: str, min_dim: int = 0, activation_scale: str = "sample"
) -> AbstractContextManager[nn.Module]:
    """The network that samples for the rollout policy at ``precision`` (a registered explore backend).

    Raises:
        ValueError: unknown precision, or a hardware precision this machine cannot run.
    """
    return EXPLORE_BACKENDS.get(precision).network(policy, min_dim, activation_scale)


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
) -> Iterator[tuple[nn.Module, CompileStats | None]]:
    """``rollout_network`` with, when ``compile``, its transformer's repeated blocks compiled for the duration
    (``solrl.stages.sampling.compiled.compiled_blocks``; the backend's ``eager_layer`` compiled around). Yields
    ``(network, stats)``; stats is None without compile, and complete once the context exits. ``adapter``
    (``rollout``, ``ema`` or ``policy``; full precision only) samples another of the policy's adapters.

    Raises:
        ValueError: as ``rollout_network``; an unknown ``mode``; a transformer with no repeated blocks; an adapter
        other than the rollout at a low precision.
    """
    backend = EXPLORE_BACKENDS.get(precision)
    if adapter != "rollout" and backend.low_precision:
        raise ValueError(f"the {precision} explore copy samples the rollout policy only, not the {adapter} adapter")
    network = (
        rollout_network(policy, precision, min_dim, activation_scale) if adapter == "rollout" else policy.using(adapter)
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
