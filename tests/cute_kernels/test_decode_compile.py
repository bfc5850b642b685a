"""CPU tests: the SM90 decode kernel (and the split-KV combine) compile for sm_90a, and the PTX holds the
tensor-core MMA (mma.sync m16n8k16), the 16-byte cp.async loads and, for FP4, the prmt-based decode.

A representative subset runs by default (every K and V format at least once, both head_dims, every row-tile count,
two m-blocks (> 128 rows), the recent-token ring (bf16 and f16, with and without split), split and causal flags,
every page-size class, fp16 q); the full K x V format matrix is marked ``slow``. The tile / split / ring schedule
of the kernel is emulated in plain Python at the end (the index math the GPU tests then check for real).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import pytest
import torch

from qattn.cute_kernels.combine import CombineSplits
from qattn.cute_kernels.common import fp4
from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count
from qattn.cute_kernels.sm90.decode import DecodeSm90
from qattn.cute_kernels.sm90.decode_config import (NARROW_ROWS, DecodeConfig, m_blocks_for, num_splits_heuristic,
                                                   row_tiles_for, tuning_from_env)
from qattn.interface.decode import combine_compile_args, decode_compile_args
from qattn.layouts.formats import FORMAT_NAMES, kv_format

# (k format, v format, head_dim, q dtype, group, seqlen_q, page, causal, split)
REPRESENTATIVE = [
    ("bf16", "bf16", 128, "bf16", 8, 1, 64, True, False),
    ("nvfp4", "nvfp4", 128, "bf16", 4, 1, 64, True, False),
    ("nvfp4", "nvfp4", 64, "f16", 1, 1, 16, False, True),
    ("mxfp4", "mxfp4", 128, "bf16", 8, 4, 16, True, True),  # 2 row tiles
    ("mxfp4_b16", "mxfp4_b16", 64, "bf16", 8, 8, 256, True, False),  # 4 row tiles
    ("fp8", "fp8", 128, "bf16", 16, 8, 128, True, True),  # 8 row tiles, 8 warps
    ("int8", "int8", 64, "bf16", 4, 4, 32, True, False),
    ("int8", "nvfp4", 128, "bf16", 8, 1, 128, True, True),  # mixed pair
    ("nvfp4", "bf16", 128, "f16", 4, 2, 64, False, False),  # f16 q with a bf16 V
    ("nvfp4", "nvfp4", 128, "bf16", 16, 16, 16, True, True),  # 256 rows: 2 m-blocks
    ("fp8", "int8", 64, "f16", 16, 9, 64, True, False),  # 144 rows: 2 m-blocks, the second one partial
]

# recent-token ring: (k format, v format, head_dim, q dtype, group, seqlen_q, page, causal, split, W, ring dtype)
RING = [
    ("nvfp4", "nvfp4", 128, "bf16", 8, 1, 64, True, False, 64, "bf16"),  # f16 page MMAs, bf16 ring: Q reloaded
    ("nvfp4", "nvfp4", 64, "bf16", 4, 4, 16, True, True, 64, "bf16"),  # + split, V global scale moved
    ("bf16", "bf16", 128, "bf16", 1, 1, 128, True, True, 64, "bf16"),  # same MMA type everywhere
    ("int8", "nvfp4", 128, "f16", 16, 16, 16, True, True, 64, "f16"),  # row scales, 2 m-blocks, f16 ring
    ("fp8", "mxfp4", 64, "bf16", 4, 1, 128, False, False, 100, "f16"),  # W not a power of two; bf16 q -> f16
]


def _compile(kf, vf, D, qd, group, sq, page, causal, split, window=0, ring_dtype="bf16", sink_tokens=0):
    rows = group * sq
    cfg = DecodeConfig(kv_format(kf), kv_format(vf), D, qd, group, row_tiles_for(rows), page, causal, split,
                       m_blocks=m_blocks_for(rows), ring_window=window, ring_dtype=ring_dtype,
                       sink_tokens=sink_tokens, narrow=rows <= NARROW_ROWS)  # as choose_config
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    return cfg, ptx


# A 16-byte cp.async: operands [dst], [src], cp-size 16 (then an optional src-size / ignore-src operand). The
# old pattern "cp.async.cg.shared.global.*16" also took any other size next to a "16" in a register name.
CP_ASYNC_16 = r"cp\.async\.cg\.shared\.global(\.L2::\w+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*16\s*(,\s*[^;]+)?;"
# The FP4 decode's own prmt forms (common/fp4.py), none of which a bf16 / fp8 / int8 page path emits:
# the E2M1 -> E4M3 table lookup (2 per decoded word, table decode), the sign-replicate pair (2 per decoded word,
# table decode) and the E4M3 block-scale broadcast (nvfp4 scales, e4m3_to_f16x2). The table-free even/odd decode
# of nvfp4 has no prmt; its signature is the 0x1C1C1C1C magnitude mask (2 per decoded word).
FP4_LUT_PRMT = (rf"(?i)prmt\.b32\s+\w+,\s*{fp4.E2M1_TO_E4M3_LUT[0]:#010x},\s*{fp4.E2M1_TO_E4M3_LUT[1]:#010x},"
                r"\s*\w+;")
FP4_SIGN_PRMT = r"(?i)prmt\.b32\s+\w+,\s*\w+,\s*%r\d+,\s*0x(d9c8|fbea);"
# an E4M3 block scale broadcast (byte k twice), or two tokens' scales paired (fp4.e4m3_pair_to_f16x2: nvfp4 V)
FP4_SCALE_PRMT = r"prmt\.b32\s+\w+,\s*%r\d+,\s*(0,\s*0x(0|11|22|33)|%r\d+,\s*0x40);"
FP4_V_PAIR_PRMT = r"prmt\.b32\s+%r\d+,\s*%r\d+,\s*%r\d+,\s*0x(5140|7362);"
FP4_EVEN_ODD_AND = r"(?i)and\.b32\s+\w+,\s*\w+,\s*0x1c1c1c1c;"


@functools.lru_cache(maxsize=None)
def _bf16_pages_prmt(cfg: DecodeConfig) -> int:
    """prmt count of ``cfg`` with its FP4 K / V pages replaced by bf16 ones (everything else the same)."""
    bf16 = kv_format("bf16")
    swap = {f: (bf16 if f.payload == "e2m1" else f) for f in (cfg.k_fmt, cfg.v_fmt)}
    base = dataclasses.replace(cfg, k_fmt=swap[cfg.k_fmt], v_fmt=swap[cfg.v_fmt])
    _, ptx = compile_for_arch(DecodeSm90(base), *decode_compile_args(), arch="sm_90a")
    return ptx_count(ptx, r"prmt\.b32")


def _check_fp4_decode(cfg: DecodeConfig, ptx: str) -> None:
    """The FP4 decode is in the PTX: each K / V FP4 operand's own decode (table or even/odd) and the nvfp4 scale
    broadcast, and those prmt come on top of the bf16-pages variant's prmt count. A bare ``prmt.b32 > 0`` proved
    nothing: bf16/bf16 kernels have 16..384 prmt (token-pair packing), int8/int8 48..96 (i8 -> f16)."""
    kern = DecodeSm90(cfg)
    fp4_ops = [(info, eo) for info, eo in ((kern.k, kern.k.even_odd), (kern.v, kern.v_even_odd))
               if info.kind == "fp4"]
    lut, sign = ptx_count(ptx, FP4_LUT_PRMT), ptx_count(ptx, FP4_SIGN_PRMT)
    scale, eo_and = ptx_count(ptx, FP4_SCALE_PRMT), ptx_count(ptx, FP4_EVEN_ODD_AND)
    assert (lut > 0) == any(not eo for _, eo in fp4_ops), f"E2M1 table prmt: {lut}"
    assert sign == lut, f"sign-replicate prmt {sign} != table prmt {lut} (2 + 2 per decoded word)"
    assert (eo_and > 0) == any(eo for _, eo in fp4_ops), f"even/odd decode masks: {eo_and}"
    assert (scale > 0) == any(info.scale == "e4m3" for info, _ in fp4_ops), f"e4m3 scale broadcasts: {scale}"
    assert ptx_count(ptx, r"cvt\.rn\.f16x2\.e4m3x2") >= 2 * (lut + eo_and)  # 4 per word; 2 table prmt / masks
    # an even/odd nvfp4 V pairs its tokens as E4M3 bytes (DecodeSm90._v_operands: 2 + 2 prmt per two tokens' word)
    # instead of as halves after the conversion (the bf16 path's 8): its kernels have fewer prmt than with bf16
    # V pages, so the count bound below is for the other FP4 decodes
    v_pairs = ptx_count(ptx, FP4_V_PAIR_PRMT)
    assert (v_pairs > 0) == (kern.v.kind == "fp4" and kern.v_even_odd), f"nvfp4 V token-pair prmt: {v_pairs}"
    assert v_pairs % 2 == 0
    if fp4_ops and not v_pairs:
        # Expected increase over the same config with bf16 pages: at least the decode's own prmt, a structural
        # bound (the other permutes, token pairs / bytes, are the bf16 path's or more: nvfp4's even/odd K adds
        # 8..32). Measured over REPRESENTATIVE / RING / SINK: increase 4..256, increase - decode prmt 0..32
        # (0 for the MX formats and an nvfp4 V, e.g. int8/nvfp4 d128 split: 68 - 64 = 4 = its 4 scale prmt).
        decode_prmt = lut + sign + scale
        increase = ptx_count(ptx, r"prmt\.b32") - _bf16_pages_prmt(cfg)
        assert decode_prmt > 0 and increase >= decode_prmt, (increase, lut, sign, scale)


def _check_ptx(cfg: DecodeConfig, ptx: str) -> None:
    assert ptx_count(ptx, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32") > 0, "no tensor-core MMA in the PTX"
    # narrow: P^T's B fragments come from the S^T accumulator through movmatrix.trans; the wide layout has none
    assert (ptx_count(ptx, r"movmatrix\.sync\.aligned\.m8n8\.trans\.b16") > 0) == cfg.narrow
    n16 = ptx_count(ptx, CP_ASYNC_16)
    assert n16 > 0, "no 16-byte cp.async in the PTX"
    assert n16 == ptx_count(ptx, r"cp\.async\.c[ag]\."), "a cp.async of another size / cache mode"
    assert ptx_count(ptx, r"cp\.async\.wait_group") > 0
    _check_fp4_decode(cfg, ptx)
    for f in (cfg.k_fmt, cfg.v_fmt):
        if f.payload == "e4m3":
            assert ptx_count(ptx, r"cvt\.rn\.f16x2\.e4m3x2") > 0


@pytest.mark.parametrize("case", REPRESENTATIVE, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}-g{c[4]}-sq{c[5]}-p{c[6]}"
                         f"{'-causal' if c[7] else ''}{'-split' if c[8] else ''}")
def test_decode_compiles_sm90(case):
    cfg, ptx = _compile(*case)
    _check_ptx(cfg, ptx)


@pytest.mark.parametrize("case", RING, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}-g{c[4]}-sq{c[5]}-p{c[6]}"
                         f"{'-causal' if c[7] else ''}{'-split' if c[8] else ''}-w{c[9]}-{c[10]}")
def test_decode_ring_compiles_sm90(case):
    cfg, ptx = _compile(*case)
    _check_ptx(cfg, ptx)
    # the ring tiles' own MMAs: bf16 for a bf16 ring, f16 for an f16 one
    t = "bf16" if cfg.ring_dtype == "bf16" else "f16"
    assert ptx_count(ptx, rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32") > 0
    _, base = _compile(*case[:9])
    assert ptx_count(ptx, r"cp\.async\.cg\.shared\.global") > ptx_count(base, r"cp\.async\.cg\.shared\.global")


# attention sink: (k format, v format, head_dim, q dtype, group, seqlen_q, page, causal, split, W, dtype, N)
SINK = [
    ("nvfp4", "nvfp4", 128, "bf16", 8, 1, 64, True, True, 64, "bf16", 1),  # the shipped nvfp4 config, split
    ("nvfp4", "nvfp4", 64, "bf16", 4, 4, 16, True, False, 0, "bf16", 4),  # sink without a ring
    ("mxfp4", "mxfp4", 128, "f16", 16, 16, 16, True, True, 64, "f16", 64),  # 2 m-blocks, N = one whole tile
    ("int8", "nvfp4", 64, "bf16", 8, 1, 128, False, False, 100, "f16", 3),  # row scales, W not a power of two
    ("bf16", "bf16", 128, "bf16", 1, 1, 128, True, True, 64, "bf16", 1),  # same MMA type everywhere
    ("fp8", "fp8", 128, "bf16", 4, 2, 256, True, True, 0, "bf16", 2),
]


@pytest.mark.parametrize("case", SINK, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}-g{c[4]}-sq{c[5]}-p{c[6]}"
                         f"{'-causal' if c[7] else ''}{'-split' if c[8] else ''}-w{c[9]}-{c[10]}-n{c[11]}")
def test_decode_sink_compiles_sm90(case):
    """The sink tile adds its own cp.async loads and runs the bf16 / f16 path (the cache dtype's MMAs)."""
    cfg, ptx = _compile(*case)
    _check_ptx(cfg, ptx)
    assert cfg.sink_tokens == case[11] and cfg.sink_tile_n >= cfg.sink_tokens
    t = "bf16" if cfg.ring_dtype == "bf16" else "f16"
    assert ptx_count(ptx, rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32") > 0
    _, base = _compile(*case[:11])  # the same variant without sinks
    assert ptx_count(ptx, r"cp\.async\.cg\.shared\.global") > ptx_count(base, r"cp\.async\.cg\.shared\.global")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "int8", "bf16"])
