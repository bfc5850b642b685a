"""GPU tests of the SM90 paged decode kernel (``qattn.interface.decode.flash_attn_with_kvcache``).

Oracle: ``paged_decode_reference`` (fp64) over the *same* quantized cache, so the error measured is the kernel's
alone (rel. error <= 1e-2 for bf16 output). Pools and rings are poisoned (NaN bf16, 0x7F bytes = E4M3 NaN, NaN
fp32 scales) before the tokens are written, so slots past a sequence's end (and ring entries it never wrote) hold
garbage the kernel must mask; the output is poisoned with NaN before the call; block tables are random permutations
padded with -1; ring slots are a permutation of batch rows (seq_slots != arange).

The matrix: every format (and two K/V pairs) x head_dim 64/128 runs CONFIGS, which cover GQA 1/4/8/16, seqlen_q
1/4/16 (up to 256 query rows: two m-blocks), page sizes 16/64/128, split-KV on (fixed and automatic) and off and
recent window 0/64, on lengths with partial last pages and lengths below / around the window. Attention-sink
caches (``sink_tokens`` 1 / 4 / 64, with and without a window) run every format with lengths below / at / above N
and N + W, and their page rows of the sink positions are poisoned after the write.

Run as a script for a quick timing: ``python tests/gpu/test_decode_gpu.py --bench``.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ["bf16", "nvfp4", "mxfp4", "mxfp4_b16", "fp8", "int8", ("int8", "nvfp4"), ("nvfp4", "bf16")]
# (gqa, seqlen_q, page_size, num_splits, recent_window): each (format, head_dim) runs all of them
CONFIGS = [
    (1, 1, 16, 1, 0),
    (4, 4, 64, 3, 64),
    (8, 1, 128, 1, 64),
    (16, 16, 16, 3, 0),  # 256 rows: two m-blocks, split
    (16, 4, 64, 1, 64),
    (8, 16, 128, 3, 64),  # 128 rows, split, ring
    (16, 16, 64, 1, 64),  # 256 rows with the ring
    (4, 1, 16, 0, 64),  # automatic split count with the ring
    (8, 4, 16, 3, 0),
]


def _poison(cache, layer=0):
    lay = cache.layer(layer)
    for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_ring, lay.v_ring, lay.k_sink,
              lay.v_sink):
        if t is None:
            continue
        if t.dtype in (torch.bfloat16, torch.float32, torch.float16):
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0x7F)
        else:
            t.fill_(127)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_case(fmt, head_dim, gqa, seqlen_q, page, lens, num_kv_heads=2, q_dtype=torch.bfloat16, seed=0, dev=None,
              window=0, cache_dtype=torch.bfloat16, sink=0):
    """A filled cache, q, lengths, block table and (window > 0 or sink > 0) seq_slots: batch row b uses ring /
    sink slot ``max_seqs - 1 - b`` of ``max_seqs = B + 2`` slots, so row and slot differ."""
    from qattn import PagedKVCache, write_kv_reference

    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = dev or _device()
    B = len(lens)
    need = [math.ceil(n / page) for n in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + 3
    max_seqs = B + 2
    seq_slots = torch.tensor([max_seqs - 1 - b for b in range(B)], dtype=torch.int32)
    cache = PagedKVCache(1, num_blocks, page, num_kv_heads, head_dim, fmt, device=dev, dtype=cache_dtype,
                         recent_window=window, sink_tokens=sink, max_seqs=max_seqs if (window or sink) else 0)
    _poison(cache)
    lay = cache.layer(0)
    for gs in (lay.k_global_scale, lay.v_global_scale):
        if gs is not None:  # nvfp4: a real per-head global scale, so the folding is exercised
            gs.copy_((torch.rand(num_kv_heads, generator=g) * 0.004 + 0.002).to(dev))
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    slots, ks, vs, tok_seqs, tok_pos = [], [], [], [], []
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = ids.to(torch.int32)
        pos = torch.arange(n)
        slots.append(ids[pos // page] * page + pos % page)
        tok_seqs.append(torch.full((n,), int(seq_slots[b])))
        tok_pos.append(pos)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        k[:, :, 3] += 4.0  # an outlier channel, as real keys have
        ks.append(k)
        vs.append(torch.randn(n, num_kv_heads, head_dim, generator=g))
    ring_kw = {}
    if window or sink:  # every token goes to its page, to ring[slot, :, pos % W] (the newest position stays)
        # and, below position `sink`, to sink[slot, :, pos]
        ring_kw = dict(seq_slots=torch.cat(tok_seqs).to(dev), positions=torch.cat(tok_pos).to(dev))
    write_kv_reference(cache, 0, torch.cat(ks).to(dev), torch.cat(vs).to(dev),
                       torch.cat(slots).to(dev), **ring_kw)
    q = torch.randn(B, seqlen_q, num_kv_heads * gqa, head_dim, generator=g).to(dev, q_dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    if window or sink:
        return cache, q, lens_t, table.to(dev), seq_slots.to(dev)
    return cache, q, lens_t, table.to(dev)


def _check(out, lse, ref_out, ref_lse, tol=1e-2):
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or unmasked)"
    o, r = out.double(), ref_out
    err = (o - r).norm() / r.norm().clamp_min(1e-30)
    assert err <= tol, f"relative error {err:.3e} > {tol}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs"
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() <= 2e-2
    return float(err)


def poison_page_rows(cache, table, ends):
    """NaN / 0x7F the page rows (payload and scales) of positions [0, ends[b]) of each sequence b, after the write."""
    lay, P = cache.layer(0), cache.page_size
    for b, n in enumerate(ends):
        for p in range(n):
            blk = int(table[b, p // P])
            for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool):
                if t is None:
                    continue
                if t.dtype in (torch.bfloat16, torch.float32, torch.float16):
                    t[blk, :, p % P] = float("nan")
                else:
                    t[blk, :, p % P] = 0x7F if t.dtype == torch.uint8 else 127


def _poison_sink_pages(cache, table, lens):
    """The *page* rows of positions < sink_tokens: decode reads those positions from the sink buffer only, so the
    page tiles must mask them (scores and V values)."""
    poison_page_rows(cache, table, [min(n, cache.sink_tokens) for n in lens])


def _run(fmt, D, gqa, sq, page, splits, causal=True, q_dtype=torch.bfloat16, lens=None, window=0,
         cache_dtype=torch.bfloat16, sink=0):
    from qattn.interface.decode import flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    lens = lens or ([3 * page + 5, 2, 129, 64] if window else [3 * page + 5, 2, 129])
    case = make_case(fmt, D, gqa, sq, page, lens, q_dtype=q_dtype, window=window, cache_dtype=cache_dtype,
                     sink=sink)
    cache, q, seqlens, table = case[:4]
    seq_slots = case[4] if (window or sink) else None
    if sink:
        _poison_sink_pages(cache, table.cpu(), lens)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=seq_slots, causal=causal,
                                       num_splits=splits, return_lse=True, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref_out, ref_lse = paged_decode_reference(q, cache, seqlens, table, causal=causal, seq_slots=seq_slots,
                                              return_lse=True)
    return _check(got, lse, ref_out, ref_lse)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"gqa{c[0]}-sq{c[1]}-p{c[2]}-s{c[3]}-w{c[4]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f if isinstance(f, str) else f"{f[0]}+{f[1]}")
def test_decode_matches_reference(fmt, D, cfg):
    gqa, sq, page, splits, window = cfg
    _run(fmt, D, gqa, sq, page, splits, window=window)


# (format, window, cache dtype, q dtype): W below / above the ring tile, W not a power of two, f16 rings, and
# every pairing of page-tile MMA type (f16 for quantized, bf16 for bf16 pages) with ring MMA type and q dtype
RING_EDGES = [
    ("nvfp4", 16, torch.bfloat16, torch.bfloat16),
    ("nvfp4", 100, torch.float16, torch.bfloat16),
    ("bf16", 64, torch.float16, torch.float16),
    (("int8", "nvfp4"), 64, torch.bfloat16, torch.float16),
    ("fp8", 128, torch.bfloat16, torch.bfloat16),
    ("mxfp4", 200, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("case", RING_EDGES, ids=lambda c: f"{c[0] if isinstance(c[0], str) else '+'.join(c[0])}"
                         f"-w{c[1]}-{str(c[2])[6:]}-q{str(c[3])[6:]}")
@pytest.mark.parametrize("splits", [1, 4, 0])
def test_decode_ring_edges(case, splits):
    """Lengths below, at and just past the window (all-ring sequences, one page token), more splits than tiles,
    causal and not."""
    fmt, window, cache_dtype, q_dtype = case
    lens = [1, window - 1, window, window + 1, 2 * window + 3, 300]
    _run(fmt, 128, 4, 1, 16, splits, q_dtype=q_dtype, lens=lens, window=window, cache_dtype=cache_dtype)
    _run(fmt, 64, 8, 3, 64, splits, causal=False, q_dtype=q_dtype, lens=lens, window=window,
         cache_dtype=cache_dtype)


def test_decode_ring_with_eight_warps(monkeypatch):
    """QATTN_DECODE_WARPS=8 (tuning): 8 token groups, so 128-token ring tiles."""
    from qattn.cute_kernels.sm90.decode_config import tuning_from_env

    monkeypatch.setenv("QATTN_DECODE_WARPS", "8")
    tuning_from_env.cache_clear()
    try:
        _run("nvfp4", 128, 4, 1, 16, 1, window=64)
        _run("nvfp4", 128, 4, 1, 64, 3, window=128, lens=[1, 127, 128, 129, 500])
    finally:
        monkeypatch.delenv("QATTN_DECODE_WARPS")
        tuning_from_env.cache_clear()


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("splits", [33, 64])
def test_decode_many_splits(fmt, splits):
    """More than 32 splits: the combine's max over splits takes two rounds of lanes and its weighted sum an
    unrolled loop with a remainder; splits past the last tile are empty. Narrow (GQA 4) and wide (GQA 16) tiles,
    long and ragged sequences."""
    lens = [64 * 128 + 37, 5000, 1]
    _run(fmt, 128, 4, 1, 128, splits, lens=lens)
    _run(fmt, 64, 16, 1, 64, splits, lens=lens)


def test_decode_wide_layout_knob(monkeypatch):
    """QATTN_DECODE_WIDE=1 (A/B knob): rows <= 8 run the untransposed layout again, and match the reference."""
    from qattn.cute_kernels.sm90.decode_config import tuning_from_env
    from qattn.interface.decode import decode_config_for

    monkeypatch.setenv("QATTN_DECODE_WIDE", "1")
    tuning_from_env.cache_clear()
    try:
        case = make_case("nvfp4", 128, 4, 1, 64, [10])
        assert not decode_config_for(case[0], "bf16", 4, 1, True, False).narrow
        _run("nvfp4", 128, 4, 1, 64, 3)
        _run("int8", 64, 8, 1, 16, 1)
    finally:
        monkeypatch.delenv("QATTN_DECODE_WIDE")
        tuning_from_env.cache_clear()


# (format, window, cache dtype, q dtype): every format, with and without a ring, both cache dtypes
SINK_FORMATS = [
    ("nvfp4", 64, torch.bfloat16, torch.bfloat16),
    ("nvfp4", 0, torch.bfloat16, torch.bfloat16),
    ("mxfp4", 64, torch.bfloat16, torch.bfloat16),
    ("fp8", 0, torch.float16, torch.bfloat16),
    ("int8", 64, torch.bfloat16, torch.float16),
    ("bf16", 64, torch.bfloat16, torch.bfloat16),
    (("int8", "nvfp4"), 64, torch.float16, torch.float16),
    ("mxfp4_b16", 0, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("sink", [1, 4])
@pytest.mark.parametrize("case", SINK_FORMATS, ids=lambda c: f"{c[0] if isinstance(c[0], str) else '+'.join(c[0])}"
                         f"-w{c[1]}-{str(c[2])[6:]}-q{str(c[3])[6:]}")
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_decode_sink_matches_reference(case, sink, splits):
    """Attention-sink caches: lengths below / at / above N and N + W (and long ones), split on (fixed, automatic)
    and off, causal and not, GQA 4 and 8 with seqlen_q 1 and 3; the page rows of the sink positions are poisoned
    after the write (decode must read those positions from the sink buffer alone)."""
    fmt, window, cache_dtype, q_dtype = case
    lens = sorted(n for n in {sink - 1, sink, sink + 1, sink + window - 1, sink + window, sink + window + 1,
                              sink + 2 * window + 3, 300} if n >= 1)
    _run(fmt, 128, 4, 1, 16, splits, q_dtype=q_dtype, lens=lens, window=window, cache_dtype=cache_dtype, sink=sink)
    _run(fmt, 64, 8, 3, 64, splits, causal=False, q_dtype=q_dtype, lens=lens, window=window,
         cache_dtype=cache_dtype, sink=sink)


def test_decode_sink_whole_tile_and_eight_warps(monkeypatch):
    """N = 64 (the whole sink tile; page tiles start at 64: the second 64-token tile or mid 128-token tile), two
    m-blocks, and 8 warps (128-token sink / ring tiles)."""
    from qattn.cute_kernels.sm90.decode_config import tuning_from_env

    _run("nvfp4", 128, 16, 16, 16, 3, lens=[1, 63, 64, 65, 128, 129, 400], window=64, sink=64)
    _run(("nvfp4", "bf16"), 64, 4, 1, 64, 1, lens=[5, 64, 65, 200], sink=64)
    monkeypatch.setenv("QATTN_DECODE_WARPS", "8")
    tuning_from_env.cache_clear()
    try:
        _run("nvfp4", 128, 4, 1, 16, 3, window=128, sink=4, lens=[1, 4, 5, 131, 132, 133, 500])
    finally:
        monkeypatch.delenv("QATTN_DECODE_WARPS")
        tuning_from_env.cache_clear()


def test_decode_two_m_blocks_partial():
    """144 and 208 rows: the second m-block is partly padding."""
    _run("nvfp4", 128, 16, 9, 16, 1)
    _run("int8", 64, 16, 13, 64, 3, window=64)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_decode_fp16_noncausal_bigpages(fmt):
    _run(fmt, 128, 4, 2, 128, 1, causal=False, q_dtype=torch.float16, lens=[300, 1000])
    _run(fmt, 128, 8, 1, 256, 0, causal=True, lens=[700, 5, 257])  # automatic splits


def lengths_past_the_table_case(fmt, splits: int, page: int = 16):
    """cache_seqlens past what each block-table row covers (not checked on the host: that would sync). The
    kernel keeps table columns inside the row, so positions past it read the row's last block: the reference
    over a table whose extra columns repeat the last one. The narrow table is its own allocation, so a read past
    its end is out of bounds (the memcheck run). Returns (got, lse, ref_out, ref_lse)."""
    from qattn.interface.decode import flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    cache, q, _, table = make_case(fmt, 128, 4, 1, page, [5 * page, 3 * page + 4])
    narrow = table[:, :3].clone()  # 3 * page positions per row; the lengths below need 5 and 4 pages
    lens = torch.tensor([5 * page, 3 * page + 4], dtype=torch.int32, device=q.device)
    wide = torch.cat([narrow, narrow[:, 2:3].expand(-1, 2)], dim=1).contiguous()
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, lens, narrow, num_splits=splits, return_lse=True, out=out)
    ref_out, ref_lse = paged_decode_reference(q, cache, lens, wide, causal=True, return_lse=True)
    return got, lse, ref_out, ref_lse


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_decode_lengths_past_the_table(fmt, splits):
    _check(*lengths_past_the_table_case(fmt, splits))


def test_decode_rejects_bad_args():
    from qattn.interface.decode import flash_attn_with_kvcache

    cache, q, seqlens, table = make_case("nvfp4", 64, 4, 1, 16, [20, 3])
    with pytest.raises(TypeError, match=r"^q: expected dtype torch\.bfloat16 or torch\.float16, got torch\.float32$"):
        flash_attn_with_kvcache(q.float(), cache, seqlens, table)
    with pytest.raises(TypeError, match="block_table"):
        flash_attn_with_kvcache(q, cache, seqlens, table.long())
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, cache, seqlens[:1], table)
    with pytest.raises(ValueError, match="query heads"):
        flash_attn_with_kvcache(q[:, :, :3], cache, seqlens, table)
    with pytest.raises(ValueError, match="seqlen_q"):
        flash_attn_with_kvcache(q.expand(2, 17, -1, -1).contiguous(), cache, seqlens, table)
    # 16 x 32 = 512 query rows per kv head: the rows check of _flash_attn_with_kvcache_eager
    with pytest.raises(ValueError, match=r"^q: seqlen_q \* \(num_heads / num_kv_heads\) = 16 \* 32 exceeds 256 "
                                         r"query rows per kv head"):
        flash_attn_with_kvcache(q.repeat(1, 16, 8, 1), cache, seqlens, table)
    with pytest.raises(ValueError, match="seq_slots"):  # no ring in this cache
        flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=seqlens)

    rcache, rq, rlens, rtable, slots = make_case("nvfp4", 64, 4, 1, 16, [20, 3], window=16)
    with pytest.raises(ValueError, match="seq_slots"):  # ring cache without seq_slots
        flash_attn_with_kvcache(rq, rcache, rlens, rtable)
    with pytest.raises(TypeError, match="seq_slots"):
        flash_attn_with_kvcache(rq, rcache, rlens, rtable, seq_slots=slots.long())
    with pytest.raises(ValueError, match="seq_slots"):
        flash_attn_with_kvcache(rq, rcache, rlens, rtable, seq_slots=slots[:1])
    with pytest.raises(ValueError, match="seq_slots"):
        flash_attn_with_kvcache(rq, rcache, rlens, rtable, seq_slots=slots.cpu())

    scache, sq_, slens, stable, sslots = make_case("nvfp4", 64, 4, 1, 16, [20, 3], sink=1)
    with pytest.raises(ValueError, match="seq_slots: the cache keeps the first 1 tokens"):  # sink cache, no slots
        flash_attn_with_kvcache(sq_, scache, slens, stable)


# --------------------------------------------------------------------------------------------------
# quick timing (not a test): B32 x 8K, GQA 32/8, D128
# --------------------------------------------------------------------------------------------------
def _bench(fmt, B=32, ctx=8192, Hq=32, H=8, D=128, page=64, iters=30, num_splits=0):
    from qattn import PagedKVCache
    from qattn.interface.decode import flash_attn_with_kvcache

    dev = _device()
    nblk = B * ctx // page
    cache = PagedKVCache(1, nblk, page, H, D, fmt, device=dev)
    lay = cache.layer(0)
    for t in (lay.k_data, lay.v_data):
        if t.dtype == torch.bfloat16:
            t.normal_()
        else:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=dev))
    for t in (lay.k_scale_pool, lay.v_scale_pool):
        if t is not None:  # E4M3 bytes of moderate scales (0x30..0x3F)
            t.copy_(torch.randint(0x30, 0x40, t.shape, dtype=torch.uint8, device=dev))
    table = torch.randperm(nblk, device=dev, dtype=torch.int64).to(torch.int32).view(B, ctx // page)
    seqlens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for _ in range(3):
        flash_attn_with_kvcache(q, cache, seqlens, table, out=out, num_splits=num_splits)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):  # back-to-back launches between two events: kernel time, not Python overhead
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            flash_attn_with_kvcache(q, cache, seqlens, table, out=out, num_splits=num_splits)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 10)
    us = sorted(ts)[len(ts) // 2]
    graph_us = float("nan")
    try:  # the same through a CUDA graph of 10 launches (no host overhead at all)
        from ._timing import graph_median_us

        graph_us = graph_median_us(lambda: flash_attn_with_kvcache(q, cache, seqlens, table, out=out,
                                                                   num_splits=num_splits), reps=iters, launches=10)
    except Exception as e:  # report, do not hide
        print(f"  cuda graph timing failed: {type(e).__name__}: {e}")
    nbytes = B * ctx * H * (cache.k_format.bytes_per_token_head(D) + cache.v_format.bytes_per_token_head(D))
    print(f"{fmt:6s} B{B} ctx{ctx} H{Hq}/{H} D{D} page{page} splits{num_splits}: median {us:8.1f} us eager, {graph_us:8.1f} us graph; "
          f"{nbytes / min(us, graph_us if graph_us == graph_us else us) / 1e3:7.1f} GB/s "
          f"({nbytes / 1e6:.0f} MB read)", flush=True)


if __name__ == "__main__" and "--bench" in sys.argv:
    # python -m tests.gpu.test_decode_gpu --bench [fmt ...]   (QATTN_DECODE_TILE_N=128 to try bigger tiles)
    import os

    print(torch.cuda.get_device_name(), "tile_n", os.environ.get("QATTN_DECODE_TILE_N", "default"))
    fmts = [a for a in sys.argv[1:] if not a.startswith("--")] or ["nvfp4", "bf16"]
    splits = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--splits=")] or [0]
    pages = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--page=")] or [64, 128]
    for f in fmts:
        for page in pages:
            for ns in splits:
                _bench(f, page=page, num_splits=ns)
