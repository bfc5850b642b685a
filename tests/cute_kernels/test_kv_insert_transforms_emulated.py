"""CPU emulation of the insert kernel's transform data movement (RoPE, smoothing, Hadamard rotation).

No GPU here, so the kernel's *algorithm* is replayed in numpy: a row is split over G = head_dim / E lanes of a
warp exactly as in ``KVInsert`` (lane ``row_in_warp * G + part`` holds elements ``[part * E, part * E + E)``),
warp shuffles read another lane's register (source lane ``& 31``, as ``shfl.sync.idx`` / ``.bfly`` with clamp
31), the NeoX partner plan is the kernel's own (:func:`neox_partner_plan`), and every fp32 operation is one
numpy float32 operation (one rounding: what ``mul.rn`` / ``add.rn`` / ``sub.rn`` do). The result must equal
``qattn.quant.transforms.transform_kv`` bit for bit. This checks the index logic and the operation order; the
GPU tests check the compiled kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qattn.cute_kernels.kv_insert import neox_partner_plan
from qattn.quant.transforms import RoPE, _scale_const, rotation_signs, transform_kv


def _elems(head_dim: int) -> int:
    return 32 if head_dim % 32 == 0 else 16


class _Warps:
    """Rows spread over lanes: array (warps, 32, E) float32, plus each lane's row index and part."""

    def __init__(self, x: np.ndarray, head_dim: int):
        R = x.shape[0]
        self.E = _elems(head_dim)
        self.G = head_dim // self.E
        rows_per_warp = 32 // self.G
        W = -(-R // rows_per_warp)
        pad = np.zeros((W * rows_per_warp, head_dim), np.float32)
        pad[:R] = x
        self.R = R
        self.regs = pad.reshape(W, 32, self.E).copy()  # lane = row_in_warp * G + part
        lane = np.arange(32)
        self.part = lane % self.G
        self.row = (np.arange(W)[:, None] * rows_per_warp + lane[None, :] // self.G)  # (W, 32)

    def shfl(self, j_loc: int, src_lane: np.ndarray) -> np.ndarray:
        """Every lane reads register j_loc of lane src_lane & 31 (src_lane: (32,) or (W, 32))."""
        src = np.broadcast_to(src_lane & 31, self.regs.shape[:2])
        return np.take_along_axis(self.regs[:, :, j_loc], src, axis=1)

    def rows(self) -> np.ndarray:
        return self.regs.reshape(-1, self.G * self.E)[: self.R]


def _emulate_rope(w: _Warps, cs: np.ndarray, rope_rows: np.ndarray, style: str, rd: int) -> None:
    E, half = w.E, rd // 2
    lane = np.arange(32)
    base = (w.part * E)[None, :]  # (1, 32)
    part_vals = np.zeros_like(w.regs)
    if style == "gptj":
        for j in range(E):
            part_vals[:, :, j] = w.regs[:, :, j ^ 1]
    else:
        for j, (lo_loc, lo_off, hi_loc, hi_off) in enumerate(neox_partner_plan(E, half)):
            first = base + j < half
            if lo_loc == hi_loc:
                off = np.where(first, lo_off, hi_off)
                part_vals[:, :, j] = w.shfl(lo_loc, lane[None, :] + off)
            else:
                v_hi = w.regs[:, :, hi_loc] if hi_off == 0 else w.shfl(hi_loc, lane + hi_off)
                v_lo = w.regs[:, :, lo_loc] if lo_off == 0 else w.shfl(lo_loc, lane + lo_off)
                part_vals[:, :, j] = np.where(first, v_lo, v_hi)
    prow = rope_rows[np.minimum(w.row, len(rope_rows) - 1)]  # (W, 32) table row per lane
    for j in range(E):
        i = base + j
        inside = i < rd
        if style == "gptj":
            col = i // 2
            first = np.full(i.shape, j % 2 == 0)
        else:
            first = i < half
            col = np.where(first, i, i - half)
        col = np.broadcast_to(np.where(inside, col, 0), prow.shape)
        cos, sin = cs[prow, col], cs[prow, col + half]
        pc = (w.regs[:, :, j] * cos).astype(np.float32)
        ps = (part_vals[:, :, j] * sin).astype(np.float32)
        out = np.where(first, pc - ps, pc + ps).astype(np.float32)
        w.regs[:, :, j] = np.where(inside, out, w.regs[:, :, j])


def _emulate_smooth(w: _Warps, mean: np.ndarray, heads: np.ndarray) -> None:
    hd = heads[np.minimum(w.row, len(heads) - 1)]  # (W, 32)
    for j in range(w.E):
        m = mean[hd, w.part[None, :] * w.E + j]
        w.regs[:, :, j] = (w.regs[:, :, j] - m).astype(np.float32)


def _emulate_rotate(w: _Warps, signs: np.ndarray, head_dim: int) -> None:
    E = w.E
    lane = np.arange(32)
    h = 1
    while h < head_dim:
        if h < E:
            for j in range(E):
                if j & h == 0:
                    a, b = w.regs[:, :, j].copy(), w.regs[:, :, j + h].copy()
                    w.regs[:, :, j], w.regs[:, :, j + h] = a + b, a - b
        else:
            lanes = h // E
            upper = (w.part & lanes) != 0
            new = np.empty_like(w.regs)
            for j in range(E):
                other = w.shfl(j, lane ^ lanes)
                new[:, :, j] = np.where(upper[None, :], other - w.regs[:, :, j], w.regs[:, :, j] + other)
            w.regs = new
        h *= 2
    c = np.float32(float(_scale_const(head_dim, torch.float32)))
    for j in range(E):
        s = signs[w.part * E + j][None, :]
        w.regs[:, :, j] = ((w.regs[:, :, j] * s).astype(np.float32) * c).astype(np.float32)


def _kernel_emulation(k, v, positions, rope, k_mean, signs, head_dim):
    T, H, D = k.shape
    heads = np.tile(np.arange(H), T)
    kw = _Warps(k.float().reshape(T * H, D).numpy(), D)
    vw = _Warps(v.float().reshape(T * H, D).numpy(), D)
    if rope is not None:
        rows = np.clip(np.repeat(positions.numpy(), H), 0, rope.max_position - 1)
        _emulate_rope(kw, rope.cos_sin_cache.numpy(), rows, rope.style, rope.rotary_dim)
    if k_mean is not None:
        _emulate_smooth(kw, k_mean.numpy(), heads)
    if signs is not None:
        _emulate_rotate(kw, signs.numpy(), D)
        _emulate_rotate(vw, signs.numpy(), D)
    return (torch.from_numpy(kw.rows().reshape(T, H, D)), torch.from_numpy(vw.rows().reshape(T, H, D)))


CASES = [  # head_dim, rotary_dim (None = no RoPE), style, smooth, rotate
    (128, 128, "neox", False, False),
    (128, 80, "neox", True, True),  # half 40: partners straddle lanes (two shuffles)
    (128, 64, "gptj", True, False),
    (128, 96, "neox", False, True),
    (64, 48, "neox", True, True),
    (64, 64, "gptj", False, True),
    (64, 32, "neox", False, False),
    (256, 256, "neox", True, True),
    (256, 200, "gptj", False, True),
    (256, 136, "neox", True, False),
    (32, 16, "neox", False, True),
    (32, 32, "gptj", True, True),
    (16, 16, "neox", True, True),  # E = 16, one lane per row
    (16, 10, "neox", False, False),
    (128, None, None, True, True),
    (64, None, None, False, True),
]


@pytest.mark.parametrize("head_dim,rd,style,smooth,rotate", CASES)
def test_kernel_transform_order_matches_reference(head_dim, rd, style, smooth, rotate):
    g = torch.Generator().manual_seed(head_dim * 1000 + (rd or 0))
    T, H = 37, 3
    k = (torch.randn(T, H, head_dim, generator=g) * 3).to(torch.bfloat16)
    v = (torch.randn(T, H, head_dim, generator=g) * 3).to(torch.bfloat16)
    k[0, 0, :] = 0.0
    k[1, 0, 0] = -0.0
    rope = RoPE.from_theta(10000.0, rd, 4096, style) if rd else None
    positions = torch.randint(0, 4096, (T,), generator=g)
    k_mean = torch.randn(H, head_dim, generator=g) if smooth else None
    signs = rotation_signs(head_dim, 3) if rotate else None
    ref_k, ref_v = transform_kv(k, v, positions=positions, rope=rope, k_mean=k_mean, rotation_signs=signs)
    emu_k, emu_v = _kernel_emulation(k, v, positions, rope, k_mean, signs, head_dim)
    assert torch.equal(emu_k.view(torch.int32), ref_k.view(torch.int32))
    assert torch.equal(emu_v.view(torch.int32), ref_v.view(torch.int32))


def test_neox_partner_plan_covers_pairs():
    for E in (16, 32):
        for G in (1, 2, 4, 8):
            D = E * G
            for rd in range(2, D + 1, 2):
                half = rd // 2
                plan = neox_partner_plan(E, half)
                for part in range(G):
                    for j in range(E):
                        i = part * E + j
                        if i >= rd:
                            continue
                        lo_loc, lo_off, hi_loc, hi_off = plan[j]
                        loc, off = (lo_loc, lo_off) if i < half else (hi_loc, hi_off)
                        assert 0 <= part + off < G  # the partner is in the same row
                        assert (part + off) * E + loc == (i + half if i < half else i - half)
