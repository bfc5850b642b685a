"""``python -m qattn.bench {decode,prefill,insert} [--peers fa4,sdpa,sage] [--json F] [--markdown F] [--plot F]``

Runs qattn and the installed peers on identical inputs in one process, with the device copy bandwidth and
a bf16 GEMM measured in the same run as ceilings, and prints a table (plus JSON / markdown / PNG on request).
"""

from __future__ import annotations

import argparse
import datetime
import sys

from . import report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qattn.bench", description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=["decode", "prefill", "insert"])
    p.add_argument("--peers", default=None, help="comma list of fa4, sdpa, sage (default: all for the bench)")
    p.add_argument("--formats", default="nvfp4,fp8,bf16", help="KV formats for decode/insert; a pair as k+v")
    p.add_argument("--quick", action="store_true", help="a small subset of configs (smoke run)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("python -m qattn.bench needs a CUDA GPU (the CPU has the reference path: python -m qattn.demo)",
              file=sys.stderr)
        return 2
    from . import runners
    from .timing import bf16_gemm_tflops, copy_bandwidth_gbs

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    formats = [tuple(f.split("+")) if "+" in f else f for f in args.formats.split(",")]
    copy = copy_bandwidth_gbs()
    meta = {"bench": args.bench, "device": torch.cuda.get_device_name(), "copy_gbs": round(copy),
            "bf16_gemm_tflops": round(bf16_gemm_tflops()), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "command": "python -m qattn.bench " + " ".join(argv or sys.argv[1:])}
    try:
        import cutlass

        meta["cutlass_dsl"] = cutlass.__version__
    except Exception:
        pass
    peers = args.peers.split(",") if args.peers else None
    if args.bench == "decode":
        shapes = runners.DECODE_SHAPES[:1] if args.quick else runners.DECODE_SHAPES
        rows, base = runners.run_decode(shapes, formats, peers or ("fa4", "sdpa"), copy, args.reps, log=log)
    elif args.bench == "prefill":
        shapes = runners.PREFILL_SHAPES[:2] if args.quick else runners.PREFILL_SHAPES
        rows, base = runners.run_prefill(shapes, peers or ("fa4", "sage", "sdpa"), args.reps, log=log)
    else:
        rows, base = runners.run_insert(formats=formats, copy_gbs=copy, reps=args.reps, log=log)
    meta["baseline"] = base
    print(f"{meta['device']}: copy {meta['copy_gbs']} GB/s, bf16 GEMM {meta['bf16_gemm_tflops']} TFLOP/s; "
          f"speedup vs {base}")
    print(report.table(rows))
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
