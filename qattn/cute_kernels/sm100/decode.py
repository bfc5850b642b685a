"""SM100 (Blackwell) paged decode attention over an FP4 KV cache, QK^T on the block-scaled tcgen05 MMA (issue 6).

**Never ran on hardware.** No Blackwell GPU was available: this kernel is compiled for ``sm_100a`` on a CPU
(ptxas produces a cubin; the tests check the PTX for the block-scaled ``tcgen05.mma``, ``tcgen05.alloc``,
``tcgen05.cp`` and TMA ``cp.async.bulk.tensor``), and its arithmetic is modelled in torch by ``emulate.py``.
Synchronisation, TMEM layouts and TMA descriptors are unverified at runtime.

One CTA = one (split, kv head, sequence); 128 threads, thread t = TMEM lane t = packed query row t.

    S  (TMEM, 128 rows x 128 tokens, fp32) = blockscaled_mma(Q_fp4 [SMEM] x SFQ [TMEM], K_fp4 [SMEM] x SFK [TMEM])
    P  (TMEM, 16-bit)                      = exp2(S * scale * q_row_scale - m)          (online softmax, thread = row)
    O  (TMEM, 128 x D, fp32)              += P [TMEM] . V_16bit [SMEM, dequantized]     (tcgen05 "TS" MMA)

* **M = 128 query rows**: the rows of one kv head (seqlen_q x GQA group, row r = i_q * G + g) packed and
  zero-padded to 128 (v0: rows <= 128). The QK MMA's N is a 128-token KV tile, its K is head_dim.
* **Q** is quantized by a torch prepass (``q_prepass.py``) to the K format's FP4 flavour (NVFP4 for nvfp4 K,
  the K's own MX format otherwise), scales already in the tcgen05 scale-factor atom layout; TMA loads the Q tile
  and its scales once (the same ``make_tiled_tma_atom_A`` pattern as the CUTLASS block-scaled GEMM), the scales go
  SMEM -> TMEM with ``tcgen05.cp`` (``Cp4x32x128bOp``). The NVFP4 per-row decode scale of Q multiplies S in
  the softmax (thread = row), the K global scale is folded into the softmax scale, the V global scale into
  the output.
* **K payload**: TMA (``cp.async.bulk.tensor``) straight from the page pool into the UMMA's K-major swizzled
  SMEM layout. A 128-token tile is one box when a page holds >= 128 tokens, else 128 / page boxes of one
  page each (the pool is "HND": one page of one head is a contiguous run of rows); box i lands in rows
  [i*page, (i+1)*page) of the tile, which is the same swizzle pattern because pages are multiples of the
  8-row swizzle atom. Pieces past the sequence end are redirected to block 0 (masked in the softmax).
* **K scales**: the pool stores them per token row (``(page, D/vec)`` bytes per page and head), the MMA wants
  the 128x4 scale-factor atom. TMA brings the raw rows (contiguous, as 16-byte rows) into a staging buffer;
  the 128 threads rewrite them (one token each) into the atom layout, then ``tcgen05.cp`` moves them to TMEM.
* **V path** (the block scales of V run along head_dim, but P.V reduces over tokens, so they cannot be MMA
  scale factors): V payload + scales arrive by TMA into staging buffers; each thread dequantizes one token
  row (E2M1 x block scale, exact in f16 for nvfp4 and in bf16 for MX scales) into the P.V MMA's B operand
  (MN-major, head_dim contiguous) in SMEM; P.V is a plain 16-bit tcgen05 MMA with P read from TMEM.
* **Sliding window** (``cfg.window``; runtime ``window_left`` / ``window_right``, FlashAttention's semantics as
  ``qattn.interface.window`` normalizes them): the tile list starts at the tile holding the first query's first
  visible key, and each row masks positions left of its window as well as past its (shifted) causal edge.
* **Soft-capping** (``cfg.softcap``, compile time): the host's scale gives z / softcap, each score goes through
  ``tanh.approx.f32`` (``common/softcap.py``) before the mask, as on SM90.
* **Split-KV**: split s of ``num_splits`` takes a contiguous range of 128-token tiles and writes its normalized
  fp32 partial O (num_splits, B, Sq, Hq, D) and natural-log LSE (num_splits, B, Hq, Sq): the layout
  ``combine.py`` merges, as on SM90. num_splits = 1 writes the output (q dtype) and LSE directly.

Pipeline (v0, deliberately simple): the 4 warps do everything in lock step; warp 0 issues TMA and MMAs (one
elected lane). Two TMA stages: the loads of tile t+2 are issued as soon as the QK MMA of tile t has finished
with its stage, so HBM traffic overlaps the softmax / P.V / dequant of the next tiles. No warp specialisation,
no S/P double buffering yet. The parts of the loop shared with ``prefill_int8.py`` are in ``lockstep.py``.
"""

from __future__ import annotations

import itertools
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

from qattn.cute_kernels.common.softcap import capped_log2
from qattn.cute_kernels.sm100.decode_config import ROWS, TILE_N, DecodeConfigSm100
from qattn.cute_kernels.sm100.lockstep import (TmemRow, allocate_tmem, fmax, free_tmem, init_barriers,
                                               issue_pv_mma, lockstep_storage, make_pv_mma, row_epilogue, sel,
                                               softmax_exp2, store_row, tcgen05_fence, tmem_s_o_p,
                                               tmem_stores_to_mma, wait_mma)

