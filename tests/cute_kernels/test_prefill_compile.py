"""CPU: every shipped SM90 INT8-QK prefill variant compiles for sm_90a, and its PTX has the instructions the
design depends on (int8 and 16-bit wgmma, TMA loads, register re-allocation, no I2F, no local memory)."""

from __future__ import annotations

import itertools

import pytest

from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count, ptx_has
from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
from qattn.interface.prefill import prefill_compile_args

pytestmark = pytest.mark.compile

_PTX = {"bf16": "bf16", "fp16": "f16"}
VARIANTS = [v + (False,) for v in itertools.product((64, 128), ("bf16", "fp16"), (False, True), ("per_warp", "per_block"))]
VARIANTS += [(D, "bf16", causal, "per_warp", True) for D in (64, 128) for causal in (False, True)]  # varlen
# Any integer -> float conversion (I2F): every rounding mode (.rn/.rz/.rm/.rp, with .ftz/.sat), every float
# destination (f16, bf16, f32, f64) and signed / unsigned source width; "cvt.rn.f32.s32" alone missed e.g.
# cvt.rz.f32.s32 or cvt.rn.f32.u32. The kernels have no int -> float cvt at all (their cvt are int <-> int
# widenings / narrowings and f32 -> 16-bit packs), so the whole PTX is checked, not only the scores path.
I2F = r"\bcvt(\.\w+)*\.(b?f16|f32|f64)\.[su](8|16|32|64)\b"


def _compile(cfg):
    from qattn.cute_kernels.sm90.prefill_int8 import QKInt8PrefillSm90

    return compile_for_arch(QKInt8PrefillSm90(cfg), *prefill_compile_args(), arch="sm_90a")[1]


