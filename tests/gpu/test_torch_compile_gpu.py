"""torch.compile(fullgraph=True) of a decode step (insert + attention) runs the qattn kernels through their
custom ops and gives the eager results: the same cache bytes and the same attention output."""

import pytest
import torch

import qattn

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", ("int8", "mxfp4")])
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
