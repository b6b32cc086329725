"""torchao's explore backends (``torchao_fp8``, ``torchao_nvfp4``) run on this CPU: the copies solrl builds from the
policy, with torchao's own configs, tensor subclasses, quantize functions and dispatch.

torchao refuses both without a GPU of their compute capability, and ``solrl run`` refuses them too (their
``unavailable_reason``). Here both refusals are lifted (``torchao_here``), and nothing else is replaced for FP8:
torch has a CPU kernel for torchao's row-wise FP8 GEMM (``torch._scaled_mm``), so ``torchao_fp8`` runs as it does on
a Hopper, the kernel aside. NVFP4's block-scaled GEMM has no CPU kernel. For it, and for it only, these tests put
the GEMM's definition in the kernel's place (``_block_scaled_mm_fp4``: the E2M1 codes times their unswizzled E4M3
block scales, multiplied in float32, as the tensor cores accumulate); torchao's code before and after that call
runs unchanged. What a GPU alone can tell (the kernels' own numbers, their speed) is ``bench/gpu_smoke.py``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from solrl.config import load_config
from solrl.registry import EXPLORE_BACKENDS
from solrl.stages.models import load_model
from solrl.stages.models.policy import Policy
from solrl.stages.quant.backends import quantized_layers, rollout_network, sampling_network

FAMILIES = ("tiny-sd3", "tiny-flux", "tiny-sana")


def _block_scaled_mm_fp4(kernel):
    """``torch._scaled_mm`` with NVFP4 operands (``float4_e2m1fn_x2`` codes, swizzled E4M3 block scales) computed
    by definition, on CPU; every other call goes to ``kernel``, torch's own."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.utils import from_blocked

    def values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows, k = codes.shape[0], codes.shape[1] * 2
        e2m1 = f4_unpacked_to_f32(unpack_uint4(codes.contiguous().view(torch.uint8))).view(rows, k // 16, 16)
        blocks = from_blocked(scales.contiguous().flatten(), rows, k // 16).float()
        return (e2m1 * blocks.unsqueeze(-1)).view(rows, k)

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **kwargs):
        if a.dtype != torch.float4_e2m1fn_x2:
            return kernel(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype, **kwargs)
        assert scale_result is None and not kwargs, kwargs  # torchao 0.18 applies its tensor scales after the call
        out = values(a, scale_a) @ values(b.t(), scale_b).t()
        return (out if bias is None else out + bias.float()).to(out_dtype or torch.bfloat16)

    return scaled_mm


@pytest.fixture
def torchao_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's and solrl's capability checks lifted for the torchao precisions."""
    import torchao.prototype.mx_formats.inference_workflow as nvfp4_workflow
    import torchao.quantization.quant_api as quant_api

    from solrl.stages.quant import backends

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setattr(nvfp4_workflow, "is_sm_at_least_100", lambda: True)
    check = backends.check_precision
    monkeypatch.setattr(backends, "check_precision", lambda p: None if p.startswith("torchao") else check(p))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """``(cfg, policy, inputs)``: a tiny twin in bfloat16 (what a GPU run holds), its rollout adapter moved away
    from its init so that the merge matters, and a batch of 6 (latents, sigmas, two prompts' conditioning)."""
    name, root = request.param, tmp_path_factory.mktemp("torchao")
    cfg = load_config(name, [f"storage.root={root}", f"model.path={root / name}", "model.dtype=bfloat16"])
    policy = Policy(load_model(cfg.model, torch.device("cpu")), rank=4, alpha=4.0, seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.adapter_params("rollout").values():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(6, *policy.model.latent_shape, dtype=torch.bfloat16)
    inputs = (x, torch.full((6,), 0.7), policy.model.encode(["a photo of a cat", "a red bicycle"] * 3))
    return cfg, policy, inputs


def _velocity(policy: Policy, precision: str, inputs, **kwargs) -> torch.Tensor:
    with torch.no_grad(), rollout_network(policy, precision, **kwargs) as net:
        return policy.model.velocity(net, *inputs).float()


def _keep_input(seen: dict, name: str):
    def hook(module: nn.Module, args: tuple) -> None:
        seen[name] = args[0]

    return hook


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _nudge_(policy: Policy) -> None:
    """An update: new rollout weights."""
    with torch.no_grad():
        for p in policy.adapter_params("rollout").values():
            p.add_(0.02 * torch.randn_like(p))


def test_the_torchao_fp8_copy_runs_batch_invariant_and_compiled_without_a_break_or_a_recompile(torchao_here, family):
    """What ``torchao_fp8`` promises, on torchao's own FP8 tensors: every layer the rule picks is a ``Float8Tensor``
    and the copy holds exactly the bytes the memory plan counts from shapes; its error against bf16 is FP8's; a
    seed alone samples what it samples inside a batch (per-token activation scales); an update is re-quantized
    into the cached copy, equal to a fresh build; the copy compiles as one graph and does not recompile after the
    update (compiled by Inductor for tiny-sd3; traced by dynamo for each family); and building it leaves Inductor's
    process-wide settings alone."""
    from torchao.quantization import Float8Tensor

    cfg, policy, inputs = family
    min_dim, skip = cfg.explore.min_dim, policy.model.explore_skip
    inductor = dict(torch._inductor.config.get_config_copy())
    policy.explore_copies.clear()
    with torch.no_grad(), rollout_network(policy, "torchao_fp8", min_dim) as net:
        layers = [m for name, m in net.named_modules() if name in net.ao_layers]
        assert layers and quantized_layers(net) == len(layers)
        assert all(isinstance(m.weight, Float8Tensor) for m in layers)
        assert policy.owned_bytes(net) == EXPLORE_BACKENDS.get("torchao_fp8").copy_bytes(
            policy.transformer, skip, min_dim
        )
        fp8 = policy.model.velocity(net, *inputs).float()
        x, sigma, cond = inputs
        alone = policy.model.velocity(net, x[:1], sigma[:1], policy.model.encode(["a photo of a cat"])).float()
    # torchao sets coordinate-descent tuning and friends unless told not to (ao_config), for the whole process.
    assert dict(torch._inductor.config.get_config_copy()) == inductor
    assert all(not isinstance(p, Float8Tensor) for p in policy.transformer.parameters())
    bf16 = _velocity(policy, "bf16", inputs)
    assert 1e-3 < _rel(fp8, bf16) < 0.1, _rel(fp8, bf16)
    # Per-token scales: alone, a seed quantizes as in its batch, so only the GEMM's rounding may differ (it does
    # not at these widths; torch's CPU FP8 GEMM is batch-variant at 1536 wide). A scale per call would move it by
    # as much as FP8 moves it from bf16.
    assert _rel(alone, fp8[:1]) < 0.1 * _rel(fp8, bf16), (_rel(alone, fp8[:1]), _rel(fp8, bf16))

    _nudge_(policy)
    synced = _velocity(policy, "torchao_fp8", inputs, min_dim=min_dim)
    assert len(policy.explore_copies) == 1 and next(iter(policy.explore_copies.values())) is net  # no rebuild
    policy.explore_copies.clear()
    torch.testing.assert_close(synced, _velocity(policy, "torchao_fp8", inputs, min_dim=min_dim), rtol=0, atol=0)
    assert _rel(synced, fp8) > 1e-3  # the update reached the copy

    with torch.no_grad(), rollout_network(policy, "torchao_fp8", min_dim) as net:
        explained = torch._dynamo.explain(lambda x: policy.model.velocity(net, x, *inputs[1:]))(inputs[0])
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    if cfg.model.family != "sd3":  # Inductor's compile (most of this file's time, cold) once; the trace is per family
        policy.explore_copies.clear()
        return
    runs = []
    for _ in range(2):
        with torch.no_grad(), sampling_network(policy, "torchao_fp8", compile=True, min_dim=min_dim) as (net, stats):
            runs.append((policy.model.velocity(net, *inputs).float(), stats))
        _nudge_(policy)
    (first, warm), (second, again) = runs
    assert warm.graphs >= 1 and again.graphs == 0, (warm, again)
    # Inductor's compiled FP8 quantization and torch's eager one differ here by 1.5 to 2.2% (2026-12-07, this CPU):
    # about half of what FP8 itself moves the velocity.
    assert _rel(first, synced) < 0.05 and _rel(second, first) > 1e-3
    policy.explore_copies.clear()


def test_the_torchao_nvfp4_copy_holds_solrls_nvfp4_encoding_and_samples_as_the_emulated_copy_per_call(
    torchao_here, family, monkeypatch
):
    """torchao's NVFP4 copy of the merged rollout weights holds, layer for layer, the E2M1 codes, E4M3 block scales
    and FP32 tensor scale of solrl's emulated copy, in the bytes the memory plan counts; it runs (SD3's and SANA's
    attention layers that take transposed inputs included: torchao's NVFP4 linear takes contiguous ones only) and
    samples as
    ``nvfp4_emulated`` with one activation scale per call, as torchao scales them, within bf16's rounding of the
    two orders of applying the scales; an update is re-quantized into the cached copy, equal to a fresh build; the
    copy traces as one graph."""
    import torchao.prototype.mx_formats.nvfp4_tensor as nvfp4_tensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.prototype.mx_formats.utils import from_blocked

    from solrl.stages.quant import FakeQuantLinear

    # torchao's NVFP4 module alone sees the GEMM's definition: torch itself, and Inductor's kernels (registered by
    # name, and cached on disk), keep torch's own _scaled_mm.
    fp4_torch = SimpleNamespace(**{**vars(torch), "_scaled_mm": _block_scaled_mm_fp4(torch._scaled_mm)})
    monkeypatch.setattr(nvfp4_tensor, "torch", fp4_torch)
    cfg, policy, inputs = family
    min_dim, skip = cfg.explore.min_dim, policy.model.explore_skip
    policy.explore_copies.clear()
    with torch.no_grad(), rollout_network(policy, "torchao_nvfp4", min_dim) as net:
        ao = {name: m for name, m in net.named_modules() if name in net.ao_layers}
        assert ao and all(isinstance(m.weight, NVFP4Tensor) for m in ao.values())
        assert policy.owned_bytes(net) == EXPLORE_BACKENDS.get("torchao_nvfp4").copy_bytes(
            policy.transformer, skip, min_dim
        )
        seen: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_pre_hook(_keep_input(seen, n)) for n, m in ao.items()]
        nvfp4 = policy.model.velocity(net, *inputs).float()
        for hook in hooks:
            hook.remove()
    merged = policy.merged_copy("rollout")
    with torch.no_grad(), rollout_network(policy, "nvfp4_emulated", min_dim, "call", keep_copy="none") as emulated:
        packed = {n: m for n, m in emulated.named_modules() if isinstance(m, FakeQuantLinear)}
        assert set(ao) <= set(packed)
        for name, layer in ao.items():
            w, ref = layer.weight, packed[name]
            assert int(ref.weight_pow2) == 0
            assert torch.equal(w.qdata.view(torch.uint8), ref.codes), name
            blocks = from_blocked(w.scale.flatten(), ref.out_features, ref.in_features // 16)
            assert torch.equal(blocks.view(torch.uint8), ref.block_scales), name
            assert torch.equal(w.per_tensor_scale.view(torch.int32), ref.weight_scale), name
            x = seen[name]
            out, expect = layer(x).float(), ref(x).float()
            # One bf16 rounding apart: torchao rounds its GEMM's output, then multiplies by its tensor scales cast
            # to bf16; the emulated layer multiplies bf16 operands and applies the scales in float32.
            assert _rel(out, expect) < 1e-2 and (out - expect).abs().max() <= 2**-6 * expect.abs().max(), name
        for name in set(packed) - set(ao):  # torchao takes Linears only: SANA's 1x1 convs stay in bf16 there
            parent, _, child = name.rpartition(".")
            setattr(emulated.get_submodule(parent), child, merged.get_submodule(name))
        reference = policy.model.velocity(emulated, *inputs).float()
    bf16 = _velocity(policy, "bf16", inputs)
    # Through the network, a layer's last-bit difference can move the next layer's activation across an E2M1
    # rounding boundary (a whole step): the copies agree far better than either agrees with bf16, not to the bit.
    assert _rel(nvfp4, reference) < 0.5 * _rel(nvfp4, bf16), (_rel(nvfp4, reference), _rel(nvfp4, bf16))

    _nudge_(policy)
    synced = _velocity(policy, "torchao_nvfp4", inputs, min_dim=min_dim)
    policy.explore_copies.clear()
    torch.testing.assert_close(synced, _velocity(policy, "torchao_nvfp4", inputs, min_dim=min_dim), rtol=0, atol=0)
    assert _rel(synced, nvfp4) > 1e-3
    # Dynamo traces the copy as one graph. (Inductor's CPU code generation then fails on a float8 dtype promotion,
    # torch 2.14.1; a GPU generates Triton instead: bench/gpu_smoke.py's check 5.)
    with torch.no_grad(), rollout_network(policy, "torchao_nvfp4", min_dim) as net:
        explained = torch._dynamo.explain(lambda x: policy.model.velocity(net, x, *inputs[1:]))(inputs[0])
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    policy.explore_copies.clear()
