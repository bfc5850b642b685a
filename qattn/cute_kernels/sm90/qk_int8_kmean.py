"""Per-channel sums of K for the INT8 prefill's K smoothing (CuTe-DSL): the first of the two passes over K --
and the per-channel ranges that channel balancing (``balance_qk``) needs, of K and of Q.

For K (batch, seqlen, kv_heads, head_dim) bf16/fp16 -- or varlen (total, kv_heads, head_dim) with
``cu_seqlens`` -- the kernel writes ``partial[b, h, c, :]`` (fp64, (B, H, num_chunks, D)), the sum of the rows
``[c * chunk_rows, (c + 1) * chunk_rows)`` of sequence ``b``, head ``h`` (rows past the sequence's length count
as nothing). :class:`~qattn.cute_kernels.sm90.qk_int8_quant.QKInt8Quant` adds the chunks in order, divides by
the length and rounds once to fp32.

Why fp64: the values are bf16/fp16 (at most 11 significant bits), so the fp64 sums of one channel are exact as
long as its values span fewer than about ``42 - log2(seqlen)`` binades (randn-like data: ~20), and otherwise
off by ~2^-53 relative. The mean, one RN division and one RN conversion later, is then the one the torch
reference computes (it sums in float64 too), whatever the summation order, except in near-tie cases. The fp64
adds and conversions cost nothing next to the HBM read.

``stats`` picks what is written: ``"sum"`` (the fp64 sums above), ``"sum_range"`` (also the fp32 column maximum
and the negated minimum of the chunk's rows, ``range[b, h, 0 | 1, c, :]`` in a (B, H, 2, num_chunks, D) tensor:
with the mean, ``max |K - mean| = max(max - mean, mean - min)`` exactly, fp32 subtraction being monotonic;
-inf for a chunk with no rows), ``"range"`` (only those) or ``"absmax"`` (only ``max |x|``, (B, H, num_chunks, D),
0 for no rows; for Q).

Work split: grid ``(num_chunks, heads, batch)``; a thread owns 8 consecutive columns (one 16-byte load per row)
and walks the chunk's rows ``rows_per_pass`` apart, ``UNROLL`` loads in flight; the per-thread sums are
combined in shared memory in a fixed order (deterministic). The launcher picks ``chunk_rows`` so that the grid
fills the GPU.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64, Uint32

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.kv_insert import bf16x2_to_f32x2
from qattn.interface.variants import Variant, cache_for, register

__all__ = ["KMeanPartial", "make_kmean_compile_args", "kmean_placeholder_args", "compiled_kmean", "UNROLL", "STATS"]

KIND = "qk_int8_kmean"

UNROLL = 8  # 16-byte loads in flight per thread
STATS = ("sum", "sum_range", "range", "absmax")


def _gptr(dtype, addr, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


class KMeanPartial:
    """fp64 per-chunk column sums (and / or fp32 ranges, ``stats``) of a (B, S, H, D) or varlen (total, H, D)
    bf16/fp16 tensor."""

    def __init__(self, head_dim: int, in_bf16: bool = True, varlen: bool = False, stats: str = "sum"):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim: the K mean kernel supports 64, 128 and 256, got {head_dim}")
        if stats not in STATS:
            raise ValueError(f"stats: expected one of {STATS}, got {stats!r}")
        self.stats = stats
        self.sums = stats in ("sum", "sum_range")
        self.range = stats in ("sum_range", "range")
        self.absmax = stats == "absmax"
        self.head_dim = head_dim
        self.in_bf16 = bool(in_bf16)
        self.varlen = bool(varlen)
        self.threads_per_row = head_dim // 8
        self.threads = max(128, head_dim)
        self.rows_per_pass = self.threads // self.threads_per_row
        self.rows_per_step = self.rows_per_pass * UNROLL  # chunk_rows should be a multiple of this

    @property
    def key(self) -> tuple:
        key = ("bf16" if self.in_bf16 else "fp16", self.head_dim, self.varlen)
        return key if self.stats == "sum" else key + (self.stats,)

    @cute.jit
    def __call__(
        self,
        x_addr: Int64,  # bf16/fp16 K, 16-byte aligned; element strides below
        partial_addr: Int64,  # fp64 (B, H, num_chunks, D) sums
        stat_addr: Int64,  # fp32 (B, H, 2, num_chunks, D) range, or (B, H, num_chunks, D) absmax
        cu_seqlens_addr: Int64,  # int32 (B + 1,) (varlen only)
        batch: Int32,
        seqlen: Int32,  # dense: S; varlen: unused
        num_heads: Int32,
        num_chunks: Int32,
        chunk_rows: Int32,
        stride_b: Int64,
        stride_s: Int64,
        stride_h: Int64,
        stream: cuda.CUstream,
    ):
        self.kernel(x_addr, partial_addr, stat_addr, cu_seqlens_addr, batch, seqlen, num_heads, num_chunks,
                    chunk_rows, stride_b, stride_s, stride_h).launch(
            grid=(num_chunks, num_heads, batch), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x_addr: Int64, partial_addr: Int64, stat_addr: Int64, cu_seqlens_addr: Int64, batch: Int32,
               seqlen: Int32,
               num_heads: Int32, num_chunks: Int32, chunk_rows: Int32, stride_b: Int64, stride_s: Int64,
               stride_h: Int64):
        D, TPR, RPP = self.head_dim, self.threads_per_row, self.rows_per_pass
        # the prepass's next kernel (chunk totals or the quantize kernel, launched with pdl) may be scheduled once
        # every CTA of this grid has started; it waits for this grid's end before reading the partials
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, b = cute.arch.block_idx()
        part = tidx % TPR  # columns [8 * part, 8 * part + 8)
        rip = tidx // TPR

        length = seqlen
        if cutlass.const_expr(self.varlen):
            mCu = cute.make_tensor(_gptr(Int32, cu_seqlens_addr, 4), cute.make_layout(batch + 1))
            seq_start = mCu[b]
            length = mCu[b + 1] - seq_start
            row_base = x_addr + Int64(seq_start) * stride_s * Int64(2)
        else:
            row_base = x_addr + Int64(b) * stride_b * Int64(2)
        base = row_base + Int64(head) * stride_h * Int64(2) + Int64(part * 16)
        begin = chunk * chunk_rows
        end = begin + chunk_rows
        if end > length:
            end = length

        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        acc = cute.make_rmem_tensor((8,), Float64)
        acc.fill(Float64(0.0))
        # range: column max and negated min (-inf: no rows); absmax: max |x| (rows past the end read as 0)
        hi_max = cute.make_rmem_tensor((8,), Float32)
        neg_min = cute.make_rmem_tensor((8,), Float32)
        hi_max.fill(-Float32.inf if cutlass.const_expr(self.range) else Float32(0.0))
        neg_min.fill(-Float32.inf)
        rX = cute.make_rmem_tensor((4, UNROLL), Uint32)
        widen = bf16x2_to_f32x2 if self.in_bf16 else fp4.f16x2_to_f32x2
        for step in cutlass.range(begin, end, self.rows_per_step, unroll=1):
            rX.fill(Uint32(0))  # rows past the end add zeros
            for u in cutlass.range_constexpr(UNROLL):
                row = step + u * RPP + rip
                if row < end:
                    src = base + Int64(row) * stride_s * Int64(2)
                    cute.copy(vec128, cute.make_tensor(_gptr(Uint32, src, 16), cute.make_layout(4)), rX[None, u])
            for u in cutlass.range_constexpr(UNROLL):
                words = [widen(rX[w, u]) for w in range(4)]  # exact widening of the row's 8 values
                for w in cutlass.range_constexpr(4):
                    lo, hi = words[w]
                    if cutlass.const_expr(self.sums):
                        acc[2 * w] = acc[2 * w] + Float64(lo)  # exact sums (module docstring)
                        acc[2 * w + 1] = acc[2 * w + 1] + Float64(hi)
                    if cutlass.const_expr(self.absmax):
                        hi_max[2 * w] = cute.arch.fmax(hi_max[2 * w], cute.math.absf(lo))
                        hi_max[2 * w + 1] = cute.arch.fmax(hi_max[2 * w + 1], cute.math.absf(hi))
                if cutlass.const_expr(self.range):
                    if step + u * RPP + rip < end:  # zeros of missing rows must not enter a max / min
                        for w in cutlass.range_constexpr(4):
                            lo, hi = words[w]
                            hi_max[2 * w] = cute.arch.fmax(hi_max[2 * w], lo)
                            hi_max[2 * w + 1] = cute.arch.fmax(hi_max[2 * w + 1], hi)
                            neg_min[2 * w] = cute.arch.fmax(neg_min[2 * w], -lo)
                            neg_min[2 * w + 1] = cute.arch.fmax(neg_min[2 * w + 1], -hi)

        # combine the RPP threads of each column, in a fixed order
        smem = cutlass.memory.SmemAllocator()
        sAcc, sMax = None, None
        if cutlass.const_expr(self.sums):
            sAcc = smem.allocate_tensor(Float64, cute.make_layout((D, RPP), stride=(1, D)), byte_alignment=16)
        if cutlass.const_expr(self.range or self.absmax):
            sMax = smem.allocate_tensor(Float32, cute.make_layout((D, RPP, 2), stride=(1, D, D * RPP)),
                                        byte_alignment=16)
        for i in cutlass.range_constexpr(8):
            if cutlass.const_expr(self.sums):
                sAcc[part * 8 + i, rip] = acc[i]
            if cutlass.const_expr(self.range or self.absmax):
                sMax[part * 8 + i, rip, 0] = hi_max[i]
                sMax[part * 8 + i, rip, 1] = neg_min[i]
        cute.arch.sync_threads()
        if tidx < D:
            bh = Int64(b) * Int64(num_heads) + Int64(head)
            if cutlass.const_expr(self.sums):
                total = Float64(0.0)
                for r in cutlass.range_constexpr(RPP):
                    total = total + sAcc[tidx, r]
                row_addr = partial_addr + (bh * Int64(num_chunks) + Int64(chunk)) * Int64(D * 8)
                mOut = cute.make_tensor(_gptr(Float64, row_addr, 8), cute.make_layout(D))
                mOut[tidx] = total
            if cutlass.const_expr(self.range or self.absmax):
                n_kinds = 2 if cutlass.const_expr(self.range) else 1
                for kind in cutlass.range_constexpr(n_kinds):
                    m = sMax[tidx, 0, kind]
                    for r in cutlass.range_constexpr(1, RPP):
                        m = cute.arch.fmax(m, sMax[tidx, r, kind])
                    row = (bh * Int64(n_kinds) + Int64(kind)) * Int64(num_chunks) + Int64(chunk)
                    mStat = cute.make_tensor(_gptr(Float32, stat_addr + row * Int64(D * 4), 4), cute.make_layout(D))
                    mStat[tidx] = m


def kmean_placeholder_args() -> tuple:
    return (tuple(Int64(0) for _ in range(4)) + tuple(Int32(1) for _ in range(5))
            + tuple(Int64(1) for _ in range(3)) + (cute.runtime.make_fake_stream(),))


def make_kmean_compile_args(head_dim: int, in_bf16: bool = True, varlen: bool = False, stats: str = "sum"):
    """(kernel object, placeholder args) to compile :class:`KMeanPartial` without a GPU."""
    return KMeanPartial(head_dim, in_bf16, varlen, stats), kmean_placeholder_args()


def compiled_kmean(cfg: KMeanPartial, arch: str):
    """The compiled kernel from the shared compile cache (memory, else disk, else compiled now)."""
    return cache_for(KIND).get((KIND, arch) + cfg.key, lambda: _build(cfg, arch))


def _build(cfg: KMeanPartial, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    return compile_for_arch(cfg, *kmean_placeholder_args(), arch=arch, keep_ptx=False)[0]


@register(KIND)
def _kmean_variants(arch: str, head_dims=None, balance_qk: bool = False, **_):
    """The K-mean sums of the default prefill; with ``balance_qk`` also the range / absmax statistics of
    channel balancing (off by default: they compile on first use)."""
    out = []
    for d in head_dims or [64, 128]:
        if d not in (64, 128, 256):
            continue
        for in_bf16 in (True, False):
            for varlen in (False, True):
                for stats in STATS if balance_qk else ("sum",):
                    cfg = KMeanPartial(d, in_bf16, varlen, stats)
                    label = (f"{'bf16' if in_bf16 else 'fp16'} D{d}{' varlen' if varlen else ''}"
                             f"{'' if stats == 'sum' else ' ' + stats}")
                    out.append(Variant(KIND, (KIND, arch) + cfg.key, label, lambda cfg=cfg: _build(cfg, arch)))
    return out
