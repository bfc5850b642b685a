"""The persistent compile cache on a GPU: a fresh process loads the kernel from disk, fast and correct."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, time, torch
t0 = time.perf_counter()
from qattn.cute_kernels.fp4_rows import dequantize_rows
from qattn.interface.variants import cache_for
from qattn.quant.reference import dequantize
g = torch.Generator(device="cuda").manual_seed(1)
p = torch.randint(0, 256, (777, 64), dtype=torch.uint8, device="cuda", generator=g)
s = torch.randint(0, 0x7F, (777, 8), dtype=torch.uint8, device="cuda", generator=g)
gs = torch.rand(777, device="cuda", generator=g) + 0.5
out = torch.full((777, 128), float("nan"), device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
dequantize_rows(p, s, "nvfp4", gs, out=out)
torch.cuda.synchronize()
t2 = time.perf_counter()
ev = cache_for("fp4_dequant").events[-1]
print(json.dumps({"source": ev.source, "first_call_s": t2 - t1, "import_s": t1 - t0,
                  "exact": bool(torch.equal(out, dequantize(p, s, "nvfp4", gs)))}))
"""


def _run(cache_dir):
    env = dict(os.environ, QATTN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cold_then_warm_first_call(tmp_path):
    cold = _run(tmp_path)
    warm = _run(tmp_path)
    print(f"\nfirst call: cold {cold['first_call_s']:.3f} s (compiled), warm {warm['first_call_s']:.3f} s (from disk)")
    assert cold["source"] == "compiled" and warm["source"] == "disk"
    assert cold["exact"] and warm["exact"]
    assert warm["first_call_s"] <= 0.5
