"""GPU tests of the SM90 INT8-QK prefill attention kernel (``qattn.interface.prefill.prefill_int8``).

Kernel error: vs ``prefill_reference`` (fp64) on the *same* int8 Q/K and scales, so only the kernel's own
rounding (P and the output in bf16/fp16, fp32 softmax) is measured. Format error: vs exact fp64 attention on
random and outlier-heavy inputs (cosine >= 0.999, NRMSE <= 3%). Outputs are poisoned (NaN) before each call.

Run as a script for a quick timing: ``python tests/gpu/test_prefill_gpu.py --bench``.
"""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, outliers=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, device="cuda", generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", generator=g)
    if outliers:  # SageAttention's observation: K has large per-channel offsets shared by all tokens (what
        # smoothing removes); "heavy" adds a few channels 4x larger than the rest in Q and K
        k[..., 10:13] += 10.0
        if outliers == "heavy":
            q[..., :4] *= 4.0
            k[..., 5:8] *= 4.0
        if outliers == "v_outliers":  # V channel outliers (per-channel V scales) and a few loud tokens
            v[..., :4] *= 20.0
            v[:, ::97] *= 8.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _quantize(q, k, granularity, smooth_k=True):
    from qattn.quant import quantize_qk_int8_reference

    return quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k)


