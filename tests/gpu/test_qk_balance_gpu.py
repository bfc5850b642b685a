"""GPU tests: channel balancing of the INT8 Q/K prepass (``balance_qk=True``), bit for bit against the torch
reference, and its effect on attention accuracy through ``flash_attn_func``.

Output buffers and workspaces are poisoned (int8 -128, fp32 / fp64 NaN) as in ``test_qk_int8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from qattn.quant import launch, quantize_qk_int8, quantize_qk_int8_varlen
from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference
from tests.gpu.test_prefill_gpu import _cos, _inputs, _nrmse, assert_flash_attn_func_equals_prepass_path
from tests.gpu.test_qk_int8_gpu import (_assert_bits_equal, _assert_int8_equal, _assert_within_ulps, _cu,
                                        _poisoned_alloc)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "_alloc", _poisoned_alloc)


def _loud(shape, dtype, gen, *, q_channels=(), k_channels=(), offset=0.0):
    """randn with some channels x8 (and a per-channel offset for K), the balancing's use case."""
    x = torch.randn(*shape, generator=gen)
    for c in q_channels + k_channels:
        x[..., c] *= 8.0
    if offset:
        x = x + offset * torch.randn(shape[-1], generator=gen)
    return x.to(dtype).cuda()


def _check(got, ref_fn, smooth_k: bool):
    qi, qs, ki, ks, km, lam = got
    assert lam.dtype == torch.float32 and lam.is_contiguous()
    ref = ref_fn(None)
    if smooth_k:
        _assert_within_ulps(km, ref[4], 2, "k_mean")
        ref = ref_fn(km.cpu())  # K and lam for the kernels' own mean
    else:
        assert km is None
    _assert_bits_equal(lam, ref[5], "qk_balance")
    _assert_int8_equal(qi, ref[0], "q_int8")
    _assert_bits_equal(qs, ref[1], "q_scale")
    _assert_int8_equal(ki, ref[2], "k_int8")
    _assert_bits_equal(ks, ref[3], "k_scale")
    vals = lam.cpu()
    assert torch.equal(vals, torch.exp2(torch.log2(vals).round())), "qk_balance must hold powers of two"
    return vals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_dense_equals_reference(dtype, head_dim, granularity, smooth_k):
    gen = torch.Generator().manual_seed(head_dim + smooth_k)
    q = _loud((2, 333, 8, head_dim), dtype, gen, q_channels=(0, 1, 2))
    k = _loud((2, 1500, 2, head_dim), dtype, gen, k_channels=(5, 9), offset=3.0)
    got = quantize_qk_int8(q, k, granularity=granularity, smooth_k=smooth_k, balance_qk=True)
    assert len(got) == 6 and got[5].shape == (2, 2, head_dim)
    lam = _check(got, lambda km: quantize_qk_int8_reference(q.cpu(), k.cpu(), granularity=granularity,
                                                            smooth_k=smooth_k, k_mean=km, balance_qk=True),
                 smooth_k)
    assert (lam < 1).any() and (lam > 1).any(), "loud Q and loud K channels must move both ways"


def test_dense_zero_channels_and_empty_sides():
    gen = torch.Generator().manual_seed(3)
    q = _loud((1, 40, 2, 64), torch.bfloat16, gen)
    k = _loud((1, 70, 1, 64), torch.bfloat16, gen)
    q[..., 7] = 0  # amax_q 0 -> lam 1
    k[..., 9] = 1.5  # constant: smoothed to 0 -> lam 1
    got = quantize_qk_int8(q, k, balance_qk=True)
    lam = _check(got, lambda km: quantize_qk_int8_reference(q.cpu(), k.cpu(), k_mean=km, balance_qk=True), True)
    assert lam[0, 0, 7] == 1 and lam[0, 0, 9] == 1
    for sq, sk in ((0, 70), (40, 0)):  # one side empty: every lam is 1
        got = quantize_qk_int8(q[:, :sq], k[:, :sk], balance_qk=True)
        assert torch.all(got[5] == 1)


