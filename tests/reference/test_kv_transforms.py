"""Insert transforms in the reference writer (RoPE, K smoothing, cache rotation), NVFP4 calibration and the
decode-side rotation, all on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

import qattn
from qattn.layouts.paged import KVLayer, PagedKVCache
from qattn.quant.reference import dequantize, e4m3_decode, quantize
from qattn.quant.transforms import (
    RoPE,
    apply_rope,
    rotate,
    rotate_query,
    rotate_rows,
    rotation_signs,
    transform_kv,
    unrotate,
    unrotate_output,
    unrotate_rows,
)
from qattn.reference.attention import attention_reference, paged_decode_reference
from qattn.reference.kv_ops import write_kv_reference


def _rope_fp64(x, positions, theta, rd, style):
    """Straightforward RoPE in fp64 with fp64 angles (no table)."""
    x = x.double().clone()
    half = rd // 2
    inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if style == "neox":
        x1, x2 = x[..., :half].clone(), x[..., half:rd].clone()
        x[..., :half], x[..., half:rd] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0:rd:2].clone(), x[..., 1:rd:2].clone()
        x[..., 0:rd:2], x[..., 1:rd:2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return x


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rd", [(64, 64), (128, 128), (128, 64), (128, 80), (256, 200)])
def test_rope_matches_fp64(style, head_dim, rd):
    g = torch.Generator().manual_seed(rd)
    T, H, theta = 50, 3, 10000.0
    x = (torch.randn(T, H, head_dim, generator=g) * 5).to(torch.bfloat16)
    pos = torch.randint(0, 8192, (T,), generator=g)
    rope = RoPE.from_theta(theta, rd, 8192, style)
    got = apply_rope(x, pos, rope)
    want = _rope_fp64(x, pos, theta, rd, style)
    assert got.dtype == torch.float32
    # fp32 table (cos/sin rounded once) and fp32 products: a few ulps of max |x|
    assert (got.double() - want).abs().max() <= 4e-6 * x.float().abs().max()
    assert torch.equal(got[..., rd:], x[..., rd:].float())  # partial rotary: the tail is untouched
    # a rotation: the norm of every pair is kept
    torch.testing.assert_close(got.double().norm(dim=-1), x.double().norm(dim=-1), rtol=1e-5, atol=0)


def test_rope_table():
    rope = RoPE.from_theta(500000.0, 64, 100, "gptj")
    t = rope.cos_sin_cache
    assert t.shape == (100, 64) and t.dtype == torch.float32 and rope.rotary_dim == 64
    assert torch.equal(t[0, :32], torch.ones(32)) and torch.equal(t[0, 32:], torch.zeros(32))
    torch.testing.assert_close(t[:, :32] ** 2 + t[:, 32:] ** 2, torch.ones(100, 32))
    x = torch.randn(4, 2, 64)
    assert torch.equal(apply_rope(x, torch.zeros(4, dtype=torch.long), rope), x)  # position 0 is identity
    with pytest.raises(ValueError, match="style"):
        RoPE(t, "llama")
    with pytest.raises(TypeError, match="float32"):
        RoPE(t.double())
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, torch.tensor([0, 1, 2, 100]), rope)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(torch.randn(4, 2, 32), torch.zeros(4, dtype=torch.long), rope)


def test_rotate_rows_equals_seeded_rotate():
    x = torch.randn(5, 2, 128)
    s = rotation_signs(128, 9)
    assert torch.equal(rotate_rows(x, s), rotate(x, 9))
    assert torch.equal(unrotate_rows(x, s), unrotate(x, 9))
    q = torch.randn(2, 1, 4, 128).to(torch.bfloat16)
    qr = rotate_query(q, s)
    assert qr.dtype == torch.bfloat16
    out = torch.empty_like(q)
    assert unrotate_output(qr, s, out) is out
    torch.testing.assert_close(out.float(), q.float(), atol=0.05, rtol=0.02)


def _inputs(T, H, D, seed, outlier=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g) * 2
    if outlier:
        k[:, :, 5] += 40.0  # an outlier channel (a channel mean smoothing removes)
        k[:, :, 9] *= 20.0
    v = torch.randn(T, H, D, generator=g)
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "int8", "bf16", ("int8", "nvfp4")])
def test_reference_write_applies_transforms(fmt):
    T, H, D, page, W = 40, 2, 64, 16, 8
    cache = PagedKVCache(1, 8, page, H, D, fmt, recent_window=W, max_seqs=2, rotate=True, rotation_seed=4)
    k, v = _inputs(T, H, D, 1)
    pos = torch.arange(100, 100 + T)
    slots = torch.randperm(8 * page)[:T]
    slots[3] = -1
    seqs = torch.ones(T, dtype=torch.long)
    rope = RoPE.from_theta(10000.0, 48, 1024, "neox")
    k_mean = torch.randn(H, D)
    write_kv_reference(cache, 0, k, v, slots, seq_slots=seqs, positions=pos, rope=rope, k_mean=k_mean)
    kt, vt = transform_kv(k, v, positions=pos, rope=rope, k_mean=k_mean, rotation_signs=cache.rotation_signs)
    # the same as rotating with the seed by hand, after RoPE and smoothing
    torch.testing.assert_close(kt, rotate(apply_rope(k, pos, rope) - k_mean, 4), rtol=0, atol=0)
    lay = cache.layer(0)
    keep = slots >= 0
    blk, off = slots[keep] // page, slots[keep] % page
    for x, f, data, sp, gs in ((kt, cache.k_format, lay.k_data, lay.k_scale_pool, lay.k_global_scale),
                               (vt, cache.v_format, lay.v_data, lay.v_scale_pool, lay.v_global_scale)):
        payload, scales = quantize(x[keep], f, gs)
        assert torch.equal(data[blk, :, off].view(torch.uint8), payload.view(torch.uint8))
        if sp is not None:
            assert torch.equal(sp[blk, :, off].view(torch.uint8), scales.view(torch.uint8))
    # the ring holds the transformed rows (the newest W positions), rounded to the cache dtype
    newest = pos[-W:]
    assert torch.equal(lay.k_ring[1, :, newest % W].transpose(0, 1), kt[-W:].to(torch.bfloat16))
    assert torch.equal(lay.v_ring[1, :, newest % W].transpose(0, 1), vt[-W:].to(torch.bfloat16))


def test_reference_write_without_transforms_unchanged():
    cache_a = PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    cache_b = PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    k, v = _inputs(20, 2, 64, 2)
    slots = torch.arange(20)
    write_kv_reference(cache_a, 0, k, v, slots)
    payload, scales = quantize(k, "nvfp4")
    assert torch.equal(cache_a.layer(0).k_data[0, :, :16], payload[:16].transpose(0, 1))
    write_kv_reference(cache_b, 0, k, v, slots, k_mean=torch.zeros(2, 64))  # x - 0 is x
    assert torch.equal(cache_a.layer(0).k_data, cache_b.layer(0).k_data)


def test_reference_write_argument_errors():
    cache = PagedKVCache(1, 4, 16, 2, 64, "fp8")
    k, v = _inputs(4, 2, 64, 3)
    rope = RoPE.from_theta(10000.0, 64, 16)
    with pytest.raises(ValueError, match="positions"):
        write_kv_reference(cache, 0, k, v, torch.arange(4), rope=rope)
    with pytest.raises(ValueError, match="positions"):
        write_kv_reference(cache, 0, k, v, torch.arange(4), positions=torch.arange(4))  # no ring, no RoPE
    with pytest.raises(ValueError, match="positions"):
        write_kv_reference(cache, 0, k, v, torch.arange(4), positions=torch.tensor([0, 1, 2, 16]), rope=rope)
    with pytest.raises(ValueError, match="k_mean"):
        write_kv_reference(cache, 0, k, v, torch.arange(4), k_mean=torch.zeros(64))
    with pytest.raises(ValueError, match="power-of-two"):
        PagedKVCache(1, 4, 16, 2, 96, "fp8", rotate=True)


def test_cache_rotation_state_and_views():
    cache = PagedKVCache(2, 4, 16, 2, 128, "nvfp4", rotate=True, rotation_seed=7)
    assert cache.rotate and cache.rotation_seed == 7
    assert torch.equal(cache.rotation_signs, rotation_signs(128, 7))
    assert PagedKVCache(1, 4, 16, 2, 128, "nvfp4").rotation_signs is None
    view = PagedKVCache.from_tensors(cache._layers, 16, 128, "nvfp4", rotate=True, rotation_seed=7,
                                     rotation_signs=cache.rotation_signs)
    assert view.rotation_signs is cache.rotation_signs
    assert "rotate=True" in repr(cache)


# ------------------------------------------------------------------------------------------------
# calibration
# ------------------------------------------------------------------------------------------------
def test_calibrate_sets_global_scales_from_transformed_rows():
    H, D = 3, 64
    cache = PagedKVCache(2, 8, 16, H, D, ("nvfp4", "nvfp4"), rotate=True)
    k, v = _inputs(30, H, D, 5)
    pos = torch.arange(30)
    rope = RoPE.from_theta(10000.0, 64, 64)
    k_mean = torch.randn(H, D)
    gk, gv = cache.calibrate(1, k, v, headroom=1.5, positions=pos, rope=rope, k_mean=k_mean)
    kt, vt = transform_kv(k, v, positions=pos, rope=rope, k_mean=k_mean, rotation_signs=cache.rotation_signs)
    want_k = (kt.abs().amax(dim=(0, 2)).double() * 1.5 / 2688).float()
    want_v = (vt.abs().amax(dim=(0, 2)).double() * 1.5 / 2688).float()
    assert torch.equal(gk, want_k) and torch.equal(gv, want_v)
    assert torch.equal(cache.layer(1).k_global_scale, want_k)
    assert torch.equal(cache.layer(0).k_global_scale, torch.ones(H))  # other layers untouched


def test_calibrate_top_block_uses_the_top_scale():
    H, D = 2, 64
    cache = PagedKVCache(1, 8, 16, H, D, "nvfp4")
    k, v = _inputs(16, H, D, 6)
    cache.calibrate(0, k, v)  # headroom 1: the largest block maps to E4M3 448
    write_kv_reference(cache, 0, k, v, torch.arange(16))
    sc = cache.layer(0).k_scale_pool[0]  # (H, page, D/16)
    assert int(sc.max()) == 0x7E  # 448


def test_calibrate_non_nvfp4_and_zero_rows():
    cache = PagedKVCache(1, 4, 16, 2, 64, ("fp8", "nvfp4"))
    k, v = _inputs(8, 2, 64, 7)
    v[:, 1] = 0.0
    gk, gv = cache.calibrate(0, k, v)
    assert gk is None
    assert float(gv[1]) == 1.0 and float(gv[0]) == float((v[:, 0].float().abs().max().double() / 2688).float())
    with pytest.raises(ValueError, match="headroom"):
        cache.calibrate(0, k, v, headroom=0.0)
    with pytest.raises(ValueError, match="k"):
        cache.calibrate(0, k[:, :1], v)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "int8"])
def test_overflow_saturates_never_inf(fmt, rotate):
    """Values far above the calibrated range saturate: decoded rows are finite. Without rotation that holds up to
    the largest bf16 value; with rotation up to fp32_max / head_dim (the butterflies' sums must stay finite)."""
    H, D = 2, 64
    cache = PagedKVCache(1, 8, 16, H, D, fmt, rotate=rotate)
    k, v = _inputs(16, H, D, 8)
    if fmt == "nvfp4":
        cache.calibrate(0, k, v)
    big_k, big_v = (k.float() * 1000).to(torch.bfloat16), (v.float() * 1000).to(torch.bfloat16)
    huge = 1.0e36 if rotate else 3.0e38
    big_k[0, 0, :] = huge
    big_k[0, 0, 1::2] = -huge
    write_kv_reference(cache, 0, big_k, big_v, torch.arange(16))
    lay = cache.layer(0)
    for data, sp, gs, f in ((lay.k_data, lay.k_scale_pool, lay.k_global_scale, cache.k_format),
                            (lay.v_data, lay.v_scale_pool, lay.v_global_scale, cache.v_format)):
        x = dequantize(data[0], sp[0], f, None if gs is None else gs[:, None])
        assert bool(torch.isfinite(x).all())
        if fmt == "nvfp4":
            assert x.abs().max() <= 6 * 448 * gs.max() * (1 + 1e-6)
            assert not bool(((sp == 0x7F) | (sp == 0xFF)).any())
            assert bool((e4m3_decode(sp[0]) == 448).any())  # some blocks saturated


# ------------------------------------------------------------------------------------------------
# decode over a rotated cache (reference path): rotate q, attend, rotate the output back
# ------------------------------------------------------------------------------------------------
def _decode_setup(fmt, rotate_cache, D=128, H=2, group=4, lens=(37, 80, 5), seed=10):
    g = torch.Generator().manual_seed(seed)
    page = 16
    B = len(lens)
    nb = sum(-(-L // page) for L in lens)
    cache = PagedKVCache(1, nb, page, H, D, fmt, rotate=rotate_cache, rotation_seed=seed)
    Lmax = max(lens)
    k, v = _inputs(B * Lmax, H, D, seed, outlier=False)
    k, v = k.reshape(B, Lmax, H, D), v.reshape(B, Lmax, H, D)
    table = torch.zeros(B, -(-Lmax // page), dtype=torch.int32)
    perm = torch.randperm(nb, generator=g)
    o = 0
    for b, L in enumerate(lens):
        m = -(-L // page)
        table[b, :m] = perm[o:o + m].int()
        o += m
        t = torch.arange(L)
        slots = table[b, t // page].long() * page + t % page
        if fmt == "nvfp4" and b == 0:
            cache.calibrate(0, k[b, :L], v[b, :L])
        write_kv_reference(cache, 0, k[b, :L], v[b, :L], slots)
    q = torch.randn(B, 1, H * group, D, generator=g).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = attention_reference(q, k, v, causal=True, kv_lens=lens_t)
    return cache, q, table, lens_t, want


def _rotated_decode(q, cache, lens, table):
    """What qattn.flash_attn_with_kvcache does around the kernel on a rotated cache, with the fp64 reference
    decode standing in for the kernel."""
    s = cache.rotation_signs
    o = paged_decode_reference(rotate_query(q, s), cache, lens, table)
    return unrotate_rows(o, s)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_decode_over_rotated_cache_equals_unrotated_attention(fmt):
    cache, q, table, lens, want = _decode_setup(fmt, True)
    got = _rotated_decode(q, cache, lens, table)
    plain_cache, _, _, _, _ = _decode_setup(fmt, False)
    plain = paged_decode_reference(q, plain_cache, lens, table)
    err_rot, err_plain = _rel(got, want), _rel(plain, want)
    tol = {"bf16": 0.01, "fp8": 0.05, "nvfp4": 0.2, "mxfp4": 0.3}[fmt]
    # the rotated path has the format's error (and bf16 rounding of the rotated q), nothing more
    assert err_rot < tol and err_rot < 1.5 * err_plain + 0.01, (err_rot, err_plain)
    # without the q / output rotation the answer is wrong: the pre/post steps matter
    wrong = paged_decode_reference(q, cache, lens, table)
    assert _rel(wrong, want) > 0.3


def test_decode_smoothing_is_invisible_to_softmax():
    cache_s, q, table, lens, want = _decode_setup("bf16", False)
    # rewrite the same tokens with a large key mean subtracted: attention must not move (beyond bf16 rounding)
    lay = cache_s.layer(0)
    flat_k, _ = qattn.flatten_kv_reference(cache_s, 0, table, lens)
    k_mean = torch.randn(cache_s.num_kv_heads, cache_s.head_dim) * 3
    for b in range(table.shape[0]):
        L = int(lens[b])
        t = torch.arange(L)
        slots = table[b, t // 16].long() * 16 + t % 16
        kb = flat_k[b, :L].to(torch.bfloat16)
        write_kv_reference(cache_s, 0, kb, lay.v_data[table[b, t // 16].long(), :, t % 16], slots, k_mean=k_mean)
    got = paged_decode_reference(q, cache_s, lens, table)
    assert _rel(got, want) < 0.02
