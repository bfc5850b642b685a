"""Tile shapes and compile-time flags of the SM90 INT8-QK prefill kernel (``prefill_int8.py``).

The INT8 Q/K block sizes of the prepass are tied to these tiles (docs in ``qattn/quant/qk_int8.py``):

* one CTA owns ``tile_m`` = 128 query rows = ``block_q``; its two MMA warpgroups own 64 rows each and every warp
  owns 16 consecutive rows = ``warp_q``, exactly the rows of the wgmma accumulator fragment of that warp. So a
  per-warp q scale is one scalar per thread and a per-block q scale one scalar per CTA;
* one K/V tile is ``tile_n`` = 128 keys = ``block_k``, so each tile has one k scale.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefillConfig", "BLOCK_Q", "WARP_Q", "BLOCK_K", "HEAD_DIMS"]

BLOCK_Q = 128
WARP_Q = 16
BLOCK_K = 128
HEAD_DIMS = (64, 128)
_V_DTYPES = ("bf16", "fp16")
_GRANULARITIES = ("per_warp", "per_block")
_PV_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class PrefillConfig:
    head_dim: int
    v_dtype: str  # "bf16" | "fp16": V as given to the API and the output (and P, V in the 16-bit P x V)
    causal: bool
    granularity: str  # q scale granularity, "per_warp" | "per_block"
    varlen: bool = False
    kv_stages: int = 2
    pingpong: bool = True  # the two MMA warpgroups take turns issuing their wgmmas (named barriers)
    tile_m: int = BLOCK_Q
    tile_n: int = BLOCK_K
    # "bf16": P x V in V's 16-bit dtype (v_dtype); "fp8": P and V^T in E4M3 (V per-channel scaled, transposed and
    # key-permuted by the V prepass, ``qattn.quant.v_fp8``), two-level fp32 accumulation. Dense only so far.
    pv_dtype: str = "bf16"
    # "int8": SageAttention-style int8 Q / K with fp32 scales; "bf16": Q and K in V's 16-bit dtype, no
    # quantization (flash_attn_func(qk_quant=None), the A/B baseline of the same kernel)
    qk_dtype: str = "int8"

    def __post_init__(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {self.head_dim}")
        if self.v_dtype not in _V_DTYPES:
            raise ValueError(f"v_dtype: expected one of {_V_DTYPES}, got {self.v_dtype!r}")
        if self.granularity not in _GRANULARITIES:
            raise ValueError(f"granularity: expected one of {_GRANULARITIES}, got {self.granularity!r}")
        if (self.tile_m, self.tile_n) != (BLOCK_Q, BLOCK_K):
            raise ValueError("tile_m / tile_n: the prepass block sizes fix them to 128 x 128")
        if self.pv_dtype not in _PV_DTYPES:
            raise ValueError(f"pv_dtype: expected one of {_PV_DTYPES}, got {self.pv_dtype!r}")
        if self.pv_dtype == "fp8" and self.varlen:
            raise ValueError("pv_dtype: 'fp8' is implemented for dense (non-varlen) prefill only")
        if self.qk_dtype not in ("int8", "bf16"):
            raise ValueError(f"qk_dtype: expected 'int8' or 'bf16', got {self.qk_dtype!r}")
        if self.qk_dtype == "bf16" and self.pv_dtype != "bf16":
            raise ValueError("pv_dtype: the unquantized QK path (qk_dtype 'bf16') runs P x V in V's dtype only")
        if not 2 <= self.kv_stages <= 4:
            raise ValueError(f"kv_stages: expected 2..4, got {self.kv_stages}")

    @property
    def key(self) -> tuple:
        """Everything that changes the generated code (the compile-cache key, arch excluded)."""
        pv = "pv_" + self.v_dtype if self.pv_dtype == "bf16" else "pv_fp8e4m3"
        qk = ("int8", "int8") if self.qk_dtype == "int8" else (self.v_dtype, self.v_dtype)
        return ("prefill_int8", self.head_dim, *qk, self.v_dtype, pv, self.causal,
                self.granularity, BLOCK_Q, WARP_Q, BLOCK_K, self.varlen, self.kv_stages, self.pingpong, self.tile_m,
                self.tile_n)
