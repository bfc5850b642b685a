"""Benchmark of the fused quantize-and-insert kernel (``qattn.write_kv``).

Insert of 64K tokens, 8 kv heads, head_dim 128, into nvfp4 and fp8 caches (page 64, blocks in random order):
achieved bandwidth = (bytes read: k, v, slots, global scales + bytes written: payload and scales) / time,
against a device-to-device copy measured in the same run (``dst.copy_(src)`` of 1 GiB, read + write bytes).
Also the single-token decode append for 256 sequences (latency). Times are medians of CUDA-event timings
after warm-up; inputs are random normal values.

    python benchmarks/bench_insert.py
"""

from __future__ import annotations

import statistics

import torch

import qattn
from qattn.layouts.paged import PagedKVCache


def _time(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


def copy_bandwidth(nbytes=1 << 30):
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src))
    return 2 * nbytes / t


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}")
    copy_bw = copy_bandwidth()
    print(f"device copy: {copy_bw / 1e12:.2f} TB/s (read + write)")
    n, H, D, page = 65536, 8, 128, 64
    nb = n // page
    k = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(nb, device=dev)
    pos = torch.arange(n, device=dev)
    slots = table[pos // page] * page + pos % page
    print(f"{'format':8} {'tokens':>7} {'time us':>9} {'GB moved':>9} {'GB/s':>8} {'% of copy':>9}")
    for fmt in ("nvfp4", "fp8"):
        cache = PagedKVCache(1, nb, page, H, D, fmt, device=dev)
        f = cache.k_format
        written = 2 * n * H * f.bytes_per_token_head(D)
        read = 2 * k.numel() * 2 + slots.numel() * 8 + (2 * H * 4 if f.has_global_scale else 0)
        t = _time(lambda: qattn.write_kv(cache, 0, k, v, slots))
        bw = (read + written) / t
        print(f"{fmt:8} {n:7d} {t * 1e6:9.1f} {(read + written) / 1e9:9.3f} {bw / 1e9:8.0f} {100 * bw / copy_bw:8.1f}%")
    # single-token decode append: 256 sequences, one token each
    B = 256
    for fmt in ("nvfp4", "fp8"):
        cache = PagedKVCache(1, nb, page, H, D, fmt, device=dev)
        s = torch.randperm(nb * page, device=dev)[:B]
        kk = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        vv = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
        t = _time(lambda: qattn.write_kv(cache, 0, kk, vv, s), iters=200)
        print(f"decode append {fmt}: 256 sequences x 1 token: {t * 1e6:.1f} us (CUDA events, incl. launch)")


if __name__ == "__main__":
    main()
