"""Explore throughput of each family's transformer at its published size per precision, for a lent GPU.

Each family's transformer class at its published configuration with random weights: SANA 1.6B (diffusers'
defaults; 1024 px, DC-AE f32 latents 32 x 32 x 32, 300 Gemma tokens), FLUX.1-dev (diffusers' defaults with the
guidance embedding; 512 px, 1024 packed tokens, 512 T5 tokens), SD3.5-Large (38 blocks of 38 x 64; 1024 px,
128 x 128 x 16 latents, 333 text tokens); the newer families at diffusers' default configuration of their class,
which is the flagship published one: Z-Image-Turbo 6B (512 px, 128 caption tokens of Qwen3-4B), Qwen-Image 20B
(512 px, 128 Qwen2.5-VL tokens), FLUX.2-dev 32B (512 px, 512 Mistral-3 tokens x 3 layers), Wan2.1-T2V 14B
(256 px x 13 frames, 512 UMT5 tokens); FLUX.2-klein 4B, which is not a diffusers default: 5 double and 20 single
blocks (as its ports describe it), 24 heads of 128 inferred from its 4B parameters (3.9B with these), 512 Qwen3-4B
tokens x 3 layers of 2560. Batch 24, ``--steps`` Euler steps. Layers are quantized by each
family's Sol-RL skip rule (its adapter's NVFP4 skip list and ``max(in, out) <= min_dim``). For each
precision this machine runs (bf16, fp8, nvfp4 via Transformer Engine; fp8_emulated / nvfp4_emulated
fake-quant for comparison), eager and with the repeated blocks compiled (``explore.compile``; the Sol-RL
release compiles both copies with ``max-autotune-no-cudagraphs`` and measures its speed-ups against a compiled
BF16 baseline, so the last column compares each row with compiled bf16), it reports images per second, the
compile seconds, the seconds to build (merge + quantize) the explore copy, and peak GPU memory. Transformer
Engine's layers are compiled around (they run eager inside the compiled blocks). One script, no network;
writes its tables to ``$OUT/gpu_explore.md`` when ``OUT`` is set. On an H200 the emulated rows of FLUX and
SD3.5 at batch 24 may take minutes: pick with ``--families``, ``--precisions`` and ``--compile``.

    python bench/gpu_explore.py                          # on a GPU: every family, eager and compiled
    python bench/gpu_explore.py --families sana --batch 8 --compile compiled
    python bench/gpu_explore.py --smoke                  # tiny shapes on CPU: checks the script, not the numbers
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from solrl.registry import EXPLORE_BACKENDS
from solrl.stages.models.flux import Flux, TinyFlux
from solrl.stages.models.flux2 import Flux2, Flux2Klein, TinyFlux2, TinyFlux2Dev
from solrl.stages.models.qwen_image import QwenImage, TinyQwenImage
from solrl.stages.models.sana import Sana, TinySana
from solrl.stages.models.sd3 import SD3, TinySD3
from solrl.stages.models.wan import TinyWan, Wan
from solrl.stages.models.z_image import TinyZImage, ZImage
from solrl.stages.quant.availability import runnable_precisions, unavailable_reason
from solrl.stages.sampling.compiled import compiled_blocks


@dataclass(frozen=True)
class Case:
    """One family's transformer at its published size (random weights), its explore skip rule and inputs."""

    family: type  # the solrl model family (its NVFP4 skip list)
    min_dim: int  # Sol-RL's max(in, out) <= min_dim rule
    build: Callable[[bool], torch.nn.Module]  # smoke -> transformer
    inputs: Callable[[bool, int, torch.device, torch.dtype], dict[str, torch.Tensor]]  # smoke, batch -> kwargs
    timestep_scale: float  # the transformer's timestep for sigma = 1 (1000, or 1 for FLUX)
    #: ``(net, x, timestep, inputs) -> v`` for a transformer not called as ``net(hidden_states=x, timestep=t,
    #: **inputs)`` (Z-Image takes lists); None for those that are.
    call: Callable[..., torch.Tensor] | None = None


def _randn(g: torch.Generator, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device, dtype)


