"""Policy losses (``train.loss`` plug-ins) and group-relative advantages."""

from solrl.stages.losses.base import Batch, PolicyLoss

__all__ = ["Batch", "PolicyLoss"]
