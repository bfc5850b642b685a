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

import itertools
import math

import pytest
import torch

from qattn.cute_kernels.sm100.emulate_prefill import emulate_prefill_sm100, emulate_prefill_varlen_sm100
from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference
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
    # the LSE only sees the int8 scores, the fp32 softmax and K's smoothing mean put back (the reference's
    # lse_smoothing_shift over the same int8 Q)
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


# ---- softcap ------------------------------------------------------------------------------------------------------
def _offset_k_inputs(B, Sq, Sk, Hq, Hkv, D, seed):
    """Random bf16 inputs whose K has a mean of ~3 in every channel: smoothing takes q . k_mean (~3 in z units at
    D128) out of each row's scores, so a capped kernel that forgot to add it back fails the tests below."""
    q, k, v = fp8pv_inputs(B, Sq, Sk, Hq, Hkv, D, torch.float32, None, seed=seed)
    return q.bfloat16(), (k + 3.0).bfloat16(), v.bfloat16()


def _dequantized(q8, qs, k8, ks, k_mean, granularity):
    """fp64 Q and K exactly as the int8 kernel sees them, K's smoothing mean added back: (B, S, H, D)."""
    q_rows = 16 if granularity == "per_warp" else 128
    rows, keys = torch.arange(q8.shape[1]), torch.arange(k8.shape[1])
    qd = q8.double() * qs.double()[:, :, rows // q_rows].transpose(1, 2)[..., None]
    kd = k8.double() * ks.double()[:, :, keys // 128].transpose(1, 2)[..., None] + k_mean.double()[:, None]
    return qd, kd


# (softcap, causal, window_size, granularity, Hq, Hkv, D): caps 1 and 2 are small enough that ignoring the cap
# (or the smoothing shift) changes the output far beyond the INT8 error; 50 (Gemma 2's) barely caps random scores
SOFTCAP_CASES = [
    (1.0, True, (-1, -1), "per_warp", 4, 2, 128),
    (2.0, False, (-1, -1), "per_block", 4, 1, 64),
    (1.0, False, (64, 16), "per_warp", 4, 4, 128),
    (2.0, True, (100, 0), "per_block", 6, 2, 128),
    (50.0, True, (-1, -1), "per_warp", 4, 2, 128),
    (50.0, False, (-1, -1), "per_block", 2, 1, 64),
]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"cap{c[0]:g}-{'causal' if c[1] else 'full'}"
                         f"-w{c[2][0]}_{c[2][1]}-{c[3]}-g{c[4] // c[5]}-d{c[6]}")
def test_softcap_vs_exact_attention(case):
    """softcap vs fp64 attention of the unquantized inputs with the same cap (K with a per-channel mean of 3)."""
    cap, causal, ws, gran, Hq, Hkv, D = case
    q, k, v = _offset_k_inputs(1, 300, 383, Hq, Hkv, D, seed=int(cap) + D)
    o, lse = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, window_size=ws, softcap=cap,
                                   return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=ws, softcap=cap, return_lse=True)
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    print(f"sm100 prefill softcap {case}: cos {cos:.5f} nrmse {nrmse:.4f}")
    assert cos >= 0.999 and nrmse <= 0.03, (cos, nrmse)
    none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), none)
    # measured <= 0.075: Q's int8 rounding times K's large mean shifts whole rows (the format's error, not the cap's)
    assert torch.allclose(lse[~none].double(), ref_lse[~none], atol=0.1, rtol=0)
    if cap <= 2.0:
        # the test can tell: without the cap, or without K's smoothing shift (a kernel given no mean), it fails
        nocap = attention_reference(q, k, v, causal=causal, window_size=ws)
        assert _nrmse(o, nocap) > 0.2, _nrmse(o, nocap)
        quant = quantize_qk_int8_reference(q, k, granularity=gran)[:4]  # no k_mean: no shift added back
        no_shift = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, window_size=ws, softcap=cap,
                                         quantized=quant)
        assert _nrmse(no_shift, ref) > 0.2, _nrmse(no_shift, ref)


@pytest.mark.parametrize("cap,causal,gran,sq,sk,smooth", [(1.0, True, "per_warp", 257, 129, True),
                                                           (2.0, False, "per_block", 129, 300, True),
                                                           (0.5, True, "per_warp", 200, 383, False)])