@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_varlen_equals_reference(granularity, smooth_k):
    gen = torch.Generator().manual_seed(11 + smooth_k)
    lens_q = [1, 17, 130, 255, 0, 300, 64]
    lens_k = [300, 5, 129, 0, 1, 77, 2600]
    q = _loud((sum(lens_q), 8, 128), torch.bfloat16, gen, q_channels=(3,))
    k = _loud((sum(lens_k), 2, 128), torch.bfloat16, gen, k_channels=(40, 41), offset=2.0)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    got = quantize_qk_int8_varlen(q, k, cu_q, cu_k, 300, 2600, granularity=granularity, smooth_k=smooth_k,
                                  balance_qk=True)
    args = (q.cpu(), k.cpu(), cu_q.cpu(), cu_k.cpu(), 300, 2600)
    lam = _check(got, lambda km: quantize_qk_int8_varlen_reference(*args, granularity=granularity,
                                                                   smooth_k=smooth_k, k_mean=km, balance_qk=True),
                 smooth_k)
    assert torch.all(lam[3] == 1) and torch.all(lam[4] == 1)  # empty K / empty Q sequences


def test_balance_off_is_unchanged():
    gen = torch.Generator().manual_seed(5)
    q = _loud((1, 200, 4, 128), torch.bfloat16, gen, q_channels=(0,))
    k = _loud((1, 300, 4, 128), torch.bfloat16, gen, offset=1.0)
    plain = quantize_qk_int8(q, k)
    assert len(plain) == 5
    ref = quantize_qk_int8_reference(q.cpu(), k.cpu(), k_mean=plain[4].cpu())
    _assert_int8_equal(plain[0], ref[0], "q_int8")
    _assert_int8_equal(plain[2], ref[2], "k_int8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_heavy_outliers_meet_the_bar_with_balancing(dtype, causal, varlen):
    """The issue's bar (cos >= 0.999, NRMSE <= 3 %) on the "heavy" input, which misses it without balancing
    (3.8 % on the H100)."""
    import qattn
    from qattn.reference.attention import attention_reference

    q, k, v = _inputs(2, 1024, 1024, 4, 2, 128, dtype, outliers="heavy", seed=7)  # the prefill tests' input
    ref = attention_reference(q, k, v, causal=causal)
    res = {}
    for bal in (False, True):
        if varlen:
            cu = _cu([1024, 1024])
            o = qattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 1024, 1024,
                                             causal=causal, balance_qk=bal).view(q.shape)
        else:
            o = qattn.flash_attn_func(q, k, v, causal=causal, balance_qk=bal)
        res[bal] = (_cos(o, ref), _nrmse(o, ref))
    print(f"heavy {dtype} causal={causal} varlen={varlen}: off cos {res[False][0]:.5f} nrmse {res[False][1]:.4f}, "
          f"on cos {res[True][0]:.5f} nrmse {res[True][1]:.4f}")
    assert res[True][0] >= 0.999 and res[True][1] <= 0.03, res
    assert res[True][1] < res[False][1], res


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_heavy_outliers_fp8_pv_with_balancing(causal):
    """FP8 P x V on the "heavy" input: balancing removes the INT8 Q/K share of the error; held to the FP8 P x V
    bar of random inputs (cos >= 0.999, NRMSE <= 4.5 %, ``test_prefill_gpu.FP8_FORMAT_CASES``)."""
    import qattn
    from qattn.reference.attention import attention_reference

    q, k, v = _inputs(2, 1024, 1024, 4, 2, 128, torch.bfloat16, outliers="heavy", seed=8)
    ref = attention_reference(q, k, v, causal=causal)
    res = {}
    for bal in (False, True):
        o = qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype="fp8", balance_qk=bal)
        res[bal] = (_cos(o, ref), _nrmse(o, ref))
    print(f"heavy fp8 P.V causal={causal}: off cos {res[False][0]:.5f} nrmse {res[False][1]:.4f}, "
          f"on cos {res[True][0]:.5f} nrmse {res[True][1]:.4f}")
    assert res[True][0] >= 0.999 and res[True][1] <= 0.045, res
    assert res[True][1] < res[False][1], res


