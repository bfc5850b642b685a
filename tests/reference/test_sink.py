"""CPU tests of the attention-sink feature (``PagedKVCache(..., sink_tokens=N)``): the layout, which source each
position is read from (``read_sources``), the reference write / flatten / decode, and that the eval harness's
``^N`` configs model exactly what such a cache does."""

from __future__ import annotations

import pytest
import torch

from qattn.layouts import MAX_SINK_TOKENS, KVLayer, PagedKVCache, SinkGeometry, read_sources
from qattn.reference import attention_reference, flatten_kv_reference, paged_decode_reference, write_kv_reference


def _sources_by_rule(L, W, N):
    """The rule of docs/formats.md, position by position."""
    out = []
    for p in range(L):
        if p < N:
            out.append("sink")
        elif W and p >= max(N, L - W):
            out.append("ring")
        else:
            out.append("page")
    return out


@pytest.mark.parametrize("W", [0, 1, 4, 16, 64])
@pytest.mark.parametrize("N", [0, 1, 4, 64])
def test_read_sources_partition(W, N):
    for L in list(range(0, 80)) + [127, 128, 129, 200]:
        sink, pages, ring = read_sources(L, W, N)
        got = ["sink"] * len(sink) + ["page"] * len(pages) + ["ring"] * len(ring)
        assert list(sink) + list(pages) + list(ring) == list(range(L))  # disjoint, ordered, covering
        assert got == _sources_by_rule(L, W, N)
        assert len(ring) <= W and len(sink) == min(L, N)


def test_sink_layout_and_validation():
    c = PagedKVCache(2, 8, 16, 3, 64, ("int8", "nvfp4"), recent_window=32, sink_tokens=4, max_seqs=5)
    lay = c.layer(1)
    assert lay.k_sink.shape == (5, 3, 4, 64) and lay.v_sink.dtype == torch.bfloat16
    assert c.sink_geometry.offset(2, 1, 3) == ((2 * 3 + 1) * 4 + 3) * 64 * 2
    assert c.sink_geometry.offset(2, 1, 3) == (lay.k_sink[2, 1, 3].data_ptr() - lay.k_sink.data_ptr())
    with pytest.raises(ValueError, match="position"):
        c.sink_geometry.offset(0, 0, 4)
    # nbytes and the capacity planner count the sink buffers
    plain = PagedKVCache(2, 8, 16, 3, 64, ("int8", "nvfp4"), recent_window=32, max_seqs=5)
    assert c.nbytes - plain.nbytes == 2 * 2 * 5 * 3 * 4 * 64 * 2
    kw = dict(page_size=16, num_kv_heads=3, head_dim=64, kv_format="nvfp4", num_layers=2, max_seqs=5)
    budget = 10**6
    assert (PagedKVCache.blocks_for_budget(budget, sink_tokens=4, **kw)
            <= PagedKVCache.blocks_for_budget(budget, **kw))
    assert "sink_tokens=4" in repr(c)
    # a sink-only cache (no window) is valid
    s = PagedKVCache(1, 4, 16, 2, 64, "nvfp4", sink_tokens=1, max_seqs=2)
    assert s.layer(0).k_ring is None and s.layer(0).k_sink.shape == (2, 2, 1, 64)
    with pytest.raises(ValueError, match="max_seqs"):
        PagedKVCache(1, 4, 16, 2, 64, "nvfp4", sink_tokens=1)
    for bad in (-1, MAX_SINK_TOKENS + 1, 1.5, True):
        with pytest.raises(ValueError, match="sink_tokens"):
            PagedKVCache(1, 4, 16, 2, 64, "nvfp4", sink_tokens=bad, max_seqs=2)


