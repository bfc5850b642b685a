"""Pieces of the lock-step tile loop that the SM100 kernels share (``decode.py``, ``prefill_int8.py``).

Both kernels run the same v0 pipeline: one CTA of 128 threads, thread t = TMEM lane t = row t; warp 0 issues the
TMA loads and the tcgen05 MMAs (one elected lane) and all 4 warps wait on the same mbarriers. Per KV tile: stage
landed -> QK MMA -> S in TMEM -> online softmax in registers (thread = row) -> P (16-bit) to TMEM, O rescaled in
TMEM -> P . V MMA (P read from TMEM). TMEM holds S (128 columns) | O (head_dim columns) | P (64 columns) from
column 0; what differs (the QK MMA and its operands, the loads, masks and scales) stays in the kernels.

Everything here is inlined into the kernel at trace time: plain functions, or ``@cute.jit`` where a runtime
branch needs the DSL's preprocessor. **Never ran on hardware** (see the kernels' docstrings).
"""

import math
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------------
# small PTX and arithmetic helpers
# ------------------------------------------------------------------------------------------------------
@dsl_user_op
def tcgen05_fence(kind: str, *, loc=None, ip=None) -> None:
    """``tcgen05.fence::before_thread_sync`` / ``::after_thread_sync``: order tcgen05 ops across a thread sync."""
    llvm.inline_asm(res=None, operands_=[], asm_string=f"tcgen05.fence::{kind};", constraints="~{memory}",
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ex2(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def lg2(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "lg2.approx.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def pack2(lo, hi, bf16: bool, *, loc=None, ip=None) -> Float32:
    """Two fp32 -> one 32-bit word of two f16 / bf16 (round to nearest even), ``lo`` in the low half; the word is
    returned in an fp32-typed register (TMEM stores move 32-bit words)."""
    t = "bf16x2" if bf16 else "f16x2"
    return Float32(llvm.inline_asm(T.f32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                                   "{\n\t.reg .b32 w;\n\tcvt.rn." + t + ".f32 w, $2, $1;\n\tmov.b32 $0, w;\n\t}",
                                   "=f,f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


def sel(cond, a, b, ty):
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def fmax(a, b):
    return cute.arch.fmax(Float32(a), Float32(b))


# ------------------------------------------------------------------------------------------------------
# trace-time layout checks
# ------------------------------------------------------------------------------------------------------
def check_order(tc, n):
    """Trace-time check: register i of a thread's TMEM row load holds column i (the P packing relies on it)."""
    for i in range(n):
        c = tc[i][1]
        if isinstance(c, int) and c != i:
            raise AssertionError(f"TMEM load order: register {i} holds column {c}")


def check_same_cells(a, b, what: str) -> None:
    """Trace-time check: register i of two TMEM copy partitions of one thread holds the same column (the O
    rescale loads with one partition and stores with another, element by element). The row is the thread's
    lane in both (a runtime value, thread = lane), so only the columns are compared; they must be static."""
    if cute.size(a) != cute.size(b):
        raise AssertionError(f"{what}: partitions of {cute.size(a)} and {cute.size(b)} values")
    for i in range(cute.size(a)):
        ca, cb = a[i][1], b[i][1]
        if not (isinstance(ca, int) and isinstance(cb, int)):
            raise AssertionError(f"{what}: register {i}'s column is not known at trace time")
        if ca != cb:
            raise AssertionError(f"{what}: register {i} holds column {ca} in one partition and {cb} in the other")


# ------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------
def make_pv_mma(v_dtype, rows: int, head_dim: int):
    """P (A, from TMEM, K-major) x V (B, MN-major: head_dim contiguous) -> fp32 O: tcgen05.mma kind::f16 "TS"."""
    return sm100_utils.make_trivial_tiled_mma(v_dtype, v_dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                              tcgen05.CtaGroup.ONE, (rows, head_dim), tcgen05.OperandSource.TMEM)


# ------------------------------------------------------------------------------------------------------
# set-up and teardown in the kernel
# ------------------------------------------------------------------------------------------------------
def lockstep_storage(stages: int):
    """The shared-memory header of the loop: the mbarriers (one per TMA stage, Q landed, S done, O done) and the
    slot where ``tcgen05.alloc`` writes the TMEM address. (``cute.struct`` needs evaluated annotations: this module
    has no ``from __future__ import annotations``.)"""

    @cute.struct
    class Storage:
        full: cute.struct.MemRange[cutlass.Int64, stages]  # TMA of a KV stage landed
        q_full: cutlass.Int64  # TMA of Q landed
        s_done: cutlass.Int64  # QK MMA finished (S in TMEM)
        o_done: cutlass.Int64  # PV MMA finished (O in TMEM, P and the V stage free)
        tmem_holder: cutlass.Int32

    return Storage


@cute.jit
def init_barriers(st, stages: cutlass.Constexpr, warp):
    """Initialise the header's mbarriers (one arrival each: the elected lane's expect_tx or tcgen05.commit) from
    one thread and fence the init for the other threads and the async proxy. Returns (full, q_full, s_done,
    o_done); ``full + s`` is stage s's."""
    full = st.full.data_ptr()
    q_full = st.q_full.ptr
    s_done = st.s_done.ptr
    o_done = st.o_done.ptr
    if warp == 0:
        with cute.arch.elect_one():
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(full + s, 1)
            cute.arch.mbarrier_init(q_full, 1)
            cute.arch.mbarrier_init(s_done, 1)
            cute.arch.mbarrier_init(o_done, 1)
    cute.arch.mbarrier_init_fence()
    return full, q_full, s_done, o_done


def allocate_tmem(st, cols: int, threads: int):
    """Warp 0 allocates ``cols`` TMEM columns; every thread waits for the address (named barrier 1). Returns the
    allocator (for :func:`free_tmem`) and the base address as an fp32 TMEM pointer."""
    tmem = cutlass.memory.TmemAllocator(st.tmem_holder.ptr, barrier_for_retrieve=cutlass.pipeline.NamedBarrier(
        barrier_id=1, num_threads=threads))
    tmem.allocate(cols)
    tmem.wait_for_alloc()
    return tmem, tmem.retrieve_ptr(Float32)


def tmem_s_o_p(tmem_ptr, qk_mma, pv_mma, thr_pv, p_tmem, qk_tiler, pv_tiler, s_dtype, v_dtype):
    """S (the QK accumulator, ``s_dtype``) at column 0, O (fp32) after the 128 S columns, P (128 x 16-bit as 64
    words) after O. Returns (tStS, tOtO, tOrP, p_col): S and O as the MMAs' C, P as the P.V MMA's TMEM A."""
    s_layout = qk_mma.make_fragment_C(qk_mma.partition_shape_C(qk_tiler[:2])).layout
    tStS = cute.make_tensor(cute.recast_ptr(tmem_ptr, dtype=s_dtype), s_layout)
    o_col = qk_tiler[1]
    tOtO = cute.make_tensor(tmem_ptr + o_col, pv_mma.make_fragment_C(pv_mma.partition_shape_C(pv_tiler[:2])).layout)
    p_col = o_col + pv_tiler[1]
    tP = cute.make_tensor(tmem_ptr + p_col, p_tmem.outer)
    tOrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + p_col, dtype=v_dtype),
                            thr_pv.make_fragment_A(tP)[None, None, None, 0].layout)
    return tStS, tOtO, tOrP, p_col


def free_tmem(tmem, tmem_ptr):
    """All tcgen05 work is done (fence + CTA barrier): give the TMEM columns and the allocation permit back."""
    tcgen05_fence("before_thread_sync")
    cute.arch.sync_threads()
    tmem.relinquish_alloc_permit()
    tmem.free(tmem_ptr)


# ------------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TmemRow:
    """TMEM <-> register copies of one row per thread (32x32b atoms, thread = lane): S (fp32 or s32 x 128), P
    (16-bit x 128 as 64 words, column j = keys 2j, 2j+1) and O (fp32 x head_dim). Frozen: the DSL then passes
    it through the kernel's runtime loop unchanged instead of trying to carry it as a loop value."""

    ld_s: Any
    tSt: Any
    tSc: Any
    st_p: Any
    tPt: Any
    tPc: Any
    ld_o: Any
    tOt: Any
    tOc: Any
    st_o: Any
    tOt_st: Any
    tOc_st: Any

    @staticmethod
    def make(tStS, tOtO, tmem_ptr, p_col, thr_qk, thr_pv, qk_tiler, pv_tiler, tidx):
        """The copies of thread ``tidx``; asserts at trace time the register orders that the P packing and the
        O rescale rely on."""
        rows, cols = qk_tiler[:2]
        ld_s = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)),
                                                          tStS.element_type), tStS)
        thr_ld_s = ld_s.get_slice(tidx)
        tSt = thr_ld_s.partition_S(tStS)
        tSc = thr_ld_s.partition_D(thr_qk.partition_C(cute.make_identity_tensor(qk_tiler[:2])))
        tStP = cute.make_tensor(tmem_ptr + p_col, cute.composition(tStS.layout, cute.make_layout((rows, cols // 2))))
        st_p = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(32)), Float32), tStP)
        tPt = st_p.get_slice(tidx).partition_D(tStP)
        tPc = st_p.get_slice(tidx).partition_S(cute.make_identity_tensor((rows, cols // 2)))
        ld_o = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32), tOtO)
        thr_ld_o = ld_o.get_slice(tidx)
        tOt = thr_ld_o.partition_S(tOtO)
        tOc = thr_ld_o.partition_D(thr_pv.partition_C(cute.make_identity_tensor(pv_tiler[:2])))
        st_o = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(32)), Float32), tOtO)
        tOt_st = st_o.get_slice(tidx).partition_D(tOtO)
        tOc_st = st_o.get_slice(tidx).partition_S(thr_pv.partition_C(cute.make_identity_tensor(pv_tiler[:2])))
        check_order(tSc, cols)  # register i of the S row = key column i
        check_order(tPc, cols // 2)  # P word j goes to TMEM column j
        check_same_cells(tOc, tOc_st, "O rescale")  # O load and store enumerate the same cells in the same order
        return TmemRow(ld_s, tSt, tSc, st_p, tPt, tPc, ld_o, tOt, tOc, st_o, tOt_st, tOc_st)

    def load_s(self, dtype):
        """This thread's row of S in registers (``dtype``: the accumulator's)."""
        rS = cute.make_rmem_tensor(self.tSc.shape, dtype)
        cute.copy(self.ld_s, self.tSt, rS)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.ld is asynchronous: rS is defined after wait::ld
        return rS

    def pack_p(self, rS, bf16: bool):
        """P (fp32 in ``rS``) rounded to V's type, two per 32-bit word = TMEM column (column j = keys 2j, 2j+1)."""
        rPw = cute.make_rmem_tensor(self.tPc.shape, Float32)
        for j in range(cute.size(rPw)):
            rPw[j] = pack2(rS[2 * j], rS[2 * j + 1], bf16)
        return rPw

    def store_p(self, rPw):
        """The packed P words into TMEM (made visible to the MMA by :func:`tmem_stores_to_mma`)."""
        cute.copy(self.st_p, rPw, self.tPt)

    def rescale_o(self, corr):
        """O *= corr in TMEM, one 32-column chunk at a time (load, wait, multiply, store); the previous P.V must
        have finished. Chunks keep 32 O values live instead of head_dim: a whole D128 row at once made ptxas
        spill ~340 bytes (255 registers) in the loop."""
        for k in range(cute.size(self.tOt, mode=[1])):
            rO = cute.make_rmem_tensor(self.tOc[(None, k, None, None)].shape, Float32)
            cute.copy(self.ld_o, self.tOt[(None, k, None, None)], rO)
            cute.arch.fence_view_async_tmem_load()
            for i in range(cute.size(rO)):
                rO[i] = rO[i] * corr
            cute.copy(self.st_o, rO, self.tOt_st[(None, k, None, None)])

    @cute.jit
    def load_o(self, n_tiles):
        """This thread's row of O for the epilogue; zeros when the CTA had no tile (no MMA ever wrote O)."""
        rO = cute.make_rmem_tensor(self.tOc.shape, Float32)
        if n_tiles > 0:
            cute.copy(self.ld_o, self.tOt, rO)
            cute.arch.fence_view_async_tmem_load()
        else:
            for i in cutlass.range_constexpr(cute.size(rO)):
                rO[i] = Float32(0.0)
        return rO


def wait_mma(bar, phase):
    """Wait for a ``tcgen05.commit`` on ``bar``; the fence orders the thread's later tcgen05 ops after it."""
    cute.arch.mbarrier_wait(bar, phase)
    tcgen05_fence("after_thread_sync")


def softmax_exp2(rS, mx, m_run):
    """Online softmax step of one row: ``rS`` holds the tile's masked log2-domain scores, ``mx`` their max.
    rS <- p = exp2(rS - m) with m the new running max (0 while it is -inf: no inf - inf). Returns (m_run, corr,
    psum): corr = exp2(m_old - m) rescales l and O, psum is the sum of the unrounded fp32 p. The caller updates
    l = l * corr + psum itself: each kernel keeps it where it was (moving it moves one fma in the PTX)."""
    m_new = fmax(m_run, mx)
    m_use = sel(m_new == Float32(-math.inf), Float32(0.0), m_new, Float32)
    corr = ex2(m_run - m_use)
    psum = Float32(0.0)
    for i in range(cute.size(rS)):
        p = ex2(rS[i] - m_use)
        psum = psum + p
        rS[i] = p
    return m_new, corr, psum


def tmem_stores_to_mma():
    """Make every thread's tcgen05.st (P, rescaled O) complete and visible to the MMA that warp 0 issues next:
    wait::st, then a CTA barrier between the tcgen05 fences."""
    cute.arch.fence_view_async_tmem_store()
    tcgen05_fence("before_thread_sync")
    cute.arch.sync_threads()
    tcgen05_fence("after_thread_sync")


def issue_pv_mma(pv_mma, tOtO, tOrP, tCrV, stage, it, o_done):
    """(Warp 0) O (+)= P . V of tile ``it`` over V stage ``stage`` (128 keys, 16 per MMA; the first tile overwrites
    O), committed to ``o_done``. Returns ``pv_mma``: the kernel assigns it back, so that the DSL carries the MMA's
    runtime fields through the warp-0 branch and the loop as it does for an inline ``pv_mma.set`` (the same
    PTX)."""
    for kb in range(cute.size(tOrP, mode=[2])):
        pv_mma.set(tcgen05.Field.ACCUMULATE, kb > 0 or it > 0)
        cute.gemm(pv_mma, tOtO, tOrP[(None, None, kb)], tCrV[(None, None, kb, stage)], tOtO)
    with cute.arch.elect_one():
        tcgen05.commit(o_done)
    return pv_mma


def row_epilogue(m_run, l_run, o_scale, lse_shift=None):
    """Per-row factor for O (o_scale / l, 0 for a row that saw no key) and the LSE in natural log (-inf then);
    ``lse_shift`` (log2 units) is added to the log2 LSE first (the prefill's K smoothing mean put back)."""
    has = l_run > Float32(0.0)
    inv = sel(has, o_scale / l_run, Float32(0.0), Float32)
    lse2 = m_run + lg2(l_run)
    if lse_shift is not None:
        lse2 = lse2 + lse_shift
    lse = sel(has, lse2 * Float32(LN2), Float32(-math.inf), Float32)
    return inv, lse


def store_row(o_addr, lse_addr, dtype, rO, tOc, inv, lse, batch, seqlen_q, heads, head_dim, b, i, h):
    """Row (batch b, query i, head h) of the output: O = rO * inv in ``dtype`` into (B, Sq, H, D) (column
    ``tOc[k][1]`` from register k) and the LSE into (B, H, Sq) fp32, both contiguous."""
    gmem = cute.AddressSpace.gmem
    mOut = cute.make_tensor(cute.make_ptr(dtype, o_addr, gmem, assumed_align=2),
                            cute.make_layout(batch * seqlen_q * heads * head_dim))
    base = ((b * seqlen_q + i) * heads + h) * head_dim
    for k in range(cute.size(rO)):
        mOut[base + tOc[k][1]] = (rO[k] * inv).to(dtype)
    mL = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4),
                          cute.make_layout(batch * heads * seqlen_q))
    mL[(b * heads + h) * seqlen_q + i] = lse
