"""Custom ops: torch.compile(fullgraph=True) traces a decode step (insert + attention) into qattn ops.

On the CPU this checks tracing only (the backend records the graph and never runs the kernels); the GPU test
in tests/gpu/test_torch_compile_gpu.py runs the compiled step.
"""

import pytest
import torch

import qattn
from qattn.interface.torch_ops import _parse, format_str
from qattn.layouts import FORMAT_NAMES, kv_format


def _recorder():
    """(graphs, backend): a torch.compile backend that records each graph and returns placeholders (the kernels
    never run on the CPU)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * n_out

    return graphs, record


def _decode_step_inputs():
    """(cache, q, lens, table): a one-layer nvfp4 cache and one decode step of two sequences (4 and 41 keys)."""
    cache = qattn.PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    return cache, q, lens, table


def test_format_strings_round_trip():
    for name in FORMAT_NAMES:
        for rule in ((None,) if not name.startswith("mxfp4") else ("floor", "rceil")):
            f = kv_format(name, scale_rule=rule)
            assert _parse(format_str(f)) == f
            if f.payload == "e2m1":
                fs = kv_format(f, scale_search="msenb")
                assert _parse(format_str(fs)) == fs and fs != f


def test_decode_step_traces_into_custom_ops_without_breaks():
    graphs, record = _recorder()

    cache = qattn.PagedKVCache(1, 8, 16, 2, 128, ("int8", "nvfp4"))
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 128, dtype=torch.bfloat16)
    slots = torch.tensor([3, 40])
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)

    def step(q, k, v, slots, lens, table):
        qattn.write_kv(cache, 0, k, v, slots)
        return qattn.flash_attn_with_kvcache(q, cache, lens, table)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=record)  # fullgraph: a graph break raises
    compiled(q, k, k.clone(), slots, lens, table)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("qattn.write_kv" in t for t in targets) and any("qattn.paged_decode" in t for t in targets)


def test_windowed_steps_trace_with_their_window():
    """window_size reaches the decode and prefill ops as two ints (one graph, no break)."""
    graphs, record = _recorder()

    cache, q, lens, table = _decode_step_inputs()
    qp = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    kp = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)

    def step(q, lens, table, qp, kp):
        return (qattn.flash_attn_with_kvcache(q, cache, lens, table, window_size=(16, 0)),
                qattn.flash_attn_func(qp, kp, kp, causal=True, window_size=(32, 0)))

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=record)(q, lens, table, qp, kp)
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "qattn" in str(n.target)]
    decode = next(n for n in calls if "paged_decode" in str(n.target))
    prefill = next(n for n in calls if "qattn.prefill" in str(n.target))
    assert tuple(decode.args[-2:]) == (16, 0) and tuple(prefill.args[-2:]) == (32, 0)


def test_softcap_reaches_the_decode_op_and_smoothed_caches_refuse_it():
    """softcap reaches the paged decode op (one graph); a cache that write_kv smoothed refuses a softcap."""
    graphs, record = _recorder()
    cache, q, lens, table = _decode_step_inputs()

    def step(q, lens, table):
        return qattn.flash_attn_with_kvcache(q, cache, lens, table, softcap=50.0)

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=record)(q, lens, table)
    assert len(graphs) == 1
    decode = next(n for n in graphs[0].graph.nodes if n.op == "call_function" and "paged_decode" in str(n.target))
    assert decode.kwargs["softcap"] == 50.0
    assert not cache.k_smoothed
    cache.k_smoothed = True  # what write_kv(k_mean=...) sets
    with pytest.raises(ValueError, match="softcap: this cache's K was smoothed"):
        qattn.flash_attn_with_kvcache(q, cache, lens, table, softcap=50.0)
    for bad in (-1.0, float("nan"), "50"):
        with pytest.raises(ValueError, match="softcap"):
            qattn.flash_attn_with_kvcache(q, qattn.PagedKVCache(1, 8, 16, 2, 128, "nvfp4"), lens, table, softcap=bad)


def test_softcap_reaches_the_prefill_ops():
    """softcap reaches the dense and varlen prefill ops (one graph, no break)."""
    graphs, record = _recorder()
    qp = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    kp = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)

    def step(qp, kp, cu):
        return (qattn.flash_attn_func(qp, kp, kp, causal=True, softcap=30.0),
                qattn.flash_attn_varlen_func(qp[0], kp[0], kp[0], cu, cu, 34, 34, softcap=50.0))

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=record)(qp, kp, cu)
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "qattn" in str(n.target)]
    dense = next(n for n in calls if str(n.target).endswith("qattn.prefill.default"))
    varlen = next(n for n in calls if "prefill_varlen" in str(n.target))
    assert dense.kwargs["softcap"] == 30.0 and varlen.kwargs["softcap"] == 50.0


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 2, 8, 64, dtype=torch.float16)
        pools = [torch.empty(4, 2, 16, 32, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.empty(4, 2, 16, 4, dtype=torch.uint8) for _ in range(2)]
        gs = [torch.empty(2) for _ in range(2)]
        out, lse = torch.ops.qattn.paged_decode(q, pools[0], pools[1], scales[0], scales[1], gs[0], gs[1],
                                                torch.empty(3, dtype=torch.int32), torch.empty(3, 5, dtype=torch.int32),
                                                "nvfp4", "nvfp4", 16, 0.125, True, 0)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (3, 8, 2) and lse.dtype == torch.float32
        # a transposed q (heads-major memory, two query rows): the real op returns a contiguous out, so must the fake
        qt = torch.empty(3, 8, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
        out, _ = torch.ops.qattn.paged_decode(qt, pools[0], pools[1], scales[0], scales[1], gs[0], gs[1],
                                              torch.empty(3, dtype=torch.int32), torch.empty(3, 5, dtype=torch.int32),
                                              "nvfp4", "nvfp4", 16, 0.125, True, 0)
        assert not qt.is_contiguous() and out.shape == qt.shape and out.is_contiguous()


def test_ring_decode_step_traces_with_seq_slots():
    """A cache with a recent-token window: seq_slots reach the decode op (with the rings) in the traced graph."""
    graphs, record = _recorder()

    cache = qattn.PagedKVCache(1, 8, 16, 2, 64, "nvfp4", recent_window=32, max_seqs=4)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    slots, pos = torch.tensor([3, 40]), torch.tensor([3, 8])
    tok_seqs = torch.tensor([2, 0])  # write_kv: int64 per token
    seqs = tok_seqs.to(torch.int32)  # decode: int32 per batch row
    lens = torch.tensor([4, 9], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [2, 4, 5]], dtype=torch.int32)

    def step(q, k, v, slots, tok_seqs, pos, seqs, lens, table):
        qattn.write_kv(cache, 0, k, v, slots, seq_slots=tok_seqs, positions=pos)
        return qattn.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=seqs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=record)
    compiled(q, k, k.clone(), slots, tok_seqs, pos, seqs, lens, table)
    assert len(graphs) == 1
    dec = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "qattn.paged_decode" in str(n.target)]
    assert len(dec) == 1
    args = list(dec[0].args) + list(dec[0].kwargs.values())
    assert sum(1 for a in args if isinstance(a, torch.fx.Node)) >= 9 + 3  # q, pools, scales, lens, table + rings, slots


def test_sink_decode_step_traces_with_seq_slots():
    """A cache with sink tokens (and a window): one graph; the sink buffers reach both ops."""
    graphs, record = _recorder()

    for window in (0, 32):
        cache = qattn.PagedKVCache(1, 8, 16, 2, 64, "nvfp4", recent_window=window, sink_tokens=2, max_seqs=4)
        q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
        k = torch.randn(2, 2, 64, dtype=torch.bfloat16)
        slots, pos = torch.tensor([1, 40]), torch.tensor([1, 8])
        tok_seqs = torch.tensor([2, 0])
        seqs = tok_seqs.to(torch.int32)
        lens = torch.tensor([2, 9], dtype=torch.int32)
        table = torch.tensor([[0, 1, 2], [2, 4, 5]], dtype=torch.int32)

        def step(q, k, v, slots, tok_seqs, pos, seqs, lens, table):
            qattn.write_kv(cache, 0, k, v, slots, seq_slots=tok_seqs, positions=pos)
            return qattn.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=seqs)

        graphs.clear()
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=record)
        compiled(q, k, k.clone(), slots, tok_seqs, pos, seqs, lens, table)
        assert len(graphs) == 1
        ops = [n for n in graphs[0].graph.nodes if n.op == "call_function"
               and ("qattn.paged_decode" in str(n.target) or "qattn.write_kv" in str(n.target))]
        assert len(ops) == 2
        for n in ops:  # the two sink buffers are graph inputs of both ops
            args = list(n.args) + list(n.kwargs.values())
            names = {a.name for a in args if isinstance(a, torch.fx.Node)}
            assert sum("sink" in nm for nm in names) == 2, names


def test_fake_shapes_with_sink():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 1, 8, 128, dtype=torch.bfloat16)
        pools = [torch.empty(4, 2, 16, 64, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.empty(4, 2, 16, 8, dtype=torch.uint8) for _ in range(2)]
        gs = [torch.empty(2) for _ in range(2)]
        sinks = [torch.empty(5, 2, 1, 128, dtype=torch.bfloat16) for _ in range(2)]
        out, lse = torch.ops.qattn.paged_decode(q, pools[0], pools[1], scales[0], scales[1], gs[0], gs[1],
                                                torch.empty(3, dtype=torch.int32), torch.empty(3, 5, dtype=torch.int32),
                                                "nvfp4", "nvfp4", 16, 0.125, True, 0, None, None,
                                                torch.empty(3, dtype=torch.int32), sinks[0], sinks[1])
        assert out.shape == q.shape and lse.shape == (3, 8, 1)
        torch.ops.qattn.write_kv(torch.empty(2, 2, 128, dtype=torch.bfloat16),
                                 torch.empty(2, 2, 128, dtype=torch.bfloat16), torch.empty(2, dtype=torch.int64),
                                 pools[0], pools[1], scales[0], scales[1], gs[0], gs[1], None, None, sinks[0],
                                 sinks[1], torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64),
                                 "nvfp4", "nvfp4", 16)


def test_fake_shapes_with_ring():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 4, 32, 128, dtype=torch.bfloat16)
        pools = [torch.empty(4, 2, 16, 64, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.empty(4, 2, 16, 8, dtype=torch.uint8) for _ in range(2)]
        gs = [torch.empty(2) for _ in range(2)]
        rings = [torch.empty(5, 2, 64, 128, dtype=torch.bfloat16) for _ in range(2)]
        out, lse = torch.ops.qattn.paged_decode(q, pools[0], pools[1], scales[0], scales[1], gs[0], gs[1],
                                                torch.empty(3, dtype=torch.int32), torch.empty(3, 5, dtype=torch.int32),
                                                "nvfp4", "nvfp4", 16, 0.125, True, 0, rings[0], rings[1],
                                                torch.empty(3, dtype=torch.int32))
        assert out.shape == q.shape and lse.shape == (3, 32, 4)


def test_seq_slots_validation_on_host():
    from qattn.interface.decode import _check_seq_slots

    ring = qattn.PagedKVCache(1, 4, 16, 2, 64, "nvfp4", recent_window=16, max_seqs=3)
    plain = qattn.PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    dev = torch.device("cpu")
    ok = torch.tensor([2, 0], dtype=torch.int32)
    _check_seq_slots(ring, ok, 2, dev)
    _check_seq_slots(plain, None, 2, dev)
    with pytest.raises(ValueError, match="seq_slots: the cache keeps"):
        _check_seq_slots(ring, None, 2, dev)
    with pytest.raises(ValueError, match="seq_slots: the cache has no recent-token window and no sink"):
        _check_seq_slots(plain, ok, 2, dev)
    with pytest.raises(TypeError, match="seq_slots"):
        _check_seq_slots(ring, ok.long(), 2, dev)
    with pytest.raises(ValueError, match=r"seq_slots: expected shape \(3,\)"):
        _check_seq_slots(ring, ok, 3, dev)
    with pytest.raises(ValueError, match="seq_slots: expected a contiguous"):
        _check_seq_slots(ring, torch.zeros(4, dtype=torch.int32)[::2], 2, dev)
    with pytest.raises(TypeError, match="seq_slots"):
        _check_seq_slots(ring, [2, 0], 2, dev)
    sink = qattn.PagedKVCache(1, 4, 16, 2, 64, "nvfp4", sink_tokens=1, max_seqs=3)
    _check_seq_slots(sink, ok, 2, dev)
    with pytest.raises(ValueError, match="seq_slots: the cache keeps the first 1 tokens"):
        _check_seq_slots(sink, None, 2, dev)


def test_transformed_step_traces_without_breaks():
    """RoPE + smoothing at insert and a rotated cache (q rotated before, output rotated back after the decode op):
    still one graph with the two qattn ops, and the rotation pre/post steps are plain traced torch ops."""
    graphs, record = _recorder()

    cache = qattn.PagedKVCache(1, 8, 16, 2, 128, "nvfp4", rotate=True, rotation_seed=3)
    rope = qattn.RoPE.from_theta(10000.0, 64, 256, "gptj")
    k_mean = torch.randn(2, 128)
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 128, dtype=torch.bfloat16)
    slots = torch.tensor([3, 40])
    pos = torch.tensor([3, 40])
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)

    def step(q, k, v, slots, pos, lens, table):
        qattn.write_kv(cache, 0, k, v, slots, positions=pos, rope=rope, k_mean=k_mean)
        return qattn.flash_attn_with_kvcache(q, cache, lens, table)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=record)
    assert not cache.k_smoothed
    compiled(q, k, k.clone(), slots, pos, lens, table)
    assert len(graphs) == 1
    assert cache.k_smoothed  # the host-side flag write_kv(k_mean=...) sets survives tracing (softcap refuses it)
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in nodes]
    assert any("qattn.write_kv" in t for t in targets) and any("qattn.paged_decode" in t for t in targets)
    wk = next(n for n in nodes if "qattn.write_kv" in str(n.target))
    assert "gptj" in [a for a in list(wk.args) + list(wk.kwargs.values()) if isinstance(a, str)]


def test_write_kv_fake_accepts_transform_args():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        k = torch.empty(3, 2, 64, dtype=torch.bfloat16)
        pools = [torch.empty(4, 2, 16, 32, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.empty(4, 2, 16, 4, dtype=torch.uint8) for _ in range(2)]
        gs = [torch.empty(2) for _ in range(2)]
        torch.ops.qattn.write_kv(k, k, torch.empty(3, dtype=torch.long), pools[0], pools[1], scales[0], scales[1],
                                 gs[0], gs[1], None, None, None, None, None, torch.empty(3, dtype=torch.long),
                                 "nvfp4", "nvfp4",
                                 16, torch.empty(10, 64), "neox", torch.empty(2, 64), torch.empty(64), 0)


def test_mutated_arguments_take_no_default():
    """torch 2.11's dispatcher drops trailing arguments equal to their defaults before its in-place version bump
    indexes the mutated ones: a mutated argument with a default raised IndexError under torch.compile there."""
    for name in ("write_kv", "paged_decode", "prefill", "prefill_varlen", "flatten_kv", "quantize_qk_int8",
                 "quantize_qk_int8_varlen", "quantize_v_fp8", "quantize_v_fp8_varlen"):
        schema = getattr(torch.ops.qattn, name).default._schema
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                assert not arg.has_default_value(), f"qattn::{name}: mutated argument {arg.name} has a default"


def test_flatten_kv_traces_into_its_custom_op():
    """flatten_kv(..., max_seqlen=N) traces as qattn::flatten_kv (fullgraph); without max_seqlen a clear error."""
    graphs, record = _recorder()

    cache = qattn.PagedKVCache(1, 8, 16, 2, 64, "nvfp4")
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda lens, table: qattn.flatten_kv(cache, 0, table, lens, max_seqlen=48),
                             fullgraph=True, backend=record)
    compiled(lens, table)
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("qattn.flatten_kv" in t for t in targets)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pass max_seqlen"):
        torch.compile(lambda lens, table: qattn.flatten_kv(cache, 0, table, lens), fullgraph=True,
                      backend=record)(lens, table)
    with pytest.raises(ValueError, match="max_seqlen"):
        qattn.flatten_kv(cache, 0, table, lens, max_seqlen=-1)


def test_flatten_kv_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pools = [torch.empty(4, 2, 16, 32, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.empty(4, 2, 16, 4, dtype=torch.uint8) for _ in range(2)]
        gs = [torch.empty(2) for _ in range(2)]
        k, v = torch.ops.qattn.flatten_kv(pools[0], pools[1], scales[0], scales[1], gs[0], gs[1],
                                          torch.empty(3, 5, dtype=torch.int32), torch.empty(3, dtype=torch.int32),
                                          "nvfp4", "nvfp4", 16, 70)
        assert k.shape == v.shape == (3, 70, 2, 64) and k.dtype == torch.bfloat16


@pytest.mark.parametrize("granularity,smooth_k", [("per_warp", True), ("per_block", False)])
@pytest.mark.parametrize("balance_qk", [False, True])
def test_prepass_fake_shapes_equal_the_references(granularity, smooth_k, balance_qk):
    """The prepass ops' fake outputs have the shapes and dtypes of the exact references' outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qattn.quant import quantize_v_fp8_reference, quantize_v_fp8_varlen_reference
    from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 300, 8, 64, generator=g).bfloat16()
    k = torch.randn(2, 200, 2, 64, generator=g).bfloat16()
    ref = quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k, balance_qk=balance_qk)
    cu_q, cu_k = torch.tensor([0, 100, 300], dtype=torch.int32), torch.tensor([0, 150, 200], dtype=torch.int32)
    qv, kv = q[0, :300], k[0, :200]
    ref_v = quantize_qk_int8_varlen_reference(qv, kv, cu_q, cu_k, 200, 150, granularity=granularity,
                                              smooth_k=smooth_k, balance_qk=balance_qk)
    ref_fp8 = quantize_v_fp8_reference(k)
    ref_fp8_varlen = quantize_v_fp8_varlen_reference(kv, cu_k)
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(t) for t in (q, k, qv, cu_q, cu_k))
        outs = torch.ops.qattn.quantize_qk_int8(fq, fk, granularity, smooth_k, 128, 16, 128, balance_qk)
        outs_v = torch.ops.qattn.quantize_qk_int8_varlen(fv, mode.from_tensor(kv), fcq, fck, 200, 150, granularity,
                                                          smooth_k, 128, 16, 128, balance_qk)
        outs_fp8 = torch.ops.qattn.quantize_v_fp8(fk)
        outs_fp8_varlen = torch.ops.qattn.quantize_v_fp8_varlen(mode.from_tensor(kv), fck, 150)
    assert len(outs) == len(outs_v) == 6 and len(ref) == len(ref_v) == (6 if balance_qk else 5)
    if not balance_qk:  # the op's qk_balance slot is an empty tensor
        assert outs[5].numel() == outs_v[5].numel() == 0
    for fake, real in (list(zip(outs, ref)) + list(zip(outs_v, ref_v)) + list(zip(outs_fp8, ref_fp8))
                       + list(zip(outs_fp8_varlen, ref_fp8_varlen))):
        if real is None:
            assert fake.numel() == 0  # no smoothing: an empty k_mean, None from the public function
        else:
            assert fake.shape == real.shape and fake.dtype == real.dtype


