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


def stop_signal(exc: BaseException) -> int | None:
    """The signal of the stop that ``exc`` is or wraps: ``SIGTERM`` for Prefect's ``TerminationSignal`` (Prefect
    takes SIGTERM while a flow runs and raises it), ``SIGINT`` for a ``KeyboardInterrupt`` (solrl's SIGTERM
    exception is one: its ``signal`` says SIGTERM); None for any other error. The exception's ``__cause__`` and
    ``__context__`` are followed: a stop that lands while Prefect sets up a task run surfaces as its crash
    handler's ``ValueError: Task run is not set``, raised while handling the stop."""
    from prefect.exceptions import TerminationSignal

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TerminationSignal):
            return current.signal
        if isinstance(current, KeyboardInterrupt):
            return getattr(current, "signal", signal.SIGINT)
        current = current.__cause__ or current.__context__
    return None
