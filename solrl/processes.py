"""Child processes that must not outlive solrl (the temporary Prefect server, torchrun)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn`` of a child: ask the kernel for SIGTERM when the parent exits (Linux ``PR_SET_PDEATHSIG``,
    SIGKILL of the parent included); exit now if the parent is already gone. Elsewhere a no-op: the parent's own
    cleanup then has to stop the child."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
