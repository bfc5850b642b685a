"""CPU emulation of the SM100 INT8-QK prefill kernel (never ran on hardware) against the fp64 references.

``emulate_prefill_sm100`` models the kernel's arithmetic (int8 scores exact, the kernel's fp32 scale products,
fp32 online softmax tile by tile, P rounded to V's 16-bit type before P.V, fp32 O). Two errors are checked:
  total error  = emulation vs fp64 attention of the unquantized inputs (``attention_reference``)
  kernel error = emulation vs fp64 attention over the *same* int8 Q/K (``prefill_reference(qk_quant="int8")``,
                 exact P and V): what the kernel adds to the INT8 format (P rounding, fp32 softmax)
Measured (B1, S1024, Hq4/Hkv2, D128, bf16, seed 7; docs/sm100.md has the full table): random cos 0.99994 /
NRMSE 1.05 % (causal, per_warp), heavy outliers 0.99897 / 4.53 % (full, per_warp) -- the same as the INT8
reference itself, i.e. the SM90 INT8-QK/bf16-PV numbers; kernel error 0.15-0.24 % NRMSE (bf16 P).
"""

from __future__ import annotations

import math

import pytest
import torch

from qattn.cute_kernels.sm100.emulate_prefill import emulate_prefill_sm100
from qattn.quant.qk_int8 import quantize_qk_int8_reference
from qattn.reference.attention import attention_reference, prefill_reference
from tests.reference.test_prefill_fp8pv import _cos, _nrmse, fp8pv_inputs

# (outliers, causal, granularity, min cos, max NRMSE) vs the unquantized fp64 attention: measured values with margin
TOTAL_CASES = [
    (None, True, "per_warp", 0.999, 0.03),
    (None, False, "per_block", 0.999, 0.03),
    ("k_offset", True, "per_block", 0.999, 0.03),
    ("heavy", True, "per_warp", 0.9988, 0.045),
    ("heavy", False, "per_block", 0.998, 0.058),  # measured 0.99881 / 4.89 %: INT8 Q/K's own error on this input
    ("v_outliers", False, "per_warp", 0.9995, 0.03),
]


@pytest.mark.parametrize("case", TOTAL_CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}")
def test_total_error_vs_exact_attention(case):
    outliers, causal, gran, min_cos, max_nrmse = case
    q, k, v = fp8pv_inputs(1, 1024, 1024, 4, 2, 128, torch.bfloat16, outliers, seed=7)
    o = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran)
    ref = attention_reference(q, k, v, causal=causal)
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    print(f"sm100 prefill emulation {outliers} causal={causal} {gran}: cos {cos:.5f} nrmse {nrmse:.4f}")
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert cos >= min_cos and nrmse <= max_nrmse, (cos, nrmse)


# shapes around the tile edges (128 rows / 128 keys), Sq != Sk both ways, GQA, D64/D128, both v dtypes
EDGE_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal, granularity, dtype
    (2, 128, 128, 4, 2, 128, True, "per_warp", torch.bfloat16),
    (1, 129, 257, 4, 1, 64, True, "per_block", torch.float16),
    (1, 257, 129, 6, 2, 128, True, "per_warp", torch.bfloat16),  # Sq > Sk: the first 128 rows see no key
    (2, 1, 300, 2, 2, 64, True, "per_warp", torch.bfloat16),  # one query row (decode-like)
    (1, 300, 1, 4, 2, 64, False, "per_block", torch.float16),  # one key
    (1, 200, 383, 8, 2, 128, False, "per_warp", torch.float16),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: f"sq{c[1]}-sk{c[2]}-g{c[3] // c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}-{c[7]}-{str(c[8])[6:]}")
