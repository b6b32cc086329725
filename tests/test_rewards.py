"""The real rewards on tiny random backbones of their real classes (built here, no hub), the OCR reward on its
real shipped model, options and errors, and a campaign trained on a weighted pair of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from safetensors.torch import save_file
from typer.testing import CliRunner

from solrl.cli import app
from solrl.config import ConfigError, load_config
from solrl.stages.rewards import build_reward
from solrl.stages.rewards.clip import AestheticHead
from solrl.stages.runnable import check_runnable

PROMPTS = ["a photo of a cat", "a red apple on a table", "two dogs", "a very long prompt " * 12]


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (4, 48, 40, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> dict[str, str]:
    """A tiny random transformers CLIPModel + CLIPProcessor (local tokenizer) and an aesthetic head, saved."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from solrl.stages.models.tiny_components import clip_model, clip_tokenizer

    root = tmp_path_factory.mktemp("clip")
    tokenizer = clip_tokenizer()
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = clip_model(tokenizer, tower, tower | dict(image_size=32, patch_size=8), 16)
    model.save_pretrained(root / "clip")
    with torch.no_grad():
        model.text_projection.weight.neg_()
    model.save_pretrained(root / "flipped")
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(root / "clip")
    processor.save_pretrained(root / "flipped")
    torch.manual_seed(1)
    save_file(AestheticHead(16).state_dict(), root / "head.safetensors")
    return {"path": str(root / "clip"), "head": str(root / "head.safetensors"), "flipped": str(root / "flipped")}


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory) -> dict[str, str]:
    """A tiny open_clip architecture registered by config, with a checkpoint saved as the HPS file is."""
    import open_clip

    root = tmp_path_factory.mktemp("hps")
    (root / "tiny-hps.json").write_text(
        json.dumps(
            {
                "embed_dim": 16,
                "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
                "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
            }
        )
    )
    open_clip.add_model_config(root / "tiny-hps.json")
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps", pretrained=None)
    torch.save({"state_dict": model.state_dict()}, root / "HPS_v2.1_compressed.pt")
    return {"checkpoint": str(root / "HPS_v2.1_compressed.pt"), "architecture": "tiny-hps"}


def _options(name: str, tiny_clip, tiny_hps, **extra) -> dict:
    base = {
        "pickscore": {"path": tiny_clip["path"]},
        "clipscore": {"path": tiny_clip["path"]},
        "aesthetic": {"path": tiny_clip["path"], "head": tiny_clip["head"]},
        "hpsv2": tiny_hps,
    }[name]
    return {**base, **extra}


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "hpsv2"])
def test_a_score_is_float32_per_image_and_does_not_depend_on_the_rest_of_the_batch(name, images, tiny_clip, tiny_hps):
    batched = build_reward(name, "cpu", _options(name, tiny_clip, tiny_hps, batch_size=4))(images, PROMPTS)
    alone = build_reward(name, "cpu", _options(name, tiny_clip, tiny_hps, batch_size=1))
    assert batched.dtype == np.float32 and batched.shape == (4,) and np.isfinite(batched).all()
    np.testing.assert_allclose(
        [alone(images[i : i + 1], PROMPTS[i : i + 1])[0] for i in range(4)], batched, rtol=1e-5, atol=1e-6
    )
    if name != "clipscore":  # random embeddings: CLIPScore may clamp every cosine to 0
        assert len(set(np.round(batched, 6))) > 1


