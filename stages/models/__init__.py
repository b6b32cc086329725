"""Model adapters: one diffusers family each, registered as ``model.family`` plug-ins (DESIGN 5)."""

from solrl.stages.models import flux, sana, sd3, tiny_digits
from solrl.stages.models.adapter import Conditioning, ModelAdapter, load_model, model_family, resolve_device

__all__ = [
    "Conditioning",
    "ModelAdapter",
    "flux",
    "load_model",
    "model_family",
    "resolve_device",
    "sana",
    "sd3",
    "tiny_digits",
]
