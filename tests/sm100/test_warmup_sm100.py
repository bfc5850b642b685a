"""CPU: qattn-warmup lists and compiles the SM100 decode variants with the keys the SM100 launcher uses
(compile only: no Blackwell GPU exists here, these kernels never ran on hardware)."""

from __future__ import annotations

import pytest

import qattn
from qattn.cute_kernels.sm100.decode import decode_sm100_cache_key
from qattn.interface.decode_sm100 import sm100_config_for
from qattn.interface.variants import enumerate_variants


def test_warmed_keys_are_the_launcher_keys():
    keys = {v.key for v in enumerate_variants("decode", "sm_100a", kv_formats=["nvfp4", "mxfp4_b16", "mxfp4"],
                                              head_dims=[64, 128], gqa=[4, 8], page_sizes=[16, 128])}
    for fmt, d in (("nvfp4", 64), ("nvfp4", 128), ("mxfp4_b16", 64), ("mxfp4", 128)):
        for g in (4, 8):
            for page in (16, 128):
                cache = qattn.PagedKVCache(1, 4, page, 2, d, fmt)
                for split in (False, True):
                    cfg = sm100_config_for(cache, "bf16", g, 1, True, split)
                    assert decode_sm100_cache_key("sm_100a", cfg) in keys
    # what the SM100 kernel cannot take is not listed: mxfp4 (block 32) at head_dim 64, 8-bit formats, rings
    assert not enumerate_variants("decode", "sm_100a", kv_formats=["mxfp4"], head_dims=[64])
    assert not enumerate_variants("decode", "sm_100a", kv_formats=["fp8", "int8", "bf16"])
    assert not enumerate_variants("decode", "sm_100a", kv_formats=["nvfp4"], recent_windows=[64])
    assert {v.label for v in enumerate_variants("combine", "sm_100a", head_dims=[128])} == {"D128 out bf16"}


def test_sliding_window_twins_are_the_launcher_keys():
    """``qattn-warmup --sliding-window`` adds each SM100 decode variant's window twin, with the key the launcher
    builds for a window (never ran on hardware)."""
    kw = dict(kv_formats=["nvfp4"], head_dims=[128], gqa=[8], page_sizes=[64])
    plain = {v.key for v in enumerate_variants("decode", "sm_100a", **kw)}
    both = {v.key for v in enumerate_variants("decode", "sm_100a", sliding_window=True, **kw)}
    assert plain < both and len(both) == 2 * len(plain)
    cache = qattn.PagedKVCache(1, 4, 64, 2, 128, "nvfp4")
    for split in (False, True):
        cfg = sm100_config_for(cache, "bf16", 8, 1, True, split, window=True)
        assert decode_sm100_cache_key("sm_100a", cfg) in both - plain


@pytest.mark.compile
def test_warmup_cli_compiles_sm100_decode_on_the_cpu(tmp_path):
    from tests.interface.test_warmup import check_compiles_then_cached

    args = ["--arch", "sm_100a", "--kernels", "decode,combine", "--kv-formats", "nvfp4", "--head-dims", "64",
            "--gqa", "4", "--page-sizes", "16", "--jobs", "2"]
    check_compiles_then_cached(args, "sm_100a", 3, tmp_path)


def test_softcap_twins_are_the_launcher_keys():
    """``qattn-warmup --softcap 50`` adds each SM100 decode variant's softcap twin, with the key the launcher builds
    for that cap (never ran on hardware)."""
    kw = dict(kv_formats=["nvfp4"], head_dims=[128], gqa=[8], page_sizes=[64])
    plain = {v.key for v in enumerate_variants("decode", "sm_100a", **kw)}
    both = {v.key for v in enumerate_variants("decode", "sm_100a", softcaps=[50.0], **kw)}
    assert plain < both and len(both) == 2 * len(plain)
    cache = qattn.PagedKVCache(1, 4, 64, 2, 128, "nvfp4")
    for split in (False, True):
        cfg = sm100_config_for(cache, "bf16", 8, 1, True, split, softcap=50.0)
        assert decode_sm100_cache_key("sm_100a", cfg) in both - plain
