"""CPU: the FP8 V format (``qattn.quant.v_fp8``): exact reference, key permutation, and a model of the attention
kernel's register fragments (PTX ISA wgmma tables) showing that the permutation makes P x V come out right."""

from __future__ import annotations

import pytest
import torch

from qattn.quant.reference import e4m3_decode, e4m3_encode
from qattn.quant.v_fp8 import dequantize_v_fp8_reference, key_permutation, quantize_v_fp8_reference


def _v(B=2, Sk=300, H=2, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sk, H, D, generator=g) * torch.rand(1, 1, H, D, generator=g) * 4).to(dtype)


def test_key_permutation_is_a_permutation_of_32():
    perm = key_permutation()
    assert sorted(perm.tolist()) == list(range(32))
    # stored 16h + 4t + 2a + c holds token 16h + 8a + 2t + c
    assert perm[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
    assert perm[16:20].tolist() == [16, 17, 24, 25]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sk", [1, 31, 128, 300])
def test_reference_layout_scales_and_padding(Sk, dtype):
    v = _v(Sk=Sk, dtype=dtype)
    vt, vs = quantize_v_fp8_reference(v)
    B, _, H, D = v.shape
    pad = -(-Sk // 128) * 128
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (B, H, D, pad) and vs.shape == (B, H, D)
    amax = v.float().abs().amax(dim=1)  # B H D
    assert torch.equal(vs, amax / torch.full_like(amax, 448.0))
    codes = vt.view(torch.uint8)
    # un-permute, then: codes = e4m3(v * (1 / scale)) in token order, zeros after Sk
    inv_perm = torch.argsort(key_permutation())
    tok = codes.reshape(B, H, D, pad // 32, 32)[..., inv_perm].reshape(B, H, D, pad)
    expect = e4m3_encode(v.float().permute(0, 2, 3, 1) * (torch.ones_like(vs) / vs)[..., None])
    assert torch.equal(tok[..., :Sk], expect)
    assert torch.all(tok[..., Sk:] == 0)
    # the channel max encodes as +-448 (0x7E / 0xFE); the dequantized values are within half an E4M3 step
    assert torch.all((tok[..., :Sk] & 0x7F).amax(dim=-1) == 0x7E)
    deq = dequantize_v_fp8_reference(vt, vs, Sk)
    err = (deq - v.float()).abs()
    assert torch.all(err <= v.float().abs() * 2.0**-4 + vs[:, None] * 2.0**-9 * 1.0001)


def test_zero_channel_and_exact_values():
    v = torch.zeros(1, 5, 1, 64, dtype=torch.bfloat16)
    v[0, :, 0, 1] = torch.tensor([448.0, -224.0, 1.0, 0.0, 3.5])  # scale 1: codes are the values themselves
    vt, vs = quantize_v_fp8_reference(v)
    assert vs[0, 0, 0] == 0 and vs[0, 0, 1] == 1.0 and torch.all(vt.view(torch.uint8)[0, 0, 0] == 0)
    deq = dequantize_v_fp8_reference(vt, vs, 5)
    assert torch.equal(deq[0, :, 0, 1], v[0, :, 0, 1].float())


# ---- fragment model ------------------------------------------------------------------------------------------
def _acc_coord(lane, c, r, j):
    """wgmma accumulator (PTX ISA, m64nNk*, one warp's 16 rows): value (c, r, j) of a lane is row
    lane/4 + 8r, column 8j + 2(lane%4) + c."""
    return lane // 4 + 8 * r, 8 * j + 2 * (lane % 4) + c


def _a8_coord(lane, e):
    """8-bit A fragment (PTX ISA, wgmma m64nNk32, .e4m3/.s8): element e = 0..15 (register e // 4, byte e % 4)
    of a lane is row lane/4 + 8 * ((e // 4) % 2), k = 4(lane%4) + e % 4 + 16 * (e // 8)."""
    return lane // 4 + 8 * ((e // 4) % 2), 4 * (lane % 4) + e % 4 + 16 * (e // 8)


def test_fragment_model_pv_equals_dense_product():
    """The kernel's ``_store_p`` puts accumulator value (c = v0 % 2, r = v1, j = 4kb + 2v2 + v0 // 2) into byte
    v0 of A register v1 + 2 v2 of k-block kb. With V^T stored key-permuted, the wgmma's sum over k equals P @ V."""
    g = torch.Generator().manual_seed(1)
    P = torch.rand(16, 128, generator=g, dtype=torch.float64)  # one warp's rows, one 128-key tile
    V = torch.randn(128, 8, generator=g, dtype=torch.float64)
    perm = key_permutation()
    vt_stored = V.T.reshape(8, 4, 32)[..., perm].reshape(8, 128)  # what the prepass stores (channel, position)
    A = torch.full((4, 16, 32), float("nan"), dtype=torch.float64)  # per k-block: the A tile the MMA sees
    for lane in range(32):
        for kb in range(4):
            for v2 in range(2):
                for v1 in range(2):
                    for v0 in range(4):
                        row, col = _acc_coord(lane, v0 % 2, v1, 4 * kb + 2 * v2 + v0 // 2)
                        arow, ak = _a8_coord(lane, 4 * (v1 + 2 * v2) + v0)
                        assert arow == row
                        A[kb, arow, ak] = P[row, col]
    assert not torch.isnan(A).any()  # every A element written exactly once per k-block (16 x 32 = 32 lanes x 16)
    out = sum(A[kb] @ vt_stored[:, 32 * kb:32 * kb + 32].T for kb in range(4))
    assert torch.allclose(out, P @ V, rtol=1e-12, atol=1e-12)


def test_transpose_kernel_index_math_matches_reference():
    """A CPU replica of ``VFp8TransposeQuant``'s addressing (item -> channel, chunk; position e -> token
    chunk*16 + key_perm_offset(e)) reproduces the reference bytes."""
    from qattn.cute_kernels.sm90.v_fp8_quant import V_TILE, VFp8TransposeQuant, key_perm_offset

    for D in (64, 128):
        v = _v(B=1, Sk=200, H=1, D=D)
        vt_ref, vs = quantize_v_fp8_reference(v)
        cfg = VFp8TransposeQuant(D)
        pad = vt_ref.shape[-1]
        out = torch.full((D, pad), 0xAA, dtype=torch.uint8)
        x = torch.zeros(pad, D)
        x[:200] = v[0, :, 0].float()
        inv = torch.ones_like(vs[0, 0]) / vs[0, 0]
        for tile in range(pad // V_TILE):
            for tidx in range(cfg.threads):
                for k in range(cfg.items):
                    item = tidx + k * cfg.threads
                    c, chunk = item % D, item // D
                    toks = [tile * V_TILE + chunk * 16 + key_perm_offset(e) for e in range(16)]
                    out[c, tile * V_TILE + chunk * 16: tile * V_TILE + chunk * 16 + 16] = e4m3_encode(x[toks, c] * inv[c])
        assert torch.equal(out, vt_ref.view(torch.uint8)[0, 0])


def test_e4m3_saturates_above_448():
    assert e4m3_decode(e4m3_encode(torch.tensor([448.0 * (1 + 2**-20), 460.0, -1000.0]))).tolist() == [448.0, 448.0, -448.0]


# ---- varlen layout ---------------------------------------------------------------------------------------------
def _cu(lens):
    import itertools

    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)


@pytest.mark.parametrize("seed", range(6))
def test_varlen_regions_are_aligned_disjoint_and_inside(seed):
    """Every sequence's padded region (one whole tile for an empty sequence: the transpose's tile 0 writes it)
    starts 32-byte aligned (a DRAM sector), ends before the next one starts, and lies inside ``varlen_vt_keys``."""
    from qattn.quant.v_fp8 import V_TILE, varlen_vt_keys, varlen_vt_offsets

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    lens = [int(x) for x in torch.randint(0, 400, (n,), generator=g)]
    lens[::5] = [0] * len(lens[::5])  # empty sequences too
    lens[1::7] = [x % 3 + 127 for x in lens[1::7]]  # lengths next to a tile edge
    off = varlen_vt_offsets(_cu(lens)).tolist()
    ends = [o + max(-(-ln // V_TILE), 1) * V_TILE for o, ln in zip(off, lens)]
    assert all(o % 32 == 0 for o in off)
    assert all(e <= o for e, o in zip(ends, off[1:]))
    assert ends[-1] <= varlen_vt_keys(sum(lens), n)


def test_varlen_reference_is_each_sequence_dense_reference_at_its_offset():
    from qattn.quant.v_fp8 import quantize_v_fp8_varlen_reference, varlen_vt_keys, varlen_vt_offsets

    lens = [1, 300, 0, 129, 64]
    cu = _cu(lens)
    v = _v(B=1, Sk=sum(lens), H=2, D=64, seed=3)[0]
    vt, vs = quantize_v_fp8_varlen_reference(v, cu)
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (2, 64, varlen_vt_keys(sum(lens), len(lens)))
    assert vs.shape == (len(lens), 2, 64)
    raw = vt.view(torch.uint8)
    covered = torch.zeros(raw.shape[-1], dtype=torch.bool)
    for i, o in enumerate(varlen_vt_offsets(cu).tolist()):
        t, s = quantize_v_fp8_reference(v[cu[i]:cu[i + 1]].unsqueeze(0))
        assert torch.equal(raw[:, :, o:o + t.shape[-1]], t[0].view(torch.uint8))
        assert torch.equal(vs[i], s[0])
        back = dequantize_v_fp8_reference(raw[:, :, o:o + t.shape[-1]].unsqueeze(0).view(torch.float8_e4m3fn),
                                          vs[i:i + 1], lens[i])
        assert torch.allclose(back[0], v[cu[i]:cu[i + 1]].float(), rtol=0.07, atol=1e-6 + 0.07 * s.max().item() * 448 / 8)
        covered[o:o + t.shape[-1]] = True
    assert (raw[:, :, ~covered] == 0).all()  # zeros between the regions (the kernel leaves them unwritten)
    assert vs[2].eq(0).all()  # an empty sequence: all-zero scales


def test_reference_inputs_checked():
    """The references reject what would silently give wrong layouts: NaN V (the GPU prepass cannot check it),
    cu_seqlens that do not cover V in order, and a seqlen_k / v_scale that do not fit vt."""
    from qattn.quant.v_fp8 import (dequantize_v_fp8_reference, quantize_v_fp8_reference,
                                   quantize_v_fp8_varlen_reference)

    v = torch.randn(1, 100, 2, 64, dtype=torch.bfloat16)
    bad = v.clone()
    bad[0, 3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_v_fp8_reference(bad)
    for cu in ([5, 100], [0, 80], [0, 200], [0, 60, 40, 100]):
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            quantize_v_fp8_varlen_reference(v[0], torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        quantize_v_fp8_varlen_reference(v[0], torch.tensor([0, 100]))  # int64
    vt, vs = quantize_v_fp8_reference(v)
    assert torch.equal(dequantize_v_fp8_reference(vt, vs, 100)[0, :100], dequantize_v_fp8_reference(vt, vs, 100)[0])
    for sk in (-5, 129, 100.0):
        with pytest.raises(ValueError, match="seqlen_k"):
            dequantize_v_fp8_reference(vt, vs, sk)
    with pytest.raises(ValueError, match="v_scale"):
        dequantize_v_fp8_reference(vt, vs[0], 100)
    with pytest.raises(ValueError, match="vt"):
        dequantize_v_fp8_reference(vt[0], vs, 100)
