"""Campaign progress for people: one live line on a terminal, plain log lines elsewhere.

The campaign flow reports each stage's start and end here. On a terminal (``solrl run`` / ``resume`` with
stderr a TTY) a rich progress line shows iteration i/N, the current stage, elapsed time, the ETA and the
latest evaluation; elsewhere (CI, a log file, ``nohup``) the flow's log gets one line per finished iteration
with the same figures. The ETA is the mean seconds of the stages run so far in this process times the stages
left in the plan (stages skipped on resume count neither way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column


def format_seconds(seconds: float) -> str:
    """``h:mm:ss`` (``-:--:--`` when unknown)."""
    if seconds != seconds or seconds < 0:  # nan
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class CampaignProgress:
    """Progress of one campaign over its plan of ``(iteration, [stages])`` (``campaign_plan``).

    Args:
        plan: the campaign plan. live: draw a live line on ``console`` (a terminal); else only ``summary``
            lines are produced, for the caller to log. console: where the live line goes (stderr by default).
    """

    def __init__(self, plan: Sequence[tuple[int, Sequence[str]]], live: bool, console: Console | None = None):
        self.total = sum(len(stages) for _, stages in plan)
        self.iterations = max(i for i, _ in plan)
        self.done = 0
        self.ran_seconds = 0.0
        self.ran = 0
        self.started = time.monotonic()
        self.latest: dict[str, float] = {}
        self.latest_iteration = 0  # the iteration ``latest`` evaluated
        self._where = ""
        self._progress: Progress | None = None
        if live:
            # The evaluation takes what width is left and is cut with an ellipsis: everything before it keeps
            # its width (a long evaluation squeezed the stage and the ETA to a few characters).
            self._progress = Progress(
                TextColumn("[bold]{task.fields[where]}", table_column=Column(no_wrap=True)),
                BarColumn(bar_width=24),
                TextColumn("{task.completed}/{task.total} stages", table_column=Column(no_wrap=True)),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}", table_column=Column(no_wrap=True)),
                TextColumn(
                    "{task.fields[evaluation]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")
                ),
                console=console or Console(stderr=True),
                transient=False,
                expand=True,
            )
            self._task = self._progress.add_task("campaign", total=self.total, where="", eta="", evaluation="")
            self._progress.start()

    @property
    def eta(self) -> float:
        """Seconds left: mean seconds of the stages run so far times the stages left (nan before any ran)."""
        return (self.ran_seconds / self.ran) * (self.total - self.done) if self.ran else float("nan")

    def evaluation(self) -> str:
        """The latest evaluation's metrics, in the evaluate stage's order (its rewards, then the guards')."""
        return " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in self.latest.items())

    def _refresh(self, where: str) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=self.done,
                where=where,
                eta=format_seconds(self.eta),
                evaluation=self.evaluation(),
            )

    def stage_started(self, iteration: int, stage: str) -> None:
        self._where = f"iteration {iteration}/{self.iterations} {stage}"
        self._refresh(self._where)

    def note(self, message: str) -> None:
        """Say what the running stage is doing now, after its name (``compiling the BF16 rollout...``), until it
        ends: a long first batch is not mistaken for a hang."""
        self._refresh(f"{self._where}: {message}")

    def stage_done(self, iteration: int, stage: str, seconds: float, skipped: bool, metrics: dict[str, float]) -> None:
        """Count a stage; ``seconds`` feeds the ETA unless the stage was ``skipped`` (committed earlier)."""
        self.done += 1
        if not skipped:
            self.ran += 1
            self.ran_seconds += seconds
        if evaluation := {k: v for k, v in metrics.items() if k.startswith("eval/")}:
            self.latest, self.latest_iteration = evaluation, iteration
        self._refresh(f"iteration {iteration}/{self.iterations} {stage} done")

    def summary(self, iteration: int) -> str:
        """The plain line for the end of ``iteration``: position, elapsed, ETA, latest evaluation (named by its
        iteration when an earlier one's: ``campaign.eval_every`` > 1)."""
        older = f"evaluation of iteration {self.latest_iteration}: " if self.latest_iteration != iteration else ""
        return (
            f"iteration {iteration}/{self.iterations} done; {self.done}/{self.total} stages, elapsed "
            f"{format_seconds(time.monotonic() - self.started)}, ETA {format_seconds(self.eta)}"
            + (f"; {older}{self.evaluation()}" if self.latest else "")
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


_current: CampaignProgress | None = None
_live = False


#: What Prefect's engine logs at INFO for every flow and task run that the campaign's own lines already carry
#: (each stage's "committed in" line, each iteration's summary): outside a terminal they doubled a run's log.
ENGINE_ROUTINE = ("Finished in state Completed()", "Beginning flow run", "Beginning subflow run")
#: Why Prefect's engine says a flow or task run crashed when Ctrl-C or SIGTERM stopped it: it logs "Crash detected!
#: <why>" and "Finished in state Crashed('<why>')" for every run the stop ended. A stop is not a crash, and solrl's
#: own line says how to continue.
ENGINE_STOPPED = ("Execution was aborted by an interrupt signal.", "Execution was aborted by a termination signal.")


class EngineRoutineFilter(logging.Filter):
    """Drops Prefect's ``ENGINE_ROUTINE`` and ``ENGINE_STOPPED`` lines, and without ``links`` its ``View at <url>``
    lines (the temporary server's pages are gone once the run ends), from the console; other errors, warnings and
    solrl's lines pass."""

    def __init__(self, links: bool) -> None:
        super().__init__()
        self.links = links

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno not in (logging.INFO, logging.ERROR) or not record.name.startswith("prefect"):
            return True
        message = record.getMessage()
        if message.startswith(("Crash detected! ", "Finished in state Crashed(")):
            return not any(why in message for why in ENGINE_STOPPED)
        if record.levelno == logging.ERROR:
            return True
        return not (message.startswith(ENGINE_ROUTINE) or (not self.links and message.startswith("View at ")))


@contextmanager
def plain_console(links: bool) -> Iterator[None]:
    """Within this block Prefect's console handlers (the root logger's, as Prefect's logging config sets them up)
    leave out the engine's routine lines (``EngineRoutineFilter``); the Prefect UI still gets every line."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    routine = EngineRoutineFilter(links)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in handlers:
        handler.addFilter(routine)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(routine)


def enable_live(live: bool) -> None:
    """Ask campaigns started in this process for the live line (the CLI: stderr is a terminal)."""
    global _live
    _live = live


def start(plan: Sequence[tuple[int, Sequence[str]]]) -> CampaignProgress:
    """The progress of the campaign starting now in this process (live if enabled); ``current()`` returns it
    to the stage tasks of its iteration subflows."""
    global _current
    if _current is not None:
        _current.close()
    _current = CampaignProgress(plan, live=_live)
    return _current


def current() -> CampaignProgress | None:
    """The progress of the campaign running in this process, if any."""
    return _current


class _StageNotes(logging.Handler):
    """solrl's own log records (the ``solrl`` logger) to a stage's run logger and the live line."""

    def __init__(self, run_logger: logging.Logger | logging.LoggerAdapter, progress: CampaignProgress | None):
        super().__init__(logging.INFO)
        self.run_logger, self.progress = run_logger, progress

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.run_logger.log(record.levelno, message)
        if self.progress is not None:
            self.progress.note(message)


@contextmanager
def stage_notes(
    run_logger: logging.Logger | logging.LoggerAdapter, progress: CampaignProgress | None = None
) -> Iterator[None]:
    """While a stage runs: what solrl's stage code logs at INFO or above (``compiling the explore copy:
    ...``) goes to the stage's Prefect task log and, on a terminal, after the stage's name in the live line
    of ``progress`` (default: the campaign running in this process)."""
    solrl_log = logging.getLogger("solrl")
    handler, level = _StageNotes(run_logger, progress or _current), solrl_log.level
    solrl_log.addHandler(handler)
    solrl_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        solrl_log.removeHandler(handler)
        solrl_log.setLevel(level)
