"""Where a model family's weights come from, checked without importing torch.

A published family (SANA, FLUX.1, SD3.5, Z-Image, Qwen-Image, FLUX.2-klein, Wan2.1) reads a diffusers pipeline folder
from ``model.path``: a local folder, or a Hugging Face hub id read from the local hub cache (downloaded by diffusers
only when ``HF_HUB_OFFLINE=0``).
Each adapter declares its published weights as literal class attributes (``hub_id``, ``weights_hint``,
``published_variants``), which the model registry reads from its source without importing it, so that ``solrl
run`` and ``solrl resume`` refuse a preset whose weights are not on the machine before they import torch (about a
second on its own): the error comes at once, names the missing path and where the weights are published. A
third-party family is checked by its own ``check_runnable`` after its import instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from solrl.config import ConfigError, ModelConfig

#: ``org/name``: a Hugging Face hub id rather than a local folder.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: Files of a diffusers pipeline folder that must exist before any work starts.
PIPELINE_FILES = ("model_index.json", "transformer/config.json", "vae/config.json")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloads (solrl's Makefile and tests set it; unset means online)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def pipeline_dir(path: str) -> Path:
    """``model.path`` as a folder: itself when it exists or is not a hub id; a hub id's snapshot in the local
    hub cache when there is one (never downloaded here); else the path itself (then missing)."""
    local = Path(path).expanduser()
    if local.exists() or not HUB_ID.match(path):
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # not in the local cache: the missing-file check names the path
        return local


def hub_download(path: str | None) -> bool:
    """Whether ``path`` is a hub id that is neither a local folder nor in the hub cache (then diffusers'
    ``from_pretrained`` downloads it, when ``HF_HUB_OFFLINE`` allows)."""
    return bool(path) and HUB_ID.match(path) is not None and not pipeline_dir(path).exists()


@dataclass(frozen=True)
class PublishedWeights:
    """A family's published diffusers pipeline: its hub id, where a user gets it, and the files every run needs.

    Attributes:
        hub_id: the published repository, e.g. ``black-forest-labs/FLUX.1-dev``.
        hint: where the weights are published (a URL, with any licence step), for error messages.
        required_files: files, relative to the pipeline folder, that must exist before any work starts.
    """

    hub_id: str
    hint: str
    required_files: tuple[str, ...] = PIPELINE_FILES

    def check(self, family: str, path: str | None) -> None:
        """Check that ``path`` (``model.path``) holds this pipeline, or may be downloaded.

        Raises:
            ConfigError: no path; a hub id not cached while offline; a local folder lacking a required file.
                One line naming the path and where the weights are published.
        """
        if not path:
            raise ConfigError(
                f"model.family={family} needs model.path: a diffusers-format folder or hub id; weights: {self.hint}"
            )
        if hub_download(path):
            if hub_offline():
                raise ConfigError(
                    f"model.path={path}: not a local folder and not in the Hugging Face cache, and "
                    f"HF_HUB_OFFLINE=1 (solrl's default) forbids downloading; download it first or set "
                    f"HF_HUB_OFFLINE=0 to let diffusers fetch it; weights: {self.hint}"
                )
            return
        root = pipeline_dir(path)
        for rel in self.required_files:
            if not (root / rel).exists():
                raise ConfigError(f"model.path: {root / rel} is missing ({family} weights); weights: {self.hint}")


def published_weights(family: str, path: str | None) -> PublishedWeights | None:
    """The published checkpoint ``model.path`` names, as the family's adapter declares it (``hub_id``,
    ``weights_hint``, ``published_variants``), read without importing the adapter (``Registry.declared``): a
    variant whose hub id is the path, or whose repository name is the path's last folder (a local copy); else the
    family's own ``hub_id``; None for a family that declares none (tiny-digits).

    An unregistered family has none here: the config's validation names it.
    """
    from solrl.registry import MODELS

    if family not in MODELS:
        return None
    if path:
        name = Path(path).expanduser().name
        for hub_id, hint in MODELS.declared(family, "published_variants", ()):
            if path == hub_id or name == hub_id.rsplit("/", 1)[-1]:
                return PublishedWeights(hub_id, hint)
    hub_id = MODELS.declared(family, "hub_id")
    return PublishedWeights(hub_id, MODELS.declared(family, "weights_hint", "")) if hub_id else None


def check_published_weights(model: ModelConfig) -> None:
    """The weights check of a published family (``published_weights``), before anything imports torch; nothing
    for a tiny twin (``model.source: tiny``) or other families (their adapter checks after its import).

    Raises:
        ConfigError: as ``PublishedWeights.check``.
    """
    published = None if model.source == "tiny" else published_weights(model.family, model.path)
    if published is not None:
        published.check(model.family, model.path)


def published_presets() -> list[str]:
    """The shipped presets whose family declares published weights (not the tiny twins, not tiny-digits), sorted:
    what the benchmarks at published size iterate, so a new family's preset is picked up without an edit there."""
    from solrl.config import list_presets, load_config

    models = {name: load_config(name, plugins=False).model for name in list_presets()}
    return [
        name for name, model in models.items() if model.source == "weights" and published_weights(model.family, None)
    ]
