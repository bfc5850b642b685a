"""GPU timing done right: CUDA events, warm-up, medians, rotating inputs, optional CUDA-graph replay,
and the two ceilings (device copy bandwidth, bf16 GEMM rate) measured in the same run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    reps: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the run-to-run noise; differences smaller than this mean nothing."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us else float("nan")


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def bench(fn: Callable[..., object], arg_sets: Sequence[tuple] = ((),), *, warmup: int = 10, reps: int = 30,
          inner: int = 10, use_graph: bool = False) -> Timing:
    """Time ``fn(*args)`` with CUDA events, rotating through ``arg_sets`` (several input sets, so that
    repeated calls do not find their inputs in L2).

    Each sample enqueues ``inner`` calls back to back between two events and divides by ``inner``: once the
    GPU queue is full, host-side launch overhead (Python, argument checks) is hidden as long as it is shorter
    than the kernel, as in a serving loop. A sample of one call would time the host instead. With
    ``use_graph``, each call is captured once per arg set in a CUDA graph and replays are timed (what engines
    do for decode steps; no launch overhead at all)."""
    if not arg_sets:
        raise ValueError("arg_sets: need at least one argument tuple")
    calls: list[Callable[[], object]] = [lambda a=a: fn(*a) for a in arg_sets]
    for i in range(max(warmup, len(calls))):
        calls[i % len(calls)]()
    if use_graph:
        graphs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()  # warm on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        for c in calls:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                c()
            graphs.append(g)
        calls = [g.replay for g in graphs]
        for c in calls:
            c()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(inner):
            calls[(i * inner + j) % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return Timing(statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), reps)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written (the usual ceiling)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = bench(dst.copy_, [(src,)], warmup=3, reps=10, inner=2)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def bf16_gemm_tflops(n: int = 8192) -> float:
    """Dense bf16 n x n x n matrix product rate on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = bench(torch.matmul, [(a, b)], warmup=3, reps=5, inner=2)
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12
