"""CPU model (torch) of exactly what the SM100 INT8-QK prefill kernel (``prefill_int8.py``) computes. The kernel
never ran on hardware: this model is how its numerics were checked, and it is only as faithful as the
modelling choices below (each says where the hardware may differ).

Per CTA = (batch b, q head h, 128-row query block), in the kernel's order:

1. Q, K -> int8 + fp32 scales by ``qattn.quant.quantize_qk_int8_reference`` (the exact torch model of the
   prepass the launcher runs, ``quantize_qk_int8``; K mean-smoothed when ``smooth_k``), or the caller's
   ``quantized`` tensors (e.g. the GPU prepass's outputs).
2. S = q_int8 . k_int8 over head_dim, exact (|S| <= 127^2 * 128 < 2^22: exact in fp64 and in the kernel's s32
   accumulator and its int32 -> fp32 conversion).
3. Per row and tile, the log2-domain scale ``fp32(fp32(q_scale * scale_log2) * k_scale)`` with
   ``scale_log2 = fp32(softmax_scale * log2 e)`` (the kernel's two fp32 multiplies, in this order), then
   ``x = fp32(S * scale)``; keys >= seqlen_k and (causal) keys > row + seqlen_k - seqlen_q are -inf; with a
   ``window_size``, keys outside the row's window too (the host's normalization and flags,
   ``qattn.interface.window``, then the kernel's tile range: a CTA starts at the tile of its first row's first key).
4. Online softmax in fp32, tile by tile: ``m_new = max(m, max x)``, ``m_use = m_new`` (0 while -inf),
   ``corr = 2^(m - m_use)``, ``p = 2^(x - m_use)`` (the kernel's ``ex2.approx.ftz`` is modelled as the exact
   exp2 rounded to fp32; the hardware is within ~2 ulp), ``l = l * corr + sum(p)`` with the *unrounded* fp32 p
   (the kernel sums 128 values sequentially in fp32: modelled as an fp64 sum rounded once; differences are a
   few fp32 ulp of l).
5. P rounded to V's 16-bit dtype (RNE: the kernel's ``cvt.rn.bf16x2.f32`` / ``f16x2``), O = fp32(O * corr)
   (the kernel's TMEM rescale), then O += P16 . V (products exact, fp64 sum rounded to fp32 once per tile; the
   tensor core accumulates in fp32 in an unspecified order, again an fp32-ulp-level effect).
6. Epilogue: ``out = fp32(O * fp32(1 / l))`` (``rcp.rn.f32``) rounded to V's dtype (0 for a row that sees no key),
   ``LSE = (m + log2 l + shift) * ln 2`` (-inf for such a row), computed in fp64 and rounded to fp32 once (the
   kernel's few fp32 operations and ``lg2.approx``: fp32-ulp-level effects). ``shift`` puts K's smoothing mean
   back, so that the LSE is that of the unsmoothed K's scores (FlashAttention's; the softmax itself is invariant
   to it): ``shift = fp32(fp32(q_scale * scale_log2) * dot)`` per row, ``dot = sum_c q_int8[c] * k_mean[c]``
   (the kernel's sequential fp32 FMA chain modelled as an fp64 sum rounded once), 0 without a mean (an
   unsmoothed K, the kernel's k_mean address 0). This is ``qattn.reference.lse_smoothing_shift`` in log2 units,
   over the same int8 Q.

``softcap`` (the kernel's compile-time cap): ``scale_log2 = fp32(softmax_scale / softcap)`` instead, so
``u = fp32(S * scale + shift)`` (one FFMA) is z / softcap, and ``x = fp32(fp32(softcap * log2 e) * tanh(u))``
replaces step 3's x before the mask (masked keys -inf after the tanh). ``tanh.approx.f32`` is modelled as the
exact tanh rounded to fp32 (the hardware's relative error is ~2^-11: far above fp32 rounding, far below the
cap's effect). ``shift`` is step 6's, in these pre-tanh units (the cap is not invariant to it); it is in the
scores, so the epilogue does not add it again.

Tiles a causal CTA reads beyond one row's diagonal are fully masked for that row; they change nothing (corr is
exactly 1, p exactly 0), exactly as in the kernel, so they are run here too (the CTA's own ``n_blocks``).

Varlen (``emulate_prefill_varlen_sm100``, the kernel's ``varlen`` variant): the prepass is
``quantize_qk_int8_varlen_reference`` (scales padded per sequence), the window is resolved with max_seqlen_q /
max_seqlen_k (as the launcher does), and each sequence runs the dense model above in its own coordinates, with
one difference that is the kernel's: a K/V tile is the 128 packed rows from the tile's start, so a tile crossing
the sequence's end holds the next sequence's keys and values (zeros past the last row). The keys are masked, so
their P is exactly 0 and their V rows add exactly 0 -- if they are finite (an inf / NaN there makes NaN, in the
kernel as here). CTAs past a sequence's rows do nothing (the kernel's early exit).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from qattn.cute_kernels.sm100.prefill_config import BLOCK_K, BLOCK_Q, WARP_Q
from qattn.quant.qk_int8 import quantize_qk_int8_reference

__all__ = ["emulate_prefill_sm100", "emulate_prefill_varlen_sm100"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round to fp32 (RNE) and carry on in fp64."""
    return x.to(torch.float32).to(torch.float64)


