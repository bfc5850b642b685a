"""fp64 reference attention: the oracles of the GPU tests.

``paged_decode_reference`` attends over exactly the values a kernel can see in a quantized paged cache
(decoded pages, plus the recent-token ring), so ``kernel - reference`` is kernel error alone; comparing the
reference to attention over the unquantized K/V gives the format's error.
"""

from __future__ import annotations

import math

import torch

from ..cute_kernels.config_values import window_ints
from ..layouts.paged import PagedKVCache
from .kv_ops import flatten_kv_reference


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    kv_lens: torch.Tensor | None = None,
    return_lse: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    """Dense attention in float64. q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) with Hq % Hkv == 0 (GQA:
    query head h reads kv head h // (Hq // Hkv)).

    ``kv_lens`` (B,) limits each sequence's keys to its first kv_lens[b]. The causal mask is aligned to the
    end (FlashAttention's convention): query i sees keys j <= i + len_k - Sq. ``window_size=(left, right)``:
    FlashAttention's sliding window, keys i + len_k - Sq - left <= j <= i + len_k - Sq + right (-1 or None:
    unbounded; ``causal`` sets right to 0). ``softcap > 0``: FlashAttention's soft-capping, the scaled scores z
    become softcap * tanh(z / softcap). A row that sees no key gives out = 0 and lse = -inf. Returns out (B, Sq,
    Hq, D) float64 and, with ``return_lse``, the natural-log LSE (B, Hq, Sq) of the (capped) scaled scores.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q: q, k and v must be 4-d (batch, seqlen, heads, head_dim)")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(f"k: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q: {Hq} query heads is not a multiple of {Hkv} kv heads")
    left, right = window_ints(window_size)  # the kernels' rule (-1 or None: unbounded)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    g = Hq // Hkv
    qd = q.double().permute(0, 2, 1, 3)  # B Hq Sq D
    kd = k.double().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)  # B Hq Sk D
    vd = v.double().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale  # B Hq Sq Sk
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lens = (torch.full((B,), Sk, device=q.device) if kv_lens is None else kv_lens.to(q.device).long())
    j = torch.arange(Sk, device=q.device)
    mask = j[None, :] < lens[:, None]  # B Sk
    mask = mask[:, None, None, :].expand(B, 1, Sq, Sk)
    if causal:
        right = 0
    i = torch.arange(Sq, device=q.device)
    diag = i[None, :, None] + (lens[:, None, None] - Sq)  # B Sq 1: row i's diagonal key
    if right >= 0:
        mask = mask & (j[None, None, :] <= diag + right)[:, None]
    if left >= 0:
        mask = mask & (j[None, None, :] >= diag - left)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # B Hq Sq
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    p = torch.where(mask, p, 0.0)
    out = torch.matmul(p, vd).permute(0, 2, 1, 3).contiguous()  # B Sq Hq D
    return (out, lse) if return_lse else out


def paged_decode_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    layer: int = 0,
    softmax_scale: float | None = None,
    causal: bool = True,
    seq_slots: torch.Tensor | None = None,
    return_lse: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    """Attention of q (batch, seqlen_q, num_heads, head_dim) over a paged cache, in float64.

    Keys and values are what the cache holds: the quantized pages decoded exactly, and with ``seq_slots``
    (caches with a recent window or sink tokens) the unquantized rows where attention reads them
    (``qattn.layouts.paged.read_sources``): the first ``min(sink_tokens, len)`` positions from the sink buffer,
    ``[max(sink_tokens, len - W), len)`` from the ring, the rest from the pages.
    Arguments follow ``flash_attn_with_kvcache``; the causal mask (and ``window_size``) is aligned to the end of
    the cache.
    """
    if q.dim() != 4 or q.shape[3] != cache.head_dim:
        raise ValueError(f"q: expected (batch, seqlen_q, num_heads, {cache.head_dim}), got {tuple(q.shape)}")
    if q.shape[2] % cache.num_kv_heads:
        raise ValueError(f"q: {q.shape[2]} heads is not a multiple of {cache.num_kv_heads} kv heads")
    if (cache.recent_window or cache.sink_tokens) and seq_slots is None:
        raise ValueError("seq_slots: a cache with a recent window or sink tokens needs seq_slots")
    if softcap and cache.k_smoothed:  # as flash_attn_with_kvcache: the cap is not invariant to the q . k_mean shift
        raise ValueError("softcap: this cache's K was smoothed (k_mean); a smoothed cache cannot be read with a softcap")
    k, v = flatten_kv_reference(cache, layer, block_table, cache_seqlens, seq_slots=seq_slots,
                                dtype=torch.float64)
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               kv_lens=cache_seqlens, return_lse=return_lse, window_size=window_size, softcap=softcap)


def _expand_rows(scale: torch.Tensor, rows_per_group: int, seqlen: int) -> torch.Tensor:
    """(B, H, groups) per-group scales -> (B, seqlen, H, 1), float64."""
    return scale.double().repeat_interleave(rows_per_group, dim=2)[:, :, :seqlen].permute(0, 2, 1)[..., None]


def prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    qk_quant: str | None = None,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
    return_lse: bool = False,
    window_size: tuple = (-1, -1),
    lse_q: str = "int8",
):
    """Dense prefill attention in float64, optionally with SageAttention-style INT8 Q/K fake quantization.

    q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D). With ``qk_quant="int8"``, Q and K are quantized exactly as
    :func:`qattn.quant.quantize_qk_int8_reference` does (K mean-smoothed first when ``smooth_k``), and the
    scores are the exact values ``(q_int8 . k_int8) * q_scale * k_scale * softmax_scale`` that an INT8 tensor
    core kernel computes before its softmax; P and V stay exact. ``qk_quant=None`` is plain attention. The LSE
    (``return_lse``) is that of the scores with K's smoothing mean put back (:func:`lse_smoothing_shift`), as the
    kernels return it, computed from the Q that ``lse_q`` names: ``"int8"`` the dequantized int8 Q (the kernels given
    a quantized Q: ``prefill_int8`` with ``q_scale``, ``per_block``, SM100), ``"16bit"`` the caller's Q (SM90
    ``flash_attn_func`` / ``_varlen`` with ``per_warp``, whose kernel quantizes Q itself).
    ``window_size`` as in :func:`attention_reference`.
    """
    if qk_quant is None:
        return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                   window_size=window_size)
    if qk_quant != "int8":
        raise ValueError(f"qk_quant: expected None or 'int8', got {qk_quant!r}")
    _check_lse_q(lse_q)
    from ..quant.qk_int8 import quantize_qk_int8_reference

    q8, qs, k8, ks, k_mean = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k,
                                                        block_q=block_q, warp_q=warp_q, block_k=block_k)
    q_rows = warp_q if granularity == "per_warp" else block_q
    qd = q8.double() * _expand_rows(qs, q_rows, q.shape[1])  # exact in fp64: int8 x fp32
    kd = k8.double() * _expand_rows(ks, block_k, k.shape[1])
    res = attention_reference(qd, kd, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                              window_size=window_size)
    if not return_lse:
        return res
    out, lse = res
    return out, lse + lse_smoothing_shift(qd if lse_q == "int8" else q, k_mean, softmax_scale)


def _check_lse_q(lse_q) -> None:
    if lse_q not in ("int8", "16bit"):
        raise ValueError(f"lse_q: expected 'int8' or '16bit', got {lse_q!r}")


def lse_smoothing_shift(q: torch.Tensor, k_mean: torch.Tensor | None, softmax_scale: float | None) -> torch.Tensor:
    """(B, Hq, Sq) float64: ``softmax_scale * q . k_mean`` per query row, what K's smoothing took out of every
    score of the row (0 without smoothing). The softmax is invariant to it, the LSE is not: the kernels add it
    to the LSE they return (``return_lse``), so that it is the LSE of the scores of the unsmoothed K, as
    FlashAttention's (and SageAttention's), and partial results can be merged by it. ``q`` (B, Sq, Hq, D) is
    the Q the kernel takes it from (the caller's 16-bit Q where the SM90 kernel quantizes Q itself, else the
    dequantized int8 Q, ``q_int8 * q_scale``); ``k_mean`` (B, Hkv, D) or None."""
    B, Sq, Hq, D = q.shape
    if k_mean is None:
        return torch.zeros(B, Hq, Sq, dtype=torch.float64, device=q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    km = k_mean.double().repeat_interleave(Hq // k_mean.shape[1], dim=1)  # B Hq D
    return torch.einsum("bshd,bhd->bhs", q.double(), km) * softmax_scale
