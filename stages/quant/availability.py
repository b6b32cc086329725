"""Which explore precisions this machine can run, and why not (DESIGN 2, backends table).

| precision | needs |
| --- | --- |
| ``bf16``, ``nvfp4_emulated``, ``fp8_emulated`` | nothing: run anywhere, CPU included |
| ``fp8`` | a CUDA GPU of compute capability >= 8.9 (Ada, Hopper, Blackwell) and Transformer Engine |
| ``nvfp4`` | a CUDA GPU of compute capability >= 10.0 (Blackwell) and Transformer Engine (NVFP4BlockScaling) |
| ``torchao_fp8`` | a CUDA GPU of compute capability >= 8.9 and torchao's inference configs |
| ``torchao_nvfp4`` | a CUDA GPU of compute capability >= 10.0 and torchao's inference configs |

Asking for a backend the machine cannot run is a configuration error that names the backends it can.
"""

from __future__ import annotations

from functools import cache

#: Hardware precisions -> the compute capability they need; every other precision runs anywhere.
HARDWARE = {"fp8": (8, 9), "nvfp4": (10, 0), "torchao_fp8": (8, 9), "torchao_nvfp4": (10, 0)}
#: The GPU generations of each compute capability floor in ``HARDWARE``, as a refusal names them.
GENERATIONS = {(8, 9): "Ada, Hopper or Blackwell", (10, 0): "Blackwell"}
#: How Transformer Engine is installed: its PyTorch extension is a source distribution compiled against the
#: installed CUDA torch, so without build isolation (its docs; ``transformer_engine[pytorch,core_cu13]`` for a
#: CUDA 13 torch, docs/install.md).
TE_INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.9' (docs/install.md, GPU machines)"


#: The first Transformer Engine release with ``is_fp8_available`` / ``is_nvfp4_available(return_reason=True)``.
TE_MIN_VERSION = (2, 9)


def _transformer_engine_reason(precision: str) -> str | None:
    """None when Transformer Engine says ``precision`` runs on this GPU, else its reason (or why TE is unusable)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything at import
        return f"Transformer Engine is not importable ({exc.__class__.__name__}); {TE_INSTALL}"
    return te_reason(te, getattr(transformer_engine, "__version__", "0"), precision)


def te_reason(te: object, version: str, precision: str) -> str | None:
    """Transformer Engine's own answer for ``precision`` (``te`` the ``transformer_engine.pytorch`` module):
    None when it is available, else TE's reason. TE < 2.9 lacks the top-level checks and is refused by name.
    TE >= 2.9 returns a bare bool unless ``return_reason=True`` (``transformer_engine/pytorch/__init__.py``)."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    name = "is_nvfp4_available" if precision == "nvfp4" else "is_fp8_available"
    check = getattr(te, name, None)
    if parts < TE_MIN_VERSION or check is None:
        return (
            f"Transformer Engine {version} is older than {'.'.join(map(str, TE_MIN_VERSION))} (no te.{name}); "
            f"{TE_INSTALL}"
        )
    available = check(return_reason=True)
    ok, reason = available if isinstance(available, tuple) else (bool(available), "")
    return None if ok else f"Transformer Engine says: {reason or 'not available'}"


@cache
def unavailable_reason(precision: str) -> str | None:
    """None when ``precision`` runs here, else why not (one sentence)."""
    if precision not in HARDWARE:
        return None
    import torch

    need = HARDWARE[precision]
    if not torch.cuda.is_available():
        library = "torchao" if precision.startswith("torchao_") else "Transformer Engine"
        return (
            f"this machine has no CUDA device ({precision} needs a GPU of compute capability >= "
            f"{need[0]}.{need[1]}, {GENERATIONS[need]}, and {library})"
        )
    have = torch.cuda.get_device_capability()
    if have < need:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {have[0]}.{have[1]}, {precision} needs >= {need[0]}.{need[1]}"
    if precision.startswith("torchao_"):
        from solrl.stages.quant.ao import ao_reason

        return ao_reason()
    return _transformer_engine_reason(precision)


def runnable_precisions() -> list[str]:
    """Every registered explore precision this machine can run (each backend's own ``unavailable_reason``: a
    plug-in's answer, not only the built-in table)."""
    from solrl.registry import EXPLORE_BACKENDS

    return [p for p in EXPLORE_BACKENDS.names() if EXPLORE_BACKENDS.get(p).unavailable_reason() is None]


def check_precision(precision: str) -> None:
    """Raises ValueError naming the runnable backends when ``precision`` cannot run here (the message is the
    one-line error ``solrl run`` and ``solrl resume`` print)."""
    from solrl.registry import EXPLORE_BACKENDS

    reason = EXPLORE_BACKENDS.get(precision).unavailable_reason()
    if reason is not None:
        raise ValueError(
            f"explore.precision={precision} cannot run here: {reason}; this machine runs: "
            f"{', '.join(runnable_precisions())}"
        )
