"""CPU: inputs that would otherwise reach a kernel (a wrong result, an out-of-bounds access, an obscure error deep
inside) are rejected first, with the argument named, before any launch, the prepass included. CUDA is faked
(capability 9.0, ``is_cuda``) and launches are recorded, so every check that precedes them runs here."""

from __future__ import annotations

import pytest
import torch

import qattn
from qattn.interface.fast_launch import kernel_view
from qattn.layouts.paged import KVLayer, PagedKVCache


@pytest.fixture
def fake_sm90(gpu):
    """CPU tensors pass as CUDA on an SM90 (tests/conftest.py's ``gpu``): 'k prepass' / 'kernel' in launch order."""
    launches = []
    gpu((9, 0), log=launches)
    return launches


def _qkv(B=2, Sq=64, Sk=80, Hq=4, Hkv=2, D=64):
    return (torch.randn(B, Sq, Hq, D, dtype=torch.bfloat16), torch.randn(B, Sk, Hkv, D, dtype=torch.bfloat16),
            torch.randn(B, Sk, Hkv, D, dtype=torch.bfloat16))


@pytest.mark.parametrize("qk_quant", ["int8", None])
@pytest.mark.parametrize("shapes,err", [
    (dict(B=0), "batch"),
    (dict(Sq=0), "seqlen_q"),
    (dict(Sk=0), "seqlen_k"),
    (dict(Hq=0), "num_heads"),
    (dict(D=256), "head_dim"),
])
def test_dense_sizes_checked_before_any_launch(fake_sm90, qk_quant, shapes, err):
    q, k, v = _qkv(**shapes)
    with pytest.raises(ValueError, match=err):
        qattn.flash_attn_func(q, k, v, qk_quant=qk_quant)
    assert fake_sm90 == []


def test_dense_v_and_grid_checked_before_the_k_prepass(fake_sm90):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k and v alike"):
        qattn.flash_attn_func(q, k, v[:1])
    with pytest.raises(ValueError, match="grid limit"):
        qattn.flash_attn_func(*(t.expand(65536, -1, -1, -1) for t in _qkv(B=1, Sq=1, Sk=1)))
    assert fake_sm90 == []
    qattn.flash_attn_func(q, k, v)  # the valid call reaches both launches
    assert fake_sm90 == ["k prepass", "kernel"]


