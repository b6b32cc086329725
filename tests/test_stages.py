"""Each stage of one iteration on tiny inputs, through the same ``run_stage`` the flow calls (no Prefect)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import zarr
from conftest import needs_batch_invariant_gemm

from solrl.stages.context import StageContext
from solrl.stages.pipeline import ITERATION, run_stage
from solrl.storage.artifacts import (
    CandidatePool,
    ExploreRewards,
    FidelityTable,
    RegeneratedRewards,
    RewardStats,
    Samples,
    StartingPolicy,
)
from solrl.storage.checkpoints import load_checkpoint
from solrl.storage.html_report import render_html
from solrl.storage.runs import create_run
from solrl.storage.stage import StageNotCommitted, stage_dir
from solrl.storage.summary import rankings, summary_markdown


def read_arrays(path):
    """A Zarr store as stock zarr-python reads it: name -> ndarray, and its attributes."""
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(array[...]) for name, array in group.arrays()}, dict(group.attrs)


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


@pytest.mark.parametrize(
    ("stage", "store", "dims"),
    [
        ("explore", "candidates.zarr", {"prompt": 2, "candidate": 8, "y": 16, "x": 16, "rgb": 3}),
        ("regenerate", "samples.zarr", {"prompt": 2, "slot": 4, "latent_channel": 1, "latent_y": 16}),
        ("evaluate", "samples.zarr", {"prompt": 10, "sample": 2, "y": 16}),
    ],
)
def test_every_zarr_store_opens_in_xarray_with_named_dimensions(iteration_one, stage, store, dims):
    import warnings

    import xarray

    ctx, _ = iteration_one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback from consolidated metadata
        dataset = xarray.open_zarr(stage_dir(ctx.run_dir, 1, stage) / store)
    assert {name: dataset.sizes[name] for name in dims} == dims
    assert dataset["images"].dtype == np.uint8 and dataset.attrs["prompts"]


def test_score_writes_one_row_per_candidate_and_reward(iteration_one):
    ctx, manifests = iteration_one
    table = pd.read_parquet(stage_dir(ctx.run_dir, 1, "score_explore") / "rewards.parquet")
    assert len(table) == 16 and set(table["reward"]) == {"digit_alignment"}
    assert table["value"].between(0, 1).all()
    assert manifests["score_explore"].metrics["explore/reward_max"] == pytest.approx(table["value"].max())


def test_select_keeps_best_and_worst_by_explore_reward(iteration_one):
    ctx, _ = iteration_one
    sel = pd.read_parquet(stage_dir(ctx.run_dir, 1, "select") / "selection.parquet")
    assert len(sel) == 2 * 4
    for _, group in sel.groupby("group"):
        assert sorted(group["rank"]) == [1, 2, 7, 8]
        best = group[group.kept_as == "best"]["explore_reward"].min()
        assert best >= group[group.kept_as == "worst"]["explore_reward"].max()
    assert (stage_dir(ctx.run_dir, 1, "select") / "best_worst.png").exists()


def test_regenerate_resamples_exactly_the_kept_seeds(iteration_one):
    ctx, _ = iteration_one
    sel = pd.read_parquet(stage_dir(ctx.run_dir, 1, "select") / "selection.parquet").sort_values(["group", "slot"])
    regen, attrs = read_arrays(stage_dir(ctx.run_dir, 1, "regenerate") / "samples.zarr")
    np.testing.assert_array_equal(regen["seeds"].reshape(-1), sel["seed"].to_numpy())
    assert regen["latents"].shape == (2, 4, 1, 16, 16) and regen["latents"].dtype == np.float32
    assert attrs["precision"] == "bf16"


def test_score_regenerate_logs_proxy_fidelity_to_manifest_and_parquet(iteration_one):
    ctx, manifests = iteration_one
    metrics = manifests["score_regenerate"].metrics
    assert -1 <= metrics["fidelity/spearman"] <= 1 and 0 <= metrics["fidelity/top_half_match"] <= 1
    table = pd.read_parquet(stage_dir(ctx.run_dir, 1, "score_regenerate") / "fidelity.parquet")
    assert list(table.columns) == ["group", "prompt", "spearman", "kendall", "top_half_match"] and len(table) == 2
    assert manifests["score_regenerate"].info["warnings"] == []


def test_audit_regenerates_whole_pools_and_reports_true_ranks(iteration_one):
    ctx, manifests = iteration_one
    table = pd.read_parquet(stage_dir(ctx.run_dir, 1, "audit") / "pool.parquet")
    assert len(table) == 2 * 8 and sorted(table[table.group == 0]["bf16_rank"]) == list(range(1, 9))
    metrics = manifests["audit"].metrics
    assert metrics["audit/best_perfect"] == 1.5 and metrics["audit/worst_perfect"] == 7.5
    assert metrics["audit/random_rank"] == 4.5 and 1 <= metrics["audit/best_true_rank"] <= 8
    # The kept seeds regenerated by the regenerate stage are the same samples the audit made for them.
    regen, _ = read_arrays(stage_dir(ctx.run_dir, 1, "regenerate") / "samples.zarr")
    rewards = pd.read_parquet(stage_dir(ctx.run_dir, 1, "score_regenerate") / "rewards.parquet")
    first = table[(table.group == 0) & (table.candidate_index == int(regen["candidate_index"][0, 0]))]
    again = rewards[(rewards.group == 0) & (rewards.candidate_index == int(regen["candidate_index"][0, 0]))]
    assert float(first["bf16_reward"].iloc[0]) == pytest.approx(float(again["weighted"].sum()), abs=1e-5)


def test_an_explore_copy_that_quantizes_no_layer_says_so(iteration_one, tmp_path):
    """A breaker's finding: ``explore.min_dim`` above every layer made ``nvfp4_emulated`` sample in full precision,
    and the run, its manifests and ``inspect`` all still said nvfp4_emulated."""
    from conftest import tiny_config

    _, manifests = iteration_one
    assert not manifests["explore"].info["warnings"]  # the usual copy quantizes
    cfg = tiny_config(tmp_path, "explore.min_dim=100000000")
    run = create_run(cfg, "unquantized")
    manifest, _ = run_stage(StageContext(cfg, run.run_dir, run.run_id, 1), "explore")
    assert manifest.info["warnings"] == [
        "explore.precision=nvfp4_emulated quantizes no layer of this transformer (explore.min_dim=100000000 and the "
        "family's skip rule leave none): the pool is sampled at the policy's precision"
    ]


def test_sampling_draws_no_progress_bar_into_a_log_file(iteration_one, capsys):
    """A breaker's finding: a run redirected to a file still wrote tqdm's bars there, while the docs (and the
    campaign's own progress) say a log file gets one line per iteration. Here stderr is pytest's capture."""
    from solrl.stages.quant.backends import sampling_network
    from solrl.stages.sampling.rollout import generate

    ctx, _ = iteration_one
    policy = ctx.load_policy(None)
    capsys.readouterr()
    with sampling_network(policy, "bf16") as (net, _):
        prompt = ctx.iteration_prompts()[1][0]
        generate(policy.model, net, [prompt] * 4, [1, 2, 3, 4], 1, 1, desc="bar-check")  # 4 batches: a bar on a tty
    assert "bar-check" not in capsys.readouterr().err


def test_low_fidelity_switches_the_next_explore_to_bf16_when_asked(tmp_path):
    """``fidelity.on_low=bf16``: an iteration whose quantized explore ranked badly sends the next to bf16; that one
    measured bf16 against bf16, so the one after explores quantized again; an iteration without a measurement
    (a breaker's finding: naive-FP4's missing Spearman read as NaN, and NaN < bound sent it to bf16) changes
    nothing."""
    from conftest import tiny_config

    from solrl.stages.explore import explore_precision
    from solrl.storage.stage import StageOutput, commit

    cfg = tiny_config(tmp_path, "fidelity.min_spearman=0.5", "fidelity.on_low=bf16")
    run = create_run(cfg, "fallback")

    def iteration(i: int, precision: str, metrics: dict[str, float]) -> None:
        commit(run.run_dir, run.run_id, i, "explore", "k", lambda out: StageOutput(info={"precision": precision}))
        commit(run.run_dir, run.run_id, i, "score_regenerate", "k", lambda out: StageOutput(metrics=metrics))

    def precision_at(i: int, config=cfg) -> tuple[str, list[str]]:
        return explore_precision(StageContext(config, run.run_dir, run.run_id, i))

    iteration(1, "nvfp4_emulated", {"fidelity/spearman": 0.2})
    precision, warnings = precision_at(2)
    assert precision == "bf16" and "0.200 < 0.5" in warnings[0] and "again" in warnings[0]
    warn_only = tiny_config(tmp_path, "fidelity.min_spearman=0.5")
    assert precision_at(2, warn_only) == ("nvfp4_emulated", [])
    iteration(2, "bf16", {"fidelity/spearman": 0.1})  # bf16 against bf16: not the quantized copy's fidelity
    assert precision_at(3) == ("nvfp4_emulated", [])
    iteration(3, "nvfp4_emulated", {})  # regenerate.enabled=false: no fidelity measured
    assert precision_at(4) == ("nvfp4_emulated", [])
    iteration(4, "nvfp4_emulated", {"fidelity/spearman": float("nan")})
    assert precision_at(5) == ("nvfp4_emulated", [])
    naive = tiny_config(tmp_path, "regenerate.enabled=false", "fidelity.min_spearman=0.5", "fidelity.on_low=bf16")
    assert any("proxy fidelity is not measured and neither the bound" in w for w in naive.warnings())


def test_update_trains_the_policy_adapter_only_and_starts_on_policy(iteration_one):
    ctx, manifests = iteration_one
    metrics = manifests["update"].metrics
    assert metrics["train/on_policy_max_dev"] == 0.0  # fresh adapters: v_theta == v_old before the update
    assert metrics["train/global_step"] == 2 and np.isfinite(metrics["train/loss"])
    policy0 = ctx.load_policy(None)
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
    assert state["architecture"]["transformer"]["_class_name"] == "SanaTransformer2DModel"
    assert state["model_family"] == "tiny-digits"
    assert set(sections) == {"policy", "rollout", "ema", "optimizer", "rng"}


def test_the_next_iteration_starts_from_the_checkpoint(iteration_one):
    ctx, _ = iteration_one
    start = StartingPolicy.load(ctx.run_dir, 2)
    assert start.state["global_step"] == 2 and start.state["iteration"] == 1
    assert StartingPolicy.load(ctx.run_dir, 1) is None  # iteration 1 starts from the base model
    policy = StageContext(ctx.cfg, ctx.run_dir, ctx.run_id, 2).load_policy(start)
    torch.testing.assert_close(policy.state_dict("rollout"), start.sections["rollout"])


def test_evaluate_logs_every_reward_and_diversity(iteration_one):
    _, manifests = iteration_one
    metrics = manifests["evaluate"].metrics
    assert set(metrics) == {
        "eval/digit_alignment",
        "eval/digit_evaluator",
        "eval/jpeg_compressibility",
        "eval/diversity",
        "eval/grid_energy",
    }
    assert 0 <= metrics["eval/grid_energy"] < 1
    assert 0 < metrics["eval/diversity"] < 1


def test_a_stage_whose_upstream_is_missing_refuses_to_run(iteration_one):
    ctx, _ = iteration_one
    later = StageContext(ctx.cfg, ctx.run_dir, ctx.run_id, 5)
    with pytest.raises(StageNotCommitted, match="iteration 5 stage 'explore'"):
        run_stage(later, "select")
    assert not stage_dir(ctx.run_dir, 5, "select").exists()


def test_samples_that_come_out_nan_stop_the_stage_and_are_not_retried(tmp_path, monkeypatch):
    """A breaker's finding: an explore backend whose samples were NaN had its pool committed, scored, ranked and
    trained on, exit 0. The stage now stops on them, commits nothing, and the flow does not retry it."""
    from types import SimpleNamespace

    from conftest import tiny_config

    from solrl.flows.sol_rl import _worth_retrying
    from solrl.stages.models.tiny_digits import TinyDigits
    from solrl.stages.sampling.rollout import NonFiniteSamples
    from solrl.storage.stage import read_manifest

    real = TinyDigits.velocity

    def diverging(self, net, x, sigma, cond):
        v = real(self, net, x, sigma, cond)
        v[1] = float("nan")  # the second sample of every batch diverges
        return v

    monkeypatch.setattr(TinyDigits, "velocity", diverging)
    cfg = tiny_config(tmp_path, "explore.precision=bf16")  # NVFP4's quantizer already refuses a NaN activation
    run = create_run(cfg, "diverged")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    with pytest.raises(NonFiniteSamples, match=r"explore bf16: 1 of \d+ samples in a batch came out NaN"):
        run_stage(ctx, "explore")
    assert read_manifest(run.run_dir, 1, "explore") is None
    assert not _worth_retrying(None, None, SimpleNamespace(data=NonFiniteSamples("x")))
    assert _worth_retrying(None, None, SimpleNamespace(data=RuntimeError("CUDA error: an illegal memory access")))


def test_rerunning_a_committed_stage_is_a_skip(iteration_one):
    ctx, manifests = iteration_one
    again, skipped = run_stage(ctx, "select")
    assert skipped and again == manifests["select"]


def test_total_rewards_sums_rewards_and_follows_the_requested_candidate_order():
    table = pd.DataFrame(
        {
            "group": [0, 0, 0, 0, 1, 1],
            "candidate_index": [3, 3, 7, 7, 5, 5],
            "reward": ["a", "b", "a", "b", "a", "b"],
            "weighted": np.array([0.5, 1.0, 0.25, 2.0, 1.0, 1.0], np.float32),
        }
    )
    for column in ("prompt_index", "prompt", "seed", "value", "weight", "precision"):
        table[column] = 0
    out = ExploreRewards(table).totals(np.array([[7, 3], [5, 5]]))
    np.testing.assert_allclose(out, [[2.25, 1.5], [2.0, 2.0]])


@pytest.mark.parametrize("guard", [False, True])
def test_flow_grpo_iteration_stores_trajectories_and_starts_exactly_on_policy(tmp_path, guard):
    from conftest import tiny_config

    cfg = tiny_config(
        tmp_path,
        "train.loss=flow_grpo",
        "regenerate.sde_window=[2, 6]",
        "train.kl_beta=0.01",
        f"train.loss_options={{grpo_guard: {str(guard).lower()}}}",
    )
    run = create_run(cfg, "grpo")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    for stage in ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update"):
        manifest, _ = run_stage(ctx, stage)
    regen, attrs = read_arrays(stage_dir(run.run_dir, 1, "regenerate") / "samples.zarr")
    assert regen["trajectory"].shape == (2, 4, 11, 1, 16, 16) and regen["log_probs"].shape == (2, 4, 10)
    assert attrs["sde_steps"] == [False, False, True, True, True, True, False, False, False, False]
    assert (regen["log_probs"][..., 2:6] != 0).all() and (regen["log_probs"][..., :2] == 0).all()
    np.testing.assert_array_equal(regen["trajectory"][:, :, -1], regen["latents"])
    metrics = manifest.metrics
    # The recomputed log-prob of the stored step equals the stored one: the PPO ratio starts at 1.
    assert metrics["train/on_policy_max_dev"] < 1e-4
    assert np.isfinite(metrics["train/loss"]) and metrics["train/kl"] >= 0
    assert 0 <= metrics["train/clip_fraction"] <= 1
    # GRPO-Guard recovered each step's rollout mean from the seeds (or it would have refused), and after the first
    # of the 2 optimizer steps the policy mean moved: RatioNorm's shift is then positive; without it, 0.
    assert (metrics["train/ratio_shift"] > 0) if guard else metrics["train/ratio_shift"] == 0


def test_explore_and_regenerate_share_the_sde_noise_path_of_a_seed(tmp_path):
    from conftest import tiny_config

    from solrl.stages.quant.backends import rollout_network
    from solrl.stages.sampling.rollout import generate

    cfg = tiny_config(tmp_path, "train.loss=flow_grpo")
    ctx = StageContext(cfg, tmp_path, "x", 1)
    policy = ctx.load_policy(None)
    with rollout_network(policy, "bf16") as net:
        alone = generate(policy.model, net, ["the digit one"], [77], 10, 8, noise_level=0.7)
        batch = generate(policy.model, net, ["the digit two", "the digit one"], [5, 77], 10, 8, noise_level=0.7)
        ode = generate(policy.model, net, ["the digit one"], [77], 10, 8)
    torch.testing.assert_close(alone.latents[0], batch.latents[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone.latents[0, 0], ode.latents[0, 0], rtol=0, atol=0)  # same initial noise
    assert not torch.allclose(alone.samples, ode.samples)


def test_sol_rl_is_the_default_tiny_digits_preset_under_its_own_name():
    """Presets do not inherit from tiny-digits.yaml (each is its file plus the schema defaults): a default
    changed in tiny-digits.yaml alone left sol-rl and the baselines on the old settings (issue 12)."""
    from solrl.config import load_config

    default, sol_rl = load_config("tiny-digits").model_dump(), load_config("sol-rl").model_dump()
    assert {k: v for k, v in default.items() if k != "name"} == {k: v for k, v in sol_rl.items() if k != "name"}
    for preset in ("bf16-scaling", "naive-fp4", "diffusionnft"):  # the same training as the default
        assert load_config(preset).train == load_config("tiny-digits").train, preset


@pytest.mark.parametrize(
    "preset",
    ["sol-rl", "sol-rl-unregularised", "bf16-scaling", "naive-fp4", "diffusionnft", "sol-rl-flow-grpo", "flow-grpo"],
)
def test_baseline_presets_load(preset):
    from solrl.config import load_config

    cfg = load_config(preset)
    assert cfg.name == preset and cfg.regenerate.enabled == preset.startswith("sol-rl")
    assert cfg.train.loss == ("flow_grpo" if preset.endswith("flow-grpo") else "nft")


@pytest.mark.parametrize(("loss", "guard"), [("nft", False), ("flow_grpo", False), ("flow_grpo", True)])
def test_without_regenerate_the_update_trains_on_the_kept_explore_samples(tmp_path, loss, guard):
    from conftest import tiny_config

    cfg = tiny_config(
        tmp_path,
        "regenerate.enabled=false",
        f"train.loss={loss}",
        "explore.steps=10",
        f"train.loss_options={{grpo_guard: {str(guard).lower()}}}",  # the explore copy's rollout means come back too
    )
    run = create_run(cfg, f"naive-{loss}")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    stages = ("explore", "score_explore", "select", "regenerate", "score_regenerate", "update")
    manifests = {stage: run_stage(ctx, stage)[0] for stage in stages}
    manifest = manifests["update"]
    # Nothing was regenerated, so there is no BF16 ranking: no fidelity figure (it was a Spearman of 1.0, the
    # explore rewards against themselves), an empty table, and the summary says why.
    assert manifests["score_regenerate"].metrics == {}  # neither fidelity/* nor regenerate/* figures
    assert FidelityTable.load(run.run_dir, 1).frame.empty
    summary = summary_markdown(run.run_dir, run.run_id, 1, stages)
    assert FidelityTable.not_measured in summary
    if loss == "nft":  # flow_grpo's guard trips (below)
        assert "No guard tripped (diversity, grid energy; proxy fidelity not measured)." in summary
    page = render_html(run, stages, [(1, stages)], figures=[("Training reward", ""), ("Stage-time split", "")])
    training, fidelity, split = (page.index(t) for t in ("Training reward", "Proxy fidelity", "Stage-time split"))
    assert training < fidelity < split and f"Not measured: {FidelityTable.not_measured}." in page
    assert {row["bf16_reward"] for row in rankings(run.run_dir, 1)} == {None}  # the NVFP4 samples' are not BF16's
    pool, _ = read_arrays(stage_dir(run.run_dir, 1, "explore") / "candidates.zarr")
    kept, attrs = read_arrays(stage_dir(run.run_dir, 1, "regenerate") / "samples.zarr")
    rows = np.arange(2)[:, None]
    np.testing.assert_array_equal(kept["latents"], pool["latents"][rows, kept["candidate_index"]])
    np.testing.assert_array_equal(kept["images"], pool["images"][rows, kept["candidate_index"]])
    assert attrs["precision"] == "nvfp4_emulated" and attrs["regenerated"] is False
    assert ("trajectory" in kept) == (loss == "flow_grpo")
    assert np.isfinite(manifest.metrics["train/loss"])
    assert "the naive-FP4 ablation" in cfg.warnings()[0]  # said at load (solrl run, the campaign flow)
    off_policy = [w for w in manifest.info["warnings"] if "on_policy_max_dev" in w]
    if loss == "flow_grpo":  # on-policy by design, so trained on quantized log-probs it warns
        assert manifest.metrics["train/on_policy_max_dev"] > 0.01 and off_policy, manifest.metrics
    else:  # the NFT rollout lags the policy by design: no bound
        assert off_policy == []


def test_per_prompt_statistics_persist_across_iterations(tmp_path):
    from conftest import tiny_config

    cfg = tiny_config(
        tmp_path,
        "train.advantage_stats=per_prompt",
        "train.stat_buffer=6",
        "train.stat_min_count=2",
        "fidelity.audit_every=0",
        "campaign.eval_every=100",
    )
    run = create_run(cfg, "tracker")
    tables, rewards = [], []
    for iteration in (1, 2):
        ctx = StageContext(cfg, run.run_dir, run.run_id, iteration)
        for stage in ITERATION:
            if stage.name not in ("audit", "evaluate"):
                run_stage(ctx, stage.name)
        tables.append(RewardStats.read(RewardStats.path(run.run_dir, iteration)).frame)
        samples = Samples.load(run.run_dir, iteration)
        values = RegeneratedRewards.load(run.run_dir, iteration).totals(samples.candidate_index)
        rewards.append((samples.prompts, values))
    first, second = tables
    prompts, values = rewards[1]
    # Iteration 2 continues iteration 1's committed buffers: each prompt keeps its last 6 rewards, oldest first.
    for prompt in set(first.prompt) | set(prompts):
        older = first.loc[first.prompt == prompt, "reward"].to_numpy()
        newer = values[[p for p, name in enumerate(prompts) if name == prompt]].reshape(-1)
        expected = np.concatenate([older, newer])[-6:]
        np.testing.assert_allclose(second.loc[second.prompt == prompt, "reward"].to_numpy(), expected, rtol=1e-6)
    assert len(first) == 8  # 2 prompts x k = 4 at iteration 1


def test_group_normalisation_standardises_each_reward_within_its_group_before_weighting():
    import pandas as pd

    # Two rewards of very different scales over one group of 3 candidates (and a second group without spread).
    a, b = np.array([1.0, 2.0, 3.0]), np.array([300.0, 100.0, 200.0])
    rows = [(0, c, "a", a[c], 1.0) for c in range(3)] + [(0, c, "b", b[c], 0.5) for c in range(3)]
    rows += [(1, c, name, 7.0, w) for c in range(3) for name, w in (("a", 1.0), ("b", 0.5))]
    table = pd.DataFrame(rows, columns=["group", "candidate_index", "reward", "value", "weight"])
    table["weighted"] = table["value"] * table["weight"]
    for column in ("prompt_index", "prompt", "seed", "precision"):
        table[column] = 0
    rewards = ExploreRewards(table)
    order = np.array([[0, 1, 2], [0, 1, 2]])
    standard = lambda v: (v - v.mean()) / (v.std() + 1e-4)  # noqa: E731
    np.testing.assert_allclose(rewards.totals(order, "group")[0], standard(a) + 0.5 * standard(b), rtol=1e-5)
    np.testing.assert_array_equal(rewards.totals(order, "group")[1], 0)  # no spread: no signal
    np.testing.assert_allclose(rewards.totals(order)[0], a + 0.5 * b)  # raw weighted sum by default


def test_evaluate_warns_when_grid_artifact_energy_grows_past_the_starting_policys(iteration_one):
    import json
    import shutil

    from solrl.storage.stage import MANIFEST

    ctx, _ = iteration_one
    run_stage(StageContext(ctx.cfg, ctx.run_dir, ctx.run_id, 0), "evaluate")  # the starting policy
    start = stage_dir(ctx.run_dir, 0, "evaluate") / MANIFEST
    data = json.loads(start.read_text())
    data["metrics"]["eval/grid_energy"] = 1e-9  # as if the starting policy drew no grid at all
    start.write_text(json.dumps(data))
    shutil.rmtree(stage_dir(ctx.run_dir, 1, "evaluate"))
    campaign = ctx.cfg.campaign.model_copy(update={"guard_grid_min": 0.0})  # this policy's grid is still tiny
    ctx = StageContext(ctx.cfg.model_copy(update={"campaign": campaign}), ctx.run_dir, ctx.run_id, 1)
    manifest, skipped = run_stage(ctx, "evaluate")
    assert not skipped
    assert any("grid-artifact energy" in w and "2-pixel patch period" in w for w in manifest.info["warnings"])


@needs_batch_invariant_gemm
@pytest.mark.parametrize("precision", ["nvfp4_emulated", "fp8_emulated"])
def test_the_candidate_pool_does_not_depend_on_the_explore_batch_size(tmp_path, precision):
    from conftest import tiny_config

    pools = {}
    for scale in ("sample", "call"):
        for batch in (4, 256):  # 4 candidates a forward call, or the whole pool of 16 in one
            cfg = tiny_config(
                tmp_path / f"{scale}{batch}",
                f"explore.batch_size={batch}",
                f"explore.precision={precision}",
                f"explore.activation_scale={scale}",
            )
            run = create_run(cfg, "batch")
            run_stage(StageContext(cfg, run.run_dir, run.run_id, 1), "explore")
            pools[scale, batch] = CandidatePool.load(run.run_dir, 1).images
    np.testing.assert_array_equal(pools["sample", 4], pools["sample", 256])  # per-sample activation scales
    if precision == "nvfp4_emulated":  # one scale per call: a sample depends on what else is in the batch
        assert (pools["call", 4] != pools["call", 256]).mean() > 0.1


def test_an_update_step_whose_grad_norm_spikes_is_skipped_counted_and_warned(tmp_path, monkeypatch):
    from conftest import tiny_config

    from solrl.stages.losses.nft import NFT
    from solrl.stages.update import is_spike

    assert not is_spike(1e9, [1.0] * 3, 10.0) and is_spike(11.0, [1.0] * 4, 10.0) and not is_spike(9.0, [1.0] * 4, 10)
    assert not is_spike(1e9, [1.0] * 8, None)
    cfg = tiny_config(tmp_path, "train.optimizer_steps=4", "fidelity.audit_every=0")
    run = create_run(cfg, "spike")
    stages = [s.name for s in ITERATION if s.name not in ("audit", "evaluate")]
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    first = {stage: run_stage(ctx, stage)[0] for stage in stages}["update"]
    assert first.metrics["train/skipped_steps"] == 0 and first.metrics["train/global_step"] == 4

    terms = NFT.terms.__func__

    def exploding(cls, *args, **kwargs):  # a loss 1e12 times the usual, as a broken reward would give
        loss, parts, deviation = terms(cls, *args, **kwargs)
        return loss * 1e12, parts, deviation

    monkeypatch.setattr(NFT, "terms", classmethod(exploding))
    ctx2 = StageContext(cfg, run.run_dir, run.run_id, 2)
    second = {stage: run_stage(ctx2, stage)[0] for stage in stages}["update"]
    assert second.metrics["train/skipped_steps"] == 4 and second.metrics["train/global_step"] == 4
    assert "train/loss" not in second.metrics  # no step taken: no mean of NaNs in the manifest
    assert any("skipped 4 of 4 optimizer steps" in w for w in second.info["warnings"])
    table = pd.read_parquet(stage_dir(run.run_dir, 2, "update") / "metrics.parquet")
    assert table["skipped"].tolist() == [1, 1, 1, 1] and (table["grad_norm"] > 1e6).all()
    before = load_checkpoint(stage_dir(run.run_dir, 1, "checkpoint"))[0]["policy"]
    after = load_checkpoint(stage_dir(run.run_dir, 2, "checkpoint"))[0]["policy"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing applied


def test_the_evaluation_samples_the_adapter_it_is_told_to(tmp_path):
    """``campaign.eval_adapter``: the rollout policy (default), its EMA or the policy, at full precision only."""
    from conftest import tiny_config

    from solrl.stages.quant.backends import sampling_network

    policy = StageContext(tiny_config(tmp_path), tmp_path, "x", 1).load_policy(None)
    for adapter in ("rollout", "ema", "policy"):
        with sampling_network(policy, "bf16", adapter=adapter) as (net, _):
            assert net.active_adapters() == [adapter]
    assert policy.transformer.active_adapters() == ["policy"]  # restored on exit
    with pytest.raises(ValueError, match="samples the rollout policy only, not the ema adapter"):
        with sampling_network(policy, "nvfp4_emulated", adapter="ema"):
            pass


def test_each_stage_says_when_it_is_due():
    """The campaign's plan asks each stage (``Stage.due``): the audit every fidelity.audit_every iterations, the
    evaluation every campaign.eval_every, at 0 and at the last, every other stage always."""
    from solrl.config import load_config
    from solrl.stages.pipeline import ITERATION, campaign_plan

    cfg = load_config("tiny-digits", ["campaign.iterations=8", "fidelity.audit_every=3", "campaign.eval_every=4"])
    plan = dict(campaign_plan(cfg))
    assert plan[0] == ["evaluate"]
    assert [i for i, stages in plan.items() if "audit" in stages] == [3, 6]
    assert [i for i, stages in plan.items() if "evaluate" in stages] == [0, 4, 8]
    always = [s.name for s in ITERATION if s.name not in ("audit", "evaluate")]
    assert all(set(always) <= set(plan[i]) for i in range(1, 9))
    # the policy the campaign ends with is evaluated, whatever eval_every says (it was not: 3 with eval_every 2)
    for iterations, every, evaluated in ((3, 2, [0, 2, 3]), (2, 5, [0, 2]), (1, 1, [0, 1])):
        cfg = load_config("tiny-digits", [f"campaign.iterations={iterations}", f"campaign.eval_every={every}"])
        assert [i for i, stages in campaign_plan(cfg) if "evaluate" in stages] == evaluated


def test_what_a_loss_returns_is_checked_before_backward_and_blamed_on_it():
    """A breaker's findings: a loss plug-in returning NaN was reported as a non-finite grad norm ('lower
    train.lr'); a detached, non-scalar or None-terms return was a bare autograd or attribute error."""
    from solrl.stages.update import _checked_terms

    w = torch.ones(3, requires_grad=True)
    good = (w.sum(), {"kl": 0.5}, 0.0)
    assert _checked_terms("mine", good, 0, 2) == good and _checked_terms("mine", (None, {}, 0), 0, 2)[0] is None
    for returned, match in (
        (
            (w * float("nan")).sum(),
            r"train.loss=mine: terms\(\) at optimizer step 4, timestep index 2 returned loss nan",
        ),
        (w * 2, r"returned a loss of \(3,\), not a scalar tensor"),
        (w.sum().detach(), r"returned a loss with no gradient"),
        (1.0, r"returned a loss of float, not a scalar tensor"),
    ):
        with pytest.raises((TypeError, FloatingPointError), match=match):
            _checked_terms("mine", (returned, {}, 0.0), 3, 2)
    with pytest.raises(TypeError, match=r"returned terms None, not a dict of numbers"):
        _checked_terms("mine", (w.sum(), None, 0.0), 0, 2)
    with pytest.raises(TypeError, match=r"returned tuple, not \(loss, terms, on-policy deviation\)"):
        _checked_terms("mine", (w.sum(), {}), 0, 2)
