"""CPU tests of the INT8 Q/K prepass launchers: argument validation (before anything touches a GPU), the
in-place-or-copy decision for strided inputs and the K-sum grid heuristic."""

import pytest
import torch

from qattn.quant import launch
from qattn.quant.launch import quantize_qk_int8, quantize_qk_int8_varlen


def _qk(B=2, Sq=40, Sk=50, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16):
    return torch.randn(B, Sq, Hq, D).to(dtype), torch.randn(B, Sk, Hkv, D).to(dtype)


def test_dense_errors():
    q, k = _qk()
    with pytest.raises(ValueError, match="granularity"):
        quantize_qk_int8(q, k, granularity="per_thread")
    with pytest.raises(ValueError, match="warp_q"):
        quantize_qk_int8(q, k, block_q=64, warp_q=48)
    with pytest.raises(TypeError, match="smooth_k"):
        quantize_qk_int8(q, k, smooth_k=1)
    with pytest.raises(TypeError, match="q"):
        quantize_qk_int8(q.float(), k)
    with pytest.raises(TypeError, match="k"):
        quantize_qk_int8(q, k.to(torch.int8))
    with pytest.raises(TypeError, match="q"):
        quantize_qk_int8(q.tolist(), k)
    with pytest.raises(ValueError, match="q"):
        quantize_qk_int8(q[0], k)
    qq, kk = _qk(D=96)
    with pytest.raises(ValueError, match="head_dim"):
        quantize_qk_int8(qq, kk)
    with pytest.raises(ValueError, match="num_kv_heads"):
        quantize_qk_int8(q[:, :, :3], k)
    with pytest.raises(ValueError, match="head_dim"):
        quantize_qk_int8(q, torch.randn(2, 50, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        quantize_qk_int8(q, k)  # CPU tensors: a clear error, not a crash


def test_varlen_errors():
    q = torch.randn(10, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="q"):
        quantize_qk_int8_varlen(q[None], k, cu_q, cu_k, 6, 7)
    with pytest.raises(ValueError, match="CUDA"):
        quantize_qk_int8_varlen(q, k, cu_q, cu_k, 6, 7)
    with pytest.raises(ValueError, match="warp_q"):
        quantize_qk_int8_varlen(q, k, cu_q, cu_k, 6, 7, warp_q=3)
    with pytest.raises(TypeError, match="smooth_k"):
        quantize_qk_int8_varlen(q, k, cu_q, cu_k, 6, 7, smooth_k=None)
    # the K-only prepass reads cu_seqlens_q / max_seqlen_q only for balance_q: alone they would be ignored
    for extra in (dict(cu_seqlens_q=cu_q), dict(max_seqlen_q=6), dict(cu_seqlens_q=cu_q, max_seqlen_q=6)):
        with pytest.raises(ValueError, match=r"^cu_seqlens_q / max_seqlen_q: only read with balance_q"):
            launch.quantize_k_int8_varlen(k, cu_k, 7, **extra)


def test_kernel_view_in_place_or_copy():
    base = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)
    # contiguous, and head / seqlen slices keep 16-byte aligned strides: used in place
    assert launch._kernel_view(base) is base
    v = base[:, :, 2:6]
    assert launch._kernel_view(v) is v and launch._strides(v) == (64 * 8 * 128, 8 * 128, 128)
    v = base.transpose(1, 2)  # (B, H, S, D) memory seen as (B, S, H, D) after a transpose back is fine too
    assert launch._kernel_view(v) is v
    # last dimension not contiguous, or a misaligned start: copied
    w = base[..., ::2]
    assert launch._kernel_view(w).is_contiguous()
    flat = torch.randn(1 + 2 * 16 * 4 * 64).to(torch.bfloat16)
    odd = flat[1:].view(2, 16, 4, 64)
    got = launch._kernel_view(odd)
    assert got is not odd and got.data_ptr() % 16 == 0 and torch.equal(got, odd)
    # size-1 dimensions: their strides are never used
    one = base[:1, :1]
    assert launch._strides(one) == (0, 0, 128)


def test_k_chunks():
    # B2 x 16 heads x 8K rows on 132 SMs: ~8 CTAs per SM (32 chunks of 256 rows), chunks a multiple of the step
    n, rows = launch._k_chunks(8192, 32, 64, 132)
    assert n * 32 >= 8 * 132 - 64 and rows % 64 == 0 and n * rows >= 8192 and (n - 1) * rows < 8192
    assert (n, rows) == (32, 256)
    # short sequences: one chunk; long sequences with few heads: at most _MAX_K_CHUNKS (ChunkReduce adds them)
    assert launch._k_chunks(100, 1, 64, 132) == (1, 128)
    n, rows = launch._k_chunks(1 << 20, 1, 64, 132)
    assert n <= launch._MAX_K_CHUNKS == 64 and n * rows >= 1 << 20
    n, rows = launch._k_chunks(1, 4, 64, 132)
    assert n == 1 and rows == 64
    # chunks folded by ChunkReduce anyway: down to 32 KB of rows, at least 128 (128 at head_dim 128 and 256,
    # still 256 at 64); no change where the quantize kernel adds them itself (no fold launch added) or where
    # 8 CTAs per SM bind already
    assert launch._k_chunks(4096, 32, 64, 132, 256, 8) == (32, 128)
    assert launch._k_chunks(4096, 32, 64, 132, 128, 8) == (16, 256)
    assert launch._k_chunks(4096, 32, 64, 132, 512, 8) == (32, 128)
    assert launch._k_chunks(1500, 32, 64, 132, 256, 8) == (6, 256)
    assert launch._k_chunks(8192, 32, 64, 132, 256, 8) == (32, 256)


def test_varlen_rows_count_the_work_in_longest_sequences():
    # equal lengths: sequences x heads, as dense; ragged: the long sequences get the chunks the short ones skip
    assert launch._varlen_rows(4, 4 * 4096, 4096, 16) == 64
    assert launch._varlen_rows(35, 16900, 8000, 16) == 3 * 16
    assert launch._varlen_rows(65, 16384 + 64 * 128, 16384, 8) == 2 * 8
    assert launch._varlen_rows(3, 0, 0, 2) == 2  # nothing to do: still a valid grid
    n_ragged, _ = launch._k_chunks(8000, launch._varlen_rows(35, 16900, 8000, 16), 64, 132)
    n_padded, _ = launch._k_chunks(8000, 35 * 16, 64, 132)
    assert n_ragged > 5 * n_padded


def test_k_cluster_plan_only_while_its_clusters_fit_one_wave():
    assert launch.k_cluster_plan(128, 128, 8) == (8, 1)
    assert launch.k_cluster_plan(128, 128, 8, units=32, num_sms=132) == (8, 1)
    assert launch.k_cluster_plan(128, 128, 8, units=132, num_sms=132) == (8, 1)  # 8 CTAs per SM
    assert launch.k_cluster_plan(128, 128, 8, units=133, num_sms=132) is None
    assert launch.k_cluster_plan(128, 128, 2, units=300 * 16, num_sms=132) is None  # many short sequences
    assert launch.k_cluster_plan(128, 128, 17) is None  # longer than 2048 keys