@pytest.mark.parametrize("qk_quant", ["int8", None])
def test_varlen_cu_seqlens_and_max_seqlens_checked_on_every_path(fake_sm90, qk_quant):
    """The 16-bit path (qk_quant=None) took cu_seqlens and max_seqlen unchecked: int64 offsets were read as
    int32 (wrong rows), floats as huge offsets (out of bounds)."""
    q, k, v = (t[0] for t in _qkv(B=1, Sq=200, Sk=200))
    cu = torch.tensor([0, 100, 200], dtype=torch.int32)

    def call(cu_q=cu, cu_k=cu, mq=100, mk=100):
        return qattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, qk_quant=qk_quant)

    for bad in (cu.long(), cu.float(), cu[:1], cu[None]):
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            call(cu_q=bad)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(cu_k=torch.tensor([0, 50, 100, 150, 200], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        call(cu_q=[0, 100, 200])
    for mq in (0, -5, 99, 100.0, None):  # 99: two sequences of 99 rows hold fewer than the 200 packed
        with pytest.raises(ValueError, match="max_seqlen_q"):
            call(mq=mq)
    assert fake_sm90 == []
    call()
    assert fake_sm90[-1] == "kernel"
    n = len(fake_sm90)
    call(mq=10**6, mk=201)  # upper bounds, as in FlashAttention: lowered to the packed total (200)
    assert fake_sm90[n:][-1] == "kernel"


@pytest.mark.parametrize("kw,err", [
    (dict(softmax_scale=float("inf")), "softmax_scale"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(softmax_scale=1e39), "not a normal fp32"),  # times log2 e, past fp32
    (dict(softcap=1e-45), "not a normal fp32"),  # softmax_scale / softcap past fp32
    (dict(softcap=float("inf")), "softcap"),
])
def test_scales_that_do_not_fit_fp32_are_rejected(fake_sm90, kw, err):
    with pytest.raises(ValueError, match=err):
        qattn.flash_attn_func(*_qkv(), **kw)
    assert fake_sm90 == []


@pytest.mark.parametrize("varlen", [False, True])
def test_return_attn_probs(fake_sm90, varlen):
    """FlashAttention 2 / 3's keyword: False passes (the call runs), True is a NotImplementedError."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 64], dtype=torch.int32)

    def call(**kw):
        if varlen:
            return qattn.flash_attn_varlen_func(q[0], k[0, :64], v[0, :64], cu, cu, 64, 64, **kw)
        return qattn.flash_attn_func(q, k, v, **kw)

    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        call(return_attn_probs=True)
    call(return_attn_probs=False)
    assert fake_sm90[-1] == "kernel"


def test_broadcast_inputs_are_copied_not_read_in_place():
    """A stride-0 (``expand``ed) dimension is not handed to the kernels' TMA descriptors / 16-byte loads."""
    k = torch.randn(1, 80, 2, 64, dtype=torch.bfloat16)
    ke = k.expand(3, -1, -1, -1)
    kv = kernel_view(ke)
    assert kv is not ke and kv.is_contiguous() and torch.equal(kv, ke)
    sliced = torch.randn(2, 80, 6, 64, dtype=torch.bfloat16)[:, :, :2]  # strided, in place
    assert kernel_view(sliced) is sliced


def _decode_case(**cache_kw):
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4", **cache_kw)
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    return cache, q, torch.tensor([4, 41], dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)


@pytest.fixture
def fake_decode(monkeypatch):
    from qattn.interface import decode as dec

    launches = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    def kernels(*a, **k):  # a call that got this far would launch: record it and stop
        launches.append("decode")
        raise RuntimeError("launch")

    monkeypatch.setattr(dec, "_kernels", kernels)
    return launches


def test_decode_sizes_and_scales_checked(fake_decode):
    cache, q, lens, table = _decode_case()
    with pytest.raises(ValueError, match="batch"):
        qattn.flash_attn_with_kvcache(q[:0], cache, lens[:0], table[:0])
    with pytest.raises(ValueError, match="num_heads"):
        qattn.flash_attn_with_kvcache(q[:, :, :0], cache, lens, table)
    with pytest.raises(ValueError, match="layer"):
        qattn.flash_attn_with_kvcache(q, cache, lens, table, layer=True)
    for scale in (float("inf"), float("nan"), 1e39):
        with pytest.raises(ValueError, match="softmax_scale"):
            qattn.flash_attn_with_kvcache(q, cache, lens, table, softmax_scale=scale)
    assert fake_decode == []
    with pytest.raises(RuntimeError, match="launch"):  # the valid call gets to its launch
        qattn.flash_attn_with_kvcache(q, cache, lens, table, num_splits=1)
    assert fake_decode == ["decode"]


def test_decode_rotated_cache_checks_q_and_out_before_rotating(fake_decode):
    """A rotated cache multiplies q by its rotation first: a wrong head_dim or out was a shape error inside the
    matmul, or a broadcast into a wrong ``out``."""
    cache, q, lens, table = _decode_case(rotate=True)
    with pytest.raises(ValueError, match="head_dim 64"):
        qattn.flash_attn_with_kvcache(q[..., :64], cache, lens, table)
    with pytest.raises(TypeError, match="out: expected dtype"):
        qattn.flash_attn_with_kvcache(q, cache, lens, table, out=torch.empty(3, *q.shape))
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        qattn.flash_attn_with_kvcache(q, cache, lens, table, out=torch.empty(3, *q.shape, dtype=q.dtype))
    assert fake_decode == []


def test_from_tensors_rejects_misaligned_pools():
    shapes = PagedKVCache.pool_shapes(8, 16, 2, 128, "fp8")
    (shape, dtype) = shapes["k_data"]
    n = torch.Size(shape).numel()
    buf = torch.empty(n + 16, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 16  # a 16-byte aligned start inside buf

    def pool(off):
        return buf[base + off:base + off + n].view(dtype).view(shape)

    def layer(off):
        return KVLayer(pool(off), torch.empty(shape, dtype=dtype), *(torch.empty(*s[0], dtype=s[1]) for s in (
            shapes["k_scale_pool"], shapes["v_scale_pool"])), None, None)

    PagedKVCache.from_tensors([layer(0)], 16, 128, "fp8")
    with pytest.raises(ValueError, match="16-byte boundary"):
        PagedKVCache.from_tensors([layer(4)], 16, 128, "fp8")


@pytest.mark.parametrize("kw", [dict(recent_window=True, max_seqs=2), dict(recent_window=8, max_seqs=True)])
def test_cache_sizes_are_not_bools(kw):
    with pytest.raises(ValueError):
        PagedKVCache(1, 8, 16, 2, 128, "nvfp4", **kw)
