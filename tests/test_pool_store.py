"""The run store at published scale (issue 36): pools written as they are sampled and read only where indexed,
each file hashed once when committed, ``solrl verify``, and what a pool keeps (``storage.pool``,
``storage.keep_pools``, ``solrl prune``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import flip_middle_byte, tiny_config
from typer.testing import CliRunner

from solrl.cli import app
from solrl.stages.sharding import prompts_per_part
from solrl.storage import stage as stage_module
from solrl.storage.artifacts import CHUNK_BYTES, CandidatePool, LazyArray, chunk_shape
from solrl.storage.stage import StageOutput, commit, read_manifest, require, run_or_skip, stage_dir, verify_run

runner = CliRunner()


class ChunkReads:
    """Counts the chunk files Zarr reads from a local store (test-only instrumentation of zarr's LocalStore)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from zarr.storage import LocalStore

        self.keys: list[str] = []
        original = LocalStore.get

        async def get(store, key, *args, **kwargs):  # noqa: ANN001
            if "/c/" in key:
                self.keys.append(key)
            return await original(store, key, *args, **kwargs)

        monkeypatch.setattr(LocalStore, "get", get)


@pytest.fixture
def stored(tmp_path: Path) -> tuple[np.ndarray, LazyArray]:
    data = np.arange(4 * 6 * 2 * 3, dtype=np.int32).reshape(4, 6, 2, 3)
    group = zarr.open_group(str(tmp_path / "a.zarr"), mode="w")
    array = group.create_array("x", shape=data.shape, dtype=data.dtype, chunks=(1, 2, 2, 3))
    array[...] = data
    return data, LazyArray(zarr.open_group(str(tmp_path / "a.zarr"), mode="r")["x"])


@pytest.mark.parametrize(
    "key",
    [
        1,
        -1,
        slice(1, 3),
        (2, slice(None)),
        np.array([3, 0]),
        (np.array([[0], [2]]), np.array([[1, 5], [0, 3]])),  # the select stage's rows [P, 1] x kept [P, k]
        (np.array([1, 1, 2]), np.array([0, 5, -1])),
        (np.array([], dtype=np.int64),),
        (slice(None), 1),  # not a leading-fancy key: read whole, index in numpy
        (slice(None), np.array([0, 2])),
    ],
)
def test_a_lazy_array_indexes_as_numpy_does(stored, key):
    data, lazy = stored
    np.testing.assert_array_equal(lazy[key], data[key])
    assert lazy.shape == data.shape and lazy.dtype == data.dtype and len(lazy) == 4
    np.testing.assert_array_equal(np.asarray(lazy), data)


def test_a_lazy_array_reads_only_the_chunks_it_is_indexed_at(stored, monkeypatch):
    _, lazy = stored
    reads = ChunkReads(monkeypatch)
    lazy[np.array([[2]]), np.array([[1, 4]])]  # prompt 2's candidates 1 and 4: chunks (2, 0) and (2, 2)
    assert sorted(k.split("/c/")[1] for k in reads.keys) == ["2/0/0/0", "2/2/0/0"]
    reads.keys.clear()
    lazy[1:2]
    assert len(reads.keys) == 3  # one prompt: its three candidate chunks
    assert lazy.shape == (4, 6, 2, 3) and not reads.keys[3:]


def test_chunks_hold_one_prompt_and_a_few_candidates():
    assert chunk_shape((48, 96, 1024, 1024, 3), 1, ("prompt", "candidate", "y", "x", "rgb")) == (1, 1, 1024, 1024, 3)
    assert chunk_shape((48, 96, 512, 512, 3), 1, ("prompt", "candidate", "y", "x", "rgb")) == (1, 5, 512, 512, 3)
    assert chunk_shape((8, 32, 16, 16, 3), 1, ("prompt", "candidate", "y", "x", "rgb")) == (1, 32, 16, 16, 3)
    assert chunk_shape((8,), 8, ("prompt",)) == (8,)
    video = ("prompt", "candidate", "frame", "y", "x", "rgb")
    assert chunk_shape((2, 4, 81, 64, 64, 3), 1, video) == (1, 1, 81, 64, 64, 3)
    assert 5 * 512 * 512 * 3 <= CHUNK_BYTES < 6 * 512 * 512 * 3


def test_streamed_explore_and_score_keep_every_batch_whole():
    """A group of prompts whose candidates fill whole batches: the batches of one call over the whole pool."""
    for pool, batch in [(96, 24), (32, 256), (8, 256), (96, 64), (10, 4), (7, 3)]:
        step = prompts_per_part(pool, [batch])
        assert (step * pool) % batch == 0 and all((s * pool) % batch for s in range(1, step))
    assert prompts_per_part(96, [32, 64]) == 2 and prompts_per_part(32, [32]) == 1 and prompts_per_part(8, []) == 1
    assert prompts_per_part(10, [4, 6]) == 6  # 60 images: whole batches of 4 and of 6


def _files(out: Path) -> StageOutput:
    (out / "a.bin").write_bytes(b"\x01" * 1000)
    (out / "b.bin").write_bytes(b"\x02" * 500)
    return StageOutput()


def test_each_file_is_hashed_once_when_committed_and_readers_check_sizes(tmp_path, monkeypatch):
    hashed: list[str] = []
    original = stage_module.file_sha256

    def counted(path: Path) -> str:
        hashed.append(Path(path).name)
        return original(path)

    monkeypatch.setattr(stage_module, "file_sha256", counted)
    commit(tmp_path, "r", 1, "explore", "k", _files)
    assert sorted(hashed) == ["a.bin", "b.bin"]
    hashed.clear()
    require(tmp_path, 1, "explore")
    run_or_skip(tmp_path, "r", 1, "explore", "k", _files)
    read_manifest(tmp_path, 1, "explore")
    assert hashed == []  # no reader re-hashes a committed file
    (stage_dir(tmp_path, 1, "explore") / "b.bin").write_bytes(b"\x02" * 499)  # truncated: the size tells
    assert read_manifest(tmp_path, 1, "explore") is None
    _, skipped = run_or_skip(tmp_path, "r", 1, "explore", "k", _files)
    assert not skipped


def test_verify_names_a_flipped_byte_and_redo_makes_resume_recompute_it(tmp_path):
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import STAGES, first_pending, run_stage, stage_key
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path, "campaign.iterations=1", "fidelity.audit_every=0")
    run = create_run(cfg, "v")
    run_stage(StageContext.of(run, 0), "evaluate")
    for name in ("explore", "score_explore", "select"):
        run_stage(StageContext.of(run, 1), name)
    chunk = next(
        p for p in (stage_dir(run.run_dir, 1, "explore") / "candidates.zarr" / "images").rglob("*") if p.is_file()
    )
    flip_middle_byte(chunk)
    ctx0 = StageContext.of(run, 0)
    assert first_pending(ctx0) == (1, "regenerate")  # resume reads manifests and sizes only
    assert require(run.run_dir, 1, "explore")  # same size: a reader cannot tell
    bad = verify_run(run.run_dir)
    assert [(b.iteration, b.stage, b.problem) for b in bad] == [(1, "explore", "sha256")]
    assert bad[0].file == chunk.relative_to(stage_dir(run.run_dir, 1, "explore")).as_posix()

    result = runner.invoke(app, ["verify", "v", "--store", str(tmp_path)])
    assert result.exit_code == 1 and f"iteration 1 explore: {bad[0].file}: other bytes than committed" in result.output
    assert "--redo" in result.output
    result = runner.invoke(app, ["verify", "v", "--store", str(tmp_path), "--redo"])
    # score_explore and select may have read the flipped chunk (readers check sizes): they are redone with it. A
    # breaker's finding: they stayed committed, and a redone stage's bytes equal to the manifest's kept them so.
    uncommitted = "1 stage(s) uncommitted and the 2 committed stage(s) that read them"
    assert result.exit_code == 1 and uncommitted in result.output, result.output
    assert all(read_manifest(run.run_dir, 1, s) is None for s in ("explore", "score_explore", "select"))
    assert read_manifest(run.run_dir, 0, "evaluate") is not None  # it read nothing of iteration 1
    for name in ("explore", "score_explore", "select"):  # what resume does
        run_stage(StageContext.of(run, 1), name)
    select = read_manifest(run.run_dir, 1, "select")
    assert select.inputs_hash == stage_key(StageContext.of(run, 1), STAGES["select"])
    result = runner.invoke(app, ["verify", "v", "--store", str(tmp_path)])
    assert result.exit_code == 0 and "every file of its 4 committed stages matches" in result.output

    # What the update trains on is hashed as it is read (a breaker's finding: a latents chunk of the regenerated
    # samples changed at the same size was trained on, and the NaN loss it gave blamed train.lr); images, the
    # bulk of a pool, are checked by size only.
    from solrl.storage.artifacts import Samples
    from solrl.storage.stage import StageChanged

    run_stage(StageContext.of(run, 1), "regenerate")
    samples = Samples.load(run.run_dir, 1)
    latents, images = np.asarray(samples.latents), np.asarray(samples.images)
    folder = stage_dir(run.run_dir, 1, "regenerate") / "samples.zarr"
    chunk = next(p for p in (folder / "latents" / "c").rglob("*") if p.is_file())
    flip_middle_byte(chunk)
    flip_middle_byte(next(p for p in (folder / "images" / "c").rglob("*") if p.is_file()))
    changed = Samples.load(run.run_dir, 1)
    assert not np.array_equal(np.asarray(changed.images), images)  # read as it is
    rel = chunk.relative_to(folder.parent).as_posix()
    with pytest.raises(StageChanged, match=rf"iteration 1 stage 'regenerate': {rel} changed since it was committed"):
        changed.latents[0]
    assert np.asarray(Samples.load(run.run_dir, 1).seeds).shape == latents.shape[:2]  # what is intact reads
    # The group's metadata changed: Zarr reads a FileNotFoundError (which StageChanged is) while opening a group as
    # "no group found", and a resume was advised (a second breaker's finding). It is hashed before Zarr opens it.
    metadata = folder / "zarr.json"
    metadata.write_text(metadata.read_text().replace('"prompts"', '"prompts"'.upper()))
    with pytest.raises(StageChanged, match=r"iteration 1 stage 'regenerate': samples.zarr/zarr.json changed since"):
        Samples.load(run.run_dir, 1)


