"""SageAttention-style INT8 Q/K quantization reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qattn.quant.qk_int8 import dequantize_qk_int8_reference, quantize_qk_int8_reference


def make_qk(B=2, Sq=200, Sk=300, Hq=8, Hkv=2, D=64, dtype=torch.float32, seed=0, k_bias=3.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=gen)
    # keys with a large per-channel offset, the case smoothing is for
    k = torch.randn(B, Sk, Hkv, D, generator=gen) + k_bias * torch.randn(1, 1, Hkv, D, generator=gen)
    return q.to(dtype), k.to(dtype)


def loop_scales(x, group, ngroups):
    """Per-(batch, head, group) amax / 127 with Python loops over groups (float64 amax is exact)."""
    B, S, H, _ = x.shape
    out = np.zeros((B, H, ngroups), dtype=np.float32)
    xn = x.double().numpy()
    for b in range(B):
        for h in range(H):
            for g in range(ngroups):
                rows = xn[b, g * group : min((g + 1) * group, S), h]
                amax = np.float32(np.abs(rows).max()) if rows.size else np.float32(0)
                out[b, h, g] = amax / np.float32(127)
    return torch.from_numpy(out)


def row_scales(s, group, S):
    """(B, H, ngroups) -> (B, S, H, 1): each row's scale."""
    return s.repeat_interleave(group, dim=2)[:, :, :S].transpose(1, 2)[..., None]


@pytest.mark.parametrize("granularity", ["per_block", "per_warp"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_shapes_and_scales(granularity, smooth_k):
    q, k = make_qk()
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k)
    assert qi.shape == q.shape and qi.dtype == torch.int8
    assert ki.shape == k.shape and ki.dtype == torch.int8
    nq = 2 if granularity == "per_block" else 2 * (128 // 16)  # ceil(200 / 128) blocks
    assert qs.shape == (2, 8, nq) and qs.dtype == torch.float32
    assert ks.shape == (2, 2, 3) and ks.dtype == torch.float32  # ceil(300 / 128)
    group = 128 if granularity == "per_block" else 16
    assert torch.equal(qs, loop_scales(q.float(), group, nq))
    kk = k.float() - km[:, None] if smooth_k else k.float()
    assert torch.equal(ks, loop_scales(kk, 128, 3))
    if smooth_k:
        assert km.shape == (2, 2, 64) and km.dtype == torch.float32
    else:
        assert km is None
    assert qi.abs().max() <= 127 and ki.abs().max() <= 127 and (qi == -128).sum() == 0


def test_ragged_blocks():
    q, k = make_qk(Sq=200, Sk=130)
    _, qs, _, ks, _ = quantize_qk_int8_reference(q, k, granularity="per_warp")
    # q rows 128..199 fill warps 8..12 (warp 12 partially: rows 192..199); warps 13..15 have no rows
    assert torch.all(qs[:, :, 13:] == 0) and torch.all(qs[:, :, :13] > 0)
    assert torch.equal(qs[:, :, 12], q[:, 192:200].abs().amax(dim=(1, 3)) / 127)
    # k: the second block holds rows 128, 129 only
    _, _, ki, ks, km = quantize_qk_int8_reference(q, k, block_k=128)
    kk = k - km[:, None]
    assert torch.equal(ks[:, :, 1], kk[:, 128:130].abs().amax(dim=(1, 3)) / 127)
    # blocks smaller than the sequence and sizes that do not divide it
    qi, qs, ki, ks, _ = quantize_qk_int8_reference(q, k, granularity="per_warp", block_q=64, warp_q=32,
                                                     block_k=48)
    assert qs.shape == (2, 8, 4 * 2) and ks.shape == (2, 2, 3)
    assert torch.equal(qs, loop_scales(q, 32, 8))


def test_one_row_and_empty():
    q, k = make_qk(Sq=1, Sk=1)
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q, k, granularity="per_block")
    assert qs.shape == (2, 8, 1) and ks.shape == (2, 2, 1)
    assert torch.equal(km, k[:, 0].float()) and torch.all(ki == 0)  # a single key minus its mean is 0
    q0, k0 = make_qk(Sq=0, Sk=0)
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q0, k0)
    assert qs.shape == (2, 8, 0) and ks.shape == (2, 2, 0) and torch.all(km == 0)


