"""V prepass of the FP8 P x V prefill (CuTe-DSL): V (B, Sk, Hkv, D) bf16/fp16 -> V^T E4M3 + per-channel scales.

Output format (the exact reference is :func:`qattn.quant.v_fp8.quantize_v_fp8_reference`):

* ``v_scale`` fp32 (B, Hkv, D): ``amax / 448`` (``div.rn.f32``) with ``amax = max |v|`` over the sequence's
  tokens of one (batch, kv head, channel); ``inv = 1 / v_scale`` (``div.rn.f32``), only of a normal fp32, else 0.
* ``vt`` E4M3 bytes (B, Hkv, D, Sk_pad), ``Sk_pad = ceil(Sk / 128) * 128``: ``e4m3(v * inv)`` (``mul.rn``, then
  ``cvt.rn.satfinite``: RNE, saturating at 448), tokens contiguous (the K-major B operand FP8 wgmma needs), padding
  tokens 0, and tokens **permuted inside every group of 32**: stored position ``16h + 4t + 2a + c`` holds token
  ``16h + 8a + 2t + c`` (``key_permutation``), the order in which the attention kernel packs P into the 8-bit
  wgmma A fragments without moving bytes between lanes (see ``prefill_int8.QKInt8PrefillSm90._store_p``).

Launches on the stream (one read of V each for the first and the last):

1. :class:`VAmaxPartial`, grid ``(num_chunks, Hkv, B)``: per chunk of tokens, per channel amax -> fp32
   ``partial`` (B, Hkv, num_chunks, D). A thread owns 8 channels (16-byte loads), rows ``rows_per_pass`` apart,
   combined over the CTA in shared memory (max is exact and order-free: deterministic).
   :class:`~qattn.cute_kernels.sm90.chunk_reduce.ChunkReduce` then folds the chunks into one amax per channel.
2. :class:`VFp8TransposeQuant`, grid ``(Sk_pad / 128, Hkv, B)``: the first ``D`` threads fold the partials into
   the channel's scale and inverse (the CTA of tile 0 writes ``v_scale``); the 128 x D tile is loaded with
   16-byte loads into shared memory (rows past Sk are zeros), then each thread produces 16 consecutive stored
   bytes of one channel (16 shared loads, 4 x 2 cvt.rn.satfinite.e4m3x2.f32, one 16-byte store); a warp covers
   32 channels of the same 16 positions (conflict-free shared reads).

Programmatic dependent launches (``pdl``): the fold and the transpose kernel are launched as dependents of the
kernel before them (the amax kernel triggers at its start; the transpose kernel loads its V tile before it waits
for the partials); in ``flash_attn_func`` the amax kernel is one too, of the K prepass's last kernel (which does
not write V), and waits for it after its V loads and before its stores, so the kernels after it still see the K
prepass done. No kernel here writes global memory before its wait: a buffer freed on the host while a kernel
before still reads it may be the one a dependent writes (the caching allocator reuses memory in stream order).

Varlen (``varlen=True``, compile time): V is the packed (total_k, Hkv, D) tensor (batch stride 0), grid z = the
sequence, whose rows ``cu_seqlens_k[b] ..`` each CTA reads from ``cu_addr``; the grid is sized for the longest
sequence (chunks / tiles past a shorter one's end read nothing and store no V^T, but tile 0 always computes and
writes the sequence's scales); V^T goes to the sequence's region at key offset ``32 ceil(cu[b] / 32) + 160 b``
of the (Hkv, D, vt_keys) output (:mod:`qattn.quant.v_fp8`).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.kv_insert import bf16x2_to_f32x2, f32x4_to_e4m3x4, mul_rn
from qattn.cute_kernels.sm90.qk_int8_quant import div_rn
from qattn.interface.variants import Variant, cache_for, register
from qattn.quant import v_fp8 as vt_layout  # the varlen V^T layout (where each sequence's region starts)

__all__ = ["VAmaxPartial", "VFp8TransposeQuant", "V_TILE", "E4M3_MAX", "key_perm_offset", "amax_placeholder_args",
           "transpose_placeholder_args", "compiled_amax", "compiled_transpose"]

KIND_AMAX = "v_fp8_amax"
KIND_TRANSPOSE = "v_fp8_transpose"
V_TILE = 128  # tokens per CTA of the transpose = the attention kernel's tile_n (Sk is padded to it)
E4M3_MAX = 448.0
UNROLL = 8
_FP32_MIN_NORMAL = 2.0**-126
_THREADS = 256


def key_perm_offset(e: int) -> int:
    """Token (within its 16-aligned half of a 32-group) stored at position ``e`` (0..15) of that half:
    e = 4t + 2a + c holds token 8a + 2t + c."""
    t, a, c = e // 4, (e // 2) % 2, e % 2
    return 8 * a + 2 * t + c


def _gptr(dtype, addr, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def _widen(word, in_bf16: bool):
    return bf16x2_to_f32x2(word) if in_bf16 else fp4.f16x2_to_f32x2(word)


@cute.jit
def _sequence(varlen: cutlass.Constexpr, cu_addr: Int64, b: Int32, seqlen: Int32):
    """(first row, length) of sequence ``b``: (0, seqlen) when dense (batch stride), from cu_seqlens when varlen."""
    start = Int32(0)
    if cutlass.const_expr(varlen):
        cu = cute.make_tensor(_gptr(Int32, cu_addr, 4), cute.make_layout(2 ** 30))
        start = cu[b]
        seqlen = cu[b + 1] - start
    return start, seqlen


class VAmaxPartial:
    """fp32 per-chunk channel amax of V (B, S, H, D) bf16/fp16 (dense, contiguous last dim, strides given)."""

    def __init__(self, head_dim: int, in_bf16: bool = True, varlen: bool = False):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim: the V FP8 prepass supports 64 and 128, got {head_dim}")
        self.head_dim = head_dim
        self.in_bf16 = bool(in_bf16)
        self.varlen = bool(varlen)
        self.threads_per_row = head_dim // 8
        self.threads = max(128, head_dim)
        self.rows_per_pass = self.threads // self.threads_per_row
        self.rows_per_step = self.rows_per_pass * UNROLL

    @property
    def key(self) -> tuple:
        return ("bf16" if self.in_bf16 else "fp16", self.head_dim) + (("varlen",) if self.varlen else ())

    @cute.jit
    def __call__(self, x_addr: Int64, cu_addr: Int64, partial_addr: Int64, batch: Int32, seqlen: Int32,
                 num_heads: Int32, num_chunks: Int32, chunk_rows: Int32, stride_b: Int64, stride_s: Int64,
                 stride_h: Int64, pdl: Int32, stream: cuda.CUstream):
        """``pdl`` (0 / 1): launched as a programmatic dependent of the kernel before it, which must not write V
        (``flash_attn_func``: the K prepass's last kernel): this grid reads V while that one ends, and waits for
        it (``griddepcontrol.wait``) before it writes anything, so that whatever waits for this grid waits for
        both, and its stores cannot land in memory the kernels before still use (torch's caching allocator
        recycles a freed buffer for the next allocation in stream order, which a programmatic dependent does not
        keep).
        Varlen: ``batch`` = sequences, ``seqlen`` = the longest, ``cu_addr`` = cu_seqlens_k (unused when dense)."""
        self.kernel(x_addr, cu_addr, partial_addr, seqlen, num_heads, num_chunks, chunk_rows, stride_b, stride_s,
                    stride_h).launch(grid=(num_chunks, num_heads, batch), block=(self.threads, 1, 1), stream=stream,
                                     use_pdl=pdl)

    @cute.kernel
    def kernel(self, x_addr: Int64, cu_addr: Int64, partial_addr: Int64, seqlen: Int32, num_heads: Int32,
               num_chunks: Int32, chunk_rows: Int32, stride_b: Int64, stride_s: Int64, stride_h: Int64):
        D, TPR, RPP = self.head_dim, self.threads_per_row, self.rows_per_pass
        # the fold of the partials (launched with pdl) may be scheduled now: it waits for this grid's end
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, b = cute.arch.block_idx()
        part = tidx % TPR
        rip = tidx // TPR
        start, seqlen = _sequence(self.varlen, cu_addr, b, seqlen)
        base = (x_addr + (Int64(b) * stride_b + Int64(start) * stride_s + Int64(head) * stride_h) * Int64(2)
                + Int64(part * 16))
        begin = chunk * chunk_rows
        end = begin + chunk_rows
        if end > seqlen:
            end = seqlen

        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        acc = cute.make_rmem_tensor((8,), Float32)
        acc.fill(Float32(0.0))
        rX = cute.make_rmem_tensor((4, UNROLL), Uint32)
        for step in cutlass.range(begin, end, self.rows_per_step, unroll=1):
            rX.fill(Uint32(0))  # rows past the end give |0|
            for u in cutlass.range_constexpr(UNROLL):
                row = step + u * RPP + rip
                if row < end:
                    src = base + Int64(row) * stride_s * Int64(2)
                    cute.copy(vec128, cute.make_tensor(_gptr(Uint32, src, 16), cute.make_layout(4)), rX[None, u])
            for u in cutlass.range_constexpr(UNROLL):
                for w in cutlass.range_constexpr(4):
                    lo, hi = _widen(rX[w, u], self.in_bf16)
                    acc[2 * w] = cute.arch.fmax(acc[2 * w], cute.arch.fmax(lo, -lo))
                    acc[2 * w + 1] = cute.arch.fmax(acc[2 * w + 1], cute.arch.fmax(hi, -hi))

        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((D, RPP), stride=(1, D)), byte_alignment=16)
        for i in cutlass.range_constexpr(8):
            sAcc[part * 8 + i, rip] = acc[i]
        cute.arch.sync_threads()
        # ``pdl``: the kernels before (which wrote nothing this grid reads) are complete from here on, so the
        # stores below cannot hit a buffer they still read that the allocator handed to ``partial``; the kernels
        # after this one wait for this grid only (a no-op in a plain launch)
        cute.arch.griddepcontrol_wait()
        if tidx < D:
            total = Float32(0.0)
            for r in cutlass.range_constexpr(RPP):
                total = cute.arch.fmax(total, sAcc[tidx, r])
            bh = Int64(b) * Int64(num_heads) + Int64(head)
            row_addr = partial_addr + (bh * Int64(num_chunks) + Int64(chunk)) * Int64(D * 4)
            mOut = cute.make_tensor(_gptr(Float32, row_addr, 4), cute.make_layout(D))
            mOut[tidx] = total


class VFp8TransposeQuant:
    """Scales from the amax partials, then E4M3 V^T tiles (128 tokens x D channels per CTA); module docstring."""

    def __init__(self, head_dim: int, in_bf16: bool = True, varlen: bool = False):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim: the V FP8 prepass supports 64 and 128, got {head_dim}")
        self.head_dim = head_dim
        self.in_bf16 = bool(in_bf16)
        self.varlen = bool(varlen)
        self.dtype = BFloat16 if in_bf16 else Float16
        self.threads = _THREADS
        self.threads_per_row = head_dim // 8
        self.rows_per_pass = self.threads // self.threads_per_row
        self.passes = V_TILE // self.rows_per_pass
        self.items = head_dim * (V_TILE // 16) // self.threads  # (channel, 16 positions) per thread

    @property
    def key(self) -> tuple:
        return ("bf16" if self.in_bf16 else "fp16", self.head_dim, V_TILE) + (("varlen",) if self.varlen else ())

    @cute.jit
    def __call__(self, x_addr: Int64, cu_addr: Int64, partial_addr: Int64, vt_addr: Int64, scale_addr: Int64,
                 batch: Int32, seqlen: Int32, num_heads: Int32, num_chunks: Int32, num_tiles: Int32, vt_keys: Int32,
                 stride_b: Int64, stride_s: Int64, stride_h: Int64, pdl: Int32, stream: cuda.CUstream):
        """``pdl`` (0 / 1): launched as a programmatic dependent of the kernel that wrote ``partial`` (the amax
        or fold kernel): this grid loads its V tile while that one ends and waits before reading the partials.
        ``vt_keys``: keys per (head, channel) row of the output (dense: ``num_tiles * 128``). Varlen: ``batch`` =
        sequences, ``seqlen`` = the longest, ``cu_addr`` = cu_seqlens_k (unused when dense)."""
        self.kernel(x_addr, cu_addr, partial_addr, vt_addr, scale_addr, seqlen, num_heads, num_chunks, vt_keys,
                    stride_b, stride_s, stride_h).launch(grid=(num_tiles, num_heads, batch), block=(self.threads, 1, 1),
                                               stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, x_addr: Int64, cu_addr: Int64, partial_addr: Int64, vt_addr: Int64, scale_addr: Int64,
               seqlen: Int32, num_heads: Int32, num_chunks: Int32, vt_keys: Int32, stride_b: Int64, stride_s: Int64,
               stride_h: Int64):
        D, TPR, RPP = self.head_dim, self.threads_per_row, self.rows_per_pass
        # FP8 P.V: the attention kernel after this one may start early (see ``qk_int8_quant``'s kernel)
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, b = cute.arch.block_idx()
        bh = Int64(b) * Int64(num_heads) + Int64(head)
        row0 = tile * V_TILE
        start, seqlen = _sequence(self.varlen, cu_addr, b, seqlen)
        # V^T rows: (batch, head, channel) dense; varlen (head, channel), the sequence's region from vt_off on
        vt_bh, vt_off = bh, Int64(0)
        if cutlass.const_expr(self.varlen):
            vt_bh = Int64(head)
            vt_off = Int64(vt_layout.varlen_vt_offset(start, b))
        # varlen grids are sized for the longest sequence: a tile past this one's end stores nothing (tile 0
        # always runs: it writes the scales, and for an empty sequence one zero tile inside its gap)
        stores = (row0 < seqlen) | (tile == 0)

        # ---- the tile: 16-byte loads (all in flight), rows past the sequence are zeros
        part = tidx % TPR
        rip = tidx // TPR
        base = (x_addr + (Int64(b) * stride_b + Int64(start) * stride_s + Int64(head) * stride_h) * Int64(2)
                + Int64(part * 16))
        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        rX = cute.make_rmem_tensor((4, self.passes), Uint32)
        rX.fill(Uint32(0))
        for p in cutlass.range_constexpr(self.passes):
            row = row0 + p * RPP + rip
            if row < seqlen:
                src = base + Int64(row) * stride_s * Int64(2)
                cute.copy(vec128, cute.make_tensor(_gptr(Uint32, src, 16), cute.make_layout(4)), rX[None, p])

        # ``pdl``: the partials of the kernel before are read only from here on (a no-op in a plain launch)
        cute.arch.griddepcontrol_wait()

        smem = cutlass.memory.SmemAllocator()
        sInv = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
        # the tile as 32-bit words: (row, word) with D / 2 words per row
        sX = smem.allocate_tensor(Uint32, cute.make_layout((V_TILE, D // 2), stride=(D // 2, 1)), byte_alignment=16)
        if stores:  # (CTA-uniform) varlen: nothing to do past a sequence's end, not even its scales
            self._scales_and_tile(tidx, tile, bh, partial_addr, scale_addr, num_chunks, sInv, sX, rX, part, rip)
            # ---- V^T: thread item = (channel c, 16 stored positions), 16 bytes out
            for k in cutlass.range_constexpr(self.items):
                item = tidx + k * self.threads
                c = item % D
                chunk = item // D  # stored positions [16 chunk, 16 chunk + 16) of the tile
                inv = sInv[c]
                vals = []
                for e in cutlass.range_constexpr(16):
                    lo, hi = _widen(sX[chunk * 16 + key_perm_offset(e), c // 2], self.in_bf16)
                    vals.append(mul_rn(cutlass.select_(c % 2 == 1, hi, lo), inv))
                out = cute.make_rmem_tensor((4,), Uint32)
                for w in cutlass.range_constexpr(4):
                    out[w] = f32x4_to_e4m3x4(vals[4 * w], vals[4 * w + 1], vals[4 * w + 2], vals[4 * w + 3])
                dst = vt_addr + (vt_bh * Int64(D) + Int64(c)) * Int64(vt_keys) + vt_off + Int64(row0 + chunk * 16)
                cute.copy(vec128, out, cute.make_tensor(_gptr(Uint32, dst, 16), cute.make_layout(4)))

    @cute.jit
    def _scales_and_tile(self, tidx, tile, bh, partial_addr, scale_addr, num_chunks, sInv, sX, rX, part, rip):
        """The channels' inverse scales into ``sInv`` (every CTA of a head computes the same values from the
        partials; tile 0 writes the scales) and this CTA's V tile into ``sX``, then a CTA barrier."""
        D, RPP = self.head_dim, self.rows_per_pass
        if tidx < D:
            mPart = cute.make_tensor(_gptr(Float32, partial_addr + bh * Int64(num_chunks * D * 4), 4),
                                     cute.make_layout((D, num_chunks), stride=(1, D)))
            amax = Float32(0.0)
            for c in cutlass.range(num_chunks, unroll=1):
                amax = cute.arch.fmax(amax, mPart[tidx, c])
            s = div_rn(amax, Float32(E4M3_MAX))
            inv = Float32(0.0)
            if s >= Float32(_FP32_MIN_NORMAL):
                inv = fp4.rcp_rn(s)
            sInv[tidx] = inv
            if tile == 0:
                mS = cute.make_tensor(_gptr(Float32, scale_addr + bh * Int64(D * 4), 4), cute.make_layout(D))
                mS[tidx] = s
        for p in cutlass.range_constexpr(self.passes):
            r = p * RPP + rip
            for w in cutlass.range_constexpr(4):
                sX[r, part * 4 + w] = rX[w, p]
        cute.arch.sync_threads()


