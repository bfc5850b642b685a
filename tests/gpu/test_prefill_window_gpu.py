"""GPU tests of sliding-window (local) prefill attention: FlashAttention's ``window_size=(left, right)``, query i
sees keys i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded; causal: right 0).

The kernel against the fp64 reference of the same quantization and window (``prefill_reference``); FP8 P x V
against its CPU emulation; ``flash_attn_func`` (in-kernel Q quantization, PDL launch) against exact attention;
varlen per sequence; the unquantized 16-bit path. Outputs are poisoned (NaN) before each call, so a row the
kernel never writes fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from .test_prefill_gpu import _cos, _inputs, _nrmse, _quantize, _varlen_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (left, right, causal): a single key (the diagonal), windows ending at / crossing 128-key tile edges, left
# only, right only (a non-causal upper bound), both sides, a window longer than some sequences
WINDOWS = [(0, 0, True), (1, -1, True), (127, 0, True), (128, 7, True), (300, 0, True), (64, 64, False),
           (200, -1, False), (-1, 50, False), (5, 300, False)]
# (B, Sq, Sk, Hq, Hkv): Sq < Sk, Sq > Sk (rows without keys), ragged tiles, GQA, one row, 8 tiles
SHAPES = [(2, 256, 256, 4, 4), (2, 77, 333, 8, 2), (1, 513, 129, 2, 1), (1, 1000, 1000, 2, 2), (1, 1, 200, 4, 1)]


def _check(o, lse, ref, ref_lse, tol=1e-2):
    assert torch.isfinite(o).all(), "NaN left in the output (a row was not written)"
    err = (o.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    assert err <= tol, f"max rel err {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows with no visible key must have LSE -inf"
    assert (lse[fin].double() - ref_lse[fin]).abs().max() <= 1e-3


@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w[0]}_{w[1]}{'_causal' if w[2] else ''}")
def test_window_kernel_vs_same_quantization(window, shape, D):
    from qattn.interface.prefill import prefill_int8
    from qattn.reference.attention import prefill_reference

    left, right, causal = window
    B, Sq, Sk, Hq, Hkv = shape
    granularity = "per_block" if Sq == 77 else "per_warp"
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=Sq + Sk + D + left)
    q8, qs, k8, ks, k_mean = _quantize(q, k, granularity)
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = prefill_int8(q8, qs, k8, ks, v, causal=causal, granularity=granularity, return_lse=True, out=out,
                          window_size=(left, right), k_mean=k_mean)
    ref, ref_lse = prefill_reference(q, k, v, causal=causal, qk_quant="int8", granularity=granularity,
                                     return_lse=True, window_size=(left, right))
    _check(o, lse, ref, ref_lse)


@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("window", [(0, 0, True), (127, 0, True), (64, 64, False), (200, -1, False)],
                         ids=lambda w: f"{w[0]}_{w[1]}{'_causal' if w[2] else ''}")
@pytest.mark.parametrize("shape", [(2, 77, 333, 8, 2), (1, 513, 129, 2, 1), (1, 1000, 1000, 2, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_window_fp8pv_kernel_vs_emulation(shape, window, D):
    from qattn.interface.prefill import prefill_int8
    from qattn.quant.v_fp8 import quantize_v_fp8_reference
    from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation

    left, right, causal = window
    B, Sq, Sk, Hq, Hkv = shape
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=Sq + Sk + D)
    q8, qs, k8, ks, _ = _quantize(q, k, "per_warp")
    vt, vs = quantize_v_fp8_reference(v)
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = prefill_int8(q8, qs, k8, ks, vt, causal=causal, return_lse=True, out=out, pv_dtype="fp8",
                          v_scale=vs, window_size=(left, right))
    emu, emu_lse = prefill_fp8pv_emulation(q, k, v, causal=causal, return_lse=True, out_dtype=torch.float64,
                                           quantized=(q8, qs, k8, ks, vt, vs), window_size=(left, right))
    _check(o, lse, emu, emu_lse)
    assert _nrmse(o, emu) <= 5e-3


@pytest.mark.parametrize("pv_dtype,qk_quant", [("bf16", "int8"), ("fp8", "int8"), ("bf16", None)])
@pytest.mark.parametrize("D,Sq,Sk,window", [(128, 4096, 4096, (1024, 0, True)), (64, 2048, 2048, (500, 0, True)),
                                            (128, 1500, 3000, (256, 256, False)), (64, 3000, 3000, (1000, -1, False))])
def test_flash_attn_func_window_vs_exact(D, Sq, Sk, window, pv_dtype, qk_quant):
    """End to end (K prepass, PDL launch, in-kernel Q; the 192-row tiles of long causal grids at D128) against
    exact fp64 attention with the window: the issue's bar for int8 Q K^T (the 16-bit path much tighter)."""
    from qattn import flash_attn_func
    from qattn.reference import attention_reference

    left, right, causal = window
    q, k, v = _inputs(1, Sq, Sk, 4, 2, D, torch.bfloat16, outliers="k_offset", seed=D + Sq)
    o, lse = flash_attn_func(q, k, v, causal=causal, window_size=(left, right), pv_dtype=pv_dtype,
                             qk_quant=qk_quant, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=(left, right), return_lse=True)
    full = attention_reference(q, k, v, causal=causal)
    assert _cos(full.float(), ref) < 0.99, "the window must change this output"
    cos, nrmse = _cos(o, ref), _nrmse(o, ref)
    if qk_quant is None:
        assert cos >= 0.99999 and nrmse <= 0.005, (cos, nrmse)
    else:
        assert cos >= 0.999 and nrmse <= (0.045 if pv_dtype == "fp8" else 0.03), (cos, nrmse)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))