def test_kernel_error_vs_int8_reference(case):
    B, Sq, Sk, Hq, Hkv, D, causal, gran, dt = case
    q, k, v = fp8pv_inputs(B, Sq, Sk, Hq, Hkv, D, dt, None, seed=Sq + Sk)
    o, lse = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, return_lse=True)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=gran, return_lse=True)
    assert o.dtype == dt and o.shape == q.shape and lse.shape == (B, Hq, Sq)
    # rows that see no key (causal, Sq > Sk): 0 and -inf, as the kernel writes them
    none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), none)
    assert (o.permute(0, 2, 1, 3)[none] == 0).all()
    # the LSE only sees the int8 scores and the fp32 softmax
    assert torch.allclose(lse[~none].double(), ref_lse[~none], atol=2e-4, rtol=0)
    # P rounded to bf16 (8 bits) / fp16 (11 bits) and the output rounding: the kernel's own error
    bound = 0.005 if dt == torch.bfloat16 else 0.002
    assert _nrmse(o, ref) <= bound, _nrmse(o, ref)
    if not none.all():
        assert _cos(o, ref) >= 0.9999


@pytest.mark.parametrize("causal,window,sq,sk", [(True, (100, 0), 300, 300), (True, (0, 0), 129, 257),
                                                 (False, (64, 64), 257, 129), (False, (150, -1), 200, 383),
                                                 (False, (-1, 3), 300, 300)])
def test_sliding_window_vs_int8_reference(causal, window, sq, sk):
    """window_size: the kernel's tile range (a CTA starts at its first row's window tile) and masks, against the
    fp64 reference of the same int8 Q/K and window."""
    q, k, v = fp8pv_inputs(1, sq, sk, 4, 2, 64, torch.bfloat16, None, seed=sq + sk)
    o, lse = emulate_prefill_sm100(q, k, v, causal=causal, return_lse=True, window_size=window)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", return_lse=True, window_size=window)
    none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), none)
    assert torch.allclose(lse[~none].double(), ref_lse[~none], atol=2e-4, rtol=0)
    assert _nrmse(o, ref) <= 0.005 and _cos(o, ref) >= 0.9999
    full = prefill_reference(q, k, v, causal=causal, qk_quant="int8")
    assert _cos(full, ref) < 0.999  # the window changed the output


def test_p_rounding_is_modelled():
    """The emulation is not the reference: rounding P to bf16 costs ~4-8x more than to fp16 (3 mantissa bits),
    and neither is zero."""
    q, k, v = fp8pv_inputs(1, 256, 512, 2, 1, 64, torch.float32, None, seed=11)
    errs = {}
    for dt in (torch.bfloat16, torch.float16):
        vd = v.to(dt)  # each run against the reference over its own (rounded) V
        errs[dt] = _nrmse(emulate_prefill_sm100(q, k, vd), prefill_reference(q, k, vd, qk_quant="int8"))
    assert 0 < errs[torch.float16] < errs[torch.bfloat16] / 3, errs


def test_scales_are_the_prepass_scales():
    """Passing the prepass's tensors explicitly gives the same result, and a different k scale changes it: the
    emulation reads q_scale / k_scale with the SM90 prepass's shapes and meaning."""
    q, k, v = fp8pv_inputs(1, 160, 260, 4, 2, 64, torch.bfloat16, "k_offset", seed=5)
    quant = quantize_qk_int8_reference(q, k, granularity="per_warp")[:4]
    assert quant[1].shape == (1, 4, 16) and quant[3].shape == (1, 2, 3)
    a = emulate_prefill_sm100(q, k, v, causal=True)
    b = emulate_prefill_sm100(q, k, v, causal=True, quantized=quant)
    assert torch.equal(a, b)
    ks2 = quant[3].clone()
    ks2[0, 1, 2] *= 2.0  # last (ragged) k block of kv head 1 only
    c = emulate_prefill_sm100(q, k, v, causal=True, quantized=(quant[0], quant[1], quant[2], ks2))
    diff = (c.double() - a.double()).abs().amax(dim=(0, 1, 3))  # per q head
    assert diff[:2].max() == 0 and diff[2:].min() > 0  # GQA: q heads 2, 3 read kv head 1


def test_zero_scale_gives_no_nan():
    """An all-zero q group has scale 0: masked scores must stay -inf, not 0 * inf = NaN (kernel: select after
    the multiply)."""
    q, k, v = fp8pv_inputs(1, 130, 200, 2, 1, 64, torch.bfloat16, None, seed=2)
    q[:, :16] = 0
    o, lse = emulate_prefill_sm100(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(o).all()
    ref = attention_reference(q, k, v, causal=True)
    assert _cos(o, ref) > 0.999 and math.isfinite(float(lse[lse > -math.inf].sum()))
