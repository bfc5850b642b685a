"""CPU: which q / k / v (prefill) and k / v (write_kv) views the kernels read in place, and the strides (in 16-byte
units) their launchers pass. The GPU tests check the results (test_strided_inputs_are_read_in_place,
test_write_strided_inputs)."""

from __future__ import annotations

import torch

from qattn.cute_kernels.kv_insert import _strides16 as insert_strides16
from qattn.interface.prefill import _aligned, _strides16


def _input_view(t):  # what write_kv does with k and v
    from qattn.interface.fast_launch import kernel_view

    return kernel_view(t, offset_limit=2**31)


def _packed(B=2, S=10, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16):
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D).to(dtype)
    return qkv, qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]


def test_prefill_views_pass_through_with_their_strides():
    qkv, q, k, v = _packed()
    for t in (q, k, v):
        assert _aligned(t) is t  # read in place: same tensor object, no copy
    row = 12 * 64 * 2 // 16  # (Hq + 2 Hkv) D bf16 = 1536 bytes
    assert _strides16(q) == (row, 64 * 2 // 16, 10 * row)
    assert _strides16(v) == (row, 8, 10 * row)
    heads_major = torch.randn(2, 4, 10, 64).to(torch.bfloat16).transpose(1, 2)  # head stride S D
    assert _aligned(heads_major) is heads_major
    assert _strides16(heads_major) == (8, 10 * 8, 4 * 10 * 8)
    assert _strides16(q[0]) == (row, 8, 10 * row)  # packed 3-d: the batch stride spans all rows


def test_prefill_contiguous_shortcut_matches_the_general_path():
    for shape, dtype in (((2, 10, 4, 64), torch.bfloat16), ((3, 7, 2, 128), torch.int8), ((15, 4, 64), torch.float16),
                         ((1, 5, 1, 64), torch.bfloat16)):
        t = torch.zeros(shape, dtype=dtype)
        rows, heads = (shape[1], shape[2]) if len(shape) == 4 else (shape[0], shape[1])
        assert _strides16(t, rows, heads) == _strides16(t)
    assert _strides16(None, 5, 2) == (0, 0, 0)


def test_prefill_copies_what_tma_cannot_read():
    flat = torch.randn(2 * 10 * 4 * 64 + 1).to(torch.bfloat16)
    odd = flat[1:].view(2, 10, 4, 64)  # 2-byte aligned data pointer
    c = _aligned(odd)
    assert c is not odd and c.is_contiguous() and c.data_ptr() % 16 == 0 and torch.equal(c, odd)
    strided_last = torch.randn(2, 10, 4, 128).to(torch.bfloat16)[..., ::2]  # last dim not contiguous
    assert _aligned(strided_last).is_contiguous()
    narrow = torch.randn(2, 10, 4 * 64 + 4).to(torch.bfloat16)[:, :, :256].view(2, 10, 4, 64)  # row stride 520 B
    assert _aligned(narrow).is_contiguous()
    size_one = torch.randn(1, 10, 3, 64).to(torch.bfloat16)
    assert _aligned(size_one) is size_one


def test_insert_views_pass_through_with_their_strides():
    qkv = torch.randn(100, 12, 128).to(torch.bfloat16)
    k, v = qkv[:, 8:10], qkv[:, 10:]
    assert _input_view(k) is k and _input_view(v) is v
    assert insert_strides16(k) == (12 * 128 * 2 // 16, 128 * 2 // 16)
    c = torch.randn(100, 2, 128).to(torch.float16)
    assert _input_view(c) is c and insert_strides16(c) == (2 * 128 // 8, 128 // 8)
    assert insert_strides16(qkv[:1, 8:10]) == (2 * 128 // 8, 128 // 8)  # one token: its stride is never used
    odd = torch.randn(2 * 100 * 128 + 1).to(torch.bfloat16)[1:].view(100, 2, 128)
    assert _input_view(odd) is not odd and _input_view(odd).data_ptr() % 16 == 0
