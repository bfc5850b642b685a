"""Compile-time configuration of the SM90 paged decode kernel, and the split-KV heuristic.

Everything here is a plain Python value: a :class:`DecodeConfig` is what the kernel class is built from and
(through :attr:`DecodeConfig.key`) what the compile cache is keyed by.

Work split (see ``decode.py`` for the why):
    CTA     = one (split, kv head, m-block, sequence); the query rows of that kv head packed together
              (rows = seqlen_q x group, row r = i_q * group + h_in_group). Up to 128 rows one CTA holds them all;
              129..256 rows take ``m_blocks`` = 2 CTAs of 128 rows each (each reads the same K/V, mostly from L2):
              a 16-warp CTA would need twice the registers and merge buffers of an SM's share.
    narrow  = rows <= 8 (decode with GQA <= 8): the MMAs run transposed, tokens / head dims on M and the query rows
              on N = 8 (decode.py, "Narrow tiles"); row_tiles is 1 and the warps only split tokens.
    warps   = max(4, row_tiles); warp w owns row tile ``w % row_tiles`` (16 rows, one mma M) and token group
              ``w // row_tiles``: with few rows the warps of a CTA split every KV tile between them (flash-decoding
              inside the CTA) and merge their softmax states in shared memory at the end.
    tile_n  = 64 or 128 tokens of K and V per pipeline stage (any page size: a tile is a piece of one page or
              several whole pages, both contiguous runs in the pools), ``stages`` deep (2: cp.async double
              buffering; 3-4 with QATTN_DECODE_STAGES, no faster on an H100). See :func:`default_tile_n`.
    ring    = caches with a recent-token window W: each sequence's newest min(len, W) tokens come from the bf16
              ring, older ones from the pages. Ring tiles (``ring_tile_n`` tokens, one bf16 row per token) follow
              the page tiles in the tile list, so split-KV needs no special case: the ring tiles land in the last
              split(s). A ring tile's stage buffers share shared memory with a page tile's (a union per stage).
    sink    = caches with ``sink_tokens`` N > 0: each sequence's first min(len, N) tokens come from the bf16 sink
              buffer, in one sink tile (``sink_tile_n`` >= N tokens, the ring tile's buffers), and the page
              tiles start at position N. Order: page tiles, the sink tile, ring tiles; so all the bf16 tiles
              are at the end of the list (one switch of Q's MMA type and of the V global scale per CTA, as for
              the ring alone) and, with split-KV, the sink tile is in the split just before the ring tiles.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

from qattn.cute_kernels.config_values import softcap_value
from qattn.layouts.formats import KVFormat

TILE_N = 64
STAGES = 2  # cp.async stages of K/V tiles (stages - 1 tiles in flight while one is computed)
ROWS_PER_CTA = 128  # 8 row tiles = 8 warps
MAX_ROWS = 256  # seqlen_q * group: spec range seqlen_q 1..16 x GQA 1..16; m_blocks = 2 CTAs above 128
HEAD_DIMS = (64, 128)
NARROW_ROWS = 8  # up to this many packed query rows, the transposed ("narrow") MMA layout
PAGE_SIZES = (16, 32, 64, 128, 256)


def _read_key(fmt: KVFormat) -> tuple:
    """What of a format changes the decode code: its encoding, not the rule that chose its scales (mxfp4
    floor and rceil caches share one variant)."""
    return (fmt.payload, fmt.scale_dtype, fmt.scale_block, fmt.has_global_scale)


def default_tile_n(k_fmt: KVFormat, v_fmt: KVFormat) -> int:
    """128-token tiles when K and V are both quantized (more bytes in flight per CTA: nvfp4 B32x8K went from
    166 to 153 us on an H100), 64 when either is bf16 (a 128-token bf16 stage pair needs ~160 KB of smem, one CTA
    per SM, and measured no faster)."""
    return TILE_N if "bf16" in (k_fmt.payload, v_fmt.payload) else 2 * TILE_N


def _check_rows(rows: int) -> None:
    if rows < 1 or rows > MAX_ROWS:
        raise ValueError(f"rows: seqlen_q * (num_heads / num_kv_heads) must be in [1, {MAX_ROWS}], got {rows}")


def row_tiles_for(rows: int) -> int:
    """Row tiles of 16 per CTA for ``rows`` packed query rows, rounded up to a power of two (1, 2, 4, 8)."""
    _check_rows(rows)
    t = 1
    while t * 16 < min(rows, ROWS_PER_CTA):
        t *= 2
    return t


def m_blocks_for(rows: int) -> int:
    """CTAs per (split, kv head, sequence) that share the ``rows`` packed query rows, 128 rows each."""
    _check_rows(rows)
    return -(-rows // ROWS_PER_CTA)


class DecodeTuning(NamedTuple):
    tile_n: Optional[int]  # None: default_tile_n
    min_warps: int
    stages: Optional[int]  # None: STAGES
    wide: bool  # True: no narrow tiles (A/B runs)


@functools.lru_cache(maxsize=1)
def tuning_from_env() -> DecodeTuning:
    """``DecodeTuning(tile_n or None, min_warps, stages or None, wide)`` from ``QATTN_DECODE_TILE_N`` (64 / 128),
    ``QATTN_DECODE_WARPS`` (4 / 8), ``QATTN_DECODE_STAGES`` (2 / 3 / 4) and ``QATTN_DECODE_WIDE`` (1: the
    untransposed MMA layout even for <= 8 rows, for A/B runs), read once per process (tuning runs set them before
    the first call; ``cache_clear()`` re-reads). All end up in the compile key through the :class:`DecodeConfig`
    they shape."""
    tn = os.environ.get("QATTN_DECODE_TILE_N")
    if tn is not None and tn not in ("64", "128"):
        raise ValueError(f"QATTN_DECODE_TILE_N: expected 64 or 128, got {tn!r}")
    w = os.environ.get("QATTN_DECODE_WARPS", "4")
    if w not in ("4", "8"):
        raise ValueError(f"QATTN_DECODE_WARPS: expected 4 or 8, got {w!r}")
    st = os.environ.get("QATTN_DECODE_STAGES")
    if st is not None and st not in ("2", "3", "4"):
        raise ValueError(f"QATTN_DECODE_STAGES: expected 2, 3 or 4, got {st!r}")
    wide = os.environ.get("QATTN_DECODE_WIDE", "0")
    if wide not in ("0", "1"):
        raise ValueError(f"QATTN_DECODE_WIDE: expected 0 or 1, got {wide!r}")
    return DecodeTuning(None if tn is None else int(tn), int(w), None if st is None else int(st), wide == "1")


def tile_n_for(k_fmt: KVFormat, v_fmt: KVFormat) -> int:
    """Tokens per page tile: ``default_tile_n`` unless ``QATTN_DECODE_TILE_N`` overrides it."""
    tn = tuning_from_env().tile_n
    return default_tile_n(k_fmt, v_fmt) if tn is None else tn


def choose_config(k_fmt: KVFormat, v_fmt: KVFormat, head_dim: int, page_size: int, q_dtype: str, group: int,
                  seqlen_q: int, causal: bool, split: bool, ring_window: int = 0,
                  ring_dtype: str = "bf16", sink_tokens: int = 0, window: bool = False,
                  softcap: float = 0.0) -> "DecodeConfig":
    """The :class:`DecodeConfig` a decode call uses: the one place the launcher and ``qattn-warmup`` get it
    from, so a warmed variant has exactly the runtime key."""
    rows = seqlen_q * group
    tile_n = tile_n_for(k_fmt, v_fmt)
    # 8 warps split a tile 8 ways only when it has 8 x 16 tokens
    tuning = tuning_from_env()
    min_warps = tuning.min_warps if tile_n >= 128 else 4
    stages = tuning.stages or STAGES
    return DecodeConfig(k_fmt, v_fmt, head_dim, q_dtype, group, row_tiles_for(rows), page_size, bool(causal),
                        bool(split), tile_n=tile_n, stages=stages, min_warps=min_warps,
                        m_blocks=m_blocks_for(rows),
                        ring_window=int(ring_window), sink_tokens=int(sink_tokens),
                        ring_dtype=ring_dtype if (ring_window or sink_tokens) else "bf16",
                        narrow=rows <= NARROW_ROWS and not tuning.wide, window=bool(window), softcap=softcap)


@dataclass(frozen=True)
class DecodeConfig:
    k_fmt: KVFormat
    v_fmt: KVFormat
    head_dim: int
    q_dtype: str  # "bf16" or "f16" (also the output dtype)
    group: int  # query heads per kv head
    row_tiles: int  # 16-row tiles per CTA (1, 2, 4, 8): the seqlen_q bucket is rows <= 16 * row_tiles * m_blocks
    page_size: int
    causal: bool
    split: bool  # write fp32 partial O + LSE for the combine kernel, instead of the output
    tile_n: int = TILE_N
    stages: int = STAGES
    min_warps: int = 4  # 4 or 8: with few rows, more warps split each tile's tokens (more latency hiding)
    m_blocks: int = 1  # CTAs sharing one (split, kv head, sequence)'s rows: 2 for 129..256 rows (8 row tiles each)
    ring_window: int = 0  # recent-token window W of the cache (0: no ring); compile time, so p % W is cheap
    ring_dtype: str = "bf16"  # the ring's and the sink's dtype ("bf16" / "f16", the cache's), their tiles' MMA type
    sink_tokens: int = 0  # N first tokens read from the sink buffer (0: none); compile time: the page tiles' start
    # rows <= 8: the MMAs run transposed, S^T = K Q^T and O^T = V^T P^T, with tokens / head dims as the 16-row M
    # side and the query rows as the 8-column N side (see decode.py, "Narrow tiles")
    narrow: bool = False
    # sliding window (flash_attn_with_kvcache's ``window_size``): query i sees keys j >= i + len - seqlen_q -
    # window_left (runtime), and with ``causal`` j <= i + len - seqlen_q + window_right (runtime); the tiles left
    # of the first query's window are never loaded (with a ring or sink: of each part of the tile list).
    window: bool = False
    # FlashAttention's ``softcap`` (compile time): scores z become softcap * tanh(z / softcap); 0.0: off
    softcap: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} not supported by the SM90 decode kernel; expected one of {HEAD_DIMS}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: {self.page_size} is not one of {PAGE_SIZES}")
        if self.q_dtype not in ("bf16", "f16"):
            raise ValueError(f"q_dtype: expected 'bf16' or 'f16', got {self.q_dtype!r}")
        if self.row_tiles not in (1, 2, 4, 8):
            raise ValueError(f"row_tiles: expected 1, 2, 4 or 8, got {self.row_tiles}")
        if self.m_blocks not in (1, 2) or (self.m_blocks > 1 and self.row_tiles != 8):
            raise ValueError(f"m_blocks: expected 1, or 2 with 8 row tiles (rows <= {MAX_ROWS}), got "
                             f"{self.m_blocks} with {self.row_tiles} row tiles")
        if self.narrow and (self.row_tiles != 1 or self.m_blocks != 1 or self.group > NARROW_ROWS):
            raise ValueError(f"narrow: only for rows <= {NARROW_ROWS} (one row tile), got group {self.group}, "
                             f"{self.row_tiles} row tiles, {self.m_blocks} m-blocks")
        if not 1 <= self.group <= self.max_rows:
            raise ValueError(f"group: {self.group} query heads per kv head does not fit {self.max_rows} rows")
        if not isinstance(self.ring_window, int) or self.ring_window < 0:
            raise ValueError(f"ring_window: expected an int >= 0, got {self.ring_window!r}")
        if not isinstance(self.sink_tokens, int) or not 0 <= self.sink_tokens <= self.sink_tile_n:
            raise ValueError(f"sink_tokens: expected an int in [0, {self.sink_tile_n}] (one sink tile), "
                             f"got {self.sink_tokens!r}")
        if self.ring_dtype not in ("bf16", "f16"):
            raise ValueError(f"ring_dtype: expected 'bf16' or 'f16', got {self.ring_dtype!r}")
        for f in (self.k_fmt, self.v_fmt):
            f.check_head_dim(self.head_dim)
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages: expected 2, 3 or 4, got {self.stages}")
        if self.min_warps not in (4, 8):
            raise ValueError(f"min_warps: expected 4 or 8, got {self.min_warps}")
        if self.tile_n % (16 * self.token_groups):
            raise ValueError("tile_n: must give every token group whole 16-token chunks")
        object.__setattr__(self, "softcap", softcap_value(self.softcap))

    # --- derived ------------------------------------------------------------------------------------
    @property
    def num_warps(self) -> int:
        return max(self.min_warps, self.row_tiles)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def token_groups(self) -> int:
        return self.num_warps // self.row_tiles

    @property
    def max_rows(self) -> int:
        """Packed query rows (seqlen_q x group) a launch of this variant can hold."""
        return NARROW_ROWS if self.narrow else 16 * self.row_tiles * self.m_blocks

    @property
    def ring_tile_n(self) -> int:
        """Tokens per ring tile: 64 (32 KB of bf16 K+V per stage at D=128) unless 8 token groups need 128."""
        return max(64, 16 * self.token_groups)

    @property
    def sink_tile_n(self) -> int:
        """Tokens of the sink tile (it uses the ring tile's stage buffers): at least 64, so any N <= 64 fits."""
        return self.ring_tile_n

    @property
    def key(self) -> tuple:
        """Everything that changes the generated code (the arch is added by the caller)."""
        return ("sm90_decode", _read_key(self.k_fmt), _read_key(self.v_fmt), self.head_dim, self.q_dtype, self.group,
                self.row_tiles, self.page_size, self.causal, self.split, self.tile_n, self.stages, self.min_warps,
                self.m_blocks, self.ring_window, self.ring_dtype, self.sink_tokens, self.narrow) + (
                    ("window",) if self.window else ()) + ((("softcap", self.softcap),) if self.softcap else ())


def num_splits_heuristic(batch: int, num_kv_heads: int, max_context: int, num_sms: int, *,
                         tile_n: int = TILE_N, max_splits: int = 64, min_tiles_per_split: int = 4,
                         ctas_per_sm: int = 2) -> int:
    """Splits of the KV range so that a launch fills the GPU evenly.

    Uses only host-known sizes (``max_context`` = block_table columns x page size, an upper bound of the
    sequence lengths) so that choosing it needs no device sync. One CTA per (sequence, kv head) is enough when
    there are already a wave of them. Otherwise the time is set by the busiest SM: ``ceil(CTAs / SMs)`` CTAs of
    ``ceil(tiles / splits)`` tiles each, and an SM holding a single CTA (4 warps) works ~1.25x slower per tile
    than one holding two (H100, nvfp4 GQA 32/8 D128: B8 x 32K, 1 CTA of 128 tiles per SM 197 us, 2 CTAs of 64
    tiles 157 us; 2 or 3 CTAs of equal total tiles ran equally fast). The choice minimises that cost over
    ``splits`` with at most ``ctas_per_sm`` CTAs per SM (one wave: 2 fit every format's registers and shared
    memory; a second partial wave or a 3-vs-2 imbalance cost up to 30 %), the fewest splits on a tie, and never
    fewer than ``min_tiles_per_split`` tiles per split. Measured against the former rule (ceil(2 SMs / CTAs)),
    H100, CUDA graph: nvfp4 B8 x 32K 179 -> 157 us, B4 x 32K 112 -> 91, B2 x 64K 121 -> 94; fp8 B8 x 32K 257 ->
    203; one regression, nvfp4 B16 x 16K 153 -> 159 (3 CTAs per SM would fit there, not for every format).
    """
    ctas = batch * num_kv_heads
    if ctas >= num_sms:
        return 1
    tiles = max(1, math.ceil(max_context / tile_n))
    limit = max(1, min(max_splits, tiles // min_tiles_per_split, (ctas_per_sm * num_sms) // ctas))

    def busiest_sm(splits: int) -> float:
        per_sm = -(-ctas * splits // num_sms)
        return per_sm * -(-tiles // splits) * (1.25 if per_sm == 1 else 1.0)

    return min(range(1, limit + 1), key=lambda ns: (busiest_sm(ns), ns))
