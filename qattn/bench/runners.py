"""The three benchmarks: paged decode, dense prefill, KV insert. Each returns rows (dicts) for report.py.

Inputs are random (never zeros); every implementation of a config sees identical inputs; errors are taken
against an fp64 reference over unquantized inputs on the first few sequences (what a user loses in total:
format error plus kernel error), from a call made after the timing (a launch-plan replay, as the timed calls
are; with ``out=``, whose tensor makes a new signature, the third call, which replays that one's plan) into
NaN-poisoned output memory (rows a kernel leaves unwritten give NaN errors, never another
implementation's output). A qattn entry point that does not exist yet gives a row saying so.
"""

from __future__ import annotations

import functools

import torch

from ..layouts import PagedKVCache, kv_formats
from ..reference import attention_reference
from . import peers as P
from .metrics import DecodeShape, Errors, PrefillShape, attention_flops, decode_bytes, errors, insert_bytes
from .timing import bench, bench_interleaved

DECODE_SHAPES = [DecodeShape(32, 8192, 32, 8, 128, 128), DecodeShape(8, 32768, 32, 8, 128, 128),
                 DecodeShape(128, 2048, 32, 8, 128, 128), DecodeShape(1, 131072, 32, 8, 128, 128),
                 DecodeShape(32, 8192, 32, 8, 128, 16)]
PREFILL_SHAPES = [PrefillShape(2, s, 16, 16, d, c) for d in (128, 64) for s in (2048, 4096, 8192, 16384)
                  for c in (False, True)]
PEERS = ("fa4", "sdpa", "sage")  # every peer name the benches know (peers.available)
DECODE_PEERS = ("fa4", "sdpa")  # those with a decode implementation; sage gets a row saying it has none
NO_DECODE = "SageAttention has no paged decode (prefill only): not timed"
PREFILL_LEGEND = ("scopes: eager = 10 back-to-back eager calls per sample (host launch cost hidden while shorter "
                  "than the GPU work); graph = the same call replayed from a CUDA graph; kernel = the attention "
                  "kernel alone, launched as flash_attn_func launches it (SM90: the 16-bit Q, quantized inside "
                  "the kernel, and K quantized once beforehand, outside the timing; 'qattn 16-bit QK': flash_attn_func(qk_quant=None), which has no prepass); "
                  "end-to-end = flash_attn_func (prepass + kernel); prepass = what flash_attn_func launches before "
                  "the kernel (CUDA graph) and its share of the end-to-end graph time. Errors: the last 1024 query "
                  "rows of sequence 0 against fp64 attention.")


def check_peers(bench_name: str, peers) -> None:
    """Raises ValueError for a peer name no bench knows, or any peer for ``insert`` (its baseline is torch's
    own paged scatter): before anything is measured."""
    if bench_name == "insert" and peers:
        raise ValueError("insert has no peers (its baseline is torch's index_copy_)")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(map(repr, bad))}; expected some of {', '.join(PEERS)}")


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

# The third call of a signature replays its launch plan (the first takes the normal path, the second records it),
# as the timed calls do
_REPLAY_CALLS = 3


def _errors_into(fn, like: torch.Tensor, ref: torch.Tensor, sel) -> Errors:
    """Errors of ``fn(out=...)`` (an API that takes ``out``) on ``out[sel]``: ``out`` shaped like ``like``,
    NaN-filled before each call, called until its launch plan replays (a new ``out`` is a new signature)."""
    out = torch.empty_like(like)
    for _ in range(_REPLAY_CALLS):
        out.fill_(float("nan"))
        fn(out=out)
    return errors(out[sel], ref)


def _within(span: tuple, spans: list) -> bool:
    """Whether the byte range ``span`` lies inside the union of ``spans``."""
    lo, hi = span
    for a, b in sorted(spans):
        if a <= lo < b:
            lo = b
        if lo >= hi:
            return True
    return False


