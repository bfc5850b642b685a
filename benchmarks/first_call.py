"""First call of each public GPU op in a fresh process, with an empty (cold) and a filled (warm) compile cache.

    python benchmarks/first_call.py            # needs an SM90 GPU; uses a temporary QATTN_CACHE_DIR

Each run is a new Python process (as a server start-up is): it imports qattn and CuTe-DSL (timed separately,
'imports'), then times the first call of prefill (``flash_attn_func``; on SM90 the K prepass, one to three
kernels, then the attention kernel, which quantizes Q itself), ``write_kv``, ``flash_attn_with_kvcache`` and
``flatten_kv``, each to completion (synchronized). Cold: every variant is compiled; warm: every variant is loaded
from the disk cache the cold run filled.
"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import time, json, torch
t0 = time.perf_counter()
import qattn
import cutlass, qattn.interface.prefill, qattn.quant.launch, qattn.cute_kernels.sm90.decode  # server start-up
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_imp = time.perf_counter() - t0
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
cache = qattn.PagedKVCache(1, 64, 16, 2, 128, "nvfp4", device="cuda")
tbl = torch.arange(64, device="cuda", dtype=torch.int32).view(2, 32)
lens = torch.tensor([300, 500], dtype=torch.int32, device="cuda")
qd = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
slots = torch.arange(512, device="cuda")
times = {"imports": t_imp}
for name, fn in (("prefill", lambda: qattn.flash_attn_func(q, k, k, causal=True)),
                 ("write_kv", lambda: qattn.write_kv(cache, 0, k[0], k[0], slots)),
                 ("decode", lambda: qattn.flash_attn_with_kvcache(qd, cache, lens, tbl)),
                 ("flatten_kv", lambda: qattn.flatten_kv(cache, 0, tbl, lens))):
    torch.cuda.synchronize(); t = time.perf_counter()
    fn(); torch.cuda.synchronize()
    times[name] = time.perf_counter() - t
print(json.dumps({k: round(v, 3) for k, v in times.items()}))
'''


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, QATTN_CACHE_DIR=d,
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        rows = {}
        for run in ("cold", "warm"):
            r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not line:
                raise SystemExit(f"{run} run failed:\n{r.stderr[-3000:]}")
            rows[run] = json.loads(line[-1])
    names = list(rows["cold"])
    print("| first call (s) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for run, t in rows.items():
        print(f"| {run} | " + " | ".join(f"{t[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
