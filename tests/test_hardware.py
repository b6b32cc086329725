"""The parts of the Transformer Engine explore backends that run without a GPU: the row padding around a
quantized GEMM, the one rule for which layers TE takes, and the version floor (issue 35)."""

from __future__ import annotations

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
