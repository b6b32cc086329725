"""Every registered family (SANA, FLUX.1, SD3.5, Z-Image, Qwen-Image, FLUX.2, Wan) as a tiny random model of its
real diffusers classes: built in code, saved with ``save_pretrained``, loaded through their adapters, run through
the same Prefect flow as tiny-digits with NVFP4-emulated explore, and their exported LoRA loaded by the stock
diffusers pipeline, which samples as the policy (the adapter's ``stock_pipeline_latents`` says how to call it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import diffusers
import pytest
import torch
from conftest import NO_REPORT, TINY_TWINS, trained_policy
from typer.testing import CliRunner

from solrl.cli import app
from solrl.config import load_config
from solrl.stages.models import load_model, model_family
from solrl.stages.models.lora import LORA_WEIGHTS, save_diffusers_lora
from solrl.stages.sampling.rollout import generate
from solrl.stages.sampling.samplers import initial_noise

#: Every tiny twin's preset: a new family's twin is picked up here without an edit.
FAMILIES = TINY_TWINS


def _config(family: str, root: Path, *extra: str):
    return load_config(family, [f"storage.root={root}", *extra])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_family_is_built_saved_and_loaded_through_its_adapter(tmp_path: Path, family: str):
    cfg = _config(family, tmp_path / "runs", f"model.path={tmp_path / family}")
    model = load_model(cfg.model, torch.device("cpu"))  # builds into model.path, then loads from it
    assert (tmp_path / family / "model_index.json").exists() and (tmp_path / family / "transformer").is_dir()
    assert type(model.pipe).__name__ == model_family(cfg.model).pipeline_class
    prompts = ["a photo of a cat", "a photo of two dogs", "a photo of a cat"]
    cond = model.encode(prompts)
    assert all(v.shape[0] == 3 for v in cond.values())
    torch.testing.assert_close(model.encode(prompts[1:2])[next(iter(cond))][0], cond[next(iter(cond))][1])
    x = torch.randn(3, *model.latent_shape)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        v = model.velocity(model.transformer, x, sigma, cond)
        v_alone = model.velocity(model.transformer, x[1:2], sigma[1:2], model.encode(prompts[1:2]))
    assert v.shape == x.shape and torch.isfinite(v).all()
    torch.testing.assert_close(v[1:2], v_alone, rtol=1e-4, atol=1e-5)  # no leakage across the batch
    images = model.decode(x)
    assert images.shape == ((3, 5, 32, 32, 3) if model.frames else (3, 32, 32, 3)) and images.dtype.name == "uint8"
    sigmas = model.sigmas(4)
    assert sigmas.shape == (5,) and sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas.diff() < 0).all()
    # One step (explore.steps=1) is [1, 0]: Qwen-Image's terminal stretch gave [nan, 0] (bench/published_size.py).
    assert model.sigmas(1).tolist() == [1.0, 0.0]


def test_a_family_whose_vae_factor_is_not_its_vaes_is_named_at_its_first_decode(tmp_path: Path, monkeypatch):
    """A plug-in family (Lumina 2, whose pipeline hard-codes a VAE factor of 8) decoded images of the wrong size
    and failed later, in a reward, with "images of 8x8 pixels are smaller than one period of 16"."""
    cfg = _config("tiny-sana", tmp_path / "runs")
    family = model_family(cfg.model)
    factor = family.vae_scale_factor
    monkeypatch.setattr(family, "vae_scale_factor", classmethod(lambda cls, pipe: 2 * factor(pipe)))
    model = load_model(cfg.model, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^model family tiny-sana decoded 16x16 images at model.resolution=32: "):
        model.decode(torch.randn(1, *model.latent_shape))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_exported_lora_loads_into_the_stock_pipeline_and_samples_as_the_policy(tmp_path: Path, family, caplog):
    cfg = _config(family, tmp_path / "runs", "model.solver=euler")
    family_cls = model_family(cfg.model)
    if family_cls.guidance_embedding:  # the pipeline's guidance_scale is then the embedded value: not the default
        cfg = _config(family, tmp_path / "runs", "model.solver=euler", "model.guidance=3.5")
    policy = trained_policy(cfg, rank=4, alpha=8.0)
    save_diffusers_lora(policy, "policy", family_cls.pipeline_class, tmp_path / "lora")
    if family == "tiny-sd3":  # the joint attention only: MMDiT-X's second attention stays frozen (as the peers)
        from safetensors.torch import load_file

        keys = list(load_file(tmp_path / "lora" / LORA_WEIGHTS))
        assert any(".attn.to_q." in k for k in keys) and any(".attn.add_q_proj." in k for k in keys)
        assert not any(".attn2." in k for k in keys)

    pipe = getattr(diffusers, family_cls.pipeline_class).from_pretrained(family_cls.weights_dir(cfg.model))
    pipe.set_progress_bar_config(disable=True)
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        pipe.load_lora_weights(str(tmp_path / "lora"))
    problems = [
        r.getMessage()
        for r in caplog.records
        if "led to unexpected keys" in r.getMessage() or "led to missing keys" in r.getMessage()
    ]
    assert not problems

    prompt, steps, seed = "a photo of a red apple", 4, 7
    noise = initial_noise([seed], policy.model.latent_shape)
    with torch.no_grad(), policy.using("policy") as net:
        ours = generate(policy.model, net, [prompt], [seed], steps, 1).samples
    theirs = policy.model.stock_pipeline_latents(pipe, prompt, noise, steps)  # the adapter says how
    # The grid first: a pipeline that shifts its sigmas by image size needs the family's sigmas(steps) to say so,
    # and a wrong grid would otherwise show only as the latents' mismatch below.
    stock_grid, grid = pipe.scheduler.sigmas.float().cpu(), policy.model.sigmas(steps).cpu()
    assert stock_grid.shape == grid.shape and torch.allclose(stock_grid, grid, atol=1e-6), (
        f"{family}'s sigma grid {grid.tolist()} is not its pipeline's {stock_grid.tolist()}: override the "
        "family's sigmas(steps) (docs/extending/family.md)"
    )
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-3, atol=1e-4)
    with torch.no_grad(), policy.using("reference") as net:
        base = generate(policy.model, net, [prompt], [seed], steps, 1).samples
    assert (ours - base).abs().max() > 1e-3  # the LoRA changes the samples, in both


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_iteration_campaign_through_the_prefect_flow_with_nvfp4_explore(tmp_path: Path, family: str):
    from solrl.flows.sol_rl import campaign
    from solrl.stages.pipeline import campaign_plan
    from solrl.storage.artifacts import CandidatePool, Checkpoint, Samples
    from solrl.storage.runs import create_run, list_runs
    from solrl.storage.stage import read_manifest, stage_dir

    cfg = _config(family, tmp_path / "store", NO_REPORT)
    assert cfg.explore.precision == "nvfp4_emulated" and cfg.campaign.iterations == 2
    run = create_run(cfg, f"{family}-flow")
    campaign(str(run.run_dir.parent), run.run_id)
    (listed,) = list_runs(run.run_dir.parent)  # solrl ls tells a twin's run from the family's
    assert listed["model"] == f"{cfg.model.family} (tiny twin)" and listed["last_stage"] == "iter 2: evaluate"
    for iteration, stages in campaign_plan(cfg):
        for stage in stages:
            assert read_manifest(run.run_dir, iteration, stage) is not None, (iteration, stage)
    pool, samples = CandidatePool.load(run.run_dir, 2), Samples.load(run.run_dir, 2)
    family_cls = model_family(cfg.model)
    frames = (cfg.model.num_frames or family_cls.default_num_frames,) if family_cls.video else ()
    assert samples.images.shape == (2, 4, *frames, 32, 32, 3) and pool.attrs["precision"] == "nvfp4_emulated"
    # Its checkpoint committed, the pool keeps every candidate's latents, not its images (storage.pool=latents).
    assert pool.images is None and pool.latents.shape == (2, 8, *samples.latents.shape[2:])
    checkpoint = Checkpoint.load(run.run_dir, 2)
    assert checkpoint.state["model_family"] == cfg.model.family and checkpoint.state["global_step"] == 2
    transformer = getattr(diffusers, checkpoint.state["architecture"]["transformer"]["_class_name"])
    assert issubclass(transformer, diffusers.ModelMixin)  # the family's diffusers transformer, recorded
    assert (stage_dir(run.run_dir, 2, "checkpoint") / "lora" / LORA_WEIGHTS).exists()
    audit = read_manifest(run.run_dir, 2, "audit").metrics  # the full-pool BF16 audit ran at iteration 2
    assert -1 <= audit["audit/spearman"] <= 1 and audit["audit/random_rank"] == 4.5
    store = str(run.run_dir.parent)
    exported = CliRunner().invoke(app, ["export", run.run_id, "--store", store, "--out", str(tmp_path / "lora")])
    assert exported.exit_code == 0 and (tmp_path / "lora" / LORA_WEIGHTS).is_file(), exported.output
    # A stock pipeline's default guidance_scale is not the embedded guidance the policy sampled with: said.
    said = f"sample as the policy did with guidance_scale={cfg.model.guidance:g}"
    assert (said in exported.stdout) == family_cls.guidance_embedding, exported.stdout


@pytest.mark.parametrize(
    ("preset", "where"),
    [
        ("sana-1600m", "huggingface.co/Efficient-Large-Model/Sana_1600M_1024px_diffusers"),
        ("flux1-dev", "huggingface.co/black-forest-labs/FLUX.1-dev"),
        ("sd35-large", "huggingface.co/stabilityai/stable-diffusion-3.5-large"),
        ("sd35-medium", "huggingface.co/stabilityai/stable-diffusion-3.5-medium"),
        ("z-image-turbo", "huggingface.co/Tongyi-MAI/Z-Image-Turbo"),
        ("qwen-image", "huggingface.co/Qwen/Qwen-Image"),
        ("flux2-klein-4b", "huggingface.co/black-forest-labs/FLUX.2-klein-4B"),
        ("flux2-dev", "huggingface.co/black-forest-labs/FLUX.2-dev"),
        ("wan21-t2v-1.3b", "huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
        ("wan21-t2v-14b", "huggingface.co/Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    ],
)
def test_a_real_preset_without_its_weights_exits_2_naming_the_path_and_where_they_are_published(
    tmp_path: Path, preset: str, where: str
):
    result = CliRunner().invoke(app, ["run", preset, "--set", f"storage.root={tmp_path / 'store'}"])
    assert result.exit_code == 2, result.output
    assert "not a local folder and not in the Hugging Face cache" in result.stderr and where in result.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("command", ["run", "run-local", "resume"])
def test_missing_published_weights_are_refused_before_torch_is_imported(tmp_path: Path, command: str):
    """The missing-weights error must come at once (issue 8: under a second); importing torch alone takes about
    one, so the check must run before anything imports it: a hub id not cached offline, a local folder without
    the pipeline's files, or a run whose weights have gone."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\nfrom solrl.cli import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    print('torch' in sys.modules, exc.code)\n"
    )
    from solrl.storage.runs import create_run

    local = command == "run-local"
    path = ["--set", f"model.path={tmp_path / 'sana'}"] if local else []
    (tmp_path / "sana").mkdir()
    args = ["run", "sana-1600m", "--set", f"storage.root={tmp_path / 'store'}", *path]
    if command == "resume":  # a run made where the weights were (written directly, as on that machine)
        create_run(load_config("sana-1600m", [f"storage.root={tmp_path / 'runs'}"], plugins=False), "made-elsewhere")
        args = ["resume", "made-elsewhere", "--store", str(tmp_path / "runs")]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # solrl's own default applies: offline
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "2"], done.stdout + done.stderr
    missing = f"{tmp_path / 'sana' / 'model_index.json'} is missing" if local else "not in the Hugging Face cache"
    assert missing in done.stderr and "huggingface.co/Efficient-Large-Model/Sana_1600M" in done.stderr
    assert not (tmp_path / "store").exists()


