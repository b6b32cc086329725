"""``solrl inspect`` and ``solrl show``: audit a run from its stored files, finished or dead mid-iteration;
bad input (unknown run or iteration, corrupted manifest or Parquet file) is one clear error, exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import flip_middle_byte, tiny_config
from PIL import Image
from typer.testing import CliRunner

from solrl.cli import app
from solrl.stages.pipeline import campaign_plan
from solrl.storage.audit import audit_iteration, pool_view, stage_state
from solrl.storage.stage import MANIFEST, stage_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-iteration tiny run (with a fidelity audit at iteration 2); its store folder."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run

    store = tmp_path_factory.mktemp("audit") / "store"
    run = create_run(tiny_config(store), "done")
    for iteration, stages in campaign_plan(run.config):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            run_stage(ctx, stage)
    return store


def copy_run(finished: Path, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(finished, store)
    return store


def inspect(store: Path, *extra: str):
    return runner.invoke(app, ["inspect", "done", "--store", str(store), *extra])


def test_inspect_a_finished_run_shows_pool_selection_fidelity_and_timings(finished: Path):
    result = inspect(finished, "--iteration", "2")
    assert result.exit_code == 0, result.output
    for text in (
        "run done, iteration 2",
        "candidate pool: weighted reward per prompt",
        "kept seeds",
        "bf16_reward",
        "proxy fidelity per prompt",
        "spearman",
        "audit: 2 whole pools regenerated in BF16",
        "fidelity/spearman",
    ):
        assert text in result.output, text
    assert "not committed" not in result.output and "missing" not in result.output
    found = audit_iteration(finished / "done", 2, dict(campaign_plan(tiny_config(finished)))[2])
    assert set(found.states.values()) == {"committed"}
    assert len(found.pool) == 2 and (found.pool["candidates"] == 8).all()
    assert len(found.selection) == 2 * 4 and found.selection["bf16_reward"].notna().all()
    assert list(found.selection["kept_as"][:4]) == ["best", "best", "worst", "worst"]
    # the default iteration is the last one begun
    assert "run done, iteration 2" in inspect(finished).output


def test_inspect_and_show_a_run_that_died_mid_iteration(finished: Path, tmp_path: Path):
    store = copy_run(finished, tmp_path)
    for stage in ("score_regenerate", "audit", "update", "checkpoint", "evaluate"):
        shutil.rmtree(stage_dir(store / "done", 2, stage))
    (stage_dir(store / "done", 2, "update").parent / ".update.tmp-0123abcd").mkdir()  # killed while writing
    result = inspect(store)
    assert result.exit_code == 0, result.output
    assert "run done, iteration 2" in result.output
    assert stage_state(store / "done", 2, "update")[0] == "incomplete"
    assert stage_state(store / "done", 2, "checkpoint")[0] == "missing"
    assert "proxy fidelity per prompt (kept seeds): not available (score_regenerate missing)" in result.output
    assert "not committed: score_regenerate, audit, update, checkpoint, evaluate" in result.output
    assert "kept seeds" in result.output

    out = tmp_path / "pool.png"
    shown = runner.invoke(
        app, ["show", "done", "--store", str(store), "--iteration", "2", "--prompt", "1", "--out", str(out)]
    )
    assert shown.exit_code == 0, shown.output
    assert "8 candidates, 4 kept" in shown.output
    assert Image.open(out).size[0] > 8 * 32


def test_show_orders_the_pool_by_reward_and_marks_the_kept_seeds(finished: Path, tmp_path: Path):
    view = pool_view(finished / "done", 1, "0")
    assert list(view.rewards) == sorted(view.rewards, reverse=True)
    assert view.kept_as[:2] == ["best", "best"] and view.kept_as[-2:] == ["worst", "worst"]
    assert view.kept_as[2:-2] == [None] * 4
    assert view.images.shape[0] == 8 and sorted(view.candidates) == list(range(8))
    by_text = pool_view(finished / "done", 1, view.prompt)
    assert list(by_text.candidates) == list(view.candidates)
    out = tmp_path / "p.png"
    result = runner.invoke(
        app, ["show", "done", "--store", str(finished), "--iteration", "1", "--prompt", view.prompt, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.exists()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["inspect", "nope"], "no run 'nope'"),
        (["inspect", "done", "--iteration", "9"], "run done has no iteration 9: its campaign has iterations 0"),
        (["show", "done", "--iteration", "-1", "--prompt", "0"], "run done has no iteration -1"),
        (["show", "done", "--iteration", "1", "--prompt", "zebra"], "'zebra' matches no prompt of iteration 1"),
        (["show", "done", "--iteration", "0", "--prompt", "0"], "iteration 0 only evaluates the starting policy; it "),
        (["report", "nope"], "no run 'nope'"),
    ],
)
def test_bad_input_is_one_line_exit_2(finished: Path, args: list[str], match: str):
    result = runner.invoke(app, [*args, "--store", str(finished)])
    assert result.exit_code == 2, result.output
    assert match in result.stderr
    assert len([ln for ln in result.stderr.splitlines() if ln.strip()]) == 1


def test_a_corrupted_parquet_file_or_manifest_is_reported_not_read(finished: Path, tmp_path: Path):
    store = copy_run(finished, tmp_path)
    table = stage_dir(store / "done", 1, "score_explore") / "rewards.parquet"
    flip_middle_byte(table)
    (stage_dir(store / "done", 1, "select") / MANIFEST).write_text("{not json")

    result = inspect(store, "--iteration", "1")
    assert result.exit_code == 2
    assert "score_explore, select fail verification" in result.stderr
    assert "--redo` uncommits every stage whose files changed" in result.stderr
    assert "candidate pool: weighted reward per prompt: not available (score_explore corrupted)" in result.output
    shown = runner.invoke(app, ["show", "done", "--store", str(store), "--iteration", "1", "--prompt", "0"])
    assert shown.exit_code == 2 and "no verified candidate pool" in shown.stderr
    reported = runner.invoke(app, ["report", "done", "--store", str(store)])
    assert reported.exit_code == 2 and "iteration 1: select: its _MANIFEST.json is unreadable; " in reported.stderr


def test_show_draws_a_pool_whose_select_stage_fails_verification_and_says_no_seed_is_marked(
    finished: Path, tmp_path: Path
):
    """A damaged select stage: show drew "0 kept" and exit 0 without a word when its manifest did not hold, and
    blamed explore and score_explore, both intact, when its table's bytes changed."""
    store = copy_run(finished, tmp_path)
    args = ["show", "done", "--store", str(store), "--iteration", "1", "--prompt", "0", "--out", str(tmp_path)]
    redo = f"`solrl verify done --store {store} --redo` uncommits it and `solrl resume` redoes it"
    flip_middle_byte(stage_dir(store / "done", 1, "select") / "selection.parquet")
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0 and "8 candidates, 0 kept" in shown.stdout, shown.output
    assert shown.stderr == (
        f"solrl: warning: iteration 1's select stage fails verification, so no seed is marked kept; {redo}\n"
    )
    shutil.rmtree(stage_dir(store / "done", 1, "select"))
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0 and "0 kept" in shown.stdout
    assert shown.stderr == "solrl: warning: iteration 1's select stage is not committed, so no seed is marked kept\n"


