"""Compile-time configuration of the SM100 (Blackwell) INT8-QK prefill kernel (``prefill_int8.py``).

Plain Python, no cutlass import: the launcher, the CPU emulation (``emulate_prefill.py``) and the tests read the
same choices from here. NOTE: no SM100 kernel of qattn has ever run on hardware (no Blackwell GPU was
available); this one is compiled for ``sm_100a`` on a CPU and its arithmetic is emulated in torch.

The block sizes are the SM90 prepass's (``qattn.quant.quantize_qk_int8``), so the scale tensors are the same
tensors with the same meaning on both architectures:

* one CTA owns ``BLOCK_Q`` = 128 query rows of one (batch, q head) = the tcgen05 MMA's M = the 128 TMEM lanes,
  thread t = lane t = row t. A q scale group (``WARP_Q`` = 16 rows per_warp, 128 rows per_block) is therefore
  one scalar per thread on SM100 too (a "warp" of the prepass is just a 16-row group here; the name is
  SageAttention's);
* one K/V tile is ``BLOCK_K`` = 128 keys = the QK MMA's N, so each tile has exactly one k scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from qattn.cute_kernels.config_values import softcap_value

__all__ = ["PrefillConfigSm100", "BLOCK_Q", "WARP_Q", "BLOCK_K", "HEAD_DIMS", "V_DTYPES", "GRANULARITIES"]

BLOCK_Q = 128  # query rows per CTA = MMA M = TMEM lanes = threads
WARP_Q = 16  # rows of a per_warp q scale group (the SM90 prepass's block size, kept for identical scales)
BLOCK_K = 128  # keys per K/V tile = QK MMA N = P.V MMA K; one k scale per tile
HEAD_DIMS = (64, 128)
V_DTYPES = ("bf16", "fp16")
GRANULARITIES = ("per_warp", "per_block")


@dataclass(frozen=True)
class PrefillConfigSm100:
    head_dim: int
    v_dtype: str  # "bf16" | "fp16": V, P (rounded before P.V) and the output
    causal: bool
    granularity: str  # q scale granularity of the prepass: "per_warp" (16 rows) | "per_block" (128 rows)
    kv_stages: int = 2  # TMA stages of the (K, V) tile ring
    # sliding window (FlashAttention's ``window_size``): keys j >= i + seqlen_k - seqlen_q - window_left (runtime)
    # and, with ``causal``, j <= i + seqlen_k - seqlen_q + window_right (runtime); a CTA starts at the K/V tile of
    # its first row's first key. Without it the window arguments are unused.
    local: bool = False
    # FlashAttention's ``softcap``: the logits z = softmax_scale * q.k become softcap * tanh(z / softcap) before the
    # softmax (SM90's semantics). A compile-time constant (a model has one cap); 0.0: off
    softcap: float = 0.0
    # packed sequences (FlashAttention's varlen layout, SM90's semantics): sequence i owns q rows cu_seqlens_q[i] ..
    # cu_seqlens_q[i+1] and key rows cu_seqlens_k[i] .. cu_seqlens_k[i+1], read by each CTA on the device; the
    # grid is (m blocks of max_seqlen_q, heads, sequences), masks and tile ranges per sequence.
    varlen: bool = False

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} is not supported by the SM100 prefill kernel; expected one "
                             f"of {HEAD_DIMS}")
        if self.v_dtype not in V_DTYPES:
            raise ValueError(f"v_dtype: expected one of {V_DTYPES}, got {self.v_dtype!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {self.granularity!r}")
        if self.kv_stages not in (1, 2, 3):
            raise ValueError(f"kv_stages: expected 1..3, got {self.kv_stages}")
        object.__setattr__(self, "softcap", softcap_value(self.softcap))  # 50 and 50.0: one key
        object.__setattr__(self, "varlen", bool(self.varlen))

    @property
    def q_group_rows(self) -> int:
        """Query rows sharing one q scale."""
        return WARP_Q if self.granularity == "per_warp" else BLOCK_Q

    @property
    def tmem_cols(self) -> int:
        """TMEM columns used: S (128 x 32-bit), O (head_dim x fp32), P (128 x 16-bit = 64 columns); the
        allocation is the next power of two (tcgen05.alloc takes 32..512, powers of two)."""
        used = BLOCK_K + self.head_dim + BLOCK_K // 2
        n = 32
        while n < used:
            n *= 2
        return n

    @property
    def key(self) -> tuple:
        """Everything that changes the generated code (the compile-cache key, arch excluded)."""
        return ("sm100_prefill_int8", self.head_dim, "int8", "int8", self.v_dtype, "pv_" + self.v_dtype,
                self.causal, self.granularity, BLOCK_Q, WARP_Q, BLOCK_K, self.kv_stages) + (
                    ("local",) if self.local else ()) + (
                    (("softcap", self.softcap),) if self.softcap else ()) + (
                    ("varlen",) if self.varlen else ())  # dense keys unchanged
