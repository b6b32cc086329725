"""First contact of the Transformer Engine explore backends with a GPU: one script, minutes, one table per check.

Every check the CPU cannot make (issue 35), each writing one markdown table (to ``$OUT/gpu_smoke.md`` when
``OUT`` is set, and to stdout):

1. versions: torch, CUDA, the device and its compute capability, Transformer Engine's version, and TE's own
   answer for fp8 and nvfp4 with its reason (``solrl.stages.quant.availability.te_reason``);
2. one TE Linear under solrl's recipe (``te_recipe``) against ``F.linear`` and against the emulated backend
   (``FakeQuantLinear``, per-call scale: what TE does) for rows {4, 24, 666} and in/out {16, 48, 3072}, bare (which
   shapes TE refuses) and inside ``RowPadded`` (the product's path: none may fail);
3. weights with and without ``quantized_model_init`` under ``no_grad``: the weight's type, its bytes, and
   ``max_memory_allocated`` around one forward;
4. explore through the product (``rollout_network``) with Transformer Engine (``fp8``, ``nvfp4``) and torchao
   (``torchao_fp8``, ``torchao_nvfp4``) on tiny-sd3, tiny-flux and tiny-sana at batch 4 and 24: the velocity's
   error against the BF16 policy and against the emulated copy at per-call scales, and the copy's bytes against
   what the memory plan counts (``copy_bytes``);
5. graph breaks of one compiled forward of each quantized copy (``torch._dynamo.explain``);
6. one seed alone against the same seed inside a batch of 24 (TE scales activations per call, NVFP4 per row
   where TE >= 2.16 has ``row_scaled_activation``; torchao FP8 per token).

NVFP4 needs sm_100 (Blackwell): on an H200 (sm_90) its rows say so and only FP8 runs.

On a GPU machine without a network (the project's borrowed test GPUs) it is one step of ``bench/gpu_session.sh``,
which runs it with the wheels ``make gpu-kit`` prepares (docs/development/benchmarks.md). Transformer Engine
travels there in parts over a few commands (``TE=2.16.1 make gpu-kit``, ``bench/te_kit.py``); without them its rows
say it is not importable and torchao's run. On a GPU machine with a network, after ``pip install -e '.[test]'``:

    OUT=$OUT .venv/bin/python bench/gpu_smoke.py                       # torchao and the emulation, no TE
    .venv/bin/pip install --no-build-isolation 'transformer-engine[pytorch]>=2.9'
    OUT=$OUT .venv/bin/python bench/gpu_smoke.py                       # every check

Transformer Engine's PyTorch extension has no wheel on PyPI (``pip download --only-binary=:all:
transformer-engine-torch`` finds none), so its install compiles it against the installed torch and needs the CUDA
toolkit (minutes).

On a machine without a GPU it runs what it can and says why the rest did not run (``tests/test_hardware.py``).
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import argparse
import os
import platform
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from solrl.stages.quant.availability import unavailable_reason

PRECISIONS = ("fp8", "nvfp4")
ROWS = (4, 24, 666)
DIMS = (16, 48, 3072)
FAMILIES = ("tiny-sd3", "tiny-flux", "tiny-sana")


def table(title: str, header: list[str], rows: list[list[object]]) -> str:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _error(exc: BaseException) -> str:
    return f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float(), b.float()
    return f"{((a - b).norm() / b.norm().clamp_min(1e-30)).item():.2e}"


def check_versions() -> str:
    rows: list[list[object]] = [["torch", torch.__version__], ["python", platform.python_version()]]
    if torch.cuda.is_available():
        rows += [
            ["CUDA", torch.version.cuda],
            ["device", torch.cuda.get_device_name()],
            ["compute capability", "sm_{}{}".format(*torch.cuda.get_device_capability())],
        ]
    else:
        rows.append(["device", "no CUDA device"])
    try:
        import transformer_engine

        rows.append(["Transformer Engine", getattr(transformer_engine, "__version__", "?")])
    except Exception as exc:  # not installed, or a broken CUDA install
        rows.append(["Transformer Engine", f"not importable: {_error(exc)}"])
    for precision in PRECISIONS:
        rows.append([f"solrl {precision}", unavailable_reason(precision) or "available"])
    return table("1. Versions and availability", ["what", "value"], rows)


def _te_linear(in_f: int, out_f: int, weight: torch.Tensor, precision: str, quantized_init: bool = True) -> nn.Module:
    import contextlib

    import transformer_engine.pytorch as te

    from solrl.stages.quant.hardware import te_recipe

    init = te.quantized_model_init(enabled=True, recipe=te_recipe(precision)) if quantized_init else None
    with torch.no_grad(), init or contextlib.nullcontext():
        linear = te.Linear(in_f, out_f, bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def _under_recipe(precision: str) -> object:
    import transformer_engine.pytorch as te

    from solrl.stages.quant.hardware import te_recipe

    return te.autocast(enabled=True, recipe=te_recipe(precision))


def check_linear() -> str:
    from solrl.stages.quant.hardware import TE_ROW_MULTIPLE, RowPadded, te_takes
    from solrl.stages.quant.nvfp4 import FakeQuantLinear

    rows: list[list[object]] = []
    for precision in PRECISIONS:
        reason = unavailable_reason(precision)
        if reason is not None:
            rows.append([precision, *["-"] * 7, f"not run: {reason}"])
            continue
        for in_f in DIMS:
            for out_f in DIMS:
                torch.manual_seed(in_f * 7 + out_f)
                weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * in_f**-0.5
                base = nn.Linear(in_f, out_f, bias=False, device="cuda")
                emulated = FakeQuantLinear(base, precision, "call", weight=weight)
                takes = "TE" if te_takes(in_f, out_f, precision) else "bf16"
                try:
                    linear = _te_linear(in_f, out_f, weight, precision)
                except Exception as exc:
                    rows.append([precision, in_f, out_f, takes, "-", "build", "-", "-", _error(exc)])
                    continue
                for n in ROWS:
                    x = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16)
                    exact = F.linear(x.float(), weight.float())
                    reference = emulated(x.float())
                    padded = RowPadded(linear, TE_ROW_MULTIPLE[precision])
                    for label, module in (("bare", linear), ("RowPadded", padded)):
                        try:
                            with torch.no_grad(), _under_recipe(precision):
                                y = module(x)
                            torch.cuda.synchronize()
                            cells = [_rel(y, exact), _rel(y, reference), "ok"]
                        except Exception as exc:
                            cells = ["-", "-", _error(exc)]
                        rows.append([precision, in_f, out_f, takes, n, label, *cells])
    header = [
        "precision",
        "in",
        "out",
        "solrl runs it in",
        "rows",
        "call",
        "rel. error vs F.linear",
        "vs emulated (per call)",
        "result",
    ]
    return table("2. One TE Linear against F.linear and the emulated quantizer", header, rows)


def check_quantized_init() -> str:
    rows: list[list[object]] = []
    in_f = out_f = 8192
    for precision in PRECISIONS:
        reason = unavailable_reason(precision)
        if reason is not None:
            rows.append([precision, "-", "-", "-", "-", f"not run: {reason}"])
            continue
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * in_f**-0.5
        x = torch.randn(1024, in_f, device="cuda", dtype=torch.bfloat16)
        for quantized_init in (False, True):
            try:
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                linear = _te_linear(in_f, out_f, weight, precision, quantized_init)
                held = torch.cuda.memory_allocated() - before
                torch.cuda.reset_peak_memory_stats()
                with torch.no_grad(), _under_recipe(precision):
                    linear(x)
                peak = torch.cuda.max_memory_allocated() - before
                cells = [type(linear.weight).__name__, f"{held / 2**20:.1f}", f"{peak / 2**20:.1f}", "ok"]
                del linear
            except Exception as exc:
                cells = ["-", "-", "-", _error(exc)]
            rows.append([precision, quantized_init, *cells])
    header = ["precision", "quantized_model_init", "weight type", "held MiB", "peak MiB (forward)", "result"]
    return table(f"3. A {out_f} x {in_f} weight with and without quantized_model_init (bf16: 128 MiB)", header, rows)


def _policy(family: str, root: Path):
    from solrl.config import load_config
    from solrl.stages.models import load_model
    from solrl.stages.models.policy import Policy

    cfg = load_config(family, [f"storage.root={root}", f"model.path={root / family}", "model.device=cuda"])
    policy = Policy(load_model(cfg.model, torch.device("cuda")), rank=4, alpha=4.0, seed=0)
    with torch.no_grad():  # a rollout adapter away from its init, so the merge matters
        for p in policy.adapter_params("rollout").values():
            p.add_(0.05 * torch.randn_like(p))
    return cfg, policy


def _inputs(policy, batch: int, seed: int = 0):
    generator = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(batch, *policy.model.latent_shape, device="cuda", generator=generator)
    sigma = torch.full((batch,), 0.7, device="cuda")
    return x, sigma, policy.model.encode(["a photo of a cat"] * batch)


#: The explore backends checked through the product (NVFP4's need sm_100: their rows say so on an H200).
EXPLORE = ("fp8", "torchao_fp8", "nvfp4", "torchao_nvfp4")


def _each_family(run: Callable[[str, str, object, object], list[list[object]]], width: int) -> list[list[object]]:
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in EXPLORE:
            reason = unavailable_reason(precision)
            if reason is not None:
                rows.append([precision, *["-"] * (width - 2), f"not run: {reason}"])
                continue
            for family in FAMILIES:
                try:
                    cfg, policy = _policy(family, Path(tmp))
                    rows += run(precision, family, cfg, policy)
                except Exception as exc:
                    traceback.print_exc()
                    rows.append([precision, family, *["-"] * (width - 3), _error(exc)])
    return rows


def check_explore() -> str:
    from solrl.registry import EXPLORE_BACKENDS
    from solrl.stages.quant.backends import rollout_network

    def run(precision, family, cfg, policy):
        out = []
        skip, min_dim = policy.model.explore_skip, cfg.explore.min_dim
        planned = EXPLORE_BACKENDS.get(precision).copy_bytes(policy.transformer, skip, min_dim)
        emulated = "nvfp4_emulated" if "nvfp4" in precision else "fp8_emulated"
        for batch in (4, 24):
            x, sigma, cond = _inputs(policy, batch)
            with torch.no_grad():
                with rollout_network(policy, "bf16") as net:
                    bf16 = policy.model.velocity(net, x, sigma, cond)
                with rollout_network(policy, emulated, min_dim, "call", keep_copy="none") as net:
                    reference = policy.model.velocity(net, x, sigma, cond)
                with rollout_network(policy, precision, min_dim) as net:
                    quantized = policy.model.velocity(net, x, sigma, cond)
                    owned = policy.owned_bytes(net)
            out.append(
                [precision, family, batch, _rel(quantized, bf16), _rel(quantized, reference), owned, planned, "ok"]
            )
        policy.explore_copies.clear()
        return out

    header = ["precision", "family", "batch", "rel. error vs bf16", "vs emulated (per call)", "copy bytes"]
    header += ["planned", "result"]
    return table("4. Explore through the product", header, _each_family(run, len(header)))


def check_compile() -> str:
    from solrl.stages.quant.backends import rollout_network

    def run(precision, family, cfg, policy):
        x, sigma, cond = _inputs(policy, 4)
        with torch.no_grad(), rollout_network(policy, precision, cfg.explore.min_dim) as net:
            explained = torch._dynamo.explain(lambda x: policy.model.velocity(net, x, sigma, cond))(x)
        reasons = sorted({str(b.reason).splitlines()[0][:80] for b in explained.break_reasons})
        torch._dynamo.reset()
        policy.explore_copies.clear()
        row = [precision, family, explained.graph_count, explained.graph_break_count, "; ".join(reasons[:3]) or "-"]
        return [[*row, "ok"]]

    header = ["precision", "family", "graphs", "graph breaks", "first reasons", "result"]
    return table("5. Graph breaks of the quantized copy under torch.compile", header, _each_family(run, len(header)))


def check_batch_invariance() -> str:
    from solrl.stages.quant.backends import rollout_network

    def run(precision, family, cfg, policy):
        x, sigma, cond = _inputs(policy, 24, seed=1)
        alone = (x[:1], sigma[:1], policy.model.encode(["a photo of a cat"]))
        with torch.no_grad(), rollout_network(policy, precision, cfg.explore.min_dim) as net:
            in_batch = policy.model.velocity(net, x, sigma, cond)[:1]
            single = policy.model.velocity(net, *alone)
        policy.explore_copies.clear()
        return [[precision, family, f"{(in_batch.float() - single.float()).abs().max().item():.3e}", "ok"]]

    header = ["precision", "family", "max abs diff (alone vs in a batch of 24)", "result"]
    return table("6. One seed alone against inside a batch of 24", header, _each_family(run, len(header)))


CHECKS = {
    "versions": check_versions,
    "linear": check_linear,
    "quantized_init": check_quantized_init,
    "explore": check_explore,
    "compile": check_compile,
    "batch": check_batch_invariance,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    args = parser.parse_args()
    out = Path(os.environ["OUT"]) / "gpu_smoke.md" if os.environ.get("OUT") else None
    parts = [f"# GPU smoke ({platform.node()})\n"]
    for name in args.checks:
        try:
            parts.append(CHECKS[name]())
        except Exception as exc:  # one failing check must not hide the others' tables
            traceback.print_exc()
            parts.append(table(name, ["result"], [[f"failed: {_error(exc)}"]]))
        print(parts[-1], flush=True)
        if out is not None:
            out.write_text("\n".join(parts), encoding="utf-8")


if __name__ == "__main__":
    main()
