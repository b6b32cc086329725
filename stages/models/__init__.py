"""Model adapters: one diffusers family per module, registered as ``model.family`` plug-ins (DESIGN 5).

A family module here registers by being here (``solrl.registry.scan``); it is imported when its name is used.
"""

from solrl.stages.models.adapter import Conditioning, ModelAdapter, load_model, model_family, resolve_device

__all__ = ["Conditioning", "ModelAdapter", "load_model", "model_family", "resolve_device"]
