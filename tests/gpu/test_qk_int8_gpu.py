"""GPU tests: the INT8 Q/K prepass kernels (``qattn.quant.quantize_qk_int8`` / ``quantize_qk_int8_varlen``)
against the torch references, bit for bit.

Every output buffer (and the K partial-sum workspace) is poisoned before the launch (int8 -128, which the
kernels never write, and NaN for fp32 / fp64), so any element the kernels fail to write is caught. The
references run on the CPU. ``q_int8`` / ``q_scale`` must equal the reference exactly; ``k_int8`` / ``k_scale``
must equal the reference run with the kernels' own ``k_mean``, and that mean must be within 2 fp32 ulps of the
reference mean (it is normally identical: the kernels sum in fp64, exactly).

Run as a script for a small memcheck case:
``compute-sanitizer --tool memcheck python tests/gpu/test_qk_int8_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from qattn.quant import launch
from qattn.quant import quantize_qk_int8, quantize_qk_int8_varlen
from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.bfloat16, torch.float16]


def _poisoned_alloc(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.int8:
        t.fill_(-128)
    else:
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(launch, "_alloc", _poisoned_alloc)


# ------------------------------------------------------------------------------------------------
# inputs and comparisons
# ------------------------------------------------------------------------------------------------
def _rand(shape, dtype, gen, *, outliers=False, bias=0.0):
    """randn, optionally a per-(head, channel) offset (what K smoothing removes) and a few outlier channels."""
    x = torch.randn(*shape, generator=gen)
    if bias:
        off = torch.randn(*shape[-2:], generator=gen) * bias
        x = x + off
    if outliers:
        D = shape[-1]
        for c in (3, D // 2 + 1, D - 5):
            x[..., c] *= 100
    return x.to(dtype).cuda()


def _assert_int8_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    got = got.cpu()
    assert got.dtype == torch.int8 and got.shape == want.shape, (name, got.shape, want.shape)
    if not torch.equal(got, want):
        bad = torch.nonzero(got != want)
        idx = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {bad.shape[0]} bytes differ, first at {idx}: got {int(got[idx])}, "
                             f"want {int(want[idx])} (poison is -128)")


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape, (name, got.shape, want.shape)
    g, w = got.view(torch.int32), want.view(torch.int32)
    if not torch.equal(g, w):
        bad = torch.nonzero(g != w)
        idx = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {bad.shape[0]} values differ, first at {idx}: got {got[idx].item()!r}, "
                             f"want {want[idx].item()!r}")


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, name: str) -> None:
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.isfinite(got).all(), name
    a = want.abs()
    ulp = torch.nextafter(a, torch.full_like(a, float("inf"))) - a
    err = (got - want).abs()
    assert torch.all(err <= ulps * ulp), f"{name}: max error {(err / ulp).max().item():.1f} ulps"


def _check_dense(q, k, got, *, smooth_k=True, **blocks):
    qi, qs, ki, ks, km = got
    for t in (qi, qs, ki, ks) + ((km,) if km is not None else ()):
        assert t.is_cuda and t.is_contiguous()
    qc, kc = q.cpu(), k.cpu()
    ref = quantize_qk_int8_reference(qc, kc, smooth_k=smooth_k, **blocks)
    _assert_int8_equal(qi, ref[0], "q_int8")
    _assert_bits_equal(qs, ref[1], "q_scale")
    if smooth_k:
        assert km is not None and km.shape == ref[4].shape
        _assert_within_ulps(km, ref[4], 2, "k_mean")
        ref = quantize_qk_int8_reference(qc, kc, smooth_k=True, k_mean=km.cpu(), **blocks)  # the kernel's mean
    else:
        assert km is None
    _assert_int8_equal(ki, ref[2], "k_int8")
    _assert_bits_equal(ks, ref[3], "k_scale")


def _check_varlen(q, k, cu_q, cu_k, max_q, max_k, got, *, smooth_k=True, **blocks):
    qi, qs, ki, ks, km = got
    args = (q.cpu(), k.cpu(), cu_q.cpu(), cu_k.cpu(), max_q, max_k)
    ref = quantize_qk_int8_varlen_reference(*args, smooth_k=smooth_k, **blocks)
    _assert_int8_equal(qi, ref[0], "q_int8")
    _assert_bits_equal(qs, ref[1], "q_scale")
    if smooth_k:
        _assert_within_ulps(km, ref[4], 2, "k_mean")
        ref = quantize_qk_int8_varlen_reference(*args, smooth_k=True, k_mean=km.cpu(), **blocks)
    else:
        assert km is None
    _assert_int8_equal(ki, ref[2], "k_int8")
    _assert_bits_equal(ks, ref[3], "k_scale")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


# ------------------------------------------------------------------------------------------------
# dense
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_dense_outliers(dtype, head_dim, granularity, smooth_k):
    gen = torch.Generator().manual_seed(head_dim + 7 * smooth_k)
    q = _rand((2, 200, 8, head_dim), dtype, gen, outliers=True)
    k = _rand((2, 300, 2, head_dim), dtype, gen, outliers=True, bias=3.0)
    got = quantize_qk_int8(q, k, granularity=granularity, smooth_k=smooth_k)
    assert got[1].shape == (2, 8, 16 if granularity == "per_warp" else 2) and got[3].shape == (2, 2, 3)
    _check_dense(q, k, got, smooth_k=smooth_k, granularity=granularity)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
def test_dense_random(dtype, granularity):
    gen = torch.Generator().manual_seed(11)
    q = _rand((3, 517, 4, 128), dtype, gen)
    k = _rand((3, 1029, 4, 128), dtype, gen, bias=8.0)
    got = quantize_qk_int8(q, k, granularity=granularity)
    _check_dense(q, k, got, granularity=granularity)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 129), (2, 3), (15, 16), (16, 17), (17, 127), (127, 128),
                                   (128, 129), (129, 1), (1000, 333)])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
def test_ragged_lengths(sq, sk, granularity):
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q = _rand((2, sq, 4, 128), torch.bfloat16, gen, outliers=True)
    k = _rand((2, sk, 2, 128), torch.bfloat16, gen, bias=2.0)
    got = quantize_qk_int8(q, k, granularity=granularity)
    _check_dense(q, k, got, granularity=granularity)
    if sk == 1:  # a single key minus its own mean is 0
        assert torch.all(got[2] == 0) and torch.all(got[3] == 0)


@pytest.mark.parametrize("block_q,warp_q,block_k", [(64, 32, 64), (96, 32, 48), (128, 8, 256), (64, 64, 32),
                                                    (256, 16, 512), (48, 16, 7)])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
def test_block_sizes(block_q, warp_q, block_k, granularity):
    gen = torch.Generator().manual_seed(block_q + block_k)
    q = _rand((2, 333, 4, 64), torch.float16, gen, outliers=True)
    k = _rand((2, 555, 4, 64), torch.float16, gen, bias=1.0)
    blocks = dict(granularity=granularity, block_q=block_q, warp_q=warp_q, block_k=block_k)
    got = quantize_qk_int8(q, k, **blocks)
    _check_dense(q, k, got, **blocks)


@pytest.mark.parametrize("sk,hkv", [(5000, 1), (20000, 1), (3000, 3)])
def test_long_k_several_chunks(sk, hkv):
    # the K column sums run in several chunks per (batch, head); the mean stays (within ulps) the exact one
    gen = torch.Generator().manual_seed(sk)
    q = _rand((1, 64, hkv * 2, 128), torch.bfloat16, gen)
    k = _rand((1, sk, hkv, 128), torch.bfloat16, gen, outliers=True, bias=30.0)
    got = quantize_qk_int8(q, k)
    _check_dense(q, k, got)


@pytest.mark.parametrize("sk,hkv,varlen", [(700, 2, False), (2048, 4, False), (5000, 1, False), (3000, 2, True)])
def test_chunk_sums_added_by_the_quantize_kernel_or_chunk_reduce_alike(monkeypatch, sk, hkv, varlen):
    # up to _SUM_IN_QUANT_MAX_CHUNKS partial sums the K quantize kernel adds them itself, above it ChunkReduce
    # does (one launch more): the same order, so the same mean and bytes, whichever path runs
    gen = torch.Generator().manual_seed(sk + hkv)
    k = _rand((1, sk, hkv, 128), torch.bfloat16, gen, outliers=True, bias=20.0)
    monkeypatch.setattr(launch, "k_cluster_plan", lambda *a: None)  # the two-kernel path at any length
    outs = []
    for limit in (0, 1 << 20):
        monkeypatch.setattr(launch, "_SUM_IN_QUANT_MAX_CHUNKS", limit)
        if varlen:
            cu = _cu([sk // 3, sk - sk // 3])
            outs.append(launch.quantize_k_int8_varlen(k[0], cu, sk - sk // 3))
        else:
            outs.append(launch.quantize_k_int8(k))
    nc = launch._k_chunks(sk, hkv * (2 if varlen else 1), 8, launch._num_sms(k.device))[0]
    assert nc > 1, "the shape must give several chunks"
    for a, b, name in zip(outs[0], outs[1], ("k_int8", "k_scale", "k_mean")):
        assert torch.equal(a.view(torch.int8) if a.dtype == torch.int8 else a.view(torch.int32),
                           b.view(torch.int8) if b.dtype == torch.int8 else b.view(torch.int32)), name


@pytest.mark.parametrize("b,sk,hkv,d,dtype", [(2, 1, 3, 128, torch.bfloat16), (1, 1000, 2, 128, torch.bfloat16),
                                               (2, 2048, 3, 128, torch.float16), (1, 1025, 2, 64, torch.bfloat16),
                                               (3, 1500, 1, 256, torch.float16)])
def test_one_launch_k_quantization_equals_the_two_kernel_path(monkeypatch, b, sk, hkv, d, dtype):
    """Short dense K with smoothing: one cluster of CTAs per (sequence, head) holds its rows in registers and sums
    the mean through distributed shared memory (one launch, K read once); the bytes, scales and mean equal the
    mean kernel + quantize kernel path bit for bit, and the reference with that mean."""
    gen = torch.Generator().manual_seed(sk + d)
    k = _rand((b, sk, hkv, d), dtype, gen, outliers=True, bias=20.0)
    plan = launch.k_cluster_plan(d, 128, -(-sk // 128))
    assert plan is not None and plan[0] * plan[1] * 128 >= sk
    assert launch.k_cluster_plan(d, 128, 17) is None  # longer: the two-kernel path
    one = launch.quantize_k_int8(k)
    monkeypatch.setattr(launch, "k_cluster_plan", lambda *a: None)
    two = launch.quantize_k_int8(k)
    for x, y, name in zip(one, two, ("k_int8", "k_scale", "k_mean")):
        assert torch.equal(x.view(torch.int8) if x.dtype == torch.int8 else x.view(torch.int32),
                           y.view(torch.int8) if y.dtype == torch.int8 else y.view(torch.int32)), name
    ref = quantize_qk_int8_reference(k[:, :1].cpu(), k.cpu(), k_mean=one[2].cpu())
    _assert_int8_equal(one[0], ref[2], "k_int8")
    _assert_bits_equal(one[1], ref[3], "k_scale")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_one_launch_k_quantization_varlen(monkeypatch, dtype):
    """The one-launch K quantization of packed sequences (the longest <= 2048 keys; an empty one, a 1-key one)
    equals the two-kernel path bit for bit: bytes, padded scales, means."""
    gen = torch.Generator().manual_seed(7)
    lens = [700, 1, 2048, 0, 1300]
    k = _rand((1, sum(lens), 2, 128), dtype, gen, outliers=True, bias=20.0)[0]
    cu = _cu(lens)
    assert launch.k_cluster_plan(128, 128, 16) is not None
    one = launch.quantize_k_int8_varlen(k, cu, max(lens))
    monkeypatch.setattr(launch, "k_cluster_plan", lambda *a: None)
    two = launch.quantize_k_int8_varlen(k, cu, max(lens))
    for x, y, name in zip(one, two, ("k_int8", "k_scale", "k_mean")):
        assert torch.equal(x.view(torch.int8) if x.dtype == torch.int8 else x.view(torch.int32),
                           y.view(torch.int8) if y.dtype == torch.int8 else y.view(torch.int32)), name


def test_zero_tiny_and_constant_groups():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 96, 2, 128, generator=gen)
    q[:, :16] = 0  # a zero warp group: scale 0, bytes 0
    q[:, 16:32] *= 1e-38  # a subnormal scale: inv = 0, bytes 0
    k = torch.randn(1, 256, 2, 128, generator=gen)
    k[:, :, :, :8] = 5.0  # constant channels: smoothed to exactly 0
    k[:, 128:] = k[:, :1]  # the second block is one repeated row
    q, k = q.to(torch.bfloat16).cuda(), k.to(torch.bfloat16).cuda()
    got = quantize_qk_int8(q, k)
    _check_dense(q, k, got)
    qs = got[1].cpu()
    assert torch.all(qs[:, :, 0] == 0) and torch.all(qs[:, :, 1] < 2.0**-126) and torch.all(got[0][:, :32] == 0)
    assert torch.all(got[4][..., :8] == 5.0)


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(5)
    B, S, H, D = 2, 150, 4, 128
    qkv = _rand((B, S, 3, H, D), torch.bfloat16, gen, outliers=True)
    q, k = qkv[:, :, 0], qkv[:, :, 1, :2]  # packed QKV, and a head slice
    assert not q.is_contiguous() and launch._kernel_view(q) is q and launch._kernel_view(k) is k
    before = qkv.clone()
    _check_dense(q, k, quantize_qk_int8(q, k))
    assert torch.equal(qkv, before)
    # (B, H, S, D) memory seen as (B, S, H, D)
    bhsd = _rand((B, H, S + 3, D), torch.float16, gen, bias=4.0)
    q2, k2 = bhsd.transpose(1, 2)[:, 3:], bhsd.transpose(1, 2)[:, :S, :1]
    _check_dense(q2, k2, quantize_qk_int8(q2, k2, granularity="per_block"), granularity="per_block")
    # layouts the kernels cannot read in place (misaligned start, strided last dimension): copied first
    flat = _rand((1 + B * S * H * D,), torch.bfloat16, gen)
    q3 = flat[1:].view(B, S, H, D)
    k3 = _rand((B, S, 2, 2 * D), torch.bfloat16, gen)[..., ::2]
    _check_dense(q3, k3, quantize_qk_int8(q3, k3))


def test_current_stream_and_empty_inputs():
    gen = torch.Generator().manual_seed(6)
    q = _rand((2, 77, 4, 64), torch.bfloat16, gen)
    k = _rand((2, 99, 4, 64), torch.bfloat16, gen, bias=1.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = quantize_qk_int8(q, k)
    s.synchronize()
    _check_dense(q, k, got)
    for sq, sk in ((0, 5), (5, 0), (0, 0)):
        qe = _rand((2, sq, 4, 64), torch.bfloat16, gen)
        ke = _rand((2, sk, 2, 64), torch.bfloat16, gen)
        got = quantize_qk_int8(qe, ke)
        _check_dense(qe, ke, got)
        if sk == 0:
            assert torch.all(got[4] == 0)
    got = quantize_qk_int8(_rand((0, 5, 4, 64), torch.bfloat16, gen), _rand((0, 5, 4, 64), torch.bfloat16, gen))
    assert got[1].shape == (0, 4, 8) and got[4].shape == (0, 4, 64)


def test_no_host_sync_and_cuda_graph():
    gen = torch.Generator().manual_seed(8)
    q = _rand((2, 300, 8, 128), torch.bfloat16, gen, outliers=True)
    k = _rand((2, 400, 2, 128), torch.bfloat16, gen, bias=2.0)
    quantize_qk_int8(q, k)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantize_qk_int8(q, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # capture once, then replay on new contents of the same input buffers
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        quantize_qk_int8(q, k)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = quantize_qk_int8(q, k)
    q.copy_(_rand(tuple(q.shape), torch.bfloat16, gen))
    k.copy_(_rand(tuple(k.shape), torch.bfloat16, gen, outliers=True, bias=5.0))
    graph.replay()
    torch.cuda.synchronize()
    _check_dense(q, k, outs)


# ------------------------------------------------------------------------------------------------
# varlen
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("granularity", ["per_warp", "per_block"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_varlen(dtype, head_dim, granularity, smooth_k):
    gen = torch.Generator().manual_seed(head_dim + smooth_k)
    lens_q = [1, 17, 130, 255, 0, 300, 64]
    lens_k = [300, 5, 129, 0, 1, 77, 256]
    q = _rand((sum(lens_q), 8, head_dim), dtype, gen, outliers=True)
    k = _rand((sum(lens_k), 2, head_dim), dtype, gen, outliers=True, bias=3.0)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    got = quantize_qk_int8_varlen(q, k, cu_q, cu_k, 300, 300, granularity=granularity, smooth_k=smooth_k)
    assert got[1].shape == (7, 8, 24 if granularity == "per_warp" else 3) and got[3].shape == (7, 2, 3)
    _check_varlen(q, k, cu_q, cu_k, 300, 300, got, smooth_k=smooth_k, granularity=granularity)


def test_varlen_padding_blocks_and_strides():
    gen = torch.Generator().manual_seed(9)
    lens_q, lens_k = [33, 1, 200], [7, 190, 2]
    tq, tk = sum(lens_q), sum(lens_k)
    qkv = _rand((max(tq, tk), 3, 4, 128), torch.bfloat16, gen, outliers=True)
    q, k = qkv[:tq, 0], qkv[:tk, 1, :2]  # packed QKV slices: strided rows, read in place
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    blocks = dict(granularity="per_warp", block_q=64, warp_q=32, block_k=64)
    # max_seqlen larger than every sequence: whole padding groups, all 0
    got = quantize_qk_int8_varlen(q, k, cu_q, cu_k, 500, 700, **blocks)
    assert got[1].shape == (3, 4, 8 * 2) and got[3].shape == (3, 2, 11)
    _check_varlen(q, k, cu_q, cu_k, 500, 700, got, **blocks)
    assert torch.all(got[1][:, :, 8:] == 0) and torch.all(got[3][:, :, 4:] == 0)


def test_varlen_single_sequence_equals_dense():
    gen = torch.Generator().manual_seed(10)
    q = _rand((1, 211, 4, 128), torch.float16, gen, outliers=True)
    k = _rand((1, 333, 4, 128), torch.float16, gen, bias=2.0)
    dense = quantize_qk_int8(q, k)
    var = quantize_qk_int8_varlen(q[0], k[0], _cu([211]), _cu([333]), 211, 333)
    for d, v in zip(dense, var):
        assert torch.equal(d.reshape(v.shape).view(torch.uint8), v.view(torch.uint8))


def test_varlen_empty():
    gen = torch.Generator().manual_seed(12)
    q = _rand((0, 4, 64), torch.bfloat16, gen)
    got = quantize_qk_int8_varlen(q, q[:, :2], _cu([0, 0]), _cu([0, 0]), 0, 0)
    assert got[1].shape == (2, 4, 0) and got[3].shape == (2, 2, 0) and torch.all(got[4] == 0)
    got = quantize_qk_int8_varlen(q, q[:, :2], _cu([]), _cu([]), 0, 0)
    assert got[1].shape == (0, 4, 0) and got[4].shape == (0, 2, 64)


if __name__ == "__main__":  # a small case for compute-sanitizer
    launch._alloc = _poisoned_alloc
    g = torch.Generator().manual_seed(0)
    qq = _rand((2, 37, 4, 128), torch.bfloat16, g, outliers=True)
    kk = _rand((2, 45, 2, 128), torch.bfloat16, g, bias=2.0)
    _check_dense(qq, kk, quantize_qk_int8(qq, kk))
    lq, lk = [5, 0, 33], [17, 2, 0]
    qv = _rand((sum(lq), 4, 64), torch.float16, g)
    kv = _rand((sum(lk), 2, 64), torch.float16, g, bias=1.0)
    _check_varlen(qv, kv, _cu(lq), _cu(lk), 33, 17, quantize_qk_int8_varlen(qv, kv, _cu(lq), _cu(lk), 33, 17))
    torch.cuda.synchronize()
    print("ok")


# ------------------------------------------------------------------------------------------------
# K only (flash_attn_func's prepass on SM90, whose attention kernel quantizes Q)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("sk,hkv,head_dim", [(300, 2, 128), (20000, 1, 64), (1, 3, 256)])
def test_k_only_equals_the_k_half(sk, hkv, head_dim, smooth_k):
    gen = torch.Generator().manual_seed(sk + head_dim)
    q = _rand((2, 40, hkv, head_dim), torch.bfloat16, gen)
    k = _rand((2, sk, hkv, head_dim), torch.bfloat16, gen, outliers=True, bias=5.0)
    want = quantize_qk_int8(q, k, smooth_k=smooth_k)
    got = launch.quantize_k_int8(k, smooth_k=smooth_k)
    _assert_int8_equal(got[0], want[2].cpu(), "k_int8")
    _assert_bits_equal(got[1], want[3].cpu(), "k_scale")
    if smooth_k:
        _assert_bits_equal(got[2], want[4].cpu(), "k_mean")
    else:
        assert got[2] is None and want[4] is None


def test_k_only_varlen_equals_the_k_half():
    gen = torch.Generator().manual_seed(3)
    lens = [300, 5, 0, 4000, 1]
    k = _rand((sum(lens), 2, 128), torch.float16, gen, outliers=True, bias=3.0)
    q = _rand((sum(lens), 2, 128), torch.float16, gen)
    cu = _cu(lens)
    want = quantize_qk_int8_varlen(q, k, cu, cu, 4000, 4000)
    got = launch.quantize_k_int8_varlen(k, cu, 4000)
    _assert_int8_equal(got[0], want[2].cpu(), "k_int8")
    _assert_bits_equal(got[1], want[3].cpu(), "k_scale")
    _assert_bits_equal(got[2], want[4].cpu(), "k_mean")
