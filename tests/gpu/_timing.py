"""A quick timing helper of the GPU test scripts' ``__main__`` blocks (the benchmarks live in ``qattn.bench``)."""

from __future__ import annotations

import torch

from qattn.bench.timing import _settle


def graph_median_us(fn, warmup: int = 3, reps: int = 20, launches: int = 1, settle_ms: float = 30.0) -> float:
    """Median time in µs of one call of ``fn``, replayed from a CUDA graph of ``launches`` calls (captured after
    ``warmup`` eager calls, then replayed for at least ``settle_ms`` before the timed replays: on an H100 the first
    ~20 replays after a case's set-up ran 10-17 % slow (decode, 2026-11-28), which biased whichever variant a
    script timed first)."""
    for _ in range(warmup):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    _settle([g.replay], settle_ms / 1e3)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / launches)
    return sorted(ts)[len(ts) // 2]
