"""Low-precision explore copy: emulated NVFP4 (W4A4) and FP8 (W8A8) fake quantization, Transformer Engine
hardware backends, and the explore-backend registry (:mod:`.backends`).

See :mod:`.nvfp4` and DESIGN 2 (``docs/design.md``) for the numerics.
"""

from . import backends
from .nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    FORMATS,
    NVFP4_BLOCK,
    FakeQuantLinear,
    eligible_layers,
    fp8_e4m3_fake_quantize,
    nvfp4_fake_quantize,
    quantize_model_,
    requantize_model_,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "FORMATS",
    "NVFP4_BLOCK",
    "FakeQuantLinear",
    "backends",
    "eligible_layers",
    "fp8_e4m3_fake_quantize",
    "nvfp4_fake_quantize",
    "quantize_model_",
    "requantize_model_",
]
