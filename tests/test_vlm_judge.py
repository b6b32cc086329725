"""The VLM-judge reward on a tiny random Qwen2.5-VL built here (no hub): images, videos, answers, rationale, and two
differently configured judges scoring one campaign."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from solrl.config import load_config
from solrl.stages.rewards.base import build_reward, checked


def build_tiny_judge(out: Path) -> None:
    """A Qwen2.5-VL of the real classes at random weights (``tiny_components.qwen2_5_vl``, as tiny-qwen-image's text
    encoder) and its processor (``tiny_components.qwen2_5_vl_processor``)."""
    from solrl.stages.models.tiny_components import qwen2_5_vl, qwen2_5_vl_processor

    processor, ids = qwen2_5_vl_processor()
    processor.save_pretrained(out)
    vision = {k: v for k, v in ids.items() if k not in ("eos_token_id", "pad_token_id")}
    qwen2_5_vl(len(processor.tokenizer), ids["eos_token_id"], ids["pad_token_id"], vision).save_pretrained(out)


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-judge")
    build_tiny_judge(out)
    return str(out)


IMAGES = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
PROMPTS = ["a red cube", "a dog", "two cats"]


def test_the_judge_reads_its_answer_probabilities_batch_by_batch(judge_path: str):
    """P(Yes) over {Yes, No}: the same as computed by hand from the model's next-token logits, the same alone as in
    a batch (left padding), and an expected grade in [1, 5] for a 1..5 scale."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    judge = build_reward("judge", "cpu", {"type": "vlm_judge", "model_path": judge_path, "batch_size": 3})
    scores = checked(judge, IMAGES, PROMPTS)
    assert scores.values.dtype == np.float32 and ((scores.values > 0) & (scores.values < 1)).all()
    assert scores.columns == {}  # no rationale unless asked

    processor, model = (
        AutoProcessor.from_pretrained(judge_path),
        AutoModelForImageTextToText.from_pretrained(judge_path),
    )
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    for i in range(3):
        turn[0]["content"][1]["text"] = judge.options.question.format(prompt=PROMPTS[i], media="image")
        text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        logits = model(**processor(text=[text], images=[IMAGES[i]], return_tensors="pt")).logits[0, -1]
        yes, no = (processor.tokenizer.encode(a, add_special_tokens=False)[0] for a in ("Yes", "No"))
        expected = logits[[yes, no]].softmax(-1)[0].item()
        assert scores.values[i] == pytest.approx(expected, abs=1e-5)

    one_by_one = build_reward("judge_1", "cpu", {"type": "vlm_judge", "model_path": judge_path, "batch_size": 1})
    np.testing.assert_allclose(one_by_one(IMAGES, PROMPTS), scores.values, atol=1e-5)
    scale = {str(g): float(g) for g in range(1, 6)}
    graded = build_reward("grader", "cpu", {"type": "vlm_judge", "model_path": judge_path, "answers": scale})(
        IMAGES, PROMPTS
    )
    assert ((graded > 1) & (graded < 5)).all()


def test_the_judge_scores_a_video_whole_and_gives_its_rationale_when_asked(judge_path: str):
    """A video reaches the judge as a video (its frames spread over it), not frame by frame; an image is a
    one-frame video shown as an image; the rationale is the judge's greedy answer, one string per sample."""
    judge = build_reward(
        "talker", "cpu", {"type": "vlm_judge", "model_path": judge_path, "rationale": True, "max_new_tokens": 4}
    )
    videos = np.random.default_rng(1).integers(0, 256, (2, 6, 32, 32, 3), dtype=np.uint8)
    batch = judge._inputs(videos, PROMPTS[:2])
    assert "pixel_values_videos" in batch and "pixel_values" not in batch
    assert "pixel_values" in judge._inputs(IMAGES[:, None], PROMPTS)
    scores = checked(judge, videos, PROMPTS[:2])
    assert scores.values.shape == (2,) and np.isfinite(scores.values).all()
    assert [type(r) for r in scores.columns["rationale"]] == [str, str]
    assert checked(judge, videos[:, :1], PROMPTS[:2]).values.shape == (2,)
    with pytest.raises(ValueError, match="expected uint8 images"):
        judge(videos.astype(np.float32), PROMPTS[:2])


def test_answers_that_share_a_first_token_or_a_question_without_the_prompt_are_refused(judge_path: str):
    with pytest.raises(ValueError, match="must start with distinct tokens"):
        build_reward("j", "cpu", {"type": "vlm_judge", "model_path": judge_path, "answers": {"yes": 1, "yeah": 0}})
    with pytest.raises(ValueError, match=r"must contain \{prompt\}"):
        load_config("tiny-sana", ["reward.models={j: {type: vlm_judge, question: 'Good?'}}", "reward.evaluate=[j]"])


