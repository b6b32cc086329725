"""Tests for the emulated NVFP4 / FP8 explore-copy quantization (solrl.stages.quant).

The reference quantizer below is independent of torchao and of the module under
test: plain numpy float64, with its own E4M3 and E2M1 round-to-nearest-even.
It follows DESIGN 2 (docs/design.md):

    g   = fp32(amax(|x|) / (448 * 6))            (g = 1 without a tensor scale)
    s_b = e4m3(clamp(amax(|block|) / 6 / g, 2^-6, 448))
    q   = round_e2m1(clamp(x * ((1 / g) / s_b), -6, 6))
    x_hat = fp32(q * s_b * g)

``fp32_steps=True`` evaluates the two scale expressions with FP32 rounding after
each operation, in the order written above (``fp32(fp32(amax_b / 6) / g)`` and
``fp32(x * fp32(fp32(1 / g) / s_b))``); ``fp32_steps=False`` evaluates them in
exact (float64) arithmetic. Findings (asserted below):

* with ``fp32_steps=True`` the module matches the reference bit for bit
  (including the sign of zero) for float32 and bfloat16 inputs, with and
  without the tensor scale;
* with exact arithmetic it also matches bit for bit on random float32 inputs;
  on bfloat16 inputs (8-bit mantissas) a fraction of a percent of elements sit
  exactly on, or within FP32 rounding of, an E2M1 or E4M3 rounding midpoint,
  and there FP32 evaluation can round the other way: one E2M1 step for the
  element, or one E4M3 step for the block scale. Those are the only differences.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from solrl.stages.quant import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    NVFP4_BLOCK,
    FakeQuantLinear,
    fp8_e4m3_fake_quantize,
    nvfp4_fake_quantize,
    quantize_model_,
    requantize_model_,
)

# --------------------------------------------------------------------------- #
# Independent numpy float64 reference
# --------------------------------------------------------------------------- #

_E4M3_MIN_NORMAL = 2.0**-6
_E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _fp32(a) -> np.ndarray:
    """Round float64 values to float32 (RNE) and return them as float64."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def _bf16(a) -> np.ndarray:
    """Round float64 values to bfloat16 (RNE via float32 bits) and return float64."""
    u = np.asarray(a, np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def ref_e4m3(v) -> np.ndarray:
    """Round to the FP8 E4M3 (fn) grid: nearest, ties to even, subnormals, saturate at 448."""
    v = np.asarray(v, np.float64)
    a = np.abs(v)
    _, e = np.frexp(np.maximum(a, _E4M3_MIN_NORMAL))  # a = m * 2^e, m in [0.5, 1)
    quantum = 2.0 ** (e - 1 - 3)  # 3 mantissa bits; subnormal spacing 2^-9
    return np.copysign(np.minimum(np.rint(a / quantum) * quantum, 448.0), v)


def ref_e2m1(v) -> np.ndarray:
    """Round to the FP4 E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: nearest, ties to even, saturate."""
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), 6.0)
    quantum = np.where(a < 2.0, 0.5, np.where(a < 4.0, 1.0, 2.0))
    return np.copysign(np.rint(a / quantum) * quantum, v)


