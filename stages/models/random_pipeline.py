"""A family's pipeline at its published widths with random weights: the published-size check (issue 20).

``write_random_pipeline`` writes a diffusers pipeline folder whose transformer is the published one (the config
shipped in ``solrl/stages/models/published/``, or the weights folder's) with its depth cut to a few blocks, whose
VAE and scheduler are the published ones, all with random weights in the run's dtype. The tokenizers and text
encoders are the family's tiny ones: a published text encoder (T5-XXL, Mistral-3, Qwen2.5-VL) is not what this
checks, and the prompt embeddings are written at the published width instead (``write_random_embeddings``, the
run's own prompt-embedding cache), so the run never loads a text encoder.

The folder loads through the family's own ``load`` as real weights do, so one iteration of the flow exercises, at
the real width and resolution: LoRA over a bf16 base, the NVFP4 emulation of bf16 weights, the VAE decode of
real-size images and the rewards' preprocessing of them. ``bench/published_size.py`` runs it for every family; a
GPU user can run it before downloading weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from solrl.config import ModelConfig
from solrl.stages.models.adapter import write_embedding_cache
from solrl.stages.models.diffusers_family import DiffusersFamily, build_once, quiet_diffusers


def tiny_counterpart(family: type[DiffusersFamily]) -> type[DiffusersFamily]:
    """The tiny twin of ``family`` or, failing that, of its nearest base that has one (``flux`` -> ``tiny-flux``;
    a family subclassing ``Flux`` without a twin of its own -> ``tiny-flux``).

    Raises:
        ValueError: neither ``family`` nor any of its bases has a tiny twin.
    """
    for cls in family.__mro__:
        if "_tiny_twin" in vars(cls):
            return vars(cls)["_tiny_twin"]
    raise ValueError(f"model.family={family.name}: no tiny twin of its classes to take tokenizers from")


def cut_transformer_config(family: type[DiffusersFamily], config: dict[str, Any], blocks: int) -> dict[str, Any]:
    """``config`` with every ``depth_keys`` count cut to at most ``blocks`` and the rest kept consistent
    (``family.cut_depth``); a new dict."""
    cut = dict(config)
    for key in family.depth_keys:
        cut[key] = min(blocks, int(cut[key]))
    family.cut_depth(cut, config)
    return cut


def write_random_pipeline(
    model: ModelConfig, out: Path, *, blocks: int = 1, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write ``model.family``'s pipeline at its published widths, with random weights, into ``out``.

    Args:
        model: the model section of a published preset (its ``family`` and ``path``: the hub id naming the
            shipped configs, or a weights folder whose configs are read).
        out: the folder to write (created; replaced if it exists).
        blocks: transformer blocks kept of each kind (``depth_keys``: FLUX keeps ``blocks`` double and
            ``blocks`` single blocks).
        dtype: the weights' dtype on disk.

    Returns:
        ``out``, a folder ``DiffusersFamily.load`` takes as ``model.path``.

    Raises:
        ConfigError: solrl ships no configs for ``model.path`` and it is no weights folder. ValueError: the family
            has no tiny counterpart (no tokenizers to take).
    """
    import diffusers

    from solrl.registry import MODELS

    family = MODELS.get(model.family)
    configs, _ = family.pipeline_configs(model)
    tiny = tiny_counterpart(family)
    if out.exists():
        shutil.rmtree(out)
    build_once(tiny, out)  # tokenizers, tiny text encoders, model_index.json of the real pipeline class
    transformer_config = cut_transformer_config(family, configs["transformer"]["config"], blocks)
    torch.manual_seed(0)
    with quiet_diffusers():
        for name, cls, config in (
            ("transformer", configs["transformer"]["class"], transformer_config),
            ("vae", configs["vae"]["class"], configs["vae"]["config"]),
        ):
            component = getattr(diffusers, cls).from_config(config).to(dtype)
            shutil.rmtree(out / name)
            component.save_pretrained(out / name)
            del component
    scheduler = configs.get("scheduler")
    if scheduler:
        (out / "scheduler" / "scheduler_config.json").write_text(
            json.dumps({"_class_name": scheduler["class"], **scheduler["config"]}, indent=2)
        )
    return out


def write_random_embeddings(adapter: DiffusersFamily, prompts: list[str], cache: Path, seed: int = 0) -> None:
    """The prompt-embedding cache of a run (``StageContext.prompt_embeddings``) filled with random embeddings of
    the shapes and dtypes the family's published text encoders give (``conditioning_like``): standard normal
    values, token masks all ones.

    Args:
        adapter: the family's adapter (a ``meta_adapter`` serves: only shapes are read).
        prompts: the run's prompts; one entry per unique prompt, sorted, as ``ModelAdapter.precompute`` writes.
        cache: the cache file to write.
    """
    like = adapter.conditioning_like(1)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, _ in enumerate(sorted(set(prompts))):
        for name, value in like.items():
            shape, dtype = tuple(value.shape[1:]), value.dtype
            tensors[f"{i}/{name}"] = (
                torch.ones(shape, dtype=dtype)
                if not dtype.is_floating_point
                else torch.randn(shape, generator=g).to(dtype)
            )
    write_embedding_cache(cache, tensors)
