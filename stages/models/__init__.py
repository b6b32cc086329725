"""Model adapters: one diffusers family each, registered as ``model.family`` plug-ins (DESIGN 5)."""

from solrl.stages.models import tiny_digits
from solrl.stages.models.adapter import Conditioning, ModelAdapter, load_model, model_family, resolve_device

__all__ = ["Conditioning", "ModelAdapter", "load_model", "model_family", "resolve_device", "tiny_digits"]
