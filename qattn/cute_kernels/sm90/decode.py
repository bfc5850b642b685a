"""SM90 paged decode attention that reads the quantized KV cache directly (issue 3, v0).

One CTA = one (split, kv head, m-block, sequence). The query rows of the kv head are packed into the MMA M
dimension (row r = i_q * group + h_in_group), so one pass over K/V serves the whole GQA group and every query
token; above 128 rows (up to 256: seqlen_q 16 x GQA 16) two m-blocks of 128 rows each read the same K/V.

Data path (no flatten-to-bf16 pass anywhere):

    pools (gmem) --cp.async 16 B--> smem, raw bytes, `stages` deep --LDS + dequant in registers--> mma.sync fragments

* Loads: a tile is ``tile_n`` = 64 tokens. Because pages are powers of two, a tile is either a piece of one page
  or several whole pages, and each piece is one contiguous run of payload bytes (and of scale bytes) in the pool
  (layout "HND", docs/formats.md): every thread issues 16-byte cp.async vectors at ``PoolGeometry`` offsets. The
  smem copy keeps the pool's row layout, so no shuffling happens on the way in.
* MMA: warp-level ``mma.sync.m16n8k16`` (f32 accumulate). Why not wgmma for v0: wgmma wants B in shared memory,
  so dequantized K or V would have to be written back to smem (extra smem traffic) or put in the A operand with
  tokens as M (64 tokens per instruction, which is awkward for P.V where tokens are the reduction). mma.sync takes
  both operands from registers, and because a reduction index (head_dim for QK^T, tokens for P.V) and a column
  index (tokens for QK^T, head_dim for P.V) may be permuted freely as long as both operands agree, every thread
  can own *contiguous* bytes of the packed rows:
    - QK^T  (S = Q K^T; M = query rows, N = 8 tokens, K = 16 dims): lane (g, q) needs 4 dims of token g per
      k-step; we give lane q the dims [q*D/4, (q+1)*D/4) of its token, i.e. one contiguous D/8-byte run of FP4
      payload (one 16 B load at D=128), and load Q with the same dim permutation (once, from gmem).
    - P.V   (O = P V; M = rows, K = 16 tokens, N = 8 dims): lane (g, q) needs tokens {2q, 2q+1, 2q+8, 2q+9} of
      one dim per n-tile; we give lane g the dims [g*D/8, (g+1)*D/8) of those 4 tokens (contiguous bytes again),
      decode them to f16x2 (dim pairs) and turn dim pairs into token pairs with one ``prmt`` each. Output column
      g of n-tile j is then dim g*D/8 + j; the epilogue goes through smem anyway, so the permutation is free.
    - P is the QK^T accumulator converted in registers (the usual FA2 identity), never touching smem.
* Narrow tiles (``cfg.narrow``: at most 8 packed query rows, i.e. decode with GQA <= 8, or seqlen_q x group <= 8):
  the M = 16 side of m16n8k16 would be half padding (rows 8..15) in every MMA, in the O accumulator and in the Q
  fragments. So both products run transposed, S^T = K Q^T (M = 16 tokens, N = 8 rows, K = 16 dims) and
  O^T = V^T P^T (M = 16 head dims, N = 8 rows, K = 16 tokens). The K and V fragments are unchanged (an A fragment
  is the B fragments of two tokens / two dim columns side by side), Q becomes the B operand (half the registers),
  the S^T accumulator is turned into P^T's B fragments by one ``movmatrix.trans`` per 8x8 half, and a row's
  softmax reduces over the 8 lanes of a quad column instead of the 4 of a quad. Half the MMAs, exponentials and
  O rescales, and 128 instead of 173 registers (nvfp4, D128): H100, CUDA graph, same caches and splits, nvfp4
  GQA 32/8 D128 page 128: B32x8K 134.3 -> 109.8 us, B8x32K 137.9 -> 114.1, B128x2K 154.4 -> 115.8, B1x128K
  89.6 -> 74.4; mxfp4 B32x8K 145.6 -> 121.9; fp8 195.4 -> 191.7 (memory-bound already). Nsight Compute had
  shown the wide kernel latency-bound (2 warps per scheduler, a third of the stalls on fixed-latency
  dependencies); 8 warps per CTA (QATTN_DECODE_WARPS) and more splits per SM measured slower again.
* Dequant: FP4 nibbles -> E4M3 bytes (prmt) -> f16x2 (cvt.rn.f16x2.e4m3x2) from ``common/fp4.py``; the block scale
  is one f16x2 multiply (exact for nvfp4, see fp4.f16x2_mul). fp8 -> f16 by cvt, int8 -> f16 by the exact
  "0x6400 magic" trick. Quantized operands run f16 MMAs (Q converted to f16 once); bf16 caches run bf16 MMAs.
  nvfp4 rows take the table-free even/odd decode (values x 2^-6, undone in the fp32 softmax / output scales,
  ``EVEN_ODD_FOLD``, not by a multiply per block scale), and nvfp4 V is paired into the P.V MMA's token-pair
  words while still E4M3 bytes (``_v_operands``: one prmt per 4 values instead of one per 2 after the
  conversion, one scale conversion per token pair and block). Those two: bit-identical outputs, 6 % fewer
  SASS instructions per tile, H200 (SM-bound there), CUDA graph, GQA 32/8 D128: B32x8K 105.7 -> 101.5 us,
  B8x32K 108.6 -> 104.0, B128x2K 101.4 -> 97.6, B1x128K 62.5 -> 59.7, page 16 122.5 -> 114.0, D64 72.7 -> 64.2.
  Scales that do not vary along the MMA reduction are kept out of the operands and applied in fp32:
  the nvfp4 K global scale is folded into the softmax scale, the V global scale into the output, per-token
  fp8/int8 K scales multiply the fp32 scores and per-token V scales multiply P before it is rounded to f16.
* Softmax: fp32 online softmax in the log2 domain (exp2, log2(e) folded into the scale), per 16-row tile.
  Warps of one row tile that split the tokens of each tile merge their (m, l, O) in smem at the end.
* Split-KV: split s of ``num_splits`` (grid x) takes a contiguous range of whole tiles and writes its normalized
  fp32 partial O and natural-log LSE; ``combine.py`` merges them. num_splits = 1 writes the output directly.
* Recent-token window (``cfg.ring_window`` = W > 0): positions [max(0, len - W), len) of a sequence are read from
  ``ring[seq_slots[b], h, p % W]`` (bf16 / f16 rows, exactly what ``flatten_kv_reference`` overlays) and only
  positions below len - W from the pages. The tile list of a CTA is "page tiles, then ring tiles"
  (``ring_tile_n`` tokens each, loaded row by row with cp.async because p % W wraps), and splits cut that list
  into contiguous ranges as before: the ring tiles fall into the last split(s). Ring tiles run the bf16 code
  path with their own MMA type; the page-only scales stay out of them: the K global scale is folded into the
  page tiles' softmax scale only, and the V global scale, applied at the end for page-only CTAs, is instead
  multiplied into the accumulator at a CTA's first ring tile (and the epilogue then applies none).
* Attention sink (``cfg.sink_tokens`` = N > 0): positions [0, min(len, N)) are read from
  ``sink[seq_slots[b], h, p]`` (bf16 / f16 rows, as ``flatten_kv_reference`` overlays them) in one sink tile
  (``sink_tile_n`` >= N tokens, the ring tile's stage buffers and code path), and the page tiles cover
  positions [N, page_end) only (page_end = max(N, len - W), or len without a ring): they start at the
  ``tile_n``-aligned tile holding N and mask positions below N. The tile list is "page tiles, sink tile, ring
  tiles": every bf16 tile comes after every page tile, so the Q reload and the V-global-scale fold above happen
  once per CTA at its first bf16 tile, exactly as with the ring alone (the sink tile, in the split before the
  ring tiles, is one more such tile).

* Sliding window (``cfg.window``; runtime ``window_left`` / ``window_right``): row i_q sees positions
  [len - Sq + i_q - window_left, len - Sq + i_q + window_right] (the right edge with ``causal``); the tile list
  starts at the page tile holding the first query's first visible key, and each row's lower edge is one more
  compare in the score mask. With a ring or sink, each part of the list loses what lies left of the first
  query's window: page tiles from the front, the sink tile when all of it does, ring tiles from the front (the
  kept ring tiles keep their positions); every tile kind masks the rows' lower edges.

Known limits (documented, checked by the launcher where they matter):
* rows = seqlen_q * group <= 256; head_dim 64 / 128.
* MX (UE8M0) scales are applied in f16: exact for scale exponents in [-24, 13] (block amax ~ 2^-22 .. 2^16);
  outside that range values lose precision. fp8/int8 V scales go into P in f16 (subnormal below ~6e-5).
* Block ids are clamped to [0, num_blocks) in the kernel (memory safety); validating them needs a host sync and is
  the launcher's optional job.

First numbers (H100, B32 x 8K, GQA 32/8, D128, CUDA-graph timing): bf16 361 us (2.97 TB/s of real bytes, on par
with FA4's bf16 paged decode), fp8 194 us (2.85 TB/s), nvfp4 153 us (1.97 TB/s: the FP4 path is bound by the
in-register decode and the per-tile load/compute serialization, not by HBM), mxfp4 169 us (64-token tiles).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.common.softcap import capped_log2
from qattn.cute_kernels.sm90.decode_config import HEAD_DIMS, DecodeConfig, choose_config
from qattn.interface.variants import Variant, register
from qattn.layouts.formats import FORMAT_NAMES, KVFormat, kv_format

__all__ = ["DecodeSm90", "FmtInfo", "decode_cache_key", "decode_compile_args"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# FP4 page rows decoded by the table-free even/odd decode hold 2^-6 x their values (FmtInfo.even_odd)
EVEN_ODD_FOLD = 64.0


# ==================================================================================================
# Private PTX helpers (not in common/fp4.py): MMA, packing, int8 / ue8m0 -> f16, byte permutes.
# ==================================================================================================
def _asm(result_type, operands, text: str, constraints: str):
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _u(x, loc, ip):
    return Uint32(x).ir_value(loc=loc, ip=ip)


def _f(x, loc, ip):
    return Float32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def mma_16816(a, b, c, bf16: bool, *, loc=None, ip=None):
    """D = A B + C, one warp, m16n8k16, f32 accumulate. ``a``: 4 Uint32 (a0a1, a2a3, a4a5, a6a7 of the PTX
    fragment), ``b``: 2 Uint32, ``c``: 4 Float32. Returns 4 Float32."""
    t = "bf16" if bf16 else "f16"
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    ops = [_u(x, loc, ip) for x in a] + [_u(x, loc, ip) for x in b] + [_f(x, loc, ip) for x in c]
    st = llvm.StructType.get_literal([T.f32()] * 4)
    res = _asm(st, ops, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def pack_f32x2(lo, hi, bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> one f16x2 / bf16x2 word (round to nearest), ``lo`` in the low half."""
    t = "bf16x2" if bf16 else "f16x2"
    return Uint32(_asm(T.i32(), [_f(lo, loc, ip), _f(hi, loc, ip)], f"cvt.rn.{t}.f32 $0, $2, $1;", "=r,f,f"))


