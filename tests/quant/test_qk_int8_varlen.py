"""Varlen INT8 Q/K reference: packed sequences, per-sequence groups and means, padded scales."""

import pytest
import torch

from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference


def _packed(lens, H, D, gen, bias=0.0, dtype=torch.bfloat16):
    total = sum(lens)
    x = torch.randn(total, H, D, generator=gen) + bias * torch.randn(1, H, D, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return x.to(dtype), cu


@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_matches_dense_per_sequence(granularity, smooth_k):
    gen = torch.Generator().manual_seed(0)
    lens_q, lens_k = [1, 130, 17, 0, 256], [300, 5, 129, 0, 64]
    q, cu_q = _packed(lens_q, 4, 64, gen)
    k, cu_k = _packed(lens_k, 2, 64, gen, bias=3.0)
    mq, mk = max(lens_q), max(lens_k)
    qi, qs, ki, ks, km = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, mq, mk, granularity=granularity,
                                                           smooth_k=smooth_k)
    nq = 2 * (8 if granularity == "per_warp" else 1)  # ceil(256 / 128) blocks
    assert qi.shape == q.shape and ki.shape == k.shape and qi.dtype == ki.dtype == torch.int8
    assert qs.shape == (5, 4, nq) and ks.shape == (5, 2, 3)  # ceil(300 / 128)
    assert (km is None) == (not smooth_k)
    for i in range(5):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        dq = quantize_qk_int8_reference(q[None, qa:qb], k[None, ka:kb], granularity=granularity, smooth_k=smooth_k)
        assert torch.equal(qi[qa:qb], dq[0][0]) and torch.equal(ki[ka:kb], dq[2][0])
        assert torch.equal(qs[i, :, : dq[1].shape[2]], dq[1][0])
        assert torch.equal(ks[i, :, : dq[3].shape[2]], dq[3][0])
        assert torch.all(qs[i, :, dq[1].shape[2]:] == 0) and torch.all(ks[i, :, dq[3].shape[2]:] == 0)
        if smooth_k:
            assert torch.equal(km[i], dq[4][0])
    if smooth_k:
        assert torch.all(km[3] == 0)  # the empty sequence


def test_groups_do_not_cross_sequences():
    # two sequences of 3 rows: one q warp group (16 rows) per sequence, each with its own amax
    q = torch.zeros(6, 1, 64)
    q[:3] = 1.0
    q[3:] = 100.0
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    qi, qs, ki, ks, km = quantize_qk_int8_varlen_reference(q, q, cu, cu, 3, 3, smooth_k=False)
    assert qs.shape == (2, 1, 8)
    assert qs[0, 0, 0].item() == pytest.approx(1 / 127) and qs[1, 0, 0].item() == pytest.approx(100 / 127)
    assert torch.all(qs[:, :, 1:] == 0) and torch.all(qi == 127) and torch.all(ki == 127)
    # K smoothing per sequence: each sequence is constant, so smoothed K is all zeros
    _, _, ki, ks, km = quantize_qk_int8_varlen_reference(q, q, cu, cu, 3, 3)
    assert torch.all(ki == 0) and torch.all(ks == 0)
    assert torch.all(km[0] == 1.0) and torch.all(km[1] == 100.0)


def test_explicit_mean_and_padding_to_max_seqlen():
    gen = torch.Generator().manual_seed(1)
    q, cu_q = _packed([5, 7], 2, 64, gen)
    k, cu_k = _packed([9, 3], 2, 64, gen)
    # max_seqlen larger than any sequence: more (zero) padding groups
    qi, qs, ki, ks, km = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, 300, 300, block_k=64)
    assert qs.shape == (2, 2, 3 * 8) and ks.shape == (2, 2, 5)
    assert torch.all(qs[:, :, 1:] == 0) and torch.all(ks[:, :, 1:] == 0)
    m = km + 0.5
    _, _, ki2, ks2, km2 = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, 7, 9, block_k=64, k_mean=m)
    assert torch.equal(km2, m)
    dense = quantize_qk_int8_reference(q[None, :5], k[None, :9], block_k=64, k_mean=m[:1])
    assert torch.equal(ki2[:9], dense[2][0]) and torch.equal(ks2[0, :, :1], dense[3][0])


def test_errors():
    gen = torch.Generator().manual_seed(2)
    q, cu = _packed([4, 4], 2, 64, gen)
    call = quantize_qk_int8_varlen_reference
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        call(q, q, cu.long(), cu, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(q, q, cu, torch.tensor([0, 4, 7], dtype=torch.int32), 4, 4)  # does not end at the total
    with pytest.raises(ValueError, match="non-decreasing"):
        call(q, q, torch.tensor([0, 6, 2, 8], dtype=torch.int32), torch.tensor([0, 4, 4, 8], dtype=torch.int32), 8, 4)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        call(q, q, cu, cu, 3, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        call(q, q, cu, torch.tensor([0, 8], dtype=torch.int32), 4, 8)  # sequence counts differ
    with pytest.raises(ValueError, match="q"):
        call(q[None], q, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        call(q, torch.cat([q, q[:, :1]], dim=1), cu, cu, 4, 4)
    with pytest.raises(ValueError, match="k_mean"):
        call(q, q, cu, cu, 4, 4, k_mean=torch.zeros(1, 2, 64))
