"""GPU: FlashAttention's ``softcap`` in ``flash_attn_func`` / ``flash_attn_varlen_func`` (SM90): the scores z
become softcap * tanh(z / softcap) before the softmax. Output and LSE against fp64 attention of the unquantized
inputs with the same cap; most caps are small enough (logits of std ~1) that a kernel ignoring them would fail."""

from __future__ import annotations

import pytest
import torch

import qattn
from qattn.reference.attention import attention_reference
from tests.gpu.test_prefill_gpu import _nrmse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g) + 0.5  # a channel offset (smooth_k)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _lse_err(lse, ref_lse):
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    return float((lse.double() - ref_lse)[fin].abs().max())


# (B, Sq, Sk, Hq, Hkv, D, causal, pv_dtype, qk_quant, window, softcap)
CASES = [
    (2, 333, 333, 4, 4, 128, False, "bf16", "int8", (-1, -1), 1.0),
    (2, 333, 333, 4, 4, 128, True, "bf16", "int8", (-1, -1), 1.5),
    (1, 700, 1300, 8, 2, 64, True, "bf16", "int8", (-1, -1), 1.0),
    (1, 512, 512, 4, 4, 128, False, "fp8", "int8", (-1, -1), 1.2),
    (1, 400, 600, 4, 2, 64, True, "fp8", "int8", (-1, -1), 0.8),
    (2, 256, 256, 4, 4, 128, True, "bf16", None, (-1, -1), 1.0),     # the unquantized 16-bit Q K^T path
    (1, 600, 600, 4, 4, 128, True, "bf16", "int8", (200, 0), 1.5),   # with a sliding window
    (1, 3000, 3000, 2, 2, 128, True, "bf16", "int8", (-1, -1), 50.0),  # Gemma 2's cap; 192-row tiles
    (1, 1024, 1024, 2, 2, 128, False, "bf16", "int8", (-1, -1), 30.0),  # Grok's cap
]


@pytest.mark.parametrize("B,Sq,Sk,Hq,Hkv,D,causal,pv_dtype,qk_quant,window,softcap", CASES)
def test_softcap_dense(B, Sq, Sk, Hq, Hkv, D, causal, pv_dtype, qk_quant, window, softcap):
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=Sq + D)
    out, lse = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, qk_quant=qk_quant,
                                     window_size=window, softcap=softcap, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    tol = {"fp8": 0.05, "bf16": 0.02}[pv_dtype] if qk_quant else 0.01
    err, lse_err = _nrmse(out, ref), _lse_err(lse, ref_lse)
    print(f"softcap {softcap} D{D} {'causal' if causal else 'full'} {pv_dtype} P.V qk {qk_quant}: "
          f"NRMSE {err:.4f}, LSE max err {lse_err:.4f}")
    assert err < tol, err
    assert lse_err < (0.05 if qk_quant else 0.01)
    if softcap <= 2.0:  # the cap matters here: the uncapped attention is far from the output
        plain = attention_reference(q, k, v, causal=causal, window_size=window)
        assert _nrmse(out, plain) > 5 * err
    # the same signature again: the same bits (plans are off here, see tests/conftest.py; their replay of a capped
    # call is checked in test_launch_plan_gpu.py)
    for _ in range(2):
        again = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, qk_quant=qk_quant,
                                      window_size=window, softcap=softcap, return_lse=True)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_softcap_varlen(pv_dtype):
    lens_q, lens_k = [130, 1, 400, 77], [130, 9, 400, 300]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, _, _ = _inputs(1, sum(lens_q), 1, 8, 2, 128, torch.float16, seed=1)
    _, k, v = _inputs(1, 1, sum(lens_k), 8, 2, 128, torch.float16, seed=2)
    q, k, v = q[0], k[0], v[0]
    out, lse = qattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                            pv_dtype=pv_dtype, softcap=1.0, return_lse=True)
    for i in range(len(lens_q)):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        ref, ref_lse = attention_reference(q[None, a:b], k[None, c:d], v[None, c:d], causal=True, softcap=1.0,
                                           return_lse=True)
        err, lse_err = _nrmse(out[a:b], ref[0]), _lse_err(lse[:, a:b], ref_lse[0])
        print(f"softcap 1.0 varlen seq {i} ({b - a} x {d - c}) {pv_dtype} P.V: NRMSE {err:.4f}, LSE max err {lse_err:.4f}")
        assert err < (0.05 if pv_dtype == "fp8" else 0.02)
        assert lse_err < 0.05


@pytest.mark.parametrize("opts", [dict(granularity="per_block"), dict(smooth_k=False), dict(balance_qk=True),
                                  dict(granularity="per_block", pv_dtype="fp8")])
def test_softcap_with_prepass_options(opts):
    """The smoothing shift added back whichever way K (and Q) were quantized: per_block (prepass Q), unsmoothed K,
    channel balancing (the kernel divides the mean by the balance)."""
    q, k, v = _inputs(1, 500, 700, 4, 2, 128, torch.bfloat16, seed=9)
    k = k + 2.0 * torch.linspace(-1, 1, 128, device="cuda", dtype=k.dtype)  # uneven channel offsets
    out = qattn.flash_attn_func(q, k, v, causal=True, softcap=1.0, **opts)
    ref = attention_reference(q, k, v, causal=True, softcap=1.0)
    err = _nrmse(out, ref)
    print(f"softcap 1.0 {opts}: NRMSE {err:.4f}")
    assert err < (0.05 if opts.get("pv_dtype") == "fp8" else 0.02)


def test_softcap_kernel_level_needs_k_mean():
    """prefill_int8 with softcap: K's smoothing mean is required (the cap is not shift-invariant), and with it the
    call gives flash_attn_func's bits (per_block: the same prepass, then the same kernel)."""
    from qattn.interface.prefill import prefill_int8
    from qattn.quant import quantize_qk_int8

    q, k, v = _inputs(1, 300, 300, 4, 4, 64, torch.bfloat16, seed=4)
    q8, qs, k8, ks, km = quantize_qk_int8(q, k, granularity="per_block")
    with pytest.raises(ValueError, match="k_mean"):
        prefill_int8(q8, qs, k8, ks, v, granularity="per_block", softcap=1.0)
    # without softcap k_mean is optional: it only puts the smoothing shift back into the LSE
    plain, plain_lse = prefill_int8(q8, qs, k8, ks, v, granularity="per_block", return_lse=True)
    shifted, shifted_lse = prefill_int8(q8, qs, k8, ks, v, granularity="per_block", k_mean=km, return_lse=True)
    want_plain = qattn.flash_attn_func(q, k, v, granularity="per_block", return_lse=True)
    assert torch.equal(plain, shifted) and torch.equal(shifted, want_plain[0])
    assert torch.equal(shifted_lse, want_plain[1]) and not torch.equal(plain_lse, shifted_lse)
    got = prefill_int8(q8, qs, k8, ks, v, granularity="per_block", softcap=1.0, k_mean=km, return_lse=True)
    want = qattn.flash_attn_func(q, k, v, granularity="per_block", softcap=1.0, return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the mean matters: zeros (claiming an unsmoothed K) give another output
    other = prefill_int8(q8, qs, k8, ks, v, granularity="per_block", softcap=1.0, k_mean=torch.zeros_like(km))
    ref = attention_reference(q, k, v, softcap=1.0)
    assert _nrmse(other, ref) > 2 * _nrmse(got[0], ref)