def _clip_forward(tiny_clip, images, prompts):
    """CLIPModel's own forward (an independent path to the embeddings): image_embeds, text_embeds, logit scale."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip["path"]).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip["path"])
    inputs = processor(
        text=prompts, images=list(images), padding="max_length", truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(**inputs)
    return out, model.logit_scale.exp().item()


@pytest.mark.parametrize("flip", [False, True])
def test_pickscore_and_clipscore_equal_their_published_formulas(images, tiny_clip, tiny_hps, flip):
    clip_dir = tiny_clip["flipped" if flip else "path"]  # flipping the text projection negates every cosine
    out, scale = _clip_forward({"path": clip_dir}, images, PROMPTS)
    cosine = (out.image_embeds * out.text_embeds).sum(-1).numpy()
    np.testing.assert_allclose(out.logits_per_image.diagonal().numpy(), scale * cosine, rtol=1e-5)  # sanity
    pick = build_reward("pickscore", "cpu", {"path": clip_dir})(images, PROMPTS)
    np.testing.assert_allclose(pick, scale * cosine, rtol=1e-4, atol=1e-5)  # logit_scale.exp() * cos
    clip = build_reward("clipscore", "cpu", {"path": clip_dir})(images, PROMPTS)
    np.testing.assert_allclose(clip, 2.5 * np.maximum(cosine, 0), rtol=1e-4, atol=1e-5)  # Hessel et al. eq. 1


def test_the_two_tiny_clips_cover_both_sides_of_clipscores_clamp(images, tiny_clip):
    signs = [
        np.sign((out.image_embeds * out.text_embeds).sum(-1).numpy())
        for out, _ in (_clip_forward({"path": tiny_clip[key]}, images, PROMPTS) for key in ("path", "flipped"))
    ]
    np.testing.assert_array_equal(signs[0], -signs[1])


def test_aesthetic_is_the_mlp_on_the_unit_norm_image_embedding(images, tiny_clip, tiny_hps):
    from safetensors.torch import load_file

    out, _ = _clip_forward(tiny_clip, images, PROMPTS)
    head = AestheticHead(16).eval()
    head.load_state_dict(load_file(tiny_clip["head"]))
    with torch.no_grad():
        expected = head(out.image_embeds).squeeze(-1).numpy()
    got = build_reward("aesthetic", "cpu", _options("aesthetic", tiny_clip, tiny_hps))(images, ["ignored"] * 4)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_hpsv2_is_the_cosine_of_the_open_clip_features(images, tiny_clip, tiny_hps):
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms("tiny-hps", pretrained=None)
    model.load_state_dict(torch.load(tiny_hps["checkpoint"], weights_only=True)["state_dict"])
    model.eval()
    pixels = torch.stack([preprocess(Image.fromarray(image)) for image in images])
    with torch.no_grad():
        image_features, text_features, _ = model(pixels, open_clip.get_tokenizer("tiny-hps")(PROMPTS))
    expected = (image_features @ text_features.T).diagonal().numpy()
    got = build_reward("hpsv2", "cpu", _options("hpsv2", tiny_clip, tiny_hps))(images, PROMPTS)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _rendered(text: str) -> np.ndarray:
    image = Image.new("RGB", (512, 256), "white")
    if text:
        ImageDraw.Draw(image).text((16, 100), text, fill="black", font=ImageFont.load_default(size=44))
    return np.asarray(image)


def test_ocr_reads_real_rendered_text_with_its_shipped_model():
    reward = build_reward("ocr")
    prompt = 'A storefront sign that reads "Spring Collection" in gold letters'
    images = np.stack([_rendered("Spring Collection"), _rendered(""), _rendered("Spring Coffee")])
    exact, blank, one_word_wrong = reward(images, [prompt] * 3)
    assert exact >= 0.95 and blank <= 0.05 and 0.2 < one_word_wrong < 0.9
    with pytest.raises(ValueError, match="quotes no text"):
        reward(images[:1], ["no quotes here"])


def test_ocr_accuracy_follows_flow_grpo():
    from solrl.stages.rewards.ocr import ocr_accuracy, quoted_text

    assert quoted_text('say "Hello World" twice') == "Hello World" and quoted_text("none") is None
    assert ocr_accuracy("xx hello world yy", "Hello World") == 1.0  # contained: distance 0
    assert ocr_accuracy("helloword", "Hello World") == pytest.approx(1 - 1 / 10)
    assert ocr_accuracy("", "abc") == 0.0 and ocr_accuracy("zzzzzzzzzz", "abc") == 0.0  # capped at the length


def test_reward_options_are_validated_by_the_reward_at_load():
    with pytest.raises(ConfigError, match=r"reward.models.pickscore.path: Field required"):
        load_config(None, ["reward.weights={pickscore: 1.0}"])
    with pytest.raises(ConfigError, match=r"reward.models.ocr.batch_sise: unknown key; known keys here: device, "):
        load_config(None, ["reward.models={ocr: {batch_sise: 4}}"])
    with pytest.raises(ConfigError, match=r"reward.models: unknown reward 'imagereward2'"):
        load_config(None, ["reward.models={imagereward2: {}}"])


def test_a_missing_reward_weight_file_exits_2_before_any_work_naming_it_and_where_it_is_published(tmp_path):
    cfg = load_config(None, ["reward.weights={pickscore: 1.0}", "reward.models={pickscore: {path: /nope/pick}}"])
    with pytest.raises(
        ConfigError,
        match=r"reward.models.pickscore.path: /nope/pick does not exist; weights: "
        r"https://huggingface.co/yuvalkirstain/PickScore_v1",
    ):
        check_runnable(cfg)
    store = tmp_path / "store"
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--set",
            "reward.weights={aesthetic: 1.0}",
            "--set",
            "reward.models={aesthetic: {path: /nope/clip, head: /nope/head.pth}}",
            "--set",
            f"storage.root={store}",
        ],
    )
    assert result.exit_code == 2 and "reward.models.aesthetic.path: /nope/clip does not exist" in result.stderr
    assert "improved-aesthetic-predictor" in result.stderr and not store.exists()


@pytest.mark.slow
def test_a_campaign_trains_on_a_weighted_pair_of_real_rewards_and_logs_each(tmp_path: Path, tiny_clip, tiny_hps):
    import mlflow

    from solrl.flows.sol_rl import campaign
    from solrl.storage.artifacts import RegeneratedRewards
    from solrl.storage.runs import create_run
    from solrl.storage.tracking import tracking_uri

    models = json.dumps({"pickscore": {"path": tiny_clip["path"]}, "hpsv2": tiny_hps})
    cfg = load_config(
        "tiny-sana",
        [
            f"storage.root={tmp_path / 'store'}",
            "reward.weights={pickscore: 1.0, hpsv2: 2.0}",
            "reward.evaluate=[pickscore, hpsv2, jpeg_compressibility]",
            f"reward.models={models}",
            "reward.normalize=group",
        ],
    )
    run = create_run(cfg, "two-rewards")
    campaign(str(run.run_dir.parent), run.run_id)
    table = RegeneratedRewards.load(run.run_dir, 2).frame
    assert set(table["reward"]) == {"pickscore", "hpsv2"}
    assert dict(table.groupby("reward")["weight"].first()) == {"hpsv2": 2.0, "pickscore": 1.0}
    client = mlflow.MlflowClient(tracking_uri(cfg, run.run_dir.parent))
    (mlflow_run,) = client.search_runs(client.get_experiment_by_name("solrl").experiment_id)
    for key in ("eval/pickscore", "eval/hpsv2", "eval/jpeg_compressibility", "eval/diversity"):
        assert sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, key)) == [0, 1, 2], key


def test_imagereward_without_its_package_is_refused_where_work_starts_naming_the_extra():
    import importlib.util

    if importlib.util.find_spec("ImageReward") is not None:
        pytest.skip("the image-reward package is installed here")
    cfg = load_config(
        None,
        [
            "reward.evaluate=[digit_alignment, imagereward]",
            "reward.models={imagereward: {checkpoint: /m/ImageReward.pt, med_config: /m/med.json}}",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"reward imagereward needs the ImageReward package: pip install 'solrl\[imagereward\]'"
    ):
        check_runnable(cfg)


def test_metadata_of_the_wrong_shape_says_what_does_not_match_and_the_form_expected(images):
    """Tried as a new user would (issue 19): 3 images, 3 prompts and metadata as a dict of lists once said
    ``reward ocr: 3 images but 3 prompts``."""
    ocr = build_reward("ocr")
    three, prompts = images[:3], ['a sign that says "hi"'] * 3
    with pytest.raises(ValueError) as caught:
        ocr(three, prompts, {"text": ["hi", "hi", "hi"]})
    message = str(caught.value)
    assert "metadata is one dict of columns ('text'), not one dict per image" in message
    assert "give metadata as a list of 3 dicts, one per image" in message
    with pytest.raises(ValueError, match="3 images but 2 metadata entries; give metadata as a list of 3 dicts"):
        ocr(three, prompts, [{"text": "hi"}] * 2)
    with pytest.raises(ValueError, match="metadata entry 1 is a str, not a dict"):
        ocr(three, prompts, [{"text": "hi"}, "hi", {"text": "hi"}])
    with pytest.raises(ValueError, match="3 images but 2 prompts; give one prompt per image"):
        ocr(three, prompts[:2])


#: Two instances of one registered reward, configured differently (reward.models.<name>.type).
TWO_JPEGS = [
    "reward.evaluate=[digit_alignment, jpeg_q95, jpeg_q10]",
    "reward.models={jpeg_q95: {type: jpeg_compressibility}, jpeg_q10: {type: jpeg_compressibility, quality: 10}}",
]


def test_two_instances_of_one_reward_score_one_run_each_with_its_options(tmp_path: Path):
    """A reward instance is named apart from its type: jpeg_q95 and jpeg_q10 are both JPEG compressibility, at
    quality 95 and 10, and both score the starting policy's evaluation under their own names."""
    from conftest import tiny_config

    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.artifacts import EvalMetrics
    from solrl.storage.runs import create_run

    cfg = tiny_config(tmp_path / "store", *TWO_JPEGS)
    check_runnable(cfg)
    run = create_run(cfg, "two-jpegs")
    run_stage(StageContext(cfg, run.run_dir, run.run_id, 0), "evaluate")
    means = EvalMetrics.load(run.run_dir, 0).frame.groupby("reward")["mean"].mean()
    assert {"digit_alignment", "jpeg_q95", "jpeg_q10"} <= set(means.index)
    assert means["jpeg_q10"] > means["jpeg_q95"]  # smaller files at quality 10: a higher (less negative) reward
    assert build_reward("jpeg_q10", "cpu", {"type": "jpeg_compressibility", "quality": 10}).options.quality == 10


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["reward.models={judge: {type: no-such-reward}}"],
            r"reward.models.judge.type: unknown reward 'no-such-reward'",
        ),
        (["reward.models={jpeg_q0: {type: jpeg_compressibility, quality: 0}}"], r"reward.models.jpeg_q0.quality"),
        (["reward.evaluate=[judge]"], r"reward.evaluate: unknown reward 'judge'"),  # an instance needs its type
        (
            ["reward.models={judge: {type: [pickscore]}}"],
            r"judge.type must name a registered reward, got \['pickscore'\]",
        ),
        (  # a registered reward's name reused for another reward: its scores would be reported under the wrong name
            ["reward.models={pickscore: {type: jpeg_compressibility}}", "reward.weights={pickscore: 1.0}"],
            r"'pickscore' is a registered reward, so it cannot name an instance of 'jpeg_compressibility'",
        ),
        (["reward.models={'judge(a)': {type: jpeg_compressibility}}"], r"'judge\(a\)' cannot name a reward instance"),
        (["reward.models={diversity: {type: jpeg_compressibility}}"], r"'diversity' cannot name a reward instance"),
    ],
)
def test_a_bad_reward_instance_is_one_line_naming_it(overrides: list[str], match: str):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-digits", overrides)