def test_prompt_embeddings_are_cached_once_and_a_corrupt_cache_is_recomputed(tmp_path: Path):
    from safetensors.torch import load_file

    cfg = _config("tiny-sd3", tmp_path / "runs")
    prompts = ["a photo of a cat", "a photo of two dogs"]
    cache = tmp_path / "embeddings.safetensors"
    first = load_model(cfg.model, torch.device("cpu"))
    first.precompute(prompts, cache)
    assert cache.exists() and first.text_encoders() == {name: None for name in first.text_encoder_names}
    with pytest.raises(KeyError, match="was not encoded before the text encoders were released"):
        first.encode(["a prompt never seen"])
    second = load_model(cfg.model, torch.device("cpu"))
    second.precompute(prompts, cache)  # read from the cache
    for key, value in first.encode(prompts).items():
        torch.testing.assert_close(second.encode(prompts)[key], value)
    cache.write_bytes(b"not a safetensors file")
    third = load_model(cfg.model, torch.device("cpu"))
    third.precompute(prompts, cache)  # recomputed, and the cache rewritten
    torch.testing.assert_close(third.encode(prompts)["emb"], first.encode(prompts)["emb"])
    assert set(load_file(cache)) == {f"{i}/{name}" for i in range(2) for name in ("emb", "pooled")}