@pytest.mark.parametrize("W,N", [(0, 0), (64, 0), (0, 1), (0, 16), (128, 4)])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stage_buffers_never_overlap(fmt, W, N, stages):
    """Shared-memory placement of the stage buffers (no GPU needed): every (buffer, stage) slice lies inside the
    stage area, slices of different stages are disjoint, and within a stage the page buffers are disjoint from
    each other, as are the 16-bit (ring / sink) ones; page and 16-bit buffers may share a stage (a union: a stage
    holds one tile). A sink-only cache once got the page-only layout and its sink tile overwrote page stages."""
    f = kv_format(fmt)
    cfg = DecodeConfig(f, f, 128, "bf16", 4, 1, 128, True, True, tile_n=128 if fmt != "bf16" else 64,
                       ring_window=W, sink_tokens=N, stages=stages)
    kern = DecodeSm90(cfg)
    place = kern.buffer_placement()
    assert ("rkd" in place) == bool(W or N)
    spans = {(name, st): (base + st * stride, base + st * stride + kern.vec[name])
             for name, (base, stride) in place.items() for st in range(cfg.stages)}
    for lo, hi in spans.values():
        assert 0 <= lo < hi <= cfg.stages * kern.stage_vecs
    for (a, sa), (b, sb) in itertools.combinations(spans, 2):
        if sa == sb and a.startswith("r") != b.startswith("r"):
            continue  # the union
        (lo1, hi1), (lo2, hi2) = spans[a, sa], spans[b, sb]
        assert hi1 <= lo2 or hi2 <= lo1, f"{a}[{sa}] overlaps {b}[{sb}]"


