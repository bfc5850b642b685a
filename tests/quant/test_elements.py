"""Element casts and the MX shared exponent against independent oracles (ml_dtypes, Python floats)."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from qattn.quant.reference import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    mx_shared_exponent,
    pack_e2m1,
    ue8m0_decode,
    unpack_e2m1,
)

E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _all_bf16_as_fp32(drop_nan: bool = True) -> np.ndarray:
    """Every bf16 bit pattern, widened exactly to fp32."""
    bits = np.arange(1 << 16, dtype=np.uint32) << 16
    x = bits.view(np.float32)
    return x[~np.isnan(x)] if drop_nan else x


def _ulp_neighbours(points, n: int = 4) -> np.ndarray:
    """Each fp32 point and its n fp32 neighbours on each side, both signs."""
    p = np.asarray(points, dtype=np.float32)
    bits = p.view(np.int32)[:, None] + np.arange(-n, n + 1, dtype=np.int32)[None, :]
    x = bits.reshape(-1).view(np.float32)
    x = x[np.isfinite(x) & (x >= 0)]
    return np.concatenate([x, -x])


def _ml_e2m1(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def _ml_e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _all_e4m3_positive_values() -> np.ndarray:
    v = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0 .. 448
    return v


# ---------------------------------------------------------------------------------------- E2M1
def test_e2m1_encode_every_bf16():
    x = _all_bf16_as_fp32()
    assert np.isinf(x).sum() == 2  # infinities saturate like ml_dtypes
    got = e2m1_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _ml_e2m1(x))


def test_e2m1_encode_midpoint_sweep():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = _ulp_neighbours(E2M1_MIDPOINTS + grid + [6.5, 7.0, 1e30, 3.4028235e38], n=4)
    x = np.concatenate([x, np.array([0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf], dtype=np.float32)])
    got = e2m1_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _ml_e2m1(x))


def test_e2m1_ties_to_even_and_sign():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.1, -5.0, 100.0])
    assert e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 8 | 6, 7]


def test_e2m1_encode_input_dtypes():
    x = torch.linspace(-8, 8, 1001)
    ref = e2m1_encode(x)
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        assert torch.equal(e2m1_encode(xd), e2m1_encode(xd.float()))
    assert ref.dtype == torch.uint8


def test_e2m1_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = e2m1_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # code 8 is -0.0
    # encode(decode(c)) == c for every code
    assert torch.equal(e2m1_encode(torch.from_numpy(got)), torch.from_numpy(codes))


def test_pack_unpack_nibble_order():
    codes = torch.tensor([[1, 2, 3, 15], [0, 8, 7, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3], [0x80, 0x07]]  # element 2i in the low nibble
    assert torch.equal(unpack_e2m1(packed), codes)
    everything = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(everything)), everything)
    assert unpack_e2m1(torch.zeros(0, 3, dtype=torch.uint8)).shape == (0, 6)


def test_pack_errors():
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(torch.full((2,), 16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes"):
        pack_e2m1(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="packed"):
        unpack_e2m1(torch.zeros(2, dtype=torch.int8))
    with pytest.raises(TypeError, match="x"):
        e2m1_encode(torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------------------------------- E4M3
def test_e4m3_encode_every_bf16():
    x = _all_bf16_as_fp32()
    got = e4m3_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _ml_e4m3(x))


def test_e4m3_encode_midpoint_sweep():
    v = _all_e4m3_positive_values().astype(np.float64)
    mids = ((v[:-1] + v[1:]) / 2).astype(np.float32)  # exact in fp32: e4m3 has 3 mantissa bits
    assert np.array_equal(mids.astype(np.float64), (v[:-1] + v[1:]) / 2)
    assert mids[0] == 2.0**-10  # the tie between 0 and the smallest subnormal
    pts = np.concatenate([mids, v.astype(np.float32), np.float32([464.0, 465.0, 1e6, 3.4028235e38])])
    x = _ulp_neighbours(pts, n=4)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-45, np.inf, -np.inf])])
    got = e4m3_encode(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _ml_e4m3(x))
    assert e4m3_encode(torch.tensor([2.0**-10, 3 * 2.0**-10, 1e9, -1e9])).tolist() == [0, 2, 0x7E, 0xFE]


def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = e4m3_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got, want)  # NaN == NaN for assert_array_equal
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2
    finite = ~np.isnan(got)
    assert np.array_equal(e4m3_encode(torch.from_numpy(got[finite])).numpy(), codes[finite])


# ---------------------------------------------------------------------------------------- UE8M0
def test_ue8m0_decode():
    b = np.arange(255, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = ue8m0_decode(torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(got, want)
    assert got[0] == np.float32(2.0**-127) and got[127] == 1.0 and got[254] == np.float32(2.0**127)
    assert torch.isnan(ue8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


# ---------------------------------------------------------------------------------------- MX exponent
def _oracle_exponent(a: float, rule: str) -> int:
    """Python-float oracle (exact: frexp and ldexp do not round here)."""
    if a == 0.0:
        return -127
    m, ex = math.frexp(a)  # a = m * 2**ex, m in [0.5, 1)
    e = ex - 1 - 2  # floor(log2(a)) - 2
    if rule == "rceil":  # smallest e with a <= 6 * 2**e
        while a > math.ldexp(6.0, e):
            e += 1
        while a <= math.ldexp(6.0, e - 1):
            e -= 1
    return max(-127, min(125, e))  # 125: both rules' cap (6 * 2**e finite)


def _exponent_test_values() -> np.ndarray:
    mans = [0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x555555, 0x7FFFFE, 0x7FFFFF]
    bits = [(be << 23) | m for be in range(1, 255) for m in mans]
    # subnormals: leading bit at every position, with and without mantissa > 1.5 after normalising
    for p in range(23):
        lead = 1 << p
        bits += [lead, lead | (lead >> 1), (lead | (lead >> 1)) + (1 if p >= 2 else 0), (lead << 1) - 1]
    bits += [0]
    return np.unique(np.array(bits, dtype=np.uint32)).view(np.float32)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_exponent_every_fp32_exponent(rule):
    a = _exponent_test_values()
    got = mx_shared_exponent(torch.from_numpy(a), rule).numpy()
    want = np.array([_oracle_exponent(float(v), rule) for v in a])
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


def test_mx_exponent_edges():
    ks = list(range(-120, 126))
    six = torch.tensor([6.0 * 2.0**k for k in ks], dtype=torch.float32)
    above = torch.nextafter(six, torch.tensor(math.inf))
    assert mx_shared_exponent(six, "rceil").tolist() == ks
    assert mx_shared_exponent(above, "rceil").tolist() == [min(k + 1, 125) for k in ks]  # capped at 125
    # floor: 1.5 * 2**k has floor(log2) = k; rceil puts it at k - 2 too (1.5 * 2**k = 6 * 2**(k-2)).
    ks = list(range(-124, 127))
    onefive = torch.tensor([1.5 * 2.0**k for k in ks], dtype=torch.float32)
    assert mx_shared_exponent(onefive, "floor").tolist() == [k - 2 for k in ks]
    assert mx_shared_exponent(onefive, "rceil").tolist() == [k - 2 for k in ks]
    after = torch.nextafter(onefive, torch.tensor(math.inf))
    assert mx_shared_exponent(after, "floor").tolist() == [k - 2 for k in ks]
    assert mx_shared_exponent(after, "rceil").tolist() == [k - 1 for k in ks]
    # clamping and zero
    tiny = torch.tensor([0.0, -0.0, 1e-45, 2.0**-126, 3.4028235e38])
    assert mx_shared_exponent(tiny, "floor").tolist() == [-127, -127, -127, -127, 125]
    assert mx_shared_exponent(tiny, "rceil").tolist() == [-127, -127, -127, -127, 125]  # not 126: 6 * 2**126 = inf


def test_mx_exponent_errors():
    with pytest.raises(ValueError, match="rule"):
        mx_shared_exponent(torch.ones(2), "ceil")
    with pytest.raises(ValueError, match="amax"):
        mx_shared_exponent(torch.tensor([-1.0]), "floor")
    with pytest.raises(ValueError, match="amax"):
        mx_shared_exponent(torch.tensor([math.inf]), "floor")
    with pytest.raises(TypeError, match="amax"):
        mx_shared_exponent(torch.ones(2, dtype=torch.int32), "floor")
