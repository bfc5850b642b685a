"""CPU tests of the insert and flatten kernels: every shipped (K format, V format) pair compiles for sm_90a and
sm_100a, and the PTX has the intended shape (128-bit accesses, no local memory, no approximate division, no
flush-to-zero, explicit RNE conversions, butterfly shuffles for the per-row amax)."""

from __future__ import annotations

import functools
import itertools

import pytest

from qattn.layouts.formats import kv_format

pytestmark = pytest.mark.compile

FORMATS = [("bf16", None), ("fp8", None), ("int8", None), ("nvfp4", None), ("mxfp4", "floor"), ("mxfp4", "rceil"),
           ("mxfp4_b16", "floor"), ("mxfp4_b16", "rceil")]
ARCHS = ("sm_90a", "sm_100a")


def _f(spec):
    name, rule = spec
    return kv_format(name, scale_rule=rule) if rule else kv_format(name)


@functools.lru_cache(maxsize=None)
def _insert_ptx(kspec, vspec, head_dim, arch, in_bf16=True, ring=False, ring_bf16=True):
    from qattn.cute_kernels import compile_utils, kv_insert

    cfg, args = kv_insert.make_insert_compile_args(_f(kspec), _f(vspec), head_dim, in_bf16, ring, ring_bf16)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    assert ptx
    return ptx


def _common(ptx, arch):
    from qattn.cute_kernels.compile_utils import ptx_has

    assert ptx_has(ptx, rf"^\s*\.target\s+{arch}\b")
    assert not ptx_has(ptx, r"\.local\b"), "local memory"
    assert not ptx_has(ptx, r"\.ftz\b"), "flush to zero"
    assert not ptx_has(ptx, r"\b(rcp|div|sqrt)\.approx|div\.full"), "approximate division"


def _elems(kspec, vspec, head_dim):
    """Values per thread the kernel's own rule picks (16 for 8/16-bit K and V, 32 with an FP4 side)."""
    from qattn.cute_kernels.kv_insert import KVInsert

    return KVInsert(_f(kspec), _f(vspec), head_dim).elems


def _store_count(spec, head_dim):
    f = _f(spec)
    words = _elems(spec, spec, head_dim) * f.bits // 32
    return max(1, words // 4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s[0]}-{s[1]}")
def test_same_format_compiles(spec, arch):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    ptx = _insert_ptx(spec, spec, 128, arch)
    _common(ptx, arch)
    # input: E / 8 16-byte loads per thread for K and for V
    assert ptx_count(ptx, r"\bld\.global(\.\w+)*\.v4\.(b|u)32\b") == 2 * _elems(spec, spec, 128) // 8
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u)32\b") == 2 * _store_count(spec, 128)
    name = spec[0]
    if name in ("fp8", "int8"):
        rows_threads = 128 // _elems(spec, spec, 128)
        assert ptx_count(ptx, r"\bshfl\.sync\.bfly") == 2 * (rows_threads.bit_length() - 1)  # log2(G), K and V
        assert ptx_has(ptx, r"\bdiv\.rn\.f32\b")
        assert ptx_has(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32" if name == "fp8" else r"cvt\.rni\.s32\.f32")
    else:
        assert not ptx_has(ptx, r"\bshfl\.sync")
    if name == "nvfp4":
        assert ptx_has(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") and ptx_has(ptx, r"\bdiv\.rn\.f32\b")
    if name.startswith("mxfp4"):
        assert ptx_has(ptx, r"\bbfe\.u32\b")


@pytest.mark.parametrize("kspec,vspec", list(itertools.product(FORMATS, FORMATS)),
                         ids=lambda s: f"{s[0]}-{s[1]}")
def test_every_pair_compiles_sm90(kspec, vspec):
    _common(_insert_ptx(kspec, vspec, 64, "sm_90a"), "sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("in_bf16,ring_bf16", [(True, True), (False, True), (True, False), (False, False)])
def test_ring_variants_compile(in_bf16, ring_bf16, arch):
    from qattn.cute_kernels.compile_utils import ptx_count

    ptx = _insert_ptx(("nvfp4", None), ("int8", None), 128, arch, in_bf16, True, ring_bf16)
    _common(ptx, arch)
    # 16-byte stores per thread: K and V ring rows (E / 8 each) + nvfp4 K payload (E / 32) + int8 V payload (E / 16)
    E = _elems(("nvfp4", None), ("int8", None), 128)
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u)32\b") == E // 4 + E // 32 + E // 16
    if in_bf16 != ring_bf16:
        assert ptx_count(ptx, r"cvt\.rn\.(bf16|f16)x2\.f32") >= 16


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ring,sink_tokens,in_bf16,ring_bf16", [(False, 1, True, True), (True, 4, True, True),
                                                                (True, 4, False, True), (False, 64, True, False)])