def test_decode_ring_eight_warps_compiles_sm90():
    """QATTN_DECODE_WARPS=8 with 128-token page tiles: 8 token groups, so 128-token ring tiles."""
    f = kv_format("nvfp4")
    cfg = DecodeConfig(f, f, 128, "bf16", 4, 1, 16, True, True, tile_n=128, min_warps=8, ring_window=64)
    assert cfg.token_groups == 8 and cfg.ring_tile_n == 128
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    _check_ptx(cfg, ptx)


@pytest.mark.parametrize("kf,vf,D,group,split,W", [("nvfp4", "nvfp4", 128, 4, False, 0), ("fp8", "int8", 64, 8, True, 0),
                                                  ("nvfp4", "nvfp4", 128, 1, True, 64)])
def test_narrow_layout_halves_the_mmas(kf, vf, D, group, split, W):
    """Up to 8 query rows the MMAs run transposed (tokens / head dims on M): half as many m16n8k16 per tile as
    the wide layout of the same variant, which spends half of each MMA on rows 8..15."""
    wide, narrow = [DecodeConfig(kv_format(kf), kv_format(vf), D, "bf16", group, 1, 64, True, split, tile_n=128,
                                 ring_window=W, narrow=n) for n in (False, True)]
    counts = []
    for cfg in (wide, narrow):
        _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
        _check_ptx(cfg, ptx)
        counts.append(ptx_count(ptx, r"mma\.sync\.aligned\.m16n8k16"))
    assert counts[0] == 2 * counts[1], counts
    assert wide.key != narrow.key