@dsl_user_op
def bf16x2_to_f32x2(w, *, loc=None, ip=None):
    """bf16x2 word -> (low, high) fp32, exact (a bf16 is the top half of an fp32)."""
    text = ("{\n\t.reg .b32 t;\n\tshl.b32 t, $2, 16;\n\tmov.b32 $0, t;\n\t"
            "and.b32 t, $2, 0xFFFF0000;\n\tmov.b32 $1, t;\n\t}")
    st = llvm.StructType.get_literal([T.f32(), T.f32()])
    res = _asm(st, [_u(w, loc, ip)], text, "=f,=f,r")
    return (Float32(llvm.extractvalue(T.f32(), res, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def prmt(a, b, sel: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute: output byte i = byte ``sel`` nibble i of {b, a} (a = bytes 0..3, b = 4..7)."""
    return Uint32(_asm(T.i32(), [_u(a, loc, ip), _u(b, loc, ip)], f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r"))


@dsl_user_op
def movmatrix_trans(a, *, loc=None, ip=None) -> Uint32:
    """Transpose of the warp's 8x8 16-bit matrix whose row lane/4, columns 2(lane%4) + {0, 1} this lane holds
    (the m16n8 accumulator layout of 8 rows): afterwards the lane holds row lane/4 of the transpose."""
    return Uint32(_asm(T.i32(), [_u(a, loc, ip)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r"))


# $0, $1 <- $2: 4 int8 -> two f16x2, exact. Byte x -> f16 bits 0x6400 | (x ^ 0x80) = 1024 + (x + 128), then
# subtract 1152 (0x6480): both steps exact in f16 (integers below 2048).
_PTX_I8X4_TO_F16X4 = (
    "{\n\t.reg .b32 x, p0, p1, c;\n\t"
    "xor.b32 x, $2, 0x80808080;\n\t"
    "prmt.b32 p0, x, 0x64646464, 0x4140;\n\t"
    "prmt.b32 p1, x, 0x64646464, 0x4342;\n\t"
    "mov.b32 c, 0x64806480;\n\t"
    "sub.rn.f16x2 $0, p0, c;\n\t"
    "sub.rn.f16x2 $1, p1, c;\n\t}"
)


@dsl_user_op
def i8x4_to_f16x4(w, *, loc=None, ip=None):
    st = llvm.StructType.get_literal([T.i32(), T.i32()])
    res = _asm(st, [_u(w, loc, ip)], _PTX_I8X4_TO_F16X4, "=r,=r,r")
    return (Uint32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Uint32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def f32_to_f16x2_bcast(x, *, loc=None, ip=None) -> Uint32:
    """fp32 -> f16 (RN, saturating to inf as cvt does) in both halves of a word."""
    text = "{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, $1;\n\tmov.b32 $0, {h, h};\n\t}"
    return Uint32(_asm(T.i32(), [_f(x, loc, ip)], text, "=r,f"))


@dsl_user_op
def lg2_approx(x, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_f(x, loc, ip)], "lg2.approx.f32 $0, $1;", "=f,f"))


@dsl_user_op
def ex2_approx(x, *, loc=None, ip=None) -> Float32:
    # Pure (no side effects) so the compiler may schedule it freely; ex2(-inf) = +0.
    return Float32(_asm(T.f32(), [_f(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f"))


def _sel(cond, a, b, ty):
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def _fmax(a, b):
    return cute.arch.fmax(Float32(a), Float32(b))


# ==================================================================================================
# Format description (compile time)
# ==================================================================================================
def even_odd_dim(j: int) -> int:
    """Dim (within a lane's slice) of P.V output column ``j`` when V words come in the even/odd order of
    ``fp4.e2m1x8_to_f16x8_scaled_even_odd``: word j // 2 of each 8 dims holds (d0,d2), (d4,d6), (d1,d3), (d5,d7),
    and column j is its low (j even) or high (j odd) half."""
    i, hi = j // 2, j % 2
    return 8 * (i // 4) + ((2, 6, 3, 7) if hi else (0, 4, 1, 5))[i % 4]


class FmtInfo:
    """What the kernel needs to know about one of the K / V formats."""

    def __init__(self, fmt: KVFormat, head_dim: int):
        self.fmt = fmt
        self.kind = {"bf16": "bf16", "e4m3": "fp8", "int8": "int8", "e2m1": "fp4"}[fmt.payload]
        self.rb = fmt.payload_bytes(head_dim)  # payload bytes per token-head row
        self.srb = fmt.scale_bytes(head_dim)  # scale bytes per row (0: none)
        self.scale = ("none" if fmt.scale_dtype is None else
                      "row" if fmt.scale_block is None else fmt.scale_dtype)  # "none" | "row" | "e4m3" | "ue8m0"
        self.sb = fmt.scale_block or 0
        self.nscales = fmt.num_scales(head_dim)
        self.has_global = fmt.has_global_scale
        self.bf16 = self.kind == "bf16"  # MMA operand type: bf16 for bf16 caches, f16 for every quantized one
        self.row_words = self.rb // 4
        # nvfp4 rows can take the table-free decode (fp4.e2m1x8_to_f16x8_scaled_even_odd: 7 instead of 9 integer
        # instructions per 8 values; this loop is bound by the integer pipe), whose element order is even dims,
        # then odd, per 8; its 2^-6 goes into the block scale (x 64, exact in f16). MX scales stay on the table
        # decode: x 64 would shrink the exact f16 range of a 2^e scale.
        self.even_odd = self.kind == "fp4" and self.scale == "e4m3"


# ==================================================================================================
# The kernel
# ==================================================================================================
class DecodeSm90:
    """Paged decode attention over a quantized cache, SM90, one compiled variant per :class:`DecodeConfig`.

    ``__call__`` (host, ``@cute.jit``) takes raw device addresses (Int64) of every tensor, the runtime sizes and
    a CUDA stream, and launches ``kernel`` on grid (num_splits, num_kv_heads * m_blocks, batch).

    Tensors (all contiguous):
        q          (B, Sq, Hq, D) bf16 / f16
        k/v data   (num_blocks, H, page, row_elems), k/v scales (num_blocks, H, page[, nscales]), global (H,) fp32
        block_table (B, max_blocks) int32, cache_seqlens (B,) int32
        k/v ring   (max_seqs, H, W, D) bf16 / f16, seq_slots (B,) int32     (ring variants only; else unused)
        k/v sink   (max_seqs, H, N, D) bf16 / f16, indexed by seq_slots     (sink variants only; else unused)
        out        (B, Sq, Hq, D) q dtype        | split: out_partial (num_splits, B, Sq, Hq, D) fp32
        lse        (B, Hq, Sq) fp32              | split: lse_partial (num_splits, B, Hq, Sq) fp32
    """

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.k = FmtInfo(cfg.k_fmt, self.D)
        self.v = FmtInfo(cfg.v_fmt, self.D)
        self.q_bf16 = cfg.q_dtype == "bf16"
        self.out_dtype = cutlass.BFloat16 if self.q_bf16 else cutlass.Float16
        self.T = cfg.num_threads
        self.ring = cfg.ring_window > 0
        self.sink = cfg.sink_tokens > 0
        self.unquantized = self.ring or self.sink  # any bf16 / f16 tiles (ring or sink) after the page tiles
        # nvfp4 V rows in the even/odd order of the table-free decode: P.V output column j then holds dim
        # even_odd_dim(j) of the lane's slice. Not with ring / sink tiles, whose 16-bit V rows accumulate into the
        # same registers in natural order.
        self.v_even_odd = self.v.even_odd and not self.unquantized
        # ring and sink rows are plain 16-bit rows: the "bf16" code path, with the cache dtype's own MMA type
        self.r = FmtInfo(kv_format("bf16"), self.D)
        self.r.bf16 = cfg.ring_dtype == "bf16"
        # smem: raw stage buffers (Uint32 vectors of 16 B) + the epilogue's merge buffers. Page buffers
        # (kd, ks, vd, vs) and ring buffers (rkd, rvd; the sink tile's too) are a union within a stage: a stage
        # holds one tile.
        self.vec, self.vec_off = {}, {}
        off = 0
        for name, rb in (("kd", self.k.rb), ("ks", self.k.srb), ("vd", self.v.rb), ("vs", self.v.srb)):
            self.vec[name] = cfg.tile_n * rb // 16  # 16-byte vectors per stage (0: no such buffer)
            self.vec_off[name] = off
            off += self.vec[name]
        page_vecs, off = off, 0
        if self.unquantized:
            for name in ("rkd", "rvd"):
                self.vec[name] = cfg.ring_tile_n * self.r.rb // 16
                self.vec_off[name] = off
                off += self.vec[name]
        self.stage_vecs = max(page_vecs, off)
        nbytes = 16 * self.stage_vecs * cfg.stages
        self.rw = 8 if cfg.narrow else 16  # rows of one warp's slot in the merge buffers
        nbytes += 4 * cfg.num_warps * self.rw * self.D + 2 * 4 * cfg.num_warps * self.rw
        self.smem_bytes = nbytes + 16 * 8  # alignment slack

    def buffer_placement(self) -> dict:
        """``{buffer: (base, stage_stride)}`` in 16-byte vectors of the stage area, for every non-empty buffer.

        With a ring or a sink, page buffers (kd, ks, vd, vs) and 16-bit buffers (rkd, rvd) are a union inside
        each stage (buffer-major offsets, stage stride ``stage_vecs``): a stage holds one tile of either kind.
        Without them each buffer keeps its stages contiguous (base ``stages * offset``, stage stride its size),
        the layout the page-only kernel was tuned with (H100 A/B, nvfp4 GQA 32/8 D128 page 128: the union layout
        for every cache cost 236 vs 183 us at B8 x 32K and 168 vs 155 us at B128 x 2K)."""
        S = self.cfg.stages
        return {name: ((self.vec_off[name], self.stage_vecs) if self.unquantized else (S * self.vec_off[name], n))
                for name, n in self.vec.items() if n > 0}

    # ----------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_addr: Int64, kd_addr: Int64, ks_addr: Int64, kg_addr: Int64,
        vd_addr: Int64, vs_addr: Int64, vg_addr: Int64,
        bt_addr: Int64, sl_addr: Int64, o_addr: Int64, lse_addr: Int64,
        rk_addr: Int64, rv_addr: Int64, ss_addr: Int64, sk_addr: Int64, sv_addr: Int64,
        batch: Int32, seqlen_q: Int32, num_kv_heads: Int32, max_blocks: Int32, num_blocks: Int32,
        num_splits: Int32, max_seqs: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
        stream: cuda.CUstream,
    ):
        """``window_left`` / ``window_right``: the sliding window's edges (``cfg.window``; unread otherwise)."""
        self.kernel(q_addr, kd_addr, ks_addr, kg_addr, vd_addr, vs_addr, vg_addr, bt_addr, sl_addr, o_addr,
                    lse_addr, rk_addr, rv_addr, ss_addr, sk_addr, sv_addr, batch, seqlen_q, num_kv_heads,
                    max_blocks, num_blocks, num_splits, max_seqs, scale_log2, window_left, window_right).launch(
                        grid=(num_splits, num_kv_heads * self.cfg.m_blocks, batch), block=(self.T, 1, 1),
                        smem=self.smem_bytes, stream=stream)

    # ----------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        q_addr: Int64, kd_addr: Int64, ks_addr: Int64, kg_addr: Int64,
        vd_addr: Int64, vs_addr: Int64, vg_addr: Int64,
        bt_addr: Int64, sl_addr: Int64, o_addr: Int64, lse_addr: Int64,
        rk_addr: Int64, rv_addr: Int64, ss_addr: Int64, sk_addr: Int64, sv_addr: Int64,
        batch: Int32, seqlen_q: Int32, num_kv_heads: Int32, max_blocks: Int32, num_blocks: Int32,
        num_splits: Int32, max_seqs: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
    ):
        cfg = self.cfg
        D, G, MT, TG, TN = self.D, cfg.group, cfg.row_tiles, cfg.token_groups, cfg.tile_n
        TR, W, N = cfg.ring_tile_n, cfg.ring_window, cfg.sink_tokens
        tidx, _, _ = cute.arch.thread_idx()
        split, hm, b = cute.arch.block_idx()
        if cutlass.const_expr(cfg.split):
            # the combine kernel (launched with programmatic dependent launch) may be scheduled now: it waits
            # for this grid's completion itself (griddepcontrol.wait), so only its launch latency overlaps
            cute.arch.griddepcontrol_launch_dependents()
        h = hm // cfg.m_blocks
        row0 = (hm % cfg.m_blocks) * (MT * 16)  # first packed row of this m-block
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        q4 = lane % 4
        mt = warp % MT
        tg = warp // MT
        Hq = num_kv_heads * G
        rows = seqlen_q * G
        gmem = cute.AddressSpace.gmem

        mQ = cute.make_tensor(cute.make_ptr(Uint32, q_addr, gmem, assumed_align=4),
                              cute.make_layout(batch * seqlen_q * Hq * (D // 2)))
        mBT = cute.make_tensor(cute.make_ptr(Int32, bt_addr, gmem, assumed_align=4),
                               cute.make_layout(batch * max_blocks))
        mSL = cute.make_tensor(cute.make_ptr(Int32, sl_addr, gmem, assumed_align=4), cute.make_layout(batch))
        kv_len = mSL[b]

        # ---- shared memory -------------------------------------------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        S = cfg.stages
        SV = self.stage_vecs
        stage_buf = smem.allocate_tensor(Uint32, cute.make_layout((4, SV, S), stride=(1, 4, 4 * SV)),
                                         byte_alignment=16)
        place = self.buffer_placement()
        bufs, sstride = {}, {}
        for name, n in self.vec.items():
            if cutlass.const_expr(n > 0):  # a 16-byte aligned slice of every stage
                base, sstride[name] = place[name]
                bufs[name] = cute.make_tensor(stage_buf.iterator + 4 * base,
                                              cute.make_layout((4, n, S), stride=(1, 4, 4 * sstride[name])))
        RW = self.rw
        sO = smem.allocate_tensor(Float32, cute.make_layout(cfg.num_warps * RW * D), byte_alignment=16)
        sM = smem.allocate_tensor(Float32, cute.make_layout(cfg.num_warps * RW), byte_alignment=16)
        sL = smem.allocate_tensor(Float32, cute.make_layout(cfg.num_warps * RW), byte_alignment=16)
        # word / byte / fp32 views of the stage buffers for the compute side: (index in stage, stage)
        views = {}
        for name, n in self.vec.items():
            if cutlass.const_expr(n > 0):
                base_ptr = bufs[name].iterator
                st = sstride[name]
                views[name + "_w"] = cute.make_tensor(base_ptr, cute.make_layout((4 * n, S), stride=(1, 4 * st)))
                views[name + "_b"] = cute.make_tensor(cute.recast_ptr(base_ptr, dtype=Uint8),
                                                      cute.make_layout((16 * n, S), stride=(1, 16 * st)))
                views[name + "_f"] = cute.make_tensor(cute.recast_ptr(base_ptr, dtype=Float32),
                                                      cute.make_layout((4 * n, S), stride=(1, 4 * st)))

        # ---- this split's tiles: page tiles [0, n_page) cover positions [N, page_len) (N = sink tokens, 0 without
        # a sink; list entry i is the TN-aligned tile first_pt + i); with a sink, tile n_page is the sink tile
        # (positions [0, min(kv_len, N))); with a ring, ring tiles [n_page + n_sink, n_tiles) cover
        # [page_len, kv_len), TR tokens each (qattn.layouts.paged.read_sources) ------------------------------
        page_len = kv_len
        n_tiles = (kv_len + (TN - 1)) // TN
        n_page = n_tiles
        first_pt = N // TN  # the aligned page tile that holds position N (0 without a sink)
        n_sink = Int32(0)
        sink_len = Int32(0)
        slot = Int32(0)
        if cutlass.const_expr(self.unquantized):
            if cutlass.const_expr(self.ring):
                page_len = _sel(kv_len > W, kv_len - W, 0, Int32)
            if cutlass.const_expr(self.sink):
                page_len = _sel(page_len > N, page_len, N, Int32)  # may exceed kv_len: then no page tile
                sink_len = _sel(kv_len < N, kv_len, N, Int32)
                n_sink = _sel(kv_len > 0, 1, 0, Int32)
            n_page = _sel(page_len > N, (page_len + (TN - 1)) // TN - first_pt, 0, Int32)
            n_ring = Int32(0)
            if cutlass.const_expr(self.ring):
                n_ring = _sel(kv_len > page_len, (kv_len - page_len + (TR - 1)) // TR, 0, Int32)
            n_tiles = n_page + n_sink + n_ring
            mSS = cute.make_tensor(cute.make_ptr(Int32, ss_addr, gmem, assumed_align=4), cute.make_layout(batch))
            slot = mSS[b]  # clamped into the ring (memory safety; the launcher cannot read device values)
            slot = _sel(slot < max_seqs, slot, max_seqs - 1, Int32)
            slot = _sel(slot > 0, slot, 0, Int32)
        first_t = Int32(0)  # window: the first page tile, the one holding the first query's first visible key
        ring0 = 0  # window over a ring: the ring tiles left of the first query's window, skipped
        if cutlass.const_expr(cfg.window):
            p0 = kv_len - seqlen_q - window_left  # the first query's first visible position (may be < 0)
            if cutlass.const_expr(self.unquantized):
                # drop what lies left of p0 from each part of the list: page tiles from the front (the list's
                # page tile i becomes first_pt + i), the sink tile if all of it, ring tiles from the front
                pt = _sel(p0 > 0, p0, 0, Int32) // TN
                skip = _sel(pt > first_pt, pt - first_pt, 0, Int32)
                skip = _sel(skip < n_page, skip, n_page, Int32)
                skip = _sel(p0 < page_len, skip, n_page, Int32)  # the window starts past the pages
                first_pt = first_pt + skip
                n_page = n_page - skip
                if cutlass.const_expr(self.sink):
                    n_sink = _sel(sink_len > p0, n_sink, 0, Int32)
                if cutlass.const_expr(self.ring):
                    rp = p0 - page_len
                    ring0 = _sel(rp > 0, rp, 0, Int32) // TR
                    ring0 = _sel(ring0 < n_ring, ring0, n_ring, Int32)
                    n_ring = n_ring - ring0
                n_tiles = n_page + n_sink + n_ring
            else:
                first_t = _sel(p0 > 0, p0 // TN, 0, Int32)
                n_tiles = _sel(n_tiles > first_t, n_tiles - first_t, 0, Int32)
        per = (n_tiles + num_splits - 1) // num_splits
        t_begin = split * per
        t_end = _sel(t_begin + per < n_tiles, t_begin + per, n_tiles, Int32)
        n_my = _sel(t_end > t_begin, t_end - t_begin, 0, Int32)

        # ---- global scales folded into the softmax scale / output -------------------------------------
        # (page tiles of even/odd-decoded FP4 hold 2^-6 times the values: EVEN_ODD_FOLD undoes it here, in fp32)
        sl2 = scale_log2 * Float32(EVEN_ODD_FOLD) if cutlass.const_expr(self.k.even_odd) else scale_log2
        if cutlass.const_expr(self.k.has_global):
            mKG = cute.make_tensor(cute.make_ptr(Float32, kg_addr, gmem, assumed_align=4),
                                   cute.make_layout(num_kv_heads))
            sl2 = sl2 * mKG[h]
        vg = Float32(EVEN_ODD_FOLD if self.v_even_odd else 1.0)
        if cutlass.const_expr(self.v.has_global):
            mVG = cute.make_tensor(cute.make_ptr(Float32, vg_addr, gmem, assumed_align=4),
                                   cute.make_layout(num_kv_heads))
            vg = vg * mVG[h]
        # bf16 (sink / ring) tiles are not scaled by vg: a CTA that reaches one multiplies its accumulator by vg
        # there (first_ring: its first bf16 tile; all of them follow the page tiles), and its epilogue scales by 1
        first_ring = _sel(t_begin > n_page, t_begin, n_page, Int32)
        vg_out = vg
        if cutlass.const_expr(self.unquantized and self.v.has_global):
            vg_out = _sel(t_end > n_page, Float32(1.0), vg, Float32)

        # ---- Q fragments (once): A operand of QK^T, in the dim permutation the K fragments use ----------
        nk = D // 16
        narrow = cfg.narrow
        rQ = cute.make_rmem_tensor(((2 if narrow else 4) * nk,), Uint32)
        lims = []
        lims_page = []
        lims_sink = []
        lows = [] if cfg.window else None  # window: each row's first visible key
        for hr in cutlass.range_constexpr(2):
            # this lane's rows: g and g + 8 of its row tile, or (narrow) 2 q4 and 2 q4 + 1
            r = row0 + 2 * q4 + hr if narrow else row0 + mt * 16 + g + 8 * hr
            i_q = r // G
            # causal: query i sees keys j <= i + kv_len - Sq (FlashAttention's end-aligned mask)
            lim = kv_len - 1
            if cutlass.const_expr(cfg.causal):
                lim = kv_len - seqlen_q + i_q
                if cutlass.const_expr(cfg.window):
                    lim = lim + window_right
            lim = _sel(lim < kv_len - 1, lim, kv_len - 1, Int32)  # padding rows: never past the end
            lims.append(lim)
            if cutlass.const_expr(cfg.window):
                lows.append(kv_len - seqlen_q + i_q - window_left)
            lims_page.append(_sel(lim < page_len - 1, lim, page_len - 1, Int32))  # ring positions: not from pages
            lims_sink.append(_sel(lim < sink_len - 1, lim, sink_len - 1, Int32))  # the sink tile: [0, sink_len)
        self._load_q(rQ, mQ, b, h, row0 + mt * 16 + g, rows, seqlen_q, Hq, q4, self.k.bf16, self.k.even_odd)

        # ---- running softmax state ------------------------------------------------------------------------
        nn = D // 8
        n_o = D // 4 if narrow else 4 * nn  # O^T (D x 8) or O (16 x D) accumulator values per lane
        rO = cute.make_rmem_tensor((n_o,), Float32)
        for i in cutlass.range_constexpr(n_o):
            rO[i] = Float32(0.0)
        rM = cute.make_rmem_tensor((2,), Float32)
        rL = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            rM[i] = Float32(-math.inf)
            rL[i] = Float32(0.0)

        # ---- main loop: iteration `it` issues the loads of tile `it` and computes tile `it - LAG` ---------
        # (cp.async multi-buffering, LAG = stages - 1 tiles in flight while one is computed: the copies of the
        # next tiles overlap the math of this one)
        LAG = S - 1
        for it in cutlass.range(n_my + LAG, unroll=1):
            if it < n_my:
                if cutlass.const_expr(self.unquantized):
                    if t_begin + it < n_page:
                        self._load_tile(bufs, first_pt + t_begin + it, it % S, page_len, b, h, tidx, mBT,
                                        max_blocks, num_blocks, num_kv_heads, kd_addr, ks_addr, vd_addr, vs_addr)
                    elif cutlass.const_expr(self.sink and self.ring):
                        if self._is_sink_tile(t_begin + it, n_page, n_sink):
                            self._load_sink_tile(bufs, it % S, slot, h, tidx, num_kv_heads, sk_addr, sv_addr)
                        else:
                            self._load_ring_tile(bufs, t_begin + it - n_page - n_sink + ring0, it % S, page_len,
                                                 slot, h, tidx, num_kv_heads, rk_addr, rv_addr)
                    elif cutlass.const_expr(self.sink):
                        self._load_sink_tile(bufs, it % S, slot, h, tidx, num_kv_heads, sk_addr, sv_addr)
                    else:
                        self._load_ring_tile(bufs, t_begin + it - n_page + ring0, it % S, page_len, slot, h, tidx,
                                             num_kv_heads, rk_addr, rv_addr)
                else:
                    self._load_tile(bufs, first_t + t_begin + it, it % S, kv_len, b, h, tidx, mBT, max_blocks,
                                    num_blocks, num_kv_heads, kd_addr, ks_addr, vd_addr, vs_addr)
            cute.arch.cp_async_commit_group()
            if it >= LAG:
                cute.arch.cp_async_wait_group(LAG)  # this thread's copies of tile it-LAG have landed ...
                cute.arch.sync_threads()  # ... and everyone else's
                tile = t_begin + it - LAG
                if cutlass.const_expr(self.unquantized):
                    if tile < n_page:
                        self._compute_tile(self.k, self.v, "k", "v", TN, views, (it - LAG) % S,
                                           (first_pt + tile) * TN, page_len, lims_page, g, q4, tg, rQ, rO, rM, rL,
                                           sl2, None, N if self.sink else None, lows)
                    else:
                        if cutlass.const_expr(self.r.bf16 != self.k.bf16 or self.k.even_odd):
                            if tile == first_ring:  # Q in the ring tiles' MMA type and dim order from here on
                                self._load_q(rQ, mQ, b, h, row0 + mt * 16 + g, rows, seqlen_q, Hq, q4,
                                             self.r.bf16)
                        o_scale = None
                        if cutlass.const_expr(self.v.has_global):
                            o_scale = _sel(tile == first_ring, vg, Float32(1.0), Float32)
                        if cutlass.const_expr(self.sink and self.ring):
                            if self._is_sink_tile(tile, n_page, n_sink):
                                self._compute_tile(self.r, self.r, "rk", "rv", TR, views, (it - LAG) % S, Int32(0),
                                                   sink_len, lims_sink, g, q4, tg, rQ, rO, rM, rL, scale_log2,
                                                   o_scale, None, lows)
                            else:
                                self._compute_tile(self.r, self.r, "rk", "rv", TR, views, (it - LAG) % S,
                                                   page_len + (tile - n_page - n_sink + ring0) * TR, kv_len, lims,
                                                   g, q4, tg, rQ, rO, rM, rL, scale_log2, o_scale, None, lows)
                        elif cutlass.const_expr(self.sink):
                            self._compute_tile(self.r, self.r, "rk", "rv", TR, views, (it - LAG) % S, Int32(0),
                                               sink_len, lims_sink, g, q4, tg, rQ, rO, rM, rL, scale_log2,
                                               o_scale, None, lows)
                        else:
                            self._compute_tile(self.r, self.r, "rk", "rv", TR, views, (it - LAG) % S,
                                               page_len + (tile - n_page + ring0) * TR, kv_len, lims, g, q4, tg, rQ,
                                               rO, rM, rL, scale_log2, o_scale, None, lows)
                else:
                    self._compute_tile(self.k, self.v, "k", "v", TN, views, (it - LAG) % S, (first_t + tile) * TN,
                                       kv_len, lims, g, q4, tg, rQ, rO, rM, rL, sl2, None, None, lows)
                cute.arch.sync_threads()  # the stage may be overwritten by the next iteration's loads
        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: per-warp state -> smem, then merge the token groups of each row tile ----------------
        E2 = D // 8
        slot_dim = even_odd_dim if self.v_even_odd else (lambda j: j)  # column slot -> dim in a lane's slice
        if cutlass.const_expr(narrow):
            # rows 2 q4 + hr; a row's tokens are spread over the 8 lanes g of its quad column
            for hr in cutlass.range_constexpr(2):
                l = rL[hr]
                for off in (4, 8, 16):
                    l = l + cute.arch.shuffle_sync_bfly(l, offset=off)
                if g == 0:
                    sM[warp * RW + 2 * q4 + hr] = rM[hr]
                    sL[warp * RW + 2 * q4 + hr] = l
            for i in cutlass.range_constexpr(D // 16):
                for e in cutlass.range_constexpr(4):
                    row = warp * RW + 2 * q4 + (e % 2)
                    sO[row * D + E2 * g + slot_dim(2 * i + e // 2)] = rO[4 * i + e]
        else:
            for hr in cutlass.range_constexpr(2):
                l = rL[hr]
                l = l + cute.arch.shuffle_sync_bfly(l, offset=1)
                l = l + cute.arch.shuffle_sync_bfly(l, offset=2)
                row = warp * 16 + g + 8 * hr
                sM[row] = rM[hr]
                sL[row] = l
            for j in cutlass.range_constexpr(nn):
                for e in cutlass.range_constexpr(4):
                    row = warp * 16 + g + 8 * (e // 2)
                    sO[row * D + E2 * (2 * q4 + (e % 2)) + slot_dim(j)] = rO[4 * j + e]
        cute.arch.sync_threads()

        total = MT * RW * D
        for k in cutlass.range(total // self.T, unroll=1):
            i = tidx + k * self.T
            row_l = i // D  # row within this m-block
            row_c = row0 + row_l
            d = i % D
            mt_ = row_l // RW
            rr = row_l % RW
            M = Float32(-math.inf)
            for t in cutlass.range_constexpr(TG):
                M = _fmax(M, sM[(t * MT + mt_) * RW + rr])
            M_use = _sel(M == Float32(-math.inf), Float32(0.0), M, Float32)
            L = Float32(0.0)
            O = Float32(0.0)
            for t in cutlass.range_constexpr(TG):
                w = t * MT + mt_
                f = ex2_approx(sM[w * RW + rr] - M_use)
                L = L + sL[w * RW + rr] * f
                O = O + sO[(w * RW + rr) * D + d] * f
            has = L > Float32(0.0)
            O = O * _sel(has, vg_out / L, Float32(0.0), Float32)
            lse = _sel(has, (M_use + lg2_approx(L)) * Float32(_LN2), Float32(-math.inf), Float32)
            if row_c < rows:
                i_q = row_c // G
                hq = h * G + row_c % G
                if cutlass.const_expr(cfg.split):
                    mOp = cute.make_tensor(cute.make_ptr(Float32, o_addr, gmem, assumed_align=4),
                                           cute.make_layout(num_splits * batch * seqlen_q * Hq * D))
                    mOp[(((split * batch + b) * seqlen_q + i_q) * Hq + hq) * D + d] = O
                    if d == 0:
                        mLp = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4),
                                               cute.make_layout(num_splits * batch * Hq * seqlen_q))
                        mLp[((split * batch + b) * Hq + hq) * seqlen_q + i_q] = lse
                else:
                    mOut = cute.make_tensor(cute.make_ptr(self.out_dtype, o_addr, gmem, assumed_align=2),
                                            cute.make_layout(batch * seqlen_q * Hq * D))
                    mOut[((b * seqlen_q + i_q) * Hq + hq) * D + d] = O.to(self.out_dtype)
                    if d == 0:
                        mL = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4),
                                              cute.make_layout(batch * Hq * seqlen_q))
                        mL[(b * Hq + hq) * seqlen_q + i_q] = lse

    # ==============================================================================================
    # Device helpers (straight-line code, traced inline)
    # ==============================================================================================
    def _q_word(self, w, to_bf16: bool):
        """A q word (two q-dtype halves) in a QK MMA operand type (bf16 if ``to_bf16`` else f16)."""
        if cutlass.const_expr(to_bf16 == self.q_bf16):
            return Uint32(w)
        if cutlass.const_expr(self.q_bf16):
            lo, hi = bf16x2_to_f32x2(w)
        else:
            lo, hi = fp4.f16x2_to_f32x2(w)
        return pack_f32x2(lo, hi, to_bf16)

    def _load_q(self, rQ, mQ, b, h, r_lo, rows, seqlen_q, Hq, q4, to_bf16: bool, even_odd: bool = False):
        """Q fragments (A operand of QK^T) of rows ``r_lo`` and ``r_lo + 8``, in the dim permutation the K
        fragments use (``even_odd``: the order of :meth:`_row_slice`'s ``even_odd`` decode of nvfp4 rows);
        rows past ``rows`` (padding) get zeros (their index is clamped so nothing is read out of bounds).
        Narrow: the B operand of S^T = K Q^T, row ``r_lo`` only, k-step j in ``rQ[2j], rQ[2j + 1]`` (the same
        words as the A fragment's a0a1 and a4a5)."""
        D, G = self.D, self.cfg.group
        narrow = self.cfg.narrow
        for hr in range(1 if narrow else 2):
            r = r_lo + 8 * hr
            ok = r < rows
            r_use = _sel(ok, r, 0, Int32)
            base = ((b * seqlen_q + r_use // G) * Hq + h * G + r_use % G) * (D // 2) + q4 * (D // 8)
            if cutlass.const_expr(even_odd):
                # k-steps 2p and 2p + 1 take dims (8p, 8p+2 | 8p+4, 8p+6) and (8p+1, 8p+3 | 8p+5, 8p+7)
                for p in range(D // 32):
                    w = [self._q_word(mQ[base + 4 * p + i], to_bf16) for i in range(4)]
                    for j, sel in ((2 * p, 0x5410), (2 * p + 1, 0x7632)):
                        lo = _sel(ok, prmt(w[0], w[1], sel), Uint32(0), Uint32)
                        hi = _sel(ok, prmt(w[2], w[3], sel), Uint32(0), Uint32)
                        self._set_q(rQ, j, hr, lo, hi)
            else:
                for j in range(D // 16):
                    self._set_q(rQ, j, hr, _sel(ok, self._q_word(mQ[base + 2 * j], to_bf16), Uint32(0), Uint32),
                                _sel(ok, self._q_word(mQ[base + 2 * j + 1], to_bf16), Uint32(0), Uint32))

    def _set_q(self, rQ, j, hr, lo, hi):
        """Store the k-step ``j`` words of row half ``hr`` (k = 2 q4.. and 2 q4 + 8..) in the fragment layout."""
        if cutlass.const_expr(self.cfg.narrow):
            rQ[2 * j] = lo
            rQ[2 * j + 1] = hi
        else:
            rQ[4 * j + hr] = lo
            rQ[4 * j + 2 + hr] = hi

    def _load_tile(self, bufs, tile, stage, kv_len, b, h, tidx, mBT, max_blocks, num_blocks, num_kv_heads,
                   kd_addr, ks_addr, vd_addr, vs_addr):
        """Issue the cp.async copies of one tile (K and V payload and scales) into ``stage``.

        A tile is cut into pieces of P = min(tile_n, page_size) tokens; a piece lies in one page, so its payload
        (and its scales) are one contiguous run of the pool. Pieces past the sequence end are redirected to block 0
        (always allocated) instead of branching: their tokens are masked in the math, so the bytes do not matter.
        """
        cfg = self.cfg
        TN, page = cfg.tile_n, cfg.page_size
        P = min(TN, page)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint32,
                                   num_bits_per_copy=128)
        gmem = cute.AddressSpace.gmem
        for name, addr, rb in (("kd", kd_addr, self.k.rb), ("ks", ks_addr, self.k.srb),
                               ("vd", vd_addr, self.v.rb), ("vs", vs_addr, self.v.srb)):
            nv = self.vec[name]
            if nv == 0:
                continue
            vpp = P * rb // 16  # vectors per piece
            for k in range((nv + self.T - 1) // self.T):
                v = tidx + k * self.T
                if (k + 1) * self.T > nv:  # ragged last round: duplicate the last vector (same bytes, same place)
                    v = _sel(v < nv, v, nv - 1, Int32)
                piece = v // vpp
                within = v % vpp
                token0 = tile * TN + piece * P
                valid = token0 < kv_len
                col = token0 // page  # kept in the table's row: a length past what it covers reads wrong
                col = _sel(col < max_blocks, col, max_blocks - 1, Int32)  # numbers, never past the table
                bt_idx = _sel(valid, b * max_blocks + col, b * max_blocks, Int32)
                blk = _sel(valid, mBT[bt_idx], 0, Int32)
                blk = _sel(blk < num_blocks, blk, num_blocks - 1, Int32)
                blk = _sel(blk > 0, blk, 0, Int32)
                row = (Int64(blk) * Int64(num_kv_heads) + Int64(h)) * Int64(page) + Int64(token0 % page)
                src_addr = addr + row * Int64(rb) + Int64(within * 16)
                src = cute.make_tensor(cute.make_ptr(Uint32, src_addr, gmem, assumed_align=16), cute.make_layout(4))
                cute.copy(atom, src, bufs[name][None, v, stage])

    def _load_ring_tile(self, bufs, rtile, stage, page_len, slot, h, tidx, num_kv_heads, rk_addr, rv_addr):
        """Issue the cp.async copies of ring tile ``rtile`` (positions page_len + rtile * TR + t) into ``stage``.

        Token p lives at ring row (slot * H + h) * W + p % W: rows are contiguous only until the ring wraps, so
        every 16-byte vector is addressed per token. Positions past the sequence end read some other ring row
        of the same sequence (always in bounds); the math masks them.
        """
        cfg = self.cfg
        TR, W, rb = cfg.ring_tile_n, cfg.ring_window, self.r.rb
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint32,
                                   num_bits_per_copy=128)
        gmem = cute.AddressSpace.gmem
        vpr = rb // 16  # vectors per token row
        for name, addr in (("rkd", rk_addr), ("rvd", rv_addr)):
            nv = self.vec[name]
            for k in range((nv + self.T - 1) // self.T):
                v = tidx + k * self.T
                if (k + 1) * self.T > nv:  # ragged last round: duplicate the last vector
                    v = _sel(v < nv, v, nv - 1, Int32)
                p = page_len + rtile * TR + v // vpr
                row = (Int64(slot) * Int64(num_kv_heads) + Int64(h)) * Int64(W) + Int64(p % W)
                src_addr = addr + row * Int64(rb) + Int64((v % vpr) * 16)
                src = cute.make_tensor(cute.make_ptr(Uint32, src_addr, gmem, assumed_align=16), cute.make_layout(4))
                cute.copy(atom, src, bufs[name][None, v, stage])

    def _load_sink_tile(self, bufs, stage, slot, h, tidx, num_kv_heads, sk_addr, sv_addr):
        """Issue the cp.async copies of the sink tile (positions 0 .. sink_tile_n - 1) into ``stage``.

        Token p < N lives at sink row (slot * H + h) * N + p: one contiguous run of N rows. Tile rows p >= N
        re-read row N - 1 (in bounds); the math masks every position >= min(len, N).
        """
        N, rb = self.cfg.sink_tokens, self.r.rb
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint32,
                                   num_bits_per_copy=128)
        gmem = cute.AddressSpace.gmem
        vpr = rb // 16  # vectors per token row
        for name, addr in (("rkd", sk_addr), ("rvd", sv_addr)):
            nv = self.vec[name]
            for k in range((nv + self.T - 1) // self.T):
                v = tidx + k * self.T
                if (k + 1) * self.T > nv:  # ragged last round: duplicate the last vector
                    v = _sel(v < nv, v, nv - 1, Int32)
                p = v // vpr
                p = _sel(p < N, p, N - 1, Int32)
                row = (Int64(slot) * Int64(num_kv_heads) + Int64(h)) * Int64(N) + Int64(p)
                src_addr = addr + row * Int64(rb) + Int64((v % vpr) * 16)
                src = cute.make_tensor(cute.make_ptr(Uint32, src_addr, gmem, assumed_align=16), cute.make_layout(4))
                cute.copy(atom, src, bufs[name][None, v, stage])

    # ---- dequantized row slices ------------------------------------------------------------------------
    def _row_slice(self, f: FmtInfo, views, pre: str, stage, tok, dim0: int, ndims, dim0_dyn, keep=None,
                   even_odd: bool = False):
        """``ndims`` values of token ``tok`` (tile-local) starting at dim ``dim0_dyn`` (dynamic; multiple of 8
        for FP4, of 4 for 8-bit, of 2 for bf16), as ndims/2 words of 16-bit pairs in the MMA operand type
        (f16 for quantized formats, with FP4 block scales applied; bf16 for bf16). Per-row fp32 scales are not
        applied here. ``keep`` (FP4 only, or None): False zeroes the values through their block scale (E2M1
        codes are finite, so a zero scale gives exact zeros whatever garbage the scale byte held).
        ``even_odd`` (only for ``f.even_odd`` formats): each 8 dims come as (d0,d2), (d4,d6), (d1,d3), (d5,d7),
        the order :meth:`_load_q` loads Q in for the K operand and :func:`even_odd_dim` maps the P.V output
        columns back (cheaper decode), and the values are 2^-6 times the true ones (exact in f16: E2M1 x 2^-6 x
        an E4M3 scale is a multiple of 2^-16 with at most 6 significant bits; the kernel multiplies the fp32
        softmax scale / output scale by ``EVEN_ODD_FOLD`` instead of every block scale by 64)."""
        words = []
        w = views[pre + "d_w"]
        if cutlass.const_expr(f.kind == "bf16"):
            base = tok * f.row_words + dim0_dyn // 2
            for i in range(ndims // 2):
                words.append(Uint32(w[base + i, stage]))
        elif cutlass.const_expr(f.kind in ("fp8", "int8")):
            base = tok * f.row_words + dim0_dyn // 4
            for i in range(ndims // 4):
                x = Uint32(w[base + i, stage])
                if cutlass.const_expr(f.kind == "fp8"):
                    lo, hi = fp4.e4m3x4_to_f16x4(x)
                else:
                    lo, hi = i8x4_to_f16x4(x)
                words.append(lo)
                words.append(hi)
        else:  # fp4
            for i in range(ndims // 8):
                x, sbyte = self._fp4_word(f, views, pre, stage, tok, dim0_dyn, i)
                if cutlass.const_expr(f.scale == "e4m3"):
                    s2 = fp4.e4m3_to_f16x2(sbyte, 0)
                else:
                    s2 = f32_to_f16x2_bcast(fp4.ue8m0_to_f32(sbyte))
                if cutlass.const_expr(keep is not None):
                    s2 = _sel(keep, s2, Uint32(0), Uint32)
                if cutlass.const_expr(even_odd):  # values x 2^-6: the kernel folds 64 into sl2 / vg (EVEN_ODD_FOLD)
                    for hh in fp4.e2m1x8_to_f16x8_scaled_even_odd(x):
                        words.append(fp4.f16x2_mul(hh, s2))
                else:
                    for hh in fp4.e2m1x8_to_f16x8(x):
                        words.append(fp4.f16x2_mul(hh, s2))
        return words

    def _fp4_word(self, f: FmtInfo, views, pre: str, stage, tok, dim0, i: int):
        """Payload word ``i`` (FP4 dims [dim0 + 8 i, dim0 + 8 i + 8); ``dim0`` a multiple of 8) of token ``tok``
        (tile-local) and its block's scale byte."""
        x = Uint32(views[pre + "d_w"][tok * f.row_words + dim0 // 8 + i, stage])
        return x, Uint32(views[pre + "s_b"][tok * f.nscales + (dim0 + 8 * i) // f.sb, stage])

    def _keep(self, pos, kv_len, pos_lo):
        """Position ``pos`` is one this tile reads: below the sequence end and, with a sink (``pos_lo``, a
        compile-time int or None), not below it."""
        ok = pos < kv_len
        if cutlass.const_expr(pos_lo is not None):
            ok = ok & (pos >= pos_lo)
        return ok

    def _v_rows(self, vf: FmtInfo, views, vpre: str, stage, tok0, pos0, kv_len, pos_lo, g):
        """This lane's V words of a 16-token chunk: tokens ``tok0`` + 0, 1, 8, 9 (tile-local), head dims
        [g D/8, (g+1) D/8), as :meth:`_row_slice` returns them. Bytes past the sequence end may be anything (NaN
        bf16, 0x7F E4M3 scales): P = 0 there, but 0 * NaN is NaN, so the values themselves are zeroed: FP4
        through the block scale (one select per block instead of one per word: fewer integer-pipe
        instructions), the other formats word by word."""
        D = self.D
        vw = []
        for off in (0, 1, 8, 9):
            tok = tok0 + off
            ok = self._keep(pos0 + tok, kv_len, pos_lo)
            if cutlass.const_expr(vf.kind == "fp4"):
                vw.append(self._row_slice(vf, views, vpre, stage, tok, 0, D // 8, g * (D // 8), keep=ok,
                                          even_odd=self.v_even_odd))
            else:
                ws = self._row_slice(vf, views, vpre, stage, tok, 0, D // 8, g * (D // 8))
                vw.append([_sel(ok, x, Uint32(0), Uint32) for x in ws])
        return vw

    def _v_operands(self, vf: FmtInfo, views, vpre: str, stage, tok0, pos0, kv_len, pos_lo, g):
        """This lane's V operand words of a 16-token chunk, as two lists (tokens ``tok0`` + 0 / 1 and + 8 / 9) of
        D/8 f16x2 words: word j holds column slot j (see :meth:`_row_slice`) of both tokens, the first token in
        the low half, i.e. the token-pair words the P.V MMA reads (A of O^T = V^T P^T, B of O = P V).

        nvfp4 V in the even/odd order pairs the tokens while they are E4M3 bytes: one prmt per 4 values instead
        of one per 2 after the conversion, and one scale conversion and select per token pair and block
        (:func:`fp4.e4m3_pair_to_f16x2`); values x 2^-6 as in :meth:`_row_slice`. Other formats: :meth:`_v_rows`,
        then the pairing prmt."""
        D = self.D
        ndims, dim0 = D // 8, g * (D // 8)
        if cutlass.const_expr(not (vf.kind == "fp4" and self.v_even_odd)):
            vw = self._v_rows(vf, views, vpre, stage, tok0, pos0, kv_len, pos_lo, g)
            return [[prmt(vw[2 * p][j // 2], vw[2 * p + 1][j // 2], 0x7632 if j % 2 else 0x5410)
                     for j in range(ndims)] for p in range(2)]
        pairs = []
        for off in (0, 8):
            ta, tb = tok0 + off, tok0 + off + 1
            # positions outside the tile's range: zero scale -> exact zeros (E2M1 codes are finite)
            keep_a, keep_b = self._keep(pos0 + ta, kv_len, pos_lo), self._keep(pos0 + tb, kv_len, pos_lo)
            words = []
            for i in range(ndims // 8):
                xa, sa = self._fp4_word(vf, views, vpre, stage, ta, dim0, i)
                xb, sb = self._fp4_word(vf, views, vpre, stage, tb, dim0, i)
                s2 = fp4.e4m3_pair_to_f16x2(_sel(keep_a, sa, Uint32(0), Uint32), _sel(keep_b, sb, Uint32(0), Uint32))
                ev_a, od_a = fp4.e2m1x8_to_e4m3x8_even_odd(xa)
                ev_b, od_b = fp4.e2m1x8_to_e4m3x8_even_odd(xb)
                # slots 8i..8i+7 = (e0, e2, e4, e6, e1, e3, e5, e7): bytes [a, b, a, b] of each pair of slots
                for ea, eb in ((ev_a, ev_b), (od_a, od_b)):
                    for sel in (0x5140, 0x7362):
                        for hh in fp4.e4m3x4_to_f16x4(prmt(ea, eb, sel)):
                            words.append(fp4.f16x2_mul(hh, s2))
            pairs.append(words)
        return pairs

    def _is_sink_tile(self, tile, n_page, n_sink):
        """Whether list entry ``tile`` (>= n_page) of a sink + ring list is the sink tile: the entry right after the
        page tiles, unless a sliding window dropped it (``n_sink`` 0)."""
        if self.cfg.window:
            return tile - n_page < n_sink
        return tile == n_page

    def _compute_tile(self, kf: FmtInfo, vf: FmtInfo, kpre: str, vpre: str, TN: int, views, stage, pos0, kv_len,
                      lims, g, q4, tg, rQ, rO, rM, rL, sl2, o_scale, pos_lo, lows=None):
        """One warp's share of one tile of ``TN`` tokens at positions ``pos0 + t``: S = Q K^T, online softmax,
        O += P V. Tokens at positions >= ``kv_len`` or past a row's ``lims`` are masked, and so are positions
        below ``pos_lo`` (a compile-time int: the sink tokens, which page tiles do not read; None: no lower
        bound) and below a row's ``lows`` (the sliding window; None: none). ``o_scale`` (or None) multiplies the
        accumulator before this tile's P V is added. (Keys below a row's window are real cache rows: their V
        needs no zeroing, P is 0 there.)"""
        if cutlass.const_expr(self.cfg.narrow):
            self._compute_tile_narrow(kf, vf, kpre, vpre, TN, views, stage, pos0, kv_len, lims, g, q4, tg, rQ, rO,
                                      rM, rL, sl2, o_scale, pos_lo, lows)
            return
        D = self.D
        nk, nn = D // 16, D // 8
        neg_inf = Float32(-math.inf)
        tpw = TN // self.cfg.token_groups  # tokens of a tile one warp handles
        nchunks = tpw // 16
        t_base = tg * tpw

        # ---- S = Q K^T (scaled to the log2 domain, masked) ----
        S = []
        for c in range(nchunks):
            Sc = []
            for nt in range(2):
                tok = t_base + 16 * c + 8 * nt + g
                kw = self._row_slice(kf, views, kpre, stage, tok, 0, D // 4, q4 * (D // 4), even_odd=kf.even_odd)
                acc = [Float32(0.0)] * 4
                for j in range(nk):
                    acc = mma_16816([rQ[4 * j], rQ[4 * j + 1], rQ[4 * j + 2], rQ[4 * j + 3]],
                                    [kw[2 * j], kw[2 * j + 1]], acc, kf.bf16)
                vals = []
                for e in range(4):
                    tok_e = t_base + 16 * c + 8 * nt + 2 * q4 + (e % 2)
                    x = acc[e] * sl2
                    if cutlass.const_expr(kf.scale == "row"):
                        x = x * views["ks_f"][tok_e, stage]
                    x = self._capped(x)
                    keep = pos0 + tok_e <= lims[e // 2]
                    if cutlass.const_expr(pos_lo is not None):
                        keep = keep & (pos0 + tok_e >= pos_lo)
                    if cutlass.const_expr(lows is not None):
                        keep = keep & (pos0 + tok_e >= lows[e // 2])
                    vals.append(_sel(keep, x, neg_inf, Float32))
                Sc.append(vals)
            S.append(Sc)

        # ---- online softmax (rows g and g+8 of this warp's tile; a row lives in the 4 lanes of a quad) ----
        for hr in range(2):
            mx = neg_inf
            for c in range(nchunks):
                for nt in range(2):
                    mx = _fmax(mx, _fmax(S[c][nt][2 * hr], S[c][nt][2 * hr + 1]))
            mx = _fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = _fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            m_old = rM[hr]
            m_new = _fmax(m_old, mx)
            m_use = _sel(m_new == neg_inf, Float32(0.0), m_new, Float32)  # all masked so far: avoid inf - inf
            corr = ex2_approx(m_old - m_use)
            corr_o = corr if o_scale is None else corr * o_scale
            rM[hr] = m_new
            psum = Float32(0.0)
            for c in range(nchunks):
                for nt in range(2):
                    for k in range(2):
                        p = ex2_approx(S[c][nt][2 * hr + k] - m_use)
                        S[c][nt][2 * hr + k] = p
                        psum = psum + p
            rL[hr] = rL[hr] * corr + psum
            for j in range(nn):
                for k in range(2):
                    rO[4 * j + 2 * hr + k] = rO[4 * j + 2 * hr + k] * corr_o

        # ---- O += P V ----
        for c in range(nchunks):
            P = S[c]
            if cutlass.const_expr(vf.scale == "row"):
                # per-token V scale multiplies P (the reduction runs over tokens); sanitized outside the tile's
                # positions (past the end, and below pos_lo: 0 * NaN would be NaN)
                for nt in range(2):
                    for e in range(4):
                        tok_e = t_base + 16 * c + 8 * nt + 2 * q4 + (e % 2)
                        vs = _sel(self._keep(pos0 + tok_e, kv_len, pos_lo), views["vs_f"][tok_e, stage], Float32(0.0),
                                  Float32)
                        P[nt][e] = P[nt][e] * vs
            a = [pack_f32x2(P[0][0], P[0][1], vf.bf16), pack_f32x2(P[0][2], P[0][3], vf.bf16),
                 pack_f32x2(P[1][0], P[1][1], vf.bf16), pack_f32x2(P[1][2], P[1][3], vf.bf16)]
            v01, v89 = self._v_operands(vf, views, vpre, stage, t_base + 16 * c + 2 * q4, pos0, kv_len, pos_lo, g)
            for j in range(nn):
                out = mma_16816(a, [v01[j], v89[j]], [rO[4 * j + e] for e in range(4)], vf.bf16)
                for e in range(4):
                    rO[4 * j + e] = out[e]

    def _capped(self, x):
        """``softcap``: the score x = z / softcap (the host's scale is softmax_scale / softcap) -> the capped logit
        in the log2 domain (``common/softcap.py``; masking follows, so masked scores stay -inf)."""
        if cutlass.const_expr(self.cfg.softcap > 0.0):
            x = capped_log2(x, self.cfg.softcap)
        return x

    def _compute_tile_narrow(self, kf: FmtInfo, vf: FmtInfo, kpre: str, vpre: str, TN: int, views, stage, pos0,
                             kv_len, lims, g, q4, tg, rQ, rO, rM, rL, sl2, o_scale, pos_lo, lows=None):
        """:meth:`_compute_tile` for at most 8 query rows, with both MMAs transposed (M = 16 tokens or 16 head
        dims, N = 8 query rows): S^T = K Q^T, O^T = V^T P^T. Same fragments of K and V as the wide layout (the
        A operand of m16n8k16 is two tokens' B operands side by side), half the MMAs, and half the accumulator
        and Q registers, which the wide layout spends on rows 8..15 that a decode with GQA <= 8 does not have.
        The S^T accumulator holds (token g / g + 8, rows 2 q4 / 2 q4 + 1); ``movmatrix.trans`` turns each 8x8 half
        into the (tokens 2 q4.., row g) B fragment of P^T. O^T value 4 i + e: row 2 q4 + e % 2, column slot
        2 i + e // 2 of lane g's slice of the head dims."""
        D = self.D
        nk = D // 16
        neg_inf = Float32(-math.inf)
        tpw = TN // self.cfg.token_groups  # tokens of a tile one warp handles
        nchunks = tpw // 16
        t_base = tg * tpw

        # ---- S^T = K Q^T (scaled to the log2 domain, masked); S[c][e]: token t_base + 16 c + g + 8 (e // 2) ----
        S = []
        for c in range(nchunks):
            tok = t_base + 16 * c + g
            kw = [self._row_slice(kf, views, kpre, stage, tok + 8 * half, 0, D // 4, q4 * (D // 4),
                                  even_odd=kf.even_odd) for half in range(2)]
            acc = [Float32(0.0)] * 4
            for j in range(nk):
                acc = mma_16816([kw[0][2 * j], kw[1][2 * j], kw[0][2 * j + 1], kw[1][2 * j + 1]],
                                [rQ[2 * j], rQ[2 * j + 1]], acc, kf.bf16)
            vals = []
            for e in range(4):
                tok_e = tok + 8 * (e // 2)
                x = acc[e] * sl2
                if cutlass.const_expr(kf.scale == "row"):
                    x = x * views["ks_f"][tok_e, stage]
                x = self._capped(x)
                keep = pos0 + tok_e <= lims[e % 2]
                if cutlass.const_expr(pos_lo is not None):
                    keep = keep & (pos0 + tok_e >= pos_lo)
                if cutlass.const_expr(lows is not None):
                    keep = keep & (pos0 + tok_e >= lows[e % 2])
                vals.append(_sel(keep, x, neg_inf, Float32))
            S.append(vals)

        # ---- online softmax (rows 2 q4 + hr; a row's tokens live in the 8 lanes g of one q4) ----
        for hr in range(2):
            mx = neg_inf
            for c in range(nchunks):
                mx = _fmax(mx, _fmax(S[c][hr], S[c][2 + hr]))
            for off in (4, 8, 16):
                mx = _fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
            m_old = rM[hr]
            m_new = _fmax(m_old, mx)
            m_use = _sel(m_new == neg_inf, Float32(0.0), m_new, Float32)  # all masked so far: avoid inf - inf
            corr = ex2_approx(m_old - m_use)
            corr_o = corr if o_scale is None else corr * o_scale
            rM[hr] = m_new
            psum = Float32(0.0)
            for c in range(nchunks):
                for k in (0, 2):
                    p = ex2_approx(S[c][k + hr] - m_use)
                    S[c][k + hr] = p
                    psum = psum + p
            rL[hr] = rL[hr] * corr + psum
            for i in range(D // 16):
                for k in (0, 2):
                    rO[4 * i + k + hr] = rO[4 * i + k + hr] * corr_o

        # ---- O^T += V^T P^T ----
        for c in range(nchunks):
            P = S[c]
            if cutlass.const_expr(vf.scale == "row"):  # per-token V scale into P (see _compute_tile)
                for e in range(4):
                    tok_e = t_base + 16 * c + g + 8 * (e // 2)
                    vs = _sel(self._keep(pos0 + tok_e, kv_len, pos_lo), views["vs_f"][tok_e, stage], Float32(0.0),
                              Float32)
                    P[e] = P[e] * vs
            b = [movmatrix_trans(pack_f32x2(P[0], P[1], vf.bf16)), movmatrix_trans(pack_f32x2(P[2], P[3], vf.bf16))]
            v01, v89 = self._v_operands(vf, views, vpre, stage, t_base + 16 * c + 2 * q4, pos0, kv_len, pos_lo, g)
            for i in range(D // 16):
                # A of m-tile i: rows g / g + 8 = column slots 2i / 2i + 1 of lane g's dims, tokens 2 q4.. / +8..
                a = [v01[2 * i], v01[2 * i + 1], v89[2 * i], v89[2 * i + 1]]
                out = mma_16816(a, b, [rO[4 * i + e] for e in range(4)], vf.bf16)
                for e in range(4):
                    rO[4 * i + e] = out[e]


def decode_compile_args() -> list:
    """Placeholder arguments of :meth:`DecodeSm90.__call__` (zero addresses, unit sizes, a fake stream) to
    compile a variant without a GPU or any tensor."""
    return [Int64(0)] * 16 + [Int32(1)] * 7 + [Float32(1.0), Int32(0), Int32(0), cute.runtime.make_fake_stream()]


def decode_cache_key(arch: str, cfg: DecodeConfig) -> tuple:
    """The compile-cache key of a decode variant: the launcher's and ``qattn-warmup``'s."""
    return (arch,) + cfg.key


# ==================================================================================================
# variants for qattn-warmup
# ==================================================================================================
def _format_pair(name: str):
    """``"nvfp4"`` -> (nvfp4, nvfp4); ``"int8+nvfp4"`` -> (int8 K, nvfp4 V); None for unknown names."""
    parts = name.split("+")
    if len(parts) > 2 or any(p not in FORMAT_NAMES for p in parts):
        return None
    return kv_format(parts[0]), kv_format(parts[-1])


@register("decode")
def _decode_variants(arch: str, kv_formats=None, head_dims=None, gqa=None, page_sizes=None, seqlen_q=None,
                     recent_windows=None, q_dtypes=None, sink_tokens=None, sliding_window: bool = False,
                     softcaps=None, **_):
    """The variants ``flash_attn_with_kvcache`` compiles, through the same ``choose_config``: for each
    format (or ``k+v`` pair), head_dim, GQA ratio, page size, seqlen_q, recent window, sink token count and q
    dtype, causal, with and without split-KV (the ring / sink, when there is one, in the q dtype);
    ``sliding_window``: also the ``window_size`` variants; ``softcaps``: also each one's twin per ``softcap``.
    On sm_100a, the dispatch of compute capability 10.0: the tcgen05 kernel's variants, and this kernel's for what
    the tcgen05 kernel does not take (``sm100.decode_config.tcgen05_takes``)."""
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm100.decode_config import tcgen05_takes

    out, seen = [], set()
    if arch == "sm_100a":  # the SM100 kernel, through the same dispatch as flash_attn_with_kvcache on cc 10.0
        from qattn.cute_kernels.sm100.decode import sm100_decode_variants

        if 0 in (recent_windows or [0]) and 0 in (sink_tokens or [0]):  # it reads caches without ring or sink
            out = sm100_decode_variants(arch, kv_formats, head_dims, gqa, page_sizes, seqlen_q, None, q_dtypes,
                                        sliding_window, softcaps)
    elif arch != "sm_90a":
        return []
    for name in kv_formats or FORMAT_NAMES:
        pair = _format_pair(name)
        if pair is None:
            continue
        for d in [x for x in (head_dims or HEAD_DIMS) if x in HEAD_DIMS]:
            for g in gqa or [1, 4, 8]:
                for page in page_sizes or [16, 64, 128]:
                    for sq in seqlen_q or [1]:
                        if sq * g > 256:
                            continue
                        for w, n in [(w, n) for w in recent_windows or [0] for n in sink_tokens or [0]]:
                            for qd in q_dtypes or ["bf16"]:
                                if arch == "sm_100a" and tcgen05_takes(*pair, d, page, qd, g, sq, w, n):
                                    continue  # the tcgen05 kernel's call on SM100
                                for split, win, cap in itertools.product(
                                        (False, True), (False, True) if sliding_window else (False,),
                                        [0.0] + [float(c) for c in softcaps or () if c]):
                                    cfg = choose_config(pair[0], pair[1], d, page, qd, g, sq, True, split,
                                                        ring_window=w, ring_dtype=qd, sink_tokens=n, window=win,
                                                        softcap=cap)
                                    key = decode_cache_key(arch, cfg)
                                    if key in seen:
                                        continue
                                    seen.add(key)
                                    build = (lambda cfg=cfg: compile_for_arch(
                                        DecodeSm90(cfg), *decode_compile_args(), arch=arch, keep_ptx=False)[0])
                                    label = (f"{name} D{d} gqa{g} page{page} sq{sq}" + (f" W{w}" if w else "")
                                             + (f" N{n}" if n else "")
                                             + ("" if qd == "bf16" else f" {qd}") + (" split" if split else "")
                                             + (" window" if win else "") + (f" softcap {cap:g}" if cap else "")
                                             + (" (mma.sync on sm100, never ran)" if arch == "sm_100a" else ""))
                                    out.append(Variant("decode", key, label, build))
    return out
