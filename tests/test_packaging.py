"""The top-level folders map onto one ``solrl`` namespace, in an editable install and in a plain wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_top_level_folders():
    import solrl.flows.sol_rl
    import solrl.stages.explore
    import solrl.storage.stage

    assert Path(solrl.stages.explore.__file__).parent == REPO / "stages"
    assert Path(solrl.storage.stage.__file__).parent == REPO / "storage"
    assert Path(solrl.flows.sol_rl.__file__).parent == REPO / "flows"


@pytest.mark.slow
def test_a_plain_wheel_holds_code_presets_and_weights_and_imports(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("solrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "solrl/flows/sol_rl.py",
        "solrl/stages/quant/nvfp4.py",
        "solrl/storage/stage.py",
        "solrl/configs/tiny-digits.yaml",
        "solrl/configs/prompts/tiny-digits-train.txt",
        "solrl/stages/models/weights/tiny-digits/transformer/diffusion_pytorch_model.safetensors",
        "solrl/stages/models/weights/tiny-digits/classifier.safetensors",
    ):
        assert needed in names, needed
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import solrl, solrl.flows.sol_rl, solrl.cli; from solrl.config import load_config; "
        "from solrl.stages.models import load_model; import torch; cfg = load_config(); "
        "load_model(cfg.model, torch.device('cpu')); print(solrl.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith(str(site))
