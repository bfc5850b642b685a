"""INT8 quantization of Q or K for the SageAttention-style prefill (CuTe-DSL): one amax scale per group of rows.

The kernel quantizes one tensor ``x`` (batch, seqlen, heads, head_dim) bf16/fp16 -- or, varlen, (total, heads,
head_dim) with ``cu_seqlens`` -- to int8 in the contiguous (B, S, H, D) layout, with one fp32 scale per
*group* of ``group_rows`` consecutive rows of one (sequence, head) over all head_dim columns. The launcher
(:mod:`qattn.quant.launch`) maps the public granularities onto groups: Q per-warp groups are ``warp_q`` rows,
Q per-block groups ``block_q`` rows, K groups ``block_k`` rows. With ``subtract_mean`` (K smoothing) the kernel
first finishes the per-(sequence, head, channel) mean from the fp64 sums of :mod:`qk_int8_kmean` (the launcher
passes one total per column, added up by :mod:`chunk_reduce`; several partial sums are added in chunk
order; one RN fp64 division by the length, one RN conversion to fp32), writes it out, and quantizes
``x - mean`` (one RN fp32 subtraction).

One launch for short K (``cluster``, ``groups_per_cta``; K with smoothing, no balance, at most
``CLUSTER_MAX_GROUPS_PER_CTA`` groups per CTA, ``qattn.quant.launch.k_cluster_plan``): the ``cluster`` CTAs of
one cluster hold all rows of one (sequence, head) in registers; each adds up its rows in fp64 (exact, like
:mod:`qk_int8_kmean`), and after a cluster barrier every CTA adds the CTAs' sums in rank order through
distributed shared memory and quantizes as above: K read once, no mean kernel, the same mean and bytes.

Channel balancing (``balance``, ``qattn.quant.qk_int8`` explains it): ``"k"`` -- the K kernel also derives the
power-of-two ``lam = 2^e`` of every channel of its kv head from the K range totals and the Q amax totals of the
head's q heads (:mod:`qk_int8_kmean` + :mod:`chunk_reduce`), writes ``lam`` out and quantizes
``(x - mean) * 2^-e``; ``"q"`` -- the Q kernel reads ``lam`` and quantizes ``x * 2^e``. Both products are exact.

Numerics, exactly those of ``qattn.quant.qk_int8.quantize_qk_int8_reference``: ``amax = max |x|`` over the
group's existing rows (0 for a group with no rows), ``s = amax / 127`` (``div.rn.f32``), ``inv = 1 / s``
(``div.rn.f32``, only when ``s`` is a normal fp32, else 0), ``q = clamp(cvt.rni(x * inv), -127, 127)``; the
products and the subtraction are explicit ``mul.rn`` / ``sub.rn`` so nothing is contracted into an fma.

Work split: a CTA quantizes ``tile_rows`` = ``groups_per_cta * group_rows`` rows (about 128) of one (sequence,
head): grid ``(ceil(num_groups / groups_per_cta), heads, batch)``. A thread owns 8 consecutive columns of a
row (one 16-byte load, one 8-byte int8 store), ``threads_per_row = head_dim / 8`` consecutive threads share a
row, so every load instruction of a warp reads whole 32-byte sectors (so does every store), and ``passes``
rounds cover the tile; the whole tile stays in registers (about 64 words per thread), so ``x`` is read
exactly once. (16 columns per thread would allow 16-byte int8 stores, but then each load instruction would
read half of every sector it touches; the loads are two thirds of the traffic.) A row's amax is reduced over its threads with butterfly shuffles, then folded into its group's
slot in shared memory with an integer atomic max (amax >= 0, so the fp32 bit patterns order like the values).

Addresses are 64-bit byte addresses; input strides (in elements) are runtime values, so non-contiguous
batch / seqlen / head strides need no copy as long as they (and the base) keep 16-byte alignment (the launcher
checks, and copies otherwise).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.kv_insert import bf16x2_to_f32x2, f32x4_to_s8x4, mul_rn, sub_rn
from qattn.interface.variants import Variant, cache_for, register

__all__ = ["QKInt8Quant", "CLUSTER_MAX_GROUPS_PER_CTA", "CLUSTER_SIZE", "CLUSTER_TILE_VALUES", "balance_log2",
           "bits_f32", "cluster_groups_per_cta", "f32_bits", "make_quant_compile_args", "quant_placeholder_args",
           "compiled_quant", "div_rn", "div_rn_f64", "f64_to_f32_rn"]

KIND = "qk_int8_quant"

INT8_MAX = 127.0
FP32_MIN_NORMAL = 2.0**-126
BALANCE_MAX_LOG2 = 32  # = qattn.quant.qk_int8.BALANCE_MAX_LOG2
BALANCES = (None, "k", "q")
_MAX_THREADS = 1024
_TARGET_TILE_ROWS = 128  # rows per CTA: 128 x 16-bit x head_dim 128 = 32 KB in flight per CTA
CLUSTER_TILE_VALUES = 512 * 128  # cluster CTAs: at most 512 threads x 128 values, the tile in registers
CLUSTER_SIZE = 8  # CTAs per cluster (one (sequence, head) each) of the one-launch K quantization: the portable max
CLUSTER_MAX_GROUPS_PER_CTA = 2  # beyond, the two-kernel path is faster (qattn.quant.launch.k_cluster_plan)


def _asm(result_type, operands, text: str, constraints: str):
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    """Correctly rounded fp32 ``a / b`` (spelled out: a fast-math lowering would give div.approx / div.full)."""
    ops = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(_asm(T.f32(), ops, "div.rn.f32 $0, $1, $2;", "=f,f,f"))


@dsl_user_op
def div_rn_f64(a, b, *, loc=None, ip=None) -> Float64:
    """Correctly rounded fp64 ``a / b``."""
    ops = [Float64(a).ir_value(loc=loc, ip=ip), Float64(b).ir_value(loc=loc, ip=ip)]
    return Float64(_asm(T.f64(), ops, "div.rn.f64 $0, $1, $2;", "=d,d,d"))


@dsl_user_op
def f64_to_f32_rn(a, *, loc=None, ip=None) -> Float32:
    """fp64 -> fp32, round to nearest even."""
    return Float32(_asm(T.f32(), [Float64(a).ir_value(loc=loc, ip=ip)], "cvt.rn.f32.f64 $0, $1;", "=f,d"))


def _ptx_word_absmax(in_bf16: bool, subtract_mean: bool, scaled: bool = False) -> str:
    """$0 <- max(|lo - $2|, |hi - $3|) of the two 16-bit values packed in $1 (exact widening, RN subtraction;
    ``scaled``: times $4, $5 after the subtraction).

    The amax pass uses this instead of the quantize pass's widening helpers on purpose: a different asm body
    cannot be merged with them, so the compiler keeps the packed words (not 2x as many fp32 values) alive
    between the two passes, which halves the registers that hold the tile."""
    if in_bf16:
        widen = "shl.b32 lo, $1, 16;\n\tand.b32 hi, $1, 0xFFFF0000;\n\t"
    else:
        widen = "mov.b32 {h0, h1}, $1;\n\tcvt.f32.f16 lo, h0;\n\tcvt.f32.f16 hi, h1;\n\t"
    sub = "sub.rn.f32 lo, lo, $2;\n\tsub.rn.f32 hi, hi, $3;\n\t" if subtract_mean else ""
    if scaled:
        sub += "mul.rn.f32 lo, lo, $4;\n\tmul.rn.f32 hi, hi, $5;\n\t"
    return ("{\n\t.reg .f32 lo, hi;\n\t.reg .b16 h0, h1;\n\t" + widen + sub
            + "abs.f32 lo, lo;\n\tabs.f32 hi, hi;\n\tmax.f32 $0, lo, hi;\n\t}")


@dsl_user_op
def word_absmax(word, m0, m1, in_bf16: bool, subtract_mean: bool, l0=None, l1=None, *, loc=None, ip=None) -> Float32:
    ops = [Uint32(word).ir_value(loc=loc, ip=ip), Float32(m0).ir_value(loc=loc, ip=ip),
           Float32(m1).ir_value(loc=loc, ip=ip)]
    scaled = l0 is not None
    if scaled:
        ops += [Float32(l0).ir_value(loc=loc, ip=ip), Float32(l1).ir_value(loc=loc, ip=ip)]
    return Float32(_asm(T.f32(), ops, _ptx_word_absmax(in_bf16, subtract_mean, scaled),
                        "=f,r,f,f,f,f" if scaled else "=f,r,f,f"))


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f"))


@dsl_user_op
def bits_f32(x, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r"))


@cute.jit
def balance_log2(amax_q: Float32, amax_k: Float32) -> Int32:
    """e of the channel balance ``lam = 2^e`` (``qattn.quant.qk_int8.qk_balance_reference``, bit for bit)."""
    bq = f32_bits(amax_q)
    bk = f32_bits(amax_k)
    d = ((bk >> 23) - (bq >> 23)) - cutlass.select_((bk & 0x7FFFFF) < (bq & 0x7FFFFF), Int32(1), Int32(0))
    e = cutlass.min(cutlass.max((d + 1) >> 1, Int32(-BALANCE_MAX_LOG2)), Int32(BALANCE_MAX_LOG2))
    if amax_q < Float32(FP32_MIN_NORMAL):  # also -inf: no rows
        e = Int32(0)
    if amax_k < Float32(FP32_MIN_NORMAL):
        e = Int32(0)
    return e


@dsl_user_op
def _ld_cluster_f64(smem_addr, rank, *, loc=None, ip=None) -> Float64:
    """The fp64 at shared address ``smem_addr`` of CTA ``rank`` of this cluster."""
    ops = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)]
    return Float64(_asm(T.f64(), ops, "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $1, $2;\n\t"
                                      "ld.shared::cluster.f64 $0, [a];\n\t}", "=d,r,r"))


@dsl_user_op
def _add_word_f64(acc_lo, acc_hi, word, in_bf16: bool, *, loc=None, ip=None) -> tuple:
    """(acc_lo + lo, acc_hi + hi) in fp64, lo / hi the 16-bit values packed in ``word`` (exact widening). An asm
    body of its own, like ``word_absmax``: the compiler keeps the packed words, not their fp32 widening, alive
    for the quantize pass."""
    if in_bf16:
        widen = "shl.b32 l, $4, 16;\n\tand.b32 h, $4, 0xFFFF0000;\n\tcvt.f64.f32 dl, l;\n\tcvt.f64.f32 dh, h;\n\t"
    else:
        widen = "mov.b32 {x, y}, $4;\n\tcvt.f64.f16 dl, x;\n\tcvt.f64.f16 dh, y;\n\t"
    text = ("{\n\t.reg .b32 l, h;\n\t.reg .b16 x, y;\n\t.reg .f64 dl, dh;\n\t" + widen
            + "add.rn.f64 $0, $2, dl;\n\tadd.rn.f64 $1, $3, dh;\n\t}")
    ops = [Float64(acc_lo).ir_value(loc=loc, ip=ip), Float64(acc_hi).ir_value(loc=loc, ip=ip),
           Uint32(word).ir_value(loc=loc, ip=ip)]
    res = _asm(llvm.StructType.get_literal([T.f64(), T.f64()]), ops, text, "=d,=d,d,d,r")
    return (Float64(llvm.extractvalue(T.f64(), res, [0], loc=loc, ip=ip)),
            Float64(llvm.extractvalue(T.f64(), res, [1], loc=loc, ip=ip)))


def cluster_groups_per_cta(head_dim: int, group_rows: int, num_groups: int) -> int | None:
    """Groups per CTA of the one-launch (cluster) K quantization for ``num_groups`` groups per (sequence, head):
    the smallest power of two with ``CLUSTER_SIZE`` CTAs covering them, or None when that exceeds
    ``CLUSTER_MAX_GROUPS_PER_CTA`` or a CTA's ``CLUSTER_TILE_VALUES`` (the two-kernel path then)."""
    gpc = 1
    while CLUSTER_SIZE * gpc < num_groups:
        gpc *= 2
    if gpc > CLUSTER_MAX_GROUPS_PER_CTA or gpc * group_rows * head_dim > CLUSTER_TILE_VALUES:
        return None
    return gpc


