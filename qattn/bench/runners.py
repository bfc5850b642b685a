"""The three benchmarks: paged decode, dense prefill, KV insert. Each returns rows (dicts) for report.py.

Inputs are random (never zeros); every implementation of a config sees identical inputs; errors are taken
against an fp64 reference over unquantized inputs on the first few sequences (what a user loses in total:
format error plus kernel error). A qattn entry point that does not exist yet gives a row saying so.
"""

from __future__ import annotations

import math

import torch

from ..layouts import PagedKVCache, kv_formats
from ..reference import attention_reference
from . import peers as P
from .metrics import DecodeShape, PrefillShape, attention_flops, decode_bytes, errors, insert_bytes
from .timing import bench, bench_interleaved

DECODE_SHAPES = [DecodeShape(32, 8192, 32, 8, 128, 128), DecodeShape(8, 32768, 32, 8, 128, 128),
                 DecodeShape(128, 2048, 32, 8, 128, 128), DecodeShape(1, 131072, 32, 8, 128, 128),
                 DecodeShape(32, 8192, 32, 8, 128, 16)]
PREFILL_SHAPES = [PrefillShape(2, s, 16, 16, d, c) for d in (128, 64) for s in (2048, 4096, 8192, 16384)
                  for c in (False, True)]


def _ours(name: str):
    import qattn

    return getattr(qattn, name, None)


