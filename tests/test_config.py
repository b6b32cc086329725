"""Config loading: presets, overrides, and every error a user can make, each one line naming the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from solrl.config import ConfigError, RunConfig, list_presets, load_config, preset_dir, validate_config
from solrl.stages.runnable import check_runnable


def test_default_preset_is_tiny_digits_and_valid():
    cfg = load_config()
    assert cfg.name == "tiny-digits"
    assert "tiny-digits" in list_presets()
    assert cfg.explore.precision == "nvfp4_emulated"
    assert len(cfg.train_prompts()) >= cfg.campaign.prompts_per_iteration


def test_set_overrides_parse_yaml_values():
    cfg = load_config(None, ["explore.pool_size=64", "select.k=16", "train.global_std=false"])
    assert (cfg.explore.pool_size, cfg.select.k, cfg.train.global_std) == (64, 16, False)


def test_config_is_frozen_and_hash_changes_with_values():
    a, b = load_config(), load_config(None, ["train.lr=0.01"])
    with pytest.raises(ValidationError, match="frozen"):
        a.train.lr = 1.0  # type: ignore[misc]
    assert a.digest() != b.digest()
    assert a.digest() == load_config().digest()
    layout = load_config(None, ["train.launcher=ray", "train.workers=2", "campaign.task_runner=ray"])
    assert layout.digest() == a.digest()  # how the work is laid out is not part of the config hash


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["select.k=7"], r"select.k=7 must be even.*set select.k=8"),
        (["train.workers=2"], r"train.workers=2 counts Ray Train workers \(train.launcher=ray\)"),
        (
            ["train.launcher=ray", "train.nproc_per_node=2"],
            r"train.nproc_per_node=2 counts torchrun processes.*set train.workers=2",
        ),
        (["select.k=40"], r"select.k=40 exceeds explore.pool_size=32"),
        (["explore.precision=fp3"], r"explore.precision: unknown explore precision 'fp3'; registered: bf16, fp8,"),
        (
            ["explore.precision=nvfp5"],
            r"unknown explore precision 'nvfp5'; registered: .*; did you mean 'nvfp4'\? If not, a plug-in explore "
            r"precision is imported from SOLRL_PLUGINS or an installed package's solrl.plugins entry point$",
        ),
        (
            ["reward.weights={brightness: 1.0}"],
            r"unknown reward 'brightness'; .*; a plug-in reward is imported from SOLRL_PLUGINS or an installed",
        ),
        (
            ["reward.weights={hpsv2: 1.0}"],
            r"reward.models.hpsv2.checkpoint: Field required \(HPS_v2.1_compressed.pt .*\); published weights: "
            r"https://huggingface.co/xswu/HPSv2",
        ),
        (["model.family=sdxl"], r"model.family: unknown model family 'sdxl'; registered: .*tiny-digits"),
        (["train.loss=dpo"], r"train.loss: unknown loss 'dpo'; registered: flow_grpo, nft"),
        (
            ["model.family=sana", "model.source=tiny", "model.resolution=33"],
            r"model.resolution=33 must be a multiple of 2 for tiny-sana",
        ),
        (["model.family=sana", "model.resolution=1000"], r"model.resolution=1000 must be a multiple of 32 for sana"),
        (
            ["model.family=flux", "model.source=tiny", "model.max_sequence_length=100000"],
            r"exceeds the 512 tokens tiny-flux's text",
        ),
        (["model.source=tiny"], r"model.source=tiny: model family tiny-digits has no tiny twin; set model.source=weig"),
        (["model.family=tiny-sd3"], r"'tiny-sd3' is a preset, not a family; its model is model.family=sd3 model.so"),
        (
            ["model.family=sd3", "model.source=tiny", "model.resolution=256"],
            r"model.resolution=256 is more than the 128 px tiny-sd3, the tiny twin \(model.source=tiny\), takes",
        ),
        (["explore.pool_sise=8"], r"explore.pool_sise: unknown key; known keys here: precision, steps, pool_size,"),
        (["bogus.key=1"], r"bogus: unknown key; known keys here: name, model, explore, select,"),
        (["extends=tiny-sd3"], r"extends is a preset file's key, read before any --set; .*\(solrl run tiny-sd3 --set"),
        (["explore.steps=0"], r"explore.steps: Input should be greater than or equal to 1"),
        (["train.timestep_fraction=1.5"], r"train.timestep_fraction: Input should be less than or equal to 1"),
        # a breaker's finding: 10^8 iterations were accepted, and the run hung planning them
        (["campaign.iterations=100000000"], r"campaign.iterations: Input should be less than or equal to 100000"),
        (
            ["reward.weights={clip_score: 1.0}"],
            r"reward.weights: unknown reward 'clip_score'; registered: aesthetic, clipscore, digit_alignment",
        ),
        (["reward.evaluate=[aesthetics]"], r"reward.evaluate: unknown reward 'aesthetics'"),
        (["train.loss=flow_grpo", "regenerate.steps=1"], r"regenerate.steps >= 2.*set regenerate.steps=10"),
        (["explore.pool_size"], r"expected section.key=value"),
        (["train.loss=flow_grpo", "regenerate.noise_level=0"], r"needs an SDE sampler.*set regenerate.noise_level=0.7"),
        (["train.loss=flow_grpo", "regenerate.enabled=false"], r"explore.steps=6 must equal regenerate.steps=10"),
        (["train.lr=.inf"], r"train.lr: Input should be a finite number"),
        (
            ["reward.weights={digit_alignment: .nan}"],
            r"reward.weights.digit_alignment: Input should be a finite number",
        ),
        (["train.betas=[2, 3]"], r"train.betas=\[2.0, 3.0\] must both be in \[0, 1\)"),
        (["explore.steps=yes"], r"explore.steps: expected a number but got True: YAML reads true/false/yes/no/on/off"),
        (
            ["reward.weights={digit_alignment: on}"],
            r"reward.weights: expected a number but got \{'digit_alignment': True\}",
        ),
        (["fidelity.min_spearman=off"], r"fidelity.min_spearman: expected a number.*or null where the key allows it"),
        (["campaign.on_guard=off"], r"campaign.on_guard: expected a name but got False: .*quotes \(one of 'warn', 'st"),
        (  # no shell quoting suggested: 'off' is no precision either
            ["explore.precision=off"],
            r"explore.precision: expected a name but got False: YAML reads .* in quotes \(one of 'bf16', .*'nvfp4_em"
            r"ulated', .*\)$",
        ),
        (["model.family=no"], r"model.family: expected a name .* \(one of .*'flux', .*'sd3', .*\)$"),
        (["tracking.experiment=yes"], r"tracking.experiment: .*--set \"tracking.experiment='yes'\"$"),  # any name
        (
            ["train.stat_min_count=40"],
            r"train.stat_min_count=40 exceeds train.stat_buffer=32.*set train.stat_min_count <= 32",
        ),
        (["train.advantage_stats=history"], r"train.advantage_stats: Input should be 'group' or 'per_prompt'"),
        (["train.loss=flow_grpo", "train.loss_options={clip_range: 0}"], r"clip_range: Input should be greater than 0"),
        (["train.timestep_fraction=0"], r"train.timestep_fraction: Input should be greater than 0"),
        (["regenerate.sde_window=[3, 2]"], r"regenerate.sde_window=\[3, 2\] must satisfy 0 <= start < end <= "),
        (["regenerate.sde_window=[0, 10]"], r"end <= regenerate.steps - 1 = 9"),
        # Settings the family or the loss ignores: refused, not taken into the config hash.
        (["regenerate.sde_window=[0, 3]"], r"train.loss=nft samples with the ODE .* remove it \(it applies to a loss"),
        (["model.guidance=3.5"], r"model.guidance=3.5: the tiny-digits family's transformer embeds no guidance"),
        (["model.family=chroma", "model.guidance=4"], r"model.guidance=4: the chroma family's transformer embeds no"),
        (["model.max_sequence_length=64"], r"tiny-digits' text encoder reads 6 tokens, always; remove it"),
    ],
)
def test_bad_overrides_raise_one_line_config_error(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_unknown_preset_lists_presets_and_names_the_nearest():
    with pytest.raises(ConfigError, match="no preset or file named 'nope'; presets: .*tiny-digits"):
        load_config("nope")
    with pytest.raises(ConfigError, match="'tiny-digit'; did you mean 'tiny-digits'\\? presets: "):  # a user's typo
        load_config("tiny-digit")


def test_malformed_yaml_names_the_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("explore:\n  pool_size: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line 3: expected ',' or ']', but got '<stream end>'"):
        load_config(path)


def test_a_stored_run_with_a_setting_now_refused_for_new_runs_still_validates():
    """A breaker's finding: a run begun with model.guidance=3.5 on tiny-digits (accepted then) could not be
    resumed once new runs refused it, and the fix it gave (remove it) would break run.json's hash."""
    data = load_config(None).model_dump(mode="json")
    data["model"]["guidance"] = 3.5
    data["regenerate"]["sde_window"] = [0, 3]
    assert validate_config(data).model.guidance == 3.5  # what resume and check_runnable read
    with pytest.raises(ConfigError, match="model.guidance=3.5"):
        load_config(None, ["model.guidance=3.5"])