@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("window", [(100, 0, True), (0, 0, True), (50, 20, False), (300, -1, False)],
                         ids=lambda w: f"{w[0]}_{w[1]}{'_causal' if w[2] else ''}")
def test_window_varlen_matches_each_sequence(window, D):
    from qattn.interface.prefill import prefill_int8_varlen
    from qattn.reference.attention import prefill_reference

    left, right, causal = window
    lens_q, lens_k = [1, 300, 129, 700, 64], [5, 300, 400, 700, 1]
    seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, "per_warp", seed=D + left)
    out = torch.full((sum(lens_q), 4, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 return_lse=True, out=out, window_size=(left, right),
                                 k_mean=torch.cat([s[7] for s in seqs]))
    start = 0
    for (q, k, vv, *_), lq in zip(seqs, lens_q):
        ref, ref_lse = prefill_reference(q, k, vv, causal=causal, qk_quant="int8", return_lse=True,
                                         window_size=(left, right))
        _check(o[start:start + lq].unsqueeze(0), lse[:, start:start + lq].unsqueeze(0), ref, ref_lse)
        start += lq


def test_window_covering_everything_is_the_plain_kernel():
    """A window no row reaches the end of (left >= seqlen_k - 1, right >= seqlen_q - 1) is the plain kernel, and
    a right edge of 0 the causal one: same bits."""
    from qattn import flash_attn_func

    q, k, v = _inputs(2, 700, 700, 4, 2, 128, torch.bfloat16, seed=3)
    a = flash_attn_func(q, k, v, causal=True)
    for left in (699, 5000):
        assert torch.equal(flash_attn_func(q, k, v, causal=True, window_size=(left, 0)), a)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 0)), a)  # right edge 0: the causal mask
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 699)), flash_attn_func(q, k, v))
    b = flash_attn_func(q, k, v, causal=True, window_size=(698, 0))  # key 0 cut for the last row: the window kernel
    assert not torch.equal(a, b) and torch.equal(a[:, :-1], b[:, :-1])


def test_window_output_is_deterministic_and_inputs_untouched():
    from qattn import flash_attn_func

    q, k, v = _inputs(2, 1200, 1200, 8, 2, 64, torch.bfloat16, seed=9)
    copies = [t.clone() for t in (q, k, v)]
    a = flash_attn_func(q, k, v, causal=True, window_size=(256, 0))
    b = flash_attn_func(q, k, v, causal=True, window_size=(256, 0))
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), copies))


if __name__ == "__main__":  # quick timing: windowed vs full causal, kernel + prepass (flash_attn_func), graphs
    from qattn import flash_attn_func

    from ._timing import graph_median_us

    for D, S, left in itertools.product((128, 64), (8192, 16384), (1024, 4096)):
        q, k, v = _inputs(2, S, S, 16, 16, D, torch.bfloat16, seed=1)
        times = {name: graph_median_us(lambda ws=ws: flash_attn_func(q, k, v, causal=True, window_size=ws), reps=10)
                 for name, ws in (("causal", (-1, -1)), (f"window {left}", (left, 0)))}
        print(f"D{D} S{S}: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items()))
