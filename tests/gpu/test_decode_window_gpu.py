"""GPU tests of sliding-window paged decode: ``flash_attn_with_kvcache(..., window_size=(left, right))``, query i
of a sequence of ``len`` cached keys sees keys i + len - seqlen_q - left <= j <= i + len - seqlen_q + right.

Oracle: ``paged_decode_reference`` (fp64) with the same window over the same quantized cache (and its ring / sink
rows, for caches that keep them). Besides the usual
poisoning (pools NaN / 0x7F before the write, NaN output), the page rows of every position left of the tile
that holds a sequence's first visible key are poisoned after the write: the kernel must not read them at all.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from .test_decode_gpu import _check, make_case, poison_page_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ["nvfp4", "fp8", "int8", "bf16", ("int8", "nvfp4"), "mxfp4"]
# (gqa, seqlen_q, page, num_splits): narrow (<= 8 rows) and wide layouts, two m-blocks, split-KV fixed / automatic
CONFIGS = [(4, 1, 16, 1), (8, 4, 64, 3), (16, 16, 128, 0), (1, 1, 32, 5)]
# (left, right, causal): the diagonal key only, a window inside a page, windows crossing tiles, non-causal with
# and without a right edge, a right edge only
WINDOWS = [(0, 0, True), (100, 0, True), (1000, -1, False), (5, 3, False), (-1, 2, False), (300, 0, True)]
LENS = [3000, 2, 129, 700]
CASES = [(f, d, c, w) for (f, d), c, w in zip(itertools.cycle(itertools.product(FORMATS, (64, 128))),
                                             CONFIGS * 6, [w for w in WINDOWS for _ in range(4)])]


def _poison_left_of_windows(cache, table, lens, seqlen_q, left, tile_n):
    """The page rows of positions below the tile holding each sequence's first visible key."""
    poison_page_rows(cache, table, [max(n - seqlen_q - left, 0) // tile_n * tile_n if left >= 0 else 0 for n in lens])


@pytest.mark.parametrize("case", CASES, ids=lambda c: (f"{c[0] if isinstance(c[0], str) else '+'.join(c[0])}-D{c[1]}"
                                                       f"-gqa{c[2][0]}-sq{c[2][1]}-p{c[2][2]}-s{c[2][3]}"
                                                       f"-w{c[3][0]}_{c[3][1]}{'c' if c[3][2] else ''}"))
def test_window_decode_matches_reference(case):
    from qattn.interface.decode import _tile_n, flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    fmt, D, (gqa, sq, page, splits), (left, right, causal) = case
    cache, q, seqlens, table = make_case(fmt, D, gqa, sq, page, LENS, seed=D + gqa + left)
    ref, ref_lse = paged_decode_reference(q, cache, seqlens, table, causal=causal, return_lse=True,
                                          window_size=(left, right))  # before the poison: it reads every row
    _poison_left_of_windows(cache, table.cpu(), LENS, sq, left, _tile_n(cache))
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, causal=causal, num_splits=splits, return_lse=True,
                                       out=out, window_size=(left, right))
    _check(got, lse, ref, ref_lse)


def test_window_covering_the_cache_is_the_plain_kernel():
    """A window no row reaches the end of (left >= the block table's capacity - 1) runs the plain kernel: same
    bits; a left edge inside it does not."""
    from qattn.interface.decode import flash_attn_with_kvcache

    cache, q, seqlens, table = make_case("nvfp4", 128, 8, 1, 64, [700, 300], seed=1)
    cap = table.shape[1] * 64
    a = flash_attn_with_kvcache(q, cache, seqlens, table)
    assert torch.equal(flash_attn_with_kvcache(q, cache, seqlens, table, window_size=(cap - 1, 0)), a)
    assert not torch.equal(flash_attn_with_kvcache(q, cache, seqlens, table, window_size=(500, 0)), a)


# (format, head_dim, (gqa, seqlen_q, page, num_splits), recent window W, sink tokens N): narrow and wide layouts,
# ring only, sink only, both; split-KV fixed and automatic
RING_SINK = [("nvfp4", 128, (4, 1, 16, 1), 64, 0), ("fp8", 64, (8, 4, 64, 3), 0, 4),
             ("nvfp4", 128, (16, 16, 128, 0), 128, 8), ("int8", 128, (1, 1, 32, 5), 64, 4)]
WINDOWS_RS = [(0, 0, True), (40, 0, True), (100, 0, True), (30, -1, False), (5, 3, False), (700, 0, True)]


@pytest.mark.parametrize("case", [(c, w) for c in RING_SINK for w in WINDOWS_RS],
                         ids=lambda c: f"{c[0][0]}-D{c[0][1]}-gqa{c[0][2][0]}-sq{c[0][2][1]}-W{c[0][3]}-N{c[0][4]}"
                                       f"-w{c[1][0]}_{c[1][1]}{'c' if c[1][2] else ''}")
def test_window_decode_over_ring_and_sink_caches(case):
    """A window over a cache whose newest tokens come from a bf16 ring and / or whose first ones from a sink
    buffer: each part of the tile list drops what lies left of the first query's window, every tile kind masks
    the rows' lower edges. Against the reference over the same sources, with the page rows left of the windows
    poisoned (never read)."""
    from qattn.interface.decode import _tile_n, flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    (fmt, D, (gqa, sq, page, splits), W, N), (left, right, causal) = case
    cache, q, seqlens, table, slots = make_case(fmt, D, gqa, sq, page, LENS, window=W, sink=N,
                                                seed=D + gqa + left + W + N)
    ref, ref_lse = paged_decode_reference(q, cache, seqlens, table, causal=causal, seq_slots=slots, return_lse=True,
                                          window_size=(left, right))
    _poison_left_of_windows(cache, table.cpu(), LENS, sq, left, _tile_n(cache))
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=slots, causal=causal, num_splits=splits,
                                       return_lse=True, out=out, window_size=(left, right))
    _check(got, lse, ref, ref_lse)