def test_yaml_merge_keys_merge_and_the_mapping_own_keys_override_them(tmp_path: Path):
    """A breaker's finding: ``<<: *anchor`` was refused ("not valid YAML at line 5", and no reason)."""
    path = tmp_path / "anchors.yaml"
    path.write_text("explore: &fast {steps: 4, batch_size: 8}\nregenerate: {<<: *fast, steps: 6}\n")
    cfg = load_config(path)
    assert (cfg.explore.steps, cfg.explore.batch_size) == (4, 8)
    assert (cfg.regenerate.steps, cfg.regenerate.batch_size) == (6, 8)
    path.write_text("explore: {<<: {steps: 4}, steps: 5, steps: 6}\n")  # its own keys still given once
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("extends: tiny-digits\nexplore:\n  pool_size: 8\n  pool_size: 16\n", 4, "pool_size"),
        ("explore: {pool_size: 8}\nselect: {k: 4}\nexplore: {steps: 3}\n", 3, "explore"),
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path: Path, text: str, line: int, key: str):
    """PyYAML keeps the last of two equal keys silently: the run used a value its author may not have meant."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"not valid YAML at line {line}: duplicate key '{key}'$"):
        load_config(path)


def test_non_mapping_yaml(tmp_path: Path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(path)


def test_relative_prompt_files_resolve_against_the_preset(tmp_path: Path):
    (tmp_path / "p.txt").write_text("a handwritten digit four\n")
    (tmp_path / "run.yaml").write_text("campaign:\n  prompts_file: p.txt\n  prompts_per_iteration: 1\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.train_prompts() == ["a handwritten digit four"]


def test_a_relative_prompt_file_given_with_set_is_first_the_one_in_the_current_folder(tmp_path: Path, monkeypatch):
    """A breaker's finding: ``--set campaign.prompts_file=mine/p.txt`` looked in the preset's folder and the
    shipped presets only, so the file beside the user was not found (or a shipped one of that name was used)."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "tiny-digits.txt").write_text("a handwritten digit seven\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["campaign.prompts_file=prompts/tiny-digits.txt", "campaign.prompts_per_iteration=1"])
    assert cfg.campaign.prompts_file == str(tmp_path / "prompts" / "tiny-digits.txt")
    assert cfg.train_prompts() == ["a handwritten digit seven"]
    shipped = load_config(None, ["campaign.prompts_file=prompts/ocr.txt"])  # not here: the preset's, then shipped
    assert shipped.campaign.prompts_file == "prompts/ocr.txt" and len(shipped.prompt_sets()[0].prompts) > 100


