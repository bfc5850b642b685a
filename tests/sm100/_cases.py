"""Shared builders for the SM100 CPU tests: a random paged cache (shuffled blocks) over given K/V, and a timed
sm_100a compile."""

from __future__ import annotations

import json
import os
import time

import torch

from qattn.cute_kernels.compile_utils import compile_for_arch
from qattn.layouts.paged import PagedKVCache
from qattn.reference.kv_ops import write_kv_reference


def compile_sm100_timed(kernel: str, case, fn, args) -> str:
    """``compile_for_arch(fn, *args, arch="sm_100a")``'s PTX; the compile time is printed and, when
    ``$QATTN_COMPILE_TIMES`` names a file, appended to it as a JSON line {kernel, case, seconds}."""
    t0 = time.perf_counter()
    _, ptx = compile_for_arch(fn, *args, arch="sm_100a")
    dt = time.perf_counter() - t0
    print(f"compile {kernel} {case}: {dt:.2f} s")
    path = os.environ.get("QATTN_COMPILE_TIMES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"kernel": kernel, "case": list(case), "seconds": round(dt, 2)}) + "\n")
    return ptx


def make_case(fmt: str, *, B=2, H=2, G=4, Sq=1, D=128, page=16, lens=(300, 77), outliers=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens[:B], dtype=torch.int32)
    max_len = int(lens.max())
    nblk_seq = -(-max_len // page)
    num_blocks = B * nblk_seq + 3
    cache = PagedKVCache(1, num_blocks, page, H, D, fmt)
    k = torch.randn(B, max_len, H, D, generator=g)
    v = torch.randn(B, max_len, H, D, generator=g)
    q = torch.randn(B, Sq, H * G, D, generator=g)
    if outliers:  # a few large key channels and some spiky query / value entries
        k[..., 3] *= 20.0
        k[..., 77 % D] *= 8.0
        q[..., 5] *= 10.0
        v[:, ::13] *= 6.0
    perm = torch.randperm(num_blocks - 1, generator=g)[: B * nblk_seq] + 1
    bt = perm.reshape(B, nblk_seq).to(torch.int32)
    for b in range(B):
        n = int(lens[b])
        t = torch.arange(n)
        slots = bt[b, t // page].long() * page + t % page
        write_kv_reference(cache, 0, k[b, :n], v[b, :n], slots)
    return q.to(torch.bfloat16), k, v, cache, lens, bt


def ptxas_spill_bytes(ptx: str, arch: str = "sm_100a") -> tuple[int, int]:
    """(registers, spill-store bytes) that ``ptxas -v`` reports for ``ptx`` (the CUDA toolkit's ptxas on PATH;
    callers skip when it is absent). Spills are ptxas's, invisible in the PTX."""
    import re
    import shutil
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        out = subprocess.run([shutil.which("ptxas"), f"-arch={arch}", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = max(int(x) for x in re.findall(r"Used (\d+) registers", out))
    spills = max(int(x) for x in re.findall(r"(\d+) bytes spill stores", out))
    return regs, spills