def test_one_instance_name_of_two_types_in_one_process_builds_each_type():
    """The built-rewards cache is keyed by the registered type too: a process that scores two runs whose
    ``judge`` is another reward each (pytest does) must not get the first run's reward back."""
    jpeg = build_reward("judge", "cpu", {"type": "jpeg_compressibility"})
    digits = build_reward("judge", "cpu", {"type": "digit_alignment"})
    assert (jpeg.name, digits.name) == ("jpeg_compressibility", "digit_alignment")


def test_a_missing_weights_file_of_an_instance_names_the_instance(tmp_path: Path):
    cfg = load_config(
        "tiny-digits",
        [
            "reward.evaluate=[digit_alignment, pick_ft]",
            f"reward.models={{pick_ft: {{type: pickscore, path: {tmp_path / 'nope'}, processor: {tmp_path}}}}}",
        ],
    )
    with pytest.raises(ConfigError, match=r"reward.models.pick_ft.path: .*nope does not exist"):
        check_runnable(cfg)


def test_every_registered_reward_benchmarks_itself_or_says_why(tmp_path: Path):
    """bench/rewards.py measures every registered reward with no list of its own: each makes inputs it can score
    (``benchmark_inputs``) and builds itself at its published size (``benchmark_options``) or says why it cannot.
    The script runs on the cheap ones and names the one it cannot build. The published CLIP backbones the
    benchmark builds have the parameters the memory plan counts (within 0.1%)."""
    import runpy

    from solrl.registry import REWARDS
    from solrl.stages.models.tiny_components import clip_model, clip_tokenizer
    from solrl.stages.rewards.clip import PUBLISHED_CLIP

    for name in REWARDS.names():
        cls = REWARDS.get(name)
        images, prompts = cls.benchmark_inputs(2, size=64)
        assert images.dtype == np.uint8 and images.shape == (2, 64, 64, 3) and len(prompts) == 2, name
        cls.check_prompts(prompts, f"{name}'s benchmark prompts")
    for name, size in (("pickscore", "vit-h-14"), ("clipscore", "vit-l-14")):
        spec = PUBLISHED_CLIP[size]
        with torch.device("meta"):
            model = clip_model(clip_tokenizer(), spec["text"], spec["vision"], spec["projection_dim"], vocab_size=49408)
        counted = sum(p.numel() for p in model.parameters())
        assert abs(counted / REWARDS.get(name).parameters - 1) < 1e-3, (name, counted)

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "rewards.py"))
    table = bench["main"](["--rewards", "jpeg_compressibility", "digit_alignment", "ocr", "imagereward"])
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    for name in ("jpeg_compressibility", "digit_alignment", "ocr"):
        assert float(rows[name].split(" | ")[1]) > 0, rows[name]
    assert "not measured: its BLIP loads bert-base-uncased from the Hugging Face hub" in rows["imagereward"]


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (lambda n: ["high"] * n, r"reward 'returns' returned \"\['high', .*not numbers \(could not convert"),
        (lambda n: {"score": 1.0}, r"returned .*not numbers \(float\(\) argument must be"),
        (lambda n: 0.5, r"reward 'returns' returned 1 values for a batch of 2 images"),
        (lambda n: np.ones((n, 2)), r"reward 'returns' returned 4 values for a batch of 2 images"),
        (lambda n: np.full(n, 1e40), r"reward 'returns' returned 1e\+40, beyond float32's range"),
    ],
)
def test_what_a_reward_returns_is_checked_batch_by_batch_and_blamed_on_it(returned, match):
    """A breaker's findings: strings or a dict were a bare 'could not convert string to float'; one number a batch
    was 'returned shape (3,), expected (80,)'; 1e40 was 'returned inf'."""
    from solrl.stages.rewards.base import Reward, RewardError, RewardOptions, checked

    class Returns(Reward):
        name = "returns"

        def _score(self, images, prompts, metadata):
            return returned(len(images))

    reward = Returns(RewardOptions(batch_size=2))
    with pytest.raises(RewardError, match=match):
        checked(reward, np.zeros((4, 8, 8, 3), np.uint8), ["a"] * 4)
    assert reward._values(torch.tensor([1.0, 2.0], dtype=torch.float64), 2).dtype == np.float32
