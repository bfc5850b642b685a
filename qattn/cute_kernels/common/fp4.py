"""Device-side FP4 (E2M1) helpers for SM90 and newer, written as inline PTX.

SM90 has no FP4 or E8M0 conversion instructions (``cvt.*.e2m1x2`` is sm_100a+), so FP4 is decoded with
integer byte permutes and the FP8 conversion that SM89+/SM90 do have:

* every E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) is exactly an E4M3 value, so a ``prmt`` over an 8-byte
  table turns four 3-bit magnitudes into four E4M3 bytes, and
* ``cvt.rn.f16x2.e4m3x2`` then gives two exact halves per instruction.

Decoding 8 values (one 32-bit word of packed payload) costs 9 integer instructions plus 4 conversions, about
1.6 instructions per value, which is what the decode kernel's budget allows (docs/design-notes.md, "Decode on
SM90").

Every helper takes and returns DSL numerics (``Uint32`` words holding packed bytes or packed halves,
``Float32`` scalars), so kernels compose them freely. Each is one ``llvm.inline_asm`` whose PTX body is a
module constant ``PTX_*`` (``$0..`` are the outputs, then the inputs); the CPU tests run those exact strings
through a small PTX interpreter against ``qattn.quant.reference``. ``PTX_HELPERS`` maps helper -> body.

Byte and nibble order: element ``2i`` of a row sits in the LOW nibble of byte ``i`` and words are little
endian, so element ``k`` of a payload word is nibble ``k`` (bits ``4k..4k+3``). Helpers keep that natural
order: the low half of f16x2 output word ``j`` is element ``2j``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = [
    "E2M1_TO_E4M3_LUT",
    "PTX_HELPERS",
    "e2m1x8_to_e4m3x8",
    "e4m3x4_to_f16x4",
    "e2m1x8_to_f16x8",
    "e2m1x8_to_f16x8_scaled_even_odd",
    "e2m1x8_to_e4m3x8_even_odd",
    "e4m3_pair_to_f16x2",
    "e4m3_to_f16x2",
    "f16x2_mul",
    "f16x2_to_f32x2",
    "ue8m0_to_f32",
    "e4m3_to_f32",
    "f32_to_e4m3_satfinite",
    "rcp_rn",
    "mx_ue8m0_floor",
    "mx_ue8m0_rceil",
    "f32_to_e2m1",
    "e2m1_round_f32",
    "pack_e2m1x8",
    "fp4_block_scale",
    "fp4_block_multiplier",
]

# E4M3FN bytes of the 8 E2M1 magnitudes, as the two prmt source registers: entries 0..3 in the low word,
# 4..7 in the high word.  0 -> 0x00, 0.5 -> 0x30, 1 -> 0x38, 1.5 -> 0x3C, 2 -> 0x40, 3 -> 0x44, 4 -> 0x48,
# 6 -> 0x4C  (E4M3: bias 7, 3 mantissa bits).
E2M1_TO_E4M3_LUT = (0x3C383000, 0x4C484440)


# ------------------------------------------------------------------------------------------------
# PTX bodies
# ------------------------------------------------------------------------------------------------
# $0, $1 <- $2: 8 E2M1 -> 8 E4M3 bytes (elements 0..3, 4..7).
PTX_E2M1X8_TO_E4M3X8 = (
    "{\n\t"
    ".reg .b32 s, h, w4, m0, m1, g0, g1;\n\t"
    "and.b32 s, $2, 0x77777777;\n\t"  # 3-bit magnitudes of all 8 nibbles
    "shr.b32 h, s, 16;\n\t"  # elements 4..7 into the low half (prmt reads selectors c[15:0])
    "shl.b32 w4, $2, 4;\n\t"  # sign of even elements (bit 3 of a byte) -> that byte's msb
    f"prmt.b32 m0, {E2M1_TO_E4M3_LUT[0]:#010x}, {E2M1_TO_E4M3_LUT[1]:#010x}, s;\n\t"  # table lookup
    f"prmt.b32 m1, {E2M1_TO_E4M3_LUT[0]:#010x}, {E2M1_TO_E4M3_LUT[1]:#010x}, h;\n\t"
    # sign-replicate mode (selector bit 3): 0xFF/0x00 from the msb of w4 (even) or w (odd elements)
    "prmt.b32 g0, w4, $2, 0xD9C8;\n\t"
    "prmt.b32 g1, w4, $2, 0xFBEA;\n\t"
    "lop3.b32 $0, m0, g0, 0x80808080, 0xF8;\n\t"  # m | (g & 0x80808080)
    "lop3.b32 $1, m1, g1, 0x80808080, 0xF8;\n\t"
    "}"
)

# $0, $1 <- $2: 8 E2M1 -> 8 E4M3 bytes holding the values times 2^-6, even elements in $0, odd in $1
# ($0 = [e0, e2, e4, e6], $1 = [e1, e3, e5, e7]). The E4M3 byte (sign << 7) | (magnitude << 2) is exactly
# 2^-6 times the E2M1 value, subnormals included: the 2 exponent bits land in E4M3's exponent field (bias 7
# instead of E2M1's 1) and the mantissa bit in its top mantissa bit. No table, 7 integer instructions.
PTX_E2M1X8_TO_E4M3X8_EVEN_ODD = (
    "{\n\t"
    ".reg .b32 a, b, c;\n\t"
    "shl.b32 a, $2, 2;\n\t"  # low nibbles: magnitude bits 0..2 -> 2..4 of each byte
    "and.b32 a, a, 0x1C1C1C1C;\n\t"
    "shl.b32 b, $2, 4;\n\t"  # low nibbles: sign bit 3 -> 7
    "lop3.b32 $0, a, b, 0x80808080, 0xF8;\n\t"  # a | (b & 0x80808080)
    "shr.b32 c, $2, 2;\n\t"  # high nibbles: magnitude bits 4..6 -> 2..4; the sign is already bit 7
    "and.b32 c, c, 0x1C1C1C1C;\n\t"
    "lop3.b32 $1, c, $2, 0x80808080, 0xF8;\n\t"
    "}"
)

# $0, $1 <- $2: 4 E4M3 bytes -> two f16x2 (the low byte of each 16-bit source -> the low half).
PTX_E4M3X4_TO_F16X4 = (
    "{\n\t"
    ".reg .b16 lo, hi;\n\t"
    "mov.b32 {lo, hi}, $2;\n\t"
    "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t"
    "cvt.rn.f16x2.e4m3x2 $1, hi;\n\t"
    "}"
)


def _ptx_e4m3_bcast(byte_index: int) -> str:
    # $0 <- $1: byte k of the word twice (prmt selector 0xkk), then one conversion.
    return (
        "{\n\t"
        ".reg .b32 t;\n\t"
        ".reg .b16 lo, hi;\n\t"
        f"prmt.b32 t, $1, 0, {byte_index * 0x11:#x};\n\t"
        "mov.b32 {lo, hi}, t;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t"
        "}"
    )


# $0 <- byte 0 of $1 and byte 0 of $2, two E4M3 scales, as one f16x2 (low half from $1). Exact.
PTX_E4M3_PAIR_TO_F16X2 = (
    "{\n\t"
    ".reg .b32 t;\n\t"
    ".reg .b16 lo, hi;\n\t"
    "prmt.b32 t, $1, $2, 0x40;\n\t"
    "mov.b32 {lo, hi}, t;\n\t"
    "cvt.rn.f16x2.e4m3x2 $0, lo;\n\t"
    "}"
)

PTX_F16X2_MUL = "mul.rn.f16x2 $0, $1, $2;"

# $0, $1 <- $2
PTX_F16X2_TO_F32X2 = (
    "{\n\t"
    ".reg .b16 lo, hi;\n\t"
    "mov.b32 {lo, hi}, $2;\n\t"
    "cvt.f32.f16 $0, lo;\n\t"
    "cvt.f32.f16 $1, hi;\n\t"
    "}"
)

# $0 (f32) <- $1 (byte): 2^(byte-127) from bits.
PTX_UE8M0_TO_F32 = (
    "{\n\t"
    ".reg .b32 t;\n\t"
    ".reg .pred p;\n\t"
    "shl.b32 t, $1, 23;\n\t"  # biased exponent field
    "max.u32 t, t, 0x00400000;\n\t"  # byte 0: 2^-127 is the subnormal 0x00400000 (bytes >= 1 give >= 0x00800000)
    "setp.eq.u32 p, $1, 255;\n\t"  # byte 255 is NaN (the shift would give +inf)
    "selp.b32 $0, 0x7FC00000, t, p;\n\t"
    "}"
)

# $0 (f32) <- $1 (byte)
PTX_E4M3_TO_F32 = (
    "{\n\t"
    ".reg .b16 b, lo, hi;\n\t"
    ".reg .b32 h;\n\t"
    "cvt.u16.u32 b, $1;\n\t"
    "cvt.rn.f16x2.e4m3x2 h, b;\n\t"
    "mov.b32 {lo, hi}, h;\n\t"
    "cvt.f32.f16 $0, lo;\n\t"
    "}"
)

# $0 (byte) <- $1 (f32). The first source goes to the upper byte, so x is the second.
PTX_F32_TO_E4M3_SATFINITE = (
    "{\n\t"
    ".reg .b16 h;\n\t"
    ".reg .f32 z;\n\t"
    "mov.b32 z, 0;\n\t"
    "cvt.rn.satfinite.e4m3x2.f32 h, z, $1;\n\t"
    "cvt.u32.u16 $0, h;\n\t"
    "}"
)

PTX_RCP_RN = "rcp.rn.f32 $0, $1;"

# $0 (byte) <- $1 (amax, f32 >= 0): byte = max(E, 2) - 2 with E the biased exponent field.
PTX_MX_UE8M0_FLOOR = (
    "{\n\t"
    ".reg .b32 e;\n\t"
    "mov.b32 e, $1;\n\t"
    "bfe.u32 e, e, 23, 8;\n\t"
    "max.u32 e, e, 2;\n\t"
    "sub.u32 $0, e, 2;\n\t"
    "}"
)

# $0 (byte) <- $1 (amax): byte = max(E + (mantissa > 0x400000), 2) - 2.
PTX_MX_UE8M0_RCEIL = (
    "{\n\t"
    ".reg .b32 b, e, m;\n\t"
    ".reg .pred p;\n\t"
    "mov.b32 b, $1;\n\t"
    "bfe.u32 e, b, 23, 8;\n\t"
    "and.b32 m, b, 0x007FFFFF;\n\t"
    "setp.gt.u32 p, m, 0x00400000;\n\t"
    "selp.b32 m, 1, 0, p;\n\t"
    "add.s32 e, e, m;\n\t"
    "max.s32 e, e, 2;\n\t"
    "min.s32 e, e, 254;\n\t"  # e <= 125: 6 * 2^e stays finite (saturate, never inf)
    "sub.s32 $0, e, 2;\n\t"
    "}"
)

# $0 <- $1 rounded to the signed E2M1 grid (the value of f32_to_e2m1's code, as fp32): |x| saturated at 6, then
# rounded to a multiple of 2^(E-1) (E = its binade, at least 0) by adding and subtracting c = 1.5 * 2^(E+22),
# whose binade has exactly that ulp: the fp32 add rounds half to even, and an even multiple of the step is an
# even E2M1 code (c is an even multiple), so ties go where E2M1's do; a sum that rounds up into the next binade
# is still exact (2^(E+1) is a grid value). Then the sign of x.
PTX_E2M1_ROUND_F32 = (
    "{\n\t"
    ".reg .b32 a, c, s;\n\t"
    ".reg .f32 af, cf, t;\n\t"
    "abs.f32 af, $1;\n\t"
    "min.f32 af, af, 0f40C00000;\n\t"  # saturate at 6.0 (+inf -> 6; NaN -> 6 since min ignores NaN)
    "mov.b32 a, af;\n\t"
    "and.b32 c, a, 0x7F800000;\n\t"  # the exponent field ...
    "max.u32 c, c, 0x3F800000;\n\t"  # ... at least 2^0 (step 0.5 on [0, 2)) ...
    "add.u32 c, c, 0x0B400000;\n\t"  # ... times 2^22, mantissa 1.5
    "mov.b32 cf, c;\n\t"
    "add.rn.f32 t, af, cf;\n\t"
    "sub.rn.f32 t, t, cf;\n\t"
    "mov.b32 a, t;\n\t"
    "mov.b32 s, $1;\n\t"
    "and.b32 s, s, 0x80000000;\n\t"
    "or.b32 a, a, s;\n\t"
    "mov.b32 $0, a;\n\t"
    "}"
)
# $0 (code) <- $1 (f32): code = rni(a * 2^(1-e)) + 2e, e = clamp(floor(log2 a), 0, 2), a = min(|x|, 6).
PTX_F32_TO_E2M1 = (
    "{\n\t"
    ".reg .b32 xb, a, e, m, r, s;\n\t"
    ".reg .f32 af, mf, v;\n\t"
    "mov.b32 xb, $1;\n\t"
    "and.b32 a, xb, 0x7FFFFFFF;\n\t"  # |x|
    "mov.b32 af, a;\n\t"
    "min.f32 af, af, 0f40C00000;\n\t"  # saturate at 6.0 (+inf -> 6; NaN -> 6 since min ignores NaN)
    "mov.b32 a, af;\n\t"
    "shr.u32 e, a, 23;\n\t"
    "max.u32 e, e, 127;\n\t"  # biased exponent, clamped to [127, 129]  (a <= 6 bounds it above)
    "sub.u32 m, 255, e;\n\t"  # biased exponent of 2^(1-e)
    "shl.b32 m, m, 23;\n\t"
    "mov.b32 mf, m;\n\t"
    "mul.rn.f32 v, af, mf;\n\t"  # exact: a power-of-two scaling into [0, 4)
    "cvt.rni.u32.f32 r, v;\n\t"  # round half to even: the E2M1 tie rule
    "mad.lo.u32 r, e, 2, r;\n\t"  # + 2 * biased exponent ...
    "sub.u32 r, r, 254;\n\t"  # ... - 2 * 127
    "shr.u32 s, xb, 28;\n\t"  # the fp32 sign bit -> bit 3
    "and.b32 s, s, 8;\n\t"
    "or.b32 $0, r, s;\n\t"
    "}"
)

# $0 <- $1..$8: 8 codes -> one word, code k in nibble k.
PTX_PACK_E2M1X8 = (
    "{\n\t.reg .b32 t;\n\tmov.b32 t, $1;\n\t"
    + "".join(f"bfi.b32 t, ${k + 1}, t, {4 * k}, 4;\n\t" for k in range(1, 8))
    + "mov.b32 $0, t;\n\t}"
)

# helper name -> (PTX body, number of outputs, input kinds "u" (u32) / "f" (f32))
PTX_HELPERS = {
    "e2m1x8_to_e4m3x8": (PTX_E2M1X8_TO_E4M3X8, 2, "u"),
    "e2m1x8_to_e4m3x8_even_odd": (PTX_E2M1X8_TO_E4M3X8_EVEN_ODD, 2, "u"),
    "e4m3x4_to_f16x4": (PTX_E4M3X4_TO_F16X4, 2, "u"),
    "e4m3_pair_to_f16x2": (PTX_E4M3_PAIR_TO_F16X2, 1, "uu"),
    "e4m3_to_f16x2[0]": (_ptx_e4m3_bcast(0), 1, "u"),
    "e4m3_to_f16x2[1]": (_ptx_e4m3_bcast(1), 1, "u"),
    "e4m3_to_f16x2[2]": (_ptx_e4m3_bcast(2), 1, "u"),
    "e4m3_to_f16x2[3]": (_ptx_e4m3_bcast(3), 1, "u"),
    "f16x2_mul": (PTX_F16X2_MUL, 1, "uu"),
    "f16x2_to_f32x2": (PTX_F16X2_TO_F32X2, 2, "u"),
    "ue8m0_to_f32": (PTX_UE8M0_TO_F32, 1, "u"),
    "e4m3_to_f32": (PTX_E4M3_TO_F32, 1, "u"),
    "f32_to_e4m3_satfinite": (PTX_F32_TO_E4M3_SATFINITE, 1, "f"),
    "rcp_rn": (PTX_RCP_RN, 1, "f"),
    "mx_ue8m0_floor": (PTX_MX_UE8M0_FLOOR, 1, "f"),
    "mx_ue8m0_rceil": (PTX_MX_UE8M0_RCEIL, 1, "f"),
    "f32_to_e2m1": (PTX_F32_TO_E2M1, 1, "f"),
    "e2m1_round_f32": (PTX_E2M1_ROUND_F32, 1, "f"),
    "pack_e2m1x8": (PTX_PACK_E2M1X8, 1, "uuuuuuuu"),
}


# ------------------------------------------------------------------------------------------------
# plumbing
# ------------------------------------------------------------------------------------------------
def _u32(x, loc, ip) -> ir.Value:
    return Uint32(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc, ip) -> ir.Value:
    return Float32(x).ir_value(loc=loc, ip=ip)


def _asm(result_type, operands, text: str, constraints: str) -> ir.Value:
    # Pure register arithmetic: no side effects, so LLVM may CSE, hoist or drop it.
    return llvm.inline_asm(
        result_type, operands, text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _two(res, elem_type, cls, loc, ip):
    return (
        cls(llvm.extractvalue(elem_type, res, [0], loc=loc, ip=ip)),
        cls(llvm.extractvalue(elem_type, res, [1], loc=loc, ip=ip)),
    )


def _pair(elem_type):
    return llvm.StructType.get_literal([elem_type, elem_type])


# ------------------------------------------------------------------------------------------------
# FP4 -> 16-bit (decode, the hot loop)
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def e2m1x8_to_e4m3x8(
    word, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Uint32, Uint32]:
    """8 packed E2M1 values (one word) -> 8 E4M3 bytes, as (elements 0..3, elements 4..7).

    9 integer instructions (and, shr, shl, 4 prmt, 2 lop3), no conversion unit: two prmt look the
    magnitudes up in the E4M3 table, two more prmt in sign-replicate mode spread the sign bits to 0xFF/0x00
    bytes, and lop3 merges ``m | (g & 0x80)``. Code 8 (-0) becomes 0x80 (E4M3 -0): signed zeros survive.
    """
    res = _asm(_pair(T.i32()), [_u32(word, loc, ip)], PTX_E2M1X8_TO_E4M3X8, "=r,=r,r")
    return _two(res, T.i32(), Uint32, loc, ip)


@dsl_user_op
def e4m3x4_to_f16x4(
    word, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Uint32, Uint32]:
    """4 E4M3 bytes -> two f16x2 words (bytes 0,1 -> word 0; bytes 2,3 -> word 1). Exact.
    PTX: 2 x cvt.rn.f16x2.e4m3x2 (sm_89+)."""
    res = _asm(_pair(T.i32()), [_u32(word, loc, ip)], PTX_E4M3X4_TO_F16X4, "=r,=r,r")
    return _two(res, T.i32(), Uint32, loc, ip)


@dsl_user_op
def e2m1x8_to_f16x8(
    word, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Uint32, Uint32, Uint32, Uint32]:
    """8 packed E2M1 values -> 4 f16x2 words ((e0,e1), (e2,e3), (e4,e5), (e6,e7)). Exact.
    9 integer instructions + 4 cvt.rn.f16x2.e4m3x2: 13 for 8 values."""
    lo, hi = e2m1x8_to_e4m3x8(word, loc=loc, ip=ip)
    h0, h1 = e4m3x4_to_f16x4(lo, loc=loc, ip=ip)
    h2, h3 = e4m3x4_to_f16x4(hi, loc=loc, ip=ip)
    return h0, h1, h2, h3


@dsl_user_op
def e2m1x8_to_e4m3x8_even_odd(
    word, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Uint32, Uint32]:
    """8 packed E2M1 values times 2^-6 -> 8 E4M3 bytes, as (e0, e2, e4, e6) and (e1, e3, e5, e7). Exact; 7 integer
    instructions (the first half of :func:`e2m1x8_to_f16x8_scaled_even_odd`, for callers that permute bytes
    before converting them)."""
    res = _asm(_pair(T.i32()), [_u32(word, loc, ip)], PTX_E2M1X8_TO_E4M3X8_EVEN_ODD, "=r,=r,r")
    return _two(res, T.i32(), Uint32, loc, ip)


@dsl_user_op
def e2m1x8_to_f16x8_scaled_even_odd(
    word, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Uint32, Uint32, Uint32, Uint32]:
    """8 packed E2M1 values times 2^-6 -> 4 f16x2 words ((e0,e2), (e4,e6), (e1,e3), (e5,e7)). Exact (the
    smallest nonzero value, 2^-7, is a normal f16); the caller undoes the 2^-6 elsewhere (the decode kernel: in its
    fp32 softmax and output scales).
    7 integer instructions + 4 cvt.rn.f16x2.e4m3x2 (e2m1x8_to_f16x8: 9 + 4), for operands whose element order
    is free (an MMA reduction dimension permuted the same way in the other operand)."""
    ev, od = e2m1x8_to_e4m3x8_even_odd(word, loc=loc, ip=ip)
    h0, h1 = e4m3x4_to_f16x4(ev, loc=loc, ip=ip)
    h2, h3 = e4m3x4_to_f16x4(od, loc=loc, ip=ip)
    return h0, h1, h2, h3


@dsl_user_op
def e4m3_pair_to_f16x2(
    a, b, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Uint32:
    """Byte 0 of ``a`` and byte 0 of ``b`` (two E4M3 scales, e.g. of two tokens) as one f16x2 word, ``a`` in the
    low half. Exact. PTX: prmt.b32 + cvt.rn.f16x2.e4m3x2."""
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], PTX_E4M3_PAIR_TO_F16X2, "=r,r,r"))


@dsl_user_op
def e4m3_to_f16x2(
    scale_word, byte_index: int = 0, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Uint32:
    """Byte ``byte_index`` (a Python int 0..3) of ``scale_word``, an E4M3 block scale, in both halves of an
    f16x2 word, ready for ``f16x2_mul``. Exact: every E4M3 value (subnormals, +-448) is an f16 value.
    PTX: prmt.b32 (byte k twice) + cvt.rn.f16x2.e4m3x2."""
    if not isinstance(byte_index, int) or not 0 <= byte_index < 4:
        raise ValueError(f"byte_index: expected a Python int 0..3, got {byte_index!r}")
    return Uint32(_asm(T.i32(), [_u32(scale_word, loc, ip)], _ptx_e4m3_bcast(byte_index), "=r,r"))


@dsl_user_op
def f16x2_mul(a, b, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Uint32:
    """Packed half multiply, RN, no flush (PTX: mul.rn.f16x2).

    An E2M1 value (2 significant bits, |x| <= 6) times an E4M3 scale (<= 4 significant bits, 2^-9 <= |s| <=
    448) has at most 6 significant bits and lies in [2^-10, 2688], so the NVFP4 block product is exact in f16.
    """
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], PTX_F16X2_MUL, "=r,r,r"))


@dsl_user_op
def f16x2_to_f32x2(
    h2, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None
) -> Tuple[Float32, Float32]:
    """f16x2 word -> (low half, high half) in fp32. Exact. PTX: 2 x cvt.f32.f16."""
    res = _asm(_pair(T.f32()), [_u32(h2, loc, ip)], PTX_F16X2_TO_F32X2, "=f,=f,r")
    return _two(res, T.f32(), Float32, loc, ip)


# ------------------------------------------------------------------------------------------------
# Scales
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def ue8m0_to_f32(byte, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Float32:
    """UE8M0 scale byte (0..255 in a Uint32) -> 2^(byte-127) in fp32, from bits, no conversion unit.

    byte << 23 is the fp32 with that biased exponent. Byte 0 means 2^-127, below fp32's smallest normal: it
    is the subnormal 0x00400000, which ``max.u32`` picks (every byte >= 1 shifts to >= 0x00800000). Byte 255
    is E8M0's NaN. PTX: shl.b32, max.u32, setp.eq.u32, selp.b32 (once per scale block).
    """
    return Float32(_asm(T.f32(), [_u32(byte, loc, ip)], PTX_UE8M0_TO_F32, "=f,r"))


@dsl_user_op
def e4m3_to_f32(byte, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Float32:
    """E4M3FN byte (low 8 bits of a Uint32) -> fp32, exact (0x7F/0xFF give NaN).
    PTX: cvt.u16.u32, cvt.rn.f16x2.e4m3x2, cvt.f32.f16."""
    return Float32(_asm(T.f32(), [_u32(byte, loc, ip)], PTX_E4M3_TO_F32, "=f,r"))


@dsl_user_op
def f32_to_e4m3_satfinite(x, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Uint32:
    """fp32 -> E4M3FN byte, RNE, saturating to +-448 (NaN stays NaN). PTX: cvt.rn.satfinite.e4m3x2.f32 (sm_89+)."""
    return Uint32(_asm(T.i32(), [_f32(x, loc, ip)], PTX_F32_TO_E4M3_SATFINITE, "=r,f"))


@dsl_user_op
def rcp_rn(x, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Float32:
    """IEEE 1/x, correctly rounded, subnormals kept (PTX: rcp.rn.f32; the same value as div.rn.f32 1.0, x, which
    ptxas expands into a longer general-division sequence). Spelled out because the quantizer must match the
    reference bit for bit, which a fast-math rcp.approx would not."""
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], PTX_RCP_RN, "=f,f"))


@dsl_user_op
def mx_ue8m0_floor(amax, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Uint32:
    """OCP MX "floor" scale byte of a block with absolute maximum ``amax`` (fp32, finite, >= 0).

    e = floor(log2(amax)) - 2 clamped to [-127, 127] (at most 125 for finite amax), byte = e + 127. A normal amax has floor(log2) = E - 127
    (E the biased exponent field), so byte = E - 2; zero / subnormal amax (E = 0) and E = 1 clamp to 0.
    PTX: bfe.u32, max.u32, sub.u32.
    """
    return Uint32(_asm(T.i32(), [_f32(amax, loc, ip)], PTX_MX_UE8M0_FLOOR, "=r,f"))


@dsl_user_op
def mx_ue8m0_rceil(amax, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Uint32:
    """MX "rceil" scale byte: the smallest e with amax <= 6 * 2^e, clamped to [-127, 125], byte = e + 127.

    amax = 1.m * 2^(E-127) and 6 * 2^e = 1.5 * 2^(e+2): e = E - 129 when 1.m <= 1.5 (mantissa field <=
    0x400000), else E - 128. PTX: bfe.u32, and.b32, setp.gt.u32, selp.b32, add.s32, max.s32, min.s32, sub.s32.
    """
    return Uint32(_asm(T.i32(), [_f32(amax, loc, ip)], PTX_MX_UE8M0_RCEIL, "=r,f"))


# ------------------------------------------------------------------------------------------------
# fp32 -> E2M1 (encode, for the quantize / insert kernels)
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def f32_to_e2m1(x, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Uint32:
    """fp32 -> 4-bit E2M1 code (sign in bit 3, from the fp32 sign bit), RNE, saturating at 6.

    sm_100a has cvt.rn.satfinite.e2m1x2.f32 for this; SM90 has nothing. The E2M1 grid has step 0.5 on
    [0, 2) and step 2^(e-1) on [2^e, 2^(e+1)) for e = 1, 2, and a code counts grid steps, so with
    a = min(|x|, 6) and e = clamp(floor(log2 a), 0, 2):  code = rni(a * 2^(1-e)) + 2e.  The power-of-two
    multiply is exact, cvt.rni rounds ties to even, and a tie on a binade edge rounds up into the next binade
    correctly (1.75 -> rni(3.5) = 4 -> 2.0). +-inf -> +-6; NaN -> 6 with NaN's sign bit (out of contract).
    PTX: 17 instructions (and, min.f32, shr, max.u32, sub, shl, mul.rn.f32, cvt.rni.u32.f32, mad.lo, sub,
    shr, and, or, and 4 free register moves).
    """
    return Uint32(_asm(T.i32(), [_f32(x, loc, ip)], PTX_F32_TO_E2M1, "=r,f"))


@dsl_user_op
def e2m1_round_f32(x, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Float32:
    """``x`` rounded to the E2M1 grid (RNE, saturating at 6, x's sign): the fp32 value of
    ``f32_to_e2m1(x)``'s code, without the code (for error sums over candidate scales). PTX: abs, min, and,
    max, add, add.rn, sub.rn, and, or (9 instructions against 17 for the code plus its decode)."""
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], PTX_E2M1_ROUND_F32, "=f,f"))


@dsl_user_op
def pack_e2m1x8(c0, c1, c2, c3, c4, c5, c6, c7, *, loc=None, ip=None) -> Uint32:
    """Eight 4-bit codes -> one payload word, code k in nibble k (element 2i in the low nibble of byte i).
    PTX: 7 x bfi.b32."""
    codes = [_u32(c, loc, ip) for c in (c0, c1, c2, c3, c4, c5, c6, c7)]
    return Uint32(_asm(T.i32(), codes, PTX_PACK_E2M1X8, "=r," + ",".join(["r"] * 8)))


# ------------------------------------------------------------------------------------------------
# the block-scale rule (one home for what every FP4 writer computes)
# ------------------------------------------------------------------------------------------------
@cute.jit
def fp4_block_scale(amax: Float32, g: Float32, nvfp4: cutlass.Constexpr, rceil: cutlass.Constexpr):
    """``(scale byte, multiplier)`` of one FP4 block with largest magnitude ``amax``, exactly as
    ``qattn.quant.reference.quantize``: the block's codes are ``f32_to_e2m1(x * multiplier)``.

    nvfp4 (``g`` = the global scale): byte = E4M3(amax / (g * 6)), multiplier = 1 / (E4M3 value * g), or 0 when
    that product is not a normal fp32. MX (``g`` unused): byte = e + 127 from the floor or rceil rule on
    amax's bits, multiplier = 2^-e (exact)."""
    sbyte = Uint32(0)
    if cutlass.const_expr(nvfp4):
        sbyte = f32_to_e4m3_satfinite(amax / (g * Float32(6.0)))
    else:
        if cutlass.const_expr(rceil):
            sbyte = mx_ue8m0_rceil(amax)
        else:
            sbyte = mx_ue8m0_floor(amax)
    return sbyte, fp4_block_multiplier(sbyte, g, nvfp4)


@cute.jit
def fp4_block_multiplier(sbyte: Uint32, g: Float32, nvfp4: cutlass.Constexpr) -> Float32:
    """The multiplier that encodes a block with scale byte ``sbyte`` (codes ``f32_to_e2m1(x * multiplier)``):
    nvfp4 1 / (E4M3 value * g), or 0 when that product is not a normal fp32; MX 2^-e (exact, e = byte - 127)."""
    mul = Float32(0.0)
    if cutlass.const_expr(nvfp4):
        sg = e4m3_to_f32(sbyte) * g
        if sg >= Float32(2.0**-126):  # reciprocal only of a normal fp32: 0 and subnormals give 0
            mul = rcp_rn(sg)
    else:
        mul = ue8m0_to_f32(Uint32(254) - sbyte)
    return mul
