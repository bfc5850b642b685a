"""Paged cache -> dense bf16 K and V (CuTe-DSL): the inverse of the insert kernel, for debugging, tests and
features that need dense KV.

Output ``(batch, max_len, num_kv_heads, head_dim)`` bf16 for K and for V, zero past each sequence's length;
equal to ``flatten_kv_reference(cache, layer, block_table, cache_seqlens).to(bfloat16)`` (the decode is exact
fp32 in the reference's order, then one RNE conversion to bf16). The recent-token ring is not overlaid (the
pages always hold every token).

Work split as in :mod:`kv_insert`: ``G = head_dim / E`` threads per output row (one (sequence, token, head)),
E = 32 (or 16) values each: payload loads of 16 (or 8) bytes, 16-byte output stores.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.kv_insert import _Side, _resolve, f32x2_to_16x2, scale_rows_tensor
from qattn.interface.variants import Variant, cache_for, register

__all__ = ["KVFlatten", "flatten_kv", "make_flatten_compile_args"]

_THREADS = 128

# $0..$3 <- $4: the 4 signed bytes of a word as exact fp32 (bfe.s32 sign-extends).
PTX_S8X4_TO_F32X4 = "{\n\t.reg .s32 t;\n\t" + "".join(
    f"bfe.s32 t, $4, {8 * j}, 8;\n\tcvt.rn.f32.s32 ${j}, t;\n\t" for j in range(4)) + "}"


@dsl_user_op
def s8x4_to_f32x4(w, *, loc=None, ip=None):
    f = T.f32()
    res = llvm.inline_asm(llvm.StructType.get_literal([f, f, f, f]), [Uint32(w).ir_value(loc=loc, ip=ip)],
                          PTX_S8X4_TO_F32X4, "=f,=f,=f,=f,r", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Float32(llvm.extractvalue(f, res, [j], loc=loc, ip=ip)) for j in range(4))


class KVFlatten:
    """Dense bf16 rows from one layer's K and V pools, for one (K format, V format, head_dim)."""

    def __init__(self, k_fmt, v_fmt, head_dim: int):
        kf, vf = _resolve(k_fmt), _resolve(v_fmt)
        kf.check_head_dim(head_dim)
        vf.check_head_dim(head_dim)
        self.head_dim = head_dim
        self.elems = 32 if head_dim % 32 == 0 else 16
        g = head_dim // self.elems
        if g & (g - 1):
            raise ValueError(f"head_dim: {head_dim} is not supported by the flatten kernel")
        self.threads_per_row = g
        self.rows_per_cta = max(1, _THREADS // g)
        self.threads = self.rows_per_cta * g
        self.out_chunks = self.elems // 8
        self.k = _Side(kf, head_dim, self.elems)
        self.v = _Side(vf, head_dim, self.elems)

    @property
    def key(self) -> tuple:
        return (self.k.fmt.key, self.v.fmt.key, self.head_dim)

    def _data_tensor(self, side, ptr, rows):
        return cute.make_tensor(ptr, cute.make_layout((side.vec, side.words // side.vec, self.threads_per_row, rows),
                                                      stride=(1, side.vec, side.words, side.row_words)))

    def _scale_tensor(self, side, ptr, rows):
        return scale_rows_tensor(side, ptr, rows, self.threads_per_row)

    def _out_tensor(self, ptr, rows):
        return cute.make_tensor(ptr, cute.make_layout((4, self.out_chunks, self.threads_per_row, rows),
                                                      stride=(1, 4, self.elems // 2, self.head_dim // 2)))

    @cute.jit
    def __call__(
        self,
        k_data: cute.Pointer, k_scale: cute.Pointer, k_gscale: cute.Pointer,
        v_data: cute.Pointer, v_scale: cute.Pointer, v_gscale: cute.Pointer,
        block_table: cute.Pointer,  # Int32 (B, max_blocks)
        seqlens: cute.Pointer,  # Int32 (B,)
        k_out: cute.Pointer,  # Uint32 view of (B, max_len, H, D) bf16, 16-byte aligned
        v_out: cute.Pointer,
        batch: Int32, max_len: Int32, max_blocks: Int32, num_heads: Int32, page_size: Int32, pool_rows: Int32,
        stream: cuda.CUstream,
    ):
        rows = batch * max_len * num_heads
        mKd = self._data_tensor(self.k, k_data, pool_rows)
        mVd = self._data_tensor(self.v, v_data, pool_rows)
        mKs = self._scale_tensor(self.k, k_scale, pool_rows)
        mVs = self._scale_tensor(self.v, v_scale, pool_rows)
        mKg = cute.make_tensor(k_gscale, cute.make_layout((num_heads,)))
        mVg = cute.make_tensor(v_gscale, cute.make_layout((num_heads,)))
        mBT = cute.make_tensor(block_table, cute.make_layout((max_blocks, batch), stride=(1, max_blocks)))
        mL = cute.make_tensor(seqlens, cute.make_layout((batch,)))
        mKo = self._out_tensor(k_out, rows)
        mVo = self._out_tensor(v_out, rows)
        grid_x = (rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mKd, mKs, mKg, mVd, mVs, mVg, mBT, mL, mKo, mVo, rows, max_len, num_heads, page_size).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mKd: cute.Tensor, mKs: cute.Tensor, mKg: cute.Tensor, mVd: cute.Tensor, mVs: cute.Tensor,
               mVg: cute.Tensor, mBT: cute.Tensor, mL: cute.Tensor, mKo: cute.Tensor, mVo: cute.Tensor,
               rows: Int32, max_len: Int32, num_heads: Int32, page_size: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        part = tidx % self.threads_per_row
        if row < rows:
            bt = row // num_heads
            head = row - bt * num_heads
            b = bt // max_len
            t = bt - b * max_len
            live = t < mL[b]
            pool_row = Int32(0)
            if live:
                blk = mBT[t // page_size, b]
                pool_row = (blk * num_heads + head) * page_size + t % page_size
            self._side(self.k, mKd, mKs, mKg, mKo, row, head, part, pool_row, live)
            self._side(self.v, mVd, mVs, mVg, mVo, row, head, part, pool_row, live)

    @cute.jit
    def _side(self, side: cutlass.Constexpr, mD: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor, mO: cute.Tensor,
              row: Int32, head: Int32, part: Int32, pool_row: Int32, live: cutlass.Boolean):
        E = self.elems
        rO = cute.make_rmem_tensor((4, self.out_chunks), Uint32)
        rO.fill(Uint32(0))
        if live:
            rP = cute.make_rmem_tensor((side.vec, side.words // side.vec), Uint32)
            ld = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * side.vec)
            for c in cutlass.range_constexpr(side.words // side.vec):
                cute.copy(ld, mD[None, c, part, pool_row], rP[None, c])
            rX = cute.make_rmem_tensor((E,), Float32)
            if cutlass.const_expr(side.kind == "bf16"):
                for w in cutlass.range_constexpr(E // 2):
                    rO[w % 4, w // 4] = rP[w % side.vec, w // side.vec]
            else:
                if cutlass.const_expr(side.kind == "fp8" or side.kind == "int8"):
                    s = mS[pool_row]
                    for w in cutlass.range_constexpr(side.words):
                        word = rP[w % side.vec, w // side.vec]
                        if cutlass.const_expr(side.kind == "fp8"):
                            h0, h1 = fp4.e4m3x4_to_f16x4(word)
                            a0, a1 = fp4.f16x2_to_f32x2(h0)
                            a2, a3 = fp4.f16x2_to_f32x2(h1)
                            rX[4 * w] = a0 * s
                            rX[4 * w + 1] = a1 * s
                            rX[4 * w + 2] = a2 * s
                            rX[4 * w + 3] = a3 * s
                        else:
                            q0, q1, q2, q3 = s8x4_to_f32x4(word)
                            rX[4 * w] = q0 * s
                            rX[4 * w + 1] = q1 * s
                            rX[4 * w + 2] = q2 * s
                            rX[4 * w + 3] = q3 * s
                else:
                    rS = cute.make_rmem_tensor((side.scales_per_thread,), Uint8)
                    cute.autovec_copy(mS[None, part, pool_row], rS)
                    g = Float32(1.0)
                    if cutlass.const_expr(side.nvfp4):
                        g = mG[head]
                    for w in cutlass.range_constexpr(side.words):
                        sb = Uint32(rS[(8 * w) // side.block])
                        halves = fp4.e2m1x8_to_f16x8(rP[w % side.vec, w // side.vec])
                        if cutlass.const_expr(side.nvfp4):
                            s2 = fp4.e4m3_to_f16x2(sb, 0)
                            for h in cutlass.range_constexpr(4):
                                lo, hi = fp4.f16x2_to_f32x2(fp4.f16x2_mul(halves[h], s2))
                                rX[8 * w + 2 * h] = lo * g
                                rX[8 * w + 2 * h + 1] = hi * g
                        else:
                            sf = fp4.ue8m0_to_f32(sb)
                            for h in cutlass.range_constexpr(4):
                                lo, hi = fp4.f16x2_to_f32x2(halves[h])
                                rX[8 * w + 2 * h] = lo * sf
                                rX[8 * w + 2 * h + 1] = hi * sf
                for w in cutlass.range_constexpr(E // 2):
                    rO[w % 4, w // 4] = f32x2_to_16x2(rX[2 * w], rX[2 * w + 1], True)
        st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        for c in cutlass.range_constexpr(self.out_chunks):
            cute.copy(st, rO[None, c], mO[None, c, part, row])


# ==================================================================================================
def _scale_ptr_type(fmt):
    if fmt.scale_block:
        return Uint8
    return Float32 if fmt.is_quantized else Uint8


def _fake_args(cfg: KVFlatten):
    def p(dt, a):
        return cute.runtime.make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=a)

    return (p(Uint32, 16), p(_scale_ptr_type(cfg.k.fmt), 4), p(Float32, 4),
            p(Uint32, 16), p(_scale_ptr_type(cfg.v.fmt), 4), p(Float32, 4),
            p(Int32, 4), p(Int32, 4), p(Uint32, 16), p(Uint32, 16)) + tuple(Int32(1) for _ in range(6)) + (
        cute.runtime.make_fake_stream(),)


def make_flatten_compile_args(k_fmt, v_fmt, head_dim: int):
    cfg = KVFlatten(k_fmt, v_fmt, head_dim)
    return cfg, _fake_args(cfg)


def _compiled(cfg: KVFlatten, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    def build():
        return compile_for_arch(cfg, *_fake_args(cfg), arch=arch, keep_ptx=False)[0]

    return cache_for("kv_flatten").get(("kv_flatten", arch) + cfg.key, build)


def flatten_kv(cache, layer: int, block_table, cache_seqlens, max_seqlen=None):
    """See :func:`qattn.interface.kv_cache_ops.flatten_kv`."""
    import torch

    from qattn.interface.variants import supported_arch
    from qattn.layouts.paged import PagedKVCache

    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    lay = cache.layer(layer)
    dev = cache.device
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise TypeError("block_table: expected a 2-d torch.int32 tensor (batch, max_blocks)")
    B, MB = block_table.shape
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or \
            tuple(cache_seqlens.shape) != (B,):
        raise TypeError(f"cache_seqlens: expected a ({B},) torch.int32 tensor")
    from qattn.interface.kv_cache_ops import _norm

    for t, nm in ((block_table, "block_table"), (cache_seqlens, "cache_seqlens")):
        if _norm(t.device) != _norm(dev):
            raise ValueError(f"{nm}: expected device {dev}, got {t.device}")
    from qattn.reference.kv_ops import check_block_table

    check_block_table(cache, block_table, cache_seqlens)  # value checks: flatten is a debugging tool
    H, D = cache.num_kv_heads, cache.head_dim
    longest = int(cache_seqlens.max()) if B else 0
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen: {max_seqlen} is shorter than the longest sequence ({longest})")
    max_len = longest if max_seqlen is None else max_seqlen
    # the kernel indexes rows (batch x max_len x heads) and the pools in 32-bit words
    if B * max_len * H * D // 2 >= 2**31 or max(cache.k_geometry.data_words, cache.v_geometry.data_words) >= 2**31:
        raise ValueError("flatten_kv: the output (batch x max_seqlen) or a pool exceeds the kernel's 32-bit "
                         "indexing; flatten fewer sequences at a time")
    if dev.type != "cuda":  # the last check (the others also run on the CPU)
        raise ValueError(f"cache: flatten_kv runs on a CUDA cache, this one is on {dev} "
                         "(use qattn.flatten_kv_reference on the CPU)")
    k_out = torch.empty((B, max_len, H, D), dtype=torch.bfloat16, device=dev)
    v_out = torch.empty_like(k_out)
    if B * max_len == 0:
        return k_out, v_out
    cfg = KVFlatten(cache.k_format, cache.v_format, D)

    def ptr(dt, t, a):
        return cute.runtime.make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=a)

    def sptr(t, fmt):
        return ptr(_scale_ptr_type(fmt), t if t is not None else k_out, 4)

    with torch.cuda.device(dev):
        arch = supported_arch(dev)
        bt, lens = block_table.contiguous(), cache_seqlens.contiguous()
        gk = lay.k_global_scale if lay.k_global_scale is not None else k_out
        gv = lay.v_global_scale if lay.v_global_scale is not None else k_out
        ptrs = (ptr(Uint32, lay.k_data, 16), sptr(lay.k_scale_pool, cfg.k.fmt), ptr(Float32, gk, 4),
                ptr(Uint32, lay.v_data, 16), sptr(lay.v_scale_pool, cfg.v.fmt), ptr(Float32, gv, 4),
                ptr(Int32, bt, 4), ptr(Int32, lens, 4), ptr(Uint32, k_out, 16), ptr(Uint32, v_out, 16))
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        _compiled(cfg, arch)(*ptrs, Int32(B), Int32(max_len), Int32(MB), Int32(H), Int32(cache.page_size),
                             Int32(cache.num_blocks * H * cache.page_size), stream)
    return k_out, v_out


@register("kv_flatten")
def _flatten_variants(arch: str, kv_formats=None, head_dims=None, **_):
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.kv_insert import INSERT_FORMATS

    out = []
    for name in [f for f in (kv_formats or INSERT_FORMATS) if f in INSERT_FORMATS]:
        for d in head_dims or [64, 128, 256]:
            cfg = KVFlatten(name, name, d)
            build = (lambda cfg=cfg: compile_for_arch(cfg, *_fake_args(cfg), arch=arch, keep_ptx=False)[0])
            out.append(Variant("kv_flatten", ("kv_flatten", arch) + cfg.key, f"{name} D{d}", build))
    return out