def test_window_decode_in_cuda_graph_and_torch_compile():
    from qattn.interface.decode import flash_attn_with_kvcache

    cache, q, seqlens, table = make_case("nvfp4", 128, 8, 4, 16, [2000, 900, 33], seed=3)
    ref = flash_attn_with_kvcache(q, cache, seqlens, table, window_size=(256, 0))
    fn = torch.compile(lambda q: flash_attn_with_kvcache(q, cache, seqlens, table, window_size=(256, 0)),
                       fullgraph=True)
    assert torch.equal(fn(q), ref)
    out = torch.empty_like(q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(flash_attn_with_kvcache(q, cache, seqlens, table, window_size=(256, 0)))
    out.fill_(float("nan"))
    g.replay()
    assert torch.equal(out, ref)


if __name__ == "__main__":  # quick timing: windowed vs full decode, CUDA graph, GQA 32/8 D128 page 64
    from qattn.interface.decode import flash_attn_with_kvcache

    from ._timing import graph_median_us

    for fmt, (B, ctx), w in itertools.product(("nvfp4", "bf16"), ((32, 8192), (8, 32768)), (1024, 4096)):
        cache, q, seqlens, table = make_case(fmt, 128, 4, 1, 64, [ctx] * B, num_kv_heads=8, seed=0)
        times = {name: graph_median_us(lambda ws=ws: flash_attn_with_kvcache(q, cache, seqlens, table, window_size=ws))
                 for name, ws in (("full", (-1, -1)), (f"window {w}", (w, 0)))}
        print(f"{fmt} B{B}x{ctx // 1024}K: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items()), flush=True)
    # caches with a bf16 ring of the newest 128 tokens and 4 sink tokens: windows over all three parts
    for (B, ctx), w in itertools.product(((32, 8192), (8, 32768)), (64, 1024, 4096)):
        cache, q, seqlens, table, slots = make_case("nvfp4", 128, 4, 1, 64, [ctx] * B, num_kv_heads=8, seed=0,
                                                    window=128, sink=4)
        times = {name: graph_median_us(lambda ws=ws: flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=slots,
                                                                             window_size=ws))
                 for name, ws in (("full", (-1, -1)), (f"window {w}", (w, 0)))}
        print(f"nvfp4 ring 128 + sink 4 B{B}x{ctx // 1024}K: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items()),
              flush=True)
