"""Small cases for ``compute-sanitizer --tool memcheck``: insert (plain, and with RoPE + smoothing + rotation
into ring and / or sink caches), flatten, decode (split on/off, partial pages, -1 padded block tables, GQA,
seqlen_q > 1, a recent window, sink tokens, sliding windows, also over the ring / sink), the INT8 Q/K prepass and the INT8-QK prefill (dense
ragged, causal, varlen; with and without channel balancing; a split last wave; sliding windows), launch plan
replays of prefill, decode and insert calls, and unchecked out-of-range slots, ring rows and lengths. Run as a script; exits non-zero on a wrong result."""

import torch

import qattn
from qattn.reference import paged_decode_reference


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for fmt, page in (("nvfp4", 16), (("int8", "mxfp4"), 64), ("bf16", 16)):
        B, H, Hk, D = 2, 8, 2, 128
        lens = torch.tensor([37, 100], dtype=torch.int32, device="cuda")
        per = -(-100 // page) + 1
        cache = qattn.PagedKVCache(1, B * per + 1, page, Hk, D, fmt, device="cuda")
        table = torch.randperm(B * per, device="cuda", generator=g).view(B, per).to(torch.int32)
        table[0, -(-37 // page):] = -1
        for b in range(B):
            pos = torch.arange(int(lens[b]), device="cuda")
            k = torch.randn(len(pos), Hk, D, device="cuda", generator=g, dtype=torch.bfloat16)
            slots = table[b, pos // page].long() * page + pos % page
            qattn.write_kv(cache, 0, k, torch.randn_like(k), slots)
        qattn.flatten_kv(cache, 0, table, lens)
        q = torch.randn(B, 4, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = paged_decode_reference(q, cache, lens, table)
        for splits in (1, 3):
            out = qattn.flash_attn_with_kvcache(q, cache, lens, table, num_splits=splits)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-2, (fmt, page, splits, err)
            print(f"{str(fmt):18} page {page:3} splits {splits}: rel err {err:.2e}")
        for ws in ((40, 0), (0, 0), (60, -1)):  # sliding window: the tile list starts past the table's first pages
            out = qattn.flash_attn_with_kvcache(q, cache, lens, table, num_splits=2, window_size=ws, causal=ws[1] == 0)
            ref = paged_decode_reference(q, cache, lens, table, window_size=ws, causal=ws[1] == 0)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-2, (fmt, page, ws, err)
        print(f"{str(fmt):18} page {page:3} sliding windows: rel err {err:.2e}")
    _ring_and_transforms(g)
    _prefill(g)
    _replays(g)
    _out_of_range()
    torch.cuda.synchronize()
    print("sanitize_small: OK")


def _out_of_range() -> None:
    """Unchecked bad values (no host sync to find them): insert slots past the pool and ring rows out of range
    write nothing; decode lengths past the block table's row read inside it."""
    from tests.gpu.test_decode_gpu import _check, lengths_past_the_table_case
    from tests.gpu.test_kv_insert_gpu import test_out_of_range_slots_and_ring_rows_write_nothing

    test_out_of_range_slots_and_ring_rows_write_nothing()
    for splits in (1, 3):
        _check(*lengths_past_the_table_case("nvfp4", splits))
    print("out-of-range slots, ring rows and lengths: OK")


def _ring_and_transforms(g) -> None:
    for W, N in ((32, 0), (32, 4), (0, 1)):  # ring, ring + sink, sink only
        _ring_sink_transforms(g, W, N)


def _ring_sink_transforms(g, W: int, N: int) -> None:
    B, H, Hk, D, page = 2, 8, 2, 64, 16
    lens = torch.tensor([20, 75], dtype=torch.int32, device="cuda")
    cache = qattn.PagedKVCache(1, 16, page, Hk, D, "nvfp4", recent_window=W, max_seqs=3, rotate=True,
                               sink_tokens=N, device="cuda")
    table = torch.arange(12, device="cuda", dtype=torch.int32).view(B, 6)
    seqs = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    rope = qattn.RoPE.from_theta(10000.0, D, 128, "neox", device="cuda")
    k_mean = torch.randn(Hk, D, device="cuda", generator=g)
    for b in range(B):
        pos = torch.arange(int(lens[b]), device="cuda")
        k = torch.randn(len(pos), Hk, D, device="cuda", generator=g, dtype=torch.bfloat16)
        slots = table[b, pos // page].long() * page + pos % page
        qattn.write_kv(cache, 0, k, torch.randn_like(k), slots, positions=pos, rope=rope, k_mean=k_mean,
                       seq_slots=torch.full_like(pos, int(seqs[b])))
    q = torch.randn(B, 2, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    for splits in (1, 2):
        out = qattn.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=seqs, num_splits=splits)
        assert torch.isfinite(out).all()
        for ws in ((10, 0), (40, 0), (0, 0)):  # sliding windows: the list's parts cut at the first visible key
            out = qattn.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=seqs, num_splits=splits,
                                                window_size=ws)
            assert torch.isfinite(out).all()
    print(f"ring {W} + sink {N} + rope + smoothing + rotation: insert and decode (+ windows) ran")


def _prefill(g) -> None:
    from qattn.reference.attention import prefill_reference

    q, k, v = (torch.randn(1, n, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for n, h in ((200, 4), (333, 2), (333, 2)))
    for causal in (False, True):
        out = qattn.flash_attn_func(q, k, v, causal=causal)
        ref = prefill_reference(q, k, v, causal=causal, qk_quant="int8")
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-2, ("prefill", causal, err)
        print(f"prefill int8-QK causal={causal}: max rel err {err:.2e}")
    for D in (64, 128):  # Q quantized in the kernel (per_warp), FP8 P.V, both tile heights; and the Q prepass
        qd, kd, vd = (t[..., :D].contiguous() for t in (q, k, v))
        for kw in (dict(pv_dtype="fp8"), dict(granularity="per_block"), dict(balance_qk=True),
                   dict(balance_qk=True, granularity="per_block", smooth_k=False)):
            assert torch.isfinite(qattn.flash_attn_func(qd, kd, vd, causal=True, **kw)).all()
    print("prefill fp8 P.V / per_block / channel balance ran")
    import qattn.interface.prefill as P

    num_sms = P._num_sms
    P._num_sms = lambda dev: 7  # 8 units on "7 SMs": the last one split in 4 over its 24 K/V tiles (split_tail)
    try:
        qs, ks, vs = (torch.randn(1, n, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                      for n, h in ((200, 4), (3000, 2), (3000, 2)))
        out = qattn.flash_attn_func(qs, ks, vs)
        ref = prefill_reference(qs, ks, vs, qk_quant="int8")
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-2, ("prefill split tail", err)
        assert torch.isfinite(qattn.flash_attn_func(qs, ks, vs, pv_dtype="fp8")).all()
    finally:
        P._num_sms = num_sms
    print(f"prefill split tail: max rel err {err:.2e}; fp8 P.V ran")
    lens = [1, 150, 70]
    cu = torch.tensor([0, 1, 151, 221], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(221, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (4, 1, 1))
    for bal in (False, True):
        out = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True, balance_qk=bal)
        assert torch.isfinite(out).all()
    for causal in (False, True):  # FP8 P.V: the varlen V prepass's regions, the kernel's V^T offsets
        out = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=causal, pv_dtype="fp8")
        assert torch.isfinite(out).all()
    print("prefill varlen (16-bit and fp8 P.V) ran")
    for ws, causal in (((100, 0), True), ((64, 64), False), ((150, -1), False)):  # CTAs start past key 0
        out = qattn.flash_attn_func(q, k, v, causal=causal, window_size=ws)
        ref = prefill_reference(q, k, v, causal=causal, qk_quant="int8", window_size=ws)
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-2, ("prefill window", ws, err)
        assert torch.isfinite(qattn.flash_attn_func(q, k, v, causal=causal, window_size=ws, pv_dtype="fp8")).all()
        out = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=causal, window_size=ws)
        assert torch.isfinite(out).all()
        out = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=causal, window_size=ws,
                                           pv_dtype="fp8")
        assert torch.isfinite(out).all()
    print("prefill sliding windows ran")
    for kw in (dict(), dict(pv_dtype="fp8"), dict(granularity="per_block"), dict(balance_qk=True),
               dict(qk_quant=None), dict(window_size=(100, 0))):  # softcap: the K mean read per row
        assert torch.isfinite(qattn.flash_attn_func(q, k, v, causal=True, softcap=2.0, **kw)).all()
    for pv in ("bf16", "fp8"):
        out = qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True, softcap=2.0,
                                           pv_dtype=pv)
        assert torch.isfinite(out).all()
    print("prefill softcap ran")


def _replays(g) -> None:
    """Launch plans (``qattn.interface.launch_plan``): each signature called four times, so its last two calls
    replay the recorded launches with their buffers carved from one workspace."""
    from qattn.interface import launch_plan

    launch_plan.set_enabled(True)
    q = torch.randn(1, 700, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = torch.randn_like(q[:, :, :2]), torch.randn_like(q[:, :, :2])
    for kw in ({}, {"causal": True, "pv_dtype": "fp8"}, {"granularity": "per_block"}):
        outs = [qattn.flash_attn_func(q, k, v, **kw) for _ in range(4)]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), kw
    cu = torch.tensor([0, 300, 700], dtype=torch.int32, device="cuda")
    outs = [qattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 400, 400, pv_dtype="fp8") for _ in range(4)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    cache = qattn.PagedKVCache(2, 12, 16, 2, 128, "nvfp4", device="cuda")
    table = torch.arange(12, device="cuda", dtype=torch.int32).view(2, 6)
    lens = torch.tensor([90, 41], dtype=torch.int32, device="cuda")
    for layer in range(2):
        for _ in range(2):
            kn = torch.randn(96, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
            qattn.write_kv(cache, layer, kn, torch.randn_like(kn), torch.arange(96, device="cuda"))
    qd = torch.randn(2, 1, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    outs = [qattn.flash_attn_with_kvcache(qd, cache, lens, table, layer=1, num_splits=3) for _ in range(4)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert sum(p.hits for p in launch_plan.PLANNERS) >= 10, [p.hits for p in launch_plan.PLANNERS]
    print("launch plan replays ran")


if __name__ == "__main__":
    main()