def test_softcap_kernel_error_vs_int8_reference(cap, causal, gran, sq, sk, smooth):
    """softcap's own error: vs fp64 attention with the same cap over the *same* int8 Q/K (K's mean added back, as
    the kernel does; an unsmoothed K has none): only P rounding, fp32 softmax and the fp32 shift remain. Rows of a
    causal Sq > Sk that see no key stay 0 / -inf."""
    q, k, v = _offset_k_inputs(2, sq, sk, 4, 2, 128, seed=sq + sk)
    q8, qs, k8, ks, k_mean = quantize_qk_int8_reference(q, k, granularity=gran, smooth_k=smooth)[:5]
    if k_mean is None:
        k_mean = torch.zeros(2, 2, 128)
    o, lse = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, softcap=cap, return_lse=True,
                                   quantized=(q8, qs, k8, ks, k_mean if smooth else None))
    qd, kd = _dequantized(q8, qs, k8, ks, k_mean, gran)
    ref, ref_lse = attention_reference(qd, kd, v, causal=causal, softcap=cap, return_lse=True)
    none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), none)
    assert torch.allclose(lse[~none].double(), ref_lse[~none], atol=2e-4, rtol=0)
    assert _nrmse(o, ref) <= 0.005 and _cos(o, ref) >= 0.9999, (_nrmse(o, ref), _cos(o, ref))


# ---- varlen (packed sequences) --------------------------------------------------------------------------------------
def _packed(lens_q, lens_k, Hq, Hkv, D, dtype, seed, k_offset=0.0):
    """Per-sequence random inputs (K offset by ``k_offset`` in every channel) and their packed concatenation with
    int32 cu_seqlens: (seqs, q, k, v, cu_q, cu_k)."""
    seqs = []
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q, k, v = fp8pv_inputs(1, lq, lk, Hq, Hkv, D, torch.float32, None, seed=seed + i)
        seqs.append((q.to(dtype), (k + k_offset).to(dtype), v.to(dtype)))
    cat = lambda j: torch.cat([s[j][0] for s in seqs])  # noqa: E731
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)  # noqa: E731
    return seqs, cat(0), cat(1), cat(2), cu(lens_q), cu(lens_k)


# (lens_q, lens_k, causal, window_size, softcap, granularity, Hq, Hkv, D, V dtype): ragged lengths -- 1-token
# sequences, an empty query sequence, a sequence of 0 keys, lengths that are not multiples of 128 (tiles that cross
# into the next sequence), Sq != Sk both ways (causal rows that see no key)
VARLEN_CASES = [
    ([1, 300, 129, 0, 64, 200], [5, 300, 400, 7, 1, 130], False, (-1, -1), 0.0, "per_warp", 4, 2, 128,
     torch.bfloat16),
    ([1, 300, 129, 64, 200], [1, 300, 400, 0, 130], True, (-1, -1), 0.0, "per_block", 4, 1, 64, torch.float16),
    ([257, 3, 140], [129, 3, 383], True, (-1, -1), 0.0, "per_warp", 6, 2, 64, torch.bfloat16),  # Sq > Sk
    ([200, 77, 300], [383, 77, 129], True, (100, 0), 0.0, "per_warp", 4, 2, 128, torch.bfloat16),
    ([200, 77, 300], [383, 77, 129], False, (64, 16), 0.0, "per_block", 4, 4, 64, torch.float16),
    ([130, 1, 250], [300, 40, 250], True, (-1, -1), 1.0, "per_warp", 4, 2, 128, torch.bfloat16),
    ([130, 1, 250], [300, 40, 250], False, (50, 20), 2.0, "per_block", 4, 1, 64, torch.bfloat16),
]