def test_prepass_traces_into_custom_ops():
    from qattn.quant import quantize_qk_int8, quantize_v_fp8, quantize_v_fp8_varlen

    graphs, record = _recorder()
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)

    def prepass(q, k):
        qi, qs, ki, ks, km = quantize_qk_int8(q, k, smooth_k=False)
        assert km is None
        return qi, qs, ki, ks, quantize_v_fp8(k), quantize_v_fp8_varlen(k[0], cu, 44)

    torch._dynamo.reset()
    torch.compile(prepass, fullgraph=True, backend=record)(torch.randn(1, 64, 4, 64).bfloat16(),
                                                            torch.randn(1, 64, 2, 64).bfloat16())
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("qattn.quantize_qk_int8" in t for t in targets) and any("qattn.quantize_v_fp8" in t for t in targets)
    assert any("qattn.quantize_v_fp8_varlen" in t for t in targets)


def test_traced_max_seqlen_must_be_an_int():
    """Under torch.compile a float max_seqlen raises as in eager mode (int() would truncate it silently)."""
    from qattn.quant import quantize_qk_int8_varlen, quantize_v_fp8_varlen

    graphs, record = _recorder()
    qp = torch.randn(64, 4, 64, dtype=torch.bfloat16)
    kp = torch.randn(64, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    calls = {
        "max_seqlen_q": lambda: qattn.flash_attn_varlen_func(qp, kp, kp, cu, cu, 44.0, 44),
        "max_seqlen_k": lambda: qattn.flash_attn_varlen_func(qp, kp, kp, cu, cu, 44, 44.9),
        "max_seqlen_q ": lambda: quantize_qk_int8_varlen(qp, kp, cu, cu, 44.5, 44),
        "max_seqlen_k ": lambda: quantize_v_fp8_varlen(kp, cu, 44.0),
    }  # (flatten_kv checks its max_seqlen before it branches on compiling)
    for name, call in calls.items():
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"{name.strip()}: expected an int"):
            torch.compile(call, fullgraph=True, backend=record)()
    torch._dynamo.reset()
    torch.compile(lambda: qattn.flash_attn_varlen_func(qp, kp, kp, cu, cu, 44, 44), fullgraph=True,
                  backend=record)()
    assert any("prefill_varlen" in str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function")
