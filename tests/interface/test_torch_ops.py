"""Custom ops: torch.compile(fullgraph=True) traces a decode step (insert + attention) into qattn ops.

On the CPU this checks tracing only (the backend records the graph and never runs the kernels); the GPU test
in tests/gpu/test_torch_compile_gpu.py runs the compiled step.
"""

import torch

import qattn
from qattn.interface.torch_ops import _parse, format_str
from qattn.layouts import FORMAT_NAMES, kv_format


def test_format_strings_round_trip():
    for name in FORMAT_NAMES:
        for rule in ((None,) if not name.startswith("mxfp4") else ("floor", "rceil")):
            f = kv_format(name, scale_rule=rule)
            assert _parse(format_str(f)) == f


def test_decode_step_traces_into_custom_ops_without_breaks():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * n_out  # placeholders: the kernels never run on the CPU

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


def test_transformed_step_traces_without_breaks():
    """RoPE + smoothing at insert and a rotated cache (q rotated before, output rotated back after the decode op):
    still one graph with the two qattn ops, and the rotation pre/post steps are plain traced torch ops."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * n_out

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
    compiled(q, k, k.clone(), slots, pos, lens, table)
    assert len(graphs) == 1
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
                                 gs[0], gs[1], None, None, None, torch.empty(3, dtype=torch.long), "nvfp4", "nvfp4",
                                 16, torch.empty(10, 64), "neox", torch.empty(2, 64), torch.empty(64), 0)
