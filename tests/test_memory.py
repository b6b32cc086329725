"""The memory plan (issue 20): meta-device counts against real ones, the refusal before an out-of-memory with its
numbers and fixes, ``--force``, and gradient checkpointing that trains the same LoRA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_TWINS, tiny_config

from solrl.config import load_config
from solrl.stages.memory import (
    DEVICE_MEMORY_ENV,
    MemoryPlanError,
    check_memory,
    make_plan,
    measure,
    train_bytes,
)
from solrl.stages.models import load_model, model_family

SOLRL = [sys.executable, "-m", "solrl.cli"]
#: Every tiny twin's preset (a new family is planned here without an edit).
TINY_FAMILIES = TINY_TWINS


def _with_lora(adapter):
    from peft import LoraConfig

    targets = adapter.lora_targets if isinstance(adapter.lora_targets, str) else list(adapter.lora_targets)
    adapter.transformer.requires_grad_(False)
    adapter.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets), "policy")
    adapter.transformer.set_adapter("policy")
    return adapter


@pytest.mark.parametrize("preset", TINY_FAMILIES)
def test_the_planned_conditioning_is_what_the_text_encoders_give(preset):
    """The plan measures with ``conditioning_like``: the keys, shapes and dtypes of the family's own ``_encode``."""
    cfg = load_config(preset, ["model.device=cpu"])
    real = load_model(cfg.model, torch.device("cpu"))._encode(["a photo of a cat"])
    meta, _, _ = model_family(cfg.model).meta_adapter(cfg.model, torch.float32)
    like = meta.conditioning_like(1)
    assert {k: (tuple(v.shape), v.dtype) for k, v in like.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in real.items()
    }
    assert all(v.device.type == "meta" for v in like.values())


@pytest.mark.parametrize("preset", TINY_FAMILIES)
def test_every_tiny_twin_is_planned_on_the_meta_device(preset, monkeypatch):
    """Each family's velocity and decode run on the meta device (a family whose transformer reads a tensor's values
    there would run unplanned, unchecked on a GPU): the plan's line is a plan, checked against a device."""
    monkeypatch.setenv("SOLRL_DEVICE_MEMORY_GIB", "80")
    line = check_memory(load_config(preset, ["model.device=cpu"]))
    assert line.startswith("memory plan (float32 weights, peak per device, ") and line.endswith("; fits"), line


def test_a_family_the_plan_cannot_run_is_said_and_warned_where_a_device_waits(monkeypatch, capsys):
    """``memory plan: none`` on a CPU run is information; with a device to check against it names it, and the
    callers warn (``UNCHECKED``)."""
    from solrl.stages.memory import UNCHECKED

    def unplannable(*args, **kwargs):
        raise NotImplementedError("model family tiny-digits does not run on the meta device")

    monkeypatch.setattr("solrl.stages.memory.cached_measure", unplannable)
    cfg = load_config(None, ["model.device=cpu"])
    assert check_memory(cfg) == "memory plan: none (model family tiny-digits does not run on the meta device)"
    monkeypatch.setenv("SOLRL_DEVICE_MEMORY_GIB", "80")
    assert check_memory(cfg).endswith(f"; {UNCHECKED} (an 80 GiB device (SOLRL_DEVICE_MEMORY_GIB))")
    from solrl.cli import _check_ready

    line = _check_ready(cfg, force=False)
    assert capsys.readouterr().err == f"solrl: warning: {line}\n"


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-z-image"])
def test_meta_counts_of_saved_activations_agree_with_a_real_cpu_backward(preset):
    """Saved-for-backward and peak activation bytes counted on the meta device agree with those of real float32
    tensors on CPU under the same fused-attention accounting, with and without gradient checkpointing."""
    cfg = load_config(preset, ["model.device=cpu"])
    meta = _with_lora(model_family(cfg.model).meta_adapter(cfg.model, torch.float32)[0])
    real = _with_lora(load_model(cfg.model, torch.device("cpu"), text_encoders=False))
    for batch, checkpointed in ((1, False), (2, False), (2, True)):
        (meta_peak, meta_saved), (real_peak, real_saved) = (train_bytes(a, batch, checkpointed) for a in (meta, real))
        # Within 5%, plus 32 KiB: the few per-call constants (position ids, rotary tables) that the real run
        # builds on the CPU from Python numbers or caches count on the meta device, whatever the model's size.
        for counted, measured in ((meta_saved, real_saved), (meta_peak, real_peak)):
            assert measured > 0 and abs(counted - measured) <= 0.05 * measured + (32 << 10), (batch, checkpointed)
    assert train_bytes(meta, 2, True)[1] < 0.25 * train_bytes(meta, 2, False)[1]  # checkpointing keeps inputs


