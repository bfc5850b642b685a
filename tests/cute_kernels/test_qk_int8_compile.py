"""CPU tests of the INT8 Q/K prepass kernels: they compile for sm_90a (and sm_100a) and the PTX has the intended
shape: 16-byte loads, 8-byte int8 stores (both whole sectors per warp), correctly rounded divisions (never div.approx / div.full / rcp.approx), RNE
int conversions (cvt.rni), explicit RN products / subtractions, no local memory, no flush to zero."""

from __future__ import annotations

import functools

import re

import pytest

pytestmark = pytest.mark.compile

LD16 = r"\bld\.global(\.\w+)*\.v4\.(b|u)32\b"
ST8 = r"\bst\.global(\.\w+)*\.v2\.(b|u)32\b"


@functools.lru_cache(maxsize=None)
def _quant_ptx(head_dim, group_rows, in_bf16=True, subtract_mean=False, varlen=False, arch="sm_90a"):
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.sm90 import qk_int8_quant

    cfg, args = qk_int8_quant.make_quant_compile_args(head_dim, group_rows, in_bf16, subtract_mean, varlen)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    assert ptx
    return cfg, ptx


@functools.lru_cache(maxsize=None)
def _kmean_ptx(head_dim, in_bf16=True, varlen=False, arch="sm_90a"):
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.sm90 import qk_int8_kmean

    cfg, args = qk_int8_kmean.make_kmean_compile_args(head_dim, in_bf16, varlen)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    assert ptx
    return cfg, ptx


def _common(ptx, arch="sm_90a"):
    from qattn.cute_kernels.compile_utils import ptx_has

    assert ptx_has(ptx, rf"^\s*\.target\s+{arch}\b")
    assert not ptx_has(ptx, r"\.local\b"), "local memory"
    assert not ptx_has(ptx, r"\.ftz\b"), "flush to zero"
    assert not ptx_has(ptx, r"\b(rcp|div|sqrt)\.approx|div\.full"), "approximate division"
    assert not ptx_has(ptx, r"\bfma\.|\bmad\.(rn\.)?f"), "contracted float arithmetic"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group_rows", [16, 128])
@pytest.mark.parametrize("in_bf16", [True, False], ids=["bf16", "fp16"])
def test_quant_compiles(head_dim, group_rows, in_bf16):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    cfg, ptx = _quant_ptx(head_dim, group_rows, in_bf16)
    _common(ptx)
    # flash_attn_func launches the attention kernel as its programmatic dependent (pdl)
    assert ptx_count(ptx, r"griddepcontrol\.launch_dependents") == 1
    # every thread: one 16-byte load and one 8-byte int8 store per pass
    assert ptx_count(ptx, LD16) == cfg.passes
    assert ptx_count(ptx, ST8) == cfg.passes
    # s = amax / 127 and inv = 1 / s, both correctly rounded
    assert ptx_count(ptx, r"\bdiv\.rn\.f32\b") == 1
    assert ptx_count(ptx, r"\brcp\.rn\.f32\b") == 1
    assert ptx_count(ptx, r"\bcvt\.rni\.s32\.f32\b") == 8 * cfg.passes
    assert ptx_count(ptx, r"\bmul\.rn\.f32\b") == 8 * cfg.passes
    assert ptx_has(ptx, r"\batom\.shared(\.\w+)*\.max\.s32\b")
    assert ptx_has(ptx, r"\bshfl\.sync\.bfly")
    assert not ptx_has(ptx, r"\bsub\.rn\.f32\b|\bf64\b")  # no mean without smoothing
    if not in_bf16:
        assert ptx_has(ptx, r"\bcvt\.f32\.f16\b")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("varlen", [False, True])
