"""Policy losses (``train.loss`` plug-ins) and group-relative advantages."""

from solrl.stages.losses.base import Batch, LossOptions, PolicyLoss

__all__ = ["Batch", "LossOptions", "PolicyLoss"]
