"""The memory plan of every published preset on an H100, an H200 and a B200 (their CUDA totals in GiB), and the
checks behind it (issue 20).

For each preset the transformer and VAE are built from their published configs (shipped in
``solrl/stages/models/published/``) on PyTorch's meta device, in bfloat16 as they load on a GPU, and measured through
the family's own ``velocity`` and ``vae_decode`` (``solrl.stages.memory``). The tables give, per GPU size and
update layout (one process, DDP-style replication; the same with gradient checkpointing; FSDP over 8 processes,
``train.parallel=fsdp``, with and without checkpointing), each stage's peak on one device and the largest explore
batch and training micro-batch that fit.

Two checks, printed after the tables:

* depth: the plan is counted at full depth; it is also extrapolated from the counts at 2 and at 4 blocks of
  each kind (linear in the blocks of each kind) and the two compared (within 10%);
* real tensors (``--real``): the same counts on CPU with random bfloat16 weights at the published width and
  resolution, micro-batch 1, at 2 and at 4 blocks of each kind, against the meta counts (within 10%).

    .venv/bin/python bench/memory_plan.py                     # every preset, meta only: about 2 minutes on 2 cores
    .venv/bin/python bench/memory_plan.py --real sd35-medium  # and real bf16 tensors for these presets (minutes)
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

from solrl.weights import published_presets

#: The update layouts of the table: label -> ``make_plan`` keywords.
LAYOUTS = [
    ("ddp x 1", {"parallel": "ddp", "processes": 1, "checkpointing": False}),
    ("ddp x 1, checkpointing", {"parallel": "ddp", "processes": 1, "checkpointing": True}),
    ("fsdp x 8", {"parallel": "fsdp", "processes": 8, "checkpointing": False}),
    ("fsdp x 8, checkpointing", {"parallel": "fsdp", "processes": 8, "checkpointing": True}),
]


def footprint_at(cfg, blocks, device="meta"):
    """(saved bytes, peak bytes) of one training forward + backward at micro-batch 1 with ``blocks`` kept."""
    import torch
    from peft import LoraConfig

    from solrl.stages.memory import train_bytes
    from solrl.stages.models import model_family

    adapter = model_family(cfg.model).meta_adapter(cfg.model, torch.bfloat16, blocks=blocks, device=device)[0]
    targets = adapter.lora_targets if isinstance(adapter.lora_targets, str) else list(adapter.lora_targets)
    adapter.transformer.add_adapter(
        LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha, target_modules=targets), "policy"
    )
    adapter.transformer.set_adapter("policy")
    peak, saved = train_bytes(adapter, 1)
    return saved, peak


def depths(cfg):
    """The family's depth config keys and their published counts."""
    from solrl.stages.models import model_family

    family = model_family(cfg.model)
    configs, _ = family.pipeline_configs(cfg.model)
    return {key: int(configs["transformer"]["config"][key]) for key in family.depth_keys}


