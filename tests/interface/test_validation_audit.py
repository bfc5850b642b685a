"""CPU: a bad argument is named before the "expected CUDA tensors" error that ends every entry point's checks
(on a CPU-only machine that error used to hide it), and typos that a path ignores are still rejected."""

from __future__ import annotations

import pytest
import torch

import qattn
from qattn.layouts.paged import PagedKVCache
from qattn.quant import quantize_qk_int8, quantize_qk_int8_varlen

bf = torch.bfloat16
i32 = torch.int32


@pytest.mark.parametrize("qk_quant", ["int8", None])
def test_granularity_typo_is_named(qk_quant):
    """Was the CUDA-device error on CPU tensors, and ignored with qk_quant=None ("per_thread": SageAttention's)."""
    q, k = torch.randn(1, 64, 4, 64, dtype=bf), torch.randn(1, 64, 2, 64, dtype=bf)
    v = k.clone()
    cu = torch.tensor([0, 64], dtype=i32)
    with pytest.raises(ValueError, match="granularity"):
        qattn.flash_attn_func(q, k, v, qk_quant=qk_quant, granularity="per_thread")
    with pytest.raises(ValueError, match="granularity"):
        qattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 64, 64, qk_quant=qk_quant, granularity="per_thread")


@pytest.mark.parametrize("qk_quant", ["int8", None])
def test_empty_varlen_on_cpu_names_the_prefill_reference(qk_quant):
    """Packed totals of 0 skipped the common device check: the error named the prepass's reference."""
    q, k = torch.randn(0, 4, 64, dtype=bf), torch.randn(0, 2, 64, dtype=bf)
    cu = torch.tensor([0, 0], dtype=i32)
    with pytest.raises(ValueError, match="prefill_reference"):
        qattn.flash_attn_varlen_func(q, k, k.clone(), cu, cu, 0, 0, qk_quant=qk_quant)


def test_decode_checks_precede_the_device_check():
    """The CUDA check came right after q's dtype / rank: every other bad argument read as a device error."""
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    q, lens, table = torch.randn(2, 1, 8, 128, dtype=bf), torch.tensor([4, 41], dtype=i32), torch.zeros(2, 4, dtype=i32)
    call = qattn.flash_attn_with_kvcache
    for args, kw, exc, err in [
        ((torch.randn(2, 1, 3, 128, dtype=bf), cache, lens, table), {}, ValueError, "kv heads"),
        ((torch.randn(2, 17, 8, 128, dtype=bf), cache, lens, table), {}, ValueError, "seqlen_q"),
        ((q, cache, lens.long(), table), {}, TypeError, "cache_seqlens"),
        ((q, cache, lens, table.long()), {}, TypeError, "block_table"),
        ((q, cache, lens, table[:1]), {}, ValueError, "block_table"),
        ((q, cache, lens, table), dict(layer=1), ValueError, "layer"),
        ((q, cache, lens, table), dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        ((q, cache, lens, table), dict(num_splits=-1), ValueError, "num_splits"),
    ]:
        with pytest.raises(exc, match=err):
            call(*args, **kw)
    with pytest.raises(ValueError, match="paged_decode_reference"):
        call(q, cache, lens, table)


def test_write_kv_checks_precede_the_device_check():
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    k, slots = torch.randn(3, 2, 128, dtype=bf), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="slot_mapping"):
        qattn.write_kv(cache, 0, k, k.clone(), slots.int())
    with pytest.raises(ValueError, match="k: expected shape"):
        qattn.write_kv(cache, 0, k[:, :1], k[:, :1].clone(), slots)
    with pytest.raises(ValueError, match="write_kv_reference"):
        qattn.write_kv(cache, 0, k, k.clone(), slots)


def test_quantize_qk_int8_checks_precede_the_device_check():
    q, k = torch.randn(3, 40, 4, 64, dtype=bf), torch.randn(2, 50, 2, 64, dtype=bf)
    with pytest.raises(ValueError, match="batch"):
        quantize_qk_int8(q, k)
    qp, kp, cu = q[0], k[0, :40], torch.tensor([0, 20, 40], dtype=i32)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        quantize_qk_int8_varlen(qp, kp, cu.long(), cu, 20, 20)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        quantize_qk_int8_varlen(qp, kp, cu, cu, 10, 20)
    with pytest.raises(ValueError, match="CUDA"):
        quantize_qk_int8_varlen(qp, kp, cu, cu, 20, 20)


