"""CPU CI: every shipped dense SM100 INT8-QK prefill variant (head_dim 64/128 x causal x q-scale granularity x V
dtype, 16 in all; varlen twins below) compiles for sm_100a, and its PTX holds the int8 tcgen05.mma (Q K^T), the 16-bit tcgen05.mma (P.V),
TMA loads, TMEM allocation, the TMEM loads/stores with their waits and the read of each thread's int8 Q row for
K's smoothing shift (the LSE's, or with softcap the scores'). Compile times are appended to
``$QATTN_COMPILE_TIMES`` (default: none) and printed. NOTE: this kernel never ran on hardware."""

from __future__ import annotations

import itertools
import shutil

import pytest

from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count
from qattn.cute_kernels.sm100.prefill_config import PrefillConfigSm100
from qattn.cute_kernels.sm100.prefill_int8 import QKInt8PrefillSm100, prefill_sm100_compile_args
from tests.sm100._cases import compile_sm100_timed

CASES = list(itertools.product((64, 128), (False, True), ("per_warp", "per_block"), ("bf16", "fp16")))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}-{c[3]}")
def test_prefill_sm100_compiles(case):
    D, causal, gran, vd = case
    cfg = PrefillConfigSm100(D, vd, causal, gran)
    ptx = compile_sm100_timed("sm100_prefill_int8", case, QKInt8PrefillSm100(cfg), prefill_sm100_compile_args())
    # Q K^T: head_dim / 32 int8 MMAs per tile (K = 32 bytes per instruction)
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::i8") == D // 32
    # P.V: 128 keys / 16 per 16-bit MMA; the element type is in the instruction descriptor, not the mnemonic
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::f16") == 128 // 16
    assert ptx_count(ptx, r"tcgen05\.mma") == D // 32 + 8  # nothing else issues MMAs
    assert ptx_count(ptx, r"cp\.async\.bulk\.tensor") > 0  # TMA (Q, K, V)
    assert ptx_count(ptx, r"tcgen05\.alloc") == 1 and ptx_count(ptx, r"tcgen05\.dealloc") == 1
    assert ptx_count(ptx, r"tcgen05\.commit") == 2  # S done, O done
    assert ptx_count(ptx, r"tcgen05\.ld\.sync\.aligned\.32x32b") > 0 and ptx_count(ptx, r"tcgen05\.st\.sync") > 0
    # tcgen05.ld is asynchronous: waited on once for S, once per 32-column chunk of the O rescale (chunks keep the
    # D128 kernels free of spills), once for the epilogue's O
    assert ptx_count(ptx, r"tcgen05\.wait::ld") == 2 + D // 32 and ptx_count(ptx, r"tcgen05\.wait::st") >= 1
    # the S row: int32 -> fp32; once per CTA D more, the Q row's bytes of K's smoothing shift (``_row_shift``)
    assert ptx_count(ptx, r"cvt\.rn\.f32\.s32") == 128 + D
    pack = r"cvt\.rn\.bf16x2\.f32" if vd == "bf16" else r"cvt\.rn\.f16x2\.f32"
    assert ptx_count(ptx, pack) == 64  # P rounded to V's type, two per TMEM column
    assert ptx_count(ptx, r"tanh\.approx") == 0  # no softcap
    # K's smoothing mean put back into the LSE: each thread's int8 Q row, read once (D / 16 128-bit loads)
    assert ptx_count(ptx, r"ld\.global\.v4") == D // 16


def test_config_rejects():
    with pytest.raises(ValueError, match="head_dim"):
        PrefillConfigSm100(96, "bf16", True, "per_warp")
    with pytest.raises(ValueError, match="v_dtype"):
        PrefillConfigSm100(128, "fp8", True, "per_warp")
    with pytest.raises(ValueError, match="granularity"):
        PrefillConfigSm100(128, "bf16", True, "per_thread")
    assert PrefillConfigSm100(64, "bf16", True, "per_warp").tmem_cols == 256
    assert PrefillConfigSm100(128, "bf16", True, "per_warp").tmem_cols == 512
    keys = {PrefillConfigSm100(d, vd, causal, gran).key for d, causal, gran, vd in CASES}
    assert len(keys) == len(CASES)  # the key tells every variant apart
    for bad in (-1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ValueError, match="softcap"):
            PrefillConfigSm100(128, "bf16", True, "per_warp", softcap=bad)
    plain = PrefillConfigSm100(128, "bf16", True, "per_warp")
    assert PrefillConfigSm100(128, "bf16", True, "per_warp", softcap=0).key == plain.key  # 0: off, key unchanged
    capped = PrefillConfigSm100(128, "bf16", True, "per_warp", softcap=50)
    assert capped.softcap == 50.0 and capped.key == plain.key + (("softcap", 50.0),)


@pytest.mark.parametrize("D,causal", [(128, True), (64, False)])
def test_prefill_sm100_window_compiles(D, causal):
    """The sliding-window variant (``local``): the same MMAs, loads and TMEM traffic; the tile loop starts at the
    first row's window tile (never ran on hardware)."""
    cfg = PrefillConfigSm100(D, "bf16", causal, "per_warp", local=True)
    assert "local" in cfg.key and cfg.key != PrefillConfigSm100(D, "bf16", causal, "per_warp").key
    ptx = compile_sm100_timed("sm100_prefill_int8", (D, causal, "window"), QKInt8PrefillSm100(cfg),
                              prefill_sm100_compile_args())
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::i8") == D // 32
    assert ptx_count(ptx, r"tcgen05\.mma") == D // 32 + 8
    assert ptx_count(ptx, r"cp\.async\.bulk\.tensor") > 0 and ptx_count(ptx, r"tcgen05\.alloc") == 1
    assert ptx_count(ptx, r"cvt\.rn\.f32\.s32") == 128 + D  # the S row, and the Q row of the smoothing shift