def test_quant_with_mean_compiles(head_dim, varlen):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    cfg, ptx = _quant_ptx(head_dim, 128, True, True, varlen)
    _common(ptx)
    # flash_attn_func launches the attention kernel as its programmatic dependent (pdl), and this kernel as the
    # mean kernel's: it waits for the prepass before it reads the sums, after its loads of K
    assert ptx_count(ptx, r"griddepcontrol\.launch_dependents") == 1
    assert ptx_count(ptx, r"griddepcontrol\.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert max(m.start() for m in re.finditer(LD16, ptx)) < wait  # the K tile's loads are issued first
    assert wait < min(m.start() for m in re.finditer(r"ld\.global\.b64", ptx))  # then the fp64 sums are read
    assert ptx_count(ptx, LD16) == cfg.passes and ptx_count(ptx, ST8) == cfg.passes
    assert ptx_count(ptx, r"\bdiv\.rn\.f32\b") == 1 and ptx_count(ptx, r"\brcp\.rn\.f32\b") == 1
    # the mean: fp64 sum of the chunks, one RN fp64 division, one RN conversion to fp32, RN subtraction
    assert ptx_has(ptx, r"\badd\.f64\b") and ptx_count(ptx, r"\bdiv\.rn\.f64\b") == 1
    assert ptx_count(ptx, r"\bcvt\.rn\.f32\.f64\b") == 1
    assert ptx_count(ptx, r"\bsub\.rn\.f32\b") >= 8
    assert ptx_has(ptx, r"\bcvt\.rni\.s32\.f32\b")


def test_quant_varlen_and_odd_groups_compile():
    from qattn.cute_kernels.compile_utils import ptx_count

    for rows in (7, 48, 200, 1024):
        cfg, ptx = _quant_ptx(128, rows, False, rows == 48, True)
        _common(ptx)
        assert cfg.tile_rows % rows == 0 and cfg.threads % 32 == 0 and cfg.threads <= 1024
        assert ptx_count(ptx, LD16) == cfg.passes and ptx_count(ptx, ST8) == cfg.passes


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("in_bf16,varlen", [(True, False), (False, True)])
def test_kmean_compiles(head_dim, in_bf16, varlen):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has
    from qattn.cute_kernels.sm90.qk_int8_kmean import UNROLL

    cfg, ptx = _kmean_ptx(head_dim, in_bf16, varlen)
    _common(ptx)
    assert ptx_count(ptx, LD16) == UNROLL
    assert ptx_count(ptx, r"\bcvt\.f64\.f32\b") == 8 * UNROLL  # exact widening of every value
    assert ptx_has(ptx, r"\badd\.f64\b")
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.(b|f)64\b") == 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("op", ["sum_f64", "max_f32"])
def test_chunk_reduce_compiles(head_dim, op):
    from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count
    from qattn.cute_kernels.sm90.chunk_reduce import ChunkReduce, chunk_reduce_placeholder_args

    ptx = compile_for_arch(ChunkReduce(head_dim, op), *chunk_reduce_placeholder_args(), arch="sm_90a",
                           keep_ptx=True)[1]
    _common(ptx)
    reduce, store = (r"\badd\.f64\b", r"(b|f)64") if op == "sum_f64" else (r"\bmax\.f32\b", r"(b|f)32")
    assert ptx_count(ptx, reduce) >= 8  # the chunk loop, unrolled 8
    assert ptx_count(ptx, rf"\bst\.global(\.\w+)*\.{store}\b") == 1
    with pytest.raises(ValueError, match="op"):
        ChunkReduce(head_dim, "min_f16")


def test_compiles_for_sm100():
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.sm90.qk_int8_quant import CLUSTER_SIZE, QKInt8Quant, quant_placeholder_args

    _common(_quant_ptx(128, 16, arch="sm_100a")[1], "sm_100a")
    _common(_quant_ptx(128, 128, True, True, arch="sm_100a")[1], "sm_100a")
    _common(_kmean_ptx(128, arch="sm_100a")[1], "sm_100a")
    one_launch = QKInt8Quant(128, 128, True, True, False, None, CLUSTER_SIZE, 2)  # the launcher picks it on SM100 too
    _common(compile_utils.compile_for_arch(one_launch, *quant_placeholder_args(), arch="sm_100a")[1], "sm_100a")
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm90.chunk_reduce import ChunkReduce, chunk_reduce_placeholder_args

    for op in ("sum_f64", "max_f32"):  # the K-mean totals run in SM100's prepass too
        _common(compile_for_arch(ChunkReduce(128, op), *chunk_reduce_placeholder_args(), arch="sm_100a",
                                 keep_ptx=True)[1], "sm_100a")


def test_config_errors_and_keys():
    from qattn.cute_kernels.sm90.qk_int8_kmean import KMeanPartial
    from qattn.cute_kernels.sm90.qk_int8_quant import QKInt8Quant

    with pytest.raises(ValueError, match="head_dim"):
        QKInt8Quant(96, 16)
    with pytest.raises(ValueError, match="head_dim"):
        KMeanPartial(32)
    with pytest.raises(ValueError, match="group_rows"):
        QKInt8Quant(128, 2048)
    with pytest.raises(ValueError, match="group_rows"):
        QKInt8Quant(128, 0)
    keys = {QKInt8Quant(d, r, b, m, v).key for d in (64, 128) for r in (16, 128) for b in (True, False)
            for m in (True, False) for v in (True, False)}
    assert len(keys) == 32


@pytest.mark.parametrize("head_dim,gpc,in_bf16,varlen", [(128, 2, True, False), (64, 1, False, False),
                                                         (256, 2, True, False), (128, 2, True, True)])
def test_one_launch_k_quantization_compiles(head_dim, gpc, in_bf16, varlen):
    """Cluster mode (``qattn.quant.launch.k_cluster_plan``): the fp64 K sums cross the cluster through distributed
    shared memory (mapa + ld.shared::cluster, one per CTA of the cluster), two cluster barriers (arrive + wait),
    no spills; the keys of the two paths differ. Configs outside the mode are refused."""
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.compile_utils import ptx_count
    from qattn.cute_kernels.sm90.qk_int8_quant import CLUSTER_SIZE, QKInt8Quant, quant_placeholder_args

    cfg = QKInt8Quant(head_dim, 128, in_bf16, True, varlen, None, CLUSTER_SIZE, gpc)
    _, ptx = compile_utils.compile_for_arch(cfg, *quant_placeholder_args(), arch="sm_90a")
    _common(ptx)
    assert ptx_count(ptx, r"mapa\.shared::cluster") == CLUSTER_SIZE
    assert ptx_count(ptx, r"ld\.shared::cluster\.f64") == CLUSTER_SIZE
    assert ptx_count(ptx, r"barrier\.cluster\.arrive") == 2 and ptx_count(ptx, r"barrier\.cluster\.wait") == 2
    assert cfg.key != QKInt8Quant(head_dim, 128, in_bf16, True, varlen).key
    for bad in (dict(cluster=3, groups_per_cta=1), dict(cluster=8, groups_per_cta=None),
                dict(cluster=8, groups_per_cta=1024 // head_dim), dict(cluster=8, groups_per_cta=1, balance="k"),
                dict(cluster=8, groups_per_cta=1, subtract_mean=False), dict(groups_per_cta=2)):
        kw = dict(dict(head_dim=head_dim, group_rows=128, subtract_mean=True), **bad)
        with pytest.raises(ValueError, match="cluster|groups_per_cta"):
            QKInt8Quant(**kw)


def test_registered_variants():
    from qattn.interface import variants

    assert {"qk_int8_quant", "qk_int8_kmean", "chunk_reduce"} <= set(variants.kinds())
    assert len(variants.enumerate_variants("chunk_reduce", "sm_90a", head_dims=[64, 128, 96])) == 4
    vq = variants.enumerate_variants("qk_int8_quant", "sm_90a", head_dims=[128])
    vk = variants.enumerate_variants("qk_int8_kmean", "sm_90a", head_dims=[128, 96])
    # + one-launch K quantization: 1 or 2 groups per CTA, bf16 / fp16, dense / varlen
    assert len(vq) == 12 + 8 and len(vk) == 4
    assert len({v.key for v in vq + vk}) == 24
    assert all(v.key[:2] == (v.kind, "sm_90a") for v in vq + vk)


def test_export_and_reload_through_the_compile_cache(tmp_path, monkeypatch):
    # the launchers' path: compiled once, exported as an object, loaded back by a fresh process-level cache
    from qattn.interface import CompileCache, variants

    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path))
    picks = [v for v in variants.enumerate_variants("qk_int8_quant", "sm_90a", head_dims=[128])
             if v.key[-2:] == (True, False)][:1]  # K with smoothing, dense
    picks += variants.enumerate_variants("qk_int8_kmean", "sm_90a", head_dims=[64])[:1]
    assert len(picks) == 2
    for v in picks:
        CompileCache(v.kind).get(v.key, v.build)
        fresh = CompileCache(v.kind)
        assert fresh.get(v.key, v.build) is not None and fresh.events[-1].source == "disk"
    assert len(list(tmp_path.rglob("*.o"))) == 2