def _launch_constants(v, num_heads: int, num_kv_heads: int, head_dim: int, softmax_scale, granularity: str,
                      softcap: float):
    """What the launcher fixes for a call: (GQA group, q rows per q scale, the fp32 score scale argument -- z /
    softcap when capped, else z * log2 e --, the kernel's fp32 softcap * log2 e); checks V's dtype and the heads."""
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v: expected bf16 or fp16 (the P.V MMA type), got {v.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"k: num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    scale_log2 = softmax_scale / softcap if softcap else softmax_scale * math.log2(math.e)
    return (num_heads // num_kv_heads, WARP_Q if granularity == "per_warp" else BLOCK_Q,
            float(torch.tensor(scale_log2, dtype=torch.float32)),
            float(torch.tensor(softcap * math.log2(math.e), dtype=torch.float32)))


def emulate_prefill_sm100(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    return_lse: bool = False,
    quantized: Optional[tuple] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    """The SM100 kernel's output (B, Sq, Hq, D) in V's dtype and, with ``return_lse``, the natural-log LSE
    (B, Hq, Sq) fp32, computed on the CPU as the module docstring describes. q (B, Sq, Hq, D), k and v
    (B, Sk, Hkv, D), v bf16 or fp16. ``quantized`` = (q_int8, q_scale, k_int8, k_scale[, k_mean]) replaces
    step 1 (k_mean: the (B, Hkv, D) mean the kernel puts back, into the scores with ``softcap``, else into the
    LSE; absent or None: no shift, as the kernel with k_mean address 0). ``softcap > 0``: the soft-capped
    kernel."""
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    group, q_rows, scale_log2, softcap_log2 = _launch_constants(v, Hq, k.shape[2], D, softmax_scale, granularity,
                                                                softcap)
    if quantized is None:
        quantized = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k, block_q=BLOCK_Q,
                                               warp_q=WARP_Q, block_k=BLOCK_K)[:5]
    q8, qs, k8, ks = (t.cpu() for t in quantized[:4])
    k_mean = quantized[4] if len(quantized) > 4 else None
    vdt = v.dtype
    # (B, H, S, D) views; kv heads expanded to q heads (GQA: q head h reads kv head h // group)
    qi = q8.permute(0, 2, 1, 3).double()
    ki = k8.permute(0, 2, 1, 3).double().repeat_interleave(group, dim=1)
    vv = v.cpu().permute(0, 2, 1, 3).double().repeat_interleave(group, dim=1)  # exact: 16-bit -> fp64
    ks_h = ks.double().repeat_interleave(group, dim=1)  # (B, Hq, n_kb)
    # the smoothing shift's sum_c q_int8[c] * k_mean[c] per (B, Hq, Sq) row (exact products, one fp32 rounding), 0
    # without a mean
    dot = torch.zeros(B, Hq, Sq, dtype=torch.float64)
    if k_mean is not None:
        dot = _f32(qi @ k_mean.cpu().double().repeat_interleave(group, dim=1)[..., None])[..., 0]
    from qattn.interface.window import resolve_window

    # what prefill_int8 launches for these arguments: the causal flag, the window flag and the runtime edges
    window = resolve_window(window_size, causal, Sq, Sk)
    out, lse = _sequence(qi, ki, vv, qs.double(), ks_h, dot, Sk, window, q_rows, scale_log2, softcap, softcap_log2,
                         vdt)
    out = out.permute(0, 2, 1, 3).to(vdt)
    lse = lse.to(torch.float32)
    return (out, lse) if return_lse else out


def _sequence(qi, ki, vv, qs, ks_h, dot, Sk: int, window, q_rows: int, scale_log2: float, softcap: float,
              softcap_log2: float, vdt):
    """The CTAs of one batch of sequences of equal lengths: qi (B, Hq, Sq, D) int8 Q, ki / vv (B, Hq, >= Sk, D) the
    keys and values from the sequence's first one on (varlen: the packed rows after them too, which a tile crossing
    key Sk reads and masks, as the kernel's TMA does), qs (B, Hq, q groups), ks_h (B, Hq, k blocks) fp64, dot
    (B, Hq, Sq) the smoothing shift's q . k_mean. Returns out (B, Hq, Sq, D) fp64 and the natural-log LSE (B, Hq, Sq),
    K's mean put back (into the scores with ``softcap``, else into the LSE).
    """
    B, Hq, Sq, D = qi.shape
    rows_kv = ki.shape[2]  # rows a tile can reach: Sk (dense), or up to the end of the packed tensor (varlen)
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    causal, local = window.causal, window.local
    w_left, w_right = window.edges
    diag = Sk - Sq
    n_mb = -(-Sq // BLOCK_Q)
    for mb in range(n_mb):
        r0, r1 = mb * BLOCK_Q, min(Sq, (mb + 1) * BLOCK_Q)
        rows = torch.arange(r0, r1)
        n_blocks = -(-Sk // BLOCK_K)
        if causal:
            last_key = min(Sk, (mb + 1) * BLOCK_Q + diag + (w_right if local else 0))
            n_blocks = max(last_key + BLOCK_K - 1, 0) // BLOCK_K
        kb0 = min(max(mb * BLOCK_Q + diag - w_left, 0) // BLOCK_K, n_blocks) if local else 0
        key_end = torch.full_like(rows, Sk)
        if causal:
            key_end = torch.clamp(rows + diag + 1 + (w_right if local else 0), max=Sk)
        key_start = rows + diag - w_left if local else torch.full_like(rows, -(2**40))
        # fp32(q_scale * scale_log2), one per row
        qsr = qs[:, :, rows // q_rows]  # (B, Hq, rows)
        qs_log2 = _f32(_f32(qsr) * scale_log2)
        # the row's smoothing shift: pre-tanh units with softcap (into the scores), else log2 units (into the LSE)
        shift = _f32(qs_log2 * dot[:, :, r0:r1])
        m = torch.full((B, Hq, r1 - r0), -math.inf, dtype=torch.float64)
        l_ = torch.zeros(B, Hq, r1 - r0, dtype=torch.float64)
        o = torch.zeros(B, Hq, r1 - r0, D, dtype=torch.float64)
        for t in range(kb0, n_blocks):
            # the tile's rows: keys >= Sk (varlen: the next sequence's) are read and masked below; past the last
            # row TMA zero-fills, which adds nothing (dense: the tile stops at Sk, the same sums)
            c0, c1 = t * BLOCK_K, min(rows_kv, (t + 1) * BLOCK_K)
            s_int = qi[:, :, r0:r1] @ ki[:, :, c0:c1].transpose(-1, -2)  # exact integers
            scale = _f32(qs_log2 * ks_h[:, :, t, None])  # (B, Hq, rows)
            if softcap:  # u = fp32(S * scale + shift) (FFMA), then the cap in log2 units
                x = _f32(softcap_log2 * _f32(torch.tanh(_f32(s_int * scale[..., None] + shift[..., None]))))
            else:
                x = _f32(s_int * scale[..., None])
            cols = torch.arange(c0, c1)
            visible = (cols[None, :] < key_end[:, None]) & (cols[None, :] >= key_start[:, None])  # (rows, cols)
            x = torch.where(visible, x, torch.tensor(-math.inf, dtype=torch.float64))
            m_new = torch.maximum(m, x.amax(-1))
            m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            corr = _f32(torch.exp2(_f32(m - m_use)))
            p = _f32(torch.exp2(_f32(x - m_use[..., None])))
            l_ = _f32(l_ * corr + p.sum(-1))  # fp32 FFMA-style update with the unrounded p
            p16 = p.to(vdt).double()  # P rounded to V's type before the MMA
            o = _f32(_f32(o * corr[..., None]) + p16 @ vv[:, :, c0:c1])  # O *= corr is stored to TMEM in fp32
            m = m_new
        has = l_ > 0
        inv = torch.where(has, _f32(1.0 / torch.where(has, l_, torch.ones_like(l_))), torch.zeros_like(l_))
        out[:, :, r0:r1] = _f32(o * inv[..., None])
        lse2 = m + torch.log2(torch.where(has, l_, torch.ones_like(l_)))
        if not softcap:  # the LSE of the unsmoothed K's scores (capped: the shift is in them already)
            lse2 = lse2 + shift
        lse[:, :, r0:r1] = torch.where(has, lse2 * math.log(2.0), torch.full_like(m, -math.inf))
    return out, lse


def emulate_prefill_varlen_sm100(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    return_lse: bool = False,
    quantized: Optional[tuple] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    """The SM100 varlen kernel's output (total_q, Hq, D) in V's dtype and, with ``return_lse``, the natural-log LSE
    (Hq, total_q) fp32: packed q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens (num_seqs + 1,).
    ``quantized`` = (q_int8, q_scale, k_int8, k_scale[, k_mean]) in ``quantize_qk_int8_varlen``'s layout (scales
    padded per sequence) replaces the prepass; the rest as :func:`emulate_prefill_sm100`."""
    from qattn.interface.window import resolve_window
    from qattn.quant.qk_int8 import quantize_qk_int8_varlen_reference

    Tq, Hq, D = q.shape
    group, q_rows, scale_log2, softcap_log2 = _launch_constants(v, Hq, k.shape[1], D, softmax_scale, granularity,
                                                                softcap)
    if quantized is None:
        quantized = quantize_qk_int8_varlen_reference(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      granularity=granularity, smooth_k=smooth_k, block_q=BLOCK_Q,
                                                      warp_q=WARP_Q, block_k=BLOCK_K)[:5]
    q8, qs, k8, ks = (t.cpu() for t in quantized[:4])
    k_mean = quantized[4] if len(quantized) > 4 else None
    # the launcher resolves the window once, with the longest lengths (SM90's rule)
    window = resolve_window(window_size, causal, max_seqlen_q, max_seqlen_k)
    cq, ck = [int(x) for x in cu_seqlens_q.cpu()], [int(x) for x in cu_seqlens_k.cpu()]
    # (1, H, rows, D) views of the packed tensors; kv heads expanded to q heads
    qi = q8.permute(1, 0, 2)[None].double()
    ki = k8.permute(1, 0, 2)[None].double().repeat_interleave(group, dim=1)
    vv = v.cpu().permute(1, 0, 2)[None].double().repeat_interleave(group, dim=1)
    ks_h = ks.double().repeat_interleave(group, dim=1)  # (num_seqs, Hq, n_kb)
    out = torch.zeros(1, Hq, Tq, D, dtype=torch.float64)
    lse = torch.full((1, Hq, Tq), -math.inf, dtype=torch.float64)
    for i in range(len(cq) - 1):
        qa, qb, ka, kb = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qb == qa:
            continue  # every CTA of the sequence exits
        dot = torch.zeros(1, Hq, qb - qa, dtype=torch.float64)
        if k_mean is not None:
            km = k_mean[i : i + 1].cpu().double().repeat_interleave(group, dim=1)  # (1, Hq, D)
            dot = _f32(qi[:, :, qa:qb] @ km[..., None])[..., 0]
        # K / V from the sequence's first key to the end of the packed tensors: what its tiles can reach
        o, l_ = _sequence(qi[:, :, qa:qb], ki[:, :, ka:], vv[:, :, ka:], qs[i : i + 1].double(), ks_h[i : i + 1],
                          dot, kb - ka, window, q_rows, scale_log2, softcap, softcap_log2, v.dtype)
        out[:, :, qa:qb], lse[:, :, qa:qb] = o, l_
    out = out[0].permute(1, 0, 2).to(v.dtype)
    lse = lse[0].to(torch.float32)
    return (out, lse) if return_lse else out
