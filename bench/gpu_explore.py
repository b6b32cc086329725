"""Explore throughput of a SANA-1600M-sized transformer per precision, for a lent GPU.

SanaTransformer2DModel with the 1.6B configuration (diffusers defaults: 20 layers, 70 heads x 32, cross-attention
2240, caption channels 2304), random init, 1024 px (DC-AE f32: 32 x 32 x 32 latents), 300 text tokens, batch
24, ``--steps`` Euler steps. For each precision this machine runs (bf16, fp8, nvfp4 via Transformer Engine;
fp8_emulated / nvfp4_emulated fake-quant for comparison) it reports images per second, the seconds to build
(merge + quantize) the explore copy, and peak GPU memory. One script, no network, under 10 minutes; writes
its table to ``$OUT/gpu_explore.md`` when ``OUT`` is set.

    python bench/gpu_explore.py                 # on a GPU
    python bench/gpu_explore.py --smoke         # tiny shapes on CPU: checks the script, not the numbers
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from diffusers import SanaTransformer2DModel

from solrl.stages.quant import quantize_model_
from solrl.stages.quant.availability import runnable_precisions, unavailable_reason

SANA_SKIP = (
    "patch_embed",
    "time_embed",
    "caption_projection",
    "proj_out",
    "norm",
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
)  # Sol-RL's SANA list: embedders, final layer, attn qkv; plus max(in, out) <= 2240
SANA_MIN_DIM = 2240


def build(smoke: bool, device: torch.device) -> tuple[SanaTransformer2DModel, dict[str, torch.Tensor]]:
    if smoke:
        net = SanaTransformer2DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=32,
            cross_attention_dim=64,
            caption_channels=32,
            sample_size=8,
            patch_size=1,
            interpolation_scale=1.0,
        )
        batch, latent, tokens, text = 4, (4, 8, 8), 8, 32
    else:
        net = SanaTransformer2DModel()  # the 1600M configuration
        batch, latent, tokens, text = 24, (32, 32, 32), 300, 2304
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net = net.to(device, dtype).eval().requires_grad_(False)
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, *latent, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(batch, tokens, text, generator=g).to(device, dtype),
        "encoder_attention_mask": torch.ones(batch, tokens, device=device),
    }
    return net, inputs


def explore_copy(net: torch.nn.Module, precision: str, smoke: bool) -> torch.nn.Module:
    import copy

    if precision == "bf16":
        return net
    min_dim = 0 if smoke else SANA_MIN_DIM
    clone = copy.deepcopy(net)
    if precision.endswith("_emulated"):
        quantize_model_(clone, fmt=precision.removesuffix("_emulated"), skip=SANA_SKIP, min_dim=min_dim)
        return clone
    from solrl.stages.quant.hardware import te_explore_copy

    return te_explore_copy(clone, precision, SANA_SKIP, min_dim)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure(net: torch.nn.Module, inputs: dict[str, torch.Tensor], steps: int, device: torch.device) -> float:
    """Seconds for one batch of ``steps`` Euler steps (after one warm-up step)."""
    x = inputs["hidden_states"].clone()
    batch = x.shape[0]
    net(**inputs, timestep=torch.full((batch,), 999.0, device=device))  # warm-up (TE/cuBLAS autotuning)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        sigma = 1.0 - i / steps
        v = net(**{**inputs, "hidden_states": x}, timestep=torch.full((batch,), sigma * 1000, device=device))[0]
        x = x - (1.0 / steps) * v.to(x.dtype)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU is fine")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "nvfp4", "fp8_emulated", "nvfp4_emulated"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    net, inputs = build(args.smoke, device)
    batch = inputs["hidden_states"].shape[0]
    params = sum(p.numel() for p in net.parameters())
    rows = []
    for precision in args.precisions:
        reason = unavailable_reason(precision)
        if reason is not None:
            rows.append(f"| {precision} | - | - | - | - | not run: {reason} |")
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        copy_net = explore_copy(net, precision, args.smoke)
        sync(device)
        copy_seconds = time.perf_counter() - start
        seconds = measure(copy_net, inputs, args.steps, device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rows.append(f"| {precision} | {batch / seconds:.2f} | {seconds:.2f} | {copy_seconds:.2f} | {peak:.1f} | |")
        del copy_net
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    table = "\n".join(
        [
            f"SanaTransformer2DModel {'smoke' if args.smoke else '1600M'} ({params / 1e6:.0f}M params), batch {batch}, "
            f"{args.steps} steps; {name}; torch {torch.__version__}; runnable: {', '.join(runnable_precisions())}",
            "",
            "| precision | images/s | s per batch | copy build s (merge + quantize) | peak GiB | note |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_explore.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
