"""CPU: FlashAttention's packed forms (``flash_attn_qkvpacked_func`` and friends) check the packed tensor and
hand its views, uncopied, with every keyword to ``flash_attn_func`` / ``flash_attn_varlen_func``."""

from __future__ import annotations

import pytest
import torch

import qattn
from qattn.interface import prefill


@pytest.fixture
def spy(monkeypatch):
    calls = []

    def record(name):
        def fn(*args, **kwargs):
            calls.append((name, args, kwargs))
            return "out"
        return fn

    monkeypatch.setattr(prefill, "flash_attn_func", record("dense"))
    monkeypatch.setattr(prefill, "flash_attn_varlen_func", record("varlen"))
    return calls


def _same_view(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def test_qkvpacked_passes_the_three_views(spy):
    qkv = torch.randn(2, 33, 3, 4, 64, dtype=torch.bfloat16)
    assert prefill.flash_attn_qkvpacked_func(qkv, causal=True, pv_dtype="fp8", return_lse=True) == "out"
    (name, args, kwargs), = spy
    assert name == "dense" and kwargs == {"causal": True, "pv_dtype": "fp8", "return_lse": True}
    for i, t in enumerate(args):
        assert _same_view(t, qkv[:, :, i])


def test_kvpacked_passes_q_and_the_two_views(spy):
    q = torch.randn(2, 17, 8, 128, dtype=torch.float16)
    kv = torch.randn(2, 40, 2, 2, 128, dtype=torch.float16)
    prefill.flash_attn_kvpacked_func(q, kv, window_size=(64, 0))
    (name, args, kwargs), = spy
    assert name == "dense" and kwargs == {"window_size": (64, 0)} and args[0] is q
    assert _same_view(args[1], kv[:, :, 0]) and _same_view(args[2], kv[:, :, 1])


def test_varlen_qkvpacked_uses_one_cu_seqlens_for_both(spy):
    qkv = torch.randn(50, 3, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    prefill.flash_attn_varlen_qkvpacked_func(qkv, cu, 30, causal=True)
    (name, args, kwargs), = spy
    assert name == "varlen" and kwargs == {"causal": True}
    for i in range(3):
        assert _same_view(args[i], qkv[:, i])
    assert args[3] is cu and args[4] is cu and args[5:] == (30, 30)


def test_varlen_kvpacked_passes_both_cu_seqlens(spy):
    q = torch.randn(30, 8, 64, dtype=torch.bfloat16)
    kv = torch.randn(70, 2, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 70], dtype=torch.int32)
    prefill.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 20, 40, softmax_scale=0.1)
    (name, args, kwargs), = spy
    assert name == "varlen" and kwargs == {"softmax_scale": 0.1} and args[0] is q
    assert _same_view(args[1], kv[:, 0]) and _same_view(args[2], kv[:, 1])
    assert args[3] is cu_q and args[4] is cu_k and args[5:] == (20, 40)


@pytest.mark.parametrize("call,match", [
    (lambda: qattn.flash_attn_qkvpacked_func(torch.zeros(2, 8, 2, 4, 64)), r"qkv: expected shape \(batch, seqlen, 3"),
    (lambda: qattn.flash_attn_qkvpacked_func(torch.zeros(8, 3, 4, 64)), "qkv: expected shape"),
    (lambda: qattn.flash_attn_kvpacked_func(torch.zeros(1, 8, 4, 64), torch.zeros(1, 8, 3, 4, 64)),
     r"kv: expected shape \(batch, seqlen_k, 2"),
    (lambda: qattn.flash_attn_varlen_qkvpacked_func(torch.zeros(8, 2, 4, 64), torch.zeros(2, dtype=torch.int32), 8),
     r"qkv: expected shape \(total, 3"),
    (lambda: qattn.flash_attn_varlen_kvpacked_func(torch.zeros(8, 4, 64), torch.zeros(8, 4, 64), None, None, 8, 8),
     r"kv: expected shape \(total_k, 2"),
])
def test_bad_packing_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_not_a_tensor():
    with pytest.raises(TypeError, match="qkv: expected a torch.Tensor"):
        qattn.flash_attn_qkvpacked_func([1, 2, 3])


def test_packed_views_reach_the_real_checks():
    """No spy: a packed fp32 tensor fails flash_attn_func's own dtype check, so the views really go there."""
    with pytest.raises(TypeError, match="q: expected dtype"):
        qattn.flash_attn_qkvpacked_func(torch.zeros(1, 8, 3, 4, 64))


def test_packed_forms_trace_as_the_prefill_ops():
    """torch.compile(fullgraph=True): the packed forms are views plus the qattn::prefill / prefill_varlen custom
    ops, no graph break (fake shapes on the CPU; the kernels never run here)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * n_out

    def layer(qkv, kv, cu):
        a = qattn.flash_attn_qkvpacked_func(qkv, causal=True)
        b = qattn.flash_attn_kvpacked_func(qkv[:, :, 0], kv)
        c = qattn.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 16, causal=True)
        d = qattn.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], kv[0], cu, cu, 16, 16)
        return a, b, c, d

    qkv = torch.randn(1, 16, 3, 2, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 16, 2, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=record)(qkv, kv, cu)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("qattn.prefill.default" in t for t in targets) == 2
    assert sum("qattn.prefill_varlen" in t for t in targets) == 2
