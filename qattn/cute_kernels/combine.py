"""Split-KV combine: merge per-split partial outputs with their log-sum-exps.

Each split s of a row wrote its normalized partial output O_s (fp32) and the natural-log LSE_s of its scores
(-inf when the split saw no key). The exact merge is

    M = max_s LSE_s,  w_s = exp(LSE_s - M),  O = sum_s w_s O_s / sum_s w_s,  LSE = M + log(sum_s w_s)

(a row that no split saw gives O = 0, LSE = -inf). One warp per (row (b, i_q, hq), 32 dims), one dim per lane:
a decode of few sequences has few rows but many splits (B1 x 128K: 32 rows, 32 splits), so the parallelism
comes from the dims and from loads of several splits in flight (the max over splits is spread over the lanes,
the weighted sum unrolled): H100, nvfp4 B1 x 128K, 32 splits: decode + combine 76.5 -> 66.1 us (one warp per row took 16.7 us to merge).
The split loop is a runtime loop, so one compiled variant serves every ``num_splits``. Launched as a programmatic
dependent of the decode (``use_pdl``; the SM90 decode signals it at its start), so the launch overlaps the decode.

Layouts (contiguous):
    out_partial (num_splits, B, Sq, Hq, D) fp32     lse_partial (num_splits, B, Hq, Sq) fp32
    out         (B, Sq, Hq, D) bf16 / f16            lse         (B, Hq, Sq) fp32
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from qattn.interface.variants import Variant, register

__all__ = ["CombineSplits", "combine_cache_key", "combine_compile_args"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_WARPS = 4


class CombineSplits:
    """``CombineSplits(head_dim, "bf16")``: one compiled variant per (head_dim, output dtype)."""

    def __init__(self, head_dim: int, out_dtype: str):
        if head_dim % 32:
            raise ValueError(f"head_dim: the combine kernel needs a multiple of 32, got {head_dim}")
        if out_dtype not in ("bf16", "f16"):
            raise ValueError(f"out_dtype: expected 'bf16' or 'f16', got {out_dtype!r}")
        self.D = head_dim
        self.out_dtype = cutlass.BFloat16 if out_dtype == "bf16" else cutlass.Float16
        self.key = ("combine", head_dim, out_dtype)

    @cute.jit
    def __call__(self, op_addr: Int64, lp_addr: Int64, o_addr: Int64, lse_addr: Int64,
                 batch: Int32, seqlen_q: Int32, num_heads: Int32, num_splits: Int32, stream: cuda.CUstream):
        num_warps = batch * seqlen_q * num_heads * (self.D // 32)
        self.kernel(op_addr, lp_addr, o_addr, lse_addr, batch, seqlen_q, num_heads, num_splits).launch(
            grid=((num_warps + _WARPS - 1) // _WARPS, 1, 1), block=(32 * _WARPS, 1, 1), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, op_addr: Int64, lp_addr: Int64, o_addr: Int64, lse_addr: Int64,
               batch: Int32, seqlen_q: Int32, num_heads: Int32, num_splits: Int32):
        D = self.D
        C = D // 32  # 32-dim chunks of a row: one warp each
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        wid = bidx * _WARPS + tidx // 32
        R = wid // C  # row = (b * Sq + i_q) * Hq + hq
        dim = (wid % C) * 32 + lane
        num_rows = batch * seqlen_q * num_heads
        gmem = cute.AddressSpace.gmem
        mOp = cute.make_tensor(cute.make_ptr(Float32, op_addr, gmem, assumed_align=4),
                               cute.make_layout(num_splits * num_rows * D))
        mLp = cute.make_tensor(cute.make_ptr(Float32, lp_addr, gmem, assumed_align=4),
                               cute.make_layout(num_splits * num_rows))
        mO = cute.make_tensor(cute.make_ptr(self.out_dtype, o_addr, gmem, assumed_align=2),
                              cute.make_layout(num_rows * D))
        mL = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4), cute.make_layout(num_rows))
        # Programmatic dependent launch: the decode lets this grid start early (its CTAs wait here, already
        # resident, instead of being launched after the decode ends); wait returns once the decode grid has
        # completed and its partial outputs are visible. Without a programmatic predecessor it returns at once.
        cute.arch.griddepcontrol_wait()
        if R < num_rows:
            b = R // (seqlen_q * num_heads)
            rem = R % (seqlen_q * num_heads)
            i_q = rem // num_heads
            hq = rem % num_heads
            lrow = (b * num_heads + hq) * seqlen_q + i_q  # the (B, Hq, Sq) index of this row

            st = cute.make_rmem_tensor((3,), Float32)  # [M, L, acc]; memory keeps the loops simple
            # the max over splits: lanes take splits lane, lane + 32, ... (all loads in flight at once)
            st[0] = Float32(-math.inf)
            for s0 in cutlass.range(0, num_splits, 32, unroll=1):
                s = s0 + lane
                if s < num_splits:
                    st[0] = cute.arch.fmax(st[0], mLp[s * num_rows + lrow])
            M = cute.arch.warp_reduction(st[0], cute.arch.fmax)
            M_use = Float32(cutlass.select_(M == Float32(-math.inf), Float32(0.0), M))
            st[1] = Float32(0.0)
            st[2] = Float32(0.0)
            # unrolled: the loads of several splits are in flight together (a row's splits are few hundred
            # bytes apart, but each load waits ~1 us on an idle GPU: B1 x 128K has 32 rows and 32 splits)
            for s in cutlass.range(num_splits, unroll=8):
                w = cute.math.exp2((mLp[s * num_rows + lrow] - M_use) * Float32(_LOG2E), fastmath=True)
                st[1] = st[1] + w
                st[2] = st[2] + w * mOp[(s * num_rows + R) * D + dim]
            L = st[1]
            has = L > Float32(0.0)
            inv = Float32(cutlass.select_(has, Float32(1.0) / L, Float32(0.0)))
            mO[R * D + dim] = (st[2] * inv).to(self.out_dtype)
            if dim == 0:
                mL[lrow] = Float32(cutlass.select_(has, M_use + cute.math.log(L, fastmath=True), Float32(-math.inf)))


def combine_cache_key(arch: str, comb: CombineSplits) -> tuple:
    """The compile-cache key of a combine variant (the launcher's and ``qattn-warmup``'s)."""
    return (arch,) + comb.key


def combine_compile_args() -> list:
    """Placeholder arguments of :meth:`CombineSplits.__call__` to compile without a GPU."""
    return [Int64(0)] * 4 + [Int32(1)] * 4 + [cute.runtime.make_fake_stream()]


@register("combine")
def _combine_variants(arch: str, head_dims=None, q_dtypes=None, **_):
    """The split-KV combine of the SM90 decode launcher: one variant per (head_dim, output dtype)."""
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm90.decode_config import HEAD_DIMS

    if arch not in ("sm_90a", "sm_100a"):  # the SM90 and SM100 decode launchers use it
        return []
    out = []
    for d in [x for x in (head_dims or HEAD_DIMS) if x in HEAD_DIMS]:
        for qd in q_dtypes or ["bf16"]:
            comb = CombineSplits(d, qd)
            build = (lambda comb=comb: compile_for_arch(comb, *combine_compile_args(), arch=arch,
                                                        keep_ptx=False)[0])
            out.append(Variant("combine", combine_cache_key(arch, comb), f"D{d} out {qd}", build))
    return out
