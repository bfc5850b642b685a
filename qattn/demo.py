"""A small end-to-end demo that runs on the CPU: ``python -m qattn.demo``.

Builds a paged KV cache in every format through the reference encoders (the same bytes the kernels write),
runs decode attention over it in fp64 and prints, per format, the cache bytes per token and the attention
error against unquantized K/V. ``--compile`` also compiles the project's CuTe-DSL kernels for sm_90a and
sm_100a on this machine (no GPU needed) and reports what the PTX contains.
"""

from __future__ import annotations

import argparse
import time

import torch

from .layouts import FORMAT_NAMES, PagedKVCache, kv_format
from .reference import attention_reference, paged_decode_reference, write_kv_reference


def make_kv(batch: int, seqlen: int, num_kv_heads: int, head_dim: int, gen: torch.Generator):
    """Keys with a few outlier channels (as real post-RoPE keys have) and plain Gaussian values."""
    k = torch.randn(batch, seqlen, num_kv_heads, head_dim, generator=gen)
    outliers = torch.randperm(head_dim, generator=gen)[: max(1, head_dim // 32)]
    k[..., outliers] *= 8.0
    v = torch.randn(batch, seqlen, num_kv_heads, head_dim, generator=gen)
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def fill_cache(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator):
    """Write each sequence into shuffled blocks; return its block table and lengths."""
    B, S = k.shape[:2]
    per_seq = cache.blocks_needed(S)
    ids = torch.randperm(cache.num_blocks, generator=gen)[: B * per_seq].view(B, per_seq).to(torch.int32)
    pos = torch.arange(S)
    for b in range(B):
        slots = ids[b, pos // cache.page_size].long() * cache.page_size + pos % cache.page_size
        kw = {}
        if cache.recent_window:
            kw = dict(seq_slots=torch.full((S,), b, dtype=torch.long), positions=pos)
        write_kv_reference(cache, 0, k[b], v[b], slots, **kw)
    return ids, torch.full((B,), S, dtype=torch.int32)


def error_table(batch=2, seqlen=1000, num_heads=16, num_kv_heads=4, head_dim=128, page_size=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = make_kv(batch, seqlen, num_kv_heads, head_dim, gen)
    q = torch.randn(batch, 1, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    exact = attention_reference(q, k, v, causal=True)
    blocks = batch * -(-seqlen // page_size)
    configs = [(name, 0) for name in FORMAT_NAMES] + [(("int8", "nvfp4"), 0), ("nvfp4", 64)]
    rows = []
    for fmt, window in configs:
        cache = PagedKVCache(1, blocks, page_size, num_kv_heads, head_dim, fmt,
                             recent_window=window, max_seqs=batch if window else 0)
        table, lens = fill_cache(cache, k, v, gen)
        kw = {"seq_slots": torch.arange(batch, dtype=torch.int32)} if window else {}
        out = paged_decode_reference(q, cache, lens, table, **kw)
        err = (out - exact).flatten()
        nrmse = float(err.norm() / exact.flatten().norm())
        cos = float(torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0))
        kf, vf = (kv_format(fmt).k, kv_format(fmt).v) if isinstance(fmt, tuple) else (kv_format(fmt),) * 2
        per_tok = kf.bytes_per_token_head(head_dim) + vf.bytes_per_token_head(head_dim)
        name = fmt if isinstance(fmt, str) else f"{fmt[0]} K + {fmt[1]} V"
        rows.append((name + (f", newest {window} in bf16" if window else ""), per_tok, 4 * head_dim / per_tok,
                     nrmse, cos))
    return rows


def compile_report() -> list[str]:
    """Compile the FP4 row kernels for both arches and say what their PTX contains."""
    from .cute_kernels.compile_utils import compile_for_arch, ptx_count
    from .cute_kernels.fp4_rows import make_dequant_compile_args, make_quantize_compile_args

    lines = []
    for arch in ("sm_90a", "sm_100a"):
        for what, make in (("FP4 dequantize rows", make_dequant_compile_args),
                           ("FP4 quantize rows", make_quantize_compile_args)):
            t0 = time.perf_counter()
            cfg, args = make("nvfp4", 128)
            _, ptx = compile_for_arch(cfg, *args, arch=arch)
            counts = {name: ptx_count(ptx, pat) for name, pat in (
                ("prmt", r"\bprmt\.b32"), ("cvt e4m3x2->f16x2", r"cvt\.rn\.f16x2\.e4m3x2"),
                ("cvt f32->e4m3", r"cvt\.rn\.satfinite\.e4m3x2"), ("16-byte loads", r"ld\.global\.v4"))}
            found = ", ".join(f"{n} x{c}" for n, c in counts.items() if c)
            lines.append(f"{arch}  {what:20} nvfp4 D128  {time.perf_counter() - t0:5.2f} s  PTX: {found}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qattn.demo", description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="also compile the FP4 row kernels (CuTe-DSL) for sm_90a/sm_100a")
    p.add_argument("--seqlen", type=int, default=1000)
    args = p.parse_args(argv)
    t0 = time.time()
    print("qattn demo: decode attention over a paged cache (B2, 1000 tokens, GQA 16/4, head_dim 128, page 64),")
    print("keys with outlier channels; error of the quantized cache vs unquantized K/V, fp64 reference path (CPU)\n")
    print(f"{'KV format':<34}{'bytes/token/kv-head':>20}{'vs bf16':>9}{'attn NRMSE':>12}{'cosine':>10}")
    for name, per_tok, ratio, nrmse, cos in error_table(seqlen=args.seqlen):
        print(f"{name:<34}{per_tok:>20d}{ratio:>8.2f}x{nrmse:>12.2e}{cos:>10.6f}")
    if args.compile:
        print("\nCuTe-DSL kernels compiled on this machine (no GPU needed):")
        for line in compile_report():
            print("  " + line)
    print(f"\ndone in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
