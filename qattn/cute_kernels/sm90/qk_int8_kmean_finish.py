"""Totals of the K-mean partial sums (CuTe-DSL): ``total[b, h, d] = sum_c partial[b, h, c, d]`` in chunk order.

:class:`~qattn.cute_kernels.sm90.qk_int8_kmean.KMeanPartial` leaves fp64 column sums per chunk of rows; adding
them up once here (one CTA per (sequence, head), one thread per channel) lets every CTA of the K quantize kernel
read a single total instead of re-adding all chunks (H100, K (2, 8192, 16, 128): that kernel takes 43.8 us with
one chunk to read, 61.7 us with 16). The order is the one the quantize kernel used (0.0 + chunk 0 + chunk 1 ...),
so the mean is bit for bit the same.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float64, Int32, Int64

from qattn.interface.variants import Variant, cache_for, register

__all__ = ["KMeanFinish", "kmean_finish_placeholder_args", "compiled_kmean_finish"]

KIND = "qk_int8_kmean_finish"


def _gptr(dtype, addr, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


class KMeanFinish:
    """fp64 (B, H, num_chunks, D) partial sums -> fp64 (B, H, 1, D) totals."""

    def __init__(self, head_dim: int):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim: the K mean kernels support 64, 128 and 256, got {head_dim}")
        self.head_dim = head_dim

    @property
    def key(self) -> tuple:
        return (self.head_dim,)

    @cute.jit
    def __call__(self, partial_addr: Int64, total_addr: Int64, batch: Int32, num_heads: Int32, num_chunks: Int32,
                 stream: cuda.CUstream):
        self.kernel(partial_addr, total_addr, num_heads, num_chunks).launch(
            grid=(num_heads, batch, 1), block=(self.head_dim, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, partial_addr: Int64, total_addr: Int64, num_heads: Int32, num_chunks: Int32):
        D = self.head_dim
        d, _, _ = cute.arch.thread_idx()
        head, b, _ = cute.arch.block_idx()
        bh = Int64(b) * Int64(num_heads) + Int64(head)
        mPart = cute.make_tensor(_gptr(Float64, partial_addr + bh * Int64(num_chunks) * Int64(D * 8), 8),
                                 cute.make_layout((D, num_chunks), stride=(1, D)))
        acc = Float64(0.0)
        for c in cutlass.range(num_chunks, unroll=8):
            acc = acc + mPart[d, c]
        mTotal = cute.make_tensor(_gptr(Float64, total_addr + bh * Int64(D * 8), 8), cute.make_layout(D))
        mTotal[d] = acc


def kmean_finish_placeholder_args() -> tuple:
    return (Int64(0), Int64(0), Int32(1), Int32(1), Int32(1), cute.runtime.make_fake_stream())


def compiled_kmean_finish(cfg: KMeanFinish, arch: str):
    """The compiled kernel from the shared compile cache (memory, else disk, else compiled now)."""
    return cache_for(KIND).get((KIND, arch) + cfg.key, lambda: _build(cfg, arch))


def _build(cfg: KMeanFinish, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    return compile_for_arch(cfg, *kmean_finish_placeholder_args(), arch=arch, keep_ptx=False)[0]


@register(KIND)
def _finish_variants(arch: str, head_dims=None, **_):
    return [Variant(KIND, (KIND, arch) + KMeanFinish(d).key, f"D{d}", lambda d=d: _build(KMeanFinish(d), arch))
            for d in (head_dims or [64, 128]) if d in (64, 128, 256)]
