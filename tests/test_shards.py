"""Sharded stages (issue 11): explore and regenerate split into prompt shards, each committed on its own, then
one reduce. The answer must not depend on the shard count, a killed shard is redone alone, and a run killed
with one shard count resumes with another to the same result."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CHILD_PRELOAD, needs_batch_invariant_gemm, tiny_config
from fault_injection import FAULT_ENV
from test_faults import outputs

from solrl.stages.context import StageContext
from solrl.stages.pipeline import STAGES, campaign_plan, run_shard, run_stage, shards_folder, stage_shards
from solrl.stages.sharding import Shard
from solrl.storage.runs import create_run, open_run, set_shards
from solrl.storage.stage import read_manifest

RUN_ID = "shards"
#: Four prompts per iteration, so 1, 2 and 4 shards all divide differently (4: one prompt per shard).
FOUR_PROMPTS = ("campaign.prompts_per_iteration=4",)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_shards_split_the_prompts_into_contiguous_non_empty_blocks_in_order(count: int):
    prompts = 7
    blocks = [Shard(index, count).positions(prompts) for index in range(count)]
    assert [p for block in blocks for p in block] == list(range(prompts))
    assert all(len(block) >= 1 for block in blocks)
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(ValueError, match="outside"):
        Shard(count, count)


def test_shard_boundaries_fall_between_batching_blocks_where_there_are_enough_blocks():
    """With ``block`` prompts to a batching block, shards hold whole blocks (so whole batches) where there are at
    least as many blocks as shards; else the prompts split evenly, as with blocks of one prompt."""

    def layout(count: int, block: int, prompts: int = 7) -> list[list[int]]:
        return [list(Shard(index, count, block).positions(prompts)) for index in range(count)]

    assert layout(2, 2) == [[0, 1, 2, 3], [4, 5, 6]]  # 4 blocks (the last one short); evenly: [0, 1, 2] [3..6]
    assert layout(3, 2) == [[0, 1], [2, 3], [4, 5, 6]]
    assert layout(2, 3) == [[0, 1, 2], [3, 4, 5, 6]] and layout(3, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert layout(4, 2) == [[0, 1], [2, 3], [4, 5], [6]]
    assert layout(5, 2) == layout(5, 1) == [[0], [1], [2, 3], [4], [5, 6]]  # 4 blocks < 5 shards: split evenly
    assert Shard(0, 5, 2).splits_batches(7) and not Shard(0, 4, 2).splits_batches(7)
    with pytest.raises(ValueError, match="block 0"):
        Shard(0, 1, 0)


def test_shards_of_whole_batches_regenerate_bit_for_bit_and_a_count_that_splits_them_is_warned(tmp_path: Path):
    """A breaker's finding: ``solrl run`` with 3 shards regenerated other last bits than with 1 (regenerate batches of
    256 across 4 prompts: 3 shards must split them), and two iterations later kept other seeds. Six prompts of 4
    kept seeds in batches of 16: whole batches every 4 prompts; 2 shards split over blocks at prompt 4, between
    batches (evenly they would split at prompt 3, inside one): the same bits as one shard. (In-process at one
    thread this CPU rounds an even split the same too; `solrl run`'s two threads did not.) A count that must split a
    batch on the training path is warned (4 shards: 2 blocks)."""
    from solrl.stages.pipeline import shard_warnings
    from solrl.storage.artifacts import Samples
    from solrl.storage.stage import stage_dir

    extra = ("campaign.prompts_per_iteration=6", "explore.batch_size=8", "regenerate.batch_size=16")
    cfg = tiny_config(tmp_path, *extra, "reward.models={digit_alignment: {batch_size: 8}}")
    assert {name: STAGES[name].block(cfg) for name in ("explore", "score_explore", "regenerate")} == {
        "explore": 1,
        "score_explore": 1,
        "regenerate": 4,
    }
    run = create_run(cfg, RUN_ID)
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1, run.config_hash)
    for stage in ("explore", "score_explore", "select"):
        run_stage(ctx, stage)
    regenerated = {}
    for shards in (1, 2):
        sharded = cfg.model_copy(update={"campaign": cfg.campaign.model_copy(update={"shards": shards})})
        run_stage(StageContext(sharded, run.run_dir, run.run_id, 1, run.config_hash), "regenerate")
        regenerated[shards] = Samples.read(stage_dir(run.run_dir, 1, "regenerate") / Samples.filename)
        shutil.rmtree(stage_dir(run.run_dir, 1, "regenerate"))
    np.testing.assert_array_equal(regenerated[2].latents, regenerated[1].latents)
    np.testing.assert_array_equal(regenerated[2].images, regenerated[1].images)
    assert shard_warnings(cfg.model_copy(update={"campaign": cfg.campaign.model_copy(update={"shards": 2})})) == []
    four = cfg.model_copy(update={"campaign": cfg.campaign.model_copy(update={"shards": 4})})
    (warning,) = shard_warnings(four)
    assert warning.startswith(
        "campaign.shards=4 splits batches of regenerate (whole batches every 4 prompts, of 6), score_regenerate "
        "(whole batches every 2 prompts, of 6): where a matrix product rounds by the batch around a row"
    )


def campaign(store: str, shards: int, fault: str | None = None) -> None:
    """Create or resume run ``shards`` in ``store`` with ``campaign.shards=shards`` and run its whole plan through
    the stage functions (in a child when ``fault`` kills it), then prune its pools as the Prefect flow does
    (``storage.pool=latents``), so the runs of either kind compare file for file."""
    from solrl.storage.retention import prune_run

    torch.set_num_threads(1)
    if fault is None:
        os.environ.pop(FAULT_ENV, None)
    else:
        os.environ[FAULT_ENV] = fault
    if (Path(store) / RUN_ID).exists():
        set_shards(store, RUN_ID, shards)
        run = open_run(store, RUN_ID)
    else:
        run = create_run(tiny_config(Path(store), *FOUR_PROMPTS, f"campaign.shards={shards}"), RUN_ID)
    for iteration, stages in campaign_plan(run.config):
        ctx = StageContext(run.config, run.run_dir, run.run_id, iteration, run.config_hash)
        for stage in stages:
            run_stage(ctx, stage)
    prune_run(run.config, run.run_dir)


def assert_same_outputs(got_dir: Path, expected_dir: Path, iterations: int | None = None) -> None:
    """Every Parquet table equal; every Zarr array and checkpoint tensor equal within float tolerance (a shard
    samples a smaller batch: CPU kernels may round its last bits differently); the kept seeds identical. With
    ``iterations``, ``got_dir`` ran only that many of ``expected_dir``'s iterations: those are compared."""

    def ran(key: Path | str) -> bool:
        top = Path(key).parts[0]
        return iterations is None or not top.startswith("iter_") or int(top[5:]) <= iterations

    expected = {key: value for key, value in outputs(expected_dir).items() if ran(key)}
    assert_close_outputs(outputs(got_dir), expected)
    for path in sorted(p for p in expected_dir.rglob("selection.parquet") if ran(p.relative_to(expected_dir))):
        kept = ["group", "slot", "candidate_index", "seed"]
        pd.testing.assert_frame_equal(
            pd.read_parquet(got_dir / path.relative_to(expected_dir))[kept], pd.read_parquet(path)[kept]
        )


def assert_close_outputs(got: dict[str, object], expected: dict[str, object]) -> None:
    """``test_faults.outputs`` of two runs: the same keys, within the tolerances of ``assert_same_outputs``."""
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(got[key], value, obj=key, check_exact=False, rtol=1e-4, atol=1e-5)
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
        elif value.dtype == np.uint8:  # images: at most one grey level apart
            assert np.abs(got[key].astype(int) - value.astype(int)).max() <= 1, key
        else:
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-shard campaign every layout is compared with (run once for the module's tests)."""
    store = tmp_path_factory.mktemp("one-shard")
    campaign(str(store), 1)
    return store / RUN_ID


@needs_batch_invariant_gemm
@pytest.mark.slow
def test_two_and_four_shards_give_the_one_shard_run_and_leave_no_shard_folder(tmp_path: Path, one_shard: Path):
    for count in (2, 4):
        campaign(str(tmp_path / f"s{count}"), count)
        run_dir = tmp_path / f"s{count}" / RUN_ID
        assert_same_outputs(run_dir, one_shard)
        assert not list(run_dir.rglob("*.shards"))
        manifest = read_manifest(run_dir, 1, "explore")
        assert manifest is not None and manifest.info["shards"] == count
        assert manifest.info["prompts"] == 4 and manifest.info["pool_size"] == 8  # counts summed, the rest kept
        for stage in ("score_explore", "regenerate", "score_regenerate", "evaluate"):  # 10 evaluation prompts
            assert read_manifest(run_dir, 2, stage).info["shards"] == count, stage
        assert read_manifest(run_dir, 2, "audit").info["shards"] == 2  # fidelity.audit_prompts=2: 2 at most
        for key, value in read_manifest(one_shard, 2, "audit").metrics.items():
            assert read_manifest(run_dir, 2, "audit").metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        # The stage keys do not depend on the layout: the shard count is outside the config hash.
        assert tiny_config(tmp_path, f"campaign.shards={count}").digest() == tiny_config(tmp_path).digest()


def run_in_child(store: Path, shards: int, fault: str) -> int | None:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(CHILD_PRELOAD)
    child = context.Process(target=campaign, args=(str(store), shards, fault))
    child.start()
    child.join(timeout=600)
    return child.exitcode


@pytest.mark.slow
def test_a_shard_killed_mid_write_is_redone_alone_and_a_resume_may_change_the_shard_count(
    tmp_path: Path, one_shard: Path
):
    store = tmp_path / "killed"
    # Killed while shard 2 of 2 of iteration 1's explore writes its pool: shard 1 is committed, shard 2 is not.
    assert run_in_child(store, 2, "1:explore.shards/001-of-002:write") == -9
    run = open_run(store, RUN_ID)
    ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
    folder = run.run_dir / "iter_000001" / shards_folder("explore")
    first = read_manifest(run.run_dir, 1, "explore.shards/000-of-002")
    assert first is not None and read_manifest(run.run_dir, 1, "explore.shards/001-of-002") is None
    assert read_manifest(run.run_dir, 1, "explore") is None
    assert [s.name for s in stage_shards(ctx, STAGES["explore"])] == ["000-of-002", "001-of-002"]
    first_shard, second_shard = stage_shards(ctx, STAGES["explore"])  # over explore's batching blocks
    assert run_shard(ctx, "explore", first_shard)[1] is True  # committed: kept
    assert run_shard(ctx, "explore", second_shard)[1] is False  # redone alone
    assert read_manifest(run.run_dir, 1, "explore.shards/000-of-002").created == first.created
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]

    # Killed again in iteration 2's regenerate with 2 shards, resumed with 4: the same final run.
    assert run_in_child(store, 2, "2:regenerate.shards/001-of-002:write") == -9
    campaign(str(store), 4)
    assert open_run(store, RUN_ID).config.campaign.shards == 4
    assert_same_outputs(store / RUN_ID, one_shard)
    leftovers = [p for p in (store / RUN_ID).rglob("*") if ".tmp-" in p.name or ".trash-" in p.name]
    assert leftovers == [] and not list((store / RUN_ID).rglob("*.shards"))


@pytest.mark.slow
def test_through_prefect_each_shard_is_its_own_task_run(tmp_path: Path):
    from prefect.client.orchestration import get_client

    from solrl.flows.sol_rl import campaign as prefect_campaign

    run = create_run(tiny_config(tmp_path, "campaign.iterations=1", "campaign.shards=2"), "prefect-shards")
    prefect_campaign(str(tmp_path), run.run_id)
    manifest = read_manifest(run.run_dir, 1, "regenerate", verify=True)
    assert manifest is not None and manifest.info["shards"] == 2
    with get_client(sync_client=True) as client:
        names = {task_run.name for task_run in client.read_task_runs()}
    for stage in ("explore", "regenerate"):
        assert {f"{stage}[1] shard 000-of-002", f"{stage}[1] shard 001-of-002", f"{stage}[1]"} <= names, sorted(names)


def test_resume_may_record_another_shard_count_without_touching_the_config_hash(tmp_path: Path):
    from typer.testing import CliRunner

    from solrl.cli import app

    run = create_run(tiny_config(tmp_path, "campaign.iterations=1", "campaign.shards=2"), "reshard")
    for stage in campaign_plan(run.config)[0][1]:  # iteration 0 only; the resume below finds work to do
        run_stage(StageContext(run.config, run.run_dir, run.run_id, 0, run.config_hash), stage)
    bad = CliRunner().invoke(app, ["resume", "reshard", "--store", str(tmp_path), "--shards", "0"])
    assert bad.exit_code == 2 and open_run(tmp_path, "reshard").config.campaign.shards == 2
    set_shards(tmp_path, "reshard", 3)
    reopened = open_run(tmp_path, "reshard")
    assert reopened.config.campaign.shards == 3 and reopened.config_hash == run.config_hash


@pytest.mark.slow
def test_two_shards_on_a_local_dask_cluster_give_the_one_shard_run(tmp_path: Path, one_shard: Path):
    """Through the Prefect flow, each shard task submitted to a local Dask cluster of 2 worker processes. Ray's
    shards are checked against the one-process run by the 2-node Ray test (``test_object_store``), which shares
    its campaign with Ray Train's update; the local Ray instance a campaign starts is ``test_distributed``'s. One
    iteration: its evaluation's shards already sample the updated policy from the store."""
    from solrl.flows.sol_rl import campaign as prefect_campaign

    extra = (*FOUR_PROMPTS, "campaign.shards=2", "campaign.task_runner=dask", "campaign.iterations=1")
    run = create_run(tiny_config(tmp_path / "dask", *extra), RUN_ID)
    prefect_campaign(str(run.run_dir.parent), RUN_ID)
    assert_same_outputs(run.run_dir, one_shard, 1)
    assert read_manifest(run.run_dir, 1, "explore").info["shards"] == 2
    assert read_manifest(run.run_dir, 1, "evaluate").info["shards"] == 2


def test_sharded_scoring_of_two_rewards_writes_the_whole_stages_table(tmp_path: Path):
    two = ("reward.weights={digit_alignment: 1.0, jpeg_compressibility: 0.3}",)
    tables = []
    for count in (1, 2):
        cfg = tiny_config(tmp_path / str(count), *FOUR_PROMPTS, *two, f"campaign.shards={count}")
        run = create_run(cfg, RUN_ID)
        ctx = StageContext(run.config, run.run_dir, run.run_id, 1, run.config_hash)
        for stage in ("explore", "score_explore"):
            run_stage(ctx, stage)
        tables.append(pd.read_parquet(run.run_dir / "iter_000001" / "score_explore" / "rewards.parquet"))
        metrics = read_manifest(run.run_dir, 1, "score_explore").metrics
        assert set(metrics) == {"explore/reward_mean", "explore/reward_std", "explore/reward_max", "explore/reward_min"}
    assert tables[1]["reward"].iloc[0] == "digit_alignment" and tables[1]["reward"].iloc[-1] == "jpeg_compressibility"
    pd.testing.assert_frame_equal(tables[1], tables[0], check_exact=False, rtol=1e-4, atol=1e-5)


def test_a_dask_address_that_does_not_answer_is_one_line_naming_the_field(tmp_path: Path):
    from solrl.config import ConfigError
    from solrl.flows.runners import shard_task_runner

    address = "campaign.task_runner_address=tcp://127.0.0.1:9"
    cfg = tiny_config(tmp_path, "campaign.shards=2", "campaign.task_runner=dask", address)
    # Refused at once (ConnectionRefusedError), not after the Dask client's 10 s of retries (an OSError "Timed out").
    with pytest.raises(ConfigError, match=f"{address}: cannot reach the Dask scheduler \\(ConnectionRefusedError"):
        with shard_task_runner(cfg):
            pass


@pytest.mark.parametrize(
    "sets, env, field",
    [
        (
            ["campaign.shards=2", "campaign.task_runner=ray", "campaign.task_runner_address=127.0.0.1:9"],
            {},
            "campaign.task_runner_address=127.0.0.1:9",
        ),
        (
            ["train.launcher=ray", "train.workers=2"],
            {"RAY_ADDRESS": "ray://127.0.0.1:9"},
            "RAY_ADDRESS=ray://127.0.0.1:9",
        ),
        (["train.launcher=ray"], {"RAY_ADDRESS": "no-port"}, "RAY_ADDRESS=no-port: not a Ray address"),
        (  # the dashboard's address answers, but takes jobs, not drivers
            ["train.launcher=ray"],
            {"RAY_ADDRESS": "http://127.0.0.1:8265"},
            "RAY_ADDRESS=http://127.0.0.1:8265: not a Ray address (http:// is not how a driver joins",
        ),
    ],
)
@pytest.mark.usefixtures("own_prefect_server")  # checks that solrl started no Prefect server
def test_a_ray_address_that_does_not_answer_is_one_line_and_exit_2_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sets: list[str], env: dict[str, str], field: str
):
    import time

    from typer.testing import CliRunner

    from solrl.cli import app

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    store = tmp_path / "runs"
    args = ["run", "tiny-digits", "--set", f"storage.root={store}"]
    for item in sets:
        args += ["--set", item]
    start = time.monotonic()
    ran = CliRunner().invoke(app, args)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert ran.exit_code == 2 and len(lines) == 1 and field in lines[0], ran.output
    assert "not a Ray address" in lines[0] or "cannot reach the Ray cluster" in lines[0], lines
    assert time.monotonic() - start < 10
    assert not store.exists() and not (tmp_path / "prefect").exists()  # nothing written, no Prefect started


