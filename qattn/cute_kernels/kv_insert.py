"""Fused quantize-and-insert of new K/V tokens into the paged cache (CuTe-DSL, SM90 and SM100).

One kernel, :class:`KVInsert`, writes ``k`` and ``v`` (num_tokens, num_kv_heads, head_dim) bf16/fp16 into one
layer's pools at ``slot_mapping`` (int64, ``block * page_size + offset``, -1 = skip), quantized to the cache's K
format and V format (independent compile-time parameters: nvfp4, mxfp4 / mxfp4_b16 floor|rceil, fp8, int8,
bf16) and, for caches with a recent window, also writes the unquantized row to
``ring[seq_slot, head, position % W]``, and for caches with ``sink_tokens = N`` (compile time) the rows of
positions ``< N`` to ``sink[seq_slot, head, position]``. The bytes equal ``qattn.reference.write_kv_reference``
bit for bit.

Work split: one *row* is one (token, kv_head); ``G = head_dim / E`` consecutive threads share a row, each
holding ``E`` = 32 values (16 when head_dim is not a multiple of 32): 16-byte loads of the input, 16-byte
stores of the payload (8-byte for FP4 rows with E = 16). Block-scaled formats (16 / 32 values per scale) are
quantized inside one thread; fp8 / int8 (one fp32 scale per row) reduce ``amax`` over the G threads of the row
with butterfly shuffles (G is a power of two, and the G lanes of a row are aligned within a warp). A CTA of 128
threads covers ``128 / G`` rows; the grid is ``ceil(num_tokens * num_kv_heads / rows_per_cta)``. K and V of a
row are done by the same threads, one after the other. All arithmetic is IEEE fp32 in the reference's order:
``div.rn`` for ``amax / qmax`` and ``amax / (g * 6)``, ``div.rn 1, d`` for reciprocals (only of normal
divisors), RNE conversions (``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rni.s32.f32``, ``cvt.rn.bf16x2.f32``).
An FP4 side whose format has ``scale_search="msenb"`` takes, per block, the scale with the smallest squared error
among the rule's and its neighbours (:func:`_fp4_scale_search`, the reference's arithmetic; compile time, keyed).

Insert transforms (compile-time flags, part of the compile-cache key: ``rope_style`` / ``rotary_dim``, ``smooth``,
``rotate``), applied in registers between the fp32 widening and the quantizer, in the order and with the exact
fp32 operations of ``qattn.quant.transforms.transform_kv``: RoPE on K (NeoX pairs ``(i, i + rotary_dim/2)``, whose
partner may sit in another lane of the row: warp shuffles, see :func:`neox_partner_plan`; GPT-J pairs
``(2i, 2i+1)`` are in-thread; cos/sin read from the caller's fp32 table at the token's position, clamped into
the table), minus the K mean of the row's head, then the Hadamard butterflies on K and V (steps with
``h < E`` in-thread, the others by xor-shuffles between the lanes of the row), the sign multiply and the
``fp32(1/sqrt(D))`` multiply. Every one of these fp32 operations is an inline ``mul.rn`` / ``add.rn`` /
``sub.rn`` (ptxas never contracts them into an fma; the CPU test checks that the PTX holds no fp32 fma).
Rows that a transform changed are stored from fp32 (RNE to bf16 for bf16 payloads and rings).

Ring entries hit twice in one call (a prefill chunk longer than the window): the reference keeps the token with
the largest position. The kernel writes a token's ring row unless token ``t + W`` of the same call (W = the
window) is a kept token of the same ring slot at position ``pos + W`` (the token that overwrites it). This is
exactly the reference when, for every ring entry that several tokens of the call hit, those tokens' sequence is
laid out contiguously in the call with consecutive positions (how prefill chunks and decode batches are
built). ``write_kv(..., check=True)`` verifies that precondition on the host (and the slot / position ranges);
without ``check`` nothing is synchronised and a violation gives an unspecified (but in-bounds) ring entry.

Pools and inputs are addressed with 32-bit element indices: the wrapper rejects (from shapes only) pools of
>= 2^31 words or inputs of >= 2^31 values.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

import torch

from qattn.cute_kernels.common import fp4
from qattn.interface.fast_launch import fast, stream_handle
from qattn.interface.variants import Variant, cache_for, register
from qattn.layouts.formats import KVFormat, kv_format
from qattn.quant.transforms import ROPE_STYLES, _scale_const

__all__ = ["KVInsert", "make_insert_compile_args", "launch_insert", "INSERT_FORMATS"]

INSERT_FORMATS = ("bf16", "fp8", "int8", "nvfp4", "mxfp4", "mxfp4_b16")
_THREADS = 128
_FP32_MIN_NORMAL = 2.0**-126


# ------------------------------------------------------------------------------------------------
# PTX helpers (pure register ops)
# ------------------------------------------------------------------------------------------------
PTX_BF16X2_TO_F32X2 = "{\n\tshl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;\n\t}"
PTX_F32X2_TO_BF16X2 = "cvt.rn.bf16x2.f32 $0, $2, $1;"  # first source -> upper half
PTX_F32X2_TO_F16X2 = "cvt.rn.f16x2.f32 $0, $2, $1;"
PTX_F32X4_TO_E4M3X4 = (
    "{\n\t.reg .b16 lo, hi;\n\t"
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
    "mov.b32 $0, {lo, hi};\n\t}"
)
PTX_F32X4_TO_S8X4 = (
    "{\n\t.reg .s32 a, b, c, d, t;\n\t"
    "cvt.rni.s32.f32 a, $1;\n\tcvt.rni.s32.f32 b, $2;\n\tcvt.rni.s32.f32 c, $3;\n\tcvt.rni.s32.f32 d, $4;\n\t"
    "max.s32 a, a, -127;\n\tmax.s32 b, b, -127;\n\tmax.s32 c, c, -127;\n\tmax.s32 d, d, -127;\n\t"
    "min.s32 a, a, 127;\n\tmin.s32 b, b, 127;\n\tmin.s32 c, c, 127;\n\tmin.s32 d, d, 127;\n\t"
    "and.b32 t, a, 0xFF;\n\tbfi.b32 t, b, t, 8, 8;\n\tbfi.b32 t, c, t, 16, 8;\n\tbfi.b32 $0, d, t, 24, 8;\n\t}"
)
# Explicitly rounded fp32 ops: ptxas never contracts mul.rn / add.rn / sub.rn into an fma, so the order of
# operations is exactly the one written (the transforms' references depend on it).
PTX_MUL_RN = "mul.rn.f32 $0, $1, $2;"
PTX_ADD_RN = "add.rn.f32 $0, $1, $2;"
PTX_SUB_RN = "sub.rn.f32 $0, $1, $2;"


def _asm(result_type, operands, text: str, constraints: str) -> ir.Value:
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bf16x2_to_f32x2(w, *, loc=None, ip=None):
    res = _asm(llvm.StructType.get_literal([T.f32(), T.f32()]), [Uint32(w).ir_value(loc=loc, ip=ip)],
               PTX_BF16X2_TO_F32X2, "=f,=f,r")
    return (Float32(llvm.extractvalue(T.f32(), res, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def f32x2_to_16x2(lo, hi, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    text = PTX_F32X2_TO_BF16X2 if is_bf16 else PTX_F32X2_TO_F16X2
    return Uint32(_asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                       text, "=r,f,f"))


@dsl_user_op
def f32x4_to_e4m3x4(a, b, c, d, *, loc=None, ip=None) -> Uint32:
    ops = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Uint32(_asm(T.i32(), ops, PTX_F32X4_TO_E4M3X4, "=r,f,f,f,f"))


@dsl_user_op
def f32x4_to_s8x4(a, b, c, d, *, loc=None, ip=None) -> Uint32:
    ops = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Uint32(_asm(T.i32(), ops, PTX_F32X4_TO_S8X4, "=r,f,f,f,f"))


@dsl_user_op
def _binop(a, b, text: str, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                        text, "=f,f,f"))


def mul_rn(a, b):
    return _binop(a, b, PTX_MUL_RN)


def sub_rn(a, b):
    return _binop(a, b, PTX_SUB_RN)


def add_rn(a, b):
    return _binop(a, b, PTX_ADD_RN)


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
def neox_partner_plan(elems: int, half: int) -> list[tuple[int, int, int, int]]:
    """Where the NeoX RoPE partner of each of a thread's ``elems`` values lives (compile-time, per local index j).

    Element ``i = part * elems + j`` pairs with ``i + half`` when ``i < half`` and with ``i - half`` otherwise;
    that is local index ``(j +- half) mod elems`` of the lane ``(j +- half) div elems`` away (floor division:
    the same for every thread of the row). Returns ``(lo_loc, lo_off, hi_loc, hi_off)`` per j. Shared with the
    CPU emulation test of the kernel's data movement."""
    return [((j + half) % elems, (j + half) // elems, (j - half) % elems, (j - half) // elems) for j in range(elems)]


def _resolve(fmt, scale_rule=None) -> KVFormat:
    if isinstance(fmt, KVFormat):
        return fmt
    return kv_format(fmt, scale_rule=scale_rule) if scale_rule else kv_format(fmt)


class _Side:
    """Constexpr facts of one side (K or V): its format and the per-thread vector widths."""

    def __init__(self, fmt: KVFormat, head_dim: int, elems: int):
        self.fmt = fmt
        self.kind = {"bf16": "bf16", "e4m3": "fp8", "int8": "int8", "e2m1": "fp4"}[fmt.payload]
        self.words = elems * fmt.bits // 32  # payload words per thread
        self.vec = min(4, self.words)  # words per store (16 or 8 bytes)
        self.row_words = head_dim * fmt.bits // 32
        self.block = fmt.scale_block or 0
        self.nvfp4 = fmt.scale_rule == "nvfp4"
        self.rceil = fmt.scale_rule == "rceil"
        self.scales_per_thread = elems // self.block if self.block else 0
        self.scales_per_row = head_dim // self.block if self.block else 0
        self.qmax = 448.0 if self.kind == "fp8" else 127.0
        self.search = fmt.scale_search  # FP4 only: None or "msenb" (_fp4_scale_search)


class KVInsert:
    """Quantize-and-insert for one (K format, V format, head_dim, input dtype, ring) combination.

    ``KVInsert("nvfp4", "fp8", 128)``; ``__call__`` is the ``@cute.jit`` host entry taking raw global pointers
    (inputs, payload pools and rings 16-byte aligned) plus the dynamic sizes. num_kv_heads, page_size and the
    window are runtime values (no recompilation per model), formats and head_dim are compile-time.
    """

    def __init__(self, k_fmt, v_fmt, head_dim: int, in_bf16: bool = True, ring: bool = False,
                 ring_bf16: bool = True, *, rope_style: Optional[str] = None, rotary_dim: int = 0,
                 smooth: bool = False, rotate: bool = False, sink_tokens: int = 0, elems: Optional[int] = None,
                 cta_threads: int = _THREADS):
        kf, vf = _resolve(k_fmt), _resolve(v_fmt)
        kf.check_head_dim(head_dim)
        vf.check_head_dim(head_dim)
        if head_dim % 16 or head_dim < 16 or (head_dim // (32 if head_dim % 32 == 0 else 16)) & (
                head_dim // (32 if head_dim % 32 == 0 else 16) - 1):
            raise ValueError(f"head_dim: {head_dim} is not supported by the insert kernel "
                             "(needs head_dim / 32 (or / 16) to be a power of two: 16, 32, 64, 128, 256, 512)")
        self.head_dim = head_dim
        # values per thread (``elems``) and threads per CTA: A/B knobs; the defaults are what write_kv launches.
        # 16 values per thread (more threads per row hide more load latency; H100, 64K tokens H8 D128 page 16,
        # % of copy bandwidth, E 32 -> 16: int8 80.8 -> 85.3, fp8 80.2 -> 85.5, bf16 71.8 -> 86.0, int8 K +
        # nvfp4 V 74.4 -> 77.5), except when both sides are FP4 (nvfp4: 68.5 vs 68.8, noise) or one has MX
        # blocks of 32 (a thread holds whole blocks), and above head_dim 256 (G would exceed 16 lanes).
        both_fp4 = kf.payload == vf.payload == "e2m1"
        wide = 32 in (kf.scale_block, vf.scale_block) or both_fp4 or head_dim > 256
        self.elems = elems if elems is not None else (32 if head_dim % 32 == 0 and wide else 16)
        if self.elems not in (16, 32) or head_dim % self.elems or (self.elems == 16 and 32 in (kf.scale_block,
                                                                                            vf.scale_block)):
            raise ValueError(f"elems: {self.elems} values per thread do not fit head_dim {head_dim} and the formats")
        self.cta_threads = cta_threads
        self.threads_per_row = head_dim // self.elems
        self.rows_per_cta = max(1, cta_threads // self.threads_per_row)
        self.threads = self.rows_per_cta * self.threads_per_row
        self.in_bf16 = bool(in_bf16)
        self.ring = bool(ring)
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens: expected an int >= 0, got {sink_tokens!r}")
        # the dtype of the unquantized rows, ring and sink (the cache's dtype); without either it is unused and
        # fixed, so that caches differing only in dtype share the variant
        self.ring_bf16 = bool(ring_bf16) if (ring or sink_tokens) else True
        self.sink_tokens = sink_tokens  # compile time: the position test is one compare with a constant
        self.k = _Side(kf, head_dim, self.elems)
        self.v = _Side(vf, head_dim, self.elems)
        self.in_chunks = self.elems // 8  # 16-byte input vectors per thread
        # insert transforms (compile-time): RoPE on K, K smoothing, Hadamard rotation of K and V
        if rope_style is not None:
            if rope_style not in ROPE_STYLES:
                raise ValueError(f"rope_style: expected one of {ROPE_STYLES} or None, got {rope_style!r}")
            if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
                raise ValueError(f"rotary_dim: expected an even int in [2, head_dim={head_dim}], got {rotary_dim!r}")
        self.rope_style = rope_style
        self.rotary_dim = int(rotary_dim) if rope_style is not None else 0
        self.smooth = bool(smooth)
        self.rotate = bool(rotate)
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(f"head_dim: the Hadamard rotation needs a power of two, got {head_dim}")
        # fp32(1 / sqrt(head_dim)), rounded once from fp64: the reference's normalisation constant
        self.rotation_scale = float(_scale_const(head_dim, torch.float32)) if self.rotate else 0.0

    @property
    def key(self) -> tuple:
        key = (self.k.fmt.key, self.v.fmt.key, self.head_dim, self.in_bf16, self.ring, self.ring_bf16,
               self.rope_style, self.rotary_dim, self.smooth, self.rotate, self.sink_tokens, self.elems,
               self.cta_threads)
        return key + (("scale_search", self.k.search, self.v.search),) if self.k.search or self.v.search else key

    def _transforms(self, is_key: bool) -> bool:
        """Whether the row of this side is changed before it is stored (then stores convert from fp32)."""
        return self.rotate or (is_key and (self.rope_style is not None or self.smooth))

    # --------------------------------------------------------------------------------------------
    def _data_tensor(self, side: _Side, ptr, rows):
        return cute.make_tensor(ptr, cute.make_layout((side.vec, side.words // side.vec, self.threads_per_row, rows),
                                                      stride=(1, side.vec, side.words, side.row_words)))

    def _scale_tensor(self, side: _Side, ptr, rows):
        return scale_rows_tensor(side, ptr, rows, self.threads_per_row)

    def _input_tensor(self, ptr, num_tokens, num_heads, token16, head16):
        # the 16-bit K / V input: (4 words, chunk, thread-in-row, head, token), strides of tokens and heads given
        # in 16-byte units (4 words: the 16-byte loads stay provably aligned), so views are read in place
        head_words, token_words = cute.assume(head16 * 4, divby=4), cute.assume(token16 * 4, divby=4)
        return cute.make_tensor(ptr, cute.make_layout((4, self.in_chunks, self.threads_per_row, num_heads, num_tokens),
                                                      stride=(1, 4, self.elems // 2, head_words, token_words)))

    def _vec16_tensor(self, ptr, rows):
        # 16-bit rows (inputs, rings): (4 words, chunk, thread-in-row, row)
        return cute.make_tensor(ptr, cute.make_layout((4, self.in_chunks, self.threads_per_row, rows),
                                                      stride=(1, 4, self.elems // 2, self.head_dim // 2)))

    @cute.jit
    def __call__(
        self,
        k_in: cute.Pointer,  # Uint32 view of k (T, H, D) bf16/fp16, last dim contiguous, 16-byte aligned
        v_in: cute.Pointer,
        slots: cute.Pointer,  # Int64 (T,)
        seq_slots: cute.Pointer,  # Int64 (T,) (ring caches; any pointer otherwise)
        positions: cute.Pointer,  # Int64 (T,)
        k_data: cute.Pointer,  # Uint32 view of the K data pool, 16-byte aligned
        k_scale: cute.Pointer,  # Uint8 (block scales) / Float32 (row scales) / any (bf16)
        k_gscale: cute.Pointer,  # Float32 (H,) (nvfp4; any pointer otherwise)
        v_data: cute.Pointer,
        v_scale: cute.Pointer,
        v_gscale: cute.Pointer,
        k_ring: cute.Pointer,  # Uint32 view of (max_seqs, H, W, D) 16-bit ring (ring caches; any otherwise)
        v_ring: cute.Pointer,
        k_sink: cute.Pointer,  # Uint32 view of (max_seqs, H, N, D) 16-bit sink rows (sink caches; any otherwise)
        v_sink: cute.Pointer,
        cos_sin: cute.Pointer,  # Float32 (max_position, rotary_dim) RoPE table (RoPE; any otherwise)
        k_mean: cute.Pointer,  # Float32 (H, D), 16-byte aligned (smoothing; any otherwise)
        rot_signs: cute.Pointer,  # Float32 (D,) +-1, 16-byte aligned (rotation; any otherwise)
        num_tokens: Int32,
        num_heads: Int32,
        page_size: Int32,
        window: Int32,
        pool_rows: Int32,  # num_blocks * H * page_size
        ring_rows: Int32,  # max_seqs * H * window
        sink_rows: Int32,  # max_seqs * H * sink_tokens
        max_position: Int32,  # rows of the RoPE table (1 without RoPE)
        k_token16: Int32,  # token and head strides of k and v, in 16-byte units
        k_head16: Int32,
        v_token16: Int32,
        v_head16: Int32,
        stream: cuda.CUstream,
    ):
        rows = num_tokens * num_heads
        mKin = self._input_tensor(k_in, num_tokens, num_heads, k_token16, k_head16)
        mVin = self._input_tensor(v_in, num_tokens, num_heads, v_token16, v_head16)
        mSlot = cute.make_tensor(slots, cute.make_layout((num_tokens,)))
        mSeq = cute.make_tensor(seq_slots, cute.make_layout((num_tokens,)))
        mPos = cute.make_tensor(positions, cute.make_layout((num_tokens,)))
        mKd = self._data_tensor(self.k, k_data, pool_rows)
        mVd = self._data_tensor(self.v, v_data, pool_rows)
        mKs = self._scale_tensor(self.k, k_scale, pool_rows)
        mVs = self._scale_tensor(self.v, v_scale, pool_rows)
        mKg = cute.make_tensor(k_gscale, cute.make_layout((num_heads,)))
        mVg = cute.make_tensor(v_gscale, cute.make_layout((num_heads,)))
        mKr = self._vec16_tensor(k_ring, ring_rows)
        mVr = self._vec16_tensor(v_ring, ring_rows)
        mKsk = self._vec16_tensor(k_sink, sink_rows)
        mVsk = self._vec16_tensor(v_sink, sink_rows)
        rd = max(self.rotary_dim, 2)
        mCS = cute.make_tensor(cos_sin, cute.make_layout((max_position, rd), stride=(rd, 1)))
        mMean = cute.make_tensor(k_mean, cute.make_layout((self.elems, self.threads_per_row, num_heads),
                                                          stride=(1, self.elems, self.head_dim)))
        mSigns = cute.make_tensor(rot_signs, cute.make_layout((self.elems, self.threads_per_row)))
        grid_x = (rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mKin, mVin, mSlot, mSeq, mPos, mKd, mKs, mKg, mVd, mVs, mVg, mKr, mVr, mKsk, mVsk, mCS, mMean,
                    mSigns, num_tokens, num_heads, page_size, window, pool_rows, ring_rows, sink_rows,
                    max_position).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mKin: cute.Tensor, mVin: cute.Tensor, mSlot: cute.Tensor, mSeq: cute.Tensor,
               mPos: cute.Tensor, mKd: cute.Tensor, mKs: cute.Tensor, mKg: cute.Tensor, mVd: cute.Tensor,
               mVs: cute.Tensor, mVg: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor, mKsk: cute.Tensor,
               mVsk: cute.Tensor, mCS: cute.Tensor,
               mMean: cute.Tensor, mSigns: cute.Tensor, num_tokens: Int32, num_heads: Int32, page_size: Int32,
               window: Int32, pool_rows: Int32, ring_rows: Int32, sink_rows: Int32, max_position: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        part = tidx % self.threads_per_row
        token = row // num_heads
        head = row - token * num_heads
        # Both inputs are loaded first (for every in-range token, skipped ones too: in bounds and harmless), so
        # the 16-byte loads of K and V and the slot load are all in flight together.
        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        rKin = cute.make_rmem_tensor((4, self.in_chunks), Uint32)
        rVin = cute.make_rmem_tensor((4, self.in_chunks), Uint32)
        rKin.fill(Uint32(0))
        rVin.fill(Uint32(0))
        slot = Int64(-1)
        if token < num_tokens:
            slot = mSlot[token]
            for ci in cutlass.range_constexpr(self.in_chunks):
                cute.copy(vec128, mKin[None, ci, part, head, token], rKin[None, ci])
                cute.copy(vec128, mVin[None, ci, part, head, token], rVin[None, ci])
        # A slot past the pool (unchecked without write_kv(check=True)) is skipped like -1: never out of bounds.
        capacity = Int64(pool_rows // num_heads)  # num_blocks * page_size slots
        valid = slot >= Int64(0)
        if slot >= capacity:
            valid = False
        s32 = Int32(slot)
        blk = s32 // page_size
        pool_row = (blk * num_heads + head) * page_size + (s32 - blk * page_size)

        ring_ok = valid
        ring_row = Int32(0)
        if cutlass.const_expr(self.ring):
            if valid:
                seq = mSeq[token]
                pos = mPos[token]
                nxt = token + window
                if nxt < num_tokens:
                    if mSlot[nxt] >= Int64(0):
                        if mSlot[nxt] < capacity:  # a token that is written (its slot inside the pool)
                            if mSeq[nxt] == seq:
                                if mPos[nxt] == pos + Int64(window):
                                    ring_ok = False
                # an out-of-range seq_slot or a negative position writes no ring row (as for the sink, below);
                # seq < ring_rows (< 2^31) also keeps the 64-bit row product below from wrapping
                if seq < Int64(0):
                    ring_ok = False
                if seq >= Int64(ring_rows):
                    ring_ok = False
                if pos < Int64(0):
                    ring_ok = False
                row64 = (seq * Int64(num_heads) + Int64(head)) * Int64(window) + pos % Int64(window)
                if row64 >= Int64(ring_rows):
                    ring_ok = False
                ring_row = Int32(row64)

        # Sink caches: positions < N also go to sink[seq, head, pos]. Each entry is written by the one token at
        # that (sequence, position), so unlike the ring there is nothing to arbitrate. A negative position or an
        # out-of-range seq_slot (unchecked without write_kv(check=True)) writes no sink row: never out of bounds.
        sink_ok = valid
        sink_row = Int32(0)
        if cutlass.const_expr(self.sink_tokens > 0):
            spos = Int64(-1)
            sseq = Int64(0)
            if valid:
                spos = mPos[token]
                sseq = mSeq[token]
            if spos < Int64(0):
                sink_ok = False
            if spos >= Int64(self.sink_tokens):
                sink_ok = False
            if sseq < Int64(0):
                sink_ok = False
            if sseq >= Int64(sink_rows):  # (also keeps the row product below from wrapping)
                sink_ok = False
            row64 = (sseq * Int64(num_heads) + Int64(head)) * Int64(self.sink_tokens) + spos
            if row64 >= Int64(sink_rows):
                sink_ok = False
            sink_row = Int32(row64)

        # The RoPE table row of the token, clamped into the table: only kept tokens' rows matter, and a bad
        # position gives wrong numbers, never an out-of-bounds read (write_kv(check=True) rejects it).
        rope_row = Int32(0)
        if cutlass.const_expr(self.rope_style is not None):
            if valid:
                p = mPos[token]
                if p > Int64(0):
                    rope_row = max_position - 1
                    if p < Int64(max_position):
                        rope_row = Int32(p)

        self._side(self.k, True, rKin, mKd, mKs, mKg, mKr, mKsk, mCS, mMean, mSigns, rope_row, head, part,
                   pool_row, valid, ring_ok, ring_row, sink_ok, sink_row)
        self._side(self.v, False, rVin, mVd, mVs, mVg, mVr, mVsk, mCS, mMean, mSigns, rope_row, head, part,
                   pool_row, valid, ring_ok, ring_row, sink_ok, sink_row)

    @cute.jit
    def _side(self, side: cutlass.Constexpr, is_key: cutlass.Constexpr, rIn: cute.Tensor, mD: cute.Tensor,
              mS: cute.Tensor, mG: cute.Tensor, mR: cute.Tensor, mSk: cute.Tensor, mCS: cute.Tensor,
              mMean: cute.Tensor, mSigns: cute.Tensor, rope_row: Int32, head: Int32, part: Int32, pool_row: Int32,
              valid: cutlass.Boolean, ring_ok: cutlass.Boolean, ring_row: Int32, sink_ok: cutlass.Boolean,
              sink_row: Int32):
        E = self.elems
        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        rX = cute.make_rmem_tensor((E,), Float32)
        for w in cutlass.range_constexpr(E // 2):
            if cutlass.const_expr(self.in_bf16):
                lo, hi = bf16x2_to_f32x2(rIn[w % 4, w // 4])
            else:
                lo, hi = fp4.f16x2_to_f32x2(rIn[w % 4, w // 4])
            rX[2 * w] = lo
            rX[2 * w + 1] = hi

        # --- insert transforms, fp32, in the reference's order (qattn.quant.transforms.transform_kv) ----
        transformed = self._transforms(is_key)
        if cutlass.const_expr(is_key and self.rope_style is not None):
            self._rope(rX, mCS, rope_row, part)
        if cutlass.const_expr(is_key and self.smooth):
            self._smooth(rX, mMean, head, part)
        if cutlass.const_expr(self.rotate):
            self._rotate(rX, mSigns, part)

        # --- the unquantized (transformed) row into the ring and / or the sink --------------------
        if cutlass.const_expr(self.ring or self.sink_tokens > 0):
            rR = cute.make_rmem_tensor((4, self.in_chunks), Uint32)
            for w in cutlass.range_constexpr(E // 2):
                if cutlass.const_expr(self.ring_bf16 == self.in_bf16 and not transformed):
                    rR[w % 4, w // 4] = rIn[w % 4, w // 4]
                else:
                    rR[w % 4, w // 4] = f32x2_to_16x2(rX[2 * w], rX[2 * w + 1], self.ring_bf16)
            if cutlass.const_expr(self.ring):
                if ring_ok:
                    for cr in cutlass.range_constexpr(self.in_chunks):
                        cute.copy(vec128, rR[None, cr], mR[None, cr, part, ring_row])
            if cutlass.const_expr(self.sink_tokens > 0):
                if sink_ok:
                    for cr in cutlass.range_constexpr(self.in_chunks):
                        cute.copy(vec128, rR[None, cr], mSk[None, cr, part, sink_row])

        # --- quantize ------------------------------------------------------------------------------
        rP = cute.make_rmem_tensor((side.vec, side.words // side.vec), Uint32)
        if cutlass.const_expr(side.kind == "bf16"):
            for w in cutlass.range_constexpr(E // 2):
                if cutlass.const_expr(self.in_bf16 and not transformed):
                    rP[w % 4, w // 4] = rIn[w % 4, w // 4]
                else:
                    rP[w % 4, w // 4] = f32x2_to_16x2(rX[2 * w], rX[2 * w + 1], True)
        elif cutlass.const_expr(side.kind == "fp8" or side.kind == "int8"):
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(E):
                amax = cute.arch.fmax(amax, abs(rX[i]))
            off = self.threads_per_row // 2
            while cutlass.const_expr(off >= 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
                off = off // 2
            s = amax / Float32(side.qmax)
            inv = Float32(0.0)
            if s >= Float32(_FP32_MIN_NORMAL):
                inv = fp4.rcp_rn(s)
            for w in cutlass.range_constexpr(side.words):
                y0 = rX[4 * w] * inv
                y1 = rX[4 * w + 1] * inv
                y2 = rX[4 * w + 2] * inv
                y3 = rX[4 * w + 3] * inv
                if cutlass.const_expr(side.kind == "fp8"):
                    rP[w % side.vec, w // side.vec] = f32x4_to_e4m3x4(y0, y1, y2, y3)
                else:
                    rP[w % side.vec, w // side.vec] = f32x4_to_s8x4(y0, y1, y2, y3)
            if valid:
                if part == 0:
                    mS[pool_row] = s
        else:  # FP4
            rS = cute.make_rmem_tensor((side.scales_per_thread,), Uint8)
            g = Float32(1.0)
            if cutlass.const_expr(side.nvfp4):
                g = mG[head]
            for b in cutlass.range_constexpr(side.scales_per_thread):
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(side.block):
                    amax = cute.arch.fmax(amax, abs(rX[b * side.block + i]))
                sbyte, mul = fp4.fp4_block_scale(amax, g, side.nvfp4, side.rceil)
                if cutlass.const_expr(side.search is not None):
                    sbyte, mul = _fp4_scale_search(rX, b * side.block, side, amax, g, sbyte, mul)
                words = _fp4_block_words(rX, b * side.block, side.block, mul)
                rS[b] = Uint8(sbyte)
                for wj in cutlass.range_constexpr(side.block // 8):
                    w = b * side.block // 8 + wj
                    rP[w % side.vec, w // side.vec] = words[wj]
            if valid:
                cute.autovec_copy(rS, mS[None, part, pool_row])

        if valid:
            st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * side.vec)
            for cs in cutlass.range_constexpr(side.words // side.vec):
                cute.copy(st, rP[None, cs], mD[None, cs, part, pool_row])


    # --------------------------------------------------------------------------------------------
    # transforms. Every fp32 operation is an explicitly rounded mul.rn / add.rn / sub.rn (inline PTX that ptxas
    # never contracts into an fma), in the order of qattn.quant.transforms, so the bytes equal the reference's.
    # Thread `part` of a row holds elements [part * E, part * E + E) of it; partners in other threads of the row
    # come by warp shuffles (the G threads of a row are consecutive lanes of one warp).
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def _rope(self, rX: cute.Tensor, mCS: cute.Tensor, rope_row: Int32, part: Int32):
        """x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin per pair; elements >= rotary_dim unchanged."""
        E = self.elems
        rd = self.rotary_dim
        half = rd // 2
        base = part * E
        # the partner of each element (the other member of its pair), gathered before anything is overwritten
        rPart = cute.make_rmem_tensor((E,), Float32)
        if cutlass.const_expr(self.rope_style == "gptj"):
            for j in cutlass.range_constexpr(E):
                rPart[j] = rX[j ^ 1]  # pairs (2i, 2i + 1) never straddle threads (E is even)
        else:
            lane = cute.arch.lane_idx()
            plan = neox_partner_plan(E, half)
            for j in cutlass.range_constexpr(E):
                lo_loc, lo_off, hi_loc, hi_off = plan[j]
                first = base + j < half
                if cutlass.const_expr(lo_loc == hi_loc):  # one shuffle, source lane picked per thread
                    off = Int32(hi_off)
                    if first:
                        off = Int32(lo_off)
                    rPart[j] = cute.arch.shuffle_sync(rX[lo_loc], lane + off)
                else:
                    if cutlass.const_expr(hi_off == 0):
                        rPart[j] = rX[hi_loc]
                    else:
                        rPart[j] = cute.arch.shuffle_sync(rX[hi_loc], lane + Int32(hi_off))
                    if cutlass.const_expr(lo_off == 0):
                        if first:
                            rPart[j] = rX[lo_loc]
                    else:
                        from_lo = cute.arch.shuffle_sync(rX[lo_loc], lane + Int32(lo_off))
                        if first:
                            rPart[j] = from_lo
        for j in cutlass.range_constexpr(E):
            i = base + j
            if i < rd:
                if cutlass.const_expr(self.rope_style == "gptj"):
                    col = i // 2
                    cos = mCS[rope_row, col]
                    sin = mCS[rope_row, col + half]
                    prod_cos = mul_rn(rX[j], cos)
                    prod_sin = mul_rn(rPart[j], sin)
                    if cutlass.const_expr(j % 2 == 0):  # base is even: j's parity is i's
                        rX[j] = sub_rn(prod_cos, prod_sin)
                    else:
                        rX[j] = add_rn(prod_cos, prod_sin)
                else:
                    first = i < half
                    col = i
                    if not first:
                        col = i - half
                    cos = mCS[rope_row, col]
                    sin = mCS[rope_row, col + half]
                    prod_cos = mul_rn(rX[j], cos)
                    prod_sin = mul_rn(rPart[j], sin)
                    if first:
                        rX[j] = sub_rn(prod_cos, prod_sin)
                    else:
                        rX[j] = add_rn(prod_cos, prod_sin)

    @cute.jit
    def _smooth(self, rX: cute.Tensor, mMean: cute.Tensor, head: Int32, part: Int32):
        """x - k_mean[head] (one fp32 subtraction per element)."""
        rM = cute.make_rmem_tensor((self.elems,), Float32)
        cute.autovec_copy(mMean[None, part, head], rM)
        for j in cutlass.range_constexpr(self.elems):
            rX[j] = sub_rn(rX[j], rM[j])

    @cute.jit
    def _rotate(self, rX: cute.Tensor, mSigns: cute.Tensor, part: Int32):
        """(FWHT(x) * s) * c: butterflies h = 1, 2, ..., D/2 turning (a, b) = (x[i], x[i + h]) (i & h == 0)
        into (a + b, a - b); steps with h < E stay in the thread, the others pair lanes by xor-shuffles."""
        E = self.elems
        for step in cutlass.range_constexpr(self.head_dim.bit_length() - 1):
            h = 1 << step
            if cutlass.const_expr(h < E):
                for j in cutlass.range_constexpr(E):
                    if cutlass.const_expr(j & h == 0):
                        a = rX[j]
                        b = rX[j + h]
                        rX[j] = add_rn(a, b)
                        rX[j + h] = sub_rn(a, b)
            else:
                lanes = h // E  # the partner element i ^ h lives in thread part ^ lanes, same local index
                upper = (part & Int32(lanes)) != Int32(0)
                for j in cutlass.range_constexpr(E):
                    other = cute.arch.shuffle_sync_bfly(rX[j], offset=lanes)
                    if upper:  # this thread holds b: a - b with a from the partner
                        rX[j] = sub_rn(other, rX[j])
                    else:
                        rX[j] = add_rn(rX[j], other)
        rS = cute.make_rmem_tensor((E,), Float32)
        cute.autovec_copy(mSigns[None, part], rS)
        scale = Float32(self.rotation_scale)
        for j in cutlass.range_constexpr(E):
            rX[j] = mul_rn(mul_rn(rX[j], rS[j]), scale)


# ------------------------------------------------------------------------------------------------
# FP4 blocks (one thread holds a whole block): codes, and the encoder-side scale search
# ------------------------------------------------------------------------------------------------
def _fp4_block_words(rX, base: int, block: int, mul) -> list:
    """The packed E2M1 words of values ``rX[base:base + block]`` times ``mul`` (8 codes per word)."""
    return [fp4.pack_e2m1x8(*[fp4.f32_to_e2m1(rX[base + 8 * wj + k] * mul) for k in range(8)])
            for wj in range(block // 8)]


def _fp4_block_sse(rX, base: int, block: int, mul, scale_f, g, nvfp4: bool):
    """Squared error of values ``rX[base:base + block]`` encoded with multiplier ``mul`` and decoded as the
    readers do (nvfp4 ``(q * s_f) * g``, MX ``q * 2^e``; ``scale_f`` = s_f or 2^e), in the reference's order
    (``qattn.quant.reference._block_sse``): ``e = x - y``, ``e * e``, then the halving tree
    ``sq[i] += sq[i + n/2]``, every step one rounded fp32 op. ``q`` is the E2M1 grid value of the code
    ``f32_to_e2m1(x * mul)`` would give (``e2m1_round_f32``, no code needed)."""
    sq = []
    for i in range(block):
        x = rX[base + i]
        y = mul_rn(fp4.e2m1_round_f32(x * mul), scale_f)
        if nvfp4:
            y = mul_rn(y, g)
        e = sub_rn(x, y)
        sq.append(mul_rn(e, e))
    n = len(sq)
    while n > 1:
        n //= 2
        sq = [add_rn(sq[i], sq[i + n]) for i in range(n)]
    return sq[0]


def _fp4_scale_search(rX, base: int, side: _Side, amax, g, sbyte, mul):
    """``KVFormat.scale_search == "msenb"``: the block's (scale byte, multiplier) with the smallest squared error
    among the rule's (``sbyte``, ``mul``) and its neighbours, as ``qattn.quant.reference.quantize`` picks them:
    nvfp4 the E4M3 bytes ``sbyte - 1`` and ``sbyte + 1`` (clamped to [0, 0x7E]), MX the other one of floor /
    floor + 1 (floor + 1 at most 125). A candidate replaces the best so far only when its error is strictly
    smaller, so ties keep the rule's scale. Branch-free (selects); the caller encodes the block once, with the
    winner."""
    if side.nvfp4:
        cands = [cutlass.select_(sbyte > Uint32(0), sbyte - Uint32(1), Uint32(0)),
                 cutlass.select_(sbyte < Uint32(0x7E), sbyte + Uint32(1), Uint32(0x7E))]
    else:
        floor_byte = fp4.mx_ue8m0_floor(amax)
        up = cutlass.select_(floor_byte < Uint32(252), floor_byte + Uint32(1), Uint32(252))  # e + 1 <= 125
        cands = [cutlass.select_(sbyte == floor_byte, up, floor_byte)]

    def scale_value(byte):
        return fp4.e4m3_to_f32(byte) if side.nvfp4 else fp4.ue8m0_to_f32(byte)

    best = _fp4_block_sse(rX, base, side.block, mul, scale_value(sbyte), g, side.nvfp4)
    for c in cands:
        cmul = fp4.fp4_block_multiplier(c, g, side.nvfp4)
        err = _fp4_block_sse(rX, base, side.block, cmul, scale_value(c), g, side.nvfp4)
        take = err < best  # strict: NaN never wins, ties keep the earlier candidate
        best = cutlass.select_(take, err, best)
        sbyte = cutlass.select_(take, c, sbyte)
        mul = cutlass.select_(take, cmul, mul)
    return sbyte, mul


# ==================================================================================================
# compile and launch
# ==================================================================================================
def scale_rows_tensor(side: _Side, ptr, rows, threads_per_row: int):
    """The scale pool of one side as seen by a row kernel (insert, flatten): block scales as (scales of a thread,
    thread in the row, row); one fp32 per-token scale (fp8 / int8) as (row,)."""
    if side.block:
        return cute.make_tensor(ptr, cute.make_layout((side.scales_per_thread, threads_per_row, rows),
                                                      stride=(1, side.scales_per_thread, side.scales_per_row)))
    return cute.make_tensor(ptr, cute.make_layout((rows,)))


def _scale_ptr_type(fmt: KVFormat):
    if fmt.scale_block:
        return Uint8, 4
    return (Float32, 4) if fmt.is_quantized else (Uint8, 4)


def make_insert_compile_args(k_fmt, v_fmt, head_dim: int, in_bf16: bool = True, ring: bool = False,
                             ring_bf16: bool = True, **transforms):
    """(kernel object, args) to compile :class:`KVInsert` without a GPU (fake pointers, fake stream).
    ``transforms``: ``rope_style``, ``rotary_dim``, ``smooth``, ``rotate``, ``sink_tokens`` as in :class:`KVInsert`."""
    cfg = KVInsert(k_fmt, v_fmt, head_dim, in_bf16, ring, ring_bf16, **transforms)
    return cfg, _fake_args(cfg)


def _fake_args(cfg: KVInsert):
    def p(dt, a):
        return cute.runtime.make_ptr(dt, 0, cute.AddressSpace.gmem, assumed_align=a)

    ks, vs = _scale_ptr_type(cfg.k.fmt), _scale_ptr_type(cfg.v.fmt)
    return (p(Uint32, 16), p(Uint32, 16), p(Int64, 8), p(Int64, 8), p(Int64, 8),
            p(Uint32, 16), p(*ks), p(Float32, 4), p(Uint32, 16), p(*vs), p(Float32, 4),
            p(Uint32, 16), p(Uint32, 16), p(Uint32, 16), p(Uint32, 16), p(Float32, 4), p(Float32, 16),
            p(Float32, 16)) + tuple(Int32(1) for _ in range(12)) + (cute.runtime.make_fake_stream(),)


def _compiled(cfg: KVInsert, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    def build():
        return compile_for_arch(cfg, *_fake_args(cfg), arch=arch, keep_ptx=False)[0]

    return cache_for("kv_insert").get(("kv_insert", arch) + cfg.key, build)


def launch_insert(cfg: KVInsert, arch: str, k, v, slots, seq_slots, positions, lay, num_blocks: int,
                  page_size: int, window: int, max_seqs: int, cos_sin=None, k_mean=None, rot_signs=None,
                  sink_tokens: int = 0) -> None:
    """Launch on torch's current stream. Tensors must already be validated (kv_cache_ops.write_kv).
    ``cos_sin`` (max_position, rotary_dim) fp32, ``k_mean`` (H, D) fp32 and ``rot_signs`` (D,) fp32 (16-byte
    aligned, contiguous) are needed exactly when ``cfg`` has RoPE, smoothing, rotation."""
    import torch

    T_, H = int(k.shape[0]), int(k.shape[1])
    if T_ == 0:
        return
    any16 = k  # a 16-byte aligned tensor for unused pointer slots

    gk = lay.k_global_scale if lay.k_global_scale is not None else any16
    gv = lay.v_global_scale if lay.v_global_scale is not None else any16
    kr = lay.k_ring if lay.k_ring is not None else any16
    vr = lay.v_ring if lay.v_ring is not None else any16
    ksk = lay.k_sink if lay.k_sink is not None else any16
    vsk = lay.v_sink if lay.v_sink is not None else any16
    seqs = seq_slots if seq_slots is not None else slots
    pos = positions if positions is not None else slots
    # raw addresses; each pointer's dtype and alignment are compile-time facts of the kernel (see _fake_args)
    ptrs = tuple((t if t is not None else any16).data_ptr() for t in (
        k, v, slots, seqs, pos, lay.k_data, lay.k_scale_pool, gk, lay.v_data, lay.v_scale_pool, gv, kr, vr,
        ksk, vsk, cos_sin, k_mean, rot_signs))
    max_position = int(cos_sin.shape[0]) if cos_sin is not None else 1
    fast(_compiled(cfg, arch))(*ptrs, T_, H, page_size, max(window, 1), num_blocks * H * page_size,
                               max_seqs * H * max(window, 1), max_seqs * H * max(sink_tokens, 1), max_position,
                               *_strides16(k), *_strides16(v), stream_handle(k.device))


def _strides16(t) -> tuple[int, int]:
    """(token, head) strides of a (T, H, D) 16-bit input in 16-byte units (a size-1 dimension's own stride is
    never used and may be anything: the contiguous one instead). ``write_kv`` copies inputs it cannot pass so."""
    T_, H, D = t.shape  # 16-bit: 8 elements per 16 bytes
    if t.is_contiguous():
        return H * D // 8, D // 8
    tok, head, _ = t.stride()
    return (tok if T_ > 1 else H * D) // 8, (head if H > 1 else D) // 8


# ==================================================================================================
# variants for qattn-warmup
# ==================================================================================================
@register("kv_insert")
def _insert_variants(arch: str, kv_formats=None, head_dims=None, recent_windows=None, sink_tokens=None,
                     q_dtypes=None, scale_searches=None, **_):
    """The variants ``write_kv`` compiles for caches without RoPE / smoothing / rotation (those compile on first
    use): each format or ``k+v`` pair (MX formats with both scale rules), head_dim, with / without a ring
    (any ``recent_windows`` entry > 0), sink token count, and dtype (``q_dtypes``: bf16 / f16, the input's
    and the cache's); formats with an FP4 side also with each of ``scale_searches`` (``kv_format(...,
    scale_search=)``)."""
    from qattn.cute_kernels.compile_utils import compile_for_arch

    out, seen = [], set()
    for name in kv_formats or INSERT_FORMATS:
        sides = name.split("+") if "+" in name else [name, name]
        if len(sides) != 2 or any(x not in INSERT_FORMATS for x in sides):
            continue
        rules = ("floor", "rceil") if any(x.startswith("mxfp4") for x in sides) else (None,)
        fp4 = any(kv_format(x).payload == "e2m1" for x in sides)
        for rule, search in ((r, s) for r in rules for s in [None] + (list(scale_searches or ()) if fp4 else [])):
            kf, vf = (_resolve(x, rule if x.startswith("mxfp4") else None) for x in sides)
            if search is not None:  # (the FP4 sides take it)
                pair = kv_format((kf, vf), scale_search=search)
                kf, vf = pair.k, pair.v
            for d in head_dims or [64, 128, 256]:
                for ring in sorted({bool(w) for w in recent_windows or [0]}):
                    for n in sink_tokens or [0]:
                        for dt in q_dtypes or ["bf16"]:
                            bf16 = dt == "bf16"
                            cfg = KVInsert(kf, vf, d, in_bf16=bf16, ring=ring, ring_bf16=bf16, sink_tokens=n)
                            key = ("kv_insert", arch) + cfg.key
                            if key in seen:
                                continue
                            seen.add(key)
                            build = (lambda cfg=cfg: compile_for_arch(cfg, *_fake_args(cfg), arch=arch,
                                                                      keep_ptx=False)[0])
                            label = (f"{name}{'' if rule is None else ' ' + rule} D{d}" + (" ring" if ring else "")
                                     + (f" N{n}" if n else "") + ("" if bf16 else f" {dt}")
                                     + ("" if search is None else f" {search}"))
                            out.append(Variant("kv_insert", key, label, build))
    return out
