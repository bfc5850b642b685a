"""CPU model (torch) of exactly what the SM100 decode kernel (``decode.py``) computes. Never ran on hardware:
this model is how its numerics were checked, and it is only as faithful as the modelling choices below.

Per (sequence b, kv head h), rows r = i_q * G + g packed into 128, tiles of 128 tokens, splits of whole tiles:

1. Q quantized by ``q_prepass.quantize_q`` (the launcher's own prepass): Q_t = E2M1 x block scale, t < q_terms,
   plus the NVFP4 per-row scale ``q_rs``.
2. S_raw = sum_t Q_t . K^T where K = E2M1 x block scale (the cache bytes, no global scale): what the
   block-scaled MMA multiplies. Products are exact; the MMA's fp32 accumulation order is not specified by PTX,
   so S_raw is modelled as the exact (fp64) dot product rounded once to fp32 (the hardware's rounding can
   differ in the last bits: a relative 2^-24-ish effect, far below every other error here).
3. s = S_raw * (scale_log2 * q_rs[r] * k_global) in fp32, masked (end-aligned causal, kv_len; with a
   ``window_size``, positions outside the row's window too: the host's normalization and flags,
   ``qattn.interface.window``, and the kernel's tile range, whose splits share the tiles from the one holding the
   first query's first visible key). With ``softcap`` c the scale is softmax_scale / c instead of
   softmax_scale * log2 e and s becomes c * log2 e * tanh(s) before the mask (``tanh.approx.f32`` modelled as the
   exact tanh rounded to fp32; the hardware's is within ~2^-11 relative).
4. Online softmax per tile in fp32 (ex2 modelled as exact exp2 rounded to fp32): m, corr = 2^(m_old - m),
   p = 2^(s - m), l = l * corr + sum(p) with the *unrounded* p; O = O * corr.
5. P rounded to the V MMA type (f16 for nvfp4 V, bf16 for MX V); V = E2M1 x block scale rounded to that type
   (exact); O += P . V in fp32 (modelled as fp64 products summed, rounded to fp32 per tile).
6. Epilogue: O * v_global / l; LSE = (m + log2 l) * ln 2. Splits are merged like ``combine.py``.
"""

from __future__ import annotations

import math

import torch

from qattn.cute_kernels.sm100.decode_config import ROWS, TILE_N, v_dtype_for
from qattn.cute_kernels.sm100.q_prepass import dequantize_q, quantize_q
from qattn.layouts.paged import PagedKVCache
from qattn.quant.reference import e2m1_decode, e4m3_decode, ue8m0_decode, unpack_e2m1

__all__ = ["emulate_decode_sm100"]


def _decode_rows(data: torch.Tensor, scales: torch.Tensor, fmt) -> torch.Tensor:
    """Pool rows (..., D/2) + scale bytes (..., D/vec) -> E2M1 x block scale, fp32 (no global scale)."""
    vals = e2m1_decode(unpack_e2m1(data))
    blk = fmt.scale_block
    sf = e4m3_decode(scales) if fmt.scale_dtype == "e4m3" else ue8m0_decode(scales)
    lead = vals.shape[:-1]
    return (vals.reshape(*lead, -1, blk) * sf.unsqueeze(-1)).reshape(vals.shape)