def test_config_round_trips_through_json():
    cfg = load_config()
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.digest() == cfg.digest()


def runnable(*overrides: str) -> None:
    check_runnable(load_config(None, list(overrides)))


def test_the_default_preset_runs_here():
    runnable()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model.path=/nonexistent"],
            r"model.path: /nonexistent/transformer/config.json is missing \(tiny-digits "
            r"weights\); weights: shipped with solrl; rebuild with",
        ),
        (["campaign.prompts_file=/nonexistent/prompts.txt"], r"campaign.prompts_file: cannot read prompt file"),
        (  # a relative name: every place it was looked for
            ["campaign.eval_prompts_file=mine.txt"],
            r"campaign.eval_prompts_file: no prompt file 'mine.txt': looked for beside the preset and among solrl's "
            r"shipped ones \(/\S*/configs/mine.txt\); a path given with --set is first looked for in the current "
            r"folder \(/\S*/mine.txt\)$",
        ),
    ],
)
def test_what_this_machine_lacks_is_refused_where_work_starts_not_at_load(overrides, match):
    cfg = load_config(None, overrides)  # the schema is pure: valid anywhere
    with pytest.raises(ConfigError, match=match):
        check_runnable(cfg)


def test_empty_prompt_file(tmp_path: Path):
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        runnable(f"campaign.prompts_file={tmp_path / 'empty.txt'}")


def test_unreadable_prompt_file(tmp_path: Path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="cannot read prompt file"):
        runnable(f"campaign.eval_prompts_file={path}")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("precision", ["nvfp4", "fp8", "torchao_fp8", "torchao_nvfp4"])
def test_hardware_precision_without_the_hardware_is_valid_but_refused_where_work_starts(precision):
    cfg = load_config(None, [f"explore.precision={precision}"])
    need = "10.0, Blackwell" if "nvfp4" in precision else "8.9, Ada, Hopper or Blackwell"
    library = "torchao" if precision.startswith("torchao") else "Transformer Engine"
    with pytest.raises(ConfigError) as refused:
        check_runnable(cfg)
    assert str(refused.value) == (  # what the precision needs, and what runs here instead
        f"explore.precision={precision} cannot run here: this machine has no CUDA device ({precision} needs a GPU "
        f"of compute capability >= {need}, and {library}); this machine runs: bf16, fp8_emulated, nvfp4_emulated"
    )