def test_report_plot_paths_are_checked_before_the_table(finished: Path, tmp_path: Path):
    """``--plot`` wrote ``noext.png`` and said ``noext``, raised matplotlib's traceback for ``.txt`` after the
    table, and ``--html`` of the same path replaced the curves without a word: each takes its own suffix, or a
    folder."""
    args = ["report", "done", "--store", str(finished)]
    into = runner.invoke(app, [*args, "--plot", str(tmp_path), "--html", str(tmp_path)])
    assert into.exit_code == 0 and f"curves saved to {tmp_path / 'done-curves.png'}" in into.stdout, into.output
    assert f"report page written to {tmp_path / 'done-report.html'}" in into.stdout
    assert (tmp_path / "done-curves.png").read_bytes().startswith(b"\x89PNG")
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in into.stdout.splitlines()]
    rows = [row for row in rows if row and row[0].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2"] and rows[0][-1] == ""  # iteration 0 only evaluates: no s/iter
    assert float(rows[1][-1]) > 0
    for plot, extra, says in (
        ("noext", [], "--plot {}: give a .png file (or a folder, for done-curves.png)"),
        ("p.txt", [], "--plot {}: give a .png file (or a folder, for done-curves.png)"),
        ("same.png", ["--html", str(tmp_path / "same.png")], "--html {}: give an .html file (or a folder, for "),
    ):
        bad = runner.invoke(app, [*args, "--plot", str(tmp_path / plot), *extra])
        assert bad.exit_code == 2 and bad.stdout == "", bad.output
        assert bad.stderr.startswith("solrl: error: " + says.format(tmp_path / plot)), bad.stderr
    nowhere = runner.invoke(app, [*args, "--plot", str(tmp_path / "c.png"), "--html", str(tmp_path / "no" / "r.html")])
    assert nowhere.exit_code == 2 and nowhere.stdout == "", nowhere.output  # nothing written, no table
    assert f"--html {tmp_path / 'no' / 'r.html'}: its folder {tmp_path / 'no'} does not exist" in nowhere.stderr
    empty = runner.invoke(app, [*args, "--html", ""])  # was the current folder
    assert empty.exit_code == 2 and "--html is empty: give an .html file or a folder" in empty.stderr, empty.output
    slash = runner.invoke(app, [*args, "--html", f"{tmp_path / 'no'}/"])  # a folder meant, not a file "no"
    assert slash.exit_code == 2 and f"--html {tmp_path / 'no'}/: it does not exist" in slash.stderr, slash.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done-curves.png", "done-report.html"]


def test_the_docs_audit_snippet_runs_on_a_finished_run(finished: Path, monkeypatch: pytest.MonkeyPatch):
    """The audit guide's pandas / DuckDB / xarray example (docs/guides/audit.md), as written, on a real run store."""
    import re

    page = (Path(__file__).parents[1] / "docs" / "guides" / "audit.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "duckdb" in b]
    monkeypatch.chdir(finished.parent)
    namespace: dict[str, object] = {}
    snippet = snippet.replace("runs/<run_id>", "store/done").replace("iter_000003", "iter_000002")
    exec(compile(snippet, "audit.md", "exec"), namespace)
    assert namespace["pool"]["images"].dims == ("prompt", "candidate", "y", "x", "rgb")
    assert len(namespace["kept"]) == 2 * 4
    assert len(namespace["per_prompt"]) == 2 and set(namespace["per_prompt"]["candidates"]) == {8}
    assert len(namespace["every_iteration"]) == 2 * 2 * 4  # 2 iterations x 2 prompts x 4 kept seeds, 1 reward


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(page: Path, *args: str, width: int = 1400, height: int = 1000) -> str:
    """Headless Chromium (Debian's package) on ``page`` in a ``width`` x ``height`` px window; its stdout."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--hide-scrollbars",
                "--virtual-time-budget=5000",
                *args,
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout


def rendered_figures(page: Path) -> tuple[int, int, list[dict], int]:
    """(figures, figures rendered, each figure's rectangle, window width) of a report page loaded in headless
    Chromium at a 1400 px window."""
    import html as html_lib
    import json
    import re

    dom = _chromium(page, "--dump-dom")
    total = re.search(r'data-figures="(\d+)"', dom)
    done = re.search(r'data-figures-rendered="(\d+)"', dom)
    geometry = re.search(r'data-geometry="([^"]*)"', dom)
    window = re.search(r'data-window="(\d+)"', dom)
    assert total and done and geometry and window, dom[:2000]
    rects = json.loads(html_lib.unescape(geometry.group(1)))
    return int(total.group(1)), int(done.group(1)), rects, int(window.group(1))


def test_report_html_is_one_self_contained_page_with_every_figure(finished: Path, tmp_path: Path):
    page = tmp_path / "report.html"
    result = runner.invoke(app, ["report", "done", "--store", str(finished), "--html", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    for title in (
        "Training reward",
        "Evaluation rewards",
        "Proxy fidelity",
        "Guards: sample diversity, grid-artifact energy and (videos) temporal change",
        "Stage-time split",
        "Best (left) and worst kept candidates per iteration",
        "Evaluation samples, starting policy",
        "<h2 id='config'>Config</h2>",
    ):
        assert title in text, title
    for anchor in ("training-reward", "evaluation-rewards", "proxy-fidelity", "guards", "kept", "evaluation-samples"):
        assert f"<h2 id='{anchor}'>" in text, anchor  # report.html#kept links into the page
    assert "src='http" not in text and 'src="http' not in text  # nothing fetched: self-contained
    assert text.count("data:image/png;base64,") == 6 + 2 + 2  # curves and split, 2 grids, 2 evaluations
    assert "Not committed yet" not in text
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    total, rendered, rects, window = rendered_figures(page)
    assert (total, rendered, window) == (10, 10, 1400)  # every image decoded, at a 1400 px window
    for rect in rects:
        assert rect["width"] >= 300, f"{rect['alt']} is {rect['width']:.0f} px wide at a 1400 px window"
        assert rect["left"] >= 0 and rect["left"] + rect["width"] <= window, f"{rect['alt']} leaves the page"
    for i, a in enumerate(rects):
        for b in rects[i + 1 :]:
            apart_x = a["left"] + a["width"] <= b["left"] or b["left"] + b["width"] <= a["left"]
            apart_y = a["top"] + a["height"] <= b["top"] or b["top"] + b["height"] <= a["top"]
            assert apart_x or apart_y, f"{a['alt']} overlaps {b['alt']}"
    charts = [r for r in rects if r["alt"] in ("Training reward", "Stage-time split")]
    assert all(r["width"] >= 1000 for r in charts), charts  # the charts use the page's width
    starting, final = (r for r in rects if r["alt"].startswith("evaluation, "))
    assert abs(starting["top"] - final["top"]) < 1 and starting["left"] < final["left"]  # side by side
    _chromium(page, f"--screenshot={tmp_path / 'report-1400px.png'}", height=4200)
    assert (tmp_path / "report-1400px.png").stat().st_size > 10_000  # left for a look: the test's tmp_path


def test_report_html_of_a_run_that_died_mid_iteration_says_what_is_missing(finished: Path, tmp_path: Path):
    store = copy_run(finished, tmp_path)
    for stage in ("update", "checkpoint", "evaluate"):
        shutil.rmtree(stage_dir(store / "done", 2, stage))
    page = tmp_path / "died.html"
    result = runner.invoke(app, ["report", "done", "--store", str(store), "--html", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "Not committed yet" in text and "iteration 2: update, checkpoint, evaluate" in text
    assert "solrl resume done" in text
    if CHROMIUM is not None:
        total, rendered, _, _ = rendered_figures(page)
        assert total == rendered > 0


def test_report_html_does_not_embed_an_image_that_fails_verification(finished: Path, tmp_path: Path):
    store = copy_run(finished, tmp_path)
    grid = stage_dir(store / "done", 2, "select") / "best_worst.png"
    flip_middle_byte(grid)
    page = tmp_path / "r.html"
    assert runner.invoke(app, ["report", "done", "--store", str(store), "--html", str(page)]).exit_code == 0
    text = page.read_text()
    assert "Not shown, failing verification" in text and "iteration 2: select" in text
    assert "best and worst, iteration 2" not in text and "best and worst, iteration 1" in text
    # The fix it names is verify --redo: a resume checks sizes, and the flipped byte kept the size.
    assert f"<code>solrl verify done --store {store} --redo</code> uncommits them and" in text


def test_show_writes_into_a_folder_and_refuses_an_out_that_is_not_a_png(finished: Path, tmp_path: Path):
    args = ["show", "done", "--store", str(finished), "--iteration", "1", "--prompt", "1"]
    into = runner.invoke(app, [*args, "--out", str(tmp_path)])
    assert into.exit_code == 0, into.output
    assert (tmp_path / "done-iter1-prompt1.png").exists()
    bad = runner.invoke(app, [*args, "--out", str(tmp_path / "noext")])
    assert bad.exit_code == 2 and "give a .png file (or a folder, for done-iter1-prompt<i>.png)" in bad.stderr
    slash = runner.invoke(app, [*args, "--out", f"{tmp_path / 'new'}/"])  # a folder meant: refused before any work
    assert slash.exit_code == 2 and f"--out {tmp_path / 'new'}/: it does not exist" in slash.stderr, slash.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done-iter1-prompt1.png"]


def test_the_rankings_artifact_carries_seeds_exactly_as_strings(finished: Path):
    """A seed is int64; the Prefect UI reads JSON numbers as doubles and showed 8647285256395037271 as
    8647285256395037000, so a seed copied from the rankings artifact regenerated another image."""
    from solrl.storage.artifacts import Selection
    from solrl.storage.summary import rankings

    run_dir = finished / "done"
    rows = rankings(run_dir, 2)
    kept = Selection.load(run_dir, 2).frame["seed"]
    assert all(isinstance(r["seed"], str) for r in rows)
    assert sorted(int(r["seed"]) for r in rows) == sorted(int(s) for s in kept)
    assert any(int(s) > 2**53 for s in kept)  # the case a double cannot hold
