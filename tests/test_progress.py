"""The campaign progress line (terminal) and its plain per-iteration log line (elsewhere)."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from solrl.flows.progress import CampaignProgress, format_seconds, stage_notes


def test_the_live_line_shows_iteration_stage_elapsed_eta_and_the_latest_evaluation():
    plan = [(0, ["evaluate"]), (1, ["explore", "update", "evaluate"]), (2, ["explore", "update", "evaluate"])]
    out = io.StringIO()
    progress = CampaignProgress(plan, live=True, console=Console(file=out, force_terminal=True, width=200))
    progress.stage_started(0, "evaluate")
    progress.stage_done(0, "evaluate", 2.0, skipped=False, metrics={"eval/digit_evaluator": 0.43})
    progress.stage_started(1, "explore")
    progress.stage_done(1, "explore", 4.0, skipped=False, metrics={"explore/reward_mean": 0.5})
    progress.stage_started(1, "update")
    progress.close()
    text = out.getvalue()
    assert "iteration 1/2 update" in text and "2/7 stages" in text
    assert "ETA 0:00:15" in text  # 3 s per stage run so far x 5 stages left
    assert "digit_evaluator 0.430" in text


def test_a_long_evaluation_is_cut_at_the_terminal_width_and_the_stage_and_eta_keep_theirs():
    """At 120 columns tiny-digits' evaluation metrics squeezed the stage name and the ETA to a few letters."""
    import re

    out = io.StringIO()
    plan = [(0, ["evaluate"]), (1, ["explore", "score_regenerate", "update", "evaluate"])]
    progress = CampaignProgress(plan, live=True, console=Console(file=out, force_terminal=True, width=120))
    metrics = {"digit_alignment": 0.402, "digit_evaluator": 0.428, "jpeg_compressibility": -0.787, "diversity": 0.184}
    progress.stage_done(0, "evaluate", 2.0, skipped=False, metrics={f"eval/{k}": v for k, v in metrics.items()})
    progress.stage_started(1, "score_regenerate")
    progress.close()
    lines = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()))
    line = [x for x in lines if "score_regenerate" in x][-1].rstrip()
    assert "iteration 1/1 score_regenerate" in line and "1/5 stages" in line and "ETA 0:00:08" in line
    assert "digit_alignment 0.402" in line and line.endswith("…") and len(line) <= 120


def test_skipped_stages_count_toward_progress_but_not_toward_the_eta():
    plan = [(0, ["evaluate"]), (1, ["explore", "update"])]
    progress = CampaignProgress(plan, live=False)
    progress.stage_done(0, "evaluate", 100.0, skipped=True, metrics={})
    assert progress.eta != progress.eta  # nan: nothing ran in this process yet
    progress.stage_done(1, "explore", 6.0, skipped=False, metrics={"eval/diversity": 0.2})
    assert progress.eta == 6.0
    line = progress.summary(1)
    assert line.startswith("iteration 1/1 done; 2/3 stages, elapsed 0:00:0") and "ETA 0:00:06" in line
    assert line.endswith("; diversity 0.200")
    # an earlier iteration's evaluation (eval_every > 1) was shown as if it were this one's
    assert progress.summary(2).endswith("; evaluation of iteration 1: diversity 0.200")
    assert format_seconds(3725) == "1:02:05" and format_seconds(float("nan")) == "-:--:--"


def test_what_a_stage_logs_while_it_runs_reaches_its_task_log_and_the_live_line():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    progress = CampaignProgress([(1, ["explore"])], live=True, console=console)
    task_log = logging.getLogger("test-progress-task")  # stands where the Prefect task's run logger stands
    records: list[logging.LogRecord] = []
    kept = logging.Handler()
    kept.emit = records.append  # type: ignore[method-assign]
    task_log.addHandler(kept)
    task_log.propagate = False
    task_log.setLevel(logging.INFO)
    progress.stage_started(1, "explore")
    with stage_notes(task_log, progress):
        logging.getLogger("solrl.compile").info("compiling nvfp4_emulated explore copy: 3 blocks")
    logging.getLogger("solrl.compile").info("after the stage: not forwarded")
    progress.close()
    assert [r.getMessage() for r in records] == ["compiling nvfp4_emulated explore copy: 3 blocks"]
    assert "iteration 1/1 explore: compiling nvfp4_emulated explore copy" in out.getvalue()


def test_outside_a_terminal_the_console_leaves_out_prefects_routine_lines_and_the_ui_keeps_them():
    """A user's finding: piped to a file, a 3-iteration run logged 81 lines, two of Prefect's for every stage
    ("Finished in state Completed()") and links to the temporary server's pages, gone once the run ends; and a
    Ctrl-C printed Prefect's "Crash detected!" for every flow and task run it stopped."""
    from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

    from solrl.flows.progress import plain_console

    def record(message: str, level: int = logging.INFO, name: str = "prefect.task_runs") -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, message, None, None)

    routine = [
        record("Finished in state Completed()"),
        record("Beginning subflow run 'r-iter1' for flow 'x'"),
        # Ctrl-C on a terminal: four of these, the first on the live line, read as a crash (a user's finding)
        record("Crash detected! Execution was aborted by an interrupt signal.", logging.ERROR),
        record("Finished in state Crashed('Execution was aborted by a termination signal.')", logging.ERROR),
        record("Finished in state Crashed('Execution was aborted by a termination signal.')"),
    ]
    kept = [
        record("iteration 1 explore: committed in 2.70 s"),
        record("Finished in state Failed('Task run encountered an exception')", logging.ERROR),
        record("Crash detected! Execution was cancelled by the runtime environment.", logging.ERROR),
        record("Finished in state Completed()", name="mlflow"),  # another library's line is its own business
    ]
    link = record("View at http://127.0.0.1:4200/runs/flow-run/1", name="prefect.flow_runs")
    with plain_console(links=False):
        consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
        assert consoles
        for console in consoles:
            assert [console.filter(r) for r in [*routine, link]] == [False] * 6
            assert all(console.filter(r) for r in kept)
        api = [h for h in logging.getLogger("prefect.task_runs").handlers if isinstance(h, APILogHandler)]
        assert api and all(h.filter(r) for h in api for r in routine)  # the Prefect UI gets every line
    with plain_console(links=True):  # a lasting server's pages stay: the link is worth its line
        assert all(console.filter(link) for console in consoles)
    assert all(console.filter(r) for console in consoles for r in routine)  # as before, after the block
