"""Model adapters: one diffusers family each (DESIGN 5)."""

from solrl.stages.models.adapter import ModelAdapter, load_model, resolve_device

__all__ = ["ModelAdapter", "load_model", "resolve_device"]
