"""Encoder-side block-scale search (``quantize(..., scale_search="mse")``): an independent numpy mirror (bit-exact
bytes), never a larger block SSE than the plain rule, ordinary decode, edge cases (zeros, subnormal E4M3 scales,
saturation), and argument errors."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qattn.layouts import kv_format
from qattn.quant.reference import (
    SCALE_SEARCHES,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    fake_quantize,
    mx_shared_exponent,
    quantize,
    unpack_e2m1,
)

F32 = np.float32
FP4 = {
    "nvfp4": kv_format("nvfp4"),
    "mxfp4": kv_format("mxfp4"),  # rceil
    "mxfp4_floor": kv_format("mxfp4", scale_rule="floor"),
    "mxfp4_b16": kv_format("mxfp4_b16"),
    "mxfp4_b16_floor": kv_format("mxfp4_b16", scale_rule="floor"),
}


# ------------------------------------------------------------------------------------------------
# numpy mirror, one block at a time (float32 arithmetic, ml_dtypes casts, python loops)
# ------------------------------------------------------------------------------------------------
def np_e2m1_rt(y):
    return y.astype(ml_dtypes.float4_e2m1fn).astype(F32)  # RNE, saturating (E2M1 has no inf)


def np_tree_sse(x, deq):
    e = (x - deq).astype(F32)
    with np.errstate(over="ignore"):  # huge blocks: inf SSE for every candidate, the plain rule wins the tie
        sq = (e * e).astype(F32)
    n = sq.shape[-1]
    while n > 1:
        n //= 2
        sq = (sq[:n] + sq[n:2 * n]).astype(F32)
    return sq[0]


def np_e4m3_byte(t):
    return int(np.array(min(t, F32(448.0)), dtype=F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def np_e4m3_val(b):
    return F32(np.array(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32))


def np_nvfp4_block(xb, g, search):
    g = F32(g)
    amax = F32(np.abs(xb).max())
    s0 = np_e4m3_byte(F32(amax / F32(g * F32(6))))
    s46 = np_e4m3_byte(F32(amax / F32(g * F32(4))))
    nb = lambda k: min(max(s0 + k, 0), 0x7E)  # noqa: E731
    cands = {"mse": [s0, s46, nb(-1), nb(1)], "mse46": [s0, s46], "msenb": [s0, nb(-1), nb(1)], "mseup": [s0, s46, nb(1)],
             "msewide": [s0, s46] + [nb(k) for k in range(-8, 9) if k]}[search]
    best, best_sse = None, None
    for b in cands:
        sf = np_e4m3_val(b)
        d = F32(sf * g)
        inv = F32(F32(1) / d) if d >= F32(2.0**-126) else F32(0)
        deq = ((np_e2m1_rt((xb * inv).astype(F32)) * sf).astype(F32) * g).astype(F32)
        sse = np_tree_sse(xb, deq)
        if best is None or sse < best_sse:
            best, best_sse = b, sse
    return best


def np_mx_block(xb, rule, search):
    amax = float(np.abs(xb).max())
    if amax == 0 or amax < 2.0**-126:
        e_f, e_r = -127, -127
    else:
        m, E = np.frexp(amax)  # amax = m * 2**E, m in [0.5, 1)
        e_f = int(E) - 1 - 2
        e_r = e_f + (1 if 2 * m > 1.5 else 0)
    e_f, e_r = max(min(e_f, 125), -127), max(min(e_r, 125), -127)
    e_rule = e_r if rule == "rceil" else e_f
    other = min(e_f + 1, 125) if e_rule == e_f else e_f
    cands = [e_rule, other] + ([max(e_f - 1, -127), min(e_f + 2, 125)] if search == "msewide" else [])
    best, best_sse = None, None
    for e in cands:
        deq = (np_e2m1_rt((xb * F32(2.0**-e)).astype(F32)) * F32(2.0**e)).astype(F32)
        sse = np_tree_sse(xb, deq)
        if best is None or sse < best_sse:
            best, best_sse = e, sse
    return best + 127


def np_scales(x, fmt, g, search):
    x = x.float().numpy()
    blk = fmt.scale_block
    lead, D = x.shape[:-1], x.shape[-1]
    xb = x.reshape(-1, D // blk, blk)
    gg = np.broadcast_to(np.asarray(1.0 if g is None else g, dtype=F32), lead).reshape(-1)
    out = np.zeros(xb.shape[:2], dtype=np.uint8)
    for r in range(xb.shape[0]):
        for b in range(xb.shape[1]):
            if fmt.scale_rule == "nvfp4":
                out[r, b] = np_nvfp4_block(xb[r, b], gg[r], search)
            else:
                out[r, b] = np_mx_block(xb[r, b], fmt.scale_rule, search)
    return out.reshape(*lead, D // blk)


def block_sse(x, fmt, g, payload, scales):
    """fp64 SSE per block of the decoded encoding."""
    y = dequantize(payload, scales, fmt, g).double()
    blk = fmt.scale_block
    return ((x.double() - y) ** 2).reshape(*x.shape[:-1], -1, blk).sum(-1)


def check_search(x, name, g, search="mse"):
    fmt = FP4[name]
    p0, s0 = quantize(x, fmt, g)
    p1, s1 = quantize(x, fmt, g, scale_search=search)
    assert p1.shape == p0.shape and s1.shape == s0.shape and p1.dtype == p0.dtype and s1.dtype == s0.dtype
    # bit-exact against the numpy mirror
    assert np.array_equal(s1.numpy(), np_scales(x, fmt, g, search))
    # the codes are the plain RNE encoding for the chosen scale
    blk = fmt.scale_block
    xb = x.float().reshape(*x.shape[:-1], -1, blk)
    if fmt.scale_rule == "nvfp4":
        gb = (torch.ones(()) if g is None else torch.as_tensor(g, dtype=torch.float32)).expand(x.shape[:-1])
        d = e4m3_decode(s1) * gb.unsqueeze(-1)
        inv = torch.where(d >= 2.0**-126, 1.0 / d, torch.zeros_like(d))
    else:
        inv = torch.exp2(-(s1.double() - 127)).float()
    codes = e2m1_encode(xb * inv.unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(unpack_e2m1(p1), codes)
    # ordinary decode; never worse than the plain rule per block (the rule compares fp32 tree sums, so check fp64
    # with a relative slack of a few fp32 ulps)
    assert torch.equal(fake_quantize(x, fmt, g, scale_search=search), dequantize(p1, s1, fmt, g))
    e0, e1 = block_sse(x, fmt, g, p0, s0), block_sse(x, fmt, g, p1, s1)
    assert bool((e1 <= e0 * (1 + 1e-5) + 1e-300).all())
    return e0, e1


# ------------------------------------------------------------------------------------------------
# deterministic cases
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FP4))
@pytest.mark.parametrize("search", SCALE_SEARCHES)
def test_search_matches_mirror_gaussian(name, search):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(24, 3, 64, generator=gen)
    x[..., 5] *= 20  # an outlier channel
    g = x.abs().amax((0, 2)) / 2688 if name == "nvfp4" else None
    e0, e1 = check_search(x, name, g, search)
    assert float(e1.sum()) < float(e0.sum())  # the search helps on Gaussian data


def test_nvfp4_mse_reduces_error_and_uses_each_candidate():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 64, generator=gen)
    g = float(x.abs().max()) / 2688
    p0, s0 = quantize(x, "nvfp4", g)
    p1, s1 = quantize(x, "nvfp4", g, scale_search="mse")
    fmt = kv_format("nvfp4")
    e0, e1 = block_sse(x, fmt, g, p0, s0).sum(), block_sse(x, fmt, g, p1, s1).sum()
    assert float(e1) < 0.85 * float(e0)
    amax = x.reshape(4096, 4, 16).abs().amax(-1)
    s46 = (amax / (g * 4.0)).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
    d = s1.int() - s0.int()
    assert bool((d == -1).any()) and bool((d == 1).any()) and bool((d == 0).any())
    assert bool(((s1 == s46) & (s1 != s0)).any())


def test_zero_rows_and_blocks():
    x = torch.zeros(3, 64)
    x[1, 16:32] = torch.linspace(-1, 1, 16)
    for name in FP4:
        fmt = FP4[name]
        g = 0.01 if name == "nvfp4" else None
        p0, s0 = quantize(x, fmt, g)
        p1, s1 = quantize(x, fmt, g, scale_search="mse")
        zero = x.reshape(3, -1, fmt.scale_block).abs().amax(-1) == 0
        assert torch.equal(s1[zero], s0[zero])  # ties keep the plain rule's scale
        assert torch.equal(fake_quantize(x, fmt, g, scale_search="mse")[0], torch.zeros(64))
        check_search(x, name, g)


def test_nvfp4_subnormal_scales_and_saturation():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 64, generator=gen)
    # subnormal E4M3 block scales: amax / (6 g) below 2**-6
    for g in (1.0, 30.0, 1000.0):
        _, s = quantize(x, "nvfp4", g, scale_search="mse")
        if g >= 30.0:
            assert bool((e4m3_decode(s) < 2.0**-6).any())
        check_search(x, "nvfp4", g)
    # saturation: amax far above 448 * 6 * g; candidates clamp at byte 0x7E (448), never 0x7F (NaN)
    g = float(x.abs().max()) / 2688 / 4
    p, s = quantize(x, "nvfp4", g, scale_search="mse")
    assert int(s.max()) <= 0x7E and bool((s == 0x7E).any())
    assert bool(torch.isfinite(dequantize(p, s, "nvfp4", g)).all())
    check_search(x, "nvfp4", g)


def test_mx_extremes():
    x = torch.tensor([[3.0e38] + [1.0] * 31, [1e-40] * 32, [-2.0**-130] + [0.0] * 31, [6.0 * 2**-127] * 32])
    for name in ("mxfp4", "mxfp4_floor"):
        fmt = FP4[name]
        p, s = quantize(x, fmt, scale_search="mse")
        assert int(s.max()) <= 125 + 127
        check_search(x, name, None)
        assert bool(torch.isfinite(dequantize(p, s, fmt)).all())
    # the MX candidates are exactly {floor, floor + 1}; rceil is one of them
    amax = torch.rand(1000) * 100
    ef, er = mx_shared_exponent(amax, "floor"), mx_shared_exponent(amax, "rceil")
    assert bool(((er == ef) | (er == ef + 1)).all())


def test_ties_keep_plain_rule():
    # a block whose values are exactly representable with the plain scale: SSE 0, no other candidate can win
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2)
    x = torch.stack([vals, -vals]).repeat(1, 4)  # (2, 64)
    for name in FP4:
        fmt = FP4[name]
        g = 1.0 if name == "nvfp4" else None
        p0, s0 = quantize(x, fmt, g)
        p1, s1 = quantize(x, fmt, g, scale_search="mse")
        assert torch.equal(s1, s0) and torch.equal(p1, p0)


def test_scale_search_errors():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="scale_search"):
        quantize(x, "nvfp4", scale_search="bogus")
    for name in ("int8", "fp8", "bf16"):
        with pytest.raises(ValueError, match="scale_search"):
            quantize(x, name, scale_search="mse")
    assert torch.equal(fake_quantize(x, "int8"), fake_quantize(x, "int8", scale_search=None))


# ------------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------------
@st.composite
def search_inputs(draw):
    name = draw(st.sampled_from(list(FP4)))
    fmt = FP4[name]
    D = draw(st.sampled_from([32, 64, 128]))
    rows = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    mag = draw(st.integers(-30, 30))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    zero_frac = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
    n_out = draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=gen)
    if n_out:
        x[:, torch.randperm(D, generator=gen)[:n_out]] *= 50.0
    if zero_frac:
        x = torch.where(torch.rand(rows, D, generator=gen) < zero_frac, 0.0, x)
    x = (x * 2.0**mag).to(dtype)
    g = None
    if fmt.has_global_scale:
        amax = float(x.float().abs().max()) or 1.0
        # calibrated, too small (saturating), too large (subnormal block scales), a constant
        g = amax / 2688 * draw(st.sampled_from([1.0, 0.3, 0.05, 30.0, 3000.0]))
        if draw(st.booleans()):
            g = 1.0
    search = draw(st.sampled_from(SCALE_SEARCHES))
    return name, x, g, search


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(search_inputs())
def test_prop_search(args):
    name, x, g, search = args
    check_search(x, name, g, search)


def test_decoders_unchanged_by_search():
    """The search changes only which bytes the encoder writes: decoding the bytes by hand equals dequantize."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=gen)
    g = float(x.abs().max()) / 2688
    p, s = quantize(x, "nvfp4", g, scale_search="mse")
    vals = e2m1_decode(unpack_e2m1(p)).reshape(8, 4, 16)
    assert torch.equal(((vals * e4m3_decode(s).unsqueeze(-1)) * g).reshape(8, 64), dequantize(p, s, "nvfp4", g))
    p, s = quantize(x, "mxfp4", scale_search="mse")
    vals = e2m1_decode(unpack_e2m1(p)).reshape(8, 2, 32)
    assert torch.equal((vals * torch.exp2(s.float() - 127).unsqueeze(-1)).reshape(8, 64), dequantize(p, s, "mxfp4"))


