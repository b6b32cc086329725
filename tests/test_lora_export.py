"""The trained LoRA outside solrl: diffusers' format, loaded by a stock SanaTransformer2DModel, same output."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import trained_policy
from diffusers import SanaTransformer2DModel
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from typer.testing import CliRunner

from solrl.cli import app
from solrl.config import load_config
from solrl.stages.models.lora import LORA_WEIGHTS, save_diffusers_lora
from solrl.stages.models.tiny_digits import TINY_DIGITS_WEIGHTS


def _stock_transformer_with(folder: Path, caplog) -> SanaTransformer2DModel:
    """A stock diffusers transformer with the exported LoRA loaded the way diffusers' pipelines do."""
    transformer = SanaTransformer2DModel.from_pretrained(TINY_DIGITS_WEIGHTS / "transformer")
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        transformer.load_lora_adapter(
            str(folder), weight_name=LORA_WEIGHTS, prefix="transformer", adapter_name="exported"
        )
    assert not [
        r
        for r in caplog.records
        if "led to unexpected keys" in r.getMessage() or "led to missing keys" in r.getMessage()
    ]
    return transformer


def test_exported_keys_are_diffusers_format_not_peft_format(tmp_path: Path):
    path = save_diffusers_lora(trained_policy(load_config(), 4, 8.0, scale=0.05), "policy", "SanaPipeline", tmp_path)
    keys = list(load_file(path))
    assert path.name == LORA_WEIGHTS and keys and all(k.startswith("transformer.") for k in keys)
    assert not [k for k in keys if "base_model.model." in k or ".default" in k or "{adapter}" in k or ".policy." in k]


def test_exported_lora_loads_without_missing_keys_and_reproduces_the_policy(tmp_path: Path, caplog):
    policy = trained_policy(
        load_config(), 4, 8.0, scale=0.05
    )  # alpha != rank: the scale alpha / r = 2 must travel with the file
    save_diffusers_lora(policy, "policy", "SanaPipeline", tmp_path)
    stock = _stock_transformer_with(tmp_path, caplog)
    ours = get_peft_model_state_dict(policy.transformer, adapter_name="policy")
    theirs = get_peft_model_state_dict(stock, adapter_name="exported")
    assert set(theirs) == set(ours)
    for key in ours:
        torch.testing.assert_close(theirs[key], ours[key], rtol=0, atol=0)
    model = policy.model
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5, 0.2])
    cond = model.encode(["the digit one", "a handwritten digit two", "the digit nine"])
    with torch.no_grad():
        expected = policy.velocity("policy", x, sigma, cond)
        base = policy.velocity("reference", x, sigma, cond)
        got = model.velocity(stock, x, sigma, cond)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the LoRA changes the output, as the policy does


def test_unknown_adapter_is_refused(tmp_path: Path):
    with pytest.raises(KeyError, match="no adapter 'best'"):
        save_diffusers_lora(trained_policy(load_config(), 4, 4.0, scale=0.05), "best", "SanaPipeline", tmp_path)


