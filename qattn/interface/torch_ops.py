"""torch.library custom ops, so that ``torch.compile(..., fullgraph=True)`` traces a decode step without breaks.

The ops take the plain tensors of one cache layer plus the formats as strings (``"nvfp4"``, ``"mxfp4:rceil"``),
rebuild a :class:`PagedKVCache` view (no copy) and call the same launchers as eager code. Their fake
implementations give output shapes only. The public functions (``qattn.write_kv``,
``qattn.flash_attn_with_kvcache``, ``qattn.flatten_kv``, ``qattn.flash_attn_func``,
``qattn.flash_attn_varlen_func``, and the prepass entry points ``qattn.quant.quantize_qk_int8`` /
``quantize_qk_int8_varlen`` / ``quantize_v_fp8`` / ``_varlen``) route through these ops only while torch.compile traces them,
so eager callers pay no dispatcher overhead.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layouts.formats import KVFormat, kv_format
from ..layouts.paged import KVLayer, PagedKVCache


def format_str(fmt: KVFormat) -> str:
    """A format as a string an op can carry: its name, plus the MX rule and the scale search when there are
    ones (``"mxfp4:rceil+msenb"``)."""
    s = f"{fmt.name}:{fmt.scale_rule}" if fmt.scale_rule in ("floor", "rceil") else fmt.name
    return f"{s}+{fmt.scale_search}" if fmt.scale_search else s


def _parse(s: str) -> KVFormat:
    s, _, search = s.partition("+")
    name, _, rule = s.partition(":")
    return kv_format(name, scale_rule=rule or None, scale_search=search or None)


def _view(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, k_ring, v_ring,
          k_format: str, v_format: str, page_size: int, head_dim: int, ring_dtype, rotation_signs=None,
          rotation_seed: int = 0, k_sink=None, v_sink=None) -> PagedKVCache:
    # rotation_signs (the cache's device tensor) is passed through, so the op never copies from the host
    layer = KVLayer(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, k_ring, v_ring,
                    k_sink, v_sink)
    return PagedKVCache.from_tensors([layer], page_size, head_dim, (_parse(k_format), _parse(v_format)),
                                     dtype=ring_dtype, rotate=rotation_signs is not None,
                                     rotation_seed=rotation_seed, rotation_signs=rotation_signs)


def int_arg(v, name: str):
    """An int argument passed into a custom op under torch.compile: ints (and SymInts) pass, anything else is a
    TypeError (``int()`` would truncate a float silently; the eager paths reject it too)."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    return v


def _head_dim(k_data: torch.Tensor, k_format: str) -> int:
    return k_data.shape[-1] * (2 if _parse(k_format).is_packed else 1)


def _unquantized_dtype(k_ring, k_sink) -> torch.dtype:
    """The cache's dtype, as held by its ring or sink rows (bf16 when it has neither: then unused)."""
    t = k_ring if k_ring is not None else k_sink
    return t.dtype if t is not None else torch.bfloat16


@torch.library.custom_op("qattn::write_kv", mutates_args=("k_data", "v_data", "k_scale_pool", "v_scale_pool",
                                                         "k_ring", "v_ring", "k_sink", "v_sink"))
def write_kv_op(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                k_data: torch.Tensor, v_data: torch.Tensor,
                k_scale_pool: Optional[torch.Tensor], v_scale_pool: Optional[torch.Tensor],
                k_global_scale: Optional[torch.Tensor], v_global_scale: Optional[torch.Tensor],
                k_ring: Optional[torch.Tensor], v_ring: Optional[torch.Tensor],
                k_sink: Optional[torch.Tensor], v_sink: Optional[torch.Tensor],
                seq_slots: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                k_format: str, v_format: str, page_size: int,
                cos_sin_cache: Optional[torch.Tensor] = None, rope_style: str = "neox",
                k_mean: Optional[torch.Tensor] = None, rotation_signs: Optional[torch.Tensor] = None,
                rotation_seed: int = 0) -> None:
    # Mutated tensors never take a default: torch 2.11's dispatcher drops trailing arguments equal to their
    # defaults before its in-place version bump indexes them (IndexError under torch.compile on the GPU).
    from ..quant.transforms import RoPE
    from .kv_cache_ops import _write_kv_eager

    cache = _view(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, k_ring, v_ring,
                  k_format, v_format, page_size, _head_dim(k_data, k_format), _unquantized_dtype(k_ring, k_sink),
                  rotation_signs, rotation_seed, k_sink, v_sink)
    rope = None if cos_sin_cache is None else RoPE(cos_sin_cache, rope_style)
    _write_kv_eager(cache, 0, k, v, slot_mapping, seq_slots=seq_slots, positions=positions, rope=rope,
                    k_mean=k_mean)