@pytest.mark.parametrize("stages", [3, 4])
def test_decode_deeper_pipeline_compiles_sm90(stages):
    """QATTN_DECODE_STAGES (tuning knob): stages - 1 tiles in flight, so the main loop waits for all but
    stages - 1 cp.async groups (a ring cache too: its tiles share the stages)."""
    f = kv_format("nvfp4")
    for W in (0, 64):
        cfg = DecodeConfig(f, f, 128, "bf16", 4, 1, 128, True, False, tile_n=128, stages=stages, ring_window=W)
        _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
        _check_ptx(cfg, ptx)
        waits = set(re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx))
        assert waits == {str(stages - 1), "0"}, waits


@pytest.mark.slow
@pytest.mark.parametrize("kf,vf", list(itertools.product(FORMAT_NAMES, FORMAT_NAMES)))
@pytest.mark.parametrize("D", [64, 128])
def test_decode_compiles_all_format_pairs(kf, vf, D):
    for group, sq, split in ((4, 1, False), (8, 4, True)):
        cfg, ptx = _compile(kf, vf, D, "bf16", group, sq, 64, True, split)
        _check_ptx(cfg, ptx)


@pytest.mark.parametrize("D", [64, 128])
def test_combine_compiles_sm90(D):
    _, ptx = compile_for_arch(CombineSplits(D, "bf16"), *combine_compile_args(), arch="sm_90a")
    assert ptx_count(ptx, r"ex2\.approx") > 0


