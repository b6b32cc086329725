"""The documentation's promises that a build alone does not check (``make docs`` builds the site with --strict).

Every "DESIGN N" that the code cites is a section of docs/design.md; nothing points outside the repository (a
clone has no ``../shared``); every config field has a description for the generated reference; the README stays
short and its links land on pages that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel

from solrl.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
#: "DESIGN 2", "DESIGN glossary": a citation of docs/design.md's section 2 or its glossary.
CITATION = re.compile(r"DESIGN(?:\.md)?\s*(?:§\s*)?(\d+|glossary)?")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json", ""}
    files = [REPO / name for name in names.splitlines() if Path(name).suffix in suffixes]
    return [f for f in files if f.is_file() and f.stat().st_size < 2_000_000]


def test_every_design_citation_names_a_section_that_exists():
    headings = re.findall(r"^## (\d+)\. ", (REPO / "docs" / "design.md").read_text(), re.M)
    sections = set(headings) | ({"glossary"} if "\n## Glossary" in (REPO / "docs" / "design.md").read_text() else set())
    cited, unnumbered = {}, []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve() or (path.parent.name == "docs" and path.name == "design.md"):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in CITATION.finditer(line):
                where = f"{path.relative_to(REPO)}:{lineno}"
                if match.group(1) is None:
                    unnumbered.append(where)
                else:
                    cited.setdefault(match.group(1), []).append(where)
    assert cited, "no DESIGN citation found: the pattern is wrong"
    assert not unnumbered, f"DESIGN cited without a section (write 'DESIGN N'): {unnumbered}"
    missing = {section: places for section, places in cited.items() if section not in sections}
    assert not missing, f"cited sections missing from docs/design.md (it has {sorted(sections)}): {missing}"


def test_nothing_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|shared/(?:DESIGN|PAPER|STYLE)\.md")
    found = [
        f"{path.relative_to(REPO)}:{lineno}"
        for path in _tracked_text_files()
        if path != Path(__file__).resolve()
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, f"references to ../shared, which a clone does not have: {found}"


def test_every_config_field_is_described_for_the_reference():
    undescribed = []
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            undescribed += [f"{name}.{key}" for key, sub in section.model_fields.items() if not sub.description]
        elif not field.description:
            undescribed.append(name)
    assert not undescribed, f"config fields without a description (docs/reference/config.md shows none): {undescribed}"


def test_the_readme_is_short_and_its_links_land():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links to no page of the docs"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_reward_plugin_example_registers_and_scores():
    """docs/extending/reward.md's example, as written, is a working reward (registered under a test-only name, so
    the registry of this process is left as it was)."""
    import numpy as np

    from solrl.registry import REWARDS

    page = (REPO / "docs" / "extending" / "reward.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "register_reward" in b]
    name = "docs-example-brightness"
    namespace: dict[str, object] = {}
    try:
        exec(compile(snippet.replace('"brightness"', f'"{name}"'), "reward.md", "exec"), namespace)
        reward = REWARDS.get(name)()
        images = np.zeros((3, 8, 8, 3), dtype=np.uint8)
        images[1] = 255
        images[2, :4] = 255
        scores = reward(images, ["a", "b", "c"])
        assert scores.dtype == np.float32 and np.allclose(scores, [0.0, 1.0, 0.5])
    finally:
        REWARDS._entries.pop(name, None)


def test_the_loss_skeleton_runs_and_two_processes_share_its_micro_batch_as_one():
    """docs/extending/loss.md's skeleton, registered as written: its loss over a micro-batch is the mean of its two
    halves' (the ``part`` each process of a 2-process update computes), from the same draws."""
    import torch

    from solrl.config import load_config
    from solrl.registry import LOSSES
    from solrl.stages.losses import Batch
    from solrl.stages.models import load_model
    from solrl.stages.models.policy import Policy

    snippet = re.search(
        r"```python\n(# my_package/my_loss.py\n.*?)```", (REPO / "docs/extending/loss.md").read_text(), re.S
    )
    namespace: dict = {}
    exec(compile(snippet.group(1), "loss.md", "exec"), namespace)
    try:
        loss_cls = LOSSES.get("my_loss")
        cfg = load_config(None, ["train.loss=my_loss", "train.loss_options={temperature: 0.5}"])
        policy = Policy(load_model(cfg.model, torch.device("cpu")), rank=4, alpha=4.0, seed=0)
        torch.manual_seed(0)
        batch = Batch(
            x0=torch.randn(4, *policy.model.latent_shape),
            advantages=torch.randn(4),
            cond=policy.model.encode(["a handwritten digit three"] * 4),
            sigmas=policy.model.sigmas(4),
            trajectory=None,
            old_log_probs=None,
            sde_steps=[False] * 4,
        )
        mb = slice(0, 4)

        def loss(part):
            return loss_cls.terms(policy, batch, 1, mb, torch.Generator().manual_seed(7), cfg, part)[0]

        whole, first, second = loss(None), loss(slice(0, 2)), loss(slice(2, 4))
        assert whole.requires_grad and torch.allclose(whole, (first + second) / 2, rtol=1e-5)
        assert loss(slice(2, 2)) is None
    finally:
        LOSSES._entries.pop("my_loss", None)