@pytest.fixture(scope="module")
def digits_footprint():
    cfg = load_config("tiny-digits", ["model.device=cpu"])
    return cfg, measure(cfg, weights_dtype=torch.float32)


def test_the_plan_adds_up_and_its_largest_batches_fit_exactly(digits_footprint):
    cfg, footprint = digits_footprint
    assert footprint.blocks == 3 and footprint.transformer > 0 and footprint.lora > 0
    assert footprint.train.per_sample > footprint.sample.per_sample > 0  # a backward keeps more than sampling
    assert footprint.train_checkpointed.per_sample < footprint.train.per_sample
    device = 64 << 20  # 64 MiB
    plan = make_plan(cfg, footprint, device)
    update = next(s for s in plan.stages if s.stage == "update")
    assert update.total == sum(update.parts.values()) and update.parts["activations"] == footprint.train.at(
        cfg.train.micro_batch
    )
    # The largest micro-batch is the one whose update just fits.
    largest = plan.largest_micro_batch
    fits = make_plan(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": largest})}), footprint, device
    )
    over = make_plan(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": largest + 1})}), footprint, device
    )
    assert "update" not in {s.stage for s in fits.over()} and "update" in {s.stage for s in over.over()}
    # Without regeneration nothing is sampled after explore: the plan has no regenerate stage.
    copied = cfg.model_copy(update={"regenerate": cfg.regenerate.model_copy(update={"enabled": False})})
    assert [s.stage for s in make_plan(copied, footprint, device).stages] == ["explore", "score", "update"]


def test_a_sampling_batch_larger_than_the_samples_drawn_is_planned_at_the_samples_drawn(digits_footprint):
    """A breaker's finding: ``explore.batch_size=1000`` with 2 prompts of 8 candidates was planned as 1000 samples
    in one forward (and refused on a GPU) where explore draws 16. Each precision's batch is capped at what its
    stages draw at most: explore 2 x 8; BF16 the most of regenerate (2 x k), the audit and evaluation."""
    from solrl.stages.memory import sampling_batches

    cfg, footprint = digits_footprint

    def planned(explore: int, bf16: int) -> dict[str, int]:
        sized = cfg.model_copy(
            update={
                "campaign": cfg.campaign.model_copy(update={"prompts_per_iteration": 2}),
                "explore": cfg.explore.model_copy(update={"pool_size": 8, "batch_size": explore}),
                "select": cfg.select.model_copy(update={"k": 4}),
                "regenerate": cfg.regenerate.model_copy(update={"batch_size": bf16}),
            }
        )
        return {s.stage: s.parts["sampling"] for s in make_plan(sized, footprint, None).stages if "sampling" in s.parts}

    evaluation = len(cfg.eval_prompts()) * cfg.campaign.eval_seeds
    drawn = max(2 * 4, min(cfg.fidelity.audit_prompts, 2) * 8, evaluation)
    assert planned(1000, 1000) == planned(16, drawn) != planned(8, 4)
    over = cfg.model_copy(update={"explore": cfg.explore.model_copy(update={"batch_size": 100_000})})
    P, N = cfg.campaign.prompts_per_iteration, cfg.explore.pool_size
    assert sampling_batches(over)[0] == P * N


