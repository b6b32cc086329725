"""One iteration of every family at its published width and resolution, in bfloat16 on CPU (issue 20).

For each published preset: the family's pipeline at its published widths with random weights
(``solrl.stages.models.random_pipeline``: the published transformer config with its depth cut to ``--blocks``
blocks of each kind, the published VAE and scheduler), prompt embeddings of the published text encoders' width, and
a PickScore reward whose CLIP has ViT-H/14's widths and PickScore's published preprocessing (224 px) at one layer
per tower. The preset runs as published except for what makes it one small iteration: ``model.device=cpu``,
``model.dtype=bfloat16``, ``explore.precision=nvfp4_emulated`` (NVFP4 of the bf16 weights), pool 2 -> keep 2,
1 explore step and 2 regenerate steps, micro-batch 1, one prompt, one evaluation seed at 2 steps, no audit, no
compile. It runs through the Prefect flow (``campaign``), each preset in a process of its own, and the table gives
each stage's seconds (from its manifest) and the process's peak resident memory.

    .venv/bin/python bench/published_size.py                        # every family (about 20 minutes on 2 cores)
    .venv/bin/python bench/published_size.py sd35-medium --blocks 2  # some presets, 2 blocks of each kind

What a row checks: no dtype, shape or device error anywhere in the iteration (LoRA over the bf16 base, the NVFP4
emulation, the VAE decode at the real resolution, the reward's preprocessing of real-size images, the update's
backward and the diffusers-format LoRA of the checkpoint), and finite losses.
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from solrl.weights import published_presets

#: What running a preset here found, and how it was fixed (kept with the table).
FOUND = {
    "qwen-image": "explore.steps=1 gave NaN sigmas: the scheduler's terminal stretch (shift_terminal 0.02) divides "
    "by 1 - sigma = 0 for a single step; a one-step grid is now [1, 0] for every family (test_families)",
}
STAGE_ORDER = [
    "explore",
    "score_explore",
    "select",
    "regenerate",
    "score_regenerate",
    "update",
    "checkpoint",
    "evaluate",
]


def pickscore_at_published_width(out: Path) -> Path:
    """PickScore's CLIP (ViT-H/14: vision 1280 wide, 16 heads, patch 14 at 224 px; text 1024 wide; projection
    1024) at one layer per tower, random weights, with PickScore's published preprocessing (shortest edge 224,
    centre crop 224, CLIP's mean and std) and solrl's tiny CLIP tokenizer."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from solrl.stages.models.tiny_components import clip_model, clip_tokenizer

    tokenizer = clip_tokenizer()
    text = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16)
    vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=1, num_attention_heads=16)
    clip_model(tokenizer, text, vision | dict(image_size=224, patch_size=14), 1024).save_pretrained(out)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(out)
    return out


def overrides(preset: str, root: Path, weights: Path, reward: Path, blocks: int, extra: list[str]) -> list[str]:
    """The preset's overrides for one small bf16 CPU iteration (module docstring)."""
    (root / "train.txt").write_text("a photo of a red bicycle leaning on a wall\n")
    (root / "eval.txt").write_text("a photo of two cats on a sofa\n")
    return [
        f"storage.root={root / 'store'}",
        f"model.path={weights}",
        "model.device=cpu",
        "model.dtype=bfloat16",
        "explore.precision=nvfp4_emulated",
        "explore.compile=false",
        "regenerate.compile=false",
        "explore.pool_size=2",
        "explore.steps=1",
        "explore.batch_size=2",
        "select.k=2",
        "regenerate.steps=2",
        "regenerate.batch_size=2",
        "train.micro_batch=1",
        "train.timestep_fraction=0.5",
        "reward.weights={pickscore: 1.0}",
        "reward.evaluate=[pickscore]",
        f"reward.models={{pickscore: {{path: {reward}}}}}",
        "fidelity.audit_every=0",
        "tracking.grid_prompts=1",
        "storage.pool=full",  # the row records the explore pool's images (a campaign keeps latents by default)
        "campaign.iterations=1",
        "campaign.prompts_per_iteration=1",
        f"campaign.prompts_file={root / 'train.txt'}",
        f"campaign.eval_prompts_file={root / 'eval.txt'}",
        "campaign.eval_seeds=1",
        "campaign.eval_steps=2",
        "campaign.eval_every=1",
        *extra,
    ]


