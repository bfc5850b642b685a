import math

import pytest
import torch

from qattn.reference import attention_reference


def naive(q, k, v, causal, scale, lens, window=(-1, -1)):
    """Row-by-row softmax in Python: the slowest, most obvious version (``window``: FlashAttention's
    window_size, spelled out from its docstring)."""
    B, Sq, Hq, D = q.shape
    g = Hq // k.shape[2]
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    left, right = window
    for b in range(B):
        L = int(lens[b])
        for h in range(Hq):
            for i in range(Sq):
                keys = [j for j in range(L) if (not causal or j <= i + L - Sq)
                        and (right < 0 or j <= i + L - Sq + right) and (left < 0 or j >= i + L - Sq - left)]
                if not keys:
                    continue
                s = torch.stack([q[b, i, h].double() @ k[b, j, h // g].double() * scale for j in keys])
                m = s.max()
                p = torch.exp(s - m)
                lse[b, h, i] = m + torch.log(p.sum())
                out[b, i, h] = sum(p[n] * v[b, j, h // g].double() for n, j in enumerate(keys)) / p.sum()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Hq,Hkv", [(1, 4, 4), (3, 8, 2), (5, 6, 1)])
def test_matches_naive(causal, Sq, Hq, Hkv):
    g = torch.Generator().manual_seed(Sq * 10 + Hq)
    B, Sk, D = 2, 9, 16
    q = torch.randn(B, Sq, Hq, D, generator=g)
    k = torch.randn(B, Sk, Hkv, D, generator=g)
    v = torch.randn(B, Sk, Hkv, D, generator=g)
    lens = torch.tensor([9, 4])
    out, lse = attention_reference(q, k, v, causal=causal, kv_lens=lens, return_lse=True, softmax_scale=0.3)
    ref_out, ref_lse = naive(q, k, v, causal, 0.3, lens)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal,window", [(False, (2, 1)), (True, (3, -1)), (True, (0, 5)), (False, (-1, 0)),
                                           (False, (4, -1)), (False, (0, 0)), (False, (-1, 3))])
@pytest.mark.parametrize("Sq", [1, 5, 12])
def test_sliding_window_matches_naive(causal, window, Sq):
    g = torch.Generator().manual_seed(Sq + 7 * window[0])
    B, Sk, D, Hq, Hkv = 2, 9, 16, 4, 2
    q = torch.randn(B, Sq, Hq, D, generator=g)
    k = torch.randn(B, Sk, Hkv, D, generator=g)
    v = torch.randn(B, Sk, Hkv, D, generator=g)
    lens = torch.tensor([9, 6])
    out, lse = attention_reference(q, k, v, causal=causal, kv_lens=lens, return_lse=True, softmax_scale=0.3,
                                   window_size=window)
    ref_out, ref_lse = naive(q, k, v, causal, 0.3, lens, window)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_row_without_keys_is_zero():
    q = torch.randn(1, 4, 2, 16)
    k = v = torch.randn(1, 6, 2, 16)
    out, lse = attention_reference(q, k, v, causal=True, kv_lens=torch.tensor([2]), return_lse=True)
    # len 2, Sq 4: queries 0 and 1 sit before the first key
    assert torch.all(out[0, :2] == 0) and torch.all(torch.isinf(lse[0, :, :2]))
    assert torch.isfinite(out[0, 2:]).all()


def test_default_scale_and_errors():
    q = torch.randn(1, 1, 2, 64)
    k = v = torch.randn(1, 3, 2, 64)
    a = attention_reference(q, k, v)
    b = attention_reference(q, k, v, softmax_scale=1 / math.sqrt(64))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="kv heads"):
        attention_reference(torch.randn(1, 1, 3, 64), k, v)


def _outlier_qkv(B, Sq, Sk, Hq, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g)
    k = torch.randn(B, Sk, Hkv, D, generator=g) + 4.0 * torch.randn(1, 1, Hkv, D, generator=g)  # channel bias
    k[..., 3] *= 10  # an outlier channel
    v = torch.randn(B, Sk, Hkv, D, generator=g)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_int8_close_to_exact(granularity, causal):
    from qattn.reference import prefill_reference

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 200, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    exact = prefill_reference(q, k, v, causal=causal)
    fq = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=granularity)
    cos = torch.nn.functional.cosine_similarity(fq.flatten(), exact.flatten(), dim=0)
    nrmse = (fq - exact).norm() / exact.norm()
    assert cos > 0.999 and nrmse < 0.03
    assert not torch.equal(fq, exact)


def test_prefill_smoothing_helps_biased_keys():
    from qattn.reference import prefill_reference

    q, k, v = _outlier_qkv(1, 128, 256, 2, 2, 64, 8)
    exact = prefill_reference(q, k, v)
    err = {s: float((prefill_reference(q, k, v, qk_quant="int8", smooth_k=s) - exact).norm()) for s in (False, True)}
    assert err[True] < err[False]


def test_prefill_bad_mode():
    from qattn.reference import prefill_reference

    q, k, v = _outlier_qkv(1, 8, 8, 2, 2, 64, 9)
    with pytest.raises(ValueError, match="qk_quant"):
        prefill_reference(q, k, v, qk_quant="int4")


def test_prefill_reference_lse_is_that_of_the_unsmoothed_k():
    """smooth_k: the LSE gets softmax_scale * q . k_mean back, close to the exact one despite K offsets."""
    from qattn.reference import lse_smoothing_shift, prefill_reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, h, 64, generator=g) for n, h in ((200, 4), (300, 2), (300, 2)))
    k = k + 3 * torch.randn(2, 64, generator=g)
    exact = attention_reference(q, k, v, return_lse=True)[1]
    lse = prefill_reference(q, k, v, qk_quant="int8", return_lse=True)[1]
    assert float((lse - exact).abs().max()) < 0.1
    assert float((lse - lse_smoothing_shift(q, k.mean(1), None) - exact).abs().mean()) > 1.0
    # the shift from the caller's Q (SM90 flash_attn_func, per_warp) leaves out the int8 Q's rounding times the mean
    lse16 = prefill_reference(q, k, v, qk_quant="int8", return_lse=True, lse_q="16bit")[1]
    assert float((lse16 - exact).abs().max()) < float((lse - exact).abs().max()) / 4
    with pytest.raises(ValueError, match="lse_q"):
        prefill_reference(q, k, v, qk_quant="int8", lse_q="fp32")
