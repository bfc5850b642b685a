"""Torch entry points of the INT8-QK prefill kernels: ``flash_attn_func`` (FlashAttention's argument names)
and ``prefill_int8`` (the attention kernel alone, on already-quantized Q/K).

Thin by design: validate host-known facts, pick the compiled kernel from the shared compile cache (key = arch +
:class:`~qattn.cute_kernels.sm90.prefill_config.PrefillConfig`), launch on torch's current stream. No host sync.

Arch dispatch (``_check_arch``): compute capability 9.0 -> the SM90 kernel; 10.0 -> the SM100 kernel
(``prefill_sm100.py``, dense and varlen INT8 Q K^T with P.V in V's dtype only; NEVER RAN ON HARDWARE,
compile-checked and emulated on the CPU); anything else a ValueError. What the SM100 kernel lacks (FP8 P.V, the
16-bit Q K^T path) raises NotImplementedError before any launch: no silent fallback.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..cute_kernels.config_values import MAX_GRID_YZ
from ..cute_kernels.sm90.prefill_config import (BLOCK_K, BLOCK_Q, HEAD_DIMS, LONG_CAUSAL_KEYS, WARP_Q, PrefillConfig,
                                               lpt_group, seqlen_tile_m, split_tail_plan)
from .fast_launch import contiguous16, fast, kernel_view, on_device, stream_handle
from .launch_plan import Planner, signature_key
from .variants import Variant, cache_for, kernel_arch, register
from .window import (FULL, Window, check_forward_only, resolve_window, score_scale, softcap_value as _softcap,
                     softmax_scale_value as _softmax_scale_value, window_ints as _window_ints)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "prefill_int8", "prefill_int8_varlen",
           "prefill_compile_args"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def prefill_compile_args():
    """Placeholder arguments (fake addresses, fake stream) to compile a prefill kernel without a GPU."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    return ([Int64(0)] * 9 + [Int32(1)] * 9 + [Float32(1.0), Int64(0), Int64(0), Int32(0)]
            + [Int32(1), Int32(1), Int64(0), Int64(0), Int32(0), Int32(0), Int32(0)] + [Int32(1)] * 9
            + [Int64(0), cute.runtime.make_fake_stream()])


def _check_arch(device: torch.device) -> str:
    return kernel_arch(device, "INT8-QK prefill")  # 10.0: prefill_sm100.py


def _check_sm100_options(device: torch.device, **options) -> None:
    """On an SM100 device, raise for the options its prefill kernel does not implement (before any launch)."""
    if _check_arch(device) == "sm_100a":
        from .prefill_sm100 import check_sm100_prefill_options

        check_sm100_prefill_options(**options)