def _fill(cache: PagedKVCache, k, v, table):
    """Write dense (B, S, H, D) K/V into the cache's pages given by ``table``: the insert kernel when it
    exists, else the reference writer (same bytes)."""
    B, S = k.shape[:2]
    pos = torch.arange(S, device=k.device)
    slots = (table.long()[:, pos // cache.page_size] * cache.page_size + pos % cache.page_size).flatten()
    write = _ours("write_kv")
    if write is None:
        from ..reference import write_kv_reference as write
    for start in range(0, B * S, 1 << 16):  # chunks bound the reference's temporaries
        sl = slice(start, start + (1 << 16))
        write(cache, 0, k.flatten(0, 1)[sl], v.flatten(0, 1)[sl], slots[sl])


def _row(config, impl, fmt, scope, t, nbytes=None, flops=None, copy_gbs=None, err=None, kv_bpt=None, note=""):
    r = {"config": config, "impl": impl, "kv_format": fmt, "scope": scope, "note": note, "kv_bytes_per_token": kv_bpt}
    if t is not None:
        r.update(median_us=t.median_us, spread=t.spread)
        if nbytes:
            r["gbs"] = nbytes / (t.median_us * 1e-6) / 1e9
            r["pct_copy"] = r["gbs"] / copy_gbs if copy_gbs else None
        if flops:
            r["tflops"] = flops / (t.median_us * 1e-6) / 1e12
    if err is not None:
        r.update(err.as_dict())
    return r


SCOPES = (("eager", False), ("graph", True))  # decode: launched from Python, and replayed from a CUDA graph


def _speedups(rows: list[dict], baseline: str, match_scope: bool = True) -> None:
    """Speed-up over the baseline implementation of the same config and (with ``match_scope``) scope: eager vs
    eager, graph vs graph. Prefill peers have one eager row that our kernel-only and end-to-end rows compare to."""
    for r in rows:
        if r["scope"] == "prepass":  # part of the end-to-end row, not an alternative to the baseline
            continue
        scope = r.get("base_scope", r["scope"])
        base = next((b for b in rows if b["config"] == r["config"] and (b["scope"] == scope or not match_scope)
                     and b["impl"] == baseline and b.get("median_us")), None)
        if base is not None and r.get("median_us"):
            r["speedup"] = base["median_us"] / r["median_us"]


def run_decode(shapes=DECODE_SHAPES, formats=("nvfp4", "fp8", "bf16"), peers=("fa4", "sdpa"), copy_gbs=None,
               reps=30, err_seqs=2, log=print) -> tuple[list[dict], str]:
    rows, dev = [], "cuda"
    have = {p: P.available(p) for p in peers}
    baseline = next((p for p in peers if have[p][0]), None)
    for sh in shapes:
        log(f"decode {sh.label}")
        g = torch.Generator(device=dev).manual_seed(0)
        B, S, H, Hk, D, Pg = sh.batch, sh.seqlen, sh.num_heads, sh.num_kv_heads, sh.head_dim, sh.page_size
        q = torch.randn(B, sh.seqlen_q, H, D, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(B, S, Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(B, S, Hk, D, device=dev, generator=g, dtype=torch.bfloat16)
        per = -(-S // Pg)
        table = torch.randperm(B * per, device=dev, generator=g).view(B, per).to(torch.int32)
        lens = torch.full((B,), S, dtype=torch.int32, device=dev)
        e = min(B, err_seqs)
        ref = attention_reference(q[:e], k[:e], v[:e], causal=True)
        for p in peers:
            ok, note = have[p]
            if not ok:
                rows.append(_row(sh.label, p, "bf16", "eager", None, note=note))
                continue
            if p == "fa4":
                kp = torch.empty(B * per * Pg, Hk, D, device=dev, dtype=torch.bfloat16).view(B * per, Pg, Hk, D)
                vp = torch.empty_like(kp)
                pad = per * Pg - S
                kp[table.long()] = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(B, per, Pg, Hk, D)
                vp[table.long()] = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(B, per, Pg, Hk, D)
                fn = P.fa4_paged_decode(q, kp, vp, table, lens)
            else:
                fn = P.sdpa_dense(q, k, v, causal=True)
            out = fn()
            err = errors(out[:e], ref)
            for scope, graph in SCOPES:
                t = bench(fn, warmup=5, reps=reps, use_graph=graph)
                rows.append(_row(sh.label, p, "bf16", scope, t, decode_bytes(sh, "bf16"), copy_gbs=copy_gbs,
                                 err=err, kv_bpt=2 * 2 * D))
            del fn, out
        attn = _ours("flash_attn_with_kvcache")
        for fmt in formats:
            kf, vf = kv_formats(fmt)
            bpt = kf.bytes_per_token_head(D) + vf.bytes_per_token_head(D)
            name = fmt if isinstance(fmt, str) else "+".join(fmt)
            if attn is None:
                rows.append(_row(sh.label, "qattn", name, "eager", None, kv_bpt=bpt,
                                 note="qattn.flash_attn_with_kvcache not built yet"))
                continue
            cache = PagedKVCache(1, B * per, Pg, Hk, D, fmt, device=dev)
            _fill(cache, k, v, table)
            fn = (lambda c=cache: attn(q, c, lens, table))
            out = fn()
            err = errors(out[:e], ref)
            for scope, graph in SCOPES:
                t = bench(fn, warmup=5, reps=reps, use_graph=graph)
                rows.append(_row(sh.label, "qattn", name, scope, t, decode_bytes(sh, fmt), copy_gbs=copy_gbs,
                                 err=err, kv_bpt=bpt))
            write = _ours("write_kv")
            if write is not None and sh.seqlen_q == 1:
                # end-to-end decode step: append each sequence's newest token (its own K/V again, so the cache
                # stays what the error was measured on) with write_kv, then attention; one CUDA graph. The
                # speed-up compares with the peer's attention alone (graph scope).
                last = torch.full((B,), S - 1, device=dev, dtype=torch.long)
                slots = table.long()[torch.arange(B, device=dev), last // Pg] * Pg + last % Pg
                k_new, v_new = k[:, -1].contiguous(), v[:, -1].contiguous()
                step = (lambda c=cache: (write(c, 0, k_new, v_new, slots), attn(q, c, lens, table))[1])
                t = bench(step, warmup=5, reps=reps, use_graph=True)
                row = _row(sh.label, "qattn", name, "step graph", t, None, copy_gbs=copy_gbs,
                           err=errors(step()[:e], ref), kv_bpt=bpt,
                           note="write_kv of 1 token/seq + attention; speed-up vs the peer's attention graph")
                row["base_scope"] = "graph"
                rows.append(row)
            del cache, fn, out
        del q, k, v
        torch.cuda.empty_cache()
    if baseline:
        _speedups(rows, baseline)
    return rows, baseline or "-"


def _qattn_prefill_kernel_only(q, k, v, causal):
    from ..interface.prefill import prefill_int8
    from ..quant.launch import quantize_qk_int8

    q8, qs, k8, ks, _ = quantize_qk_int8(q, k)
    return lambda: prefill_int8(q8, qs, k8, ks, v, causal=causal)


def _qattn_prefill_fp8pv_kernel_only(q, k, v, causal):
    from ..interface.prefill import prefill_int8
    from ..quant.launch import quantize_qk_int8
    from ..quant.v_fp8 import quantize_v_fp8

    q8, qs, k8, ks, _ = quantize_qk_int8(q, k)
    vt, vs = quantize_v_fp8(v)
    return lambda: prefill_int8(q8, qs, k8, ks, vt, causal=causal, pv_dtype="fp8", v_scale=vs, out_dtype=q.dtype)


def _qattn_prefill_prepass(q, k, v, causal):
    """The prepass that flash_attn_func launches on SM90 (per_warp q scales: K only, Q is quantized inside the
    attention kernel), to report its share of the end-to-end time."""
    from ..quant.launch import quantize_k_int8

    return lambda: quantize_k_int8(k)


def _qattn_prefill_balanced_prepass(q, k, v, causal):
    """flash_attn_func(balance_qk=True)'s prepass on SM90: K, with Q's column amax for the channel balance."""
    from ..quant.launch import quantize_k_int8

    return lambda: quantize_k_int8(k, balance_q=q)


def _qattn_prefill_fp8pv_prepass(q, k, v, causal):
    from ..quant.launch import quantize_k_int8
    from ..quant.v_fp8 import quantize_v_fp8

    return lambda: (quantize_k_int8(k), quantize_v_fp8(v))


def run_prefill(shapes=PREFILL_SHAPES, peers=("fa4", "sage", "sdpa"), reps=20, log=print):
    rows, dev = [], "cuda"
    have = {p: P.available(p) for p in peers}
    baseline = next((p for p in peers if have[p][0]), None)
    make = {"fa4": P.fa4_dense, "sage": P.sage_dense, "sdpa": P.sdpa_dense}
    for sh in shapes:
        log(f"prefill {sh.label}")
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(sh.batch, sh.seqlen, h, sh.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
                   for h in (sh.num_heads, sh.num_kv_heads, sh.num_kv_heads))
        flops = attention_flops(sh.batch, sh.num_heads, sh.seqlen, sh.seqlen, sh.head_dim, sh.causal)
        ref = attention_reference(q[:1, :1024], k[:1], v[:1], causal=sh.causal) if not sh.causal else None
        impls = [(p, make[p], "eager") for p in peers]
        ours = _ours("flash_attn_func")

        def call(**kw):  # maker of one flash_attn_func call with these options (None until it exists)
            return (lambda q, k, v, causal: (lambda: ours(q, k, v, causal=causal, **kw))) if ours else None

        # kernel-only: the attention kernel on Q/K quantized once beforehand; end-to-end: flash_attn_func (the K
        # prepass + the kernel quantizing Q itself); prepass: what flash_attn_func launches before the kernel
        impls.append(("qattn int8-QK", _qattn_prefill_kernel_only if ours else None, "kernel"))
        impls.append(("qattn int8-QK", call(), "end-to-end"))
        impls.append(("qattn int8-QK", _qattn_prefill_prepass if ours else None, "prepass"))
        impls.append(("qattn int8-QK balanced", call(balance_qk=True), "end-to-end"))
        impls.append(("qattn int8-QK balanced", _qattn_prefill_balanced_prepass if ours else None, "prepass"))
        impls.append(("qattn 16-bit QK", call(qk_quant=None), "kernel"))  # the same kernel unquantized: the A/B
        impls.append(("qattn int8-QK fp8-PV", _qattn_prefill_fp8pv_kernel_only if ours else None, "kernel"))
        impls.append(("qattn int8-QK fp8-PV", call(pv_dtype="fp8"), "end-to-end"))
        impls.append(("qattn int8-QK fp8-PV", _qattn_prefill_fp8pv_prepass if ours else None, "prepass"))
        # GPU time of the same calls (CUDA graph): at short lengths an eager call can be host-bound (FA4's Python
        # at S2K: ~100-180 us per call on a lent H100's host, more than its kernel), so these rows compare the GPU
        # work alone, each against FA4's graph row
        if "fa4" in peers:
            impls.append(("fa4", make["fa4"], "graph"))
        impls.append(("qattn int8-QK", call(), "graph"))
        impls.append(("qattn int8-QK fp8-PV", call(pv_dtype="fp8"), "graph"))
        # every implementation's output checked first, then all of them timed in turns (``bench_interleaved``),
        # so that the GPU's clock drift over the run weighs on each alike
        fns, errs, notes = {}, {}, {}
        for i, (name, mk, scope) in enumerate(impls):
            ok, note = have.get(name, (mk is not None, "qattn.flash_attn_func not built yet"))
            if not ok:
                notes[i] = note
                continue
            fns[i] = mk(q, k, v, sh.causal)
            out = fns[i]()
            if scope != "prepass":  # no attention output
                errs[i] = errors(out[:1, :1024], ref) if ref is not None else None
            del out
        # the prepass in a CUDA graph: its GPU time (eager, the host's launch cost of two or three small kernels
        # would dominate it, while in the end-to-end row that cost overlaps the GPU's work)
        times = bench_interleaved(fns, reps=reps, graph_keys=[i for i in fns if impls[i][2] in ("prepass", "graph")])
        del fns
        for i, (name, mk, scope) in enumerate(impls):
            if i in notes:
                rows.append(_row(sh.label, name, None, scope, None, note=notes[i]))
            elif scope == "prepass":  # no FLOPs; its share of the end-to-end time
                r = _row(sh.label, name, None, scope, times[i])
                e2e = next((x for x in rows if x["config"] == sh.label and x["impl"] == name
                            and x["scope"] == "end-to-end" and x.get("median_us")), None)
                if e2e is not None:
                    r["note"] = f"GPU time (graph), {100 * times[i].median_us / e2e['median_us']:.1f}% of end-to-end"
                rows.append(r)
            else:
                rows.append(_row(sh.label, name, None, scope, times[i], flops=flops, err=errs[i]))
                # kernel and end-to-end rows against the peer's eager row, graph rows against its graph row
                rows[-1]["base_scope"] = "graph" if scope == "graph" else "eager"
    if baseline:
        _speedups(rows, baseline)
    return rows, baseline or "-"


def insert_slots(num_tokens: int, page_size: int, num_blocks: int, order: str, generator) -> torch.Tensor:
    """Slot mapping of a ``num_tokens`` insert into a pool of ``num_blocks`` pages.

    ``"page-ordered"``: the pages in random order, the tokens in order inside each page: what an engine's
    prefill writes (``block_table[i // page] * page + i % page``). ``"random"``: every token to a random slot of
    the pool (neighbouring tokens in different pages), the worst case for the write pattern: a page's scale
    rows, a fraction of a 32-byte sector each, are then written by many CTAs far apart in time."""
    dev = generator.device
    if order == "random":
        return torch.randperm(num_blocks * page_size, device=dev, generator=generator)[:num_tokens]
    if order == "page-ordered":
        pages = torch.randperm(num_blocks, device=dev, generator=generator)[: -(-num_tokens // page_size)]
        return (pages[:, None] * page_size + torch.arange(page_size, device=dev)).reshape(-1)[:num_tokens]
    raise ValueError(f"order: expected 'page-ordered' or 'random', got {order!r}")


INSERT_ORDERS = ("page-ordered", "random")


def run_insert(num_tokens=65536, num_kv_heads=8, head_dim=128, page_size=16, formats=("nvfp4", "fp8", "bf16"),
               copy_gbs=None, reps=30, log=print, orders=INSERT_ORDERS):
    """KV insert: new (num_tokens, H, D) bf16 K/V into the pool, for each slot order of :func:`insert_slots`,
    launched from Python (back-to-back calls) and replayed from a CUDA graph. The peer is torch's own bf16 paged
    scatter (what an engine does without quantization)."""
    rows, dev = [], "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    blocks = -(-num_tokens // page_size) + 8
    kd = torch.empty(blocks * page_size, num_kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    vd = torch.empty_like(kd)
    write = _ours("write_kv")
    for order in orders:
        label = f"{num_tokens // 1024}K tok H{num_kv_heads} D{head_dim} p{page_size} {order}"
        slots = insert_slots(num_tokens, page_size, blocks, order, g)
        log(f"insert {label}")
        for scope, graph in SCOPES:
            t = bench(lambda: (kd.index_copy_(0, slots, k), vd.index_copy_(0, slots, v)), warmup=5, reps=reps,
                      use_graph=graph)
            rows.append(_row(label, "torch index_copy", "bf16", scope, t,
                             insert_bytes(num_tokens, num_kv_heads, head_dim, "bf16"), copy_gbs=copy_gbs))
        for fmt in formats:
            name = fmt if isinstance(fmt, str) else "+".join(fmt)
            if write is None:
                rows.append(_row(label, "qattn write_kv", name, "eager", None, note="qattn.write_kv not built yet"))
                continue
            cache = PagedKVCache(1, blocks, page_size, num_kv_heads, head_dim, fmt, device=dev)
            for scope, graph in SCOPES:
                t = bench(lambda c=cache: write(c, 0, k, v, slots), warmup=5, reps=reps, use_graph=graph)
                rows.append(_row(label, "qattn write_kv", name, scope, t,
                                 insert_bytes(num_tokens, num_kv_heads, head_dim, fmt), copy_gbs=copy_gbs))
    rows += _decode_append(num_kv_heads, head_dim, page_size, formats, reps)
    _speedups(rows, "torch index_copy")
    return rows, "torch index_copy"


def _decode_append(num_kv_heads, head_dim, page_size, formats, reps, num_seqs=256):
    """One decode step's insert: one new token for each of ``num_seqs`` sequences (a latency number:
    launched from Python, and replayed from a CUDA graph as engines do)."""
    rows, dev = [], "cuda"
    write = _ours("write_kv")
    label = f"append {num_seqs}x1 tok H{num_kv_heads} D{head_dim}"
    g = torch.Generator(device=dev).manual_seed(1)
    k = torch.randn(num_seqs, num_kv_heads, head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    blocks = num_seqs * 4
    slots = torch.randperm(blocks * page_size, device=dev, generator=g)[:num_seqs]
    kd = torch.empty(blocks * page_size, num_kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    vd = torch.empty_like(kd)
    for scope, graph in SCOPES:
        t = bench(lambda: (kd.index_copy_(0, slots, k), vd.index_copy_(0, slots, v)), reps=reps, use_graph=graph)
        rows.append(_row(label, "torch index_copy", "bf16", scope, t))
    for fmt in formats:
        name = fmt if isinstance(fmt, str) else "+".join(fmt)
        if write is None:
            continue
        cache = PagedKVCache(1, blocks, page_size, num_kv_heads, head_dim, fmt, device=dev)
        for scope, graph in SCOPES:
            t = bench(lambda c=cache: write(c, 0, k, v, slots), reps=reps, use_graph=graph)
            rows.append(_row(label, "qattn write_kv", name, scope, t))
    return rows