def _sana(smoke: bool) -> torch.nn.Module:
    from diffusers import SanaTransformer2DModel

    if smoke:
        return TinySana.tiny_transformer()  # the tiny CPU family's transformer
    return SanaTransformer2DModel()  # diffusers' defaults are the 1600M configuration


def _sana_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    latent, tokens, text = ((4, 8, 8), 8, 32) if smoke else ((32, 32, 32), 300, 2304)  # 1024 px, DC-AE f32c32
    return {
        "hidden_states": _randn(g, device, dtype, batch, *latent),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
        "encoder_attention_mask": torch.ones(batch, tokens, device=device),
    }


def _flux(smoke: bool) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    if smoke:
        return TinyFlux.tiny_transformer()  # the tiny CPU family's transformer
    return FluxTransformer2DModel(guidance_embeds=True)  # diffusers' defaults are FLUX.1; dev has guidance


def _flux_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 512 px: 64 x 64 x 16 latents packed 2x2 -> 1024 tokens of 64; T5 512 x 4096; CLIP pooled 768
    side, channels, tokens, text, pooled = (4, 16, 8, 32, 32) if smoke else (32, 64, 512, 4096, 768)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    return {
        "hidden_states": _randn(g, device, dtype, batch, side * side, channels),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
        "pooled_projections": _randn(g, device, dtype, batch, pooled),
        "img_ids": ids.reshape(-1, 3).to(device, dtype),
        "txt_ids": torch.zeros(tokens, 3, device=device, dtype=dtype),
        "guidance": torch.ones(batch, device=device),
    }


def _sd3(smoke: bool) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    if smoke:
        return TinySD3.tiny_transformer()  # the tiny CPU family's transformer
    return SD3Transformer2DModel(  # the SD3.5-Large configuration
        sample_size=128,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=38,
        attention_head_dim=64,
        num_attention_heads=38,
        joint_attention_dim=4096,
        caption_projection_dim=2432,
        pooled_projection_dim=2048,
        pos_embed_max_size=192,
        qk_norm="rms_norm",
    )


def _sd3_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 1024 px: 128 x 128 x 16 latents; CLIP-L + CLIP-G + T5 256 tokens of 4096; pooled 2048
    latent, tokens, text, pooled = ((4, 16, 16), 8, 64, 48) if smoke else ((16, 128, 128), 77 + 256, 4096, 2048)
    return {
        "hidden_states": _randn(g, device, dtype, batch, *latent),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
        "pooled_projections": _randn(g, device, dtype, batch, pooled),
    }


def _z_image(smoke: bool) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel

    return TinyZImage.tiny_transformer() if smoke else ZImageTransformer2DModel()  # defaults: Z-Image-Turbo 6B


def _z_image_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 512 px: 64 x 64 x 16 latents (2x2 patches inside); 128 caption rows of Qwen3-4B's 2560
    latent, tokens, text = ((16, 16, 16), 8, 32) if smoke else ((16, 64, 64), 128, 2560)
    return {
        "hidden_states": _randn(g, device, dtype, batch, *latent),
        "captions": _randn(g, device, dtype, tokens, text),
    }


def _z_image_call(net: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, inputs: dict) -> torch.Tensor:
    """Z-Image's list inputs: one ``[C, 1, h, w]`` latent and one caption per sample."""
    out = net(list(x.unsqueeze(2).unbind(0)), t, [inputs["captions"]] * len(x), return_dict=False)[0]
    return torch.stack(out).squeeze(2)


def _qwen_image(smoke: bool) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return TinyQwenImage.tiny_transformer() if smoke else QwenImageTransformer2DModel()  # defaults: the 20B


def _qwen_image_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    # 512 px: 64 x 64 x 16 latents packed 2x2 -> 1024 tokens of 64; 128 Qwen2.5-VL rows of 3584
    side, channels, tokens, text = (4, 16, 8, 32) if smoke else (32, 64, 128, 3584)
    return {
        "hidden_states": _randn(g, device, dtype, batch, side * side, channels),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
        "img_shapes": [[(1, side, side)]] * batch,
    }


