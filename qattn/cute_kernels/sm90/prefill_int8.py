"""SM90 prefill attention with INT8 Q/K (SageAttention style): wgmma s8 x s8 -> s32 for Q K^T, fp32 online
softmax, bf16/fp16 P x V on wgmma with P straight from registers (issue 5, v0).

One CTA = one query tile of one (batch, head), 64 rows per MMA warpgroup: 128 rows and 3 warpgroups, or (per_warp
q scales at head_dim 64, and at head_dim 128 non-causal or with FP8 P x V; ``prefill_config.default_tile_m``) 192
rows and 4:

* warpgroup 0, warp 0 is the producer: TMA loads of the Q tile (once; int8, or 16-bit with ``quantize_q``),
  then K and V tiles of 128 keys into ``kv_stages``-deep smem rings (two ``PipelineTmaAsync`` pipelines, one
  for K, one for V, so that the QK^T of a tile can start before its V has landed). Its registers are given
  back (setmaxregister).
* warpgroups 1, 2 (, 3) own query rows 0..63, 64..127 (, 128..191). Per K/V tile:
    S_int32 = wgmma(Q_int8, K_int8)         (SS, K-major both: the only form s8 wgmma has)
    S = float(S_int32) * (q_scale * k_scale * softmax_scale * log2 e)
  The product is exact up to one fp32 rounding: |S_int32| <= 127^2 * 128 < 2^24, so the int -> fp32
  conversion is exact, and per-tile scales are applied *before* the running max, so the online softmax lives
  in the true logit domain and needs no rescale when the scale changes from tile to tile.
  Then the usual log2-domain online softmax (running max / sum per row, four lanes of a quad share a row),
  P rounded to the V dtype in registers, reinterpreted as the A fragment of the P x V wgmma (RS, V MN-major).

Why the scale granularity matches the tiles: wgmma's accumulator gives warp w of a warpgroup rows
16w .. 16w+15, so SageAttention's per-warp q scale (16 rows) is one scalar per thread; the per-block q scale
(128 rows) one per CTA; the k scale (128 keys) one per tile. See ``prefill_config.py``.

Masks: keys >= seqlen_k (TMA zero-fills the ragged last tile, the scores are then set to -inf) and, with
``causal``, FlashAttention's bottom-right alignment: query i sees keys j <= i + seqlen_k - seqlen_q. A row that
sees no key writes 0 and LSE -inf. Rows >= seqlen_q are never stored. A causal CTA reads the K/V tiles its last
rows see; a warpgroup whose 64 rows see fewer computes only those and keeps its turns for the rest. Sliding
window (FlashAttention's ``window_size``, ``local``, runtime ``window_left`` / ``window_right``): keys j >= i +
seqlen_k - seqlen_q - window_left, and with ``causal`` j <= i + seqlen_k - seqlen_q + window_right; the CTA
starts at the tile of its first row's first key, as a split CTA does (k scales and mask columns from there on).
Without ``local`` the window arguments are not read.

Split tail (``PrefillConfig.split_tail``, dense non-causal): a 1-D grid whose units (query tile, head, sequence)
past ``num_full_units`` run as ``tail_splits`` CTAs over contiguous K/V ranges each; those write fp32 partials,
and the last of a unit's CTAs to count itself in merges them (``_split_epilogue``; ``prefill_config.
split_tail_plan`` says why and when).

FP8 P x V (``PrefillConfig(pv_dtype="fp8")``, same template, branches taken at compile time; the 16-bit variant's
PTX is byte-identical to the one before the branch existed): V comes from the V prepass
(``qattn.quant.v_fp8``) as E4M3 V^T (batch, kv_heads, head_dim, keys padded to 128; varlen: (kv_heads, head_dim,
keys) with one padded region per sequence at a key offset computed from cu_seqlens_k), keys contiguous -- FP8
wgmma takes K-major B only -- with a per-channel fp32 scale. P is computed as 448 * P (the P scale folded into the
exp2 offset, so no multiply and no overflow: P <= 1), rounded to E4M3 in registers (cvt.rn.satfinite.e4m3x2.f32)
straight into the 8-bit A fragments of ``wgmma.m64n{D}k32.f32.e4m3.e4m3``: instead of exchanging bytes between
lanes, the prepass stores the keys of every 32-key group in the order in which a lane holds them (``_store_p``).
Two-level accumulation: each tile's P x V goes into a fresh fp32 accumulator, added to the running O (fp32) at
the rescale; the epilogue multiplies by the V channel scale and divides by the (448-scaled) row sum.

Softmax per tile: the int8 -> fp32 bias comes out inside the exp2's FFMA, the row max is an integer tree over
the biased scores' bits, three at a time (3-input IMNMX), the row sum a pairwise tree; with 16-bit P x V the
running max moves (and O is rescaled, skipped warp by warp otherwise) only when a tile's max exceeds it by more
than 2^8; with FP8 P x V it always moves, and a tile's P x V is added to O without the rescale multiply when no
row's max moved. H100 A/B, kernel only, CUDA graph, B2 H16: bias in the FFMA + trees + lazy rescale, D128 S8K
1644.7 -> 1614.6 us, causal 909.0 -> 862.5, S16K causal 3394.4 -> 3242.6, D64 S16K causal 2621.6 -> 2510.7; the
integer max (709 -> 679 SASS instructions per tile and warp at D128), D128 S8K 1630.1 / 1640.7 -> 1570.1 /
1570.0 us, D64 S8K 1089.1 -> 1068.1; FP8 P x V with all three, D128 S8K 1601.7 -> 1513.1, D64 S8K 1275.7 ->
1177.9.

``quantize_q`` (``flash_attn_func``'s path on SM90 with per_warp q scales): Q arrives in V's 16-bit dtype, the
producer's TMA puts it in a staging tile and every MMA warp quantizes its own 16 rows (its q-scale group) into
the int8 tile before the first Q K^T (``_quantize_q``, the prepass's numerics bit for bit), so the prepass
handles K only. End to end, interleaved A/B (K prepass + this vs Q/K prepass + the int8-Q kernel): 0.94-0.98x
the time, except D128 S16K (1.00x).

``early_kv_wait`` (default at head_dim 128 with 16-bit P x V, ``prefill_config.default_early_kv_wait``): while
the softmax of tile n runs, mbarrier.test_wait (non-blocking) checks whether K(n+1) and V(n) have landed; the
answers let the next turn skip its blocking waits (a ready-barrier wait cost ~80-100 cycles per tile each in
%clock traces of the loop): 0.97-0.99x the time.

``intra_wg_overlap`` (FA3's overlap: QK^T(n) issued together with P V(n-1), whose P registers stay live through the
softmax of tile n) is off with three MMA warpgroups at head_dim 128, whose 160 registers cannot hold the scores, P
and O together: there one turn issues P V(n-1), waits for it, refills the score registers and issues QK^T(n)
(``_tile_serial``), and the other two warpgroups' turns keep the tensor cores busy during the softmax. H100,
interleaved A/B vs 128 rows with the overlap, outputs bit-identical: D128 S8K 0.96-0.98x the time, S16K
0.92-0.93x, FP8 P x V 0.89-0.98x; causal 16-bit P x V mixed (0.97-1.04x), so it keeps 128 rows.

``softcap`` (FlashAttention's logit soft-capping, a compile-time constant): the host's scale is softmax_scale /
softcap, each score goes through ``tanh.approx.f32`` before its exp2 (masked ones kept at -inf), the tile max
through the same tanh (tanh is increasing); with int8 Q K^T each row adds back the shift q . k_mean that K's
smoothing took out of its scores (``_row_mean_logits``: the cap, unlike the softmax, is not invariant to it).

``bias_in_acc`` (default with int8 Q K): the score registers are set to the bias bits (16 shared loads) once P has
left them and Q K^T accumulates onto them, so no integer add per score converts the int32 scores
(``_bias_scores``, ``_scores``).

Limits: outputs stored straight from registers (16-byte stores after a quad transpose, ``_store_o``; no
smem/TMA epilogue), non-persistent grid (a persistent variant, tried, slowed the loop: docs/results). Measured
on an H100 (D128 S8K): Nsight Compute has the shared (tensor) pipe ~56 % busy, and the kernel's TFLOP/s are ~52 %
of what the int8 + bf16 MMA peak rates allow, against ~67 % of the bf16 peak for FA4's kernel, so the int8
Q K^T's 2x rate shows up only as parity with FA4 (docs/results).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float16, Float32, Int8, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils.layout import LayoutEnum

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.common.softcap import tanh_approx
from qattn.cute_kernels.kv_insert import bf16x2_to_f32x2, f32x2_to_16x2, f32x4_to_e4m3x4, mul_rn
from qattn.cute_kernels.sm90.qk_int8_quant import FP32_MIN_NORMAL, INT8_MAX, div_rn
from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
from qattn.quant import v_fp8 as vt_layout  # FP8 P x V, varlen: where each sequence's V^T region starts

__all__ = ["QKInt8PrefillSm90"]

_LN2 = math.log(2.0)
# FP8 P x V: P (<= 1 after the online softmax) is computed as 448 * P = exp2(x - m + log2 448) and rounded to
# E4M3 (448 = E4M3's largest finite value): the scale is folded into the exponent offset (no multiply), the row
# sum adds the same scaled values, so out = acc * v_scale / rowsum needs no 1/448, and the LSE subtracts log2 448.
P_FP8_SCALE = 448.0
P_FP8_LOG2_SCALE = math.log2(P_FP8_SCALE)
# int8 scores arrive as float(S) + 1.5 * 2^23 (``_scores``); exact for |S| < 2^22
SCORE_BIAS = 12582912.0
# 16-bit P x V: the running max is only moved (and O rescaled) when a tile's max exceeds it by more than this
# (log2 domain), so P <= 2^8, still exact enough in bf16 / fp16 and far from their range limits
LAZY_RESCALE_LOG2 = 8.0


def _rows_cols(acc_layout: cute.Layout) -> cute.Layout:
    """View of a wgmma accumulator fragment ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread.

    In a fragment value (c, r, j): c picks one of the two adjacent columns of an 8-column group j, r picks row
    lane/4 or lane/4 + 8 of the warp's 16 rows. So rows = (r, MMA_M), cols = (c, j, MMA_N)."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
                            stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))