def _gather(cache: PagedKVCache, layer: int, which: str, block_table, b: int, h: int, n: int) -> torch.Tensor:
    lay = cache.layer(layer)
    data = lay.k_data if which == "k" else lay.v_data
    sc = lay.k_scale_pool if which == "k" else lay.v_scale_pool
    fmt = cache.k_format if which == "k" else cache.v_format
    t = torch.arange(n)
    blk = block_table[b, t // cache.page_size].long().cpu()
    off = t % cache.page_size
    return _decode_rows(data.cpu()[blk, h, off], sc.cpu()[blk, h, off], fmt)


def emulate_decode_sm100(q, cache: PagedKVCache, cache_seqlens, block_table, *, layer: int = 0,
                         softmax_scale=None, causal: bool = True, num_splits: int = 1, q_terms: int = 1,
                         return_lse: bool = False, window_size: tuple = (-1, -1), softcap: float = 0.0):
    """The SM100 kernel's output (B, Sq, Hq, D) fp32 and LSE (B, Hq, Sq), computed on the CPU as described in
    the module docstring."""
    from qattn.interface.window import resolve_window

    B, Sq, Hq, D = q.shape
    # what flash_attn_with_kvcache launches for these arguments: the causal / window flags and the runtime edges
    window = resolve_window(window_size, causal, Sq, block_table.shape[1] * cache.page_size)
    causal = window.causal
    w_left, w_right = window.edges
    H = cache.num_kv_heads
    G = Hq // H
    rows = Sq * G
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    sl2 = torch.tensor(scale / softcap if softcap else scale * math.log2(math.e), dtype=torch.float32)
    vdt = torch.float16 if v_dtype_for(cache.v_format) == "f16" else torch.bfloat16
    qd, qsf, qrs = quantize_q(q.cpu(), H, cache.k_format, q_terms)
    Qv = dequantize_q(qd, qsf, qrs, cache.k_format)  # (T, B, H, 128, D)
    lay = cache.layer(layer)
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float32)
    lse_out = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32)
    r = torch.arange(ROWS)
    i_q = r // G
    for b in range(B):
        L = int(cache_seqlens[b])
        lim = torch.full((ROWS,), L - 1, dtype=torch.long)
        if causal:
            lim = torch.minimum(L - Sq + i_q + (w_right if window.local else 0), lim)
        low = L - Sq + i_q - w_left if window.local else torch.zeros(ROWS, dtype=torch.long)
        n_tiles = -(-L // TILE_N)
        first_t = max(L - Sq - w_left, 0) // TILE_N if window.local else 0
        per = -(-(n_tiles - first_t) // num_splits) if n_tiles > first_t else 0
        for h in range(H):
            K = _gather(cache, layer, "k", block_table, b, h, L)
            V = _gather(cache, layer, "v", block_table, b, h, L).to(vdt)
            row_scale = sl2 * qrs[b, h]
            if cache.k_format.has_global_scale:
                row_scale = row_scale * lay.k_global_scale.cpu()[h].float()
            vg = lay.v_global_scale.cpu()[h].float() if cache.v_format.has_global_scale else torch.tensor(1.0)
            parts = []
            for s in range(num_splits):
                t0, t1 = first_t + s * per, min(first_t + s * per + per, n_tiles)
                m = torch.full((ROWS,), float("-inf"))
                lsum = torch.zeros(ROWS)
                O = torch.zeros(ROWS, D)
                for t in range(t0, t1):
                    j = torch.arange(t * TILE_N, min((t + 1) * TILE_N, L))
                    Sraw = sum(Qv[k, b, h].double() @ K[j].double().T for k in range(q_terms)).float()
                    sc = Sraw * row_scale[:, None]
                    if softcap:  # the kernel's FMUL by fp32(c * log2 e) after tanh.approx
                        sc = torch.tanh(sc) * torch.tensor(softcap * math.log2(math.e), dtype=torch.float32)
                    visible = (j[None, :] <= lim[:, None]) & (j[None, :] >= low[:, None])
                    sc = torch.where(visible, sc, torch.tensor(float("-inf")))
                    m_new = torch.maximum(m, sc.amax(1))
                    m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    corr = torch.exp2(m - m_use)
                    p = torch.exp2(sc - m_use[:, None])
                    lsum = lsum * corr + p.sum(1)
                    O = O * corr[:, None] + (p.to(vdt).double() @ V[j].double()).float()
                    m = m_new
                has = lsum > 0
                o = torch.where(has[:, None], O * (vg / lsum)[:, None], torch.zeros_like(O))
                lse = torch.where(has, (m + torch.log2(lsum)) * math.log(2.0), torch.tensor(float("-inf")))
                parts.append((o, lse))
            if num_splits == 1:
                o, lse = parts[0]
            else:  # combine.py
                L_ = torch.stack([p[1] for p in parts])
                M = L_.amax(0)
                M_use = torch.where(torch.isinf(M), torch.zeros_like(M), M)
                w = torch.exp(L_ - M_use)
                ws = w.sum(0)
                o = sum(w[i][:, None] * parts[i][0] for i in range(num_splits))
                o = torch.where(ws[:, None] > 0, o / ws[:, None], torch.zeros_like(o))
                lse = torch.where(ws > 0, M_use + torch.log(ws), torch.tensor(float("-inf")))
            for rr in range(rows):
                out[b, rr // G, h * G + rr % G] = o[rr]
                lse_out[b, h * G + rr % G, rr // G] = lse[rr]
    return (out, lse_out) if return_lse else out
