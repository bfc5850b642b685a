"""Totals of per-chunk column statistics (CuTe-DSL): ``total[b, h, d] = op_c partial[b, h, c, d]`` in chunk order.

The prepasses reduce a long sequence in chunks of rows (many CTAs per (sequence, head)) and leave one partial
per chunk and channel: fp64 sums of K for the K mean (:mod:`qk_int8_kmean`), fp32 amax of V for the FP8 V scales
(:mod:`v_fp8_quant`), fp32 ranges of K and amax of Q for channel balancing (:mod:`qk_int8_kmean`). Combining them once here (one CTA per (sequence, head), one thread per channel) lets every
CTA of the following kernel read one total instead of re-reading all chunks. H100, K (2, 8192, 16, 128): the K
quantize kernel takes 43.8 us with one value per column to read, 61.7 us with 16. The order (0 op chunk 0 op
chunk 1 ...) is the one those kernels used, so the results are bit for bit the same.

``op``: ``"sum_f64"`` (fp64 adds) or ``"max_f32"`` (fp32 max, starting from -inf; there is always a chunk).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64

from qattn.interface.variants import Variant, cache_for, register

__all__ = ["ChunkReduce", "chunk_reduce_placeholder_args", "compiled_chunk_reduce", "OPS"]

KIND = "chunk_reduce"
OPS = ("sum_f64", "max_f32")


def _gptr(dtype, addr, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


class ChunkReduce:
    """(B, H, num_chunks, D) partials -> (B, H, 1, D) totals, fp64 sums or fp32 maxima."""

    def __init__(self, head_dim: int, op: str):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim: the chunk reduction supports 64, 128 and 256, got {head_dim}")
        if op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {op!r}")
        self.head_dim = head_dim
        self.op = op
        self.dtype = Float64 if op == "sum_f64" else Float32

    @property
    def key(self) -> tuple:
        return (self.op, self.head_dim)

    @cute.jit
    def __call__(self, partial_addr: Int64, total_addr: Int64, batch: Int32, num_heads: Int32, num_chunks: Int32,
                 pdl: Int32, stream: cuda.CUstream):
        """``pdl`` (0 / 1): launched as a programmatic dependent of the kernel before it, which must be the one
        that wrote ``partial``: this grid is scheduled early and waits (``griddepcontrol.wait``) before reading."""
        self.kernel(partial_addr, total_addr, num_heads, num_chunks).launch(
            grid=(num_heads, batch, 1), block=(self.head_dim, 1, 1), stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, partial_addr: Int64, total_addr: Int64, num_heads: Int32, num_chunks: Int32):
        D, dt = self.head_dim, self.dtype
        # the next kernel of the prepass (launched with pdl) may be scheduled now: it waits for this grid itself
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # the partials of the kernel before (a no-op in a plain launch)
        nbytes = dt.width // 8
        d, _, _ = cute.arch.thread_idx()
        head, b, _ = cute.arch.block_idx()
        bh = Int64(b) * Int64(num_heads) + Int64(head)
        mPart = cute.make_tensor(_gptr(dt, partial_addr + bh * Int64(num_chunks) * Int64(D * nbytes), nbytes),
                                 cute.make_layout((D, num_chunks), stride=(1, D)))
        acc = dt(0.0) if cutlass.const_expr(self.op == "sum_f64") else -Float32.inf
        for c in cutlass.range(num_chunks, unroll=8):
            if cutlass.const_expr(self.op == "sum_f64"):
                acc = acc + mPart[d, c]
            else:
                acc = cute.arch.fmax(acc, mPart[d, c])
        mTotal = cute.make_tensor(_gptr(dt, total_addr + bh * Int64(D * nbytes), nbytes), cute.make_layout(D))
        mTotal[d] = acc


def chunk_reduce_placeholder_args() -> tuple:
    return (Int64(0), Int64(0), Int32(1), Int32(1), Int32(1), Int32(0), cute.runtime.make_fake_stream())


def compiled_chunk_reduce(cfg: ChunkReduce, arch: str):
    """The compiled kernel from the shared compile cache (memory, else disk, else compiled now)."""
    return cache_for(KIND).get((KIND, arch) + cfg.key, lambda: _build(cfg, arch))


def _build(cfg: ChunkReduce, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    return compile_for_arch(cfg, *chunk_reduce_placeholder_args(), arch=arch, keep_ptx=False)[0]


@register(KIND)
def _chunk_reduce_variants(arch: str, head_dims=None, **_):
    return [Variant(KIND, (KIND, arch) + ChunkReduce(d, op).key, f"{op} D{d}",
                    lambda d=d, op=op: _build(ChunkReduce(d, op), arch))
            for d in (head_dims or [64, 128]) if d in (64, 128, 256) for op in OPS]