__all__ = ["DecodeSm100", "decode_sm100_compile_args", "decode_sm100_cache_key"]


class DecodeSm100:
    """Paged FP4 decode attention for SM100, one compiled variant per :class:`DecodeConfigSm100`.

    ``__call__`` (host, ``@cute.jit``) takes raw device addresses (Int64), runtime sizes and a stream, builds the
    TMA descriptors and launches ``kernel`` on grid (num_splits, num_kv_heads, batch) with 128 threads.

    Tensors (contiguous):
        q_data (q_terms, B, H, 128, D/2) u8, q_sf (q_terms, B, H, 128*D/vec) u8, q_rs (B, H, 128) fp32  (q_prepass)
        k/v data (num_blocks, H, page, D/2) u8, k/v scales (num_blocks, H, page, D/vec) u8, k/v global (H,) fp32
        block_table (B, max_blocks) i32, cache_seqlens (B,) i32
        out (B, Sq, Hq, D) q dtype | split: (num_splits, B, Sq, Hq, D) fp32
        lse (B, Hq, Sq) fp32       | split: (num_splits, B, Hq, Sq) fp32
    """

    def __init__(self, cfg: DecodeConfigSm100):
        self.cfg = cfg
        self.D = cfg.head_dim
        self.vec = cfg.sf_vec
        self.sf_dtype = cutlass.Float8E4M3FN if cfg.q_scale == "e4m3" else cutlass.Float8E8M0FNU
        self.v_dtype = cutlass.Float16 if cfg.v_dtype == "f16" else cutlass.BFloat16
        self.out_dtype = cutlass.BFloat16 if cfg.q_dtype == "bf16" else cutlass.Float16
        self.P = cfg.piece
        self.n_pieces = TILE_N // self.P
        self.k_rb = cfg.k_fmt.payload_bytes(self.D)  # payload bytes per token row
        self.v_rb = cfg.v_fmt.payload_bytes(self.D)
        self.k_srb = cfg.k_fmt.scale_bytes(self.D)  # scale bytes per token row
        self.v_srb = cfg.v_fmt.scale_bytes(self.D)
        self.k_ns = cfg.k_fmt.num_scales(self.D)
        self.v_ns = cfg.v_fmt.num_scales(self.D)
        self.v_sb = cfg.v_fmt.scale_block
        self.threads = 128
        self.tmem_cols = 512
        self.qk_tiler = (ROWS, TILE_N, self.D)
        self.pv_tiler = (ROWS, self.D, TILE_N)
        self.piece_tiler = (ROWS, self.P, self.D)

    # --------------------------------------------------------------------------------------------------
    def _qk_mma(self, n: int):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, OperandMajorMode.K, OperandMajorMode.K, self.sf_dtype,
            self.vec, tcgen05.CtaGroup.ONE, (ROWS, n))

    def _pv_mma(self):
        return make_pv_mma(self.v_dtype, ROWS, self.D)

    @cute.jit
    def __call__(
        self,
        qd_addr: Int64, qsf_addr: Int64, qrs_addr: Int64,
        kd_addr: Int64, ks_addr: Int64, kg_addr: Int64,
        vd_addr: Int64, vs_addr: Int64, vg_addr: Int64,
        bt_addr: Int64, sl_addr: Int64, o_addr: Int64, lse_addr: Int64,
        batch: Int32, seqlen_q: Int32, num_kv_heads: Int32, max_blocks: Int32, num_blocks: Int32,
        num_splits: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
        stream: cuda.CUstream,
    ):
        """``window_left`` / ``window_right``: the sliding window's edges (``cfg.window``; unread otherwise)."""
        cfg = self.cfg
        D = self.D
        fp4 = cutlass.Float4E2M1FN
        gmem = cute.AddressSpace.gmem
        qk_mma = self._qk_mma(TILE_N)
        qk_mma_piece = self._qk_mma(self.P)
        pv_mma = self._pv_mma()
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))

        # ---- shared-memory layouts ---------------------------------------------------------------------
        q_smem = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, fp4, cfg.q_terms)
        k_smem = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, fp4, cfg.stages)
        k_piece_smem = sm100_utils.make_smem_layout_b(qk_mma_piece, self.piece_tiler, fp4, 1)
        sfq_smem = blockscaled_utils.make_smem_layout_sfa(qk_mma, self.qk_tiler, self.vec, cfg.q_terms)
        sfk_smem = blockscaled_utils.make_smem_layout_sfb(qk_mma, self.qk_tiler, self.vec, 1)
        p_tmem = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.v_dtype, 1)
        v_smem = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.v_dtype, 1)

        # ---- global tensors and TMA atoms -------------------------------------------------------------
        q_rows = cfg.q_terms * batch * num_kv_heads * ROWS
        mQ = cute.make_tensor(cute.make_ptr(fp4, qd_addr, gmem, assumed_align=16),
                              cute.make_layout((q_rows, D, 1), stride=(D, 1, 0)))
        mQSF = cute.make_tensor(cute.make_ptr(self.sf_dtype, qsf_addr, gmem, assumed_align=16),
                                blockscaled_utils.tile_atom_to_shape_SF(mQ.shape, self.vec))
        kv_rows = num_blocks * num_kv_heads * cfg.page_size  # token-head rows of a pool
        mK = cute.make_tensor(cute.make_ptr(fp4, kd_addr, gmem, assumed_align=16),
                              cute.make_layout((kv_rows, D, 1), stride=(D, 1, 0)))
        mV = cute.make_tensor(cute.make_ptr(Uint8, vd_addr, gmem, assumed_align=16),
                              cute.make_layout((kv_rows, self.v_rb), stride=(self.v_rb, 1)))
        # scale pools as rows of 16 bytes (a page's scales are one contiguous run; TMA boxes need >= 16 B rows)
        mKS = cute.make_tensor(cute.make_ptr(Uint8, ks_addr, gmem, assumed_align=16),
                               cute.make_layout((kv_rows * self.k_srb // 16, 16), stride=(16, 1)))
        mVS = cute.make_tensor(cute.make_ptr(Uint8, vs_addr, gmem, assumed_align=16),
                               cute.make_layout((kv_rows * self.v_srb // 16, 16), stride=(16, 1)))

        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(
            op, mQ, cute.slice_(q_smem, (None, None, None, 0)), self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_qsf, tma_mQSF = cute.nvgpu.make_tiled_tma_atom_A(
            op, mQSF, cute.slice_(sfq_smem, (None, None, None, 0)), self.qk_tiler, qk_mma, cluster_vmnk.shape,
            internal_type=cutlass.Int16)
        tma_k, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(
            op, mK, cute.slice_(k_piece_smem, (None, None, None, 0)), self.piece_tiler, qk_mma_piece,
            cluster_vmnk.shape)
        v_piece = cute.make_layout((self.P, self.v_rb), stride=(self.v_rb, 1))
        ks_piece = cute.make_layout((self.P * self.k_srb // 16, 16), stride=(16, 1))
        vs_piece = cute.make_layout((self.P * self.v_srb // 16, 16), stride=(16, 1))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mV, v_piece,
                                                    (self.P, self.v_rb))
        tma_ks, tma_mKS = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKS, ks_piece,
                                                      (self.P * self.k_srb // 16, 16))
        tma_vs, tma_mVS = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mVS, vs_piece,
                                                      (self.P * self.v_srb // 16, 16))

        self.q_bytes = cfg.q_terms * (ROWS * D // 2 + ROWS * D // self.vec)
        self.kv_bytes = TILE_N * (self.k_rb + self.v_rb + self.k_srb + self.v_srb)

        self.kernel(qk_mma, pv_mma, tma_q, tma_mQ, tma_qsf, tma_mQSF, tma_k, tma_mK, tma_v, tma_mV, tma_ks, tma_mKS,
                    tma_vs, tma_mVS, q_smem, k_smem, k_piece_smem, sfq_smem, sfk_smem, p_tmem, v_smem,
                    qrs_addr, kg_addr, vg_addr, bt_addr, sl_addr, o_addr, lse_addr,
                    batch, seqlen_q, num_kv_heads, max_blocks, num_blocks, num_splits, scale_log2, window_left,
                    window_right).launch(
                        grid=(num_splits, num_kv_heads, batch), block=(self.threads, 1, 1), cluster=(1, 1, 1),
                        stream=stream)

    # --------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_qsf: cute.CopyAtom, mQSF: cute.Tensor,
        tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
        tma_ks: cute.CopyAtom, mKS: cute.Tensor, tma_vs: cute.CopyAtom, mVS: cute.Tensor,
        q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout, k_piece_smem: cute.ComposedLayout,
        sfq_smem: cute.Layout, sfk_smem: cute.Layout, p_tmem: cute.ComposedLayout, v_smem: cute.ComposedLayout,
        qrs_addr: Int64, kg_addr: Int64, vg_addr: Int64, bt_addr: Int64, sl_addr: Int64, o_addr: Int64,
        lse_addr: Int64,
        batch: Int32, seqlen_q: Int32, num_kv_heads: Int32, max_blocks: Int32, num_blocks: Int32,
        num_splits: Int32, scale_log2: Float32, window_left: Int32, window_right: Int32,
    ):
        cfg = self.cfg
        D, G, S, P, NP = self.D, cfg.group, cfg.stages, self.P, self.n_pieces
        fp4 = cutlass.Float4E2M1FN
        gmem = cute.AddressSpace.gmem
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, h, b = cute.arch.block_idx()
        Hq = num_kv_heads * G
        rows = seqlen_q * G

        mBT = cute.make_tensor(cute.make_ptr(Int32, bt_addr, gmem, assumed_align=4),
                               cute.make_layout(batch * max_blocks))
        mSL = cute.make_tensor(cute.make_ptr(Int32, sl_addr, gmem, assumed_align=4), cute.make_layout(batch))
        mQRS = cute.make_tensor(cute.make_ptr(Float32, qrs_addr, gmem, assumed_align=4),
                                cute.make_layout(batch * num_kv_heads * ROWS))
        kv_len = mSL[b]

        # ---- shared memory ---------------------------------------------------------------------------------
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(lockstep_storage(S))  # s_done: the QK MMA and its scale copies
        # the swizzled operand tiles start on 1024-byte boundaries (a 128B-swizzle pattern's repeat), as in the
        # SM90 / SM100 prefill: the TMA's and the MMA descriptor's swizzle phase then starts at 0 with no base
        # offset to get right (at 128-byte alignment sQ began 128 bytes past a boundary)
        sQ = smem.allocate_tensor(fp4, q_smem.outer, byte_alignment=1024, swizzle=q_smem.inner)
        sK = smem.allocate_tensor(fp4, k_smem.outer, byte_alignment=1024, swizzle=k_smem.inner)
        sQSF = smem.allocate_tensor(self.sf_dtype, sfq_smem, byte_alignment=128)
        sKSF = smem.allocate_tensor(self.sf_dtype, sfk_smem, byte_alignment=128)
        sV = smem.allocate_tensor(self.v_dtype, v_smem.outer, byte_alignment=1024, swizzle=v_smem.inner)
        sVraw = smem.allocate_tensor(Uint8, cute.make_layout((TILE_N, self.v_rb, S),
                                                             stride=(self.v_rb, 1, TILE_N * self.v_rb)),
                                     byte_alignment=128)
        sKSraw = smem.allocate_tensor(Uint8, cute.make_layout((TILE_N * self.k_srb // 16, 16, S),
                                                              stride=(16, 1, TILE_N * self.k_srb)),
                                      byte_alignment=128)
        sVSraw = smem.allocate_tensor(Uint8, cute.make_layout((TILE_N * self.v_srb // 16, 16, S),
                                                              stride=(16, 1, TILE_N * self.v_srb)),
                                      byte_alignment=128)
        full, q_full, s_done, o_done = init_barriers(st, S, warp)

        # ---- tensor memory: S | O | P | SFQ | SFK -------------------------------------------------------------
        tmem, tmem_ptr = allocate_tmem(st, self.tmem_cols, self.threads)
        thr_qk = qk_mma.get_slice(0)
        thr_pv = pv_mma.get_slice(0)
        tStS, tOtO, tOrP, p_col = tmem_s_o_p(tmem_ptr, qk_mma, pv_mma, thr_pv, p_tmem, self.qk_tiler, self.pv_tiler,
                                             Float32, self.v_dtype)
        sf_col = p_col + TILE_N // 2
        tQSF_layout = blockscaled_utils.make_tmem_layout_sfa(qk_mma, self.qk_tiler, self.vec,
                                                             cute.slice_(sfq_smem, (None, None, None, 0)))
        tKSF_layout = blockscaled_utils.make_tmem_layout_sfb(qk_mma, self.qk_tiler, self.vec,
                                                             cute.slice_(sfk_smem, (None, None, None, 0)))
        tCtQSF = []
        col = sf_col
        for t in cutlass.range_constexpr(cfg.q_terms):
            tCtQSF.append(cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=self.sf_dtype), tQSF_layout))
            col = col + tcgen05.find_tmem_tensor_col_offset(tCtQSF[t])
        tCtKSF = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=self.sf_dtype), tKSF_layout)

        # ---- MMA operand views ----------------------------------------------------------------------------------
        tCrQ = qk_mma.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, q_terms)
        tCrK = qk_mma.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, stages)
        tCrV = pv_mma.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, 1)

        # ---- scale-factor SMEM -> TMEM copies (tcgen05.cp 4x32x128b) ----------------------------------------
        s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        s2t_q = []
        for t in cutlass.range_constexpr(cfg.q_terms):
            tq = cute.filter_zeros(tCtQSF[t])
            cp = tcgen05.make_s2t_copy(s2t_atom, tq)
            thr = cp.get_slice(0)
            src = tcgen05.get_s2t_smem_desc_tensor(cp, thr.partition_S(cute.filter_zeros(sQSF)))
            s2t_q.append((cp, src, thr.partition_D(tq)))
        tk = cute.filter_zeros(tCtKSF)
        s2t_k = tcgen05.make_s2t_copy(s2t_atom, tk)
        thr_k = s2t_k.get_slice(0)
        s2t_k_src = tcgen05.get_s2t_smem_desc_tensor(s2t_k, thr_k.partition_S(cute.filter_zeros(sKSF)))
        s2t_k_dst = thr_k.partition_D(tk)

        # ---- TMA partitions ----------------------------------------------------------------------------------
        q_tile0 = b * num_kv_heads + h  # 128-row tile of term 0; term t adds t * batch * num_kv_heads
        gQ = cute.local_tile(mQ, cute.slice_(self.qk_tiler, (None, 0, None)), (None, None, None))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                         cute.group_modes(thr_qk.partition_A(gQ), 0, 3))
        gQSF = cute.local_tile(mQSF, cute.slice_(self.qk_tiler, (None, 0, None)), (None, None, None))
        tQSFs, tQSFg = cpasync.tma_partition(tma_qsf, 0, cute.make_layout(1), cute.group_modes(sQSF, 0, 3),
                                             cute.group_modes(thr_qk.partition_A(gQSF), 0, 3))
        tQSFs = cute.filter_zeros(tQSFs)
        tQSFg = cute.filter_zeros(tQSFg)

        thr_piece = self._qk_mma(P).get_slice(0)
        gK = cute.local_tile(mK, cute.slice_(self.piece_tiler, (0, None, None)), (None, None, None))
        tCgK = thr_piece.partition_B(gK)
        gV = cute.local_tile(mV, (P, self.v_rb), (None, 0))
        gKS = cute.local_tile(mKS, (P * self.k_srb // 16, 16), (None, 0))
        gVS = cute.local_tile(mVS, (P * self.v_srb // 16, 16), (None, 0))
        tmas = (tma_k, tCgK, k_piece_smem, tma_v, gV, tma_ks, gKS, tma_vs, gVS)
        # ---- this split's tiles -------------------------------------------------------------------------------
        n_tiles = (kv_len + (TILE_N - 1)) // TILE_N
        first_t = Int32(0)  # window: the tile holding the first query's first visible key; no split reads before
        if cutlass.const_expr(cfg.window):
            first_t = sel(kv_len - seqlen_q > window_left, (kv_len - seqlen_q - window_left) // TILE_N, 0, Int32)
            n_tiles = sel(n_tiles > first_t, n_tiles, first_t, Int32)
        per = (n_tiles - first_t + num_splits - 1) // num_splits
        t_begin = first_t + split * per
        t_end = sel(t_begin + per < n_tiles, t_begin + per, n_tiles, Int32)
        n_my = sel(t_end > t_begin, t_end - t_begin, 0, Int32)

        # ---- prologue: Q (+ scales) and the first S tiles -----------------------------------------------------------
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(q_full, self.q_bytes)
            for t in cutlass.range_constexpr(cfg.q_terms):
                qt = q_tile0 + t * batch * num_kv_heads
                cute.copy(tma_q, tQg[(None, qt, 0, 0)], tQs[(None, t)], tma_bar_ptr=q_full)
                cute.copy(tma_qsf, tQSFg[(None, qt, 0, 0)], tQSFs[(None, t)], tma_bar_ptr=q_full)
            for s in cutlass.range_constexpr(S):
                if s < n_my:
                    self._issue_tile(t_begin + s, s, tmas, full, sK, sVraw, sKSraw, sVSraw, kv_len, b, h, mBT,
                                     max_blocks, num_blocks, num_kv_heads)

        # ---- per-thread row state ---------------------------------------------------------------------------
        r = tidx  # packed query row = TMEM lane
        i_q = r // G
        lim = kv_len - 1
        if cutlass.const_expr(cfg.causal):
            lim = kv_len - seqlen_q + i_q  # end-aligned causal mask
            if cutlass.const_expr(cfg.window):
                lim = lim + window_right
        lim = sel(lim < kv_len - 1, lim, kv_len - 1, Int32)
        low = Int32(0)  # window: this row's first visible key
        if cutlass.const_expr(cfg.window):
            low = kv_len - seqlen_q + i_q - window_left
        sl2 = scale_log2 * mQRS[(b * num_kv_heads + h) * ROWS + r]
        if cutlass.const_expr(cfg.k_fmt.has_global_scale):
            mKG = cute.make_tensor(cute.make_ptr(Float32, kg_addr, gmem, assumed_align=4),
                                   cute.make_layout(num_kv_heads))
            sl2 = sl2 * mKG[h]
        vg = Float32(1.0)
        if cutlass.const_expr(cfg.v_fmt.has_global_scale):
            mVG = cute.make_tensor(cute.make_ptr(Float32, vg_addr, gmem, assumed_align=4),
                                   cute.make_layout(num_kv_heads))
            vg = mVG[h]
        m_run = Float32(-math.inf)
        l_run = Float32(0.0)
        # TMEM <-> register copies of one row (thread = lane): S (fp32 x 128), P (16-bit x 128 as 64 words), O
        trow = TmemRow.make(tStS, tOtO, tmem_ptr, p_col, thr_qk, thr_pv, self.qk_tiler, self.pv_tiler, tidx)
        tSc = trow.tSc

        # ---- Q landed: its scales go to TMEM once (warp 0) ---------------------------------------------------
        cute.arch.mbarrier_wait(q_full, 0)

        # ---- main loop ---------------------------------------------------------------------------------------
        for it in cutlass.range(n_my, unroll=1):
            stage = it % S
            tile = t_begin + it
            cute.arch.mbarrier_wait(full + stage, (it // S) % 2)
            # K scales: raw rows -> the scale-factor atom (thread = token); V: dequantize one token row
            self._stage_k_scales(sKSraw, sKSF, stage, tidx)
            self._dequant_v(sVraw, sVSraw, sV, stage, tidx, tile * TILE_N + tidx < kv_len)
            cute.arch.fence_view_async_shared()  # generic-proxy SMEM writes -> visible to tcgen05.cp / mma
            cute.arch.sync_threads()
            tcgen05_fence("after_thread_sync")
            if warp == 0:
                if it == 0:
                    for t in cutlass.range_constexpr(cfg.q_terms):
                        cute.copy(s2t_q[t][0], s2t_q[t][1][(None, None, None, None, t)], s2t_q[t][2])
                cute.copy(s2t_k, s2t_k_src[(None, None, None, None, 0)], s2t_k_dst)
                for t in cutlass.range_constexpr(cfg.q_terms):
                    for kb in cutlass.range_constexpr(cute.size(tCrQ, mode=[2])):
                        qk_mma.set(tcgen05.Field.ACCUMULATE, t != 0 or kb != 0)
                        qk_mma.set(tcgen05.Field.SFA, tCtQSF[t][(None, None, kb)].iterator)
                        qk_mma.set(tcgen05.Field.SFB, tCtKSF[(None, None, kb)].iterator)
                        cute.gemm(qk_mma, tStS, tCrQ[(None, None, kb, t)], tCrK[(None, None, kb, stage)], tStS)
                with cute.arch.elect_one():
                    tcgen05.commit(s_done)
            wait_mma(s_done, it % 2)
            # this stage's buffers are free again: prefetch tile it + S into it
            if warp == 0:
                if it + S < n_my:
                    self._issue_tile(tile + S, stage, tmas, full, sK, sVraw, sKSraw, sVSraw, kv_len, b, h, mBT,
                                     max_blocks, num_blocks, num_kv_heads)

            # ---- online softmax, thread = row --------------------------------------------------------------
            rS = trow.load_s(Float32)
            mx = Float32(-math.inf)
            for i in cutlass.range_constexpr(cute.size(rS)):
                pos = tile * TILE_N + tSc[i][1]
                keep = pos <= lim
                x = rS[i] * sl2
                if cutlass.const_expr(cfg.softcap > 0.0):  # sl2 gives z / softcap: the capped log2-domain logit
                    x = capped_log2(x, cfg.softcap)
                x = sel(keep, x, Float32(-math.inf), Float32)
                if cutlass.const_expr(cfg.window):
                    x = sel(pos >= low, x, Float32(-math.inf), Float32)
                rS[i] = x
                mx = fmax(mx, x)
            m_run, corr, psum = softmax_exp2(rS, mx, m_run)
            rPw = trow.pack_p(rS, self.cfg.v_dtype == "bf16")  # column j of P = token j (TmemRow.make checks it)
            l_run = l_run * corr + psum
            trow.store_p(rPw)
            if it > 0:  # rescale O (the previous P.V has finished: o_done was waited on)
                trow.rescale_o(corr)
            tmem_stores_to_mma()
            if warp == 0:
                pv_mma = issue_pv_mma(pv_mma, tOtO, tOrP, tCrV, 0, it, o_done)
            wait_mma(o_done, it % 2)

        # ---- epilogue: thread = row; O / l (x V global scale), LSE in natural log -----------------------------------
        inv, lse = row_epilogue(m_run, l_run, vg)
        rO = trow.load_o(n_my)
        if r < rows:
            hq = h * G + r % G
            if cutlass.const_expr(cfg.split):
                mOp = cute.make_tensor(cute.make_ptr(Float32, o_addr, gmem, assumed_align=4),
                                       cute.make_layout(num_splits * batch * seqlen_q * Hq * D))
                base = (((split * batch + b) * seqlen_q + i_q) * Hq + hq) * D
                for i in cutlass.range_constexpr(cute.size(rO)):
                    mOp[base + trow.tOc[i][1]] = rO[i] * inv
                mLp = cute.make_tensor(cute.make_ptr(Float32, lse_addr, gmem, assumed_align=4),
                                       cute.make_layout(num_splits * batch * Hq * seqlen_q))
                mLp[((split * batch + b) * Hq + hq) * seqlen_q + i_q] = lse
            else:
                store_row(o_addr, lse_addr, self.out_dtype, rO, trow.tOc, inv, lse, batch, seqlen_q, Hq, D, b, i_q, hq)

        free_tmem(tmem, tmem_ptr)

    # ======================================================================================================
    # device helpers
    # ======================================================================================================
    def _issue_tile(self, tile, stage, tmas, full, sK, sVraw, sKSraw, sVSraw, kv_len, b, h, mBT, max_blocks,
                    num_blocks, num_kv_heads):
        """TMA of KV tile ``tile`` into ``stage``: per piece (one page, or a 128-token part of one), the K payload
        into the MMA's swizzled layout, the V payload and both scale runs as raw bytes. One mbarrier counts
        all bytes of the tile. Pieces past the sequence end read block 0 (masked later)."""
        cfg = self.cfg
        P, D = self.P, self.D
        tma_k, tCgK, k_piece_smem, tma_v, gV, tma_ks, gKS, tma_vs, gVS = tmas
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.kv_bytes)
        for i in range(self.n_pieces):
            token0 = tile * TILE_N + i * P
            valid = token0 < kv_len
            col = token0 // cfg.page_size  # kept in the table's row: a length past what it covers reads wrong
            col = sel(col < max_blocks, col, max_blocks - 1, Int32)  # numbers, never past the table
            bt_idx = sel(valid, b * max_blocks + col, b * max_blocks, Int32)
            blk = sel(valid, mBT[bt_idx], 0, Int32)
            blk = sel(blk < num_blocks, blk, num_blocks - 1, Int32)
            blk = sel(blk > 0, blk, 0, Int32)
            row0 = (blk * num_kv_heads + h) * cfg.page_size + token0 % cfg.page_size
            piece = row0 // P
            # element offset of piece i of the stage: a multiple of 16 rows x D FP4 (>= 512 B, whole swizzle atoms)
            sKp = cute.make_tensor(sK.iterator + cute.assume((stage * TILE_N + i * P) * D, 1024), k_piece_smem.outer)
            tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sKp, 0, 3),
                                             cute.group_modes(tCgK, 0, 3))
            cute.copy(tma_k, tKg[(None, piece, 0, 0)], tKs[(None, 0)], tma_bar_ptr=full + stage)
            for (sraw, rb, tma_r, g_r) in ((sVraw, self.v_rb, tma_v, gV), (sKSraw, self.k_srb, tma_ks, gKS),
                                           (sVSraw, self.v_srb, tma_vs, gVS)):
                if rb >= 16 and sraw is sVraw:
                    lay = cute.make_layout((P, rb), stride=(rb, 1))
                else:
                    lay = cute.make_layout((P * rb // 16, 16), stride=(16, 1))
                sRp = cute.make_tensor(sraw.iterator + stage * TILE_N * rb + i * P * rb, lay)
                tRs, tRg = cpasync.tma_partition(tma_r, 0, cute.make_layout(1), cute.group_modes(sRp, 0, 2),
                                                 cute.group_modes(g_r, 0, 2))
                cute.copy(tma_r, tRg[(None, piece)], tRs[(None, 0)] if cute.rank(tRs) > 1 else tRs,
                          tma_bar_ptr=full + stage)

    def _stage_k_scales(self, sKSraw, sKSF, stage, tidx):
        """Thread t copies token t's scale bytes (a pool row) into the tcgen05 scale-factor atom layout
        (``q_prepass.sf_atom_offset``: byte (t%32)*16 + (t//32)*4 + k%4 + 512*(k//4))."""
        ns, srb = self.k_ns, self.k_srb
        raw = cute.make_tensor(sKSraw.iterator + stage * TILE_N * srb, cute.make_layout(TILE_N * srb))
        dst = cute.make_tensor(cute.recast_ptr(sKSF.iterator, dtype=Uint8), cute.make_layout(TILE_N * ns))
        for k in range(ns):
            dst[(tidx % 32) * 16 + (tidx // 32) * 4 + (k % 4) + 512 * (k // 4)] = raw[tidx * srb + k]

    def _dequant_v(self, sVraw, sVSraw, sV, stage, tidx, valid):
        """Thread t dequantizes V row t of the stage into the P.V MMA's B operand (N = head_dim, K = token),
        E2M1 x block scale in fp32 (exact), rounded to the 16-bit V type (exact for nvfp4 in f16 and for MX in
        bf16, see decode_config.v_dtype_for). Tokens past the sequence end are zeroed (their P is 0, but garbage
        bytes could decode to NaN scales).

        Eight values at a time: one 32-bit payload word in, one 16-byte store out. Written value by value (128
        16-bit stores per row) it made ptxas spill up to ~490 bytes at D128 (255 registers); the values and the
        cells they land in are the same (checked by running both versions' PTX on all 128 threads)."""
        D, rb, srb, sb = self.D, self.v_rb, self.v_srb, self.v_sb
        # payload as 32-bit words: word c of a row = bytes 4c..4c+3 = values 8c..8c+7, value 8c+i in nibble i
        # (value d sits in byte d // 2, low nibble first; words are little endian)
        raw = cute.make_tensor(cute.recast_ptr(sVraw.iterator + stage * TILE_N * rb, dtype=Uint32),
                               cute.make_layout(TILE_N * rb // 4))
        sraw = cute.make_tensor(sVSraw.iterator + stage * TILE_N * srb, cute.make_layout(TILE_N * srb))
        tok = tidx
        # this token's head_dim in the B operand (D128: (64, 2):(1, 8192) elements from a 128-byte aligned row
        # start) in chunks of 8: chunk c = values 8c..8c+7, 8 consecutive elements at a 16-byte aligned address.
        # The 128B swizzle (S<3,4,3>: byte address bits 4-6 ^= bits 7-9) moves whole 16-byte units, so a chunk
        # stays 16 contiguous bytes in the same order: one 16-byte store fills exactly the cells that eight
        # 16-bit stores did. The 128-bit copy atom refuses at compile time a chunk that is not 8 unit-stride
        # elements at a 16-byte aligned address.
        chunks = cute.logical_divide(sV[((None, tok % 16), 0, tok // 16, 0)], cute.make_layout(8))
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.v_dtype, num_bits_per_copy=128)
        for blk in range(D // sb):
            sbyte = Uint32(sraw[tok * srb + blk])
            if cutlass.const_expr(self.cfg.v_fmt.scale_dtype == "e4m3"):
                scale = _e4m3_to_f32(sbyte)
            else:
                scale = _ue8m0_to_f32(sbyte)
            scale = sel(valid, scale, Float32(0.0), Float32)
            for c in range(blk * sb // 8, (blk + 1) * sb // 8):
                word = raw[tok * rb // 4 + c]
                vals = cute.make_rmem_tensor(cute.make_layout(8), self.v_dtype)
                for i in range(8):
                    vals[i] = (_e2m1_to_f32((word >> (4 * i)) & Uint32(0xF)) * scale).to(self.v_dtype)
                cute.copy(store, vals, chunks[(None, c)])


@dsl_user_op
def _e2m1_to_f32(code, *, loc=None, ip=None) -> Float32:
    """E2M1 code (low 4 bits) -> fp32, exact: magnitude 0, .5, 1, 1.5, 2, 3, 4, 6 by bits 0-2, sign bit 3.
    Built from bits: e = code>>1 & 3, m = code & 1; value = e ? 2^(e-1) * (1 + m/2) : m/2."""
    text = ("{\n\t.reg .b32 e, m, s, x, sub;\n\t.reg .pred pz;\n\t"
            "bfe.u32 e, $1, 1, 2;\n\t"
            "and.b32 m, $1, 1;\n\t"
            "shl.b32 s, $1, 28;\n\t"
            "and.b32 s, s, 0x80000000;\n\t"
            "add.u32 x, e, 126;\n\t"  # biased exponent of 2^(e-1)
            "shl.b32 x, x, 23;\n\t"
            "shl.b32 sub, m, 22;\n\t"  # mantissa bit: 1 + m/2
            "or.b32 x, x, sub;\n\t"
            "setp.eq.u32 pz, e, 0;\n\t"
            "selp.b32 sub, 0x3F000000, 0, pz;\n\t"  # e == 0: 0.5 * m
            "mul.lo.u32 sub, sub, m;\n\t"
            "selp.b32 x, sub, x, pz;\n\t"
            "or.b32 $0, x, s;\n\t}")
    return Float32(llvm.inline_asm(T.f32(), [Uint32(code).ir_value(loc=loc, ip=ip)], text, "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _e4m3_to_f32(byte, *, loc=None, ip=None) -> Float32:
    """E4M3FN byte -> fp32 via the hardware f16x2 conversion (exact), then f16 -> f32."""
    text = ("{\n\t.reg .b16 lo, hi, b;\n\t.reg .b32 h2;\n\t"
            "cvt.u16.u32 b, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 h2, b;\n\t"
            "mov.b32 {lo, hi}, h2;\n\t"
            "cvt.f32.f16 $0, lo;\n\t}")
    return Float32(llvm.inline_asm(T.f32(), [Uint32(byte).ir_value(loc=loc, ip=ip)], text, "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _ue8m0_to_f32(byte, *, loc=None, ip=None) -> Float32:
    """UE8M0 byte -> 2^(byte - 127) (byte 0 -> 2^-127, a subnormal, built as 0x00400000)."""
    text = ("{\n\t.reg .b32 x;\n\t.reg .pred z;\n\t"
            "shl.b32 x, $1, 23;\n\t"
            "setp.eq.u32 z, $1, 0;\n\t"
            "selp.b32 $0, 0x00400000, x, z;\n\t}")
    return Float32(llvm.inline_asm(T.f32(), [Uint32(byte).ir_value(loc=loc, ip=ip)], text, "=f,r",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def decode_sm100_compile_args() -> list:
    """Placeholder arguments of :meth:`DecodeSm100.__call__` to compile without a GPU (zero addresses)."""
    return [Int64(0)] * 13 + [Int32(1)] * 6 + [Float32(1.0), Int32(0), Int32(0), cute.runtime.make_fake_stream()]


def decode_sm100_cache_key(arch: str, cfg: DecodeConfigSm100) -> tuple:
    return (arch,) + cfg.key


def sm100_decode_variants(arch: str, kv_formats=None, head_dims=None, gqa=None, page_sizes=None, seqlen_q=None,
                          recent_windows=None, q_dtypes=None, sliding_window: bool = False, softcaps=None) -> list:
    """``qattn-warmup`` variants of the SM100 decode kernel, built through the launcher's own config choice
    (``qattn.interface.decode_sm100.sm100_config_for``'s rules): FP4 K and V formats only, causal, with and without
    split-KV (``sliding_window``: also each one's window twin; ``softcaps``: each one's twin per cap). Combinations the kernel rejects (ring windows,
    > 128 rows, non-FP4 formats, mxfp4 at head_dim 64) are skipped. Never ran on hardware: these variants are
    compiled for images, not tested."""
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm100.decode_config import HEAD_DIMS, PAGE_SIZES, ROWS
    from qattn.interface.variants import Variant
    from qattn.layouts.formats import FORMAT_NAMES, kv_format

    out, seen = [], set()
    if any(w for w in (recent_windows or [0])):
        return out
    for name in kv_formats or FORMAT_NAMES:
        parts = name.split("+")
        if len(parts) > 2 or any(p not in FORMAT_NAMES for p in parts):
            continue
        k_fmt, v_fmt = kv_format(parts[0]), kv_format(parts[-1])
        for d in [x for x in (head_dims or HEAD_DIMS) if x in HEAD_DIMS]:
            for g in gqa or [1, 4, 8]:
                for page in [p for p in (page_sizes or [16, 64, 128]) if p in PAGE_SIZES]:
                    for sq in seqlen_q or [1]:
                        if sq * g > ROWS:
                            continue
                        for qd in q_dtypes or ["bf16"]:
                            for split, window, cap in itertools.product(
                                    (False, True), (False, True) if sliding_window else (False,),
                                    [0.0] + [float(c) for c in softcaps or () if c]):
                                try:
                                    cfg = DecodeConfigSm100(k_fmt, v_fmt, d, qd, g, page, True, split, window=window,
                                                            softcap=cap)
                                except ValueError:  # a format / head_dim the SM100 kernel does not take
                                    continue
                                key = decode_sm100_cache_key(arch, cfg)
                                if key in seen:
                                    continue
                                seen.add(key)
                                build = (lambda cfg=cfg: compile_for_arch(
                                    DecodeSm100(cfg), *decode_sm100_compile_args(), arch=arch, keep_ptx=False)[0])
                                label = (f"{name} D{d} gqa{g} page{page} sq{sq}" + ("" if qd == "bf16" else f" {qd}")
                                         + (" split" if split else "") + (" window" if window else "")
                                         + (f" softcap {cap:g}" if cap else "") + " (sm100, never ran)")
                                out.append(Variant("decode", key, label, build))
    return out
