"""Torch entry points of the cache kernels: ``write_kv`` (fused quantize-and-insert), ``flatten_kv`` (paged ->
dense bf16) and ``inspect_kv`` (a host-side probe of one token).

Every launch goes on torch's current stream and never synchronises the host: shape / dtype / device checks
always run (they read only metadata); checks of *values* (slot ranges, duplicate slots, ring preconditions,
NaN) need the data on the host and run only with ``check=True``.
"""

from __future__ import annotations

import torch

from ..layouts.paged import PagedKVCache
from ..quant.transforms import RoPE
from .fast_launch import contiguous16, kernel_view, on_device
from .launch_plan import Planner, cache_signature, layer_tensors, signature_key
from .torch_ops import write_kv_traced  # registers the custom ops

__all__ = ["write_kv", "flatten_kv", "inspect_kv"]

_MAX_I32 = 2**31 - 1


def _norm(d: torch.device) -> torch.device:
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _tensor(t, name: str, dtypes, device, shape=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if _norm(t.device) != _norm(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def insert_config_for(cache: PagedKVCache, k_dtype: torch.dtype, rope: RoPE | None = None, smooth: bool = False):
    """The :class:`~qattn.cute_kernels.kv_insert.KVInsert` variant ``write_kv`` launches for this cache, input
    dtype and transforms (``qattn-warmup`` enumerates the same configurations)."""
    from ..cute_kernels import kv_insert

    return kv_insert.KVInsert(cache.k_format, cache.v_format, cache.head_dim, in_bf16=k_dtype == torch.bfloat16,
                              ring=bool(cache.recent_window), ring_bf16=cache.dtype == torch.bfloat16,
                              rope_style=None if rope is None else rope.style,
                              rotary_dim=0 if rope is None else rope.rotary_dim,
                              smooth=smooth, rotate=cache.rotate, sink_tokens=cache.sink_tokens)


def _write_kv_eager(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
             seq_slots: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             rope: RoPE | None = None, k_mean: torch.Tensor | None = None, check: bool = False) -> None:
    """Quantize ``k``, ``v`` (num_tokens, num_kv_heads, head_dim) bf16/fp16 and write them into ``layer`` of
    ``cache`` at ``slot_mapping`` (num_tokens,) int64 (``block * page_size + offset``; -1 skips the token:
    nothing is written for it). One fused CuTe-DSL kernel launch on the current stream; the bytes equal
    :func:`qattn.reference.write_kv_reference`. ``k`` and ``v`` may be views (last dim contiguous, token and head
    strides and the data pointer 16-byte aligned: e.g. sliced out of one packed QKV projection): the kernel reads
    them in place; anything else is copied to a contiguous tensor first.

    Optional transforms, fused into the same launch, in this order and in fp32 (docs/formats.md, "Insert
    transforms"): ``rope`` (a :class:`qattn.RoPE`: NeoX or GPT-J pairing, cos/sin table on the cache's device)
    rotates K at ``positions`` (num_tokens,) int64; ``k_mean`` (num_kv_heads, head_dim) fp32 is subtracted from
    K (smoothing); a cache built with ``rotate=True`` applies its randomized Hadamard rotation to K and V. The
    ring, if any, stores the transformed rows (what decode reads).

    For a cache with a recent window or sink tokens, ``seq_slots`` and ``positions`` (num_tokens,) int64 are
    required. With a window each kept token is also written, unquantized, to ``ring[seq_slot, :, position % W]``.
    Precondition when a ring entry is hit by several tokens of one call: those tokens' sequence is contiguous in
    the call with consecutive positions (prefill chunks, decode batches); then the largest position stays, as in
    the reference. With ``sink_tokens = N`` a kept token at position ``< N`` is also written, unquantized, to
    ``sink[seq_slot, :, position]`` (same launch). Slots must be distinct.

    ``check=False`` (default): only metadata checks (types, shapes, devices, sizes); no host synchronisation,
    so it is safe inside CUDA graphs (a position outside the RoPE table is then clamped into it: wrong numbers,
    never an out-of-bounds read). ``check=True`` also validates values (synchronises): slots in
    ``[-1, capacity)`` and distinct, seq_slots in range, positions >= 0 (and inside the RoPE table), the ring
    precondition above, no (seq_slot, position) twice, and finite k / v / k_mean. (Without ``check`` the kernel
    still never writes out of bounds: a token whose slot is past the pool is skipped, like slot -1, and a ring or
    sink row whose seq_slot or position is out of range is not written.)
    """
    from ..cute_kernels import kv_insert
    from .variants import supported_arch

    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    lay = cache.layer(layer)
    dev = cache.device
    H, D = cache.num_kv_heads, cache.head_dim
    _tensor(k, "k", (torch.bfloat16, torch.float16), dev)
    if k.dim() != 3 or tuple(k.shape[1:]) != (H, D):
        raise ValueError(f"k: expected shape (num_tokens, {H}, {D}), got {tuple(k.shape)}")
    n = k.shape[0]
    _tensor(v, "v", (k.dtype,), dev, (n, H, D))
    _tensor(slot_mapping, "slot_mapping", (torch.int64,), dev, (n,))
    capacity = cache.num_blocks * cache.page_size
    if capacity * H > _MAX_I32 or n * H * D > _MAX_I32:
        raise ValueError("write_kv: the pools or the inputs exceed the kernel's 32-bit indexing; split the cache "
                         "into more layers' worth of smaller pools or the call into smaller chunks")
    if max(cache.k_geometry.data_words, cache.v_geometry.data_words) > _MAX_I32:
        raise ValueError("write_kv: a data pool exceeds 2^31 32-bit words (kernel indexing)")
    ring = bool(cache.recent_window)
    sink = cache.sink_tokens
    if ring or sink:
        if seq_slots is None or positions is None:
            what = "a recent window" if ring else f"sink_tokens={sink}"
            raise ValueError(f"seq_slots: a cache with {what} needs seq_slots and positions (num_tokens,) int64")
        _tensor(seq_slots, "seq_slots", (torch.int64,), dev, (n,))
        if cache.max_seqs * H * max(cache.recent_window, sink) * D > _MAX_I32:
            raise ValueError("write_kv: the ring or the sink buffer exceeds the kernel's 32-bit indexing")
    elif seq_slots is not None:
        raise ValueError("seq_slots: the cache has no recent window and no sink tokens; pass no seq_slots")
    if rope is not None:
        if not isinstance(rope, RoPE):
            raise TypeError(f"rope: expected a qattn.RoPE, got {type(rope).__name__}")
        _tensor(rope.cos_sin_cache, "rope.cos_sin_cache", (torch.float32,), dev)
        if rope.rotary_dim > D:
            raise ValueError(f"rope: rotary_dim {rope.rotary_dim} exceeds head_dim {D}")
        if rope.max_position * rope.rotary_dim > _MAX_I32:
            raise ValueError("rope: the cos/sin table exceeds the kernel's 32-bit indexing")
        if positions is None:
            raise ValueError("positions: RoPE needs each token's position")
    elif positions is not None and not (ring or sink):
        raise ValueError("positions: the cache has no recent window, no sink tokens and no RoPE is applied; "
                         "pass no positions")
    if positions is not None:
        _tensor(positions, "positions", (torch.int64,), dev, (n,))
    if k_mean is not None:
        _tensor(k_mean, "k_mean", (torch.float32,), dev, (H, D))
    if dev.type != "cuda":  # the last check (the inputs' metadata first, also on the CPU)
        raise ValueError(f"cache: write_kv runs on a CUDA cache, this one is on {dev} "
                         "(use qattn.write_kv_reference on the CPU)")
    if check:
        _check_values(cache, k, v, slot_mapping, seq_slots, positions, rope, k_mean)
    if n == 0:
        return
    cfg = insert_config_for(cache, k.dtype, rope, k_mean is not None)
    with on_device(dev):
        arch = supported_arch(dev)
        # views (e.g. of a packed QKV projection) are read in place; the kernel takes 32-bit strides
        k16, v16 = kernel_view(k, offset_limit=2**31), kernel_view(v, offset_limit=2**31)
        slots = slot_mapping.contiguous()
        kv_insert.launch_insert(cfg, arch, k16, v16, slots,
                                None if seq_slots is None else seq_slots.contiguous(),
                                None if positions is None else positions.contiguous(),
                                lay, cache.num_blocks, cache.page_size, cache.recent_window, cache.max_seqs,
                                cos_sin=None if rope is None else rope.cos_sin_cache,
                                k_mean=None if k_mean is None else contiguous16(k_mean),
                                rot_signs=contiguous16(cache.rotation_signs) if cache.rotate else None,
                                sink_tokens=sink)


def _check_values(cache, k, v, slot_mapping, seq_slots, positions, rope=None, k_mean=None) -> None:
    capacity = cache.num_blocks * cache.page_size
    s = slot_mapping
    bad = (s < -1) | (s >= capacity)
    if bool(bad.any()):
        raise ValueError(f"slot_mapping: values must be -1 or in [0, {capacity}), got {int(s[bad][0])}")
    kept = s[s >= 0]
    if kept.numel() != torch.unique(kept).numel():
        raise ValueError("slot_mapping: the same slot appears twice")
    for t, name in ((k, "k"), (v, "v"), (k_mean, "k_mean")):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or Inf")
    if rope is not None:
        p = positions[s >= 0]
        if bool(((p < 0) | (p >= rope.max_position)).any()):
            raise ValueError(f"positions: values must be in [0, {rope.max_position}) (the RoPE table's rows)")
    if not (cache.recent_window or cache.sink_tokens):
        return
    keep = s >= 0
    seqs, pos = seq_slots, positions
    if bool(((seqs[keep] < 0) | (seqs[keep] >= cache.max_seqs)).any()):
        raise ValueError(f"seq_slots: values must be in [0, {cache.max_seqs})")
    if bool((pos[keep] < 0).any()):
        raise ValueError("positions: values must be >= 0")
    if cache.sink_tokens:  # two tokens on one sink entry would race (the reference rejects any repeat)
        first = keep & (pos < cache.sink_tokens)
        entry = seqs[first] * cache.sink_tokens + pos[first]
        if entry.numel() != torch.unique(entry).numel():
            raise ValueError("positions: the same (seq_slot, position) appears twice")
    if not cache.recent_window:
        return
    # The kernel's rule (token t yields its ring entry to token t + W of the same sequence at position + W)
    # must pick the same tokens as the reference's rule (the largest position per ring entry).
    n, W = s.numel(), cache.recent_window
    idx = torch.arange(n, device=s.device)
    nxt = idx + W
    has = nxt < n
    nc = nxt.clamp(max=max(n - 1, 0))
    yielded = has & (s[nc] >= 0) & (seqs[nc] == seqs) & (pos[nc] == pos + W)
    kernel_win = keep & ~yielded
    entry = seqs.clamp(min=0) * W + pos.clamp(min=0) % W
    newest = torch.full((cache.max_seqs * W,), -1, dtype=torch.long, device=s.device)
    newest.scatter_reduce_(0, entry[keep], pos[keep], reduce="amax")
    ref_win = keep & (pos == newest[entry])
    if not torch.equal(kernel_win, ref_win):
        raise ValueError("seq_slots/positions: several tokens of this call hit one ring entry and their sequence "
                         "is not contiguous with consecutive positions; the kernel cannot keep the newest "
                         "(split the call, or order each sequence's tokens contiguously)")
    # both rules picking the same tokens also rules out two winners on one entry
    if int(kernel_win.sum()) != torch.unique(entry[kernel_win]).numel():
        raise ValueError("positions: the same (seq_slot, position) appears twice")


def _flatten_kv_eager(cache: PagedKVCache, layer: int, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                      max_seqlen: int | None = None):
    from ..cute_kernels import kv_flatten

    return kv_flatten.flatten_kv(cache, layer, block_table, cache_seqlens, max_seqlen)


def flatten_kv(cache: PagedKVCache, layer: int, block_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
               max_seqlen: int | None = None):
    """Dense K and V (batch, max_len, num_kv_heads, head_dim) bf16 from the paged pools (zero past each
    length); equals ``flatten_kv_reference(...)`` cast to bf16 (the recent-token ring and sink rows are not
    overlaid: this reads the pages). ``max_len`` is ``max_seqlen`` when given (it must be at least every
    length), else ``cache_seqlens.max()`` read on the host. Under ``torch.compile`` pass ``max_seqlen``: the
    call is then the custom op ``qattn::flatten_kv`` and tracing reads nothing on the host. A debugging tool:
    eager calls validate the block table's values (a host synchronisation)."""
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        raise ValueError(f"max_seqlen: expected an int >= 0 or None, got {max_seqlen!r}")
    if torch.compiler.is_compiling():
        if max_seqlen is None:
            raise ValueError("flatten_kv under torch.compile: pass max_seqlen= (the output length), so that "
                             "tracing does not read cache_seqlens on the host")
        from .torch_ops import flatten_kv_traced

        return flatten_kv_traced(cache, layer, block_table, cache_seqlens, max_seqlen)
    return _flatten_kv_eager(cache, layer, block_table, cache_seqlens, max_seqlen)


def inspect_kv(cache: PagedKVCache, layer: int, block: int, offset: int, head: int) -> dict:
    """Everything stored for one token of one kv head: a debugging probe (host-side torch indexing).

    Returns a dict with, for ``"k"`` and ``"v"``: ``format`` (name), ``data_offset`` / ``scale_offset`` (byte
    offsets from :class:`PoolGeometry`), ``payload`` (the raw row bytes, uint8), ``scales`` (raw scale bytes,
    uint8, or None), ``scale_values`` (decoded fp32 scales, or None), ``global_scale`` (float or None) and
    ``values`` (the decoded fp32 row, exactly what attention reads from the pages).
    """
    from ..quant.reference import dequantize, e4m3_decode, ue8m0_decode

    lay = cache.layer(layer)
    for val, lim, name in ((block, cache.num_blocks, "block"), (offset, cache.page_size, "offset"),
                           (head, cache.num_kv_heads, "head")):
        if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < lim:
            raise ValueError(f"{name}: expected an int in [0, {lim}), got {val!r}")
    out = {}
    for side, fmt, geo, data, sp, gs in (
        ("k", cache.k_format, cache.k_geometry, lay.k_data, lay.k_scale_pool, lay.k_global_scale),
        ("v", cache.v_format, cache.v_geometry, lay.v_data, lay.v_scale_pool, lay.v_global_scale),
    ):
        row = data[block, head, offset].cpu()
        payload = row.contiguous().view(torch.uint8).clone()
        scales = None if sp is None else sp[block, head, offset].cpu()
        g = None if gs is None else gs[head].cpu()
        values = dequantize(row, scales, fmt, g)
        if scales is None:
            sbytes, svals = None, None
        elif fmt.scale_block is None:
            sbytes, svals = scales.reshape(1).view(torch.uint8).clone(), scales.reshape(1).float()
        else:
            sbytes = scales.clone()
            svals = e4m3_decode(scales) if fmt.scale_dtype == "e4m3" else ue8m0_decode(scales)
        out[side] = {
            "format": fmt.name, "data_offset": geo.data_offset(block, head, offset),
            "scale_offset": geo.scale_offset(block, head, offset) if sp is not None else None,
            "payload": payload, "scales": sbytes, "scale_values": svals,
            "global_scale": None if g is None else float(g), "values": values,
        }
    return out


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
             positions: torch.Tensor | None = None, rope: RoPE | None = None, k_mean: torch.Tensor | None = None,
             seq_slots: torch.Tensor | None = None, check: bool = False) -> None:
    if torch.compiler.is_compiling():  # torch.compile traces the registered custom op (no graph break)
        write_kv_traced(cache, layer, k, v, slot_mapping, seq_slots, positions, rope, k_mean)
    else:
        _write_kv_planned(cache, layer, k, v, slot_mapping, positions, rope, k_mean, seq_slots, check)
    if k_mean is not None:
        cache.k_smoothed = True  # (host-side: a soft-capped decode then refuses the cache)


def _write_kv_planned(cache, layer, k, v, slot_mapping, positions, rope, k_mean, seq_slots, check) -> None:
    """The eager write, through the launch plan of its signature when there is one."""
    key = inputs = tensors = None
    if not check and isinstance(cache, PagedKVCache) and type(layer) is int and 0 <= layer < cache.num_layers and (
            rope is None or isinstance(rope, RoPE)):
        # (the rotation signs are keyed: write_kv copies them when misaligned)
        tensors = (k, v, slot_mapping, seq_slots, positions, k_mean, None if rope is None else rope.cos_sin_cache,
                   cache.rotation_signs)
        key = signature_key(tensors, (cache_signature(cache), None if rope is None else rope.style))
        # the launch plan of this signature (launch_plan: the layer's tensors are inputs too)
        inputs = None if key is None else tensors + layer_tensors(cache.layer(layer))
    _INSERT_PLANS.call(key, inputs,
                       lambda: _write_kv_eager(cache, layer, k, v, slot_mapping, seq_slots=seq_slots,
                                               positions=positions, rope=rope, k_mean=k_mean, check=check) or (),
                       keyed=None if tensors is None else len(tensors))


_INSERT_PLANS = Planner()


write_kv.__doc__ = _write_kv_eager.__doc__
