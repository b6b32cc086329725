"""Clean shutdown of ``solrl run``: Ctrl-C to the process group exits 130, SIGTERM exits 143, both within
seconds and resumable; no child (the temporary Prefect server) outlives solrl after these or after a SIGKILL
of solrl alone (that case is in ``test_flow``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TINY, temporary_server_env, tiny_config

from solrl.stages.pipeline import campaign_plan
from solrl.storage.stage import read_manifest

pytestmark = pytest.mark.slow

SOLRL = [sys.executable, "-m", "solrl.cli"]
ENV = temporary_server_env(PYTHONUNBUFFERED="1")  # the temporary Prefect server is what it is about
ONE_ITERATION = ("campaign.iterations=1",)


def start_run(store: Path, run_id: str) -> subprocess.Popen[str]:
    """``solrl run`` of the tiny config in its own session (so the test can signal its process group), with
    Ctrl-C's SIGINT handled as in a terminal: a suite started in the background of a non-interactive shell
    inherits SIGINT ignored, and Python then never raises KeyboardInterrupt. One iteration: the signals come in
    its middle."""
    overrides = [a for o in [*TINY, *ONE_ITERATION, f"storage.root={store}"] for a in ("--set", o)]
    return subprocess.Popen(
        [*SOLRL, "run", *overrides, "--run-id", run_id],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(proc: subprocess.Popen[str], path: Path, timeout: float = 240) -> list[psutil.Process]:
    """Wait until ``path`` exists while ``proc`` runs; returns ``proc``'s descendants at that moment."""
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"solrl ended early:\n{proc.stdout.read() if proc.stdout else ''}"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("uvicorn" in " ".join(c.cmdline()) for c in children), "no temporary Prefect server found"
    return children


def assert_all_gone(processes: list[psutil.Process], within: float = 10) -> None:
    _, alive = psutil.wait_procs(processes, timeout=within)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(p.cmdline()[:4]) for p in alive]


def mlflow_status(store: Path) -> str:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name("solrl").experiment_id)
    return run.info.status