def test_a_judge_behind_a_reward_server_scores_images_and_videos_with_its_rationale_as_it_does_locally(
    judge_path: str,
):
    """``solrl reward-server vlm_judge`` (a real server process): the client takes the judge's inputs and columns,
    sends videos whole, and gets the same values (float32 tolerance) and the same rationale as the judge in this
    process, for images and for a video."""
    import json

    from test_remote_reward import start_server, stop

    options = {"model_path": judge_path, "rationale": True, "max_new_tokens": 4, "batch_size": 2}
    server, url = start_server("vlm_judge", options=json.dumps(options))
    try:
        remote = build_reward("remote_judge", "cpu", {"type": "vlm_judge", "url": url})
        assert (remote.inputs, remote.columns) == ("video", ("rationale",))
        local = build_reward("local_judge", "cpu", {"type": "vlm_judge", **options})
        videos = np.random.default_rng(1).integers(0, 256, (2, 3, 32, 32, 3), dtype=np.uint8)
        for samples, prompts in ((IMAGES, PROMPTS), (videos, PROMPTS[:2])):
            got, expected = checked(remote, samples, prompts), checked(local, samples, prompts)
            np.testing.assert_allclose(got.values, expected.values, rtol=1e-5, atol=1e-6)
            assert got.columns == expected.columns and len(got.columns["rationale"]) == len(prompts)
    finally:
        stop(server)


@pytest.mark.slow
def test_two_differently_configured_judges_score_one_campaign(tmp_path: Path, judge_path: str):
    """judge_yes (P(Yes)) and judge_grade (a 1..5 grade, with its rationale) train one campaign: both
    score every candidate under their own names, and the rationale lands in the rewards tables beside the
    grade's rows only, and in the evaluation's per-sample table."""
    from solrl.flows.sol_rl import campaign
    from solrl.stages.runnable import check_runnable
    from solrl.storage.artifacts import EvalMetrics, EvalScores, ExploreRewards, RegeneratedRewards
    from solrl.storage.runs import create_run

    grade = {str(g): float(g) for g in range(1, 6)}
    models = {
        "judge_yes": {"type": "vlm_judge", "model_path": judge_path},
        "judge_grade": {
            "type": "vlm_judge",
            "model_path": judge_path,
            "answers": grade,
            "question": "Grade this {media} for '{prompt}' from 1 to 5.",
            "rationale": True,
            "max_new_tokens": 3,
        },
    }
    cfg = load_config(
        "tiny-sana",
        [
            f"storage.root={tmp_path / 'store'}",
            "reward.weights={judge_yes: 1.0, judge_grade: 0.25}",
            "campaign.iterations=1",
            f"reward.models={json.dumps(models)}",
        ],
    )
    check_runnable(cfg)
    run = create_run(cfg, "two-judges")
    campaign(str(run.run_dir.parent), run.run_id)
    for table in (ExploreRewards.load(run.run_dir, 1).frame, RegeneratedRewards.load(run.run_dir, 1).frame):
        assert set(table["reward"]) == {"judge_yes", "judge_grade"}
        yes, graded = table[table["reward"] == "judge_yes"], table[table["reward"] == "judge_grade"]
        assert yes["value"].between(0, 1).all() and graded["value"].between(1, 5).all()
        assert yes["rationale"].isna().all() and graded["rationale"].map(type).eq(str).all()
    samples = EvalScores.load(run.run_dir, 0).frame  # the evaluation's samples: one row per (sample, judge)
    seeds = cfg.campaign.eval_seeds
    assert {"judge_yes", "judge_grade"} <= set(samples["reward"])
    assert samples.groupby("reward").size().eq(seeds * samples["prompt"].nunique()).all()
    graded = samples[samples["reward"] == "judge_grade"]
    assert (
        graded["rationale"].map(type).eq(str).all()
        and samples[samples["reward"] == "judge_yes"]["rationale"].isna().all()
    )
    means = EvalMetrics.load(run.run_dir, 0).frame.set_index(["prompt", "reward"])["mean"]
    per_sample = samples.groupby(["prompt", "reward"])["value"].mean()
    assert np.allclose(per_sample.loc[means.index], means, atol=1e-6)  # the metrics are these samples' means


def test_the_published_judge_the_benchmark_builds_has_the_parameters_the_memory_plan_counts():
    """``QWEN2_5_VL_7B``, which bench/rewards.py builds at random weights, is Qwen2.5-VL-7B: exactly
    ``VLMJudge.parameters`` (counted on the meta device, nothing allocated)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from solrl.stages.rewards.vlm_judge import QWEN2_5_VL_7B, VLMJudge

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN2_5_VL_7B))
    assert sum(p.numel() for p in model.parameters()) == VLMJudge.parameters == 8_292_166_656