def _nrmse(x, ref):
    return float((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def _cos(x, ref):
    return float(torch.nn.functional.cosine_similarity(x.double().flatten(), ref.flatten(), dim=0))


def _run_kernel(q8, qs, k8, ks, v, causal, granularity, out_dtype, k_mean=None):
    from qattn.interface.prefill import prefill_int8

    B, Sq, Hq, D = q8.shape
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=out_dtype, device="cuda")
    o, lse = prefill_int8(q8, qs, k8, ks, v, causal=causal, granularity=granularity, return_lse=True, out=out,
                          k_mean=k_mean)
    return o, lse


# (B, Sq, Sk, Hq, Hkv): ragged tails, Sq != Sk (causal bottom-right alignment), GQA, single rows
SHAPES = [(2, 256, 256, 4, 4), (1, 300, 300, 4, 2), (2, 77, 333, 8, 2), (1, 513, 129, 2, 1), (1, 1, 200, 4, 1),
          (1, 1000, 1000, 2, 2)]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_error_vs_same_quantization(shape, granularity, causal, D):
    from qattn.reference.attention import prefill_reference

    B, Sq, Sk, Hq, Hkv = shape
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=Sq + Sk + D)
    q8, qs, k8, ks, k_mean = _quantize(q, k, granularity)
    # k_mean: the LSE with the smoothing shift put back, as the reference's (test_lse_is_that_of_the_unsmoothed_k)
    o, lse = _run_kernel(q8, qs, k8, ks, v, causal, granularity, torch.bfloat16, k_mean=k_mean)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=granularity,
                                     return_lse=True)
    assert torch.isfinite(o).all(), "NaN left in the output (a row was not written)"
    err = (o.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-2, f"max rel err {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows with no visible key must have LSE -inf"
    assert (lse[fin].double() - ref_lse[fin]).abs().max() <= 1e-3


# (outliers, min cosine, max NRMSE): the bar (0.999, 3%) for random inputs and K channel offsets; the
# "heavy" case (4x channels in Q and K) measures 0.9993 / 3.8% on the H100 and is held to a looser documented bar.
FORMAT_CASES = [(None, 0.999, 0.03), ("k_offset", 0.999, 0.03), ("heavy", 0.998, 0.05)]


@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: str(c[0]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_format_error_vs_exact_attention(dtype, case):
    from qattn.reference.attention import attention_reference

    outliers, min_cos, max_nrmse = case
    q, k, v = _inputs(2, 1024, 1024, 4, 2, 128, dtype, outliers=outliers, seed=7)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    o, _ = _run_kernel(q8, qs, k8, ks, v, True, "per_warp", dtype)
    ref = attention_reference(q, k, v, causal=True)
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    print(f"format error {dtype} {outliers}: cos {cos:.5f} nrmse {nrmse:.4f}")
    assert cos >= min_cos and nrmse <= max_nrmse, (cos, nrmse)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_scales_give_no_nan(causal):
    # one key: smoothing makes K exactly 0, so k_scale = 0 (and an all-zero q group has q_scale = 0); masked
    # scores must stay -inf, never -inf * 0 = NaN
    q, k, v = _inputs(1, 200, 1, 2, 2, 64, torch.bfloat16, seed=5)
    q[:, :16] = 0
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    assert (ks == 0).all() and (qs[:, :, 0] == 0).all()
    o, lse = _run_kernel(q8, qs, k8, ks, v, causal, "per_warp", torch.bfloat16)
    if not causal:  # every row sees the single key: out = v
        assert torch.equal(o, v.expand(1, 200, 2, 64)) and torch.isfinite(lse).all()
    else:  # only the last row sees it
        assert torch.equal(o[:, -1], v[:, 0]) and torch.all(o[:, :-1] == 0)
        assert torch.isneginf(lse[:, :, :-1]).all() and torch.isfinite(lse[:, :, -1]).all()  # lse (B, H, Sq)


def test_rows_without_keys_are_zero():
    # causal with seqlen_q > seqlen_k: the first Sq - Sk rows see no key -> out 0, lse -inf
    q, k, v = _inputs(1, 300, 100, 2, 2, 64, torch.bfloat16, seed=3)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    o, lse = _run_kernel(q8, qs, k8, ks, v, True, "per_warp", torch.bfloat16)
    assert torch.all(o[:, :200] == 0) and torch.all(torch.isneginf(lse[:, :, :200]))
    assert torch.isfinite(o[:, 200:]).all() and torch.isfinite(lse[:, :, 200:]).all()


@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_end_to_end(causal, granularity):
    """Prepass kernel + attention kernel vs the fp64 reference of the same quantization rule."""
    import qattn
    from qattn.reference.attention import prefill_reference

    q, k, v = _inputs(2, 700, 900, 8, 2, 128, torch.bfloat16, outliers="k_offset", seed=11)
    o, lse = qattn.flash_attn_func(q, k, v, causal=causal, granularity=granularity, return_lse=True)
    # the LSE's smoothing shift: per_warp's kernel quantizes Q and takes the shift from the 16-bit Q
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=granularity,
                                     return_lse=True, lse_q="16bit" if granularity == "per_warp" else "int8")
    err = (o.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-2, f"max rel err {err:.3e}"
    assert (lse.double() - ref_lse).abs().max() <= 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_end_to_end(causal):
    import qattn
    from qattn.reference.attention import prefill_reference

    lens = [300, 1, 517, 128]
    g = torch.Generator(device="cuda").manual_seed(2)
    seqs = [tuple(torch.randn(1, n, h, 64, device="cuda", generator=g).bfloat16() for h in (4, 1, 1)) for n in lens]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.cat([s[j][0] for s in seqs]) for j in range(3))
    o = qattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    for (qs, ks, vs), a, b in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
        ref = prefill_reference(qs, ks, vs, causal=causal, qk_quant="int8")
        assert (o[a:b].unsqueeze(0).double() - ref).abs().max() / ref.abs().max() <= 1e-2


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_unquantized_qk_path_vs_exact(causal, D):
    """qk_quant=None: the same kernel with 16-bit Q K^T (the A/B baseline): kernel error only."""
    import qattn
    from qattn.reference.attention import attention_reference

    q, k, v = _inputs(2, 300, 333, 4, 2, D, torch.bfloat16, seed=31 + D)
    o, lse = qattn.flash_attn_func(q, k, v, causal=causal, qk_quant=None, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    assert (o.double() - ref).abs().max() / ref.abs().max() <= 1e-2
    assert (lse.double() - ref_lse).abs().max() <= 1e-3
    lens = [5, 300, 128]
    cu = torch.tensor([0, 5, 305, 433], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(433, h, D, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    ov = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 300, 300, causal=causal, qk_quant=None)
    for a, b in ((0, 5), (5, 305), (305, 433)):
        r = attention_reference(qv[None, a:b], kv[None, a:b], vv[None, a:b], causal=causal)
        assert (ov[None, a:b].double() - r).abs().max() / r.abs().max() <= 1e-2


@pytest.mark.parametrize("balance_qk", [False, True])
def test_torch_compile_fullgraph_matches_eager(balance_qk):
    import qattn

    q, k, v = _inputs(1, 300, 300, 4, 2, 128, torch.bfloat16, seed=21)

    def layer(q, k, v):
        return qattn.flash_attn_func(q, k, v, causal=True, return_lse=True, balance_qk=balance_qk)

    torch._dynamo.reset()
    o_c, lse_c = torch.compile(layer, fullgraph=True)(q, k, v)
    o_e, lse_e = layer(q, k, v)
    assert torch.equal(o_c, o_e) and torch.equal(lse_c, lse_e)


@pytest.mark.launch_plans
@pytest.mark.parametrize("pv_dtype,qk_quant", [("bf16", "int8"), ("fp8", "int8"), ("bf16", None)])
@pytest.mark.parametrize("lens_q,lens_k", [([0, 0], [0, 0]), ([0, 0], [3, 5]), ([4, 7], [0, 0])])
def test_varlen_packed_totals_zero(lens_q, lens_k, pv_dtype, qk_quant):
    """Packed totals of 0 (no query row, or no key for any row): FlashAttention's shapes, out 0 and LSE -inf for
    rows without keys (as qattn's kernels write a sequence without keys), no launch (asserted on the CPU with
    recorded launches, tests/sm100/test_prefill_dispatch_sm100.py); then a normal call still works. Also the
    kernel-level ``prefill_int8_varlen``."""
    import qattn
    from qattn.interface.prefill import _scale_groups, prefill_int8_varlen

    g = torch.Generator(device="cuda").manual_seed(5)
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
    Tq, Tk, Hq, Hkv, D = sum(lens_q), sum(lens_k), 4, 2, 128
    q = torch.randn(Tq, Hq, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(Tk, Hkv, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    # the first call, the recorded second and the replayed third (launch plans; a call without query rows stays
    # unplanned: its empty output has no address to record)
    for _ in range(3):
        # freed blocks of the outputs' sizes, NaN, for the caching allocator to hand out: an unfilled output shows
        torch.full((Tq, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        torch.full((Hq, Tq), float("nan"), device="cuda")
        o, lse = qattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                              qk_quant=qk_quant, pv_dtype=pv_dtype, return_lse=True)
        assert o.shape == (Tq, Hq, D) and o.dtype == q.dtype and lse.shape == (Hq, Tq) and lse.dtype == torch.float32
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    if pv_dtype == "bf16" and qk_quant:  # the kernel-level call, its own out poisoned
        n_qg, n_kb = _scale_groups("per_warp", max(lens_q), max(lens_k))
        out = torch.full((Tq, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        o2, lse2 = prefill_int8_varlen(q.to(torch.int8), torch.ones(2, Hq, n_qg, device="cuda"), k.to(torch.int8),
                                       torch.ones(2, Hkv, n_kb, device="cuda"), v, cu(lens_q), cu(lens_k),
                                       max(lens_q), max(lens_k), return_lse=True, out=out)
        assert o2.data_ptr() == out.data_ptr() and torch.all(o2 == 0) and torch.all(torch.isneginf(lse2))
    lens = [300, 1]
    q, k, v = (torch.randn(301, h, D, device="cuda", generator=g).bfloat16() for h in (Hq, Hkv, Hkv))
    o = qattn.flash_attn_varlen_func(q, k, v, cu(lens), cu(lens), 300, 300, qk_quant=qk_quant, pv_dtype=pv_dtype)
    assert torch.isfinite(o).all() and o.abs().max() > 0


def _varlen_inputs(lens_q, lens_k, Hq, Hkv, D, granularity, seed=0):
    """Packed q/k/v and the per-sequence dense-reference quantization laid out as the varlen prepass does
    (scales padded to the longest sequence, zeros in the unused tail groups)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seqs = []
    for lq, lk in zip(lens_q, lens_k):
        q = torch.randn(1, lq, Hq, D, device="cuda", generator=g).bfloat16()
        k = (torch.randn(1, lk, Hkv, D, device="cuda", generator=g) + 0.5).bfloat16()
        v = torch.randn(1, lk, Hkv, D, device="cuda", generator=g).bfloat16()
        seqs.append((q, k, v) + tuple(_quantize(q, k, granularity)))
    n_qg = max(s[4].shape[2] for s in seqs)
    n_kb = max(s[6].shape[2] for s in seqs)
    qs = torch.zeros(len(seqs), Hq, n_qg, device="cuda")
    ks = torch.zeros(len(seqs), Hkv, n_kb, device="cuda")
    for i, s in enumerate(seqs):
        qs[i, :, : s[4].shape[2]] = s[4][0]
        ks[i, :, : s[6].shape[2]] = s[6][0]
    cat = lambda j: torch.cat([s[j][0] for s in seqs])  # noqa: E731
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
    return seqs, cat(3), qs, cat(5), ks, cat(2), cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence(causal, D):
    from qattn.interface.prefill import prefill_int8_varlen
    from qattn.reference.attention import prefill_reference

    lens_q, lens_k = [1, 300, 129, 700, 64], [5, 300, 400, 700, 1]
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, "per_warp", seed=D)
    out = torch.full((sum(lens_q), 4, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    k_mean = torch.cat([s[7] for s in seqs])  # (num_seqs, Hkv, D): each sequence's own mean
    o, lse = prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 return_lse=True, out=out, k_mean=k_mean)
    start = 0
    for (q, k, vv, *_), lq in zip(seqs, lens_q):
        ref, ref_lse = prefill_reference(q, k, vv, causal=causal, qk_quant="int8", return_lse=True)
        got = o[start:start + lq].unsqueeze(0)
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err <= 1e-2, f"sequence at row {start}: max rel err {err:.3e}"
        assert (lse[:, start:start + lq].double() - ref_lse[0]).abs().max() <= 1e-3
        start += lq


@pytest.mark.parametrize("qk_quant,pv_dtype,causal", [("int8", "bf16", True), ("int8", "fp8", False),
                                                      (None, "bf16", False)])
def test_varlen_max_seqlen_is_an_upper_bound(qk_quant, pv_dtype, causal):
    """max_seqlen past every sequence (an engine's fixed bound), as FlashAttention takes it: the same bits as the
    exact maxima (lowered to the packed total; the grid and padded scales grow, the masks do not)."""
    import qattn

    lens_q, lens_k = [70, 1, 300], [90, 40, 300]
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(lens_q), 4, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
    kw = dict(causal=causal, qk_quant=qk_quant, pv_dtype=pv_dtype, return_lse=True)
    want = qattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), 300, 300, **kw)
    for mq, mk in ((4096, 4096), (10**6, 301)):
        got = qattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), mq, mk, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mq, mk)


# ---- Q quantized inside the kernel (q_scale=None: flash_attn_func's per_warp path on SM90) ---------------------
# The kernel computes the prepass's Q bytes and scales, so out and LSE must equal those of the kernel run on the
# prepass's int8 Q, bit for bit (same scores, same instructions after the quantization).
def _loud_q(q):
    q[:, :16] = 0  # an all-zero 16-row group: scale 0
    q[:, 20:21] *= 50  # a loud row in the second group
    return q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_quantized_q_equals_prepass_q(shape, causal, D, dtype):
    B, Sq, Sk, Hq, Hkv = shape
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, outliers="heavy", seed=Sq + D)
    q = _loud_q(q)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    want, want_lse = _run_kernel(q8, qs, k8, ks, v, causal, "per_warp", dtype)
    got, got_lse = _run_kernel(q, None, k8, ks, v, causal, "per_warp", dtype)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_quantized_q_varlen_equals_prepass_q(causal, D):
    from qattn.interface.prefill import prefill_int8_varlen

    lens_q, lens_k = [1, 300, 129, 700, 64], [5, 300, 400, 700, 1]
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, "per_warp", seed=D + 1)
    q = torch.cat([s[0][0] for s in seqs])
    outs = []
    for qq, ss in ((q8, qs), (q, None)):
        out = torch.full((sum(lens_q), 4, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs.append(prefill_int8_varlen(qq, ss, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True, out=out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def assert_flash_attn_func_equals_prepass_path(q, k, v, causal, pv_dtype="bf16", balance_qk=False):
    """flash_attn_func's output == that of the Q/K prepass (``quantize_qk_int8``) + ``prefill_int8`` on the int8
    Q, bit for bit (on SM90 per_warp, flash_attn_func quantizes Q inside the kernel instead); its LSE == the
    latter's without the smoothing shift plus the exact shift of the caller's Q (the kernel that quantizes Q
    takes it from the 16-bit Q), to fp32 rounding."""
    import qattn
    from qattn.interface.prefill import prefill_int8
    from qattn.quant import quantize_qk_int8
    from qattn.quant.v_fp8 import quantize_v_fp8
    from qattn.reference import lse_smoothing_shift

    got, got_lse = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, return_lse=True,
                                         balance_qk=balance_qk)
    q8, qs, k8, ks, km, *lam = quantize_qk_int8(q, k, balance_qk=balance_qk)
    if pv_dtype == "fp8":
        vt, vs = quantize_v_fp8(v)
        want, want_lse = prefill_int8(q8, qs, k8, ks, vt, causal=causal, return_lse=True, pv_dtype="fp8",
                                      v_scale=vs, out_dtype=q.dtype)
    else:
        want, want_lse = prefill_int8(q8, qs, k8, ks, v, causal=causal, return_lse=True)
    assert torch.equal(got, want)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), fin)
    want_lse = want_lse.double() + lse_smoothing_shift(q, km, None)  # the balance cancels: q . k_mean
    err = float((got_lse.double() - want_lse)[fin].abs().max())
    assert err <= 1e-4 * (1 + float(want_lse[fin].abs().max())), err


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_is_that_of_the_unsmoothed_k(causal, varlen, pv_dtype):
    """return_lse with smooth_k (the default): FlashAttention's LSE of the caller's K, not that of the smoothed
    scores (off by softmax_scale * q . k_mean per row; K with channel offsets makes that large), so partial results
    merge by it. Dense and varlen (each sequence its own mean), split tails (dense non-causal) and FP8 P x V."""
    import qattn
    from qattn.reference.attention import attention_reference

    lens_q, lens_k = [333, 1, 1000], [700, 900, 1000]
    g = torch.Generator(device="cuda").manual_seed(31 + causal + 2 * varlen)
    offs = 3.0 * torch.randn(2, 64, device="cuda", generator=g)  # per kv head and channel

    def qkv(sq, sk):
        q = torch.randn(sq, 4, 64, device="cuda", generator=g)
        k = torch.randn(sk, 2, 64, device="cuda", generator=g) + offs
        return q.bfloat16(), k.bfloat16(), torch.randn(sk, 2, 64, device="cuda", generator=g).bfloat16()

    if varlen:
        seqs = [qkv(a, b) for a, b in zip(lens_q, lens_k)]
        cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")  # noqa: E731
        q, k, v = (torch.cat([s[j] for s in seqs]) for j in range(3))
        _, lse = qattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                              causal=causal, pv_dtype=pv_dtype, return_lse=True)
        _, plain = qattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                                causal=causal, pv_dtype=pv_dtype, return_lse=True, smooth_k=False)
        ref = torch.cat([attention_reference(*(t.unsqueeze(0) for t in s), causal=causal, return_lse=True)[1][0]
                         for s in seqs], dim=1)  # (Hq, total_q)
        shift = torch.cat([(s[0].double() * 0.125).view(-1, 2, 2, 64).mul(
            s[1].double().mean(0)[None, :, None]).sum(-1).reshape(-1, 4).T for s in seqs], dim=1)
    else:
        q, k, v = (t.unsqueeze(0) for t in qkv(1000, 1000))
        _, lse = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, return_lse=True)
        _, plain = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, return_lse=True, smooth_k=False)
        ref = attention_reference(q, k, v, causal=causal, return_lse=True)[1]
        shift = (q[0].double() * 0.125).view(-1, 2, 2, 64).mul(k[0].double().mean(0)[None, :, None]).sum(-1)
        shift = shift.reshape(-1, 4).T[None]
    err = float((lse.double() - ref).abs().max())
    err_plain = float((plain.double() - ref).abs().max())
    err_smoothed = float((lse.double() - shift - ref).abs().max())  # what the LSE was before
    print(f"LSE vs fp64, causal={causal} varlen={varlen} {pv_dtype}: {err:.4f} (smooth_k=False {err_plain:.4f}, "
          f"smoothed scores' LSE {err_smoothed:.2f})")
    # CPU reference on such inputs: int8 Q K^T costs the unsmoothed path ~0.10-0.11 of LSE, the smoothed one with
    # the shift from the int8 Q as much (its rounding times the mean), from the 16-bit Q (this kernel) 0.005-0.018
    assert err <= 0.04 and err < err_plain / 2.5 and err_smoothed > 1.0, (err, err_plain, err_smoothed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_flash_attn_func_per_warp_equals_full_prepass(pv_dtype, causal):
    """flash_attn_func (K-only prepass, Q quantized in the kernel) == the Q/K prepass + kernel, bit for bit."""
    q, k, v = _inputs(2, 700, 900, 8, 2, 128, torch.float16, outliers="k_offset", seed=13)
    assert_flash_attn_func_equals_prepass_path(_loud_q(q), k, v, causal, pv_dtype)


def _ab_inputs(sq: int, sk: int, D: int, pv_dtype: str, causal: bool, seed: int):
    """Inputs of the A/B tests below (B2, 4 q heads, 2 kv heads, "heavy" outliers): 16-bit q, its prepass int8
    q8 / qs, k8 / ks, V (E4M3 V^T for FP8 P x V) and the prefill_int8 keywords."""
    from qattn.quant.v_fp8 import quantize_v_fp8

    q, k, v = _inputs(2, sq, sk, 4, 2, D, torch.bfloat16, outliers="heavy", seed=seed)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    kw = dict(causal=causal, return_lse=True, pv_dtype=pv_dtype)
    if pv_dtype == "fp8":
        v, vs = quantize_v_fp8(v)
        kw.update(v_scale=vs, out_dtype=torch.bfloat16)
    return q, q8, qs, k8, ks, v, kw


@pytest.mark.parametrize("D,pv_dtype,causal", [(128, "bf16", True), (64, "bf16", False), (128, "fp8", True),
                                                (64, "fp8", False)])
def test_bias_in_acc_gives_identical_outputs(D, pv_dtype, causal):
    """QK^T accumulating onto the score bias (``PrefillConfig.bias_in_acc``) == adding the bias after it, bit for
    bit: ragged lengths (masked tiles), in-kernel Q quantization and the prepass's int8 Q, GQA."""
    from qattn.interface.prefill import prefill_int8

    q, q8, qs, k8, ks, v, kw = _ab_inputs(333, 1000, D, pv_dtype, causal, seed=D + 3)
    for qq, ss in ((q, None), (q8, qs)):
        outs = [prefill_int8(qq, ss, k8, ks, v, **kw, _tuning={"bias_in_acc": on}) for on in (False, True)]
        assert torch.isfinite(outs[0][0]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("D,pv_dtype,causal", [(128, "bf16", False), (128, "bf16", True), (128, "fp8", False),
                                                (128, "fp8", True), (64, "bf16", True)])
def test_serial_loop_gives_identical_outputs(D, pv_dtype, causal):
    """The serial loop (``intra_wg_overlap=False``: P V(n-1) finished before QK^T(n) is issued) with 192-row tiles
    (three MMA warpgroups, the default at head_dim 128 non-causal or with FP8 P x V) and with 128 == FA3's
    overlapped loop with 128 rows (192 at D64), bit for bit: ragged lengths, GQA, in-kernel Q quantization and
    the prepass's int8 Q; varlen with 16-bit P x V (tiles past a sequence's end)."""
    from qattn.interface.prefill import prefill_int8, prefill_int8_varlen

    # whole units (split_tail off): the tail's split plan depends on tile_m, and its merge rounds differently
    tunings = [{"tile_m": 128 if D == 128 else 192, "intra_wg_overlap": True, "split_tail": False},
               {"tile_m": 192, "intra_wg_overlap": False, "split_tail": False},
               {"tile_m": 128, "intra_wg_overlap": False, "split_tail": False}]
    q, q8, qs, k8, ks, v, kw = _ab_inputs(333, 1000, D, pv_dtype, causal, seed=D + 5)
    for qq, ss in ((q, None), (q8, qs)):
        outs = [prefill_int8(qq, ss, k8, ks, v, **kw, _tuning=t) for t in tunings]
        assert torch.isfinite(outs[0][0]).all()
        for o in outs[1:]:
            assert torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1])
    if pv_dtype == "bf16":
        lens_q, lens_k = [1, 300, 700], [900, 5, 700]
        seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, "per_warp", seed=D + 6)
        outs = [prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                    return_lse=True, _tuning=t) for t in tunings]
        for o in outs[1:]:
            assert torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1])


def test_long_causal_grids_pick_192_rows(monkeypatch):
    """prefill_int8 asks for 192-row tiles on dense causal grids from LONG_CAUSAL_KEYS keys (D128, 16-bit P.V,
    per_warp), 128 below; the outputs equal those of the 128-row kernel bit for bit."""
    import qattn.interface.prefill as P
    from qattn.cute_kernels.sm90.prefill_config import LONG_CAUSAL_KEYS

    seen = []
    launch = P._launch
    monkeypatch.setattr(P, "_launch", lambda cfg, *a, **k: (seen.append(cfg.tile_m), launch(cfg, *a, **k))[1])
    for sk, tile in ((LONG_CAUSAL_KEYS, 192), (LONG_CAUSAL_KEYS - 128, 128)):
        q, q8, qs, k8, ks, v, kw = _ab_inputs(300, sk, 128, "bf16", True, seed=sk)
        for qq, ss in ((q, None), (q8, qs)):
            seen.clear()
            o = P.prefill_int8(qq, ss, k8, ks, v, **kw)
            ref = P.prefill_int8(qq, ss, k8, ks, v, **kw, _tuning={"tile_m": 128})
            assert seen == [tile, 128]
            assert torch.isfinite(o[0]).all() and torch.equal(o[0], ref[0]) and torch.equal(o[1], ref[1])


@pytest.mark.parametrize("D,pv_dtype", [(128, "bf16"), (64, "bf16"), (128, "fp8")])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (3100, 3100), (700, 2000), (2000, 700)])
def test_causal_warpgroup_skip_matches_128_rows(D, pv_dtype, sq, sk):
    """Causal 192-row CTAs: a warpgroup computes only the K/V tiles its own 64 rows see and skips the rest of the
    CTA's (masked for all of its rows); outputs and LSE equal those of 128-row CTAs (two warpgroups, whose
    tiles differ) bit for bit: diagonals at every offset within a tile (Sq = Sk, Sq < Sk, Sq > Sk with rows that
    see no key), in-kernel and prepass Q."""
    from qattn.interface.prefill import prefill_int8

    q, q8, qs, k8, ks, v, kw = _ab_inputs(sq, sk, D, pv_dtype, True, seed=sq + sk + D)
    for qq, ss in ((q, None), (q8, qs)):
        outs = [prefill_int8(qq, ss, k8, ks, v, **kw, _tuning={"tile_m": tm}) for tm in (192, 128)]
        assert torch.isfinite(outs[0][0]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("sms", [5, 7])
@pytest.mark.parametrize("D,pv_dtype", [(128, "bf16"), (64, "bf16"), (128, "fp8"), (64, "fp8")])
def test_split_tail_matches_whole_units(monkeypatch, D, pv_dtype, sms):
    """Dense non-causal grids split the units of their last, partial wave over K/V ranges (``split_tail``; the SM
    count patched to 5 / 7 so that these 16 units, 2 query tiles x 4 heads x 2, have a tail of 1 / 2; 3000 keys =
    24 tiles, the last one ragged and masked, in the last split). Against the same grid run as whole units: the
    other units bit for bit, LSE to fp32 rounding, and the same result on every run (the merge adds the splits in
    order, whichever CTA finishes last). The split units: 16-bit P x V close to whole units (the merge reorders
    sums); FP8 P x V rounds P against each split's own running max, so its E4M3 rounding differs from the whole
    row's (~2 % NRMSE apart on these "heavy" inputs): there, as close to exact attention as whole units."""
    import qattn.interface.prefill as P
    from qattn.interface.prefill import prefill_int8

    from qattn.reference.attention import attention_reference

    monkeypatch.setattr(P, "_num_sms", lambda dev: sms)
    q, q8, qs, k8, ks, v, kw = _ab_inputs(333, 3000, D, pv_dtype, False, seed=D + 9)
    _, k16, v16 = _inputs(2, 333, 3000, 4, 2, D, torch.bfloat16, outliers="heavy", seed=D + 9)  # as _ab_inputs
    ref = attention_reference(q, k16, v16)
    cfg = P._config(head_dim=D, v_dtype="bf16", causal=False, granularity="per_warp", pv_dtype=pv_dtype,
                    quantize_q=True)
    B, Sq, Hq, _ = q.shape
    m_blocks = -(-Sq // cfg.tile_m)
    num_full, splits = P.split_tail_plan(m_blocks * Hq * B, -(-3000 // 128), sms)
    assert cfg.split_tail and splits > 1 and num_full < m_blocks * Hq * B
    tail = torch.zeros(B, Sq, Hq, dtype=torch.bool, device="cuda")
    for u in range(num_full, m_blocks * Hq * B):  # units: query tile fastest, then head, then sequence
        m, h, b = u % m_blocks, u // m_blocks % Hq, u // (m_blocks * Hq)
        tail[b, m * cfg.tile_m:(m + 1) * cfg.tile_m, h] = True
    for qq, ss in ((q, None), (q8, qs)):
        split, split2, whole = (prefill_int8(qq, ss, k8, ks, v, **kw, _tuning=t)
                                for t in (None, None, {"split_tail": False}))
        assert torch.isfinite(split[0]).all()
        assert torch.equal(split[0], split2[0]) and torch.equal(split[1], split2[1]), "not deterministic"
        assert torch.equal(split[0][~tail], whole[0][~tail]), "whole units changed"
        assert torch.equal(split[1].transpose(1, 2)[~tail], whole[1].transpose(1, 2)[~tail])
        err_split, err_whole = _nrmse(split[0][tail], ref[tail]), _nrmse(whole[0][tail], ref[tail])
        assert err_split <= 1.1 * err_whole, (err_split, err_whole)
        if pv_dtype == "bf16":
            diff = _nrmse(split[0][tail], whole[0][tail].double())
            assert diff <= 3e-3, diff
        assert (split[1] - whole[1]).abs().max() <= 1e-3
    # CUDA graph: the per-call counters are zeroed inside the graph, so every replay merges again
    prefill_int8(q, None, k8, ks, v, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prefill_int8(q, None, k8, ks, v, **kw)
    eager = prefill_int8(q, None, k8, ks, v, **kw)
    for _ in range(2):
        captured[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.parametrize("sk", [100, 1000, 1100])  # 1, 8 and 9 key tiles
def test_bias_in_acc_identical_at_head_dim_128_dense_and_varlen(sk):
    """The score bias in the accumulator (refilled by shared loads, ``PrefillConfig.bias_in_acc``) == the integer
    add, bit for bit, at head_dim 128 non-causal with 16-bit P x V; dense and varlen (a CTA past its sequence's
    end, ragged tiles)."""
    from qattn.interface.prefill import prefill_int8, prefill_int8_varlen

    q, k, v = _inputs(2, 333, sk, 4, 2, 128, torch.bfloat16, outliers="heavy", seed=sk)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    for qq, ss in ((q, None), (q8, qs)):
        outs = [prefill_int8(qq, ss, k8, ks, v, return_lse=True, _tuning={"bias_in_acc": on}) for on in (False, True)]
        assert torch.isfinite(outs[0][0]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    lens_q, lens_k = [1, 300, 129], [sk, 5, 700]
    seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 128, "per_warp", seed=sk + 1)
    outs = [prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                _tuning={"bias_in_acc": on}) for on in (False, True)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("D,pv_dtype", [(128, "bf16"), (64, "bf16"), (128, "fp8")])
def test_causal_grid_groups_give_identical_outputs(monkeypatch, D, pv_dtype):
    """Causal: every grouping of the (sequence, head) units (``lpt_group``: 1 = head by head, 2, all 8) gives the
    same outputs, bit for bit; dense (GQA, ragged tiles) and varlen (tiles past a sequence's end)."""
    import qattn.interface.prefill as pf

    q, q8, qs, k8, ks, v, kw = _ab_inputs(700, 900, D, pv_dtype, True, seed=D + 11)
    outs = []
    for g in (1, 2, 8):
        monkeypatch.setattr(pf, "_lpt_group", lambda *a, g=g: g)
        outs.append(pf.prefill_int8(q, None, k8, ks, v, **kw))
    assert torch.isfinite(outs[0][0]).all()
    for o in outs[1:]:
        assert torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1])
    if pv_dtype == "bf16":
        lens_q, lens_k = [1, 300, 700], [900, 5, 700]
        seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, "per_warp", seed=D)
        outs = []
        for g in (1, 3, 12):  # 3 sequences x 4 heads
            monkeypatch.setattr(pf, "_lpt_group", lambda *a, g=g: g)
            outs.append(pf.prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                               return_lse=True))
        for o in outs[1:]:
            assert torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1])


# ---- FP8 P x V (pv_dtype="fp8") ------------------------------------------------------------------------------
# Kernel error: vs ``prefill_fp8pv_emulation`` on the same int8 Q/K and E4M3 V (tight: only accumulation order,
# ex2.approx and the output rounding differ). Format error: vs exact fp64 attention (FP8 P and V cost ~3.5% NRMSE,
# see tests/reference/test_prefill_fp8pv.py for the CPU numbers).
@pytest.fixture
def poison_v_prepass(monkeypatch):
    import qattn.quant.v_fp8 as m

    def alloc(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(0xFF) if dtype == torch.uint8 else t.fill_(float("nan"))  # 0xFF is E4M3 NaN

    monkeypatch.setattr(m, "_alloc", alloc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,Sk,H", [(1, 1, 1), (2, 300, 2), (1, 128, 4), (3, 1000, 2), (1, 5000, 1)])
def test_v_fp8_prepass_matches_reference(poison_v_prepass, B, Sk, H, D, dtype):
    from qattn.quant.v_fp8 import quantize_v_fp8, quantize_v_fp8_reference

    g = torch.Generator(device="cuda").manual_seed(Sk + D)
    big = torch.randn(B, Sk, 2 * H, D, device="cuda", generator=g) * torch.rand(1, 1, 2 * H, D, device="cuda",
                                                                                 generator=g) * 8
    big[..., 3] = 0.0  # an all-zero channel: scale 0, codes 0
    v = big.to(dtype)[:, :, :H]  # head-strided view: read in place
    vt, vs = quantize_v_fp8(v)
    vt_ref, vs_ref = quantize_v_fp8_reference(v)
    assert torch.equal(vs, vs_ref)
    assert torch.equal(vt.view(torch.uint8), vt_ref.view(torch.uint8))


@pytest.mark.parametrize("B,Sk,H,D", [(2, 3000, 2, 128), (1, 129, 3, 64), (2, 20000, 1, 128)])
def test_v_fp8_prepass_pdl_chain(monkeypatch, B, Sk, H, D):
    """The V prepass as ``flash_attn_func`` launches it (``_pdl``: its amax kernel a programmatic dependent of the
    K prepass's last kernel; the fold and transpose kernels of the one before them): right after a K prepass on
    the same stream, three times back to back, the same bytes as the reference; and ``flash_attn_func`` with FP8
    P.V gives the same bits as with the V prepass launched plainly. (No poisoning allocator here: its fill
    kernels would run between the two prepasses.)"""
    import qattn
    import qattn.quant.v_fp8 as V
    from qattn.quant.launch import quantize_k_int8

    g = torch.Generator(device="cuda").manual_seed(Sk + D)
    k, v = ((torch.randn(B, Sk, H, D, device="cuda", generator=g) * 3).to(torch.bfloat16) for _ in range(2))
    vt_ref, vs_ref = V.quantize_v_fp8_reference(v)
    for _ in range(3):
        quantize_k_int8(k)
        vt, vs = V.quantize_v_fp8(v, _pdl=True)
        assert torch.equal(vs, vs_ref) and torch.equal(vt.view(torch.uint8), vt_ref.view(torch.uint8))

    q = (torch.randn(B, min(Sk, 1024), 2 * H, D, device="cuda", generator=g)).to(torch.bfloat16)
    # four calls back to back: a dependent that stored before its wait raced with the kernels before it (the
    # allocator recycles their freed buffers in stream order): the amax kernel did, until it moved its wait
    with_pdl = [qattn.flash_attn_func(q, k, v, causal=True, pv_dtype="fp8", return_lse=True) for _ in range(4)]
    orig = V._v_kernels

    def plain(arch, d, in_bf16, *varlen):  # every V prepass kernel launched plainly (pdl = 0)
        rows, amax, transpose = orig(arch, d, in_bf16, *varlen)
        return rows, (lambda *a: amax(*a[:-2], 0, a[-1])), (lambda *a: transpose(*a[:-2], 0, a[-1]))

    monkeypatch.setattr(V, "_v_kernels", plain)
    ref = qattn.flash_attn_func(q, k, v, causal=True, pv_dtype="fp8", return_lse=True)
    for o, lse in with_pdl:
        assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])


def _run_fp8(q8, qs, k8, ks, vt, vs, causal, granularity, out_dtype):
    """Whole units (no ``split_tail``): the emulation rounds P against one running max per row, while a split
    unit rounds it against each split's own (``test_split_tail_matches_whole_units``)."""
    from qattn.interface.prefill import prefill_int8

    B, Sq, Hq, D = q8.shape
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=out_dtype, device="cuda")
    return prefill_int8(q8, qs, k8, ks, vt, causal=causal, granularity=granularity, return_lse=True, out=out,
                        pv_dtype="fp8", v_scale=vs, _tuning={"split_tail": False})


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8pv_kernel_vs_emulation(shape, causal, D):
    from qattn.quant.v_fp8 import quantize_v_fp8_reference
    from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation

    B, Sq, Sk, Hq, Hkv = shape
    granularity = "per_block" if Sq == 300 else "per_warp"
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=Sq + Sk + D)
    q8, qs, k8, ks, _ = _quantize(q, k, granularity)
    vt, vs = quantize_v_fp8_reference(v)
    o, lse = _run_fp8(q8, qs, k8, ks, vt, vs, causal, granularity, torch.bfloat16)
    emu, emu_lse = prefill_fp8pv_emulation(q, k, v, causal=causal, granularity=granularity, return_lse=True,
                                           quantized=(q8, qs, k8, ks, vt, vs), out_dtype=torch.float64)
    assert torch.isfinite(o).all(), "NaN left in the output (a row was not written)"
    err = (o.double() - emu).abs().max() / emu.abs().max()
    assert err <= 1e-2, f"max rel err vs emulation {err:.3e}"
    assert _nrmse(o, emu) <= 5e-3, _nrmse(o, emu)
    fin = torch.isfinite(emu_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows with no visible key must have LSE -inf"
    assert (lse[fin].double() - emu_lse[fin]).abs().max() <= 1e-3


# (outliers, min cosine, max NRMSE) vs exact attention; CPU emulation measures 0.9994 / 3.4% (random, causal)
FP8_FORMAT_CASES = [(None, 0.999, 0.045), ("k_offset", 0.999, 0.045), ("heavy", 0.998, 0.065),
                    ("v_outliers", 0.999, 0.05)]


@pytest.mark.parametrize("case", FP8_FORMAT_CASES, ids=lambda c: str(c[0]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8pv_format_error_vs_exact_attention(dtype, case):
    import qattn
    from qattn.reference.attention import attention_reference

    outliers, min_cos, max_nrmse = case
    q, k, v = _inputs(2, 1024, 1024, 4, 2, 128, dtype, outliers=outliers, seed=7)
    o = qattn.flash_attn_func(q, k, v, causal=True, pv_dtype="fp8")
    assert o.dtype == dtype
    ref = attention_reference(q, k, v, causal=True)
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    print(f"fp8 PV format error {dtype} {outliers}: cos {cos:.5f} nrmse {nrmse:.4f}")
    assert cos >= min_cos and nrmse <= max_nrmse, (cos, nrmse)


@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_fp8_end_to_end(monkeypatch, causal, D, dtype):
    """Three launches (Q/K prepass, V prepass, attention) vs the emulation of the same rules (whole units, see
    ``_run_fp8``)."""
    import qattn
    import qattn.interface.prefill as P
    from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation

    monkeypatch.setattr(P, "_split_tail_plan", lambda num_units, num_kv_tiles, num_sms: (num_units, 1))

    q, k, v = _inputs(2, 700, 900, 8, 2, D, dtype, outliers="k_offset", seed=11)
    o, lse = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype="fp8", return_lse=True)
    emu, emu_lse = prefill_fp8pv_emulation(q, k, v, causal=causal, return_lse=True, out_dtype=torch.float64,
                                           lse_q="16bit")  # the kernel quantizes Q: the shift of the 16-bit Q
    assert o.dtype == dtype and torch.isfinite(o).all()
    assert (o.double() - emu).abs().max() / emu.abs().max() <= 1e-2
    assert _nrmse(o, emu) <= 5e-3
    assert (lse.double() - emu_lse).abs().max() <= 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_fp8pv_zero_scales_and_rows_without_keys(causal):
    from qattn.quant.v_fp8 import dequantize_v_fp8_reference, quantize_v_fp8_reference

    # one key (k_scale 0 after smoothing), an all-zero q group; causal: only the last row sees the key
    q, k, v = _inputs(1, 200, 1, 2, 2, 64, torch.bfloat16, seed=5)
    q[:, :16] = 0
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    vt, vs = quantize_v_fp8_reference(v)
    o, lse = _run_fp8(q8, qs, k8, ks, vt, vs, causal, "per_warp", torch.bfloat16)
    deq = dequantize_v_fp8_reference(vt, vs, 1).to(torch.bfloat16)  # P' = 448: out = the E4M3 V, dequantized
    if not causal:
        assert torch.isfinite(lse).all()
        assert torch.allclose(o.float(), deq.expand(1, 200, 2, 64).float(), rtol=1e-2, atol=0)
    else:
        assert torch.allclose(o[:, -1].float(), deq[:, 0].float(), rtol=1e-2, atol=0) and torch.all(o[:, :-1] == 0)
        assert torch.all(torch.isneginf(lse[:, :, :-1]))


def _bench():
    import triton.testing as tt

    from qattn.interface.prefill import prefill_int8
    from qattn.quant.v_fp8 import quantize_v_fp8

    rows = []
    for D in (128, 64):
        for causal in (False, True):
            for S in (2048, 8192):
                B, H = 2, 16
                q, k, v = _inputs(B, S, S, H, H, D, torch.bfloat16, seed=1)
                q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                fn = lambda: prefill_int8(q8, qs, k8, ks, v, causal=causal)  # noqa: E731
                ms = tt.do_bench(fn, warmup=50, rep=200, return_mode="median")
                rows.append(("bf16", D, causal, S, ms * 1e3, flops / ms / 1e9))
                vt, vs = quantize_v_fp8(v)
                fn = lambda: prefill_int8(q8, qs, k8, ks, vt, causal=causal, pv_dtype="fp8", v_scale=vs)  # noqa: E731
                ms = tt.do_bench(fn, warmup=50, rep=200, return_mode="median")
                rows.append(("fp8", D, causal, S, ms * 1e3, flops / ms / 1e9))
                ms = tt.do_bench(lambda: quantize_v_fp8(v), warmup=50, rep=200, return_mode="median")
                rows.append(("V prepass", D, causal, S, ms * 1e3, 0))
    print("| PV | D | causal | S | us | TFLOP/s (attention kernel only) |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.0f} |")


if __name__ == "__main__" and "--bench" in sys.argv:
    _bench()


@pytest.mark.parametrize("case", [("per_warp", "bf16", False, False), ("per_block", "bf16", False, False),
                                  ("per_warp", "fp8", False, False), ("per_warp", "bf16", True, False),
                                  ("per_warp", "bf16", False, True)],
                         ids=["in-kernel-q", "prepass-q", "fp8-pv", "balance-qk", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_pdl_launch_gives_identical_outputs(monkeypatch, causal, case):
    """``flash_attn_func`` launches the attention kernel as a programmatic dependent of the prepass (``pdl``: it
    may start while the prepass finishes and waits for it before reading its outputs). The same kernel launched
    plainly must give the same bits, for each prepass that can precede it (K only, K then Q, the V prepass, K
    with the channel balance, varlen K), run several times back to back."""
    import qattn
    import qattn.interface.prefill as P

    granularity, pv_dtype, balance, varlen = case
    q, k, v = _inputs(2, 1500, 1500, 8, 2, 128, torch.bfloat16, outliers="k_offset", seed=21)
    kw = dict(causal=causal, granularity=granularity, pv_dtype=pv_dtype, balance_qk=balance, return_lse=True)
    if varlen:
        cu = torch.tensor([0, 700, 1500, 3000], dtype=torch.int32, device="cuda")
        args = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 1500, 1500)
        fn = qattn.flash_attn_varlen_func
    else:
        args, fn = (q, k, v), qattn.flash_attn_func
    launches = []
    orig = P._launch

    def spy(*a):
        launches.append(a[-1])
        return orig(*a)

    monkeypatch.setattr(P, "_launch", spy)
    with_pdl = [fn(*args, **kw) for _ in range(3)]
    assert launches == [True] * 3

    def plain(*a):
        return orig(*a[:-1], False)

    monkeypatch.setattr(P, "_launch", plain)
    ref = fn(*args, **kw)
    for o, lse in with_pdl:
        assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])


@pytest.mark.parametrize("layout", ["packed_qkv", "heads_major", "misaligned"])
@pytest.mark.parametrize("mode", ["int8", "per_block", "fp8", "qk16", "varlen"])
def test_strided_inputs_are_read_in_place(monkeypatch, mode, layout):
    """q, k, v as views: sliced out of one packed QKV tensor (row stride (Hq + 2 Hkv) D), or (batch, heads, seq,
    dim) memory transposed to (batch, seq, heads, dim) (head stride seq x dim). The attention kernel's TMA reads
    them in place (the tensors it gets are the caller's, no copy) and the bits equal those of contiguous copies;
    a view whose data pointer is not 16-byte aligned is copied first (same bits)."""
    import qattn
    import qattn.interface.prefill as P

    B, S, Hq, Hkv, D = 2, 700, 4, 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    if layout == "packed_qkv":
        qkv = torch.randn(B, S, Hq + 2 * Hkv, D, device="cuda", generator=g).bfloat16()
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    elif layout == "heads_major":
        q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=g).bfloat16().transpose(1, 2)
                   for h in (Hq, Hkv, Hkv))
    else:  # one element in: 2-byte aligned only
        flat = torch.randn(3 * B * S * Hq * D + 1, device="cuda", generator=g).bfloat16()[1:]
        q, k, v = (flat[i * B * S * Hq * D:(i * B * S * Hq * D + B * S * h * D)].view(B, S, h, D)
                   for i, h in enumerate((Hq, Hkv, Hkv)))
    if mode == "varlen":
        q, k, v = q[0], k[0], v[0]  # (S, heads, dim) views of batch 0
    kw = dict(causal=True, return_lse=True)
    if mode == "per_block":
        kw["granularity"] = "per_block"
    elif mode == "fp8":
        kw["pv_dtype"] = "fp8"
    elif mode == "qk16":
        kw["qk_quant"] = None
    seen = []
    orig = P._launch

    def spy(cfg, q_arg, k_arg, v_arg, *rest):
        seen.append((q_arg.data_ptr(), k_arg.data_ptr(), v_arg.data_ptr()))
        return orig(cfg, q_arg, k_arg, v_arg, *rest)

    monkeypatch.setattr(P, "_launch", spy)
    if mode == "varlen":
        cu = torch.tensor([0, 300, S], dtype=torch.int32, device="cuda")
        out = qattn.flash_attn_varlen_func(q, k, v, cu, cu, 400, 400, **kw)
        ref = qattn.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 400, 400, **kw)
    else:
        out = qattn.flash_attn_func(q, k, v, **kw)
        ref = qattn.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), **kw)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    in_place = layout != "misaligned"
    if mode in ("int8", "varlen", "qk16", "fp8"):  # the kernel reads the caller's Q
        assert (seen[0][0] == q.data_ptr()) == in_place
    if mode in ("int8", "per_block", "varlen", "qk16"):  # and the caller's V
        assert (seen[0][2] == v.data_ptr()) == in_place
    if mode == "qk16":  # and K
        assert (seen[0][1] == k.data_ptr()) == in_place


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_flash_attn_func_graph_replay(pv_dtype):
    """``flash_attn_func`` (prepass + attention kernel launched as its programmatic dependent) captured in a CUDA
    graph: every replay, on new values written into the same input tensors, gives the eager call's bits."""
    import qattn

    q, k, v = _inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, outliers="k_offset", seed=31)
    kw = dict(causal=True, pv_dtype=pv_dtype, return_lse=True)
    qattn.flash_attn_func(q, k, v, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = qattn.flash_attn_func(q, k, v, **kw)
    for seed in (32, 33):
        q2, k2, v2 = _inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, outliers="k_offset", seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = qattn.flash_attn_func(q, k, v, **kw)
        assert torch.equal(out, ref_o) and torch.equal(lse, ref_lse)
