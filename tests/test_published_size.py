"""A family at its published width, in bfloat16 on CPU, through one iteration of the flow (issue 20).

``bench/published_size.py`` runs every family at its published width and resolution; this keeps one small case of
it in the suite: SD3.5-Medium's published transformer (1536 wide, 24 heads, its MMDiT-X block) cut to one block,
its published VAE (16 channels), at 64 px (the benchmark runs its published 512 px), in bfloat16 with
NVFP4-emulated explore, through the Prefect flow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "published_size.py"


@pytest.fixture(scope="module")
def row() -> dict:
    done = subprocess.run(
        [sys.executable, str(BENCH), "sd35-medium", "--one", "--blocks", "1", "--set", "model.resolution=64"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert done.returncode == 0 and found, done.stderr[-3000:]
    return json.loads(found[0])


def test_every_stage_of_the_iteration_commits_at_the_published_width_in_bf16(row):
    assert row["depth"] == {"num_layers": 1} and row["resolution"] == 64
    assert set(row["stages"]) >= {
        "evaluate[0]",
        "explore[1]",
        "score_explore[1]",
        "select[1]",
        "regenerate[1]",
        "score_regenerate[1]",
        "update[1]",
        "checkpoint[1]",
        "evaluate[1]",
    }
    # One MMDiT-X block of the published width: 1536 = 24 heads x 64.
    assert row["transformer_parameters"] > 80_000_000


def test_the_bf16_pool_images_decode_at_the_resolution_and_the_update_is_finite(row):
    assert row["pool"] == {"shape": [1, 2, 64, 64, 3], "dtype": "uint8"}
    assert row["weights_dtype"] == "torch.bfloat16" and row["explore_copy_dtype"] == "torch.bfloat16"
    assert row["lora_dtype"] == "torch.bfloat16"
    assert row["loss"] == row["loss"] and abs(row["loss"]) < 1e6 and row["grad_norm"] == row["grad_norm"]
    assert row["diffusers_lora_keys"] > 0
