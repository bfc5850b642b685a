"""torch.compile(fullgraph=True) of a decode step (insert + attention) runs the qattn kernels through their
custom ops and gives the eager results: the same cache bytes and the same attention output."""

import pytest
import torch

import qattn
from qattn.reference.kv_ops import flatten_kv_reference
from tests.gpu.test_kv_insert_gpu import nan_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", ("int8", "mxfp4"), qattn.kv_format(("int8", "nvfp4"), scale_search="msenb")],
                         ids=["nvfp4", "int8-mxfp4", "int8-nvfp4-search"])
def test_compiled_decode_step_matches_eager(fmt):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    B, H, Hk, D, P, nb = 3, 16, 4, 128, 16, 8
    caches = [qattn.PagedKVCache(1, B * nb, P, Hk, D, fmt, device=dev) for _ in range(2)]
    table = torch.randperm(B * nb, device=dev, generator=g).view(B, nb).to(torch.int32)
    lens = torch.tensor([20, 77, 5], dtype=torch.int32, device=dev)
    for b in range(B):
        pos = torch.arange(int(lens[b]), device=dev)
        k = torch.randn(len(pos), Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for c in caches:
            qattn.write_kv(c, 0, k, v, table[b, pos // P].long() * P + pos % P)

    def step(cache, q, k, v, slots, lens, table):
        qattn.write_kv(cache, 0, k, v, slots)
        return qattn.flash_attn_with_kvcache(q, cache, lens + 1, table)

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        q = torch.randn(B, 1, H, D, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(B, Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = table.long().gather(1, (lens.long() // P)[:, None])[:, 0] * P + lens.long() % P
        eager = step(caches[0], q, k, v, slots, lens, table)
        comp = compiled(caches[1], q, k, v, slots, lens, table)
        torch.cuda.synchronize()
        assert torch.equal(comp, eager)
        for name in ("k_data", "v_data", "k_scale_pool", "v_scale_pool"):
            a, b = getattr(caches[0].layer(0), name), getattr(caches[1].layer(0), name)
            assert torch.equal(a, b), name
        lens += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_ring_decode_step_matches_eager():
    """The same with a recent-token window: seq_slots reach the decode op, the rings are read in the launch."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    B, H, Hk, D, P, nb, W = 3, 16, 4, 128, 16, 8, 32
    caches = [qattn.PagedKVCache(1, B * nb, P, Hk, D, "nvfp4", device=dev, recent_window=W, max_seqs=B + 2)
              for _ in range(2)]
    table = torch.randperm(B * nb, device=dev, generator=g).view(B, nb).to(torch.int32)
    lens = torch.tensor([20, 77, 5], dtype=torch.int32, device=dev)
    ring_slots = torch.tensor([4, 0, 2], dtype=torch.int64, device=dev)
    for b in range(B):
        pos = torch.arange(int(lens[b]), device=dev)
        k = torch.randn(len(pos), Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for c in caches:
            qattn.write_kv(c, 0, k, v, table[b, pos // P].long() * P + pos % P,
                           seq_slots=ring_slots[b].repeat(len(pos)), positions=pos)

    def step(cache, q, k, v, slots, tok_seqs, positions, seqs, lens, table):
        qattn.write_kv(cache, 0, k, v, slots, seq_slots=tok_seqs, positions=positions)
        return qattn.flash_attn_with_kvcache(q, cache, lens + 1, table, seq_slots=seqs)

    compiled = torch.compile(step, fullgraph=True)
    seqs = ring_slots.to(torch.int32)
    for _ in range(3):
        q = torch.randn(B, 1, H, D, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(B, Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = table.long().gather(1, (lens.long() // P)[:, None])[:, 0] * P + lens.long() % P
        args = (q, k, v, slots, ring_slots, lens.long(), seqs, lens, table)
        eager = step(caches[0], *args)
        comp = compiled(caches[1], *args)
        torch.cuda.synchronize()
        assert torch.equal(comp, eager)
        ref = qattn.reference.paged_decode_reference(q, caches[0], lens + 1, table, seq_slots=seqs)
        assert ((eager.double() - ref).norm() / ref.norm()) <= 1e-2
        for name in ("k_data", "v_data", "k_ring", "v_ring"):
            a, b = getattr(caches[0].layer(0), name), getattr(caches[1].layer(0), name)
            assert torch.equal(a, b), name
        lens += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flatten_kv_matches_eager(monkeypatch):
    """flatten_kv(max_seqlen=N) compiled (the qattn::flatten_kv op) == eager; rows past each length are zero,
    also past the longest one; a max_seqlen below the longest sequence is an error."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(11)
    B, Hk, D, P, nb = 3, 2, 128, 16, 6
    cache = qattn.PagedKVCache(1, B * nb, P, Hk, D, ("fp8", "nvfp4"), device=dev)
    table = torch.randperm(B * nb, device=dev, generator=g).view(B, nb).to(torch.int32)
    lens = torch.tensor([20, 77, 5], dtype=torch.int32, device=dev)
    for b in range(B):
        pos = torch.arange(int(lens[b]), device=dev)
        k = torch.randn(len(pos), Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        qattn.write_kv(cache, 0, k, torch.randn_like(k), table[b, pos // P].long() * P + pos % P)
    compiled = torch.compile(lambda lens, table: qattn.flatten_kv(cache, 0, table, lens, max_seqlen=90),
                             fullgraph=True)

    compiled(lens, table)  # traced and compiled here, outside the poisoning below
    kr, vr = flatten_kv_reference(cache, 0, table, lens)
    nan_outputs(monkeypatch)  # the outputs come NaN-filled: rows the kernel does not write show
    kc, vc = compiled(lens, table)
    ke, ve = qattn.flatten_kv(cache, 0, table, lens, max_seqlen=90)
    k0, v0 = qattn.flatten_kv(cache, 0, table, lens)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert kc.shape == (B, 90, Hk, D) and k0.shape == (B, 77, Hk, D)
    assert torch.equal(kc, ke) and torch.equal(vc, ve)
    assert torch.equal(ke[:, :77], k0) and torch.equal(ve[:, :77], v0)
    assert torch.equal(k0, kr.bfloat16()) and torch.equal(v0, vr.bfloat16())
    for b, L in enumerate(lens.tolist()):  # zero past each length, also past the longest one
        assert not ke[b, L:].any() and not ve[b, L:].any() and not k0[b, L:].any()
    with pytest.raises(ValueError, match="shorter than the longest"):
        qattn.flatten_kv(cache, 0, table, lens, max_seqlen=76)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("smooth_k,balance_qk", [(True, False), (False, False), (True, True)])
def test_compiled_prepass_matches_eager(smooth_k, balance_qk):
    """quantize_qk_int8 / _varlen / quantize_v_fp8 compiled (their custom ops) == eager, bit for bit."""
    from qattn.quant import quantize_qk_int8, quantize_qk_int8_varlen, quantize_v_fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(17)
    q = torch.randn(2, 300, 8, 128, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 200, 2, 128, device=dev, generator=g, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 150, 200], dtype=torch.int32, device=dev)

    def prepass(q, k, qv, kv):
        return (quantize_qk_int8(q, k, smooth_k=smooth_k, balance_qk=balance_qk),
                quantize_qk_int8_varlen(qv, kv, cu_q, cu_k, 200, 150, smooth_k=smooth_k, balance_qk=balance_qk),
                quantize_v_fp8(k))

    args = (q, k, q[0].contiguous(), k[0].contiguous())
    eager = prepass(*args)
    comp = torch.compile(prepass, fullgraph=True)(*args)
    torch.cuda.synchronize()
    for e_group, c_group in zip(eager, comp):
        assert len(e_group) == len(c_group)
        for e, c in zip(e_group, c_group):
            assert (e is None) == (c is None)
            if e is not None:
                assert torch.equal(e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e,
                                   c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c)