def test_sink_variants_compile(ring, sink_tokens, in_bf16, ring_bf16, arch):
    """Sink caches store the unquantized row of positions < N once more (K and V, E / 8 x 16 bytes each), from the
    same converted registers as the ring row; N is compile time (in the key)."""
    from qattn.cute_kernels import compile_utils, kv_insert
    from qattn.cute_kernels.compile_utils import ptx_count

    cfg, args = kv_insert.make_insert_compile_args(_f(("nvfp4", None)), _f(("int8", None)), 128, in_bf16, ring,
                                                   ring_bf16, sink_tokens=sink_tokens)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    _common(ptx, arch)
    E = cfg.elems
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u)32\b") == E // 4 * (1 + int(ring)) + E // 32 + E // 16
    assert cfg.key != kv_insert.KVInsert("nvfp4", "int8", 128, in_bf16, ring, ring_bf16).key
    assert cfg.key != kv_insert.KVInsert("nvfp4", "int8", 128, in_bf16, ring, ring_bf16,
                                         sink_tokens=sink_tokens + 1).key


@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_other_head_dims(head_dim):
    for spec in (("nvfp4", None), ("fp8", None), ("mxfp4", "floor"), ("bf16", None)):
        _common(_insert_ptx(spec, spec, head_dim, "sm_90a"), "sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", FORMATS[:5] + FORMATS[6:7], ids=lambda s: f"{s[0]}-{s[1]}")
def test_flatten_compiles(spec, arch):
    from qattn.cute_kernels import compile_utils, kv_flatten

    cfg, args = kv_flatten.make_flatten_compile_args(_f(spec), _f(spec), 128)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    _common(ptx, arch)
    # 4 x 16-byte bf16 output stores per thread, K and V
    assert compile_utils.ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u)32\b") == 8
    if spec[0] in ("nvfp4", "mxfp4", "mxfp4_b16"):
        assert not compile_utils.ptx_has(ptx, r"e2m1x2")  # the SM90 decode path