def _check(t, name: str, dtype, shape, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the attention kernel's TMA can read it in place (``kernel_view``; 32-bit strides), else a
    contiguous, aligned copy."""
    return kernel_view(t, offset_limit=2**31)


def _strides16(t: Optional[torch.Tensor], rows: int = 0, heads: int = 0) -> tuple[int, int, int]:
    """(row, head, batch) strides of a dense (batch, rows, heads, dim) or packed (rows, heads, dim) tensor that
    passed :func:`_aligned`, in 16-byte units, for the kernel's TMA descriptors. A dimension of size 1 gets the
    stride a contiguous tensor would have (its own is never used, and may be anything); packed: the batch stride
    spans all rows. None (the FP8 V^T, whose layout the kernel fixes): zeros. ``rows`` / ``heads``: the caller's
    known sizes (rows per sequence, or all rows when packed), for the contiguous case's shortcut."""
    if t is None:
        return 0, 0, 0
    if t.is_contiguous() and rows:  # the common case, from known sizes (tensor attributes cost ~0.2 us each)
        u = 16 // t.element_size()
        dim = t.shape[-1]
        return heads * dim // u, dim // u, rows * heads * dim // u
    eb, shape = t.element_size(), t.shape
    contig = [1] * t.dim()
    for i in range(t.dim() - 2, -1, -1):
        contig[i] = contig[i + 1] * shape[i + 1]
    st = [contig[i] if shape[i] == 1 else t.stride(i) for i in range(t.dim())]
    if t.dim() == 4:
        row, head, batch = st[1], st[2], st[0]
    else:
        row, head = st[0], st[1]
        batch = row * max(shape[0], 1)
    return row * eb // 16, head * eb // 16, batch * eb // 16


def _check_q_dtypes(q, k_int8, quantize_q: bool, granularity: str) -> None:
    if k_int8.dtype != torch.int8:
        raise TypeError(f"k_int8: expected torch.int8, got {k_int8.dtype}")
    if not quantize_q:
        if q.dtype != torch.int8:
            raise TypeError(f"q_int8: expected torch.int8 (or Q in bf16/fp16 with q_scale=None), got {q.dtype}")
        return
    if q.dtype not in _DTYPES:
        raise TypeError(f"q_int8: with q_scale=None, expected the unquantized Q (bf16/fp16), got {q.dtype}")
    if granularity != "per_warp":
        raise ValueError(f"q_scale: None (Q quantized inside the kernel) needs granularity='per_warp', got {granularity!r}")


def _check_balance_input(qk_balance, quantize_q: bool, shape, dev) -> None:
    if qk_balance is None:
        return
    if not quantize_q:
        raise ValueError("qk_balance: only with q_scale=None (the kernel quantizes Q); a prepass-quantized Q "
                         "carries the balance already")
    _check(qk_balance, "qk_balance", torch.float32, shape, dev)


def _check_heads(D: int, Hq: int, Hkv: int, kname: str) -> None:
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim: {D} is not supported by the SM90 prefill kernel {HEAD_DIMS}")
    if Hq < 1 or Hkv < 1:
        raise ValueError(f"{kname}: num_heads ({Hq}) and num_kv_heads ({Hkv}) must be >= 1")
    if Hq % Hkv:
        raise ValueError(f"{kname}: num_kv_heads ({Hkv}) must divide num_heads ({Hq})")


def _scale_groups(granularity: str, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(q scale groups, k scale blocks) the prepass makes for these (max) lengths."""
    if granularity not in ("per_warp", "per_block"):
        raise ValueError(f"granularity: expected 'per_warp' or 'per_block', got {granularity!r}")
    n_qb = -(-seqlen_q // BLOCK_Q)
    return (n_qb * (BLOCK_Q // WARP_Q) if granularity == "per_warp" else n_qb), -(-seqlen_k // BLOCK_K)


def _out(out, dtype, shape, dev) -> torch.Tensor:
    """The caller's ``out`` (checked) or a new output tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    _check(out, "out", dtype, shape, dev)
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("out: expected a contiguous, 16-byte aligned tensor")
    return out


def _check_qkv_16bit(q, k, v) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_pv(fp8: bool, v, v_scale, out, out_dtype, q_int8, quantize_q: bool) -> torch.dtype:
    """V's dtype for the P x V dtype and the output dtype that follows (``prefill_int8`` / ``_varlen``)."""
    if not fp8:
        if v.dtype not in _DTYPES:
            raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
        if v_scale is not None:
            raise ValueError("v_scale: only used with pv_dtype='fp8'")
        return v.dtype
    if v.dtype != torch.float8_e4m3fn:
        raise TypeError(f"v: pv_dtype='fp8' expects the V prepass's V^T (torch.float8_e4m3fn), got {v.dtype}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (q_int8.dtype if quantize_q else torch.bfloat16)
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float16, got {out_dtype}")
    return out_dtype


_lpt_group = functools.lru_cache(maxsize=4096)(lpt_group)  # per argument tuple: no Python work per call
_split_tail_plan = functools.lru_cache(maxsize=4096)(split_tail_plan)


def _launch(cfg: PrefillConfig, q_int8, k_int8, v, out, lse, q_scale, k_scale, cu_q, cu_k, batch: int,
            num_seqs: int, seqlen_q: int, seqlen_k: int, max_seqlen_q: int, Hq: int, Hkv: int, n_qg: int, n_kb: int,
            softmax_scale: float, v_scale=None, qk_balance=None, window: Window = FULL, k_mean=None,
            pdl: bool = False) -> None:
    """``pdl``: the kernel launched just before on this stream is the prepass of these inputs (see the
    kernel's ``pdl``): set by ``flash_attn_func`` / ``flash_attn_varlen_func`` only. ``window``: the call's
    :class:`~qattn.interface.window.Window`, whose flags ``cfg.causal`` / ``cfg.local`` are. ``k_mean``: K's
    smoothing mean (None: none, or an unsmoothed K), added back to the scores before a soft cap, else to the LSE."""
    dev = q_int8.device
    arch = _check_arch(dev)

    def addr(t):
        return 0 if t is None else t.data_ptr()

    num_full, splits, part, count = 0, 1, None, None
    if cfg.split_tail:  # dense non-causal: the last partial wave's units may run split over their keys
        num_units = -(-max_seqlen_q // cfg.tile_m) * Hq * num_seqs
        num_full, splits = _split_tail_plan(num_units, -(-seqlen_k // cfg.tile_n), _num_sms(dev))
        if splits > 1:
            n_tail = num_units - num_full
            part = torch.empty(n_tail * splits * cfg.tile_m * (cfg.head_dim + 1), dtype=torch.float32, device=dev)
            count = torch.zeros(n_tail, dtype=torch.int32, device=dev)
    with on_device(dev):
        _prefill_kernel(arch, cfg)(
            addr(q_int8), addr(k_int8), addr(v), addr(out), addr(lse), addr(q_scale), addr(k_scale), addr(cu_q),
            addr(cu_k), batch, num_seqs, seqlen_q, seqlen_k, max_seqlen_q, Hq, Hkv, n_qg, n_kb,
            score_scale(softmax_scale, cfg.softcap), addr(v_scale),
            addr(qk_balance),
            _lpt_group(cfg, num_seqs * Hq, Hq // Hkv, seqlen_k // max(num_seqs, 1) if cu_k is not None else seqlen_k),
            num_full, splits, addr(part), addr(count), int(pdl and count is None), *window.edges,
            *_strides16(q_int8, seqlen_q, Hq),
            *_strides16(k_int8, seqlen_k, Hkv), *_strides16(None if v.dtype == torch.float8_e4m3fn else v, seqlen_k, Hkv),
            addr(k_mean), stream_handle(dev))


@functools.lru_cache(maxsize=None)
def _num_sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def prefill_int8(
    q_int8: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    k_int8: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    granularity: str = "per_warp",
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    pv_dtype: str = "bf16",
    v_scale: Optional[torch.Tensor] = None,
    qk_balance: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    k_mean: Optional[torch.Tensor] = None,
    _tuning: Optional[dict] = None,
    _pdl: bool = False,
):
    """Attention on INT8 Q/K already quantized by ``qattn.quant.quantize_qk_int8`` (same block sizes:
    block_q 128, warp_q 16, block_k 128) and V (batch, seqlen_k, num_kv_heads, head_dim) bf16/fp16.

    ``pv_dtype="fp8"``: P x V in FP8 E4M3; ``v`` is then the V prepass's output (``qattn.quant.v_fp8``:
    ``quantize_v_fp8`` / ``quantize_v_fp8_reference``), V^T float8_e4m3fn (batch, num_kv_heads, head_dim,
    ceil(seqlen_k / 128) * 128) with its ``v_scale`` fp32 (batch, num_kv_heads, head_dim); the output dtype is
    ``out_dtype`` (bf16 or fp16, default bf16, or that of ``out``). ``pv_dtype="bf16"`` means V's 16-bit dtype.

    ``q_scale=None`` (SM90, ``granularity="per_warp"``): ``q_int8`` is the unquantized Q in the output's 16-bit
    dtype and the kernel quantizes it itself, with the prepass's numerics (one Q read instead of the prepass's
    read + int8 write + the kernel's int8 read); ``flash_attn_func`` does this. With it, ``qk_balance`` (batch,
    num_kv_heads, head_dim) fp32, the K prepass's channel balance (``quantize_k_int8(..., balance_q=q)``),
    scales Q's channels before they are quantized (``balance_qk``; the K given must be the balanced one).

    Scores are ``(q_int8 . k_int8) * q_scale * k_scale * softmax_scale`` (K's smoothing mean is not added back:
    softmax is invariant to it). ``softmax_scale`` defaults to 1/sqrt(head_dim). Returns out (batch, seqlen_q,
    num_heads, head_dim) in V's dtype and, with ``return_lse``, the natural-log LSE (batch, num_heads, seqlen_q)
    fp32: with ``k_mean`` (batch, num_kv_heads, head_dim) fp32, the mean ``quantize_qk_int8`` took out of K
    (``k_mean / qk_balance`` for a Q the prepass balanced; not with ``qk_balance=``), that of the scores with it
    back, ``+ softmax_scale * q . k_mean`` per row (FlashAttention's LSE of the unsmoothed K, e.g. to merge partial
    results; ``q`` the 16-bit Q where the kernel quantizes it, ``q_scale=None``, else the int8 Q times its scale,
    whose rounding times a large mean stays in the LSE), without it that of the smoothed scores. The causal mask
    is aligned to the end (FlashAttention): query i sees keys j <= i + seqlen_k - seqlen_q.
    ``window_size=(left, right)``: sliding-window attention as in FlashAttention, query i sees keys
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded; causal: right = 0).
    ``softcap > 0``: FlashAttention's logit soft-capping, scores ``softcap * tanh(scores / softcap)`` (SM90; SM100
    compile-checked and emulated only). It
    needs ``k_mean`` (zeros for an unsmoothed K): the kernel adds ``q . k_mean`` back to each row's scores before
    the cap, which, unlike the softmax, is not invariant to it.
    """
    if pv_dtype not in ("bf16", "fp8"):
        raise ValueError(f"pv_dtype: expected 'bf16' (V's 16-bit dtype) or 'fp8', got {pv_dtype!r}")
    fp8 = pv_dtype == "fp8"
    for t, name in ((q_int8, "q_int8"), (k_int8, "k_int8"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected shape (batch, seqlen, heads, head_dim), got {tuple(t.shape)}")
    dev = q_int8.device
    B, Sq, Hq, D = q_int8.shape
    Sk, Hkv = k_int8.shape[1], k_int8.shape[2]
    quantize_q = q_scale is None
    _check_q_dtypes(q_int8, k_int8, quantize_q, granularity)
    out_dtype = _check_pv(fp8, v, v_scale, out, out_dtype, q_int8, quantize_q)
    if quantize_q and q_int8.dtype != out_dtype:
        raise TypeError(f"q_int8: with q_scale=None, Q must have the output's dtype {out_dtype}, got {q_int8.dtype}")
    _check_heads(D, Hq, Hkv, "k_int8")
    _check(k_int8, "k_int8", torch.int8, (B, Sk, Hkv, D), dev)
    if fp8:
        sk_pad = -(-Sk // BLOCK_K) * BLOCK_K
        _check(v, "v", torch.float8_e4m3fn, (B, Hkv, D, sk_pad), dev)
        _check(v_scale, "v_scale", torch.float32, (B, Hkv, D), dev)
    else:
        _check(v, "v", v.dtype, (B, Sk, Hkv, D), dev)
    if B < 1 or Sq < 1 or Sk < 1:
        raise ValueError(f"q_int8: batch ({B}), seqlen_q ({Sq}) and seqlen_k ({Sk}) must be >= 1")
    _check_grid(B, Hq, "q_int8")
    n_qg, n_kb = _scale_groups(granularity, Sq, Sk)
    if not quantize_q:
        _check(q_scale, "q_scale", torch.float32, (B, Hq, n_qg), dev)
    _check_balance_input(qk_balance, quantize_q, (B, Hkv, D), dev)
    _check(k_scale, "k_scale", torch.float32, (B, Hkv, n_kb), dev)
    _check_numel(q_int8, k_int8, v.numel() if fp8 else 0)
    softmax_scale = _softmax_scale_value(softmax_scale, D)
    if not q_int8.is_cuda:
        raise ValueError(f"q_int8: expected a CUDA tensor, got device {q_int8.device}")
    out = _out(out, out_dtype, (B, Sq, Hq, D), dev)
    window = resolve_window(window_size, causal, Sq, Sk)
    softcap = _softcap(softcap)
    score_scale(softmax_scale, softcap)  # checked here, not first at the launch
    if _check_arch(dev) == "sm_100a":
        out, lse = _prefill_sm100(q_int8, q_scale, k_int8, k_scale, v, out, (B, Hq, Sq), (B, Hkv, D), window=window,
                                  softmax_scale=softmax_scale, granularity=granularity, softcap=softcap,
                                  k_mean=k_mean, pv_dtype=pv_dtype, tuning=_tuning, quantize_q=quantize_q)
        return (out, lse) if return_lse else out
    k_mean = _k_mean_arg(softcap, k_mean, (B, Hkv, D), dev)
    tuning = _tuning or {}  # _tuning: A/B overrides
    long_tile = seqlen_tile_m(D, granularity, pv_dtype, window.causal, "int8", Sk)
    if long_tile is not None and "tile_m" not in tuning:
        tuning = {**tuning, "tile_m": long_tile}
    cfg = _config(head_dim=D, v_dtype=_DTYPES[out_dtype], causal=window.causal, granularity=granularity,
                  pv_dtype=pv_dtype, quantize_q=quantize_q, balance_qk=qk_balance is not None, local=window.local,
                  softcap=softcap, **tuning)

    q_int8, k_int8, v = _aligned(q_int8), _aligned(k_int8), _aligned(v)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)
    _launch(cfg, q_int8, k_int8, v, out, lse, None if quantize_q else q_scale.contiguous(), k_scale.contiguous(),
            None, None,
            B, B, Sq, Sk, Sq, Hq, Hkv, n_qg, n_kb, softmax_scale, v_scale.contiguous() if fp8 else None,
            None if qk_balance is None else qk_balance.contiguous(), window, k_mean, _pdl)
    return (out, lse) if return_lse else out


def _prefill_sm100(q_int8, q_scale, k_int8, k_scale, v, out, lse_shape: tuple, k_mean_shape: tuple, *, window,
                   softmax_scale: float, granularity: str, softcap: float, k_mean, pv_dtype: str, tuning,
                   quantize_q: bool, cu_seqlens: Optional[tuple] = None):
    """The SM100 branch of :func:`prefill_int8` and (``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q))
    :func:`prefill_int8_varlen`: the SM100 kernel's limits, then the kernel on contiguous copies (it addresses
    contiguous tensors, no strides). Returns (out, lse)."""
    from .prefill_sm100 import check_sm100_prefill_options, prefill_int8_sm100

    check_sm100_prefill_options(varlen=cu_seqlens is not None, pv_dtype=pv_dtype, tuning=tuning)
    if quantize_q:
        raise ValueError("q_scale: None (Q quantized inside the kernel) is implemented on SM90 only")
    k_mean = _k_mean_arg(softcap, k_mean, k_mean_shape, out.device)  # as on SM90
    if cu_seqlens is not None and (q_int8.shape[0] == 0 or k_int8.shape[0] == 0):  # packed totals of 0
        return _no_keys(out, *lse_shape)
    q_int8, k_int8, v = contiguous16(q_int8), contiguous16(k_int8), contiguous16(v)
    if cu_seqlens is not None:
        cu_q, cu_k, max_seqlen_q = cu_seqlens
        cu_seqlens = (cu_q.contiguous(), cu_k.contiguous(), max_seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=out.device)
    prefill_int8_sm100(q_int8, q_scale.contiguous(), k_int8, k_scale.contiguous(), v, out, lse, window=window,
                       softmax_scale=softmax_scale, granularity=granularity, softcap=softcap, k_mean=k_mean,
                       cu_seqlens=cu_seqlens)
    return out, lse


def _check_grid(num_seqs: int, num_heads: int, name: str) -> None:
    if max(num_seqs, num_heads) > MAX_GRID_YZ:  # heads on the grid's y, sequences on z
        raise ValueError(f"{name}: at most {MAX_GRID_YZ} sequences and heads (grid limit), got {num_seqs} and "
                         f"{num_heads}")


def _check_dense_inputs(q, k, v, pv_dtype: str = "bf16") -> None:
    """``flash_attn_func``'s q, k, v shapes and sizes, before any launch (the prepass included): 4-d, k and v
    alike with q's batch and head_dim, at least one batch, row and head, a supported head_dim and GQA ratio, no
    more batches or heads than a grid dimension takes, and sizes the kernels' 32-bit indexing takes."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v: expected (batch, seqlen, heads, head_dim) tensors with k and v alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: expected batch {B} and head_dim {D} like q, got shape {tuple(k.shape)}")
    if B < 1 or Sq < 1 or k.shape[1] < 1:
        raise ValueError(f"q, k: batch ({B}), seqlen_q ({Sq}) and seqlen_k ({k.shape[1]}) must be >= 1")
    _check_heads(D, Hq, k.shape[2], "k")
    _check_grid(B, Hq, "q")
    vt_numel = B * k.shape[2] * D * -(-k.shape[1] // BLOCK_K) * BLOCK_K if pv_dtype == "fp8" else 0  # V^T
    _check_numel(q, k, vt_numel)


def _check_numel(q, k, vt_numel: int) -> None:
    """q and k (and with FP8 P x V the V^T the V prepass makes) within the kernels' 32-bit element indexing."""
    if max(q.numel(), k.numel()) >= 2**31:
        raise ValueError("q, k: too large for the kernels' 32-bit indexing; split the batch")
    if vt_numel >= 2**31:
        raise ValueError("v: its FP8 V^T is too large for the kernel's 32-bit indexing; split the batch")


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         pv_dtype: str = "bf16") -> int:
    """``flash_attn_varlen_func``'s packed q, k, v, cu_seqlens and max_seqlens, before any launch (packed totals
    of 0 included); returns num_seqs."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q, k, v: expected packed (total, heads, head_dim) tensors with k and v alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: head_dim {k.shape[2]} differs from q's {q.shape[2]}")
    _check_heads(q.shape[2], q.shape[1], k.shape[1], "k")
    num_seqs = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.device)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0], num_seqs)
    _check_grid(num_seqs, q.shape[1], "cu_seqlens_q")
    from ..quant.v_fp8 import varlen_vt_keys

    vt_numel = k.shape[1] * k.shape[2] * varlen_vt_keys(k.shape[0], num_seqs) if pv_dtype == "fp8" else 0  # V^T
    _check_numel(q, k, vt_numel)
    return num_seqs


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, dev) -> int:
    """Both cu_seqlens 1-d int32 tensors on ``dev`` of the same num_seqs + 1 >= 2 entries; returns num_seqs."""
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2 or t.device != dev:
            raise ValueError(f"{name}: expected a 1-d int32 tensor of num_seqs + 1 >= 2 entries on {dev}")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_k: expected {num_seqs + 1} entries like cu_seqlens_q, got {cu_seqlens_k.shape[0]}")
    return num_seqs


def _at_most_total(max_seqlen, total: int):
    """``flash_attn_varlen_func``'s max_seqlen lowered to the packed total (at least 1): the scales and the grid are
    sized by it. Anything but an int goes to :func:`_check_max_seqlens` unchanged."""
    if isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool) and max_seqlen > max(total, 1):
        return max(total, 1)
    return max_seqlen


def _check_max_seqlens(max_seqlen_q, max_seqlen_k, total_q: int, total_k: int, num_seqs: int) -> None:
    """Each max_seqlen an int in [1, max(total, 1)] (0 is also taken where the total is 0) with num_seqs x
    max_seqlen >= total: else some sequence is longer than max_seqlen (the grid, sized by it, would skip rows)."""
    for m, name, total in ((max_seqlen_q, "max_seqlen_q", total_q), (max_seqlen_k, "max_seqlen_k", total_k)):
        if (isinstance(m, bool) or not isinstance(m, int) or not (0 if total == 0 else 1) <= m <= max(total, 1)
                or num_seqs * m < total):
            raise ValueError(f"{name}: expected an int in [{min(total, 1)}, {max(total, 1)}] with num_seqs "
                             f"({num_seqs}) x {name} >= the packed total ({total}), got {m!r}")


def _no_keys(out: torch.Tensor, Hq: int, Tq: int) -> tuple:
    """The result of a varlen call whose packed totals are 0, as qattn's kernels write a row that sees no key:
    out 0, LSE -inf (FlashAttention 2 / 3 write LSE +inf there)."""
    return out.zero_(), torch.full((Hq, Tq), float("-inf"), dtype=torch.float32, device=out.device)


def prefill_int8_varlen(
    q_int8: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    k_int8: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    granularity: str = "per_warp",
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    pv_dtype: str = "bf16",
    v_scale: Optional[torch.Tensor] = None,
    qk_balance: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    k_mean: Optional[torch.Tensor] = None,
    _tuning: Optional[dict] = None,
    _pdl: bool = False,
):
    """:func:`prefill_int8` for packed sequences (FlashAttention's varlen layout): q_int8 (total_q, num_heads,
    head_dim), k_int8 and v (total_k, num_kv_heads, head_dim); sequence i owns rows cu_seqlens[i] ..
    cu_seqlens[i+1] (int32, num_seqs + 1 entries, on the device). Scales as ``quantize_qk_int8_varlen`` makes
    them, padded per sequence: q_scale (num_seqs, num_heads, groups of max_seqlen_q), k_scale (num_seqs,
    num_kv_heads, ceil(max_seqlen_k / 128)). Returns out (total_q, num_heads, head_dim) and, with ``return_lse``,
    LSE (num_heads, total_q). cu_seqlens contents are not read on the host (no sync): they must be
    non-decreasing, start at 0, end at the totals, and no sequence may exceed ``max_seqlen_q`` / ``max_seqlen_k``.
    ``q_scale=None``: ``q_int8`` is the unquantized Q in V's dtype, quantized inside the kernel (per_warp), as in
    :func:`prefill_int8`; ``qk_balance`` (num_seqs, num_kv_heads, head_dim) and ``window_size`` as there.
    ``pv_dtype="fp8"``: ``v`` is the varlen V prepass's V^T (``qattn.quant.v_fp8.quantize_v_fp8_varlen``),
    float8_e4m3fn (num_kv_heads, head_dim, ``varlen_vt_keys(total_k, num_seqs)``) with ``v_scale`` fp32
    (num_seqs, num_kv_heads, head_dim); ``out_dtype`` and ``softcap`` as in :func:`prefill_int8`, with ``k_mean``
    (num_seqs, num_kv_heads, head_dim).
    """
    if pv_dtype not in ("bf16", "fp8"):
        raise ValueError(f"pv_dtype: expected 'bf16' (V's 16-bit dtype) or 'fp8', got {pv_dtype!r}")
    fp8 = pv_dtype == "fp8"
    for t, name in ((q_int8, "q_int8"), (k_int8, "k_int8"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected shape (total_rows, heads, head_dim), got {tuple(t.shape)}")
    dev = q_int8.device
    Tq, Hq, D = q_int8.shape
    Tk, Hkv = k_int8.shape[0], k_int8.shape[1]
    quantize_q = q_scale is None
    _check_q_dtypes(q_int8, k_int8, quantize_q, granularity)
    out_dtype = _check_pv(fp8, v, v_scale, out, out_dtype, q_int8, quantize_q)
    if quantize_q and q_int8.dtype != out_dtype:
        raise TypeError(f"q_int8: with q_scale=None, Q must have the output's dtype {out_dtype}, got {q_int8.dtype}")
    _check_heads(D, Hq, Hkv, "k_int8")
    _check(k_int8, "k_int8", torch.int8, (Tk, Hkv, D), dev)
    num_seqs = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, dev)
    if fp8:
        from ..quant.v_fp8 import varlen_vt_keys

        _check(v, "v", torch.float8_e4m3fn, (Hkv, D, varlen_vt_keys(Tk, num_seqs)), dev)
        _check(v_scale, "v_scale", torch.float32, (num_seqs, Hkv, D), dev)
    else:
        _check(v, "v", v.dtype, (Tk, Hkv, D), dev)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k, Tq, Tk, num_seqs)
    _check_grid(num_seqs, Hq, "cu_seqlens_q")
    n_qg, n_kb = _scale_groups(granularity, max_seqlen_q, max_seqlen_k)
    if not quantize_q:
        _check(q_scale, "q_scale", torch.float32, (num_seqs, Hq, n_qg), dev)
    _check_balance_input(qk_balance, quantize_q, (num_seqs, Hkv, D), dev)
    _check(k_scale, "k_scale", torch.float32, (num_seqs, Hkv, n_kb), dev)
    _check_numel(q_int8, k_int8, v.numel() if fp8 else 0)
    softmax_scale = _softmax_scale_value(softmax_scale, D)
    if not q_int8.is_cuda:
        raise ValueError(f"q_int8: expected a CUDA tensor, got device {q_int8.device}")
    out = _out(out, out_dtype, (Tq, Hq, D), dev)
    window = resolve_window(window_size, causal, max_seqlen_q, max_seqlen_k)
    softcap = _softcap(softcap)
    score_scale(softmax_scale, softcap)  # checked here, not first at the launch
    if _check_arch(dev) == "sm_100a":
        out, lse = _prefill_sm100(q_int8, q_scale, k_int8, k_scale, v, out, (Hq, Tq), (num_seqs, Hkv, D),
                                  window=window, softmax_scale=softmax_scale, granularity=granularity,
                                  softcap=softcap, k_mean=k_mean, pv_dtype=pv_dtype, tuning=_tuning,
                                  quantize_q=quantize_q, cu_seqlens=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q))
        return (out, lse) if return_lse else out
    k_mean = _k_mean_arg(softcap, k_mean, (num_seqs, Hkv, D), dev)
    cfg = _config(head_dim=D, v_dtype=_DTYPES[out_dtype], causal=window.causal, granularity=granularity,
                  varlen=True, pv_dtype=pv_dtype, quantize_q=quantize_q, balance_qk=qk_balance is not None,
                  local=window.local, softcap=softcap, **(_tuning or {}))
    if Tq == 0 or Tk == 0:  # packed totals of 0, every option checked: nothing to launch
        out, lse = _no_keys(out, Hq, Tq)
        return (out, lse) if return_lse else out
    q_int8, k_int8, v = _aligned(q_int8), _aligned(k_int8), _aligned(v)
    lse = torch.empty((Hq, Tq), dtype=torch.float32, device=dev)
    _launch(cfg, q_int8, k_int8, v, out, lse, None if quantize_q else q_scale.contiguous(), k_scale.contiguous(),
            cu_seqlens_q.contiguous(),
            cu_seqlens_k.contiguous(), 1, num_seqs, Tq, Tk, max_seqlen_q, Hq, Hkv, n_qg, n_kb, softmax_scale,
            v_scale.contiguous() if fp8 else None, None if qk_balance is None else qk_balance.contiguous(), window,
            k_mean, _pdl)
    return (out, lse) if return_lse else out


def _check_cuda_inputs(q, k, v, name: str, qk_quant: str | None = "int8", softcap: float = 0.0,
                       pv_dtype: str = "bf16") -> None:
    """The last check before the first launch (the one before a device-dependent check): q, k, v on one CUDA
    device, else the fp64 CPU reference of the call's options is named."""
    if not q.is_cuda or k.device != q.device or v.device != q.device:
        if softcap:  # the quantized references take no cap: exact attention
            ref = f"attention_reference(q, k, v, softcap={softcap!r})"
        elif pv_dtype == "fp8" and qk_quant:
            ref = "prefill_fp8pv.prefill_fp8pv_emulation(q, k, v)"
        else:
            ref = "prefill_reference(q, k, v" + (f", qk_quant={qk_quant!r})" if qk_quant else ")")
        raise ValueError(f"q, k, v: expected CUDA tensors on one device, got {q.device}, {k.device}, {v.device} "
                         f"({name} runs on the GPU; its fp64 CPU reference is qattn.reference.{ref}, per sequence "
                         "for packed ones)")


def _prefill_16bit(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal: bool, softmax_scale: float,
                   window_size=(-1, -1), softcap: float = 0.0):
    """The unquantized A/B path of the same kernel (``qk_quant=None``): Q, K, V in one 16-bit dtype, fp32 scores.
    Dense when ``cu_q`` is None (4-d inputs), else varlen (3-d packed inputs); returns (out, lse)."""
    varlen = cu_q is not None  # shapes, heads and sizes: _check_dense_inputs / _check_varlen_inputs (the callers)
    D, Hq, Hkv = q.shape[-1], q.shape[-2], k.shape[-2]
    _check_cuda_inputs(q, k, v, "flash_attn_varlen_func" if varlen else "flash_attn_func", qk_quant=None,
                       softcap=softcap)
    _check_sm100_options(q.device, varlen=varlen, qk_quant=None)
    window = resolve_window(window_size, causal, max_seqlen_q if varlen else q.shape[1],
                            max_seqlen_k if varlen else k.shape[1])
    cfg = _config(head_dim=D, v_dtype=_DTYPES[v.dtype], causal=window.causal, granularity="per_block",
                  varlen=varlen, qk_dtype="bf16", local=window.local, softcap=_softcap(softcap))
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if varlen:
        num_seqs = cu_q.shape[0] - 1
        lse = torch.empty((Hq, q.shape[0]), dtype=torch.float32, device=q.device)
        _launch(cfg, q, k, v, out, lse, None, None, cu_q.contiguous(), cu_k.contiguous(), 1, num_seqs, q.shape[0],
                k.shape[0], max_seqlen_q, Hq, Hkv, 0, 0, softmax_scale, None, None, window)
    else:
        B, Sq = q.shape[:2]
        lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
        _launch(cfg, q, k, v, out, lse, None, None, None, None, B, B, Sq, k.shape[1], Sq, Hq, Hkv, 0, 0,
                softmax_scale, None, None, window)
    return out, lse


# launch plans of the two entry points (launch_plan.py): a signature's second call is recorded, later ones replayed
_DENSE_PLANS = Planner()
_VARLEN_PLANS = Planner()


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    qk_quant: Optional[str] = "int8",
    granularity: str = "per_warp",
    smooth_k: bool = True,
    pv_dtype: str = "bf16",
    return_lse: bool = False,
    balance_qk: bool = False,
    dropout_p: float = 0.0,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """FlashAttention's ``flash_attn_func`` with SageAttention-style INT8 Q/K: q (batch, seqlen_q, num_heads,
    head_dim), k and v (batch, seqlen_k, num_kv_heads, head_dim), bf16 or fp16, head_dim 64 or 128.

    Launches on the current stream: the prepass (``qattn.quant.quantize_qk_int8``: int8 Q/K with fp32 scales,
    K minus its per-channel mean when ``smooth_k``; one to three kernels) and the attention kernel
    (:func:`prefill_int8`). On SM90 with
    ``granularity="per_warp"`` the prepass quantizes K only (``qattn.quant.launch.quantize_k_int8``) and the
    attention kernel quantizes Q itself, with the same numerics (same output, less memory traffic). P x V runs
    in V's dtype with ``pv_dtype="bf16"`` (meaning "V's 16-bit dtype"), or in FP8 E4M3 with ``pv_dtype="fp8"``
    (then a third launch, the V prepass ``qattn.quant.v_fp8.quantize_v_fp8``: per-channel scaled E4M3 V^T).
    ``balance_qk=True`` (off by default): power-of-two channel scales moved between Q and K before quantizing
    (``Q K^T`` unchanged), for inputs with loud channels (``qattn.quant.qk_int8``); the prepass then also reads
    Q once (its column amax) and takes K's column ranges, and Q is quantized from ``q * qk_balance``.
    Returns out like q's dtype and, with ``return_lse``, the natural-log LSE (batch, num_heads, seqlen_q) fp32 of
    the caller's K, as FlashAttention's: K's smoothing mean, which the softmax ignores, is put back into it.

    ``window_size=(left, right)``: sliding-window (local) attention as in FlashAttention, query i sees keys
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1 or None: unbounded on that side;
    ``causal=True`` sets right to 0); the K/V tiles left of a query tile's windows are not read (the SM100 kernel's
    window is compile-checked and emulated only: it never ran).

    ``softcap > 0``: FlashAttention's logit soft-capping (Gemma 2, Grok): the scores z = softmax_scale * q.k become
    ``softcap * tanh(z / softcap)`` before the softmax (``tanh.approx`` on the MUFU; on SM100 compile-checked and
    emulated only). One compiled kernel per value (a model has one).

    FlashAttention's other keywords are accepted at the values that mean "off", so a call written for it runs
    unchanged when passed by keyword: ``dropout_p=0.0``, ``alibi_slopes=None``, ``return_attn_probs=False``;
    anything else raises NotImplementedError (no ALiBi, dropout or attention probabilities here). Everything after
    q, k, v is keyword-only (FlashAttention's versions order their positional parameters differently).
    ``deterministic`` is accepted either way: every launch is deterministic (split units merge in a fixed order).
    """
    _check_attn_probs(return_attn_probs)
    check_forward_only(q, k, v)
    options = (causal, softmax_scale, qk_quant, granularity, smooth_k, pv_dtype, balance_qk, dropout_p, window_size,
               softcap, alibi_slopes, deterministic, bool(return_lse))
    # a signature seen before replays its recorded launches (launch_plan.py)
    out, lse = _DENSE_PLANS.call(signature_key((q, k, v), options), (q, k, v),
                                 lambda: _flash_attn_func(q, k, v, *options))
    return (out, lse) if return_lse else out


def _flash_attn_func(q, k, v, causal, softmax_scale, qk_quant, granularity, smooth_k, pv_dtype, balance_qk,
                     dropout_p, window_size, softcap, alibi_slopes, deterministic, return_lse=True):
    """:func:`flash_attn_func`'s checks and launches (or its custom op under torch.compile): (out, lse)."""
    window, softmax_scale, softcap = _check_options(q, k, v, softmax_scale, qk_quant, pv_dtype, balance_qk,
                                                    dropout_p, window_size, softcap, alibi_slopes, deterministic,
                                                    granularity)
    if torch.compiler.is_compiling():  # torch.compile traces the registered custom op (no graph break)
        from .torch_ops import prefill_op

        out, lse = prefill_op(q, k, v, bool(causal), float(softmax_scale), granularity, bool(smooth_k), pv_dtype,
                              qk_quant or "none", balance_qk, *window, softcap=softcap, lse_shift=return_lse)
    else:
        out, lse = _flash_attn_func_eager(q, k, v, bool(causal), float(softmax_scale), granularity, bool(smooth_k),
                                          pv_dtype, qk_quant or "none", balance_qk, window, softcap, return_lse)
    return out, lse


def _check_options(q, k, v, softmax_scale, qk_quant, pv_dtype, balance_qk, dropout_p, window_size, softcap,
                   alibi_slopes, deterministic, granularity) -> tuple:
    """The checks ``flash_attn_func`` and ``flash_attn_varlen_func`` share: (window edges, softmax scale,
    softcap)."""
    _check_fa_keywords(dropout_p, alibi_slopes, deterministic)
    softcap = _softcap(softcap)
    window = _window_ints(window_size)
    if qk_quant not in ("int8", None):
        raise ValueError(f"qk_quant: expected 'int8' or None (plain 16-bit Q K^T), got {qk_quant!r}")
    _scale_groups(granularity, 1, 1)  # its name (a typo was the CUDA-device error on CPU, ignored with qk_quant=None)
    _check_balance(balance_qk, qk_quant)
    _check_pv_dtype(pv_dtype, qk_quant)
    _check_qkv_16bit(q, k, v)
    softmax_scale = _softmax_scale_value(softmax_scale, q.shape[-1])
    score_scale(softmax_scale, softcap)  # the kernels' fp32 score scale, checked before any launch
    return window, softmax_scale, softcap


# ``k_mean`` of an internal call whose K was not smoothed (``flash_attn_func(smooth_k=False)``)
_UNSMOOTHED = object()


def _k_mean_arg(softcap: float, k_mean, shape, dev):
    """The K smoothing mean the int8 kernel adds back (None: none to add), checked: to the scores before a soft
    cap, which unlike the softmax is not invariant to the per-row shift q . k_mean that smoothing takes out of
    them (so a soft-capped call must say what it was), else to the returned LSE (optional: without it the LSE is
    that of the smoothed scores)."""
    if k_mean is _UNSMOOTHED or (k_mean is None and not softcap):
        return None
    if k_mean is None:
        raise ValueError("k_mean: softcap > 0 needs K's smoothing mean (quantize_qk_int8's k_mean; zeros for an "
                         "unsmoothed K): soft-capping is not invariant to the shift smoothing takes out")
    _check(k_mean, "k_mean", torch.float32, shape, dev)
    return _aligned(k_mean.contiguous())  # the kernels read it 16 bytes at a time


def _check_softcap_balance(softcap: float, balance_qk: bool, kernel_quantizes_q: bool) -> None:
    """softcap with balance_qk needs the kernel that quantizes Q (it reads the balance); before any launch."""
    if softcap and balance_qk and not kernel_quantizes_q:
        raise NotImplementedError("softcap: with balance_qk=True only granularity='per_warp' on SM90 (the kernel "
                                  "that quantizes Q reads the balance the smoothing shift needs)")


def _internal_k_mean(k_mean, softcap: float, lse_shift: bool, q_balance=None):
    """What an internal call hands ``prefill_int8`` as ``k_mean``: the prepass's mean, or the unsmoothed marker.
    Only where something reads it: a soft cap (the scores), or a returned LSE (``lse_shift``; the shift costs the
    kernel up to 4 %, H200, so a call that drops the LSE does not pay it). ``q_balance``: the balance a
    prepass-quantized Q carries (the kernel does not see it), the mean is divided by it (no softcap there)."""
    if k_mean is None:
        return _UNSMOOTHED if softcap else None  # a soft-capped call must say it was unsmoothed
    if not (softcap or lse_shift):
        return None
    return k_mean if q_balance is None else k_mean / q_balance


def _check_attn_probs(return_attn_probs) -> None:
    """FlashAttention 2 / 3's ``return_attn_probs``: False only (the kernels never form the attention matrix)."""
    if return_attn_probs is not False:
        raise NotImplementedError(f"return_attn_probs: the attention probabilities are not returned; False only, "
                                  f"got {return_attn_probs!r} (return_lse=True gives the log-sum-exp)")


def _check_fa_keywords(dropout_p, alibi_slopes, deterministic) -> None:
    """FlashAttention's keywords that qattn takes only at their "off" values (see :func:`flash_attn_func`)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise NotImplementedError(f"dropout_p: qattn's prefill is for inference; 0.0 only, got {dropout_p!r}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented; None only")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")


def _check_pv_dtype(pv_dtype, qk_quant) -> None:
    if pv_dtype not in ("bf16", "fp8"):
        raise ValueError(f"pv_dtype: expected 'bf16' (V's 16-bit dtype) or 'fp8', got {pv_dtype!r}")
    if qk_quant is None and pv_dtype != "bf16":
        raise ValueError("pv_dtype: qk_quant=None (the unquantized A/B path) runs P x V in V's dtype only")


def _check_balance(balance_qk, qk_quant) -> None:
    if not isinstance(balance_qk, bool):
        raise TypeError(f"balance_qk: expected a bool, got {type(balance_qk).__name__}")
    if balance_qk and qk_quant is None:
        raise ValueError("balance_qk: balances the int8 quantization of Q and K; qk_quant=None quantizes nothing")


def _flash_attn_func_eager(q, k, v, causal: bool, softmax_scale: float, granularity: str, smooth_k: bool,
                           pv_dtype: str, qk_quant: str = "int8", balance_qk: bool = False, window=(-1, -1),
                           softcap: float = 0.0, lse_shift: bool = True):
    """Prepass + kernel launches of :func:`flash_attn_func` (arguments already checked); returns (out, lse)."""
    from ..quant.launch import _check_pair, quantize_k_int8, quantize_qk_int8

    _check_dense_inputs(q, k, v, pv_dtype)
    if q.is_cuda:  # SM100's limits before any launch (the prepass included); CPU tensors fail later, clearly
        _check_sm100_options(q.device, pv_dtype=pv_dtype, qk_quant=None if qk_quant == "none" else qk_quant)
    if qk_quant == "none":
        return _prefill_16bit(q, k, v, None, None, None, None, causal, softmax_scale, window, softcap)

    if pv_dtype == "fp8":
        from ..quant.v_fp8 import _check_v

        _check_v(v)  # before any launch: head_dim 64 / 128
    lam = q_balance = None  # the channel balance, for a kernel that quantizes Q itself / carried by Q
    _check_cuda_inputs(q, k, v, "flash_attn_func", softcap=softcap, pv_dtype=pv_dtype)
    quantizes_q = _kernel_quantizes_q(q, granularity)
    _check_softcap_balance(softcap, balance_qk, quantizes_q)
    if quantizes_q:
        q8, qs = q, None
        _check_pair(q, k)  # what quantize_qk_int8 checks about the pair, before the K prepass launches
        k8, ks, k_mean, *lam = quantize_k_int8(k, smooth_k=smooth_k, block_k=BLOCK_K,
                                               balance_q=q if balance_qk else None)
        lam = lam[0] if lam else None
    else:  # a prepass-quantized Q carries the balance (Q K^T of the balanced Q and K is the same)
        q8, qs, k8, ks, k_mean, *q_lam = quantize_qk_int8(q, k, granularity=granularity, smooth_k=smooth_k,
                                                           block_q=BLOCK_Q, warp_q=WARP_Q, block_k=BLOCK_K,
                                                           balance_qk=balance_qk)
        q_balance = q_lam[0] if q_lam else None  # Q carries it
    k_mean = _internal_k_mean(k_mean, softcap, lse_shift, q_balance)
    if pv_dtype == "fp8":
        from ..quant.v_fp8 import quantize_v_fp8

        vt, vs = quantize_v_fp8(v, _pdl=True)  # right after the K (or Q / K) prepass, which does not write v
        return prefill_int8(q8, qs, k8, ks, vt, causal=causal, softmax_scale=softmax_scale, granularity=granularity,
                            return_lse=True, pv_dtype="fp8", v_scale=vs, out_dtype=q.dtype, qk_balance=lam,
                            window_size=window, softcap=softcap, k_mean=k_mean, _pdl=True)
    # _pdl: the prepass launched just before (K only, or K then Q) lets the attention grid start early
    return prefill_int8(q8, qs, k8, ks, v, causal=causal, softmax_scale=softmax_scale, granularity=granularity,
                        return_lse=True, qk_balance=lam, window_size=window, softcap=softcap, k_mean=k_mean,
                        _pdl=True)


def flash_attn_varlen_func(
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
    qk_quant: Optional[str] = "int8",
    granularity: str = "per_warp",
    smooth_k: bool = True,
    pv_dtype: str = "bf16",
    return_lse: bool = False,
    balance_qk: bool = False,
    dropout_p: float = 0.0,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """FlashAttention's ``flash_attn_varlen_func`` with INT8 Q/K: q (total_q, num_heads, head_dim), k and v
    (total_k, num_kv_heads, head_dim), int32 ``cu_seqlens_*`` (num_seqs + 1,). Prepass
    (``qattn.quant.quantize_qk_int8_varlen``: groups never cross sequences, K smoothed per sequence) + kernel
    (:func:`prefill_int8_varlen`). LSE, with ``return_lse``, is (num_heads, total_q). ``pv_dtype="fp8"``: P x V
    in FP8 E4M3 after the varlen V prepass (``qattn.quant.v_fp8.quantize_v_fp8_varlen``: each sequence's own
    per-channel scales). ``balance_qk`` and FlashAttention's other keywords (``dropout_p``, ``window_size``, ...)
    as in :func:`flash_attn_func` (one balance per sequence). ``max_seqlen_*`` are upper bounds, as in
    FlashAttention (one above the packed total is lowered to it)."""
    _check_attn_probs(return_attn_probs)
    check_forward_only(q, k, v)
    options = (causal, softmax_scale, qk_quant, granularity, smooth_k, pv_dtype, balance_qk, dropout_p, window_size,
               softcap, alibi_slopes, deterministic, bool(return_lse))
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    out, lse = _VARLEN_PLANS.call(signature_key(inputs, options + (max_seqlen_q, max_seqlen_k)), inputs,
                                  lambda: _flash_attn_varlen_func(*inputs, max_seqlen_q, max_seqlen_k, *options))
    return (out, lse) if return_lse else out



def _unpack(t, name: str, dims: int, axis: int, count: int, layout: str) -> tuple:
    """The ``count`` views of a packed tensor along ``axis`` (no copy), after checking its rank and that axis."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.shape[axis] != count:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(t.shape)}")
    return t.unbind(axis)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, **options):
    """FlashAttention's ``flash_attn_qkvpacked_func``: ``qkv`` (batch, seqlen, 3, num_heads, head_dim) is
    :func:`flash_attn_func` on its three views ``qkv[:, :, 0]``, ``[:, :, 1]``, ``[:, :, 2]`` (no copy; the kernels
    read the strided views). ``options``: :func:`flash_attn_func`'s keywords."""
    q, k, v = _unpack(qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, num_heads, head_dim)")
    return flash_attn_func(q, k, v, **options)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, **options):
    """FlashAttention's ``flash_attn_kvpacked_func``: ``kv`` (batch, seqlen_k, 2, num_kv_heads, head_dim) is
    :func:`flash_attn_func` on ``q``, ``kv[:, :, 0]`` and ``kv[:, :, 1]`` (views, no copy)."""
    k, v = _unpack(kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, num_kv_heads, head_dim)")
    return flash_attn_func(q, k, v, **options)


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, **options):
    """FlashAttention's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` (total, 3, num_heads, head_dim) is
    :func:`flash_attn_varlen_func` on its three views, with ``cu_seqlens`` / ``max_seqlen`` for queries and keys."""
    q, k, v = _unpack(qkv, "qkv", 4, 1, 3, "(total, 3, num_heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, **options):
    """FlashAttention's ``flash_attn_varlen_kvpacked_func``: ``kv`` (total_k, 2, num_kv_heads, head_dim) is
    :func:`flash_attn_varlen_func` on ``q``, ``kv[:, 0]`` and ``kv[:, 1]`` (views, no copy)."""
    k, v = _unpack(kv, "kv", 4, 1, 2, "(total_k, 2, num_kv_heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)


def _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                            qk_quant, granularity, smooth_k, pv_dtype, balance_qk, dropout_p, window_size, softcap,
                            alibi_slopes, deterministic, return_lse=True):
    """:func:`flash_attn_varlen_func`'s checks and launches (or its custom op under torch.compile): (out, lse)."""
    window, softmax_scale, softcap = _check_options(q, k, v, softmax_scale, qk_quant, pv_dtype, balance_qk,
                                                    dropout_p, window_size, softcap, alibi_slopes, deterministic,
                                                    granularity)
    if torch.compiler.is_compiling():
        from .torch_ops import int_arg, prefill_varlen_op

        out, lse = prefill_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int_arg(max_seqlen_q, "max_seqlen_q"),
                                     int_arg(max_seqlen_k, "max_seqlen_k"),
                                     bool(causal), float(softmax_scale), granularity, bool(smooth_k),
                                     qk_quant or "none", balance_qk, *window, pv_dtype=pv_dtype, softcap=softcap,
                                     lse_shift=return_lse)
    else:
        out, lse = _flash_attn_varlen_func_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 bool(causal), float(softmax_scale), granularity, bool(smooth_k),
                                                 qk_quant or "none", balance_qk, window, pv_dtype, softcap, return_lse)
    return out, lse


def _check_empty_varlen(q, k, v, granularity: str, softcap: float, balance_qk: bool, quantized: bool) -> None:
    """The checks that a varlen call whose packed totals are 0 would otherwise get from the prepass and kernel
    launchers it skips (shapes, cu_seqlens and max_seqlens are :func:`_check_varlen_inputs`', granularity
    :func:`_check_options`'): q, k, v on one CUDA device (the CPU reference named, as for non-empty calls), then
    with int8 Q K^T (``quantized``) softcap with balance_qk."""
    _check_cuda_inputs(q, k, v, "flash_attn_varlen_func", qk_quant="int8" if quantized else None, softcap=softcap)
    if quantized:
        _check_softcap_balance(softcap, balance_qk, _kernel_quantizes_q(q, granularity))


def _flash_attn_varlen_func_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                  causal: bool, softmax_scale: float, granularity: str, smooth_k: bool,
                                  qk_quant: str = "int8", balance_qk: bool = False, window=(-1, -1),
                                  pv_dtype: str = "bf16", softcap: float = 0.0, lse_shift: bool = True):
    """Prepass + kernel launches of :func:`flash_attn_varlen_func`; returns (out, lse)."""
    from ..quant.launch import _check_pair, quantize_k_int8_varlen, quantize_qk_int8_varlen

    # an upper bound, as in FlashAttention (engines pass a fixed one): no sequence outgrows its packed total
    max_seqlen_q, max_seqlen_k = _at_most_total(max_seqlen_q, q.shape[0]), _at_most_total(max_seqlen_k, k.shape[0])
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, pv_dtype)
    if q.is_cuda:  # SM100's limits before any launch (the prepass included), as in flash_attn_func
        _check_sm100_options(q.device, varlen=True, pv_dtype=pv_dtype,
                             qk_quant=None if qk_quant == "none" else qk_quant)
    if pv_dtype == "fp8":
        from ..quant.v_fp8 import _check_v

        _check_v(v.unsqueeze(0))  # before any launch: head_dim 64 / 128
    if q.shape[0] == 0 or k.shape[0] == 0:  # packed totals of 0: no prepass or kernel launch (they need rows)
        _check_empty_varlen(q, k, v, granularity, softcap, balance_qk, quantized=qk_quant != "none")
        return _no_keys(torch.zeros(q.shape, dtype=q.dtype, device=q.device), q.shape[1], q.shape[0])
    if qk_quant == "none":
        return _prefill_16bit(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              window, softcap)

    lam = q_balance = None
    _check_cuda_inputs(q, k, v, "flash_attn_varlen_func", softcap=softcap, pv_dtype=pv_dtype)
    quantizes_q = _kernel_quantizes_q(q, granularity)
    _check_softcap_balance(softcap, balance_qk, quantizes_q)
    if quantizes_q:
        q8, qs = q, None
        _check_pair(q, k)  # what quantize_qk_int8_varlen checks about q, before the K prepass launches
        k8, ks, k_mean, *lam = quantize_k_int8_varlen(k, cu_seqlens_k, max_seqlen_k, smooth_k=smooth_k, block_k=BLOCK_K,
                                                 **(dict(balance_q=q, cu_seqlens_q=cu_seqlens_q,
                                                         max_seqlen_q=max_seqlen_q) if balance_qk else {}))
        lam = lam[0] if lam else None
    else:
        q8, qs, k8, ks, k_mean, *q_lam = quantize_qk_int8_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k, granularity=granularity,
                                                                  smooth_k=smooth_k, block_q=BLOCK_Q, warp_q=WARP_Q,
                                                                  block_k=BLOCK_K, balance_qk=balance_qk)
        q_balance = q_lam[0] if q_lam else None  # Q carries it
    k_mean = _internal_k_mean(k_mean, softcap, lse_shift, q_balance)
    if pv_dtype == "fp8":
        from ..quant.v_fp8 import quantize_v_fp8_varlen

        # right after the K (or Q / K) prepass, which does not write v
        vt, vs = quantize_v_fp8_varlen(v, cu_seqlens_k, max_seqlen_k, _pdl=True)
        return prefill_int8_varlen(q8, qs, k8, ks, vt, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   causal=causal, softmax_scale=softmax_scale, granularity=granularity,
                                   return_lse=True, pv_dtype="fp8", v_scale=vs, out_dtype=q.dtype, qk_balance=lam,
                                   window_size=window, softcap=softcap, k_mean=k_mean, _pdl=True)
    return prefill_int8_varlen(q8, qs, k8, ks, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=causal, softmax_scale=softmax_scale, granularity=granularity,
                               return_lse=True, qk_balance=lam, window_size=window, softcap=softcap, k_mean=k_mean,
                               _pdl=True)


