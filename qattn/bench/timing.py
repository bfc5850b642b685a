"""GPU timing done right: CUDA events around back-to-back calls, warm-up, medians, optional rotating inputs,
optional CUDA-graph replay, and the two ceilings (device copy bandwidth, bf16 GEMM rate) measured in the same
run."""

from __future__ import annotations

import statistics
import time
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


def _prepared_calls(fn: Callable[..., object], arg_sets: Sequence[tuple], warmup: int,
                    use_graph: bool) -> list[Callable[[], object]]:
    """The calls a sample enqueues: ``fn`` on each arg set, warmed up, or (``use_graph``) CUDA-graph replays."""
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
    return calls


def _samples(calls: list[Callable[[], object]], reps: int, inner: int, first: int = 0) -> list[float]:
    """``reps`` samples in µs per call, each ``inner`` calls between two CUDA events.

    A sample starts after a synchronize, on an empty queue: were its start event recorded first, it would fire
    at once and the sample would include the host time of its first call. So one untimed call goes first and
    the start event fires when it completes: if the host is faster than the GPU the timed calls are queued by
    then (the sample is GPU time of back-to-back calls), if slower the sample is the host-bound period, as a
    loop of eager calls sees it (each timed call's host time, and no first-call extra)."""
    times = []
    for i in range(first, first + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls[(i * inner - 1) % len(calls)]()  # untimed: the start event fires after it
        start.record()
        for j in range(inner):
            calls[(i * inner + j) % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return times


def _timing(times: list[float]) -> Timing:
    return Timing(statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), len(times))


def bench(fn: Callable[..., object], arg_sets: Sequence[tuple] = ((),), *, warmup: int = 10, reps: int = 30,
          inner: int = 10, use_graph: bool = False) -> Timing:
    """Time ``fn(*args)`` with CUDA events: the median of ``reps`` samples, rotating through ``arg_sets`` (pass
    several input sets to keep repeated calls from finding their inputs in L2; the runners pass one: decode's
    and insert's inputs are many times L2, prefill re-reads K and V from L2 within each call anyway).

    Each sample enqueues ``inner`` calls back to back between two events and divides by ``inner``; the start
    event fires when an untimed call before them completes (:func:`_samples`). Once the queue is full, host-side
    launch overhead (Python, argument checks) is hidden as long as it is shorter than the kernel, as in a
    serving loop; a host slower than the GPU shows. With ``use_graph``, each call is captured once per arg set
    in a CUDA graph and replays are timed (what engines do for decode steps; a replay's host cost is a few µs)."""
    return _timing(_samples(_prepared_calls(fn, arg_sets, warmup, use_graph), reps, inner))


def _settle(calls: list[Callable[[], object]], seconds: float) -> None:
    """Run ``calls`` back to back for about ``seconds`` of wall time (untimed)."""
    t0 = time.perf_counter()
    i = 0
    while True:
        for _ in range(10):
            calls[i % len(calls)]()
            i += 1
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= seconds:
            return


def bench_interleaved(fns: dict, *, rounds: int = 2, reps: int = 20, warmup: int = 3, inner: int = 10,
                      settle_s: float = 0.3, graph_keys: Sequence = ()) -> dict:
    """``bench`` of several zero-argument callables, ``{key: fn}``, taken in turns: ``rounds`` rounds of
    ``reps / rounds`` samples of each, every turn after ``settle_s`` seconds of untimed calls of that callable.

    Why the settling: under sustained load an H100 runs at its power limit (700 W), and its SM clock follows the
    power the running kernels draw with a delay of a fraction of a second (measured, B2 H16 D128 S8K, 6 s of
    back-to-back calls each: FA4 ~1510 MHz, the INT8-QK kernel ~1630 MHz, both at ~698 W). Samples taken right
    after another implementation ran would measure this one at that one's clock. Taking turns spreads a slow
    drift (temperature) over all of them. ``graph_keys``: those timed as CUDA-graph replays, the others as eager
    calls (both as in :func:`bench`). Returns ``{key: Timing}`` over all of a key's samples."""
    calls = {k: _prepared_calls(f, ((),), warmup, k in graph_keys) for k, f in fns.items()}
    per_round = max(1, -(-reps // rounds))
    times: dict = {k: [] for k in fns}
    for r in range(rounds):
        for k, c in calls.items():
            _settle(c, settle_s)
            times[k] += _samples(c, per_round, inner, first=r * per_round)
    return {k: _timing(t) for k, t in times.items()}


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