def test_a_ray_cluster_that_refuses_the_connection_names_token_authentication(tmp_path: Path, monkeypatch):
    """Ray 2.59 and later start a head node with token authentication: its port answers (the check before any
    work passes) and ``ray.init`` fails later with a bare ConnectionError after Ray's own InvalidAuthToken lines,
    as seen with ``ray start --head`` (Ray 2.60). The message says what to set, and says to check the token where
    RAY_AUTH_MODE=token is set already."""
    import ray

    from solrl.config import ConfigError
    from solrl.stages.cluster import ray_session

    def refused(**kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    cfg = tiny_config(tmp_path, "campaign.shards=2", "campaign.task_runner=ray", "campaign.task_runner_address=h:6379")
    with pytest.raises(ConfigError, match=r"cannot reach the Ray cluster .*set RAY_AUTH_MODE=token, with the head's"):
        with ray_session(cfg, 1):
            pass
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ConfigError, match=r"check that RAY_AUTH_TOKEN \(or ~/.ray/auth_token\) is the head's$"):
        with ray_session(cfg, 1):
            pass


def test_a_task_runner_whose_prefect_integration_is_missing_is_refused_before_any_work(tmp_path: Path, monkeypatch):
    import importlib.util

    from solrl.config import ConfigError
    from solrl.stages.runnable import check_runnable

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "prefect_ray" else find_spec(name))
    cfg = tiny_config(tmp_path, "campaign.shards=2", "campaign.task_runner=ray")
    with pytest.raises(
        ConfigError, match=r"campaign.task_runner=ray needs prefect-ray: pip install 'solrl\[distributed\]'"
    ):
        check_runnable(cfg)