@functools.lru_cache(maxsize=None)
def _prefill_kernel(arch: str, cfg: PrefillConfig):
    """The launcher of ``cfg``'s compiled kernel (the compile cache's lookup and key, once per config)."""
    return fast(cache_for("prefill").get((arch,) + cfg.key, lambda: _build_prefill(cfg, arch)))


@functools.lru_cache(maxsize=256)
def _config(*args, **kwargs) -> PrefillConfig:
    """``PrefillConfig(...)``, remembered (its checks cost ~6 µs per call)."""
    return PrefillConfig(*args, **kwargs)


def _kernel_quantizes_q(q: torch.Tensor, granularity: str) -> bool:
    """SM90 with per_warp q scales: the attention kernel quantizes Q itself (``PrefillConfig.quantize_q``)."""
    return granularity == "per_warp" and q.is_cuda and _check_arch(q.device) == "sm_90a"


def _build_prefill(cfg: PrefillConfig, arch: str):
    from ..cute_kernels.compile_utils import compile_for_arch
    from ..cute_kernels.sm90.prefill_int8 import QKInt8PrefillSm90

    return compile_for_arch(QKInt8PrefillSm90(cfg), *prefill_compile_args(), arch=arch, keep_ptx=False)[0]


@register("prefill")
def _prefill_variants(arch: str, head_dims=None, q_dtypes=None, balance_qk: bool = False,
                      sliding_window: bool = False, softcaps=None, **_) -> list:
    """The SM90 INT8-QK prefill variants ``flash_attn_func`` / ``flash_attn_varlen_func`` compile: head_dim x
    V dtype x causal x q-scale granularity x (dense, varlen) x (16-bit, fp8 P.V), default tuning (the runtime
    key, arch first); per_warp ones quantize Q in the kernel, as those functions launch them. ``balance_qk``:
    also the per_warp kernels that quantize ``q * qk_balance`` (``balance_qk=True``). ``sliding_window``: also
    each one's ``window_size`` twin (``PrefillConfig.local``: a left window edge; the right one is ``causal``).
    ``softcaps``: also each one's twin per ``softcap`` value (one kernel per value; SM100 too)."""
    if arch == "sm_100a":  # the SM100 kernel's variants (dense, int8 QK, P.V in V's dtype; never ran on hardware)
        from .prefill_sm100 import sm100_prefill_variants

        return sm100_prefill_variants(arch, head_dims, q_dtypes, sliding_window, softcaps)
    if arch != "sm_90a":
        return []
    dts = [{"f16": "fp16"}.get(d, d) for d in (q_dtypes or ["bf16", "fp16"])]
    out = []
    for d in [x for x in (head_dims or HEAD_DIMS) if x in HEAD_DIMS]:
        for vd in [x for x in dts if x in _DTYPES.values()]:
            for causal in (False, True):
                for gran in ("per_warp", "per_block"):
                    for varlen, pv in ((False, "bf16"), (True, "bf16"), (False, "fp8"), (True, "fp8")):
                        cfg = PrefillConfig(head_dim=d, v_dtype=vd, causal=causal, granularity=gran, varlen=varlen,
                                            pv_dtype=pv, quantize_q=gran == "per_warp")  # _kernel_quantizes_q
                        label = (f"D{d} {vd} {'causal' if causal else 'full'} {gran}{' varlen' if varlen else ''}"
                                 f"{' pv-fp8' if pv == 'fp8' else ''}")
                        cfgs = [(cfg, label)]
                        long_tm = None if varlen else seqlen_tile_m(d, gran, pv, causal, "int8", LONG_CAUSAL_KEYS)
                        if long_tm is not None:  # what prefill_int8 picks for long dense causal grids
                            cfgs.append((dataclasses.replace(cfg, tile_m=long_tm, intra_wg_overlap=None),
                                         label + f" tile_m {long_tm} (from {LONG_CAUSAL_KEYS} keys)"))
                        for cfg, label in cfgs:
                            twins = [(cfg, label)]
                            if balance_qk and gran == "per_warp":
                                twins.append((dataclasses.replace(cfg, balance_qk=True), label + " balance_qk"))
                            if sliding_window:
                                twins += [(_local_twin(c), lab + " window") for c, lab in twins]
                            twins += _softcap_twins(twins, softcaps)
                            out += [Variant("prefill", (arch,) + c.key, lab, lambda c=c: _build_prefill(c, arch))
                                    for c, lab in twins]
                for varlen in (False, True):  # qk_quant=None, the unquantized A/B path
                    cfg = PrefillConfig(head_dim=d, v_dtype=vd, causal=causal, granularity="per_block",
                                        varlen=varlen, qk_dtype="bf16")
                    label = f"D{d} {vd} {'causal' if causal else 'full'} qk-16bit{' varlen' if varlen else ''}"
                    twins = [(cfg, label)] + ([(_local_twin(cfg), label + " window")] if sliding_window else [])
                    twins += _softcap_twins(twins, softcaps)
                    out += [Variant("prefill", (arch,) + c.key, lab, lambda c=c: _build_prefill(c, arch))
                            for c, lab in twins]
    return out


def _softcap_twins(twins: list, softcaps) -> list:
    """The ``softcap`` twins of (config, label) pairs, one per positive value of ``softcaps``."""
    return [(dataclasses.replace(c, softcap=float(sc)), f"{lab} softcap {float(sc):g}")
            for sc in (softcaps or ()) if sc for c, lab in twins]


def _local_twin(cfg: PrefillConfig) -> PrefillConfig:
    """``cfg`` with a left window edge (``local``), as ``prefill_int8`` picks it for a ``window_size``."""
    return dataclasses.replace(cfg, local=True, split_tail=False if not cfg.causal else cfg.split_tail)
