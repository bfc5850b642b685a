"""Compile-time configuration of the SM100 (Blackwell) paged decode kernel.

Plain Python, no cutlass import: the launcher, the CPU emulation (``emulate.py``) and the tests read the same
choices from here. NOTE: no SM100 kernel of qattn has ever run on hardware (no Blackwell GPU was available);
they are compiled for ``sm_100a`` on a CPU and their arithmetic is emulated in torch.

Which block-scaled tcgen05 MMA a K format gets, and how Q is quantized for it (the MMA wants *both* operands
block-scaled along the reduction axis, head_dim):

| K format    | MMA (kind)                      | Q operand                                  | scale block |
|-------------|---------------------------------|--------------------------------------------|-------------|
| nvfp4       | MmaMXF4NVF4Op (mxf4nvf4)        | NVFP4: E2M1 + E4M3 block scale + fp32/row  | 16          |
| mxfp4_b16   | MmaMXF4NVF4Op (mxf4nvf4), UE8M0 | E2M1 + UE8M0 block scale                   | 16          |
| mxfp4       | MmaMXF4Op (mxf4)                | E2M1 + UE8M0 block scale (MXFP4)           | 32          |

(The MXF8F6F4 form, FP8 Q x FP4 K with UE8M0 block-32 scales, would quantize Q far more finely for mxfp4 K;
it needs the FP4 K tile unpacked to one byte per element in shared memory (TMA U4_UNPACK_U8). Not built yet:
see docs/sm100.md.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from qattn.cute_kernels.config_values import softcap_value
from qattn.layouts.formats import KVFormat

TILE_N = 128  # tokens per KV tile = the QK MMA's N and the PV MMA's K
ROWS = 128  # the MMA M: packed query rows (seqlen_q x GQA group), zero-padded to 128
HEAD_DIMS = (64, 128)
PAGE_SIZES = (16, 32, 64, 128, 256)
Q_TERMS = (1, 2)


def qk_kind(k_fmt: KVFormat) -> str:
    """``"nvf4"`` (MXF4NVF4, E4M3 scales, block 16), ``"mxf4_b16"`` (MXF4NVF4 with UE8M0, block 16) or
    ``"mxf4"`` (MXF4, UE8M0, block 32): the block-scaled MMA of a K format. Others raise."""
    if k_fmt.payload != "e2m1":
        raise ValueError(f"k format: the SM100 decode kernel reads FP4 keys (nvfp4 / mxfp4 / mxfp4_b16), got "
                         f"{k_fmt.name}")
    if k_fmt.scale_dtype == "e4m3":
        return "nvf4"
    return "mxf4_b16" if k_fmt.scale_block == 16 else "mxf4"


def v_dtype_for(v_fmt: KVFormat) -> str:
    """The 16-bit type V is dequantized to for the P.V MMA: f16 for nvfp4 (e2m1 x e4m3 is exact in f16 and P
    keeps 11 bits), bf16 for MX scales (2^-127..2^127 only fit bf16's exponent range)."""
    if v_fmt.payload != "e2m1":
        raise ValueError(f"v format: the SM100 decode kernel reads FP4 values, got {v_fmt.name}")
    return "f16" if v_fmt.scale_dtype == "e4m3" else "bf16"


@dataclass(frozen=True)
class DecodeConfigSm100:
    k_fmt: KVFormat
    v_fmt: KVFormat
    head_dim: int
    q_dtype: str  # "bf16" / "f16": the caller's q and the output dtype
    group: int  # query heads per kv head
    page_size: int
    causal: bool
    split: bool  # fp32 partial O + LSE for combine.py instead of the output
    q_terms: int = 2  # Q = sum of q_terms FP4 tensors (2, default: residual split, ~8x less Q error; 1: plain)
    stages: int = 2  # TMA stages of the (K payload, K scales, V payload, V scales) tile
    # sliding window (FlashAttention's ``window_size``): row i_q sees positions >= len - seqlen_q + i_q -
    # window_left (runtime) and, with ``causal``, <= len - seqlen_q + i_q + window_right (runtime); the splits
    # share the tiles from the one holding the first query's first visible key. Without it the window
    # arguments are unused.
    window: bool = False
    # FlashAttention's ``softcap`` (compile time): scores z become softcap * tanh(z / softcap); 0.0: off
    softcap: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} not supported by the SM100 decode kernel; expected one of "
                             f"{HEAD_DIMS}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: {self.page_size} is not one of {PAGE_SIZES}")
        if self.q_dtype not in ("bf16", "f16"):
            raise ValueError(f"q_dtype: expected 'bf16' or 'f16', got {self.q_dtype!r}")
        if not 1 <= self.group <= ROWS:
            raise ValueError(f"group: {self.group} query heads per kv head does not fit {ROWS} rows")
        if self.q_terms not in Q_TERMS:
            raise ValueError(f"q_terms: expected 1 or 2, got {self.q_terms}")
        qk_kind(self.k_fmt)
        v_dtype_for(self.v_fmt)
        if (self.head_dim // self.sf_vec) % 4:
            raise ValueError(f"head_dim: {self.head_dim} gives {self.head_dim // self.sf_vec} block scales per row; the "
                             "tcgen05 scale-factor atom holds 4 along K (mxfp4 block 32 needs head_dim 128)")
        for f in (self.k_fmt, self.v_fmt):
            f.check_head_dim(self.head_dim)
        object.__setattr__(self, "softcap", softcap_value(self.softcap))

    @property
    def kind(self) -> str:
        return qk_kind(self.k_fmt)

    @property
    def sf_vec(self) -> int:
        return 32 if self.kind == "mxf4" else 16

    @property
    def q_scale(self) -> str:
        """Scale dtype of the quantized Q: the K format's (the MMA takes one scale type for both operands)."""
        return "e4m3" if self.kind == "nvf4" else "ue8m0"

    @property
    def v_dtype(self) -> str:
        return v_dtype_for(self.v_fmt)

    @property
    def piece(self) -> int:
        """Tokens per TMA box: a tile of 128 tokens is one piece of a page (page >= 128) or 128 / page whole pages."""
        return min(self.page_size, TILE_N)

    @property
    def key(self) -> tuple:
        f = lambda x: (x.payload, x.scale_dtype, x.scale_block, x.has_global_scale)  # noqa: E731
        return ("sm100_decode", f(self.k_fmt), f(self.v_fmt), self.head_dim, self.q_dtype, self.group,
                self.page_size, self.causal, self.split, self.q_terms, self.stages) + (
                    ("window",) if self.window else ()) + ((("softcap", self.softcap),) if self.softcap else ())


@functools.lru_cache(maxsize=512)  # eager decode asks on every call: host-known facts only
def tcgen05_takes(k_fmt: KVFormat, v_fmt: KVFormat, head_dim: int, page_size: int, q_dtype: str, group: int,
                  seqlen_q: int, ring_window: int = 0, sink_tokens: int = 0) -> bool:
    """Whether the tcgen05 decode kernel of this file takes a call: FP4 K and V (its block-scaled MMA), no
    recent-token ring or sink buffer, at most 128 packed query rows, a page size and head_dim it knows (mxfp4's
    block 32 needs head_dim 128). On compute capability 10.0 every other call runs the portable mma.sync decode
    kernel (``qattn.cute_kernels.sm90.decode.DecodeSm90``, compiled for sm_100a): the one place that rule lives,
    used by the launcher and by ``qattn-warmup``."""
    if ring_window or sink_tokens or seqlen_q * group > ROWS:
        return False
    try:
        DecodeConfigSm100(k_fmt, v_fmt, head_dim, q_dtype, group, page_size, True, False)
    except ValueError:  # a format, head_dim or page size the kernel does not take
        return False
    return True


def check_rows(seqlen_q: int, group: int) -> None:
    """v0 packs all query rows of a kv head into one 128-row M tile."""
    if seqlen_q * group > ROWS:
        raise ValueError(f"q: seqlen_q * (num_heads / num_kv_heads) = {seqlen_q} * {group} exceeds {ROWS} query rows "
                         "per kv head (the SM100 decode kernel's one M tile)")