@pytest.mark.parametrize("D,causal,gran,local", [(128, True, "per_warp", False), (64, False, "per_block", True)])
def test_prefill_sm100_softcap_compiles(D, causal, gran, local):
    """``softcap``: one ``tanh.approx.f32`` per score of the thread's 128-key row, the same MMAs as the plain
    kernel, and the smoothing shift's one read of the thread's int8 Q row (D / 16 128-bit loads; never ran on
    hardware)."""
    cfg = PrefillConfigSm100(D, "bf16", causal, gran, local=local, softcap=30.0)
    ptx = compile_sm100_timed("sm100_prefill_int8", (D, causal, gran, "softcap"), QKInt8PrefillSm100(cfg),
                              prefill_sm100_compile_args())
    assert ptx_count(ptx, r"tanh\.approx\.f32") == 128
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::i8") == D // 32
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::f16") == 128 // 16
    assert ptx_count(ptx, r"tcgen05\.mma") == D // 32 + 8
    assert ptx_count(ptx, r"ld\.global\.v4") == D // 16
    assert ptx_count(ptx, r"tcgen05\.alloc") == 1 and ptx_count(ptx, r"tcgen05\.commit") == 2


@pytest.mark.parametrize("D,causal,gran,vd,local,cap", [(128, True, "per_warp", "bf16", False, 0.0),
                                                        (64, False, "per_block", "fp16", False, 0.0),
                                                        (128, True, "per_block", "bf16", True, 30.0),
                                                        (64, False, "per_warp", "bf16", True, 0.0)])
def test_prefill_sm100_varlen_compiles(D, causal, gran, vd, local, cap):
    """``varlen``: the same MMAs, TMEM traffic and conversions as the dense twin; TMA over the packed tensors as
    one batch (3-d boxes, the batch mode gone), the cu_seqlens reads, and no ptxas spills where the dense twin has
    none (never ran on hardware)."""
    dense = PrefillConfigSm100(D, vd, causal, gran, local=local, softcap=cap)
    cfg = PrefillConfigSm100(D, vd, causal, gran, local=local, softcap=cap, varlen=True)
    assert cfg.key == dense.key + ("varlen",) and "varlen" not in dense.key
    ptx = compile_sm100_timed("sm100_prefill_int8", (D, causal, gran, vd, local, cap, "varlen"),
                              QKInt8PrefillSm100(cfg), prefill_sm100_compile_args())
    _, ptx_dense = compile_for_arch(QKInt8PrefillSm100(dense), *prefill_sm100_compile_args(), arch="sm_100a")
    for pat in (r"tcgen05\.mma\.cta_group::1\.kind::i8", r"tcgen05\.mma\.cta_group::1\.kind::f16", r"tcgen05\.mma",
                r"tcgen05\.alloc", r"tcgen05\.dealloc", r"tcgen05\.commit", r"tcgen05\.wait::ld",
                r"cvt\.rn\.f32\.s32", r"cvt\.rn\.(bf16|f16)x2\.f32", r"tanh\.approx\.f32", r"cp\.async\.bulk\.tensor",
                r"ld\.global\.v4"):
        assert ptx_count(ptx, pat) == ptx_count(ptx_dense, pat), pat
    assert ptx_count(ptx, r"tcgen05\.mma") == D // 32 + 8
    assert ptx_count(ptx, r"cp\.async\.bulk\.tensor\.3d") > 0 and ptx_count(ptx, r"cp\.async\.bulk\.tensor\.4d") == 0
    assert ptx_count(ptx_dense, r"cp\.async\.bulk\.tensor\.4d") > 0
    if shutil.which("ptxas") is not None:
        from tests.sm100._cases import ptxas_spill_bytes

        spills, spills_dense = ptxas_spill_bytes(ptx)[1], ptxas_spill_bytes(ptx_dense)[1]
        print(f"ptxas spill stores: varlen {spills}, dense {spills_dense}")
        if spills_dense == 0:
            assert spills == 0


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs the CUDA toolkit's ptxas on PATH")
@pytest.mark.parametrize("extra", [{}, {"varlen": True}, {"softcap": 30.0, "local": True}], ids=["plain", "varlen",
                                                                                                   "softcap-window"])
def test_prefill_sm100_d128_does_not_spill(extra):
    """ptxas keeps the D128 kernels in registers: the O rescale goes through TMEM in 32-column chunks (a whole
    128-column O row at once spilled ~340 bytes at 255 registers)."""
    from tests.sm100._cases import ptxas_spill_bytes

    cfg = PrefillConfigSm100(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp", **extra)
    _, ptx = compile_for_arch(QKInt8PrefillSm100(cfg), *prefill_sm100_compile_args(), arch="sm_100a")
    regs, spills = ptxas_spill_bytes(ptx)
    assert spills == 0, (regs, spills)
