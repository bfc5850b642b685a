"""SM100 launcher of ``flash_attn_with_kvcache`` (reached through the dispatch hook in ``decode.py`` on compute
capability 10.0). NEVER RAN ON HARDWARE: no Blackwell GPU was available; the kernel is compile-checked for
sm_100a and emulated on the CPU (``qattn.cute_kernels.sm100.emulate``).

The caller's arguments were validated by ``decode.py`` already; this adds the SM100 kernel's own limits (FP4
K and V, no recent-token ring yet, rows <= 128), quantizes Q (``q_prepass``, torch), and launches the decode
kernel (+ ``combine.py`` for split-KV) from the shared compile cache with arch "sm_100a".
"""

from __future__ import annotations

import torch

from .variants import cache_for
from .window import score_scale, softmax_scale_value

__all__ = ["flash_attn_with_kvcache_sm100", "sm100_config_for"]

_NUM_SMS: dict = {}


def sm100_config_for(cache, q_dtype: str, group: int, seqlen_q: int, causal: bool, split: bool,
                     window: bool = False, softcap: float = 0.0):
    """The :class:`DecodeConfigSm100` the launcher uses (``causal`` / ``window``: the flags of
    ``qattn.interface.window.resolve_window`` for the call; ``softcap``: 0.0 or the call's cap)."""
    from ..cute_kernels.sm100.decode_config import DecodeConfigSm100, check_rows

    if cache.recent_window:
        raise ValueError("cache: the SM100 decode kernel does not read the recent-token ring yet (recent_window > 0)")
    if cache.sink_tokens:
        raise ValueError("cache: the SM100 decode kernel does not read the sink buffer yet (sink_tokens > 0)")
    check_rows(seqlen_q, group)
    return DecodeConfigSm100(cache.k_format, cache.v_format, cache.head_dim, q_dtype, group, cache.page_size,
                             bool(causal), bool(split), window=bool(window), softcap=softcap)


def flash_attn_with_kvcache_sm100(q, cache, cache_seqlens, block_table, *, seq_slots=None, layer=0,
                                  softmax_scale=None, window, num_splits=0, return_lse=False, out=None,
                                  softcap: float = 0.0):
    """``window``: the call's :class:`qattn.interface.window.Window` (``decode.py`` resolved it); ``softcap``: the
    call's validated cap (0.0: off)."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64

    from ..cute_kernels.combine import CombineSplits, combine_cache_key, combine_compile_args
    from ..cute_kernels.compile_utils import compile_for_arch
    from ..cute_kernels.sm100.decode import DecodeSm100, decode_sm100_cache_key, decode_sm100_compile_args
    from ..cute_kernels.sm100.q_prepass import quantize_q
    from ..cute_kernels.sm90.decode_config import num_splits_heuristic

    B, Sq, Hq, D = q.shape
    H = cache.num_kv_heads
    group = Hq // H
    qd = "bf16" if q.dtype == torch.bfloat16 else "f16"
    dev = q.device
    if num_splits == 0:
        if dev not in _NUM_SMS:
            _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
        context = window.keys_read(block_table.shape[1] * cache.page_size, Sq, 128)
        num_splits = num_splits_heuristic(B, H, context, _NUM_SMS[dev], tile_n=128)
    split = num_splits > 1
    cfg = sm100_config_for(cache, qd, group, Sq, window.causal, split, window.local, softcap)
    arch = "sm_100a"
    kern = cache_for("decode").get(decode_sm100_cache_key(arch, cfg), lambda: compile_for_arch(
        DecodeSm100(cfg), *decode_sm100_compile_args(), arch=arch, keep_ptx=False)[0])
    softmax_scale = softmax_scale_value(softmax_scale, D)  # decode.py's rule (it resolved it already)
    q_data, q_sf, q_rs = quantize_q(q, H, cache.k_format, cfg.q_terms)
    lay = cache.layer(layer)
    if out is None:  # contiguous whatever q's strides: the kernel and the combine write (B, Sq, Hq, D) rows
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=dev)

    def addr(t):
        return Int64(0 if t is None else t.data_ptr())

    with torch.cuda.device(dev):
        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        if split:
            o_dst = torch.empty((num_splits, B, Sq, Hq, D), dtype=torch.float32, device=dev)
            l_dst = torch.empty((num_splits, B, Hq, Sq), dtype=torch.float32, device=dev)
        else:
            o_dst, l_dst = out, lse
        kern(addr(q_data), addr(q_sf), addr(q_rs), addr(lay.k_data), addr(lay.k_scale_pool),
             addr(lay.k_global_scale), addr(lay.v_data), addr(lay.v_scale_pool), addr(lay.v_global_scale),
             addr(block_table.contiguous()), addr(cache_seqlens), addr(o_dst), addr(l_dst),
             Int32(B), Int32(Sq), Int32(H), Int32(block_table.shape[1]), Int32(cache.num_blocks), Int32(num_splits),
             Float32(score_scale(softmax_scale, softcap)),
             *(Int32(e) for e in window.edges), stream)
        if split:
            comb = CombineSplits(D, qd)
            ck = cache_for("combine").get(combine_cache_key(arch, comb), lambda: compile_for_arch(
                comb, *combine_compile_args(), arch=arch, keep_ptx=False)[0])
            ck(addr(o_dst), addr(l_dst), addr(out), addr(lse), Int32(B), Int32(Sq), Int32(Hq), Int32(num_splits),
               stream)
    return (out, lse) if return_lse else out
