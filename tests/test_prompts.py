"""Prompt sets: plain text and JSONL with metadata, the fixed train/evaluation split, metadata to the rewards."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from solrl.config import ConfigError, load_config
from solrl.prompts import read_prompt_set, split
from solrl.registry import register_reward
from solrl.stages.rewards.base import Metadata, Reward


def test_jsonl_prompts_carry_their_metadata_and_the_shipped_sets_parse():
    geneval = read_prompt_set(Path("configs/prompts/geneval.jsonl"), "f")
    assert len(geneval.prompts) == 2212 and geneval.prompts[0] == "a photo of two wine glasses"
    assert geneval.metadata[0] == {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
    }
    ocr = read_prompt_set(Path("configs/prompts/ocr.txt"), "f")
    assert len(ocr.prompts) == 1018 and '"Spring Collection 2024"' in ocr.prompts[0] and not ocr.has_metadata()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"prompt": "a cat"}\nnot json\n', "line 2 is not JSON"),
        ('{"text": "no prompt key"}\n', 'line 1 has no "prompt" string'),
        ('["a list"]\n', 'line 1 has no "prompt" string \\(a .jsonl prompt file is JSON Lines'),
        ("# only a comment\n\n", "holds no prompt"),
    ],
)
def test_a_malformed_jsonl_file_is_refused_naming_the_line(tmp_path: Path, text: str, match: str):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"campaign.prompts_file={path}"]).prompt_sets()


def test_the_split_is_fixed_by_prompt_whatever_the_file_order(tmp_path: Path):
    prompts = read_prompt_set(Path("configs/prompts/ocr.txt"), "f")
    train, evaluation = split(prompts, 0.1, "f")
    assert set(train.prompts).isdisjoint(evaluation.prompts)
    assert 0.06 < len(evaluation.prompts) / len(prompts.prompts) < 0.14
    reversed_file = tmp_path / "reversed.txt"
    reversed_file.write_text("\n".join(reversed(prompts.prompts)) + "\n")
    cfg = load_config(
        None,
        [
            f"campaign.prompts_file={reversed_file}",
            "campaign.eval_prompts_file=null",
            "reward.weights={jpeg_compressibility: 1.0}",
            "reward.evaluate=[jpeg_compressibility]",
        ],
    )
    again_train, again_eval = cfg.prompt_sets()
    assert sorted(again_eval.prompts) == sorted(evaluation.prompts)
    assert sorted(again_train.prompts) == sorted(train.prompts)
    with pytest.raises(ConfigError, match="leaves an empty side"):
        load_config(
            None,
            [
                "campaign.prompts_file=prompts/tiny-digits-eval.txt",
                "campaign.eval_prompts_file=null",
                "campaign.eval_fraction=0.001",
            ],
        ).prompt_sets()


SEEN: list[dict] = []


@register_reward("metadata_probe")
class MetadataProbe(Reward):
    """Test-only: scores each image by its metadata's ``count`` and records what it received."""

    name = "metadata_probe"

    def _score(self, images: np.ndarray, prompts: Sequence[str], metadata: Metadata) -> np.ndarray:
        assert metadata is not None
        SEEN.extend({"prompt": p, **m} for p, m in zip(prompts, metadata))
        return np.asarray([m["count"] for m in metadata], np.float32)