# ------------------------------------------------------------------------------------------------
# a cache format with a search (KVFormat.scale_search): quantize and the reference writer use it
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FP4))
def test_format_scale_search_is_quantize_default(name):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2, 64, generator=gen)
    plain = FP4[name]
    fmt = kv_format(plain, scale_search="msenb")
    g = torch.tensor([0.003, 0.01]) if plain.has_global_scale else None
    p1, s1 = quantize(x, fmt, g)
    p2, s2 = quantize(x, plain, g, scale_search="msenb")
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    assert not torch.equal(s1, quantize(x, plain, g)[1])  # the search moved some scales


def test_reference_writer_follows_the_cache_format():
    from qattn.layouts.paged import PagedKVCache
    from qattn.reference.kv_ops import write_kv_reference

    gen = torch.Generator().manual_seed(9)
    H, D, page, n = 2, 64, 16, 40
    f = kv_format(("int8", "nvfp4"), scale_search="msenb")
    cache = PagedKVCache(1, 4, page, H, D, f)
    cache.layer(0).v_global_scale.copy_(torch.tensor([0.004, 0.02]))
    k, v = (torch.randn(n, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    slots = torch.arange(n)
    write_kv_reference(cache, 0, k, v, slots)
    lay = cache.layer(0)
    payload, scales = quantize(v, "nvfp4", lay.v_global_scale, scale_search="msenb")
    # pools are (blocks, heads, page, row): slots 0..n-1 in token order
    assert torch.equal(lay.v_data.permute(0, 2, 1, 3).reshape(-1, H, D // 2)[:n], payload)
    assert torch.equal(lay.v_scale_pool.permute(0, 2, 1, 3).reshape(-1, H, D // 16)[:n], scales)
    assert torch.equal(lay.k_data.permute(0, 2, 1, 3).reshape(-1, H, D)[:n], quantize(k, "int8")[0])