def test_the_extending_page_names_every_built_in_plugin():
    """docs/extending/index.md's table lists each registry's built-in names, no more and no fewer: they are filled in
    from the registries when the site is built (docs/hooks.py), so a new built-in needs no edit there."""
    import importlib.util

    from solrl.registry import EXPLORE_BACKENDS, LOSSES, MODELS, REWARDS

    spec = importlib.util.spec_from_file_location("solrl_docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.built_ins((REPO / "docs" / "extending" / "index.md").read_text())
    rows = {cells[1]: cells[4] for cells in (line.split("|") for line in page.splitlines() if line.startswith("| `"))}
    for point, registry in [
        (" `model.family` ", MODELS),
        (" `reward.weights`, `reward.evaluate` ", REWARDS),
        (" `explore.precision` ", EXPLORE_BACKENDS),
        (" `train.loss` ", LOSSES),
    ]:
        listed = set(re.findall(r"`([^`]+)`", rows[point].split("(")[0]))
        assert listed == set(registry.index()), (point, listed ^ set(registry.index()))
    with pytest.raises(ValueError, match="built-in markers"):
        hooks.built_ins("| `train.loss` | <!-- built-ins: train.losses --> |")


def test_the_configuration_guide_extends_example_loads_as_it_says(tmp_path: Path):
    from solrl.config import load_config

    page = (REPO / "docs" / "guides" / "configuration.md").read_text()
    (snippet,) = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "extends:" in b]
    (tmp_path / "my-flux.yaml").write_text(snippet)
    cfg, base = load_config(tmp_path / "my-flux.yaml", plugins=False), load_config("flux1-dev", plugins=False)
    assert (cfg.name, cfg.explore.pool_size, cfg.select.k) == ("my-flux", 64, 16)
    assert cfg.explore.steps == base.explore.steps and cfg.model == base.model  # the rest is flux1-dev's
    assert cfg.reward.weights == {"hpsv2": 1.0}


def test_the_rewards_page_instances_example_is_a_valid_config():
    import json

    import yaml

    from solrl.config import load_config

    page = (REPO / "docs" / "rewards.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.S) if "{type:" in b]
    reward = yaml.safe_load(block)["reward"]
    cfg = load_config("tiny-digits", [f"reward.{key}={json.dumps(value)}" for key, value in reward.items()])
    assert [cfg.reward.type_of(n) for n in cfg.reward.evaluate] == ["pickscore", "pickscore", "jpeg_compressibility"]
    assert cfg.reward.options_of("jpeg_q10") == {"quality": 10}


def test_make_docs_builds_strict_and_loud():
    """``mkdocs build --strict --quiet`` passes whatever the warnings: --quiet keeps them from MkDocs' strict
    counter (MkDocs 1.6), so a broken link passed ``make docs`` until an adversarial review noticed."""
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert "mkdocs build --strict" in recipe
    assert not re.search(r"mkdocs build[^\n]*(?:\s-q\b|--quiet)", recipe)