def test_the_rewards_receive_each_images_prompt_metadata(tmp_path: Path):
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.artifacts import ExploreRewards
    from solrl.storage.runs import create_run

    digits = ["zero", "one", "two", "three", "four"]
    path = tmp_path / "digits.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the digit {d}", "count": i}) + "\n" for i, d in enumerate(digits)))
    cfg = tiny_config(tmp_path / "store", f"campaign.prompts_file={path}", "reward.weights={metadata_probe: 1.0}")
    run = create_run(cfg, "metadata")
    ctx = StageContext(cfg, run.run_dir, run.run_id, 1)
    SEEN.clear()
    for stage in ("explore", "score_explore"):
        run_stage(ctx, stage)
    assert SEEN and all(item["prompt"] == f"the digit {digits[item['count']]}" for item in SEEN)
    table = ExploreRewards.load(run.run_dir, 1).frame
    expected = [digits.index(p.rsplit(" ", 1)[1]) for p in table["prompt"]]
    np.testing.assert_array_equal(table["value"].to_numpy(), expected)


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path: Path):
    """A file saved by a Windows editor starts with U+FEFF; it was stored as the first prompt's first letter."""
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffa hand drawn zero\na hand drawn three\n".encode())
    assert read_prompt_set(path, "campaign.prompts_file").prompts == ["a hand drawn zero", "a hand drawn three"]


def test_lines_end_at_newlines_only_and_json_lines_are_read_by_any_of_their_names(tmp_path: Path):
    """A breaker's findings: str.splitlines() also broke a prompt at U+2028, U+0085 or a form feed (10 prompts
    read as 20), and refused valid JSONL holding one; a .json or .JSONL file was read as text, its metadata
    stored as prompt text."""
    text = tmp_path / "p.txt"
    text.write_bytes("a sign reading\u2028OPEN\r\nline two\x0cstill two\rthree\n".encode())
    assert read_prompt_set(text, "f").prompts == ["a sign reading\u2028OPEN", "line two\x0cstill two", "three"]
    record = {"prompt": "a sign reading\u2028OPEN", "text": "OPEN"}
    for name in ("p.jsonl", "p.JSONL", "p.json", "p.ndjson"):
        path = tmp_path / name
        path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
        found = read_prompt_set(path, "f")
        assert found.prompts == [record["prompt"]] and found.metadata == [{"text": "OPEN"}], name
    disguised = tmp_path / "prompts.txt"
    disguised.write_text(json.dumps(record) + "\n")
    with pytest.raises(
        ConfigError, match=r"holds JSON Lines .* under a name read as plain text; name it prompts.jsonl"
    ):
        load_config(None, [f"campaign.prompts_file={disguised}"]).prompt_sets()


def test_a_prompt_of_megabytes_is_drawn_cut_in_the_best_worst_grid(tmp_path: Path):
    """select drew each prompt whole as its row's label, and PIL refuses text over about a million characters: a
    run with such a prompt failed at select on every resume."""
    from PIL import Image

    from solrl.stages.metrics.grid import MAX_LABEL, save_grid

    images = np.zeros((2, 2, 8, 8, 3), np.uint8)
    save_grid(images, tmp_path / "grid.png", row_labels=["a hand drawn zero " + "x" * 2_000_000, "short"])
    short = tmp_path / "short.png"
    save_grid(images, short, row_labels=["a hand drawn zero " + "x" * (MAX_LABEL - 19), "short"])
    assert Image.open(tmp_path / "grid.png").width <= Image.open(short).width + 20


def test_fewer_training_prompts_than_an_iteration_draws_is_said_before_the_run(tmp_path: Path):
    """A breaker's finding: 3 prompts and 8 an iteration drew one prompt 3 times, another 5 and the third never,
    and nothing said so."""
    from typer.testing import CliRunner

    from solrl.cli import app

    path = tmp_path / "few.txt"
    path.write_text("a handwritten digit zero\na handwritten digit one\na handwritten digit two\n")
    overrides = [f"campaign.prompts_file={path}", f"storage.root={tmp_path / 'runs'}"]
    (warning,) = load_config(None, overrides).prompt_warnings()
    assert "campaign.prompts_per_iteration=8 but the training prompts number 3" in warning
    assert load_config(None, [*overrides, "campaign.prompts_per_iteration=3"]).prompt_warnings() == []
    planned = CliRunner().invoke(app, ["plan", *(w for o in overrides for w in ("--set", o)), "--gpu", "80"])
    assert planned.exit_code == 0 and f"solrl: warning: {warning}" in planned.stderr, planned.output