def test_the_explore_copy_is_resident_outside_explore_only_with_keep_copy_device(digits_footprint):
    cfg, footprint = digits_footprint
    copy = footprint.explore_copy[cfg.explore.precision]
    assert 0 < copy < 0.6 * footprint.quantizable and footprint.explore_copy["bf16"] == 0
    for keep, elsewhere in (("device", True), ("host", False), ("none", False)):
        trial = cfg.model_copy(update={"explore": cfg.explore.model_copy(update={"keep_copy": keep})})
        stages = {s.stage: s.parts for s in make_plan(trial, footprint, 64 << 20).stages}
        assert stages["explore"]["explore copy"] == copy
        for stage in ("score", "regenerate", "update"):
            assert ("explore copy" in stages[stage]) == elsewhere, (keep, stage)
    # A device on which the resident copy alone makes regenerate (a large batch) not fit: the fix names keep_copy.
    # (256 evaluation seeds a prompt, so that BF16 sampling draws the batch in one forward.)
    from solrl.stages.memory import RESERVE_FRACTION, fixes

    def trial(keep):
        return cfg.model_copy(
            update={
                "explore": cfg.explore.model_copy(update={"keep_copy": keep}),
                "regenerate": cfg.regenerate.model_copy(update={"batch_size": 8 * cfg.explore.batch_size}),
                "campaign": cfg.campaign.model_copy(update={"eval_seeds": 256}),
                "train": cfg.train.model_copy(update={"micro_batch": 1}),
            }
        )

    peak = max(s.total for s in make_plan(trial("host"), footprint, None).stages)
    device = int(peak / (1 - RESERVE_FRACTION)) + 2
    assert not make_plan(trial("host"), footprint, device).over()
    plan = make_plan(trial("device"), footprint, device)
    assert "regenerate" in {s.stage for s in plan.over()}
    found = dict(fixes(trial("device"), plan))
    assert "regenerate" in found["explore.keep_copy=host (the explore copy off the GPU outside explore)"]


