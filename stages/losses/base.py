"""The policy-loss plug-in interface and the batch every loss trains on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from solrl.config import ConfigSection, RunConfig, TrainConfig
from solrl.stages.models.adapter import Conditioning
from solrl.stages.models.policy import Policy


@dataclass
class Batch:
    """The group samples of one update, flattened to B = P * k, on the device."""

    x0: torch.Tensor  # float32 [B, C, h, w], the clean samples
    advantages: torch.Tensor  # float32 [B]
    cond: Conditioning  # the prompts' conditioning, name -> [B, ...] (ModelAdapter.encode)
    sigmas: torch.Tensor  # [S + 1] the sampling grid
    trajectory: torch.Tensor | None  # float32 [B, S + 1, C, h, w] (SDE rollouts)
    old_log_probs: torch.Tensor | None  # float32 [B, S] (SDE rollouts)
    sde_steps: list[bool]  # [S]: which rollout steps were stochastic
    seeds: torch.Tensor | None = None  # int64 [B]: each sample's seed (its initial and SDE step noises)
    noise: torch.Tensor | None = None  # float32 [B, S + 1, C, h, w]: the seeds' draws (GRPO-Guard), drawn once


class LossOptions(ConfigSection):
    """A loss's own options, under ``train.loss_options`` (none by default); a loss with settings subclasses it."""


class PolicyLoss:
    """One policy loss as a plug-in (``solrl.registry.register_loss``), named by ``train.loss``.

    A loss says how rollouts must be sampled for it (``noise_level``: 0 = the deterministic ODE), which of a
    rollout's steps it trains (``trainable_steps``), its term for one micro-batch at one step (``terms``),
    and how the rollout policy follows the policy after an optimizer step (``rollout_decay``). Its settings are its
    ``Options``, validated from ``train.loss_options`` with the config (``solrl.config``), read with ``options``.
    """

    name: ClassVar[str]
    Options: ClassVar[type[LossOptions]] = LossOptions
    #: Added to the warning about training on the quantized explore samples (``RunConfig.warnings``): what it
    #: means for this loss in particular (a literal: read without importing the loss).
    off_policy_note: ClassVar[str] = ""
    #: The largest on-policy deviation (``terms``' third value) an on-policy loss expects before its first
    #: update; the update warns above it. None: the rollout lags the policy by design (no bound).
    on_policy_bound: ClassVar[float | None] = None

    #: The methods a loss must define: the update calls them, and ``PolicyLoss``'s raise NotImplementedError.
    required: ClassVar[tuple[str, ...]] = ("trainable_steps", "terms")

    @classmethod
    def missing(cls) -> list[str]:
        """The methods of ``required`` this loss does not define (it inherits ``PolicyLoss``'s), checked with the
        config: a plug-in without ``terms`` failed only at its first update, with an empty NotImplementedError."""
        own = cls.__mro__[: cls.__mro__.index(PolicyLoss)]  # the classes between this loss and PolicyLoss
        return [name for name in cls.required if not any(name in vars(k) for k in own)]

    @classmethod
    def options(cls, tc: TrainConfig) -> LossOptions:
        """This loss's options from ``train.loss_options`` (resolved with the config; validated again here for a
        stored config read without plug-ins)."""
        from solrl.config import loss_option_values

        return cls.Options.model_validate(loss_option_values(tc.loss_options, set(cls.Options.model_fields)))

    @classmethod
    def draws_seed_noise(cls, cfg: RunConfig) -> bool:
        """Whether the update needs each sample's seed draws (``Batch.noise``), drawn once per update."""
        return False

    @classmethod
    def validate_config(cls, cfg: RunConfig) -> None:
        """Loss-specific rules of a valid config (pure). Raises ValueError naming the value and the fix."""

    @classmethod
    def noise_level(cls, cfg: RunConfig) -> float:
        """The SDE noise level rollouts sample with (0 = Euler ODE)."""
        return 0.0

    @classmethod
    def trainable_steps(cls, batch: Batch) -> list[int]:
        """Indices t of the sampling steps (``x_t -> x_{t+1}``) the loss may train."""
        raise NotImplementedError

    @classmethod
    def terms(
        cls,
        policy: Policy,
        batch: Batch,
        t_index: int,
        mb: slice,
        generator: torch.Generator,
        cfg: RunConfig,
        part: slice | None = None,
    ) -> tuple[torch.Tensor | None, dict[str, float], float]:
        """(scalar loss with grad, detached loss terms, on-policy deviation) of micro-batch ``mb`` at step
        ``t_index``. The deviation is how far the rollout that produced the samples is from the policy now
        (0 before the first update of an on-policy iteration, up to rounding).

        ``part`` (a sub-slice of ``mb``, absolute rows) computes only those rows, the loss their mean: one
        process's share of a multi-process update. Random draws must still be made for the whole of ``mb``, in
        the same order, so every layout sees the same numbers; an empty ``part`` returns a None loss."""
        raise NotImplementedError

    @classmethod
    def rollout_decay(cls, step: int, tc: TrainConfig) -> float:
        """``d`` of the rollout update ``rollout = d rollout + (1 - d) policy`` after optimizer step ``step``."""
        return 0.0
