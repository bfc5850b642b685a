"""CPU CI: every SM100 decode variant class compiles for sm_100a and its PTX holds the block-scaled tcgen05.mma,
TMEM allocation, the SMEM->TMEM scale copies and TMA loads. Compile times are recorded in
``$QATTN_COMPILE_TIMES`` (default: none) and printed. NOTE: these kernels never ran on hardware."""

from __future__ import annotations

import pytest

from qattn.cute_kernels.compile_utils import ptx_count
from qattn.cute_kernels.sm100.decode import DecodeSm100, decode_sm100_compile_args
from qattn.cute_kernels.sm100.decode_config import DecodeConfigSm100
from qattn.layouts.formats import kv_format
from tests.sm100._cases import compile_sm100_timed

# (format, head_dim, page, group, causal, split, q_terms) -> expected MMA kind
CASES = [
    ("nvfp4", 128, 16, 8, True, True, 2, r"kind::mxf4nvf4\.block_scale\.block16"),
    ("nvfp4", 64, 256, 4, True, False, 1, r"kind::mxf4nvf4\.block_scale\.block16"),
    ("mxfp4", 128, 64, 8, True, True, 2, r"kind::mxf4nvf4\.block_scale\.block32"),  # MmaMXF4Op lowers to this
    ("mxfp4_b16", 64, 128, 16, False, False, 2, r"kind::mxf4nvf4\.block_scale\.block16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-p{c[2]}-g{c[3]}-qt{c[6]}"
                         f"{'-split' if c[5] else ''}")
def test_decode_sm100_compiles(case):
    fmt, D, page, group, causal, split, qt, kind = case
    cfg = DecodeConfigSm100(kv_format(fmt), kv_format(fmt), D, "bf16", group, page, causal, split, q_terms=qt)
    ptx = compile_sm100_timed("sm100_decode", case[:7], DecodeSm100(cfg), decode_sm100_compile_args())
    n_qk = ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\." + kind)
    assert n_qk >= qt * (D // 64), f"block-scaled QK MMA missing ({n_qk})"
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::f16") > 0  # P.V
    assert ptx_count(ptx, r"tcgen05\.alloc") > 0 and ptx_count(ptx, r"tcgen05\.dealloc") > 0
    assert ptx_count(ptx, r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4") > 0  # scale factors SMEM -> TMEM
    assert ptx_count(ptx, r"cp\.async\.bulk\.tensor") > 0  # TMA
    assert ptx_count(ptx, r"tcgen05\.commit") > 0 and ptx_count(ptx, r"mbarrier") > 0
    assert ptx_count(ptx, r"tcgen05\.ld\.sync") > 0 and ptx_count(ptx, r"tcgen05\.st\.sync") > 0
    # tcgen05.ld is asynchronous: each load of S / O is waited on before its registers are read
    assert ptx_count(ptx, r"tcgen05\.wait::ld") >= 3


def test_config_rejects():
    with pytest.raises(ValueError, match="FP4 keys"):
        DecodeConfigSm100(kv_format("fp8"), kv_format("nvfp4"), 128, "bf16", 8, 16, True, False)
    with pytest.raises(ValueError, match="scale-factor atom"):
        DecodeConfigSm100(kv_format("mxfp4"), kv_format("mxfp4"), 64, "bf16", 8, 16, True, False)
    with pytest.raises(ValueError, match="page_size"):
        DecodeConfigSm100(kv_format("nvfp4"), kv_format("nvfp4"), 128, "bf16", 8, 8, True, False)


@pytest.mark.parametrize("split", [False, True])
def test_decode_sm100_window_compiles(split):
    """The sliding-window variant (``window``): the same MMAs, TMEM traffic and loads as the causal kernel; the
    splits start at the first visible tile and each row masks its left edge (never ran on hardware)."""
    fmt = kv_format("nvfp4")
    plain = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split)
    cfg = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, window=True)
    assert cfg.key == plain.key + ("window",)
    ptx = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "window", split), DecodeSm100(cfg),
                              decode_sm100_compile_args())
    ref = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "plain", split), DecodeSm100(plain),
                              decode_sm100_compile_args())
    for op in (r"tcgen05\.mma\.cta_group::1\.", r"tcgen05\.cp\.", r"cp\.async\.bulk\.tensor", r"tcgen05\.ld\.sync",
               r"tcgen05\.st\.sync", r"tcgen05\.commit"):
        assert ptx_count(ptx, op) == ptx_count(ref, op) > 0, op
    # one more compare-and-select per score (the left edge) than the causal kernel
    assert ptx_count(ptx, r"selp\.f32") >= ptx_count(ref, r"selp\.f32") + 128


@pytest.mark.parametrize("split", [False, True])
def test_decode_sm100_softcap_compiles(split):
    """``softcap``: its own key per cap, one ``tanh.approx.f32`` per score of a thread's row (128) and the same
    MMAs, TMEM traffic and loads as the plain kernel (never ran on hardware)."""
    fmt = kv_format("nvfp4")
    plain = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split)
    cfg = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, softcap=50)
    assert cfg.key == plain.key + (("softcap", 50.0),) and cfg.softcap == 50.0
    ptx = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "softcap", split), DecodeSm100(cfg),
                              decode_sm100_compile_args())
    ref = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "plain", split), DecodeSm100(plain),
                              decode_sm100_compile_args())
    assert ptx_count(ptx, r"tanh\.approx\.f32") == 128 and ptx_count(ref, r"tanh\.approx") == 0
    for op in (r"tcgen05\.mma\.cta_group::1\.", r"tcgen05\.cp\.", r"cp\.async\.bulk\.tensor", r"tcgen05\.ld\.sync",
               r"tcgen05\.st\.sync", r"tcgen05\.commit", r"ex2\.approx"):
        assert ptx_count(ptx, op) == ptx_count(ref, op) > 0, op
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="softcap"):
            DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, softcap=bad)
