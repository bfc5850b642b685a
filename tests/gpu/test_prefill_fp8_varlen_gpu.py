"""GPU tests of FP8 P x V on packed sequences: the varlen V prepass (``qattn.quant.v_fp8.quantize_v_fp8_varlen``,
bytes vs its exact reference) and the attention kernel reading each sequence's V^T region
(``prefill_int8_varlen(pv_dtype="fp8")``, ``flash_attn_varlen_func(pv_dtype="fp8")``), sequence by sequence vs
the dense FP8 emulation and vs dense ``flash_attn_func``. Outputs and prepass buffers are poisoned first."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.gpu.test_prefill_gpu import _nrmse, _varlen_inputs, poison_v_prepass  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cu(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")


def _region(vt, cu, i):
    """Sequence i's V^T as the dense prepass lays it out: (1, Hkv, D, keys padded to 128)."""
    from qattn.quant.v_fp8 import varlen_vt_offsets

    o = int(varlen_vt_offsets(cu)[i])
    n = -(-int(cu[i + 1] - cu[i]) // 128) * 128
    return vt[:, :, o:o + n].unsqueeze(0)


LENS = [[1, 300, 0, 129, 64], [5000], [0, 0, 7], [3, 2100, 128, 127, 255, 1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("lens", LENS + ["many"])
def test_v_fp8_varlen_prepass_matches_reference(poison_v_prepass, lens, D, dtype):
    from qattn.quant.v_fp8 import quantize_v_fp8_varlen, quantize_v_fp8_varlen_reference, varlen_vt_offsets

    g = torch.Generator(device="cuda").manual_seed(D)
    if lens == "many":  # more sequences than SMs, mostly short
        lens = torch.randint(0, 200, (300,), device="cuda", generator=g).tolist()
    H = 2
    total = sum(lens)
    big = torch.randn(total, 2 * H, D, device="cuda", generator=g) * torch.rand(2 * H, D, device="cuda", generator=g) * 8
    big[:, :, 3] = 0.0  # an all-zero channel: scale 0, codes 0
    v = big.to(dtype)[:, :H]  # head-strided view: read in place
    cu = _cu(lens)
    vt, vs = quantize_v_fp8_varlen(v, cu, max(lens))
    vt_ref, vs_ref = quantize_v_fp8_varlen_reference(v, cu)
    assert torch.equal(vs, vs_ref)
    raw, ref = vt.view(torch.uint8), vt_ref.view(torch.uint8)
    written = torch.zeros(raw.shape[-1], dtype=torch.bool, device="cuda")
    for i, o in enumerate(varlen_vt_offsets(cu).tolist()):
        n = max(-(-lens[i] // 128), 1) * 128  # an empty sequence: one zero tile (inside its gap)
        assert torch.equal(raw[:, :, o:o + n], ref[:, :, o:o + n]), f"sequence {i} (len {lens[i]})"
        written[o:o + n] = True
    assert (raw[:, :, ~written] == 0xFF).all(), "the prepass wrote outside the sequences' regions"


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
def test_fp8_varlen_kernel_vs_emulation(granularity, causal, D):
    """The kernel on reference-quantized inputs (int8 Q/K per sequence, the varlen V^T): every sequence vs the
    dense FP8 emulation on that sequence's slices of the same bytes."""
    from qattn.interface.prefill import prefill_int8_varlen
    from qattn.quant.v_fp8 import quantize_v_fp8_varlen_reference
    from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation

    lens_q, lens_k = [1, 300, 129, 700, 64, 200], [5, 300, 400, 700, 1, 1000]
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    seqs, q8, qs, k8, ks, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, D, granularity, seed=D + causal)
    vt, vs = quantize_v_fp8_varlen_reference(v, cu_k)
    out = torch.full((sum(lens_q), 4, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = prefill_int8_varlen(q8, qs, k8, ks, vt, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 granularity=granularity, return_lse=True, out=out, pv_dtype="fp8", v_scale=vs)
    assert torch.isfinite(o).all(), "NaN left in the output (a row was not written)"
    start = 0
    for i, ((q, k, vv, q8i, qsi, k8i, ksi, _), lq) in enumerate(zip(seqs, lens_q)):
        emu, emu_lse = prefill_fp8pv_emulation(q, k, vv, causal=causal, granularity=granularity, return_lse=True,
                                               quantized=(q8i, qsi, k8i, ksi, _region(vt, cu_k, i), vs[i:i + 1]),
                                               out_dtype=torch.float64)
        got = o[start:start + lq].unsqueeze(0)
        err = (got.double() - emu).abs().max() / emu.abs().max()
        assert err <= 1e-2, f"sequence {i}: max rel err vs emulation {err:.3e}"
        assert _nrmse(got, emu) <= 5e-3
        fin = torch.isfinite(emu_lse[0])
        got_lse = lse[:, start:start + lq]
        assert torch.equal(fin, torch.isfinite(got_lse))
        assert (got_lse[fin].double() - emu_lse[0][fin]).abs().max() <= 1e-3
        start += lq


@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_fp8_matches_dense_per_sequence(monkeypatch, causal, D, dtype):
    """Three launches on packed sequences (K prepass, varlen V prepass, attention; Q quantized in the kernel)
    give, sequence by sequence, the bits of dense ``flash_attn_func(pv_dtype="fp8")`` on that sequence (whole
    units there: a split unit rounds P against each split's own max), and stay within the emulation's bounds."""
    import qattn
    import qattn.interface.prefill as P
    from qattn.reference.prefill_fp8pv import prefill_fp8pv_emulation

    monkeypatch.setattr(P, "_split_tail_plan", lambda num_units, num_kv_tiles, num_sms: (num_units, 1))
    lens_q, lens_k = [700, 1, 129, 2000, 64], [900, 3, 129, 2000, 500]
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    g = torch.Generator(device="cuda").manual_seed(D)
    Hq, Hkv = 8, 2
    q = torch.randn(sum(lens_q), Hq, D, device="cuda", generator=g).to(dtype)
    k = (torch.randn(sum(lens_k), Hkv, D, device="cuda", generator=g) + 3.0).to(dtype)  # a K offset to smooth
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda", generator=g).to(dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    runs = [qattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                         pv_dtype="fp8", return_lse=True) for _ in range(3)]
    o, lse = runs[0]
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (Hq, sum(lens_q))
    for o2, lse2 in runs[1:]:  # back to back (PDL chain): the same bits
        assert torch.equal(o2, o) and torch.equal(lse2, lse)
    for i in range(len(lens_q)):
        qi, ki, vi = (x[c[i]:c[i + 1]].unsqueeze(0) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        d_o, d_lse = qattn.flash_attn_func(qi, ki, vi, causal=causal, pv_dtype="fp8", return_lse=True)
        got, got_lse = o[cu_q[i]:cu_q[i + 1]].unsqueeze(0), lse[:, cu_q[i]:cu_q[i + 1]]
        assert torch.equal(got, d_o), f"sequence {i}: output differs from dense flash_attn_func"
        assert torch.equal(got_lse, d_lse[0]), f"sequence {i}: LSE differs from dense flash_attn_func"
        emu = prefill_fp8pv_emulation(qi, ki, vi, causal=causal, out_dtype=torch.float64)
        assert (got.double() - emu).abs().max() / emu.abs().max() <= 1e-2
        assert _nrmse(got, emu) <= 5e-3


def test_compiled_flash_attn_varlen_func_fp8_matches_eager():
    """torch.compile(fullgraph=True): the qattn::prefill_varlen op carries pv_dtype; same bits as eager."""
    import qattn

    g = torch.Generator(device="cuda").manual_seed(5)
    lens = [300, 1, 700]
    q = torch.randn(sum(lens), 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = _cu(lens)

    def layer(q, k, v):
        return qattn.flash_attn_varlen_func(q, k, v, cu, cu, 700, 700, causal=True, pv_dtype="fp8", return_lse=True)

    eager = layer(q, k, v)
    torch._dynamo.reset()
    comp = torch.compile(layer, fullgraph=True)(q, k, v)
    assert torch.equal(eager[0], comp[0]) and torch.equal(eager[1], comp[1])


def _bench() -> None:
    """H100 timing (CUDA graph, median): FP8 P.V on packed sequences vs 16-bit P.V on the same packing, and vs the
    dense path on an equal-length batch; the varlen V prepass vs the dense one."""
    import qattn
    from qattn.quant.v_fp8 import quantize_v_fp8, quantize_v_fp8_varlen
    from tests.gpu._timing import graph_median_us

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for D, H, lens, causal in ((128, 16, [4096] * 4, False), (128, 16, [4096] * 4, True), (64, 16, [4096] * 4, True),
                               (128, 16, [8000, 3000, 1500] + [300] * 12 + [40] * 20, True)):
        T = sum(lens)
        q, k, v = (torch.randn(T, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        cu = _cu(lens)
        mx = max(lens)
        flops = sum(4 * H * n * n * D / (2 if causal else 1) for n in lens)
        t = {}
        for pv in ("bf16", "fp8"):
            t[pv] = graph_median_us(lambda pv=pv: qattn.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal,
                                                                               pv_dtype=pv))
        t["v_varlen"] = graph_median_us(lambda: quantize_v_fp8_varlen(v, cu, mx))
        dense = ""
        if len(set(lens)) == 1:
            B, S = len(lens), lens[0]
            qd, kd, vd = (x.view(B, S, H, D) for x in (q, k, v))
            t["dense_fp8"] = graph_median_us(lambda: qattn.flash_attn_func(qd, kd, vd, causal=causal, pv_dtype="fp8"))
            t["v_dense"] = graph_median_us(lambda: quantize_v_fp8(vd))
            dense = f"{t['dense_fp8']:.1f} | {t['v_dense']:.1f}"
        else:
            dense = "– | –"
        name = f"D{D} H{H} {len(lens)} seqs ({'x'.join(map(str, sorted(set(lens))[-3:]))}) {'causal' if causal else 'full'}"
        rows.append(f"| {name} | {t['bf16']:.1f} ({flops / t['bf16'] / 1e6:.0f} TF) | {t['fp8']:.1f} "
                    f"({flops / t['fp8'] / 1e6:.0f} TF, {t['bf16'] / t['fp8']:.2f}x) | {t['v_varlen']:.1f} | {dense} |")
    print("| packed batch | varlen bf16 P.V, µs | varlen fp8 P.V, µs | varlen V prepass, µs | dense fp8 P.V, µs | "
          "dense V prepass, µs |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    _bench()
