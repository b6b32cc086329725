"""The command line: bad input is one line, exit code 2, and nothing written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from solrl.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["run", "no-such-preset"], "no preset or file named 'no-such-preset'"),
        (["run", "--set", "select.k=7"], "select.k=7 must be even"),
        (["run", "--set", "select.k=64"], "exceeds explore.pool_size=32"),
        (["run", "--set", "explore.pool_sise=8"], "explore.pool_sise: unknown key"),
        (
            ["run", "--set", "explore.precision=int3"],
            "explore.precision: unknown explore precision 'int3'; registered: bf16",
        ),
        (["run", "--set", "explore.precision=nvfp4"], "explore.precision=nvfp4 cannot run here"),
        (["run", "--set", "campaign.prompts_file=/nope.txt"], "cannot read prompt file '/nope.txt'"),
        (["run", "--run-id", "../escape"], "run id '../escape' must be"),
        (["run", "--run-id", "_x"], "run id '_x' must be 1-128 ASCII letters, digits, '.', '_' or '-', beginning with"),
        (["run", "--run-id", ""], "run id '' must be 1-128"),  # a breaker's finding: it was replaced by a new id
        # a config's name begins the ids of runs made without --run-id: the name is blamed, not a run id never given
        (["run", "--set", "name=../../etc"], "config name '../../etc' begins the ids of runs made without --run-id"),
        # a typo's pool (or steps) used to sit in explore for ever, drawing seeds one by one
        (["run", "--set", "explore.pool_size=100000000000000000000000"], "explore.pool_size: Input should be less"),
        (["run", "--set", "reward.weights={digit_alignment: 0.0}"], "are all 0, so every advantage is 0"),
        (["run", "--set", "regenerate.steps=5000"], "regenerate.steps: Input should be less than or equal to 1000"),
        (["run", "--set", "explore.precision=[1, 2"], "value '[1, 2' is not valid YAML (expected ',' or ']', but"),
        (["run", "--set", "train.loss_options={grpo_guard: true}"], "train.loss_options.grpo_guard: unknown key"),
        (["run", "--set", "campaign.on_guard=halt"], "campaign.on_guard: Input should be 'warn' or 'stop'"),
        (["plan", "--gpu", "nan"], "--gpu nan: a device's memory is a number of GiB above 0 and at most 4096"),
        (["plan", "--gpu", "0"], "--gpu 0: a device's memory"),
        (["plan", "--gpu", "1e30"], "--gpu 1e30: a device's memory"),
        (
            ["plan", "--gpu", "4096.0001"],
            "--gpu 4096.0001: a device's memory is a number of GiB above 0 and at most 4096",
        ),
        # a breaker's finding: plan printed diffusers' hub traceback where run names the missing file
        (
            ["plan", "tiny-digits", "--set", "model.path=/nonexistent"],
            "model.path: /nonexistent/transformer/config.json",
        ),
        (
            ["plan", "--gpu", "H100x"],
            "--gpu H100x: a device's memory is a number of GiB above 0 and at most 4096, or one of h100, h200, b200",
        ),
    ],
)
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
    path.write_text("# explore:\n#   pool_size: 96\n")  # empty, or cut short: was taken as the default preset
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and f"config '{path}' is empty; a config sets sections" in result.stderr


def test_plan_warns_of_a_prompt_file_that_a_run_would_refuse(tmp_path: Path):
    result = runner.invoke(app, ["plan", "--set", f"campaign.prompts_file={tmp_path / 'nope.txt'}", "--gpu", "80"])
    assert result.exit_code == 0, result.output
    assert "on an 80 GiB device" in result.stdout
    from solrl.stages.memory import a_or_an

    assert [a_or_an(w) for w in ("8", "11", "18", "80", "110", "141", "H100", "B200", "0.5")] == [
        "an", "an", "an", "an", "a", "a", "an", "a", "a"
    ]  # fmt: skip
    assert result.stderr.startswith("solrl: warning: campaign.prompts_file: cannot read prompt file")
    assert result.stderr.rstrip().endswith("`solrl run` refuses this config until it is fixed")


def test_resume_of_an_unknown_run_exits_2(tmp_path: Path):
    result = runner.invoke(app, ["resume", "ghost", "--store", str(tmp_path)])
    assert result.exit_code == 2 and "no run 'ghost'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_given_as_the_id_or_as_the_store_is_answered_with_the_store_and_the_id(tmp_path: Path):
    from conftest import tiny_config

    from solrl.storage.runs import create_run

    run = create_run(tiny_config(tmp_path / "store"), "demo")
    as_id = runner.invoke(app, ["inspect", str(run.run_dir)])
    assert as_id.exit_code == 2, as_id.output
    assert f"is a run's folder; give its store and its id: demo --store {tmp_path / 'store'}" in as_id.stderr
    as_store = runner.invoke(app, ["resume", "demo", "--store", str(run.run_dir)])
    assert as_store.exit_code == 2, as_store.output
    assert f"that folder is run 'demo' itself; its store is --store {tmp_path / 'store'}" in as_store.stderr
    assert not (run.run_dir / "demo").exists()


def test_inspect_writes_nothing_and_a_lease_that_cannot_be_written_is_one_line(tmp_path: Path):
    """inspect took the run's lease to learn whether a process runs it, so on a read-only store it died with a
    traceback (and could make a starting resume see the run as held); resume and prune there gave a traceback."""
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path / "store")
    run = create_run(cfg, "read-only")
    run_stage(StageContext(cfg, run.run_dir, run.run_id, 0), "evaluate")
    store = str(tmp_path / "store")
    before = {p: p.stat().st_mtime_ns for p in run.run_dir.rglob("*")}
    inspected = runner.invoke(app, ["inspect", "read-only", "--store", store, "--iteration", "0"])
    assert inspected.exit_code == 0, inspected.output
    assert {p: p.stat().st_mtime_ns for p in run.run_dir.rglob("*")} == before  # no lease taken, nothing written
    (run.run_dir / "_LEASE.json").mkdir()  # a lease this process cannot write, as on a read-only store
    for args in (["resume", "read-only"], ["prune", "read-only", "--keep-last", "1"]):
        done = runner.invoke(app, [*args, "--store", store])
        assert done.exit_code == 2 and "cannot write its lease" in done.stderr, done.output
        assert len([ln for ln in done.stderr.splitlines() if ln.strip()]) == 1, done.stderr


def test_ls_on_an_empty_store_and_on_a_store_that_is_not_there(tmp_path: Path):
    result = runner.invoke(app, ["ls", "--store", str(tmp_path)])
    assert result.exit_code == 0 and "no runs" in result.stdout
    # a typo in --store, or a file, said "no runs" with exit 0: as if the runs were gone
    (tmp_path / "a-file").write_text("x")
    for where, why in (("typo", "does not exist (a store's first run makes it)"), ("a-file", "is not a folder")):
        result = runner.invoke(app, ["ls", "--store", str(tmp_path / where)])
        assert (
            result.exit_code == 2 and result.stderr == f"solrl: error: no run store at {tmp_path / where}: it {why}\n"
        )
    # the commands that open one run said ".../a-file/r/run.json is unreadable ([Errno 20] Not a directory ...)"
    for command in (["inspect", "r"], ["report", "r"], ["prune", "r"], ["verify", "r"]):
        result = runner.invoke(app, [*command, "--store", str(tmp_path / "a-file")])
        assert result.exit_code == 2, result.output
        assert (
            result.stderr
            == f"solrl: error: store {tmp_path / 'a-file'} is not a folder; give the folder that holds the runs\n"
        )


def test_ls_lists_a_run_whose_run_json_is_damaged_and_skips_folders_that_are_no_run(tmp_path: Path):
    """A run with a torn run.json made ls say 'no runs' (inspect and resume named the file)."""
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "run.json").write_text('{"run_id": "dam')
    (tmp_path / "mlartifacts").mkdir()
    (tmp_path / "mlflow.db").write_bytes(b"SQLite format 3\x00")
    result = runner.invoke(app, ["ls", "--store", str(tmp_path)])
    assert result.exit_code == 0 and "damaged" in result.stdout and "run.json unreadable" in result.stdout
    assert "mlartifacts" not in result.stdout and "mlflow.db" not in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("setting", ["explore.precision=nvfp4", "explore.precision=fp8", "model.device=cuda"])
def test_a_run_made_on_a_gpu_machine_lists_and_reports_here_but_does_not_continue(
    tmp_path: Path, setting, monkeypatch, capsys
):
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run

    # As if made on a Blackwell machine: the config is valid anywhere; one committed stage to report.
    cfg = tiny_config(tmp_path / "store", setting)
    run = create_run(cfg, "from-gpu")
    run_stage(
        StageContext(
            cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": "cpu"})}), run.run_dir, run.run_id, 0
        ),
        "evaluate",
    )
    store = str(tmp_path / "store")
    listed = runner.invoke(app, ["ls", "--store", store])
    assert listed.exit_code == 0 and "from-gpu" in listed.stdout, listed.output
    # Not a terminal: one line a run, nothing folded (rich's 80 columns cut the date into three lines).
    (line,) = [ln for ln in listed.stdout.splitlines() if "from-gpu" in ln]
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +tiny-digits +\d+/\d+ +stopped after iter 0: evaluate", line), (
        line
    )
    reported = runner.invoke(app, ["report", "from-gpu", "--store", store])
    assert reported.exit_code == 0 and "digit_alignment" in reported.stdout, reported.output
    before = sorted(p.name for p in run.run_dir.rglob("*"))
    resumed = runner.invoke(app, ["resume", "from-gpu", "--store", store])
    assert resumed.exit_code == 2 and "no CUDA device" in resumed.stderr
    if setting.startswith("explore.precision"):  # what it needs, and where the run can go on
        assert "cannot run here: this machine has no CUDA device (" in resumed.stderr
        assert "resume it where that runs (ls, inspect, show and report read it anywhere)" in resumed.stderr
    assert len([ln for ln in resumed.stderr.splitlines() if ln.strip()]) == 1
    assert sorted(p.name for p in run.run_dir.rglob("*")) == before  # nothing written

    # The closing summary names the servers a run used, not a command that would start a second one.
    from solrl.cli import _report

    capsys.readouterr()
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _report(store, "from-gpu")
    alone = capsys.readouterr().out
    assert "prefect server start" in alone and "mlflow ui --workers 1 --backend-store-uri sqlite:" in alone
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    _report(store, "from-gpu")
    served = capsys.readouterr().out
    assert "Prefect UI: http://prefect.example:4200   (the server of PREFECT_API_URL)" in served
    assert "MLflow UI:  http://mlflow.example:5000/#/experiments/" in served and "mlflow ui" not in served


def _committed_run(tmp_path: Path, run_id: str = "r"):
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path / "store")
    run = create_run(cfg, run_id)
    run_stage(StageContext(cfg, run.run_dir, run.run_id, 0), "evaluate")
    return run


def test_ls_says_whether_a_run_is_running_or_stopped_and_past_guard_needs_a_guard_stop(tmp_path: Path):
    """ls showed the newest committed stage alone: a stopped, a running and a guard-stopped run read alike."""
    import json

    from solrl.storage.runs import create_run, list_runs, run_lock

    run = _committed_run(tmp_path)
    create_run(run.config, "fresh")
    store = str(run.run_dir.parent)

    def states() -> dict[str, str]:
        listed = runner.invoke(app, ["ls", "--store", store], env={"COLUMNS": "200"})
        assert listed.exit_code == 0, listed.output
        return {ln.split()[0]: ln for ln in listed.stdout.splitlines() if "tiny-digits" in ln}

    assert "stopped after iter 0: evaluate" in states()["r"] and "no stage committed" in states()["fresh"]
    with run_lock(run.run_dir):
        assert "running (iter 0: evaluate)" in states()["r"]
    refused = runner.invoke(app, ["resume", "r", "--store", store, "--past-guard"])
    assert refused.exit_code == 2, refused.output
    assert (
        "--past-guard: run r is not stopped by a guard (campaign.on_guard=warn); continue it without" in refused.stderr
    )
    assert "guards_passed" not in (run.run_dir / "run.json").read_text()
    from solrl.config import ConfigError
    from solrl.flows.deployment import sol_rl

    # The deployment's past_guard (the Prefect UI form) goes through the same check, and names a missing run.
    with pytest.raises(ConfigError, match="run r is not stopped by a guard"):
        sol_rl(run_id="r", store=store, past_guard=True)
    with pytest.raises(ConfigError, match="past_guard: run 'ghost' does not exist in .*; there is no guard stop"):
        sol_rl(run_id="ghost", store=store, past_guard=True)
    assert not (run.run_dir.parent / "ghost").exists()
    data = json.loads((run.run_dir / "run.json").read_text())
    (run.run_dir / "run.json").write_text(json.dumps({**data, "guards_passed": ["3"]}))  # edited by hand
    edited = runner.invoke(app, ["inspect", "r", "--store", store])
    assert edited.exit_code == 2 and "guards_passed must be a list of iterations, not ['3']" in edited.stderr
    assert "unreadable (solrl inspect says why)" in states()["r"]
    (run.run_dir / "iter_000000" / "evaluate" / "_MANIFEST.json").write_text('{"stage": "eval')  # torn: was a traceback
    assert {row["run_id"]: row["last_stage"] for row in list_runs(store)}["r"] == ""


def test_prune_names_the_pools_it_left_because_they_fail_verification(tmp_path: Path):
    """prune skipped a damaged pool and said "0.0 MiB removed", as if there had been nothing to remove."""
    from solrl.storage.stage import MANIFEST, stage_dir

    run = _committed_run(tmp_path)
    damaged = stage_dir(run.run_dir, 1, "explore") / MANIFEST
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"stage": "expl')
    store = str(run.run_dir.parent)
    pruned = runner.invoke(app, ["prune", "r", "--store", store, "--keep-last", "0"])
    assert pruned.exit_code == 0 and "0.0 MiB of pool data removed" in pruned.stdout, pruned.output
    assert (
        "(storage.pool=latents removes each pool's images; keep_pools removes the pool data of every iteration); "
        "pruning never adds back what an earlier rule removed" in pruned.stdout
    ), pruned.stdout
    again = runner.invoke(app, ["prune", "r", "--store", store])  # the run's own rule: no keep_pools
    assert "(storage.pool=latents removes each pool's images)" in again.stdout, again.output
    # A user's finding: `--pool rankings` said "every iteration's pools kept" while it removed every pool's data.
    ranked = runner.invoke(app, ["prune", "r", "--store", store, "--pool", "rankings", "--keep-every", "5"])
    assert "(storage.pool=rankings removes each pool's images and latents)" in ranked.stdout, ranked.output
    spared = runner.invoke(app, ["prune", "r", "--store", store, "--keep-last", "2", "--keep-every", "5"])
    assert "keep_pools removes the pool data of all iterations but the last 2 and every 5th)" in spared.stdout
    assert pruned.stderr == (
        "solrl: warning: left as they are, failing verification (a manifest unreadable or a file of another size): "
        f"iteration 1 explore; `solrl verify r --store {store} --redo` uncommits them and `solrl resume` redoes them\n"
    )


def test_ls_marks_a_run_whose_config_was_edited_by_hand(tmp_path: Path):
    """ls showed what an edited run.json said (2/1 iterations) while every other command refused it."""
    import json

    run = _committed_run(tmp_path)
    data = json.loads((run.run_dir / "run.json").read_text())
    data["config"]["campaign"]["iterations"] = 1
    (run.run_dir / "run.json").write_text(json.dumps(data))
    listed = runner.invoke(app, ["ls", "--store", str(run.run_dir.parent)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "run.json edited (config hash)" in listed.stdout, listed.output
    assert "2/1" not in listed.stdout and "1/1" not in listed.stdout


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--port", "99999"], "Invalid value for '--port'"),
        (["--device", "tpu"], "solrl: error: --device 'tpu': give auto, cpu, cuda or cuda:N"),
        # an address of no interface here (TEST-NET-1): refused without a name lookup
        (
            ["--host", "192.0.2.1"],
            "--host 192.0.2.1 --port 8765: cannot listen there (Cannot assign requested address)",
        ),
        (["--host", "127.0.0.1", "--port", "{taken}"], "--port {taken}: cannot listen there (Address already in use)"),
    ],
)
def test_reward_server_refuses_an_address_or_device_before_it_loads_a_model_or_says_it_serves(args, match):
    """A bad port or device was a traceback; a port in use or a host that does not resolve printed "serving
    reward ... on http://..." and then uvicorn's own error, exit 3."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = [a.format(taken=port) for a in args]
        result = runner.invoke(app, ["reward-server", "jpeg_compressibility", *args])
    assert result.exit_code == 2, result.output
    assert match.format(taken=port) in result.stderr and "serving reward" not in result.stderr


