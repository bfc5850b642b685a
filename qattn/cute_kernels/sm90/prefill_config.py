"""Tile shapes and compile-time flags of the SM90 INT8-QK prefill kernel (``prefill_int8.py``).

The INT8 Q/K block sizes of the prepass are tied to these tiles (docs in ``qattn/quant/qk_int8.py``):

* one CTA owns ``tile_m`` = 128 query rows = ``block_q`` (or 192 with per_warp q scales, ``default_tile_m``); its
  MMA warpgroups own 64 rows each and every warp owns 16 consecutive rows = ``warp_q``, exactly the rows of the
  wgmma accumulator fragment of that warp. So a per-warp q scale is one scalar per thread and a per-block q scale
  one scalar per CTA;
* one K/V tile is ``tile_n`` = 128 keys = ``block_k``, so each tile has one k scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from qattn.cute_kernels.config_values import MAX_GRID_YZ, softcap_value

__all__ = ["PrefillConfig", "BLOCK_Q", "WARP_Q", "BLOCK_K", "HEAD_DIMS", "LONG_CAUSAL_KEYS", "LPT_GROUP_KV_BYTES",
           "LPT_GROUP_UNITS", "default_early_kv_wait", "default_intra_wg_overlap", "lpt_group", "seqlen_tile_m",
           "split_tail_plan"]

BLOCK_Q = 128
WARP_Q = 16
BLOCK_K = 128
HEAD_DIMS = (64, 128)
_V_DTYPES = ("bf16", "fp16")
_GRANULARITIES = ("per_warp", "per_block")
_PV_DTYPES = ("bf16", "fp8")


def default_tile_m(head_dim: int, granularity: str, pv_dtype: str = "bf16", causal: bool = False,
                   qk_dtype: str = "int8") -> int:
    """Query rows per CTA: 192 (three MMA warpgroups) or 128 (two). H100, B2 H16, kernel only, CUDA graph,
    outputs bit-identical.

    head_dim 64 with per_warp q scales: 192 (the softmax of a 64-row tile outlasts the other warpgroup's MMAs at
    D64, so a third one keeps the tensor cores fed). 16-bit P x V: S8K 1272.3 -> 1085.6 us, causal 723.6 ->
    608.8, S16K 4828.1 -> 4082.7, causal 2517.6 -> 2157.3, S2K 100.0 -> 94.5; short grids lose a little (B3
    S1000 causal 40.3 -> 43.8). FP8 P x V (which fits the 160 registers since the score bias lives in the
    accumulator, ``bias_in_acc``; ptxas keeps one register in local memory outside the loop): S8K 0.897x the
    time, causal 0.945x, S16K 0.861x, causal 0.932x, S2K 0.966x.

    head_dim 128 with per_warp q scales (int8 QK), FP8 P x V or non-causal: 192 with the serial loop
    (``intra_wg_overlap=False``; 3 x 64 rows with the overlap do not fit the registers). Time vs 128 rows with
    the overlap, interleaved A/B, three runs: 16-bit P x V S8K 0.981 / 0.981 / 0.961, S16K 0.926 / 0.928 / 0.921,
    S4K 1.004 / 0.999, S2K 1.003 / 1.005; FP8 P x V S8K 0.936 / 0.933, causal 0.903 / 0.889, S16K 0.907, causal
    0.939, S2K 0.978, causal 0.955. Causal 16-bit P x V stays at
    128 (S8K 0.986 / 1.044 / 1.020, S16K 0.969, S4K 1.000, S2K 1.025), except for dense grids of 3072 keys or
    more, where the interface asks for 192 (``seqlen_tile_m``). Everything else: 128."""
    if granularity != "per_warp":
        return BLOCK_Q
    if head_dim == 64 or (qk_dtype == "int8" and (pv_dtype == "fp8" or not causal)):
        return 3 * 64
    return BLOCK_Q


# dense causal grids at head_dim 128 with int8 Q K^T (per_warp q scales) and 16-bit P x V: from this many keys,
# 192-row tiles (``seqlen_tile_m``)
LONG_CAUSAL_KEYS = 3072


def seqlen_tile_m(head_dim: int, granularity: str, pv_dtype: str, causal: bool, qk_dtype: str,
                  seqlen_k: int) -> Optional[int]:
    """Dense grids: a query tile that depends on the key length, or None (``default_tile_m``, which has no length
    to go by). Causal, head_dim 128, int8 Q K^T with per_warp q scales, 16-bit P x V (``default_tile_m``: 128
    rows): 192 rows (three MMA warpgroups, serial loop) from ``LONG_CAUSAL_KEYS`` keys. H100, B2 H16, kernel
    only, each variant timed after 0.3 s of its own calls (the GPU at its power limit, ``bench_interleaved``),
    outputs bit-identical, time 192 / 128 rows with in-kernel / prepass Q, since a warpgroup skips the K/V tiles
    masked for all of its rows (which 192-row tiles have more of): S8K 0.967 / 0.948, S4K 0.980 / 0.984, S3K
    0.954 / 0.927, S2K 1.011 / 1.013 (B8: 0.977 / 0.982), S1K 1.18 / 1.15; B4 S4K 0.986 / 0.996. Before the skip:
    S16K 0.966 / 0.971, S8K 0.970 / 0.974, S4K 1.012 / 1.001, S2K 1.018 / 1.031."""
    if (causal and head_dim == 128 and granularity == "per_warp" and pv_dtype == "bf16" and qk_dtype == "int8"
            and seqlen_k >= LONG_CAUSAL_KEYS):
        return 3 * 64
    return None


def default_intra_wg_overlap(head_dim: int, tile_m: int) -> bool:
    """FA3's intra-warpgroup overlap, except with three MMA warpgroups at head_dim 128, where the scores, P and O
    of a 64-row tile (64 + 32 + 64 registers per thread) do not fit the 160 registers three warpgroups get."""
    return not (head_dim == 128 and tile_m == 3 * 64)


def default_early_kv_wait(head_dim: int, pv_dtype: str = "bf16") -> bool:
    """head_dim 128 with 16-bit P x V. H100, kernel only, CUDA graph, interleaved A/B, B2 H16, outputs identical:
    D128 S8K 0.986 / 0.992x the time, causal 0.986 / 0.973x, S16K 0.974 / 0.980x, S2K 0.980 / 0.978x; not at D64
    (three MMA warpgroups: S8K 1.11x, causal 1.02x) nor with FP8 P x V (1.01x)."""
    return head_dim == 128 and pv_dtype == "bf16"


# causal grids (lpt_group): (sequence, head) units per longest-first group, and the K + V bytes of all units up
# to which grouping pays
LPT_GROUP_UNITS = 8
LPT_GROUP_KV_BYTES = 64 << 20


def lpt_group(cfg: "PrefillConfig", num_units: int, q_per_kv: int, keys_per_unit: int) -> int:
    """Causal grids: how many of the ``num_units`` (sequence, q head) units run as one group whose query tiles go
    longest first, groups one after the other (``QKInt8PrefillSm90._causal_position``): the largest divisor of
    ``num_units`` up to ``LPT_GROUP_UNITS`` while the K and V of all units (``keys_per_unit`` keys each;
    ``q_per_kv`` q heads share a kv head) fit in ``LPT_GROUP_KV_BYTES``, else 1 (head by head, longest first). A
    runtime choice: it only shapes the grid. 1 for non-causal grids (equal work per CTA).

    H100, kernel only, CUDA graph, B2 H16 (32 units), groups of 8 vs head by head: D128 S2K (K + V 24 MiB) 0.900x
    the time, S4K (48 MiB) 0.947x, D64 S2K 0.846x, S4K 0.884x, S8K (48 MiB) 0.928 / 0.911x, FP8 P x V D128 S8K
    (64 MiB) 0.961 / 0.980x (one group of 32: 0.935, 0.993, 0.868, 0.892, 0.919, 0.994x). Larger K + V: D128 S8K
    (96 MiB) groups of 4 / 8 / 16 1.053 / 1.038 / 1.084x, S16K 1.004 / 1.022 / 1.039x, D64 S16K 0.970 / 0.984 /
    1.003x, so head by head there."""
    if not cfg.causal:  # equal work per CTA: nothing to order
        return 1
    k_bytes = 1 if cfg.qk_dtype == "int8" else 2
    unit_bytes = keys_per_unit * cfg.head_dim * (k_bytes + (1 if cfg.pv_dtype == "fp8" else 2)) / q_per_kv
    if num_units * unit_bytes > LPT_GROUP_KV_BYTES:
        return 1
    g = max(g for g in range(1, min(LPT_GROUP_UNITS, num_units) + 1) if num_units % g == 0)
    return g if num_units // g <= MAX_GRID_YZ else 1  # the groups are the grid's z


# split_tail_plan's cost model, in K/V tiles of one CTA: what a CTA costs besides its tiles (Q load and
# quantization, pipeline fill, epilogue), what a split CTA adds (its partial output written, the count, the
# merge), and the least saving worth a split (a fraction of the whole tail's cost)
_CTA_TILES = 6.0
_SPLIT_TILES = 4.0
_MIN_SAVING = 0.1
MAX_TAIL_SPLITS = 4


def split_tail_plan(num_units: int, num_kv_tiles: int, num_sms: int) -> tuple:
    """Dense non-causal grids (``PrefillConfig.split_tail``): ``(num_full_units, tail_splits)``.

    One CTA per SM (registers), every (query tile, head, sequence) unit the same work: ``num_units`` CTAs run in
    waves of ``num_sms``, and a last, partial wave of ``rem`` units leaves the other SMs idle for a whole unit
    (H100, B2 H16 with 192-row tiles: S8K 1376 units = 10 waves + 56, S4K 5 + 44). The first ``num_full_units``
    (whole waves) run as usual; each of the ``rem`` others is split into ``tail_splits`` CTAs over contiguous
    ranges of its K/V tiles, and the last of them to finish merges the partial outputs (LSE weights). The tail
    costs ``ceil(rem * s / num_sms)`` waves of ``_CTA_TILES + num_kv_tiles / s + _SPLIT_TILES`` tiles against
    one wave of ``_CTA_TILES + num_kv_tiles``; ``(num_units, 1)`` (no split) unless a split saves
    ``_MIN_SAVING`` of that.

    H100, kernel only, CUDA graph, B2 H16, 16-bit P x V, time split / whole units: D128 S8K (2 splits of 32
    tiles) 0.943, FP8 P x V 0.953, D64 0.960, FP8 0.988; S4K (3 of ~11) D128 0.940, FP8 0.957, D64 0.918. Short
    splits lose (the constants above come from these): S2K 3 of ~5 tiles 1.196 (D64 1.189), S1K 2 of 4 1.125.
    Fewer units than SMs (every unit split, D128): B1 H4 S2K 0.864, B1 H2 S4K 0.654 (FP8 0.663), B1 H1 S16K
    (two waves of splits) 0.838, B1 H2 S8K (two waves) 0.995."""
    full_waves, rem = divmod(num_units, num_sms)
    whole = _CTA_TILES + num_kv_tiles
    best_s, best = 1, whole
    for s in range(2, min(MAX_TAIL_SPLITS, num_kv_tiles) + 1):
        cost = -(-rem * s // num_sms) * (_CTA_TILES + num_kv_tiles / s + _SPLIT_TILES)
        if cost < best:
            best_s, best = s, cost
    if rem == 0 or best > (1 - _MIN_SAVING) * whole:
        return num_units, 1
    return full_waves * num_sms, best_s


@dataclass(frozen=True)
class PrefillConfig:
    head_dim: int
    v_dtype: str  # "bf16" | "fp16": V as given to the API and the output (and P, V in the 16-bit P x V)
    causal: bool
    granularity: str  # q scale granularity, "per_warp" | "per_block"
    varlen: bool = False
    kv_stages: int = 2
    pingpong: bool = True  # the two MMA warpgroups take turns issuing their wgmmas (named barriers)
    # query rows per CTA, 64 per MMA warpgroup: 128 (two warpgroups), or 192 (three, FlashAttention-3's choice at
    # head_dim 64, where the softmax outweighs the MMAs; per_warp q scales only, whose 16-row groups any multiple
    # of 16 covers). None: ``default_tile_m``.
    tile_m: Optional[int] = None
    tile_n: int = BLOCK_K
    # "bf16": P x V in V's 16-bit dtype (v_dtype); "fp8": P and V^T in E4M3 (V per-channel scaled, transposed and
    # key-permuted by the V prepass, ``qattn.quant.v_fp8``), two-level fp32 accumulation. Dense or varlen.
    pv_dtype: str = "bf16"
    # "int8": SageAttention-style int8 Q / K with fp32 scales; "bf16": Q and K in V's 16-bit dtype, no
    # quantization (flash_attn_func(qk_quant=None), the A/B baseline of the same kernel)
    qk_dtype: str = "int8"
    # True: Q arrives in V's 16-bit dtype and the kernel quantizes it itself (per_warp scales, the prepass's
    # numerics bit for bit), so the prepass only handles K: one read of Q instead of a read, an int8 write and
    # an int8 read
    quantize_q: bool = False
    # quantize_q only: multiply Q's channels by the prepass's power-of-two channel balance (``balance_qk``,
    # ``qattn.quant.qk_int8``) before quantizing, as the balanced Q prepass does
    balance_qk: bool = False
    # test (without blocking) during the softmax whether the next K tile and the V tile of the next P V have
    # landed, so the waits before the MMAs are skipped when they have. None: ``default_early_kv_wait``
    early_kv_wait: Optional[bool] = None
    # int8 QK: the score registers are set to the bias bits (0x4B400000; 16 shared loads of 16 bytes) once P has
    # left them and QK^T accumulates onto them, so the scores come out of the wgmma as biased floats (no integer
    # add per score after the wait). None: on with int8 QK (False: the add, for A/B), off with bf16 QK.
    bias_in_acc: Optional[bool] = None
    # FA3's intra-warpgroup overlap: QK^T(n) issued with P V(n-1) and the softmax of tile n run while P V(n-1)
    # executes (P and the scores live at once). False: one turn issues P V(n-1), waits for it and issues QK^T(n)
    # (P and the scores never live at once: 32 registers fewer per thread at head_dim 128)
    intra_wg_overlap: Optional[bool] = None  # None: ``default_intra_wg_overlap``
    # dense non-causal: a 1-D grid whose last, partial wave of units may be split over K/V ranges (runtime plan
    # ``split_tail_plan``; the last split CTA of a unit merges). None: on for dense non-causal grids.
    split_tail: Optional[bool] = None
    # sliding-window (local) attention, FlashAttention's ``window_size``: keys left of row i's window, j < i +
    # seqlen_k - seqlen_q - window_left (runtime ``window_left``; a huge one for a window with a right edge only),
    # are masked and the K/V tiles wholly left of a CTA's windows never loaded; with ``causal`` the right edge
    # moves to j <= i + seqlen_k - seqlen_q + window_right (runtime). Without it the window arguments are unused.
    local: bool = False
    # FlashAttention's ``softcap``: the logits z = scale * q.k become softcap * tanh(z / softcap) before the
    # softmax (Gemma 2, Grok). A compile-time constant (a model has one value); 0.0: off
    softcap: float = 0.0

    def __post_init__(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {self.head_dim}")
        if self.v_dtype not in _V_DTYPES:
            raise ValueError(f"v_dtype: expected one of {_V_DTYPES}, got {self.v_dtype!r}")
        if self.granularity not in _GRANULARITIES:
            raise ValueError(f"granularity: expected one of {_GRANULARITIES}, got {self.granularity!r}")
        if self.bias_in_acc is None:
            object.__setattr__(self, "bias_in_acc", self.qk_dtype == "int8")
        if self.early_kv_wait is None:
            object.__setattr__(self, "early_kv_wait", default_early_kv_wait(self.head_dim, self.pv_dtype))
        if self.tile_m is None:
            object.__setattr__(self, "tile_m", default_tile_m(self.head_dim, self.granularity, self.pv_dtype,
                                                              self.causal, self.qk_dtype))
        if self.intra_wg_overlap is None:
            object.__setattr__(self, "intra_wg_overlap", default_intra_wg_overlap(self.head_dim, self.tile_m))
        if self.split_tail is None:
            object.__setattr__(self, "split_tail", not (self.causal or self.varlen or self.local))
        if self.split_tail and (self.causal or self.varlen or self.local):
            raise ValueError("split_tail: only dense non-causal, non-local grids (equal work per CTA) split their "
                             "last wave")
        if self.tile_n != BLOCK_K or self.tile_m not in (BLOCK_Q, 3 * 64):
            raise ValueError("tile_m / tile_n: the prepass block sizes fix them to 128 x 128 (tile_m 192 with "
                             f"per_warp q scales), got {self.tile_m} x {self.tile_n}")
        if self.tile_m != BLOCK_Q and self.granularity != "per_warp":
            raise ValueError(f"tile_m: {self.tile_m} rows need per_warp q scales (a per_block scale covers 128 rows)")
        if self.intra_wg_overlap and not default_intra_wg_overlap(self.head_dim, self.tile_m):
            raise ValueError(f"intra_wg_overlap: {self.tile_m} rows at head_dim {self.head_dim} do not fit the "
                             "registers with the overlap; use intra_wg_overlap=False")
        if self.pv_dtype not in _PV_DTYPES:
            raise ValueError(f"pv_dtype: expected one of {_PV_DTYPES}, got {self.pv_dtype!r}")
        if self.qk_dtype not in ("int8", "bf16"):
            raise ValueError(f"qk_dtype: expected 'int8' or 'bf16', got {self.qk_dtype!r}")
        if self.qk_dtype == "bf16" and self.pv_dtype != "bf16":
            raise ValueError("pv_dtype: the unquantized QK path (qk_dtype 'bf16') runs P x V in V's dtype only")
        if self.quantize_q and (self.qk_dtype != "int8" or self.granularity != "per_warp"):
            raise ValueError("quantize_q: the kernel quantizes Q only for int8 QK with per_warp q scales")
        if self.balance_qk and not self.quantize_q:
            raise ValueError("balance_qk: only the in-kernel Q quantization (quantize_q) applies the balance; a "
                             "prepass-quantized Q carries it already")
        if self.bias_in_acc and self.qk_dtype != "int8":
            raise ValueError("bias_in_acc: only the int8 QK scores carry the bias")
        object.__setattr__(self, "softcap", softcap_value(self.softcap))
        if not 2 <= self.kv_stages <= 4:
            raise ValueError(f"kv_stages: expected 2..4, got {self.kv_stages}")

    @property
    def mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def key(self) -> tuple:
        """Everything that changes the generated code (the compile-cache key, arch excluded)."""
        pv = "pv_" + self.v_dtype if self.pv_dtype == "bf16" else "pv_fp8e4m3"
        qk = ("int8", "int8") if self.qk_dtype == "int8" else (self.v_dtype, self.v_dtype)
        if self.quantize_q:  # Q arrives in V's dtype
            qk = (self.v_dtype, "int8")
        flags = tuple(name for name, on in (("balance_qk", self.balance_qk), ("early_kv_wait", self.early_kv_wait),
                                            ("bias_in_acc", self.bias_in_acc),
                                            ("serial_wg", not self.intra_wg_overlap),
                                            ("split_tail", self.split_tail), ("local", self.local))
                      if on)
        return ("prefill_int8", self.head_dim, *qk, self.v_dtype, pv, self.causal,
                self.granularity, BLOCK_Q, WARP_Q, BLOCK_K, self.varlen, self.kv_stages, self.pingpong, self.tile_m,
                self.tile_n, "quantize_q" if self.quantize_q else "q_int8") + flags + (
                    (("softcap", self.softcap),) if self.softcap else ())