@pytest.mark.parametrize("D,v_dtype,causal,granularity,varlen", VARIANTS)
def test_prefill_variant_compiles_with_wgmma_and_tma(D, v_dtype, causal, granularity, varlen):
    cfg = PrefillConfig(head_dim=D, v_dtype=v_dtype, causal=causal, granularity=granularity, varlen=varlen)
    ptx = _compile(cfg)
    # Q K^T: D/32 int8 k-steps; P V: 128/16 k-steps in V's dtype; both in the prologue/epilogue and the loop
    assert ptx_count(ptx, "wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8") == 2 * (D // 32)
    assert ptx_count(ptx, f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{_PTX[v_dtype]}.{_PTX[v_dtype]}") == 2 * 8
    assert ptx_count(ptx, "cp.async.bulk.tensor") >= 3  # Q, K, V (a 256-byte V row is two 128-byte boxes)
    assert ptx_has(ptx, "setmaxnreg.dec") and ptx_has(ptx, "setmaxnreg.inc")
    # pdl: the producer (before K / V, and before an int8 Q) and the MMA warps (before the scales) wait for the
    # prepass grid
    assert ptx_count(ptx, r"griddepcontrol\.wait") >= 2
    assert not ptx_has(ptx, I2F), "int32 scores must be converted without I2F"
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"
    # O leaves in 16-byte stores (8 columns of one row per lane after the quad transpose), two rows per thread;
    # a second copy in the split tail's merge
    assert ptx_count(ptx, r"st\.global\.v4\.b32") == 2 * (D // 32) * (2 if cfg.split_tail else 1)


def test_config_key_separates_every_field():
    base = PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp")
    others = [PrefillConfig(head_dim=64, v_dtype="bf16", causal=False, granularity="per_warp"),
              PrefillConfig(head_dim=128, v_dtype="fp16", causal=False, granularity="per_warp"),
              PrefillConfig(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp"),
              PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_block"),
              PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", kv_stages=3),
              PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", pingpong=False),
              PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", varlen=True)]
    keys = {c.key for c in others} | {base.key}
    assert len(keys) == len(others) + 1


@pytest.mark.parametrize("kw,err", [(dict(head_dim=96), "head_dim"), (dict(v_dtype="fp8"), "v_dtype"),
                                    (dict(granularity="per_thread"), "granularity"), (dict(kv_stages=1), "kv_stages")])
def test_config_rejects_unsupported(kw, err):
    args = dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp") | kw
    with pytest.raises(ValueError, match=err):
        PrefillConfig(**args)


@pytest.mark.parametrize("causal", [False, True])
def test_three_mma_warpgroups_where_they_pay(causal):
    """per_warp q scales: 192-row tiles, three MMA warpgroups of 160 registers after the producer's
    setmaxnreg.dec, at head_dim 64 (with the intra-warpgroup overlap) and at head_dim 128 with FP8 P.V or
    non-causal (serial loop: the overlap's registers do not fit); per_block (128-row q scales) and causal D128
    with 16-bit P.V keep two of 240."""
    def cfg(D, pv="bf16", gran="per_warp", **kw):
        return PrefillConfig(head_dim=D, v_dtype="bf16", causal=causal, granularity=gran, pv_dtype=pv, **kw)

    three = [(cfg(64), True), (cfg(64, "fp8"), True), (cfg(128, "fp8"), False)] + ([] if causal else [(cfg(128), False)])
    for c, overlap in three:
        assert (c.tile_m, c.mma_warpgroups, c.intra_wg_overlap) == (192, 3, overlap)
        ptx = _compile(c)
        assert ptx_has(ptx, r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160")
        assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "local arrays"
    two = [cfg(64, gran="per_block"), cfg(128, gran="per_block"), cfg(128, "fp8", "per_block")]
    two += [cfg(128)] if causal else []
    for c in two:
        assert (c.tile_m, c.mma_warpgroups, c.intra_wg_overlap) == (128, 2, True)
    assert ptx_has(_compile(cfg(64, gran="per_block")), r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240")
    with pytest.raises(ValueError, match="per_warp"):
        cfg(64, gran="per_block", tile_m=192)
    with pytest.raises(ValueError, match="tile_m"):
        cfg(64, tile_m=256)
    with pytest.raises(ValueError, match="intra_wg_overlap"):  # 64 + 32 + 64 registers of S, P, O: no fit
        cfg(128, tile_m=192, intra_wg_overlap=True)
    assert cfg(64).key != cfg(64, tile_m=128).key
    assert cfg(128, tile_m=192, intra_wg_overlap=False).key != cfg(128, tile_m=128, intra_wg_overlap=False).key
    assert cfg(128, tile_m=128).key != cfg(128, tile_m=128, intra_wg_overlap=False).key


def test_long_causal_grids_take_192_rows():
    """Dense causal head_dim 128 with int8 QK (per_warp) and 16-bit P.V: 192-row tiles from LONG_CAUSAL_KEYS keys
    (``seqlen_tile_m``), and qattn-warmup compiles that variant with the key prefill_int8 asks for."""
    from qattn.cute_kernels.sm90.prefill_config import LONG_CAUSAL_KEYS, seqlen_tile_m
    from qattn.interface.prefill import _prefill_variants

    long = LONG_CAUSAL_KEYS
    assert seqlen_tile_m(128, "per_warp", "bf16", True, "int8", long) == 192
    assert seqlen_tile_m(128, "per_warp", "bf16", True, "int8", long - 1) is None
    for args in [(128, "per_warp", "bf16", False, "int8"), (64, "per_warp", "bf16", True, "int8"),
                 (128, "per_block", "bf16", True, "int8"), (128, "per_warp", "fp8", True, "int8"),
                 (128, "per_warp", "bf16", True, "bf16")]:
        assert seqlen_tile_m(*args, 4 * long) is None, args  # already 192 rows, or not allowed
    keys = {v.key for v in _prefill_variants("sm_90a", head_dims=[128], q_dtypes=["bf16"], balance_qk=True)}
    for bal in (False, True):
        want = PrefillConfig(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp", quantize_q=True,
                             balance_qk=bal, tile_m=192)
        assert ("sm_90a",) + want.key in keys and not want.intra_wg_overlap


def test_serial_loop_keeps_the_mma_order():
    """intra_wg_overlap=False: per tile, one turn issues P V(n-1), waits for all of it (wait_group 0, never 1)
    and refills the score registers before QK^T(n); the same wgmmas as the overlapped loop."""
    base = dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", quantize_q=True)
    serial = _compile(PrefillConfig(**base, tile_m=192, intra_wg_overlap=False))
    overlap = _compile(PrefillConfig(**base, tile_m=128))
    for mma in ("wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8",
                "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"):
        assert ptx_count(serial, mma) == ptx_count(overlap, mma)
    assert ptx_has(overlap, r"wgmma\.wait_group\.sync\.aligned\s+1;")
    assert not ptx_has(serial, r"wgmma\.wait_group\.sync\.aligned\s+1;")
    assert ptx_count(serial, "ld.volatile.shared.v4.b32") == 2 * 16  # before the first tile and in the loop


# ---- Q quantized inside the kernel (quantize_q, flash_attn_func's per_warp path) -------------------------------
@pytest.mark.parametrize("D,v_dtype,causal,varlen,pv", [(128, "bf16", False, False, "bf16"), (64, "fp16", True, False, "bf16"),
                                                       (64, "bf16", False, True, "bf16"), (128, "bf16", True, False, "fp8")])
def test_quantize_q_variant_compiles(D, v_dtype, causal, varlen, pv):
    cfg = PrefillConfig(head_dim=D, v_dtype=v_dtype, causal=causal, granularity="per_warp", varlen=varlen, pv_dtype=pv,
                        quantize_q=True)
    ptx = _compile(cfg)
    plain = _compile(PrefillConfig(head_dim=D, v_dtype=v_dtype, causal=causal, granularity="per_warp", varlen=varlen,
                                   pv_dtype=pv))
    int8_qk = "wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8"
    assert ptx_count(ptx, int8_qk) == 2 * (D // 32)
    # the Q tile still arrives by TMA (16-bit now): as many bulk tensor copies as the int8 Q's, or one more box
    assert ptx_count(ptx, "cp.async.bulk.tensor") >= ptx_count(plain, "cp.async.bulk.tensor")
    # generic-proxy smem writes made visible to wgmma, then the warpgroup's named barrier (128 threads)
    assert ptx_has(ptx, r"fence\.proxy\.async\.shared::cta") and ptx_has(ptx, r"bar\.sync\s+\S+,\s*128;")
    # exact prepass numerics: div.rn scale, rcp.rn inverse, mul.rn products, rounding by the 1.5 * 2^23 add
    for op in (r"div\.rn\.f32", r"rcp\.rn\.f32", r"mul\.rn\.f32", r"add\.rn\.f32 \S+, \S+, 0f4B400000", r"max\.u16x2"):
        assert ptx_has(ptx, op), op
    assert not ptx_has(ptx, r"cvt\.rni\.s32\.f32"), "quarter-rate float -> int conversions"
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"


def test_quantize_q_config():
    base = dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp")
    assert PrefillConfig(**base).key != PrefillConfig(**base, quantize_q=True).key
    assert PrefillConfig(**base, quantize_q=True).key[2:4] == ("bf16", "int8")  # Q's and K's dtypes
    with pytest.raises(ValueError, match="quantize_q"):
        PrefillConfig(**dict(base, granularity="per_block"), quantize_q=True)
    with pytest.raises(ValueError, match="quantize_q"):
        PrefillConfig(**base, qk_dtype="bf16", quantize_q=True)


@pytest.mark.parametrize("D,varlen,pv", [(128, False, "bf16"), (64, True, "bf16"), (128, False, "fp8"),
                                         (128, True, "fp8")])
def test_quantize_q_with_channel_balance_compiles(D, varlen, pv):
    cfg = PrefillConfig(head_dim=D, v_dtype="bf16", causal=True, granularity="per_warp", varlen=varlen, pv_dtype=pv,
                        quantize_q=True, balance_qk=True)
    ptx = _compile(cfg)
    values = D // 2  # per lane: half a row of its 16-row group
    # x * lam (exact) then * inv, both RN; the amax on fp32 products instead of packed 16-bit magnitudes
    assert ptx_count(ptx, r"mul\.rn\.f32") == 2 * values
    assert not ptx_has(ptx, r"max\.u16x2") and ptx_has(ptx, r"abs\.f32")
    assert ptx_has(ptx, r"fence\.proxy\.async\.shared::cta")
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"


def test_channel_balance_config():
    base = dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", quantize_q=True)
    assert PrefillConfig(**base).key != PrefillConfig(**base, balance_qk=True).key
    with pytest.raises(ValueError, match="balance_qk"):
        PrefillConfig(**dict(base, quantize_q=False), balance_qk=True)


@pytest.mark.parametrize("pv", ["bf16", "fp8"])
def test_int8_scores_take_an_integer_row_max(pv):
    """The row max of the biased int8 scores is an integer max tree (ptxas: 3-input IMNMX), no float max left in
    the softmax except the running max's; the bias comes out in the exp2's FMA (no per-score subtract)."""
    ptx = _compile(PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", pv_dtype=pv))
    assert ptx_count(ptx, r"max\.s32") >= 2 * 63
    assert ptx_count(ptx, r"max\.f32") < 16
    # - 1.5 * 2^23 only on the row maxima (2 rows, loop + first tile), never per score
    assert ptx_count(ptx, r"0fCB400000") < 16, "per-score bias subtract"


# ---- FP8 P x V (pv_dtype="fp8") -------------------------------------------------------------------------------
FP8_VARIANTS = [(64, "bf16", False, "per_warp", False), (64, "bf16", True, "per_warp", False),
                (128, "bf16", False, "per_warp", False), (128, "bf16", True, "per_warp", False),
                (128, "fp16", True, "per_block", False),
                # varlen as flash_attn_varlen_func launches it (per_warp: Q quantized in the kernel) and per_block
                (128, "bf16", False, "per_warp", True), (64, "fp16", True, "per_warp", True),
                (128, "bf16", True, "per_block", True)]


@pytest.mark.parametrize("D,v_dtype,causal,granularity,varlen", FP8_VARIANTS)
def test_fp8_pv_variant_compiles(D, v_dtype, causal, granularity, varlen):
    quantize_q = varlen and granularity == "per_warp"
    ptx = _compile(PrefillConfig(head_dim=D, v_dtype=v_dtype, causal=causal, granularity=granularity,
                                 pv_dtype="fp8", varlen=varlen, quantize_q=quantize_q))
    assert ptx_count(ptx, "wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8") == 2 * (D // 32)
    # P x V: 128 keys / 32 per k-step, issued in the loop and after it; no 16-bit P x V left
    assert ptx_count(ptx, f"wgmma.mma_async.sync.aligned.m64n{D}k32.f32.e4m3.e4m3") == 2 * 4
    assert not ptx_has(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16")
    # P -> E4M3: 2 cvt per A register, 16 registers per tile, two call sites; no byte shuffles between lanes
    # (the keys are permuted instead): the only shfl are the 4-lane max / sum reductions of the bf16 variant
    assert ptx_count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 2 * 16 * 2
    bf16 = _compile(PrefillConfig(head_dim=D, v_dtype=v_dtype, causal=causal, granularity=granularity,
                                  varlen=varlen, quantize_q=quantize_q))
    assert ptx_count(ptx, "shfl.sync") == ptx_count(bf16, "shfl.sync")
    assert ptx_count(ptx, "cp.async.bulk.tensor") >= 3
    assert ptx_has(ptx, "setmaxnreg.dec") and ptx_has(ptx, "setmaxnreg.inc")
    assert not ptx_has(ptx, I2F), "int32 scores must be converted without I2F"
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"


def test_pv_dtype_in_key_and_checked():
    base = dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp")
    assert PrefillConfig(**base).key != PrefillConfig(**base, pv_dtype="fp8").key
    assert PrefillConfig(**base).pv_dtype == "bf16"
    with pytest.raises(ValueError, match="pv_dtype"):
        PrefillConfig(**base, pv_dtype="fp4")
    assert PrefillConfig(**base, pv_dtype="fp8", varlen=True).key != PrefillConfig(**base, pv_dtype="fp8").key


@pytest.mark.parametrize("D,causal,varlen", [(64, True, False), (128, False, True)])
def test_unquantized_qk_variant_uses_16bit_wgmma_only(D, causal, varlen):
    ptx = _compile(PrefillConfig(head_dim=D, v_dtype="bf16", causal=causal, granularity="per_block", varlen=varlen,
                                 qk_dtype="bf16"))
    assert not ptx_has(ptx, ".s8.s8")
    # Q K^T: D/16 k-steps (m64n128k16), P V: 8 k-steps (m64n{D}k16), prologue/epilogue + loop each
    assert ptx_count(ptx, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 2 * (D // 16) + (16 if D == 128 else 0)
    assert not ptx_has(ptx, "ld.local")


@pytest.mark.parametrize("D,pv", [(128, "bf16"), (64, "bf16"), (128, "fp8")])
def test_early_kv_wait_tests_barriers_without_blocking(D, pv):
    """head_dim 128 with 16-bit P x V tests the next K / V tiles' barriers during the softmax (mbarrier.test_wait,
    which never suspends the warp); the other variants keep the plain waits (slower there on the H100)."""
    cfg = PrefillConfig(head_dim=D, v_dtype="bf16", causal=True, granularity="per_warp", pv_dtype=pv)
    assert cfg.early_kv_wait == (D == 128 and pv == "bf16")
    ptx = _compile(cfg)
    # first tile + loop: K and V each
    assert ptx_count(ptx, "mbarrier.test_wait") == (4 if cfg.early_kv_wait else 0)
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"
    off = PrefillConfig(head_dim=D, v_dtype="bf16", causal=True, granularity="per_warp", pv_dtype=pv,
                        early_kv_wait=False)
    assert (off.key != cfg.key) == cfg.early_kv_wait



@pytest.mark.parametrize("D,pv,causal,on", [(128, "bf16", False, None), (128, "bf16", True, False),
                                            (64, "bf16", False, None), (128, "fp8", True, None),
                                            (64, "fp8", False, None)])
def test_bias_in_acc_replaces_the_per_score_add(D, pv, causal, on):
    """By default the score registers are set to the bias bits before QK^T accumulates onto them: no integer add
    per score is left (64 per tile with ``bias_in_acc=False``: first tile and loop), and the fills are 16-byte
    shared loads (16 per fill: before the first tile, after it (not in the serial loop), in the loop)."""
    cfg = PrefillConfig(head_dim=D, v_dtype="bf16", causal=causal, granularity="per_warp", pv_dtype=pv,
                        bias_in_acc=on)
    assert cfg.bias_in_acc == (on is None)
    ptx = _compile(cfg)
    assert ptx_count(ptx, r"add\.s32\s+%r\d+, %r\d+, 1262485504;") == (0 if cfg.bias_in_acc else 2 * 64)
    fills = 3 if cfg.intra_wg_overlap else 2  # (the serial loop fills once P V(n-1) is done, not after tile 0)
    assert ptx_count(ptx, "ld.volatile.shared.v4.b32") == (fills * 16 if cfg.bias_in_acc else 0)
    assert ptx_has(ptx, "1262485504")  # 0x4B400000
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"
    flipped = PrefillConfig(head_dim=D, v_dtype="bf16", causal=causal, granularity="per_warp", pv_dtype=pv,
                            bias_in_acc=not cfg.bias_in_acc)
    assert flipped.key != cfg.key
    assert not PrefillConfig(head_dim=D, v_dtype="bf16", causal=True, granularity="per_warp",
                             qk_dtype="bf16").bias_in_acc
    with pytest.raises(ValueError, match="bias_in_acc"):
        PrefillConfig(head_dim=D, v_dtype="bf16", causal=True, granularity="per_warp", qk_dtype="bf16",
                      bias_in_acc=True)


def test_causal_grid_groups():
    """``lpt_group``: up to LPT_GROUP_UNITS (sequence, head) units per longest-first group, a divisor of their
    number, while K and V of all units fit in LPT_GROUP_KV_BYTES (GQA: q heads of one kv head count it once);
    head by head (1) beyond."""
    from qattn.cute_kernels.sm90.prefill_config import LPT_GROUP_KV_BYTES, LPT_GROUP_UNITS, lpt_group

    causal = PrefillConfig(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp")
    fp8 = PrefillConfig(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp", pv_dtype="fp8")
    assert LPT_GROUP_UNITS == 8
    assert lpt_group(causal, 32, 1, 4096) == 8  # 48 MiB of int8 K + bf16 V
    assert lpt_group(causal, 32, 1, 8192) == 1  # 96 MiB
    assert lpt_group(causal, 32, 4, 8192) == 8  # GQA 4: 24 MiB
    assert lpt_group(fp8, 32, 1, 8192) == 8 and lpt_group(fp8, 32, 1, 8200) == 1  # E4M3 V: 64 MiB, a bit more
    assert lpt_group(causal, 7, 1, 100) == 7 and lpt_group(causal, 12, 1, 100) == 6
    assert lpt_group(causal, 5, 1, 1) == 5
    assert lpt_group(causal, 11, 1, 100) == 1 and lpt_group(causal, 22, 1, 100) == 2
    assert 32 * 4096 * 128 * 3 <= LPT_GROUP_KV_BYTES < 32 * 8192 * 128 * 3
    full = PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp")
    assert lpt_group(full, 32, 1, 1024) == 1  # non-causal: equal work per CTA
    assert lpt_group(causal, 8 * 65535, 64, 1) == 8 and lpt_group(causal, 8 * 65536, 64, 1) == 1  # grid z <= 65535


def test_split_tail_plan():
    """Whole waves run whole; the last partial wave's units split over K/V ranges where that shortens the tail
    (H100, 132 SMs, B2 H16 with 192-row tiles: S8K 1376 units = 10 waves + 56 -> 2 splits, S4K 5 + 44 -> 3),
    not where splits would be short (S2K, S1K), nor without a tail."""
    from qattn.cute_kernels.sm90.prefill_config import MAX_TAIL_SPLITS, split_tail_plan

    assert split_tail_plan(1376, 64, 132) == (1320, 2)
    assert split_tail_plan(704, 32, 132) == (660, 3)
    assert split_tail_plan(352, 16, 132) == (352, 1)
    assert split_tail_plan(192, 8, 132) == (192, 1)
    assert split_tail_plan(2752, 128, 132) == (2752, 1)  # 20 waves + 112: splitting cannot beat one wave
    assert split_tail_plan(1320, 64, 132) == (1320, 1)  # no tail
    assert split_tail_plan(3, 1, 132) == (3, 1)  # one K/V tile: nothing to split
    for units in range(1, 400, 7):
        for tiles in (1, 2, 5, 16, 64, 200):
            full, splits = split_tail_plan(units, tiles, 132)
            assert 1 <= splits <= min(MAX_TAIL_SPLITS, tiles)
            assert (full, splits) == (units, 1) or (full % 132 == 0 and full < units)


def test_split_tail_config_and_ptx():
    """split_tail: on for dense non-causal grids (1-D grid, a partial-output merge after an acq_rel counter),
    off for causal and varlen ones (equal work per CTA is what the plan assumes); in the compile key."""
    def cfg(**kw):
        return PrefillConfig(**dict(dict(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp"), **kw))

    assert cfg().split_tail and not cfg(causal=True).split_tail and not cfg(varlen=True).split_tail
    for bad in (dict(causal=True), dict(varlen=True)):
        with pytest.raises(ValueError, match="split_tail"):
            cfg(split_tail=True, **bad)
    assert cfg().key != cfg(split_tail=False).key
    split, whole = _compile(cfg(pv_dtype="fp8")), _compile(cfg(pv_dtype="fp8", split_tail=False))
    assert ptx_has(split, r"atom\.global\.acq_rel\.add\.u32") and ptx_count(split, "fence.acq_rel.gpu") == 2
    assert not ptx_has(whole, r"atom\.global") and not ptx_has(whole, "fence.acq_rel.gpu")
    for mma in ("wgmma.mma_async.sync.aligned.m64n128k32.satfinite.s32.s8.s8", "wgmma.mma_async"):
        assert ptx_count(split, mma) == ptx_count(whole, mma)
    assert not ptx_has(split, "ld.local") and not ptx_has(split, "st.local"), "local arrays"
    # the merge stores O with the epilogue's 16-byte stores
    assert ptx_count(split, r"st\.global\.v4\.b32") == 2 * ptx_count(whole, r"st\.global\.v4\.b32") == 16


@pytest.mark.parametrize("D,causal,varlen,pv,qk,tile_m", [(128, True, False, "bf16", "int8", None),
                                                         (128, True, False, "bf16", "int8", 192),
                                                         (64, False, False, "bf16", "int8", None),
                                                         (128, True, False, "fp8", "int8", None),
                                                         (128, True, True, "bf16", "int8", None),
                                                         (64, True, False, "bf16", "bf16", None)])
def test_sliding_window_variant_compiles(D, causal, varlen, pv, qk, tile_m):
    """``local`` (window_size's left edge): its own key, no split tail, the same MMAs and loads, no local
    memory in the PTX (ptxas spills of the 192-row variants are checked on the device, by timing)."""
    kw = dict(head_dim=D, v_dtype="bf16", causal=causal, granularity="per_warp" if qk == "int8" else "per_block",
              varlen=varlen, pv_dtype=pv, qk_dtype=qk, quantize_q=qk == "int8")
    if tile_m:
        kw.update(tile_m=tile_m, intra_wg_overlap=False)
    cfg, plain = PrefillConfig(**kw, local=True), PrefillConfig(**kw)
    assert cfg.key != plain.key and "local" in cfg.key and not cfg.split_tail
    ptx = _compile(cfg)
    qk_mma = ("m64n128k32.satfinite.s32.s8.s8" if qk == "int8" else "m64n128k16.f32.bf16.bf16")
    assert ptx_count(ptx, "wgmma.mma_async.sync.aligned." + qk_mma) == plain_count(plain, qk_mma)
    assert ptx_count(ptx, "cp.async.bulk.tensor") >= 3
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"


def plain_count(cfg, mma):
    return ptx_count(_compile(cfg), "wgmma.mma_async.sync.aligned." + mma)


def test_sliding_window_config():
    with pytest.raises(ValueError, match="split_tail"):
        PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", local=True, split_tail=True)
    assert not PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", local=True).split_tail


@pytest.mark.parametrize("D,causal,varlen,pv,qk", [(128, True, False, "bf16", "int8"), (64, False, True, "bf16", "int8"),
                                                   (128, False, False, "fp8", "int8"), (64, True, False, "bf16", "bf16")])
def test_softcap_variant_compiles(D, causal, varlen, pv, qk):
    """``softcap``: its own key per value; one ``tanh.approx.f32`` per score and per row max (first tile and
    loop: 2 x (64 + 2) per thread), the same MMAs as without it, no local memory."""
    kw = dict(head_dim=D, v_dtype="bf16", causal=causal, granularity="per_warp" if qk == "int8" else "per_block",
              varlen=varlen, pv_dtype=pv, qk_dtype=qk, quantize_q=qk == "int8")
    cfg, plain = PrefillConfig(**kw, softcap=30.0), PrefillConfig(**kw)
    assert len({cfg.key, plain.key, PrefillConfig(**kw, softcap=50).key}) == 3
    ptx, plain_ptx = _compile(cfg), _compile(plain)
    assert ptx_count(ptx, r"tanh\.approx\.f32") == 2 * (64 + 2)  # a 64-row x 128-key tile: 64 scores per thread
    assert not ptx_has(plain_ptx, "tanh.approx")
    assert ptx_count(ptx, "wgmma.mma_async") == ptx_count(plain_ptx, "wgmma.mma_async")
    assert not ptx_has(ptx, "ld.local") and not ptx_has(ptx, "st.local"), "register spills"


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "30"])
def test_softcap_config_rejects(bad):
    with pytest.raises(ValueError, match="softcap"):
        PrefillConfig(head_dim=128, v_dtype="bf16", causal=False, granularity="per_warp", softcap=bad)