def test_ls_names_a_run_by_its_folder_the_id_every_command_takes(tmp_path: Path):
    """ls showed run.json's id: a copied run folder was listed under the original's id, and a command given that
    id opened the original, not the copy."""
    import shutil

    run = _committed_run(tmp_path)
    shutil.copytree(run.run_dir, run.run_dir.parent / "copy")
    listed = runner.invoke(app, ["ls", "--store", str(run.run_dir.parent)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    assert sorted(line.split()[0] for line in listed.stdout.splitlines() if "tiny-digits" in line) == ["copy", "r"]


def test_the_commands_that_messages_suggest_run_as_pasted_from_a_store_with_a_space(tmp_path: Path):
    """Suggested commands were not quoted for the shell: a store path with a space broke when pasted."""
    import shlex

    from conftest import tiny_config

    from solrl.storage.runs import create_run

    store = tmp_path / "my runs"
    create_run(tiny_config(store), "r")
    again = runner.invoke(app, ["run", "--run-id", "r", "--set", f"storage.root={store}"])
    ghost = runner.invoke(app, ["resume", "ghost", "--store", str(store)])
    assert again.exit_code == 2 and ghost.exit_code == 2
    (resume,) = re.findall(r"`(solrl resume [^`]*)`", again.stderr)
    (ls,) = re.findall(r"`(solrl ls [^`]*)`", ghost.stderr)
    assert shlex.split(resume) == ["solrl", "resume", "r", "--store", str(store)]
    assert shlex.split(ls) == ["solrl", "ls", "--store", str(store)]
    assert runner.invoke(app, shlex.split(ls)[1:]).exit_code == 0
    # `run` takes --store too, as every command it suggests does: the same as --set storage.root.
    same = runner.invoke(app, ["run", "--run-id", "r", "--store", str(store)])
    assert same.exit_code == 2 and same.stderr == again.stderr


def test_a_run_whose_plugin_is_not_installed_here_lists_and_reports_but_does_not_continue(tmp_path: Path):
    import json

    from solrl.config import config_digest

    run = _committed_run(tmp_path)
    data = json.loads((run.run_dir / "run.json").read_text())
    data["config"]["reward"]["weights"] = {"brightness": 1.0}  # a third-party reward absent from this machine
    data["config_hash"] = config_digest(data["config"])
    (run.run_dir / "run.json").write_text(json.dumps(data))
    store = str(run.run_dir.parent)
    assert runner.invoke(app, ["ls", "--store", store]).exit_code == 0
    reported = runner.invoke(app, ["report", "r", "--store", store])
    assert reported.exit_code == 0, reported.output
    resumed = runner.invoke(app, ["resume", "r", "--store", store])
    assert resumed.exit_code == 2 and "unknown reward 'brightness'" in resumed.stderr


def test_resume_of_a_run_another_process_holds_is_refused_before_anything_starts(tmp_path: Path):
    from solrl.storage.runs import run_lock

    run = _committed_run(tmp_path)
    store = str(run.run_dir.parent)
    with run_lock(run.run_dir):
        result = runner.invoke(app, ["resume", "r", "--store", store])
        pruned = runner.invoke(app, ["prune", "r", "--store", store, "--keep-last", "1"])
    assert result.exit_code == 2 and "is being written by another process" in result.stderr
    assert "resuming" not in result.stdout
    assert result.stderr.rstrip().endswith(f"then `solrl resume r --store {store}`")
    # a refused prune suggested a resume: it suggests the prune it refused
    assert pruned.exit_code == 2 and pruned.stderr.rstrip().endswith(
        f"then `solrl prune r --store {store} --keep-last 1`"
    )


def test_a_committed_file_changed_in_place_is_found_by_verify_and_pending_again_after_redo(tmp_path: Path):
    """Resume reads manifests and sizes (issue 36): a file truncated is pending again at once; a byte flipped in
    place is found by ``solrl verify``, and ``--redo`` makes it pending."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import first_pending
    from solrl.storage.stage import stage_dir

    run = _committed_run(tmp_path)
    ctx0 = StageContext(run.config, run.run_dir, run.run_id, 0, run.config_hash)
    assert first_pending(ctx0) == (1, "explore")
    table = stage_dir(run.run_dir, 0, "evaluate") / "metrics.parquet"
    from conftest import flip_middle_byte

    flip_middle_byte(table)  # same size, different bytes
    assert first_pending(ctx0) == (1, "explore")
    store = str(run.run_dir.parent)
    found = runner.invoke(app, ["verify", "r", "--store", store, "--redo"])
    assert found.exit_code == 1, found.output
    assert "iteration 0 evaluate: metrics.parquet: other bytes than committed (sha256)" in found.output
    assert first_pending(ctx0) == (0, "evaluate")
    table.write_bytes(table.read_bytes()[:-1])  # a truncated file: the size tells, no verify needed
    assert first_pending(ctx0) == (0, "evaluate")


def test_a_resume_with_overrides_and_an_export_before_any_checkpoint_say_what_to_do(tmp_path: Path):
    """A user's findings: ``resume --set`` got Typer's "No such option: --set", and an export of a run stopped
    before its first checkpoint did not say that resuming makes one."""
    run = _committed_run(tmp_path)
    store = str(run.run_dir.parent)
    overridden = runner.invoke(app, ["resume", "r", "--store", store, "--set", "campaign.iterations=5"])
    assert overridden.exit_code == 2 and "--set campaign.iterations=5: a run resumes with the config it began" in (
        overridden.stderr
    )
    assert "`solrl run CONFIG --set section.key=value`" in overridden.stderr and "resuming" not in overridden.stdout
    exported = runner.invoke(app, ["export", "r", "--store", store, "--out", str(tmp_path / "lora")])
    assert exported.exit_code == 2, exported.output
    assert exported.stderr.rstrip().endswith(
        f"has no committed checkpoint yet; `solrl resume r --store {store}` continues it"
    )


def test_no_command_writes_its_output_into_the_runs_own_folder(tmp_path: Path):
    """A breaker's finding: ``export --out`` into a checkpoint folder replaced its LoRA at the same size, and
    ``report --plot`` and ``show --out`` replaced committed figures; only ``verify`` noticed."""
    run = _committed_run(tmp_path)
    store, inside = str(run.run_dir.parent), run.run_dir / "iter_000000" / "evaluate"
    before = {p: p.read_bytes() for p in run.run_dir.rglob("*") if p.is_file()}
    for args in (
        ["report", "r", "--plot", f"{inside}/"],
        ["report", "r", "--html", str(run.run_dir / "r.html")],
        ["export", "r", "--out", str(inside)],
    ):
        result = runner.invoke(app, [*args, "--store", store])
        assert result.exit_code == 2 and "inside run r's own folder" in result.stderr, (args, result.output)
    assert {p: p.read_bytes() for p in run.run_dir.rglob("*") if p.is_file()} == before
    assert runner.invoke(app, ["report", "r", "--store", store, "--plot", str(tmp_path / "c.png")]).exit_code == 0


def test_verify_names_an_unreadable_file_and_a_stage_missing_before_a_committed_one(tmp_path: Path):
    """A breaker's findings: a committed file replaced by a folder (as a link loop, no permission or a disk's I/O
    error would) crashed ``verify`` and ``--redo`` with a traceback; a deleted iteration or manifest before
    committed stages passed as "every file matches"."""
    import shutil

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.stage import read_manifest, stage_dir

    run = _committed_run(tmp_path)
    for stage in ("explore", "score_explore"):
        run_stage(StageContext.of(run, 1), stage)
    store = str(run.run_dir.parent)
    rewards = stage_dir(run.run_dir, 1, "score_explore") / "rewards.parquet"
    rewards.unlink()
    rewards.mkdir()
    for args in ([], ["--redo"]):
        found = runner.invoke(app, ["verify", "r", "--store", store, *args])
        assert found.exit_code == 1 and isinstance(found.exception, SystemExit), found.output  # no traceback
        assert "iteration 1 score_explore: rewards.parquet: unreadable (Is a directory)" in found.output, found.output
    assert read_manifest(run.run_dir, 1, "score_explore") is None and "1 stage(s) uncommitted" in found.output
    rewards.rmdir()
    run_stage(StageContext.of(run, 1), "score_explore")
    assert runner.invoke(app, ["verify", "r", "--store", store]).exit_code == 0

    shutil.rmtree(stage_dir(run.run_dir, 1, "explore"))  # deleted, with a later stage committed
    found = runner.invoke(app, ["verify", "r", "--store", store])
    assert found.exit_code == 1, found.output
    assert found.output.startswith(
        "not committed, though a later stage is: iteration 1 explore (uncommitted by `verify --redo`, or deleted); "
        f"`solrl resume r --store {store}` recomputes it\n"
    )


def test_bad_output_paths_are_one_line_errors(tmp_path: Path):
    run = _committed_run(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = runner.invoke(app, ["report", "r", "--store", str(run.run_dir.parent), "--plot", str(blocker / "x.png")])
    assert (
        result.exit_code == 2 and f"--plot {blocker / 'x.png'}: its folder {blocker} is not a folder" in result.stderr
    )


def test_resume_refuses_weights_that_changed_since_the_run_was_created(tmp_path: Path):
    import shutil

    from conftest import tiny_config

    from solrl.stages.models import model_family
    from solrl.stages.models.tiny_digits import TINY_DIGITS_WEIGHTS
    from solrl.storage.runs import create_run

    weights = tmp_path / "weights"
    shutil.copytree(TINY_DIGITS_WEIGHTS, weights)
    cfg = tiny_config(tmp_path / "store", f"model.path={weights}")
    run = create_run(cfg, "w", weights=model_family(cfg.model).weights_fingerprint(cfg.model))
    assert run.weights and "transformer/diffusion_pytorch_model.safetensors" in run.weights
    store = str(run.run_dir.parent)
    tensor_file = weights / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-100] ^= 0x01  # one bit of one weight
    tensor_file.write_bytes(bytes(data))
    result = runner.invoke(app, ["resume", "w", "--store", store])
    assert result.exit_code == 2, result.output
    assert "model weights in" in result.stderr and "transformer/diffusion_pytorch_model.safetensors" in result.stderr
    assert "resuming" not in result.stdout


def test_a_weights_fingerprint_samples_large_files_but_sees_size_and_sampled_changes(tmp_path: Path):
    from solrl.storage.fingerprint import BLOCK, SAMPLES, changed_files, folder_fingerprint

    big = tmp_path / "w" / "big.safetensors"
    big.parent.mkdir()
    data = bytearray(range(256)) * (BLOCK * SAMPLES * 4 // 256)
    big.write_bytes(bytes(data))
    (tmp_path / "w" / "config.json").write_text("{}")
    (tmp_path / "w" / ".cache").mkdir()
    (tmp_path / "w" / ".cache" / "lock").write_text("ignored")
    before = folder_fingerprint(tmp_path / "w")
    assert sorted(before) == ["big.safetensors", "config.json"]
    data[-1] ^= 0xFF  # inside the last sampled block
    big.write_bytes(bytes(data))
    assert changed_files(before, folder_fingerprint(tmp_path / "w")) == ["big.safetensors"]
    big.write_bytes(bytes(data) + b"x")
    (tmp_path / "w" / "config.json").unlink()
    assert changed_files(before, folder_fingerprint(tmp_path / "w")) == ["big.safetensors", "config.json"]


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        (["serve"], {"PREFECT_API_URL": "http://127.0.0.1:1/api"}, "no Prefect server answers there"),
        (["serve"], {"PREFECT_API_URL": "notaurl"}, "no Prefect server answers there"),
        (["serve", "--name", "bad/name"], {"PREFECT_API_URL": "http://127.0.0.1:1/api"}, "cannot contain '/'"),
        (["serve", "--interval", "-5"], {"PREFECT_API_URL": "http://127.0.0.1:1/api"}, "greater than or equal to 1"),
        (["serve"], {"PREFECT_API_URL": ""}, "needs a Prefect server"),
        (["serve", "--cron", "not a cron"], {"PREFECT_API_URL": ""}, "--cron 'not a cron': Invalid cron string"),
    ],
)
def test_serve_refuses_bad_input_in_one_line(args, env, match, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert "Traceback" not in result.output


def test_a_run_folder_without_its_run_json_is_not_taken_over_by_a_new_run(tmp_path: Path):
    """A run whose run.json was deleted keeps its committed stages: a new run of that id would have taken them
    for its own (``ls``, ``verify`` and ``report`` counted another run's iteration 2 as the new one's)."""
    store = tmp_path / "store"
    manifest = store / "A" / "iter_000002" / "evaluate" / "_MANIFEST.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"run_id": "other"}')
    result = runner.invoke(app, ["run", "--run-id", "A", "--set", f"storage.root={store}"])
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line == (
        f"solrl: error: {store}/A holds files but no run.json, so it is no run solrl can continue, and a new run "
        "there would take its committed stages for its own; move the folder away or pick another run id"
    )
    assert sorted(p.name for p in (store / "A").rglob("*")) == ["_MANIFEST.json", "evaluate", "iter_000002"]


def test_inspect_of_a_rankings_pool_does_not_offer_latents_it_never_wrote(tmp_path: Path):
    """A breaker's finding: under storage.pool=rankings explore writes no latents, and once its images were pruned
    ``inspect`` said "its latents remain: `solrl show ...` decodes them", which ``show`` then refused."""
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import campaign_plan, run_stage
    from solrl.storage.retention import after_iteration
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path / "store", "storage.pool=rankings", "campaign.iterations=1", "fidelity.audit_every=0")
    run = create_run(cfg, "rk")
    for iteration, stages in campaign_plan(cfg):
        for stage in stages:
            if stage != "evaluate":
                run_stage(StageContext.of(run, iteration), stage)
    assert after_iteration(cfg, run.run_dir, 1) > 0
    inspected = runner.invoke(app, ["inspect", "rk", "--store", str(tmp_path / "store"), "--iteration", "1"])
    text = inspected.output.replace("\n", " ")
    assert inspected.exit_code == 0 and "images pruned by storage.pool=rankings; rankings above remain" in text, text
    assert "latents remain" not in text


def test_a_full_disk_while_writing_the_report_page_leaves_the_earlier_page_whole(tmp_path: Path, monkeypatch):
    """A breaker's finding: ``report --html`` onto an earlier page on a full disk left a truncated fragment of it
    (written in place); the page, the ``--plot`` PNG and ``show``'s picture now replace the old file only whole."""
    run = _committed_run(tmp_path)
    store, page = str(run.run_dir.parent), tmp_path / "r.html"
    assert runner.invoke(app, ["report", "r", "--store", store, "--html", str(page)]).exit_code == 0
    earlier = page.read_bytes()
    write_text = Path.write_text

    def disk_fills(self, data, *args, **kwargs):
        write_text(self, data[:100], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_fills)
    result = runner.invoke(app, ["report", "r", "--store", store, "--html", str(page)])
    assert result.exit_code == 2 and "cannot write the page there (No space left on device)" in result.stderr
    assert page.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "store"]


