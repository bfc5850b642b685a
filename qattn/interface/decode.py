"""``flash_attn_with_kvcache``: paged decode attention over a quantized :class:`PagedKVCache` (SM90).

A thin launcher: it validates on the host (shapes, dtypes, devices, geometry: never device *values*, so there is
no host sync and a step can be captured in a CUDA graph), picks a compiled kernel from the shared compile cache keyed
by everything that changes the code, and launches on torch's current stream. There is no fallback: an unsupported
case raises a ``ValueError`` / ``TypeError`` naming the argument.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..cute_kernels.config_values import MAX_GRID_YZ
from ..layouts.paged import PagedKVCache
from ..quant.transforms import rotate_query_dense, unrotate_output_dense
from .torch_ops import paged_decode_traced  # registers the custom ops
from .fast_launch import fast, on_device, stream_handle
from .launch_plan import Planner, cache_signature, layer_tensors, signature_key
from .variants import cache_for, kernel_arch
from .window import (check_forward_only, resolve_window, score_scale, softcap_value as _softcap, softmax_scale_value,
                     window_ints)

__all__ = ["flash_attn_with_kvcache", "decode_compile_args", "decode_config_for", "decode_cache_key"]

_NUM_SMS: dict = {}
_MAX_SEQLEN_Q = 16
_MAX_ROWS = 256  # seqlen_q * GQA ratio (decode_config.MAX_ROWS; not imported here to keep cutlass out)


def _dtype_name(dt: torch.dtype) -> str:
    return "bf16" if dt == torch.bfloat16 else "f16"


def _tile_n(cache: PagedKVCache) -> int:
    """Tokens per page tile (``QATTN_DECODE_TILE_N`` is read once per process: ``tuning_from_env``)."""
    from ..cute_kernels.sm90.decode_config import tile_n_for

    return tile_n_for(cache.k_format, cache.v_format)


def decode_config_for(cache: PagedKVCache, q_dtype: str, group: int, seqlen_q: int, causal: bool, split: bool,
                      window: bool = False, softcap: float = 0.0):
    """The :class:`DecodeConfig` a call with these parameters uses (``decode_config.choose_config``, which
    ``qattn-warmup`` uses too)."""
    from ..cute_kernels.sm90.decode_config import choose_config

    return choose_config(cache.k_format, cache.v_format, cache.head_dim, cache.page_size, q_dtype, group,
                         seqlen_q, causal, split, ring_window=cache.recent_window,
                         ring_dtype=_dtype_name(cache.dtype), sink_tokens=cache.sink_tokens, window=window,
                         softcap=softcap)


def decode_cache_key(arch: str, cfg) -> tuple:
    """The compile-cache key of a decode variant (the runtime's and the warm-up's)."""
    from ..cute_kernels.sm90.decode import decode_cache_key as key

    return key(arch, cfg)


def decode_compile_args():
    """Placeholder arguments (fake addresses, fake stream) to compile a decode kernel without a GPU."""
    from ..cute_kernels.sm90.decode import decode_compile_args as args

    return args()


def combine_compile_args():
    from ..cute_kernels.combine import combine_compile_args as args

    return args()


def _check_arch(device: torch.device) -> str:
    return kernel_arch(device, "decode")  # 10.0: the SM100 dispatch hook -> decode_sm100.py


def _tcgen05_takes(cache: PagedKVCache, q_dtype: str, group: int, seqlen_q: int) -> bool:
    """On SM100: whether the call runs the block-scaled tcgen05 kernel (FP4 pages, no ring or sink, <= 128 rows;
    ``sm100.decode_config.tcgen05_takes``) rather than the portable mma.sync kernel compiled for sm_100a."""
    from ..cute_kernels.sm100.decode_config import tcgen05_takes

    return tcgen05_takes(cache.k_format, cache.v_format, cache.head_dim, cache.page_size, q_dtype, group, seqlen_q,
                         cache.recent_window, cache.sink_tokens)


def _get(kind: str, key: tuple, build, args):
    """The compiled kernel for ``key`` (arch first) from the shared compile cache: in memory, else on disk,
    else compiled now and exported for the next process."""
    from ..cute_kernels.compile_utils import compile_for_arch

    return cache_for(kind).get(key, lambda: compile_for_arch(build(), *args, arch=key[0], keep_ptx=False)[0])


def _check_vec(t, name: str, n: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if n > 1 and t.stride(0) != 1:  # the kernel reads it by address
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}")


def _check_seq_slots(cache: PagedKVCache, seq_slots, batch: int, device) -> None:
    """``seq_slots`` is required exactly when the cache keeps a recent-token window or sink tokens."""
    if cache.recent_window or cache.sink_tokens:
        if seq_slots is None:
            what = (f"its newest {cache.recent_window} tokens per sequence in a ring" if cache.recent_window
                    else f"the first {cache.sink_tokens} tokens per sequence in a sink buffer")
            raise ValueError(f"seq_slots: the cache keeps {what}; pass seq_slots ({batch},) int32, the ring / sink "
                             "slot of each batch row")
        _check_vec(seq_slots, "seq_slots", batch, device)
    elif seq_slots is not None:
        raise ValueError("seq_slots: the cache has no recent-token window and no sink tokens (recent_window=0, "
                         "sink_tokens=0); pass None")


def _check_q(q, cache) -> None:
    """q a 4-d bf16 / fp16 tensor with the cache's head_dim (checked before a rotated cache rotates it)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q: expected shape (batch, seqlen_q, num_heads, head_dim), got {tuple(q.shape)}")
    if q.shape[3] != cache.head_dim:
        raise ValueError(f"q: head_dim {q.shape[3]} does not match the cache's {cache.head_dim}")