def test_torchao_fp8_of_float32_weights_is_refused_when_the_config_loads():
    """torchao's per-row FP8 asserts bf16 weights: a float32 policy would have crashed at the first explore."""
    with pytest.raises(ConfigError, match=r"explore.precision=torchao_fp8 quantizes bfloat16 weights only .* set "):
        load_config(None, ["explore.precision=torchao_fp8", "model.dtype=float32"])
    load_config(None, ["explore.precision=torchao_fp8", "model.dtype=bfloat16"])
    load_config(None, ["explore.precision=torchao_nvfp4", "model.dtype=float32"])  # NVFP4Tensor takes float32


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_is_valid_but_refused_where_work_starts():
    cfg = load_config(None, ["model.device=cuda"])
    with pytest.raises(ConfigError, match="model.device=cuda but torch sees no CUDA device"):
        check_runnable(cfg)


def test_prompts_that_name_no_digit_are_refused_where_work_starts_when_a_digit_reward_is_used(tmp_path: Path):
    (tmp_path / "cats.txt").write_text("a handwritten digit two\ndraw a cat\n")
    with pytest.raises(ConfigError, match="prompt 'draw a cat' names no digit, which reward digit_alignment needs"):
        runnable(f"campaign.prompts_file={tmp_path / 'cats.txt'}")
    runnable(
        f"campaign.prompts_file={tmp_path / 'cats.txt'}",
        "reward.weights={jpeg_compressibility: 1.0}",
        "reward.evaluate=[jpeg_compressibility]",
    )


def test_a_plugin_registers_under_its_name_and_the_schema_accepts_it():
    from solrl.registry import LOSSES
    from solrl.stages.losses.nft import NFT

    assert "nft" in LOSSES and LOSSES.get("nft") is NFT
    with pytest.raises(ValueError, match="loss 'nft' is already registered"):
        LOSSES.register("nft")(type("Other", (NFT,), {}))


def test_a_loss_plugin_without_terms_is_refused_with_the_config_not_at_its_first_update(monkeypatch):
    """A plug-in loss that defines ``trainable_steps`` but not ``terms`` ran explore to score_regenerate and
    failed at update with an empty ``NotImplementedError``; the config now names the missing method."""
    from solrl.registry import LOSSES
    from solrl.stages.losses.base import PolicyLoss
    from solrl.stages.losses.nft import NFT

    class NoTerms(PolicyLoss):
        name = "noterms"

        @classmethod
        def trainable_steps(cls, batch):
            return [0]

    monkeypatch.setitem(LOSSES._entries, "noterms", NoTerms)  # as register_loss("noterms") does, undone after
    assert NFT.missing() == [] and NoTerms.missing() == ["terms"]
    with pytest.raises(ConfigError, match=r"^invalid config: train.loss=noterms: .*NoTerms does not define terms, "):
        load_config("tiny-digits", ["train.loss=noterms"])


def test_a_plugin_whose_name_attribute_is_not_its_registered_name_is_refused(monkeypatch):
    """reward.md said ``name`` is what the tables use; they use the registered name, and a run with
    ``register_reward("misnamed")`` and ``name = "something_else"`` went through, its messages naming the other."""
    from solrl.registry import REWARDS
    from solrl.stages.rewards import Reward

    class Misnamed(Reward):
        name = "something_else"
        parameters = 0

    monkeypatch.setitem(REWARDS._entries, "misnamed", Misnamed)
    message = "reward 'misnamed' is registered as 'misnamed' but its class says name = 'something_else'; give both"
    with pytest.raises(ConfigError, match=f"^invalid config: reward.evaluate: {message}"):
        load_config("tiny-digits", ["reward.evaluate=[misnamed]"])