def test_sink_from_tensors():
    c = PagedKVCache(1, 4, 16, 2, 64, "nvfp4", recent_window=16, sink_tokens=2, max_seqs=3)
    lay = c.layer(0)
    v = PagedKVCache.from_tensors([lay], 16, 64, "nvfp4")
    assert (v.sink_tokens, v.recent_window, v.max_seqs) == (2, 16, 3)
    assert v.layer(0).k_sink.data_ptr() == lay.k_sink.data_ptr()
    only = PagedKVCache.from_tensors([KVLayer(lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                              lay.k_global_scale, lay.v_global_scale, k_sink=lay.k_sink,
                                              v_sink=lay.v_sink)], 16, 64, "nvfp4")
    assert (only.sink_tokens, only.recent_window, only.max_seqs) == (2, 0, 3)
    with pytest.raises(TypeError, match="v_sink"):  # one side without its sink buffer
        PagedKVCache.from_tensors([KVLayer(lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                           lay.k_global_scale, lay.v_global_scale, k_sink=lay.k_sink)],
                                  16, 64, "nvfp4")
    with pytest.raises(ValueError, match="k_sink"):  # ring and sink disagree on max_seqs
        PagedKVCache.from_tensors([KVLayer(lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                           lay.k_global_scale, lay.v_global_scale, lay.k_ring, lay.v_ring,
                                           lay.k_sink[:2].contiguous(), lay.v_sink[:2].contiguous())],
                                  16, 64, "nvfp4")