# ------------------------------------------------------------------------------------------------
# channel balancing (balance_qk): the statistics passes and the balanced quantize kernels
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _stats_ptx(head_dim, stats, varlen=False, arch="sm_90a"):
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.sm90 import qk_int8_kmean

    cfg, args = qk_int8_kmean.make_kmean_compile_args(head_dim, True, varlen, stats)
    return cfg, compile_utils.compile_for_arch(cfg, *args, arch=arch)[1]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stats", ["sum_range", "range", "absmax"])
def test_kmean_statistics_compile(head_dim, stats):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has
    from qattn.cute_kernels.sm90.qk_int8_kmean import UNROLL

    _, ptx = _stats_ptx(head_dim, stats, varlen=stats == "range")
    _common(ptx)
    assert ptx_count(ptx, LD16) == UNROLL  # still one read of the rows
    f32_stores = ptx_count(ptx, r"\bst\.global(\.\w+)*\.(b|f)32\b")
    f64_stores = ptx_count(ptx, r"\bst\.global(\.\w+)*\.(b|f)64\b")
    assert (f32_stores, f64_stores) == {"sum_range": (2, 1), "range": (2, 0), "absmax": (1, 0)}[stats]
    assert ptx_has(ptx, r"\bmax\.f32\b")
    assert ptx_has(ptx, r"\badd\.f64\b") == (stats == "sum_range")
    assert ptx_has(ptx, r"\babs\.f32\b") == (stats == "absmax")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_rows,subtract_mean,balance", [(128, True, "k"), (128, False, "k"), (16, False, "q"),
                                                             (128, False, "q")])