def test_fsdp_shards_the_update_over_its_processes_after_loading_the_whole_base(digits_footprint):
    cfg, footprint = digits_footprint
    stages = {s.stage: s for s in make_plan(cfg, footprint, 64 << 20, parallel="fsdp", processes=4).stages}
    assert stages["update load"].parts["transformer"] == footprint.transformer  # before fully_shard cuts it
    update = stages["update"].parts
    assert update["transformer"] == -(-footprint.transformer // 4) + 2 * footprint.largest_block
    assert update["LoRA x3"] == -(-3 * footprint.lora // 4) and update["gradients + AdamW"] == -(
        -3 * footprint.lora // 4
    )
    assert update["activations"] == footprint.train.at(-(-cfg.train.micro_batch // 4))  # each process's rows


def test_a_plan_over_the_device_refuses_with_the_numbers_and_the_fix(digits_footprint, monkeypatch, tmp_path):
    cfg, _ = digits_footprint
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "0.01")  # 10 MiB: the 64-sample micro-batch's activations do not fit
    with pytest.raises(MemoryPlanError) as err:
        check_memory(cfg)
    message = str(err.value)
    assert "update needs" in message and "activations" in message and "9.5 MiB usable of 10.2 MiB" in message
    assert "Fix: to fit update: " in message and "train.micro_batch=" in message
    # Sharding the update over 8 processes with checkpointing brings its activations and state under the device.
    assert "train.parallel=fsdp over 8 GPUs (train.nproc_per_node=8" in message
    assert "--force" in message
    # A device the policy alone does not fit: no setting is offered as a fix (a breaker's finding: keep_loaded
    # false was offered, and fitted nothing).
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "0.001")
    with pytest.raises(
        MemoryPlanError,
        match=r"Fix: no single setting fits explore, score, regenerate and update \(a larger device does\)",
    ):
        check_memory(cfg)
    forced = check_memory(cfg, force=True)
    assert "forced past" in forced and "--force" not in forced  # not the advice already taken
    monkeypatch.delenv(DEVICE_MEMORY_ENV)
    assert "not checked" in check_memory(cfg)  # on CPU it reports only


def _cli(args, env_extra, cwd):
    env = {**os.environ, **env_extra}
    return subprocess.run([*SOLRL, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_run_and_resume_exit_2_before_any_work_and_force_goes_past(tmp_path):
    store = tmp_path / "runs"
    small = {DEVICE_MEMORY_ENV: "0.01"}
    refused = _cli(["run", "tiny-digits", "--set", f"storage.root={store}", "--run-id", "big"], small, tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "does not fit a 0.01 GiB device" in refused.stderr and "Fix:" in refused.stderr
    assert not (store / "big").exists()  # nothing created
    # --force goes past the plan: this run then stops at its store (a file, not a folder), after the memory check.
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    forced = _cli(["run", "tiny-digits", "--set", f"storage.root={not_a_folder}", "--force"], small, tmp_path)
    assert forced.returncode == 2 and "memory plan: forced past" in forced.stderr, forced.stderr
    assert "solrl: error: the memory plan" not in forced.stderr
    # resume checks the stored run's plan the same way.
    from solrl.storage.runs import create_run

    create_run(tiny_config(store), "stored")
    resumed = _cli(["resume", "stored", "--store", str(store)], small, tmp_path)
    assert resumed.returncode == 2 and "the memory plan does not fit" in resumed.stderr


def test_solrl_plan_prints_each_stage_against_each_device(tmp_path):
    out = _cli(["plan", "tiny-digits", "--gpu", "0.01", "--gpu", "80", "--gpu", "H200"], {}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("| update |") == 3 and "NO (by" in out.stdout and "| yes |" in out.stdout
    # a card by name is planned at the memory CUDA reports for it, as by default
    assert "on an 80 GiB device" in out.stdout and "on an H200 141 GB (140.4 GiB)" in out.stdout
    assert "float32 weights" in out.stdout  # tiny-digits keeps its shipped float32 weights on every device
    assert "largest micro-batch" in out.stdout


def test_solrl_plan_plans_the_weights_dtype_a_gpu_run_would_hold():
    """A breaker's finding: plan measured bf16 whatever ``model.dtype`` said, so a float32 config fitted in the
    plan and was refused by run's own check. ``auto`` is bf16 on a GPU; ``float32`` is planned as float32."""
    from typer.testing import CliRunner

    from solrl.cli import app

    def update(*overrides: str) -> tuple[str, float]:
        out = CliRunner().invoke(
            app, ["plan", "tiny-sd3", "--gpu", "80", *(w for o in overrides for w in ("--set", o))]
        )
        assert out.exit_code == 0, out.output
        header = next(line for line in out.stdout.splitlines() if " weights: " in line)
        row = next(line for line in out.stdout.splitlines() if line.startswith("| update |"))
        return header.split(", ")[-1].split(" weights")[0], float(row.split("|")[2].split()[0])

    (auto, auto_gib), (full, full_gib) = update(), update("model.dtype=float32")
    assert (auto, full) == ("bfloat16", "float32") and full_gib > auto_gib


def test_gradient_checkpointing_trains_the_same_lora(tmp_path):
    """train.gradient_checkpointing recomputes the blocks in backward: the same trained adapters, a layout field."""
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import ITERATION, STAGES, run_stage
    from solrl.stages.update import train_policy
    from solrl.storage.artifacts import TrainedState
    from solrl.storage.runs import create_run
    from solrl.storage.stage import stage_dir

    cfg = tiny_config(tmp_path / "runs")
    run = create_run(cfg, "ckpt")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    for stage in ITERATION:
        run_stage(ctx, stage.name)
        if stage.name == "update":
            break
    inputs = [artifact.load(ctx.run_dir, 1) for artifact in STAGES["update"].reads]
    checkpointed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"gradient_checkpointing": True})})
    assert checkpointed.digest() == cfg.digest()
    out = tmp_path / "out"
    out.mkdir()
    train_policy(StageContext(checkpointed, run.run_dir, run.run_id, 1), out, *inputs)
    eager = TrainedState.read(stage_dir(run.run_dir, 1, "update") / TrainedState.filename)
    again = TrainedState.read(out / TrainedState.filename)
    for name in ("policy", "rollout", "ema"):
        torch.testing.assert_close(again.sections[name], eager.sections[name], rtol=1e-5, atol=1e-6)


def test_the_largest_explore_batch_fits_exactly_with_its_vae_decode():
    """Explore decodes in chunks of up to ``DECODE_BATCH`` images: a VAE family's largest explore batch is bounded
    by the decode's working set as well as by the transformer's (tiny-flux, on devices cut to 1, 3 and 20 images)."""
    import math

    from solrl.stages.memory import RESERVE_FRACTION
    from solrl.stages.models.diffusers_family import DECODE_BATCH

    # 8 prompts of 8 candidates: 64 samples drawn, above every batch tried (a batch is planned at most at that)
    cfg = load_config("tiny-flux", ["model.device=cpu", "campaign.prompts_per_iteration=8"])
    footprint = measure(cfg, weights_dtype=torch.float32)
    explore = make_plan(cfg, footprint, None).stages[0]
    fixed = explore.total - explore.parts["sampling"]

    def explore_fits(batch: int, device: int) -> bool:
        sized = cfg.model_copy(update={"explore": cfg.explore.model_copy(update={"batch_size": batch})})
        return "explore" not in {s.stage for s in make_plan(sized, footprint, device).over()}

    assert footprint.decode.per_sample > 0
    for batch in (1, 3, 20):
        sampling = max(footprint.sample.at(batch), footprint.decode.at(min(DECODE_BATCH, batch)))
        device = math.ceil((fixed + sampling) / (1 - RESERVE_FRACTION)) + 1
        largest = make_plan(cfg, footprint, device).largest_explore_batch
        assert largest >= batch and explore_fits(largest, device) and not explore_fits(largest + 1, device), batch


def test_every_registered_reward_declares_the_parameters_the_plan_counts(tmp_path):
    """A reward owns its parameter count (``Reward.parameters``); one that declares none is refused by the plan,
    not counted as 0 bytes (a 7B judge on the device would otherwise vanish from the plan)."""
    from solrl.config import ConfigError
    from solrl.registry import REWARDS, register_reward
    from solrl.stages.memory import rewards_bytes
    from solrl.stages.rewards import Reward

    builtin = [name for name in REWARDS.names() if REWARDS.get(name).__module__.startswith("solrl.stages.rewards.")]
    assert len(builtin) >= 8 and all(isinstance(REWARDS.get(name).parameters, int) for name in builtin)
    cfg = load_config(None, ["reward.weights={digit_alignment: 1.0}", "reward.evaluate=[digit_evaluator]"])
    kept, scored = rewards_bytes(cfg)  # float32 by default
    declared = REWARDS.get("digit_alignment").parameters + REWARDS.get("digit_evaluator").parameters
    assert kept + scored == 4 * declared > 0
    from solrl.stages.models.tiny_digits import DigitClassifier, DigitEvaluator

    counted = [sum(p.numel() for p in net().parameters()) for net in (DigitClassifier, DigitEvaluator)]
    assert counted == [REWARDS.get(n).parameters for n in ("digit_alignment", "digit_evaluator")]

    @register_reward("undeclared-judge")
    class Judge(Reward):
        name = "undeclared-judge"

    try:
        judged = load_config(None, ["reward.weights={undeclared-judge: 1.0}", "reward.evaluate=[]"], plugins=False)
        with pytest.raises(ConfigError, match=r"reward 'undeclared-judge' declares no parameter count"):
            rewards_bytes(judged)
        on_cpu = load_config(
            None,
            [
                "reward.weights={undeclared-judge: 1.0}",
                "reward.evaluate=[]",
                "reward.models={undeclared-judge: {device: cpu}}",
            ],
            plugins=False,
        )
        assert rewards_bytes(on_cpu) == (0, 0)  # nothing of it on the device
        # A CPU run's plan is only reported, against no device: a toy reward there needs no count.
        assert rewards_bytes(judged, report_only=True) == (0, 0)
        assert check_memory(judged.model_copy(update={"model": judged.model.model_copy(update={"device": "cpu"})}))
    finally:
        REWARDS._entries.pop("undeclared-judge", None)


def test_a_plug_in_explore_backend_is_planned_with_its_own_copy_and_cannot_break_another_plan(tmp_path, monkeypatch):
    """A breaker's findings: a plan cached before a plug-in backend was loaded counted its copy as 0 bytes; a
    plug-in whose copy_bytes raised broke every precision's plan; a negative count was taken; the "cannot run
    here" message listed a plug-in that says it cannot."""
    from solrl.config import ConfigError
    from solrl.registry import EXPLORE_BACKENDS
    from solrl.stages.memory import cached_measure
    from solrl.stages.quant.availability import check_precision, runnable_precisions
    from solrl.stages.quant.backends import BF16

    class Counted(BF16):
        name = "test-counted"

        @classmethod
        def copy_bytes(cls, transformer, skip=(), min_dim=0):
            return 12345

    class Broken(BF16):
        name = "test-broken"

        @classmethod
        def copy_bytes(cls, transformer, skip=(), min_dim=0):
            raise RuntimeError("boom")

        @classmethod
        def unavailable_reason(cls):
            return "needs a test rig"

    class Negative(Counted):
        name = "test-negative"

        @classmethod
        def copy_bytes(cls, transformer, skip=(), min_dim=0):
            return -5

    def exploring(precision):
        return cfg.model_copy(update={"explore": cfg.explore.model_copy(update={"precision": precision})})

    monkeypatch.setenv("SOLRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path)
    nvfp4 = cached_measure(cfg, torch.bfloat16).explore_copy["nvfp4_emulated"]  # cached before the plug-ins
    for backend in (Counted, Broken, Negative):
        EXPLORE_BACKENDS.register(backend.name)(backend)
    try:
        assert cached_measure(exploring("test-counted"), torch.bfloat16).explore_copy["test-counted"] == 12345
        assert cached_measure(cfg, torch.bfloat16).explore_copy["nvfp4_emulated"] == nvfp4  # not this plan's
        with pytest.raises(
            ConfigError, match=r"test-broken: its backend \(.*Broken\) cannot count .*RuntimeError: boom"
        ):
            cached_measure(exploring("test-broken"), torch.bfloat16)
        with pytest.raises(ConfigError, match=r"copy_bytes TypeError: returned -5, not a number of bytes"):
            cached_measure(exploring("test-negative"), torch.bfloat16)
        assert "test-counted" in runnable_precisions() and "test-broken" not in runnable_precisions()
        with pytest.raises(ValueError, match=r"test-broken cannot run here: needs a test rig; this machine runs: "):
            check_precision("test-broken")
    finally:
        for backend in (Counted, Broken, Negative):
            EXPLORE_BACKENDS._entries.pop(backend.name, None)


def test_a_family_whose_velocity_reads_tensor_values_is_named_not_planned(tmp_path, monkeypatch):
    """A plug-in family whose velocity copied a tensor to the host (Lumina 2's rotary table) failed ``solrl plan``
    with torch's bare "Cannot copy out of meta tensor; no data!"; the plan now names the family and the cause, and
    ``run`` goes on with the plan's line saying why there is none."""
    cfg = tiny_config(tmp_path)
    family = model_family(cfg.model)
    velocity = family.velocity

    def host_reading(self, net, x, sigma, cond):
        sigma.tolist()  # what a rotary table built on the host does
        return velocity(self, net, x, sigma, cond)

    monkeypatch.setattr(family, "velocity", host_reading)
    with pytest.raises(NotImplementedError, match=r"^model family tiny-digits does not run on the meta device, where"):
        measure(cfg)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str(80 * 2**30))
    monkeypatch.setenv("SOLRL_CACHE", str(tmp_path / "cache"))  # no cached footprint: measured again
    line = check_memory(cfg)
    assert line.startswith("memory plan: none (model family tiny-digits does not run on the meta device"), line
    assert "Cannot copy out of meta tensor; no data!" in line and "the extending guide's family page" in line
