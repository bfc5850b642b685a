"""Torch emulation of the SM90 INT8-QK / FP8-PV prefill kernel's arithmetic (``PrefillConfig(pv_dtype="fp8")``).

Step by step what the kernel does, tile of 128 keys by tile, in fp64 except where the kernel rounds:

1. Q, K -> int8 + scales exactly as :func:`qattn.quant.quantize_qk_int8_reference`; V -> ``vt`` E4M3 + per-channel
   ``v_scale`` exactly as :func:`qattn.quant.v_fp8.quantize_v_fp8_reference`.
2. Integer scores (exact); per row and tile the log2-domain scale ``fp32(fp32(q_scale * scale_log2) * k_scale)``
   (``scale_log2 = fp32(softmax_scale * log2 e)``), the running max ``m`` of ``fp32(max_int * scale)``.
3. ``P' = 448 * P = exp2(fp32((s + B) * scale - fp32(B * scale + fp32(m - log2 448))))`` (``B = 1.5 * 2^23``:
   the kernel's scores arrive biased and the bias comes out in one FMA) rounded to fp32 (the kernel's
   ``ex2.approx`` is within 2 ulp of it), then to E4M3 (RNE, saturating: ``e4m3_encode``); the row sum adds the fp32 ``P'`` (not the
   rounded ones), rescaled by ``corr = exp2(m_old - m_new)`` like O.
4. O = sum over tiles of (E4M3 P') x (E4M3 V codes), exact products, fp64 sums (the kernel: one fresh fp32
   wgmma accumulator per tile, added to the running fp32 O).
5. out = O / rowsum * v_scale[channel], rounded to the output dtype; LSE = (m + log2 rowsum - log2 448) * ln 2.

So ``kernel - emulation`` is the kernel's own accumulation / exp2 rounding (small), and ``emulation - exact``
the format's error (P and V in E4M3, Q/K in INT8). Measured on the CPU (B=1, S=1024, Hq=4, Hkv=2, D=128, bf16,
causal, per-warp q scales, K smoothed; vs fp64 attention of the unquantized inputs): random cos 0.99943 / NRMSE
3.38% (INT8 QK with bf16 PV: 0.99995 / 1.05%), heavy outliers 0.99883 / 4.85%, V outliers 0.99972 / 2.54%; the
full table is in ``tests/reference/test_prefill_fp8pv.py`` and ``docs/prefill_fp8pv.md``.
"""

from __future__ import annotations

import math

import torch

from ..quant.qk_int8 import quantize_qk_int8_reference
from ..quant.reference import e4m3_decode, e4m3_encode
from ..quant.v_fp8 import dequantize_v_fp8_reference, quantize_v_fp8_reference
from .attention import _check_lse_q, _expand_rows, lse_smoothing_shift

__all__ = ["prefill_fp8pv_emulation", "P_FP8_SCALE"]