def test_quant_balanced_compiles(head_dim, group_rows, subtract_mean, balance):
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.compile_utils import ptx_count
    from qattn.cute_kernels.sm90 import qk_int8_quant

    cfg, args = qk_int8_quant.make_quant_compile_args(head_dim, group_rows, True, subtract_mean, False, balance)
    ptx = compile_utils.compile_for_arch(cfg, *args, arch="sm_90a")[1]
    _common(ptx)
    assert ptx_count(ptx, LD16) == cfg.passes and ptx_count(ptx, ST8) == cfg.passes
    # x * inv as before, plus the exact balance product in the amax pass and in the quantize pass
    assert ptx_count(ptx, r"\bmul\.rn\.f32\b") == 3 * 8 * cfg.passes
    assert ptx_count(ptx, r"\bdiv\.rn\.f32\b") == 1 and ptx_count(ptx, r"\brcp\.rn\.f32\b") == 1
    if balance == "k":  # lam derived from the exponent bits, written once
        assert compile_utils.ptx_has(ptx, r"\bshr\.s32\b")


def test_balanced_kernels_compile_for_sm100():
    from qattn.cute_kernels import compile_utils
    from qattn.cute_kernels.sm90 import qk_int8_quant

    for stats in ("sum_range", "absmax"):
        _common(_stats_ptx(128, stats, arch="sm_100a")[1], "sm_100a")
    for rows, mean, bal in ((128, True, "k"), (16, False, "q")):
        cfg, args = qk_int8_quant.make_quant_compile_args(128, rows, True, mean, False, bal)
        _common(compile_utils.compile_for_arch(cfg, *args, arch="sm_100a")[1], "sm_100a")


def test_balance_config_errors_and_keys():
    from qattn.cute_kernels.sm90.qk_int8_kmean import STATS, KMeanPartial
    from qattn.cute_kernels.sm90.qk_int8_quant import QKInt8Quant

    with pytest.raises(ValueError, match="stats"):
        KMeanPartial(128, stats="min")
    with pytest.raises(ValueError, match="balance"):
        QKInt8Quant(128, 128, balance="v")
    with pytest.raises(ValueError, match="balance"):
        QKInt8Quant(128, 16, subtract_mean=True, balance="q")
    keys = {QKInt8Quant(128, 128, True, m, False, b).key for m in (True, False) for b in (None, "k")}
    keys |= {KMeanPartial(128, True, False, s).key for s in STATS}
    assert len(keys) == 8
