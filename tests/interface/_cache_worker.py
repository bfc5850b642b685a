"""Run in a subprocess by test_compile_cache: compile (or load) a tiny kernel through a CompileCache."""

import sys
import time

import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

from qattn.interface import CompileCache


@cute.kernel
def _twice(a: cute.Tensor, b: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    b[tidx] = a[tidx] * 2.0


@cute.jit
def twice_host(a: cute.Tensor, b: cute.Tensor):
    _twice(a, b).launch(grid=(1, 1, 1), block=(32, 1, 1))


def build(log_path: str | None = None, delay: float = 0.0):
    def _build():
        if log_path:
            with open(log_path, "a") as f:
                f.write("built\n")
        time.sleep(delay)
        a = torch.zeros(32)
        return cute.compile(twice_host, from_dlpack(a), from_dlpack(torch.zeros(32)))
    return _build


if __name__ == "__main__":
    log, delay = sys.argv[1], float(sys.argv[2])
    cache = CompileCache("test")
    cache.get(("twice", "sm_90a", 32), build(log, delay))
    print(cache.events[-1].source)
