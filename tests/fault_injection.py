"""Fault injection for the tests: a solrl plug-in module that installs a commit hook (``solrl.storage.stage``).

With ``SOLRL_FAULT=<iteration>:<stage>:<point>`` in its environment, a process that imported this module
SIGKILLs itself when that stage's commit reaches ``<point>`` (``COMMIT_POINTS``: ``write``, ``renamed``,
``committed``; ``rank<r>`` in process r of a multi-process update). A ``:raise`` suffix raises ``RuntimeError``
there instead: a failure the process survives (a failed Prefect flow run, for retry tests); ``:enospc`` raises the
``OSError`` of a full disk (errno ENOSPC). With
``SOLRL_FAULT_ONCE=<path>`` as well, the fault fires only while ``<path>`` does not exist, and creates it first (a
worker that serves the retry too, with the same environment).

The tests' own processes import it with ``conftest`` (the forkserver children too); a process they start, and the
processes that one starts in turn (a served flow run, torchrun's workers, Ray's), import it from
``SOLRL_PLUGINS`` with this folder on ``PYTHONPATH``: ``fault_env`` gives that environment.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

from solrl.registry import PLUGINS_ENV
from solrl.storage.stage import commit_hooks

FAULT_ENV = "SOLRL_FAULT"
FAULT_ONCE_ENV = "SOLRL_FAULT_ONCE"
HERE = Path(__file__).resolve().parent


def fault_env(spec: str, once: Path | None = None) -> dict[str, str]:
    """The environment variables that make a process started with them, and its children, fail at ``spec``
    (``<iteration>:<stage>:<point>[:raise]``), only once if ``once`` is given."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = {FAULT_ENV: spec, PLUGINS_ENV: __name__, "PYTHONPATH": path}
    return env | ({FAULT_ONCE_ENV: str(once)} if once is not None else {})


def _fault(iteration: int, stage: str, point: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    here = f"{iteration}:{stage}:{point}"
    if spec not in (here, f"{here}:raise", f"{here}:enospc"):
        return
    if once := os.environ.get(FAULT_ONCE_ENV):
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if spec == here:
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.endswith(":enospc"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"fault injected at {here} ({FAULT_ENV})")
    raise RuntimeError(f"fault injected at {here} ({FAULT_ENV})")


commit_hooks.append(_fault)
