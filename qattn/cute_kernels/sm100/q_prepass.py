"""Q quantization for the SM100 decode kernel's block-scaled QK^T MMA (torch; runs on the GPU or the CPU).

The block-scaled ``tcgen05.mma`` needs Q quantized like K (FP4 with block scales along head_dim, the same scale
dtype and block). This prepass does it once per decode step, in torch, with the exact reference encoders of
``qattn.quant.reference`` (so the CPU emulation and the launcher share one definition), and writes what the
kernel loads with TMA:

* ``q_data``  (q_terms, B, H, 128, D/2) uint8: packed E2M1, row r of (b, h) = query (i_q, h*G + g) with
  r = i_q * G + g (GQA packing into the MMA's M = 128); rows >= seqlen_q * G are zero.
* ``q_sf``    (q_terms, B, H, 128 * D/vec) uint8: the block scales, already in the tcgen05 scale-factor atom
  layout (``sf_atom_offset``), so a tile is one contiguous TMA box and goes to tensor memory unchanged.
* ``q_rs``    (B, H, 128) fp32: the per-row decode scale of NVFP4 Q (``amax_row / (6 * 448)``, the two-level
  scheme of the KV format, with the row as the "tensor"); 1.0 for MX formats and padding rows. The kernel
  multiplies a row's scores by it (thread = row), so it never enters the MMA.

``q_terms = 2`` stores a residual split: term 2 quantizes ``q - dequant(term 1)`` with the same row scale, and
the kernel accumulates both MMAs into one S (two QK MMAs per tile instead of one: free in a memory-bound
decode). This shrinks the Q quantization error by roughly the FP4 step again.

Nothing here has run together with the SM100 kernel on hardware: no Blackwell GPU was available.
"""

from __future__ import annotations

import torch

from qattn.layouts.formats import KVFormat, kv_format
from qattn.quant.reference import E2M1_MAX, E4M3_MAX, dequantize, quantize

__all__ = ["q_format", "sf_atom_offset", "quantize_q", "dequantize_q"]

ROWS = 128


def q_format(k_fmt: KVFormat) -> KVFormat:
    """The format Q is quantized to: NVFP4 for nvfp4 K; for MX K the same UE8M0 block with the OCP floor rule,
    whatever K's rule (Q's rule is internal to the kernel; floor's finer steps measured better for one Q term:
    emulated NRMSE 0.35 vs 0.75 with rceil on outlier inputs, mxfp4)."""
    if k_fmt.payload != "e2m1":
        raise ValueError(f"k format: expected an FP4 format, got {k_fmt.name}")
    return kv_format("nvfp4") if k_fmt.scale_dtype == "e4m3" else kv_format(k_fmt.name, scale_rule="floor")


def sf_atom_offset(row: torch.Tensor, kblk: torch.Tensor, nsf: int) -> torch.Tensor:
    """Byte offset of scale ``kblk`` of row ``row`` (0..127) in one 128-row scale tile with ``nsf`` scales per row:
    the tcgen05 block-scale atom (32 x 4 rows x 4 scales, 512 B; CUTLASS ``BlockScaledBasicChunk``, K-major),
    atoms of one tile following each other along K. The kernel writes K scales to shared memory with the same
    formula (``decode.py``)."""
    return (row % 32) * 16 + (row // 32) * 4 + (kblk % 4) + 512 * (kblk // 4)


def _row_scale(q32: torch.Tensor) -> torch.Tensor:
    """NVFP4 decode scale per row: amax / (6 * 448) in fp64 rounded once, at least 2^-116, 1 for zero rows."""
    amax = q32.abs().amax(-1).double()
    g = (amax / (E2M1_MAX * E4M3_MAX)).float()
    g = torch.where(amax > 0, g.clamp(min=2.0**-116), torch.ones_like(g))
    return g


def quantize_q(q: torch.Tensor, num_kv_heads: int, k_fmt: KVFormat, q_terms: int = 1):
    """``(q_data, q_sf, q_rs)`` (see the module docstring) of q (B, Sq, Hq, D) for keys of format ``k_fmt``."""
    B, Sq, Hq, D = q.shape
    H = num_kv_heads
    G = Hq // H
    rows = Sq * G
    if rows > ROWS:
        raise ValueError(f"q: seqlen_q * group = {rows} exceeds {ROWS} rows")
    fmt = q_format(k_fmt)
    vec = fmt.scale_block
    nsf = D // vec
    # (B, Sq, H, G, D) -> (B, H, Sq, G, D) -> (B, H, rows, D), padded to 128 rows
    x = q.float().reshape(B, Sq, H, G, D).permute(0, 2, 1, 3, 4).reshape(B, H, rows, D)
    xp = torch.zeros((B, H, ROWS, D), dtype=torch.float32, device=q.device)
    xp[:, :, :rows] = x
    rs = _row_scale(xp) if fmt.has_global_scale else torch.ones((B, H, ROWS), dtype=torch.float32, device=q.device)
    g = rs if fmt.has_global_scale else None
    datas, sfs = [], []
    resid = xp
    r = torch.arange(ROWS, device=q.device)[:, None]
    k = torch.arange(nsf, device=q.device)[None, :]
    off = sf_atom_offset(r, k, nsf).reshape(-1)
    for _ in range(q_terms):
        payload, scales = quantize(resid, fmt, g, check=False)
        sf = torch.empty((B, H, ROWS * nsf), dtype=torch.uint8, device=q.device)
        sf[:, :, off] = scales.reshape(B, H, ROWS * nsf)
        datas.append(payload)
        sfs.append(sf)
        resid = resid - dequantize(payload, scales, fmt, g)
    return torch.stack(datas), torch.stack(sfs), rs


def dequantize_q(q_data: torch.Tensor, q_sf: torch.Tensor, q_rs: torch.Tensor, k_fmt: KVFormat) -> torch.Tensor:
    """Exact values of the quantized Q *before* the row scale: (q_terms, B, H, 128, D) fp32 (E2M1 x block scale,
    what the MMA multiplies), for the emulation. The row scale ``q_rs`` multiplies the scores afterwards."""
    fmt = q_format(k_fmt)
    T, B, H, R, Dh = q_data.shape
    D = 2 * Dh
    nsf = D // fmt.scale_block
    r = torch.arange(R, device=q_data.device)[:, None]
    k = torch.arange(nsf, device=q_data.device)[None, :]
    off = sf_atom_offset(r, k, nsf).reshape(-1)
    scales = q_sf[..., off].reshape(T, B, H, R, nsf)
    one = torch.ones((), dtype=torch.float32, device=q_data.device) if fmt.has_global_scale else None
    return dequantize(q_data, scales, fmt, one)