def extrapolation_check(cfg):
    """Saved bytes at full depth counted, against the extrapolation from 2 and 4 blocks of each kind."""
    full = depths(cfg)
    two = dict.fromkeys(full, 2)
    base_saved, _ = footprint_at(cfg, two)
    per_block = {}
    for key in full:
        four, _ = footprint_at(cfg, {**two, key: 4})
        per_block[key] = (four - base_saved) / 2
    predicted = base_saved + sum(per_block[k] * (full[k] - 2) for k in full)
    counted, _ = footprint_at(cfg, None)
    return counted, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="*", default=None, help="default: every published preset")
    parser.add_argument("--real", nargs="*", default=[], help="Presets also counted on real bf16 CPU tensors.")
    parser.add_argument("--out", type=Path, default=Path("bench/results/memory-plan.md"))
    args = parser.parse_args()
    args.presets = args.presets or published_presets()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from solrl.config import load_config
    from solrl.stages.memory import GIB, GPU_SIZES, make_plan, measure, size

    lines = [
        f"# Memory plan of the published presets ({datetime.now():%Y-%m-%d})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        "counted on the meta device from the published configs (bf16 weights), fused attention. Peak per device, "
        "in GiB; `-` = does not fit; FSDP rows add, in brackets, each process's peak while it loads the whole "
        "pipeline before `fully_shard` cuts it. The micro-batch is the whole update's (rows split over the processes).",
        "",
    ]
    components = [
        "| preset | transformer | blocks | LoRA x3 | explore copy | VAE | text encoders | saved / sample "
        "| train peak / sample | checkpointed / sample | sample / image | decode / image | measured in |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    header = "| preset | layout | " + " | ".join(f"{name} explore / regen / update" for name in GPU_SIZES)
    header += " | largest explore batch / micro-batch (" + ", ".join(GPU_SIZES) + ") |"
    table = [header, "| --- | --- | " + " | ".join("---" for _ in GPU_SIZES) + " | --- |"]
    precisions = ["nvfp4", "nvfp4_emulated", "torchao_nvfp4", "fp8", "fp8_emulated", "torchao_fp8"]
    copies = [
        "| preset | explore.precision | " + " | ".join(precisions) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in precisions) + " |",
    ]
    checks = [
        "| preset | saved, full depth (counted) | extrapolated from 2 and 4 blocks | difference |",
        "| --- | ---: | ---: | ---: |",
    ]
    results = {}
    for preset in args.presets:
        cfg = load_config(preset)
        start = time.perf_counter()
        f = measure(cfg, weights_dtype=torch.bfloat16)
        seconds = time.perf_counter() - start
        plan80 = make_plan(cfg, f, int(80 * GIB))
        copy = next(s for s in plan80.stages if s.stage == "explore").parts.get("explore copy", 0)
        components.append(
            f"| {preset} | {size(f.transformer)} | {f.blocks} | {size(3 * f.lora)} | {size(copy)} | {size(f.vae)} | "
            f"{size(f.text_encoders)} | {size(f.saved.per_sample)} | {size(f.train.per_sample)} | "
            f"{size(f.train_checkpointed.per_sample)} | {size(f.sample.per_sample)} | {size(f.decode.per_sample)} | "
            f"{seconds:.1f} s |"
        )
        copies.append(
            f"| {preset} | {cfg.explore.precision} | "
            + " | ".join(f"{size(f.explore_copy[p])} ({f.explore_copy[p] / f.transformer:.2f}x)" for p in precisions)
            + " |"
        )
        for label, kwargs in LAYOUTS:
            cells, largest = [], []
            for gib in GPU_SIZES.values():
                plan = make_plan(cfg, f, int(gib * GIB), **kwargs)
                usable = plan.usable
                peaks = {s.stage: (f"{s.total / GIB:.0f}" if s.total <= usable else "-") for s in plan.stages}
                cell = " / ".join(peaks[stage] for stage in ("explore", "regenerate", "update"))
                cells.append(cell + (f" ({peaks['update load']})" if "update load" in peaks else ""))
                largest.append(f"{plan.largest_explore_batch} / {plan.largest_micro_batch}")
            table.append(f"| {preset} | {label} | " + " | ".join(cells) + " | " + "; ".join(largest) + " |")
        counted, predicted = extrapolation_check(cfg)
        checks.append(
            f"| {preset} | {size(counted)} | {size(predicted)} | {100 * (predicted - counted) / counted:+.1f}% |"
        )
        results[preset] = {"footprint": f.to_json(), "saved_full": counted, "saved_extrapolated": predicted}
        print(components[-1], flush=True)
    real = [
        "| preset | blocks kept | saved: meta / real bf16 CPU | peak: meta / real | seconds |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for preset in args.real:
        cfg = load_config(preset)
        for n in (2, 4):
            blocks = dict.fromkeys(depths(cfg), n)
            meta_saved, meta_peak = footprint_at(cfg, blocks)
            start = time.perf_counter()
            real_saved, real_peak = footprint_at(cfg, blocks, device="cpu")
            seconds = time.perf_counter() - start
            real.append(
                f"| {preset} | {n} of each kind | {size(meta_saved)} / {size(real_saved)} "
                f"({100 * (meta_saved - real_saved) / real_saved:+.1f}%) | {size(meta_peak)} / {size(real_peak)} "
                f"({100 * (meta_peak - real_peak) / real_peak:+.1f}%) | {seconds:.0f} |"
            )
            print(real[-1], flush=True)
    lines += [
        "## Components and per-sample activations",
        "",
        *components,
        "",
        "## The explore copy by precision: GiB beyond the policy, and as a fraction of the bf16 transformer",
        "",
        "Emulated copies built on the meta device and their own tensors summed (packed E2M1 codes, E4M3 block "
        "scales, tensor scales, merged LoRA layers the skip rule keeps in bf16); Transformer Engine's and torchao's "
        "counted from their storage layouts (`copy_bytes` of each backend). Frozen tensors are shared with the "
        "policy and count 0.",
        "",
        *copies,
        "",
        "## Per stage, per GPU",
        "",
        "Each preset at its own `explore.precision`, with `explore.keep_copy=host` (the default): the copy is on the "
        "GPU during explore only.",
        "",
        *table,
        "",
        "## Depth check: full depth counted against the 2- and 4-block extrapolation",
        "",
        *checks,
    ]
    if args.real:
        lines += ["", "## Meta counts against real bf16 tensors on CPU (micro-batch 1, published width)", "", *real]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