def _gptr(dtype, addr, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


class QKInt8Quant:
    """Group-scaled int8 quantization of one (B, S, H, D) or varlen (total, H, D) bf16/fp16 tensor.

    ``QKInt8Quant(head_dim=128, group_rows=16, in_bf16=True, subtract_mean=False, varlen=False)``; everything
    structural is compile-time (the compile-cache key is :attr:`key`), sizes and strides are runtime values.
    """

    def __init__(self, head_dim: int, group_rows: int, in_bf16: bool = True, subtract_mean: bool = False,
                 varlen: bool = False, balance=None, cluster: int = 0, groups_per_cta: int | None = None):
        if balance not in BALANCES:
            raise ValueError(f"balance: expected one of {BALANCES}, got {balance!r}")
        if balance == "q" and subtract_mean:
            raise ValueError("balance: 'q' quantizes Q, which is never mean-subtracted")
        self.balance = balance
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim: the INT8 Q/K quantizer supports 64, 128 and 256, got {head_dim}")
        if not isinstance(group_rows, int) or group_rows <= 0:
            raise ValueError(f"group_rows: expected a positive int, got {group_rows!r}")
        self.head_dim = head_dim
        self.group_rows = group_rows
        self.in_bf16 = bool(in_bf16)
        self.subtract_mean = bool(subtract_mean)
        self.varlen = bool(varlen)
        # cluster (K smoothing, no balance): the ``cluster`` CTAs of one (sequence, head) hold all its rows
        # and add up the K mean themselves (through distributed shared memory), so K is read once, in one launch
        self.cluster = cluster
        if cluster:
            if cluster not in (2, 4, 8) or not subtract_mean or balance is not None:
                raise ValueError("cluster: 2, 4 or 8 CTAs, for the K quantization with mean subtraction and no "
                                 f"balance, got cluster={cluster}")
            if not groups_per_cta or groups_per_cta * group_rows * head_dim > CLUSTER_TILE_VALUES:
                raise ValueError(f"groups_per_cta: a cluster CTA holds at most {CLUSTER_TILE_VALUES} values, "
                                 f"got {groups_per_cta} groups of {group_rows} rows x {head_dim}")
        elif groups_per_cta is not None:
            raise ValueError("groups_per_cta: only set with cluster")
        self.groups_per_cta = groups_per_cta or max(1, _TARGET_TILE_ROWS // group_rows)
        self.tile_rows = self.groups_per_cta * group_rows
        self.threads_per_row = head_dim // 8  # 8 values (one 16-byte load, one 8-byte store) per thread
        # about 128 values per thread, at least one thread per mean column, whole warps
        want = max(128, head_dim, -(-self.tile_rows * head_dim // 128))
        self.threads = -(-want // 32) * 32
        if self.threads > _MAX_THREADS:
            raise ValueError(f"group_rows: {group_rows} rows x head_dim {head_dim} is too large a group for one "
                             f"CTA (at most {_MAX_THREADS * 128 // head_dim} rows at this head_dim)")
        self.rows_per_pass = self.threads // self.threads_per_row
        self.passes = -(-self.tile_rows // self.rows_per_pass)

    @property
    def key(self) -> tuple:
        key = ("bf16" if self.in_bf16 else "fp16", self.head_dim, self.group_rows, self.subtract_mean, self.varlen)
        if self.cluster:
            key += ("cluster", self.cluster, self.groups_per_cta)
        return key if self.balance is None else key + ("balance_" + self.balance,)

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        x_addr: Int64,  # bf16/fp16 input, 16-byte aligned; element strides below
        out_addr: Int64,  # int8 (B, S, H, D) contiguous, or (total, H, D) varlen
        scale_addr: Int64,  # fp32 (B, H, num_groups)
        partial_addr: Int64,  # fp64 (B, H, num_chunks, D) K partial sums (subtract_mean only)
        mean_addr: Int64,  # fp32 (B, H, D) mean out (subtract_mean only)
        cu_seqlens_addr: Int64,  # int32 (B + 1,) (varlen only)
        k_range_addr: Int64,  # balance "k": fp32 (B, H, 2, D) column max, negated column min of K
        q_amax_addr: Int64,  # balance "k": fp32 (B, H * q_per_kv, D) column amax of Q
        balance_addr: Int64,  # fp32 (B, H_kv, D) lam: written by balance "k", read by balance "q"
        batch: Int32,
        seqlen: Int32,  # dense: S; varlen: unused (lengths come from cu_seqlens)
        num_heads: Int32,
        num_groups: Int32,  # scale groups per (sequence, head), padding groups included
        num_chunks: Int32,  # partial sums per (sequence, head) (subtract_mean only)
        q_per_kv: Int32,  # q heads per kv head (balance only)
        stride_b: Int64,  # input strides in elements; stride_b unused in varlen
        stride_s: Int64,
        stride_h: Int64,
        pdl: Int32,  # 0 / 1: a programmatic dependent of the prepass kernel before it (not with ``cluster``)
        stream: cuda.CUstream,
    ):
        """``pdl``: the kernel before this one on the stream made its ``partial`` / totals / ``k_range`` /
        ``q_amax`` / ``balance`` inputs (the mean, chunk-total or K quantize kernel of the same prepass): this grid
        is scheduled while that one ends, loads its tile of x and waits (``griddepcontrol.wait``) before reading
        any of them. Its own outputs are written after the wait."""
        grid_x = (num_groups + self.groups_per_cta - 1) // self.groups_per_cta
        launcher = self.kernel(x_addr, out_addr, scale_addr, partial_addr, mean_addr, cu_seqlens_addr, k_range_addr,
                               q_amax_addr, balance_addr, batch, seqlen, num_heads, num_groups, num_chunks, q_per_kv,
                               stride_b, stride_s, stride_h)
        if cutlass.const_expr(self.cluster > 0):  # one cluster per (sequence, head): the launcher sizes the tiles
            launcher.launch(grid=(self.cluster, num_heads, batch), block=(self.threads, 1, 1),
                            cluster=[self.cluster, 1, 1], stream=stream)
        else:
            launcher.launch(grid=(grid_x, num_heads, batch), block=(self.threads, 1, 1), stream=stream,
                            use_pdl=pdl)

    @cute.kernel
    def kernel(self, x_addr: Int64, out_addr: Int64, scale_addr: Int64, partial_addr: Int64, mean_addr: Int64,
               cu_seqlens_addr: Int64, k_range_addr: Int64, q_amax_addr: Int64, balance_addr: Int64, batch: Int32,
               seqlen: Int32, num_heads: Int32, num_groups: Int32, num_chunks: Int32, q_per_kv: Int32,
               stride_b: Int64, stride_s: Int64, stride_h: Int64):
        D, G, TPR, RPP = self.head_dim, self.group_rows, self.threads_per_row, self.rows_per_pass
        # The attention kernel after this one (``flash_attn_func``, launched with ``pdl``) may be scheduled once
        # every CTA of this grid has started: it loads and quantizes Q meanwhile and waits for this grid's end
        # (griddepcontrol.wait) before it reads any of its outputs. No effect on any other next kernel.
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, b = cute.arch.block_idx()
        if cutlass.const_expr(self.subtract_mean and not self.cluster):
            # K is read a second time here (the mean kernel read it first, in grid order): walking the grid
            # backwards starts on the rows the mean kernel read last, which are likely still in L2.
            n_tiles, n_heads, n_batch = cute.arch.grid_dim()
            tile = n_tiles - 1 - tile
            head = n_heads - 1 - head
            b = n_batch - 1 - b
        part = tidx % TPR  # this thread's 8 columns: [8 * part, 8 * part + 8)
        rip = tidx // TPR  # row within a pass

        # ---- where the rows of this (sequence, head) live ------------------------------------------------
        seq_start = Int32(0)
        length = seqlen
        if cutlass.const_expr(self.varlen):
            mCu = cute.make_tensor(_gptr(Int32, cu_seqlens_addr, 4), cute.make_layout(batch + 1))
            seq_start = mCu[b]
            length = mCu[b + 1] - seq_start
            in_row_base = x_addr + Int64(seq_start) * stride_s * Int64(2)
            out_row0 = Int64(seq_start)
        else:
            in_row_base = x_addr + Int64(b) * stride_b * Int64(2)
            out_row0 = Int64(b) * Int64(seqlen)
        in_base = in_row_base + Int64(head) * stride_h * Int64(2) + Int64(part * 16)
        row0 = tile * self.tile_rows  # first row of this tile within the sequence

        # ---- all loads first: the whole tile in registers (one read of x) --------------------------------
        vec128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        rX = cute.make_rmem_tensor((4, self.passes), Uint32)
        rX.fill(Uint32(0))
        for p in cutlass.range_constexpr(self.passes):
            r = p * RPP + rip
            row = row0 + r
            if r < self.tile_rows:
                if row < length:
                    src = in_base + Int64(row) * stride_s * Int64(2)
                    cute.copy(vec128, cute.make_tensor(_gptr(Uint32, src, 16), cute.make_layout(4)), rX[None, p])
        # ``pdl``: what the previous kernels of the prepass wrote is read (and anything written) only from here on;
        # x itself is the caller's (a no-op in a plain launch)
        cute.arch.griddepcontrol_wait()

        # ---- shared state: per-group amax / inverse scale, the K mean --------------------------------------
        smem = cutlass.memory.SmemAllocator()
        sAmax = smem.allocate_tensor(Float32, cute.make_layout(self.groups_per_cta), byte_alignment=16)
        sInv = smem.allocate_tensor(Float32, cute.make_layout(self.groups_per_cta), byte_alignment=16)
        sMean = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
        sLam = None  # balance: the factor x is scaled by
        if cutlass.const_expr(self.balance is not None):
            sLam = smem.allocate_tensor(Float32, cute.make_layout(D), byte_alignment=16)
        if tidx < self.groups_per_cta:
            sAmax[tidx] = Float32(0.0)
        bh = Int64(b) * Int64(num_heads) + Int64(head)
        if cutlass.const_expr(self.cluster > 0):
            sRows = smem.allocate_tensor(Float64, cute.make_layout((D, RPP), stride=(1, D)), byte_alignment=16)
            sCta = smem.allocate_tensor(Float64, cute.make_layout(D), byte_alignment=16)
            self._cluster_mean(rX, sRows, sCta, sMean, tidx, tile, part, rip, length, mean_addr + bh * Int64(D * 4))
        elif cutlass.const_expr(self.subtract_mean):
            if tidx < D:
                # fixed order over the chunks: every CTA of this (sequence, head) gets the same mean
                mPart = cute.make_tensor(_gptr(Float64, partial_addr + bh * Int64(num_chunks * D * 8), 8),
                                         cute.make_layout((D, num_chunks), stride=(1, D)))
                acc = Float64(0.0)
                for c in cutlass.range(num_chunks, unroll=8):
                    acc = acc + mPart[tidx, c]
                n = Int32(cutlass.select_(length > 0, length, Int32(1)))  # an empty sequence: 0 / 1
                mean = f64_to_f32_rn(div_rn_f64(acc, Float64(n)))
                sMean[tidx] = mean
                if tile == 0:
                    mMean = cute.make_tensor(_gptr(Float32, mean_addr + bh * Int64(D * 4), 4), cute.make_layout(D))
                    mMean[tidx] = mean
        if cutlass.const_expr(self.balance == "k"):
            if tidx < D:
                mRange = cute.make_tensor(_gptr(Float32, k_range_addr + bh * Int64(2 * D * 4), 4),
                                          cute.make_layout((D, 2), stride=(1, D)))
                hi, neg_lo = mRange[tidx, 0], mRange[tidx, 1]
                amax_k = cute.arch.fmax(hi, neg_lo)
                if cutlass.const_expr(self.subtract_mean):  # max |x - mean| (RN subtraction is monotonic)
                    m = sMean[tidx]
                    amax_k = cute.arch.fmax(sub_rn(hi, m), sub_rn(m, -neg_lo))
                mQ = cute.make_tensor(_gptr(Float32, q_amax_addr, 4), cute.make_layout(1 << 30))
                q_row = (Int64(b) * Int64(num_heads) + Int64(head)) * Int64(q_per_kv)
                amax_q = Float32(0.0)
                for g in cutlass.range(q_per_kv, unroll=1):
                    amax_q = cute.arch.fmax(amax_q, mQ[(q_row + Int64(g)) * Int64(D) + Int64(tidx)])
                e = balance_log2(amax_q, amax_k)
                sLam[tidx] = bits_f32((Int32(127) - e) << 23)  # 2^-e
                if tile == 0:
                    mLam = cute.make_tensor(_gptr(Float32, balance_addr + bh * Int64(D * 4), 4), cute.make_layout(D))
                    mLam[tidx] = bits_f32((Int32(127) + e) << 23)
        if cutlass.const_expr(self.balance == "q"):
            if tidx < D:
                bh_kv = Int64(b) * Int64(num_heads // q_per_kv) + Int64(head // q_per_kv)
                mLam = cute.make_tensor(_gptr(Float32, balance_addr + bh_kv * Int64(D * 4), 4), cute.make_layout(D))
                sLam[tidx] = mLam[tidx]
        cute.arch.sync_threads()

        # ---- this thread's 8 columns' means --------------------------------------------------------------
        rMean = cute.make_rmem_tensor((8,), Float32)
        if cutlass.const_expr(self.subtract_mean):
            for i in cutlass.range_constexpr(8):
                rMean[i] = sMean[part * 8 + i]
        rLam = cute.make_rmem_tensor((8,), Float32)
        if cutlass.const_expr(self.balance is not None):
            for i in cutlass.range_constexpr(8):
                rLam[i] = sLam[part * 8 + i]

        # ---- group amax: per row over its TPR threads, then an atomic max into the group's slot -----------
        for p in cutlass.range_constexpr(self.passes):
            a = Float32(0.0)
            for w in cutlass.range_constexpr(4):
                m0, m1 = Float32(0.0), Float32(0.0)
                if cutlass.const_expr(self.subtract_mean):
                    m0, m1 = rMean[2 * w], rMean[2 * w + 1]
                l0, l1 = None, None
                if cutlass.const_expr(self.balance is not None):
                    l0, l1 = rLam[2 * w], rLam[2 * w + 1]
                a = cute.arch.fmax(a, word_absmax(rX[w, p], m0, m1, self.in_bf16, self.subtract_mean, l0, l1))
            a = cute.arch.warp_reduction(a, cute.arch.fmax, threads_in_group=TPR)
            r = p * RPP + rip
            if part == 0:
                if r < self.tile_rows:
                    if row0 + r < length:  # padding rows are not part of any group (x - mean != 0 there)
                        cute.arch.atomic_fmax(sAmax.iterator + r // G, a, sign_bit=False, scope="cta")
        cute.arch.sync_threads()

        # ---- scales: s = amax / 127, inv = 1 / s for normal s -----------------------------------------------
        if tidx < self.groups_per_cta:
            s = div_rn(sAmax[tidx], Float32(INT8_MAX))
            inv = Float32(0.0)
            if s >= Float32(FP32_MIN_NORMAL):
                inv = fp4.rcp_rn(s)
            sInv[tidx] = inv
            g = tile * self.groups_per_cta + tidx
            if g < num_groups:
                mS = cute.make_tensor(_gptr(Float32, scale_addr + bh * Int64(num_groups * 4), 4),
                                      cute.make_layout(num_groups))
                mS[g] = s
        cute.arch.sync_threads()

        # ---- quantize from registers, 8-byte int8 stores -----------------------------------------------
        vec64 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=64)
        out_base = out_addr + Int64(head * D + part * 8)
        row_bytes = Int64(num_heads * D)
        for p in cutlass.range_constexpr(self.passes):
            r = p * RPP + rip
            row = row0 + r
            if r < self.tile_rows:
                if row < length:
                    inv = sInv[r // G]
                    vals = self._values(rX, rMean, rLam, p)
                    rQ = cute.make_rmem_tensor((2,), Uint32)
                    for w in cutlass.range_constexpr(2):
                        rQ[w] = f32x4_to_s8x4(mul_rn(vals[4 * w], inv), mul_rn(vals[4 * w + 1], inv),
                                              mul_rn(vals[4 * w + 2], inv), mul_rn(vals[4 * w + 3], inv))
                    dst = out_base + (out_row0 + Int64(row)) * row_bytes
                    cute.copy(vec64, rQ, cute.make_tensor(_gptr(Uint32, dst, 8), cute.make_layout(2)))
        if cutlass.const_expr(self.cluster > 0):
            cute.arch.cluster_wait()  # the other CTAs have read this one's sums: its shared memory may go

    @cute.jit
    def _cluster_mean(self, rX: cute.Tensor, sRows: cute.Tensor, sCta: cute.Tensor, sMean: cute.Tensor, tidx, rank,
                      part, rip, length, mean_addr: Int64):
        """``cluster``: the mean of every column over all rows of this (sequence, head) into ``sMean``, and (CTA 0)
        into gmem. fp64 sums, exact for bf16 / fp16 inputs (see ``qk_int8_kmean``), so the order of the adds does
        not matter and the mean equals the two-kernel path's: per thread over its rows, per CTA in shared memory
        (fixed order), then every CTA adds the cluster's CTA sums in rank order through distributed shared
        memory (``sRows``: (D, rows_per_pass) per-thread sums, ``sCta``: (D,) this CTA's). Leaves one cluster
        barrier phase open (its wait closes the kernel)."""
        D, RPP = self.head_dim, self.rows_per_pass
        acc = [Float64(0.0)] * 8
        for p in cutlass.range_constexpr(self.passes):  # rows past the sequence were loaded as zeros
            for w in cutlass.range_constexpr(4):
                acc[2 * w], acc[2 * w + 1] = _add_word_f64(acc[2 * w], acc[2 * w + 1], rX[w, p], self.in_bf16)
        for i in cutlass.range_constexpr(8):
            sRows[part * 8 + i, rip] = acc[i]
        cute.arch.sync_threads()
        if tidx < D:
            t = Float64(0.0)
            for r in cutlass.range_constexpr(RPP):
                t = t + sRows[tidx, r]
            sCta[tidx] = t
        cute.arch.cluster_arrive()  # release: this CTA's sums are written
        cute.arch.cluster_wait()  # acquire: so are everyone's
        if tidx < D:
            total = Float64(0.0)
            addr = sCta.iterator.toint() + tidx * 8
            for r in cutlass.range_constexpr(self.cluster):
                total = total + _ld_cluster_f64(addr, r)
            n = Int32(cutlass.select_(length > 0, length, Int32(1)))  # an empty sequence: 0 / 1
            mean = f64_to_f32_rn(div_rn_f64(total, Float64(n)))
            sMean[tidx] = mean
            if rank == 0:
                cute.make_tensor(_gptr(Float32, mean_addr, 4), cute.make_layout(D))[tidx] = mean
        cute.arch.cluster_arrive()

    def _values(self, rX: cute.Tensor, rMean: cute.Tensor, rLam: cute.Tensor, p: int) -> list:
        """The 8 fp32 values of pass ``p`` (exact widening; minus the mean with one RN subtraction; times the
        balance factor, exact). Plain Python, unrolled while the kernel is traced."""
        vals = []
        for w in range(4):
            word = rX[w, p]
            if self.in_bf16:
                lo, hi = bf16x2_to_f32x2(word)
            else:
                lo, hi = fp4.f16x2_to_f32x2(word)
            if self.subtract_mean:
                lo = sub_rn(lo, rMean[2 * w])
                hi = sub_rn(hi, rMean[2 * w + 1])
            if self.balance is not None:
                lo = mul_rn(lo, rLam[2 * w])
                hi = mul_rn(hi, rLam[2 * w + 1])
            vals.append(lo)
            vals.append(hi)
        return vals


def make_quant_compile_args(head_dim: int, group_rows: int, in_bf16: bool = True, subtract_mean: bool = False,
                            varlen: bool = False, balance=None):
    """(kernel object, placeholder args) to compile :class:`QKInt8Quant` without a GPU."""
    cfg = QKInt8Quant(head_dim, group_rows, in_bf16, subtract_mean, varlen, balance)
    return cfg, quant_placeholder_args()


def quant_placeholder_args() -> tuple:
    return (tuple(Int64(0) for _ in range(9)) + tuple(Int32(1) for _ in range(6))
            + tuple(Int64(1) for _ in range(3)) + (Int32(0), cute.runtime.make_fake_stream(),))


def compiled_quant(cfg: QKInt8Quant, arch: str):
    """The compiled kernel from the shared compile cache (memory, else disk, else compiled now)."""
    return cache_for(KIND).get((KIND, arch) + cfg.key, lambda: _build(cfg, arch))


def _build(cfg: QKInt8Quant, arch: str):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    return compile_for_arch(cfg, *quant_placeholder_args(), arch=arch, keep_ptx=False)[0]


@register(KIND)
def _quant_variants(arch: str, head_dims=None, balance_qk: bool = False, **_):
    """The default prefill configurations: Q per-warp (16 rows), Q per-block / K without smoothing (128 rows),
    K with smoothing (128 rows); bf16 and fp16; dense and varlen; with ``balance_qk`` also their balanced
    forms (K derives and applies the balance, Q applies it). Other block sizes compile on first use."""
    out = []
    for d in head_dims or [64, 128]:
        if d not in (64, 128, 256):
            continue
        for in_bf16 in (True, False):
            for rows, mean in ((16, False), (128, False), (128, True)):
                for varlen in (False, True):
                    balances = [None]
                    if balance_qk:  # 128-row groups are K's (and per-block Q's), 16-row ones Q's
                        balances += ["k", "q"] if (rows == 128 and not mean) else ["k" if mean else "q"]
                    for bal in balances:
                        cfg = QKInt8Quant(d, rows, in_bf16, mean, varlen, bal)
                        label = (f"{'bf16' if in_bf16 else 'fp16'} D{d} rows{rows}{' mean' if mean else ''}"
                                 f"{' varlen' if varlen else ''}{' balance ' + bal if bal else ''}")
                        out.append(Variant(KIND, (KIND, arch) + cfg.key, label, lambda cfg=cfg: _build(cfg, arch)))
            # the one-launch K quantization of short sequences (qattn.quant.launch.k_cluster_plan)
            plans = {cluster_groups_per_cta(d, 128, n) for n in range(1, CLUSTER_SIZE * CLUSTER_MAX_GROUPS_PER_CTA + 1)}
            for gpc in sorted(plans - {None}):
                for varlen in (False, True):
                    cfg = QKInt8Quant(d, 128, in_bf16, True, varlen, None, CLUSTER_SIZE, gpc)
                    label = (f"{'bf16' if in_bf16 else 'fp16'} D{d} rows128 mean{' varlen' if varlen else ''} "
                             f"cluster{CLUSTER_SIZE}x{gpc}")
                    out.append(Variant(KIND, (KIND, arch) + cfg.key, label, lambda cfg=cfg: _build(cfg, arch)))
    return out