@pytest.mark.parametrize("report", [True, False])
def test_a_stage_redone_after_its_pool_was_pruned_redoes_the_pool_first_and_a_complete_run_is_pruned(
    tmp_path, report: bool
):
    """A breaker's finding: under the default storage.pool=latents, `verify --redo` of score_explore (or a damaged
    rewards file found on resume) in an iteration whose checkpoint is committed left a run that no resume could
    finish (score_explore read the pruned images: AttributeError). And a campaign killed after its last stage,
    before its final prune, was reported complete and never pruned. With ``tracking.report: false`` the MLflow
    run's end, not the report, tells that the campaign ended."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import campaign_plan, first_pending, restore_pruned_inputs, run_stage
    from solrl.storage.runs import create_run
    from solrl.storage.stage import uncommit

    cfg = tiny_config(tmp_path, "campaign.iterations=1", "fidelity.audit_every=0", f"tracking.report={report}")
    run = create_run(cfg, "pruned")
    for iteration, names in campaign_plan(cfg):  # the stages without the flow: nothing pruned yet
        for name in names:
            run_stage(StageContext.of(run, iteration), name)
    ctx0 = StageContext.of(run, 0)
    assert first_pending(ctx0) is None and not read_manifest(run.run_dir, 1, "explore").pruned
    result = runner.invoke(app, ["resume", "pruned", "--store", str(tmp_path)])
    # No report yet (a breaker's finding: a campaign killed after its last commit never got its report, nor its
    # MLflow run's end): the campaign runs once more, every stage skipped, and prunes, reports and finishes.
    end = "its report" if report else "its end"
    assert result.exit_code == 0 and f"resuming run pruned at {end} (every stage committed)" in result.output
    assert read_manifest(run.run_dir, 1, "explore").pruned == {"candidates.zarr/images": "storage.pool=latents"}
    assert (run.run_dir / "report" / "report.html").is_file() == report
    result = runner.invoke(app, ["resume", "pruned", "--store", str(tmp_path)])
    assert result.exit_code == 0 and "is complete" in result.output and "MiB of pool data" not in result.output

    before = {name: read_manifest(run.run_dir, 1, name).digest() for name in ("explore", "score_explore")}
    uncommit(run.run_dir, 1, "score_explore")  # what `verify --redo` does to a changed rewards file
    assert restore_pruned_inputs(ctx0) == [(1, "explore")]  # the flow calls it first, under the run's lock
    assert first_pending(ctx0) == (1, "explore")
    for name in ("explore", "score_explore"):
        run_stage(StageContext.of(run, 1), name)
    assert {name: read_manifest(run.run_dir, 1, name).digest() for name in before} == before
    assert first_pending(ctx0) is None  # select and everything after kept their inputs hash
    assert restore_pruned_inputs(ctx0) == []


def test_the_pool_is_written_as_it_is_sampled_and_equals_one_call_over_the_whole_pool(tmp_path):
    """Explore with a batch of one prompt's pool writes prompt by prompt; the pool is bit for bit what one
    ``generate`` over every candidate at that batch size gives (the sampler's batches are the same)."""
    import torch

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.stages.quant.backends import sampling_network
    from solrl.stages.sampling.rollout import generate
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path, "explore.batch_size=8", "campaign.prompts_per_iteration=3")
    run = create_run(cfg, "stream")
    ctx = StageContext.of(run, 1)
    writes = []
    original = zarr.Array.__setitem__

    def counted(array, key, value):  # noqa: ANN001
        writes.append((array.basename, np.shape(value)))
        return original(array, key, value)

    zarr.Array.__setitem__ = counted
    try:
        run_stage(ctx, "explore")
    finally:
        zarr.Array.__setitem__ = original
    assert [w for w in writes if w[0] == "images"] == [("images", (1, 8, 16, 16, 3))] * 3
    pool = CandidatePool.load(run.run_dir, 1)
    assert isinstance(pool.images, LazyArray) and pool.latents is not None  # storage.pool=latents by default

    policy = ctx.load_policy(None)
    _, prompts = ctx.iteration_prompts()
    with sampling_network(policy, cfg.explore.precision, min_dim=cfg.explore.min_dim) as (net, _):
        traj = generate(
            policy.model,
            net,
            [p for p in prompts for _ in range(8)],
            pool.seeds.reshape(-1).tolist(),
            cfg.explore.steps,
            8,
        )
    np.testing.assert_array_equal(np.asarray(pool.images).reshape(24, 16, 16, 3), policy.model.decode(traj.samples))
    np.testing.assert_array_equal(np.asarray(pool.latents).reshape(24, 1, 16, 16), traj.samples.numpy())
    assert torch.is_tensor(traj.samples)