def _varlen_id(c):
    return (f"{'causal' if c[2] else 'full'}-w{c[3][0]}_{c[3][1]}-cap{c[4]:g}-{c[5]}-g{c[6] // c[7]}-d{c[8]}"
            f"-{str(c[9])[6:]}-{len(c[0])}seqs")


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_id)
def test_varlen_vs_per_sequence_references(case):
    """Each sequence of the varlen emulation against fp64 attention of that sequence alone: over the same int8 Q/K
    (K's mean added back with a softcap: the kernel's own error) and over the unquantized inputs (the total
    error). A sequence without keys writes 0 and LSE -inf; an empty one writes nothing."""
    lens_q, lens_k, causal, ws, cap, gran, Hq, Hkv, D, dt = case
    seqs, q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, Hq, Hkv, D, dt, seed=D + Hq, k_offset=3.0 if cap else 0.0)
    mq, mk = max(lens_q), max(lens_k)
    o, lse = emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, mq, mk, causal=causal, granularity=gran,
                                          window_size=ws, softcap=cap, return_lse=True)
    assert o.shape == q.shape and o.dtype == dt and lse.shape == (Hq, q.shape[0])
    row = 0
    for (qi, ki, vi), lq, lk in zip(seqs, lens_q, lens_k):
        got, got_lse = o[row:row + lq][None], lse[:, row:row + lq][None]
        row += lq
        if lq == 0:
            continue
        if lk == 0:  # no keys: 0 and -inf, as the kernel writes a row without visible keys
            assert (got == 0).all() and torch.isinf(got_lse).all() and (got_lse < 0).all()
            continue
        if cap:  # the capped kernel adds K's smoothing mean back: fp64 over the int8 Q/K with the mean
            q8, qs, k8, ks, k_mean = quantize_qk_int8_reference(qi, ki, granularity=gran)[:5]
            qd, kd = _dequantized(q8, qs, k8, ks, k_mean, gran)
            ref, ref_lse = attention_reference(qd, kd, vi, causal=causal, window_size=ws, softcap=cap,
                                               return_lse=True)
        else:  # softmax is invariant to the mean: fp64 over the int8 Q/K (smoothed K), the LSE with the mean put back
            ref, ref_lse = prefill_reference(qi, ki, vi, causal=causal, qk_quant="int8", granularity=gran,
                                             window_size=ws, return_lse=True)
        none = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(got_lse), none)
        assert (got.permute(0, 2, 1, 3)[none] == 0).all()
        if none.all():
            continue
        assert torch.allclose(got_lse[~none].double(), ref_lse[~none], atol=2e-4, rtol=0)
        bound = 0.005 if dt == torch.bfloat16 else 0.002
        assert _nrmse(got, ref) <= bound and _cos(got, ref) >= 0.9999, (lq, lk, _nrmse(got, ref))
        exact = attention_reference(qi, ki, vi, causal=causal, window_size=ws, softcap=cap)
        if lq * lk >= 1000:  # a few scores are too few for an NRMSE bound of the INT8 format's error
            assert _cos(got, exact) >= 0.999 and _nrmse(got, exact) <= 0.03, (lq, lk, _nrmse(got, exact))


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_id)
def test_varlen_equals_dense_per_sequence(case):
    """The varlen model is the dense model run on each sequence alone, bit for bit (outputs and LSE): the keys a
    tile reads past its sequence's end (the next sequence's) are masked, P = 0 there, and 0 * finite V adds
    exactly 0; the per-sequence scales, k means and masks are the dense ones."""
    lens_q, lens_k, causal, ws, cap, gran, Hq, Hkv, D, dt = case
    seqs, q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, Hq, Hkv, D, dt, seed=D, k_offset=3.0 if cap else 0.0)
    o, lse = emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                          granularity=gran, window_size=ws, softcap=cap, return_lse=True)
    row = 0
    for (qi, ki, vi), lq, lk in zip(seqs, lens_q, lens_k):
        if lq and lk:
            od, ld = emulate_prefill_sm100(qi, ki, vi, causal=causal, granularity=gran, window_size=ws, softcap=cap,
                                           return_lse=True)
            assert torch.equal(o[row:row + lq], od[0]) and torch.equal(lse[:, row:row + lq], ld[0])
        row += lq


def test_varlen_tiles_read_the_next_sequence():
    """A tile crossing a sequence's end holds the next sequence's keys and values (the kernel's TMA reads the
    packed rows): large finite values there change nothing (masked keys, P = 0), but an inf V row makes NaN -- the
    kernel assumes finite V, as SM90's does (so does a causally masked key inside one sequence's tile)."""
    seqs, q, k, v, cu_q, cu_k = _packed([100, 50], [100, 50], 2, 1, 64, torch.bfloat16, seed=3)
    base = emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, 100, 100, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[100:] = 100.0  # the second sequence's keys would dominate the first's rows if they were not masked
    v2[100:] = 1e4
    loud = emulate_prefill_varlen_sm100(q, k2, v2, cu_q, cu_k, 100, 100, causal=True)
    assert torch.equal(loud[:100], base[:100])
    v2[120] = float("inf")  # in the first sequence's (only) tile, masked for all of its rows
    poisoned = emulate_prefill_varlen_sm100(q, k, v2, cu_q, cu_k, 100, 100, causal=True)
    assert torch.isnan(poisoned[:100]).all()
    # the scales are the varlen prepass's: passing them explicitly gives the same result
    quant = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, 100, 100)[:4]
    assert torch.equal(emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, 100, 100, causal=True, quantized=quant), base)


# ---- LSE: K's smoothing mean put back ------------------------------------------------------------------------------
def _lse_errors(lse, unshifted, ref_lse):
    """|LSE - exact| of the kernel's LSE and of the smoothed scores' LSE (no mean put back), over rows with keys."""
    none = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), none) and torch.equal(torch.isinf(unshifted), none)
    return (lse[~none].double() - ref_lse[~none]).abs(), (unshifted[~none].double() - ref_lse[~none]).abs()


