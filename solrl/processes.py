"""Child processes that must not outlive solrl (the temporary Prefect server, torchrun), and the failures that end
a process rather than a try: a stop signal, a full disk, an error the run's own inputs decide; and a stopped
process's exit, bounded in time."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
from collections.abc import Iterator

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

    for current in _chain(exc):
        if isinstance(current, TerminationSignal):
            return current.signal
        if isinstance(current, KeyboardInterrupt):
            return getattr(current, "signal", signal.SIGINT)
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


class RepeatsOnResume(Exception):
    """Base of the errors that the run's fixed config, weights, seeds and committed inputs decide, so that a retry
    of the stage or a ``solrl resume`` meets them again: NaN samples (``stages.sampling.rollout.NonFiniteSamples``),
    a committed input whose bytes changed (``storage.stage.StageChanged``). A plug-in may derive its own."""


def repeated_on_resume(exc: BaseException) -> BaseException | None:
    """The error in ``exc`` or its chain that a retry of the stage, or a ``solrl resume``, would meet again; None
    when there is none: a ``RepeatsOnResume``, or a ``FloatingPointError`` (a non-finite loss or gradient norm,
    ``stages.update``). A reward's unusable scores (``RewardError``) are not among them: a reward server or plug-in
    fixed in between makes a resume succeed."""
    for current in _chain(exc):
        if isinstance(current, FloatingPointError | RepeatsOnResume):
            return current
    return None


#: ``errno`` values of a write that a retry cannot make succeed: the device is full, the user's quota is spent.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: How SQLite (MLflow's and Prefect's default databases) and libraries that keep only the OS's text (safetensors'
#: ``SafetensorError: ... No space left on device (os error 28)``) say the same, without an errno.
_FULL_TEXTS = ("database or disk is full", *(os.strerror(e) for e in sorted(DISK_FULL_ERRNOS)))


def disk_full(exc: BaseException) -> Exception | None:
    """The error in ``exc`` or its chain (``__cause__``, ``__context__``) that says a disk is full: an ``OSError``
    with ``errno`` ENOSPC or EDQUOT (pyarrow's, Zarr's and torch's writes raise these), or an error whose text
    says so without an errno (``_FULL_TEXTS``: SQLite's, for MLflow's tracking store; safetensors'); None when
    there is none."""
    for current in _chain(exc):
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        if isinstance(current, Exception) and any(text in str(current) for text in _FULL_TEXTS):
            return current
    return None


#: After a stop signal, the longest the process's own exit may take, in seconds: Python's exit joins the threads that
#: libraries left running and runs their ``atexit`` handlers, and one that waits on a server the stop has already
#: ended would keep a stopped run's terminal, and its process group, waiting.
EXIT_GRACE_S = 10.0


def exit_within(code: int, seconds: float = EXIT_GRACE_S) -> None:
    """Make sure this process ends, with exit status ``code``, at most ``seconds`` from now: a daemon thread waits,
    and where the interpreter's exit (the non-daemon threads it joins, the ``atexit`` handlers it runs) is still
    going on by then, writes one line to stderr naming the threads and the main thread's frame it waits in, flushes
    stdout and stderr and ends the process with ``os._exit(code)``. Called once a stop signal has been handled and
    the process is about to exit; a process that exits in time never hears of it.

    Args:
        code: the exit status (130 after Ctrl-C, 143 after SIGTERM).
        seconds: the grace, in seconds.
    """
    import sys
    import threading
    import time
    import traceback

    main = threading.main_thread()

    def end() -> None:
        time.sleep(seconds)
        threads = sorted(t.name for t in threading.enumerate() if t is not main and not t.daemon)
        frame = sys._current_frames().get(main.ident or -1)
        where = traceback.extract_stack(frame)[-1] if frame is not None else None
        at = f"{where.filename}:{where.lineno} in {where.name}" if where is not None else "an unknown frame"
        waiting = f"threads {', '.join(threads)}" if threads else "no other thread"
        with contextlib.suppress(Exception):
            sys.stderr.write(f"solrl: exiting after {seconds:g} s of exit handlers (main thread at {at}; {waiting})\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    threading.Thread(target=end, name="solrl-exit-within", daemon=True).start()