def _flux2(smoke: bool) -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    return TinyFlux2Dev.tiny_transformer() if smoke else Flux2Transformer2DModel()  # defaults: FLUX.2-dev 32B


def _flux2_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 512 px: 32 x 32 patchified latents of 128 -> 1024 tokens; 512 Mistral-3 tokens x 3 layers of 5120
    side, channels, tokens, text = (4, 16, 8, 48) if smoke else (32, 128, 512, 15360)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(side), torch.arange(side), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(tokens))
    return {
        "hidden_states": _randn(g, device, dtype, batch, side * side, channels),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
        "img_ids": img_ids.expand(batch, -1, -1).to(device),
        "txt_ids": txt_ids.expand(batch, -1, -1).to(device),
        "guidance": torch.full((batch,), 4.0, device=device),
    }


def _flux2_klein(smoke: bool) -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    if smoke:
        return TinyFlux2.tiny_transformer()
    return Flux2Transformer2DModel(
        num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False
    )


def _flux2_klein_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    inputs = _flux2_inputs(smoke, batch, device, dtype)
    g = torch.Generator().manual_seed(1)
    tokens, text = inputs["encoder_hidden_states"].shape[1], 48 if smoke else 7680
    return {**inputs, "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text), "guidance": None}


def _wan(smoke: bool) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return TinyWan.tiny_transformer() if smoke else WanTransformer3DModel()  # defaults: Wan2.1-T2V 14B


def _wan_inputs(smoke: bool, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 256 px x 13 frames: 16 x 4 x 32 x 32 latents (1024 tokens of 1 x 2 x 2 patches); 512 UMT5 tokens of 4096
    latent, tokens, text = ((16, 2, 4, 4), 8, 32) if smoke else ((16, 4, 32, 32), 512, 4096)
    return {
        "hidden_states": _randn(g, device, dtype, batch, *latent),
        "encoder_hidden_states": _randn(g, device, dtype, batch, tokens, text),
    }


#: Families by name; min_dim 0 for the newer ones (issue 19's rule: attention and MLP projections quantized, the
#: skip list keeps embedders, norms, modulation and final layers).
CASES = {
    "sana": Case(Sana, 2240, _sana, _sana_inputs, 1000.0),
    "flux": Case(Flux, 1000, _flux, _flux_inputs, 1.0),
    "sd3": Case(SD3, 2432, _sd3, _sd3_inputs, 1000.0),
    "z-image": Case(ZImage, 0, _z_image, _z_image_inputs, 1.0, _z_image_call),
    "qwen-image": Case(QwenImage, 0, _qwen_image, _qwen_image_inputs, 1.0),
    "flux2": Case(Flux2, 0, _flux2, _flux2_inputs, 1.0),
    "flux2-klein": Case(Flux2Klein, 0, _flux2_klein, _flux2_klein_inputs, 1.0),
    "wan": Case(Wan, 0, _wan, _wan_inputs, 1000.0),
}


def explore_copy(net: torch.nn.Module, precision: str, case: Case, smoke: bool) -> torch.nn.Module:
    """The product's explore copy of ``net`` (a plain transformer: nothing merged; frozen tensors shared)."""
    if precision == "bf16":
        return net
    min_dim = 0 if smoke else case.min_dim
    skip = case.family.nvfp4_skip
    if precision.endswith("_emulated"):
        from solrl.stages.quant.backends import emulated_copy

        return emulated_copy(net, precision.removesuffix("_emulated"), skip, min_dim)
    from solrl.stages.quant.hardware import te_explore_copy

    return te_explore_copy(net, precision, skip, min_dim)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure(
    net: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    steps: int,
    scale: float,
    device: torch.device,
    call: Callable[..., torch.Tensor] | None = None,
) -> float:
    """Seconds for one batch of ``steps`` Euler steps (after one warm-up step); timestep = sigma x ``scale``;
    ``call`` the family's own transformer call (``Case.call``), if any."""

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if call is not None:
            return call(net, x, t, inputs)
        return net(**{**inputs, "hidden_states": x}, timestep=t, return_dict=False)[0]

    x = inputs["hidden_states"].clone()
    batch = x.shape[0]
    velocity(x, torch.full((batch,), 0.999 * scale, device=device))  # warm-up (TE/cuBLAS autotuning)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        sigma = 1.0 - i / steps
        v = velocity(x, torch.full((batch,), sigma * scale, device=device))
        x = x - (1.0 / steps) * v.to(x.dtype)
    sync(device)
    return time.perf_counter() - start


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> str:
    """The table of one family: a row per precision."""
    case = CASES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place: FLUX.2-dev's 32B in float32 on the host would need 128 GB
    try:
        with torch.device(device):
            net = case.build(args.smoke)
    finally:
        torch.set_default_dtype(default)
    net = net.to(device, dtype).eval().requires_grad_(False)
    batch = 4 if args.smoke else args.batch
    inputs = case.inputs(args.smoke, batch, device, dtype)
    params = sum(p.numel() for p in net.parameters())
    variants = {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]
    rows, measured = [], {}
    for precision in args.precisions:
        reason = unavailable_reason(precision)
        if reason is not None:
            rows.append((precision, "-", None, f"| - | - | - | - | - | not run: {reason} |"))
            continue
        for compiled in variants:
            label = "compiled" if compiled else "eager"
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                start = time.perf_counter()
                copy_net = explore_copy(net, precision, case, args.smoke)
                sync(device)
                copy_seconds = time.perf_counter() - start
                compile_seconds = float("nan")
                if compiled:
                    eager = EXPLORE_BACKENDS.get(precision).eager_layer
                    repeated = case.family.repeated_blocks
                    with compiled_blocks(copy_net, args.mode, fallback=repeated, eager=eager, what=precision) as st:
                        seconds = measure(copy_net, inputs, args.steps, case.timestep_scale, device, case.call)
                    compile_seconds = st.seconds
                else:
                    seconds = measure(copy_net, inputs, args.steps, case.timestep_scale, device, case.call)
            except Exception as exc:  # one failing backend must not hide the others' rows
                failed = f"failed: {exc.__class__.__name__}: {str(exc)[:160]}"
                rows.append((precision, label, None, f"| - | - | - | - | - | {failed} |"))
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            measured[precision, label] = seconds
            cells = (
                f"| {batch / seconds:.2f} | {seconds:.2f} | {compile_seconds:.1f} | {copy_seconds:.2f} | {peak:.1f} |"
            )
            rows.append((precision, label, seconds, cells))
            del copy_net
    del net
    baseline = measured.get(("bf16", "compiled"))
    lines = []
    for precision, label, seconds, cells in rows:
        ratio = f"{baseline / seconds:.2f}x" if baseline and seconds else "-"
        lines.append(f"| {precision} | {label} {cells} {ratio} |" if seconds else f"| {precision} | {label} {cells}")
    title = type(case.build).__name__
    return (
        "\n".join(
            [
                f"{name} ({'smoke' if args.smoke else 'published size'}, {params / 1e6:.0f}M params), batch {batch}, "
                f"{args.steps} steps",
                "",
                "| precision | run | images/s | s per batch | compile s | copy build s (merge + quantize) | peak GiB "
                "| speed-up over compiled bf16 |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |",
                *lines,
            ]
        )
        if title
        else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU is fine")
    parser.add_argument("--families", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=24, help="images per batch (Sol-RL's rollout batch: 24)")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8", "nvfp4", "fp8_emulated", "nvfp4_emulated"])
    parser.add_argument("--compile", choices=["eager", "compiled", "both"], default="both")
    parser.add_argument(
        "--mode", default=None, help="torch.compile mode; default max-autotune-no-cudagraphs on a GPU (as Sol-RL)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    args.mode = args.mode or ("max-autotune-no-cudagraphs" if device.type == "cuda" else "default")
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    header = f"{name}; torch {torch.__version__}; runnable: {', '.join(runnable_precisions())}"
    tables = [header]
    for family in args.families:
        tables.append(run_case(family, args, device))
        print(tables[-1] + "\n", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_explore.md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
