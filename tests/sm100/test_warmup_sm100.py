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
    # what the tcgen05 kernel cannot take (mxfp4's block 32 at head_dim 64, 8-bit formats, rings) is listed as the
    # portable mma.sync kernel's variants only
    for kw in (dict(kv_formats=["mxfp4"], head_dims=[64]), dict(kv_formats=["fp8", "int8", "bf16"]),
               dict(kv_formats=["nvfp4"], recent_windows=[64])):
        labels = [v.label for v in enumerate_variants("decode", "sm_100a", **kw)]
        assert labels and all(label.endswith("(mma.sync on sm100, never ran)") for label in labels)
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


def test_portable_decode_variants_are_the_launcher_keys():
    """On sm_100a the caches the tcgen05 kernel does not take (8-bit / 16-bit formats, mixed K/V with a non-FP4
    side, a ring or sinks, more than 128 rows) are warmed as the mma.sync kernel compiled for sm_100a, with the key
    flash_attn_with_kvcache builds for them; FP4 caches it takes are not warmed twice."""
    from qattn.cute_kernels.sm90.decode import decode_cache_key
    from qattn.interface.decode import _tcgen05_takes, decode_config_for

    kw = dict(head_dims=[128], gqa=[8, 16], seqlen_q=[1, 16], page_sizes=[64], recent_windows=[0, 64],
              sink_tokens=[0, 1])
    fmts = ["nvfp4", "fp8", "int8+nvfp4", "bf16"]
    keys = {v.key for v in enumerate_variants("decode", "sm_100a", kv_formats=fmts, **kw)}
    portable = 0
    for fmt in fmts:
        for W, N, g, sq in [(W, N, g, sq) for W in (0, 64) for N in (0, 1) for g in (8, 16) for sq in (1, 16)]:
            if sq * g > 256:
                continue
            pair = tuple(fmt.split("+")) if "+" in fmt else fmt
            cache = qattn.PagedKVCache(1, 4, 64, 2, 128, pair, recent_window=W, sink_tokens=N,
                                       max_seqs=2 if W or N else 0)
            for split in (False, True):
                mma_sync_key = decode_cache_key("sm_100a", decode_config_for(cache, "bf16", g, sq, True, split))
                if _tcgen05_takes(cache, "bf16", g, sq):
                    assert fmt == "nvfp4" and not (W or N) and sq * g <= 128
                    assert decode_sm100_cache_key("sm_100a", sm100_config_for(cache, "bf16", g, sq, True, split)) in keys
                    assert mma_sync_key not in keys
                else:
                    assert mma_sync_key in keys
                    portable += 1
    assert portable > 0