SEARCH_PAIRS = [(("nvfp4", None), ("nvfp4", None)), (("mxfp4", "floor"), ("mxfp4", "floor")),
                (("int8", None), ("nvfp4", None)), (("mxfp4_b16", "rceil"), ("nvfp4", None))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pair", SEARCH_PAIRS, ids=lambda p: f"{p[0][0]}+{p[1][0]}")
def test_scale_search_compiles(pair, arch):
    """``scale_search="msenb"``: its own variant (key), exact fp32 arithmetic only (no fma contraction, no
    approximate reciprocal), and one rcp.rn per nvfp4 block and candidate (the rule's byte, byte - 1, byte + 1)."""
    from qattn.cute_kernels import compile_utils, kv_insert
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    f = kv_format((_f(pair[0]), _f(pair[1])), scale_search="msenb")
    cfg, args = kv_insert.make_insert_compile_args(f.k, f.v, 128)
    plain = kv_insert.KVInsert(_f(pair[0]), _f(pair[1]), 128)
    assert cfg.key != plain.key and cfg.key[:len(plain.key)] == plain.key
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    _common(ptx, arch)
    assert not ptx_has(ptx, r"\bfma\.rn\.f32\b")
    nv_blocks = sum(cfg.elems // 16 for side in (cfg.k, cfg.v) if side.nvfp4)
    row_scales = sum(side.kind in ("fp8", "int8") for side in (cfg.k, cfg.v))  # one 1 / s per 8-bit row
    assert ptx_count(ptx, r"\brcp\.rn\.f32\b") == 3 * nv_blocks + row_scales


def test_unsupported_head_dim():
    from qattn.cute_kernels.kv_insert import KVInsert

    with pytest.raises(ValueError, match="head_dim"):
        KVInsert("fp8", "fp8", 96)


def test_variants_registered():
    from qattn.interface import variants

    assert "kv_insert" in variants.kinds() and "kv_flatten" in variants.kinds()
    vs = variants.enumerate_variants("kv_insert", "sm_90a", kv_formats=["nvfp4", "mxfp4"], head_dims=[128])
    assert [v.label for v in vs] == ["nvfp4 D128", "mxfp4 floor D128", "mxfp4 rceil D128"]


# ------------------------------------------------------------------------------------------------
# insert transforms: RoPE (NeoX / GPT-J, partial), K smoothing, Hadamard rotation
# ------------------------------------------------------------------------------------------------
TRANSFORM_CASES = [  # K format, V format, head_dim, ring, transforms
    (("nvfp4", None), ("nvfp4", None), 128, False, dict(rope_style="neox", rotary_dim=128, smooth=True, rotate=True)),
    (("mxfp4", "rceil"), ("int8", None), 128, True, dict(rope_style="neox", rotary_dim=80, rotate=True)),
    (("bf16", None), ("fp8", None), 64, True, dict(rope_style="gptj", rotary_dim=32, smooth=True)),
    (("fp8", None), ("mxfp4_b16", "floor"), 256, False, dict(rope_style="neox", rotary_dim=256, rotate=True)),
    (("int8", None), ("bf16", None), 64, False, dict(smooth=True, rotate=True)),
]


@functools.lru_cache(maxsize=None)
def _transform_ptx(case_index, arch):
    from qattn.cute_kernels import compile_utils, kv_insert

    kspec, vspec, head_dim, ring, tr = TRANSFORM_CASES[case_index]
    cfg, args = kv_insert.make_insert_compile_args(_f(kspec), _f(vspec), head_dim, True, ring, True, **tr)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    return ptx


def _expected_shuffles(kspec, vspec, head_dim, tr):
    from qattn.cute_kernels.kv_insert import neox_partner_plan

    E = _elems(kspec, vspec, head_dim)
    G = head_dim // E
    n = 0
    if tr.get("rope_style") == "neox":
        for lo_loc, lo_off, hi_loc, hi_off in neox_partner_plan(E, tr["rotary_dim"] // 2):
            n += 1 if lo_loc == hi_loc else int(lo_off != 0) + int(hi_off != 0)
    if tr.get("rotate"):
        n += 2 * E * (G.bit_length() - 1)  # butterfly steps across lanes, K and V
    for spec in (kspec, vspec):
        if spec[0] in ("fp8", "int8"):
            n += G.bit_length() - 1  # the per-row amax
    return n


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", range(len(TRANSFORM_CASES)))
def test_transform_variants_compile(case, arch):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    kspec, vspec, head_dim, ring, tr = TRANSFORM_CASES[case]
    ptx = _transform_ptx(case, arch)
    _common(ptx, arch)
    # no fused multiply-add anywhere in fp32: the reference rounds every product (transforms use mul.rn / add.rn
    # / sub.rn inline PTX, which ptxas never contracts)
    assert not ptx_has(ptx, r"\bfma\.\w*\.?f32\b"), "fp32 fma in the insert kernel"
    assert ptx_count(ptx, r"\bshfl\.sync") == _expected_shuffles(kspec, vspec, head_dim, tr)
    assert ptx_has(ptx, r"\bmul\.rn\.f32\b")
    if tr.get("rope_style") or tr.get("smooth"):
        assert ptx_has(ptx, r"\bsub\.rn\.f32\b")
    # inputs stay 16-byte loads (E / 8 per thread for K and for V)
    assert ptx_count(ptx, r"\bld\.global(\.\w+)*\.v4\.(b|u)32\b") >= 2 * _elems(kspec, vspec, head_dim) // 8


def test_transform_key_and_validation():
    from qattn.cute_kernels.kv_insert import KVInsert

    base = KVInsert("nvfp4", "nvfp4", 128)
    variants = [KVInsert("nvfp4", "nvfp4", 128, rope_style="neox", rotary_dim=128),
                KVInsert("nvfp4", "nvfp4", 128, rope_style="gptj", rotary_dim=128),
                KVInsert("nvfp4", "nvfp4", 128, rope_style="neox", rotary_dim=64),
                KVInsert("nvfp4", "nvfp4", 128, smooth=True),
                KVInsert("nvfp4", "nvfp4", 128, rotate=True)]
    keys = {base.key} | {c.key for c in variants}
    assert len(keys) == 6  # every flag is part of the compile-cache key
    with pytest.raises(ValueError, match="rope_style"):
        KVInsert("nvfp4", "nvfp4", 128, rope_style="llama", rotary_dim=128)
    with pytest.raises(ValueError, match="rotary_dim"):
        KVInsert("nvfp4", "nvfp4", 128, rope_style="neox", rotary_dim=130)
    with pytest.raises(ValueError, match="rotary_dim"):
        KVInsert("nvfp4", "nvfp4", 128, rope_style="neox", rotary_dim=63)
    with pytest.raises(ValueError, match="power of two"):
        KVInsert("fp8", "fp8", 48, rotate=True)