def _poisoned_call(fn, like: torch.Tensor) -> tuple:
    """``(fn(), poisoned)``, the call's output allocated from NaN-filled memory where ``poisoned``. For an API
    without ``out``: torch's allocator hands out memory it caches, so the cache is emptied, then three tensors
    like the output are NaN-filled and freed (three: buffers the call allocates before its output, e.g. a launch
    plan's workspace or SageAttention's int8 Q and K, take the first ones). ``poisoned`` checks that the output's
    storage lies inside them (the allocator promises nothing)."""
    torch.cuda.empty_cache()
    scratch = [torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device) for _ in range(3)]
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in scratch]
    del scratch
    out = fn()
    st = out.untyped_storage()
    return out, _within((st.data_ptr(), st.data_ptr() + st.nbytes()), spans)


_NOT_POISONED = "output memory not NaN-poisoned for the error check (allocator)"


def _errors_after(fn, like: torch.Tensor, ref: torch.Tensor, sel) -> tuple:
    """``(errors, note)`` of a call of ``fn`` made after its timing (a launch-plan replay) into poisoned memory
    (:func:`_poisoned_call`); the note says when the poisoning did not take."""
    out, poisoned = _poisoned_call(fn, like)
    return errors(out[sel], ref), "" if poisoned else _NOT_POISONED


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


def run_decode(shapes=DECODE_SHAPES, formats=("nvfp4", "fp8", "bf16"), peers=DECODE_PEERS, copy_gbs=None,
               reps=30, err_seqs=2, log=print, device="cuda") -> tuple[list[dict], str]:
    """Paged decode rows: each peer (bf16) and qattn per KV format, eager and CUDA graph, plus qattn's whole
    decode step (write_kv + attention) in a graph. ``device``: "cuda" (the CPU serves the harness's tests)."""
    check_peers("decode", peers)
    rows, dev = [], device
    have = {p: P.available(p) if p in DECODE_PEERS else (False, NO_DECODE) for p in peers}
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
        e = slice(0, min(B, err_seqs))
        ref = attention_reference(q[e], k[e], v[e], causal=True)
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
            elif p == "sdpa":
                fn = P.sdpa_dense(q, k, v, causal=True)
            else:  # DECODE_PEERS and this mapping go together
                raise AssertionError(f"no decode implementation for peer {p!r}")
            times = {scope: bench(fn, warmup=5, reps=reps, use_graph=graph) for scope, graph in SCOPES}
            err, note = _errors_after(fn, q, ref, e)
            for scope, t in times.items():
                rows.append(_row(sh.label, p, "bf16", scope, t, decode_bytes(sh, "bf16"), copy_gbs=copy_gbs,
                                 err=err, kv_bpt=2 * 2 * D, note=note))
            del fn
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
            fn = (lambda out=None, c=cache: attn(q, c, lens, table, out=out))
            times = {scope: bench(fn, warmup=5, reps=reps, use_graph=graph) for scope, graph in SCOPES}
            err = _errors_into(fn, q, ref, e)
            for scope, t in times.items():
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
                err, note = _errors_after(step, q, ref, e)
                row = _row(sh.label, "qattn", name, "step graph", t, None, copy_gbs=copy_gbs, err=err, kv_bpt=bpt,
                           note="write_kv of 1 token/seq + attention; speed-up vs the peer's attention graph"
                                + (f"; {note}" if note else ""))
                row["base_scope"] = "graph"
                rows.append(row)
            del cache, fn
        del q, k, v
        torch.cuda.empty_cache()
    if baseline:
        _speedups(rows, baseline)
    return rows, baseline or "-"


def _kernel_quantizes_q(q) -> bool:
    """Whether flash_attn_func's attention kernel quantizes Q itself here (SM90) or takes the prepass's int8 Q."""
    from ..interface.prefill import _kernel_quantizes_q

    return _kernel_quantizes_q(q, "per_warp")