def test_registries_list_and_declare_the_builtin_plugins_without_importing_them():
    """Issue 37: listing a registry and reading a family's published weights imports no plug-in, nor torch."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom solrl.registry import EXPLORE_BACKENDS, LOSSES, MODELS, REWARDS\n"
        "from solrl.weights import published_weights\n"
        "names = [len(r.names()) for r in (MODELS, REWARDS, EXPLORE_BACKENDS, LOSSES)]\n"
        "hub = published_weights('sd3', '/w/stable-diffusion-3.5-medium').hub_id\n"
        "print(names, hub, published_weights('tiny-digits', None), 'torch' in sys.modules,\n"
        "      sorted(m for m in sys.modules if m.startswith('solrl.stages.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out[-4:] == ["stabilityai/stable-diffusion-3.5-medium", "None", "False", "[]"], out


def test_a_registry_scans_once_across_threads_and_retries_cpythons_spurious_ast_error(monkeypatch):
    """A served campaign's flow run failed with CPython 3.11's ``SystemError: AST constructor recursion depth
    mismatch (before=66, after=75)`` from ``LOSSES.index()``'s ``ast.parse``, raised when another thread parses at
    the same moment (python/cpython#106905). The scan parses under one lock and retries that error; another
    SystemError, or the same one three times in a row, is raised."""
    import ast
    import threading

    from solrl import registry

    calls, real = [], ast.parse

    def flaky(source, filename="<unknown>", *args, **kwargs):
        calls.append(filename)
        if len(calls) == 1:  # as seen: the first parse of the scan
            raise SystemError("AST constructor recursion depth mismatch (before=66, after=75)")
        return real(source, filename, *args, **kwargs)

    monkeypatch.setattr(registry.ast, "parse", flaky)
    fresh = registry.Registry("loss", "solrl.stages.losses", "register_loss")
    indexes: list = []
    threads = [threading.Thread(target=lambda: indexes.append(fresh.index())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {"nft", "flow_grpo"} <= set(indexes[0]) and all(index is indexes[0] for index in indexes)
    files = len(list(Path(registry.__file__).parents[1].joinpath("stages", "losses").glob("*.py")))
    assert len(calls) == files + 1  # one scan for the four threads, its first file parsed twice

    def broken(source, filename="<unknown>", *args, **kwargs):
        raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")

    monkeypatch.setattr(registry.ast, "parse", broken)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        registry.Registry("loss", "solrl.stages.losses", "register_loss").index()
    monkeypatch.setattr(registry.ast, "parse", lambda *a, **k: (_ for _ in ()).throw(SystemError("other")))
    with pytest.raises(SystemError, match="other"):
        registry.Registry("loss", "solrl.stages.losses", "register_loss").index()


def test_the_schema_takes_its_plugin_defaults_from_the_default_preset():
    """The schema names no plug-in: the defaults that name one (and the shipped prompt files) are read from the
    default preset, ``configs.DEFAULT``, so a config built from the schema alone runs its plug-ins."""
    from solrl.configs import DEFAULT

    cfg, preset = RunConfig(), load_config()
    assert cfg.name == preset.name == DEFAULT
    for section, key in [
        ("model", "family"),
        ("explore", "precision"),
        ("train", "loss"),
        ("reward", "weights"),
        ("reward", "evaluate"),
        ("campaign", "prompts_file"),
        ("campaign", "eval_prompts_file"),
    ]:
        assert getattr(getattr(cfg, section), key) == getattr(getattr(preset, section), key), (section, key)
    cfg.reward.weights["another"] = 2.0  # a default is a copy: the next config's is untouched
    assert RunConfig().reward.weights == preset.reward.weights


def test_the_core_names_no_family_reward_loss_or_explore_backend():
    """Issue 37: the config schema, the memory plan, the stage pipeline and the flows name no registered plug-in
    in any string, so a plug-in is added or removed without an edit there. The one exception is ``bf16``: the
    precision of the BF16 policy itself (the method's "BF16 train"), which ``fidelity.on_low=bf16`` falls back
    to."""
    import ast
    import re

    from solrl.registry import EXPLORE_BACKENDS, LOSSES, MODELS, REWARDS

    names = {name for registry in (MODELS, REWARDS, LOSSES, EXPLORE_BACKENDS) for name in registry.names()}
    assert {"tiny-digits", "vlm_judge", "nft", "nvfp4_emulated"} <= names
    root = Path(__file__).resolve().parents[1]
    files = [root / "solrl/config.py", root / "stages/memory.py", root / "stages/pipeline.py"]
    found = []
    for path in [*files, *sorted((root / "flows").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words = {w.strip(".-") for w in re.findall(r"[\w.\-]+", node.value)}
                found += [f"{path.relative_to(root)}:{node.lineno} {w}" for w in sorted(words & names - {"bf16"})]
        comments = [line.partition("#")[2] for line in path.read_text().splitlines() if "#" in line]
        found += [
            f"{path.relative_to(root)} (a comment) {w}"
            for c in comments
            for w in re.findall(r"[\w\-]+", c)
            if w in names - {"bf16"}
        ]
    assert not found, found


def test_a_module_named_in_solrl_plugins_registers_and_a_broken_one_is_named(tmp_path: Path):
    """A plug-in module that is not installed (``SOLRL_PLUGINS``, on the path): imported before the first lookup,
    and before a commit calls the commit hooks, so a hook it installs is in place in a process the run starts."""
    import subprocess
    import sys

    (tmp_path / "my_plugin.py").write_text(
        "from solrl.registry import register_reward\n"
        "from solrl.stages.rewards.base import Reward\n"
        "from solrl.storage.stage import commit_hooks\n\n"
        "@register_reward('plugin_brightness')\n"
        "class Brightness(Reward):\n"
        "    name = 'plugin_brightness'\n\n"
        "commit_hooks.append(lambda iteration, stage, point: print('hook', iteration, stage, point))\n"
    )
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('no such thing')\n")
    script = (
        "from solrl.storage.stage import commit_point\n"
        "commit_point('write', (3, 'explore'))\n"
        "from solrl.registry import REWARDS\n"
        "print('plugin_brightness' in REWARDS.names())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SOLRL_PLUGINS": "my_plugin"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.stdout.split("\n")[:2] == ["hook 3 explore write", "True"], done.stderr[-2000:]
    # `solrl plugins` lists it with where it comes from, beside the built-in ones
    listed = subprocess.run([sys.executable, "-m", "solrl.cli", "plugins"], env=env, capture_output=True, text=True)
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert listed.returncode == 0 and ["reward", "plugin_brightness", "my_plugin", "(plug-in)"] in rows, listed.stdout
    assert ["loss", "nft", "solrl.stages.losses.nft"] in rows and [
        "model",
        "family",
        "sana",
        "solrl.stages.models.sana",
    ] in rows
    env["SOLRL_PLUGINS"] = "my_plugin, broken_plugin"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "plug-in module broken_plugin (SOLRL_PLUGINS) failed to import: ImportError: no such thing" in done.stderr
    # A command says it in one line, exit 2, whether or not the config names the plug-in (it was a traceback, exit 1).
    done = subprocess.run(
        [sys.executable, "-m", "solrl.cli", "plan", "tiny-digits"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr == (
        "solrl: error: plug-in module broken_plugin (SOLRL_PLUGINS) failed to import: ImportError: no such thing; "
        "fix it, or remove it from SOLRL_PLUGINS\n"
    )


def test_a_module_registers_by_being_in_the_package_and_is_imported_when_its_name_is_used(tmp_path, monkeypatch):
    import sys

    from solrl.registry import Registry

    package = tmp_path / "probe_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (tmp_path / "probe_registry.py").write_text(
        "from solrl.registry import Registry\nPROBES = Registry('probe', 'probe_plugins', 'register_probe')\n"
        "register_probe = PROBES.register\n"
    )
    (package / "fancy.py").write_text(
        "from probe_registry import register_probe\n"
        "@register_probe('fancy')\nclass Fancy:\n    hub_id = 'org/fancy'\n    size = 2 ** 3\n"
    )
    (package / "twice.py").write_text("@register_probe('fancy')\nclass Again: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Registry("probe", "probe_plugins", "register_other").names() == []
    with pytest.raises(ValueError, match="'fancy' is registered by probe_plugins.fancy and probe_plugins.twice"):
        Registry("probe", "probe_plugins", "register_probe").names()
    (package / "twice.py").unlink()
    from probe_registry import PROBES

    assert PROBES.names() == ["fancy"] and "probe_plugins.fancy" not in sys.modules
    assert PROBES.declared("fancy", "hub_id") == "org/fancy" and PROBES.declared("fancy", "size", 0) == 0  # no eval
    fancy = PROBES.get("fancy")  # imported now
    assert "probe_plugins.fancy" in sys.modules and fancy.__name__ == "Fancy"


def test_changed_by_names_only_the_overrides_that_would_change_a_stored_config(tmp_path: Path):
    """The input of the report: a retry of a run with 3 iterations, given campaign.iterations=3 again, logged
    ``ignored ['campaign.iterations=3']`` though nothing changed."""
    from solrl.config import changed_by

    stored = load_config("tiny-digits", ["campaign.iterations=3", f"storage.root={tmp_path}"])
    same = ["campaign.iterations=3", "train.lr=5.0e-4", f"storage.root={tmp_path}/../{tmp_path.name}"]
    assert changed_by(stored, same) == []
    assert changed_by(stored, ["campaign.iterations=4", *same, "explore.pool_size=16"]) == [
        "campaign.iterations=4",
        "explore.pool_size=16",
    ]
    with pytest.raises(ConfigError):
        changed_by(stored, ["campaign.iterations=zero"])


def test_a_preset_that_extends_another_is_its_flat_copy_with_the_same_hash(tmp_path: Path):
    """``extends``: sections inherited key by key, a key's value (even a mapping) replaced whole, two levels deep;
    the resolved config and its hash are those of the preset written out in full."""
    (tmp_path / "base.yaml").write_text(
        "name: base\nexplore: {pool_size: 16, steps: 4}\nselect: {k: 4}\n"
        "reward: {weights: {digit_alignment: 1.0, jpeg_compressibility: 0.5}}\n"
    )
    (tmp_path / "middle.yaml").write_text("extends: base.yaml\nname: middle\nexplore: {steps: 3}\n")
    (tmp_path / "child.yaml").write_text(
        "extends: middle.yaml\nname: child\nselect: {k: 8}\nreward: {weights: {digit_alignment: 1.0}}\n"
    )
    (tmp_path / "flat.yaml").write_text(
        "name: child\nexplore: {pool_size: 16, steps: 3}\nselect: {k: 8}\nreward: {weights: {digit_alignment: 1.0}}\n"
    )
    child, flat = load_config(tmp_path / "child.yaml"), load_config(tmp_path / "flat.yaml")
    assert (child.explore.pool_size, child.explore.steps, child.select.k) == (16, 3, 8)
    assert child.reward.weights == {"digit_alignment": 1.0}  # replaced, not merged with the base's
    assert child.model_dump() == flat.model_dump() and child.digest() == flat.digest()
    overridden = load_config(tmp_path / "child.yaml", ["explore.steps=5"])
    assert overridden.explore.steps == 5 and overridden.explore.pool_size == 16  # --set applies after extends


def test_a_tiny_twin_is_its_family_with_the_tiny_source_and_weights_keep_the_hash_they_had_before_the_field():
    """Issue 37: a tiny preset is its family with ``model.source: tiny``; ``model.source: weights`` is left out of
    the config hash (``UNHASHED_DEFAULTS``), so every config recorded before the field existed keeps its hash."""
    from solrl.config import config_digest
    from solrl.stages.models import model_family

    tiny, published = load_config("tiny-sd3"), load_config("sd35-medium")
    assert (tiny.model.family, tiny.model.source) == ("sd3", "tiny") and published.model.source == "weights"
    assert model_family(tiny.model).name == "tiny-sd3" and model_family(published.model).name == "sd3"
    assert issubclass(model_family(tiny.model), model_family(published.model))
    before = published.model_dump(mode="json")
    del before["model"]["source"]  # as a run recorded before model.source existed stored it
    assert config_digest(before) == published.digest()
    assert load_config("sd35-medium", ["model.source=tiny", "model.resolution=64"]).digest() != published.digest()


def test_a_run_recorded_before_model_source_keeps_its_prompt_cache_and_an_old_tiny_family_name_is_explained(
    tmp_path: Path,
):
    """The prompt-embedding cache is named by a digest of the model section: ``source: weights`` is left out of it as
    of the config hash, so a resumed run finds the embeddings it cached (a FLUX run would otherwise load T5-XXL
    again). A run recorded as ``model.family: tiny-sd3`` is told what that model is now, as a ConfigError (``solrl
    export`` reports ConfigErrors in one line)."""
    import hashlib

    from solrl.config import ModelConfig
    from solrl.stages.context import StageContext
    from solrl.stages.models import model_family

    cfg = load_config("sd35-medium", [f"storage.root={tmp_path}"])
    before = cfg.model.model_dump(mode="json", exclude={"device", "source"})  # as it was dumped before the field
    prompts, path = StageContext(cfg, tmp_path, "r", 1).prompt_embeddings()
    digest = hashlib.sha256(json.dumps([before, sorted(set(prompts))], sort_keys=True).encode()).hexdigest()[:16]
    assert path.name == f"sd3-{digest}.safetensors"
    with pytest.raises(ConfigError, match=r"'tiny-sd3' is a preset, not a family; its model is model.family=sd3 mo"):
        model_family(ModelConfig(family="tiny-sd3"))


def test_a_family_has_one_tiny_twin():
    """As ``register_model`` refuses a taken name, ``tiny_twin`` refuses a second twin of a family (a plug-in's
    subclass of ``TinyFlux`` would otherwise replace the twin every ``tiny-flux`` run builds)."""
    from typing import ClassVar

    from solrl.stages.models.adapter import tiny_twin
    from solrl.stages.models.flux import Flux, TinyFlux

    with pytest.raises(TypeError, match="flux already has a tiny twin, TinyFlux"):

        @tiny_twin
        class PatchedTinyFlux(TinyFlux):
            name: ClassVar[str] = "patched-tiny-flux"

    assert Flux.for_source("tiny") is TinyFlux


def test_a_published_preset_on_its_tiny_twin_builds_it_in_the_cache_and_never_in_a_real_weights_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``--set model.source=tiny`` on a published preset: its ``model.path`` is a hub id, the real checkpoint, which
    names no folder for the twin (it was built at ``./<org>/<name>`` once); a folder of other weights is refused."""
    from solrl.config import ConfigError
    from solrl.stages.models import model_family
    from solrl.stages.models.diffusers_family import TINY_MARKER, solrl_cache

    monkeypatch.chdir(tmp_path)
    cfg = load_config("sd35-medium", ["model.source=tiny", "model.resolution=64"])
    twin = model_family(cfg.model)
    assert cfg.model.path == "stabilityai/stable-diffusion-3.5-medium"
    assert twin.weights_dir(cfg.model) == solrl_cache() / "models" / "tiny-sd3-v1"
    real = tmp_path / "real"
    real.mkdir()
    (real / "model_index.json").write_text("{}")
    local = cfg.model.model_copy(update={"path": str(real)})
    with pytest.raises(ConfigError, match=r"model.path=.*/real holds a pipeline that is not a tiny twin solrl built"):
        twin.check_runnable(local)
    (real / TINY_MARKER).write_text("{}")
    twin.check_runnable(local)  # one it built: taken
    assert not list(tmp_path.glob("stabilityai*"))


def test_a_user_preset_extends_a_shipped_one_by_name(tmp_path: Path):
    (tmp_path / "mine.yaml").write_text("extends: sol-rl\nname: mine\ntrain: {lr: 1.0e-4}\n")
    mine, shipped = load_config(tmp_path / "mine.yaml"), load_config("sol-rl")
    assert mine.train.lr == 1.0e-4 and mine.train.kl_beta == shipped.train.kl_beta
    assert mine.train_prompts() == shipped.train_prompts()  # the shipped relative prompt files still resolve


def test_every_shipped_preset_that_extends_another_resolves_without_the_key():
    extending = [p for p in list_presets() if "\nextends:" in "\n" + (Path(preset_dir()) / f"{p}.yaml").read_text()]
    assert {"flux1-dev", "sd35-large", "tiny-flux", "sol-rl"} <= set(extending)
    for preset in extending:
        data = load_config(preset, plugins=False).model_dump(mode="json")
        assert "extends" not in data and data["name"] == preset


@pytest.mark.parametrize(
    ("files", "match"),
    [
        (
            {"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"},
            r"extends makes a cycle \(a.yaml -> b.yaml -> a.yaml\)",
        ),
        ({"a.yaml": "extends: a.yaml\n"}, r"extends makes a cycle \(a.yaml -> a.yaml\)"),
        ({"a.yaml": "extends: no-such-preset\n"}, r"extends 'no-such-preset': no preset or file named"),
        ({"a.yaml": "extends: [sol-rl]\n"}, r"extends must name a preset or a YAML path, got \['sol-rl'\]"),
        (
            {"a.yaml": "extends: b.yaml\n", "b.yaml": "- not a mapping\n"},
            r"a.yaml' extends 'b.yaml': .*b.yaml' must be a",
        ),
        ({"a.yaml": "extends: nope.yaml\n"}, r"a.yaml' extends 'nope.yaml': .*nope.yaml"),  # the extending file named
        ({"a.yaml": "extends: sol-rl\nmodle: {}\n"}, r"modle: unknown key; known keys here: name, .*, extends \("),
    ],
)
def test_a_bad_extends_is_one_line_naming_it(tmp_path: Path, files: dict[str, str], match: str):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(tmp_path / "a.yaml")


def test_loss_options_are_the_losses_own_resolved_and_an_old_config_is_migrated(tmp_path: Path):
    """Issue 37: ``train.loss_options`` is validated by the loss and stored resolved (one hash for none given and the
    defaults given); a run stored before it, with the options as ``train`` fields, opens with its recorded hash and
    its options read by the loss."""
    import json

    from solrl.config import config_digest
    from solrl.registry import LOSSES
    from solrl.storage.runs import create_run, open_run

    given = load_config("flow-grpo", ["train.loss_options={clip_range: 1.0e-4, grpo_guard: true}"])
    assert given.train.loss_options == {"clip_range": 1e-4, "grpo_guard": True}
    assert given.digest() == load_config("flow-grpo").digest()
    assert load_config("tiny-digits", ["train.loss_options={}"]).train.loss_options["decay_max"] == 0.5

    run = create_run(load_config("flow-grpo", [f"storage.root={tmp_path}"]), "old-grpo")
    data = json.loads((run.run_dir / "run.json").read_text())
    train = data["config"]["train"]
    options = train.pop("loss_options")
    train |= options | {"clip_range": 0.002, "beta": 1.0, "decay_rate": 0.001, "decay_max": 0.5}  # as stored then
    data["config_hash"] = config_digest(data["config"])
    (run.run_dir / "run.json").write_text(json.dumps(data))
    old = open_run(tmp_path, "old-grpo")
    assert old.config_hash == data["config_hash"] and not hasattr(old.config.train, "clip_range")
    loss = LOSSES.get("flow_grpo")
    assert loss.options(old.config.train) == loss.Options(clip_range=0.002, grpo_guard=True)
    with pytest.raises(ConfigError, match=r"train.loss_options.beta: unknown key"):
        load_config("flow-grpo", ["train.beta=2.0"])  # an old field set to a value the loss has no option for
