"""``qattn-warmup``: compile a matrix of kernel variants into the persistent cache, on a GPU or CPU machine.

Examples::

    qattn-warmup --list
    qattn-warmup --arch sm_90a,sm_100a --kernels fp4_dequant --kv-formats nvfp4,mxfp4 --head-dims 64,128
    qattn-warmup --arch auto --jobs 4        # the local GPU's arch, 4 compile processes
    qattn-warmup --arch sm_90a --kernels decode,combine --kv-formats nvfp4,int8+nvfp4 --head-dims 128 \
        --gqa 4,8 --page-sizes 16 --seqlen-q 1,4 --recent-windows 0,64 --sink-tokens 0,1
    qattn-warmup --arch sm_90a --kernels kv_insert --kv-formats nvfp4 --scale-search msenb
    qattn-warmup --cache-info                # where the cache is, its size, this version's share
    qattn-warmup --clear-stale               # drop objects of other qattn / cutlass-dsl versions
    qattn-warmup --clear                     # drop everything
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from .compile_cache import cache_root, cache_size, clear_cache, source_fingerprint
from .variants import ARCHES, cache_for, enumerate_variants, kinds, supported_arch


def _csv(s: str | None) -> list[str] | None:
    return None if s is None else [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str | None) -> list[int] | None:
    return None if s is None else [int(x) for x in _csv(s)]


def _filters(args, error) -> dict:
    """The variant filters of the command line, each value checked (``error``: argparse's, exits 2)."""
    from ..cute_kernels.config_values import softcap_value
    from ..layouts.formats import FORMAT_NAMES
    from ..layouts.paged import MAX_SINK_TOKENS, PAGE_SIZES

    def ints(flag: str, ok, what: str):
        s = getattr(args, flag.lstrip("-").replace("-", "_"))
        try:
            vals = _ints(s)
        except ValueError:
            error(f"{flag}: expected a comma list of ints, got {s!r}")
        bad = [x for x in vals or () if not ok(x)]
        if bad:
            error(f"{flag}: {bad} not {what}")
        return vals

    formats = _csv(args.kv_formats)
    bad = [f for f in formats or () if any(n not in FORMAT_NAMES for n in f.split("+")) or f.count("+") > 1]
    if bad:
        error(f"--kv-formats: unknown {bad}; known: {list(FORMAT_NAMES)} (or k+v pairs of them)")
    dtypes = _csv(args.q_dtypes)
    if [d for d in dtypes or () if d not in ("bf16", "f16")]:
        error(f"--q-dtypes: expected bf16 and / or f16, got {args.q_dtypes!r}")
    softcaps = None
    if args.softcap:
        try:
            softcaps = sorted({softcap_value(float(x)) for x in _csv(args.softcap)})
        except ValueError:
            error(f"--softcap: expected a comma list of finite numbers >= 0, got {args.softcap!r}")
    searches = _csv(args.scale_search)
    if searches:
        from ..layouts.formats import CACHE_SCALE_SEARCHES

        if [x for x in searches if x not in CACHE_SCALE_SEARCHES]:
            error(f"--scale-search: expected {list(CACHE_SCALE_SEARCHES)}, got {args.scale_search!r}")
    return {"kv_formats": formats, "head_dims": ints("--head-dims", lambda x: x > 0, "> 0"),
            "gqa": ints("--gqa", lambda x: x >= 1, ">= 1"),
            "page_sizes": ints("--page-sizes", lambda x: x in PAGE_SIZES, f"in {PAGE_SIZES}"),
            "seqlen_q": ints("--seqlen-q", lambda x: 1 <= x <= 16, "in [1, 16]"),
            "recent_windows": ints("--recent-windows", lambda x: x >= 0, ">= 0"),
            "sink_tokens": ints("--sink-tokens", lambda x: 0 <= x <= MAX_SINK_TOKENS, f"in [0, {MAX_SINK_TOKENS}]"),
            "q_dtypes": dtypes, "balance_qk": args.balance_qk, "sliding_window": args.sliding_window,
            "softcaps": softcaps, "scale_searches": searches}


def _compile_one(kind: str, arch: str, index: int, filters: dict):
    """Worker: compile (or load) variant ``index``; returns (source, seconds, path, error)."""
    t0 = time.perf_counter()
    try:
        v = enumerate_variants(kind, arch, **filters)[index]
        cache = cache_for(kind)
        if v.key in cache:  # already in this process's memory: a lookup records no event
            return ("memory", time.perf_counter() - t0, None, None)
        cache.get(v.key, v.build)
        ev = cache.events[-1]
        return (ev.source, time.perf_counter() - t0, ev.path, None)
    except Exception as e:  # reported in the table; the exit code says it failed
        return ("failed", time.perf_counter() - t0, None, f"{type(e).__name__}: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qattn-warmup", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="auto", help=f"comma list of {ARCHES} or 'auto' (the local GPU)")
    p.add_argument("--kernels", default=None, help="comma list of kernel kinds (default: all); see --list")
    p.add_argument("--kv-formats", default=None, help="comma list of KV format names")
    p.add_argument("--head-dims", default=None, help="comma list, e.g. 64,128")
    p.add_argument("--gqa", default=None, help="comma list of query heads per kv head")
    p.add_argument("--page-sizes", default=None, help="comma list of page sizes")
    p.add_argument("--seqlen-q", default=None, help="comma list of query tokens per step (decode; default 1)")
    p.add_argument("--recent-windows", default=None, help="comma list of recent-token windows (decode; default 0)")
    p.add_argument("--sink-tokens", default=None, help="comma list of sink token counts (decode; default 0)")
    p.add_argument("--q-dtypes", default=None, help="comma list of bf16 / f16 (decode, combine; default bf16)")
    p.add_argument("--balance-qk", action="store_true",
                   help="prefill: also the kernels of balance_qk=True (channel balancing of the INT8 Q/K prepass)")
    p.add_argument("--sliding-window", action="store_true",
                   help="prefill, decode: also the kernels of window_size (sliding-window attention)")
    p.add_argument("--softcap", default=None,
                   help="prefill, decode: also the kernels of these softcap values, a comma list (e.g. 50 "
                        "for Gemma 2)")
    p.add_argument("--scale-search", default=None,
                   help="insert: also the variants of caches written with this FP4 block-scale search "
                        "(kv_format(..., scale_search=...)), e.g. msenb")
    p.add_argument("--jobs", type=int, default=1, help="compile processes")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument("--dry-run", action="store_true", help="show what would be compiled, compile nothing")
    p.add_argument("--cache-info", action="store_true", help="print the cache directory and its size, and exit")
    p.add_argument("--clear", action="store_true", help="delete every cached kernel, and exit")
    p.add_argument("--clear-stale", action="store_true",
                   help="delete cached kernels of other qattn sources / cutlass-dsl versions, and exit")
    args = p.parse_args(argv)
    if args.cache_info or args.clear or args.clear_stale:
        return _cache_command(args)

    if args.arch == "auto":
        import torch

        if not torch.cuda.is_available():
            p.error("--arch auto needs a GPU; name the arch (e.g. --arch sm_90a) to compile on a CPU machine")
        arches = [supported_arch()]
    else:
        arches = _csv(args.arch)
        bad = [a for a in arches if a not in ARCHES]
        if bad:
            p.error(f"--arch: unknown {bad}; expected {ARCHES}")
    wanted = _csv(args.kernels) or kinds()
    unknown = [k for k in wanted if k not in kinds()]
    if unknown:
        p.error(f"--kernels: unknown {unknown}; known: {kinds()}")
    if args.jobs < 1:
        p.error(f"--jobs: expected an int >= 1, got {args.jobs}")
    filters = _filters(args, p.error)
    try:
        jobs = [(k, a, i, v) for a in arches for k in wanted
                for i, v in enumerate(enumerate_variants(k, a, **filters))]
    except ValueError as e:  # a filter value a kernel kind cannot take (e.g. its head_dim)
        p.error(f"no variants for these filters: {e}")
    if args.list or args.dry_run:
        for k, a, _, v in jobs:
            print(f"{a:8} {k:14} {v.label}")
        print(f"{len(jobs)} variants" + ("" if cache_root() is None else f"; cache: {cache_root()}"))
        return 0
    if not jobs:
        print("no variants match the filters", file=sys.stderr)
        return 1

    results = [None] * len(jobs)
    t_all = time.perf_counter()

    def progress(done: int) -> None:
        bar = "#" * (30 * done // len(jobs))
        print(f"\r[{bar:<30}] {done}/{len(jobs)}", end="", file=sys.stderr, flush=True)

    if args.jobs <= 1:  # in this process: no start-up cost, and the in-memory caches stay warm
        for n, (k, a, i, _) in enumerate(jobs):
            results[n] = _compile_one(k, a, i, filters)
            progress(n + 1)
    else:
        # spawn, not fork: a forked child inherits this process's MLIR/LLVM state and cannot export objects
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {pool.submit(_compile_one, k, a, i, filters): n for n, (k, a, i, _) in enumerate(jobs)}
            for done, fut in enumerate(as_completed(futs), 1):
                try:
                    results[futs[fut]] = fut.result()
                except Exception as e:  # a worker died (e.g. killed for memory): that variant failed, the table stays
                    results[futs[fut]] = ("failed", 0.0, None, f"worker: {type(e).__name__}: {e}")
                progress(done)
    print(file=sys.stderr)

    print(f"{'arch':8} {'kernel':14} {'variant':46} {'status':9} {'seconds':>8} {'size':>9}")
    failed = 0
    for (k, a, _, v), (source, secs, path, err) in zip(jobs, results):
        size = f"{os.path.getsize(path) / 1024:.0f} KiB" if path and os.path.exists(path) else "-"
        status = {"compiled": "new", "disk": "cached", "memory": "cached"}.get(source, source)
        print(f"{a:8} {k:14} {v.label:46} {status:9} {secs:8.2f} {size:>9}")
        if err:
            failed += 1
            print(f"    {err}")
    sz = cache_size()
    print(f"{len(jobs)} variants, {failed} failed, {time.perf_counter() - t_all:.1f} s; "
          f"cache {cache_root()}: {sz['objects']} objects, {sz['bytes'] / 2**20:.1f} MiB")
    return 1 if failed else 0


def _cache_command(args) -> int:
    root = cache_root()
    if root is None:
        print("persistent cache disabled (QATTN_CACHE_DIR=off)")
        return 0
    if args.clear or args.clear_stale:
        removed = clear_cache(stale_only=args.clear_stale and not args.clear)
        print(f"removed {removed} files from {root}")
    sz = cache_size()
    mine = root / source_fingerprint()
    n_mine = len(list(mine.rglob("*.o"))) if mine.exists() else 0
    print(f"cache {root}: {sz['objects']} objects, {sz['bytes'] / 2**20:.1f} MiB; "
          f"{n_mine} objects for this version ({source_fingerprint()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
