"""The command line: bad input is one line, exit code 2, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from solrl.cli import app

runner = CliRunner()


@pytest.mark.parametrize(("args", "match"), [
    (["run", "no-such-preset"], "no preset or file named 'no-such-preset'"),
    (["run", "--set", "select.k=7"], "select.k=7 must be even"),
    (["run", "--set", "select.k=64"], "exceeds explore.pool_size=32"),
    (["run", "--set", "explore.pool_sise=8"], "explore.pool_sise: unknown key"),
    (["run", "--set", "explore.precision=int3"], "explore.precision: Input should be"),
    (["run", "--set", "explore.precision=nvfp4"], "explore.precision=nvfp4 cannot run here"),
    (["run", "--set", "campaign.prompts_file=/nope.txt"], "cannot read prompt file '/nope.txt'"),
    (["run", "--run-id", "../escape"], "run id '../escape' must be"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, args, match):
    store = tmp_path / "store"
    result = runner.invoke(app, [*args, "--set", f"storage.root={store}"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("solrl: error: ") and match in lines[0]
    assert not store.exists()


def test_a_store_that_cannot_be_written_exits_2(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = runner.invoke(app, ["run", "--set", f"storage.root={blocker / 'runs'}"])
    assert result.exit_code == 2, result.output
    assert "cannot create run" in result.stderr and "set storage.root to a writable folder" in result.stderr


def test_malformed_config_file_exits_2(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("explore: [\n")
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "not valid YAML" in result.stderr


def test_resume_of_an_unknown_run_exits_2(tmp_path: Path):
    result = runner.invoke(app, ["resume", "ghost", "--store", str(tmp_path)])
    assert result.exit_code == 2 and "no run 'ghost'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_ls_on_an_empty_store(tmp_path: Path):
    result = runner.invoke(app, ["ls", "--store", str(tmp_path)])
    assert result.exit_code == 0 and "no runs" in result.stdout
