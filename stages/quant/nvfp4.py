"""Emulated (fake-quant) NVFP4 and FP8 W4A4 / W8A8 for the low-precision explore copy.

Format source
-------------
NVIDIA NVFP4 (Blackwell): every value is FP4 **E2M1** (1 sign, 2 exponent,
1 mantissa bit; magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``); every block of
**16** consecutive elements along the reduction dimension (K, in_features)
shares a scale stored as FP8 **E4M3** (max 448); every tensor has one FP32
scale. The convention followed here is the one of DESIGN 2 (``docs/design.md``)::

    g   = amax(|x|) / (448 * 6)                           (FP32; g = 1 without a tensor scale)
    s_b = e4m3(clamp(amax(|block|) / 6 / g, 2^-6, 448))   (clamped to E4M3's smallest normal)
    q   = round_e2m1(clamp(x * ((1 / g) / s_b), -6, 6))   (round to nearest, ties to even)
    x_hat = q * s_b * g

which is exactly what torchao's
``torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize`` computes. This
module does not re-implement the encoder: :func:`nvfp4_fake_quantize` calls
``nvfp4_quantize`` (with ``per_tensor_scale = g`` or ``None``) and only
*decodes* its output (unpacks the uint8-packed E2M1 codes with torchao's
``unpack_uint4`` / ``f4_unpacked_to_f32`` and multiplies by the E4M3 block
scale and the FP32 tensor scale, in that order, in float32).

Choices made here (documented, tested in ``tests/test_nvfp4.py``):

* K (the last dim) not a multiple of 16 raises :class:`ValueError`; it is never
  padded silently. Callers either pad or leave the layer in high precision
  (:func:`quantize_model_` skips such layers).
* Non-finite input raises :class:`ValueError`.
* An all-zero tensor (``g`` would be 0, giving NaN in the encoder) decodes to
  zeros.
* A tensor so small that ``1 / g`` would overflow float32 (``amax < 2^-100``)
  is first multiplied by an exact power of two, quantized, and scaled back;
  NVFP4 is scale-equivariant under powers of two, so this only avoids the
  float32 overflow.
* The quantizers run under ``torch.no_grad()``: no gradient flows through them
  (the quantized copy is used for sampling only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "NVFP4_BLOCK",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E2M1_VALUES",
    "FORMATS",
    "nvfp4_fake_quantize",
    "fp8_e4m3_fake_quantize",
    "FakeQuantLinear",
    "eligible_layers",
    "quantize_model_",
    "requantize_model_",
]

NVFP4_BLOCK: int = 16
"""Elements per NVFP4 block (along the reduction / last dim)."""

E2M1_MAX: float = 6.0
"""Largest FP4 E2M1 magnitude."""

E4M3_MAX: float = 448.0
"""Largest finite FP8 E4M3 (``torch.float8_e4m3fn``) magnitude."""

E4M3_MIN_NORMAL: float = 2.0**-6
"""Smallest normal E4M3 value; NVFP4 block scales are clamped to it before the cast."""

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The 8 non-negative FP4 E2M1 magnitudes, in code order 0b000 .. 0b111."""

FORMATS: tuple[str, ...] = ("nvfp4", "fp8")
"""Formats understood by :class:`FakeQuantLinear` and :func:`quantize_model_`."""

#: Elements of a weight encoded at once by ``FakeQuantLinear.requantize_`` (its float32 working set, about 15x this
#: in bytes for NVFP4 with torchao's temporaries; a FLUX.2-dev layer of 340M weights would otherwise need ~10 GiB).
ENCODE_CHUNK_ELEMENTS: int = 1 << 22

# Below this amax, 1 / g = (448 * 6) / amax could overflow float32 (or lose
# precision to subnormals); such tensors are rescaled by an exact power of two.
_TINY_AMAX: float = 2.0**-100


def _amax_checked(x: torch.Tensor) -> float:
    """``amax(|x|)`` as a Python float; raises ``ValueError`` on inf / NaN (one host sync)."""
    amax = float(x.detach().abs().amax().to(torch.float32)) if x.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError(f"cannot quantize a tensor with non-finite values (shape {tuple(x.shape)}, amax={amax})")
    return amax