def test_a_tiny_family_whose_cache_cannot_be_written_is_refused_before_any_run(tmp_path: Path, monkeypatch):
    from solrl.config import ConfigError
    from solrl.stages.runnable import check_runnable

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SOLRL_CACHE", str(blocker / "cache"))
    with pytest.raises(
        ConfigError,
        match=r"built on first use in .*a-file/cache/models/tiny-flux-v1, which cannot be "
        r"written .*set SOLRL_CACHE",
    ):
        check_runnable(_config("tiny-flux", tmp_path / "runs"))


def test_a_run_with_cached_prompt_embeddings_loads_no_text_encoder_and_recovers_from_a_corrupt_cache(
    tmp_path: Path,
):
    """After the first stage, every load of the model (later stages, a resume) reads the prompt embeddings from
    the run store and never reads the text encoders' weights; a corrupt cache is recomputed with them."""
    import shutil

    from solrl.stages import context
    from solrl.stages.context import PROMPT_EMBEDDINGS, StageContext

    weights = tmp_path / "tiny-flux"
    cfg = _config("tiny-flux", tmp_path / "runs", f"model.path={weights}")
    ctx = StageContext(cfg, tmp_path / "run", "run", 1)
    prompts = cfg.train_prompts()[:3]
    context._POLICIES.clear()
    expected = ctx.load_policy(None).model.encode(prompts)
    (cache,) = (tmp_path / "run" / PROMPT_EMBEDDINGS).glob("*.safetensors")  # beside it, its sha256

    encoders = [weights / name for name in ("text_encoder", "text_encoder_2")]
    for folder in encoders:  # the encoders' weights gone: a load that read them would fail
        folder.rename(tmp_path / folder.name)
    context._POLICIES.clear()
    model = ctx.load_policy(None).model
    assert model.text_encoders() == {"text_encoder": None, "text_encoder_2": None}
    for key, value in expected.items():
        torch.testing.assert_close(model.encode(prompts)[key], value)

    for folder in encoders:
        (tmp_path / folder.name).rename(folder)
    cache.write_bytes(cache.read_bytes()[:100])  # truncated: the header says more than the file holds
    context._POLICIES.clear()
    model = ctx.load_policy(None).model  # loaded without encoders, the cache fails, loaded again with them
    for key, value in expected.items():
        torch.testing.assert_close(model.encode(prompts)[key], value)
    assert cache.stat().st_size > 100  # rewritten
    context._POLICIES.clear()
    shutil.rmtree(tmp_path / "run")


