"""A decode step (insert + attention) captured once in a CUDA graph and replayed after the step's inputs
change in place: new tokens, ``slot_mapping``, ``cache_seqlens`` and ``block_table`` contents (a block moved)."""

import pytest
import torch

import qattn
from qattn.quant.transforms import rotate_query, unrotate_rows
from qattn.reference import paged_decode_reference, write_kv_reference

pytestmark = pytest.mark.gpu


def _copy_block(cache: qattn.PagedKVCache, src: int, dst: int) -> None:
    lay = cache.layer(0)
    for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool):
        if t is not None:
            t[dst].copy_(t[src])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,rotate", [("nvfp4", False), (("int8", "nvfp4"), False), ("fp8", False),
                                        ("nvfp4", True)])
def test_decode_step_graph_replay(fmt, rotate):
    """rotate=True: the decode's q rotation and output un-rotation (torch ops) are captured too."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, Hk, D, P, max_blocks = 4, 16, 4, 128, 16, 16
    num_blocks = B * max_blocks + 8
    cache = qattn.PagedKVCache(1, num_blocks, P, Hk, D, fmt, device=dev, rotate=rotate)
    # the same writes, by the reference
    shadow = qattn.PagedKVCache(1, num_blocks, P, Hk, D, fmt, device=dev, rotate=rotate)
    if cache.layer(0).k_global_scale is not None:
        for c in (cache, shadow):
            c.layer(0).k_global_scale.fill_(0.01)
    table = torch.randperm(B * max_blocks, device=dev, generator=g).view(B, max_blocks).to(torch.int32)
    lens = torch.tensor([50, 97, 16, 131], dtype=torch.int32, device=dev)
    for b in range(B):  # the prompts, written eagerly
        pos = torch.arange(int(lens[b]), device=dev)
        k = torch.randn(len(pos), Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = table[b, pos // P].long() * P + pos % P
        qattn.write_kv(cache, 0, k, v, slots)
        write_kv_reference(shadow, 0, k, v, slots)

    # static buffers of the step
    q = torch.empty(B, 1, H, D, device=dev, dtype=torch.bfloat16)
    k_new = torch.empty(B, Hk, D, device=dev, dtype=torch.bfloat16)
    v_new = torch.empty_like(k_new)
    slot_buf = torch.empty(B, dtype=torch.int64, device=dev)

    def fill_step():
        q.copy_(torch.randn(q.shape, device=dev, generator=g))
        k_new.copy_(torch.randn(k_new.shape, device=dev, generator=g))
        v_new.copy_(torch.randn(v_new.shape, device=dev, generator=g))
        pos = lens.long()  # the new token's position = the old length
        slot_buf.copy_(table.long().gather(1, (pos // P)[:, None])[:, 0] * P + pos % P)

    def step():
        qattn.write_kv(cache, 0, k_new, v_new, slot_buf)
        return qattn.flash_attn_with_kvcache(q, cache, lens + 1, table)

    fill_step()
    step()  # warm-up: compiles every kernel before capture
    torch.cuda.synchronize()
    # undo the warm-up's write so that cache and shadow hold the same tokens
    write_kv_reference(shadow, 0, k_new, v_new, slot_buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for it in range(4):
        if it:
            fill_step()
        if it == 2:  # move sequence 1's first block elsewhere, in place
            old, new = int(table[1, 0]), num_blocks - 1 - it
            _copy_block(cache, old, new)
            _copy_block(shadow, old, new)
            table[1, 0] = new
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if it:
            write_kv_reference(shadow, 0, k_new, v_new, slot_buf)
        lens_now = lens + 1
        lay, ref_lay = cache.layer(0), shadow.layer(0)
        for name in ("k_data", "v_data", "k_scale_pool", "v_scale_pool"):  # the kernel wrote the reference bytes
            a, b = getattr(lay, name), getattr(ref_lay, name)
            assert (a is None and b is None) or torch.equal(a, b), (it, name)
        if rotate:  # attention of the caller's q over the unrotated K, V: q R against K R, output R^T
            s = shadow.rotation_signs
            ref = unrotate_rows(paged_decode_reference(rotate_query(q, s), shadow, lens_now, table), s)
        else:
            ref = paged_decode_reference(q, shadow, lens_now, table)
        err = float((out.double() - ref).norm() / ref.norm())
        assert err <= 1e-2, (it, err)
        lens.add_(1)  # in place: the captured graph reads the new lengths on the next replay
