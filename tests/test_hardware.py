"""The parts of the Transformer Engine explore backends that run without a GPU: the row padding around a
quantized GEMM, the one rule for which layers TE takes, and the version floor (issue 35)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from solrl.stages.quant.availability import te_reason
from solrl.stages.quant.hardware import TE_ROW_MULTIPLE, RowPadded, te_takes
from solrl.stages.quant.nvfp4 import FakeQuantLinear

# The shape classes TE refuses unpadded: FLUX's modulation Linears take [B, 3072]; SD3's 333 context tokens;
# a ragged last batch.
SHAPES = [(3072, 96), (64, 48)]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("k_n", SHAPES)
def test_zero_padded_rows_change_no_output_of_a_per_call_quantized_linear(fmt, k_n):
    """Zero rows move no amax: the padded call quantizes every real row exactly as the unpadded call does (bit
    for bit), and its output equals the unpadded one to float32 GEMM rounding (the CPU GEMM blocks by row count),
    for batches 1..9, 333 tokens and a ragged [5, 7, K] input."""
    from solrl.stages.quant.nvfp4 import fake_quantize_per_sample

    k, n = k_n
    torch.manual_seed(k)
    layer = FakeQuantLinear(nn.Linear(k, n), fmt, activation_scale="call")
    padded = RowPadded(layer, TE_ROW_MULTIPLE["nvfp4"])
    inputs = [torch.randn(b, k) for b in range(1, 10)] + [torch.randn(2, 333, k), torch.randn(5, 7, k)]
    for x in inputs:
        out = padded(x)
        assert out.shape == (*x.shape[:-1], n)
        rows = x.reshape(-1, k)
        zeros = rows.new_zeros((-rows.shape[0]) % TE_ROW_MULTIPLE["nvfp4"], k)
        quantized = fake_quantize_per_sample(torch.cat([rows, zeros])[None], fmt)[0]
        assert torch.equal(quantized[: rows.shape[0]], fake_quantize_per_sample(rows[None], fmt)[0])
        torch.testing.assert_close(out, layer(rows).reshape(out.shape), rtol=1e-5, atol=1e-5)


def test_a_padded_conv1x1_runs_channels_last():
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 48, 1)
    layer = FakeQuantLinear(nn.Linear(32, 48), "nvfp4", activation_scale="call", weight=conv.weight.view(48, 32))
    layer.bias = conv.bias
    x = torch.randn(3, 32, 5, 3)
    out = RowPadded(layer, 8, conv=True)(x)
    expect = layer(x.movedim(1, -1).reshape(-1, 32)).reshape(3, 5, 3, 48).movedim(-1, 1)
    assert out.shape == (3, 48, 5, 3)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


def test_the_one_rule_for_layers_transformer_engine_takes():
    assert te_takes(3072, 3072, "nvfp4") and te_takes(3072, 18432, "fp8")
    assert not te_takes(24, 64, "fp8")  # K % 16
    assert te_takes(48, 16, "fp8") and not te_takes(48, 16, "nvfp4")  # NVFP4 wants K and N % 32
    assert not te_takes(64, 12, "fp8")  # N % 8


def test_transformer_engine_older_than_2_9_is_refused_by_name():
    reason = te_reason(object(), "2.8.0", "fp8")
    assert reason is not None and "older than 2.9" in reason and "te.is_fp8_available" in reason


def test_te_weight_bytes_follow_te_storage_of_row_wise_quantized_weights():
    from solrl.stages.quant.hardware import te_weight_bytes

    # NVFP4: E2M1 data out * in / 2; E4M3 scales [round_up(out, 128), round_up(in / 16, 4)]; one FP32 amax.
    assert te_weight_bytes(3072, 3072, "nvfp4") == 3072 * 3072 // 2 + 3072 * 192 + 4
    assert te_weight_bytes(48, 16, "nvfp4") == 16 * 48 // 2 + 128 * 4 + 4
    assert te_weight_bytes(48, 16, "fp8") == 16 * 48 + 4  # one byte a weight and an FP32 scale_inv


def test_torchao_weight_bytes_and_the_layers_it_takes():
    from solrl.stages.quant.ao import ao_takes, ao_weight_bytes

    assert ao_weight_bytes(3072, 3072, "torchao_nvfp4") == 3072 * 3072 // 2 + 3072 * 192 + 4
    assert ao_weight_bytes(48, 16, "torchao_fp8") == 16 * 48 + 4 * 16  # an FP32 scale per output row
    assert ao_takes("blocks.0.ff", nn.Linear(48, 32), (), 0) and not ao_takes("blocks.0.ff", nn.Linear(48, 24), (), 0)
    assert not ao_takes("proj_out", nn.Linear(48, 32), ("proj_out",), 0)  # the skip rule
    assert not ao_takes("ff.conv", nn.Conv2d(48, 32, 1), (), 0)  # torchao quantizes Linears only


def test_a_torchao_fp8_copy_of_float32_weights_is_refused_before_torchao_asserts():
    """``ao_explore_copy`` checks the weights' dtype first (torchao's own check is an AssertionError deep inside
    ``quantize_``, and on this machine its hardware check would come first)."""
    from solrl.stages.quant.ao import ao_explore_copy

    net = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
    with pytest.raises(ValueError, match=r"torchao_fp8 quantizes bfloat16 weights only .* weights are float32"):
        ao_explore_copy(net, "torchao_fp8", (), 0)


def test_the_gpu_session_runs_every_step_and_the_smoke_script_says_why_a_check_did_not_run(tmp_path):
    """bench/gpu_session.sh, kept ready for a lent GPU, with SMOKE=1 on this machine: every step (the smoke script,
    both explore benchmarks, the memory plan) exits 0 and writes its table; each row of bench/gpu_smoke.py that needs
    a GPU or Transformer Engine gives the reason it did not run."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "SMOKE": "1", "PY": sys.executable, "WHEELS": str(tmp_path / "none")}
    env["TE_KIT"] = str(tmp_path / "none")  # a checkout's own .te/ (make gpu-kit TE=...) is for a GPU machine
    done = subprocess.run(
        ["bash", "bench/gpu_session.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:]
    steps = re.findall(r"^### (.+): exit (\d+) after", done.stdout, re.MULTILINE)
    assert [name for name, _ in steps] == ["versions", "smoke", "explore", "compiled", "plan tiny-sd3"]
    assert all(rc == "0" for _, rc in steps), done.stdout[-3000:]
    tables = (tmp_path / "gpu_smoke.md").read_text()
    assert tables.count("\n## ") == 6 and "failed" not in tables
    if not torch.cuda.is_available():
        # Checks 2 and 3: a row per TE precision; 4 to 6: a row per quantized explore backend.
        assert tables.count("not run: this machine has no CUDA device") == 2 + 2 + 3 * 4
    for name in ("gpu_explore.md", "gpu_explore_compiled.md"):
        explore = (tmp_path / name).read_text()
        assert "tiny-sd3 (sd3, smoke" in explore and "| bf16 | eager |" in explore and "failed" not in explore
    assert "| explore |" in (tmp_path / "plan.md").read_text()
    assert (tmp_path / "session.log").read_text().count("### ") == 2 * len(steps)


#: Transformer Engine releases whose Python sources ``make install`` unpacks (Makefile, ``TE_SOURCE_VERSIONS``):
#: solrl's floor, the version ``make gpu-kit`` packs for a GPU, and the newest release when the list was extended.
TE_SOURCE_VERSIONS = ("2.9.0", "2.16.1", "2.20.2")


def _te_source(version: str) -> Path:
    """Transformer Engine's Python sources at ``version``, unpacked beside the venv by ``make install`` and never
    imported as a package (TE's PyTorch extension cannot be built or loaded without CUDA)."""
    import sys

    source = Path(sys.prefix) / "te-source" / version / "transformer_engine"
    if not source.is_dir():
        pytest.skip(f"{source} is missing: make install unpacks Transformer Engine's sources there")
    return source


def _te_recipe_module(version: str):
    """TE's ``common/recipe`` module at ``version``, executed afresh: its dataclass defaults read ``NVTE_*``
    environment variables when the module runs."""
    import importlib.util
    import sys

    path = _te_source(version) / "common" / "recipe" / "__init__.py"
    spec = importlib.util.spec_from_file_location(f"solrl_test_te_recipe_{version.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _definition(path: Path, qualname: str):
    """The ``ast`` node of function or class ``qualname`` (``"Linear.__init__"``) in the file at ``path``."""
    import ast

    scope = ast.parse(path.read_text()).body
    *owner, name = qualname.split(".")
    for part in owner:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == part).body
    kinds = (ast.FunctionDef, ast.ClassDef)
    found = [n for n in scope if isinstance(n, kinds) and n.name == name]
    assert found, f"{qualname} is not defined in {path}"
    return found[0]


def _signature(path: Path, qualname: str) -> list[str]:
    """The parameter names of function ``qualname`` in ``path``; of its ``__init__`` where it is a class (TE 2.16
    made ``autocast`` a class)."""
    import ast

    node = _definition(path, qualname)
    if isinstance(node, ast.ClassDef):
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in [*node.args.args, *node.args.kwonlyargs]]


def _defining_file(package: Path, line: str) -> Path:
    """The one file under ``package`` that starts a line with ``line`` (TE moves modules between releases)."""
    found = [p for p in package.rglob("*.py") if any(t.strip().startswith(line) for t in p.read_text().splitlines())]
    assert len(found) == 1, f"{line!r} in {found}"
    return found[0]


@pytest.mark.parametrize("version", TE_SOURCE_VERSIONS)
def test_solrl_builds_its_recipes_with_transformer_engines_own_recipe_module(version):
    """solrl's recipes constructed with TE's recipe module at each checked version: 1x16 weight blocks, no Hadamard
    transform, no stochastic rounding, the standard map-to-6 blocks; FP8 E4M3 with split accumulation in the forward
    GEMM and the exact amax / 448 scale; per-row NVFP4 activation scales from 2.16."""
    from solrl.stages.quant.hardware import te_recipe

    recipe = _te_recipe_module(version)
    nvfp4 = te_recipe("nvfp4", recipe)
    assert isinstance(nvfp4, recipe.NVFP4BlockScaling)
    for params in (nvfp4.fp4_quant_fwd_weight, nvfp4.fp4_quant_fwd_inp):
        assert not params.fp4_2d_quantization and not params.random_hadamard_transform
        assert not params.stochastic_rounding
    per_row = tuple(map(int, version.split("."))) >= (2, 16)
    assert getattr(nvfp4, "row_scaled_activation", False) is per_row
    assert getattr(nvfp4, "nvfp4_4over6", "none") == "none"
    fp8 = te_recipe("fp8", recipe)
    assert isinstance(fp8, recipe.Float8CurrentScaling) and fp8.fp8_format == recipe.Format.E4M3
    assert fp8.fp8_gemm_fprop.use_split_accumulator and fp8.use_power_2_scales is False
    with pytest.raises(ValueError, match="nvfp4 or fp8"):
        te_recipe("int8", recipe)


@pytest.mark.parametrize("version", TE_SOURCE_VERSIONS)
def test_no_nvte_environment_variable_changes_solrls_recipes(version, monkeypatch):
    """TE's recipe dataclasses take their defaults from ``NVTE_*`` variables when the module is imported. Each one
    that changes the numbers, set the other way: TE's default recipe follows it, solrl's recipe does not."""
    import dataclasses

    from solrl.stages.quant.hardware import te_recipe

    # The others (NVTE_NVFP4_DISABLE_RHT, ..._ROW_SCALED_ACTIVATION, ...) default to what solrl does not want, and
    # solrl has always passed them; these two default to what it wants, so solrl relied on an unset variable.
    deviant = {"NVTE_NVFP4_4OVER6": "all", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1"}

    def recipes(env: dict[str, str]) -> tuple[object, dict[str, str], dict[str, str]]:
        for name in deviant:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        recipe = _te_recipe_module(version)
        # Compared by repr: each run of the module makes its own Format enum.
        ours = [{k: repr(v) for k, v in dataclasses.asdict(te_recipe(p, recipe)).items()} for p in ("nvfp4", "fp8")]
        return recipe, *ours

    clean = recipes({})[1:]
    recipe, *ours = recipes(deviant)
    assert recipe.Float8CurrentScaling().use_power_2_scales  # the variables reached TE's own defaults
    assert getattr(recipe.NVFP4BlockScaling(), "nvfp4_4over6", "all") == "all"  # 4over6 exists from 2.20
    assert tuple(ours) == clean


@pytest.mark.parametrize("version", TE_SOURCE_VERSIONS)
def test_the_transformer_engine_calls_solrl_makes_exist_with_these_arguments_in_its_source(version):
    """Each TE call of ``stages/quant/{availability,hardware}.py`` against TE's source at each checked version (the
    PyTorch extension cannot be built without CUDA): names, keyword arguments, and the behaviours relied on."""
    te = _te_source(version) / "pytorch"
    exported = (te / "__init__.py").read_text()
    for name in ("Linear", "autocast", "quantized_model_init", "is_fp8_available", "is_nvfp4_available"):
        assert f"import {name}\n" in exported, name
    quantization = te / "quantization.py"
    assert {"return_reason"} <= set(_signature(quantization, "is_fp8_available"))
    assert {"return_reason"} <= set(_signature(quantization, "is_nvfp4_available"))
    assert {"enabled", "recipe"} <= set(_signature(quantization, "autocast"))
    assert {"enabled", "recipe"} <= set(_signature(quantization, "quantized_model_init"))
    linear = _signature(te / "module" / "linear.py", "Linear.__init__")
    assert linear[1:3] == ["in_features", "out_features"] and {"bias", "params_dtype", "device"} <= set(linear)
    # FP8 GEMM operands: rows % 8 and K % 16 (TE_ROW_MULTIPLE, TE_DIM_MULTIPLE; the weight [out, in] too).
    import ast

    check = ast.unparse(_definition(te / "utils.py", "assert_dim_for_fp8_exec"))
    assert "math.prod(tensor.shape[:-1]) % 8" in check and "tensor.shape[-1] % 16" in check
    assert TE_ROW_MULTIPLE["fp8"] == 8 and te_takes(16, 8, "fp8") and not te_takes(16, 4, "fp8")
    # Under no_grad a quantized_model_init weight keeps row-wise data only; copy_ into it re-quantizes.
    assert "set_usage(rowwise=True, columnwise=torch.is_grad_enabled())" in (te / "module" / "base.py").read_text()
    quantized_tensor = _defining_file(te, "class QuantizedTensor(")
    assert "dst.quantize_(src)" in quantized_tensor.read_text()
    # te_weight_bytes: a row-wise NVFP4 weight [M, K] has E4M3 scales [round_up(M, 128), round_up(K / 16, 4)].
    scale_shape = ast.unparse(_definition(te / "tensor" / "nvfp4_tensor.py", "NVFP4Quantizer.get_scale_shape"))
    assert "outer = round_up_to_nearest_multiple(M, 128)" in scale_shape
    assert "inner = round_up_to_nearest_multiple(math.ceil(K / NVFP4_BLOCK_SCALING_SIZE), 4)" in scale_shape


def test_a_packed_tensor_subclass_counts_its_packed_bytes_not_its_bf16_view():
    """What the GPU smoke script's "copy bytes" sums (``Policy.owned_bytes``): torchao's NVFP4Tensor reports the
    nbytes of its bf16 view; its storage is E2M1 codes plus E4M3 block scales."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    from solrl.stages.models.policy import stored_bytes

    weight = torch.randn(256, 512, dtype=torch.bfloat16)
    packed = nn.Parameter(NVFP4Tensor.to_nvfp4(weight), requires_grad=False)
    assert packed.nbytes == weight.nbytes
    assert stored_bytes(packed) == 256 * 512 // 2 + 256 * 512 // 16 and stored_bytes(weight) == weight.nbytes


def _te_kit():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "solrl_test_te_kit", Path(__file__).parents[1] / "bench" / "te_kit.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, files: dict[str, bytes], name: str) -> None:
    import zipfile

    info = f"{name}-1.0.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{member},,\n" for member in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in {**files, f"{info}/RECORD": record.encode()}.items():
            wheel.writestr(member, data)


def test_transformer_engine_travels_in_parts_under_the_call_limit_and_installs_bit_for_bit(tmp_path, monkeypatch):
    """bench/te_kit.py, for a lent GPU without a network (issue 35): a core wheel whose library exceeds one command
    is packed into calls that each stay under the limit with the tree; carried one call at a time into the stash,
    it installs the library bit for bit and the extension built in the background from its source. A skipped call
    is named, and a damaged part refused. Small limits here; the real wheel is packed by `TE=2.16.1 make gpu-kit`."""
    import importlib.metadata
    import random
    import tarfile

    kit = _te_kit()
    mib = kit.MIB
    monkeypatch.setattr(kit, "BIG_MEMBER_BYTES", mib)
    monkeypatch.setattr(kit, "CALL_LIMIT_MIB", 4)
    monkeypatch.setattr(kit, "MARGIN_MIB", 0)
    library = random.Random(0).randbytes(7 * mib)  # incompressible: 3 parts of at most 3 MiB
    _wheel(
        tmp_path / "fake_cu13-1.0-py3-none-any.whl", {"fake/__init__.py": b"", "fake/lib/core.so": library}, "fake_cu13"
    )
    _wheel(tmp_path / "fake-1.0-py3-none-any.whl", {"fake/__init__.py": b""}, "fake")
    source = tmp_path / "fake_torch-1.0"
    source.mkdir()
    (source / "setup.py").write_text(
        "from setuptools import setup\nsetup(name='fake_torch', version='1.0', py_modules=['fake_torch'])\n"
    )
    (source / "fake_torch.py").write_text("BUILT = True\n")
    with tarfile.open(tmp_path / "fake_torch-1.0.tar.gz", "w:gz") as sdist:
        sdist.add(source, arcname=source.name)
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "solrl.whl").write_bytes(b"0" * (mib // 2))

    monkeypatch.chdir(tmp_path)
    pack = ["pack", "--core", "fake_cu13-1.0-py3-none-any.whl", "--meta", "fake-1.0-py3-none-any.whl"]
    kit.main([*pack, "--sdist", "fake_torch-1.0.tar.gz", "--out", ".te", "--tree-mib", "1", "--final", "whl"])
    plan = json.loads((tmp_path / ".te" / kit.PLAN).read_text())
    assert plan["parts"] == 3 and len(plan["calls"]) == 3 and plan["big"] == ["fake/lib/core.so"]
    for carried in plan["calls"]:  # the tree, and each call's files, under the limit
        sizes = [kit._bytes(tmp_path / ("whl" if c == "whl" else f".te/{c}")) for c in carried]
        assert 1 * mib + sum(sizes) <= 4 * mib
    calls_md = (tmp_path / ".te" / "CALLS.md").read_text()
    assert "python3 bench/te_kit.py stash" in calls_md and "bash bench/gpu_session.sh" in calls_md

    def call(i: int) -> Path:  # what call i brings to the machine: its carried files and the two lists
        folder = tmp_path / f"call-{i}"
        folder.mkdir(exist_ok=True)
        for name in [*plan["calls"][i - 1], kit.SUMS, kit.PLAN]:
            if name != "whl":
                shutil.copy2(tmp_path / ".te" / name, folder / name)
        return folder

    stash, target = tmp_path / "stash", tmp_path / "site"
    kit.main(["stash", "--source", str(call(1)), "--stash", str(stash)])  # starts the extension's build
    with pytest.raises(SystemExit, match=r"not in .*stash: part-2 \(call 2\); the machine went back"):
        kit.main(["install", "--source", str(call(3)), "--stash", str(stash), "--target", str(target)])
    damaged = call(2) / "part-2"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit, match=r"part-2 does not match SHA256SUMS \(a partial copy\?\); carry it again"):
        kit.main(["stash", "--source", str(damaged.parent), "--stash", str(stash)])
    shutil.copy2(tmp_path / ".te" / "part-2", damaged)
    kit.main(["stash", "--source", str(call(2)), "--stash", str(stash)])
    kit.main(["install", "--source", str(call(3)), "--stash", str(stash), "--target", str(target), "--wait", "120"])
    assert (target / "fake" / "lib" / "core.so").read_bytes() == library
    assert "core.so" not in (target / "fake_cu13-1.0.dist-info" / "RECORD").read_text()
    assert (target / "fake_torch.py").read_text() == "BUILT = True\n"
    assert "--no-build-isolation" in (stash / "build.log").read_text()
    installed = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(target)])}
    assert installed == {"fake_cu13": "1.0", "fake": "1.0", "fake_torch": "1.0"}  # what TE's import checks
