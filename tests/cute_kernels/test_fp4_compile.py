"""CPU tests of the FP4 row kernels and device helpers (no GPU needed).

* ``@pytest.mark.compile``: every Fp4DequantRows variant (nvfp4, mxfp4, mxfp4_b16 x head_dim 64/128/256) and
  the Fp4QuantizeRows variants compile for sm_90a and sm_100a; the PTX is checked for the SM90 decode path
  (prmt + cvt.rn.f16x2.e4m3x2, no e2m1 conversions), 128-bit global accesses, no local memory, no flush-to-
  zero and no approximate division.
* The PTX bodies of the helpers in ``qattn.cute_kernels.common.fp4`` are run through a small PTX
  interpreter (below) and compared bit for bit with ``qattn.quant.reference``: this checks the bit tricks
  (prmt tables, sign spreading, UE8M0 subnormal, E2M1 rounding) before any GPU time is spent. The
  interpreter follows the PTX ISA for the ~25 instructions the helpers use; the GPU tests check the same
  helpers on hardware.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import pytest
import torch

from qattn.quant import reference as ref

FORMATS = ("nvfp4", "mxfp4", "mxfp4_b16")
HEAD_DIMS = (64, 128, 256)
ARCHS = ("sm_90a", "sm_100a")


# ==================================================================================================
# compile tests
# ==================================================================================================
@functools.lru_cache(maxsize=None)
def _compile(kind: str, fmt: str, head_dim: int, arch: str, rule: str | None = None) -> tuple[str, float]:
    from qattn.cute_kernels import compile_utils, fp4_rows

    if kind == "dequant":
        cfg, args = fp4_rows.make_dequant_compile_args(fmt, head_dim)
    else:
        cfg, args = fp4_rows.make_quantize_compile_args(fmt, head_dim, rule)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch=arch)
    assert ptx, "no PTX came back"
    return ptx, compile_utils.last_compile_seconds


def _common_ptx_checks(ptx: str, arch: str) -> None:
    from qattn.cute_kernels.compile_utils import ptx_has

    assert ptx_has(ptx, rf"^\s*\.target\s+{arch}\b")
    assert not ptx_has(ptx, r"\.local\b"), "local memory (register spill or stack array) in the kernel"
    assert not ptx_has(ptx, r"\.ftz\b"), "flush-to-zero would lose the subnormal scales / values"
    assert not ptx_has(ptx, r"\b(rcp|div|sqrt)\.approx|div\.full"), "approximate division breaks bit-exactness"


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_rows_compiles(fmt, head_dim, arch):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    ptx, _ = _compile("dequant", fmt, head_dim, arch)
    _common_ptx_checks(ptx, arch)
    # the SM90 decode path: table lookup + FP8 conversion, never the sm_100a-only e2m1 conversion
    words = 4  # head_dims here are multiples of 32: one 16-byte payload word group per thread
    assert ptx_count(ptx, r"\bprmt\.b32\b") >= 4 * words
    assert ptx_count(ptx, r"\bcvt\.rn\.f16x2\.e4m3x2\b") >= 4 * words
    assert not ptx_has(ptx, r"e2m1x2|ue8m0x2")
    # one 128-bit payload load and eight 128-bit output stores per thread
    assert ptx_count(ptx, r"\bld\.global(\.\w+)*\.v4\.(b|u)32\b") == 1
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u|f)32\b") == 8
    if fmt == "nvfp4":
        assert ptx_has(ptx, r"\bmul\.rn\.f16x2\b")  # exact block product in f16
    else:
        assert ptx_has(ptx, r"\bmax\.u32\b")  # UE8M0 byte 0 -> subnormal 2^-127


QUANT_CASES = [(f, r) for f, r in (("nvfp4", None), ("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp4_b16", "floor"),
                                   ("mxfp4_b16", "rceil"))]


@pytest.mark.compile
@pytest.mark.parametrize("arch,head_dim", [("sm_90a", 64), ("sm_90a", 128), ("sm_90a", 256), ("sm_100a", 128)])
@pytest.mark.parametrize("fmt,rule", QUANT_CASES)
def test_quantize_rows_compiles(fmt, rule, head_dim, arch):
    from qattn.cute_kernels.compile_utils import ptx_count, ptx_has

    ptx, _ = _compile("quant", fmt, head_dim, arch, rule)
    _common_ptx_checks(ptx, arch)
    assert not ptx_has(ptx, r"e2m1x2")  # portable E2M1 rounding, no sm_100a-only conversion
    assert ptx_count(ptx, r"\bcvt\.rni\.u32\.f32\b") == 32  # one per value
    assert ptx_count(ptx, r"\bld\.global(\.\w+)*\.v4\.(b|u|f)32\b") == 8  # 32 fp32 in 128-bit loads
    assert ptx_count(ptx, r"\bst\.global(\.\w+)*\.v4\.(b|u)32\b") == 1  # 16 payload bytes
    if fmt == "nvfp4":
        assert ptx_has(ptx, r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b")
        assert ptx_has(ptx, r"\bdiv\.rn\.f32\b")


@pytest.mark.compile
def test_compile_times_are_small():
    ptx_time = [_compile("dequant", f, d, a)[1] for f in FORMATS for d in HEAD_DIMS for a in ARCHS]
    assert max(ptx_time) < 20.0, ptx_time


@pytest.mark.compile
def test_compile_for_arch_restores_env_and_checks_arch(monkeypatch):
    from qattn.cute_kernels import compile_utils, fp4_rows

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    before = dict(os.environ)
    cfg, args = fp4_rows.make_dequant_compile_args("mxfp4", 64)
    _, ptx = compile_utils.compile_for_arch(cfg, *args, arch="sm_90a")
    assert dict(os.environ) == before
    assert compile_utils.ptx_has(ptx, r"\.target\s+sm_90a")
    monkeypatch.delenv("CUTE_DSL_ARCH")
    before = dict(os.environ)
    compile_utils.compile_for_arch(cfg, *args, arch="sm_100a", keep_ptx=False)
    assert dict(os.environ) == before
    with pytest.raises(ValueError, match="arch"):
        compile_utils.compile_for_arch(cfg, *args, arch="hopper")


def test_kernel_config_validation():
    from qattn.cute_kernels import fp4_rows

    with pytest.raises(ValueError, match="fmt"):
        fp4_rows.Fp4DequantRows("fp8", 128)
    with pytest.raises(ValueError, match="head_dim"):
        fp4_rows.Fp4DequantRows("mxfp4", 48)
    k = fp4_rows.Fp4DequantRows("nvfp4", 48)  # 16-value groups when head_dim is not a multiple of 32
    assert (k.words, k.threads_per_row) == (2, 3)


def test_launchers_reject_cpu_tensors():
    from qattn.cute_kernels import fp4_rows

    p = torch.zeros(4, 32, dtype=torch.uint8)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    # each check's own "<name>: <what>" message (fp4_rows._check_cuda_tensor / quantize_rows / _fp4_format)
    with pytest.raises(ValueError, match=r"^payload: expected a CUDA tensor, got device cpu$"):
        fp4_rows.dequantize_rows(p, s, "mxfp4")
    with pytest.raises(TypeError, match=r"^payload: expected dtype torch\.uint8, got torch\.float32$"):
        fp4_rows.dequantize_rows(p.float(), s, "mxfp4")
    with pytest.raises(ValueError, match=r"^fmt: expected an FP4 format .*, got 'int8'$"):
        fp4_rows.dequantize_rows(p, s, "int8")
    with pytest.raises(ValueError, match=r"^x: expected a CUDA tensor, got device cpu$"):
        fp4_rows.quantize_rows(torch.zeros(4, 64), "mxfp4")
    with pytest.raises(TypeError, match=r"^x: expected dtype float32 or bfloat16, got torch\.float16$"):
        fp4_rows.quantize_rows(torch.zeros(4, 64, dtype=torch.float16), "mxfp4")


# ==================================================================================================
# a small PTX interpreter for the helpers' inline-asm bodies (vectorised over numpy uint32 arrays)
# ==================================================================================================
M32 = np.uint64(0xFFFFFFFF)


def _f32_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _bits_f32(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint32).view(np.float32)


def _e4m3_bytes_to_f16_bits(b) -> np.ndarray:
    t = torch.from_numpy(np.asarray(b, dtype=np.uint8).copy()).view(torch.float8_e4m3fn)
    return t.to(torch.float16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def _prmt(a, b, c):
    pool = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + \
           [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        n = (c >> np.uint32(4 * i)) & np.uint32(0xF)
        sel = np.choose((n & np.uint32(7)).astype(np.int64), pool)
        rep = np.where(sel & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
        byte = np.where(n & np.uint32(8), rep, sel)
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for i in range(8):
        if (lut >> i) & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out


def _as_s32(x):
    return np.asarray(x, dtype=np.uint32).view(np.int32)


def _parse_imm(tok: str):
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", tok):
        return np.uint32(int(tok[2:], 16))
    if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", tok):
        return np.uint32(int(tok, 0) & 0xFFFFFFFF)
    return None


def run_ptx(body: str, n_out: int, inputs: list) -> list:
    """Run an inline-asm body. ``inputs`` are uint32 arrays (f32 operands as their bits); returns the outputs
    as uint32 arrays (f32 results as bits)."""
    shape = np.asarray(inputs[0]).shape
    regs: dict = {}
    for k, v in enumerate(inputs):
        regs[f"${n_out + k}"] = np.asarray(v, dtype=np.uint32)
    # statements: split on ';' but keep the {lo, hi} vector operands together
    stmts = [s.strip() for s in re.sub(r"\s+", " ", body).split(";")]

    def val(tok):
        tok = tok.strip()
        imm = _parse_imm(tok)
        if imm is not None:
            return np.full(shape, imm, dtype=np.uint32)
        return regs[tok]

    for st in stmts:
        st = st.strip().lstrip("{").strip().rstrip("}").strip()
        if not st or st.startswith(".reg"):
            continue
        op, _, rest = st.partition(" ")
        # operands; a vector operand {a, b} is one operand
        ops = [o.strip() for o in re.findall(r"\{[^}]*\}|[^,]+", rest)]
        d = ops[0]
        a = [val(o) if not o.startswith("{") else None for o in ops[1:]]
        if op in ("mov.b32", "mov.b16"):
            if d.startswith("{"):  # unpack
                lo, hi = [x.strip() for x in d.strip("{}").split(",")]
                src = a[0]
                regs[lo] = src & np.uint32(0xFFFF)
                regs[hi] = src >> np.uint32(16)
                continue
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op in ("shr.b32", "shr.u32"):
            r = a[0] >> a[1]
        elif op == "shl.b32":
            r = (a[0].astype(np.uint64) << a[1].astype(np.uint64) & M32).astype(np.uint32)
        elif op in ("sub.u32", "sub.s32"):
            r = ((a[0].astype(np.int64) - a[1].astype(np.int64)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "add.s32":
            r = ((a[0].astype(np.int64) + a[1].astype(np.int64)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "max.u32":
            r = np.maximum(a[0], a[1])
        elif op == "max.s32":
            r = np.maximum(_as_s32(a[0]), _as_s32(a[1])).view(np.uint32)
        elif op == "min.s32":
            r = np.minimum(_as_s32(a[0]), _as_s32(a[1])).view(np.uint32)
        elif op == "mad.lo.u32":
            r = ((a[0].astype(np.uint64) * a[1].astype(np.uint64) + a[2].astype(np.uint64)) & M32).astype(np.uint32)
        elif op == "prmt.b32":
            r = _prmt(a[0], a[1], a[2])
        elif op == "lop3.b32":
            r = _lop3(a[0], a[1], a[2], int(ops[4], 0))
        elif op == "bfe.u32":
            pos, ln = int(ops[2], 0), int(ops[3], 0)
            r = (a[0] >> np.uint32(pos)) & np.uint32((1 << ln) - 1)
        elif op == "bfi.b32":
            pos, ln = int(ops[3], 0), int(ops[4], 0)
            mask = np.uint32(((1 << ln) - 1) << pos)
            r = (a[1] & ~mask) | ((a[0] << np.uint32(pos)) & mask)
        elif op in ("setp.eq.u32", "setp.gt.u32"):
            r = (a[0] == a[1]) if op.startswith("setp.eq") else (a[0] > a[1])
        elif op == "selp.b32":
            r = np.where(a[2], a[0], a[1]).astype(np.uint32)
        elif op == "min.f32":
            x, y = _bits_f32(a[0]), _bits_f32(a[1])
            r = _f32_bits(np.where(np.isnan(x), y, np.where(np.isnan(y), x, np.minimum(x, y))))
        elif op == "mul.rn.f32":
            r = _f32_bits(_bits_f32(a[0]) * _bits_f32(a[1]))
        elif op in ("add.rn.f32", "sub.rn.f32"):  # numpy fp32 add / subtract: IEEE, round to nearest even
            x, y = _bits_f32(a[0]), _bits_f32(a[1])
            with np.errstate(all="ignore"):
                r = _f32_bits(x + y if op.startswith("add") else x - y)
        elif op == "abs.f32":
            r = a[0] & np.uint32(0x7FFFFFFF)
        elif op == "add.u32":
            r = ((a[0].astype(np.uint64) + a[1].astype(np.uint64)) & M32).astype(np.uint32)
        elif op == "div.rn.f32":
            with np.errstate(all="ignore"):
                r = _f32_bits(_bits_f32(a[0]) / _bits_f32(a[1]))
        elif op == "rcp.rn.f32":  # IEEE reciprocal, correctly rounded (numpy's fp32 division is)
            with np.errstate(all="ignore"):
                r = _f32_bits(np.float32(1.0) / _bits_f32(a[0]))
        elif op == "cvt.rni.u32.f32":
            x = _bits_f32(a[0]).astype(np.float64)
            x = np.where(np.isnan(x), 0.0, np.clip(np.rint(x), 0, 2**32 - 1))
            r = x.astype(np.uint32)
        elif op in ("cvt.u16.u32", "cvt.u32.u16"):
            r = a[0] & np.uint32(0xFFFF)
        elif op == "cvt.rn.f16x2.e4m3x2":
            lo = _e4m3_bytes_to_f16_bits(a[0] & np.uint32(0xFF))
            hi = _e4m3_bytes_to_f16_bits((a[0] >> np.uint32(8)) & np.uint32(0xFF))
            r = lo | (hi << np.uint32(16))
        elif op == "cvt.f32.f16":
            r = _f32_bits((a[0] & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32))
        elif op == "mul.rn.f16x2":
            def half(w, k):
                return ((w >> np.uint32(16 * k)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
            # float16 products of at most 22 significant bits are exact in fp32, so one rounding to f16
            r = np.zeros(shape, dtype=np.uint32)
            for k in range(2):
                p = (half(a[0], k).astype(np.float32) * half(a[1], k).astype(np.float32)).astype(np.float16)
                r |= p.view(np.uint16).astype(np.uint32) << np.uint32(16 * k)
        elif op == "cvt.rn.satfinite.e4m3x2.f32":
            def enc(w):
                t = torch.from_numpy(_bits_f32(w).copy())
                nan = torch.isnan(t)
                e = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
                return np.where(nan.numpy(), 0x7F, e.numpy()).astype(np.uint32)
            r = (enc(a[0]) << np.uint32(8)) | enc(a[1])
        else:
            raise NotImplementedError(f"PTX interpreter: {op}")
        regs[d] = np.broadcast_to(np.asarray(r), shape).astype(r.dtype if r.dtype == bool else np.uint32)
    return [regs[f"${k}"] for k in range(n_out)]


def helper(name: str, *inputs) -> list:
    from qattn.cute_kernels.common.fp4 import PTX_HELPERS

    body, n_out, kinds = PTX_HELPERS[name]
    ins = [(_f32_bits(x) if k == "f" else np.asarray(x, dtype=np.uint32)) for k, x in zip(kinds, inputs)]
    return run_ptx(body, n_out, ins)


def _ref_f32_bits(t: torch.Tensor) -> np.ndarray:
    return t.float().contiguous().view(torch.int32).numpy().view(np.uint32)


def _same_f32(got_bits: np.ndarray, want: torch.Tensor) -> None:
    g = _bits_f32(got_bits)
    w = want.float().numpy()
    assert np.array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    assert np.array_equal(g.view(np.uint32)[ok], w.view(np.uint32)[ok])


# ==================================================================================================
# helper bodies vs the reference codec
# ==================================================================================================
def _words_covering_all_codes(n_random: int = 50000) -> np.ndarray:
    rng = np.random.default_rng(1)
    sweep = np.array([sum(((c + k) % 16) << (4 * k) for k in range(8)) for c in range(16)], dtype=np.uint32)
    return np.concatenate([sweep, np.array([0, 0xFFFFFFFF, 0x88888888], dtype=np.uint32),
                           rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32)])


def test_interpreter_prmt_semantics():
    a, b = np.array([0x33221100], np.uint32), np.array([0xF7E6D5C4], np.uint32)
    assert _prmt(a, b, np.array([0x7654], np.uint32))[0] == 0xF7E6D5C4
    assert _prmt(a, b, np.array([0x0123], np.uint32))[0] == 0x00112233
    # sign-replicate mode: selector 0xC reads byte 4 (0xC4, msb set) -> 0xFF; 0x8 reads byte 0 (0x00) -> 0x00
    assert _prmt(a, b, np.array([0x8C8C], np.uint32))[0] == 0x00FF00FF


def _e4m3_words_to_f32(words_pair) -> np.ndarray:
    """Two words of 4 E4M3 bytes each -> (n, 8) fp32 bits, in byte order, through the f16 conversions."""
    halves = []
    for w in words_pair:
        h0, h1 = helper("e4m3x4_to_f16x4", w)
        for h in (h0, h1):
            halves += helper("f16x2_to_f32x2", h)
    return np.stack(halves, axis=1)


def test_e2m1_words_decode_exactly():
    words = _words_covering_all_codes()
    got = _e4m3_words_to_f32(helper("e2m1x8_to_e4m3x8", words))  # element order
    payload = torch.from_numpy(words.view(np.uint8).reshape(-1, 4).copy())
    want = ref.e2m1_decode(ref.unpack_e2m1(payload))
    _same_f32(got.reshape(-1), want.reshape(-1))
    assert np.array_equal(np.signbit(_bits_f32(got.reshape(-1))), np.signbit(want.reshape(-1).numpy()))


def test_e4m3_scale_broadcast_and_exact_product():
    b = np.arange(256, dtype=np.uint32)
    for k in range(4):
        word = b << np.uint32(8 * k) | np.uint32(0x5A5A5A5A & ~(0xFF << (8 * k)))
        (h,) = helper(f"e4m3_to_f16x2[{k}]", word)
        lo, hi = helper("f16x2_to_f32x2", h)
        want = ref.e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
        _same_f32(lo, want)
        _same_f32(hi, want)
    # every E2M1 value times every E4M3 scale is exact in f16 (the nvfp4 block product)
    codes = np.repeat(np.arange(16, dtype=np.uint32), 256)
    scl = np.tile(np.arange(256, dtype=np.uint32), 16)
    e4 = np.array([0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C], np.uint32)[codes & 7] | ((codes & 8) << 4)
    (v,) = helper("e4m3x4_to_f16x4", e4)[:1]
    (s,) = helper("e4m3_to_f16x2[0]", scl)
    (p,) = helper("f16x2_mul", v, s)
    lo, _ = helper("f16x2_to_f32x2", p)
    want = ref.e2m1_decode(torch.from_numpy(codes.astype(np.uint8))) * ref.e4m3_decode(
        torch.from_numpy(scl.astype(np.uint8)))
    _same_f32(lo, want)


def test_ue8m0_and_e4m3_to_f32_all_bytes():
    b = np.arange(256, dtype=np.uint32)
    tb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    (u,) = helper("ue8m0_to_f32", b)
    _same_f32(u, ref.ue8m0_decode(tb))
    assert u[0] == 0x00400000 and u[255] == 0x7FC00000  # 2^-127 subnormal, canonical NaN
    (e,) = helper("e4m3_to_f32", b)
    _same_f32(e, ref.e4m3_decode(tb))


def _special_f32() -> np.ndarray:
    rng = np.random.default_rng(2)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6, 7, 8, 1e30], np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)), mids])
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    rand = _bits_f32(bits)
    rand = rand[np.isfinite(rand)]
    small = rng.uniform(-7, 7, 200000).astype(np.float32)
    sub = _bits_f32(rng.integers(1, 0x800000, 1000, dtype=np.uint64).astype(np.uint32))
    x = np.concatenate([near, -near, rand, small, sub, -sub, np.array([0.0, -0.0, np.inf, -np.inf], np.float32)])
    return x.astype(np.float32)


def test_f32_to_e2m1_matches_reference():
    x = _special_f32()
    (c,) = helper("f32_to_e2m1", x)
    want = ref.e2m1_encode(torch.from_numpy(x.copy())).numpy().astype(np.uint32)
    bad = np.nonzero(c != want)[0]
    assert bad.size == 0, [(float(x[i]), int(c[i]), int(want[i])) for i in bad[:10]]


def test_e2m1_round_f32_is_the_value_of_the_code():
    """The scale search's rounding (no code) equals decoding f32_to_e2m1's code, sign included, on midpoints,
    their neighbours, random bits, subnormals and +-inf."""
    x = _special_f32()
    (q,) = helper("e2m1_round_f32", x)
    want = ref.e2m1_decode(ref.e2m1_encode(torch.from_numpy(x.copy())))
    got = _bits_f32(q)
    assert np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32)), \
        [(float(x[i]), float(got[i]), float(want[i])) for i in np.nonzero(got != want.numpy())[0][:10]]


def test_f32_to_e4m3_satfinite_matches_reference():
    x = _special_f32()
    x = x[np.isfinite(x)]
    (c,) = helper("f32_to_e4m3_satfinite", x)
    want = ref.e4m3_encode(torch.from_numpy(x.copy())).numpy().astype(np.uint32)
    assert np.array_equal(c, want)


def test_mx_scale_bytes_match_reference():
    rng = np.random.default_rng(3)
    e = np.arange(0, 255, dtype=np.uint32)
    mants = np.array([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF], np.uint32)
    grid = (e[:, None] << np.uint32(23) | mants[None, :]).reshape(-1)
    rnd = rng.integers(0, 0x7F800000, 100000, dtype=np.uint64).astype(np.uint32)
    amax = _bits_f32(np.concatenate([grid, rnd]))
    for rule in ("floor", "rceil"):
        (b,) = helper(f"mx_ue8m0_{rule}", amax)
        want = (ref.mx_shared_exponent(torch.from_numpy(amax.copy()), rule) + 127).numpy().astype(np.uint32)
        assert np.array_equal(b, want), rule


def test_rcp_rn_and_pack_match_reference():
    rng = np.random.default_rng(4)
    d = _bits_f32(rng.integers(0x00800000, 0x7F000000, 100000, dtype=np.uint64).astype(np.uint32))
    (r,) = helper("rcp_rn", d)
    td = torch.from_numpy(d.copy())
    _same_f32(r, torch.ones_like(td) / td)
    codes = rng.integers(0, 16, (5000, 8), dtype=np.uint64).astype(np.uint32)
    (w,) = helper("pack_e2m1x8", *[codes[:, k] for k in range(8)])
    want = ref.pack_e2m1(torch.from_numpy(codes.astype(np.uint8)))  # (n, 4) bytes
    assert np.array_equal(w.view(np.uint8).reshape(-1, 4), want.numpy())



def test_e2m1_even_odd_decode_is_exact_times_2_pow_minus_6():
    """The table-free decode (decode kernel's K operand): even elements in the first word, odd in the second,
    every E2M1 value (both signs, -0 included) times 2^-6 exactly."""
    words = _words_covering_all_codes()
    got = _e4m3_words_to_f32(helper("e2m1x8_to_e4m3x8_even_odd", words))  # e0, e2, e4, e6, e1, e3, e5, e7
    payload = torch.from_numpy(words.view(np.uint8).reshape(-1, 4).copy())
    want = ref.e2m1_decode(ref.unpack_e2m1(payload))[:, [0, 2, 4, 6, 1, 3, 5, 7]] * 2.0**-6
    _same_f32(got.reshape(-1), want.reshape(-1))
    assert np.array_equal(np.signbit(_bits_f32(got.reshape(-1))), np.signbit(want.reshape(-1).numpy()))


def test_e4m3_pair_and_even_odd_token_pairs():
    """The decode kernel's nvfp4 V token pairs: two tokens' even/odd E4M3 bytes interleaved by prmt (0x5140 /
    0x7362), converted, times the two tokens' scales from ``e4m3_pair_to_f16x2``: each f16x2 word holds the same
    element of both tokens, 2^-6 x E2M1 x scale exactly (and a zero scale gives exact zeros)."""
    words = _words_covering_all_codes(4000)
    wa, wb = words, np.roll(words, 1)
    rng = np.random.default_rng(3)
    sa = rng.integers(0, 256, len(words)).astype(np.uint32) & np.uint32(0x7F)  # E4M3 scales, NaN 0x7F included
    sb = rng.integers(0, 256, len(words)).astype(np.uint32) & np.uint32(0x7E)
    sb[:100] = 0  # a masked token
    (s2,) = helper("e4m3_pair_to_f16x2", sa | np.uint32(0xAB00), sb | np.uint32(0xCD00))  # other bytes ignored
    ev_a, od_a = helper("e2m1x8_to_e4m3x8_even_odd", wa)
    ev_b, od_b = helper("e2m1x8_to_e4m3x8_even_odd", wb)
    got = []  # (n, 8 slots, 2 tokens)
    for ea, eb in ((ev_a, ev_b), (od_a, od_b)):
        for sel in (0x5140, 0x7362):
            x = _prmt(ea, eb, np.full_like(ea, sel))
            for h in helper("e4m3x4_to_f16x4", x):
                (p,) = helper("f16x2_mul", h, s2)
                got.append(np.stack(helper("f16x2_to_f32x2", p), axis=1))
    got = np.stack(got, axis=1)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for t, (w, s) in enumerate(((wa, sa), (wb, sb))):
        payload = torch.from_numpy(w.view(np.uint8).reshape(-1, 4).copy())
        scale = ref.e4m3_decode(torch.from_numpy(s.astype(np.uint8)))
        want = ref.e2m1_decode(ref.unpack_e2m1(payload))[:, order] * 2.0**-6 * scale[:, None]
        _same_f32(got[:, :, t].reshape(-1), want.reshape(-1))