def test_config_validation_and_heuristic():
    f = kv_format("nvfp4")
    with pytest.raises(ValueError, match="head_dim"):
        DecodeConfig(f, f, 96, "bf16", 4, 1, 64, True, False)
    with pytest.raises(ValueError, match="page_size"):
        DecodeConfig(f, f, 128, "bf16", 4, 1, 48, True, False)
    with pytest.raises(ValueError, match="rows"):
        row_tiles_for(257)
    with pytest.raises(ValueError, match="rows"):
        m_blocks_for(0)
    assert [row_tiles_for(r) for r in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert [m_blocks_for(r) for r in (1, 128, 129, 256)] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="m_blocks"):
        DecodeConfig(f, f, 128, "bf16", 4, 4, 64, True, False, m_blocks=2)
    with pytest.raises(ValueError, match="ring_dtype"):
        DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, False, ring_window=64, ring_dtype="f32")
    with pytest.raises(ValueError, match="sink_tokens"):
        DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, False, sink_tokens=65)
    with pytest.raises(ValueError, match="sink_tokens"):
        DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, False, sink_tokens=-1)
    with pytest.raises(ValueError, match="narrow"):  # more than 8 rows: the wide layout
        DecodeConfig(f, f, 128, "bf16", 16, 1, 64, True, False, narrow=True)
    with pytest.raises(ValueError, match="narrow"):
        DecodeConfig(f, f, 128, "bf16", 4, 2, 64, True, False, narrow=True)
    # many sequences: no split; one long sequence: enough splits to fill the GPU, bounded by the work
    assert num_splits_heuristic(32, 8, 8192, 132) == 1
    assert num_splits_heuristic(1, 8, 131072, 132) == 33
    assert num_splits_heuristic(1, 8, 256, 132) == 1
    # fewer (sequence, kv head) CTAs than SMs: at most 2 CTAs per SM, the busiest SM's tiles minimised
    assert num_splits_heuristic(8, 8, 32768, 132, tile_n=128) == 4  # 256 CTAs; 5 splits put 3 on 56 SMs
    assert num_splits_heuristic(2, 8, 65536, 132, tile_n=128) == 16  # not 17 (272 CTAs: 3 on 8 SMs)
    for batch, heads, ctx in itertools.product((1, 2, 3, 5, 8, 12, 16), (1, 2, 4, 8), (256, 4096, 32768, 131072)):
        ns = num_splits_heuristic(batch, heads, ctx, 132, tile_n=128)
        ctas = batch * heads
        assert ns == 1 or (ctas * ns <= 2 * 132 and -(-ctx // 128) // ns >= 4)
    cfg = DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, False)
    assert cfg.key != DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, True).key
    # every compile-time flag is in the key: m-blocks, ring on/off, W, ring dtype, sink tokens
    keys = {DecodeConfig(f, f, 128, "bf16", 4, 8, 64, True, False, **kw).key
            for kw in ({}, {"m_blocks": 2}, {"ring_window": 64}, {"ring_window": 128},
                       {"ring_window": 64, "ring_dtype": "f16"}, {"sink_tokens": 1}, {"sink_tokens": 4},
                       {"ring_window": 64, "sink_tokens": 1})}
    assert len(keys) == 8
    # mxfp4 floor and rceil caches decode with the same code: one variant
    fl, rc = kv_format("mxfp4", scale_rule="floor"), kv_format("mxfp4", scale_rule="rceil")
    assert DecodeConfig(fl, fl, 64, "bf16", 1, 1, 16, True, False).key == \
        DecodeConfig(rc, rc, 64, "bf16", 1, 1, 16, True, False).key


