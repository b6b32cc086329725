"""Where compiling the sampling copies pays: eager against compiled explore and regenerate, per preset.

For each preset (at its own pool, k, steps and batch sizes, or at ``--resolution``), one iteration's explore
(the preset's explore precision, ``explore.pool_size`` seeds for each of ``campaign.prompts_per_iteration``
prompts) and regeneration (the BF16 rollout, ``select.k`` seeds per prompt) are sampled eager and with the
transformer's repeated blocks compiled (``explore.compile`` / ``regenerate.compile``, ``--mode``). The compiled
copy's first pass includes the compile (dynamo + Inductor, measured by dynamo); the timed passes after it are
warm. Printed: images/s of each, the compile seconds, the largest output difference against eager, and the
iteration at which compiling has paid for itself (the first pass's extra seconds over the seconds saved per
iteration).

    .venv/bin/python bench/compile.py                                 # tiny-digits and the tiny families
    .venv/bin/python bench/compile.py --presets tiny-flux --resolution 128 --out bench/results/compile.md

One process per preset would give each its own cold compile; here they share one, as a campaign does, and
Inductor's on-disk cache is pointed at a fresh folder so every compile is cold.
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import math
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="solrl-bench-inductor-"))

import torch  # noqa: E402

from solrl.config import load_config  # noqa: E402
from solrl.stages.context import StageContext  # noqa: E402
from solrl.stages.quant.backends import sampling_network  # noqa: E402
from solrl.stages.sampling.rollout import generate  # noqa: E402
from solrl.stages.sampling.samplers import derive_seed  # noqa: E402

PRESETS = ("tiny-digits", "tiny-sana", "tiny-flux", "tiny-sd3")


def _sample(policy, precision: str, prompts, seeds, steps: int, batch: int, *, compile: bool, mode: str):
    """One pass: (final latents, seconds, compile stats or None)."""
    start = time.perf_counter()
    with sampling_network(policy, precision, compile=compile, mode=mode) as (net, stats):
        latents = generate(policy.model, net, prompts, seeds, steps, batch, desc=precision).samples
    return latents, time.perf_counter() - start, stats


def measure(preset: str, overrides: list[str], mode: str, repeats: int) -> list[dict]:
    """Rows for one preset: explore then regenerate, eager and compiled."""
    cfg = load_config(preset, overrides)
    scratch = Path(tempfile.mkdtemp(prefix="solrl-bench-compile-"))
    policy = StageContext(cfg, scratch, "bench", 1).load_policy(None)
    prompts = cfg.train_prompts()[: cfg.campaign.prompts_per_iteration]
    rows = []
    stages = (
        ("explore", cfg.explore.precision, cfg.explore.pool_size, cfg.explore.steps, cfg.explore.batch_size),
        ("regenerate", "bf16", cfg.select.k, cfg.regenerate.steps, cfg.regenerate.batch_size),
    )
    for stage, precision, per_prompt, steps, batch in stages:
        flat = [p for p in prompts for _ in range(per_prompt)]
        seeds = [derive_seed(7, "compile-bench", i) for i in range(len(flat))]
        _sample(policy, precision, flat, seeds, steps, batch, compile=False, mode=mode)  # warm the eager path
        eager = min(
            _sample(policy, precision, flat, seeds, steps, batch, compile=False, mode=mode)[1] for _ in range(repeats)
        )
        reference = _sample(policy, precision, flat, seeds, steps, batch, compile=False, mode=mode)[0]
        out, first, stats = _sample(policy, precision, flat, seeds, steps, batch, compile=True, mode=mode)
        warm = [_sample(policy, precision, flat, seeds, steps, batch, compile=True, mode=mode) for _ in range(repeats)]
        compiled = min(w[1] for w in warm)
        assert stats is not None and all(w[2].graphs == 0 for w in warm), "a warm pass recompiled"
        saved = eager - compiled
        warm_up = first - compiled  # what the first compiled pass cost over a warm one: the compile, all of it
        rows.append(
            {
                "preset": preset,
                "size": f"{policy.model.decode(reference[:1]).shape[1]} px",
                "stage": stage,
                "precision": precision,
                "images": len(flat),
                "steps": steps,
                "eager_ips": len(flat) / eager,
                "compiled_ips": len(flat) / compiled,
                "speedup": eager / compiled,
                "compile_s": stats.seconds,
                "first_pass_s": first,
                "graphs": stats.graphs,
                "max_diff": float((out - reference).abs().max()),
                "warm_up_s": warm_up,
                "pays_at": math.ceil(warm_up / saved) if saved > 0 else math.inf,
            }
        )
        print(rows[-1], flush=True)
    return rows


def render(rows: list[dict], mode: str, repeats: int) -> str:
    """The markdown table of ``measure``'s rows, with the machine and how to read it."""
    lines = [
        "| preset | size | stage | precision | images x steps | eager img/s | compiled img/s | speed-up "
        "| compile s (dynamo) | warm-up s | max abs diff | pays at iteration |",
        "|" + " --- |" * 12,
    ]
    for r in rows:
        pays = "never" if math.isinf(r["pays_at"]) else str(r["pays_at"])
        lines.append(
            f"| {r['preset']} | {r['size']} | {r['stage']} | {r['precision']} | {r['images']} x {r['steps']} "
            f"| {r['eager_ips']:.1f} | {r['compiled_ips']:.1f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} "
            f"| {r['warm_up_s']:.1f} "
            f"| {r['max_diff']:.2e} | {pays} |"
        )
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, mode {mode}"
    )
    notes = (
        f"\nOne iteration's explore and regeneration per preset (its prompts per iteration, pool, k, steps, batch "
        f"sizes), fastest of {repeats} warm passes. compile s: dynamo + Inductor inside the first compiled pass "
        f"(cold cache), as dynamo times it; warm-up s: the first compiled pass less a warm one (the whole cost, "
        f"Inductor's start-up included); pays at: warm-up s / seconds saved per iteration by that stage, rounded "
        f"up. Regeneration, audit and evaluation share the BF16 rollout's graphs, so they pay its compile once. "
        f"Machine: {machine}."
    )
    return "\n".join(lines) + "\n" + notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--resolution", type=int, default=None, help="model.resolution of the tiny families")
    parser.add_argument("--mode", default="default", help="torch.compile mode (model.compile_mode)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each; the fastest is kept")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()

    rows = []
    for preset in args.presets:
        overrides = [f"model.resolution={args.resolution}"] if args.resolution and preset != "tiny-digits" else []
        rows += measure(preset, overrides, args.mode, args.repeats)
    table = render(rows, args.mode, args.repeats)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