def test_retention_keeps_the_expected_pools_of_a_12_iteration_campaign(tmp_path):
    """keep_pools last 3 and every 5th: pools 5, 10, 11, 12 remain (as latents, the default), the rest lose their
    pool and regenerated samples, as each iteration's summary said; every iteration's rankings remain, the run
    resumes, reports, verifies, and ``solrl show`` of a pruned pool says so in one line."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter

    from solrl.flows.sol_rl import campaign
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import first_pending
    from solrl.storage.artifacts import ExploreRewards, Samples, Selection
    from solrl.storage.runs import create_run

    store = tmp_path / "store"
    cfg = tiny_config(
        store,
        "campaign.iterations=12",
        "campaign.eval_every=12",
        "fidelity.audit_every=0",
        "train.optimizer_steps=1",
        "explore.steps=1",
        "regenerate.steps=2",
        "campaign.eval_seeds=1",
        "tracking.report_every=0",
        "storage.keep_pools={last: 3, every: 5}",
    )
    run = create_run(cfg, "kept")
    campaign(str(store), run.run_id)
    kept = {5, 10, 11, 12}
    for iteration in range(1, 13):
        pool, samples = CandidatePool.load(run.run_dir, iteration), Samples.load(run.run_dir, iteration)
        assert pool.images is None and pool.seeds.shape == (2, 8)
        assert len(ExploreRewards.load(run.run_dir, iteration).frame) == 16
        assert len(Selection.load(run.run_dir, iteration).frame) == 8
        if iteration in kept:
            assert pool.pruned == {"images": "storage.pool=latents"} and pool.latents.shape == (2, 8, 1, 16, 16)
            assert samples.images is not None and not samples.pruned
        else:
            assert set(pool.pruned) == {"images", "latents"} and pool.latents is None, iteration
            assert (
                samples.images is None and samples.latents is None and samples.pruned["images"] == "storage.keep_pools"
            )
            manifest = read_manifest(run.run_dir, iteration, "explore")
            assert any(rel.startswith("candidates.zarr/images/") for rel in manifest.files)  # the record stays
    # Each iteration's summary artifact, written while its pool was whole, said what retention would remove.
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key={"any_": ["kept-summary"]}))
    summaries = {int(a.data.split("iteration ", 1)[1].split("\n", 1)[0]): a.data for a in found}
    assert sorted(summaries) == list(range(1, 13))
    for iteration, text in summaries.items():
        (line,) = [line for line in text.splitlines() if line.startswith("- candidate pool: ")]
        fate = line.split("`; ", 1)[1]
        assert fate.startswith(
            "storage.pool=latents removes its images once this iteration's checkpoint is committed"
        ), line
        later = f"storage.keep_pools (last=3, every=5) removes the rest of it once iteration {iteration + 3}'s"
        assert (later in fate) == (iteration not in kept), line
    assert first_pending(StageContext.of(run, 0)) is None
    assert campaign(str(store), run.run_id) is not None  # a resume of the finished run: nothing redone
    assert verify_run(run.run_dir) == []

    shown = runner.invoke(app, ["show", "kept", "--store", str(store), "--iteration", "3", "--prompt", "0"])
    assert shown.exit_code == 2 and len(shown.stderr.strip().splitlines()) == 1
    assert "its images were pruned by storage.pool=latents and its latents by storage.keep_pools" in shown.stderr
    assert shown.stderr.rstrip().endswith(f"kept seeds remain: `solrl inspect kept --iteration 3 --store {store}`")
    out = tmp_path / "pool.png"
    shown = runner.invoke(
        app, ["show", "kept", "--store", str(store), "--iteration", "11", "--prompt", "0", "--out", str(out)]
    )
    assert (
        shown.exit_code == 0 and "decoded from its latents by the tiny-digits model" in shown.output and out.is_file()
    )
    for iteration, says in (
        (3, "images pruned by storage.pool=latents; latents pruned by storage.keep_pools; rankings"),
        (11, "images pruned by storage.pool=latents; its latents remain: `solrl show kept"),
    ):
        inspected = runner.invoke(app, ["inspect", "kept", "--store", str(store), "--iteration", str(iteration)])
        assert inspected.exit_code == 0 and says in inspected.output.replace("\n", " "), inspected.output
    html = runner.invoke(app, ["report", "kept", "--store", str(store), "--html", str(tmp_path / "r.html")])
    assert html.exit_code == 0, html.output

    pruned = runner.invoke(app, ["prune", "kept", "--store", str(store), "--pool", "rankings"])
    assert pruned.exit_code == 0 and "pool=rankings" in pruned.output
    assert CandidatePool.load(run.run_dir, 11).latents is None
    # The record names the command that pruned, not the run's own rule (it said "storage.pool=latents").
    assert CandidatePool.load(run.run_dir, 11).pruned["latents"] == "solrl prune (storage.pool=rankings)"
    assert first_pending(StageContext.of(run, 0)) is None
    bad = runner.invoke(app, ["prune", "kept", "--store", str(store), "--pool", "pixels"])
    assert bad.exit_code == 2 and "give full, latents or rankings" in bad.stderr


@pytest.mark.parametrize(
    ("settings", "iteration", "says"),
    [
        (["storage.pool=full"], 1, None),
        (["storage.pool=full", "storage.keep_pools={last: 1}"], 2, None),  # the last iteration of 2 is kept
        (
            ["storage.pool=full", "storage.keep_pools={last: 0, every: 2}"],
            1,
            "storage.keep_pools (last=0, every=2) removes its images, latents and trajectories once iteration 1's "
            "checkpoint is committed",
        ),
        (["storage.pool=full", "storage.keep_pools={last: 0, every: 2}"], 2, None),
        (
            ["storage.pool=rankings"],
            2,
            "storage.pool=rankings removes its images, and any latents, once this iteration's checkpoint is committed "
            "(its rewards and rankings stay)",
        ),
    ],
)
def test_the_summary_says_what_retention_will_remove_of_a_pool(tmp_path, settings, iteration, says):
    from solrl.storage.retention import kept, pool_fate

    cfg = tiny_config(tmp_path, *settings)
    assert pool_fate(cfg, iteration) == says
    if cfg.storage.keep_pools.last is not None:  # what it says of keep_pools is what retention does at the end
        assert ("keep_pools" not in (says or "")) == kept(cfg, iteration, cfg.campaign.iterations)


def test_pool_chunks_are_hashed_as_written_and_a_sharded_pool_is_merged_by_moving_them(tmp_path, monkeypatch):
    """No chunk file is read back to be hashed, by the shards' commits or by the reduce, which moves the shards'
    chunk files into the stage instead of copying them; the checksums it carries over are the bytes' own."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.runs import create_run

    run = create_run(tiny_config(tmp_path, "campaign.shards=2", "campaign.prompts_per_iteration=4"), "moved")
    read_back: list[str] = []
    original = stage_module.file_sha256

    def counted(path: Path) -> str:
        read_back.append(Path(path).as_posix())
        return original(path)

    monkeypatch.setattr(stage_module, "file_sha256", counted)
    manifest, _ = run_stage(StageContext.of(run, 1), "explore")
    assert not [p for p in read_back if ".zarr/" in p]  # every Zarr file hashed as it was written
    assert manifest.info["shards"] == 2
    pool = CandidatePool.load(run.run_dir, 1)
    assert pool.images.shape == (4, 8, 16, 16, 3) and int(np.asarray(pool.images).max()) > 0
    assert not (run.run_dir / "iter_000001" / "explore.shards").exists()
    monkeypatch.setattr(stage_module, "file_sha256", original)
    assert verify_run(run.run_dir) == []
