"""Explore throughput of each published preset's transformer at its published size per precision, for a lent GPU.

Every shipped preset of a published family (``solrl.weights.published_presets``; a new family's preset is picked up
without an edit here), its transformer and VAE built by the family's own ``meta_adapter`` from the published configs
(the weights folder's, else those shipped in ``solrl/stages/models/published/``) with random weights at full depth,
sampled through the adapter's own ``velocity`` on ``conditioning_like`` text embeddings (the shapes its text
encoders give, random values) and ``latent_shape`` noise at the preset's resolution. Batch 24, ``--steps`` Euler
steps. Layers are quantized by the preset's Sol-RL skip rule (the adapter's NVFP4 skip list and
``max(in, out) <= explore.min_dim``). For each precision this machine runs (bf16; fp8, nvfp4 via Transformer Engine;
torchao_fp8, torchao_nvfp4 via torchao; fp8_emulated / nvfp4_emulated fake-quant for comparison), eager and with the
repeated blocks compiled (``explore.compile``; the Sol-RL release compiles both copies with
``max-autotune-no-cudagraphs`` and measures its speed-ups against a compiled BF16 baseline, so the last column
compares each row with compiled bf16), it reports images per second, the compile seconds, the seconds to build
(merge + quantize) the explore copy, the copy's bytes as built beside what the memory plan counts for it (Transformer
Engine's and torchao's are counted from shapes, so only a GPU checks them), and peak GPU memory. Transformer
Engine's layers are compiled around (they run eager inside the compiled blocks). One script, no network; writes
its tables to ``--out``, else ``$OUT/gpu_explore.md`` when ``OUT`` is set, after each preset. On an H200
the emulated rows at batch 24 may take minutes: pick with ``--presets``, ``--precisions`` and ``--compile``.

    python bench/gpu_explore.py                          # on a GPU: every published preset, eager and compiled
    python bench/gpu_explore.py --presets sana-1600m --batch 8 --compile compiled
    python bench/gpu_explore.py --smoke                  # every tiny twin on CPU: checks the script, not the numbers
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from solrl.config import RunConfig, list_presets, load_config
from solrl.registry import EXPLORE_BACKENDS
from solrl.stages.models import model_family
from solrl.stages.models.adapter import ModelAdapter
from solrl.stages.models.policy import owned_bytes
from solrl.stages.quant.availability import HARDWARE, runnable_precisions, unavailable_reason
from solrl.stages.sampling.compiled import compiled_blocks
from solrl.weights import published_presets


def tiny_presets() -> list[str]:
    """The shipped presets of the tiny twins (``model.source: tiny``: random-weight families built on CPU)."""
    return [p for p in list_presets() if load_config(p, plugins=False).model.source == "tiny"]


def build(cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> ModelAdapter:
    """The preset's adapter over its transformer and VAE at full depth with random weights in ``dtype`` on
    ``device`` (built there in ``dtype``: FLUX.2-dev's 32B in float32 would not fit)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        adapter = model_family(cfg.model).meta_adapter(cfg.model, dtype, device=str(device))[0]
    finally:
        torch.set_default_dtype(default)
    adapter.transformer.eval().requires_grad_(False)
    return adapter


def explore_copy(net: torch.nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> torch.nn.Module:
    """The product's explore copy of ``net`` (a plain transformer: nothing merged; frozen tensors shared)."""
    if precision == "bf16":
        return net
    if precision.endswith("_emulated"):
        from solrl.stages.quant.backends import emulated_copy

        return emulated_copy(net, precision.removesuffix("_emulated"), skip, min_dim)
    if precision.startswith("torchao_"):
        from solrl.stages.quant.ao import ao_explore_copy

        return ao_explore_copy(net, precision, skip, min_dim)
    from solrl.stages.quant.hardware import te_explore_copy

    return te_explore_copy(net, precision, skip, min_dim)


def planned_copy_gib(net: torch.nn.Module, precision: str, skip: tuple[str, ...], min_dim: int) -> str:
    """The memory plan's explore copy of ``net`` in GiB (``copy_bytes``), for the backends whose copy the plan
    counts from shapes (Transformer Engine, torchao: their tensors need a GPU, so only a GPU checks the count).
    The emulated copies are measured by the plan itself (built on the meta device), and bf16 has none: "-"."""
    if precision == "bf16" or precision.endswith("_emulated"):
        return "-"
    return f"{EXPLORE_BACKENDS.get(precision).copy_bytes(net, skip, min_dim) / 2**30:.2f}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure(adapter: ModelAdapter, net: torch.nn.Module, batch: int, steps: int, device: torch.device) -> float:
    """Seconds for one batch of ``steps`` Euler steps of ``net`` through the adapter's ``velocity`` (after one warm-up
    step), from ``latent_shape`` noise on ``conditioning_like`` embeddings with random values."""
    g = torch.Generator().manual_seed(0)
    cond = {
        k: torch.randn(v.shape, generator=g).to(device, v.dtype) if v.is_floating_point() else v
        for k, v in adapter.conditioning_like(batch).items()
    }
    x = torch.randn(batch, *adapter.latent_shape, generator=g).to(device, torch.float32)
    adapter.velocity(net, x, torch.full((batch,), 0.999, device=device), cond)  # warm-up (TE/cuBLAS autotuning)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        sigma = 1.0 - i / steps
        v = adapter.velocity(net, x, torch.full((batch,), sigma, device=device), cond)
        x = x - (1.0 / steps) * v.float()
    sync(device)
    return time.perf_counter() - start


def run_case(preset: str, args: argparse.Namespace, device: torch.device) -> str:
    """The table of one preset: a row per precision."""
    cfg = load_config(preset)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    adapter = build(cfg, device, dtype)
    net, skip, min_dim = adapter.transformer, adapter.explore_skip, cfg.explore.min_dim
    batch = 4 if args.smoke else args.batch
    params = sum(p.numel() for p in net.parameters())
    variants = {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]
    rows, measured = [], {}
    for precision in args.precisions:
        reason = unavailable_reason(precision)
        if reason is not None:
            rows.append((precision, "-", None, f"| - | - | - | - | - | - | - | not run: {reason} |"))
            continue
        for compiled in variants:
            label = "compiled" if compiled else "eager"
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                start = time.perf_counter()
                copy_net = explore_copy(net, precision, skip, min_dim)
                sync(device)
                copy_seconds = time.perf_counter() - start
                copy_gib = (
                    f"{owned_bytes(copy_net, net) / 2**30:.2f} | {planned_copy_gib(net, precision, skip, min_dim)}"
                )
                compile_seconds = float("nan")
                if compiled:
                    eager = EXPLORE_BACKENDS.get(precision).eager_layer
                    repeated = adapter.repeated_blocks
                    with compiled_blocks(copy_net, args.mode, fallback=repeated, eager=eager, what=precision) as st:
                        seconds = measure(adapter, copy_net, batch, args.steps, device)
                    compile_seconds = st.seconds
                else:
                    seconds = measure(adapter, copy_net, batch, args.steps, device)
            except Exception as exc:  # one failing backend must not hide the others' rows
                failed = f"failed: {exc.__class__.__name__}: {str(exc)[:160]}"
                rows.append((precision, label, None, f"| - | - | - | - | - | - | - | {failed} |"))
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            measured[precision, label] = seconds
            cells = (
                f"| {batch / seconds:.2f} | {seconds:.2f} | {compile_seconds:.1f} | {copy_seconds:.2f} | {copy_gib} "
                f"| {peak:.1f} |"
            )
            rows.append((precision, label, seconds, cells))
            del copy_net
    del net, adapter
    baseline = measured.get(("bf16", "compiled"))
    lines = []
    for precision, label, seconds, cells in rows:
        ratio = f"{baseline / seconds:.2f}x" if baseline and seconds else "-"
        lines.append(f"| {precision} | {label} {cells} {ratio} |" if seconds else f"| {precision} | {label} {cells}")
    resolution = cfg.model.resolution or "default"
    return "\n".join(
        [
            f"{preset} ({cfg.model.family}, {'smoke' if args.smoke else 'published size'}, {params / 1e6:.0f}M "
            f"params, {resolution} px), batch {batch}, {args.steps} steps, min_dim {min_dim}",
            "",
            "| precision | run | images/s | s per batch | compile s | copy build s (merge + quantize) "
            "| copy GiB (built) | copy GiB (planned) | peak GiB | speed-up over compiled bf16 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU is fine")
    parser.add_argument("--presets", nargs="+", default=None, help="default: every published preset (--smoke: tiny)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=24, help="images per batch (Sol-RL's rollout batch: 24)")
    parser.add_argument("--precisions", nargs="+", default=["bf16", *HARDWARE, "fp8_emulated", "nvfp4_emulated"])
    parser.add_argument("--compile", choices=["eager", "compiled", "both"], default="both")
    parser.add_argument(
        "--mode", default=None, help="torch.compile mode; default max-autotune-no-cudagraphs on a GPU (as Sol-RL)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the tables' file (default $OUT/gpu_explore.md)")
    args = parser.parse_args()
    out = args.out or (Path(os.environ["OUT"], "gpu_explore.md") if os.environ.get("OUT") else None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    args.mode = args.mode or ("max-autotune-no-cudagraphs" if device.type == "cuda" else "default")
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    header = f"{name}; torch {torch.__version__}; runnable: {', '.join(runnable_precisions())}"
    tables = [header]
    for preset in args.presets or (tiny_presets() if args.smoke else published_presets()):
        tables.append(run_case(preset, args, device))
        print(tables[-1] + "\n", flush=True)
        if out is not None:  # after each preset: a run stopped at its time limit keeps the tables it made
            out.write_text("\n\n".join(tables) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