def test_a_failure_a_resume_would_repeat_names_what_gets_past_it(tmp_path: Path, monkeypatch, capsys):
    """A breaker's finding: every failed campaign advised `solrl resume`, also where a resume fails the same way.
    A NaN loss or gradient and NaN samples are what the run's fixed config, weights and seeds compute (a new run
    with a changed setting gets past them); a committed input whose bytes changed keeps its manifest (`verify
    --redo` uncommits it first). Neither is retried; any other error still says to resume."""
    import contextlib
    import signal
    from types import SimpleNamespace

    import typer
    from conftest import tiny_config

    import solrl.cli as cli
    import solrl.flows.server
    import solrl.flows.sol_rl
    from solrl.flows.sol_rl import _worth_retrying
    from solrl.stages.sampling.rollout import NonFiniteSamples
    from solrl.storage.artifacts import Checkpoint
    from solrl.storage.lease import LeaseLost
    from solrl.storage.runs import create_run
    from solrl.storage.stage import StageChanged, StageOutput, commit

    def wrapped(error: Exception) -> RuntimeError:  # as a process of the update reports its own error
        try:
            raise error
        except Exception as inner:
            try:
                raise RuntimeError("update failed") from inner
            except RuntimeError as outer:
                return outer

    def launch(error: Exception, store: str) -> str:
        def campaign(store: str, run_id: str) -> None:
            raise error

        monkeypatch.setattr(solrl.flows.sol_rl, "campaign", campaign)
        try:
            with pytest.raises(typer.Exit) as exited:
                cli._launch(store, "r")
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert exited.value.exit_code == 1
        return capsys.readouterr().err

    monkeypatch.setattr(solrl.flows.server, "prefect_api", contextlib.nullcontext)
    resume = "continue with `solrl resume r --store /s`"
    nan = wrapped(FloatingPointError("non-finite grad norm nan; lower train.lr"))
    for error, said in (
        (nan, "FloatingPointError: non-finite"),
        (NonFiniteSamples("explore: 1 of 4 samples came out NaN"), "NonFiniteSamples: explore: 1 of 4"),
        (StageChanged("iteration 1 stage 'checkpoint': policy.safetensors changed; `solrl verify r ...`"), "Stage"),
        (RuntimeError("CUDA error: an illegal memory access"), "RuntimeError: CUDA error"),
        (LeaseLost("s/r/_LEASE.json was taken by pid 7 on h after this process's lease expired"), "LeaseLost: s/r"),
    ):
        err = launch(error, "/s")
        assert err.startswith(f"solrl: error: {said}"), err
        retried = _worth_retrying(None, None, SimpleNamespace(data=error))
        if isinstance(error, StageChanged):
            assert (
                f"`solrl resume` alone would read the changed file again: `verify --redo` first, then {resume}" in err
            )
            assert not retried
        elif "CUDA" in said:
            assert err.endswith(f"committed stages are kept; {resume}\n") and retried
        elif isinstance(error, LeaseLost):  # another process goes on with the run: no resume to suggest
            assert "the process that took the run over continues it (`solrl ls --store /s`" in err, err
            assert resume not in err and not retried
        else:
            assert "but `solrl resume` would compute the same again" in err and "`solrl run CONFIG --set " in err
            assert "`solrl verify r --store /s` checks that its stored files are intact" in err
            assert "takes its last checkpoint" not in err and resume not in err  # no run r in /s: no checkpoint
            assert not retried

    # A run with a committed checkpoint: the error names the export of it.
    run = create_run(tiny_config(tmp_path), "r")

    def write(out: Path) -> StageOutput:
        Checkpoint({"policy": {}}, {"global_step": 2}).write(out)
        return StageOutput(metrics={}, info={})

    commit(run.run_dir, "r", 1, "checkpoint", "k", write)
    err = launch(nan, str(tmp_path))
    assert f"`solrl export r --store {tmp_path} --out FOLDER` takes its last checkpoint (iteration 1)" in err, err
