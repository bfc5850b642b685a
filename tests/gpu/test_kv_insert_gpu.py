"""GPU tests: ``qattn.write_kv`` (the fused insert kernel) and ``qattn.flatten_kv`` against the references.

Every pool (payload, scales, ring) is poisoned with random bytes first; the same poisoned cache is copied to
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
        for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_ring, lay.v_ring):
            if t is not None:
                out.append(t)
    return out


def _make_cache(kf, vf, head_dim, page, num_blocks, H, gen, *, window=0, max_seqs=0, dtype=torch.bfloat16):
    cache = PagedKVCache(1, num_blocks, page, H, head_dim, (kf, vf), device="cuda:0", dtype=dtype,
                         recent_window=window, max_seqs=max_seqs)
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
                    c(lay.v_global_scale), c(lay.k_ring), c(lay.v_ring))
    return PagedKVCache.from_tensors([layer], cache.page_size, cache.head_dim, (cache.k_format, cache.v_format),
                                     cache.dtype)


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
    names = ["k_data", "v_data", "k_scale_pool", "v_scale_pool", "k_ring", "v_ring"]
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


def _write_both(cache, k, v, slots, seq_slots=None, positions=None, check=False):
    ref = _cpu_twin(cache)
    qattn.write_kv(cache, 0, k, v, slots, seq_slots=seq_slots, positions=positions, check=check)
    torch.cuda.synchronize()
    write_kv_reference(ref, 0, k.cpu(), v.cpu(), slots.cpu(),
                       seq_slots=None if seq_slots is None else seq_slots.cpu(),
                       positions=None if positions is None else positions.cpu())
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


@pytest.mark.parametrize("pair", [("nvfp4", "nvfp4"), ("mxfp4", "fp8"), ("int8", "bf16"), ("mxfp4_b16", "int8")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flatten_equals_reference(pair, head_dim):
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
    kd, vd = qattn.flatten_kv(cache, 0, bt.cuda(), lens.cuda())
    kr, vr = flatten_kv_reference(cache, 0, bt.cuda(), lens.cuda())
    for got, want in ((kd, kr), (vd, vr)):
        want = want.to(torch.bfloat16)
        assert got.shape == want.shape
        assert torch.equal(got.view(torch.int16).cpu(), want.view(torch.int16).cpu())


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
