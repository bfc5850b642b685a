"""SM100 (Blackwell) prefill attention with INT8 Q/K (SageAttention style): Q K^T on ``tcgen05.mma kind::i8``
(s32 accumulator in TMEM), fp32 online softmax, 16-bit P . V on ``tcgen05.mma kind::f16`` (issue 6, v0).

**Never ran on hardware.** No Blackwell GPU was available: this kernel is compiled for ``sm_100a`` on a CPU
(the tests check the PTX for ``tcgen05.mma ... kind::i8``, ``kind::f16``, ``tcgen05.alloc`` and TMA
``cp.async.bulk.tensor``) and its arithmetic is modelled in torch by ``emulate_prefill.py``. TMA descriptors,
TMEM layouts, mbarrier phases and tcgen05 fences are unverified at runtime.

One CTA = one 128-row query tile of one (batch, q head); 128 threads, thread t = TMEM lane t = query row t.

    S_i32 (TMEM, 128 x 128)  = Q_int8 [SMEM] . K_int8^T [SMEM]                     (tcgen05.mma kind::i8)
    s     (registers, fp32)  = float(S_i32) * (q_scale * k_scale * softmax_scale * log2 e)
    P     (TMEM, 16-bit)     = exp2(s - m)                  (online softmax, thread = row, P rounded to V's type)
    O     (TMEM, 128 x D)   += P [TMEM] . V [SMEM]                              (tcgen05.mma kind::f16, "TS")

* **Same prepass and scales as SM90** (``qattn.quant.quantize_qk_int8``, block_q 128, warp_q 16, block_k 128):
  thread t owns row t, so the per_warp q scale (16 rows) and the per_block one (128 rows) are each one scalar
  per thread, loaded once; the k scale is one scalar per 128-key tile.
* **Exactness of the int8 part**: |S_i32| <= 127^2 * 128 < 2^22, so int32 -> fp32 is exact and the only
  roundings before the softmax are the scale product and one multiply (see ``emulate_prefill.py``).
* **Scale before the max**: the per-tile scale is applied before the running max (as on SM90), so the online
  softmax lives in the true log2 domain and needs no extra rescale when the k scale changes between tiles.
  Masked scores are *selected* to -inf after scaling, so a zero scale (an all-zero q group / k block) cannot
  make NaN from 0 * inf.
* **Loads**: TMA (``cp.async.bulk.tensor``) of the Q tile (once) and of K (K-major, int8) and V (MN-major:
  head_dim contiguous, the P . V B operand) tiles straight into the UMMA's swizzled SMEM layouts, ``kv_stages``
  deep. TMA zero-fills rows past seqlen_q / seqlen_k (ragged last tiles); those keys are masked to -inf, their
  zero V rows meet P = 0.
* **Masks**: keys >= seqlen_k and, with ``causal``, FlashAttention's bottom-right alignment: query i sees keys
  j <= i + seqlen_k - seqlen_q. Causal CTAs read only tiles up to their last row's diagonal and run in reverse
  order (longest first). A row that sees no key writes 0 and LSE -inf. Rows >= seqlen_q are never stored.
  Sliding window (``local``, runtime ``window_left`` / ``window_right``, FlashAttention's ``window_size``): keys
  j >= i + seqlen_k - seqlen_q - window_left, and with ``causal`` j <= i + seqlen_k - seqlen_q + window_right; a
  CTA's tile loop starts at the tile of its first row's first key (K/V tiles, k scales and mask columns from there).
* **GQA**: the CTA of q head h reads kv head h // (num_heads / num_kv_heads) (K/V re-read per q head: v0).
* **Varlen** (``varlen``, compile time; SM90's semantics): packed q (total_q, Hq, D), k / v (total_k, Hkv, D),
  sequence b owning rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] and cu_seqlens_k[b] .. cu_seqlens_k[b+1]; grid
  (m blocks of max_seqlen_q, heads, sequences). Each CTA reads its sequence's offsets and lengths from cu_seqlens
  (device memory: no host sync) and exits at once if its m block starts past the sequence's rows. Everything
  else runs in the sequence's own coordinates: the TMA tensors are views of the whole packed tensors (one batch,
  so the descriptors bound only the last sequence) whose coordinates are offset to the sequence's first row
  (``cute.domain_offset``), masks and tile ranges use its lengths (causal bottom-right aligned per sequence), its
  scales and k mean are row b of the varlen prepass's padded tensors. A tile crossing the sequence's end reads
  the next sequence's rows: those keys are masked (P = 0 exactly, times their V rows, which must be finite --
  as on SM90, and as for the causally masked keys of any tile), those query rows are never stored.
* **Soft-capping** (``softcap``, compile time; SM90's semantics): the host passes scale_log2 = softmax_scale /
  softcap, so u = S * scale + shift is z / softcap, and each score becomes softcap * log2 e * tanh.approx(u), masked
  keys selected to -inf after the tanh (it would make them -softcap; ``common/softcap.py``). ``shift`` puts back the row's q . k_mean that
  K's smoothing took out (softmax is invariant to it, the cap is not): once per CTA thread t reads its own int8 Q
  row and K's mean from global memory (``_row_shift``).
* **LSE of the unsmoothed K** (every kernel): the returned LSE is FlashAttention's (and SageAttention's), that of
  the scores with K's smoothing mean put back, so partial results merge by it. Without a cap the same per-row
  shift (``_row_shift``, log2 units) is added to the log2 LSE before the natural-log store; with a cap it is in the
  scores already. ``k_mean_addr`` 0 (an unsmoothed K): no shift, no load. Rows that see no key keep -inf.

Pipeline (v0, deliberately simple, like the SM100 decode): all 4 warps in lock step, warp 0 issues TMA and the
MMAs. Per tile: wait K/V landed -> QK MMA -> commit/wait -> softmax (TMEM -> registers), P -> TMEM, O *= corr in
TMEM (only in warps whose running max moved) -> fence + CTA barrier -> P . V MMA -> commit/wait -> TMA of tile
it + kv_stages into the freed stage. No warp specialisation, no S/P double buffering, no overlap of softmax
with the tensor core: performance unknown, certainly far from the hardware's peak. Epilogue: O / l straight
from registers to global memory (no TMA store). The parts of the loop shared with ``decode.py`` are in
``lockstep.py``.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float16, Float32, Int8, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from qattn.cute_kernels.common.softcap import capped_log2
from qattn.cute_kernels.sm100.lockstep import (TmemRow, allocate_tmem, fmax, free_tmem, init_barriers,
                                               issue_pv_mma, lockstep_storage, make_pv_mma, row_epilogue, sel,
                                               softmax_exp2, store_row, tmem_s_o_p, tmem_stores_to_mma, wait_mma)
from qattn.cute_kernels.sm100.prefill_config import BLOCK_K, BLOCK_Q, WARP_Q, PrefillConfigSm100

__all__ = ["QKInt8PrefillSm100", "prefill_sm100_compile_args", "prefill_sm100_cache_key"]


class QKInt8PrefillSm100:
    """INT8-QK prefill attention for SM100, one compiled variant per :class:`PrefillConfigSm100`.

    ``__call__`` (host, ``@cute.jit``) takes raw device addresses (Int64), runtime sizes and a stream, builds the
    TMA descriptors and launches ``kernel`` on grid (ceil(seqlen_q / 128), num_heads, batch), 128 threads.
    ``varlen``: ``batch`` = num_seqs, ``seqlen_q`` / ``seqlen_k`` = total_q / total_k, the grid from
    ``max_seqlen_q``; q_int8 (total_q, Hq, D), k_int8 / v (total_k, Hkv, D), out (total_q, Hq, D), lse (Hq,
    total_q), cu_seqlens_q / _k int32 (num_seqs + 1,), scales and k_mean (num_seqs, ...) as the varlen prepass
    pads them. Dense kernels ignore the cu_seqlens addresses and max_seqlen_q (no kernel parameter).

    Tensors (contiguous, FlashAttention layout; the SM90 kernel's, so the launcher is shared in spirit):
        q_int8 (B, Sq, Hq, D) i8, k_int8 (B, Sk, Hkv, D) i8, v (B, Sk, Hkv, D) bf16/fp16
        q_scale (B, Hq, num_q_groups) fp32, k_scale (B, Hkv, num_k_blocks) fp32   (quantize_qk_int8)
        out (B, Sq, Hq, D) v dtype, lse (B, Hq, Sq) fp32 (natural log)
        k_mean (B, Hkv, D) fp32: K's smoothing mean (0: an unsmoothed K), put back per row: into the scores with
        ``softcap``, else into the LSE
    """

    threads = 128

    def __init__(self, cfg: PrefillConfigSm100):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.v_dtype = BFloat16 if cfg.v_dtype == "bf16" else Float16
        self.qk_tiler = (BLOCK_Q, BLOCK_K, self.D)  # (M, N, K) of Q K^T
        self.pv_tiler = (BLOCK_Q, self.D, BLOCK_K)  # (M, N, K) of P V

    @property
    def key(self) -> tuple:
        return self.cfg.key

    # --------------------------------------------------------------------------------------------------
    def _qk_mma(self):
        # int8 x int8 -> s32, both K-major (head_dim contiguous in Q and K): tcgen05.mma kind::i8 (MmaI8Op)
        return sm100_utils.make_trivial_tiled_mma(Int8, Int8, OperandMajorMode.K, OperandMajorMode.K, Int32,
                                                  tcgen05.CtaGroup.ONE, (BLOCK_Q, BLOCK_K))

    def _pv_mma(self):
        return make_pv_mma(self.v_dtype, BLOCK_Q, self.D)

    @cute.jit
    def __call__(
        self,
        q_addr: Int64, k_addr: Int64, v_addr: Int64, o_addr: Int64, lse_addr: Int64,
        q_scale_addr: Int64, k_scale_addr: Int64,
        batch: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_kv_heads: Int32,
        num_q_groups: Int32, num_k_blocks: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
        k_mean_addr: Int64, cu_seqlens_q_addr: Int64, cu_seqlens_k_addr: Int64, max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        cfg, D = self.cfg, self.D
        gmem = cute.AddressSpace.gmem
        qk_mma = self._qk_mma()
        pv_mma = self._pv_mma()
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))

        # ---- shared-memory layouts (UMMA canonical, swizzled) -----------------------------------------
        q_smem = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, Int8, 1)
        k_smem = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, Int8, cfg.kv_stages)
        v_smem = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.v_dtype, cfg.kv_stages)
        p_tmem = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.v_dtype, 1)  # P's TMEM A layout

        # ---- global tensors: (rows, head_dim, (heads, batch)) views of the (B, S, H, D) tensors ----------
        # varlen: one packed "batch" of seqlen_q / seqlen_k (= total) rows; ``batch`` counts the sequences. The TMA
        # descriptors then bound the whole packed tensors: only rows past the last sequence are zero-filled.
        q_row, k_row = num_heads * D, num_kv_heads * D
        views = batch
        if cutlass.const_expr(cfg.varlen):
            views = 1
        mQ = cute.make_tensor(cute.make_ptr(Int8, q_addr, gmem, assumed_align=16),
                              cute.make_layout((seqlen_q, D, (num_heads, views)),
                                               stride=(q_row, 1, (D, seqlen_q * q_row))))
        mK = cute.make_tensor(cute.make_ptr(Int8, k_addr, gmem, assumed_align=16),
                              cute.make_layout((seqlen_k, D, (num_kv_heads, views)),
                                               stride=(k_row, 1, (D, seqlen_k * k_row))))
        # V as P.V's B operand (N = head_dim, K = keys): head_dim contiguous, "MN-major"
        mV = cute.make_tensor(cute.make_ptr(self.v_dtype, v_addr, gmem, assumed_align=16),
                              cute.make_layout((D, seqlen_k, (num_kv_heads, views)),
                                               stride=(1, k_row, (D, seqlen_k * k_row))))

        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(
            op, mQ, cute.slice_(q_smem, (None, None, None, 0)), self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_k, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(
            op, mK, cute.slice_(k_smem, (None, None, None, 0)), self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_v, tma_mV = cute.nvgpu.make_tiled_tma_atom_B(
            op, mV, cute.slice_(v_smem, (None, None, None, 0)), self.pv_tiler, pv_mma, cluster_vmnk.shape)

        self.q_bytes = cute.size_in_bytes(Int8, cute.slice_(q_smem, (None, None, None, 0)))
        self.kv_bytes = (cute.size_in_bytes(Int8, cute.slice_(k_smem, (None, None, None, 0)))
                         + cute.size_in_bytes(self.v_dtype, cute.slice_(v_smem, (None, None, None, 0))))

        num_m_blocks = (seqlen_q + BLOCK_Q - 1) // BLOCK_Q
        if cutlass.const_expr(cfg.varlen):  # sized for the longest sequence; the others' extra CTAs exit at once
            num_m_blocks = (max_seqlen_q + BLOCK_Q - 1) // BLOCK_Q
        varlen = cutlass.const_expr(cfg.varlen)  # the cu_seqlens addresses: varlen kernels' parameters only
        self.kernel(qk_mma, pv_mma, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, q_smem, k_smem, v_smem, p_tmem,
                    o_addr, lse_addr, q_scale_addr, k_scale_addr, batch, seqlen_q, seqlen_k, num_heads, num_kv_heads,
                    num_q_groups, num_k_blocks, scale_log2, window_left, window_right,
                    q_addr, k_mean_addr,
                    cu_seqlens_q_addr if varlen else None, cu_seqlens_k_addr if varlen else None).launch(
                        grid=(num_m_blocks, num_heads, batch), block=(self.threads, 1, 1), cluster=(1, 1, 1),
                        stream=stream)

    # --------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
        tma_v: cute.CopyAtom, mV: cute.Tensor,
        q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout, v_smem: cute.ComposedLayout,
        p_tmem: cute.ComposedLayout,
        o_addr: Int64, lse_addr: Int64, q_scale_addr: Int64, k_scale_addr: Int64,
        batch: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_kv_heads: Int32,
        num_q_groups: Int32, num_k_blocks: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
        q_addr: Int64, k_mean_addr: Int64,  # the int8 Q rows and K's mean: the smoothing shift (``_row_shift``)
        cu_q_addr, cu_k_addr,  # Int64 with ``varlen``, else None (no kernel parameter)
    ):
        """CTA (m block, q head h, batch / sequence b). Varlen: ``seqlen_q`` / ``seqlen_k`` are the packed totals
        and ``batch`` the number of sequences; the CTA reads its sequence's first rows and lengths from cu_seqlens
        here, on the device. CTAs whose m block starts past their sequence's rows exit before touching shared or
        tensor memory (the grid is sized for the longest sequence)."""
        cfg = self.cfg
        gmem = cute.AddressSpace.gmem
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bid_m, h, b = cute.arch.block_idx()
        m_block = bid_m
        if cutlass.const_expr(cfg.causal):  # longest causal rows first: the last query tiles see the most keys
            m_block = cute.arch.grid_dim()[0] - 1 - bid_m
        sizes = (batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_q_groups, num_k_blocks)
        args = (qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_tmem, o_addr, lse_addr,
                q_scale_addr, k_scale_addr, scale_log2, window_left, window_right, q_addr, k_mean_addr, tidx, warp,
                m_block, h, b)
        if cutlass.const_expr(cfg.varlen):
            cu_q = cute.make_tensor(cute.make_ptr(Int32, cu_q_addr, gmem, assumed_align=4), cute.make_layout(batch + 1))
            cu_k = cute.make_tensor(cute.make_ptr(Int32, cu_k_addr, gmem, assumed_align=4), cute.make_layout(batch + 1))
            q_start, k_start = cu_q[b], cu_k[b]
            len_q, len_k = cu_q[b + 1] - q_start, cu_k[b + 1] - k_start
            if m_block * BLOCK_Q < len_q:
                self._tile(*args, sizes, (q_start, k_start, len_q, len_k))
        else:
            self._tile(*args, sizes, None)

    @cute.jit
    def _tile(
        self, qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_tmem, o_addr, lse_addr,
        q_scale_addr, k_scale_addr, scale_log2, window_left, window_right, q_addr, k_mean_addr, tidx, warp, m_block,
        h, b, sizes, seq,
    ):
        """One 128-row query tile of (q head h, sequence b). ``seq``: varlen (q_start, k_start, len_q, len_k), the
        sequence's first rows in the packed tensors and its lengths; None: dense (batch b, all rows)."""
        cfg, D, ST = self.cfg, self.D, self.cfg.kv_stages
        gmem = cute.AddressSpace.gmem
        batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, num_q_groups, num_k_blocks = sizes
        b_t = b  # the (heads, batch) view's batch index
        total_q = seqlen_q  # rows of Q, out and LSE (varlen: the packed total)
        if cutlass.const_expr(cfg.varlen):
            # masks and tile ranges run in the sequence's own coordinates (seqlen_q / seqlen_k are its lengths from
            # here on); its rows start at q_start / k_start of the one packed "batch"
            q_start, k_start, seqlen_q, seqlen_k = seq
            b_t = 0
        group = num_heads // num_kv_heads
        h_kv = h // group

        # keys this CTA reads: all, or (causal) up to its last row's diagonal; none past seqlen_q
        diag = seqlen_k - seqlen_q  # causal: row i sees keys j <= i + diag
        n_blocks = (seqlen_k + BLOCK_K - 1) // BLOCK_K
        if cutlass.const_expr(cfg.causal):
            last_key = cutlass.min(seqlen_k, (m_block + 1) * BLOCK_Q + diag)
            if cutlass.const_expr(cfg.local):  # the window's right edge moves the causal bound
                last_key = cutlass.min(seqlen_k, (m_block + 1) * BLOCK_Q + diag + window_right)
            n_blocks = cutlass.max(last_key + BLOCK_K - 1, 0) // BLOCK_K
        kb0 = Int32(0)  # local: the tile of the first row's first key; the tiles before it are never loaded
        if cutlass.const_expr(cfg.local):
            kb0 = cutlass.min(cutlass.max(m_block * BLOCK_Q + diag - window_left, 0) // BLOCK_K, n_blocks)
            n_blocks = n_blocks - kb0
        if m_block * BLOCK_Q >= seqlen_q:
            n_blocks = 0

        # ---- shared memory ---------------------------------------------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(lockstep_storage(ST))
        sQ = smem.allocate_tensor(Int8, q_smem.outer, byte_alignment=1024, swizzle=q_smem.inner)
        sK = smem.allocate_tensor(Int8, k_smem.outer, byte_alignment=1024, swizzle=k_smem.inner)
        sV = smem.allocate_tensor(self.v_dtype, v_smem.outer, byte_alignment=1024, swizzle=v_smem.inner)
        full, q_full, s_done, o_done = init_barriers(st, ST, warp)

        # ---- tensor memory: S (128 cols, s32) | O (D cols, fp32) | P (64 cols: 128 x 16-bit) -----------------
        tmem, tmem_ptr = allocate_tmem(st, cfg.tmem_cols, self.threads)
        thr_qk = qk_mma.get_slice(0)
        thr_pv = pv_mma.get_slice(0)
        tStS, tOtO, tOrP, p_col = tmem_s_o_p(tmem_ptr, qk_mma, pv_mma, thr_pv, p_tmem, self.qk_tiler, self.pv_tiler,
                                             Int32, self.v_dtype)

        # ---- MMA operand views (SMEM descriptors) ---------------------------------------------------------------
        tCrQ = qk_mma.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, 1)
        tCrK = qk_mma.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, stages)
        tCrV = pv_mma.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, stages)

        # ---- TMA partitions: (TMA, tiles along rows, tiles along K, (head, batch)) -----------------------------
        if cutlass.const_expr(cfg.varlen):
            # the sequence's row 0 becomes coordinate 0 of the TMA tensors, so tile t is rows start + 128 t of the
            # packed tensor. A tile crossing the sequence's end reads the next sequence's rows (zeros past the
            # last one): their keys are masked (-inf: P = 0, times V rows that must be finite, as on SM90) and
            # their query rows are never stored.
            mQ = cute.domain_offset((q_start, 0, 0), mQ)
            mK = cute.domain_offset((k_start, 0, 0), mK)
            mV = cute.domain_offset((0, k_start, 0), mV)
        gQ = cute.local_tile(mQ, cute.slice_(self.qk_tiler, (None, 0, None)), (None, None, None))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                         cute.group_modes(thr_qk.partition_A(gQ), 0, 3))
        gK = cute.local_tile(mK, cute.slice_(self.qk_tiler, (0, None, None)), (None, None, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                         cute.group_modes(thr_qk.partition_B(gK), 0, 3))
        gV = cute.local_tile(mV, cute.slice_(self.pv_tiler, (0, None, None)), (None, None, None))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                         cute.group_modes(thr_pv.partition_B(gV), 0, 3))
        tmas = (tma_k, tKs, tKg, tma_v, tVs, tVg)

        # ---- prologue: Q and the first kv_stages K/V tiles ---------------------------------------------------
        if warp == 0:
            if n_blocks > 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(q_full, self.q_bytes)
                cute.copy(tma_q, tQg[(None, m_block, 0, (h, b_t))], tQs[(None, 0)], tma_bar_ptr=q_full)
            for s in cutlass.range_constexpr(ST):
                if s < n_blocks:
                    self._issue_kv(kb0 + s, s, tmas, full, h_kv, b_t)

        # ---- per-thread row state: thread t = TMEM lane t = query row t of the tile ---------------------------
        row = m_block * BLOCK_Q + tidx
        mQS = cute.make_tensor(cute.make_ptr(Float32, q_scale_addr, gmem, assumed_align=4),
                               cute.make_layout(batch * num_heads * num_q_groups))
        mKS = cute.make_tensor(cute.make_ptr(Float32, k_scale_addr, gmem, assumed_align=4),
                               cute.make_layout(batch * num_kv_heads * num_k_blocks))
        q_group = m_block
        if cutlass.const_expr(cfg.granularity == "per_warp"):
            q_group = m_block * (BLOCK_Q // WARP_Q) + tidx // WARP_Q
        # log2-domain scale of this row without the k scale: fp32(q_scale * softmax_scale * log2 e)
        qs_log2 = Float32(0.0)
        if n_blocks > 0:
            qs_log2 = mQS[(b * num_heads + h) * num_q_groups + q_group] * scale_log2
        ks_base = (b * num_kv_heads + h_kv) * num_k_blocks
        # the row's smoothing shift (pre-tanh units with softcap, else log2 units for the LSE), read here, before
        # the first wait, so that its loads overlap the Q tile's TMA
        q_row0 = None  # varlen: the sequence's first row in the packed Q
        if cutlass.const_expr(cfg.varlen):
            q_row0 = q_start
        shift = self._row_shift(q_addr, k_mean_addr, qs_log2, row, seqlen_q, num_heads, num_kv_heads, b, h, h_kv,
                                n_blocks, q_row0)
        key_end = seqlen_k  # keys < key_end are visible to this row (local: and keys >= key_start)
        if cutlass.const_expr(cfg.causal):
            key_end = cutlass.min(seqlen_k, row + diag + 1)
            if cutlass.const_expr(cfg.local):
                key_end = cutlass.min(seqlen_k, row + diag + window_right + 1)
        key_start = None
        if cutlass.const_expr(cfg.local):
            key_start = row + diag - window_left
        m_run = Float32(-math.inf)
        l_run = Float32(0.0)
        # TMEM <-> register copies of one row (thread = lane): S (s32 x 128), P (16-bit x 128 as 64 words), O
        trow = TmemRow.make(tStS, tOtO, tmem_ptr, p_col, thr_qk, thr_pv, self.qk_tiler, self.pv_tiler, tidx)
        tSc = trow.tSc

        if n_blocks > 0:
            cute.arch.mbarrier_wait(q_full, 0)

        # ---- main loop over K/V tiles ------------------------------------------------------------------------
        for it in cutlass.range(n_blocks, unroll=1):
            stage = it % ST
            cute.arch.mbarrier_wait(full + stage, (it // ST) % 2)
            if warp == 0:
                for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):  # head_dim / 32 k-blocks
                    qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(qk_mma, tStS, tCrQ[(None, None, kb, 0)], tCrK[(None, None, kb, stage)], tStS)
                with cute.arch.elect_one():
                    tcgen05.commit(s_done)
            wait_mma(s_done, it % 2)

            # ---- online softmax, thread = row --------------------------------------------------------------
            rSi = trow.load_s(Int32)
            # fp32(fp32(q_scale * softmax_scale * log2 e) * k_scale): the tile's log2-domain scale
            scale = qs_log2 * mKS[ks_base + kb0 + it]
            col0 = (kb0 + it) * BLOCK_K
            rS = cute.make_rmem_tensor(tSc.shape, Float32)
            mx = Float32(-math.inf)
            for i in cutlass.range_constexpr(cute.size(rS)):
                # int32 -> fp32 is exact (|S| < 2^22); masked keys are selected to -inf after the multiply
                visible = col0 + tSc[i][1] < key_end
                if cutlass.const_expr(cfg.local):
                    visible = visible & (col0 + tSc[i][1] >= key_start)
                if cutlass.const_expr(cfg.softcap > 0.0):  # u = z / softcap (scale_log2 = softmax_scale / softcap)
                    u = Float32(rSi[i]) * scale + shift
                    x = sel(visible, capped_log2(u, cfg.softcap), Float32(-math.inf), Float32)
                else:
                    x = sel(visible, Float32(rSi[i]) * scale, Float32(-math.inf), Float32)
                rS[i] = x
                mx = fmax(mx, x)
            m_run, corr, psum = softmax_exp2(rS, mx, m_run)
            l_run = l_run * corr + psum
            trow.store_p(trow.pack_p(rS, cfg.v_dtype == "bf16"))
            # O *= corr when the running max moved (the previous P.V finished: o_done was waited on). tcgen05.ld/st
            # are warp-collective, so the test is per warp (vote.any): a lane whose max did not move has corr == 1
            # exactly and multiplies by 1, which changes nothing.
            if it > 0:
                if cute.arch.vote_any_sync(corr < Float32(1.0)):
                    trow.rescale_o(corr)
            tmem_stores_to_mma()
            if warp == 0:
                pv_mma = issue_pv_mma(pv_mma, tOtO, tOrP, tCrV, stage, it, o_done)
            wait_mma(o_done, it % 2)
            # K and V of this stage are consumed: prefetch tile it + kv_stages into it
            if warp == 0:
                if it + ST < n_blocks:
                    self._issue_kv(kb0 + it + ST, stage, tmas, full, h_kv, b_t)

        # ---- epilogue: thread = row; O / l, LSE in natural log ------------------------------------------------
        # capped, the shift is in the scores already; else it goes into the log2 LSE (that of the unsmoothed K)
        lse_shift = None
        if cutlass.const_expr(cfg.softcap == 0.0):
            lse_shift = shift
        inv, lse = row_epilogue(m_run, l_run, Float32(1.0), lse_shift)
        rO = trow.load_o(n_blocks)
        if row < seqlen_q:
            if cutlass.const_expr(cfg.varlen):  # packed out (total_q, Hq, D), LSE (Hq, total_q)
                store_row(o_addr, lse_addr, self.v_dtype, rO, trow.tOc, inv, lse, 1, total_q, num_heads, D, 0,
                          q_start + row, h)
            else:
                store_row(o_addr, lse_addr, self.v_dtype, rO, trow.tOc, inv, lse, batch, seqlen_q, num_heads, D, b,
                          row, h)

        free_tmem(tmem, tmem_ptr)

    # ======================================================================================================
    @cute.jit
    def _row_shift(self, q_addr, k_mean_addr, qs_log2, row, seqlen_q, num_heads, num_kv_heads, b, h, h_kv, n_blocks,
                   q_row0):
        """The shift qs_log2 * sum_c q_int8[row, c] * k_mean[c] that K's smoothing took out of this thread's
        scores, in the units of ``Float32(S) * scale``: pre-tanh with ``softcap`` (qs_log2 = q_scale *
        softmax_scale / softcap; it goes into the scores), else log2 (qs_log2 = q_scale * softmax_scale * log2 e;
        it goes into the LSE). Once per CTA, straight from global memory: the thread's own int8 Q row (D
        contiguous bytes, 16-byte aligned: the launcher's tensors are) as 32-bit words, and the (batch, kv head)
        row of the fp32 mean, which all threads share (one broadcast load per channel). 0 for rows past seqlen_q
        (never read), for a CTA without tiles and for ``k_mean_addr`` 0 (an unsmoothed K: no shift). Varlen:
        ``q_row0`` is the sequence's first row in the packed Q (``row`` and ``seqlen_q`` are the sequence's), ``b``
        the sequence."""
        D = self.D
        gmem = cute.AddressSpace.gmem
        dot = Float32(0.0)
        if (k_mean_addr != Int64(0)) & (row < seqlen_q) & (n_blocks > 0):
            q_off = Int64(((b * seqlen_q + row) * num_heads + h) * D)  # bytes
            if cutlass.const_expr(self.cfg.varlen):
                q_off = Int64(((q_row0 + row) * num_heads + h) * D)
            gq = cute.make_tensor(cute.make_ptr(Int32, q_addr + q_off, gmem, assumed_align=16),
                                  cute.make_layout(D // 4))
            rq = cute.make_rmem_tensor(cute.make_layout(D // 4), Int32)
            cute.autovec_copy(gq, rq)  # 128-bit loads
            mean = cute.make_tensor(cute.make_ptr(Float32, k_mean_addr, gmem, assumed_align=4)
                                    + (b * num_kv_heads + h_kv) * D, cute.make_layout(D))
            for w in cutlass.range_constexpr(D // 4):
                for e in cutlass.range_constexpr(4):
                    q8 = (rq[w] << (24 - 8 * e)) >> 24  # byte e, sign-extended (arithmetic shift)
                    dot = dot + Float32(q8) * mean[4 * w + e]
        return qs_log2 * dot

    def _issue_kv(self, tile, stage, tmas, full, h_kv, b):
        """TMA of K/V tile ``tile`` (keys tile*128 ..) of kv head ``h_kv`` into ring slot ``stage``; one mbarrier
        counts the bytes of both (rows past seqlen_k are zero-filled by TMA and still counted)."""
        tma_k, tKs, tKg, tma_v, tVs, tVg = tmas
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.kv_bytes)
        cute.copy(tma_k, tKg[(None, tile, 0, (h_kv, b))], tKs[(None, stage)], tma_bar_ptr=full + stage)
        cute.copy(tma_v, tVg[(None, 0, tile, (h_kv, b))], tVs[(None, stage)], tma_bar_ptr=full + stage)


def prefill_sm100_compile_args() -> list:
    """Placeholder arguments of :meth:`QKInt8PrefillSm100.__call__` to compile without a GPU (zero addresses)."""
    return ([Int64(0)] * 7 + [Int32(1)] * 7 + [Float32(1.0), Int32(0), Int32(0), Int64(0)]
            + [Int64(0), Int64(0), Int32(1), cute.runtime.make_fake_stream()])


def prefill_sm100_cache_key(arch: str, cfg: PrefillConfigSm100) -> tuple:
    return (arch,) + cfg.key
