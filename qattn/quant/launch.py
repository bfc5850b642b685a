"""Torch entry points of the INT8 Q/K prepass kernels: :func:`quantize_qk_int8` and :func:`quantize_qk_int8_varlen`.

Both return ``(q_int8, q_scale, k_int8, k_scale, k_mean)`` with the shapes, dtypes and bytes of
:func:`qattn.quant.qk_int8.quantize_qk_int8_reference` / :func:`~qattn.quant.qk_int8.quantize_qk_int8_varlen_reference`
(K smoothing: the kernels' mean is the correctly rounded mean of the fp64-exact sum, so it normally equals the
reference's bit for bit; the K bytes are those the reference gives for the kernels' mean).

Launches (all on torch's current stream, no host synchronisation, so CUDA-graph capturable once compiled):

1. ``smooth_k`` only: :class:`~qattn.cute_kernels.sm90.qk_int8_kmean.KMeanPartial`, fp64 column sums of K per
   chunk of rows (first read of K), then :class:`~qattn.cute_kernels.sm90.chunk_reduce.ChunkReduce`, their
   totals in chunk order.
2. :class:`~qattn.cute_kernels.sm90.qk_int8_quant.QKInt8Quant` on K (groups of ``block_k`` rows; with smoothing
   it finishes the mean, writes ``k_mean`` and quantizes ``k - mean``; second read of K).
3. The same kernel on Q (groups of ``warp_q`` or ``block_q`` rows; one read of Q).

With ``smooth_k`` and without balancing, K of at most 2048 keys per sequence (128-key groups,
:func:`k_cluster_plan`) takes one launch instead of 1 and 2: ``QKInt8Quant`` in cluster form, 8 CTAs per (sequence,
head) holding its rows in registers and adding the mean up through distributed shared memory (one read of K).

With ``balance_qk`` (channel balancing, :mod:`qattn.quant.qk_int8`): launch 1 also takes the column max / min of
K (``stats="sum_range"``, or ``"range"`` without smoothing; their totals by a second ChunkReduce), a
``KMeanPartial(stats="absmax")`` launch + ChunkReduce take the column amax of Q (one more read of Q), launch 2
derives and writes ``qk_balance`` and quantizes ``(k - mean) / qk_balance``, launch 3 quantizes
``q * qk_balance``.

Inputs: bf16 or fp16, head_dim 64, 128 or 256, last dimension contiguous; other strides are passed to the
kernels as they are when they (and the data pointer) keep 16-byte alignment, otherwise the input is copied
first (``.contiguous()``). Outputs are fresh contiguous tensors.
"""

from __future__ import annotations

import functools

import torch

from ..cute_kernels.config_values import MAX_GRID_YZ as _MAX_GRID_YZ
from ..interface.fast_launch import kernel_view as _kernel_view  # the rule of what kernels read in place
from .qk_int8 import _check_blocks, _num_groups

__all__ = ["quantize_qk_int8", "quantize_qk_int8_varlen", "quantize_k_int8", "quantize_k_int8_varlen"]

_DTYPES = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (64, 128, 256)
_MAX_I32 = 2**31 - 1
_MAX_K_CHUNKS = 64  # partial sums per (sequence, head) column, added up once by ChunkReduce
# up to this many chunks the K quantize kernel adds the partial sums itself (every CTA, the same fixed order as
# ChunkReduce, so the same mean): one launch less where the sequence is short
_SUM_IN_QUANT_MAX_CHUNKS = 8
_MIN_CHUNK_ROWS = 256
# where the partial sums are folded by ChunkReduce anyway (more chunks cost no launch), chunks may shrink to this
# many bytes of 16-bit rows, but not below 128 rows (128 at head_dim 128 and 256; head_dim 64 keeps 256): more
# CTAs for few, short rows
_MIN_FOLDED_CHUNK_BYTES = 32 << 10
_MIN_FOLDED_CHUNK_ROWS = 128
_NUM_SMS: dict = {}


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------
def _check_input(t, name: str, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(t.shape)}")
    if t.shape[-1] not in _HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be one of {_HEAD_DIMS}, got {t.shape[-1]}")


def _check_pair(q: torch.Tensor, k: torch.Tensor) -> None:
    if k.device != q.device:
        raise ValueError(f"k: expected device {q.device} (that of q), got {k.device}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head_dim {k.shape[-1]} differs from q's head_dim {q.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k: num_kv_heads ({hkv}) must divide num_q_heads ({hq})")
    if max(hq, hkv) > _MAX_GRID_YZ:
        raise ValueError(f"q: at most {_MAX_GRID_YZ} heads (grid limit), got {max(hq, hkv)}")


