"""Model adapters: one diffusers family each, registered as ``model.family`` plug-ins (DESIGN 5)."""

from solrl.stages.models import flux, flux2, qwen_image, sana, sd3, tiny_digits, wan, z_image
from solrl.stages.models.adapter import Conditioning, ModelAdapter, load_model, model_family, resolve_device

__all__ = [
    "Conditioning",
    "ModelAdapter",
    "flux",
    "flux2",
    "load_model",
    "model_family",
    "qwen_image",
    "resolve_device",
    "sana",
    "sd3",
    "tiny_digits",
    "wan",
    "z_image",
]