@write_kv_op.register_fake
def _(k, v, slot_mapping, k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, k_ring,
      v_ring, k_sink, v_sink, seq_slots, positions, k_format, v_format, page_size, cos_sin_cache=None,
      rope_style="neox", k_mean=None, rotation_signs=None, rotation_seed=0) -> None:
    return None


@torch.library.custom_op("qattn::paged_decode", mutates_args=())
def paged_decode_op(q: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor,
                    k_scale_pool: Optional[torch.Tensor], v_scale_pool: Optional[torch.Tensor],
                    k_global_scale: Optional[torch.Tensor], v_global_scale: Optional[torch.Tensor],
                    cache_seqlens: torch.Tensor, block_table: torch.Tensor, k_format: str, v_format: str,
                    page_size: int, softmax_scale: float, causal: bool,
                    num_splits: int, k_ring: Optional[torch.Tensor] = None, v_ring: Optional[torch.Tensor] = None,
                    seq_slots: Optional[torch.Tensor] = None, k_sink: Optional[torch.Tensor] = None,
                    v_sink: Optional[torch.Tensor] = None, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    from .decode import _flash_attn_with_kvcache_eager

    cache = _view(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, k_ring, v_ring,
                  k_format, v_format, page_size, _head_dim(k_data, k_format), _unquantized_dtype(k_ring, k_sink),
                  k_sink=k_sink, v_sink=v_sink)
    return _flash_attn_with_kvcache_eager(q, cache, cache_seqlens, block_table, seq_slots=seq_slots,
                                          softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                                          return_lse=True, window_size=(window_left, window_right), softcap=softcap)


@paged_decode_op.register_fake
def _(q, k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, cache_seqlens, block_table,
      k_format, v_format, page_size, softmax_scale, causal, num_splits, k_ring=None, v_ring=None, seq_slots=None,
      k_sink=None, v_sink=None, window_left=-1, window_right=-1, softcap=0.0):
    B, Sq, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def write_kv_traced(cache: PagedKVCache, layer: int, k, v, slot_mapping, seq_slots, positions, rope=None,
                    k_mean=None) -> None:
    lay = cache.layer(layer)
    torch.ops.qattn.write_kv(k, v, slot_mapping, lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                             lay.k_global_scale, lay.v_global_scale, lay.k_ring, lay.v_ring, lay.k_sink, lay.v_sink,
                             seq_slots, positions, format_str(cache.k_format), format_str(cache.v_format),
                             cache.page_size, None if rope is None else rope.cos_sin_cache,
                             "neox" if rope is None else rope.style, k_mean, cache.rotation_signs,
                             cache.rotation_seed or 0)


def paged_decode_traced(q, cache: PagedKVCache, cache_seqlens, block_table, layer: int, softmax_scale, causal: bool,
                        num_splits: int, return_lse: bool, out, seq_slots=None, window_size=(-1, -1),
                        softcap: float = 0.0):
    import math

    lay = cache.layer(layer)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    o, lse = torch.ops.qattn.paged_decode(q, lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                          lay.k_global_scale, lay.v_global_scale, cache_seqlens, block_table,
                                          format_str(cache.k_format), format_str(cache.v_format), cache.page_size,
                                          scale, bool(causal), int(num_splits), lay.k_ring, lay.v_ring,
                                          seq_slots, lay.k_sink, lay.v_sink, *window_size, softcap=softcap)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


@torch.library.custom_op("qattn::prefill", mutates_args=())
def prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
               granularity: str, smooth_k: bool, pv_dtype: str, qk_quant: str,
               balance_qk: bool = False, window_left: int = -1,
               window_right: int = -1, softcap: float = 0.0,
               lse_shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``qattn.flash_attn_func`` (prepass + INT8-QK attention kernel; ``qk_quant`` "int8" or "none") as one op:
    returns (out, lse); ``lse_shift``: the LSE is needed (K's smoothing mean put back into it)."""
    from .prefill import _flash_attn_func_eager

    return _flash_attn_func_eager(q, k, v, causal, softmax_scale, granularity, smooth_k, pv_dtype, qk_quant,
                                  balance_qk, (window_left, window_right), softcap, lse_shift)


@prefill_op.register_fake
def _(q, k, v, causal, softmax_scale, granularity, smooth_k, pv_dtype, qk_quant, balance_qk=False, window_left=-1,
      window_right=-1, softcap=0.0, lse_shift=True):
    B, Sq, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.custom_op("qattn::prefill_varlen", mutates_args=())
def prefill_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                      softmax_scale: float, granularity: str, smooth_k: bool,
                      qk_quant: str, balance_qk: bool = False, window_left: int = -1,
                      window_right: int = -1, pv_dtype: str = "bf16",
                      softcap: float = 0.0, lse_shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``qattn.flash_attn_varlen_func`` as one op: returns (out (total_q, Hq, D), lse (Hq, total_q))."""
    from .prefill import _flash_attn_varlen_func_eager

    return _flash_attn_varlen_func_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         softmax_scale, granularity, smooth_k, qk_quant, balance_qk,
                                         (window_left, window_right), pv_dtype, softcap, lse_shift)


@prefill_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, granularity,
      smooth_k, qk_quant, balance_qk=False, window_left=-1, window_right=-1, pv_dtype="bf16", softcap=0.0,
      lse_shift=True):
    Tq, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((Hq, Tq), dtype=torch.float32)


@torch.library.custom_op("qattn::flatten_kv", mutates_args=())
def flatten_kv_op(k_data: torch.Tensor, v_data: torch.Tensor, k_scale_pool: Optional[torch.Tensor],
                  v_scale_pool: Optional[torch.Tensor], k_global_scale: Optional[torch.Tensor],
                  v_global_scale: Optional[torch.Tensor], block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                  k_format: str, v_format: str, page_size: int, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qattn.flatten_kv`` as one op: (k, v) of shape (batch, max_seqlen, num_kv_heads, head_dim) bf16.
    ``max_seqlen`` sizes the output, so tracing never reads ``cache_seqlens`` on the host."""
    from .kv_cache_ops import _flatten_kv_eager

    cache = _view(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, None, None,
                  k_format, v_format, page_size, _head_dim(k_data, k_format), torch.bfloat16)
    return _flatten_kv_eager(cache, 0, block_table, cache_seqlens, max_seqlen)


@flatten_kv_op.register_fake
def _(k_data, v_data, k_scale_pool, v_scale_pool, k_global_scale, v_global_scale, block_table, cache_seqlens,
      k_format, v_format, page_size, max_seqlen):
    shape = (block_table.shape[0], max_seqlen, k_data.shape[1], _head_dim(k_data, k_format))
    return k_data.new_empty(shape, dtype=torch.bfloat16), k_data.new_empty(shape, dtype=torch.bfloat16)


def flatten_kv_traced(cache: PagedKVCache, layer: int, block_table, cache_seqlens, max_seqlen: int):
    lay = cache.layer(layer)
    return torch.ops.qattn.flatten_kv(lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                      lay.k_global_scale, lay.v_global_scale, block_table, cache_seqlens,
                                      format_str(cache.k_format), format_str(cache.v_format), cache.page_size,
                                      int_arg(max_seqlen, "max_seqlen"))


# --- the prefill prepass entry points (qattn.quant) ----------------------------------------------------------
# A custom op cannot return None: without smooth_k the k_mean slot is an empty tensor (so is qk_balance's
# without balance_qk), turned back into None / left out by the traced wrappers.
_QK = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _or_empty(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """An optional fp32 output as a custom op can return it (None -> an empty tensor)."""
    return t if t is not None else like.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("qattn::quantize_qk_int8", mutates_args=())
def quantize_qk_int8_op(q: torch.Tensor, k: torch.Tensor, granularity: str, smooth_k: bool, block_q: int,
                        warp_q: int, block_k: int, balance_qk: bool = False) -> _QK:
    from ..quant.launch import quantize_qk_int8

    qi, qs, ki, ks, km, *lam = quantize_qk_int8(q, k, granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                                                warp_q=warp_q, block_k=block_k, balance_qk=balance_qk)
    return qi, qs, ki, ks, _or_empty(km, q), _or_empty(lam[0] if lam else None, q)


@quantize_qk_int8_op.register_fake
def _(q, k, granularity, smooth_k, block_q, warp_q, block_k, balance_qk=False):
    from ..quant.qk_int8 import _num_groups

    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    f32 = torch.float32
    return (q.new_empty(q.shape, dtype=torch.int8), q.new_empty((B, Hq, _num_groups(Sq, granularity, block_q,
                                                                                    warp_q)[1]), dtype=f32),
            k.new_empty(k.shape, dtype=torch.int8), k.new_empty((B, Hkv, -(-Sk // block_k)), dtype=f32),
            k.new_empty((B, Hkv, D) if smooth_k else (0,), dtype=f32),
            k.new_empty((B, Hkv, D) if balance_qk else (0,), dtype=f32))


def quantize_qk_int8_traced(q, k, granularity, smooth_k, block_q, warp_q, block_k, balance_qk=False):
    qi, qs, ki, ks, km, lam = torch.ops.qattn.quantize_qk_int8(q, k, granularity, smooth_k, block_q, warp_q, block_k,
                                                               balance_qk)
    out = (qi, qs, ki, ks, (km if smooth_k else None))
    return out + (lam,) if balance_qk else out


@torch.library.custom_op("qattn::quantize_qk_int8_varlen", mutates_args=())
def quantize_qk_int8_varlen_op(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, granularity: str,
                               smooth_k: bool, block_q: int, warp_q: int, block_k: int,
                               balance_qk: bool = False) -> _QK:
    from ..quant.launch import quantize_qk_int8_varlen

    qi, qs, ki, ks, km, *lam = quantize_qk_int8_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                       granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                                                       warp_q=warp_q, block_k=block_k, balance_qk=balance_qk)
    return qi, qs, ki, ks, _or_empty(km, q), _or_empty(lam[0] if lam else None, q)


@quantize_qk_int8_varlen_op.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, granularity, smooth_k, block_q, warp_q,
      block_k, balance_qk=False):
    from ..quant.qk_int8 import _num_groups

    n = cu_seqlens_q.shape[0] - 1
    Hq, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    f32 = torch.float32
    return (q.new_empty(q.shape, dtype=torch.int8),
            q.new_empty((n, Hq, _num_groups(max_seqlen_q, granularity, block_q, warp_q)[1]), dtype=f32),
            k.new_empty(k.shape, dtype=torch.int8), k.new_empty((n, Hkv, -(-max_seqlen_k // block_k)), dtype=f32),
            k.new_empty((n, Hkv, D) if smooth_k else (0,), dtype=f32),
            k.new_empty((n, Hkv, D) if balance_qk else (0,), dtype=f32))


def quantize_qk_int8_varlen_traced(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, granularity,
                                   smooth_k, block_q, warp_q, block_k, balance_qk=False):
    qi, qs, ki, ks, km, lam = torch.ops.qattn.quantize_qk_int8_varlen(
        q, k, cu_seqlens_q, cu_seqlens_k, int_arg(max_seqlen_q, "max_seqlen_q"), int_arg(max_seqlen_k, "max_seqlen_k"),
        granularity, smooth_k, block_q,
        warp_q, block_k, balance_qk)
    out = (qi, qs, ki, ks, (km if smooth_k else None))
    return out + (lam,) if balance_qk else out


@torch.library.custom_op("qattn::quantize_v_fp8", mutates_args=())
def quantize_v_fp8_op(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ..quant.v_fp8 import quantize_v_fp8

    return quantize_v_fp8(v)


@quantize_v_fp8_op.register_fake
def _(v):
    from ..quant.v_fp8 import _padded

    B, Sk, H, D = v.shape
    return (v.new_empty((B, H, D, _padded(Sk)), dtype=torch.float8_e4m3fn),
            v.new_empty((B, H, D), dtype=torch.float32))


def quantize_v_fp8_traced(v):
    return torch.ops.qattn.quantize_v_fp8(v)


@torch.library.custom_op("qattn::quantize_v_fp8_varlen", mutates_args=())
def quantize_v_fp8_varlen_op(v: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..quant.v_fp8 import quantize_v_fp8_varlen

    return quantize_v_fp8_varlen(v, cu_seqlens_k, max_seqlen_k)


@quantize_v_fp8_varlen_op.register_fake
def _(v, cu_seqlens_k, max_seqlen_k):
    from ..quant.v_fp8 import varlen_vt_keys

    total, H, D = v.shape
    n = cu_seqlens_k.shape[0] - 1
    return (v.new_empty((H, D, varlen_vt_keys(total, n)), dtype=torch.float8_e4m3fn),
            v.new_empty((n, H, D), dtype=torch.float32))


def quantize_v_fp8_varlen_traced(v, cu_seqlens_k, max_seqlen_k: int):
    return torch.ops.qattn.quantize_v_fp8_varlen(v, cu_seqlens_k, int_arg(max_seqlen_k, "max_seqlen_k"))