def test_smoothing():
    q, k = make_qk(dtype=torch.bfloat16, k_bias=10.0)
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q, k)
    assert torch.equal(km, k.double().mean(dim=1).float())
    _, kh = dequantize_qk_int8_reference(qi, qs, ki, ks)
    # the smoothed, quantized K has ~zero mean per channel, the raw K does not
    assert kh.mean(dim=1).abs().max() < 0.05
    assert k.float().mean(dim=1).abs().max() > 5
    # smoothing makes the k scales smaller (the offset no longer sets amax)
    _, _, _, ks_raw, _ = quantize_qk_int8_reference(q, k, smooth_k=False)
    assert torch.all(ks < ks_raw)
    # an explicit mean is used as given
    m = km + 0.125
    _, _, ki2, ks2, km2 = quantize_qk_int8_reference(q, k, k_mean=m)
    assert km2 is m
    assert torch.equal(ks2, loop_scales(k.float() - m[:, None], 128, 3))


def test_per_warp_scales_not_above_per_block():
    q, k = make_qk(Sq=333)
    _, qb, _, _, _ = quantize_qk_int8_reference(q, k, granularity="per_block")
    _, qw, _, _, _ = quantize_qk_int8_reference(q, k, granularity="per_warp")
    per_block_of_warp = qb.repeat_interleave(128 // 16, dim=2)
    assert torch.all(qw <= per_block_of_warp)
    # each block's scale is the max of its warps' scales
    assert torch.equal(qw.reshape(2, 8, 3, 8).amax(-1), qb)


@pytest.mark.parametrize("granularity", ["per_block", "per_warp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reconstruction_error(granularity, dtype):
    q, k = make_qk(dtype=dtype, seed=1)
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q, k, granularity=granularity)
    qh, kh = dequantize_qk_int8_reference(qi, qs, ki, ks, granularity=granularity)
    group = 128 if granularity == "per_block" else 16
    s_rows = row_scales(qs, group, q.shape[1])
    # half a step, plus the two fp32 roundings of x * (1 / s)
    assert torch.all((qh - q.float()).abs() <= 0.5 * s_rows + 2.0**-21 * q.float().abs())
    ks_rows = row_scales(ks, 128, k.shape[1])
    kk = k.float() - km[:, None]
    assert torch.all((kh - kk).abs() <= 0.5 * ks_rows + 2.0**-21 * kk.abs())
    # the block max reaches +-127
    assert qi.abs().amax(dim=(1, 3)).min() == 127


def test_exact_values_and_rounding():
    # rows that are integers times a power of two, with 127 present: exact; halves round to even
    q = torch.zeros(1, 16, 1, 16)
    q[0, :, 0, :] = torch.arange(-127, 129, dtype=torch.float32).clamp(max=127).reshape(16, 16)
    q[0, 0, 0, 0] = 127.0
    k = q * 0.25
    qi, qs, ki, ks, _ = quantize_qk_int8_reference(q, k, smooth_k=False, granularity="per_block")
    assert qs.item() == 1.0 and ks.item() == 0.25 and torch.equal(qi.float(), q) and torch.equal(ki.float(), q)
    q2 = torch.zeros(1, 1, 1, 16)
    q2[0, 0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
    qi, _, _, _, _ = quantize_qk_int8_reference(q2, q2, smooth_k=False)
    assert qi[0, 0, 0, :4].tolist() == [127, 0, 2, -2]


def test_tiny_and_zero_groups():
    q, k = make_qk(Sq=64, Sk=64)
    q[:, :16] = 0
    q[:, 16:32] = 1e-40
    qi, qs, ki, ks, _ = quantize_qk_int8_reference(q, k)
    assert torch.all(qs[:, :, 0] == 0) and torch.all(qi[:, :32] == 0)  # subnormal scale: encoded as zeros
    qh, _ = dequantize_qk_int8_reference(qi, qs, ki, ks)
    assert torch.isfinite(qh).all()


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2), Sq=st.integers(1, 90), Sk=st.integers(1, 90), hkv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 3]), D=st.sampled_from([16, 64]), block_q=st.sampled_from([32, 64]),
    warp_q=st.sampled_from([8, 16, 32]), block_k=st.sampled_from([16, 64]),
    granularity=st.sampled_from(["per_block", "per_warp"]), smooth=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_prop_scales_and_bounds(B, Sq, Sk, hkv, rep, D, block_q, warp_q, block_k, granularity, smooth, seed):
    q, k = make_qk(B, Sq, Sk, hkv * rep, hkv, D, seed=seed)
    qi, qs, ki, ks, km = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth,
                                                     block_q=block_q, warp_q=warp_q, block_k=block_k)
    nblk = math.ceil(Sq / block_q)
    group, ng = (block_q, nblk) if granularity == "per_block" else (warp_q, nblk * (block_q // warp_q))
    assert torch.equal(qs, loop_scales(q, group, ng))
    kk = k - km[:, None] if smooth else k
    assert torch.equal(ks, loop_scales(kk, block_k, math.ceil(Sk / block_k)))
    qh, kh = dequantize_qk_int8_reference(qi, qs, ki, ks, granularity=granularity, block_q=block_q,
                                          warp_q=warp_q, block_k=block_k)
    assert torch.all((qh - q).abs() <= 0.5 * row_scales(qs, group, Sq) + 2.0**-21 * q.abs())
    assert torch.all((kh - kk).abs() <= 0.5 * row_scales(ks, block_k, Sk) + 2.0**-21 * kk.abs())


def test_errors():
    q, k = make_qk(Sq=32, Sk=32)
    call = quantize_qk_int8_reference
    with pytest.raises(ValueError, match="granularity"):
        call(q, k, granularity="per_token")
    with pytest.raises(ValueError, match="warp_q"):
        call(q, k, block_q=128, warp_q=48)
    with pytest.raises(ValueError, match="block_k"):
        call(q, k, block_k=0)
    with pytest.raises(TypeError, match="block_q"):
        call(q, k, block_q=128.0)
    # each check's own "<name>: <what>" message (qk_int8._check_tensor / _check_pair), not just a letter
    with pytest.raises(TypeError, match=r"^q: expected dtype in .*, got torch\.float64$"):
        call(q.double(), k)
    with pytest.raises(TypeError, match=r"^k: expected dtype in .*, got torch\.int8$"):
        call(q, k.to(torch.int8))
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor, got ndarray$"):
        call(q.numpy(), k)
    with pytest.raises(ValueError, match=r"^q: expected shape \(batch, seqlen, heads, head_dim\), got \(32, 8, 64\)$"):
        call(q[0], k)
    with pytest.raises(ValueError, match=r"^k: batch 1 differs from q's batch 2$"):
        call(q, k[:1])  # batch
    with pytest.raises(ValueError, match=r"^k: head_dim 32 differs from q's head_dim 64$"):
        call(q, k[..., :32])  # head_dim
    with pytest.raises(ValueError, match="num_kv_heads"):
        call(q[:, :, :7], k)  # Hq % Hkv
    qb = q.clone()
    qb[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match=r"^q: contains NaN or Inf$"):
        call(qb, k)
    kb = k.clone()
    kb[0, 0, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"^k: contains NaN or Inf$"):
        call(q, kb)
    with pytest.raises(ValueError, match="k_mean"):
        call(q, k, k_mean=torch.zeros(2, 2, 32))
    with pytest.raises(ValueError, match="k_mean"):
        call(q, k, smooth_k=False, k_mean=torch.zeros(2, 2, 64))
    with pytest.raises(TypeError, match="k_mean"):
        call(q, k, k_mean=torch.zeros(2, 2, 64, dtype=torch.float64))
    qi, qs, ki, ks, _ = call(q, k)
    with pytest.raises(ValueError, match="q_scale"):
        dequantize_qk_int8_reference(qi, qs, ki, ks, granularity="per_block")
    with pytest.raises(ValueError, match="k_scale"):
        dequantize_qk_int8_reference(qi, qs, ki, ks, block_k=16)
    with pytest.raises(TypeError, match="q_int8"):
        dequantize_qk_int8_reference(qi.float(), qs, ki, ks)
    with pytest.raises(TypeError, match="k_scale"):
        dequantize_qk_int8_reference(qi, qs, ki, ks.double())


# ------------------------------------------------------------------------------------------------
# channel balancing (balance_qk)
# ------------------------------------------------------------------------------------------------
def _fp64_attention(q, k, v, causal=True):
    """Exact attention (fp64), GQA by repeating kv heads: (B, S, H, D) inputs."""
    rep = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(rep, dim=1), vd.repeat_interleave(rep, dim=1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vd).transpose(1, 2)


def test_balance_exponent_is_the_rounded_half_log_ratio():
    from qattn.quant.qk_int8 import qk_balance_reference

    gen = torch.Generator().manual_seed(0)
    aq = torch.exp2(torch.empty(4000).uniform_(-40, 40, generator=gen)).float()
    ak = torch.exp2(torch.empty(4000).uniform_(-40, 40, generator=gen)).float()
    ak[:50] = aq[:50] * 2.0  # exact powers of two apart: ties of the rounding
    ak[50:100] = aq[50:100]
    lam = qk_balance_reference(aq, ak)
    # independent: t = ak / aq in fp64 (floor(log2 t) is exact unless t is within 2^-48 of a power of two)
    t = ak.double() / aq.double()
    e = torch.floor((torch.floor(torch.log2(t)) + 1) / 2).clamp(-32, 32)
    assert torch.equal(lam.double(), torch.exp2(e))
    assert torch.all(lam[50:100] == 1) and torch.all(lam[:50] == 2)
    # balanced amaxes within a factor 2 of each other wherever no clamp applies
    inner = e.abs() < 32
    r = (ak.double() / lam.double()) / (aq.double() * lam.double())
    assert torch.all((r[inner] >= 0.5) & (r[inner] < 2))
    # zero, subnormal and clamped cases
    z = qk_balance_reference(torch.tensor([0.0, 1e-40, 1.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 2.0**100, 3e-39]))
    assert z.tolist() == [1.0, 1.0, 1.0, 2.0**32, 1.0]


@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
def test_balance_leaves_qk_unchanged(smooth_k, granularity):
    q, k = make_qk(Sq=130, Sk=257, D=64, dtype=torch.bfloat16, seed=4)
    q[..., :3] *= 16
    k[..., 7] *= 16
    qi, qs, ki, ks, km, lam = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k,
                                                         balance_qk=True)
    assert lam.shape == (2, 2, 64) and lam.dtype == torch.float32
    assert torch.equal(lam, torch.exp2(torch.log2(lam).round()))
    assert (lam[..., 7] > 1).all()  # K's loud channel: K / lam, Q * lam
    assert (lam[..., :3] < 1).all()  # Q's loud channels: the other way
    # the same bytes as quantizing the explicitly scaled tensors without balancing
    rep = q.shape[2] // k.shape[2]
    q_bal = (q.float() * lam.repeat_interleave(rep, dim=1).unsqueeze(1))
    k_s = k.float() - km.unsqueeze(1) if smooth_k else k.float()
    k_bal = k_s / lam.unsqueeze(1)
    ref = quantize_qk_int8_reference(q_bal, k_bal, granularity=granularity, smooth_k=False)
    assert torch.equal(qi, ref[0]) and torch.equal(qs, ref[1]) and torch.equal(ki, ref[2]) and torch.equal(ks, ref[3])
    # and q_bal k_bal^T == q k_s^T up to fp32 rounding of the products
    s0 = torch.einsum("bshd,bthd->bhst", q.double()[:, :, ::rep], k_s.double())
    s1 = torch.einsum("bshd,bthd->bhst", q_bal.double()[:, :, ::rep], k_bal.double())
    assert torch.allclose(s0, s1, rtol=1e-12, atol=1e-9)


def test_balance_improves_attention_on_loud_channels():
    """fp64 attention over the dequantized int8 Q/K: loud Q and K channels (x4) give ~3.8 % NRMSE, balanced ~2 %;
    plain random inputs are unchanged (1.1 %)."""
    gen = torch.Generator().manual_seed(1)
    B, S, H, D = 1, 512, 2, 128
    q, k, v = (torch.randn(B, S, H, D, generator=gen) for _ in range(3))
    k[..., 10:13] += 10.0
    ref_plain = _fp64_attention(q, k, v)
    q[..., :4] *= 4.0
    k[..., 5:8] *= 4.0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = _fp64_attention(q, k, v)

    def err(bal, qq, kk, rr):
        out = quantize_qk_int8_reference(qq, kk, balance_qk=bal)
        qd, kd = dequantize_qk_int8_reference(*out[:4])
        o = _fp64_attention(qd, kd, v)
        return float((o - rr).pow(2).mean().sqrt() / rr.pow(2).mean().sqrt())

    off, on = err(False, q, k, ref), err(True, q, k, ref)
    assert off > 0.03 and on < 0.025, (off, on)
    del ref_plain


@pytest.mark.parametrize("name", ["block_q", "warp_q", "block_k"])
def test_block_sizes_are_capped(name):
    """A huge block would size a huge scale tensor (per_warp: block_q / warp_q groups per block): refused."""
    from qattn.quant.qk_int8 import MAX_BLOCK_ROWS

    q, k = make_qk(Sq=32, Sk=32)
    blocks = dict(block_q=MAX_BLOCK_ROWS, warp_q=16, block_k=MAX_BLOCK_ROWS)
    quantize_qk_int8_reference(q, k, **blocks)  # the cap itself is allowed
    with pytest.raises(ValueError, match=f"{name}: at most {MAX_BLOCK_ROWS} rows"):
        quantize_qk_int8_reference(q, k, **{**blocks, name: 2 * MAX_BLOCK_ROWS})