P_FP8_SCALE = 448.0
_TILE = 128
_SCORE_BIAS = 12582912.0  # 1.5 * 2^23: the int8 kernel turns int32 scores into fp32 by adding it to the bits


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def prefill_fp8pv_emulation(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    quantized: tuple | None = None,
    window_size: tuple = (-1, -1),
    k_mean: torch.Tensor | None = None,
    lse_q: str = "int8",
):
    """Emulated output (B, Sq, Hq, D) in ``out_dtype`` (default q's dtype; ``torch.float64`` keeps it unrounded)
    and, with ``return_lse``, the natural-log LSE (B, Hq, Sq) fp64. q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    ``quantized`` = (q_int8, q_scale, k_int8, k_scale, vt, v_scale) replaces step 1 (e.g. the GPU prepass's
    outputs), with ``k_mean`` (B, Hkv, D), the mean the prepass took out of K (None: an unsmoothed K); the LSE is
    that of the scores with it put back (``qattn.reference.lse_smoothing_shift``, from the Q ``lse_q`` names, as
    in ``prefill_reference``), as the kernels return it.
    ``window_size``: FlashAttention's sliding window, as in ``qattn.reference.attention_reference``."""
    _check_lse_q(lse_q)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    dev = q.device
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    if quantized is None:
        q8, qs, k8, ks, k_mean = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k)
        vt, vs = quantize_v_fp8_reference(v)
    else:
        q8, qs, k8, ks, vt, vs = quantized
    q_rows = 16 if granularity == "per_warp" else 128
    scale_log2 = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32, device=dev)
    L = torch.tensor(math.log2(P_FP8_SCALE), dtype=torch.float32, device=dev).double()

    s_int = torch.matmul(q8.double().permute(0, 2, 1, 3),
                         k8.double().permute(0, 2, 3, 1).repeat_interleave(g, dim=1))  # B Hq Sq Sk, exact
    qs_rows = qs.float().repeat_interleave(q_rows, dim=2)[:, :, :Sq]  # B Hq Sq fp32
    qs_log2 = qs_rows * scale_log2  # fp32 product
    v8 = dequantize_v_fp8_reference(vt, vs, Sk, scaled=False).double()  # B Sk Hkv D (E4M3 values)
    v8 = v8.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)  # B Hq Sk D
    vs_h = vs.double().repeat_interleave(g, dim=1)  # B Hq D

    i = torch.arange(Sq, device=dev)[:, None]
    j_all = torch.arange(Sk, device=dev)[None, :]
    visible = j_all < Sk
    left, right = (-1 if w is None else int(w) for w in window_size)
    if causal:
        right = 0
    if right >= 0:
        visible = visible & (j_all <= i + (Sk - Sq) + right)  # Sq Sk
    if left >= 0:
        visible = visible & (j_all >= i + (Sk - Sq) - left)

    row_max = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64, device=dev)
    row_sum = torch.zeros(B, Hq, Sq, dtype=torch.float64, device=dev)
    acc = torch.zeros(B, Hq, Sq, D, dtype=torch.float64, device=dev)
    fmin = torch.tensor(2.0**-126, dtype=torch.float32, device=dev)
    for n in range(-(-Sk // _TILE)):
        cols = slice(n * _TILE, min(Sk, (n + 1) * _TILE))
        ks_t = ks[:, :, n].float().repeat_interleave(g, dim=1)  # B Hq
        scale = torch.maximum(qs_log2 * ks_t[..., None], fmin).double()  # fp32 product, B Hq Sq
        vis = visible[:, cols]
        x = s_int[..., cols].masked_fill(~vis, -math.inf)
        mx = x.amax(dim=-1)
        m_tile = _f32(mx * scale)
        m_new = torch.maximum(row_max, m_tile)
        m_use = torch.where(torch.isinf(m_new) & (m_new < 0), torch.zeros_like(m_new), m_new)
        corr = _f32(torch.exp2(row_max - m_use))
        m_off = _f32(m_use - L)
        # the kernel's arithmetic: scores arrive as fp32 x + 1.5 * 2^23 (exact), the offset is one FMA
        # fp32(bias * scale + m_off), and the bias comes out inside the exp2 argument's FMA (fp64 products of
        # fp32 values are exact here; one rounding to fp32 each)
        off = _f32(_SCORE_BIAS * scale + m_off)
        p = _f32(torch.exp2(_f32((x + _SCORE_BIAS) * scale[..., None] - off[..., None])))
        p = torch.where(vis, p, torch.zeros_like(p))
        p8 = e4m3_decode(e4m3_encode(p.float())).double()
        row_sum = row_sum * corr + p.sum(dim=-1)
        acc = acc * corr[..., None] + torch.matmul(p8, v8[:, :, cols])
        row_max = m_new
    inv = torch.where(row_sum > 0, 1.0 / row_sum.clamp_min(1e-300), torch.zeros_like(row_sum))
    out = (acc * inv[..., None] * vs_h[:, :, None, :]).permute(0, 2, 1, 3).contiguous()
    out = out.to(out_dtype or q.dtype)
    if not return_lse:
        return out
    lse = torch.where(row_sum > 0, (row_max + torch.log2(row_sum.clamp_min(1e-300)) - L) * math.log(2.0),
                      torch.full_like(row_sum, -math.inf))
    qd = q8.double() * _expand_rows(qs, q_rows, Sq) if lse_q == "int8" else q  # dequantized int8 Q or q itself
    return out, lse + lse_smoothing_shift(qd, k_mean, softmax_scale)
