"""Every result of a short campaign as digests, to show that a change left the results unchanged to the last digit.

Runs a 2-iteration campaign of a preset through the stage functions (no Prefect, no MLflow; tiny-digits by default,
2 prompts an iteration, an audit at iteration 2) and writes, for every committed stage, the sha256 of each of
its files and its metrics, as JSON. Two such files (two commits, e.g. with ``git checkout``) are compared with
``--compare``: a file or metric that differs, or is only in one, is listed; timing metrics (``*seconds*``) are not
results and are left out. The checkpoint's ``state.json`` is compared by content, less its config hash and solrl
version.

    .venv/bin/python bench/results_digest.py --out /tmp/after.json
    cp bench/results_digest.py /tmp/  # an older commit may not have it
    git checkout OLD && .venv/bin/python /tmp/results_digest.py --out /tmp/before.json; git checkout -
    .venv/bin/python bench/results_digest.py --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

#: The preset's campaign cut to 2 iterations of 2 prompts, with the fidelity audit at iteration 2.
SHORT = ["campaign.iterations=2", "campaign.prompts_per_iteration=2", "fidelity.audit_every=2"]


def digest(preset: str, extra: list[str]) -> dict:
    """``{"<iteration>/<stage>": {"files": {relative path: sha256}, "metrics": {...}}}`` of a fresh campaign."""
    from solrl.config import load_config
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import campaign_plan, run_stage
    from solrl.storage.runs import create_run, open_run
    from solrl.storage.stage import read_manifest, stage_dir

    root = tempfile.mkdtemp(prefix="solrl-digest-")
    cfg = load_config(preset, [*SHORT, *extra, f"storage.root={root}"])
    run = create_run(cfg, "digest")
    out: dict = {}
    for iteration, stages in campaign_plan(cfg):
        for stage in stages:
            opened = open_run(root, "digest")  # as the flow's tasks do; built by hand, as older commits lack ``of``
            run_stage(StageContext(opened.config, opened.run_dir, opened.run_id, iteration, opened.config_hash), stage)
            manifest = read_manifest(run.run_dir, iteration, stage)
            files: dict = {rel: entry.sha256 for rel, entry in manifest.files.items()}
            if stage == "checkpoint":
                state = json.loads((stage_dir(run.run_dir, iteration, stage) / "state.json").read_text())
                files["state.json"] = {k: v for k, v in state.items() if k not in ("config_hash", "solrl_version")}
            out[f"{iteration}/{stage}"] = {"files": files, "metrics": manifest.metrics}
    return out


def compare(before: dict, after: dict) -> list[str]:
    """One line per stage, file or metric that differs between two digests (timings left out)."""
    lines = [f"stage only in {'after' if k in after else 'before'}: {k}" for k in sorted(set(before) ^ set(after))]
    for key in sorted(set(before) & set(after)):
        for part in ("files", "metrics"):
            a, b = before[key][part], after[key][part]
            for name in sorted(set(a) | set(b)):
                if part == "metrics" and "seconds" in name:
                    continue
                if name not in a or name not in b:
                    lines.append(f"{key} {part[:-1]} only in {'after' if name in b else 'before'}: {name}")
                elif a[name] != b[name]:
                    keys = ""
                    if isinstance(a[name], dict) and isinstance(b[name], dict):  # state.json: which entries
                        keys = (
                            " ("
                            + ", ".join(
                                k for k in sorted(set(a[name]) | set(b[name])) if a[name].get(k) != b[name].get(k)
                            )
                            + ")"
                        )
                    lines.append(f"{key} {part[:-1]} differs: {name}{keys}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-digits")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="one more override (repeatable)")
    parser.add_argument("--out", type=Path, help="write the digests here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        lines = compare(before, after)
        print("\n".join(lines) if lines else f"identical: {len(after)} stages, every file and metric")
        return
    if args.out is None:
        parser.error("give --out FILE (or --compare BEFORE AFTER)")
    result = digest(args.preset, args.extra)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{len(result)} stages of {args.preset} -> {args.out}")


if __name__ == "__main__":
    main()