def _pow2_exponent(amax: float) -> int:
    """Exponent ``k`` such that ``amax * 2**k`` is about 1 when amax is tiny, else 0."""
    if 0.0 < amax < _TINY_AMAX:
        return -math.frexp(amax)[1]
    return 0


def _nvfp4_parts(x2d: torch.Tensor, *, tensor_scale: bool) -> tuple[torch.Tensor, float, int]:
    """NVFP4-encode a contiguous float32 ``[rows, K]`` tensor with torchao and decode it.

    Returns ``(qs, g, k)`` with ``qs = q * s_b`` (float32 ``[rows, K]``; exactly
    representable in bf16/fp16/fp32: at most 6 significant bits, magnitudes in
    ``[2^-7, 2688]``), ``g`` the FP32 tensor scale as a Python float (1.0 without a
    tensor scale) and ``k`` a power-of-two pre-scale exponent (0 except for tiny
    tensors), such that ``x_hat = (qs * g) * 2**-k`` in float32.

    Raises:
        ValueError: K not a multiple of 16, or non-finite values.
    """
    rows, k_dim = x2d.shape
    codes, scales, g, k = _nvfp4_pack(x2d, tensor_scale=tensor_scale)
    q = unpack_e2m1(codes).view(rows, k_dim // NVFP4_BLOCK, NVFP4_BLOCK)  # float32 E2M1 values
    return (q * scales.to(torch.float32).unsqueeze(-1)).view(rows, k_dim), g, k


def _decode(qs: torch.Tensor, g: float, k: int) -> torch.Tensor:
    """``(qs * g) * 2**-k`` in float32 (the final NVFP4 / FP8 decode step)."""
    out = qs.to(torch.float32) * g
    if k:
        out = out * (2.0**-k)
    return out


def _check_block_dim(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK != 0:
        raise ValueError(
            f"NVFP4 needs the last (reduction) dim to be a multiple of {NVFP4_BLOCK}, "
            f"got shape {tuple(x.shape)}; pad K to a multiple of {NVFP4_BLOCK} or skip "
            "this layer (leave it in high precision)"
        )


@torch.no_grad()
def nvfp4_fake_quantize(x: torch.Tensor, *, tensor_scale: bool = True) -> torch.Tensor:
    """NVFP4 quantize-dequantize along the last dim, in blocks of 16 (DESIGN 2).

    Format: NVIDIA NVFP4 -- E2M1 values, 16-element blocks along the last
    (reduction) dim, FP8 E4M3 block scales (clamped to ``[2^-6, 448]`` before the
    cast), one FP32 tensor scale ``g = amax(|x|) / (448 * 6)``. The encode is
    torchao's ``nvfp4_quantize`` (bit-for-bit DESIGN 2's formula); the decode is
    ``q * s_b * g`` in float32.

    Args:
        x: float tensor ``[..., K]`` (float32, bfloat16 or float16; other float
            dtypes are computed in float32 too). Leading dims are flattened to
            rows; ``K % 16 == 0``.
        tensor_scale: use the FP32 per-tensor scale (two-level scaling). With
            ``False``, ``g = 1`` (single-level scaling, torchao's
            ``per_tensor_scale=None``): block scales saturate at 448, so blocks
            with amax above ``448 * 6 = 2688`` clip to ``±2688``.

    Returns:
        Tensor with the same shape, dtype and device as ``x`` holding the
        dequantized values (computed in float32, then cast to ``x.dtype``). An
        all-zero ``x`` gives zeros. No gradient flows through.

    Raises:
        ValueError: ``x`` is 0-dim or its last dim is not a multiple of 16 (pad it
            or skip the layer), or ``x`` has inf / NaN values.
        TypeError: ``x`` is not a floating-point tensor.
    """
    if not x.is_floating_point():
        raise TypeError(f"nvfp4_fake_quantize needs a floating-point tensor, got {x.dtype}")
    _check_block_dim(x)
    if x.numel() == 0:
        return x.clone()
    x2d = x.detach().to(torch.float32).reshape(-1, x.shape[-1]).contiguous()
    qs, g, k = _nvfp4_parts(x2d, tensor_scale=tensor_scale)
    return _decode(qs, g, k).view(x.shape).to(x.dtype)


def _fp8_parts(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """Per-tensor E4M3 encode/decode of float32 ``x``: ``(e4m3 values as float32, scale, k)``."""
    q, scale, k = _fp8_pack(x)
    return q.to(torch.float32), scale, k


@torch.no_grad()
def fp8_e4m3_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled FP8 E4M3 quantize-dequantize (for FP8 comparison runs).

    ``scale = amax(|x|) / 448`` (FP32); ``x_hat = e4m3(clamp(x / scale, ±448)) * scale``,
    where ``e4m3`` is the round-to-nearest-even cast to ``torch.float8_e4m3fn``.

    Args:
        x: float tensor of any shape (computed in float32).

    Returns:
        Same shape, dtype and device as ``x``. All-zero input gives zeros. No
        gradient flows through.

    Raises:
        ValueError: ``x`` has inf / NaN values.
        TypeError: ``x`` is not a floating-point tensor.
    """
    if not x.is_floating_point():
        raise TypeError(f"fp8_e4m3_fake_quantize needs a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        return x.clone()
    q, scale, k = _fp8_parts(x.detach().to(torch.float32))
    return _decode(q, scale, k).to(x.dtype)


#: How activations get their tensor scale: one per sample (batch-invariant: a sample quantizes the same whatever
#: else is in the batch) or one per forward call (the whole batch's amax, as Transformer Engine's recipes do).
ACTIVATION_SCALES: tuple[str, ...] = ("sample", "call")


def _per_sample_parts(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parts of ``fake_quantize_per_sample``: ``(qs, g, k)`` with ``qs`` float32 ``[B, ..., K]`` (NVFP4:
    ``q * s_b``, the E2M1 values times their E4M3 block scales, exact in bf16; FP8: the E4M3 values), ``g``
    float32 ``[B]`` the per-sample FP32 tensor scales and ``k`` int ``[B]`` the power-of-two pre-scale exponents,
    such that the fake-quantized sample ``b`` is ``(qs[b] * g[b]) * 2**-k[b]`` in float32.

    Raises:
        ValueError: as ``fake_quantize_per_sample``.
    """
    _check_fmt(fmt)
    x = x.detach().to(torch.float32)
    B = x.shape[0]
    amax = x.reshape(B, -1).abs().amax(1)  # [B]
    if torch.compiler.is_compiling():  # a data-dependent raise would break the graph: an assert inside it
        torch._assert_async(torch.isfinite(amax).all(), "cannot quantize a tensor with non-finite values")
    elif not torch.isfinite(amax).all():
        raise ValueError(f"cannot quantize a tensor with non-finite values (shape {tuple(x.shape)})")
    # Exact power-of-two pre-scale of tiny samples (as _pow2_exponent), so 1 / g cannot overflow.
    k = torch.where((amax > 0) & (amax < _TINY_AMAX), -torch.frexp(amax).exponent, 0)  # int [B]
    up = torch.ldexp(torch.ones_like(amax), k)  # 2**k, [B]
    shape = (B, *([1] * (x.dim() - 1)))
    xs = x * up.view(shape)
    amax = amax * up
    if fmt == "nvfp4":
        _check_block_dim(x)
        g = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))  # FP32 tensor scales [B]
        qs = _nvfp4_blocks(xs.reshape(B, -1, x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK), g).view(x.shape)
    else:
        g = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        qs = torch.clamp(xs / g.view(shape), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return qs, g, k


@torch.no_grad()
def fake_quantize_per_sample(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fake-quantize ``x [B, ..., K]`` with one tensor scale per sample (the leading dim): exactly
    ``nvfp4_fake_quantize(x[b])`` (or ``fp8_e4m3_fake_quantize(x[b])``) for every ``b``, in one vectorised call
    (``_nvfp4_blocks``, bit-identical to torchao's ``nvfp4_quantize`` with a per-sample tensor scale). So an
    image's explore samples do not depend on the batch it was drawn in (``explore.batch_size``, shards).

    Returns:
        float32, the shape of ``x``.

    Raises:
        ValueError: non-finite values (traced by ``torch.compile``: a RuntimeError from the graph's assert),
            ``K % 16 != 0`` (nvfp4), unknown ``fmt``.
    """
    _check_fmt(fmt)
    if x.numel() == 0:
        return x.detach().to(torch.float32).clone()
    qs, g, k = _per_sample_parts(x, fmt)
    shape = (x.shape[0], *([1] * (x.dim() - 1)))
    return (qs * g.view(shape)) * torch.ldexp(torch.ones_like(g), -k).view(shape)


def _e2m1_round_(y: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (already clamped to ``[-6, 6]``) in place to the nearest E2M1 value, ties to even.

    The E2M1 grid has spacing 0.5 below 2, 1 in ``[2, 4)`` and 2 in ``[4, 6]``, so ``round(y / step) * step``
    with ``torch.round`` (half to even) is round-to-nearest-even on the grid: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Every step is exact (powers of two). The same values as torchao's
    bit-level ``f32_to_f4_unpacked`` then ``f4_unpacked_to_f32`` (tested on every tie and its neighbours)."""
    a = y.abs()
    step = (a >= 2.0).to(torch.float32).add_((a >= 4.0).to(torch.float32)).exp2_().mul_(0.5)  # 0.5, 1 or 2
    return y.div_(step).round_().mul_(step)


def _nvfp4_blocks(xb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantization of float32 blocks ``xb [B, R, K / 16, 16]`` with FP32 tensor scales ``g [B]``: returns
    ``q * s_b`` (float32, the shape of ``xb``), to be multiplied by ``g``.

    torchao's ``nvfp4_quantize`` formula, operation for operation, so bit-identical to it: block scale
    ``e4m3(clamp(amax_b / 6 / g, 2^-6, 448))``, ``y = clamp(x * ((1 / g) / s_b), -6, 6)`` rounded to E2M1, decoded
    as ``(q * s_b) * g``; but without packing the FP4 codes into bytes and unpacking them again, in place: about
    5x faster on CPU (the activation encode dominated the emulated forward)."""
    g = g.view(-1, 1, 1)
    s_b = xb.abs().amax(-1).div_(E2M1_MAX).div_(g).clamp_(E4M3_MIN_NORMAL, E4M3_MAX)
    s_b = s_b.to(torch.float8_e4m3fn).to(torch.float32)  # the FP8 E4M3 block scales, [B, R, K / 16]
    y = xb * ((1.0 / g) / s_b).unsqueeze(-1)
    y = _e2m1_round_(y.clamp_(-E2M1_MAX, E2M1_MAX))
    return y.mul_(s_b.unsqueeze(-1))


def _nvfp4_pack(
    w2d: torch.Tensor, *, tensor_scale: bool = True, amax: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """NVFP4-encode a float32 ``[rows, K]`` weight with torchao's ``nvfp4_quantize`` and keep it packed.

    Returns ``(codes, block_scales, g, k)``: ``codes`` uint8 ``[rows, K / 2]`` (two E2M1 codes a byte, the even
    element in the low nibble: torchao's ``pack_uint4``, the ``qdata`` of its ``NVFP4Tensor``), ``block_scales``
    ``torch.float8_e4m3fn`` ``[rows, K / 16]``, ``g`` the FP32 tensor scale (1.0 for an all-zero weight, or
    without ``tensor_scale``) and ``k``
    the power-of-two pre-scale exponent of a tiny weight (else 0); the weight is ``((q * s_b) * g) * 2**-k``.
    ``amax``: the whole tensor's (a chunk of rows is then encoded exactly as inside the whole: the encoding is
    block-local once ``g`` and ``k`` are fixed).

    Raises:
        ValueError: K not a multiple of 16, or non-finite values.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    rows, k_dim = w2d.shape
    amax = _amax_checked(w2d) if amax is None else amax
    if amax == 0.0:
        codes = torch.zeros(rows, k_dim // 2, dtype=torch.uint8, device=w2d.device)
        return codes, torch.zeros(rows, k_dim // NVFP4_BLOCK, device=w2d.device).to(torch.float8_e4m3fn), 1.0, 0
    k = _pow2_exponent(amax)
    if k:  # exact: scaling up by a power of two
        w2d, amax = w2d * (2.0**k), amax * (2.0**k)
    # Same expression as torchao's per_tensor_amax_to_scale: FP32 amax / (448 * 6).
    g_t = torch.tensor(amax, dtype=torch.float32, device=w2d.device) / (E4M3_MAX * E2M1_MAX) if tensor_scale else None
    scales, packed = nvfp4_quantize(w2d.contiguous(), block_size=NVFP4_BLOCK, per_tensor_scale=g_t)
    g = 1.0 if g_t is None else float(g_t)
    return packed.view(rows, k_dim // 2), scales.view(rows, k_dim // NVFP4_BLOCK), g, k


def _fp8_pack(w: torch.Tensor, amax: float | None = None) -> tuple[torch.Tensor, float, int]:
    """Per-tensor E4M3 encode of float32 ``w``: ``(values as torch.float8_e4m3fn, scale, k)``, one byte a weight;
    ``amax`` the whole tensor's when ``w`` is a chunk of it."""
    amax = _amax_checked(w) if amax is None else amax
    if amax == 0.0:
        return torch.zeros_like(w).to(torch.float8_e4m3fn), 1.0, 0
    k = _pow2_exponent(amax)
    if k:
        w, amax = w * (2.0**k), amax * (2.0**k)
    scale_t = torch.tensor(amax, dtype=torch.float32, device=w.device) / E4M3_MAX
    return torch.clamp(w / scale_t, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), float(scale_t), k


#: The 16 E2M1 codes' values in code order (sign bit 3): torchao's ``f4_unpacked_to_f32`` of 0..15.
_E2M1_CODE_VALUES: tuple[float, ...] = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))


def unpack_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The E2M1 values of packed codes ``[rows, K / 2]`` uint8 (torchao's layout, even element in the low nibble)
    as ``[rows, K]`` in ``dtype`` (every E2M1 value is exact in bf16, fp16 and fp32)."""
    lut = torch.tensor(_E2M1_CODE_VALUES, dtype=dtype, device=codes.device)
    pairs = torch.stack([lut[(codes & 0xF).long()], lut[(codes >> 4).long()]], dim=-1)
    return pairs.view(codes.shape[0], codes.shape[1] * 2)


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; valid formats: {', '.join(FORMATS)}")


def _is_conv1x1(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and tuple(module.kernel_size) == (1, 1)
        and module.groups == 1
        and module.padding_mode == "zeros"
    )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a quantized layer computes its GEMM in for input ``x``: the autocast dtype where autocast is on,
    else ``x``'s dtype; float32 unless that is bfloat16 or float16."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


class FakeQuantLinear(nn.Module):
    """W4A4 (``"nvfp4"``) or W8A8 (``"fp8"``) packed quantized replacement of a Linear or 1x1 Conv2d.

    Wraps an ``nn.Linear`` or an ``nn.Conv2d`` with ``kernel_size == (1, 1)``,
    ``groups == 1`` and zero padding (Sana's feed-forward uses such convs: a matrix
    multiply over the channel dim, so it is treated as a Linear over channels).

    * The weight (``[out, in]``, or ``[out, in, 1, 1]`` viewed as ``[out, in]``) is
      quantized once, per output row, NVFP4 blocks along ``in`` (fp8: one per-tensor
      E4M3 scale), and only its encoding is kept: NVFP4 ``codes`` (uint8 ``[out, in / 2]``,
      two E2M1 codes a byte, torchao's ``NVFP4Tensor.qdata`` layout), ``block_scales``
      (``float8_e4m3fn`` ``[out, in / 16]``) and the FP32 tensor scale: 4.5 bits a weight;
      FP8 ``codes`` (``float8_e4m3fn`` ``[out, in]``) and its scale: 8 bits a weight. The
      high-precision weight is not kept; :meth:`requantize_` re-encodes a new one in place.
    * Activations are fake-quantized per call: per token for Linear (input
      ``[..., in]``, blocks along the last dim), per pixel for the conv (input
      ``[B, C, H, W]``, blocks along C). The tensor scale (NVFP4's FP32 scale,
      FP8's E4M3 scale) is each sample's amax with ``activation_scale="sample"``
      (default: a sample quantizes the same in any batch), or the amax of the
      whole activation tensor of the call with ``"call"``.
    * The GEMM runs in :func:`compute_dtype`. In float32 the weight and activation are
      decoded whole (``((q * s_b) * g) * 2**-k``, one rounding) and multiplied: the
      reference numerics, bit for bit those of a float32 ``F.linear`` of the fake-quantized
      operands. In bfloat16 / float16 the operands are ``q * s_b`` (exact in those dtypes)
      and both tensor scales are applied to the GEMM's output, as a block-scaled
      tensor-core GEMM does (NVFP4 paper's two-level scaling); the bias is added in
      float32 and the output cast back to the input dtype.

    Sampling only: ``forward`` runs under ``torch.no_grad()``.

    Attributes:
        format: ``"nvfp4"`` or ``"fp8"``.
        is_conv: whether the replaced module is a 1x1 ``nn.Conv2d``.
        in_features, out_features: the matmul's K and N.
        codes, block_scales: buffers, the weight's encoding (above), the float8 ones held as their uint8 bits
            so that ``model.to(dtype)`` cannot cast them (``block_scales`` is empty for fp8).
        weight_scale: buffer, int32 ``[]``: the bits of the FP32 tensor scale (an integer buffer, so
            ``model.to(dtype)`` cannot round it); ``weight_pow2``: int32 ``[]``, the power-of-two pre-scale
            exponent ``k`` (0 but for tiny weights). Tensors, not Python numbers, so that a re-quantization
            changes no constant a compiled graph was specialised on.
        bias: the replaced module's bias Parameter (shared), or None.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor

    def __init__(
        self,
        module: nn.Module,
        fmt: str = "nvfp4",
        activation_scale: str = "sample",
        weight: torch.Tensor | None = None,
    ) -> None:
        """Quantize ``module``'s weight (or ``weight``, of its shape: a merged weight). ``activation_scale``: one
        of ``ACTIVATION_SCALES``. ``module`` itself is not kept: only its bias and its conv geometry.

        Raises:
            ValueError: unknown ``fmt`` or ``activation_scale``; ``in_features % 16 != 0`` with ``"nvfp4"``;
                non-finite weights.
            TypeError: ``module`` is neither ``nn.Linear`` nor an eligible 1x1
                ``nn.Conv2d`` (groups == 1, zero padding).
        """
        super().__init__()
        _check_fmt(fmt)
        if isinstance(module, nn.Linear):
            is_conv = False
            in_f, out_f = module.in_features, module.out_features
        elif _is_conv1x1(module):
            is_conv = True
            in_f, out_f = module.in_channels, module.out_channels
        else:
            raise TypeError(
                f"FakeQuantLinear wraps nn.Linear or a 1x1 nn.Conv2d with groups=1 and zero padding, got {module!r}"
            )
        if fmt == "nvfp4" and in_f % NVFP4_BLOCK != 0:
            raise ValueError(
                f"NVFP4 needs in_features to be a multiple of {NVFP4_BLOCK}, got "
                f"weight shape {tuple(module.weight.shape)}; pad it or skip this layer"
            )
        if activation_scale not in ACTIVATION_SCALES:
            raise ValueError(f"activation_scale must be one of {ACTIVATION_SCALES}, got {activation_scale!r}")
        self.format: str = fmt
        self.activation_scale: str = activation_scale
        self.is_conv: bool = is_conv
        self.in_features: int = in_f
        self.out_features: int = out_f
        self.conv_args: dict = (
            dict(stride=module.stride, padding=module.padding, dilation=module.dilation) if is_conv else {}
        )
        self.register_parameter("bias", module.bias)
        device = module.weight.device
        nvfp4 = fmt == "nvfp4"
        # float8 encodings are kept as their uint8 bits, so ``model.to(dtype)`` cannot cast them.
        self.register_buffer(
            "codes", torch.empty((out_f, in_f // 2 if nvfp4 else in_f), dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "block_scales", torch.empty((out_f, in_f // NVFP4_BLOCK if nvfp4 else 0), dtype=torch.uint8, device=device)
        )
        self.register_buffer("weight_scale", torch.zeros((), dtype=torch.int32, device=device))
        self.register_buffer("weight_pow2", torch.zeros((), dtype=torch.int32, device=device))
        if module.weight.device.type != "meta":
            self.requantize_(module.weight if weight is None else weight)

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> FakeQuantLinear:
        """Encode ``weight`` (``[out, in]``; a conv's ``[out, in, 1, 1]``; any float dtype, e.g. the merged rollout
        weight after an update) into this layer's buffers, in place: the buffers keep their identity (weight
        sync, no rebuild; a compiled graph stays valid). Returns ``self``.

        Raises:
            ValueError: ``weight`` is not a float tensor of this layer's shape (a conv's may be ``[out, in]`` too),
                or has non-finite values; the buffers are then unchanged.
        """
        out_f, in_f = self.out_features, self.in_features
        shapes = ((out_f, in_f), (out_f, in_f, 1, 1)) if self.is_conv else ((out_f, in_f),)
        if tuple(weight.shape) not in shapes or not weight.is_floating_point():
            kind, want = ("conv1x1" if self.is_conv else "linear"), " or ".join(map(str, shapes))
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} and dtype {weight.dtype} does not fit a {in_f} -> {out_f} "
                f"{kind} layer (a float tensor of shape {want})"
            )
        w2d = weight.detach().reshape(out_f, in_f)
        amax = _amax_checked(w2d)  # the whole weight's; nothing is written before this check
        # Encoded in chunks of rows, each upcast to float32 on its own: the working set is one chunk's, not a
        # float32 copy of the whole weight and torchao's temporaries of it; the bytes are those of one call.
        step = max(1, ENCODE_CHUNK_ELEMENTS // in_f)
        for r0 in range(0, out_f, step):
            chunk = w2d[r0 : r0 + step].to(self.codes.device, torch.float32).contiguous()
            if self.format == "nvfp4":
                codes, block_scales, scale, k = _nvfp4_pack(chunk, amax=amax)
                self.block_scales[r0 : r0 + step].copy_(block_scales.view(torch.uint8))
            else:
                codes, scale, k = _fp8_pack(chunk, amax=amax)
            self.codes[r0 : r0 + step].copy_(codes.view(torch.uint8))
        self.weight_scale.copy_(torch.tensor(scale, dtype=torch.float32).view(torch.int32))
        self.weight_pow2.fill_(k)
        return self

    def weight_parts(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight without its tensor scale, ``[out, in]`` in ``dtype``: NVFP4 ``q * s_b``, FP8 the E4M3 values
        (exact in bf16, fp16 and fp32)."""
        if self.format == "fp8":
            return self.codes.view(torch.float8_e4m3fn).to(dtype)
        q = unpack_e2m1(self.codes, dtype).view(self.out_features, -1, NVFP4_BLOCK)
        return (q * self.block_scales.view(torch.float8_e4m3fn).to(dtype).unsqueeze(-1)).view(
            self.out_features, self.in_features
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The quantized weight decoded, float32 ``[out, in]`` (== ``fq(weight)`` in float32): ``q * s_b``, then
        the tensor scale, then the power-of-two exponent."""
        out = self.weight_parts(torch.float32) * self.weight_scale.view(torch.float32)
        return torch.ldexp(out, -self.weight_pow2)

    def _activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_per_sample_parts`` of activations ``[B, ..., K]``: one tensor scale per sample, or per call
        (the whole call as one sample; no host sync, so it compiles into the block's graph)."""
        if self.activation_scale == "sample":
            return _per_sample_parts(x, self.format)
        qs, g, k = _per_sample_parts(x.unsqueeze(0), self.format)
        return qs.squeeze(0), g.expand(x.shape[0]), k.expand(x.shape[0])

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if not self.is_conv:
            return F.linear(x, w, b)
        return F.conv2d(x, w.view(self.out_features, self.in_features, 1, 1), b, **self.conv_args)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Quantized matmul.

        Args:
            x: Linear: ``[..., in_features]``; conv: ``[B, in_channels, H, W]``
                (or unbatched ``[in_channels, H, W]``); float32 / bfloat16 / float16.

        Returns:
            Linear: ``[..., out_features]``; conv: ``[B, out_channels, H', W']``;
            dtype of ``x``.

        Raises:
            ValueError: non-finite activations (RuntimeError inside a compiled block).
        """
        dtype = compute_dtype(x)
        unbatched = self.is_conv and x.dim() == 3  # a conv's unbatched [C, H, W] input is one sample
        xf = x.to(torch.float32)
        if unbatched or x.dim() == 1:
            xf = xf.unsqueeze(0)
        if self.is_conv:
            xf = xf.movedim(1, -1).contiguous()  # [B, H, W, C]: blocks along the channels
        if xf.numel() == 0:
            return self._matmul(x, self.dequantized_weight().to(x.dtype), self.bias)
        qs, g, k = self._activation(xf)
        if self.is_conv:
            qs = qs.movedim(-1, 1)
        shape = (qs.shape[0], *([1] * (qs.dim() - 1)))
        b = None if self.bias is None else self.bias.detach().to(torch.float32)
        if dtype == torch.float32:  # the reference: both operands decoded whole in float32
            xq = (qs * g.view(shape)) * torch.ldexp(torch.ones_like(g), -k).view(shape)
            out = self._matmul(xq, self.dequantized_weight(), b)
        else:  # block-scaled operands in bf16 / fp16, both tensor scales applied to the GEMM's output
            with torch.autocast(x.device.type, enabled=False):
                out = self._matmul(qs.to(dtype), self.weight_parts(dtype), None).to(torch.float32)
            w_scale = torch.ldexp(self.weight_scale.view(torch.float32), -self.weight_pow2)
            out = out * (torch.ldexp(g, -k) * w_scale).view(shape)
            if b is not None:
                out = out + (b.view(-1, 1, 1) if self.is_conv else b)
        if unbatched or x.dim() == 1:
            out = out.squeeze(0)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "conv1x1" if self.is_conv else "linear"
        return (
            f"format={self.format!r}, kind={kind}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


def _eligible_dims(module: nn.Module) -> tuple[int, int] | None:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if _is_conv1x1(module):
        assert isinstance(module, nn.Conv2d)
        return module.in_channels, module.out_channels
    return None


def eligible_layers(
    model: nn.Module, *, fmt: str = "nvfp4", skip: Sequence[str] = (), min_dim: int = 0
) -> list[tuple[str, nn.Module]]:
    """The layers a low-precision explore copy quantizes, in ``named_modules`` order (Sol-RL's rule).

    Eligible: every ``nn.Linear`` and every 1x1 ``nn.Conv2d`` with ``groups == 1``
    and zero padding. Other convs (depthwise, 3x3, patch embedders) are never
    touched, nor are :class:`FakeQuantLinear` modules already in place. A module
    is skipped when its qualified name contains any of the ``skip`` substrings,
    when ``max(in, out) <= min_dim``, or (``"nvfp4"`` only) when ``in % 16 != 0``.

    Raises:
        ValueError: unknown ``fmt`` (the message lists the valid ones).
    """
    _check_fmt(fmt)
    return [
        (name, module)
        for name, module in model.named_modules()
        if name and layer_eligible(name, module, fmt=fmt, skip=skip, min_dim=min_dim)
    ]


def layer_eligible(
    name: str, module: nn.Module, *, fmt: str = "nvfp4", skip: Sequence[str] = (), min_dim: int = 0
) -> bool:
    """Whether the layer ``name`` is one the explore copy quantizes (the rule of :func:`eligible_layers`)."""
    if isinstance(module, FakeQuantLinear):
        return False
    dims = _eligible_dims(module)
    if dims is None or any(s in name for s in skip):
        return False
    in_f, out_f = dims
    if max(in_f, out_f) <= min_dim:
        return False
    return not (fmt == "nvfp4" and in_f % NVFP4_BLOCK != 0)


def quantize_model_(
    model: nn.Module,
    *,
    fmt: str = "nvfp4",
    skip: Sequence[str] = (),
    min_dim: int = 0,
    activation_scale: str = "sample",
) -> list[str]:
    """Replace the :func:`eligible_layers` of ``model`` with :class:`FakeQuantLinear`, in place.

    Args:
        model: the module to modify (in place).
        fmt: ``"nvfp4"`` (W4A4) or ``"fp8"`` (W8A8).
        skip: name substrings to leave in high precision (embedders, norms,
            final layer: the per-model lists live with the model adapters).
        min_dim: skip layers whose ``max(in, out) <= min_dim``.
        activation_scale: ``"sample"`` or ``"call"`` (see :class:`FakeQuantLinear`).

    Returns:
        The sorted qualified names of the modules that were quantized.

    Raises:
        ValueError: unknown ``fmt`` (the message lists the valid ones).
    """
    targets = eligible_layers(model, fmt=fmt, skip=skip, min_dim=min_dim)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FakeQuantLinear(module, fmt, activation_scale))
    return sorted(name for name, _ in targets)


def requantize_model_(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> int:
    """Encode ``weights[name]`` into every :class:`FakeQuantLinear` of ``model`` whose qualified name is in
    ``weights`` (:meth:`FakeQuantLinear.requantize_`, in place: a weight sync, no module rebuild).

    Returns:
        How many modules were re-quantized.
    """
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantLinear) and name in weights:
            module.requantize_(weights[name])
            n += 1
    return n
