"""GPU tests: ``qattn.write_kv`` (the fused insert kernel) and ``qattn.flatten_kv`` against the references.

Every pool (payload, scales, ring, sink) is poisoned with random bytes first; the same poisoned cache is copied to
the CPU and updated there by ``write_kv_reference``; then *every byte* of every pool must be equal, so bytes
the kernel must not touch (-1 slots, other slots, other ring entries) are checked too.

Run as a script for a small memcheck case:
``compute-sanitizer --tool memcheck --report-api-errors no python tests/gpu/test_kv_insert_gpu.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import qattn
from qattn.layouts.formats import kv_format
from qattn.layouts.paged import KVLayer, PagedKVCache
from qattn.reference.kv_ops import flatten_kv_reference, write_kv_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMATS = [("bf16", None), ("fp8", None), ("int8", None), ("nvfp4", None), ("mxfp4", "floor"), ("mxfp4", "rceil"),
           ("mxfp4_b16", "floor"), ("mxfp4_b16", "rceil")]


def _fmt(name, rule=None):
    return kv_format(name, scale_rule=rule) if rule else kv_format(name)


def _tensors(cache):
    out = []
    for lay in cache._layers:
        for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_ring, lay.v_ring, lay.k_sink,
                  lay.v_sink):
            if t is not None:
                out.append(t)
    return out


def _make_cache(kf, vf, head_dim, page, num_blocks, H, gen, *, window=0, max_seqs=0, dtype=torch.bfloat16,
                rotate=False, sink=0):
    cache = PagedKVCache(1, num_blocks, page, H, head_dim, (kf, vf), device="cuda:0", dtype=dtype,
                         recent_window=window, max_seqs=max_seqs, rotate=rotate, rotation_seed=5, sink_tokens=sink)
    for t in _tensors(cache):  # poison
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).cuda())
    lay = cache.layer(0)
    for gs in (lay.k_global_scale, lay.v_global_scale):
        if gs is not None:  # realistic calibrated scales, one per head
            gs.copy_((torch.rand(H, generator=gen) * 0.02 + 0.001).cuda())
    return cache


def _cpu_twin(cache):
    lay = cache.layer(0)

    def c(t):
        return None if t is None else t.cpu().clone()

    layer = KVLayer(c(lay.k_data), c(lay.v_data), c(lay.k_scale_pool), c(lay.v_scale_pool), c(lay.k_global_scale),
                    c(lay.v_global_scale), c(lay.k_ring), c(lay.v_ring), c(lay.k_sink), c(lay.v_sink))
    return PagedKVCache.from_tensors([layer], cache.page_size, cache.head_dim, (cache.k_format, cache.v_format),
                                     cache.dtype, rotate=cache.rotate, rotation_seed=cache.rotation_seed or 0)


def _inputs(n, H, D, gen, dtype=torch.bfloat16):
    x = torch.randn(2, n, H, D, generator=gen) * 4
    x[:, :, :, 3] *= 30  # an outlier channel
    if n > 4:
        x[:, 1] = 0.0  # an all-zero row
        x[:, 2] *= 1e-30  # tiny rows (subnormal scales / inv = 0 path)
        x[:, 3] *= 1e4 if dtype == torch.bfloat16 else 40  # stay finite in fp16
    x = x.to(dtype)
    return x[0].cuda(), x[1].cuda()


def _assert_same(cache, ref):
    names = ["k_data", "v_data", "k_scale_pool", "v_scale_pool", "k_ring", "v_ring", "k_sink", "v_sink"]
    lg, lr = cache.layer(0), ref.layer(0)
    for nm in names:
        g, r = getattr(lg, nm), getattr(lr, nm)
        if g is None:
            assert r is None
            continue
        gb, rb = g.cpu().contiguous().view(torch.uint8), r.contiguous().view(torch.uint8)
        if not torch.equal(gb, rb):
            bad = torch.nonzero(gb != rb)
            raise AssertionError(f"{nm}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}")


def _write_both(cache, k, v, slots, seq_slots=None, positions=None, check=False, rope=None, k_mean=None):
    ref = _cpu_twin(cache)
    qattn.write_kv(cache, 0, k, v, slots, seq_slots=seq_slots, positions=positions, check=check, rope=rope,
                   k_mean=k_mean)
    torch.cuda.synchronize()
    write_kv_reference(ref, 0, k.cpu(), v.cpu(), slots.cpu(),
                       seq_slots=None if seq_slots is None else seq_slots.cpu(),
                       positions=None if positions is None else positions.cpu(),
                       rope=None if rope is None else rope.to("cpu"),
                       k_mean=None if k_mean is None else k_mean.cpu())
    _assert_same(cache, ref)
    return ref


def _random_slots(n, capacity, gen, skip=0.2):
    slots = torch.randperm(capacity, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < skip] = -1
    return slots.cuda()


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}")
def test_write_every_format(fmt, head_dim, page):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fmt, head_dim, page)).encode()))
    f = _fmt(*fmt)
    H, nb, n = 4, 40, 333
    cache = _make_cache(f, f, head_dim, page, nb, H, gen)
    k, v = _inputs(n, H, head_dim, gen)
    _write_both(cache, k, v, _random_slots(n, nb * page, gen))


@pytest.mark.parametrize("layout", ["packed_qkv", "heads_major", "misaligned"])
@pytest.mark.parametrize("fmt", ["nvfp4", "int8", ("fp8", "mxfp4")], ids=str)
def test_write_strided_inputs(monkeypatch, fmt, layout):
    """k and v as views: sliced out of one packed QKV projection (token stride (Hq + 2 H) D), or heads-major
    memory transposed (head stride T D). The insert kernel reads them in place (it gets the caller's tensors) and
    writes the same bytes as the reference; a view whose data pointer is only 2-byte aligned is copied first."""
    import qattn.cute_kernels.kv_insert as KI

    gen = torch.Generator().manual_seed(3)
    kf, vf = (_fmt(fmt), _fmt(fmt)) if isinstance(fmt, str) else (_fmt(fmt[0]), _fmt(fmt[1]))
    H, Hq, D, page, nb, n = 4, 8, 128, 16, 64, 500
    cache = _make_cache(kf, vf, D, page, nb, H, gen)
    k0, v0 = _inputs(n, H, D, gen)
    if layout == "packed_qkv":
        qkv = torch.zeros(n, Hq + 2 * H, D, dtype=k0.dtype, device="cuda")
        qkv[:, Hq:Hq + H], qkv[:, Hq + H:] = k0, v0
        k, v = qkv[:, Hq:Hq + H], qkv[:, Hq + H:]
    elif layout == "heads_major":
        k, v = k0.transpose(0, 1).contiguous().transpose(0, 1), v0.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        buf = torch.zeros(2 * n * H * D + 1, dtype=k0.dtype, device="cuda")[1:]
        k, v = buf[:n * H * D].view(n, H, D), buf[n * H * D:].view(n, H, D)
        k.copy_(k0), v.copy_(v0)
    seen = []
    orig = KI.launch_insert

    def spy(cfg, arch, k_arg, v_arg, *rest, **kw):
        seen.append((k_arg.data_ptr(), v_arg.data_ptr()))
        return orig(cfg, arch, k_arg, v_arg, *rest, **kw)

    monkeypatch.setattr(KI, "launch_insert", spy)
    _write_both(cache, k, v, _random_slots(n, nb * page, gen))
    assert (seen[0] == (k.data_ptr(), v.data_ptr())) == (layout != "misaligned")


@pytest.mark.parametrize("pair", [("int8", "nvfp4"), ("fp8", "mxfp4"), ("bf16", "fp8"), ("nvfp4", "int8"),
                                  ("mxfp4_b16", "bf16")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_mixed_formats(pair, dtype):
    gen = torch.Generator().manual_seed(7)
    H, D, page, nb, n = 8, 128, 16, 64, 500
    cache = _make_cache(_fmt(pair[0]), _fmt(pair[1]), D, page, nb, H, gen)
    k, v = _inputs(n, H, D, gen, dtype)
    _write_both(cache, k, v, _random_slots(n, nb * page, gen))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "int8"])
def test_head_dim_256_and_32(fmt):
    gen = torch.Generator().manual_seed(11)
    for D in (256, 32):
        cache = _make_cache(_fmt(fmt), _fmt(fmt), D, 16, 20, 2, gen)
        k, v = _inputs(100, 2, D, gen)
        _write_both(cache, k, v, _random_slots(100, 320, gen))


def _seq_layout(lens, page, nb, gen):
    """Block tables (random, disjoint blocks) for sequences of the given lengths."""
    need = [(L + page - 1) // page for L in lens]
    perm = torch.randperm(nb, generator=gen)
    tables, o = [], 0
    for m in need:
        tables.append(perm[o:o + m])
        o += m
    return tables


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4"])
def test_decode_append_256_seqs(fmt):
    """One new token for each of 256 sequences (lengths 0..999), ring cache (window 32)."""
    gen = torch.Generator().manual_seed(3)
    H, D, page, B, W = 8, 128, 16, 256, 32
    lens = torch.randint(0, 1000, (B,), generator=gen)
    tables = _seq_layout((lens + 1).tolist(), page, 256 * 64, gen)
    cache = _make_cache(_fmt(fmt), _fmt(fmt), D, page, 256 * 64, H, gen, window=W, max_seqs=B)
    slots = torch.stack([tables[b][lens[b] // page] * page + lens[b] % page for b in range(B)])
    order = torch.randperm(B, generator=gen)  # batch order is arbitrary
    k, v = _inputs(B, H, D, gen)
    _write_both(cache, k, v, slots[order].cuda(), order.cuda(), lens[order].cuda(), check=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_prefill_chunk_16k(fmt):
    """A 16K-token chunk of one sequence (continuing at position 1000), ring window 128: most ring entries are
    hit 128 times, the newest must stay."""
    gen = torch.Generator().manual_seed(5)
    H, D, page, W, n, start = 8, 128, 64, 128, 16384, 1000
    nb = (start + n) // page + 8
    cache = _make_cache(_fmt(fmt), _fmt(fmt), D, page, nb, H, gen, window=W, max_seqs=4)
    table = torch.randperm(nb, generator=gen)
    pos = torch.arange(start, start + n)
    slots = table[pos // page] * page + pos % page
    k, v = _inputs(n, H, D, gen)
    seqs = torch.full((n,), 2)
    _write_both(cache, k, v, slots.cuda(), seqs.cuda(), pos.cuda(), check=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_multi_sequence_prefill(dtype):
    """Several sequences, each contiguous with consecutive positions, some longer than the window, padding
    tokens (-1) at the end; fp16 input into a bf16 ring and vice versa."""
    gen = torch.Generator().manual_seed(9)
    H, D, page, W = 4, 64, 16, 16
    lens = [5, 40, 16, 17, 1, 33]
    starts = [0, 7, 100, 3, 50, 16]
    tables = _seq_layout([s + L for s, L in zip(starts, lens)], page, 200, gen)
    cache = _make_cache(_fmt("fp8"), _fmt("nvfp4"), D, page, 200, H, gen, window=W, max_seqs=8,
                        dtype=torch.bfloat16 if dtype == torch.float16 else torch.float16)
    slots, seqs, pos = [], [], []
    ring_slot = torch.randperm(8, generator=gen)
    for i, (s, L) in enumerate(zip(starts, lens)):
        p = torch.arange(s, s + L)
        slots.append(tables[i][p // page] * page + p % page)
        seqs.append(torch.full((L,), int(ring_slot[i])))
        pos.append(p)
    pad = 7
    slots.append(torch.full((pad,), -1))
    seqs.append(torch.zeros(pad, dtype=torch.long))
    pos.append(torch.zeros(pad, dtype=torch.long))
    slots, seqs, pos = torch.cat(slots), torch.cat(seqs), torch.cat(pos)
    k, v = _inputs(slots.numel(), H, D, gen, dtype)
    _write_both(cache, k, v, slots.cuda(), seqs.cuda(), pos.cuda(), check=True)


def test_check_mode_errors():
    gen = torch.Generator().manual_seed(1)
    cache = _make_cache(_fmt("nvfp4"), _fmt("nvfp4"), 64, 16, 8, 2, gen, window=4, max_seqs=2)
    k, v = _inputs(6, 2, 64, gen)
    seqs = torch.zeros(6, dtype=torch.long).cuda()
    pos = torch.arange(6).cuda()
    with pytest.raises(ValueError, match="slot_mapping"):
        qattn.write_kv(cache, 0, k, v, torch.tensor([0, 1, 2, 3, 4, 999]).cuda(), seq_slots=seqs, positions=pos,
                       check=True)
    with pytest.raises(ValueError, match="twice"):
        qattn.write_kv(cache, 0, k, v, torch.tensor([0, 1, 2, 3, 4, 4]).cuda(), seq_slots=seqs, positions=pos,
                       check=True)
    # a sequence whose tokens hit one ring entry in non-consecutive order
    with pytest.raises(ValueError, match="ring entry"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda(), seq_slots=seqs,
                       positions=torch.tensor([5, 1, 2, 3, 4, 0]).cuda(), check=True)
    # padding inside a sequence whose ring entries repeat: outside the kernel's ring precondition
    with pytest.raises(ValueError, match="ring entry"):
        k10, v10 = _inputs(10, 2, 64, gen)
        s10 = torch.arange(10)
        s10[4] = -1  # token 0 cannot see that token 8 (not 4) overwrites its ring entry
        qattn.write_kv(cache, 0, k10, v10, s10.cuda(), seq_slots=torch.zeros(10, dtype=torch.long).cuda(),
                       positions=torch.arange(10).cuda(), check=True)
    with pytest.raises(TypeError, match="slot_mapping"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6, dtype=torch.int32).cuda(), seq_slots=seqs, positions=pos)
    with pytest.raises(ValueError, match="seq_slots"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda())


def _sink_batch(starts, lens, page, tables, ring_slot, pad=0):
    """(slots, seq_slots, positions) of sequences i = chunks [starts[i], starts[i] + lens[i]), contiguous with
    consecutive positions, then ``pad`` padding tokens (-1)."""
    slots, seqs, pos = [], [], []
    for i, (s, L) in enumerate(zip(starts, lens)):
        p = torch.arange(s, s + L)
        slots.append(tables[i][p // page] * page + p % page)
        seqs.append(torch.full((L,), int(ring_slot[i])))
        pos.append(p)
    slots.append(torch.full((pad,), -1))
    seqs.append(torch.zeros(pad, dtype=torch.long))
    pos.append(torch.zeros(pad, dtype=torch.long))
    return torch.cat(slots), torch.cat(seqs), torch.cat(pos)


@pytest.mark.parametrize("sink", [1, 4])
@pytest.mark.parametrize("window", [0, 64])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}")
def test_write_sink(fmt, window, sink):
    """Sink caches: prefill chunks that start below / at / above N (and one shorter than N), then decode steps
    across N; every byte of pages, ring and sink equals the reference (the sink entries of other slots and of
    positions >= N keep their poison)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fmt, window, sink)).encode()))
    f = _fmt(*fmt)
    H, D, page = 2, 128, 16
    starts = [0, 0, 2, sink, 100]
    lens = [sink + 70, max(sink - 1, 1), 40, 3, 17]
    tables = _seq_layout([s + L + 4 for s, L in zip(starts, lens)], page, 200, gen)
    cache = _make_cache(f, f, D, page, 200, H, gen, window=window, max_seqs=8, sink=sink)
    ring_slot = torch.randperm(8, generator=gen)
    slots, seqs, pos = _sink_batch(starts, lens, page, tables, ring_slot, pad=5)
    k, v = _inputs(slots.numel(), H, D, gen)
    _write_both(cache, k, v, slots.cuda(), seqs.cuda(), pos.cuda(), check=True)
    # decode steps: one token per sequence, in a shuffled batch order, without check
    for step in range(3):
        order = torch.randperm(len(lens), generator=gen)
        nxt = [starts[i] + lens[i] + step for i in order.tolist()]
        slots = torch.stack([tables[i][p // page] * page + p % page for i, p in zip(order.tolist(), nxt)])
        k, v = _inputs(len(lens), H, D, gen)
        _write_both(cache, k, v, slots.cuda(), ring_slot[order].cuda(), torch.tensor(nxt).cuda())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_sink_with_transforms(dtype):
    """The sink receives the transformed rows (RoPE, smoothing, rotation), fp16 input into a bf16 cache and
    vice versa, mixed formats."""
    gen = torch.Generator().manual_seed(23)
    H, D, page, W, N = 2, 128, 16, 16, 4
    starts, lens = [0, 1, 7], [30, 2, 20]
    tables = _seq_layout([s + L for s, L in zip(starts, lens)], page, 64, gen)
    cache = _make_cache(_fmt("int8"), _fmt("nvfp4"), D, page, 64, H, gen, window=W, max_seqs=4, rotate=True,
                        dtype=torch.bfloat16 if dtype == torch.float16 else torch.float16, sink=N)
    slots, seqs, pos = _sink_batch(starts, lens, page, tables, [3, 0, 1])
    k, v = _inputs(slots.numel(), H, D, gen, dtype)
    rope = qattn.RoPE.from_theta(10000.0, D, 512, "neox", device="cuda")
    k_mean = (torch.randn(H, D, generator=gen) * 3).cuda()
    _write_both(cache, k, v, slots.cuda(), seqs.cuda(), pos.cuda(), check=True, rope=rope, k_mean=k_mean)


def test_sink_check_mode_and_out_of_range_values():
    gen = torch.Generator().manual_seed(29)
    cache = _make_cache(_fmt("nvfp4"), _fmt("nvfp4"), 64, 16, 8, 2, gen, max_seqs=2, sink=2)
    k, v = _inputs(4, 2, 64, gen)
    with pytest.raises(ValueError, match="seq_slots.*sink_tokens=2"):
        qattn.write_kv(cache, 0, k, v, torch.arange(4).cuda())
    with pytest.raises(ValueError, match="twice"):  # two tokens on one sink entry would race
        qattn.write_kv(cache, 0, k, v, torch.arange(4).cuda(), seq_slots=torch.zeros(4, dtype=torch.long).cuda(),
                       positions=torch.tensor([0, 1, 1, 3]).cuda(), check=True)
    with pytest.raises(ValueError, match="seq_slots"):
        qattn.write_kv(cache, 0, k, v, torch.arange(4).cuda(), seq_slots=torch.tensor([0, 0, 2, 0]).cuda(),
                       positions=torch.arange(4).cuda(), check=True)
    # without check, a seq_slot or position outside the sink writes no sink row (and nothing out of bounds)
    lay = cache.layer(0)
    before = (lay.k_sink.clone(), lay.v_sink.clone())
    qattn.write_kv(cache, 0, k, v, torch.arange(4).cuda(), seq_slots=torch.tensor([2, -1, 0, 0]).cuda(),
                   positions=torch.tensor([0, 1, -1, 5]).cuda())
    torch.cuda.synchronize()
    # compare bits: the sink buffer is uninitialized memory, NaNs included
    assert torch.equal(lay.k_sink.view(torch.int16), before[0].view(torch.int16))
    assert torch.equal(lay.v_sink.view(torch.int16), before[1].view(torch.int16))


def _pools(lay):
    """A layer's data and scale pools and rings, in KVLayer's order (None where the cache has none)."""
    return (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_ring, lay.v_ring)


def out_of_range_insert_case(fmt: str = "nvfp4"):
    """write_kv without check on slots past the pool (one past 2^31, which an int32 slot would wrap) and ring rows
    of an out-of-range seq_slot or a negative position, on a poisoned two-layer cache. Returns (cache, each layer's
    ``_pools`` before, k, v, a ringless reference twin of layer 0 written with the bad slots as -1)."""
    gen = torch.Generator().manual_seed(41)
    H, D, page, nb = 2, 128, 16, 8
    cache = PagedKVCache(2, nb, page, H, D, fmt, device="cuda:0", recent_window=8, max_seqs=2)
    for t in _tensors(cache):  # poison both layers
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).cuda())
    before = [[None if t is None else t.clone() for t in _pools(lay)] for lay in cache._layers]
    cap = nb * page
    k, v = _inputs(7, H, D, gen)
    slots = torch.tensor([0, cap, cap + 7, 2**31 + 3, 5, 6, 7])
    # token 4: seq_slot 2 of max_seqs 2; token 6: one whose 64-bit ring row product wraps negative
    seqs = torch.tensor([0, 0, 0, 0, 2, 1, 2**60 - 1])  # (2^60 - 1) * H 2 * W 8 = 2^64 - 16
    pos = torch.tensor([0, 1, 2, 3, 4, -2, 5])  # token 5: a negative position
    # the pools as a ringless cache of the same pools gets them from the reference, bad slots skipped
    lay = cache.layer(0)
    twin = PagedKVCache.from_tensors([KVLayer(*(None if t is None else t.cpu().clone() for t in (
        lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_global_scale, lay.v_global_scale)))],
        page, D, fmt)
    write_kv_reference(twin, 0, k.cpu(), v.cpu(), torch.tensor([0, -1, -1, -1, 5, 6, 7]))
    qattn.write_kv(cache, 0, k, v, slots.cuda(), seq_slots=seqs.cuda(), positions=pos.cuda())
    torch.cuda.synchronize()
    return cache, before, k, v, twin


def test_out_of_range_slots_and_ring_rows_write_nothing():
    cache, before, k, v, twin = out_of_range_insert_case()
    lay, ref = cache.layer(0), twin.layer(0)
    for nm in ("k_data", "v_data", "k_scale_pool", "v_scale_pool"):
        g, r = getattr(lay, nm), getattr(ref, nm)
        assert torch.equal(g.cpu().view(torch.uint8), r.view(torch.uint8)), f"layer 0 {nm} differs from the reference"
    for ring, x, old in ((lay.k_ring, k, before[0][4]), (lay.v_ring, v, before[0][5])):
        exp = old.clone()
        exp[0, :, 0] = x[0]  # only token 0 (seq_slot 0, position 0) has a ring row
        assert torch.equal(ring.view(torch.int16), exp.view(torch.int16)), "ring rows written out of range"
    for t, old in zip(_pools(cache.layer(1)), before[1]):
        if t is not None:
            assert torch.equal(t.view(torch.uint8), old.view(torch.uint8)), "layer 1 written by a layer-0 insert"


def nan_outputs(monkeypatch):
    """From now on (until ``monkeypatch.undo()``) CUDA float tensors from torch.empty / empty_like come NaN-filled
    (flatten_kv allocates its outputs with them): a row the kernel does not write, the zero rows past each
    length included, shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_cuda and t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.mark.parametrize("pair", [("nvfp4", "nvfp4"), ("mxfp4", "fp8"), ("int8", "bf16"), ("mxfp4_b16", "int8")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flatten_equals_reference(pair, head_dim, monkeypatch):
    gen = torch.Generator().manual_seed(13)
    H, page, nb = 4, 16, 64
    cache = _make_cache(_fmt(pair[0]), _fmt(pair[1]), head_dim, page, nb, H, gen)
    lens = torch.tensor([0, 1, 17, 100, 250], dtype=torch.int32)
    tables = _seq_layout(lens.tolist(), page, nb, gen)
    mb = max(len(t) for t in tables)
    bt = torch.zeros(len(lens), mb, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    # write real tokens (flatten of poison is checked too: fp scales may be NaN -> compare bits)
    k, v = _inputs(int(lens.sum()), H, head_dim, gen)
    slots = torch.cat([tables[i][torch.arange(L) // page] * page + torch.arange(L) % page
                       for i, L in enumerate(lens.tolist())])
    qattn.write_kv(cache, 0, k, v, slots.cuda())
    kr, vr = flatten_kv_reference(cache, 0, bt.cuda(), lens.cuda())  # (B, 250, H, D)
    nan_outputs(monkeypatch)  # rows 250..259 of every sequence, and past each shorter length, must be written 0
    kd, vd = qattn.flatten_kv(cache, 0, bt.cuda(), lens.cuda(), max_seqlen=260)
    monkeypatch.undo()
    for got, want in ((kd, kr), (vd, vr)):
        want = want.to(torch.bfloat16)
        assert got.shape == (len(lens), 260, H, head_dim) and want.shape[1] == 250
        assert torch.equal(got[:, :250].view(torch.int16).cpu(), want.view(torch.int16).cpu())
        for i, L in enumerate(lens.tolist()):
            assert not got[i, L:].any()


def test_inspect_kv():
    gen = torch.Generator().manual_seed(17)
    cache = _make_cache(_fmt("nvfp4"), _fmt("int8"), 64, 16, 8, 2, gen)
    k, v = _inputs(3, 2, 64, gen)
    qattn.write_kv(cache, 0, k, v, torch.tensor([5, 17, 40]).cuda())
    info = qattn.inspect_kv(cache, 0, 1, 1, 1)  # slot 17, head 1
    from qattn.quant.reference import fake_quantize

    lay = cache.layer(0)
    want_k = fake_quantize(k[1, 1].cpu(), "nvfp4", lay.k_global_scale[1].cpu())
    want_v = fake_quantize(v[1, 1].cpu(), "int8")
    assert torch.equal(info["k"]["values"], want_k) and torch.equal(info["v"]["values"], want_v)
    assert info["k"]["payload"].numel() == 32 and info["k"]["scales"].numel() == 4
    assert info["k"]["data_offset"] == cache.k_geometry.data_offset(1, 1, 1)


# ------------------------------------------------------------------------------------------------
# insert transforms: RoPE (NeoX / GPT-J, partial rotary), K smoothing, cache rotation
# ------------------------------------------------------------------------------------------------
def _transform_cases(head_dim):
    """(id, rope style or None, rotary_dim, smoothing, rotation). The partial NeoX rotary_dim puts pair
    partners in a different lane at a different register (half not a multiple of 32)."""
    odd = {64: 48, 128: 80}[head_dim]
    return [
        ("rope-neox", "neox", head_dim, False, False),
        ("rope-gptj-partial+smooth", "gptj", head_dim // 2, True, False),
        ("rotate", None, 0, False, True),
        ("rope-neox-partial+smooth+rotate", "neox", odd, True, True),
    ]


TRANSFORM_IDS = [c[0] for c in _transform_cases(64)]


def _transform_args(case, H, D, n, gen, max_position=70000):
    _, style, rd, smooth, _ = case
    rope = qattn.RoPE.from_theta(10000.0, rd, max_position, style, device="cuda") if style else None
    positions = torch.randint(0, max_position, (n,), generator=gen).cuda() if style else None
    k_mean = (torch.randn(H, D, generator=gen) * 3).cuda() if smooth else None
    return rope, positions, k_mean


@pytest.mark.parametrize("case_index", range(4), ids=TRANSFORM_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-{f[1]}")
def test_write_with_transforms(fmt, head_dim, case_index):
    """Kernel bytes == reference bytes with the fused transforms; slots in random order, -1 slots untouched."""
    case = _transform_cases(head_dim)[case_index]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((fmt, head_dim, case)).encode()))
    f = _fmt(*fmt)
    H, nb, page, n = 4, 40, 16, 333
    cache = _make_cache(f, f, head_dim, page, nb, H, gen, rotate=case[4])
    k, v = _inputs(n, H, head_dim, gen)
    rope, positions, k_mean = _transform_args(case, H, head_dim, n, gen)
    _write_both(cache, k, v, _random_slots(n, nb * page, gen), positions=positions, rope=rope, k_mean=k_mean)


@pytest.mark.parametrize("pair", [("int8", "nvfp4"), ("nvfp4", "fp8"), ("bf16", "mxfp4_b16")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_with_transforms_ring_and_mixed(pair, dtype):
    """Ring caches receive the transformed rows (fp16 input into a bf16 ring and vice versa), mixed formats,
    head_dim 256 and 32 too."""
    gen = torch.Generator().manual_seed(21)
    for D, case in ((128, ("all", "neox", 128, True, True)), (256, ("all", "gptj", 200, True, True)),
                    (32, ("all", "neox", 16, False, True))):
        kf, vf = _fmt(pair[0]), _fmt(pair[1])
        if D == 32 and (kf.scale_block == 32 or vf.scale_block == 32):
            continue
        H, page, W = 2, 16, 16
        lens, starts = [5, 40, 17], [0, 7, 100]
        tables = _seq_layout([s + L for s, L in zip(starts, lens)], page, 64, gen)
        cache = _make_cache(kf, vf, D, page, 64, H, gen, window=W, max_seqs=4, rotate=True,
                            dtype=torch.bfloat16 if dtype == torch.float16 else torch.float16)
        slots, seqs, pos = [], [], []
        for i, (s, L) in enumerate(zip(starts, lens)):
            p = torch.arange(s, s + L)
            slots.append(tables[i][p // page] * page + p % page)
            seqs.append(torch.full((L,), i + 1))
            pos.append(p)
        slots, seqs, pos = torch.cat(slots), torch.cat(seqs), torch.cat(pos)
        k, v = _inputs(slots.numel(), H, D, gen, dtype)
        rope = qattn.RoPE.from_theta(10000.0, case[2], 512, case[1], device="cuda")
        k_mean = (torch.randn(H, D, generator=gen) * 3).cuda() if case[3] else None
        _write_both(cache, k, v, slots.cuda(), seqs.cuda(), pos.cuda(), check=True, rope=rope, k_mean=k_mean)


def test_calibrate_then_overflow_saturates():
    """NVFP4 global scales calibrated on a prefill batch (after the transforms); later values 100x larger
    saturate to the top codes, equal to the reference, and decode to finite values."""
    gen = torch.Generator().manual_seed(23)
    H, D, page, nb, n = 4, 128, 16, 32, 200
    cache = _make_cache(_fmt("nvfp4"), _fmt("nvfp4"), D, page, nb, H, gen, rotate=True)
    k, v = _inputs(n, H, D, gen)
    rope = qattn.RoPE.from_theta(10000.0, 128, 4096, "neox", device="cuda")
    pos = torch.arange(n).cuda()
    cache.calibrate(0, k, v, headroom=1.0, positions=pos, rope=rope)
    big_k, big_v = (k.float() * 100).to(torch.bfloat16), (v.float() * 100).to(torch.bfloat16)
    slots = _random_slots(n, nb * page, gen, skip=0.0)
    _write_both(cache, big_k, big_v, slots, positions=pos, rope=rope)
    from qattn.quant.reference import dequantize

    lay = cache.layer(0)
    blk, off = slots // page, slots % page
    for data, sp, gs in ((lay.k_data, lay.k_scale_pool, lay.k_global_scale),
                         (lay.v_data, lay.v_scale_pool, lay.v_global_scale)):
        x = dequantize(data[blk, :, off], sp[blk, :, off], cache.k_format, gs)  # the written rows only
        assert bool(torch.isfinite(x).all())
        assert float(x.abs().max()) <= 6 * 448 * float(gs.max()) * (1 + 1e-6)
        assert bool((sp[blk, :, off] == 0x7E).any())  # saturated block scales (448)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", ("int8", "mxfp4")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_over_rotated_cache(fmt, head_dim):
    """flash_attn_with_kvcache on a rotated cache (q rotated before, output rotated back) equals the fp64
    reference decode of the same cache (kernel error) and unrotated attention over the unquantized roped K, V
    (format error)."""
    from qattn.quant.transforms import apply_rope, rotate_query, unrotate_rows
    from qattn.reference.attention import attention_reference, paged_decode_reference

    gen = torch.Generator().manual_seed(27)
    H, group, page = 2, 4, 16
    lens = [1, 37, 300]
    nb = sum(-(-L // page) for L in lens) + 2
    f = (_fmt(fmt[0]), _fmt(fmt[1])) if isinstance(fmt, tuple) else (_fmt(fmt), _fmt(fmt))
    cache = _make_cache(*f, head_dim, page, nb, H, gen, rotate=True)
    tables = _seq_layout(lens, page, nb, gen)
    bt = torch.zeros(len(lens), max(len(t) for t in tables), dtype=torch.int32)
    rope = qattn.RoPE.from_theta(10000.0, head_dim, 1024, "neox", device="cuda")
    Lmax = max(lens)
    k_all = torch.zeros(len(lens), Lmax, H, head_dim)
    v_all = torch.zeros(len(lens), Lmax, H, head_dim)
    ks, vs = [], []
    for L in lens:
        k = torch.randn(L, H, head_dim, generator=gen)
        k[:, :, 3] += 4.0
        ks.append(k.to(torch.bfloat16))
        vs.append(torch.randn(L, H, head_dim, generator=gen).to(torch.bfloat16))
    # global scales first (from the longest sequence, a "prefill batch"), then every write
    cache.calibrate(0, ks[2].cuda(), vs[2].cuda(), headroom=1.25, positions=torch.arange(lens[2]).cuda(), rope=rope)
    for b, L in enumerate(lens):
        bt[b, :len(tables[b])] = tables[b]
        k, v = ks[b], vs[b]
        pos = torch.arange(L)
        slots = tables[b][pos // page] * page + pos % page
        qattn.write_kv(cache, 0, k.cuda(), v.cuda(), slots.cuda(), positions=pos.cuda(), rope=rope)
        k_all[b, :L] = apply_rope(k, pos, rope.to("cpu"))
        v_all[b, :L] = v.float()
    q = torch.randn(len(lens), 1, H * group, head_dim, generator=gen).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out, lse = qattn.flash_attn_with_kvcache(q.cuda(), cache, lens_t.cuda(), bt.cuda(), return_lse=True)
    buf = torch.empty_like(q).cuda()
    out2 = qattn.flash_attn_with_kvcache(q.cuda(), cache, lens_t.cuda(), bt.cuda(), out=buf)
    assert out2 is buf and torch.equal(out2, out)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and bool(torch.isfinite(out).all())
    s = cache.rotation_signs.cpu()
    ref_cache = _cpu_twin(cache)
    ref_rot, ref_lse = paged_decode_reference(rotate_query(q, s), ref_cache, lens_t, bt, return_lse=True)
    ref = unrotate_rows(ref_rot, s)
    kernel_err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert kernel_err < 1e-2, kernel_err
    assert (lse.cpu().double() - ref_lse).abs().max() < 2e-2
    want = attention_reference(q, k_all, v_all, causal=True, kv_lens=lens_t)
    fmt_err = float((out.cpu().double() - want).norm() / want.norm())
    assert fmt_err < {"nvfp4": 0.2, "fp8": 0.06}.get(fmt if isinstance(fmt, str) else "x", 0.25), fmt_err


SEARCH_CASES = [(("nvfp4", None), ("nvfp4", None)), (("mxfp4", "floor"), ("mxfp4", "floor")),
                (("mxfp4", "rceil"), ("mxfp4_b16", "rceil")), (("int8", None), ("nvfp4", None)),
                (("nvfp4", None), ("mxfp4_b16", "floor")), (("mxfp4", "rceil"), ("fp8", None))]


def _decoded_rows(cache, side, slots):
    """fp64 values the pages hold for ``side`` ("k" / "v") at ``slots`` (tokens, heads, head_dim)."""
    from qattn.quant.reference import dequantize

    lay, page = cache.layer(0), cache.page_size
    blk, off = slots // page, slots % page
    fmt = getattr(cache, f"{side}_format")
    data, sp, gs = (getattr(lay, f"{side}_{n}") for n in ("data", "scale_pool", "global_scale"))
    scales = None if sp is None else sp.cpu()[blk, :, off]
    return dequantize(data.cpu()[blk, :, off], scales, fmt, None if gs is None else gs.cpu()).double()


def _searched(kspec, vspec):
    return kv_format((_fmt(*kspec), _fmt(*vspec)), scale_search="msenb")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SEARCH_CASES, ids=lambda c: f"{c[0][0]}-{c[0][1]}+{c[1][0]}-{c[1][1]}")
def test_write_scale_search(case, head_dim):
    """Caches written with ``scale_search="msenb"``: kernel bytes == reference bytes (every pool byte, -1 slots
    untouched), the search moves some block scales off the plain rule's, and never raises a block's error."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, head_dim, "search")).encode()))
    f = _searched(*case)
    H, nb, page, n = 4, 40, 16, 333
    cache = _make_cache(f.k, f.v, head_dim, page, nb, H, gen)
    plain = _make_cache(_fmt(*case[0]), _fmt(*case[1]), head_dim, page, nb, H, gen)
    for a, b in zip(_tensors(cache), _tensors(plain)):
        b.copy_(a)
    lay, play = cache.layer(0), plain.layer(0)
    for a, b in ((lay.k_global_scale, play.k_global_scale), (lay.v_global_scale, play.v_global_scale)):
        if a is not None:
            b.copy_(a)
    k, v = _inputs(n, H, head_dim, gen)
    slots = _random_slots(n, nb * page, gen)
    _write_both(cache, k, v, slots)
    qattn.write_kv(plain, 0, k, v, slots)
    moved = 0
    for side, x in (("k", k), ("v", v)):
        fmt = getattr(f, side)
        if fmt.payload != "e2m1":
            continue
        sc, sp = getattr(lay, f"{side}_scale_pool"), getattr(play, f"{side}_scale_pool")
        moved += int((sc != sp).sum())
        # per token-head block error of the stored rows: searched <= plain (fp64 of the decoded values)
        keep = (slots >= 0).cpu()
        sl = slots.cpu()[keep].long()
        xr = x.cpu()[keep].double()
        es, ep = (((xr - _decoded_rows(c, side, sl)) ** 2).reshape(*xr.shape[:-1], -1, fmt.scale_block).sum(-1)
                  for c in (cache, plain))
        assert bool((es <= ep * (1 + 1e-5) + 1e-300).all())
        assert float(es.sum()) < float(ep.sum())
    assert moved > 0


@pytest.mark.parametrize("case,head_dim", [((("nvfp4", None), ("nvfp4", None)), 256),
                                           ((("mxfp4", "rceil"), ("mxfp4", "floor")), 32),
                                           ((("int8", None), ("nvfp4", None)), 256),
                                           ((("nvfp4", None), ("mxfp4_b16", "rceil")), 32)], ids=str)
def test_write_scale_search_other_head_dims(case, head_dim):
    """head_dim 256 and 32 (other values per thread and threads per row): bytes == reference."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, head_dim, "search-hd")).encode()))
    f = _searched(*case)
    H, nb, page, n = 4, 40, 16, 300
    cache = _make_cache(f.k, f.v, head_dim, page, nb, H, gen)
    k, v = _inputs(n, H, head_dim, gen)
    _write_both(cache, k, v, _random_slots(n, nb * page, gen))


def test_write_scale_search_with_transforms_and_ring():
    """The search after RoPE + smoothing + rotation, with a ring: bytes == reference."""
    gen = torch.Generator().manual_seed(41)
    f = kv_format(("nvfp4", "mxfp4"), scale_search="msenb")
    H, D, page, nb, n = 4, 128, 16, 64, 200
    cache = _make_cache(f.k, f.v, D, page, nb, H, gen, window=32, max_seqs=4, rotate=True)
    k, v = _inputs(n, H, D, gen)
    rope, positions, k_mean = _transform_args(("x", "neox", 80, True, True), H, D, n, gen)
    seqs = torch.full((n,), 1).cuda()
    positions = torch.arange(n).cuda()
    _write_both(cache, k, v, _random_slots(n, nb * page, gen, skip=0.0), seq_slots=seqs, positions=positions,
                rope=rope, k_mean=k_mean)


def test_decode_reads_searched_cache_as_plain():
    """Readers ignore the search: decode over a searched cache equals decode over a plain-format view of the same
    tensors, bit for bit."""
    gen = torch.Generator().manual_seed(43)
    f = kv_format("nvfp4", scale_search="msenb")
    H, group, D, page, L = 2, 4, 128, 16, 300
    nb = -(-L // page) + 2
    cache = _make_cache(f, f, D, page, nb, H, gen)
    k, v = _inputs(L, H, D, gen)
    table = torch.randperm(nb, generator=gen)[: -(-L // page)]
    pos = torch.arange(L)
    qattn.write_kv(cache, 0, k, v, (table[pos // page] * page + pos % page).cuda())
    view = PagedKVCache.from_tensors([cache.layer(0)], page, D, "nvfp4", cache.dtype)
    q = torch.randn(1, 1, H * group, D, generator=gen).to(torch.bfloat16).cuda()
    lens, bt = torch.tensor([L], dtype=torch.int32).cuda(), table[None].to(torch.int32).cuda()
    out = qattn.flash_attn_with_kvcache(q, cache, lens, bt)
    assert torch.equal(out, qattn.flash_attn_with_kvcache(q, view, lens, bt))


def test_transform_check_mode_errors():
    gen = torch.Generator().manual_seed(25)
    cache = _make_cache(_fmt("nvfp4"), _fmt("nvfp4"), 64, 16, 8, 2, gen)
    k, v = _inputs(6, 2, 64, gen)
    rope = qattn.RoPE.from_theta(10000.0, 64, 16, device="cuda")
    with pytest.raises(ValueError, match="positions"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda(), rope=rope)
    with pytest.raises(ValueError, match="positions"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda(), rope=rope, positions=torch.arange(12, 18).cuda(),
                       check=True)
    with pytest.raises(ValueError, match="k_mean"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda(), k_mean=torch.zeros(2, 64))  # on the CPU
    with pytest.raises(ValueError, match="rotary_dim"):
        qattn.write_kv(cache, 0, k, v, torch.arange(6).cuda(), positions=torch.arange(6).cuda(),
                       rope=qattn.RoPE.from_theta(10000.0, 128, 16, device="cuda"))


def _memcheck_case():
    gen = torch.Generator().manual_seed(0)
    cache = _make_cache(_fmt("nvfp4"), _fmt("fp8"), 128, 16, 16, 2, gen, window=8, max_seqs=2)
    n = 40
    k, v = _inputs(n, 2, 128, gen)
    pos = torch.arange(n)
    slots = pos.clone()
    slots[-3:] = -1  # padding at the end (padding inside a sequence that wraps the ring breaks the precondition)
    _write_both(cache, k, v, slots.cuda(), torch.ones(n, dtype=torch.long).cuda(), pos.cuda())
    bt = torch.arange(16, dtype=torch.int32)[None, :].repeat(2, 1)
    lens = torch.tensor([40, 3], dtype=torch.int32)
    qattn.flatten_kv(cache, 0, bt.cuda(), lens.cuda())
    qattn.inspect_kv(cache, 0, 0, 1, 1)
    torch.cuda.synchronize()
    print("memcheck case done")


if __name__ == "__main__":
    _memcheck_case()