def test_reference_window_size_and_heads_checked():
    """The CPU reference that the device errors name: window_size (-2, 0) was silently unbounded (the kernels
    reject it), a bare int a TypeError from unpacking, and 0 kv heads a ZeroDivisionError."""
    q, k = torch.randn(1, 8, 4, 64), torch.randn(1, 8, 2, 64)
    for ws in ((-2, 0), 3):
        with pytest.raises(ValueError, match="window_size"):
            qattn.reference.prefill_reference(q, k, k, window_size=ws)
    with pytest.raises(ValueError, match="kv heads"):
        qattn.reference.prefill_reference(q, k[:, :, :0], k[:, :, :0])
    qattn.reference.prefill_reference(q, k, k, window_size=(None, 0))  # None: unbounded, as in the kernels


def test_cpu_error_names_the_reference_of_the_call():
    """softcap and FP8 P·V calls: prefill_reference takes neither option, so the CPU error names the one that does;
    a balance_qk + softcap call on CPU tensors got the SM90 kernel's NotImplementedError instead of it."""
    q, k = torch.randn(1, 64, 4, 64, dtype=bf), torch.randn(1, 64, 2, 64, dtype=bf)
    for kw, ref in ((dict(softcap=30.0), "attention_reference"), (dict(softcap=30.0, balance_qk=True), "softcap="),
                    (dict(pv_dtype="fp8"), "prefill_fp8pv_emulation"), ({}, "prefill_reference")):
        with pytest.raises(ValueError, match=ref):
            qattn.flash_attn_func(q, k, k.clone(), **kw)


def test_reference_decode_refuses_a_smoothed_cache_with_softcap():
    """write_kv_reference(k_mean=...) flags the cache as write_kv does, and the reference refuses a cap on it."""
    cache = PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    k = torch.randn(5, 2, 64, dtype=bf)
    qattn.write_kv_reference(cache, 0, k, k.clone(), torch.arange(5), k_mean=torch.zeros(2, 64))
    assert cache.k_smoothed
    q, lens, table = torch.randn(1, 1, 4, 64, dtype=bf), torch.tensor([5], dtype=i32), torch.zeros(1, 1, dtype=i32)
    qattn.reference.paged_decode_reference(q, cache, lens, table)
    with pytest.raises(ValueError, match="smoothed"):
        qattn.reference.paged_decode_reference(q, cache, lens, table, softcap=20.0)


def test_inputs_that_need_a_gradient_are_refused():
    """No backward: q, k or v requiring grad (with grad mode on) would silently get no gradient; under no_grad the
    same call proceeds (to the CPU machine's device error)."""
    q, k = torch.randn(1, 64, 4, 64, dtype=bf), torch.randn(1, 64, 2, 64, dtype=bf)
    cu = torch.tensor([0, 64], dtype=i32)
    cache = PagedKVCache(1, 8, 16, 2, 64, "nvfp4")
    lens, table = torch.tensor([4], dtype=i32), torch.zeros(1, 4, dtype=i32)
    calls = [lambda q, k: qattn.flash_attn_func(q, k, k),
             lambda q, k: qattn.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 64, 64),
             lambda q, k: qattn.flash_attn_with_kvcache(q[:, :1], cache, lens, table)]
    for i, call in enumerate(calls):
        for qg, kg in ((True, False), (False, True)) if i < 2 else ((True, False),):
            with pytest.raises(RuntimeError, match="forward-only"):
                call(q.clone().requires_grad_(qg), k.clone().requires_grad_(kg))
            with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
                call(q.clone().requires_grad_(qg), k.clone().requires_grad_(kg))


def test_flatten_kv_checks_precede_the_device_check():
    cache = PagedKVCache(1, 8, 16, 2, 64, "nvfp4")
    lens, table = torch.tensor([4], dtype=i32), torch.zeros(1, 4, dtype=i32)
    with pytest.raises(TypeError, match="block_table"):
        qattn.flatten_kv(cache, 0, table.long(), lens)
    with pytest.raises(ValueError, match="max_seqlen"):
        qattn.flatten_kv(cache, 0, table, lens, max_seqlen=2)
    with pytest.raises(ValueError, match="flatten_kv_reference"):
        qattn.flatten_kv(cache, 0, table, lens)