def test_ctrl_c_to_the_process_group_exits_130_leaves_no_child_and_resumes(tmp_path: Path):
    store = tmp_path / "store"
    proc = start_run(store, "ctrlc")
    children = wait_for(proc, store / "ctrlc" / "iter_000001" / "select" / "_MANIFEST.json")
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-3000:]
    assert time.time() - sent < 30
    assert "interrupted; continue with `solrl resume ctrlc" in output
    assert_all_gone(children)
    # KILLED, unless the signal landed inside an MLflow write and left its sqlite file locked: then RUNNING,
    # which the next resume sets anyway (flows/sol_rl.py: _mark_stopped); the exit code holds either way.
    assert mlflow_status(store) in ("KILLED", "RUNNING")
    assert read_manifest(store / "ctrlc", 1, "checkpoint") is None

    from solrl.storage.runs import open_run
    from solrl.storage.tracking import Tracker

    Tracker(open_run(store, "ctrlc"))  # what a resume does first: the MLflow run is running again
    assert mlflow_status(store) == "RUNNING"
    result = subprocess.run(
        [*SOLRL, "resume", "ctrlc", "--store", str(store)], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for iteration, stages in campaign_plan(tiny_config(store, *ONE_ITERATION)):
        for stage in stages:
            assert read_manifest(store / "ctrlc", iteration, stage, verify=True), (iteration, stage)
    assert mlflow_status(store) == "FINISHED"
    assert not [p for p in (store / "ctrlc").rglob(".*") if ".tmp-" in p.name or ".trash-" in p.name]


@pytest.mark.parametrize("waits_in", ["thread", "atexit"])
def test_a_stopped_process_whose_exit_handlers_hang_still_exits_with_its_code(waits_in: str):
    """``exit_within``, which ``solrl`` arms once it has handled a stop: a non-daemon thread that never ends, or an
    ``atexit`` handler that never returns (a library flushing to a server the stop ended), no longer keeps the
    stopped process alive; it ends with the stop's exit status and names what it waited on."""
    hang = {
        "thread": "threading.Thread(target=time.sleep, args=(600,), name='flush-to-server').start()",
        "atexit": "def flush_to_server():\n    time.sleep(600)\natexit.register(flush_to_server)",
    }[waits_in]
    code = f"import atexit, threading, time\nfrom solrl.processes import exit_within\n{hang}\nexit_within(130, 1.0)\n"
    started = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert time.time() - started < 60
    assert "solrl: exiting after 1 s of exit handlers" in done.stderr
    where = "threads flush-to-server" if waits_in == "thread" else "in flush_to_server"
    assert where in done.stderr, done.stderr


def test_the_console_script_bounds_its_exit_only_after_a_stop():
    """``solrl.cli.main`` (the ``solrl`` script) arms ``exit_within`` where ``_stopped`` ended the command: a hanging
    ``atexit`` handler then costs ``EXIT_GRACE_S``, not forever. An in-process ``app`` (a test's CliRunner) never
    arms it: the first version armed it inside the command, and a test's Ctrl-C ended its pytest worker."""
    code = (
        "import atexit, sys, time\nimport typer\nimport solrl.cli as cli\n"
        "def flush_to_server():\n    time.sleep(600)\natexit.register(flush_to_server)\n"
        "def app():\n    try:\n        cli._stopped(130, 'continue with `solrl resume r`')\n"
        "    except typer.Exit as stop:\n        sys.exit(stop.exit_code)\n"
        "cli.app = app\ncli.main()\n"
    )
    from solrl.processes import EXIT_GRACE_S

    started = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert EXIT_GRACE_S <= time.time() - started < EXIT_GRACE_S + 30
    assert "solrl: error: interrupted; continue with `solrl resume r`" in done.stderr
    assert f"solrl: exiting after {EXIT_GRACE_S:g} s of exit handlers (main thread at " in done.stderr
    assert "in flush_to_server" in done.stderr


def test_sigterm_exits_143_and_stops_the_temporary_prefect_server(tmp_path: Path):
    store = tmp_path / "store"
    proc = start_run(store, "term")
    children = wait_for(proc, store / "term" / "iter_000001" / "explore" / "_MANIFEST.json")
    sent = time.time()
    proc.send_signal(signal.SIGTERM)  # solrl alone, as a service manager or `kill` does
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output[-3000:]
    assert time.time() - sent < 30
    assert "terminated (SIGTERM); continue with `solrl resume term" in output
    assert_all_gone(children)
    # KILLED, unless the signal landed inside an MLflow write and left its sqlite file locked: then RUNNING,
    # which the next resume sets anyway (flows/sol_rl.py: _mark_stopped); the exit code holds either way.
    assert mlflow_status(store) in ("KILLED", "RUNNING")


def test_a_temporary_server_that_does_not_answer_in_time_is_stopped_with_a_clear_error():
    from solrl.flows.server import TemporaryServer

    server = TemporaryServer().start()
    process = server.process
    assert process is not None
    with pytest.raises(RuntimeError, match="did not start .*SOLRL_PREFECT_START_TIMEOUT"):
        server.wait(timeout=0.05)
    assert process.poll() is not None and server.process is None


def test_two_temporary_servers_started_together_on_a_new_database_both_answer(tmp_path: Path):
    """Two ``solrl run`` started at once on a new machine: their temporary servers share ``$PREFECT_HOME``'s new
    database, and both ran its migrations; one failed ("Online migration expected to match one row", seen when
    the test processes' own servers started together). They now start one at a time."""
    script = (
        "from solrl.flows.server import TemporaryServer\n"
        "server = TemporaryServer().start()\nprint(server.wait(timeout=120), flush=True)\nserver.stop()\n"
    )
    env = temporary_server_env(PREFECT_HOME=str(tmp_path / "new-home"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in "ab"
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0 and out.startswith("http://127.0.0.1:"), err[-3000:]
    assert (tmp_path / "new-home" / "prefect.db").exists()


def test_sigterm_while_the_run_is_being_set_up_exits_143_with_the_resume_line(tmp_path: Path):
    store = tmp_path / "store"
    proc = start_run(store, "early")
    deadline = time.time() + 120
    while not (store / "early" / "run.json").exists():  # created; the campaign has not started yet
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output[-3000:]
    assert "terminated (SIGTERM); continue with `solrl resume early --store" in output
    assert "Traceback" not in output


def test_a_ctrl_c_that_prefect_wraps_in_its_own_error_still_exits_130(monkeypatch: pytest.MonkeyPatch, capsys):
    """The fresh-clone run of 2026-12-03: Ctrl-C landed while Prefect set up a task run, its crash handler failed
    in turn, and solrl saw ``ValueError: Task run is not set`` and exited 1. The campaign below is interrupted the
    same way; solrl still says interrupted, exit 130, with the resume line."""
    import contextlib

    import typer

    import solrl.cli as cli
    import solrl.flows.server
    import solrl.flows.sol_rl

    def campaign(store: str, run_id: str) -> None:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise ValueError("Task run is not set") from None  # what Prefect's handle_crash raises then

    monkeypatch.setattr(solrl.flows.sol_rl, "campaign", campaign)
    monkeypatch.setattr(solrl.flows.server, "prefect_api", contextlib.nullcontext)
    monkeypatch.setattr(cli, "_interrupted", False)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(typer.Exit) as exited:
            cli._launch("/tmp/store", "wrapped")
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert exited.value.exit_code == 130
    assert "interrupted; continue with `solrl resume wrapped --store /tmp/store`" in capsys.readouterr().err


def test_a_stop_wrapped_by_a_library_is_recorded_killed_not_failed(monkeypatch):
    """The flake this fixes: a Ctrl-C landing while Prefect set up a task run surfaced as Prefect's ValueError,
    and MLflow recorded the stopped campaign FAILED (test above, under load)."""
    from prefect.exceptions import TerminationSignal

    import solrl.cli
    from solrl.flows.sol_rl import _stop_status

    assert _stop_status(ValueError("Task run is not set")) == "FAILED"
    assert _stop_status(KeyboardInterrupt()) == _stop_status(TerminationSignal(15)) == "KILLED"
    monkeypatch.setattr(solrl.cli, "_interrupted", True)
    assert _stop_status(ValueError("Task run is not set")) == "KILLED"


def test_a_sigterm_that_prefect_takes_and_its_crash_handler_wraps_still_exits_143(monkeypatch, capsys):
    """The fresh-clone run of 2026-12-05: SIGTERM landed while Prefect set up a task run. While a flow runs, Prefect's
    SIGTERM handler, not solrl's, takes the signal and raises ``TerminationSignal``; its crash handler then failed
    with ``ValueError: Task run is not set``, so solrl's handler never ran and solrl exited 1. The stop is now read
    from the exception chain: exit 143 with the resume line, and MLflow records KILLED."""
    import contextlib

    import typer
    from prefect.exceptions import TerminationSignal

    import solrl.cli as cli
    import solrl.flows.server
    import solrl.flows.sol_rl

    def wrapped() -> ValueError:
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal:
            try:
                raise ValueError("Task run is not set")  # what Prefect's handle_crash raises, handling the stop
            except ValueError as exc:
                return exc

    def campaign(store: str, run_id: str) -> None:
        raise wrapped()

    assert solrl.flows.sol_rl._stop_status(wrapped()) == "KILLED"
    monkeypatch.setattr(solrl.flows.sol_rl, "campaign", campaign)
    monkeypatch.setattr(solrl.flows.server, "prefect_api", contextlib.nullcontext)
    monkeypatch.setattr(cli, "_interrupted", False)
    monkeypatch.setattr(cli, "_terminated", False)
    try:
        with pytest.raises(typer.Exit) as exited:
            cli._launch("/tmp/store", "wrapped")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert exited.value.exit_code == 143
    assert "terminated (SIGTERM); continue with `solrl resume wrapped --store /tmp/store`" in capsys.readouterr().err
