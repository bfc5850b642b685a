"""Compile-time configuration of the SM90 paged decode kernel, and the split-KV heuristic.

Everything here is a plain Python value: a :class:`DecodeConfig` is what the kernel class is built from and
(through :attr:`DecodeConfig.key`) what the compile cache is keyed by.

Work split (see ``decode.py`` for the why):
    CTA     = one (split, kv head, sequence); all query rows of that kv head packed together
              (rows = seqlen_q x group, row r = i_q * group + h_in_group).
    warps   = max(4, row_tiles); warp w owns row tile ``w % row_tiles`` (16 rows, one mma M) and token group
              ``w // row_tiles``: with few rows the warps of a CTA split every KV tile between them (flash-decoding
              inside the CTA) and merge their softmax states in shared memory at the end.
    tile_n  = 64 or 128 tokens of K and V per pipeline stage (any page size: a tile is a piece of one page or
              several whole pages, both contiguous runs in the pools), 2 stages (cp.async double buffering).
              See :func:`default_tile_n`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qattn.layouts.formats import KVFormat

TILE_N = 64
MAX_ROWS = 128  # seqlen_q * group; 8 row tiles = 8 warps. More rows need a row loop (not in v0).
HEAD_DIMS = (64, 128)
PAGE_SIZES = (16, 32, 64, 128, 256)


def default_tile_n(k_fmt: KVFormat, v_fmt: KVFormat) -> int:
    """128-token tiles when K and V are both quantized (more bytes in flight per CTA: nvfp4 B32x8K went from
    166 to 153 us on an H100), 64 when either is bf16 (a 128-token bf16 stage pair needs ~160 KB of smem, one CTA
    per SM, and measured no faster)."""
    return TILE_N if "bf16" in (k_fmt.payload, v_fmt.payload) else 2 * TILE_N


def row_tiles_for(rows: int) -> int:
    """Row tiles of 16 for ``rows`` packed query rows, rounded up to a power of two (1, 2, 4, 8)."""
    if rows < 1 or rows > MAX_ROWS:
        raise ValueError(f"rows: seqlen_q * (num_heads / num_kv_heads) must be in [1, {MAX_ROWS}], got {rows}")
    t = 1
    while t * 16 < rows:
        t *= 2
    return t


@dataclass(frozen=True)
class DecodeConfig:
    k_fmt: KVFormat
    v_fmt: KVFormat
    head_dim: int
    q_dtype: str  # "bf16" or "f16" (also the output dtype)
    group: int  # query heads per kv head
    row_tiles: int  # 16-row tiles per CTA (1, 2, 4, 8): the seqlen_q bucket is rows <= 16 * row_tiles
    page_size: int
    causal: bool
    split: bool  # write fp32 partial O + LSE for the combine kernel, instead of the output
    tile_n: int = TILE_N
    stages: int = 2
    min_warps: int = 4  # 4 or 8: with few rows, more warps split each tile's tokens (more latency hiding)

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} not supported by the SM90 decode kernel; expected one of {HEAD_DIMS}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: {self.page_size} is not one of {PAGE_SIZES}")
        if self.q_dtype not in ("bf16", "f16"):
            raise ValueError(f"q_dtype: expected 'bf16' or 'f16', got {self.q_dtype!r}")
        if self.row_tiles not in (1, 2, 4, 8):
            raise ValueError(f"row_tiles: expected 1, 2, 4 or 8, got {self.row_tiles}")
        if not 1 <= self.group <= 16 * self.row_tiles:
            raise ValueError(f"group: {self.group} query heads per kv head does not fit {self.row_tiles} row tiles")
        for f in (self.k_fmt, self.v_fmt):
            f.check_head_dim(self.head_dim)
        if self.min_warps not in (4, 8):
            raise ValueError(f"min_warps: expected 4 or 8, got {self.min_warps}")
        if self.tile_n % (16 * self.token_groups):
            raise ValueError("tile_n: must give every token group whole 16-token chunks")

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
        return 16 * self.row_tiles

    @property
    def key(self) -> tuple:
        """Everything that changes the generated code (the arch is added by the caller)."""
        return ("sm90_decode", self.k_fmt.key, self.v_fmt.key, self.head_dim, self.q_dtype, self.group,
                self.row_tiles, self.page_size, self.causal, self.split, self.tile_n, self.stages, self.min_warps)


def num_splits_heuristic(batch: int, num_kv_heads: int, max_context: int, num_sms: int, *,
                         tile_n: int = TILE_N, max_splits: int = 64, min_tiles_per_split: int = 4) -> int:
    """Splits of the KV range so that a launch fills the GPU.

    Uses only host-known sizes (``max_context`` = block_table columns x page size, an upper bound of the
    sequence lengths) so that choosing it needs no device sync. One CTA per (sequence, kv head) is enough when
    there are already ~a wave of them; otherwise aim at ~2 waves, but never give a split fewer than
    ``min_tiles_per_split`` tiles of ``tile_n`` tokens (the combine costs more than it saves below that).
    Measured (H100, nvfp4, B32 x 8K, 256 CTAs): forcing 2 or 4 splits was slower (159 / 163 us vs 153 us).
    """
    ctas = batch * num_kv_heads
    if ctas >= num_sms:
        return 1
    tiles = max(1, math.ceil(max_context / tile_n))
    by_fill = math.ceil(2 * num_sms / ctas)
    by_work = max(1, tiles // min_tiles_per_split)
    return max(1, min(by_fill, by_work, max_splits))
