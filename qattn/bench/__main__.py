"""``python -m qattn.bench {decode,prefill,insert} [--peers fa4,sdpa,sage] [--json F] [--markdown F] [--plot F]``

Runs qattn and the installed peers on identical inputs in one process, with the device copy bandwidth and
a bf16 GEMM measured in the same run as ceilings, and prints a table (plus JSON / markdown / PNG on request).
"""

from __future__ import annotations

import argparse
import datetime
import sys

from . import report


def _checked(p: argparse.ArgumentParser, args) -> tuple:
    """``(peers or None, formats)`` from the command line, or an argparse error (exit code 2) before anything
    is measured: unknown peers or KV formats, peers for insert, formats for prefill."""
    from ..layouts import kv_formats
    from .runners import check_peers

    peers = args.peers.split(",") if args.peers else None  # "" (or none): the bench's default peers
    try:
        check_peers(args.bench, peers or ())
    except ValueError as e:
        p.error(f"--peers: {e}")
    if args.bench == "prefill":
        if args.formats is not None:
            p.error("--formats: prefill has no KV formats (decode and insert do)")
        return peers, None
    formats = [tuple(f.split("+")) if "+" in f else f for f in (args.formats or "nvfp4,fp8,bf16").split(",")]
    for f in formats:
        try:
            kv_formats(f)
        except ValueError as e:
            p.error(f"--formats: {'+'.join(f) if isinstance(f, tuple) else f!r}: {e}")
    return peers, formats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qattn.bench", description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=["decode", "prefill", "insert"])
    p.add_argument("--peers", default=None,
                   help="comma list of fa4, sdpa, sage (default: decode fa4,sdpa; prefill fa4,sage,sdpa; insert has "
                        "none; sage has no decode, its decode row says so)")
    p.add_argument("--formats", default=None,
                   help="KV formats for decode/insert, a pair as k+v (default: nvfp4,fp8,bf16)")
    p.add_argument("--quick", action="store_true", help="a small subset of configs (smoke run)")
    p.add_argument("--reps", type=int, default=30,
                   help="samples per timing, each 10 back-to-back calls (or graph replays); the median is reported "
                        "(default 30; prefill: two rounds of reps/2 per implementation, taken in turns)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    peers, formats = _checked(p, args)

    import torch

    if not torch.cuda.is_available():
        print("python -m qattn.bench needs a CUDA GPU (the CPU has the reference path: python -m qattn.demo)",
              file=sys.stderr)
        return 2
    from . import runners
    from .timing import bf16_gemm_tflops, copy_bandwidth_gbs

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    copy = copy_bandwidth_gbs()
    meta = {"bench": args.bench, "device": torch.cuda.get_device_name(), "copy_gbs": round(copy),
            "bf16_gemm_tflops": round(bf16_gemm_tflops()), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "command": "python -m qattn.bench " + " ".join(argv or sys.argv[1:])}
    try:
        import cutlass

        meta["cutlass_dsl"] = cutlass.__version__
    except Exception:
        pass
    if args.bench == "decode":
        shapes = runners.DECODE_SHAPES[:1] if args.quick else runners.DECODE_SHAPES
        rows, base = runners.run_decode(shapes, formats, peers or runners.DECODE_PEERS, copy, args.reps, log=log)
    elif args.bench == "prefill":
        shapes = runners.PREFILL_SHAPES[:2] if args.quick else runners.PREFILL_SHAPES
        rows, base = runners.run_prefill(shapes, peers or ("fa4", "sage", "sdpa"), args.reps, log=log)
        meta["notes"] = runners.PREFILL_LEGEND  # the markdown page's legend
    else:
        rows, base = runners.run_insert(formats=formats, copy_gbs=copy, reps=args.reps, log=log)
    meta["baseline"] = base
    print(f"{meta['device']}: copy {meta['copy_gbs']} GB/s, bf16 GEMM {meta['bf16_gemm_tflops']} TFLOP/s; "
          f"speedup vs {base}")
    print(report.table(rows))
    if meta.get("notes"):
        print(meta["notes"])
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.markdown(rows, meta))
    if args.plot:
        report.plot(args.plot, rows, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