def _check_lse_errors(err, err_unshifted):
    # Q's int8 rounding times K's mean of 3 moves whole rows by up to ~0.1 (measured max 0.099, mean 0.020): the
    # format's error. Without the mean put back each row is off by softmax_scale * q . k_mean, ~3 |N(0, 1)| here
    # (measured mean 2.4): the tolerance tells the two apart.
    assert err.max() <= 0.15 and err.mean() <= 0.03, (float(err.max()), float(err.mean()))
    assert err_unshifted.mean() > 1.0 and (err_unshifted > 0.15).double().mean() > 0.8, float(err_unshifted.mean())


@pytest.mark.parametrize("causal,ws,gran,Hq,Hkv,D", [(True, (-1, -1), "per_warp", 4, 2, 128),
                                                     (False, (-1, -1), "per_block", 4, 1, 64),
                                                     (False, (64, 16), "per_warp", 4, 4, 128),
                                                     (True, (-1, -1), "per_block", 6, 2, 64)])
def test_lse_is_the_unsmoothed_lse(causal, ws, gran, Hq, Hkv, D):
    """smooth_k (the default) takes K's per-channel mean out before quantizing: the softmax is invariant to it, the
    LSE is not. The kernel puts q . k_mean back into its LSE (without a cap; the k_mean address it is given), so it
    is FlashAttention's: that of fp64 attention over the unquantized inputs, here with a K whose channels have a
    mean of ~3. Given no mean (k_mean address 0) it returns the smoothed scores' LSE, which misses it by far. Over
    the same int8 Q/K it is the reference's (``lse_smoothing_shift``) to fp32 rounding. The last case: causal
    Sq > Sk, whose first rows see no key and stay -inf."""
    sq, sk = (300, 383) if Hq == 4 else (383, 300)
    q, k, v = _offset_k_inputs(1, sq, sk, Hq, Hkv, D, seed=D + Hkv)
    o, lse = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, window_size=ws, return_lse=True)
    quant = quantize_qk_int8_reference(q, k, granularity=gran)
    assert quant[4] is not None and quant[4].abs().min() > 2.0  # a large mean in every channel
    o_raw, unshifted = emulate_prefill_sm100(q, k, v, causal=causal, granularity=gran, window_size=ws,
                                             return_lse=True, quantized=quant[:4])
    assert torch.equal(o, o_raw)  # the mean changes the LSE only
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=ws, return_lse=True)
    if causal and sq > sk:
        assert torch.isinf(ref_lse).any()
    _check_lse_errors(*_lse_errors(lse, unshifted, ref_lse))
    _, int8_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=gran, window_size=ws,
                                    return_lse=True)
    none = torch.isinf(int8_lse)
    assert torch.allclose(lse[~none].double(), int8_lse[~none], atol=2e-4, rtol=0)


@pytest.mark.parametrize("causal,ws,gran", [(True, (-1, -1), "per_warp"), (False, (50, 20), "per_block")])
def test_varlen_lse_is_the_unsmoothed_lse(causal, ws, gran):
    """Varlen: each sequence's LSE is that of fp64 attention over its own unquantized inputs (its own k_mean row
    put back), K offset by 3 in every channel; given no mean, the LSE of the smoothed scores misses it by far."""
    lens_q, lens_k = [130, 1, 250, 0, 77], [300, 40, 250, 9, 0]
    seqs, q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 128, torch.bfloat16, seed=21, k_offset=3.0)
    mq, mk = max(lens_q), max(lens_k)
    _, lse = emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, mq, mk, causal=causal, granularity=gran,
                                          window_size=ws, return_lse=True)
    quant = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, mq, mk, granularity=gran)[:4]
    _, unshifted = emulate_prefill_varlen_sm100(q, k, v, cu_q, cu_k, mq, mk, causal=causal, granularity=gran,
                                                window_size=ws, return_lse=True, quantized=quant)
    errs, errs_unshifted, row = [], [], 0
    for (qi, ki, vi), lq, lk in zip(seqs, lens_q, lens_k):
        got, raw = lse[:, row:row + lq][None], unshifted[:, row:row + lq][None]
        row += lq
        if lq == 0:
            continue
        if lk == 0:  # no keys: -inf, shift or not
            assert torch.isneginf(got).all() and torch.isneginf(raw).all()
            continue
        _, ref_lse = attention_reference(qi, ki, vi, causal=causal, window_size=ws, return_lse=True)
        err, err_raw = _lse_errors(got, raw, ref_lse)
        errs.append(err)
        errs_unshifted.append(err_raw)
    _check_lse_errors(torch.cat(errs), torch.cat(errs_unshifted))