@pytest.mark.slow
def test_checkpoint_stage_and_solrl_export_write_a_loadable_lora(tmp_path: Path, caplog):
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import ITERATION, run_stage
    from solrl.storage.artifacts import Checkpoint
    from solrl.storage.runs import create_run
    from solrl.storage.stage import stage_dir

    cfg = tiny_config(tmp_path / "store", "fidelity.audit_every=0")
    run = create_run(cfg, "export")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    for stage in ITERATION:
        if stage.name not in ("audit", "evaluate"):
            run_stage(ctx, stage.name)
    in_checkpoint = stage_dir(run.run_dir, 1, "checkpoint") / "lora"
    runner = CliRunner()
    result = runner.invoke(
        app, ["export", "export", "--out", str(tmp_path / "out"), "--store", str(run.run_dir.parent)]
    )
    assert result.exit_code == 0, result.output
    assert f"iteration 1 written to {tmp_path / 'out' / LORA_WEIGHTS}\n" in result.stdout
    # tiny-digits has no stock pipeline (1 channel, no VAE, its own text encoder): the hint loads the transformer's
    assert "load_lora_adapter(" in result.stdout and "tiny-digits has no stock diffusers pipeline" in result.stdout
    assert f"in {TINY_DIGITS_WEIGHTS / 'transformer'})" in result.stdout  # where that transformer is
    onto_file = runner.invoke(
        app, ["export", "export", "--out", str(tmp_path / "out" / LORA_WEIGHTS), "--store", str(run.run_dir.parent)]
    )
    assert onto_file.exit_code == 2 and f"--out {tmp_path / 'out' / LORA_WEIGHTS}: is a file; give a folder" in (
        onto_file.stderr
    )
    again = runner.invoke(app, ["export", "export", "--out", str(tmp_path / "out"), "--store", str(run.run_dir.parent)])
    assert again.exit_code == 0 and f"{LORA_WEIGHTS} (it replaced the file there)" in again.stdout, again.output
    torch.testing.assert_close(load_file(tmp_path / "out" / LORA_WEIGHTS), load_file(in_checkpoint / LORA_WEIGHTS))
    assert (tmp_path / "out" / LORA_WEIGHTS).read_bytes() == (in_checkpoint / LORA_WEIGHTS).read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    readable = 0o666 & ~umask  # not safetensors' 0600: other users of a shared machine can load them
    for written in (
        tmp_path / "out" / LORA_WEIGHTS,
        in_checkpoint / LORA_WEIGHTS,
        *in_checkpoint.parent.glob("*.safetensors"),
    ):
        assert written.stat().st_mode & 0o777 == readable, written
    assert len(list((run.run_dir / "prompt_embeddings").glob("*.safetensors"))) == 1  # export encoded no prompts
    stock = _stock_transformer_with(in_checkpoint, caplog)
    policy = ctx.load_policy(Checkpoint.load(run.run_dir, 1))
    x, sigma = torch.randn(2, 1, 16, 16), torch.tensor([0.7, 0.3])
    cond = policy.model.encode(["the digit four", "the digit five"])
    with torch.no_grad():
        torch.testing.assert_close(
            policy.model.velocity(stock, x, sigma, cond),
            policy.velocity("policy", x, sigma, cond),
            rtol=1e-4,
            atol=1e-5,
        )

    for args, message in (
        (["--iteration", "7"], "no committed checkpoint at iteration 7; committed: 1"),
        (["--adapter", "best"], "--adapter 'best': choose one of policy, rollout, ema"),
    ):
        bad = runner.invoke(
            app, ["export", "export", "--out", str(tmp_path / "x"), "--store", str(run.run_dir.parent), *args]
        )
        assert bad.exit_code == 2 and message in bad.stderr, bad.output
    # safetensors' writer raises its own error, not an OSError: a folder where the file goes was a traceback
    (tmp_path / "taken" / LORA_WEIGHTS).mkdir(parents=True)
    taken = runner.invoke(
        app, ["export", "export", "--out", str(tmp_path / "taken"), "--store", str(run.run_dir.parent)]
    )
    assert taken.exit_code == 2, taken.output
    why = "I/O error: Is a directory (os error 21)"
    assert taken.stderr.strip() == f"solrl: error: --out {tmp_path / 'taken'}: cannot write the LoRA there ({why})"
    # a newer checkpoint that fails verification: exporting the one before was silent, and asking for it by
    # number said it did not exist
    damaged = stage_dir(run.run_dir, 2, "checkpoint") / "_MANIFEST.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"stage": "checkp')
    store = str(run.run_dir.parent)
    last = runner.invoke(app, ["export", "export", "--out", str(tmp_path / "last"), "--store", store])
    assert last.exit_code == 0 and "policy LoRA of run export iteration 1 written" in last.stdout, last.output
    fails = "the checkpoint of iteration 2 fails verification (its manifest is unreadable, or a file changed since"
    assert last.stderr.startswith(f"solrl: warning: {fails}") and "; exporting iteration 1, the last" in last.stderr
    asked = runner.invoke(app, ["export", "export", "--out", str(tmp_path / "x"), "--store", store, "--iteration", "2"])
    assert asked.exit_code == 2 and asked.stderr.startswith(f"solrl: error: run export: {fails}"), asked.output

    # a newer checkpoint uncommitted (verify --redo) or deleted, a stage after it still committed: said, not hidden
    damaged.unlink()
    later = stage_dir(run.run_dir, 2, "evaluate")  # iteration 2's evaluation, as if it had run after checkpoint 2
    shutil.copytree(stage_dir(run.run_dir, 1, "checkpoint"), later)
    manifest = json.loads((later / "_MANIFEST.json").read_text())
    (later / "_MANIFEST.json").write_text(json.dumps({**manifest, "stage": "evaluate", "iteration": 2}))
    gap = runner.invoke(app, ["export", "export", "--out", str(tmp_path / "z"), "--store", store])
    assert gap.exit_code == 0 and "policy LoRA of run export iteration 1 written" in gap.stdout, gap.output
    assert gap.stderr.startswith(
        "solrl: warning: the checkpoint of iteration 2 is not committed, though later stages are (uncommitted by "
        f"`verify --redo`, or deleted); `solrl resume export --store {store}` recomputes it; exporting iteration 1"
    ), gap.stderr
    shutil.rmtree(later)
    assert runner.invoke(app, ["export", "export", "--out", str(tmp_path / "z"), "--store", store]).stderr == ""

    # a byte flipped in the checkpoint's LoRA keeps its size: only a hash tells, and export is where it leaves
    from conftest import flip_middle_byte

    flip_middle_byte(in_checkpoint / LORA_WEIGHTS)
    changed = runner.invoke(app, ["export", "export", "--out", str(tmp_path / "y"), "--store", store])
    assert changed.exit_code == 2 and not (tmp_path / "y").exists(), changed.output
    assert changed.stderr.strip().splitlines()[-1] == (  # after the warning about iteration 2's
        "solrl: error: run export: the checkpoint of iteration 1 fails verification (a file's bytes changed since it "
        f"was committed); `solrl verify export --store {store} --redo` uncommits it and `solrl resume` recomputes it"
    )


def test_the_exported_metadata_is_canonical_so_a_redone_checkpoint_keeps_its_bytes(tmp_path: Path):
    import json

    from safetensors import safe_open

    path = save_diffusers_lora(trained_policy(load_config(), 4, 8.0), "policy", "SanaPipeline", tmp_path)
    with safe_open(path, "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    targets = metadata["transformer.target_modules"]
    assert targets == sorted(targets) and len(targets) == 6
    # safetensors orders __metadata__ by a hash map that changes between writes: the header is canonicalised.
    policy = trained_policy(load_config(), 4, 8.0)
    written = {save_diffusers_lora(policy, "policy", "SanaPipeline", tmp_path / f"w{i}").read_bytes() for i in range(6)}
    assert len(written) == 1
