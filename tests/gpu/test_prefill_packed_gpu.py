"""GPU: FlashAttention's packed forms read their strided views in place and give the same bits (output and LSE)
as ``flash_attn_func`` / ``flash_attn_varlen_func`` on contiguous copies of the same Q, K and V, and an output
close to exact attention."""

from __future__ import annotations

import pytest
import torch

import qattn
from qattn.reference.attention import attention_reference
from tests.gpu.test_prefill_gpu import _nrmse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _launches(monkeypatch) -> list:
    """The (q, k, v) data pointers of every attention-kernel launch from now on."""
    import qattn.interface.prefill as P

    seen, orig = [], P._launch

    def spy(cfg, q_arg, k_arg, v_arg, *rest):
        seen.append((q_arg.data_ptr(), k_arg.data_ptr(), v_arg.data_ptr()))
        return orig(cfg, q_arg, k_arg, v_arg, *rest)

    monkeypatch.setattr(P, "_launch", spy)
    return seen


def _read_in_place(seen, q, v, pv_dtype):
    """The first launch read the caller's Q view (the kernel quantizes Q itself) and, with 16-bit P.V, its V view."""
    assert seen[0][0] == q.data_ptr()
    if pv_dtype == "bf16":
        assert seen[0][2] == v.data_ptr()


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_equals_contiguous(causal, pv_dtype, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    seen = _launches(monkeypatch)
    got = qattn.flash_attn_qkvpacked_func(qkv, causal=causal, pv_dtype=pv_dtype, return_lse=True)
    _read_in_place(seen, qkv[:, :, 0], qkv[:, :, 2], pv_dtype)
    q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
    _same(got, qattn.flash_attn_func(q, k, v, causal=causal, pv_dtype=pv_dtype, return_lse=True))
    assert _nrmse(got[0], attention_reference(q, k, v, causal=causal)) < (0.05 if pv_dtype == "fp8" else 0.02)


@pytest.mark.parametrize("D", [64, 128])
def test_kvpacked_gqa_equals_contiguous(D, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(1, 200, 8, D, device="cuda", dtype=torch.float16, generator=g)
    kv = torch.randn(1, 517, 2, 2, D, device="cuda", dtype=torch.float16, generator=g)
    seen = _launches(monkeypatch)
    got = qattn.flash_attn_kvpacked_func(q, kv, causal=True, return_lse=True)
    _read_in_place(seen, q, kv[:, :, 1], "bf16")
    k, v = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    _same(got, qattn.flash_attn_func(q, k, v, causal=True, return_lse=True))
    assert _nrmse(got[0], attention_reference(q, k, v, causal=True)) < 0.02


@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_varlen_packed_equal_contiguous(pv_dtype, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(5)
    lens = [130, 1, 400]
    cu = torch.tensor([0, 130, 131, 531], dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lens), 3, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    seen = _launches(monkeypatch)
    got = qattn.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True, pv_dtype=pv_dtype,
                                                  return_lse=True)
    _read_in_place(seen, qkv[:, 0], qkv[:, 2], pv_dtype)
    q, k, v = (qkv[:, i].contiguous() for i in range(3))
    _same(got, qattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, pv_dtype=pv_dtype,
                                            return_lse=True))

    kv = qkv[:, 1:].clone()  # (total, 2, heads, dim)
    n = len(seen)
    got_kv = qattn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens), causal=True,
                                                   pv_dtype=pv_dtype, return_lse=True)
    _read_in_place(seen[n:], q, kv[:, 1], pv_dtype)
    _same(got_kv, got)
    for i in range(len(lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        ref = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)[0]
        assert _nrmse(got[0][a:b], ref) < (0.05 if pv_dtype == "fp8" else 0.02)
