"""Reference (torch, CPU or GPU) writes into and reads out of a paged cache.

These define what the quantize-and-insert and flatten kernels must produce, byte for byte. They check
their inputs on the host (they are not on a hot path).
"""

from __future__ import annotations

import torch

from ..layouts.paged import PagedKVCache, read_sources
from ..quant.reference import dequantize, quantize
from ..quant.transforms import RoPE, apply_rope, transform_kv


def _check_int_vector(t, n: int | None, name: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t.long()


def _check_kv(k, v, cache: PagedKVCache) -> None:
    for t, name in ((k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if t.dim() != 3 or t.shape[1:] != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"{name}: expected shape (num_tokens, {cache.num_kv_heads}, {cache.head_dim}), "
                             f"got {tuple(t.shape)}")
        if t.device != cache.device:
            raise ValueError(f"{name}: expected device {cache.device}, got {t.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"v: {v.shape[0]} tokens but k has {k.shape[0]}")


def write_kv_reference(
    cache: PagedKVCache,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    seq_slots: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rope: RoPE | None = None,
    k_mean: torch.Tensor | None = None,
) -> None:
    """Quantize ``k``, ``v`` (num_tokens, num_kv_heads, head_dim) and store them in their slots.

    Before quantization the insert transforms run in fp32, in this order (``qattn.quant.transforms.transform_kv``):
    RoPE on K (``rope``, a :class:`qattn.RoPE`, at ``positions``), minus ``k_mean`` (num_kv_heads, head_dim) fp32
    on K, and the cache's Hadamard rotation on K and V (``cache.rotate``). The ring, too, receives the
    transformed rows (rounded to the cache's dtype): exactly what decode reads, so decode needs no special case.

    ``slot_mapping[t] = block * page_size + offset``; -1 skips the token (padding). Slots must be distinct.
    For a cache with a recent-token window or sink tokens, ``seq_slots[t]`` (ring / sink slot of the token's
    sequence) and ``positions[t]`` (its position in the sequence) are required. With a window the token is also
    written, unquantized, to ``ring[seq_slot, :, position % window]``; when several tokens of one call land on
    one ring entry, the one with the largest position stays. With ``sink_tokens = N``, a token at position
    ``< N`` is also written, unquantized, to ``sink[seq_slot, :, position]`` (and still to its page and the ring).
    """
    lay = cache.layer(layer)
    _check_kv(k, v, cache)
    n = k.shape[0]
    slots = _check_int_vector(slot_mapping, n, "slot_mapping", cache.device)
    capacity = cache.num_blocks * cache.page_size
    bad = (slots < -1) | (slots >= capacity)
    if bool(bad.any()):
        raise ValueError(f"slot_mapping: values must be -1 or in [0, {capacity}), got {int(slots[bad][0])}")
    keep = slots >= 0
    kept = slots[keep]
    if kept.numel() != torch.unique(kept).numel():
        raise ValueError("slot_mapping: the same slot appears twice")
    blk, off = kept // cache.page_size, kept % cache.page_size
    if rope is not None and positions is None:
        raise ValueError("positions: RoPE needs each token's position")
    if k_mean is not None:
        if not isinstance(k_mean, torch.Tensor) or k_mean.dtype != torch.float32:
            raise TypeError("k_mean: expected a float32 torch.Tensor")
        if tuple(k_mean.shape) != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"k_mean: expected shape ({cache.num_kv_heads}, {cache.head_dim}), "
                             f"got {tuple(k_mean.shape)}")
    pos_all = None if positions is None else _check_int_vector(positions, n, "positions", cache.device)
    if rope is not None:  # skipped tokens' positions are never read
        rope = rope.to(cache.device)
        k = apply_rope(k.float(), torch.where(keep, pos_all, 0), rope)
    k, v = transform_kv(k, v, k_mean=k_mean, rotation_signs=cache.rotation_signs)

    for x, fmt, data, scale_pool, gscale in (
        (k, cache.k_format, lay.k_data, lay.k_scale_pool, lay.k_global_scale),
        (v, cache.v_format, lay.v_data, lay.v_scale_pool, lay.v_global_scale),
    ):
        payload, scales = quantize(x[keep], fmt, gscale)
        # data is (blocks, heads, page, row); [blk, :, off] addresses (tokens, heads, row).
        data[blk, :, off] = payload
        if scale_pool is not None:
            scale_pool[blk, :, off] = scales
    if k_mean is not None:
        cache.k_smoothed = True  # as write_kv: a soft-capped decode then refuses the cache

    if cache.recent_window or cache.sink_tokens:
        seqs, pos = _seq_positions(cache, k.shape[0], keep, seq_slots, positions)
        if cache.recent_window:
            _write_ring(cache, lay, k[keep], v[keep], seqs, pos)
        if cache.sink_tokens:
            _write_sink(cache, lay, k[keep], v[keep], seqs, pos)
    elif seq_slots is not None:
        raise ValueError("seq_slots: the cache has no recent window and no sink tokens; pass no seq_slots")
    elif positions is not None and rope is None:
        raise ValueError("positions: the cache has no recent window, no sink tokens and no RoPE is applied; "
                         "pass no positions")


def _seq_positions(cache: PagedKVCache, n: int, keep, seq_slots, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens' (seq_slot, position), validated: what the ring and the sink are indexed by."""
    if seq_slots is None or positions is None:
        what = "a recent window" if cache.recent_window else f"sink_tokens={cache.sink_tokens}"
        raise ValueError(f"seq_slots: a cache with {what} needs seq_slots and positions")
    seqs = _check_int_vector(seq_slots, n, "seq_slots", cache.device)[keep]
    pos = _check_int_vector(positions, n, "positions", cache.device)[keep]
    if bool(((seqs < 0) | (seqs >= cache.max_seqs)).any()):
        raise ValueError(f"seq_slots: values must be in [0, {cache.max_seqs})")
    if bool((pos < 0).any()):
        raise ValueError("positions: values must be >= 0")
    token_key = seqs * (int(pos.max()) + 1 if pos.numel() else 1) + pos
    if token_key.numel() != torch.unique(token_key).numel():
        raise ValueError("positions: the same (seq_slot, position) appears twice")
    return seqs, pos


def _write_sink(cache: PagedKVCache, lay, k, v, seqs, pos) -> None:
    """Tokens at positions < sink_tokens into sink[seq_slot, :, position] (each entry is hit at most once)."""
    first = pos < cache.sink_tokens
    lay.k_sink[seqs[first], :, pos[first]] = k[first].to(cache.dtype)
    lay.v_sink[seqs[first], :, pos[first]] = v[first].to(cache.dtype)


def _write_ring(cache: PagedKVCache, lay, k, v, seqs, pos) -> None:
    """Kept tokens (already filtered) into ring[seq_slot, :, position % W]."""
    W = cache.recent_window
    entry = seqs * W + pos % W
    # Keep, per ring entry, the token with the largest position.
    newest = torch.full((cache.max_seqs * W,), -1, dtype=torch.long, device=cache.device)
    newest.scatter_reduce_(0, entry, pos, reduce="amax")
    win = pos == newest[entry]
    kk, vv = k[win], v[win]
    lay.k_ring[seqs[win], :, pos[win] % W] = kk.to(cache.dtype)
    lay.v_ring[seqs[win], :, pos[win] % W] = vv.to(cache.dtype)


def check_block_table(cache: PagedKVCache, block_table, cache_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a (batch, max_blocks) int32 block table and (batch,) int32 lengths against the cache."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table: expected a 2-d tensor (batch, max_blocks)")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
    B = block_table.shape[0]
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise TypeError("cache_seqlens: expected a torch.int32 tensor")
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens: expected shape ({B},), got {tuple(cache_seqlens.shape)}")
    lens = cache_seqlens.long()
    if bool((lens < 0).any()):
        raise ValueError("cache_seqlens: values must be >= 0")
    cap = block_table.shape[1] * cache.page_size
    if bool((lens > cap).any()):
        raise ValueError(f"cache_seqlens: a length exceeds the block table's capacity ({cap} tokens)")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * cache.page_size < lens[:, None]
    ids = block_table.long()[used]
    if bool(((ids < 0) | (ids >= cache.num_blocks)).any()):
        raise ValueError(f"block_table: a used entry is outside [0, {cache.num_blocks})")
    return block_table.long(), lens


def flatten_kv_reference(
    cache: PagedKVCache,
    layer: int,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    seq_slots: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V, each (batch, max_len, num_kv_heads, head_dim) in ``dtype``, zero past each length.

    Values are decoded from the quantized pages. With ``seq_slots`` (a cache with a recent window or sink
    tokens), positions come from the source attention reads them from (``qattn.layouts.paged.read_sources``):
    the first ``min(sink_tokens, len)`` from the sink buffer, ``[max(sink_tokens, len - W), len)`` from the ring,
    the rest from the pages. Without ``seq_slots`` every position is decoded from its page.
    """
    lay = cache.layer(layer)
    table, lens = check_block_table(cache, block_table, cache_seqlens)
    B = table.shape[0]
    max_len = int(lens.max()) if B else 0
    P = cache.page_size
    pos = torch.arange(max_len, device=table.device)
    valid = pos[None, :] < lens[:, None]  # (B, max_len)
    blk = table.gather(1, (pos // P)[None, :].expand(B, -1).clamp(max=table.shape[1] - 1))
    blk = torch.where(valid, blk, 0)
    off = (pos % P)[None, :].expand(B, -1)
    out = []
    for fmt, data, scale_pool, gscale, ring, sink in (
        (cache.k_format, lay.k_data, lay.k_scale_pool, lay.k_global_scale, lay.k_ring, lay.k_sink),
        (cache.v_format, lay.v_data, lay.v_scale_pool, lay.v_global_scale, lay.v_ring, lay.v_sink),
    ):
        payload = data[blk, :, off]  # (B, max_len, H, row)
        scales = None if scale_pool is None else scale_pool[blk, :, off]
        x = dequantize(payload, scales, fmt, gscale, dtype=torch.float32)
        if seq_slots is not None:
            x = _overlay_unquantized(cache, ring, sink, x, lens, seq_slots)
        out.append(torch.where(valid[:, :, None, None], x, 0.0).to(dtype))
    return out[0], out[1]


def _overlay_unquantized(cache: PagedKVCache, ring, sink, x, lens, seq_slots) -> torch.Tensor:
    """Replace the decoded pages ``x`` (B, max_len, H, D) by the ring / sink rows where attention reads those
    (``read_sources``: positions < N from the sink, ``[max(N, len - W), len)`` from the ring)."""
    if not (cache.recent_window or cache.sink_tokens):
        raise ValueError("seq_slots: the cache has no recent window and no sink tokens")
    B, max_len = x.shape[0], x.shape[1]
    seqs = _check_int_vector(seq_slots, B, "seq_slots", cache.device)
    if bool(((seqs < 0) | (seqs >= cache.max_seqs)).any()):
        raise ValueError(f"seq_slots: values must be in [0, {cache.max_seqs})")
    W, N = cache.recent_window, cache.sink_tokens
    pos = torch.arange(max_len, device=x.device)[None, :].expand(B, -1)
    seq_idx = seqs[:, None].expand(B, max_len)
    live = pos < lens[:, None]
    if W:
        recent = (pos >= torch.clamp(lens[:, None] - W, min=N)) & live
        from_ring = ring[seq_idx, :, pos % W].float()  # (B, max_len, H, D)
        x = torch.where(recent[:, :, None, None], from_ring, x)
    if N:
        first = (pos < N) & live
        from_sink = sink[seq_idx, :, pos.clamp(max=N - 1)].float()
        x = torch.where(first[:, :, None, None], from_sink, x)
    return x