def _qattn_prefill_kernel_only(q, k, v, causal, fp8=False):
    """The attention kernel alone, launched as ``flash_attn_func(q, k, v, causal=causal)`` (``fp8``: with
    ``pv_dtype="fp8"``) launches it (``interface.prefill._flash_attn_func_eager``), on what its prepass makes,
    made once here, outside the timing: on SM90 the 16-bit Q (``q_scale=None``: the kernel quantizes it) and the
    K prepass's int8 K; elsewhere (SM100) the Q/K prepass's int8 Q and K; with ``fp8`` the V prepass's E4M3 V^T.
    Not ``_pdl``: that flag promises that the launch just before is this call's prepass, and here it is the
    previous kernel call (the overlap with the prepass shows in the end-to-end row). Returns ``fn(out=None)``."""
    from ..interface.prefill import prefill_int8
    from ..quant.launch import quantize_k_int8, quantize_qk_int8

    if _kernel_quantizes_q(q):
        q8, qs = q, None
        k8, ks, _ = quantize_k_int8(k)
    else:
        q8, qs, k8, ks, _ = quantize_qk_int8(q, k)
    kw = {}
    if fp8:
        from ..quant.v_fp8 import quantize_v_fp8

        v, vs = quantize_v_fp8(v)
        kw = dict(pv_dtype="fp8", v_scale=vs, out_dtype=q.dtype)
    return lambda out=None: prefill_int8(q8, qs, k8, ks, v, causal=causal, return_lse=True, out=out, **kw)[0]


def _qattn_prefill_prepass(q, k, v, causal, balance=False, fp8=False):
    """What ``flash_attn_func`` launches before its attention kernel, to report its share of the end-to-end
    time: on SM90 the K prepass (``balance``: ``balance_qk=True``, which also reads Q's column amax), elsewhere
    the Q/K prepass; with ``fp8`` then the V prepass, as there a programmatic dependent of the K prepass
    (``_pdl=True``: the K prepass does not write V)."""
    from ..quant.launch import quantize_k_int8, quantize_qk_int8
    from ..quant.v_fp8 import quantize_v_fp8

    if _kernel_quantizes_q(q):
        qk = lambda: quantize_k_int8(k, balance_q=q if balance else None)  # noqa: E731
    else:
        qk = lambda: quantize_qk_int8(q, k, balance_qk=balance)  # noqa: E731
    return (lambda: (qk(), quantize_v_fp8(v, _pdl=True))) if fp8 else qk


def _prefill_impls(peers, ours) -> list:
    """``(name, maker(q, k, v, causal) -> fn, scope)`` of one prefill shape (maker None: not built yet)."""
    make = {"fa4": P.fa4_dense, "sage": P.sage_dense, "sdpa": P.sdpa_dense}

    def call(**kw):  # maker of one flash_attn_func call with these options (None until it exists)
        return (lambda q, k, v, causal: (lambda: ours(q, k, v, causal=causal, **kw))) if ours else None

    def mk(f, **kw):  # a qattn maker with these options (None until flash_attn_func exists)
        return functools.partial(f, **kw) if ours else None

    impls = [(p, make[p], "eager") for p in peers]
    # kernel: the attention kernel as flash_attn_func launches it, its prepass made beforehand; end-to-end:
    # flash_attn_func (the K prepass + the kernel quantizing Q itself); prepass: what flash_attn_func launches
    # before the kernel
    impls.append(("qattn int8-QK", mk(_qattn_prefill_kernel_only), "kernel"))
    impls.append(("qattn int8-QK", call(), "end-to-end"))
    impls.append(("qattn int8-QK", mk(_qattn_prefill_prepass), "prepass"))
    impls.append(("qattn int8-QK balanced", call(balance_qk=True), "end-to-end"))
    impls.append(("qattn int8-QK balanced", mk(_qattn_prefill_prepass, balance=True), "prepass"))
    impls.append(("qattn 16-bit QK", call(qk_quant=None), "kernel"))  # the same kernel unquantized: the A/B
    impls.append(("qattn int8-QK fp8-PV", mk(_qattn_prefill_kernel_only, fp8=True), "kernel"))
    impls.append(("qattn int8-QK fp8-PV", call(pv_dtype="fp8"), "end-to-end"))
    impls.append(("qattn int8-QK fp8-PV", mk(_qattn_prefill_prepass, fp8=True), "prepass"))
    # GPU time of the same calls (CUDA graph): at short lengths an eager call can be host-bound (FA4's Python at
    # S2K: ~100-180 us per call on a lent H100's host, more than its kernel), so these rows compare the GPU work
    # alone, each against FA4's graph row; each prepass's share is of its variant's graph row
    if "fa4" in peers:
        impls.append(("fa4", make["fa4"], "graph"))
    impls.append(("qattn int8-QK", call(), "graph"))
    impls.append(("qattn int8-QK balanced", call(balance_qk=True), "graph"))
    impls.append(("qattn int8-QK fp8-PV", call(pv_dtype="fp8"), "graph"))
    return impls