def _ref_nvfp4_parts(x, tensor_scale: bool, fp32_steps: bool):
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    b = x.reshape(-1, k // 16, 16)
    amax = np.abs(x).max()
    g = _fp32(amax / 2688.0) if tensor_scale else 1.0
    amax_b = np.abs(b).max(-1, keepdims=True)
    raw = _fp32(_fp32(amax_b / 6.0) / g) if fp32_steps else amax_b / 6.0 / g
    s_b = ref_e4m3(np.clip(raw, _E4M3_MIN_NORMAL, 448.0))
    scaled = _fp32(b * _fp32(_fp32(1.0 / g) / s_b)) if fp32_steps else b / g / s_b
    q = ref_e2m1(np.clip(scaled, -6.0, 6.0))
    return q, s_b, g, raw, b / g / s_b


def ref_nvfp4(x, *, tensor_scale: bool = True, fp32_steps: bool = True) -> np.ndarray:
    """Reference NVFP4 quantize-dequantize along the last dim (float64 result, FP32 values)."""
    x = np.asarray(x, np.float64)
    if not np.any(x):
        return np.zeros_like(x)
    q, s_b, g, _, _ = _ref_nvfp4_parts(x, tensor_scale, fp32_steps)
    return _fp32(q * s_b * g).reshape(x.shape)


def ref_fp8(x) -> np.ndarray:
    """Reference per-tensor FP8 E4M3.

    scale = fp32(amax / 448); x_hat = fp32(e4m3(fp32(x / scale)) * scale).
    """
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max()
    if amax == 0:
        return np.zeros_like(x)
    scale = _fp32(amax / 448.0)
    return _fp32(ref_e4m3(np.clip(_fp32(x / scale), -448.0, 448.0)) * scale)


def _bits_equal(out: torch.Tensor, ref: np.ndarray) -> bool:
    """Bit-pattern equality (so -0.0 != +0.0) of a float32/bfloat16 tensor and a reference."""
    if out.dtype == torch.bfloat16:
        ref_t = torch.from_numpy(_bf16(ref).astype(np.float32)).to(torch.bfloat16)
        return torch.equal(out.view(torch.int16), ref_t.view(torch.int16))
    ref_t = torch.from_numpy(ref.astype(np.float32))
    return torch.equal(out.to(torch.float32).view(torch.int32), ref_t.view(torch.int32))


def _random_five_decades(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values whose 16-blocks have magnitudes spread over 10^-2.5 .. 10^2.5."""
    gen = torch.Generator().manual_seed(seed)
    *lead, k = shape
    mag = 10 ** (torch.rand(*lead, k // 16, 1, generator=gen) * 5.0 - 2.5)
    x = torch.randn(*lead, k // 16, 16, generator=gen) * mag
    return x.reshape(shape)


# --------------------------------------------------------------------------- #
# The reference itself
# --------------------------------------------------------------------------- #


def test_reference_e4m3_rounder_matches_torch_float8_cast_on_grid_and_midpoints():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    assert grid.max() == 448.0 and grid[1] == 2.0**-9  # max and smallest subnormal
    mids = (grid[1:] + grid[:-1]) / 2
    probes = np.concatenate([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    probes = np.concatenate([probes, -probes])
    via_torch = torch.from_numpy(probes).to(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(ref_e4m3(probes), via_torch)


def test_constants():
    assert NVFP4_BLOCK == 16 and E2M1_MAX == 6.0 and E4M3_MAX == 448.0
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------- #
# nvfp4_fake_quantize: code points, ties, saturation, clamps
# --------------------------------------------------------------------------- #


def test_every_e2m1_code_point_round_trips_exactly():
    vals = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])  # amax 6 -> s_b = 1
    assert vals.numel() == 16
    for dtype in (torch.float32, torch.bfloat16):
        out = nvfp4_fake_quantize(vals.to(dtype)[None], tensor_scale=False)[0]
        assert out.dtype == dtype
        assert torch.equal(out.float(), vals)
        assert torch.equal(torch.signbit(out[8]), torch.tensor(True))  # -0.0 keeps its sign


def test_e2m1_ties_round_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor([6.0] + ties + [-6.0] + [-t for t in ties])  # amax 6 -> s_b = 1 exactly
    expect = torch.tensor([6.0] + even + [-6.0] + [-e for e in even])
    out = nvfp4_fake_quantize(x[None], tensor_scale=False)[0]
    assert torch.equal(out, expect)
    assert _bits_equal(out, ref_nvfp4(x.numpy(), tensor_scale=False))


def test_block_scale_rounds_to_even_on_e4m3_grid_and_e2m1_saturates_at_6():
    # amax / 6 = 1.0625 is an E4M3 tie -> s_b = 1.0 (even); 6.375 / 1 clamps to q = 6.
    # amax / 6 = 1.1875 is an E4M3 tie -> s_b = 1.25 (even); 7.125 / 1.25 = 5.7 -> q = 6.
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1] = 6.375, 1.0
    x[1, 0], x[1, 1] = 7.125, 1.25
    out = nvfp4_fake_quantize(x, tensor_scale=False)
    assert out[0, 0] == 6.0 and out[0, 1] == 1.0
    assert out[1, 0] == 7.5 and out[1, 1] == 1.25
    assert _bits_equal(out, ref_nvfp4(x.numpy(), tensor_scale=False))


def test_block_scale_saturates_at_e4m3_max_without_tensor_scale():
    # No tensor scale: amax / 6 = 10000 / 6 > 448 -> s_b = 448, so |x| > 6 * 448 clips to 2688.
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([10000.0, -3000.0, 448.0, 100.0])
    out = nvfp4_fake_quantize(x, tensor_scale=False)[0]
    assert out[:4].tolist() == [2688.0, -2688.0, 448.0, 0.0]  # 100/448 = 0.22 -> 0
    assert _bits_equal(out, ref_nvfp4(x.numpy(), tensor_scale=False)[0])
    # With the tensor scale the same block is represented without clipping.
    out_ts = nvfp4_fake_quantize(x, tensor_scale=True)[0]
    assert out_ts[0] == pytest.approx(10000.0, rel=1e-6)
    assert _bits_equal(out_ts, ref_nvfp4(x.numpy(), tensor_scale=True)[0])


@pytest.mark.parametrize("tensor_scale", [True, False])
def test_all_zero_tensor_and_zero_blocks_give_zeros_without_nan(tensor_scale):
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.zeros(3, 32, dtype=dtype)
        out = nvfp4_fake_quantize(z, tensor_scale=tensor_scale)
        assert out.dtype == dtype and torch.equal(out, z)
        assert torch.equal(fp8_e4m3_fake_quantize(z), z)
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-1, 1, 16)  # block 0 non-zero, other three blocks all zero
    out = nvfp4_fake_quantize(x, tensor_scale=tensor_scale)
    assert torch.isfinite(out).all() and torch.equal(out[0, 16:], torch.zeros(16))
    assert torch.equal(out[1], torch.zeros(32))


def test_tiny_block_scale_is_clamped_to_e4m3_min_normal_not_subnormal():
    # Tensor amax 2688 -> g = 2688 / 2688 = 1 exactly. Block 1 has amax 6 * 2^-8, so
    # amax / 6 / g = 2^-8 would be an E4M3 *subnormal* scale; DESIGN 2 clamps it to 2^-6.
    # Then 3 * 2^-8 = 0.75 * 2^-6 -> q = 1 (tie to even) -> 2^-6, whereas a 2^-8 scale
    # would have kept 3 * 2^-8 exactly.
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0
    x[0, 16], x[0, 17], x[0, 18], x[0, 19] = 6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-7), 2.0**-8
    x[0, 32:] = 1e-6  # scale far below 2^-6: 1e-6 / 2^-6 < 0.25 -> all zero
    out = nvfp4_fake_quantize(x, tensor_scale=True)[0]
    assert out[16].item() == 6 * 2.0**-8  # 1.5 * 2^-6
    assert out[17].item() == 2.0**-6  # 0.75 -> 1 (would be 3 * 2^-8 with a subnormal scale)
    assert out[18].item() == -(2.0**-7)  # -0.5 * 2^-6
    assert out[19].item() == 0.0  # 0.25 -> 0 (tie to even)
    assert torch.equal(out[32:], torch.zeros(16))
    assert _bits_equal(out, ref_nvfp4(x.numpy(), tensor_scale=True)[0])
    # Same without a tensor scale (g = 1): identical clamp behaviour.
    out_g1 = nvfp4_fake_quantize(x, tensor_scale=False)
    assert _bits_equal(out_g1, ref_nvfp4(x.numpy(), tensor_scale=False))


def test_tiny_tensor_is_exact_power_of_two_rescaling_of_a_normal_one():
    # amax ~1e-36 would make 1 / g overflow float32; the module pre-scales by 2^k.
    x = _random_five_decades((4, 32), seed=3)
    x = x / x.abs().max() * 1e-36
    out = nvfp4_fake_quantize(x)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    big = nvfp4_fake_quantize(x * 2.0**60 * 2.0**60)  # exact; amax ~1.3
    assert torch.equal(out, big * 2.0**-60 * 2.0**-60)


# --------------------------------------------------------------------------- #
# nvfp4_fake_quantize vs the reference on random data
# --------------------------------------------------------------------------- #

_SHAPES = [(7, 16), (3, 5, 48), (2, 3, 1, 64), (1, 160), (13, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_scale", [True, False])
@pytest.mark.parametrize("shape", _SHAPES)
def test_random_tensors_over_five_decades_match_reference_bit_for_bit(shape, tensor_scale, dtype):
    x = _random_five_decades(shape, seed=sum(shape)).to(dtype)
    out = nvfp4_fake_quantize(x, tensor_scale=tensor_scale)
    assert out.shape == x.shape and out.dtype == dtype
    ref = ref_nvfp4(x.float().numpy(), tensor_scale=tensor_scale, fp32_steps=True)
    assert _bits_equal(out, ref)


def _near_midpoint(v: np.ndarray, grid: str, rel: float = 2.0**-21) -> np.ndarray:
    """Whether |v| is within ``rel`` (relative) of a rounding midpoint of the E4M3 / E2M1 grid."""
    a = np.abs(v)
    if grid == "e2m1":
        return np.isclose(a[..., None], _E2M1_TIES, rtol=rel, atol=0).any(-1)
    _, e = np.frexp(np.maximum(a, _E4M3_MIN_NORMAL))
    quantum = 2.0 ** (e - 4)
    frac = a / quantum - np.floor(a / quantum)
    return np.abs(frac - 0.5) * quantum <= rel * a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_arithmetic_reference_differs_only_at_fp32_rounding_ties(dtype):
    # Several 16k-element tensors rather than one large one (keeps CPU ops single-threaded).
    n_mismatch = 0
    for seed in range(11, 15):
        x = _random_five_decades((32, 4, 128), seed=seed).to(dtype)
        xn = x.float().numpy()
        for tensor_scale in (True, False):
            out = nvfp4_fake_quantize(x, tensor_scale=tensor_scale).double().numpy()
            exact = ref_nvfp4(xn, tensor_scale=tensor_scale, fp32_steps=False)
            if dtype == torch.bfloat16:
                exact = _bf16(exact)
            mismatch = exact != out
            n_mismatch += int(mismatch.sum())
            _, _, _, raw, scaled = _ref_nvfp4_parts(xn, tensor_scale, fp32_steps=False)
            block_tie = np.broadcast_to(_near_midpoint(raw, "e4m3"), scaled.shape).reshape(x.shape)
            elem_tie = _near_midpoint(scaled, "e2m1").reshape(x.shape)
            assert (block_tie | elem_tie)[mismatch].all()
    if dtype == torch.float32:
        assert n_mismatch == 0  # float32 inputs: bit for bit even in exact arithmetic
    else:
        assert 0 < n_mismatch < 0.01 * 8 * x.numel()  # bf16: rare, and only at (near-)ties


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


def test_last_dim_not_multiple_of_16_raises_value_error_naming_shape():
    with pytest.raises(ValueError, match=r"multiple of 16.*\(3, 24\).*pad.*skip"):
        nvfp4_fake_quantize(torch.randn(3, 24))
    with pytest.raises(ValueError, match="multiple of 16"):
        FakeQuantLinear(nn.Linear(24, 32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_value_error(bad):
    x = torch.randn(2, 16)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="non-finite"):
        nvfp4_fake_quantize(x)
    with pytest.raises(ValueError, match="non-finite"):
        fp8_e4m3_fake_quantize(x)


# --------------------------------------------------------------------------- #
# FP8
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_e4m3_fake_quantize_matches_reference_bit_for_bit(dtype):
    x = _random_five_decades((5, 7, 32), seed=5).to(dtype)
    out = fp8_e4m3_fake_quantize(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert _bits_equal(out, ref_fp8(x.float().numpy()))


# --------------------------------------------------------------------------- #
# FakeQuantLinear
# --------------------------------------------------------------------------- #


def _fq(t: torch.Tensor) -> torch.Tensor:
    return nvfp4_fake_quantize(t, tensor_scale=True)


def _per_sample(quantize, t: torch.Tensor) -> torch.Tensor:
    """``quantize`` applied to each sample (leading dim) alone: FakeQuantLinear's default activation scale."""
    return torch.stack([quantize(sample) for sample in t])


def test_fake_quant_linear_equals_linear_of_quantized_activation_and_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    wrapped = FakeQuantLinear(lin)
    x = torch.randn(2, 5, 64)
    expect = F.linear(_per_sample(_fq, x), _fq(lin.weight.detach()), lin.bias.detach())
    assert wrapped.format == "nvfp4" and wrapped.bias is lin.bias and not hasattr(wrapped, "weight")
    assert torch.equal(wrapped(x), expect)
    per_call = FakeQuantLinear(lin, activation_scale="call")  # one tensor scale for the whole call
    assert torch.equal(per_call(x), F.linear(_fq(x), _fq(lin.weight.detach()), lin.bias.detach()))


def test_fake_quant_linear_bfloat16_keeps_dtype_and_is_within_bf16_of_float32_math():
    torch.manual_seed(1)
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    wrapped = FakeQuantLinear(lin)
    assert torch.equal(wrapped.dequantized_weight(), _fq(lin.weight.float()))  # the same encoding as in float32
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expect = F.linear(_per_sample(_fq, x.float()), _fq(lin.weight.float()), lin.bias.float())
    out = wrapped(x)  # block-scaled operands in bf16, the tensor scales after the GEMM
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expect, rtol=2**-7, atol=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 input under bf16 autocast: the bf16 GEMM too
        torch.testing.assert_close(wrapped.float()(x.float()).bfloat16(), out, rtol=0, atol=0)


def test_packed_weights_hold_4_5_bits_nvfp4_and_8_bits_fp8_per_weight_and_no_high_precision_copy():
    lin = nn.Linear(256, 64, bias=False)
    nvfp4, fp8 = FakeQuantLinear(lin, "nvfp4"), FakeQuantLinear(lin, "fp8")
    held = {name: b.nbytes for name, b in nvfp4.named_buffers()}
    assert held == {"codes": 256 * 64 // 2, "block_scales": 256 * 64 // 16, "weight_scale": 4, "weight_pow2": 4}
    assert sum(b.nbytes for b in fp8.buffers()) == 256 * 64 + 8
    assert list(nvfp4.parameters()) == [] and nvfp4.codes.dtype == torch.uint8
    before = nvfp4.codes.clone()
    nvfp4.bfloat16()  # model.to(dtype) cannot cast the float8 encodings: they are held as their bits
    assert torch.equal(nvfp4.codes, before) and nvfp4.block_scales.dtype == torch.uint8


def test_packed_nvfp4_is_torchaos_nvfp4tensor_format_and_its_dequantize_to_one_rounding():
    """torchao's ``NVFP4Tensor`` (the reference format): the same codes and E4M3 block scales bit for bit.
    Its ``dequantize`` computes ``q * (g * s_b)``; solrl decodes ``(q * s_b) * g`` (DESIGN 2: one rounding, as a
    block-scaled GEMM applies the tensor scale last). From the same packed data, torchao's order is reproduced
    bit for bit, and the two orders differ by at most one float32 ulp."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    torch.manual_seed(5)
    weight = torch.randn(48, 64) * torch.logspace(-2, 2, 48)[:, None]
    wrapped = FakeQuantLinear(nn.Linear(64, 48), weight=weight)
    g = per_tensor_amax_to_scale(weight.abs().amax())
    reference = NVFP4Tensor.to_nvfp4(weight, per_tensor_scale=g)
    assert torch.equal(wrapped.codes, reference.qdata.view(torch.uint8))
    assert torch.equal(wrapped.block_scales, reference.scale.view(torch.uint8).view(48, 4))
    assert wrapped.weight_scale.view(torch.float32) == g
    from solrl.stages.quant.nvfp4 import unpack_e2m1

    q = unpack_e2m1(wrapped.codes).view(48, 4, 16)
    s_b = wrapped.block_scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    assert torch.equal(reference.dequantize(torch.float32), (q * (g * s_b)).view(48, 64))
    ours, theirs = wrapped.dequantized_weight(), reference.dequantize(torch.float32)
    assert torch.equal(ours, _fq(weight))
    ulp = (torch.nextafter(ours.abs(), torch.tensor(float("inf"))) - ours.abs()).clamp_min(1e-45)
    assert ((ours - theirs).abs() <= ulp).all()


def test_fake_quant_linear_fp8_equals_linear_of_fp8_operands():
    torch.manual_seed(2)
    lin = nn.Linear(24, 8)  # fp8 has no block constraint on K
    wrapped = FakeQuantLinear(lin, fmt="fp8")
    x = torch.randn(4, 24)
    w8 = fp8_e4m3_fake_quantize(lin.weight.detach())
    expect = F.linear(_per_sample(fp8_e4m3_fake_quantize, x), w8, lin.bias.detach())
    assert wrapped.format == "fp8" and torch.equal(wrapped(x), expect)


def test_conv1x1_wrapper_equals_conv_of_channel_blocked_quantized_operands():
    torch.manual_seed(3)
    conv = nn.Conv2d(32, 48, kernel_size=1)
    wrapped = FakeQuantLinear(conv)
    x = torch.randn(2, 32, 5, 3)
    xq = _per_sample(_fq, x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # blocks along C, per pixel
    wq = _fq(conv.weight.detach().reshape(48, 32)).reshape(48, 32, 1, 1)
    expect = F.conv2d(xq, wq, conv.bias.detach())
    out = wrapped(x)
    assert out.shape == (2, 48, 5, 3) and torch.equal(out, expect)


def test_fake_quant_linear_rejects_depthwise_and_3x3_convs():
    for conv in (nn.Conv2d(32, 32, 1, groups=32), nn.Conv2d(32, 32, 3, padding=1)):
        with pytest.raises(TypeError):
            FakeQuantLinear(conv)


def test_forward_output_does_not_require_grad():
    wrapped = FakeQuantLinear(nn.Linear(16, 16))
    x = torch.randn(2, 16, requires_grad=True)
    assert not wrapped(x).requires_grad


def test_requantize_encodes_a_new_weight_in_place():
    torch.manual_seed(4)
    lin = nn.Linear(32, 32)
    wrapped = FakeQuantLinear(lin)
    buffers = [wrapped.codes, wrapped.block_scales, wrapped.weight_scale]
    x = torch.randn(3, 32)
    before = wrapped(x)
    new = lin.weight.detach() * -0.5 + 0.1
    wrapped.requantize_(new)
    after = wrapped(x)
    assert [wrapped.codes, wrapped.block_scales, wrapped.weight_scale] == buffers  # refreshed in place
    assert all(a is b for a, b in zip([wrapped.codes, wrapped.block_scales, wrapped.weight_scale], buffers))
    assert not torch.allclose(after, before)
    assert torch.equal(after, F.linear(_per_sample(_fq, x), _fq(new), lin.bias.detach()))
    codes = wrapped.codes.clone()
    # A transposed, flat, conv-shaped or integer weight of the right size is refused, and nothing is written.
    for bad in (torch.zeros(16, 32), torch.zeros(64, 16), torch.zeros(1024), torch.zeros(32, 32, 1, 1)):
        with pytest.raises(ValueError, match="does not fit"):
            wrapped.requantize_(bad)
    with pytest.raises(ValueError, match="does not fit"):
        wrapped.requantize_(torch.zeros(32, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-finite"):
        wrapped.requantize_(torch.full((32, 32), float("nan")))
    assert torch.equal(wrapped.codes, codes)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_weight_encoded_in_chunks_of_rows_is_the_weight_encoded_whole(fmt, monkeypatch):
    """requantize_ encodes a chunk of rows at a time (its working set one chunk's): the same bytes as one call."""
    from solrl.stages.quant import nvfp4

    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    whole = FakeQuantLinear(lin, fmt)
    monkeypatch.setattr(nvfp4, "ENCODE_CHUNK_ELEMENTS", 5 * 64)  # 5 rows a chunk: 10 chunks, a ragged last one
    chunked = FakeQuantLinear(lin, fmt)
    for name, buffer in whole.named_buffers():
        assert torch.equal(buffer, dict(chunked.named_buffers())[name]), name


# --------------------------------------------------------------------------- #
# quantize_model_ / requantize_model_
# --------------------------------------------------------------------------- #


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.small = nn.Linear(16, 16)
        self.odd = nn.Linear(24, 32)
        self.ff = nn.Sequential(nn.Conv2d(32, 64, 1), nn.Conv2d(64, 64, 3, padding=1, groups=64))
        self.proj = nn.Linear(32, 32)


def test_quantize_model_skips_by_name_min_dim_and_block_size():
    model = _Toy()
    names = quantize_model_(model, skip=("embed",), min_dim=16)
    assert names == ["ff.0", "proj"]  # small: max dim 16 <= 16; odd: K=24; ff.1: depthwise
    assert isinstance(model.ff[0], FakeQuantLinear) and model.ff[0].is_conv
    assert type(model.ff[1]) is nn.Conv2d and type(model.odd) is nn.Linear
    assert quantize_model_(model, skip=("embed",), min_dim=16) == []  # idempotent
    fp8 = _Toy()
    assert quantize_model_(fp8, fmt="fp8") == ["embed", "ff.0", "odd", "proj", "small"]


def test_quantize_model_unknown_format_lists_valid_ones():
    with pytest.raises(ValueError, match="nvfp4.*fp8"):
        quantize_model_(_Toy(), fmt="int4")


def test_requantize_model_encodes_the_source_models_weights():
    model, source = _Toy(), _Toy()
    quantize_model_(model)
    weights = {name: m.weight for name, m in source.named_modules() if hasattr(m, "weight")}
    assert requantize_model_(model, weights) == 4  # weight sync from the BF16 model; the others stay as they are
    assert torch.equal(model.proj.dequantized_weight(), _fq(source.proj.weight.detach()))


_SANA_KW = dict(
    in_channels=1, out_channels=1, sample_size=16, patch_size=2, num_layers=1,
    num_attention_heads=2, attention_head_dim=32, num_cross_attention_heads=2,
    cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=32,
    mlp_ratio=2.5, interpolation_scale=1.0,
)  # fmt: skip
_SANA_SKIP = ("patch_embed", "time_embed", "caption_projection", "proj_out", "norm")


def test_quantize_model_on_tiny_sana_transformer_quantizes_attention_and_1x1_ff_convs():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.SanaTransformer2DModel(**_SANA_KW).eval()
    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 1, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(2, 4, 32, generator=gen),
        timestep=torch.tensor([100.0, 700.0]),
    )
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        names = quantize_model_(model, fmt="nvfp4", skip=_SANA_SKIP, min_dim=0)
        blk = "transformer_blocks.0."
        projs = ("to_k", "to_out.0", "to_q", "to_v")
        attn = [f"{blk}{a}.{p}" for a in ("attn1", "attn2") for p in projs]
        assert names == sorted(attn + [f"{blk}ff.conv_inverted", f"{blk}ff.conv_point"])
        assert type(model.transformer_blocks[0].ff.conv_depth) is nn.Conv2d  # depthwise untouched
        assert type(model.proj_out) is nn.Linear and type(model.patch_embed.proj) is nn.Conv2d
        out = model(**inputs, return_dict=False)[0]
        assert out.shape == ref.shape and torch.isfinite(out).all()
        rel = ((out - ref).norm() / ref.norm()).item()
        assert 0.0 < rel < 0.5, rel

        ff_in = model.transformer_blocks[0].ff.conv_inverted
        weight = ff_in.dequantized_weight().view(-1, ff_in.in_features, 1, 1)
        ff_in.requantize_(weight)  # a quantized weight re-encodes to itself: same output
        assert torch.equal(model(**inputs, return_dict=False)[0], out)
        ff_in.requantize_(3.0 * weight)
        assert not torch.allclose(model(**inputs, return_dict=False)[0], out)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_per_sample_activation_scales_equal_quantizing_each_sample_alone(fmt):
    from solrl.stages.quant.nvfp4 import fake_quantize_per_sample, fp8_e4m3_fake_quantize, nvfp4_fake_quantize

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 1.0, 300.0, 0.0, 1e-35])[:, None, None]  # five decades, a zero and a tiny sample
    x = torch.randn(5, 3, 32, generator=g) * scales
    alone = torch.stack([(nvfp4_fake_quantize if fmt == "nvfp4" else fp8_e4m3_fake_quantize)(s) for s in x])
    torch.testing.assert_close(fake_quantize_per_sample(x, fmt), alone, rtol=0, atol=0)
    assert (fake_quantize_per_sample(x, fmt)[3] == 0).all()
    with pytest.raises(ValueError, match="non-finite"):
        fake_quantize_per_sample(torch.tensor([[float("nan")] * 16]), fmt)


def test_the_explore_copy_quantizes_a_sample_the_same_in_any_batch():
    layer = nn.Linear(32, 16)
    per_sample = FakeQuantLinear(layer, "nvfp4")
    per_call = FakeQuantLinear(layer, "nvfp4", activation_scale="call")
    g = torch.Generator().manual_seed(1)
    quiet, loud = torch.randn(1, 4, 32, generator=g), 50 * torch.randn(3, 4, 32, generator=g)
    batch = torch.cat([quiet, loud])
    torch.testing.assert_close(per_sample(batch)[:1], per_sample(quiet), rtol=0, atol=0)
    assert not torch.equal(per_call(batch)[:1], per_call(quiet))  # the batch's amax changes a quiet sample
    with pytest.raises(ValueError, match="activation_scale must be one of"):
        FakeQuantLinear(layer, "nvfp4", activation_scale="token")


def test_the_vectorised_e2m1_rounding_equals_torchaos_bit_level_encoder_on_every_tie_and_its_neighbours():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    from solrl.stages.quant.nvfp4 import _e2m1_round_

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor(E2M1_VALUES)
    points = torch.cat([ties, grid, torch.linspace(0, 6, 120_001)])
    below, above = torch.nextafter(points, torch.zeros(())), torch.nextafter(points, torch.full((), 7.0))
    y = torch.cat([points, below, above]).clamp(0, 6)  # the encoder's input is clamped to [-6, 6]
    y = torch.cat([y, -y])
    expect = f4_unpacked_to_f32(f32_to_f4_unpacked(y))
    assert torch.equal(_e2m1_round_(y.clone()), expect)
    assert _e2m1_round_(torch.tensor([0.25, 0.75, 2.5, 3.5, 5.0])).tolist() == [0.0, 1.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("shape", [(7, 3, 48), (2, 5, 8, 16), (64, 256)])
def test_per_sample_nvfp4_equals_torchaos_nvfp4_quantize_bit_for_bit(shape):
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    from solrl.stages.quant.nvfp4 import fake_quantize_per_sample

    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    x.view(-1)[:7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * x.abs().max() / 6  # ties, if scaled so
    B, K = shape[0], shape[-1]
    rows = x.reshape(-1, K)
    amax = x.reshape(B, -1).abs().amax(1)
    scale = (amax / (448.0 * 6.0)).repeat_interleave(rows.shape[0] // B).unsqueeze(1)
    scales, packed = nvfp4_quantize(rows.contiguous(), block_size=16, per_tensor_scale=scale)
    q = f4_unpacked_to_f32(unpack_uint4(packed.contiguous()).view(rows.shape)).view(rows.shape[0], K // 16, 16)
    expect = ((q * scales.float().view(rows.shape[0], K // 16, 1)).view(rows.shape) * scale).view(shape)
    assert torch.equal(fake_quantize_per_sample(x, "nvfp4"), expect)