# ------------------------------------------------------------------------------------------------
# flash_attn_func's SM90 per_warp path: K-only balanced prepass + the kernel quantizing q * lam
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sk,hq,hkv,D", [(300, 4, 2, 128), (2600, 2, 1, 64), (1, 8, 8, 128)])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_k_only_balanced_equals_the_k_half(sk, hq, hkv, D, smooth_k):
    from qattn.quant.launch import quantize_k_int8

    gen = torch.Generator().manual_seed(sk + D)
    q = _loud((2, 700, hq, D), torch.bfloat16, gen, q_channels=(1, 2))
    k = _loud((2, sk, hkv, D), torch.bfloat16, gen, k_channels=(6,), offset=2.0)
    full = quantize_qk_int8(q, k, smooth_k=smooth_k, balance_qk=True)
    half = quantize_k_int8(k, smooth_k=smooth_k, balance_q=q)
    assert len(half) == 4
    for got, want in zip(half, full[2:]):
        if want is None:
            assert got is None
        else:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _kernel_vs_prepass(q, k, v, causal, pv_dtype="bf16"):
    assert_flash_attn_func_equals_prepass_path(q, k, v, causal, pv_dtype, balance_qk=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_quantizing_balanced_q_equals_the_prepass_path(dtype, D, causal):
    """Bit-identical outputs, the LSE to fp32 rounding (its smoothing shift from the 16-bit Q): the kernel's q * lam
    quantization is the balanced Q prepass's."""
    gen = torch.Generator().manual_seed(D + causal)
    q = _loud((2, 333, 4, D), dtype, gen, q_channels=(0, 5))
    q[:, :16] = 0  # an all-zero q group
    k = _loud((2, 400, 2, D), dtype, gen, k_channels=(9,), offset=3.0)
    v = _loud((2, 400, 2, D), dtype, gen)
    _kernel_vs_prepass(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_quantizing_balanced_q_fp8_pv_and_varlen(causal):
    import qattn
    from qattn.interface.prefill import prefill_int8_varlen

    gen = torch.Generator().manual_seed(21 + causal)
    q = _loud((1, 500, 4, 128), torch.bfloat16, gen, q_channels=(3,))
    k = _loud((1, 520, 2, 128), torch.bfloat16, gen, k_channels=(60,), offset=1.0)
    v = _loud((1, 520, 2, 128), torch.bfloat16, gen)
    _kernel_vs_prepass(q, k, v, causal, "fp8")
    lens_q, lens_k = [1, 300, 0, 199], [5, 300, 17, 198]
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    qv = _loud((sum(lens_q), 4, 128), torch.bfloat16, gen, q_channels=(3,))
    kv = _loud((sum(lens_k), 2, 128), torch.bfloat16, gen, k_channels=(60,), offset=1.0)
    vv = _loud((sum(lens_k), 2, 128), torch.bfloat16, gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    got, got_lse = qattn.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                balance_qk=True, return_lse=True)
    q8, qs, k8, ks, km, lam = quantize_qk_int8_varlen(qv, kv, cu_q, cu_k, max(lens_q), max(lens_k), balance_qk=True)
    want, want_lse = prefill_int8_varlen(q8, qs, k8, ks, vv, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         return_lse=True)
    assert torch.equal(got, want)
    # the LSE: the kernel that quantizes Q adds the smoothing shift of the 16-bit Q, softmax_scale * q . k_mean
    # (the balance cancels), to fp32 rounding
    seq = torch.repeat_interleave(torch.arange(len(lens_q), device="cuda"), torch.tensor(lens_q, device="cuda"))
    km_rows = km.double()[seq].repeat_interleave(2, dim=1)  # (total_q, Hq, D)
    want_lse = want_lse.double() + (qv.double() * km_rows).sum(-1).T / 128**0.5
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), fin)
    assert float((got_lse.double() - want_lse)[fin].abs().max()) <= 1e-4 * (1 + float(want_lse[fin].abs().max()))
