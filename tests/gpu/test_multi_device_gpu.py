"""GPU, two devices: every entry point on a GPU that is not the current one, as a process that drives several
GPUs calls it (pipeline stages, one engine per GPU in threads). Inputs on ``cuda:1`` while ``cuda:0`` is current
must give, on ``cuda:1``, the bits the same call gives on ``cuda:0``, through the normal path and through launch
plans (calls alternate between the devices, so each device's plan is recorded and replayed), inside a CUDA graph
captured on ``cuda:1``, and from two threads driving one device each at the same time; and no call may leave the
current device changed. The first kernel call of the process is made on ``cuda:1`` (run the file in a process of
its own to test that: ``tests/gpu/run_parallel.sh`` does).
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

DEVS = (torch.device("cuda:1"), torch.device("cuda:0"))  # cuda:1 first: the process's first launches go there


@pytest.fixture(autouse=True)
def current_device_0():
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "a call left the current device switched"


def _on(devs, *tensors):
    return [tuple(t.to(d) if isinstance(t, torch.Tensor) else t for t in tensors) for d in devs]


def _same(a, b, what):
    """Bitwise equality of (nested tuples of) tensors living on different devices; ``a`` on cuda:1."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
        return
    if a is None:
        assert b is None, what
        return
    assert a.device == DEVS[0] and b.device == DEVS[1], (what, a.device, b.device)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.cpu().view(bits), b.cpu().view(bits)), f"{what}: cuda:1 differs from cuda:0"


def _qkv(B, S, Hq, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).bfloat16()
    k = (torch.randn(B, S, Hkv, D, generator=g) * 2 + 1).bfloat16()
    v = torch.randn(B, S, Hkv, D, generator=g).bfloat16()
    return q, k, v


PREFILL = [
    ("int8", (2, 700, 4, 4, 128), {}),
    ("int8 causal GQA", (1, 1500, 4, 2, 128), {"causal": True}),
    ("fp8 P.V D64", (2, 600, 4, 4, 64), {"pv_dtype": "fp8"}),
    ("16-bit QK", (1, 500, 2, 2, 128), {"qk_quant": None}),
    ("split tail", (1, 4096, 3, 3, 128), {}),
    ("softcap window", (1, 1200, 2, 2, 128), {"softcap": 20.0, "window_size": (256, 0), "causal": True}),
]


@pytest.mark.parametrize("name,shape,kw", PREFILL, ids=[c[0] for c in PREFILL])
def test_flash_attn_func_on_the_other_device(name, shape, kw):
    import qattn

    for call in range(4):  # normal path, recorded, replayed twice: on each device
        per_dev = _on(DEVS, *_qkv(*shape, seed=call))
        outs = [qattn.flash_attn_func(q, k, v, return_lse=True, **kw) for q, k, v in per_dev]
        _same(outs[0], outs[1], f"{name} call {call}")


def test_varlen_and_prepass_on_the_other_device():
    import qattn
    from qattn.quant import quantize_qk_int8

    lens = [300, 1, 1029, 77]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    for call in range(4):
        q, k, v = (t[0] for t in _qkv(1, sum(lens), 4, 2, 128, seed=10 + call))
        per_dev = _on(DEVS, q, k, v, cu)
        outs = [qattn.flash_attn_varlen_func(q_, k_, v_, c, c, max(lens), max(lens), causal=True,
                                             pv_dtype="fp8" if call % 2 else "bf16")
                for q_, k_, v_, c in per_dev]
        _same(outs[0], outs[1], f"varlen call {call}")
    for granularity in ("per_warp", "per_block"):
        q, k, _ = _qkv(2, 900, 4, 2, 128, seed=20)
        outs = [quantize_qk_int8(q_, k_, granularity=granularity) for q_, k_ in _on(DEVS, q, k)]
        _same(tuple(outs[0]), tuple(outs[1]), f"quantize_qk_int8 {granularity}")


