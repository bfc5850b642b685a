"""GPU tests of ``flash_attn_with_kvcache(..., softcap=c)``: the scores z become c * tanh(z / c) before the softmax.
Oracle: ``paged_decode_reference`` (fp64) with the same cap over the same quantized cache (and its ring / sink rows),
with the usual poisoning (pools before the write, a NaN output). Most caps are small enough (logits of std ~1) that
a kernel ignoring them fails."""

from __future__ import annotations

import itertools

import pytest
import torch

from .test_decode_gpu import _check, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ["nvfp4", "fp8", "int8", "bf16", ("int8", "nvfp4"), "mxfp4"]
# (gqa, seqlen_q, page, num_splits): narrow (<= 8 rows) and wide layouts, two m-blocks, split-KV fixed / automatic
CONFIGS = [(4, 1, 16, 1), (8, 4, 64, 3), (16, 16, 128, 0), (2, 1, 32, 5)]
CAPS = [1.0, 2.0, 50.0]
LENS = [3000, 2, 129, 700]
CASES = [(f, d, c, cap) for (f, d), c, cap in zip(itertools.cycle(itertools.product(FORMATS, (64, 128))),
                                                 CONFIGS * 3, [c for c in CAPS for _ in range(4)])]


def _name(fmt):
    return fmt if isinstance(fmt, str) else "+".join(fmt)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{_name(c[0])}-D{c[1]}-gqa{c[2][0]}-sq{c[2][1]}-p{c[2][2]}"
                                                       f"-s{c[2][3]}-cap{c[3]:g}")
def test_softcap_decode_matches_reference(case):
    from qattn.interface.decode import flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    fmt, D, (gqa, sq, page, splits), cap = case
    cache, q, seqlens, table = make_case(fmt, D, gqa, sq, page, LENS, seed=D + gqa + int(cap))
    ref, ref_lse = paged_decode_reference(q, cache, seqlens, table, return_lse=True, softcap=cap)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, num_splits=splits, return_lse=True, out=out,
                                       softcap=cap)
    err = _check(got, lse, ref, ref_lse)
    if cap <= 2.0:  # the cap matters: attention without it is far off
        plain = paged_decode_reference(q, cache, seqlens, table, softcap=0.0)
        assert float((got.double() - plain).norm() / plain.norm()) > 5 * max(err, 1e-3)


# (format, head_dim, (gqa, seqlen_q, page, num_splits), recent window W, sink tokens N, window_size)
RING_SINK = [("nvfp4", 128, (4, 1, 16, 1), 64, 0, (-1, -1)), ("fp8", 64, (8, 4, 64, 3), 0, 4, (100, 0)),
             ("nvfp4", 128, (16, 16, 128, 0), 128, 8, (-1, -1)), ("int8", 128, (2, 1, 32, 5), 64, 4, (40, 0))]


@pytest.mark.parametrize("case", RING_SINK, ids=lambda c: f"{c[0]}-D{c[1]}-gqa{c[2][0]}-W{c[3]}-N{c[4]}-w{c[5][0]}")
def test_softcap_decode_over_ring_sink_and_windows(case):
    """The bf16 ring and sink tiles are capped like the page tiles (they take the same scale)."""
    from qattn.interface.decode import flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    fmt, D, (gqa, sq, page, splits), W, N, ws = case
    cache, q, seqlens, table, slots = make_case(fmt, D, gqa, sq, page, LENS, window=W, sink=N, seed=W + N + D)
    ref, ref_lse = paged_decode_reference(q, cache, seqlens, table, seq_slots=slots, return_lse=True,
                                          window_size=ws, softcap=1.5)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=slots, num_splits=splits,
                                       return_lse=True, out=out, window_size=ws, softcap=1.5)
    _check(got, lse, ref, ref_lse)


@pytest.mark.launch_plans
def test_softcap_decode_in_cuda_graph_torch_compile_and_plans():
    from qattn.interface import decode
    from qattn.interface.decode import flash_attn_with_kvcache

    cache, q, seqlens, table = make_case("nvfp4", 128, 8, 4, 16, [2000, 900, 33], seed=3)
    ref = flash_attn_with_kvcache(q, cache, seqlens, table, softcap=30.0)
    for _ in range(3):  # the launch plan records, then replays
        assert torch.equal(flash_attn_with_kvcache(q, cache, seqlens, table, softcap=30.0), ref)
    assert decode._DECODE_PLANS.hits >= 2, decode._DECODE_PLANS.unplanned
    fn = torch.compile(lambda q: flash_attn_with_kvcache(q, cache, seqlens, table, softcap=30.0), fullgraph=True)
    assert torch.equal(fn(q), ref)
    out = torch.empty_like(q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(flash_attn_with_kvcache(q, cache, seqlens, table, softcap=30.0))
    out.fill_(float("nan"))
    g.replay()
    assert torch.equal(out, ref)
    assert not torch.equal(flash_attn_with_kvcache(q, cache, seqlens, table), ref)


def test_smoothed_cache_refuses_softcap():
    """write_kv(k_mean=...) stores K minus a per-channel mean: the cap is not invariant to that shift, so a
    soft-capped decode of that cache raises (and a plain one still runs)."""
    import qattn

    cache = qattn.PagedKVCache(1, 8, 16, 2, 128, "nvfp4", device="cuda")
    k, v = (torch.randn(20, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(20, dtype=torch.int64, device="cuda")
    qattn.write_kv(cache, 0, k, v, slots)
    q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32, device="cuda")
    table = torch.tensor([[0, 1]], dtype=torch.int32, device="cuda")
    qattn.flash_attn_with_kvcache(q, cache, lens, table, softcap=50.0)
    qattn.write_kv(cache, 0, k, v, slots, k_mean=torch.zeros(2, 128, device="cuda"))
    with pytest.raises(ValueError, match="smoothed"):
        qattn.flash_attn_with_kvcache(q, cache, lens, table, softcap=50.0)
    assert torch.isfinite(qattn.flash_attn_with_kvcache(q, cache, lens, table)).all()


if __name__ == "__main__":  # quick timing: decode with / without softcap=50, CUDA graph, GQA 32/8 D128 page 64
    from qattn.interface.decode import flash_attn_with_kvcache

    from ._timing import graph_median_us

    for fmt, (B, ctx) in itertools.product(("nvfp4", "fp8", "bf16"), ((32, 8192), (8, 32768), (128, 2048))):
        cache, q, seqlens, table = make_case(fmt, 128, 4, 1, 64, [ctx] * B, num_kv_heads=8, seed=0)
        times = {name: graph_median_us(lambda cap=cap: flash_attn_with_kvcache(q, cache, seqlens, table, softcap=cap))
                 for name, cap in (("plain", 0.0), ("softcap 50", 50.0))}
        print(f"{fmt} B{B}x{ctx // 1024}K: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items())
              + f"  ratio {times['softcap 50'] / times['plain']:.3f}", flush=True)