def test_launcher_config_choice(monkeypatch):
    """What the launcher picks on the host (no GPU needed): tile size by format, the tuning overrides, and the
    exact split-heuristic call it makes."""
    from qattn import PagedKVCache
    from qattn.interface import decode as idec

    nv = PagedKVCache(1, 4, 64, 2, 128, "nvfp4")
    bf = PagedKVCache(1, 4, 64, 2, 128, ("nvfp4", "bf16"))
    ring = PagedKVCache(1, 4, 64, 2, 128, "nvfp4", recent_window=64, max_seqs=3, dtype=torch.float16)
    monkeypatch.delenv("QATTN_DECODE_WARPS", raising=False)
    monkeypatch.delenv("QATTN_DECODE_TILE_N", raising=False)
    monkeypatch.delenv("QATTN_DECODE_STAGES", raising=False)
    tuning_from_env.cache_clear()
    try:
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).tile_n == 128
        assert idec.decode_config_for(bf, "bf16", 4, 1, True, False).tile_n == 64
        assert idec.decode_config_for(nv, "bf16", 16, 16, True, False).m_blocks == 2
        rc = idec.decode_config_for(ring, "bf16", 4, 1, True, False)
        assert (rc.ring_window, rc.ring_dtype, rc.ring_tile_n) == (64, "f16", 64)
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).ring_window == 0
        # the transposed layout up to 8 rows (seqlen_q x group), the wide one above
        assert [idec.decode_config_for(nv, "bf16", g, sq, True, False).narrow
                for g, sq in ((1, 1), (8, 1), (4, 2), (1, 8), (16, 1), (4, 3), (1, 9))] == [True] * 4 + [False] * 3
        monkeypatch.setenv("QATTN_DECODE_WIDE", "1")  # A/B knob: the untransposed layout for every row count
        tuning_from_env.cache_clear()
        assert not idec.decode_config_for(nv, "bf16", 4, 1, True, False).narrow
        monkeypatch.setenv("QATTN_DECODE_WIDE", "2")
        tuning_from_env.cache_clear()
        with pytest.raises(ValueError, match="QATTN_DECODE_WIDE"):
            idec.decode_config_for(nv, "bf16", 4, 1, True, False)
        monkeypatch.delenv("QATTN_DECODE_WIDE")
        tuning_from_env.cache_clear()
        sink = PagedKVCache(1, 4, 64, 2, 128, "nvfp4", sink_tokens=2, max_seqs=3, dtype=torch.float16)
        sc = idec.decode_config_for(sink, "bf16", 4, 1, True, False)
        assert (sc.ring_window, sc.sink_tokens, sc.ring_dtype) == (0, 2, "f16")  # the sink's dtype: the cache's
        # the environment is read once: a later change needs cache_clear()
        monkeypatch.setenv("QATTN_DECODE_WARPS", "8")
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).num_warps == 4
        tuning_from_env.cache_clear()
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).num_warps == 8
        assert idec.decode_config_for(bf, "bf16", 4, 1, True, False).num_warps == 4  # 64-token tiles: 4 warps
        assert idec.decode_config_for(ring, "bf16", 4, 1, True, False).ring_tile_n == 128  # 8 token groups
        monkeypatch.setenv("QATTN_DECODE_TILE_N", "64")
        tuning_from_env.cache_clear()
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).tile_n == 64
        monkeypatch.setenv("QATTN_DECODE_TILE_N", "96")
        tuning_from_env.cache_clear()
        with pytest.raises(ValueError, match="QATTN_DECODE_TILE_N"):
            idec.decode_config_for(nv, "bf16", 4, 1, True, False)
        monkeypatch.setenv("QATTN_DECODE_TILE_N", "128")
        monkeypatch.setenv("QATTN_DECODE_STAGES", "3")  # cp.async depth: a tuning knob, in the key
        tuning_from_env.cache_clear()
        assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).stages == 3
        monkeypatch.setenv("QATTN_DECODE_STAGES", "5")
        tuning_from_env.cache_clear()
        with pytest.raises(ValueError, match="QATTN_DECODE_STAGES"):
            idec.decode_config_for(nv, "bf16", 4, 1, True, False)
        monkeypatch.delenv("QATTN_DECODE_STAGES")
        monkeypatch.delenv("QATTN_DECODE_TILE_N")
        monkeypatch.delenv("QATTN_DECODE_WARPS")
        tuning_from_env.cache_clear()
        # the call flash_attn_with_kvcache makes for num_splits=0
        assert num_splits_heuristic(1, 2, 4 * 64, 132, tile_n=idec._tile_n(bf)) == 1
    finally:
        tuning_from_env.cache_clear()


