import pytest
import torch

from qattn.layouts import FORMAT_NAMES, PagedKVCache, kv_formats
from qattn.quant.reference import dequantize, quantize
from qattn.reference import attention_reference, flatten_kv_reference, paged_decode_reference, write_kv_reference

FORMATS = list(FORMAT_NAMES) + [("int8", "nvfp4"), ("fp8", "mxfp4")]


def poison(cache):
    g = torch.Generator().manual_seed(1)
    lay = cache.layer(0)
    for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool):
        if t is not None:
            t.copy_(torch.randint(0, 255, t.shape, generator=g).to(t.dtype) if not t.is_floating_point()
                    else torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_stores_reference_bytes_and_skips_padding(fmt):
    c = PagedKVCache(1, 6, 16, 2, 64, fmt)
    c.layer(0).k_global_scale is not None and c.layer(0).k_global_scale.copy_(torch.tensor([0.5, 2.0]))
    poison(c)
    before = {n: t.clone() for n, t in vars(c.layer(0)).items() if t is not None}
    g = torch.Generator().manual_seed(2)
    n = 30
    k = (torch.randn(n, 2, 64, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(n, 2, 64, generator=g).to(torch.bfloat16)
    slots = torch.randperm(6 * 16, generator=g)[:n]
    slots[::7] = -1
    write_kv_reference(c, 0, k, v, slots)
    lay, keep = c.layer(0), slots >= 0
    blk, off = slots[keep] // 16, slots[keep] % 16
    kf, vf = kv_formats(fmt)
    for x, f, data, sc, gs in ((k, kf, "k_data", "k_scale_pool", lay.k_global_scale),
                               (v, vf, "v_data", "v_scale_pool", lay.v_global_scale)):
        p, s = quantize(x[keep], f, gs)
        assert torch.equal(getattr(lay, data)[blk, :, off], p)
        if s is not None:
            assert torch.equal(getattr(lay, sc)[blk, :, off], s)
        # every row not named by a kept slot is untouched
        untouched = torch.ones(6, 16, dtype=torch.bool)
        untouched[blk, off] = False
        assert torch.equal(getattr(lay, data)[untouched.nonzero(as_tuple=True)[0], :, untouched.nonzero(as_tuple=True)[1]],
                           before[data][untouched.nonzero(as_tuple=True)[0], :, untouched.nonzero(as_tuple=True)[1]])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [16, 64])
def test_flatten_is_dequantized_input(fmt, page_size):
    g = torch.Generator().manual_seed(3)
    B, S, H, D = 3, 70, 2, 128
    c = PagedKVCache(1, B * -(-S // page_size) + 2, page_size, H, D, fmt)
    k = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, S, H, D, generator=g).to(torch.bfloat16)
    per = -(-S // page_size)
    table = torch.randperm(c.num_blocks, generator=g)[: B * per].view(B, per).to(torch.int32)
    lens = torch.tensor([70, 33, 1], dtype=torch.int32)
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        write_kv_reference(c, 0, k[b, pos], v[b, pos], table[b, pos // page_size].long() * page_size + pos % page_size)
    kd, vd = flatten_kv_reference(c, 0, table, lens)
    kf, vf = kv_formats(fmt)
    for b in range(B):
        L = int(lens[b])
        assert torch.equal(kd[b, :L], dequantize(*quantize(k[b, :L], kf), kf))
        assert torch.equal(vd[b, :L], dequantize(*quantize(v[b, :L], vf), vf))
        assert torch.all(kd[b, L:] == 0) and torch.all(vd[b, L:] == 0)


def test_ring_holds_newest_tokens_unquantized():
    g = torch.Generator().manual_seed(4)
    W, S, H, D, P = 32, 100, 2, 64, 16
    c = PagedKVCache(1, 16, P, H, D, "nvfp4", recent_window=W, max_seqs=3)
    k = torch.randn(S, H, D, generator=g).to(torch.bfloat16)
    v = torch.randn(S, H, D, generator=g).to(torch.bfloat16)
    table = torch.randperm(16, generator=g)[: -(-S // P)].to(torch.int32)[None]
    start = 0
    for chunk in (40, 1, 1, 50, 8):  # a prefill chunk larger than the window, then decode steps
        pos = torch.arange(start, start + chunk)
        write_kv_reference(c, 0, k[pos], v[pos], table[0, pos // P].long() * P + pos % P,
                           seq_slots=torch.full((chunk,), 2), positions=pos)
        start += chunk
    lens = torch.tensor([S], dtype=torch.int32)
    kd, vd = flatten_kv_reference(c, 0, table, lens, seq_slots=torch.tensor([2], dtype=torch.int32))
    assert torch.equal(kd[0, S - W:], k[S - W:].float()) and torch.equal(vd[0, S - W:], v[S - W:].float())
    kq, _ = flatten_kv_reference(c, 0, table, lens)  # pages alone: quantized everywhere
    assert torch.equal(kd[0, : S - W], kq[0, : S - W]) and not torch.equal(kq[0, S - W:], kd[0, S - W:])


def test_decode_reference_bf16_is_plain_attention():
    g = torch.Generator().manual_seed(5)
    c = PagedKVCache(1, 8, 16, 2, 64, "bf16")
    k = torch.randn(1, 40, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 40, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.tensor([[5, 1, 7]], dtype=torch.int32)
    pos = torch.arange(40)
    write_kv_reference(c, 0, k[0], v[0], table[0, pos // 16].long() * 16 + pos % 16)
    q = torch.randn(1, 3, 8, 64, generator=g)
    lens = torch.tensor([40], dtype=torch.int32)
    out, lse = paged_decode_reference(q, c, lens, table, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)


def test_write_errors():
    c = PagedKVCache(1, 4, 16, 2, 64, "nvfp4")
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(c, 0, k, k, torch.tensor([0, 1, 64]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(c, 0, k, k, torch.tensor([0, 1, -2]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(c, 0, k, k, torch.tensor([5, 1, 5]))
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv_reference(c, 0, k, k, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(c, 0, k, k, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k:"):
        write_kv_reference(c, 0, torch.randn(3, 2, 32), k, torch.arange(3))
    with pytest.raises(TypeError, match="v:"):
        write_kv_reference(c, 0, k, torch.zeros(3, 2, 64, dtype=torch.int32), torch.arange(3))
    with pytest.raises(ValueError, match="layer"):
        write_kv_reference(c, 1, k, k, torch.arange(3))
    with pytest.raises(ValueError, match="seq_slots"):
        write_kv_reference(c, 0, k, k, torch.arange(3), seq_slots=torch.zeros(3, dtype=torch.long))
    r = PagedKVCache(1, 4, 16, 2, 64, "nvfp4", recent_window=16, max_seqs=2)
    with pytest.raises(ValueError, match="seq_slots"):
        write_kv_reference(r, 0, k, k, torch.arange(3))
    with pytest.raises(ValueError, match="seq_slots"):
        write_kv_reference(r, 0, k, k, torch.arange(3), seq_slots=torch.tensor([0, 2, 0]), positions=torch.arange(3))


def test_block_table_errors():
    c = PagedKVCache(1, 4, 16, 2, 64, "int8")
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flatten_kv_reference(c, 0, table, torch.tensor([33], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table"):
        flatten_kv_reference(c, 0, torch.tensor([[0, 4]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table"):
        flatten_kv_reference(c, 0, table.long(), torch.tensor([20], dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        flatten_kv_reference(c, 0, table, torch.tensor([20]))
    # unused entries past the length may hold anything (engines pad tables with -1 or garbage)
    flatten_kv_reference(c, 0, torch.tensor([[3, -1]], dtype=torch.int32), torch.tensor([16], dtype=torch.int32))
