"""GPU: launch plans (``qattn.interface.launch_plan``). A signature's third and later ``flash_attn_func`` /
``flash_attn_varlen_func`` calls replay the launches recorded at its second; they must give the bits the normal
path gives on the same inputs, whatever the inputs' data (and varlen ``cu_seqlens`` contents), with the replay's
buffers poisoned, inside a CUDA graph and on another stream."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launch_plans,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEFAULTS = dict(causal=False, softmax_scale=None, qk_quant="int8", granularity="per_warp", smooth_k=True,
                pv_dtype="bf16", balance_qk=False, dropout_p=0.0, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False)


@pytest.fixture
def poison_replays(monkeypatch):
    from qattn.interface import launch_plan

    def empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype in (torch.uint8, torch.int8, torch.int32):
            return t.fill_(-1 if dtype != torch.uint8 else 0xFF)
        return t.fill_(float("nan"))

    monkeypatch.setattr(launch_plan, "_empty", empty)


def _qkv(B, S, Hq, Hkv, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, Hq, D, device="cuda", generator=g).to(dtype)
    k = (torch.randn(B, S, Hkv, D, device="cuda", generator=g) * 2 + 1).to(dtype)
    v = torch.randn(B, S, Hkv, D, device="cuda", generator=g).to(dtype)
    return q, k, v


def _normal_path(q, k, v, **kw):
    from qattn.interface.prefill import _flash_attn_func

    opts = {**DEFAULTS, **kw}
    return _flash_attn_func(q, k, v, *(opts[n] for n in DEFAULTS))


DENSE = [
    ("int8", (2, 1000, 4, 4, 128), {}),
    ("int8 causal GQA", (2, 1000, 4, 2, 128), {"causal": True}),
    ("fp8 D64", (2, 700, 4, 4, 64), {"pv_dtype": "fp8"}),
    ("fp8 causal", (1, 3000, 2, 1, 128), {"pv_dtype": "fp8", "causal": True}),
    ("16-bit QK", (2, 500, 4, 4, 128), {"qk_quant": None}),
    ("per_block", (2, 600, 4, 4, 128), {"granularity": "per_block"}),
    ("balance", (2, 600, 4, 2, 128), {"balance_qk": True}),
    ("window", (2, 2000, 4, 4, 128), {"window_size": (300, 0)}),
    ("split tail", (1, 4096, 3, 3, 128), {}),  # a partial wave split over keys: zeroed counters in the plan
    ("long causal", (1, 4096, 2, 2, 128), {"causal": True, "softmax_scale": 0.1}),
    ("fp16 no smoothing", (2, 333, 4, 4, 64), {"smooth_k": False}),
    ("softcap GQA", (2, 800, 4, 2, 128), {"softcap": 1.5}),
    ("softcap fp8 causal D64", (1, 1500, 4, 4, 64), {"softcap": 30.0, "pv_dtype": "fp8", "causal": True}),
]


@pytest.mark.parametrize("name,shape,kw", DENSE, ids=[c[0] for c in DENSE])
def test_dense_replay_equals_normal_path(poison_replays, name, shape, kw):
    import qattn
    from qattn.interface import prefill

    dtype = torch.float16 if "fp16" in name else torch.bfloat16
    for call in range(4):  # 1: normal, 2: recorded, 3 and 4: replayed; new data every call
        q, k, v = _qkv(*shape, dtype=dtype, seed=call)
        out, lse = qattn.flash_attn_func(q, k, v, return_lse=True, **kw)
        ref, ref_lse = _normal_path(q, k, v, **kw)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse), f"call {call}"
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert len(prefill._DENSE_PLANS) == 1 and prefill._DENSE_PLANS.hits == 2, prefill._DENSE_PLANS.unplanned


VARLEN = [("int8", {}), ("fp8 causal", {"causal": True, "pv_dtype": "fp8"}), ("16-bit QK", {"qk_quant": None}),
          ("per_block causal", {"granularity": "per_block", "causal": True}),
          ("softcap causal", {"causal": True, "softcap": 1.0})]


@pytest.mark.parametrize("name,kw", VARLEN, ids=[c[0] for c in VARLEN])
def test_varlen_replay_follows_cu_seqlens_contents(poison_replays, name, kw):
    """Same totals, count and maxima, different sequence boundaries every call: read on the device only."""
    import qattn
    from qattn.interface import prefill

    bounds = [[0, 100, 900, 1000, 2500], [0, 1500, 1500, 2000, 2500], [0, 1, 2, 1002, 2500], [0, 700, 1400, 2100, 2500]]
    opts = {**DEFAULTS, **kw}
    for call, b in enumerate(bounds):
        g = torch.Generator(device="cuda").manual_seed(call)
        q = torch.randn(2500, 8, 128, device="cuda", generator=g).bfloat16()
        k = torch.randn(2500, 4, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(2500, 4, 128, device="cuda", generator=g).bfloat16()
        cu = torch.tensor(b, device="cuda", dtype=torch.int32)
        cu_k = cu.clone()
        out, lse = qattn.flash_attn_varlen_func(q, k, v, cu, cu_k, 1500, 1500, return_lse=True, **kw)
        ref, ref_lse = prefill._flash_attn_varlen_func(q, k, v, cu, cu_k, 1500, 1500, *(opts[n] for n in DEFAULTS))
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse), f"call {call}"
    assert len(prefill._VARLEN_PLANS) == 1 and prefill._VARLEN_PLANS.hits == 2, prefill._VARLEN_PLANS.unplanned


def test_packed_qkv_views_and_aliased_inputs():
    import qattn
    from qattn.interface import prefill

    qkv = torch.empty(2, 1024, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    for call in range(4):
        qkv.normal_()
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        assert torch.equal(qattn.flash_attn_func(q, k, v, causal=True), _normal_path(q, k, v, causal=True)[0])
    # q is k is v: another signature (which inputs share an address is part of it), then distinct tensors of the
    # same shapes must not replay the aliased plan
    x = torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        assert torch.equal(qattn.flash_attn_func(x, x, x), _normal_path(x, x, x)[0])
    for call in range(3):
        q, k, v = _qkv(2, 512, 4, 4, 128, seed=call)
        assert torch.equal(qattn.flash_attn_func(q, k, v), _normal_path(q, k, v)[0])
    assert len(prefill._DENSE_PLANS) == 3


def test_misaligned_inputs_stay_on_the_normal_path():
    """An input the kernels cannot read in place is copied first: no plan, the same bits every call."""
    import qattn
    from qattn.interface import prefill

    base = torch.randn(2 * 256 * 4 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    q = base[1:].view(2, 256, 4, 128)  # 2-byte aligned
    _, k, v = _qkv(2, 256, 4, 4, 128)
    ref = _normal_path(q, k, v)[0]
    for _ in range(4):
        assert torch.equal(qattn.flash_attn_func(q, k, v), ref)
    assert len(prefill._DENSE_PLANS) == 0 and prefill._DENSE_PLANS.hits == 0
    assert "device work" in next(iter(prefill._DENSE_PLANS.unplanned.values()))


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_replay_in_a_cuda_graph_and_on_a_side_stream(pv_dtype):
    import qattn

    q, k, v = _qkv(2, 1000, 4, 2, 128, seed=7)
    ref = _normal_path(q, k, v, causal=True, pv_dtype=pv_dtype)[0]
    for _ in range(3):  # the plan exists from here on
        qattn.flash_attn_func(q, k, v, causal=True, pv_dtype=pv_dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out_side = qattn.flash_attn_func(q, k, v, causal=True, pv_dtype=pv_dtype)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out_side, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = qattn.flash_attn_func(q, k, v, causal=True, pv_dtype=pv_dtype)
    q.copy_(_qkv(2, 1000, 4, 2, 128, seed=8)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_graph, _normal_path(q, k, v, causal=True, pv_dtype=pv_dtype)[0])


def test_failing_calls_are_not_recorded():
    import qattn
    from qattn.interface import prefill

    q, k, v = _qkv(1, 128, 2, 2, 128)
    for _ in range(3):
        with pytest.raises(NotImplementedError, match="dropout_p"):
            qattn.flash_attn_func(q, k, v, dropout_p=0.1)
        with pytest.raises(ValueError, match="granularity"):
            qattn.flash_attn_func(q, k, v, granularity="per_thread")
    assert len(prefill._DENSE_PLANS) == 0


def test_plans_off_switch():
    import qattn
    from qattn.interface import prefill

    from qattn.interface import launch_plan

    launch_plan.set_enabled(False)  # (the conftest fixture restores it)
    q, k, v = _qkv(1, 256, 2, 2, 128)
    for _ in range(3):
        qattn.flash_attn_func(q, k, v)
    assert len(prefill._DENSE_PLANS) == 0 and prefill._DENSE_PLANS.hits == 0


# ---- decode and insert ------------------------------------------------------------------------------------
def _cache(fmt, layers=2, window=0, sinks=0, rotate=False, B=4, max_blocks=8, P=16, Hk=4, D=128):
    import qattn

    return qattn.PagedKVCache(layers, B * max_blocks + 4, P, Hk, D, fmt, device="cuda", recent_window=window,
                              max_seqs=B + 2 if (window or sinks) else 0, sink_tokens=sinks, rotate=rotate)


def _clone_cache(cache):
    import dataclasses

    import qattn

    layers = [dataclasses.replace(lay, **{f.name: None if getattr(lay, f.name) is None else getattr(lay, f.name).clone()
                                          for f in dataclasses.fields(lay)})
              for lay in (cache.layer(i) for i in range(cache.num_layers))]
    return qattn.PagedKVCache.from_tensors(layers, cache.page_size, cache.head_dim, (cache.k_format, cache.v_format),
                                           cache.dtype, rotate=cache.rotate, rotation_seed=cache.rotation_seed or 0,
                                           rotation_signs=cache.rotation_signs)


def _same_cache(a, b):
    import dataclasses

    for i in range(a.num_layers):
        for f in dataclasses.fields(a.layer(i)):
            x, y = getattr(a.layer(i), f.name), getattr(b.layer(i), f.name)
            if x is not None and not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
    return True


INSERT = [("nvfp4", {}), ("fp8 ring", {"fmt": "fp8", "window": 32}),
          ("int8+nvfp4 rope smooth", {"fmt": ("int8", "nvfp4")}),
          ("nvfp4 rotate sinks", {"rotate": True, "sinks": 4})]


@pytest.mark.parametrize("name,kw", INSERT, ids=[c[0] for c in INSERT])
def test_write_kv_replay_writes_the_same_bytes(name, kw):
    """Planned writes into one cache, normal-path writes into its clone: every pool byte equal after each call,
    for both layers (the layer is not part of the signature), with new tokens, slots and positions each call."""
    import qattn
    from qattn.interface import kv_cache_ops

    fmt = kw.pop("fmt", "nvfp4")
    cache = _cache(fmt, **kw)
    twin = _clone_cache(cache)
    rope = qattn.RoPE.from_theta(10000.0, 64, 4096, device="cuda") if "rope" in name else None
    ring = bool(cache.recent_window or cache.sink_tokens)
    g = torch.Generator(device="cuda").manual_seed(1)
    for call in range(6):
        layer = call % 2
        n = 16
        k = torch.randn(n, 4, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(n, 4, 128, device="cuda", generator=g).bfloat16()
        slots = torch.randperm(cache.num_blocks * cache.page_size, device="cuda", generator=g)[:n]
        positions = torch.arange(call * n, call * n + n, device="cuda") if (ring or rope is not None) else None
        seq = torch.full((n,), call % 3, dtype=torch.int64, device="cuda") if ring else None
        k_mean = torch.randn(4, 128, device="cuda", generator=g) if "smooth" in name else None
        args = dict(positions=positions, seq_slots=seq, rope=rope, k_mean=k_mean)
        qattn.write_kv(cache, layer, k, v, slots, **args)
        kv_cache_ops._write_kv_eager(twin, layer, k, v, slots, **args)
        assert _same_cache(cache, twin), f"call {call}"
    assert len(kv_cache_ops._INSERT_PLANS) == 1 and kv_cache_ops._INSERT_PLANS.hits == 4, \
        kv_cache_ops._INSERT_PLANS.unplanned


DECODE = [("nvfp4", {}), ("fp8 split", {"fmt": "fp8", "num_splits": 3}),
          ("int8+nvfp4 GQA8 seqlen_q 2", {"fmt": ("int8", "nvfp4"), "sq": 2}),
          ("nvfp4 ring sinks", {"window": 32, "sinks": 4}), ("nvfp4 rotate", {"rotate": True}),
          ("nvfp4 out=", {"out": True}),
          ("fp8 window", {"fmt": "fp8", "window_size": (40, 0)}),
          ("nvfp4 softcap split", {"num_splits": 2, "softcap": 30.0})]


@pytest.mark.parametrize("name,kw", DECODE, ids=[c[0] for c in DECODE])
def test_decode_replay_equals_normal_path(name, kw):
    import qattn
    from qattn.interface import decode

    fmt = kw.get("fmt", "nvfp4")
    cache = _cache(fmt, window=kw.get("window", 0), sinks=kw.get("sinks", 0), rotate=kw.get("rotate", False))
    B, P, maxb = 4, 16, 8
    g = torch.Generator(device="cuda").manual_seed(2)
    ring = bool(cache.recent_window or cache.sink_tokens)
    for layer in range(2):  # fill both layers through the normal path
        for b in range(B):
            pos = torch.arange(P * maxb - 3, device="cuda")
            slots = (b * maxb + pos // P) * P + pos % P
            k = torch.randn(len(pos), 4, 128, device="cuda", generator=g).bfloat16()
            qattn.write_kv(cache, layer, k, torch.randn_like(k), slots,
                           positions=pos if ring else None,
                           seq_slots=torch.full_like(pos, b) if ring else None)
    table = torch.arange(B * maxb, device="cuda", dtype=torch.int32).view(B, maxb)
    seq_slots = torch.arange(B, device="cuda", dtype=torch.int32) if ring else None
    Sq, H = kw.get("sq", 1), 32 if "GQA8" in name else 16
    opts = dict(num_splits=kw.get("num_splits", 0), window_size=kw.get("window_size", (-1, -1)),
                softcap=kw.get("softcap", 0.0))
    for call in range(5):
        layer = call % 2
        q = torch.randn(B, Sq, H, 128, device="cuda", generator=g).bfloat16()
        lens = torch.randint(Sq, P * maxb - 3, (B,), device="cuda", generator=g, dtype=torch.int32)
        if call == 3:  # a block moved: the table is read on the device
            table = table.roll(1, dims=1).contiguous()
        out = torch.full_like(q, float("nan")) if kw.get("out") else None
        o, lse = qattn.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=seq_slots, layer=layer,
                                               return_lse=True, out=out, **opts)
        if out is not None:
            assert o is out
        rq = q if not cache.rotate else qattn.quant.transforms.rotate_query_dense(q, cache.rotation_matrix)
        ro, rlse = decode._flash_attn_with_kvcache_eager(rq, cache, lens, table, seq_slots=seq_slots, layer=layer,
                                                         return_lse=True, **opts)
        if cache.rotate:
            ro = qattn.quant.transforms.unrotate_output_dense(ro, cache.rotation_matrix, None)
        assert torch.equal(o, ro) and torch.equal(lse, rlse), f"call {call}"
    assert len(decode._DECODE_PLANS) >= 1 and decode._DECODE_PLANS.hits >= 2, decode._DECODE_PLANS.unplanned


def test_options_equal_in_value_but_not_in_type_are_checked():
    """After a plan of the defaults exists, arguments that compare equal to them but fail the entry point's
    checks (True for 1, 0 for False, floats in window_size) still raise."""
    import qattn

    q, k, v = _qkv(1, 256, 2, 2, 128)
    for _ in range(3):
        qattn.flash_attn_func(q, k, v, softmax_scale=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        qattn.flash_attn_func(q, k, v, softmax_scale=True)
    with pytest.raises((TypeError, ValueError), match="window_size"):
        qattn.flash_attn_func(q, k, v, softmax_scale=1.0, window_size=(-1.0, -1))


def test_decode_cache_with_one_tensor_for_both_global_scales_is_unplanned():
    """A layer whose K and V global scales are one tensor (from_tensors allows it): its addresses cannot say which
    input a launch meant, so no plan; a cache of the same geometry with separate scales then plans and replays."""
    import dataclasses

    import qattn
    from qattn.interface import decode

    base = _cache("nvfp4", layers=1)
    kv = torch.randn(512, 4, 128, device="cuda").bfloat16()
    qattn.write_kv(base, 0, kv, kv * 0.5, torch.arange(512, device="cuda"))  # every slot the table reaches
    lay = base.layer(0)
    shared = dataclasses.replace(lay, v_global_scale=lay.k_global_scale)
    one = qattn.PagedKVCache.from_tensors([shared], base.page_size, base.head_dim, "nvfp4")
    two = _clone_cache(base)
    two.layer(0).v_global_scale.fill_(0.5)
    table = torch.arange(32, device="cuda", dtype=torch.int32).view(4, 8)
    lens = torch.full((4,), 100, device="cuda", dtype=torch.int32)
    q = torch.randn(4, 1, 16, 128, device="cuda").bfloat16()
    for _ in range(3):
        qattn.flash_attn_with_kvcache(q, one, lens, table)
    assert len(decode._DECODE_PLANS) == 0 and "one address" in next(iter(decode._DECODE_PLANS.unplanned.values()))
    decode._DECODE_PLANS.clear()
    for _ in range(3):
        o = qattn.flash_attn_with_kvcache(q, two, lens, table)
        assert torch.equal(o, decode._flash_attn_with_kvcache_eager(q, two, lens, table))
    assert decode._DECODE_PLANS.hits == 1
