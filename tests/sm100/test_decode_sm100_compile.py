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


@pytest.mark.parametrize("kf,vf,D,group,sq,split,W,N,window,cap", [
    ("fp8", "fp8", 128, 4, 1, True, 0, 0, False, 0.0),
    ("nvfp4", "nvfp4", 128, 8, 1, False, 64, 1, True, 30.0),
    ("int8", "nvfp4", 64, 16, 16, True, 0, 0, False, 0.0),
])
def test_mma_sync_decode_compiles_for_sm100(kf, vf, D, group, sq, split, W, N, window, cap):
    """What the tcgen05 kernel does not take runs on SM100 as the portable mma.sync decode kernel compiled for
    sm_100a: its PTX is the sm_90a PTX (the kernel the H100 tests run) but for the ``.target`` line, and ptxas
    builds it for sm_100a. Never ran on a Blackwell GPU."""
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm90.decode import DecodeSm90, decode_compile_args
    from qattn.cute_kernels.sm90.decode_config import choose_config

    cfg = choose_config(kv_format(kf), kv_format(vf), D, 16, "bf16", group, sq, True, split, ring_window=W,
                        sink_tokens=N, window=window, softcap=cap)
    ptx = compile_sm100_timed("mma_sync_decode", (kf, vf, D, group, sq, split, W, N, window, cap), DecodeSm90(cfg),
                              decode_compile_args())
    _, ptx90 = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    lines, lines90 = ptx.splitlines(), ptx90.splitlines()
    assert ".target sm_100a" in lines and ".target sm_90a" in lines90
    assert [x for x in lines if not x.startswith(".target")] == [x for x in lines90 if not x.startswith(".target")]
    assert ptx_count(ptx, r"mma\.sync\.aligned\.m16n8k16") > 0 and ptx_count(ptx, r"tcgen05") == 0