def _emulate_schedule(kv_len, W, TN, TR, page, num_splits, N=0, p0=None):
    """The kernel's tile schedule, written out in Python with the same formulas as ``DecodeSm90.kernel``,
    ``_load_tile``, ``_load_sink_tile`` and ``_load_ring_tile``: {position: (split, source)} for every unmasked
    token, source being ("page", block-table column, offset in page), ("sink", sink row) or ("ring", ring row);
    and the list of (split, kind, last position) of every tile, in order. ``p0``: a sliding window's first
    visible position of the first query (``cfg.window``; None: no window)."""
    assert N <= TR  # one sink tile holds the whole sink
    page_len = max(kv_len - W, 0) if W else kv_len
    sink_len, n_sink = 0, 0
    if N:
        page_len = max(page_len, N)
        sink_len = min(kv_len, N)
        n_sink = 1 if kv_len > 0 else 0
    first_pt = N // TN
    n_page = (-(-page_len // TN) - first_pt) if page_len > N else 0
    n_ring = -(-(kv_len - page_len) // TR) if W and kv_len > page_len else 0
    n_tiles = n_page + n_sink + n_ring
    ring0 = 0
    if p0 is not None:  # the window: what lies left of p0 leaves each part of the list
        skip = min(max(max(p0, 0) // TN - first_pt, 0), n_page) if p0 < page_len else n_page
        first_pt, n_page = first_pt + skip, n_page - skip
        if N and not sink_len > p0:
            n_sink = 0
        if W:
            ring0 = min(max(p0 - page_len, 0) // TR, n_ring)
            n_ring -= ring0
        n_tiles = n_page + n_sink + n_ring
    per = -(-n_tiles // num_splits)
    P = min(TN, page)
    seen, kinds = {}, []
    for split in range(num_splits):
        t_begin = split * per
        t_end = min(t_begin + per, n_tiles)
        for tile in range(t_begin, t_end):
            if tile < n_page:
                kinds.append((split, "page", min((first_pt + tile + 1) * TN, page_len) - 1))
                pt = first_pt + tile
                for t in range(TN):
                    p = pt * TN + t
                    token0 = pt * TN + (t // P) * P  # the piece the token was loaded with
                    if N <= p < page_len:  # the page tiles' mask: pos_lo = N, lims_page / V's kv_len = page_len
                        assert token0 < page_len  # its piece was loaded from the real block, not block 0
                        src = ("page", token0 // page, token0 % page + t % P)
                        assert seen.setdefault(p, (split, src)) == (split, src), "position twice"
            elif N and (tile - n_page < n_sink if p0 is not None else tile == n_page):
                kinds.append((split, "sink", sink_len - 1))
                for t in range(TR):
                    if t < sink_len:  # lims_sink / V's kv_len = sink_len
                        assert t not in seen, "position twice"
                        seen[t] = (split, ("sink", min(t, N - 1)))
            else:
                r0 = page_len + (tile - n_page - n_sink + ring0) * TR
                kinds.append((split, "ring", min(r0 + TR, kv_len) - 1))
                for t in range(TR):
                    p = r0 + t
                    if p < kv_len:
                        assert p not in seen, "position twice"
                        seen[p] = (split, ("ring", p % W))
    return seen, kinds


LENGTHS = (0, 1, 2, 3, 4, 5, 15, 16, 63, 64, 65, 66, 68, 100, 127, 128, 129, 130, 200, 1000)


def _check_sources(seen, kv_len, W, N, page):
    """Every position of the schedule comes from the source the references read it from."""
    from qattn.layouts import read_sources

    sink, pages, ring = read_sources(kv_len, W, N)  # the references' rule
    for p, (_, src) in seen.items():
        if p in sink:
            assert src == ("sink", p)
        elif p in ring:
            assert src == ("ring", p % W)
        else:
            assert p in pages and src == ("page", p // page, p % page)


def _check_schedule(W, TN, TR, page, N):
    for kv_len in LENGTHS + (3 * page + 5, N + W - 1, N + W, N + W + 1):
        for num_splits in (1, 2, 3, 7, 40):
            seen, kinds = _emulate_schedule(kv_len, W, TN, TR, page, num_splits, N)
            assert sorted(seen) == list(range(kv_len))
            _check_sources(seen, kv_len, W, N, page)
            # every bf16 (sink / ring) tile follows every page tile: one Q-type switch and one V-global-scale
            # fold per CTA, at its first bf16 tile; the sink tile comes right before the ring tiles
            order = [k for _, k, _ in kinds]
            first_bf16 = next((i for i, k in enumerate(order) if k != "page"), len(order))
            assert all(k == "page" for k in order[:first_bf16]) and "page" not in order[first_bf16:]
            if "sink" in order:
                assert order.count("sink") == 1 and order[first_bf16] == "sink"


@pytest.mark.parametrize("W", [0, 16, 64, 100, 128])
@pytest.mark.parametrize("TN,TR", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("page", [16, 64, 128, 256])
def test_tile_schedule_covers_each_position_once_from_the_reference_source(W, TN, TR, page):
    _check_schedule(W, TN, TR, page, 0)


@pytest.mark.parametrize("N", [1, 4, 16, 64])
@pytest.mark.parametrize("W", [0, 16, 64, 100])
@pytest.mark.parametrize("TN,TR", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("page", [16, 64, 256])
def test_sink_tile_schedule_reads_each_position_once_from_the_reference_source(N, W, TN, TR, page):
    _check_schedule(W, TN, TR, page, N)


@pytest.mark.parametrize("N", [0, 4, 64])
@pytest.mark.parametrize("W", [0, 16, 100])
@pytest.mark.parametrize("TN,TR", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("page", [16, 128])
def test_window_schedule_keeps_every_visible_position_and_no_tile_left_of_the_window(N, W, TN, TR, page):
    """A sliding window over any cache (pages, ring, sink): the tile list keeps every position the first query
    sees, each once and from the reference's source, and no tile that lies entirely left of its window; the
    sink tile stays right before the ring tiles. (Masking inside the kept tiles is the rows' ``lows``.)"""
    for kv_len in LENGTHS + (3 * page + 5, N + W + 1):
        for left, sq in ((0, 1), (1, 3), (5, 1), (16, 2), (63, 1), (64, 1), (100, 4), (129, 1), (1000, 1)):
            p0 = kv_len - sq - left
            for num_splits in (1, 2, 7):
                seen, kinds = _emulate_schedule(kv_len, W, TN, TR, page, num_splits, N, p0)
                assert set(range(max(p0, 0), kv_len)) <= set(seen), (kv_len, left, sq)
                assert all(last >= p0 for _, _, last in kinds), (kv_len, left, sq, kinds)
                _check_sources(seen, kv_len, W, N, page)
                order = [k for _, k, _ in kinds]
                if "sink" in order:
                    assert order.count("sink") == 1 and all(k == "ring" for k in order[order.index("sink") + 1:])


# sliding window (flash_attn_with_kvcache's window_size): narrow and wide layouts, split, row-scaled formats
WINDOW = [("nvfp4", "nvfp4", 128, "bf16", 4, 1, 16, True, False), ("int8", "nvfp4", 64, "f16", 8, 4, 64, True, True),
          ("fp8", "fp8", 128, "bf16", 16, 16, 128, False, True), ("bf16", "bf16", 64, "bf16", 1, 1, 32, True, False)]


@pytest.mark.parametrize("kf,vf,D,qd,group,sq,page,causal,split", WINDOW)
def test_window_variant_compiles(kf, vf, D, qd, group, sq, page, causal, split):
    rows = group * sq
    kw = dict(m_blocks=m_blocks_for(rows), narrow=rows <= NARROW_ROWS)
    cfg = DecodeConfig(kv_format(kf), kv_format(vf), D, qd, group, row_tiles_for(rows), page, causal, split,
                       window=True, **kw)
    plain = DecodeConfig(kv_format(kf), kv_format(vf), D, qd, group, row_tiles_for(rows), page, causal, split, **kw)
    assert cfg.key != plain.key and "window" in cfg.key
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    _check_ptx(cfg, ptx)
    _, ptx_plain = compile_for_arch(DecodeSm90(plain), *decode_compile_args(), arch="sm_90a")
    # the window adds compares to the score mask: same MMAs and loads
    for pat in (r"mma\.sync\.aligned\.m16n8k16", r"cp\.async\.cg\.shared\.global"):
        assert ptx_count(ptx, pat) == ptx_count(ptx_plain, pat)


@pytest.mark.parametrize("W,N,group,sq", [(64, 0, 4, 1), (0, 4, 8, 4), (64, 4, 4, 1), (128, 8, 16, 4)])
def test_window_over_ring_and_sink_compiles(W, N, group, sq):
    """The window variants of ring / sink caches (narrow and wide): the same MMAs and loads as without the
    window (the tile list only drops tiles; each tile kind masks the rows' lower edges)."""
    from qattn.cute_kernels.sm90.decode_config import choose_config

    f = kv_format("nvfp4")
    cfg = choose_config(f, f, 128, 64, "bf16", group, sq, True, False, ring_window=W, ring_dtype="bf16",
                        sink_tokens=N, window=True)
    plain = choose_config(f, f, 128, 64, "bf16", group, sq, True, False, ring_window=W, ring_dtype="bf16",
                          sink_tokens=N)
    assert cfg.key == plain.key + ("window",)
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    _, ptx_plain = compile_for_arch(DecodeSm90(plain), *decode_compile_args(), arch="sm_90a")
    for pat in (r"mma\.sync\.aligned\.m16n8k16", r"cp\.async\.cg\.shared\.global"):
        assert ptx_count(ptx, pat) == ptx_count(ptx_plain, pat)


@pytest.mark.parametrize("kf,vf,D,group,split,W", [("nvfp4", "nvfp4", 128, 4, False, 0), ("fp8", "fp8", 128, 16, True, 0),
                                                  ("int8", "nvfp4", 64, 2, False, 64), ("bf16", "bf16", 128, 8, True, 0)])
def test_softcap_variant_compiles(kf, vf, D, group, split, W):
    """``softcap``: its own key per value, one ``tanh.approx.f32`` per score of a thread's tile (before the mask),
    the same MMAs and loads as without it."""
    from qattn.cute_kernels.sm90.decode_config import choose_config

    k, v = kv_format(kf), kv_format(vf)
    kw = dict(ring_window=W, ring_dtype="bf16")
    cfg, plain = (choose_config(k, v, D, 64, "bf16", group, 1, True, split, softcap=c, **kw) for c in (50.0, 0.0))
    assert len({cfg.key, plain.key, choose_config(k, v, D, 64, "bf16", group, 1, True, split, softcap=30, **kw).key}) == 3
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    _check_ptx(cfg, ptx)
    _, ptx_plain = compile_for_arch(DecodeSm90(plain), *decode_compile_args(), arch="sm_90a")
    # one tanh per score a thread holds of a tile: tile_n / token_groups / 16 chunks x (4 narrow, 8 wide), per
    # tile kind (page tiles; ring tiles of ring_tile_n tokens)
    per = lambda n: n // cfg.token_groups // 16 * (4 if cfg.narrow else 8)  # noqa: E731
    want = per(cfg.tile_n) + (per(cfg.ring_tile_n) if W else 0)
    assert ptx_count(ptx, r"tanh\.approx\.f32") == want and ptx_count(ptx_plain, r"tanh\.approx") == 0
    for pat in (r"mma\.sync\.aligned\.m16n8k16", r"cp\.async\.cg\.shared\.global", r"ex2\.approx"):
        assert ptx_count(ptx, pat) == ptx_count(ptx_plain, pat)
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match="softcap"):
            choose_config(k, v, D, 64, "bf16", group, 1, True, split, softcap=bad, **kw)