def amax_placeholder_args() -> tuple:
    return ((Int64(0), Int64(0), Int64(0)) + tuple(Int32(1) for _ in range(5)) + tuple(Int64(1) for _ in range(3))
            + (Int32(0), cute.runtime.make_fake_stream(),))


def transpose_placeholder_args() -> tuple:
    return (tuple(Int64(0) for _ in range(5)) + tuple(Int32(1) for _ in range(6)) + tuple(Int64(1) for _ in range(3))
            + (Int32(0), cute.runtime.make_fake_stream(),))


def compiled_amax(cfg: VAmaxPartial, arch: str):
    return cache_for(KIND_AMAX).get((KIND_AMAX, arch) + cfg.key, lambda: _build(cfg, arch))


def compiled_transpose(cfg: VFp8TransposeQuant, arch: str):
    return cache_for(KIND_TRANSPOSE).get((KIND_TRANSPOSE, arch) + cfg.key, lambda: _build(cfg, arch))


def _build(cfg, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    args = amax_placeholder_args() if isinstance(cfg, VAmaxPartial) else transpose_placeholder_args()
    return compile_for_arch(cfg, *args, arch=arch, keep_ptx=False)[0]


@register(KIND_AMAX)
def _amax_variants(arch: str, head_dims=None, **_):
    out = []
    for d in head_dims or [64, 128]:
        if d in (64, 128):
            for in_bf16 in (True, False):
                for varlen in (False, True):
                    cfg = VAmaxPartial(d, in_bf16, varlen)
                    out.append(Variant(KIND_AMAX, (KIND_AMAX, arch) + cfg.key,
                                       f"{'bf16' if in_bf16 else 'fp16'} D{d}{' varlen' if varlen else ''}",
                                       lambda cfg=cfg: _build(cfg, arch)))
    return out


@register(KIND_TRANSPOSE)
def _transpose_variants(arch: str, head_dims=None, **_):
    out = []
    for d in head_dims or [64, 128]:
        if d in (64, 128):
            for in_bf16 in (True, False):
                for varlen in (False, True):
                    cfg = VFp8TransposeQuant(d, in_bf16, varlen)
                    out.append(Variant(KIND_TRANSPOSE, (KIND_TRANSPOSE, arch) + cfg.key,
                                       f"{'bf16' if in_bf16 else 'fp16'} D{d}{' varlen' if varlen else ''}",
                                       lambda cfg=cfg: _build(cfg, arch)))
    return out
