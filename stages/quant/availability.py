"""Which explore precisions this machine can run, and why not (DESIGN 2, backends table).

| precision | needs |
| --- | --- |
| ``bf16``, ``nvfp4_emulated``, ``fp8_emulated`` | nothing: run anywhere, CPU included |
| ``fp8`` | a CUDA GPU of compute capability >= 8.9 (Ada, Hopper, Blackwell) and Transformer Engine |
| ``nvfp4`` | a CUDA GPU of compute capability >= 10.0 (Blackwell) and Transformer Engine (NVFP4BlockScaling) |

Asking for a backend the machine cannot run is a configuration error that names the backends it can.
"""

from __future__ import annotations

from functools import cache

#: Hardware precisions -> the compute capability they need; every other precision runs anywhere.
HARDWARE = {"fp8": (8, 9), "nvfp4": (10, 0)}


def _transformer_engine_reason(precision: str) -> str | None:
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything at import
        return f"Transformer Engine is not importable ({exc.__class__.__name__}); pip install 'solrl[gpu]'"
    check = te.is_nvfp4_available if precision == "nvfp4" else te.is_fp8_available
    available = check()
    ok, reason = available if isinstance(available, tuple) else (bool(available), "")
    return None if ok else f"Transformer Engine says: {reason or 'not available'}"


@cache
def unavailable_reason(precision: str) -> str | None:
    """None when ``precision`` runs here, else why not (one sentence)."""
    if precision not in HARDWARE:
        return None
    import torch

    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    need = HARDWARE[precision]
    have = torch.cuda.get_device_capability()
    if have < need:
        name = torch.cuda.get_device_name()
        return f"{name} has compute capability {have[0]}.{have[1]}, {precision} needs >= {need[0]}.{need[1]}"
    return _transformer_engine_reason(precision)


def runnable_precisions() -> list[str]:
    """Every registered explore precision this machine can run."""
    from solrl.registry import EXPLORE_BACKENDS

    return [p for p in EXPLORE_BACKENDS.names() if unavailable_reason(p) is None]


def check_precision(precision: str) -> None:
    """Raises ValueError naming the runnable backends when ``precision`` cannot run here (the message is the
    one-line error ``solrl run`` and ``solrl resume`` print)."""
    reason = unavailable_reason(precision)
    if reason is not None:
        raise ValueError(
            f"explore.precision={precision} cannot run here: {reason}; this machine runs: "
            f"{', '.join(runnable_precisions())}"
        )
