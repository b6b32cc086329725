"""Each stage of one iteration on tiny inputs, through the same ``run_stage`` the flow calls (no Prefect)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solrl.stages.context import StageContext
from solrl.stages.pipeline import ITERATION, run_stage
from solrl.storage.arrays import read_arrays
from solrl.storage.checkpoints import load_checkpoint
from solrl.storage.runs import create_run
from solrl.storage.stage import StageNotCommitted, stage_dir
from solrl.storage.tables import read_table


@pytest.fixture(scope="module")
def iteration_one(tmp_path_factory):
    from conftest import tiny_config

    cfg = tiny_config(tmp_path_factory.mktemp("store"))
    run = create_run(cfg, "stages")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    manifests = {stage.name: run_stage(ctx, stage.name)[0] for stage in ITERATION}
    return ctx, manifests


def test_explore_writes_the_candidate_pool(iteration_one):
    ctx, _ = iteration_one
    pool, attrs = read_arrays(stage_dir(ctx.run_dir, 1, "explore") / "candidates.zarr")
    assert pool["images"].shape == (2, 8, 16, 16, 3) and pool["images"].dtype == np.uint8
    assert pool["seeds"].shape == (2, 8) and len(np.unique(pool["seeds"])) == 16
    assert attrs["precision"] == "nvfp4_emulated" and attrs["policy_version"] == 0 and len(attrs["prompts"]) == 2


def test_score_writes_one_row_per_candidate_and_reward(iteration_one):
    ctx, manifests = iteration_one
    table = read_table(stage_dir(ctx.run_dir, 1, "score_explore") / "rewards.parquet")
    assert len(table) == 16 and set(table["reward"]) == {"digit_alignment"}
    assert table["value"].between(0, 1).all()
    assert manifests["score_explore"].metrics["explore/reward_max"] == pytest.approx(table["value"].max())


def test_select_keeps_best_and_worst_by_explore_reward(iteration_one):
    ctx, _ = iteration_one
    sel = read_table(stage_dir(ctx.run_dir, 1, "select") / "selection.parquet")
    assert len(sel) == 2 * 4
    for _, group in sel.groupby("group"):
        assert sorted(group["rank"]) == [1, 2, 7, 8]
        best = group[group.kept_as == "best"]["explore_reward"].min()
        assert best >= group[group.kept_as == "worst"]["explore_reward"].max()
    assert (stage_dir(ctx.run_dir, 1, "select") / "best_worst.png").exists()


def test_regenerate_resamples_exactly_the_kept_seeds(iteration_one):
    ctx, _ = iteration_one
    sel = read_table(stage_dir(ctx.run_dir, 1, "select") / "selection.parquet").sort_values(["group", "slot"])
    regen, attrs = read_arrays(stage_dir(ctx.run_dir, 1, "regenerate") / "samples.zarr")
    np.testing.assert_array_equal(regen["seeds"].reshape(-1), sel["seed"].to_numpy())
    assert regen["latents"].shape == (2, 4, 1, 16, 16) and regen["latents"].dtype == np.float32
    assert attrs["precision"] == "bf16"


def test_score_regenerate_logs_proxy_fidelity(iteration_one):
    _, manifests = iteration_one
    metrics = manifests["score_regenerate"].metrics
    assert -1 <= metrics["fidelity/spearman"] <= 1 and 0 <= metrics["fidelity/top_half_match"] <= 1


def test_update_trains_the_policy_adapter_only_and_starts_on_policy(iteration_one):
    ctx, manifests = iteration_one
    metrics = manifests["update"].metrics
    assert metrics["train/on_policy_max_dev"] == 0.0  # fresh adapters: v_theta == v_old before the update
    assert metrics["train/global_step"] == 2 and np.isfinite(metrics["train/loss"])
    policy0, _, _ = ctx.load_policy(resume=False)
    sections, state = load_checkpoint(stage_dir(ctx.run_dir, 1, "checkpoint"))
    before = policy0.state_dict("policy")
    assert any(not torch.equal(before[k], sections["policy"][k]) for k in before)
    # LoRA B of the policy moved; the rollout followed with decay d = 0.001 / 0.002 (almost all the way).
    moved = [k for k in before if "lora_B" in k]
    for key in moved:
        diff_policy = (sections["policy"][key] - before[key]).abs().sum()
        diff_gap = (sections["policy"][key] - sections["rollout"][key]).abs().sum()
        assert diff_gap <= 0.01 * diff_policy + 1e-12
    assert state["iteration"] == 1 and state["global_step"] == 2 and state["config_hash"] == ctx.cfg.digest()
    assert state["architecture"]["_class_name"] == "SanaTransformer2DModel"
    assert set(sections) == {"policy", "rollout", "ema", "optimizer", "rng"}


def test_the_next_iteration_starts_from_the_checkpoint(iteration_one):
    ctx, _ = iteration_one
    nxt = StageContext(ctx.cfg, ctx.run_dir, ctx.run_id, 2)
    policy, sections, state = nxt.load_policy()
    assert state["global_step"] == 2
    torch.testing.assert_close(policy.state_dict("rollout"), sections["rollout"])


def test_evaluate_logs_every_reward_and_diversity(iteration_one):
    _, manifests = iteration_one
    metrics = manifests["evaluate"].metrics
    assert set(metrics) == {"eval/digit_alignment", "eval/digit_evaluator", "eval/jpeg_compressibility",
                            "eval/diversity"}
    assert 0 < metrics["eval/diversity"] < 1


def test_a_stage_whose_upstream_is_missing_refuses_to_run(iteration_one):
    ctx, _ = iteration_one
    later = StageContext(ctx.cfg, ctx.run_dir, ctx.run_id, 5)
    with pytest.raises(StageNotCommitted, match="iteration 5 stage 'explore'"):
        run_stage(later, "select")
    assert not stage_dir(ctx.run_dir, 5, "select").exists()


def test_rerunning_a_committed_stage_is_a_skip(iteration_one):
    ctx, manifests = iteration_one
    again, skipped = run_stage(ctx, "select")
    assert skipped and again == manifests["select"]
