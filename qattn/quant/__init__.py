"""Quantization references (exact element casts, KV-format encoders/decoders, INT8 Q/K quantization) and the
INT8 Q/K prepass kernels' entry points (:func:`quantize_qk_int8`, :func:`quantize_qk_int8_varlen`), and the FP8 V
prepass (:func:`quantize_v_fp8` / :func:`quantize_v_fp8_varlen`, references :func:`quantize_v_fp8_reference` /
:func:`quantize_v_fp8_varlen_reference`) of the FP8 P x V prefill."""

from .launch import quantize_qk_int8, quantize_qk_int8_varlen
from .qk_int8 import dequantize_qk_int8_reference, quantize_qk_int8_reference, quantize_qk_int8_varlen_reference
from .reference import (
    E2M1_MAX,
    E4M3_MAX,
    FP32_MIN_NORMAL,
    INT8_MAX,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    fake_quantize,
    mx_shared_exponent,
    pack_e2m1,
    quantize,
    ue8m0_decode,
    unpack_e2m1,
)
from .v_fp8 import (dequantize_v_fp8_reference, quantize_v_fp8, quantize_v_fp8_reference, quantize_v_fp8_varlen,
                    quantize_v_fp8_varlen_reference)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "FP32_MIN_NORMAL",
    "INT8_MAX",
    "dequantize",
    "dequantize_qk_int8_reference",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "fake_quantize",
    "mx_shared_exponent",
    "pack_e2m1",
    "quantize",
    "quantize_qk_int8",
    "quantize_qk_int8_reference",
    "quantize_qk_int8_varlen",
    "quantize_qk_int8_varlen_reference",
    "ue8m0_decode",
    "unpack_e2m1",
    "quantize_v_fp8",
    "quantize_v_fp8_reference",
    "quantize_v_fp8_varlen",
    "quantize_v_fp8_varlen_reference",
    "dequantize_v_fp8_reference",
]