def _prepass_note(impls, times, i) -> str:
    """A prepass row's note: its GPU time as a share of its variant's end-to-end graph time (both graphs)."""
    name = impls[i][0]
    j = next((j for j, (n, _, scope) in enumerate(impls) if n == name and scope == "graph" and j in times), None)
    share = "n/a" if j is None else f"{100 * times[i].median_us / times[j].median_us:.1f}%"
    return f"GPU time (graph), {share} of the end-to-end graph time"


PREFILL_ERR_ROWS = 1024  # query rows of sequence 0 whose errors a prefill row reports


def run_prefill(shapes=PREFILL_SHAPES, peers=("fa4", "sage", "sdpa"), reps=30, log=print, device="cuda"):
    """Dense prefill rows (legend: ``PREFILL_LEGEND``), all implementations of a shape timed in turns.
    ``device``: "cuda" (the CPU serves the harness's tests)."""
    check_peers("prefill", peers)
    rows, dev = [], device
    have = {p: P.available(p) for p in peers}
    baseline = next((p for p in peers if have[p][0]), None)
    ours = _ours("flash_attn_func")
    impls = _prefill_impls(peers, ours)
    for sh in shapes:
        log(f"prefill {sh.label}")
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(sh.batch, sh.seqlen, h, sh.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
                   for h in (sh.num_heads, sh.num_kv_heads, sh.num_kv_heads))
        flops = attention_flops(sh.batch, sh.num_heads, sh.seqlen, sh.seqlen, sh.head_dim, sh.causal)
        # the last query rows of sequence 0 against all its keys: the reference's causal mask is end-aligned
        # (query i sees keys j <= i + Sk - Sq), so these rows see exactly the keys they see in the full problem
        sel = (slice(0, 1), slice(-PREFILL_ERR_ROWS, None))
        ref = attention_reference(q[sel], k[:1], v[:1], causal=sh.causal)
        # all implementations timed in turns (``bench_interleaved``), so that the GPU's clock drift over the run
        # weighs on each alike; then each one's output checked
        fns, notes = {}, {}
        for i, (name, mk, scope) in enumerate(impls):
            ok, note = have.get(name, (mk is not None, "qattn.flash_attn_func not built yet"))
            if ok:
                fns[i] = mk(q, k, v, sh.causal)
            else:
                notes[i] = note
        # the prepass in a CUDA graph, as the end-to-end graph row its share is of (no launch gaps in either)
        times = bench_interleaved(fns, reps=reps, graph_keys=[i for i in fns if impls[i][2] in ("prepass", "graph")])
        for i, (name, mk, scope) in enumerate(impls):
            if i in notes:
                rows.append(_row(sh.label, name, None, scope, None, note=notes[i]))
            elif scope == "prepass":  # no attention output, no FLOPs
                rows.append(_row(sh.label, name, None, scope, times[i], note=_prepass_note(impls, times, i)))
            else:
                if getattr(mk, "func", None) is _qattn_prefill_kernel_only:  # prefill_int8 takes out=
                    err, note = _errors_into(fns[i], q, ref, sel), ""
                else:
                    err, note = _errors_after(fns[i], q, ref, sel)
                rows.append(_row(sh.label, name, None, scope, times[i], flops=flops, err=err, note=note))
                # kernel and end-to-end rows against the peer's eager row, graph rows against its graph row
                rows[-1]["base_scope"] = "graph" if scope == "graph" else "eager"
        del fns, q, k, v
        torch.cuda.empty_cache()
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