def _check_cuda(q: torch.Tensor) -> None:
    """The last check (the others also run on the CPU): q (and so k, on q's device) on CUDA."""
    if not q.is_cuda:
        raise ValueError(f"q: expected a CUDA tensor, got device {q.device} "
                         "(use qattn.quant.quantize_qk_int8_reference on the CPU)")


def _check_cu(cu, name: str, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected shape (num_seqs + 1,), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device}, got {cu.device}")


def _check_max_seqlen(v, name: str, total: int, num_seqs: int) -> int:
    """A varlen prepass's max_seqlen against what the host knows without reading cu_seqlens: an int >= 0 with
    num_seqs * max_seqlen >= total (else some sequence is longer than it, and the grid, sized by it, would leave
    rows unwritten). Larger than every sequence is fine (whole padding groups, scale 0)."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 0 or num_seqs * v < total:
        raise ValueError(f"{name}: expected an int >= 0 with num_seqs ({num_seqs}) x {name} >= the packed total "
                         f"({total}), got {v}")
    return v


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Element strides of the leading dimensions, 0 for size-1 dimensions (they are only multiplied by 0)."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(t.dim() - 1))


# ------------------------------------------------------------------------------------------------
# compiled kernels
# ------------------------------------------------------------------------------------------------
# The kernel lookups below are remembered per argument tuple: building the config object and its cache key costs
# microseconds on every eager call otherwise. They return the launcher (_kmean_kernel also its config, whose
# rows_per_step sizes the chunks).
@functools.lru_cache(maxsize=None)
def _quant_kernel(arch: str, head_dim: int, group_rows: int, in_bf16: bool, subtract_mean: bool, varlen: bool,
                  balance=None, cluster: int = 0, groups_per_cta=None):
    from ..cute_kernels.sm90 import qk_int8_quant as m
    from ..interface.fast_launch import fast

    return fast(m.compiled_quant(m.QKInt8Quant(head_dim, group_rows, in_bf16, subtract_mean, varlen, balance,
                                               cluster, groups_per_cta), arch))


@functools.lru_cache(maxsize=None)
def k_cluster_plan(head_dim: int, block_k: int, num_groups: int, units: int = 1,
                   num_sms: int = 132) -> tuple[int, int] | None:
    """``(cluster, groups_per_cta)`` of the one-launch K quantization (a cluster of CTAs holds all rows of one
    (sequence, head) in registers and adds up the mean itself: one launch, K read once), or None for the mean
    kernel + quantize kernel path: ``groups_per_cta`` is the smallest power of two that covers ``num_groups``
    (of the longest sequence, varlen), at most ``CLUSTER_MAX_GROUPS_PER_CTA`` (so up to 2048 keys with 128-key
    groups).

    H100, B2 H16, one launch vs two (GPU time, CUDA graph; ``flash_attn_func`` eager end to end): D128 S1K 15.1
    -> 11.8 us (143 -> 116 us), S2K 18.3 -> 19.8 (166 -> 156), D64 S2K 11.0 -> 11.0 (141 -> 111); with 4 groups
    per CTA slower on the GPU and not faster end to end (D128 S4K 40.9 -> 43.5 us, 456 -> 471; D64 S4K 17.8 ->
    18.8; D64 S8K, 8 per CTA, 33.6 -> 43.5): every CTA loads, waits for its cluster's sums, then quantizes, with
    nothing to overlap those phases.

    ``units`` (sequences x kv heads): only while their clusters fit one wave of 8 CTAs per SM; beyond, the two
    kernels win (many short sequences leave most of a cluster's CTAs idle). H100, K prepass, graph, cluster / two
    kernels: varlen 300 sequences of 1-199 keys, 16 kv heads, 574.3 / 148.9 us (``flash_attn_varlen_func`` causal
    957.2 / 532.9 us), 8 kv heads 289.7 / 80.8; 64 x 128 keys, 8 kv heads 67.1 / 19.2; 16 sequences of 300-1000
    keys, 8 kv heads (128 units) 27.2 / 32.2; dense B2 H16 S256 / S512 / S1K 13.2 / 14.0, 13.5 / 14.4, 14.0 /
    16.3; the gain fades as units grow: dense B8 H32 / 8 S512 / S1K / S2K (64 units) 19.6 / 17.4, 22.4 / 22.2,
    42.3 / 39.2, B4 H32 / 32 S1K (128 units) 38.9 / 39.5."""
    from ..cute_kernels.sm90.qk_int8_quant import CLUSTER_SIZE, cluster_groups_per_cta

    if units * CLUSTER_SIZE > 8 * num_sms:
        return None
    gpc = cluster_groups_per_cta(head_dim, block_k, num_groups)
    return None if gpc is None else (CLUSTER_SIZE, gpc)


def _fold_chunks(partial: torch.Tensor, op: str, arch: str, stream) -> tuple[torch.Tensor, int]:
    """(B, H, num_chunks, D) per-chunk partials -> ``(totals (B, H, 1, D), 1)`` by one ChunkReduce launch (the
    ``partial`` itself when there is one chunk), so each CTA of the next kernel reads one value per column."""
    from ..cute_kernels.sm90 import chunk_reduce as m

    B, H, num_chunks, D = partial.shape
    if num_chunks == 1:
        return partial, 1
    total = _alloc((B, H, 1, D), partial.dtype, partial.device)
    # pdl: the kernel just before made ``partial`` (a statistics kernel, or another fold after one)
    _chunk_reduce_kernel(arch, D, op)(partial.data_ptr(), total.data_ptr(), B, H, num_chunks, 1, stream)
    return total, 1


@functools.lru_cache(maxsize=None)
def _chunk_reduce_kernel(arch: str, head_dim: int, op: str):
    from ..cute_kernels.sm90 import chunk_reduce as m
    from ..interface.fast_launch import fast

    return fast(m.compiled_chunk_reduce(m.ChunkReduce(head_dim, op), arch))


@functools.lru_cache(maxsize=None)
def _kmean_kernel(arch: str, head_dim: int, in_bf16: bool, varlen: bool, stats: str = "sum"):
    from ..cute_kernels.sm90 import qk_int8_kmean as m
    from ..interface.fast_launch import fast

    cfg = m.KMeanPartial(head_dim, in_bf16, varlen, stats)
    return cfg, fast(m.compiled_kmean(cfg, arch))


def _alloc(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (the GPU tests replace it with one that poisons the memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _num_sms(device: torch.device) -> int:
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _k_chunks(seqlen: int, rows: int, rows_per_step: int, num_sms: int, row_bytes: int = 0,
              fold_above: int = 0) -> tuple[int, int]:
    """(num_chunks, chunk_rows) for the K-sum grid: about 8 CTAs per SM, chunks of >= 256 rows, at most
    ``_MAX_K_CHUNKS`` per (sequence, head); ``rows`` = sequences x heads. (H100, K (2, 8192, 16, 128): 31.0 us
    with 16 chunks, 26.9 with 32, 28.2 with 64.)

    ``row_bytes`` (one row's bytes) and ``fold_above`` (the caller folds more chunks than this with ChunkReduce):
    when 256-row chunks are folded anyway, chunks of ``_MIN_FOLDED_CHUNK_BYTES`` (at least 128 rows) are allowed
    too, which only matters while few (sequence, head) rows are short. H200, K prepass of B2 H16, CUDA graph, in
    turns, same bytes, 128- vs 256-row chunks at head_dim 128: S2560 21.2 / 22.9 us, S4K 29.6 / 32.3, S8K and
    S16K equal (8 CTAs per SM bind there); at head_dim 64 (128 rows) S4K 15.1 / 14.9, so 256 rows stay there;
    at head_dim 256 (128 rows, the floor; 64 rows measured no better) B2 H16 S2560 38.2 / 41.5, B1 H8 S4K 16.8 /
    17.9, B4 H8 S3000 43.3 / 46.6, B2 H16 S4K 59.7 / 59.2."""
    want = -(-8 * num_sms // max(rows, 1))
    n = max(1, min(want, -(-seqlen // _MIN_CHUNK_ROWS), _MAX_K_CHUNKS))
    if row_bytes and n > fold_above:
        min_rows = max(_MIN_FOLDED_CHUNK_ROWS, _MIN_FOLDED_CHUNK_BYTES // row_bytes)
        n = max(n, min(want, -(-seqlen // min_rows), _MAX_K_CHUNKS))
    chunk = -(-seqlen // n)
    chunk = -(-chunk // rows_per_step) * rows_per_step
    return -(-seqlen // chunk), chunk


def _varlen_rows(num_seqs: int, total: int, max_seqlen: int, heads: int) -> int:
    """The ``rows`` of :func:`_k_chunks` for packed sequences: the work of ``total`` rows counted in sequences of
    ``max_seqlen``, not ``num_seqs`` of them, so that a ragged batch's long sequences get the chunks its short
    ones do not need (the grid covers ``max_seqlen`` for every sequence; chunks past a short one's end are
    empty). Equal lengths: ``num_seqs * heads``, as dense."""
    return max(1, min(num_seqs, -(-total // max(max_seqlen, 1)))) * heads


# ------------------------------------------------------------------------------------------------
# the shared launch sequence
# ------------------------------------------------------------------------------------------------
def _launch_all(q, k, *, batch: int, seqlen_q: int, seqlen_k: int, cu_q, cu_k, granularity: str, smooth_k: bool,
                block_q: int, warp_q: int, block_k: int, q_int8, q_scale, k_int8, k_scale, k_mean,
                qk_balance=None) -> None:
    from ..interface.fast_launch import on_device, stream_handle
    from ..interface.variants import supported_arch

    varlen = cu_q is not None
    dev = q.device
    D = q.shape[-1]
    Hq, Hkv = q.shape[-2], k.shape[-2]
    q_group = block_q if granularity == "per_block" else warp_q

    def addr(t):
        return 0 if t is None else t.data_ptr()

    def strides(t):
        s = _strides(t)
        return (0, s[0], s[1]) if varlen else tuple(s)

    balance = qk_balance is not None
    with on_device(dev):
        arch = supported_arch(dev)
        stream = stream_handle(dev)
        q_amax = None
        if balance:
            if seqlen_q > 0 and seqlen_k > 0:  # column amax of Q (per q head; the K kernel takes the group's max)
                qcfg, qstats = _kmean_kernel(arch, D, q.dtype == torch.bfloat16, varlen, "absmax")
                rows = _varlen_rows(batch, q.shape[0], seqlen_q, Hq) if varlen else batch * Hq
                nc, chunk_rows = _k_chunks(seqlen_q, rows, qcfg.rows_per_step, _num_sms(dev))
                q_amax = _alloc((batch, Hq, nc, D), torch.float32, dev)
                qstats(addr(q), 0, addr(q_amax), addr(cu_q), batch, seqlen_q, Hq, nc, chunk_rows, *strides(q), stream)
                q_amax, _ = _fold_chunks(q_amax, "max_f32", arch, stream)
            else:  # no rows on one side: every lam is 1
                qk_balance.fill_(1.0)
                balance = False
        if seqlen_k > 0:
            partial = None
            k_range = None
            num_chunks = 1
            plan = None  # (cluster, groups per CTA): K short enough for one launch that reads it once
            if smooth_k and not balance:
                plan = k_cluster_plan(D, block_k, k_scale.shape[2], batch * Hkv, _num_sms(dev))
            if plan is None and (smooth_k or balance):
                stats = ("sum_range" if smooth_k else "range") if balance else "sum"
                kcfg, kmean = _kmean_kernel(arch, D, k.dtype == torch.bfloat16, varlen, stats)
                rows = _varlen_rows(batch, k.shape[0], seqlen_k, Hkv) if varlen else batch * Hkv
                # the sums alone (no balance): chunks down to 32 KB where they are folded anyway
                nc, chunk_rows = _k_chunks(seqlen_k, rows, kcfg.rows_per_step, _num_sms(dev),
                                           0 if balance else D * 2, _SUM_IN_QUANT_MAX_CHUNKS)
                if smooth_k:
                    partial = _alloc((batch, Hkv, nc, D), torch.float64, dev)
                if balance:
                    k_range = _alloc((batch, Hkv * 2, nc, D), torch.float32, dev)  # (B, H, 2, chunks, D)
                kmean(addr(k), addr(partial), addr(k_range), addr(cu_k), batch, seqlen_k, Hkv, nc, chunk_rows,
                      *strides(k), stream)
                if smooth_k and nc > _SUM_IN_QUANT_MAX_CHUNKS:
                    partial, num_chunks = _fold_chunks(partial, "sum_f64", arch, stream)
                elif smooth_k:  # few chunks: the quantize kernel adds them itself, in the same order
                    num_chunks = nc
                if balance:
                    k_range, _ = _fold_chunks(k_range, "max_f32", arch, stream)
            kquant = _quant_kernel(arch, D, block_k, k.dtype == torch.bfloat16, smooth_k, varlen,
                                   "k" if balance else None, *(plan or ()))
            # pdl: after the statistics (and fold) kernels of this prepass, whose outputs it waits for
            kquant(addr(k), addr(k_int8), addr(k_scale), addr(partial), addr(k_mean), addr(cu_k), addr(k_range),
                   addr(q_amax), addr(qk_balance), batch, seqlen_k, Hkv, k_scale.shape[2], num_chunks, Hq // Hkv,
                   *strides(k), int(partial is not None or k_range is not None), stream)
        if seqlen_q > 0 and q_int8 is not None:  # (the K-only prepass reads Q for its statistics at most)
            qquant = _quant_kernel(arch, D, q_group, q.dtype == torch.bfloat16, False, varlen,
                                   "q" if qk_balance is not None else None)
            # pdl: after the K quantize kernel (whose channel balance it reads when balancing)
            qquant(addr(q), addr(q_int8), addr(q_scale), addr(None), addr(None), addr(cu_q), 0, 0, addr(qk_balance),
                   batch, seqlen_q, Hq, q_scale.shape[2], 1, Hq // Hkv, *strides(q), int(seqlen_k > 0), stream)


@functools.lru_cache(maxsize=None)
def _check_group(head_dim: int, group_rows: int) -> None:
    """Raises for quantization groups too large for a CTA (the quantize kernel's own check; valid sizes are
    remembered, errors are not)."""
    from ..cute_kernels.sm90.qk_int8_quant import QKInt8Quant

    QKInt8Quant(head_dim, group_rows)


def _check_group_sizes(D: int, granularity: str, block_q: int, warp_q: int, block_k: int) -> None:
    _check_group(D, block_q if granularity == "per_block" else warp_q)
    _check_group(D, block_k)


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def quantize_qk_int8(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
    balance_qk: bool = False,
) -> tuple:
    """INT8 Q/K quantization for the SageAttention-style prefill, on the GPU (CuTe-DSL kernels).

    ``q`` (batch, seqlen_q, num_q_heads, head_dim) and ``k`` (batch, seqlen_k, num_kv_heads, head_dim), bf16 or
    fp16, head_dim 64 / 128 / 256. Returns ``(q_int8, q_scale, k_int8, k_scale, k_mean)``:

    * ``q_int8`` (B, Sq, Hq, D) and ``k_int8`` (B, Sk, Hkv, D) int8, contiguous;
    * ``q_scale`` fp32 (B, Hq, ceil(Sq / block_q)) for ``"per_block"``, (B, Hq, ceil(Sq / block_q) *
      (block_q // warp_q)) for ``"per_warp"``; ``k_scale`` fp32 (B, Hkv, ceil(Sk / block_k));
    * ``k_mean`` fp32 (B, Hkv, D), the per-channel mean of K that was subtracted, or None without ``smooth_k``;
    * ``balance_qk=True`` (off by default) adds ``qk_balance`` fp32 (B, Hkv, D): powers of two moved between the
      channels of Q and K before quantizing (``q * qk_balance``, ``(k - k_mean) / qk_balance``; ``Q K^T`` is
      unchanged), which keeps one loud channel from coarsening every other (:mod:`qattn.quant.qk_int8`). Costs
      one more read of Q and K's column max / min.

    Bytes and scales equal :func:`~qattn.quant.qk_int8.quantize_qk_int8_reference` (with ``k_mean=`` this
    function's ``k_mean``). Launched on the current stream without host synchronisation; values are not
    checked (NaN / Inf inputs give unspecified scales).
    """
    if torch.compiler.is_compiling():  # traced as the custom op qattn::quantize_qk_int8
        from ..interface.torch_ops import quantize_qk_int8_traced

        return quantize_qk_int8_traced(q, k, granularity, smooth_k, block_q, warp_q, block_k, balance_qk)
    _check_blocks(granularity, block_q, warp_q, block_k)
    _check_bools(smooth_k=smooth_k, balance_qk=balance_qk)
    _check_input(q, "q", 4, "(batch, seqlen_q, num_q_heads, head_dim)")
    _check_input(k, "k", 4, "(batch, seqlen_k, num_kv_heads, head_dim)")
    _check_pair(q, k)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's batch {q.shape[0]}")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    _check_group_sizes(D, granularity, block_q, warp_q, block_k)
    if B > _MAX_GRID_YZ:
        raise ValueError(f"q: batch at most {_MAX_GRID_YZ} (grid limit), got {B}")
    if max(Sq, Sk) > _MAX_I32 // 2:
        raise ValueError("q: seqlen exceeds the kernels' 32-bit row indexing")
    _check_cuda(q)

    dev = q.device
    nq = _num_groups(Sq, granularity, block_q, warp_q)[1]
    nk = -(-Sk // block_k)
    q_int8 = _alloc((B, Sq, Hq, D), torch.int8, dev)
    k_int8 = _alloc((B, Sk, Hkv, D), torch.int8, dev)
    q_scale = _alloc((B, Hq, nq), torch.float32, dev)
    k_scale = _alloc((B, Hkv, nk), torch.float32, dev)
    k_mean = _k_mean_out(smooth_k, (B, Hkv, D), Sk, dev)
    qk_balance = _alloc((B, Hkv, D), torch.float32, dev) if balance_qk else None
    if B > 0:
        _launch_all(_kernel_view(q), _kernel_view(k), batch=B, seqlen_q=Sq, seqlen_k=Sk, cu_q=None, cu_k=None,
                    granularity=granularity, smooth_k=smooth_k, block_q=block_q, warp_q=warp_q, block_k=block_k,
                    q_int8=q_int8, q_scale=q_scale, k_int8=k_int8, k_scale=k_scale, k_mean=k_mean,
                    qk_balance=qk_balance)
    out = (q_int8, q_scale, k_int8, k_scale, k_mean)
    return out + (qk_balance,) if balance_qk else out


def quantize_qk_int8_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
    balance_qk: bool = False,
) -> tuple:
    """Varlen :func:`quantize_qk_int8`: ``q`` (total_q, Hq, D), ``k`` (total_k, Hkv, D), sequence ``i`` being
    rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` (int32, (num_seqs + 1,), FlashAttention's convention).

    Layout (see :mod:`qattn.quant.qk_int8`): ``q_int8`` / ``k_int8`` like ``q`` / ``k``; scales padded per
    sequence, ``q_scale`` (num_seqs, Hq, groups(max_seqlen_q)), ``k_scale`` (num_seqs, Hkv, ceil(max_seqlen_k
    / block_k)), tail groups of shorter sequences 0; ``k_mean`` (num_seqs, Hkv, D); with ``balance_qk``
    ``qk_balance`` (num_seqs, Hkv, D), one per sequence (ones where Q or K is empty). Groups never cross
    sequence boundaries. Equal to :func:`~qattn.quant.qk_int8.quantize_qk_int8_varlen_reference`.

    Not checked (that would synchronise): ``cu_seqlens`` non-decreasing from 0 with every length at most
    ``max_seqlen``; rows outside every sequence are left unwritten in ``q_int8`` / ``k_int8``.
    """
    if torch.compiler.is_compiling():  # traced as the custom op qattn::quantize_qk_int8_varlen
        from ..interface.torch_ops import quantize_qk_int8_varlen_traced

        return quantize_qk_int8_varlen_traced(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              granularity, smooth_k, block_q, warp_q, block_k, balance_qk)
    _check_blocks(granularity, block_q, warp_q, block_k)
    _check_bools(smooth_k=smooth_k, balance_qk=balance_qk)
    _check_input(q, "q", 3, "(total_q, num_q_heads, head_dim)")
    _check_input(k, "k", 3, "(total_k, num_kv_heads, head_dim)")
    _check_pair(q, k)
    _check_cu(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_cu(cu_seqlens_k, "cu_seqlens_k", q.device)
    n = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] - 1 != n:
        raise ValueError(f"cu_seqlens_k: {cu_seqlens_k.shape[0] - 1} sequences, cu_seqlens_q has {n}")
    Sq = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", q.shape[0], n)
    Sk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", k.shape[0], n)
    D, Hq, Hkv = q.shape[2], q.shape[1], k.shape[1]
    _check_group_sizes(D, granularity, block_q, warp_q, block_k)
    if n > _MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: at most {_MAX_GRID_YZ} sequences (grid limit), got {n}")
    if max(q.shape[0], k.shape[0], Sq, Sk) > _MAX_I32 // 2:
        raise ValueError("q: total rows exceed the kernels' 32-bit row indexing")
    _check_cuda(q)

    dev = q.device
    nq = _num_groups(Sq, granularity, block_q, warp_q)[1]
    nk = -(-Sk // block_k)
    q_int8 = _alloc(tuple(q.shape), torch.int8, dev)
    k_int8 = _alloc(tuple(k.shape), torch.int8, dev)
    q_scale = _alloc((n, Hq, nq), torch.float32, dev)
    k_scale = _alloc((n, Hkv, nk), torch.float32, dev)
    k_mean = _k_mean_out(smooth_k, (n, Hkv, D), Sk, dev)
    qk_balance = _alloc((n, Hkv, D), torch.float32, dev) if balance_qk else None
    if n > 0:
        _launch_all(_kernel_view(q), _kernel_view(k), batch=n, seqlen_q=Sq, seqlen_k=Sk,
                    cu_q=cu_seqlens_q.contiguous(), cu_k=cu_seqlens_k.contiguous(), granularity=granularity,
                    smooth_k=smooth_k, block_q=block_q, warp_q=warp_q, block_k=block_k, q_int8=q_int8,
                    q_scale=q_scale, k_int8=k_int8, k_scale=k_scale, k_mean=k_mean, qk_balance=qk_balance)
    out = (q_int8, q_scale, k_int8, k_scale, k_mean)
    return out + (qk_balance,) if balance_qk else out


# ------------------------------------------------------------------------------------------------
# K only: the prepass of flash_attn_func on SM90, whose attention kernel quantizes Q itself
# ------------------------------------------------------------------------------------------------
def quantize_k_int8(k: torch.Tensor, *, smooth_k: bool = True, block_k: int = 128,
                    balance_q: torch.Tensor | None = None) -> tuple:
    """The K half of :func:`quantize_qk_int8` (launches 1 and 2): ``(k_int8, k_scale, k_mean)``, the same
    tensors, bytes and scales. ``balance_q``: the Q of ``balance_qk`` (read for its column amax only), then
    ``(k_int8, k_scale, k_mean, qk_balance)`` equal to the K half of ``quantize_qk_int8(q, k, balance_qk=True)``."""
    _check_bools(smooth_k=smooth_k)
    _check_input(k, "k", 4, "(batch, seqlen_k, num_kv_heads, head_dim)")
    if balance_q is not None:
        _check_input(balance_q, "balance_q", 4, "(batch, seqlen_q, num_q_heads, head_dim)")
        _check_pair(balance_q, k)
        if balance_q.shape[0] != k.shape[0]:
            raise ValueError(f"k: batch {k.shape[0]} differs from balance_q's batch {balance_q.shape[0]}")
    _check_blocks("per_block", block_k, block_k, block_k)
    B, Sk, Hkv, D = k.shape
    _check_k_only(k, block_k)
    if B > _MAX_GRID_YZ:
        raise ValueError(f"k: batch at most {_MAX_GRID_YZ} (grid limit), got {B}")
    if Sk > _MAX_I32 // 2:
        raise ValueError("k: seqlen exceeds the kernels' 32-bit row indexing")
    k_int8 = _alloc((B, Sk, Hkv, D), torch.int8, k.device)
    k_scale = _alloc((B, Hkv, -(-Sk // block_k)), torch.float32, k.device)
    k_mean = _k_mean_out(smooth_k, (B, Hkv, D), Sk, k.device)
    lam = None if balance_q is None else _alloc((B, Hkv, D), torch.float32, k.device)
    if B > 0:
        kv = _kernel_view(k)
        # no q_int8: no Q launch; without balancing, k stands in for q's device and head_dim (seqlen_q = 0)
        qv, sq = (kv, 0) if balance_q is None else (_kernel_view(balance_q), balance_q.shape[1])
        _launch_all(qv, kv, batch=B, seqlen_q=sq, seqlen_k=Sk, cu_q=None, cu_k=None, granularity="per_block",
                    smooth_k=smooth_k, block_q=block_k, warp_q=block_k, block_k=block_k, q_int8=None, q_scale=None,
                    k_int8=k_int8, k_scale=k_scale, k_mean=k_mean, qk_balance=lam)
    return (k_int8, k_scale, k_mean) if lam is None else (k_int8, k_scale, k_mean, lam)


def quantize_k_int8_varlen(k: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *, smooth_k: bool = True,
                           block_k: int = 128, balance_q: torch.Tensor | None = None,
                           cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int | None = None) -> tuple:
    """The K half of :func:`quantize_qk_int8_varlen`: ``(k_int8, k_scale, k_mean)``; with ``balance_q`` (packed
    Q, its ``cu_seqlens_q`` and ``max_seqlen_q``) also ``qk_balance``, as in :func:`quantize_k_int8`.
    ``cu_seqlens_q`` / ``max_seqlen_q`` without ``balance_q`` are a ValueError (they would not be read)."""
    _check_bools(smooth_k=smooth_k)
    _check_input(k, "k", 3, "(total_k, num_kv_heads, head_dim)")
    _check_blocks("per_block", block_k, block_k, block_k)
    _check_cu(cu_seqlens_k, "cu_seqlens_k", k.device)
    n = cu_seqlens_k.shape[0] - 1
    if balance_q is None and (cu_seqlens_q is not None or max_seqlen_q is not None):
        raise ValueError("cu_seqlens_q / max_seqlen_q: only read with balance_q (the packed Q of balance_qk); "
                         "pass balance_q too, or neither")
    if balance_q is not None:
        _check_input(balance_q, "balance_q", 3, "(total_q, num_q_heads, head_dim)")
        _check_pair(balance_q, k)
        _check_cu(cu_seqlens_q, "cu_seqlens_q", k.device)
        if cu_seqlens_q.shape[0] - 1 != n:
            raise ValueError(f"cu_seqlens_q: {cu_seqlens_q.shape[0] - 1} sequences, cu_seqlens_k has {n}")
        max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", balance_q.shape[0], n)
        if max(balance_q.shape[0], max_seqlen_q) > _MAX_I32 // 2:
            raise ValueError("balance_q: total rows or max_seqlen_q exceed the kernels' 32-bit row indexing")
    Sk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", k.shape[0], n)
    Hkv, D = k.shape[1], k.shape[2]
    _check_k_only(k, block_k)
    if n > _MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_k: at most {_MAX_GRID_YZ} sequences (grid limit), got {n}")
    if max(k.shape[0], Sk) > _MAX_I32 // 2:
        raise ValueError("k: total rows exceed the kernels' 32-bit row indexing")
    k_int8 = _alloc(tuple(k.shape), torch.int8, k.device)
    k_scale = _alloc((n, Hkv, -(-Sk // block_k)), torch.float32, k.device)
    k_mean = _k_mean_out(smooth_k, (n, Hkv, D), Sk, k.device)
    lam = None if balance_q is None else _alloc((n, Hkv, D), torch.float32, k.device)
    if n > 0:
        kv = _kernel_view(k)
        cu = cu_seqlens_k.contiguous()
        qv, cq, sq = (kv, cu, 0) if balance_q is None else (_kernel_view(balance_q), cu_seqlens_q.contiguous(),
                                                             max_seqlen_q)
        _launch_all(qv, kv, batch=n, seqlen_q=sq, seqlen_k=Sk, cu_q=cq, cu_k=cu, granularity="per_block",
                    smooth_k=smooth_k, block_q=block_k, warp_q=block_k, block_k=block_k, q_int8=None, q_scale=None,
                    k_int8=k_int8, k_scale=k_scale, k_mean=k_mean, qk_balance=lam)
    return (k_int8, k_scale, k_mean) if lam is None else (k_int8, k_scale, k_mean, lam)


def _check_bools(**flags) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")


def _check_k_only(k: torch.Tensor, block_k: int) -> None:
    if not k.is_cuda:
        raise ValueError(f"k: expected a CUDA tensor, got device {k.device} "
                         "(use qattn.quant.quantize_qk_int8_reference on the CPU)")
    if k.shape[-2] > _MAX_GRID_YZ:
        raise ValueError(f"k: at most {_MAX_GRID_YZ} heads (grid limit), got {k.shape[-2]}")
    _check_group(k.shape[-1], block_k)


def _k_mean_out(smooth_k: bool, shape: tuple, seqlen_k: int, dev) -> torch.Tensor | None:
    """The ``k_mean`` output: None without smoothing; zeros for an empty K (as in the reference)."""
    if not smooth_k:
        return None
    k_mean = _alloc(shape, torch.float32, dev)
    if seqlen_k == 0:
        k_mean.zero_()  # an empty K has mean 0, as in the reference
    return k_mean