def _fill(cache, lens, chunks, gen, slots_of=None):
    """Write sequences of ``lens`` tokens in prefill / decode chunks (a list of chunk sizes, cycled), each
    sequence b in ring / sink slot ``slots_of[b]``; return (k, v) per sequence (bf16 values), the block table."""
    P = cache.page_size
    B = len(lens)
    slots_of = slots_of or [cache.max_seqs - 1 - b for b in range(B)]
    need = [-(-n // P) for n in lens]
    perm = torch.randperm(cache.num_blocks, generator=gen)
    table = torch.zeros(B, max(need) + 1, dtype=torch.int32)
    kv, used = [], 0
    for b, n in enumerate(lens):
        table[b, :need[b]] = perm[used:used + need[b]].to(torch.int32)
        used += need[b]
        k = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=gen)
        k[:, :, 5] += 6.0
        v = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=gen)
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
        start, i = 0, 0
        while start < n:
            c = min(chunks[i % len(chunks)], n - start)
            pos = torch.arange(start, start + c)
            write_kv_reference(cache, 0, kv[b][0][pos], kv[b][1][pos], table[b, pos // P].long() * P + pos % P,
                               seq_slots=torch.full((c,), slots_of[b]), positions=pos)
            start, i = start + c, i + 1
    return kv, table, torch.tensor(slots_of, dtype=torch.int32)


@pytest.mark.parametrize("W,N", [(0, 1), (0, 4), (16, 1), (16, 4), (8, 16)])
@pytest.mark.parametrize("fmt", ["nvfp4", "int8", ("fp8", "mxfp4")])
def test_write_and_flatten_follow_read_sources(fmt, W, N):
    g = torch.Generator().manual_seed(7)
    lens = [0, 1, N - 1 if N > 1 else 2, N, N + 1, N + W, N + W + 1, 70]
    cache = PagedKVCache(1, 64, 16, 2, 64, fmt, recent_window=W, sink_tokens=N, max_seqs=len(lens) + 1)
    kv, table, slots = _fill(cache, lens, [5, 1, 1, 23], g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kd, vd = flatten_kv_reference(cache, 0, table, lens_t, seq_slots=slots)
    kq, vq = flatten_kv_reference(cache, 0, table, lens_t)  # pages alone: every token, quantized
    lay = cache.layer(0)
    for b, L in enumerate(lens):
        src = _sources_by_rule(L, W, N)
        for p in range(L):
            want_k = {"sink": kv[b][0][p].float(), "ring": kv[b][0][p].float(), "page": kq[b, p]}[src[p]]
            want_v = {"sink": kv[b][1][p].float(), "ring": kv[b][1][p].float(), "page": vq[b, p]}[src[p]]
            assert torch.equal(kd[b, p], want_k) and torch.equal(vd[b, p], want_v), (b, L, p, src[p])
        for p in range(min(L, N)):  # the sink buffer holds the first tokens exactly
            assert torch.equal(lay.k_sink[slots[b], :, p], kv[b][0][p])
            assert torch.equal(lay.v_sink[slots[b], :, p], kv[b][1][p])
    # slots of no sequence are untouched (zeros)
    assert not lay.k_sink[0].any()


def test_sink_entries_are_written_once_and_kept():
    """Later tokens never touch the sink; a later write at a page slot does not change the sink either."""
    g = torch.Generator().manual_seed(8)
    cache = PagedKVCache(1, 16, 16, 2, 64, "nvfp4", recent_window=8, sink_tokens=4, max_seqs=2)
    kv, table, slots = _fill(cache, [60], [3, 1, 40, 1, 1], g)
    snap = cache.layer(0).k_sink.clone()
    pos = torch.arange(60, 62)
    write_kv_reference(cache, 0, torch.randn(2, 2, 64), torch.randn(2, 2, 64),
                       table[0, pos // 16].long() * 16 + pos % 16, seq_slots=torch.full((2,), int(slots[0])),
                       positions=pos)
    assert torch.equal(cache.layer(0).k_sink, snap)


def test_decode_reference_reads_the_sink():
    g = torch.Generator().manual_seed(9)
    W, N = 16, 4
    lens = [1, 3, 4, 5, 20, 21, 90]
    cache = PagedKVCache(1, 64, 16, 2, 64, "nvfp4", recent_window=W, sink_tokens=N, max_seqs=8)
    kv, table, slots = _fill(cache, lens, [7, 1], g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 2, 8, 64, generator=g)
    out, lse = paged_decode_reference(q, cache, lens_t, table, seq_slots=slots, return_lse=True)
    kd, vd = flatten_kv_reference(cache, 0, table, lens_t, seq_slots=slots, dtype=torch.float64)
    ref, ref_lse = attention_reference(q, kd, vd, causal=True, kv_lens=lens_t, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    # the sink changes the result (vs the same cache read without sink rows)
    nosink = PagedKVCache.from_tensors([KVLayer(*[getattr(cache.layer(0), f) for f in (
        "k_data", "v_data", "k_scale_pool", "v_scale_pool", "k_global_scale", "v_global_scale", "k_ring",
        "v_ring")])], 16, 64, "nvfp4")
    other = paged_decode_reference(q, nosink, lens_t, table, seq_slots=slots)
    assert not torch.allclose(out[-1], other[-1])
    with pytest.raises(ValueError, match="seq_slots"):
        paged_decode_reference(q, cache, lens_t, table)
    only = PagedKVCache(1, 8, 16, 2, 64, "nvfp4", sink_tokens=2, max_seqs=1)
    with pytest.raises(ValueError, match="seq_slots"):
        paged_decode_reference(q[:1], only, lens_t[:1], table[:1, :1])


def test_sink_write_errors():
    c = PagedKVCache(1, 4, 16, 2, 64, "nvfp4", sink_tokens=2, max_seqs=2)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="seq_slots.*sink_tokens=2"):
        write_kv_reference(c, 0, k, k, torch.arange(3))
    with pytest.raises(ValueError, match="seq_slots"):
        write_kv_reference(c, 0, k, k, torch.arange(3), seq_slots=torch.tensor([0, 2, 0]), positions=torch.arange(3))
    with pytest.raises(ValueError, match="twice"):
        write_kv_reference(c, 0, k, k, torch.arange(3), seq_slots=torch.zeros(3, dtype=torch.long),
                           positions=torch.tensor([0, 1, 0]))
    # padding tokens (-1 slots) write nothing, not even the sink
    write_kv_reference(c, 0, k, k, torch.tensor([-1, 1, 2]), seq_slots=torch.zeros(3, dtype=torch.long),
                       positions=torch.arange(3))
    assert not c.layer(0).k_sink[0, :, 0].any() and c.layer(0).k_sink[0, :, 1].any()


# ------------------------------------------------------------------------------------------------
# the eval harness models the cache
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("W,N", [(0, 1), (8, 1), (8, 4), (4, 8)])
def test_harness_masks_are_read_sources(W, N):
    from qattn.eval.attention import window_masks

    S = 40
    quant, full = window_masks(S, W, sink=N)
    for i in range(S):  # query i reads a cache of len i + 1
        sink, pages, ring = read_sources(i + 1, W, N)
        assert full[i].nonzero().flatten().tolist() == list(sink) + list(ring)
        assert quant[i].nonzero().flatten().tolist() == list(pages)


@pytest.mark.parametrize("spec", ["nvfp4@8^1", "nvfp4@8^4", "int8/nvfp4@4^2", "mxfp4^1"])
def test_harness_equals_token_by_token_decode(spec):
    """``quantized_attention`` of a ``^N`` config == decoding token by token from a sink cache holding the same
    rows (bf16-valued inputs, so the cache's bf16 ring / sink rows equal the harness's fp32 rows)."""
    from qattn.eval.attention import KVQuantConfig, LayerQuant, quantized_attention

    cfg = KVQuantConfig.parse(spec)
    g = torch.Generator().manual_seed(11)
    S, Hkv, Hq, D = 48, 2, 4, 64
    q = torch.randn(Hq, S, D, generator=g).to(torch.bfloat16).float()
    k = (torch.randn(Hkv, S, D, generator=g) * 2).to(torch.bfloat16).float()
    k[:, 0] *= 8  # a sink-like outlier token
    v = torch.randn(Hkv, S, D, generator=g).to(torch.bfloat16).float()
    gk = torch.rand(Hkv, generator=g) * 0.01 + 0.001
    gv = torch.rand(Hkv, generator=g) * 0.01 + 0.001
    lq = LayerQuant(cfg, k_global=gk, v_global=gv)
    scale = D ** -0.5
    got = quantized_attention(q, k, v, lq, scale)

    cache = PagedKVCache(1, 8, 16, Hkv, D, (cfg.k_format, cfg.v_format), recent_window=cfg.window,
                         sink_tokens=cfg.sink, max_seqs=1)
    lay = cache.layer(0)
    for gs, val in ((lay.k_global_scale, gk), (lay.v_global_scale, gv)):
        if gs is not None:
            gs.copy_(val)
    table = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    for i in range(S):  # write token i, then decode it (the ring moves on with every token)
        write_kv_reference(cache, 0, kt[i:i + 1], vt[i:i + 1], table[0, i // 16].long()[None] * 16 + i % 16,
                           seq_slots=torch.zeros(1, dtype=torch.long), positions=torch.tensor([i]))
        o = paged_decode_reference(q[:, i][None, None], cache, torch.tensor([i + 1], dtype=torch.int32), table,
                                   seq_slots=torch.zeros(1, dtype=torch.int32), softmax_scale=scale)
        torch.testing.assert_close(got[:, i].double(), o[0, 0], rtol=2e-5, atol=2e-5)


def test_harness_spec_with_sink_and_unquantized_dtype():
    from qattn.eval.attention import KVQuantConfig, quantized_attention, LayerQuant
    from qattn.eval.runner import grid_configs

    c = KVQuantConfig.parse("nvfp4+r@64^1~bf16")
    assert (c.window, c.sink, c.rotate, c.unquantized_dtype) == (64, 1, True, "bf16")
    assert c.name == "nvfp4+r@64^1~bf16" and KVQuantConfig.parse(c.name) == c
    assert KVQuantConfig.parse("int8/nvfp4^2").name == "int8/nvfp4^2"
    with pytest.raises(ValueError):
        KVQuantConfig.parse("nvfp4~f16")
    assert "nvfp4+r@64^1" in [g.name for g in grid_configs("sink")]
    # ~bf16 rounds exactly the unquantized rows
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 20, 64, generator=g) for _ in range(3))
    lq = LayerQuant(KVQuantConfig.parse("int8@4^1~bf16"))
    ref = LayerQuant(KVQuantConfig.parse("int8@4^1"))
    got = quantized_attention(q, k, v, lq, 0.125)
    kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    assert not torch.equal(got, quantized_attention(q, k, v, ref, 0.125))
    from qattn.eval.attention import _fq, windowed_attention
    want = windowed_attention(q, _fq(k, lq.config.k_format, None), _fq(v, lq.config.v_format, None), kb, vb, 4,
                              0.125, sink=1)
    assert torch.equal(got, want)


def test_sink_geometry_is_exported():
    assert SinkGeometry(2, 3, 4, 64, torch.float16).shape == (2, 3, 4, 64)