def test_a_local_copy_of_a_published_variant_is_told_where_that_variant_is_published(tmp_path: Path):
    """A local folder named after SD3.5-Medium's repository (not Large's, the sd3 family's first checkpoint)."""
    folder = tmp_path / "stable-diffusion-3.5-medium"
    folder.mkdir()
    store = tmp_path / "store"
    args = ["run", "sd35-medium", "--set", f"model.path={folder}", "--set", f"storage.root={store}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"{folder}/model_index.json is missing (sd3 weights)" in result.stderr
    assert "huggingface.co/stabilityai/stable-diffusion-3.5-medium" in result.stderr and not store.exists()


@pytest.mark.slow
def test_tiny_wan_with_two_shards_equals_the_one_shard_run_and_its_videos_are_drawn(tmp_path: Path):
    """Issue 19: the video family through the sharded Prefect flow gives the one-shard run's pools, rewards,
    selections and checkpoints; `inspect`, `show` and `report --html` draw its videos."""
    from test_shards import assert_same_outputs

    from solrl.flows.sol_rl import campaign
    from solrl.storage.runs import create_run

    run_dirs = {}
    for shards in (1, 2):
        run = create_run(
            _config("tiny-wan", tmp_path / f"store{shards}", f"campaign.shards={shards}", NO_REPORT), "wan"
        )
        campaign(str(run.run_dir.parent), run.run_id)
        run_dirs[shards] = run.run_dir
    assert_same_outputs(run_dirs[2], run_dirs[1])

    store = str(tmp_path / "store2")
    shown = CliRunner().invoke(
        app, ["show", "wan", "--iteration", "2", "--prompt", "0", "--store", store, "--out", str(tmp_path)]
    )
    assert shown.exit_code == 0, shown.output
    from PIL import Image

    picture = Image.open(tmp_path / "wan-iter2-prompt0.png")  # 8 candidates, each a strip of 4 of its 5 frames
    assert picture.width > 4 * 32 * 4 and "8 candidates, 4 kept" in shown.output
    inspected = CliRunner().invoke(app, ["inspect", "wan", "--iteration", "2", "--store", store])
    assert inspected.exit_code == 0, inspected.output
    report = CliRunner().invoke(app, ["report", "wan", "--store", store, "--html", str(tmp_path / "wan.html")])
    assert report.exit_code == 0, report.output
    html = (tmp_path / "wan.html").read_text()
    assert html.count("data:image/png;base64,") >= 2  # the kept seeds' and the evaluations' frame strips


def test_the_gpu_benchmark_script_runs_every_family_at_smoke_size(tmp_path: Path):
    """bench/gpu_explore.py, kept ready for a lent GPU: every tiny twin's transformer through its adapter's velocity
    and explore copy on CPU (the numbers are not the point); the families come from the registry's presets."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_explore.py"
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    args = ["--smoke", "--compile", "eager", "--precisions", "bf16", "nvfp4_emulated", "--steps", "1"]
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    tables = (tmp_path / "gpu_explore.md").read_text()
    for preset in FAMILIES:
        assert f"{preset} ({load_config(preset, plugins=False).model.family}, smoke" in tables
    assert "failed" not in tables
