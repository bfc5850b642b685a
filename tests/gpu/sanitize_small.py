"""Small cases for ``compute-sanitizer --tool memcheck``: insert, flatten and decode (split on/off, partial
pages, -1 padded block tables, GQA, seqlen_q > 1). Run as a script; exits non-zero on a wrong result."""

import torch

import qattn
from qattn.reference import paged_decode_reference


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for fmt, page in (("nvfp4", 16), (("int8", "mxfp4"), 64), ("bf16", 16)):
        B, H, Hk, D = 2, 8, 2, 128
        lens = torch.tensor([37, 100], dtype=torch.int32, device="cuda")
        per = -(-100 // page) + 1
        cache = qattn.PagedKVCache(1, B * per + 1, page, Hk, D, fmt, device="cuda")
        table = torch.randperm(B * per, device="cuda", generator=g).view(B, per).to(torch.int32)
        table[0, -(-37 // page):] = -1
        for b in range(B):
            pos = torch.arange(int(lens[b]), device="cuda")
            k = torch.randn(len(pos), Hk, D, device="cuda", generator=g, dtype=torch.bfloat16)
            slots = table[b, pos // page].long() * page + pos % page
            qattn.write_kv(cache, 0, k, torch.randn_like(k), slots)
        qattn.flatten_kv(cache, 0, table, lens)
        q = torch.randn(B, 4, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = paged_decode_reference(q, cache, lens, table)
        for splits in (1, 3):
            out = qattn.flash_attn_with_kvcache(q, cache, lens, table, num_splits=splits)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-2, (fmt, page, splits, err)
            print(f"{str(fmt):18} page {page:3} splits {splits}: rel err {err:.2e}")
    torch.cuda.synchronize()
    print("sanitize_small: OK")


if __name__ == "__main__":
    main()
