"""Component configs of the published pipelines, shipped so that the memory plan (``solrl.stages.memory``) can
plan a preset before its weights are on the machine: one JSON file per hub id (``org--name.json``) holding the
transformer's and the VAE's diffusers configs as published (``transformer/config.json``, ``vae/config.json``),
the scheduler's where it matters, and the text encoders' parameter counts. Where the weights folder is there, its
own configs are read instead (``read_folder``).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

#: ``model_index.json`` libraries whose components are counted as text encoders (tokenizers hold no weights).
_MODEL_LIBRARIES = ("transformers",)


def read_published(hub_id: str) -> dict[str, Any] | None:
    """The shipped configs of ``hub_id`` (``org/name``), or None when solrl ships none."""
    path = Path(str(resources.files(__package__))) / f"{hub_id.replace('/', '--')}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {
        "transformer": data["transformer"],
        "vae": data["vae"],
        "scheduler": data.get("scheduler"),
        "text_encoders": {t["name"]: int(t["parameters"]) for t in data.get("text_encoders", [])},
    }


def _config(folder: Path, name: str) -> dict[str, Any]:
    return {k: v for k, v in json.loads((folder / name).read_text(encoding="utf-8")).items() if not k.startswith("_")}


def safetensors_parameters_file(path: Path) -> int:
    """Elements of every tensor in the safetensors file ``path`` (its header only: nothing is loaded)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            count = 1
            for n in f.get_slice(key).get_shape():
                count *= n
            total += count
    return total


def safetensors_parameters(folder: Path) -> int:
    """Elements of every tensor in the ``.safetensors`` files of ``folder`` (headers only)."""
    return sum(safetensors_parameters_file(path) for path in sorted(folder.glob("*.safetensors")))


def read_folder(folder: Path) -> dict[str, Any]:
    """The configs of a diffusers pipeline folder: ``model_index.json``'s classes, the transformer's, VAE's and
    scheduler's configs, and the text encoders' parameter counts from their safetensors headers."""
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    configs: dict[str, Any] = {"text_encoders": {}, "scheduler": None}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[1] is None:
            continue
        library, cls = entry
        if name in ("transformer", "vae"):
            configs[name] = {"class": cls, "config": _config(folder / name, "config.json")}
        elif name == "scheduler":
            configs[name] = {"class": cls, "config": _config(folder / name, "scheduler_config.json")}
        elif library in _MODEL_LIBRARIES and (folder / name / "config.json").is_file():
            configs["text_encoders"][name] = safetensors_parameters(folder / name)
    return configs