def _acc_as_a_operand(acc_layout: cute.Layout) -> cute.Layout:
    """The 16-bit A fragment (k16 blocks) that aliases a (rounded) accumulator fragment of the previous MMA.

    Accumulator columns 16k .. 16k+15 are two 8-column groups (2k, 2k+1); an A fragment of k-block k holds the
    same (row, column) pairs in the order (c, r, half), so it is the accumulator with its group mode split
    in (2, N/16): no data moves (the FA2/FA3 identity for 16-bit P)."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(((s[0][0], s[0][1], 2), s[1], s[0][2] // 2),
                            stride=((d[0][0], d[0][1], d[0][2]), d[1], d[0][2] * 2))


def _swizzled_byte_offset(layout: cute.ComposedLayout, row, col, elem_bytes: int):
    """Byte offset of element (row, col) in a swizzled smem layout (the GMMA atoms' swizzle acts on byte
    addresses whatever the element type: Swizzle<B, M, S> XORs bits [M+S, M+S+B) into bits [M, M+B))."""
    off = cute.crd2idx((row, col), layout.outer) * elem_bytes
    sw = layout.inner
    return off ^ (((off >> (sw.num_base + sw.num_shift)) & ((1 << sw.num_bits) - 1)) << sw.num_base)


@dsl_user_op
def _max_u16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """Lane-wise max of two pairs of unsigned 16-bit values."""
    return Uint32(llvm.inline_asm(T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
                                  "max.u16x2 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT))


# q = rni(p) for |p| < 2^22 as the low byte of the bits of p + 1.5 * 2^23 (an exact integer add, round to even)
_PTX_ROUND_S8X4 = (
    "{\n\t.reg .f32 a, b, c, d;\n\t.reg .b32 t, u;\n\t"
    "add.rn.f32 a, $1, 0f4B400000;\n\tadd.rn.f32 b, $2, 0f4B400000;\n\t"
    "add.rn.f32 c, $3, 0f4B400000;\n\tadd.rn.f32 d, $4, 0f4B400000;\n\t"
    "prmt.b32 t, a, b, 0x0040;\n\tprmt.b32 u, c, d, 0x0040;\n\tprmt.b32 $0, t, u, 0x5410;\n\t}"
)


@dsl_user_op
def _round_s8x4(a, b, c, d, *, loc=None, ip=None) -> Uint32:
    """Four fp32 values in (-127.5, 127.5) rounded to nearest even and packed as int8 (a in byte 0)."""
    ops = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Uint32(llvm.inline_asm(T.i32(), ops, _PTX_ROUND_S8X4, "=r,f,f,f,f", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _f32_from_bits(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _lds_volatile_b32x4(addr, *, loc=None, ip=None):
    """Four 32-bit words from shared memory (a volatile load: neither merged with nor hoisted over another)."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    res = llvm.inline_asm(st, [Int32(addr).ir_value(loc=loc, ip=ip)],
                          "ld.volatile.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _st_global_v4(addr, a, b, c, d, *, loc=None, ip=None) -> None:
    """One 16-byte global store of four 32-bit words (``addr`` 16-byte aligned)."""
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    llvm.inline_asm(None, ops, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _first_row(ctid):
    """The first of this MMA thread's two rows in the tile, r0 (the other is r0 + 8): rows lane / 4 and lane / 4 + 8
    of its warp's 16 (wgmma accumulator layout); accumulator value e belongs to row r0 + 8 ((e // 2) % 2)."""
    return (ctid // 32) * 16 + (ctid % 32) // 4


def _tree(vals: list, op, arity: int = 2):
    """op-reduction of ``vals`` as a tree (traced: depth log n instead of a chain of n - 1). ``arity`` 3 groups
    op(op(a, b), c), which ptxas fuses into one 3-input instruction where one exists (integer min / max)."""
    while len(vals) > 1:
        groups = [vals[k:k + arity] for k in range(0, len(vals), arity)]
        vals = [g[0] if len(g) == 1 else (op(g[0], g[1]) if len(g) == 2 else op(op(g[0], g[1]), g[2])) for g in groups]
    return vals[0]


def _consumer_state(count, stages: int) -> pipeline.PipelineState:
    """Consumer state of the ``count``-th tile of a ``stages``-deep ring (consumers start at phase 0)."""
    count = Int32(count)
    return pipeline.PipelineState(stages, count, count % stages, (count // stages) % 2)


def _landed(pipe, state: pipeline.PipelineState):
    """Whether the TMA of ``state``'s tile has completed: mbarrier.test_wait, which never blocks (a try_wait may
    suspend the warp until the phase completes, stalling the softmax it is placed in)."""
    return pipe.sync_object_full.test_wait(state.index, state.phase)


class QKInt8PrefillSm90:
    """INT8-QK prefill attention for one :class:`PrefillConfig`; see the module docstring."""

    producer_regs = 24

    def __init__(self, cfg: PrefillConfig):
        self.cfg = cfg
        self.nw = cfg.mma_warpgroups  # MMA warpgroups (2 or 3) after the producer warpgroup
        self.num_threads = 128 * (self.nw + 1)
        # what the MMA warpgroups may hold once the producer gave its registers back (64K per SM, in steps of 8)
        self.mma_regs = 240 if self.nw == 2 else 160
        self.D = cfg.head_dim
        self.v_dtype = BFloat16 if cfg.v_dtype == "bf16" else Float16
        self.fp8 = cfg.pv_dtype == "fp8"
        self.pv_ab = Float8E4M3FN if self.fp8 else self.v_dtype  # the P x V operand type
        # qk_dtype "bf16": the plain 16-bit path for A/B (Q, K in V's dtype, fp32 scores, no scales)
        self.int8_qk = cfg.qk_dtype == "int8"
        self.qk_ab = Int8 if self.int8_qk else self.v_dtype
        self.qk_acc = Int32 if self.int8_qk else Float32
        # int8 scores reach the softmax as float(S) + SCORE_BIAS, taken out in its FFMA (the FP8 P x V CPU
        # emulation, qattn.reference.prefill_fp8pv, does the same arithmetic)
        self.score_bias = SCORE_BIAS if self.int8_qk else 0.0
        self.bias_in_acc = cfg.bias_in_acc  # the QK wgmma accumulates onto the bias bits (PrefillConfig)
        # quantize_q: Q arrives in V's 16-bit dtype (TMA into a staging tile) and the MMA warps quantize it
        self.quantize_q = cfg.quantize_q
        self.q_dtype = self.v_dtype if self.quantize_q else self.qk_ab

    @property
    def key(self) -> tuple:
        return self.cfg.key

    # ----------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_addr: Int64, k_addr: Int64, v_addr: Int64, o_addr: Int64, lse_addr: Int64,
        q_scale_addr: Int64, k_scale_addr: Int64, cu_seqlens_q_addr: Int64, cu_seqlens_k_addr: Int64,
        batch: Int32, num_seqs: Int32, seqlen_q: Int32, seqlen_k: Int32, max_seqlen_q: Int32,
        num_heads: Int32, num_kv_heads: Int32, num_q_groups: Int32, num_k_blocks: Int32, scale_log2: Float32,
        v_scale_addr: Int64, qk_balance_addr: Int64, lpt_group: Int32, num_full_units: Int32, tail_splits: Int32,
        part_addr: Int64, count_addr: Int64, pdl: Int32, window_left: Int32, window_right: Int32,
        q_row16: Int32, q_head16: Int32, q_batch16: Int32, k_row16: Int32, k_head16: Int32, k_batch16: Int32,
        v_row16: Int32, v_head16: Int32, v_batch16: Int32, k_mean_addr: Int64, stream: cuda.CUstream,
    ):
        """Dense: ``batch`` = ``num_seqs`` sequences of ``seqlen_q`` (= ``max_seqlen_q``) / ``seqlen_k`` rows.
        Varlen: ``batch`` = 1, ``seqlen_q`` / ``seqlen_k`` = total rows of the packed tensors, ``num_seqs``
        sequences whose row ranges each CTA reads from the cu_seqlens arrays. ``lpt_group`` (causal only): the
        (sequence, head) units per longest-first group, a divisor of their number (``prefill_config.lpt_group``).

        ``pv_dtype="fp8"``: ``v_addr`` is the V prepass's V^T, E4M3 (batch, num_kv_heads, head_dim,
        num_k_blocks * tile_n), and ``v_scale_addr`` its fp32 per-channel scales (batch, num_kv_heads, head_dim);
        unused (0) otherwise. ``balance_qk``: ``qk_balance_addr`` is the prepass's fp32 channel balance (num_seqs,
        num_kv_heads, head_dim); unused (0) otherwise.

        ``split_tail``: units (query tile, head, sequence) ``>= num_full_units`` run as ``tail_splits`` CTAs each
        (``prefill_config.split_tail_plan``); ``part_addr``: fp32 partial outputs (tail CTAs, tile_m, head_dim)
        then their log2-domain LSEs (tail CTAs, tile_m); ``count_addr``: int32 zeros, one per split unit. Unused
        otherwise.

        ``q_row16, q_head16, q_batch16`` (and K's, V's): the row, head and batch strides of Q, K and V (16-bit V;
        the FP8 V^T has its own fixed layout) in units of 16 bytes, so that any view whose last dim is contiguous and
        whose other strides are 16-byte multiples is read in place (e.g. q, k, v sliced out of one packed QKV
        projection); varlen: batch stride unused (one packed "batch").

        ``pdl`` (runtime, 0 / 1): launch as a programmatic dependent of the kernel just before it on the stream,
        which must be the prepass that made this kernel's quantized inputs (it lets this grid start early,
        ``griddepcontrol.launch_dependents``): the CTAs then load and quantize their 16-bit Q tile while the
        prepass finishes, and wait (``griddepcontrol.wait``) before reading anything it wrote (int8 K or Q,
        scales, FP8 V^T, channel balance). Q itself must not come from that kernel; ``flash_attn_func`` sets it,
        a direct call of ``prefill_int8`` does not.

        int8 Q K^T: ``k_mean_addr`` is K's smoothing mean, fp32 (num_seqs, num_kv_heads, head_dim), or 0 (none):
        each row adds the shift q . k_mean that smoothing took out (``_row_mean_logits``) to its scores before a
        ``softcap`` (not invariant to it), else to its LSE."""
        cfg, D, vdt, pv_ab = self.cfg, self.D, self.v_dtype, self.pv_ab
        TM, TN, ST = cfg.tile_m, cfg.tile_n, cfg.kv_stages
        gmem = cute.AddressSpace.gmem
        # FlashAttention layouts, (batch, seqlen, heads, head_dim) with any 16-byte strides but the last dim's;
        # viewed (seqlen, dim, head, batch). A stride in 16-byte units times a constant lets the TMA descriptors'
        # alignment be proven at compile time.
        def elems(units, dtype):
            return tuple(u * (16 * 8 // dtype.width) for u in units)

        q_rs, q_hs, q_bs = elems((q_row16, q_head16, q_batch16), self.q_dtype)
        k_rs, k_hs, k_bs = elems((k_row16, k_head16, k_batch16), self.qk_ab)
        mQ = cute.make_tensor(cute.make_ptr(self.q_dtype, q_addr, gmem, assumed_align=16),
                              cute.make_layout((seqlen_q, D, num_heads, batch), stride=(q_rs, 1, q_hs, q_bs)))
        mK = cute.make_tensor(cute.make_ptr(self.qk_ab, k_addr, gmem, assumed_align=16),
                              cute.make_layout((seqlen_k, D, num_kv_heads, batch), stride=(k_rs, 1, k_hs, k_bs)))
        if cutlass.const_expr(self.fp8):
            # V^T as the B operand of P x V: (N = dim, K = keys), keys contiguous ("K-major", the only form FP8
            # wgmma takes); keys padded to whole tiles (zeros) and permuted within groups of 32 by the prepass.
            sk_pad = num_k_blocks * TN
            if cutlass.const_expr(cfg.varlen):  # (kv heads, dim, keys): every sequence's region (qattn.quant.v_fp8)
                sk_pad = vt_layout.varlen_vt_offset(seqlen_k, num_seqs)
            mV = cute.make_tensor(cute.make_ptr(Float8E4M3FN, v_addr, gmem, assumed_align=16),
                                  cute.make_layout((D, sk_pad, num_kv_heads, batch),
                                                   stride=(sk_pad, 1, D * sk_pad, num_kv_heads * D * sk_pad)))
        else:
            # V as the B operand of P x V: (N = dim, K = keys), dim contiguous ("MN-major").
            v_rs, v_hs, v_bs = elems((v_row16, v_head16, v_batch16), vdt)
            mV = cute.make_tensor(cute.make_ptr(vdt, v_addr, gmem, assumed_align=16),
                                  cute.make_layout((D, seqlen_k, num_kv_heads, batch), stride=(1, v_rs, v_hs, v_bs)))

        # Two copies of the QK^T MMA, for the first k-block (overwrite) and the others (accumulate): the
        # ACCUMULATE field is set once per copy at the top of the consumer, never inside a staged branch.
        mma_qk, mma_qk_acc = [sm90_utils.make_trivial_tiled_mma(
            self.qk_ab, self.qk_ab, OperandMajorMode.K, OperandMajorMode.K, self.qk_acc,
            (TM // 64, 1, 1), (64, TN)) for _ in range(2)]
        mma_pv0 = None
        if cutlass.const_expr(self.fp8):
            # two copies again: each tile's P x V starts from zero (first k-block) and accumulates (the others)
            mma_pv, mma_pv0 = [sm90_utils.make_trivial_tiled_mma(
                Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32,
                (TM // 64, 1, 1), (64, D), warpgroup.OperandSource.RMEM) for _ in range(2)]
        else:
            mma_pv = sm90_utils.make_trivial_tiled_mma(
                vdt, vdt, OperandMajorMode.K, OperandMajorMode.MN, Float32, (TM // 64, 1, 1),
                (64, D), warpgroup.OperandSource.RMEM)

        sQ_layout = cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TM, TN, D), self.qk_ab, 1),
                                (None, None, 0))
        # what the Q TMA fills: the int8 tile itself, or (quantize_q) a 16-bit staging tile
        sQin_layout = sQ_layout
        if cutlass.const_expr(self.quantize_q):
            sQin_layout = cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TM, TN, D), self.q_dtype,
                                                                    1), (None, None, 0))
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TM, TN, D), self.qk_ab, ST)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR if self.fp8 else LayoutEnum.COL_MAJOR,
                                                  (TM, D, TN), pv_ab, ST)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQin_layout, (TM, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(sK_layout, (None, None, 0)), (TN, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, cute.slice_(sV_layout, (None, None, 0)), (D, TN))
        self.q_bytes = cute.size_in_bytes(self.q_dtype, sQin_layout)
        self.k_bytes = cute.size_in_bytes(self.qk_ab, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(pv_ab, cute.slice_(sV_layout, (None, None, 0)))

        # quantize_q: the 16-bit Q staging tile (otherwise a placeholder of 128 bytes, never touched)
        sQin_size = cute.cosize(sQin_layout) if self.quantize_q else 128

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[Int64, 2]
            k_mbar: cute.struct.MemRange[Int64, ST * 2]
            v_mbar: cute.struct.MemRange[Int64, ST * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.qk_ab, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.qk_ab, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[pv_ab, cute.cosize(sV_layout)], 1024]
            sQin: cute.struct.Align[cute.struct.MemRange[self.q_dtype, sQin_size], 1024]
            bias_bits: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
            tail_flag: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        self.shared_storage = SharedStorage
        num_m_blocks = (max_seqlen_q + TM - 1) // TM
        args = (mma_qk, mma_qk_acc, mma_pv, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout, sV_layout,
                sQin_layout, o_addr, lse_addr, q_scale_addr, k_scale_addr, cu_seqlens_q_addr, cu_seqlens_k_addr, seqlen_q,
                seqlen_k, num_heads, num_kv_heads, num_q_groups, num_k_blocks, scale_log2)
        split = (num_full_units, tail_splits, part_addr, count_addr)
        if cutlass.const_expr(self.fp8):
            launcher = self.kernel_fp8(*args, mma_pv0, v_scale_addr, qk_balance_addr, lpt_group, *split, window_left,
                                       window_right, k_mean_addr)
        else:
            launcher = self.kernel(*args, qk_balance_addr, lpt_group, *split, window_left, window_right, k_mean_addr)
        grid = (num_m_blocks, num_heads, num_seqs)
        if cutlass.const_expr(cfg.split_tail):  # 1-D: whole waves of units, then the split units' CTAs
            grid = (num_full_units + (num_m_blocks * num_heads * num_seqs - num_full_units) * tail_splits, 1, 1)
        if cutlass.const_expr(cfg.causal):  # lpt_group > 1: (unit in group, tile, group), see ``_causal_position``
            grouped = lpt_group > 1
            grid = (Int32(cutlass.select_(grouped, lpt_group, num_m_blocks)),
                    Int32(cutlass.select_(grouped, num_m_blocks, num_heads)),
                    Int32(cutlass.select_(grouped, num_heads * num_seqs // lpt_group, num_seqs)))
        launcher.launch(grid=grid, block=(self.num_threads, 1, 1), stream=stream,
                        min_blocks_per_mp=1, use_pdl=pdl)

    # ----------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mma_qk: cute.TiledMma, mma_qk_acc: cute.TiledMma, mma_pv: cute.TiledMma,
        tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
        tma_v: cute.CopyAtom, tV: cute.Tensor,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sQin_layout: cute.ComposedLayout, o_addr: Int64, lse_addr: Int64, q_scale_addr: Int64, k_scale_addr: Int64,
        cu_seqlens_q_addr: Int64, cu_seqlens_k_addr: Int64, seqlen_q: Int32, seqlen_k: Int32,
        num_heads: Int32, num_kv_heads: Int32, num_q_groups: Int32, num_k_blocks: Int32, scale_log2: Float32,
        qk_balance_addr: Int64, lpt_group: Int32, num_full_units: Int32, tail_splits: Int32, part_addr: Int64,
        count_addr: Int64, window_left: Int32, window_right: Int32, k_mean_addr: Int64,
    ):
        """16-bit P x V (``pv_dtype="bf16"``)."""
        self._k_mean_addr = k_mean_addr
        self._body(mma_qk, mma_qk_acc, mma_pv, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout, sV_layout,
                   sQin_layout, o_addr, lse_addr, q_scale_addr, k_scale_addr, cu_seqlens_q_addr, cu_seqlens_k_addr, seqlen_q,
                   seqlen_k, num_heads, num_kv_heads, num_q_groups, num_k_blocks, scale_log2, None, None,
                   qk_balance_addr, lpt_group, (num_full_units, tail_splits, part_addr, count_addr),
                   (window_left, window_right))

    @cute.kernel
    def kernel_fp8(
        self,
        mma_qk: cute.TiledMma, mma_qk_acc: cute.TiledMma, mma_pv: cute.TiledMma,
        tma_q: cute.CopyAtom, tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor,
        tma_v: cute.CopyAtom, tV: cute.Tensor,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sQin_layout: cute.ComposedLayout, o_addr: Int64, lse_addr: Int64, q_scale_addr: Int64, k_scale_addr: Int64,
        cu_seqlens_q_addr: Int64, cu_seqlens_k_addr: Int64, seqlen_q: Int32, seqlen_k: Int32,
        num_heads: Int32, num_kv_heads: Int32, num_q_groups: Int32, num_k_blocks: Int32, scale_log2: Float32,
        mma_pv0: cute.TiledMma, v_scale_addr: Int64, qk_balance_addr: Int64, lpt_group: Int32,
        num_full_units: Int32, tail_splits: Int32, part_addr: Int64, count_addr: Int64, window_left: Int32,
        window_right: Int32, k_mean_addr: Int64,
    ):
        """FP8 P x V (``pv_dtype="fp8"``): one more MMA copy (zero-initialising) and the V scales."""
        self._k_mean_addr = k_mean_addr
        self._body(mma_qk, mma_qk_acc, mma_pv, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout, sV_layout,
                   sQin_layout, o_addr, lse_addr, q_scale_addr, k_scale_addr, cu_seqlens_q_addr, cu_seqlens_k_addr, seqlen_q,
                   seqlen_k, num_heads, num_kv_heads, num_q_groups, num_k_blocks, scale_log2, mma_pv0, v_scale_addr,
                   qk_balance_addr, lpt_group, (num_full_units, tail_splits, part_addr, count_addr),
                   (window_left, window_right))

    @cute.jit
    def _body(self, mma_qk, mma_qk_acc, mma_pv, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout, sV_layout,
              sQin_layout, o_addr, lse_addr, q_scale_addr, k_scale_addr, cu_seqlens_q_addr, cu_seqlens_k_addr, seqlen_q, seqlen_k,
              num_heads, num_kv_heads, num_q_groups, num_k_blocks, scale_log2, mma_pv0, v_scale_addr,
              qk_balance_addr, lpt_group, split_args, window):
        cfg, D, vdt = self.cfg, self.D, self.v_dtype
        TM, TN = cfg.tile_m, cfg.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        bid_m, h, b = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        m_block = bid_m
        if cutlass.const_expr(cfg.causal):
            m_block, h, b = self._causal_position(num_heads, lpt_group)
        tail, split, ns = None, None, None
        if cutlass.const_expr(cfg.split_tail):
            m_block, h, b, tail, split, ns = self._split_position(seqlen_q, num_heads, split_args)
        group = num_heads // num_kv_heads
        h_kv = h // group
        # This CTA's sequence: b_t is its batch index in the (seqlen, dim, head, batch) tensors, its rows start at
        # q_start / k_start there, and len_q / len_k are its lengths. Varlen: one packed "batch" of total rows.
        b_t, q_start, k_start, len_q, len_k = b, Int32(0), Int32(0), seqlen_q, seqlen_k
        if cutlass.const_expr(cfg.varlen):
            gmem = cute.AddressSpace.gmem
            cu_q = cute.make_tensor(cute.make_ptr(Int32, cu_seqlens_q_addr, gmem, assumed_align=4),
                                    cute.make_layout(1 << 30))
            cu_k = cute.make_tensor(cute.make_ptr(Int32, cu_seqlens_k_addr, gmem, assumed_align=4),
                                    cute.make_layout(1 << 30))
            b_t, q_start, k_start = Int32(0), cu_q[b], cu_k[b]
            len_q, len_k = cu_q[b + 1] - q_start, cu_k[b + 1] - k_start

        # Keys this tile reads: all of them, or (causal) up to the last row's diagonal (+ window_right), and
        # (local) from the first row's window start on; none for a tile past the end of its sequence (varlen
        # grids are sized for the longest one).
        window_left, window_right = window
        n_blocks = (len_k + TN - 1) // TN
        kb0 = None  # split_tail / local: this CTA's first K/V tile
        if cutlass.const_expr(cfg.split_tail):
            kb0 = split * n_blocks // ns
            n_blocks = (split + 1) * n_blocks // ns - kb0
        if cutlass.const_expr(cfg.causal):
            last_key = cutlass.min(len_k, (m_block + 1) * TM + len_k - len_q)
            if cutlass.const_expr(cfg.local):
                last_key = cutlass.min(len_k, (m_block + 1) * TM + len_k - len_q + window_right)
            n_blocks = cutlass.max(last_key + TN - 1, 0) // TN
        if cutlass.const_expr(cfg.local):  # the tiles wholly left of every row's window are never loaded
            kb0 = cutlass.min(cutlass.max(m_block * TM + len_k - len_q - window_left, 0) // TN, n_blocks)
            n_blocks = n_blocks - kb0
        if m_block * TM >= len_q:
            n_blocks = 0

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQin, q_words = sQ, None
        if cutlass.const_expr(self.quantize_q):
            sQin = storage.sQin.get_tensor(sQin_layout.outer, swizzle=sQin_layout.inner)
            # 32-bit word views of the staging tile and of the int8 tile (offsets from the layouts, ``_quantize_q``)
            q_words = (cute.make_tensor(cute.recast_ptr(storage.sQin.data_ptr(), dtype=Uint32),
                                        cute.make_layout(cute.cosize(sQin_layout) // 2)),  # 16-bit elements
                       cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=Uint32),
                                        cute.make_layout(cute.cosize(sQ_layout) // 4)))
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        self._sq_words = None  # int8 Q K^T: the int8 Q tile as 32-bit words (``_row_mean_logits``)
        if cutlass.const_expr(self.int8_qk):
            self._sq_words = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=Uint32),
                                              cute.make_layout(cute.cosize(sQ_layout) // 4))

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.nw)  # one arrive per MMA warp
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        k_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_mbar.data_ptr(), num_stages=cfg.kv_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.k_bytes, defer_sync=True)
        v_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_mbar.data_ptr(), num_stages=cfg.kv_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.v_bytes, defer_sync=True)
        # bias_in_acc: 16 bytes of score bias bits, the source of the score registers' fills (``_bias_scores``)
        bias_addr = None
        if cutlass.const_expr(self.bias_in_acc):
            if tidx < 4:
                storage.bias_bits.get_tensor(cute.make_layout(4))[tidx] = Int32(0x4B400000)
            bias_addr = storage.bias_bits.data_ptr().toint()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                cpasync.prefetch_descriptor(tma_q)
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                q_rows, k_rows, v_cols = tQ[None, None, h, b_t], tK[None, None, h_kv, b_t], tV[None, None, h_kv, b_t]
                if cutlass.const_expr(cfg.varlen):  # a tile past the sequence reads the next one's rows: masked
                    q_rows = cute.domain_offset((q_start, 0), q_rows)
                    k_rows = cute.domain_offset((k_start, 0), k_rows)
                    v_start = k_start
                    if cutlass.const_expr(self.fp8):  # the sequence's V^T region (qattn.quant.v_fp8)
                        v_start = vt_layout.varlen_vt_offset(k_start, b)
                    v_cols = cute.domain_offset((0, v_start), v_cols)
                gQ = cute.local_tile(q_rows, (TM, D), (m_block, 0))
                gK = cute.local_tile(k_rows, (TN, D), (None, 0))
                gV = cute.local_tile(v_cols, (D, TN), (0, None))
                tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQin, 0, 2),
                                                 cute.group_modes(gQ, 0, 2))
                tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                 cute.group_modes(gK, 0, 2))
                tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                 cute.group_modes(gV, 0, 2))
                q_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                q_pipe.producer_acquire(q_prod)
                if cutlass.const_expr(not self.quantize_q):  # int8 Q is the prepass's output
                    cute.arch.griddepcontrol_wait()
                cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_prod))
                # ``pdl``: K (and V^T) come from the prepass, which may still run; a no-op without a
                # programmatic predecessor
                cute.arch.griddepcontrol_wait()
                kv_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.kv_stages)
                for n in cutlass.range(n_blocks, unroll=1):
                    kn = n if cutlass.const_expr(kb0 is None) else kb0 + n
                    k_pipe.producer_acquire(kv_prod)
                    cute.copy(tma_k, tKg[None, kn], tKs[None, kv_prod.index],
                              tma_bar_ptr=k_pipe.producer_get_barrier(kv_prod))
                    v_pipe.producer_acquire(kv_prod)
                    cute.copy(tma_v, tVg[None, kn], tVs[None, kv_prod.index],
                              tma_bar_ptr=v_pipe.producer_get_barrier(kv_prod))
                    kv_prod.advance()
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            tail_args = None
            if cutlass.const_expr(kb0 is not None):
                # a split (or local) CTA sees keys [kb0 * TN, ...): its tiles' k scales and mask columns start there
                k_scale_addr = k_scale_addr + Int64(kb0) * 4
                len_k = len_k - kb0 * TN
            if cutlass.const_expr(cfg.split_tail):
                tail_args = (tail, ns, split_args, storage.tail_flag.data_ptr())
            self._consume(mma_qk, mma_qk_acc, mma_pv, sQ, sK, sV, q_pipe, k_pipe, v_pipe, o_addr, lse_addr,
                          q_scale_addr, k_scale_addr, tidx - 128, m_block, h, h_kv, b, n_blocks, len_q, len_k,
                          (b_t * seqlen_q + q_start), seqlen_q, num_heads, num_kv_heads, num_q_groups, num_k_blocks,
                          scale_log2, mma_pv0, v_scale_addr, q_words, sQin_layout, sQ_layout, qk_balance_addr,
                          bias_addr, window, tail_args)

    @cute.jit
    def _split_position(self, seqlen_q: Int32, num_heads: Int32, split_args):
        """``split_tail``: (query tile, head, sequence, tail CTA index or -1, split, splits of this unit) of this
        CTA of the 1-D grid. Units are numbered tile fastest, then head, then sequence (the 3-D grid's order);
        CTA x < num_full_units runs unit x whole, the others run split ``(x - num_full_units) % tail_splits`` of
        unit ``num_full_units + (x - num_full_units) // tail_splits``."""
        num_full_units, tail_splits = split_args[0], split_args[1]
        x, _, _ = cute.arch.block_idx()
        num_m_blocks = (seqlen_q + self.cfg.tile_m - 1) // self.cfg.tile_m
        unit, tail, split, ns = x, Int32(-1), Int32(0), Int32(1)
        if x >= num_full_units:
            tail = x - num_full_units
            unit = num_full_units + tail // tail_splits
            split = tail % tail_splits
            ns = tail_splits
        m_block, h, b = unit % num_m_blocks, unit // num_m_blocks % num_heads, unit // (num_m_blocks * num_heads)
        return m_block, h, b, tail, split, ns

    @cute.jit
    def _causal_position(self, num_heads: Int32, lpt_group: Int32):
        """(query tile, head, sequence) of this CTA in a causal grid. The longest query tiles run first (the last
        tiles see the most keys, so the short ones fill the end): with ``lpt_group`` > 1 (``prefill_config.
        lpt_group``) for groups of that many (sequence, head) units together, one group after the other, grid
        (unit in group, tile, group); with 1 head by head, grid (tile, head, sequence)."""
        x, y, z = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        grouped = lpt_group > 1
        unit = z * gx + x
        m_block = cutlass.select_(grouped, gy - 1 - y, gx - 1 - x)
        h = cutlass.select_(grouped, unit % num_heads, y)
        b = cutlass.select_(grouped, unit // num_heads, z)
        return m_block, h, b

    # ----------------------------------------------------------------------------------------------
    @cute.jit
    def _consume(self, mma_qk, mma_qk_acc, mma_pv, sQ, sK, sV, q_pipe, k_pipe, v_pipe, o_addr, lse_addr, q_scale_addr,
                 k_scale_addr, ctid, m_block, h, h_kv, b, n_blocks, seqlen_q, seqlen_k, q_row0, lse_stride,
                 num_heads, num_kv_heads, num_q_groups, num_k_blocks, scale_log2, mma_pv0, v_scale_addr, q_words,
                 sQin_layout, sQ_layout, qk_balance_addr, bias_addr, window, tail_args=None):
        """The MMA warpgroups. ``seqlen_q`` / ``seqlen_k`` are this sequence's lengths (keys from this CTA's
        first tile on), ``q_row0`` its first row in the (rows, heads, dim) output, ``lse_stride`` the rows of one
        head in the LSE tensor, ``window`` = (window_left, window_right) (``local`` / ``causal``)."""
        cfg, D, vdt = self.cfg, self.D, self.v_dtype
        TM, TN = cfg.tile_m, cfg.tile_n
        gmem = cute.AddressSpace.gmem
        thr_qk = mma_qk.get_slice(ctid)
        thr_pv = mma_pv.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TM, TN)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TM, D)))
        acc_o.fill(0.0)
        # O always accumulates (it starts at 0). Set once here: a field set inside a staged branch would leave
        # the MMA object holding a value that does not dominate later uses.
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        acc_t = None
        if cutlass.const_expr(self.fp8):
            # Two-level accumulation: each tile's P x V (4 k32 wgmmas = 128 keys) goes into a fresh fp32
            # accumulator (first k-block overwrites), added to the running O in fp32 registers after the
            # rescale; Hopper's FP8 wgmma keeps fewer accumulator bits (DeepGEMM promotes every 128 K as well).
            mma_pv0.set(warpgroup.Field.ACCUMULATE, False)
            acc_t = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TM, D)))
        mma_qk.set(warpgroup.Field.ACCUMULATE, False)
        mma_qk_acc.set(warpgroup.Field.ACCUMULATE, True)
        # (row, col) inside the tile of every accumulator value, for masks and stores
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TM, TN)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((TM, D)))
        s_rc = _rows_cols(acc_s.layout)
        o_rc = _rows_cols(acc_o.layout)
        assert cute.size(o_rc, mode=[0]) == 2  # one 64-row MMA per warpgroup: rows lane/4, lane/4 + 8
        n_rows = cute.size(s_rc, mode=[0])
        row_max = cute.make_rmem_tensor(cute.make_layout(n_rows), Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(n_rows), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # This thread's q scale (times softmax_scale * log2 e): per warp = its 16 rows, per block = the CTA.
        q_group = m_block
        if cutlass.const_expr(cfg.granularity == "per_warp"):
            q_group = m_block * (TM // 16) + ctid // 32
            if cutlass.const_expr(TM != 128):  # the prepass sizes q_scale for 128-row blocks: rows past them are
                q_group = cutlass.min(q_group, num_q_groups - 1)  # padding (never stored), any scale will do
        qs_log2 = scale_log2
        mKS = None
        ks_base = Int32(0)
        q_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_pipe.consumer_wait(q_cons)
        if cutlass.const_expr(self.int8_qk):
            # ``pdl``: every thread waits for the prepass grid before it reads what the prepass wrote (the
            # channel balance, q and k scales): right away, or after quantizing Q from the caller's tensor
            if cutlass.const_expr(self.quantize_q):
                lam_row = None
                if cutlass.const_expr(cfg.balance_qk):  # this (sequence, kv head)'s channel balance
                    cute.arch.griddepcontrol_wait()
                    lam_row = cute.make_tensor(
                        cute.make_ptr(Float32, qk_balance_addr, gmem, assumed_align=4) + (b * num_kv_heads + h_kv) * D,
                        cute.make_layout(D))
                q_scale = self._quantize_q(q_words, sQin_layout, sQ_layout, ctid, m_block, seqlen_q, lam_row)
                if cutlass.const_expr(not cfg.balance_qk):
                    cute.arch.griddepcontrol_wait()
            else:
                cute.arch.griddepcontrol_wait()
                q_scale = cute.make_tensor(cute.make_ptr(Float32, q_scale_addr, gmem, assumed_align=4),
                                           cute.make_layout(1 << 30))[(b * num_heads + h) * num_q_groups + q_group]
            mKS = cute.make_tensor(cute.make_ptr(Float32, k_scale_addr, gmem, assumed_align=4),
                                   cute.make_layout(1 << 30))
            ks_base = (b * num_kv_heads + h_kv) * num_k_blocks
            qs_log2 = q_scale * scale_log2
        q_in = (q_words[0], sQin_layout) if self.quantize_q else None  # the 16-bit Q tile (``_row_mean_logits``)
        self._bq = None
        if cutlass.const_expr(cfg.softcap > 0.0 and self.int8_qk):
            self._bq = self._row_mean_logits(sQ_layout, ctid, b * num_kv_heads + h_kv, qs_log2, qk_balance_addr,
                                            q_in, scale_log2)
        # causal: row i sees keys j <= i + diag (diag includes window_right in a local kernel); local: keys
        # j >= i + seqlen_k - seqlen_q - window_left too (``mask_diag``: what ``_scores`` takes, diag or (diag,
        # window): the lower bound's offset is recomputed from the kernel's window arguments where it is used,
        # which costs no register across the loop)
        diag = seqlen_k - seqlen_q
        if cutlass.const_expr(cfg.causal and cfg.local):
            diag = diag + window[1]
        mask_diag = (diag, window) if cfg.local else diag

        # The fp32 scores live in the registers of the int32 accumulator (converted in place): the next QK^T
        # overwrites them only after P has been taken out of them.
        s = cute.recast_tensor(acc_s, Float32)
        if cutlass.const_expr(self.fp8):
            p_lo = None
            tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((TM, TN)))  # E4M3 A fragments, 4 per register
        else:
            p_lo = cute.make_rmem_tensor(acc_s.layout, vdt)
            tOrP = cute.make_tensor(p_lo.iterator, _acc_as_a_operand(p_lo.layout))
        corr = cute.make_rmem_tensor(cute.make_layout(n_rows), Float32)
        # Software pipeline (FA3's intra-warpgroup overlap): the QK^T of tile n and the PV of tile n-1 are in
        # flight together; the exponentials of tile n run while the PV wgmma still executes. Pipeline states
        # are derived from the tile index (no state object is carried across the staged branches).
        wg = ctid // 128
        early = cfg.early_kv_wait
        # tokens of the next K tile and of the V tile the next P V reads, tested while this warp is busy with the
        # softmax: the blocking wait before the MMAs is skipped when the tile had landed by then (None: always wait)
        k_tok = cutlass.Boolean(False) if early else None
        v_tok = cutlass.Boolean(False) if early else None
        if n_blocks > 0:
            if wg == self.nw - 1:  # warpgroup 0 takes the first turn
                self._turn_done(0)
            st = _consumer_state(0, cfg.kv_stages)
            self._bias_scores(acc_s, bias_addr)
            self._my_turn(wg)
            self._issue_qk(mma_qk, mma_qk_acc, acc_s, tSrQ, tSrK, k_pipe, st)
            self._turn_done(self._next_wg(wg))
            warpgroup.wait_group(0)
            k_pipe.consumer_release(st)
            self._scores(acc_s, s, tScS, 0, m_block, seqlen_k, mask_diag)
            if cutlass.const_expr(early):
                k_tok = _landed(k_pipe, _consumer_state(cutlass.min(1, n_blocks - 1), cfg.kv_stages))
                v_tok = _landed(v_pipe, st)
            self._softmax(s, s_rc, self._tile_scale(qs_log2, mKS, ks_base), row_max, row_sum, corr)
            self._store_p(s, acc_s.layout, p_lo, tOrP)
            if cutlass.const_expr(cfg.intra_wg_overlap):  # serial: filled once P V(n-1) is done with P
                self._bias_scores(acc_s, bias_addr)
        # Causal: the K/V tiles this warpgroup's 64 rows see (the CTA's n_blocks are its last rows'); the tiles
        # past them are masked for all of its rows, so it only keeps the turn order and releases them (below).
        # The same scores, sums and O as computing them (exp2(-inf) = 0 adds nothing).
        n_mine = n_blocks
        if cutlass.const_expr(cfg.causal):
            # (wg through make_warp_uniform: n_mine bounds the loop, which stays a uniform branch)
            wg_end = cutlass.min(seqlen_k, m_block * TM + 64 * cute.arch.make_warp_uniform(wg) + 64 + diag)
            n_mine = cutlass.min(n_blocks, cutlass.max(cutlass.max(wg_end, 0) + TN - 1, TN) // TN)
        tile_args = (mma_qk, mma_qk_acc, mma_pv, mma_pv0, acc_s, s, tSrQ, tSrK, tOrV, acc_o, acc_t, k_pipe, v_pipe,
                     tScS, s_rc, o_rc, m_block, seqlen_k, mask_diag, n_mine, qs_log2, mKS, ks_base, row_max, row_sum, corr,
                     wg, bias_addr)
        for n in cutlass.range(1, n_mine, unroll=1):
            if cutlass.const_expr(cfg.intra_wg_overlap):
                k_tok, v_tok = self._tile(n, p_lo, tOrP, k_tok, v_tok, *tile_args)
            else:
                k_tok, v_tok = self._tile_serial(n, p_lo, tOrP, k_tok, v_tok, *tile_args)
        if n_mine > 0:  # the last P V this warpgroup issues (its turn of tile n_mine, or the tail's)
            self._last_pv(mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, _consumer_state(n_mine - 1, cfg.kv_stages),
                          v_tok, wg)
        if cutlass.const_expr(cfg.causal):
            # the turns of the skipped tiles (and the tail's): no MMA, their K and V released once landed (a
            # release before the producer refilled the stage would count towards the stage's previous use);
            # never the last warpgroup, which sees every tile. The CTA's tile count is recomputed from values the
            # loop keeps anyway (m_block, seqlen_k, diag), so that the loop carries n_mine only (one more register
            # across it made ptxas spill inside it); n_mine = 0: no tile at all (nor here)
            cta_end = cutlass.min(seqlen_k, m_block * TM + TM + diag)
            n_all = cutlass.select_(n_mine > 0, cutlass.max(cta_end + TN - 1, 0) // TN, 0)
            for n in cutlass.range(n_mine, n_all, unroll=1):
                st = _consumer_state(n, cfg.kv_stages)
                k_pipe.consumer_wait(st)
                k_pipe.consumer_release(st)
                self._my_turn(wg)
                self._turn_done(self._next_wg(wg))
                v_pipe.consumer_wait(st)
                v_pipe.consumer_release(st)

        # ---- epilogue: normalise, store O (bf16/fp16) and the natural-log LSE of valid rows
        mO = cute.make_tensor(cute.make_ptr(vdt, o_addr, gmem, assumed_align=16),
                              cute.make_layout((seqlen_q, D), stride=(num_heads * D, 1)))
        mO = cute.make_tensor(mO.iterator + (q_row0 * num_heads + h) * D, mO.layout)
        # LSE: dense (batch, heads, seqlen_q), varlen (heads, total_q); q_row0 = b * seqlen_q + start either way
        lse_base = (q_row0 // lse_stride * num_heads + h) * lse_stride + q_row0 % lse_stride
        mLSE = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4),
                                cute.make_layout(seqlen_q))
        mLSE = cute.make_tensor(mLSE.iterator + lse_base, mLSE.layout)
        inv_sum, lse2 = self._row_totals(row_max, row_sum)
        # The accumulator fragment: value i is column 8 (i // 4) + 2 (lane % 4) + i % 2 of row lane / 4 + 8 ((i // 2)
        # % 2); values i, i + 1 (i even) are adjacent columns of one row
        assert acc_o.layout.shape[0] == (2, 2, D // 8) and acc_o.layout.stride[0] == (1, 2, 4)
        vs_cols = None
        if cutlass.const_expr(self.fp8):  # this thread's D / 4 columns' V scales, by 8-byte loads, once
            vs_cols = []
            for j in cutlass.range_constexpr(D // 8):
                col = (b * num_kv_heads + h_kv) * D + 8 * j + 2 * (ctid % 4)
                pair = cute.make_tensor(cute.make_ptr(Float32, v_scale_addr + Int64(col) * 4, gmem, assumed_align=8),
                                        cute.make_layout(2)).load()
                vs_cols += [pair[0], pair[1]]
        # The returned LSE is that of the unsmoothed K's scores (FlashAttention's, mergeable across calls): the
        # shift q . k_mean that smoothing took out of every score of a row goes back in (``_k_mean_addr`` 0: an
        # unsmoothed K, none). With softcap it is in the scores already. The merge of split units works on the
        # shifted-out LSEs (the same shift for every split of a row) and adds it once.
        lse_shift = None
        if cutlass.const_expr(self.int8_qk and cfg.softcap == 0.0):
            lse_shift = self._row_mean_logits(sQ_layout, ctid, b * num_kv_heads + h_kv, qs_log2, qk_balance_addr,
                                              q_in, scale_log2)
        q_end = seqlen_q  # rows written below: none for a split CTA, whose unit the last one merges
        if cutlass.const_expr(tail_args is not None):
            self._split_epilogue(acc_o, tOcO, inv_sum, lse2, m_block, seqlen_q, mO, mLSE, vs_cols, ctid, tail_args,
                                 lse_shift)
            q_end = cutlass.select_(tail_args[0] >= 0, 0, seqlen_q)
        for i in cutlass.range_constexpr(n_rows):
            r = m_block * TM + _first_row(ctid) + 8 * i
            if ctid % 4 == 0 and r < q_end:
                lse_row = lse2[i]
                if cutlass.const_expr(lse_shift is not None):
                    lse_row = lse_row + lse_shift[i]
                mLSE[r] = lse_row * _LN2
        # FP8: O = (448 P)(V / v_scale) / rowsum(448 P) * v_scale
        self._store_o(acc_o, tOcO, inv_sum, vs_cols, m_block, q_end, mO)

    @cute.jit
    def _row_totals(self, row_max, row_sum):
        """Per row of this thread: 1 / (row sum over the quad) and the log2-domain LSE (0 and -inf for a row that
        saw no key). FP8 P x V: the row sum adds 448 * P, whose log2 comes off the LSE."""
        inv = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        lse2 = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for i in cutlass.range_constexpr(2):
            total = cute.arch.warp_reduction(row_sum[i], lambda x, y: x + y, threads_in_group=4)
            inv[i] = 0.0
            lse2[i] = -Float32.inf
            if total > 0.0:
                inv[i] = 1.0 / total
                lse2[i] = row_max[i] + cute.math.log2(total, fastmath=True)
                if cutlass.const_expr(self.fp8):
                    lse2[i] = lse2[i] - Float32(P_FP8_LOG2_SCALE)
        return inv, lse2

    @cute.jit
    def _store_o(self, acc_o, tOcO, inv_rows, vs_cols, m_block, row_end, mO):
        """O rows < ``row_end`` of this thread's accumulator values times their row's ``inv_rows`` (and their
        column's ``vs_cols``, if given) to ``mO`` in V's 16-bit dtype, 16 bytes (8 columns) per store.

        A quad (4 lanes) holds two adjacent columns of every 8-column group of its two rows, one 32-bit word per
        group; a 4 x 4 word transpose within the quad (two butterfly rounds of shuffles) gives each lane 8 whole
        columns. One 16-byte store per 4 words instead of four 4-byte ones: every warp-wide store touches 8 rows
        (8 cache lines) either way, so the store instructions pace the epilogue (%globaltimer traces: 2.5 us per
        CTA at D128 with 4-byte stores)."""
        D = self.D
        row_stride = mO.layout.stride[0]
        base = mO.iterator.toint()
        t = cute.arch.lane_idx() % 4
        odd = [(t & 1) != 0, (t & 2) != 0]
        for rho in cutlass.range_constexpr(2):  # the thread's rows lane / 4 and lane / 4 + 8
            r, _ = tOcO[2 * rho]
            row = m_block * self.cfg.tile_m + r
            words = []
            for j in cutlass.range_constexpr(D // 8):  # columns 8 j + 2 (lane % 4) + (0, 1)
                s0 = inv_rows[rho]
                s1 = s0
                if cutlass.const_expr(vs_cols is not None):
                    s0, s1 = s0 * vs_cols[2 * j], s1 * vs_cols[2 * j + 1]
                words.append(f32x2_to_16x2(acc_o[4 * j + 2 * rho] * s0, acc_o[4 * j + 2 * rho + 1] * s1,
                                           self.v_dtype == BFloat16))
            for g in cutlass.range_constexpr(D // 32):
                x = words[4 * g:4 * g + 4]
                # lane s slot k holds column group 4 g + k of lane s; afterwards lane t slot s holds group 4 g + t
                # of lane s: exchange the slots whose bit differs from the lane's, bit 0 then bit 1
                for bit, pairs in ((0, ((0, 1), (2, 3))), (1, ((0, 2), (1, 3)))):
                    for i, k in pairs:
                        recv = cute.arch.shuffle_sync_bfly(cutlass.select_(odd[bit], x[i], x[k]), offset=1 << bit)
                        x[i], x[k] = cutlass.select_(odd[bit], recv, x[i]), cutlass.select_(odd[bit], x[k], recv)
                if row < row_end:
                    col = (4 * g + t) * 8
                    _st_global_v4(base + (Int64(row) * row_stride + col) * self.v_dtype.width // 8, *x)

    @cute.jit
    def _split_epilogue(self, acc_o, tOcO, inv, lse2, m_block, seqlen_q, mO, mLSE, vs_cols, ctid, tail_args,
                        lse_shift=None):
        """``split_tail``, a CTA of a split unit: its normalized partial output and log2-domain LSE to the
        partial buffers, then ``_merge_splits`` (``lse_shift``: added to the merged LSE). Whole-unit CTAs (tail
        -1) do nothing here."""
        tail, ns, split_args, flag_ptr = tail_args
        num_full_units, part_addr, count_addr = split_args[0], split_args[2], split_args[3]
        TM, D = self.cfg.tile_m, self.D
        gmem = cute.AddressSpace.gmem
        if tail >= 0:
            gx, _, _ = cute.arch.grid_dim()
            n_tail = gx - num_full_units
            part_o = cute.make_tensor(cute.make_ptr(Float32, part_addr, gmem, assumed_align=16),
                                      cute.make_layout((TM, D, n_tail), stride=(D, 1, TM * D)))
            part_l = cute.make_tensor(cute.make_ptr(Float32, part_addr, gmem, assumed_align=16) + n_tail * TM * D,
                                      cute.make_layout((TM, n_tail), stride=(1, TM)))
            r0 = _first_row(ctid)
            if ctid % 4 == 0:
                for i in cutlass.range_constexpr(2):
                    part_l[r0 + 8 * i, tail] = lse2[i]
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                r, c = tOcO[e]
                o = acc_o[e] * inv[(e // 2) % 2]
                if cutlass.const_expr(self.fp8):
                    o = o * vs_cols[e // 4 * 2 + e % 2]
                part_o[r, c, tail] = o
            self._merge_splits(acc_o, tOcO, m_block, seqlen_q, mO, mLSE, ctid, tail // ns, ns, count_addr, flag_ptr,
                               part_o, part_l, lse_shift)

    @cute.jit
    def _merge_splits(self, acc_o, tOcO, m_block, seqlen_q, mO, mLSE, ctid, unit, ns, count_addr, flag_ptr, part_o,
                      part_l, lse_shift=None):
        """Count this split CTA in (its partials written); the CTA that completes split unit ``unit``'s count of
        ``ns`` merges the unit's partials, O = sum_s w_s O_s / sum_s w_s with w_s = exp2(LSE_s - max_s LSE_s), in
        split order (the same sums whichever CTA merges), and writes the unit's O and LSE."""
        TM = self.cfg.tile_m
        r0 = _first_row(ctid)
        # release this CTA's partials, then count it in; the CTA that completes the count acquires the others'
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=1 + 2 * self.nw, number_of_threads=128 * self.nw)
        flag = cute.make_tensor(flag_ptr, cute.make_layout(4))
        if ctid == 0:
            count = cute.make_ptr(Int32, count_addr, cute.AddressSpace.gmem, assumed_align=4) + unit
            old = cute.arch.atomic_add(count, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = cutlass.select_(old == ns - 1, Int32(1), Int32(0))
        cute.arch.barrier(barrier_id=1 + 2 * self.nw, number_of_threads=128 * self.nw)
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            first = unit * ns
            m = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            wsum = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            w = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            for i in cutlass.range_constexpr(2):
                m[i] = -Float32.inf
                wsum[i] = 0.0
            for sp in cutlass.range(ns, unroll=1):
                for i in cutlass.range_constexpr(2):
                    m[i] = cute.arch.fmax(m[i], part_l[r0 + 8 * i, first + sp])
            for i in cutlass.range_constexpr(2):
                if m[i] == -Float32.inf:  # no key in any split: weights exp2(-inf) = 0, not NaN
                    m[i] = 0.0
            acc_o.fill(0.0)
            for sp in cutlass.range(ns, unroll=1):
                for i in cutlass.range_constexpr(2):
                    w[i] = cute.math.exp2(part_l[r0 + 8 * i, first + sp] - m[i], fastmath=True)
                    wsum[i] = wsum[i] + w[i]
                for e in cutlass.range_constexpr(cute.size(acc_o)):
                    r, c = tOcO[e]
                    acc_o[e] = acc_o[e] + w[(e // 2) % 2] * part_o[r, c, first + sp]
            for i in cutlass.range_constexpr(2):
                lse = -Float32.inf
                if wsum[i] > 0.0:
                    lse2 = m[i] + cute.math.log2(wsum[i], fastmath=True)
                    if cutlass.const_expr(lse_shift is not None):
                        lse2 = lse2 + lse_shift[i]
                    lse = lse2 * _LN2
                    wsum[i] = 1.0 / wsum[i]
                r = m_block * TM + r0 + 8 * i
                if ctid % 4 == 0 and r < seqlen_q:
                    mLSE[r] = lse
            self._store_o(acc_o, tOcO, wsum, None, m_block, seqlen_q, mO)

    # ----------------------------------------------------------------------------------------------
    @cute.jit
    def _tile(self, n, p_lo, tOrP, k_tok, v_tok, mma_qk, mma_qk_acc, mma_pv, mma_pv0, acc_s, s, tSrQ, tSrK, tOrV,
              acc_o, acc_t, k_pipe, v_pipe, tScS, s_rc, o_rc, m_block, seqlen_k, diag, n_mine, qs_log2, mKS, ks_base,
              row_max, row_sum, corr, wg, bias_addr):
        """One iteration of the MMA warpgroups' loop, tile n >= 1: QK^T(n) and P V(n-1) (P of tile n-1 in
        ``tOrP``), the softmax of tile n, the O rescale, then P(n) -> ``p_lo`` / ``tOrP`` once P V(n-1) is done
        with them and the score registers refilled with the bias. Returns the early K / V tokens
        (``early_kv_wait``)."""
        cfg = self.cfg
        st = _consumer_state(n, cfg.kv_stages)
        st_prev = _consumer_state(n - 1, cfg.kv_stages)
        self._my_turn(wg)
        self._issue_qk(mma_qk, mma_qk_acc, acc_s, tSrQ, tSrK, k_pipe, st, k_tok)
        self._issue_pv(mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, st_prev, v_tok)
        self._turn_done(self._next_wg(wg))
        warpgroup.wait_group(1)  # S(n) ready; PV(n-1) may still run
        k_tok, v_tok = self._tile_softmax(n, st, k_tok, v_tok, acc_s, s, k_pipe, v_pipe, tScS, s_rc, m_block, seqlen_k,
                                          diag, n_mine, qs_log2, mKS, ks_base, row_max, row_sum, corr)
        warpgroup.wait_group(0)  # PV(n-1) done: its P registers and O may be touched again
        v_pipe.consumer_release(st_prev)
        o_mn = cute.make_tensor(acc_o.iterator, o_rc)
        stale = self._rows_moved(corr)
        if cutlass.const_expr(self.fp8):  # O = (O + this tile's P V) * corr, in fp32
            t_mn = cute.make_tensor(acc_t.iterator, o_rc)
            if cute.arch.vote_any_sync(stale):
                for i in cutlass.range_constexpr(cute.size(corr)):
                    for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        o_mn[i, j] = (o_mn[i, j] + t_mn[i, j]) * corr[i]
            else:
                acc_o.store(acc_o.load() + acc_t.load())
        else:  # lazy rescale (the running max moves only past +2^8): O is rescaled even less often
            if cute.arch.vote_any_sync(stale):
                self._rescale_o(o_mn, corr)
        self._store_p(s, acc_s.layout, p_lo, tOrP)
        self._bias_scores(acc_s, bias_addr)
        return k_tok, v_tok

    @cute.jit
    def _last_pv(self, mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, st, v_tok, wg):
        """This warpgroup's last P V (of tile ``st``): its turn of the tile after it, or (the CTA's last tile) the
        tail's turn, after which the last warpgroup passes the turn to nobody."""
        self._my_turn(wg)
        self._issue_pv(mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, st, v_tok)
        if wg != self.nw - 1:  # the last warpgroup's last turn: nobody waits after it
            self._turn_done(self._next_wg(wg))
        warpgroup.wait_group(0)
        v_pipe.consumer_release(st)
        if cutlass.const_expr(self.fp8):
            acc_o.store(acc_o.load() + acc_t.load())

    @cute.jit
    def _tile_softmax(self, n, st, k_tok, v_tok, acc_s, s, k_pipe, v_pipe, tScS, s_rc, m_block, seqlen_k, diag,
                      n_mine, qs_log2, mKS, ks_base, row_max, row_sum, corr):
        """Tile n >= 1 once its QK^T is done: K tile released, scores (masked where needed), the early K / V
        tests (``early_kv_wait``, up to this warpgroup's last tile ``n_mine - 1``), the online softmax. Returns
        the early tokens."""
        cfg, TN = self.cfg, self.cfg.tile_n
        k_pipe.consumer_release(st)
        self._scores(acc_s, s, tScS, n * TN, m_block, seqlen_k, diag)
        if cutlass.const_expr(cfg.early_kv_wait):
            k_tok = _landed(k_pipe, _consumer_state(cutlass.min(n + 1, n_mine - 1), cfg.kv_stages))
            v_tok = _landed(v_pipe, st)
        self._softmax(s, s_rc, self._tile_scale(qs_log2, mKS, ks_base + n), row_max, row_sum, corr)
        return k_tok, v_tok

    @cute.jit
    def _rows_moved(self, corr):
        """Whether any of this thread's rows got a new running max (corr != 1). Most tiles leave every row's max
        alone (corr exactly 1), so the O rescale is skipped warp by warp (a vote on this)."""
        stale = corr[0] != Float32(1.0)
        for i in cutlass.range_constexpr(1, cute.size(corr)):
            stale = stale | (corr[i] != Float32(1.0))
        return stale

    @cute.jit
    def _rescale_o(self, o_mn, corr):
        for i in cutlass.range_constexpr(cute.size(corr)):
            for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[i, j] = o_mn[i, j] * corr[i]

    @cute.jit
    def _tile_serial(self, n, p_lo, tOrP, k_tok, v_tok, mma_qk, mma_qk_acc, mma_pv, mma_pv0, acc_s, s, tSrQ, tSrK,
                     tOrV, acc_o, acc_t, k_pipe, v_pipe, tScS, s_rc, o_rc, m_block, seqlen_k, diag, n_mine, qs_log2,
                     mKS, ks_base, row_max, row_sum, corr, wg, bias_addr):
        """``intra_wg_overlap=False``: tile n >= 1 without the intra-warpgroup overlap. One turn issues P V(n-1),
        waits for it, refills the score registers and issues QK^T(n); the softmax of tile n then runs with no
        MMA of this warpgroup in flight. So P and the scores are never live together (P V(n-1) is done before
        QK^T(n) writes the score registers): at most O + scores live (128 registers at head_dim 128) instead of
        O + scores + P (160), which lets three MMA warpgroups (192 rows) fit at head_dim 128, and the other two warpgroups' MMAs fill the tensor cores meanwhile."""
        cfg = self.cfg
        st = _consumer_state(n, cfg.kv_stages)
        st_prev = _consumer_state(n - 1, cfg.kv_stages)
        self._my_turn(wg)
        self._issue_pv(mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, st_prev, v_tok)
        warpgroup.wait_group(0)
        v_pipe.consumer_release(st_prev)
        if cutlass.const_expr(self.fp8):  # tile n-1's P V into O before the scores take registers again
            acc_o.store(acc_o.load() + acc_t.load())
        self._bias_scores(acc_s, bias_addr)
        self._issue_qk(mma_qk, mma_qk_acc, acc_s, tSrQ, tSrK, k_pipe, st, k_tok)
        self._turn_done(self._next_wg(wg))
        warpgroup.wait_group(0)
        k_tok, v_tok = self._tile_softmax(n, st, k_tok, v_tok, acc_s, s, k_pipe, v_pipe, tScS, s_rc, m_block, seqlen_k,
                                          diag, n_mine, qs_log2, mKS, ks_base, row_max, row_sum, corr)
        if cute.arch.vote_any_sync(self._rows_moved(corr)):  # FP8: tile n-1's P V was added above
            self._rescale_o(cute.make_tensor(acc_o.iterator, o_rc), corr)
        self._store_p(s, acc_s.layout, p_lo, tOrP)
        return k_tok, v_tok

    @cute.jit
    def _row_mean_logits(self, sQ_layout, ctid, head_row, qs_log2, qk_balance_addr, q_in, scale_log2):
        """Per row of this thread (r0, r0 + 8), the score shift that K's smoothing took out, in the kernel's
        score units (pre-tanh with ``softcap``, else log2 for the LSE), from the mean (``_k_mean_addr``; 0: an
        unsmoothed K, no shift). ``quantize_q``: scale_log2 * sum_c q[r, c] * k_mean[c] of the caller's 16-bit Q
        (``q_in``: the staging tile's words and layout), since the int8 Q's rounding times a large mean would stay
        in the LSE (docs/prefill.md). A prepass-quantized Q: qs_log2 * sum_c q_int8[r, c] * k_mean[c] (/
        qk_balance[c] with ``balance_qk``) from the int8 Q tile. A quad's four lanes split the columns."""
        D = self.D
        gmem = cute.AddressSpace.gmem
        bq = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        bq.fill(0.0)
        if self._k_mean_addr != Int64(0):
            mean_ptr = cute.make_ptr(Float32, self._k_mean_addr, gmem, assumed_align=16) + head_row * D
            t = ctid % 4
            r0 = _first_row(ctid)
            row_scale = qs_log2
            if cutlass.const_expr(self.quantize_q):
                row_scale = scale_log2
                q_words, sQin_layout = q_in
                widen = bf16x2_to_f32x2 if self.v_dtype is BFloat16 else fp4.f16x2_to_f32x2
                for w in cutlass.range_constexpr(D // 32):  # this lane's D / 4 columns, 8 per 16-byte chunk
                    c0 = t * (D // 4) + 8 * w
                    m8 = cute.make_tensor(mean_ptr + c0, cute.make_layout(8)).load()  # both rows' means
                    for i in cutlass.range_constexpr(2):
                        w0 = _swizzled_byte_offset(sQin_layout, r0 + 8 * i, c0, 2) // 4  # chunks stay whole
                        for j in cutlass.range_constexpr(4):
                            lo, hi = widen(q_words[w0 + j])
                            bq[i] = bq[i] + lo * m8[2 * j] + hi * m8[2 * j + 1]
            else:
                lam = None
                if cutlass.const_expr(self.cfg.balance_qk):
                    lam = cute.make_tensor(cute.make_ptr(Float32, qk_balance_addr, gmem, assumed_align=4)
                                           + head_row * D, cute.make_layout(D))
                for w in cutlass.range_constexpr(D // 16):  # this lane's D / 4 columns, 4 per 32-bit word
                    c0 = t * (D // 4) + 4 * w
                    w0 = Int32(self._sq_words[_swizzled_byte_offset(sQ_layout, r0, c0, 1) // 4])
                    w1 = Int32(self._sq_words[_swizzled_byte_offset(sQ_layout, r0 + 8, c0, 1) // 4])
                    m4 = cute.make_tensor(mean_ptr + c0, cute.make_layout(4)).load()  # one 16-byte load, both rows
                    for e in cutlass.range_constexpr(4):
                        m = m4[e]
                        if cutlass.const_expr(lam is not None):
                            m = m / lam[c0 + e]
                        # int8 byte e as fp32 exactly: 2^23 + (q + 128) from the bits (q + 128 = byte ^ 0x80),
                        # minus 2^23 + 128 (bit ops and an FADD instead of the quarter-rate int -> float conversion)
                        for i, wd in ((0, w0), (1, w1)):
                            u = ((Uint32(wd) >> (8 * e)) & Uint32(0xFF)) ^ Uint32(0x4B000080)
                            bq[i] = bq[i] + (_f32_from_bits(u) - Float32(8388736.0)) * m
            for i in cutlass.range_constexpr(2):
                bq[i] = row_scale * cute.arch.warp_reduction(bq[i], lambda a, b: a + b, threads_in_group=4)
        return bq

    @cute.jit
    def _quantize_q(self, q_words, sQin_layout, sQ_layout, ctid, m_block, seqlen_q, lam_row=None) -> Float32:
        """``quantize_q``: quantize this warp's 16 query rows (its per_warp q-scale group = the rows of its wgmma
        accumulator) from the 16-bit staging tile into the int8 Q tile, and return the group's scale.

        The prepass's numerics bit for bit (``qk_int8_quant``): amax over the group's rows that exist in the
        sequence, ``s = amax / 127`` (div.rn), ``inv = 1 / s`` for a normal ``s`` (else 0), ``q = rni(x * inv)``
        with the product rounded first. The rounding is ``x * inv + 1.5 * 2^23`` (the add rounds to an integer,
        whose low byte is q in two's complement, since |x * inv| <= 127 * (1 + 2^-22)), so no quarter-rate
        float -> int conversion and no clamp (never active). amax on the packed 16-bit magnitudes (their bits
        order like the values; with ``balance_qk`` on the fp32 products ``x * lam``, exact, as the balanced
        prepass computes them). Two lanes per row, 16-byte chunks ``2i + lane % 2``; offsets come from the two
        swizzled layouts. wgmma reads shared memory through the async proxy: a proxy fence, then the
        warpgroup's named barrier."""
        D, TM = self.D, self.cfg.tile_m
        q_in, q_out = q_words
        lane = ctid % 32
        r = (ctid // 32) * 16 + lane // 2  # row in the tile
        half = lane % 2
        n_chunks = D // 16  # 16-byte chunks (8 values) of the row per lane
        rX = cute.make_rmem_tensor((4, n_chunks), Uint32)
        rX.fill(Uint32(0))
        if m_block * TM + r < seqlen_q:  # rows past the sequence (varlen: the next one's) are not in the group
            for i in cutlass.range_constexpr(n_chunks):
                w0 = _swizzled_byte_offset(sQin_layout, r, (2 * i + half) * 8, 2) // 4
                for j in cutlass.range_constexpr(4):
                    rX[j, i] = q_in[w0 + j]
        widen = bf16x2_to_f32x2 if self.v_dtype is BFloat16 else fp4.f16x2_to_f32x2

        def values(i):  # the chunk's 8 values, times the channel balance
            vals = [x for j in (0, 1, 2, 3) for x in widen(rX[j, i])]
            if cutlass.const_expr(self.cfg.balance_qk):
                c0 = (2 * i + half) * 8
                vals = [mul_rn(x, lam_row[c0 + e]) for e, x in enumerate(vals)]
            return vals

        if cutlass.const_expr(self.cfg.balance_qk):
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(n_chunks):
                for x in values(i):
                    amax = cute.arch.fmax(amax, cute.math.absf(x))
            amax = cute.arch.warp_reduction(amax, cute.arch.fmax)  # the warp's 16 rows
        else:
            mag = Uint32(0)
            for i in cutlass.range_constexpr(n_chunks):
                for j in cutlass.range_constexpr(4):
                    mag = _max_u16x2(mag, rX[j, i] & Uint32(0x7FFF7FFF))
            mag = cute.arch.warp_reduction(mag, _max_u16x2)  # the warp's 16 rows
            lo, hi = widen(mag)
            amax = cute.arch.fmax(lo, hi)
        q_scale = div_rn(amax, Float32(INT8_MAX))
        inv = Float32(0.0)
        if q_scale >= Float32(FP32_MIN_NORMAL):
            inv = fp4.rcp_rn(q_scale)
        for i in cutlass.range_constexpr(n_chunks):
            p = [mul_rn(x, inv) for x in values(i)]
            w0 = _swizzled_byte_offset(sQ_layout, r, (2 * i + half) * 8, 1) // 4
            q_out[w0] = _round_s8x4(p[0], p[1], p[2], p[3])
            q_out[w0 + 1] = _round_s8x4(p[4], p[5], p[6], p[7])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1 + self.nw + ctid // 128, number_of_threads=128)
        return q_scale

    # ----------------------------------------------------------------------------------------------
    # Ping-pong (FA3): the warpgroups alternate issuing their wgmmas, so one runs its softmax while the other's
    # MMAs occupy the tensor cores. Named barrier 1 + w = "warpgroup w may issue": w syncs on it (128 threads),
    # the previous warpgroup in the rotation 0, 1[, 2] arrives on it (128 threads) when its own issue phase is
    # over. Every warpgroup has n_blocks + 1 issue phases; the last one gives warpgroup 0 its first turn and skips
    # its very last arrive.
    def _next_wg(self, wg):
        return (wg + 1) % self.nw

    @cute.jit
    def _my_turn(self, wg):
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=256)

    @cute.jit
    def _turn_done(self, other_wg):
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier_arrive(barrier_id=1 + other_wg, number_of_threads=256)

    @cute.jit
    def _issue_qk(self, mma_qk, mma_qk_acc, acc_s, tSrQ, tSrK, k_pipe, k_cons: pipeline.PipelineState, k_tok=None):
        """Wait for K tile ``k_cons`` (unless ``k_tok``, an earlier try-wait, saw it) and issue S = Q K^T (int8 SS
        wgmma, int32) without waiting for it."""
        k_pipe.consumer_wait(k_cons, k_tok)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            first = kb == 0 and not self.bias_in_acc  # bias_in_acc: every k-step accumulates (onto the bias)
            cute.gemm(mma_qk if first else mma_qk_acc, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb, k_cons.index],
                      acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, mma_pv, mma_pv0, acc_o, acc_t, tOrP, tOrV, v_pipe, v_cons: pipeline.PipelineState,
                  v_tok=None):
        """Wait for V tile ``v_cons`` (unless ``v_tok`` saw it) and issue O += P V (RS wgmma) without waiting for
        it; FP8: acc_t = P V."""
        v_pipe.consumer_wait(v_cons, v_tok)
        warpgroup.fence()
        if cutlass.const_expr(self.fp8):
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(mma_pv0 if kb == 0 else mma_pv, acc_t, tOrP[None, None, kb],
                          tOrV[None, None, kb, v_cons.index], acc_t)
        else:
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(mma_pv, acc_o, tOrP[None, None, kb], tOrV[None, None, kb, v_cons.index], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _bias_scores(self, acc_s, bias_addr):
        """``bias_in_acc``: the score registers (free once P has been taken out of them) <- the bits of
        SCORE_BIAS, so that the next QK^T (accumulating) leaves float(S) + SCORE_BIAS in them (see ``_scores``).

        By 16-byte volatile loads of a shared slot (``bias_addr``) rather than one move per register: a quarter
        of the instructions, none in the FMA / ALU pipes of the softmax, and kept where they are written (ptxas
        sinks 64 moves, which it can rematerialize, to just before the QK wgmma, into the issue phase)."""
        if cutlass.const_expr(self.bias_in_acc):
            bits = cute.recast_tensor(acc_s, Int32)
            for i in cutlass.range_constexpr(0, cute.size(bits), 4):
                w = _lds_volatile_b32x4(bias_addr)
                for j in cutlass.range_constexpr(4):
                    bits[i + j] = w[j]

    @cute.jit
    def _store_p(self, s, acc_layout, p_lo, tOrP):
        """P (fp32 in the score registers ``s``) into the A fragments of the P x V wgmma.

        16-bit: rounded in place of the accumulator layout, which *is* the k16 A layout (``_acc_as_a_operand``).

        FP8 (k32, 4 E4M3 values per register): the PTX ISA's 8-bit A fragment gives lane t of a quad (t = lane
        % 4) k = 4t..4t+3 (bytes 0..3 of a register) and k = 16+4t..16+4t+3, for rows g and g+8 (g = lane / 4).
        The accumulator gives it columns 8j + 2t + {0, 1}, j = 0..3, of each 32-column block. Instead of moving
        bytes between lanes (CUTLASS's Hopper FMHA uses shuffles + prmt), the *keys* are permuted: the MMA's
        k = 16h + 4t + 2a + c multiplies score column 16h + 8a + 2t + c, so every lane packs its own 8 values
        in order, and the V prepass stores V^T with the same permutation of keys inside every 32-key group
        (``qattn.quant.v_fp8.key_permutation``). A sum over keys does not care about their order.
        In fragment terms: A value (v0, v1, v2) of k-block kb <- accumulator value (c = v0 % 2, r = v1,
        j = 4 kb + 2 v2 + v0 // 2); each register = 2 x cvt.rn.satfinite.e4m3x2.f32 + one mov."""
        if cutlass.const_expr(not self.fp8):
            p_lo.store(s.load().to(self.v_dtype))
        else:
            p32 = cute.recast_tensor(tOrP, Uint32)
            regs = cute.make_tensor(p32.iterator, cute.make_layout(cute.cosize(p32.layout)))
            sf = cute.make_tensor(s.iterator, cute.make_layout(cute.cosize(acc_layout)))
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                for v2 in cutlass.range_constexpr(2):
                    for v1 in cutlass.range_constexpr(2):
                        byte = cute.crd2idx(((0, v1, v2), 0, kb), tOrP.layout)
                        assert byte % 4 == 0 and all(
                            cute.crd2idx(((v0, v1, v2), 0, kb), tOrP.layout) == byte + v0 for v0 in range(4))
                        src = [cute.crd2idx(((v0 % 2, v1, 4 * kb + 2 * v2 + v0 // 2), 0, 0), acc_layout)
                               for v0 in range(4)]
                        regs[byte // 4] = f32x4_to_e4m3x4(sf[src[0]], sf[src[1]], sf[src[2]], sf[src[3]])

    @cute.jit
    def _tile_scale(self, qs_log2, mKS, ks_index):
        """log2-domain scale of a tile's raw scores: q_scale * k_scale * softmax_scale * log2 e (int8 QK), or
        softmax_scale * log2 e (bf16 QK)."""
        scale = qs_log2
        if cutlass.const_expr(self.int8_qk):
            scale = qs_log2 * mKS[ks_index]
        return scale

    @cute.jit
    def _scores(self, acc_s, s, tScS, col0, m_block, seqlen_k, diag):
        """s = float(acc_s) (+ ``score_bias``), keys a row may not see set to -inf; ``s`` aliases ``acc_s``.

        int32 -> fp32 without I2F (a quarter-rate conversion on SM90, as costly as the exp2 of softmax): for
        |x| < 2^22, the bits of x + 0x4B400000 are the float SCORE_BIAS + x (SCORE_BIAS = 1.5 * 2^23), exactly,
        so one integer add gives a biased float; the bias is taken out in the softmax's FFMA (no subtract per
        score). |S| <= 127 * 127 * head_dim <= 2^21 for head_dim <= 128. With ``bias_in_acc`` the wgmma has
        accumulated onto the bias bits already (``_bias_scores``): no add here."""
        cfg, TM, TN = self.cfg, self.cfg.tile_m, self.cfg.tile_n
        if cutlass.const_expr(self.int8_qk and not self.bias_in_acc):  # (bf16 QK: fp32 already, bias 0)
            acc_s.store(acc_s.load() + Int32(0x4B400000))
        diag_lo = None
        if cutlass.const_expr(cfg.local):
            diag, (window_left, window_right) = diag
            diag_lo = diag - window_left - (window_right if cfg.causal else 0)
        # keys < key_end(r) are visible to row r; masking is needed when the tile's last key is not visible
        # to its first row
        first_row_end = seqlen_k
        if cutlass.const_expr(cfg.causal):
            first_row_end = cutlass.min(seqlen_k, m_block * TM + diag + 1)
        if col0 + TN > first_row_end:
            for i in cutlass.range(cute.size(s), unroll_full=True):
                r, c = tScS[i]
                key_end = seqlen_k
                if cutlass.const_expr(cfg.causal):
                    key_end = cutlass.min(seqlen_k, m_block * TM + r + diag + 1)
                if col0 + c >= key_end:
                    s[i] = -Float32.inf
        # local: keys >= r + diag_lo are visible to row r; a second pass when the tile's first key is not
        # visible to its last row (one pass for both edges needs more registers: ptxas spilled in the loop)
        if cutlass.const_expr(cfg.local):
            row_lo = m_block * TM + diag_lo - col0  # row r sees the tile's columns c >= r + row_lo
            if TM - 1 + row_lo > 0:
                for i in cutlass.range(cute.size(s), unroll_full=True):
                    r, c = tScS[i]
                    if c < r + row_lo:
                        s[i] = -Float32.inf

    @cute.jit
    def _softmax(self, s, s_rc, scale, row_max, row_sum, corr):
        """Online softmax step on integer-valued scores ``s`` of one tile (int8 QK: biased by SCORE_BIAS, see
        ``_scores``) whose true log2-domain logits are ``(s - bias) * scale`` (scale = q_scale * k_scale *
        softmax_scale * log2 e > 0, one value per row and tile).

        s -> exp2((s - bias) * scale - max) in place, as one FFMA (s * scale - (bias * scale + max)) + ex2 per
        score: since scale > 0 the row max is taken on the raw biased floats and scaled once. Running max (log2
        domain) / sum updated; ``corr`` gets the factor exp2(old max - new max) that the caller applies to O.
        16-bit P x V keeps the old max unless the tile's exceeds it by more than LAZY_RESCALE_LOG2 (then corr is
        exactly 1 and the caller skips the O rescale); FP8 P x V (P scaled to E4M3's top) always moves it. Max
        and sum are trees (short dependency chains; the 16-bit P x V max an integer one, see below). A quad of
        lanes shares each row. ``softcap``: x = softcap * log2 e * tanh((s - bias) * scale + bq) per score and for
        the max (``scale`` then gives z / softcap; ``bq``, the row's smoothing shift, ``_row_mean_logits``)."""
        s_mn = cute.make_tensor(s.iterator, s_rc)
        bits_mn = cute.make_tensor(cute.recast_tensor(s, Int32).iterator, s_rc)
        bias = Float32(self.score_bias)
        # softcap: ``scale`` gives z / softcap (the host passes softmax_scale / softcap), the log2-domain logit is
        # softcap * log2 e * tanh(z / softcap)
        softcap_log2 = self.cfg.softcap * math.log2(math.e)
        # A zero scale (an all-zero q group or k block: all its scores are exactly 0) would turn masked -inf
        # scores into NaN; the smallest normal float keeps 0 -> 0 and -inf -> -inf.
        scale = cute.arch.fmax(scale, Float32(1.1754943508222875e-38))
        ncol = cute.size(s_rc, mode=[1])
        for i in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            if cutlass.const_expr(self.score_bias != 0.0):
                # biased scores are floats in [2^23, 2^24) or -inf (masked): their bits order like the values
                # as int32 (-inf's are negative), and an integer max tree lets ptxas use 3-input IMNMX
                mb = _tree([bits_mn[i, j] for j in range(ncol)], cutlass.max, arity=3)
                mx = _f32_from_bits(cute.arch.warp_reduction(mb, cutlass.max, threads_in_group=4))
            else:
                mx = _tree([s_mn[i, j] for j in range(ncol)], cute.arch.fmax)
                mx = cute.arch.warp_reduction(mx, cute.arch.fmax, threads_in_group=4)
            m_tile = (mx - bias) * scale  # exact subtract: both in [2^23, 2^24) (or -inf)
            if cutlass.const_expr(softcap_log2 > 0.0):  # tanh is increasing: the capped max is the max's cap
                if cutlass.const_expr(self._bq is not None):  # K's smoothing shift back (``_row_mean_logits``)
                    m_tile = m_tile + self._bq[i]
                m_tile = cutlass.select_(mx == -Float32.inf, -Float32.inf,
                                         Float32(softcap_log2) * tanh_approx(m_tile))
            m_new = cute.arch.fmax(row_max[i], m_tile)
            if cutlass.const_expr(not self.fp8):
                if m_tile <= row_max[i] + Float32(LAZY_RESCALE_LOG2):
                    m_new = row_max[i]
            m_use = m_new
            if m_new == -Float32.inf:  # nothing visible yet: keep exp2(-inf - 0) = 0, avoid inf - inf
                m_use = 0.0
            corr[i] = cute.math.exp2(row_max[i] - m_use, fastmath=True)
            row_max[i] = m_new
            if cutlass.const_expr(self.fp8):  # p = 448 * exp2(x - m): the P scale folded into the offset
                m_use = m_use - Float32(P_FP8_LOG2_SCALE)
            offset = bias * scale + m_use
            if cutlass.const_expr(softcap_log2 > 0.0):
                offset = bias * scale
                if cutlass.const_expr(self._bq is not None):
                    offset = offset - self._bq[i]
            ps = []
            for j in cutlass.range_constexpr(ncol):
                x = s_mn[i, j] * scale - offset
                if cutlass.const_expr(softcap_log2 > 0.0):  # softcap * tanh(z / softcap) in log2 units; masked
                    # scores (-inf) stay -inf (tanh would make them -softcap)
                    x = cutlass.select_(s_mn[i, j] == -Float32.inf, -Float32.inf,
                                        Float32(softcap_log2) * tanh_approx(x) - m_use)
                p = cute.math.exp2(x, fastmath=True)
                s_mn[i, j] = p
                ps.append(p)
            row_sum[i] = row_sum[i] * corr[i] + _tree(ps, lambda a, b: a + b)
