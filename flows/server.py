"""The Prefect API a ``solrl`` process talks to, and a temporary loopback server that never outlives it.

With ``PREFECT_API_URL`` set (a ``prefect server start`` of the user's, or Prefect Cloud), that API is used
as is. Otherwise Prefect would start its own temporary server in a child process, which a SIGKILL of solrl
leaves running (listening on loopback, using CPU), and whose 20 s start limit a busy machine overruns.
``TemporaryServer`` starts the same server (``prefect.server.api.server:create_app`` under uvicorn, as
Prefect's ephemeral mode does) with three differences:

- the child asks the kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), so no signal to
  solrl, SIGKILL included, leaves it behind; and it runs in its own session, so a Ctrl-C to solrl's process
  group does not stop it before solrl has recorded the interruption;
- it starts in the background once the command line and the run are checked, while the flow's modules load;
- the wait for its health check is ``SOLRL_PREFECT_START_TIMEOUT`` seconds (default 180), not 20;
- servers of one ``PREFECT_HOME`` start one at a time (a lock file there, held from ``start`` until the health
  check answers): two started together on a new database both ran its migrations, and one failed ("Online
  migration expected to match one row").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from solrl.processes import die_with_parent

#: Seconds to wait for the temporary server's health check (a cold start on a busy 2-core machine took 17 s).
START_TIMEOUT = float(os.environ.get("SOLRL_PREFECT_START_TIMEOUT", "180"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporaryServer:
    """A Prefect API server on a free loopback port, owned by this process (see module doc).

    ``start()`` returns at once; ``wait()`` blocks until ``/api/health`` answers and returns the API URL;
    ``stop()`` terminates it (also registered for interpreter exit). The database is Prefect's usual one
    (``$PREFECT_HOME/prefect.db``), so the Prefect UI shows the flow runs afterwards.
    """

    def __init__(self) -> None:
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None
        self._start_lock: int | None = None  # the lock file's descriptor, from start() until the server answers

    def start(self) -> TemporaryServer:
        import importlib.util

        spec = importlib.util.find_spec("prefect")  # its folder, without the second it takes to import it
        assert spec is not None and spec.origin is not None, "prefect is not installed"
        home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
        home.mkdir(parents=True, exist_ok=True)
        self._start_lock = os.open(home / ".solrl-server-start.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._start_lock, fcntl.LOCK_EX)  # another process's server is starting on this database
        self._log = home / f"solrl-server-{self.port}.log"
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            # Prefect's own ephemeral-mode switch: no background services (scheduler, late runs) in this server.
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        env.pop("PREFECT_API_URL", None)
        with open(self._log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(Path(spec.origin).parent.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
        import atexit

        atexit.register(self.stop)
        return self

    def wait(self, timeout: float = START_TIMEOUT) -> str:
        """Block until the server answers its health check; returns the API URL.

        Raises:
            RuntimeError: the server exited or did not answer within ``timeout`` seconds (its log is quoted).
        """
        import httpx

        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        self._release_start_lock()
                        return self.api_url
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        tail = self._log.read_text(errors="replace")[-2000:] if self._log and self._log.exists() else ""
        code = self.process.poll()
        state = f"exited with code {code}" if code is not None else "no answer"
        self.stop()
        raise RuntimeError(
            f"the temporary Prefect server on {self.api_url} did not start ({state} after {timeout:.0f} s; raise "
            f"SOLRL_PREFECT_START_TIMEOUT or set PREFECT_API_URL to a running server)\n{tail}"
        )

    def _release_start_lock(self) -> None:
        lock, self._start_lock = self._start_lock, None
        if lock is not None:
            os.close(lock)  # closing the descriptor releases the flock

    def stop(self) -> None:
        """Terminate the server (SIGKILL after 5 s) and remove its log; safe to call twice."""
        self._release_start_lock()
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.unlink(missing_ok=True)


_early: TemporaryServer | None = None


def start_early() -> None:
    """Start the temporary server now, in the background, unless ``PREFECT_API_URL`` is set; ``prefect_api``
    then only waits for it. Called by the CLI before the slow imports."""
    global _early
    if _early is None and not os.environ.get("PREFECT_API_URL"):
        _early = TemporaryServer().start()


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """Within this block Prefect talks to ``PREFECT_API_URL`` if set (yields None), else to a temporary server
    owned by this process (yields its URL), stopped on the way out whatever happened.

    Raises:
        RuntimeError: the temporary server did not start (``TemporaryServer.wait``).
    """
    global _early
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server, _early = (_early or TemporaryServer().start()), None
    try:
        url = server.wait()
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()


def _drain_prefect_workers(timeout: float = 5.0) -> None:
    """Send the logs and events Prefect still queues for the API, before the server stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout)
