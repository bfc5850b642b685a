"""CPU tests: the SM90 decode kernel (and the split-KV combine) compile for sm_90a, and the PTX holds the
tensor-core MMA (mma.sync m16n8k16), the 16-byte cp.async loads and, for FP4, the prmt-based decode.

A representative subset runs by default (every K and V format at least once, both head_dims, every row-tile count,
split and causal flags, every page-size class, fp16 q); the full K x V format matrix is marked ``slow``.
"""

from __future__ import annotations

import itertools

import pytest

from qattn.cute_kernels.combine import CombineSplits
from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count
from qattn.cute_kernels.sm90.decode import DecodeSm90
from qattn.cute_kernels.sm90.decode_config import DecodeConfig, num_splits_heuristic, row_tiles_for
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
]


def _compile(kf, vf, D, qd, group, sq, page, causal, split):
    cfg = DecodeConfig(kv_format(kf), kv_format(vf), D, qd, group, row_tiles_for(group * sq), page, causal, split)
    _, ptx = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    return cfg, ptx


def _check_ptx(cfg: DecodeConfig, ptx: str) -> None:
    assert ptx_count(ptx, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32") > 0, "no tensor-core MMA in the PTX"
    assert ptx_count(ptx, r"cp\.async\.cg\.shared\.global.*16") > 0, "no 16-byte cp.async in the PTX"
    assert ptx_count(ptx, r"cp\.async\.wait_group") > 0
    for f in (cfg.k_fmt, cfg.v_fmt):
        if f.payload == "e2m1":
            assert ptx_count(ptx, r"prmt\.b32") > 0 and ptx_count(ptx, r"cvt\.rn\.f16x2\.e4m3x2") > 0
        if f.payload == "e4m3":
            assert ptx_count(ptx, r"cvt\.rn\.f16x2\.e4m3x2") > 0


@pytest.mark.parametrize("case", REPRESENTATIVE, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}-g{c[4]}-sq{c[5]}-p{c[6]}"
                         f"{'-causal' if c[7] else ''}{'-split' if c[8] else ''}")
def test_decode_compiles_sm90(case):
    cfg, ptx = _compile(*case)
    _check_ptx(cfg, ptx)


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
        row_tiles_for(129)
    assert [row_tiles_for(r) for r in (1, 16, 17, 32, 33, 64, 65, 128)] == [1, 1, 2, 2, 4, 4, 8, 8]
    # many sequences: no split; one long sequence: enough splits to fill the GPU, bounded by the work
    assert num_splits_heuristic(32, 8, 8192, 132) == 1
    assert num_splits_heuristic(1, 8, 131072, 132) == 33
    assert num_splits_heuristic(1, 8, 256, 132) == 1
    cfg = DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, False)
    assert cfg.key != DecodeConfig(f, f, 128, "bf16", 4, 1, 64, True, True).key


def test_launcher_config_choice(monkeypatch):
    """What the launcher picks on the host (no GPU needed): tile size by format, the tuning overrides, and the
    exact split-heuristic call it makes."""
    from qattn import PagedKVCache
    from qattn.interface import decode as idec

    nv = PagedKVCache(1, 4, 64, 2, 128, "nvfp4")
    bf = PagedKVCache(1, 4, 64, 2, 128, ("nvfp4", "bf16"))
    assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).tile_n == 128
    assert idec.decode_config_for(bf, "bf16", 4, 1, True, False).tile_n == 64
    monkeypatch.setenv("QATTN_DECODE_WARPS", "8")
    assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).num_warps == 8
    assert idec.decode_config_for(bf, "bf16", 4, 1, True, False).num_warps == 4  # 64-token tiles: 4 warps
    monkeypatch.setenv("QATTN_DECODE_TILE_N", "64")
    assert idec.decode_config_for(nv, "bf16", 4, 1, True, False).tile_n == 64
    monkeypatch.setenv("QATTN_DECODE_TILE_N", "96")
    with pytest.raises(ValueError, match="QATTN_DECODE_TILE_N"):
        idec.decode_config_for(nv, "bf16", 4, 1, True, False)
    monkeypatch.delenv("QATTN_DECODE_TILE_N")
    # the call flash_attn_with_kvcache makes for num_splits=0
    assert num_splits_heuristic(1, 2, 4 * 64, 132, tile_n=idec._tile_n(bf)) == 1