def _cache_and_tokens(fmt, dev, seed, B=3, Hk=2, D=128, P=64, blocks_per_seq=40):
    import qattn

    g = torch.Generator().manual_seed(seed)
    cache = qattn.PagedKVCache(1, B * blocks_per_seq + 2, P, Hk, D, fmt, device=dev)
    lay = cache.layer(0)
    for gs in (lay.k_global_scale, lay.v_global_scale):
        if gs is not None:
            gs.fill_(0.02)
    lens = torch.tensor([2500, 17, 1300][:B], dtype=torch.int32)
    table = torch.randperm(B * blocks_per_seq, generator=g).view(B, blocks_per_seq).to(torch.int32)
    writes = []
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        k = torch.randn(len(pos), Hk, D, generator=g).bfloat16()
        v = torch.randn(len(pos), Hk, D, generator=g).bfloat16()
        writes.append((k, v, table[b, pos // P].long() * P + pos % P))
    q = torch.randn(B, 1, 8, D, generator=g).bfloat16()
    return cache, writes, q, lens, table


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", ("int8", "nvfp4")], ids=str)
def test_kv_cache_calls_on_the_other_device(fmt):
    import qattn

    state = []
    for dev in DEVS:
        cache, writes, q, lens, table = _cache_and_tokens(fmt, dev, seed=1)
        k, v, slots = writes[0]  # 2500 tokens in 4 equal writes: normal path, recorded, replayed twice
        for part in torch.arange(len(slots)).chunk(4):
            qattn.write_kv(cache, 0, k[part].to(dev), v[part].to(dev), slots[part].to(dev))
        for k, v, slots in writes[1:]:
            qattn.write_kv(cache, 0, k.to(dev), v.to(dev), slots.to(dev))
        outs = []
        for call in range(4):  # decode: automatic splits (one long sequence), fixed splits, no split
            for splits in (0, 3, 1):
                outs.append(qattn.flash_attn_with_kvcache(q.to(dev), cache, lens.to(dev), table.to(dev),
                                                          num_splits=splits))
        flat = qattn.flatten_kv(cache, 0, table.to(dev), lens.to(dev))
        lay = cache.layer(0)
        pools = tuple(getattr(lay, n) for n in ("k_data", "v_data", "k_scale_pool", "v_scale_pool"))
        state.append((pools, tuple(outs), flat))
    _same(state[0], state[1], f"{fmt}")


def test_cuda_graph_captured_on_the_other_device():
    import qattn

    dev = DEVS[0]
    cache, writes, q, lens, table = _cache_and_tokens("nvfp4", dev, seed=2)
    for k, v, slots in writes:
        qattn.write_kv(cache, 0, k.to(dev), v.to(dev), slots.to(dev))
    q, lens, table = q.to(dev), lens.to(dev), table.to(dev)
    x = _qkv(1, 1000, 4, 4, 128, seed=3)
    x = tuple(t.to(dev) for t in x)
    eager = (qattn.flash_attn_with_kvcache(q, cache, lens, table), qattn.flash_attn_func(*x, causal=True))
    with torch.cuda.device(dev):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = (qattn.flash_attn_with_kvcache(q, cache, lens, table), qattn.flash_attn_func(*x, causal=True))
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(dev)
    for a, b, what in zip(outs, eager, ("decode", "prefill")):
        assert torch.equal(a, b), f"{what}: graph replay on cuda:1 differs from the eager call"


def test_one_thread_per_device():
    """Two threads, one per device, each calling prefill and decode 12 times at once (each thread's current
    device stays cuda:0: the calls follow their tensors)."""
    import qattn

    work = []
    for dev in DEVS:
        cache, writes, q, lens, table = _cache_and_tokens("nvfp4", dev, seed=4)
        for k, v, slots in writes:
            qattn.write_kv(cache, 0, k.to(dev), v.to(dev), slots.to(dev))
        x = tuple(t.to(dev) for t in _qkv(1, 1300, 4, 2, 128, seed=5))
        args = (q.to(dev), cache, lens.to(dev), table.to(dev))
        work.append((dev, x, args))
    expected = [(qattn.flash_attn_func(*x, causal=True), qattn.flash_attn_with_kvcache(*args)) for _, x, args in work]
    errors = []

    def run(i):
        dev, x, args = work[i]
        try:
            for it in range(12):
                got = (qattn.flash_attn_func(*x, causal=True), qattn.flash_attn_with_kvcache(*args))
                torch.cuda.synchronize(dev)
                for a, b in zip(got, expected[i]):
                    if not torch.equal(a, b):
                        errors.append(f"{dev} iteration {it}: differs")
            if torch.cuda.current_device() != 0:
                errors.append(f"{dev}: thread's current device switched")
        except Exception as e:  # reported below
            errors.append(f"{dev}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