def run_one(preset: str, blocks: int, extra: list[str]) -> dict:
    """One preset's iteration in this process: returns its row (seconds per stage, peak RSS, parameters)."""
    import torch
    from safetensors import safe_open

    from solrl.config import load_config
    from solrl.flows.sol_rl import campaign
    from solrl.stages.checkpoint import LORA_FOLDER
    from solrl.stages.context import _POLICIES, StageContext
    from solrl.stages.models import model_family
    from solrl.stages.models.lora import LORA_WEIGHTS
    from solrl.stages.models.random_pipeline import write_random_embeddings, write_random_pipeline
    from solrl.storage.artifacts import CandidatePool, TrainedState, UpdateMetrics
    from solrl.storage.runs import create_run
    from solrl.storage.stage import read_manifest, stage_dir

    published = load_config(preset)
    row: dict = {"preset": preset, "family": published.model.family, "blocks": blocks}
    with tempfile.TemporaryDirectory(prefix=f"solrl-published-{preset}-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        weights = write_random_pipeline(published.model, root / "weights", blocks=blocks, dtype=torch.bfloat16)
        reward = pickscore_at_published_width(root / "pickscore")
        row["build_s"] = round(time.perf_counter() - started, 1)
        cfg = load_config(preset, overrides(preset, root, weights, reward, blocks, extra))
        run = create_run(cfg, "published")
        ctx = StageContext(cfg, run.run_dir, run.run_id, 0)
        prompts, cache = ctx.prompt_embeddings()
        family = model_family(cfg.model)
        meta, _, _ = family.meta_adapter(cfg.model, torch.bfloat16)
        write_random_embeddings(meta, prompts, cache)
        transformer_config = json.loads((weights / "transformer" / "config.json").read_text())
        row["depth"] = {k: transformer_config[k] for k in family.depth_keys}
        row["resolution"] = meta.resolution
        row["frames"] = cfg.model.num_frames
        del meta
        started = time.perf_counter()
        campaign(str(run.run_dir.parent), run.run_id)
        row["flow_s"] = round(time.perf_counter() - started, 1)
        row["stages"] = {}
        for iteration in (0, 1):
            for stage in STAGE_ORDER:
                manifest = read_manifest(run.run_dir, iteration, stage)
                if manifest is not None:
                    row["stages"][f"{stage}[{iteration}]"] = manifest.seconds
        pool = CandidatePool.load(run.run_dir, 1).images
        row["pool"] = {"shape": list(pool.shape), "dtype": str(pool.dtype)}
        trained = TrainedState.load(run.run_dir, 1).sections["policy"]
        row["lora_dtype"] = str(next(iter(trained.values())).dtype)
        lora = stage_dir(run.run_dir, 1, "checkpoint") / LORA_FOLDER / LORA_WEIGHTS
        with safe_open(str(lora), framework="pt") as f:
            row["diffusers_lora_keys"] = len(list(f.keys()))
        policy = next(iter(_POLICIES.values()), None)  # the flow ran in this process: its loaded policy
        if policy is not None:
            row["weights_dtype"] = str(policy.transformer.dtype)
            copies = list(policy.explore_copies.values())
            row["explore_copy_dtype"] = str(next(copies[0].parameters()).dtype) if copies else None
        metrics = UpdateMetrics.load(run.run_dir, 1).frame
        row["loss"] = float(metrics["loss"].iloc[-1])
        row["grad_norm"] = float(metrics["grad_norm"].iloc[-1])
        row["transformer_parameters"] = sum(
            p.numel() for p in family.meta_adapter(cfg.model, torch.bfloat16)[0].transformer.parameters()
        )
    row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), 2)
    return row


def table(rows: list[dict]) -> str:
    seconds = ["explore[1]", "score_explore[1]", "regenerate[1]", "update[1]", "checkpoint[1]", "evaluate[0]"]
    lines = [
        "| preset | family | blocks kept | resolution | transformer params kept | "
        + " | ".join(f"{s} s" for s in seconds)
        + " | flow s | peak RSS GiB | result |",
        "| --- | --- | --- | ---: | ---: | " + " | ".join("---:" for _ in seconds) + " | ---: | ---: | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['preset']} | {r.get('family', '')} | | | | " + " | " * len(seconds) + f" | | {r['error']} |"
            )
            continue
        depth = ", ".join(f"{k} {v}" for k, v in r["depth"].items())
        res = f"{r['resolution']}" + (f" x {r['frames']} frames" if r.get("frames") else "")
        cells = " | ".join(f"{r['stages'].get(s, float('nan')):.1f}" for s in seconds)
        lines.append(
            f"| {r['preset']} | {r['family']} | {depth} | {res} | {r['transformer_parameters'] / 1e6:.0f} M | {cells} "
            f"| {r['flow_s']:.0f} | {r['peak_rss_gib']:.1f} | loss {r['loss']:.3g}, grad norm {r['grad_norm']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", default=None, help="default: every published preset")
    parser.add_argument("--blocks", type=int, default=1, help="Transformer blocks kept of each kind.")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="Another override (section.key=v).")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one preset, JSON out
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "published-size.md")
    args = parser.parse_args()
    args.presets = args.presets or published_presets()
    if args.one:
        print("ROW " + json.dumps(run_one(args.presets[0], args.blocks, args.extra)))
        return
    rows = []
    for preset in args.presets:
        command = [sys.executable, __file__, preset, "--one", "--blocks", str(args.blocks)]
        command += [f"--set={e}" for e in args.extra]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not found:
            raised = [line for line in done.stderr.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
            tail = (raised or done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"preset": preset, "error": f"FAILED: {tail[:300]}"})
            print(done.stderr[-4000:], file=sys.stderr)
        else:
            rows.append(json.loads(found[0]))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    import torch

    for row in rows:
        row["measured"] = (
            f"{datetime.now():%Y-%m-%d}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        )
    if args.extra or args.blocks != 1:  # another setting than the table's: printed, not written
        print("\n" + table(rows))
        return
    # The results file keeps one row per preset: a run of some presets replaces theirs.
    saved = json.loads(args.out.with_suffix(".json").read_text()) if args.out.with_suffix(".json").exists() else []
    merged = {r["preset"]: r for r in saved} | {r["preset"]: r for r in rows}
    ordered = [merged[p] for p in sorted(merged) if p in published_presets()]
    measured = sorted({r.get("measured", "") for r in ordered})
    text = (
        "# Published widths in bfloat16 on CPU\n\n"
        "`.venv/bin/python bench/published_size.py [PRESET ...]`: one iteration through the Prefect flow per preset, "
        "each in its own process (the module docstring says what is cut and what is kept). Measured: "
        + "; ".join(measured)
        + ".\n\n"
        + table(ordered)
        + "\n\nFound and fixed by these runs:\n\n"
        + "".join(f"- {preset}: {found}\n" for preset, found in FOUND.items())
    )
    print("\n" + text)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(ordered, indent=1))


if __name__ == "__main__":
    main()
