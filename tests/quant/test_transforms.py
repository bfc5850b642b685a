"""K smoothing and randomized Hadamard rotation (qattn.quant.transforms): exactness in fp64, fp32 definitions."""

import math

import pytest
import torch

from qattn.quant.transforms import (
    hadamard_matrix,
    hadamard_rotation,
    key_channel_mean,
    rotate,
    rotation_signs,
    smooth_keys,
    unrotate,
)

DIMS = (16, 32, 64, 128, 256)


def _attn(q, k, v):
    """fp64 softmax attention, q (S, D), k/v (T, D), no mask."""
    p = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)
    return p @ v


@pytest.mark.parametrize("n", (1, 2, 4, 8, 64, 128))
def test_hadamard_matrix(n):
    h = hadamard_matrix(n, torch.float64)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h, h.T, rtol=0, atol=0)
    torch.testing.assert_close(h @ h.T, n * torch.eye(n, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("d", DIMS)
def test_rotation_orthogonal(d):
    r = hadamard_rotation(d, seed=3, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    assert (r @ r.T - eye).abs().max() < 1e-12
    assert (r.T @ r - eye).abs().max() < 1e-12
    r32 = hadamard_rotation(d, seed=3)
    assert r32.dtype == torch.float32
    assert (r32.double() @ r32.double().T - eye).abs().max() < 1e-6
    # H · diag(s) / sqrt(d)
    s = rotation_signs(d, 3).double()
    torch.testing.assert_close(r, hadamard_matrix(d, torch.float64) * s / math.sqrt(d), rtol=0, atol=1e-15)


def test_rotation_deterministic_and_seeded():
    a, b = hadamard_rotation(64, seed=7), hadamard_rotation(64, seed=7)
    assert torch.equal(a, b)
    assert not torch.equal(a, hadamard_rotation(64, seed=8))
    s = rotation_signs(64, 7)
    assert set(s.unique().tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("bad", (0, 3, 48, 96))
def test_rotation_needs_power_of_two(bad):
    with pytest.raises(ValueError):
        hadamard_rotation(bad)


@pytest.mark.parametrize("d", DIMS)
def test_rotate_is_x_times_r(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, 3, d, generator=g, dtype=torch.float64)
    r = hadamard_rotation(d, seed=1, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, 1), x @ r, rtol=0, atol=1e-12)
    torch.testing.assert_close(unrotate(x, 1), x @ r.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(unrotate(rotate(x, 1), 1), x, rtol=0, atol=1e-12)
    # fp32 path: same up to fp32 rounding of the summation
    x32 = x.float()
    y32 = rotate(x32, 1)
    assert y32.dtype == torch.float32
    assert (y32.double() - x32.double() @ r).abs().max() < 1e-5 * x.abs().max()


def test_rotate_fp32_butterflies_exact_for_power_of_four():
    # d = 64: c = 1/8 is a power of two, so the result is the fp32 butterflies exactly, scaled exactly.
    x = torch.randint(-1000, 1000, (4, 64)).float()  # small integers: every butterfly sum is exact
    y = rotate(x, 5)
    expect = (x.double() @ hadamard_rotation(64, 5, torch.float64)).float()
    assert torch.equal(y, expect)
    assert rotate(torch.ones(2, 64, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("d", (32, 64, 128))
def test_qk_scores_invariant(d):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(7, d, generator=g, dtype=torch.float64)
    k = torch.randn(13, d, generator=g, dtype=torch.float64) * 4
    qr, kr = rotate(q, 2), rotate(k, 2)
    torch.testing.assert_close(qr @ kr.T, q @ k.T, rtol=0, atol=1e-10)


@pytest.mark.parametrize("d", (32, 64, 128))
def test_attention_output_invariant_under_rotation(d):
    g = torch.Generator().manual_seed(12)
    q = torch.randn(9, d, generator=g, dtype=torch.float64)
    k = torch.randn(40, d, generator=g, dtype=torch.float64) * 3
    v = torch.randn(40, d, generator=g, dtype=torch.float64)
    ref = _attn(q, k, v)
    out = unrotate(_attn(rotate(q, 4), rotate(k, 4), rotate(v, 4)), 4)
    assert (out - ref).abs().max() < 1e-10


def test_smoothing_invariant_softmax():
    g = torch.Generator().manual_seed(13)
    d = 64
    q = torch.randn(6, d, generator=g, dtype=torch.float64)
    # keys with a large per-channel offset (the outlier channels smoothing removes)
    offset = torch.zeros(d, dtype=torch.float64)
    offset[[3, 17, 40]] = torch.tensor([25.0, -30.0, 12.0], dtype=torch.float64)
    k = torch.randn(50, d, generator=g, dtype=torch.float64) + offset
    v = torch.randn(50, d, generator=g, dtype=torch.float64)
    m = key_channel_mean(k.double(), token_dim=0).double()
    ks = smooth_keys(k, m)
    p_ref = torch.softmax(q @ k.T, dim=-1)
    p_s = torch.softmax(q @ ks.T, dim=-1)
    assert (p_s - p_ref).abs().max() < 1e-12
    assert (_attn(q, ks, v) - _attn(q, k, v)).abs().max() < 1e-12
    # smoothing removes the offset: the smoothed keys have (almost) zero channel mean
    assert ks.mean(0).abs().max() < 1e-6
    # and any vector (not only the mean) keeps softmax invariant, combined with rotation too
    other = torch.randn(d, generator=g, dtype=torch.float64)
    out = unrotate(_attn(rotate(q, 9), rotate(smooth_keys(k, other), 9), rotate(v, 9)), 9)
    assert (out - _attn(q, k, v)).abs().max() < 1e-10


def test_key_channel_mean_per_head():
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # (tokens, heads, D)
    m = key_channel_mean(k, token_dim=0)
    assert m.shape == (3, 4) and m.dtype == torch.float32
    torch.testing.assert_close(m, k.double().mean(0).float())
    hk = k.transpose(0, 1)  # (heads, tokens, D)
    torch.testing.assert_close(key_channel_mean(hk, token_dim=1), m)
    with pytest.raises(ValueError):
        key_channel_mean(k[:0], token_dim=0)
    # fp32 subtraction, broadcast over tokens
    assert torch.equal(smooth_keys(k, m), k - m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_scale_scalar_equals_the_rounded_constant(dtype):
    """rotate_rows multiplies by 1/sqrt(d) as a Python float (no CPU tensor: CUDA-graph capturable); torch
    rounds it once to the dtype, bit for bit the value _scale_const gives."""
    from qattn.quant.transforms import _fwht, _scale_const, rotate_rows, rotation_signs

    for d in (16, 32, 64, 128, 256):
        x = torch.randn(7, d, dtype=dtype, generator=torch.Generator().manual_seed(d))
        s = rotation_signs(d, 3).to(dtype)
        assert torch.equal(rotate_rows(x, s), (_fwht(x) * s) * _scale_const(d, dtype))


def test_dense_rotation_matches_the_butterflies():
    """Decode's dense q / output rotation (one fp32 matrix product) equals rotate_query / unrotate_output up to
    fp32 rounding, and R is orthogonal."""
    from qattn.quant.transforms import (rotate_query, rotate_query_dense, rotation_matrix, rotation_signs,
                                        unrotate_output, unrotate_output_dense)

    for d in (64, 128):
        s = rotation_signs(d, 5)
        r = rotation_matrix(s)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-6)
        q = torch.randn(3, 2, 8, d, generator=torch.Generator().manual_seed(d))
        assert torch.allclose(rotate_query_dense(q, r), rotate_query(q, s), rtol=0, atol=1e-5)
        out = torch.empty_like(q)
        assert unrotate_output_dense(q, r, out) is out
        assert torch.allclose(out, unrotate_output(q, s), rtol=0, atol=1e-5)
        assert torch.allclose(unrotate_output_dense(rotate_query_dense(q, r), r), q, atol=1e-5)


def test_transform_kv_checks_positions_and_k_mean():
    """positions one int per token (a single one was broadcast to every token); k_mean (num_kv_heads,
    head_dim) as write_kv takes it (other shapes were broadcast)."""
    from qattn.quant.transforms import RoPE, transform_kv

    k = torch.randn(5, 2, 64)
    rope = RoPE.from_theta(10000.0, 64, 32, "neox")
    transform_kv(k, k, positions=torch.arange(5), rope=rope, k_mean=torch.zeros(2, 64))
    for pos in (torch.tensor([3]), torch.arange(5).float(), torch.arange(10).view(5, 2), [0, 1, 2, 3, 4]):
        with pytest.raises(ValueError, match="positions"):
            transform_kv(k, k, positions=pos, rope=rope)
    for km in (torch.zeros(64), torch.zeros(1), torch.zeros(2, 1), torch.zeros(5, 2, 64)):
        with pytest.raises(ValueError, match="k_mean"):
            transform_kv(k, k, k_mean=km)


def test_calibrate_rejects_a_headroom_past_fp32():
    import qattn

    cache = qattn.PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    k = torch.randn(8, 2, 64)
    cache.calibrate(0, k, k)
    with pytest.raises(ValueError, match="headroom"):
        cache.calibrate(0, k, k, headroom=1e300)


def test_quantize_check_sees_fp64_values_past_fp32():
    from qattn.quant.reference import quantize

    x = torch.randn(2, 64, dtype=torch.float64)
    x[0, 3] = 1e39  # finite in fp64, inf once rounded to the fp32 that is quantized
    for fmt in ("fp8", "int8"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize(x, fmt, check=True)
