"""CPU: accuracy of the FP8 P x V prefill's arithmetic (``qattn.reference.prefill_fp8pv``, the exact emulation
that the GPU kernel is tested against) vs fp64 attention of the unquantized inputs.

Recorded (this test's inputs: B=1, S=1024, Hq=4, Hkv=2, D=128, bf16, per-warp q scales, K smoothed; the INT8-QK /
bf16-PV column is ``prefill_reference(qk_quant="int8")`` rounded to bf16, for comparison):

==============  ======  =================  =================
inputs          causal  FP8 PV cos / NRMSE  bf16 PV cos / NRMSE
==============  ======  =================  =================
random          yes     0.99943 / 3.38%    0.99995 / 1.05%
random          no      0.99928 / 3.79%    0.99992 / 1.24%
k_offset        yes     0.99943 / 3.38%    0.99994 / 1.05%
k_offset        no      0.99928 / 3.79%    0.99992 / 1.24%
heavy           yes     0.99883 / 4.85%    0.99931 / 3.73%
heavy           no      0.99841 / 5.63%    0.99897 / 4.53%
v_outliers      yes     0.99972 / 2.54%    0.99997 / 0.72%
v_outliers      no      0.99921 / 4.00%    0.99990 / 1.38%
==============  ======  =================  =================

(random: randn Q/K/V; k_offset: + 10 on three K channels; heavy: also Q channels 0-3 and K channels 5-7 x 4;
v_outliers: V channels 0-3 x 20 and every 97th token x 8.) The ~3.5% NRMSE is E4M3's 3-bit mantissa on P and V
(a relative step of 2^-3 .. 2^-4 per element); SageAttention2 reports the same order for its FP8 P x V.
"""

from __future__ import annotations

import math

import pytest
import torch

from qattn.reference.attention import attention_reference, prefill_reference
from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation


def fp8pv_inputs(B, Sq, Sk, Hq, Hkv, D, dtype, outliers=None, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g, device=device)
    k = torch.randn(B, Sk, Hkv, D, generator=g, device=device)
    v = torch.randn(B, Sk, Hkv, D, generator=g, device=device)
    if outliers:
        k[..., 10:13] += 10.0
        if outliers == "heavy":
            q[..., :4] *= 4.0
            k[..., 5:8] *= 4.0
        if outliers == "v_outliers":
            v[..., :4] *= 20.0
            v[:, ::97] *= 8.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _nrmse(x, ref):
    return float((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def _cos(x, ref):
    return float(torch.nn.functional.cosine_similarity(x.double().flatten(), ref.flatten(), dim=0))


# (outliers, causal, min cos, max NRMSE): the measured values above with some margin
CASES = [(None, True, 0.9993, 0.037), (None, False, 0.9991, 0.041), ("k_offset", True, 0.9993, 0.037),
         ("heavy", True, 0.9986, 0.052), ("heavy", False, 0.9982, 0.06), ("v_outliers", True, 0.9996, 0.028),
         ("v_outliers", False, 0.9991, 0.043)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}")
def test_fp8pv_format_error(case):
    outliers, causal, min_cos, max_nrmse = case
    q, k, v = fp8pv_inputs(1, 1024, 1024, 4, 2, 128, torch.bfloat16, outliers, seed=7)
    o = prefill_fp8pv_emulation(q, k, v, causal=causal)
    ref = attention_reference(q, k, v, causal=causal)
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    print(f"fp8 PV {outliers} causal={causal}: cos {cos:.5f} nrmse {nrmse:.4f}")
    assert cos >= min_cos and nrmse <= max_nrmse, (cos, nrmse)


@pytest.mark.parametrize("causal", [False, True])
def test_emulation_lse_and_masks(causal):
    # ragged tiles, Sq != Sk, GQA; the LSE only sees the INT8 scores (the row sum adds the unrounded fp32 P) and
    # the kernel's fp32 exp2 argument: the score bias comes out in an FMA with the rounded offset
    # fp32(1.5 * 2^23 * scale) + max, off by up to ~ulp(1.5 * 2^23 * scale) (~1e-4 here) from the exact argument
    q, k, v = fp8pv_inputs(2, 77, 333, 4, 2, 64, torch.bfloat16, seed=3)
    o, lse = prefill_fp8pv_emulation(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert torch.allclose(lse, ref_lse, atol=5e-4, rtol=0)
    assert _cos(o, ref) > 0.999


@pytest.mark.parametrize("causal,window", [(True, (150, 0)), (False, (64, 100)), (False, (200, -1))])
def test_emulation_sliding_window(causal, window):
    # the window's masks as in the exact reference (same LSE tolerance as above); the tiles wholly left of a
    # row's window add nothing (exp2(-inf) = 0), so skipping them, as the kernel does, changes nothing
    q, k, v = fp8pv_inputs(2, 77, 333, 4, 2, 64, torch.bfloat16, seed=5)
    o, lse = prefill_fp8pv_emulation(q, k, v, causal=causal, return_lse=True, window_size=window)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", return_lse=True, window_size=window)
    full = prefill_reference(q, k, v, causal=causal, qk_quant="int8")
    assert torch.allclose(lse, ref_lse, atol=5e-4, rtol=0)
    assert _cos(o, ref) > 0.999 and _cos(full, ref) < 0.99  # the window changed the output


def test_emulation_rows_without_keys():
    q, k, v = fp8pv_inputs(1, 300, 100, 2, 2, 64, torch.bfloat16, seed=3)
    o, lse = prefill_fp8pv_emulation(q, k, v, causal=True, return_lse=True)
    assert torch.all(o[:, :200] == 0) and torch.all(torch.isneginf(lse[:, :, :200]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, 200:]).all()


def test_emulation_single_key_is_exact_up_to_v_rounding():
    # one key: P' = 448 exactly (E4M3 max), so out = e4m3(v / s) * s, rounded to bf16
    from qattn.quant.v_fp8 import dequantize_v_fp8_reference, quantize_v_fp8_reference

    q, k, v = fp8pv_inputs(1, 10, 1, 2, 1, 64, torch.bfloat16, seed=4)
    o = prefill_fp8pv_emulation(q, k, v, out_dtype=torch.float64)
    vt, vs = quantize_v_fp8_reference(v)
    deq = dequantize_v_fp8_reference(vt, vs, 1).double()
    assert torch.allclose(o, deq.expand(1, 10, 2, 64), rtol=1e-6, atol=0)
    assert math.isclose(float((o[0, 0, 0] - v[0, 0, 0].double()).abs().max() / v.double().abs().max()), 0.0,
                        abs_tol=2.0**-4)