def _check_out(out, q) -> None:
    """The caller's ``out``: None, or a contiguous tensor of q's dtype, shape and device."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype != q.dtype:
        raise TypeError(f"out: expected dtype {q.dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(q.shape) or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {tuple(q.shape)} tensor on {q.device}")


def _flash_attn_with_kvcache_eager(
    q: torch.Tensor,
    cache: PagedKVCache,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    seq_slots: Optional[torch.Tensor] = None,
    layer: int = 0,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
    num_splits: int = 0,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    """Attention of ``q`` (batch, seqlen_q, num_heads, head_dim) over the paged cache, FlashAttention style, but
    over the quantized cache object instead of ``k_cache`` / ``v_cache``: new tokens go in by ``write_kv`` first
    (no ``k`` / ``v`` / rotary arguments); FlashAttention's ``return_softmax_lse`` is ``return_lse``.

    ``cache_seqlens`` (batch,) int32 and ``block_table`` (batch, max_blocks) int32 live on q's device: token t of
    sequence b is in block ``block_table[b, t // page_size]``. ``causal`` (True by default, unlike FlashAttention's
    False; the same for seqlen_q 1): the mask is aligned to the end of the cache (query i sees keys j <= i + len -
    seqlen_q; a row that sees no key gives 0 and LSE -inf). ``window_size=(left, right)``: FlashAttention's sliding
    window, query i sees keys i + len - seqlen_q - left <= j <= i + len - seqlen_q + right (-1: unbounded; causal: right
    0); the page tiles (and ring rows) left of the window are not read.
    ``num_splits`` = 0 picks the split-KV count from host-known sizes. ``softcap > 0``: FlashAttention's logit
    soft-capping, scores z become softcap * tanh(z / softcap) (not on a cache whose K was smoothed by
    ``write_kv(k_mean=...)``, since the cap is not invariant to the shift smoothing takes out: a ValueError).
    seqlen_q is 1..16 and seqlen_q x (num_heads / num_kv_heads) at most 256.

    Kernels: on SM90 the mma.sync kernel (``cute_kernels/sm90/decode.py``). On SM100 (compute capability 10.0;
    compile-checked only, no Blackwell GPU was available) FP4 K and V pages without a ring or sink, at most 128
    query rows per kv head, run the block-scaled tcgen05 kernel (``cute_kernels/sm100/decode.py``, emulated on the
    CPU); every other call runs the same mma.sync kernel as SM90, compiled for sm_100a.

    Caches with a recent-token window W need ``seq_slots`` (batch,) int32, the ring slot of each batch row: the
    newest min(len, W) positions of sequence b are read from ``ring[seq_slots[b], :, position % W]`` (bf16 /
    f16), older ones from the quantized pages, in the same launch (as ``paged_decode_reference``). Caches with
    ``sink_tokens`` N need ``seq_slots`` too: positions below N are read from ``sink[seq_slots[b], :, position]``
    and the ring then covers ``[max(N, len - W), len)`` (``qattn.layouts.paged.read_sources``). Ring / sink slots
    are clamped to [0, max_seqs) on the device, like block ids.
    Returns ``out`` (batch, seqlen_q, num_heads, head_dim) in q's dtype, and with ``return_lse`` also the
    natural-log LSE (batch, num_heads, seqlen_q) fp32.

    Block ids and lengths are not read on the host (that would sync); the kernel clamps block ids to the pool and
    table columns to the table's row, so a bad table, or a ``cache_seqlens`` entry past what its row covers, gives
    wrong numbers, never an out-of-bounds access.
    """
    # ---- validation (host-known facts only) ----
    _check_q(q, cache)
    B, Sq, Hq, D = q.shape
    H = cache.num_kv_heads
    if D not in (64, 128):
        raise ValueError(f"head_dim: {D} is not supported by the SM90 decode kernel (64 or 128)")
    if B < 1 or Hq < 1:
        raise ValueError(f"q: batch ({B}) and num_heads ({Hq}) must be >= 1")
    if B > MAX_GRID_YZ:  # the decode grid's z
        raise ValueError(f"q: at most {MAX_GRID_YZ} sequences per call (grid limit), got {B}")
    if Hq % H:
        raise ValueError(f"q: {Hq} query heads is not a multiple of the cache's {H} kv heads")
    group = Hq // H
    if not 1 <= Sq <= _MAX_SEQLEN_Q:
        raise ValueError(f"q: seqlen_q must be in [1, {_MAX_SEQLEN_Q}], got {Sq}")
    if Sq * group > _MAX_ROWS:
        raise ValueError(f"q: seqlen_q * (num_heads / num_kv_heads) = {Sq} * {group} exceeds {_MAX_ROWS} query rows "
                         "per kv head (the decode kernel's limit: e.g. seqlen_q 16 with GQA 16)")
    if cache.device != q.device:
        raise ValueError(f"cache: on {cache.device}, q on {q.device}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer: expected an int in [0, {cache.num_layers}), got {layer!r}")
    _check_vec(cache_seqlens, "cache_seqlens", B, q.device)
    _check_seq_slots(cache, seq_slots, B, q.device)
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: expected a torch.Tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape ({B}, max_blocks >= 1), got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table: expected device {q.device}, got {block_table.device}")
    softmax_scale = softmax_scale_value(softmax_scale, D)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    max_len = block_table.shape[1] * cache.page_size  # a sequence's keys fit its row of the block table
    window = resolve_window(window_size, causal, Sq, max_len)
    softcap = _softcap(softcap)
    score_scale(softmax_scale, softcap)  # the kernels' fp32 score scale, checked before any launch
    if q.numel() >= 2**31 // max(1, num_splits or 1):
        raise ValueError("q: too large for the kernel's 32-bit indexing; split the batch")
    _check_out(out, q)
    if not q.is_cuda:  # the last check (shapes, dtypes and options first, also on the CPU)
        raise ValueError(f"q: expected a CUDA tensor, got device {q.device} (flash_attn_with_kvcache runs on the GPU; "
                         "its fp64 CPU reference is qattn.reference.paged_decode_reference)")
    arch = _check_arch(q.device)
    if arch == "sm_100a" and _tcgen05_takes(cache, _dtype_name(q.dtype), group, Sq):  # SM100 dispatch (issue 6)
        from .decode_sm100 import flash_attn_with_kvcache_sm100

        return flash_attn_with_kvcache_sm100(q, cache, cache_seqlens, block_table, seq_slots=seq_slots, layer=layer,
                                             softmax_scale=softmax_scale, window=window, num_splits=num_splits,
                                             return_lse=return_lse, out=out, softcap=softcap)

    # SM90, and on SM100 every cache the tcgen05 kernel does not take: the portable mma.sync kernel, compiled for
    # the device's arch
    from ..cute_kernels.sm90.decode_config import num_splits_heuristic

    dev = q.device
    if num_splits == 0:
        if dev not in _NUM_SMS:
            _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        num_splits = num_splits_heuristic(B, H, window.keys_read(max_len, Sq, _tile_n(cache)), _NUM_SMS[dev],
                                          tile_n=_tile_n(cache))
    split = num_splits > 1
    kern, comb = _kernels(arch, cache, _dtype_name(q.dtype), group, Sq, window.causal, split, window.local, softcap)

    q = q.contiguous()
    block_table = block_table.contiguous()
    lay = cache.layer(layer)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)

    def addr(t):
        return 0 if t is None else t.data_ptr()

    with on_device(dev):
        stream = stream_handle(dev)
        if split:
            o_part = torch.empty((num_splits, B, Sq, Hq, D), dtype=torch.float32, device=dev)
            l_part = torch.empty((num_splits, B, Hq, Sq), dtype=torch.float32, device=dev)
            o_dst, l_dst = o_part, l_part
        else:
            o_dst, l_dst = out, lse
        fast(kern)(addr(q), addr(lay.k_data), addr(lay.k_scale_pool), addr(lay.k_global_scale),
                   addr(lay.v_data), addr(lay.v_scale_pool), addr(lay.v_global_scale),
                   addr(block_table), addr(cache_seqlens), addr(o_dst), addr(l_dst),
                   addr(lay.k_ring), addr(lay.v_ring), addr(seq_slots), addr(lay.k_sink), addr(lay.v_sink),
                   B, Sq, H, block_table.shape[1], cache.num_blocks, num_splits, max(cache.max_seqs, 1),
                   score_scale(softmax_scale, softcap), *window.edges, stream)
        if split:
            fast(comb)(addr(o_part), addr(l_part), addr(out), addr(lse), B, Sq, Hq, num_splits, stream)
    return (out, lse) if return_lse else out


_KERNELS: dict = {}


def _kernels(arch: str, cache: PagedKVCache, qd: str, group: int, seqlen_q: int, causal: bool, split: bool,
             window: bool = False, softcap: float = 0.0):
    """(decode kernel, combine kernel or None) of a call, memoized on the host-known facts that choose them so
    that a repeated call skips building its config and cache keys (the eager launch cost)."""
    from ..cute_kernels.sm90.decode_config import tuning_from_env

    memo_key = (arch, cache.k_format, cache.v_format, cache.head_dim, cache.page_size, cache.recent_window,
                cache.sink_tokens, cache.dtype, qd, group, seqlen_q, bool(causal), split, window, softcap,
                tuning_from_env())
    hit = _KERNELS.get(memo_key)
    if hit is not None:
        return hit
    from ..cute_kernels.combine import CombineSplits, combine_cache_key
    from ..cute_kernels.sm90.decode import DecodeSm90

    cfg = decode_config_for(cache, qd, group, seqlen_q, causal, split, window, softcap)
    kern = _get("decode", decode_cache_key(arch, cfg), lambda: DecodeSm90(cfg), decode_compile_args())
    ck = None
    if split:
        comb = CombineSplits(cache.head_dim, qd)
        ck = _get("combine", combine_cache_key(arch, comb), lambda: comb, combine_compile_args())
    _KERNELS[memo_key] = (kern, ck)
    return kern, ck


def flash_attn_with_kvcache(
    q: torch.Tensor,
    cache: PagedKVCache,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    seq_slots: Optional[torch.Tensor] = None,
    layer: int = 0,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
    num_splits: int = 0,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
):
    softcap = _softcap(softcap)
    if softcap and isinstance(cache, PagedKVCache) and cache.k_smoothed:
        raise ValueError("softcap: this cache's K was smoothed (write_kv(k_mean=...)); soft-capping is not invariant "
                         "to the per-row shift q . k_mean that smoothing takes out of the scores, so a smoothed cache "
                         "cannot be read with a softcap")
    # A rotated cache (cache.rotate) holds K R and V R: attend with q R, then map the output back by R^T (one fp32
    # matrix product each way with the cache's dense R).
    check_forward_only(q)
    rot = cache.rotation_matrix if isinstance(cache, PagedKVCache) else None
    final_out = out
    if rot is not None:  # q and out checked first: the rotation would take (or broadcast into) wrong shapes
        _check_q(q, cache)
        _check_out(out, q)
        q, out = rotate_query_dense(q, rot), None
    if torch.compiler.is_compiling():  # torch.compile traces the registered custom op (no graph break)
        res = paged_decode_traced(q, cache, cache_seqlens, block_table, layer, softmax_scale, causal, num_splits,
                                  return_lse, out, seq_slots=seq_slots, window_size=window_ints(window_size),
                                  softcap=softcap)
    else:
        res = _eager_planned(q, cache, cache_seqlens, block_table, seq_slots, layer, softmax_scale, causal, num_splits,
                             return_lse, out, window_size, softcap)
    if rot is None:
        return res
    o, lse = res if return_lse else (res, None)
    o = unrotate_output_dense(o, rot, final_out)
    return (o, lse) if return_lse else o


_DECODE_PLANS = Planner()


def _eager_planned(q, cache, cache_seqlens, block_table, seq_slots, layer, softmax_scale, causal, num_splits,
                   return_lse, out, window_size, softcap=0.0):
    """The eager call, through the launch plan of its signature when there is one (``launch_plan``: the layer is
    not part of the signature, its tensors are plan inputs)."""
    from ..cute_kernels.sm90.decode_config import tuning_from_env

    key = None
    if isinstance(cache, PagedKVCache) and type(layer) is int and 0 <= layer < cache.num_layers:
        tensors = (q, cache_seqlens, block_table, seq_slots, out)
        key = signature_key(tensors, (cache_signature(cache), softmax_scale, causal, num_splits, window_size,
                                      softcap, tuning_from_env()))
    if key is None:
        return _flash_attn_with_kvcache_eager(q, cache, cache_seqlens, block_table, seq_slots=seq_slots, layer=layer,
                                              softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                                              return_lse=return_lse, out=out, window_size=window_size,
                                              softcap=softcap)
    o, lse = _DECODE_PLANS.call(
        key, tensors + layer_tensors(cache.layer(layer)),
        lambda: _flash_attn_with_kvcache_eager(q, cache, cache_seqlens, block_table, seq_slots=seq_slots, layer=layer,
                                               softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
                                               return_lse=True, out=out, window_size=window_size, softcap=softcap),
        keyed=len(tensors))
    return (o, lse) if return_lse else o


flash_attn_with_kvcache.__doc__ = _flash_attn_with_kvcache_eager.__doc__ + """
    On a cache built with ``rotate=True`` (K and V stored rotated), q is rotated first and the output rotated
    back, each by one fp32 matrix product with ``cache.rotation_matrix`` (``qattn.quant.transforms.
    rotate_query_dense`` / ``unrotate_output_dense``; the butterfly references are ``rotate_query`` /
    ``unrotate_output``): the result is attention of the caller's q over the unrotated K, V, up to quantization
    error; the LSE is unchanged.
    """
