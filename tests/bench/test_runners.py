"""The A/B harness's logic on the CPU: sample timing after an untimed call, output poisoning and which call the
error columns come from, peer mapping, the prefill kernel row mirroring flash_attn_func, prepass shares, causal
error slices and the CLI's argument checks. GPU timing itself needs a GPU (python -m qattn.bench ... --quick)."""

import inspect
import math

import pytest
import torch

import qattn.bench.runners as R
import qattn.bench.timing as T
from qattn.bench.metrics import DecodeShape, PrefillShape
from qattn.bench.timing import Timing


# ---------------------------------------------------------------------------------------------- timing
class _Event:
    log: list = []

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        self.log.append("record")

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0  # ms


def _fake_cuda(monkeypatch, log):
    _Event.log = log
    monkeypatch.setattr(T.torch.cuda, "Event", _Event)
    monkeypatch.setattr(T.torch.cuda, "synchronize", lambda: None)


def test_samples_start_after_an_untimed_call(monkeypatch):
    """Each sample's start event is recorded after one untimed call, so it fires when that call completes: the
    timed calls are queued by then (or arrive at the host's rate), never behind the first call's host time."""
    log = []
    _fake_cuda(monkeypatch, log)
    calls = [lambda i=i: log.append(f"call{i}") for i in range(4)]
    times = T._samples(calls, reps=2, inner=3)
    assert log == ["call3", "record", "call0", "call1", "call2", "record",
                   "call2", "record", "call3", "call0", "call1", "record"]  # inputs still rotate
    assert times == [1000.0 / 3] * 2  # µs per call


# ---------------------------------------------------------------------------------------------- errors
def test_errors_into_checks_the_replayed_call():
    """``out`` is NaN-filled before every call and the errors are those of the last one (the launch-plan replay):
    rows that call leaves unwritten give NaN, even when earlier calls wrote them."""
    ref = torch.randn(2, 4, dtype=torch.float64)
    n = []

    def leaves_a_row(out):  # a replay that skips the last row
        n.append(1)
        rows = 2 if len(n) < R._REPLAY_CALLS else 1
        out[:rows].copy_(ref[:rows])

    assert R._REPLAY_CALLS == 3
    assert math.isnan(R._errors_into(leaves_a_row, ref.float(), ref, slice(None)).nrmse) and len(n) == 3
    assert R._errors_into(lambda out: out.copy_(ref), ref.float(), ref, slice(None)).nrmse < 1e-6


def test_within():
    assert R._within((10, 20), [(0, 30)]) and R._within((10, 20), [(15, 25), (0, 15)])
    assert not R._within((10, 20), [(0, 15)]) and not R._within((10, 20), [(0, 12), (13, 30)])
    assert not R._within((10, 20), [(11, 30)])


# ---------------------------------------------------------------------------------------------- decode
def test_decode_sage_is_a_row_never_a_timing_or_the_baseline(monkeypatch):
    monkeypatch.setattr(R.P, "available", lambda name: (True, ""))  # as if every peer were installed
    monkeypatch.setattr(R, "_ours", lambda name: None)
    timed = []
    monkeypatch.setattr(R, "bench", lambda fn, **kw: (timed.append(kw["use_graph"]), Timing(10.0, 9.0, 11.0, 3))[1])
    sh = DecodeShape(3, 64, 4, 2, 32, 16)
    rows, base = R.run_decode([sh], formats=("nvfp4",), peers=("sage", "sdpa"), reps=3, log=lambda s: None,
                              device="cpu")
    assert base == "sdpa" and timed == [False, True]  # the sdpa rows only
    sage = [r for r in rows if r["impl"] == "sage"]
    assert len(sage) == 1 and "no paged decode" in sage[0]["note"] and "median_us" not in sage[0]
    sdpa = [r for r in rows if r["impl"] == "sdpa"]
    assert [r["scope"] for r in sdpa] == ["eager", "graph"] and all(r["nrmse"] < 1e-2 for r in sdpa)
    assert all(r["speedup"] == 1.0 for r in sdpa)
    assert [r["note"] for r in rows if r["impl"] == "qattn"] == ["qattn.flash_attn_with_kvcache not built yet"]


def test_check_peers():
    R.check_peers("decode", ("fa4", "sdpa", "sage"))
    R.check_peers("insert", ())
    with pytest.raises(ValueError, match="'fa-4'"):
        R.check_peers("prefill", ("fa4", "fa-4"))
    with pytest.raises(ValueError, match="insert has no peers"):
        R.check_peers("insert", ("fa4",))


# ---------------------------------------------------------------------------------------------- prefill
def _kw_defaults(fn) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def _same_args(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a, b))


@pytest.mark.parametrize("fp8, balance", [(False, False), (True, False), (False, True)])
def test_prefill_rows_launch_what_flash_attn_func_launches(monkeypatch, fp8, balance):
    """On SM90 the kernel row's prefill_int8 call is flash_attn_func's own (recorded from its
    ``_flash_attn_func_eager`` with the launches stubbed): the 16-bit Q with q_scale=None, the K prepass's K,
    the same options but ``_pdl`` (there its predecessor is the prepass, here the previous kernel call) and the
    softmax scale (spelled as the default). The prepass row makes flash_attn_func's prepass calls."""
    import qattn.interface.prefill as PF
    import qattn.quant.launch as L
    import qattn.quant.v_fp8 as VF

    defaults = {"prefill_int8": _kw_defaults(PF.prefill_int8), "quantize_k_int8": _kw_defaults(L.quantize_k_int8),
                "quantize_v_fp8": _kw_defaults(VF.quantize_v_fp8)}
    calls = []

    def rec(name, result):
        return lambda *a, **kw: (calls.append((name, a, {**defaults[name], **kw})), result)[1]

    monkeypatch.setattr(PF, "prefill_int8", rec("prefill_int8", ("out", "lse")))
    monkeypatch.setattr(L, "quantize_k_int8", rec("quantize_k_int8", ("k8", "ks", None)))
    monkeypatch.setattr(L, "_check_pair", lambda q, k: None)
    monkeypatch.setattr(VF, "quantize_v_fp8", rec("quantize_v_fp8", ("vt", "vs")))
    monkeypatch.setattr(PF, "_check_cuda_inputs", lambda *a, **kw: None)  # CPU tensors: the launches are stubbed
    monkeypatch.setattr(PF, "_kernel_quantizes_q", lambda q, granularity: granularity == "per_warp")  # SM90
    q = torch.randn(1, 256, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 256, 2, 64, dtype=torch.bfloat16)
    PF._flash_attn_func_eager(q, k, v, causal=True, softmax_scale=64 ** -0.5, granularity="per_warp", smooth_k=True,
                              pv_dtype="fp8" if fp8 else "bf16", qk_quant="int8", balance_qk=balance, window=(-1, -1),
                              softcap=0.0)
    real, calls[:] = calls[:], []
    R._qattn_prefill_prepass(q, k, v, True, balance=balance, fp8=fp8)()
    assert [(n, kw) for n, _, kw in calls] == [(n, kw) for n, _, kw in real[:-1]]
    assert all(_same_args(a, b) for (_, a, _), (_, b, _) in zip(calls, real))
    if balance:  # no balanced kernel row
        return
    kernel = R._qattn_prefill_kernel_only(q, k, v, True, fp8=fp8)
    calls[:] = []
    assert kernel() == "out"
    (name, a, kw), (_, ra, rkw) = calls[0], real[-1]
    assert name == "prefill_int8" and a[0] is q and a[1] is None  # the 16-bit Q, quantized inside the kernel
    assert _same_args(a, ra)
    assert rkw == {**kw, "_pdl": True, "softmax_scale": 64 ** -0.5}


def test_prefill_kernel_row_elsewhere_takes_the_qk_prepass(monkeypatch):
    """Where the kernel does not quantize Q (SM100), the row keeps the prepass-quantized int8 Q."""
    import qattn.interface.prefill as PF
    import qattn.quant.launch as L

    seen = []
    monkeypatch.setattr(PF, "_kernel_quantizes_q", lambda q, granularity: False)
    monkeypatch.setattr(L, "quantize_qk_int8", lambda q, k, **kw: ("q8", "qs", "k8", "ks", None))
    monkeypatch.setattr(PF, "prefill_int8", lambda *a, **kw: (seen.append(a), ("out", "lse"))[1])
    q = k = v = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    R._qattn_prefill_kernel_only(q, k, v, False)()
    assert seen[0][:4] == ("q8", "qs", "k8", "ks")


def _stub_prefill(monkeypatch, kernel_leaves_rows=False):
    """flash_attn_func and the kernel-only row as torch SDPA on the CPU (``kernel_leaves_rows``: the kernel row
    leaves the last query row unwritten), the prepass a no-op, the timings fixed (:func:`_prefill_timings`)."""
    sdpa = lambda q, k, v, causal: R.P.sdpa_dense(q, k, v, causal)()  # noqa: E731
    monkeypatch.setattr(R.P, "available", lambda name: (name == "sdpa", "not installed"))
    monkeypatch.setattr(R, "_ours", lambda name: (lambda q, k, v, causal=False, **kw: sdpa(q, k, v, causal)))
    kernel_outs = []

    def kernel_only(q, k, v, causal, fp8=False):
        def fn(out=None):
            o = sdpa(q, k, v, causal)
            out = torch.empty_like(o) if out is None else out
            kernel_outs.append(out)
            (out[:, :-1] if kernel_leaves_rows else out).copy_(o[:, :-1] if kernel_leaves_rows else o)
            return out
        return fn

    monkeypatch.setattr(R, "_qattn_prefill_kernel_only", kernel_only)
    monkeypatch.setattr(R, "_qattn_prefill_prepass", lambda q, k, v, causal, **kw: (lambda: None))
    monkeypatch.setattr(R, "bench_interleaved", _prefill_timings)
    return kernel_outs


def _prefill_timings(fns, reps, graph_keys=()):
    """Fixed timings: graph rows 100 µs, prepasses (graph keys whose fn returns None) 10 µs, eager rows 200 µs."""
    return {i: Timing((10.0 if fn() is None else 100.0) if i in graph_keys else 200.0, 1.0, 1.0, reps)
            for i, fn in fns.items()}


def test_prefill_rows_on_the_cpu(monkeypatch):
    """Errors of causal rows too (the last 1024 query rows against an end-aligned causal reference), prepass
    shares of each variant's own graph row (balanced included), the kernel row's error from ``out=``."""
    kernel_outs = _stub_prefill(monkeypatch)
    shapes = [PrefillShape(1, 1536, 2, 2, 64, False), PrefillShape(1, 1536, 2, 2, 64, True)]
    rows, base = R.run_prefill(shapes, peers=("sdpa", "fa4"), reps=4, log=lambda s: None, device="cpu")
    assert base == "sdpa"
    for label in (sh.label for sh in shapes):
        mine = [r for r in rows if r["config"] == label]
        timed = [r for r in mine if r.get("median_us") and r["scope"] != "prepass"]
        assert timed and all(r["nrmse"] < 1e-2 for r in timed), [(r["impl"], r.get("nrmse")) for r in timed]
        pre = [r for r in mine if r["scope"] == "prepass"]
        assert [r["impl"] for r in pre] == ["qattn int8-QK", "qattn int8-QK balanced", "qattn int8-QK fp8-PV"]
        assert all(r["note"] == "GPU time (graph), 10.0% of the end-to-end graph time" for r in pre)
        assert [r["note"] for r in mine if r["impl"] == "fa4"] == ["not installed"] * 2  # eager and graph
    assert len(kernel_outs) == 2 * 2 * R._REPLAY_CALLS  # two kernel rows a shape, each checked through out=


def test_prefill_causal_slice_is_end_aligned():
    """The rows a prefill error covers: the last ones of the full causal problem equal the sliced reference."""
    from qattn.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1100, 2, 32, generator=g, dtype=torch.float64) for _ in range(3))
    full = attention_reference(q, k, v, causal=True)
    sel = (slice(0, 1), slice(-R.PREFILL_ERR_ROWS, None))
    assert torch.allclose(attention_reference(q[sel], k[:1], v[:1], causal=True), full[sel])


def test_prefill_kernel_row_leaving_rows_gives_nan(monkeypatch):
    _stub_prefill(monkeypatch, kernel_leaves_rows=True)
    rows, _ = R.run_prefill([PrefillShape(1, 1536, 2, 2, 64, True)], peers=("sdpa",), reps=2, log=lambda s: None,
                            device="cpu")
    kernel = [r for r in rows if r["scope"] == "kernel" and r["impl"] != "qattn 16-bit QK"]
    assert len(kernel) == 2 and all(math.isnan(r["nrmse"]) for r in kernel)


# ---------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv, message", [
    (["prefill", "--peers", "fa-4"], "unknown peer(s) 'fa-4'"),
    (["decode", "--peers", "fa4,bogus"], "'bogus'"),
    (["insert", "--peers", "fa4"], "insert has no peers"),
    (["decode", "--formats", "nvfp4,nvfp5"], "'nvfp5'"),
    (["insert", "--formats", "int8+zz"], "'int8+zz'"),
    (["prefill", "--formats", "fp8"], "prefill has no KV formats"),
])
def test_cli_rejects_bad_arguments_before_measuring(monkeypatch, capsys, argv, message):
    from qattn.bench.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # would measure next: must not get there
    monkeypatch.setattr(T, "copy_bandwidth_gbs", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_without_cuda_exits_2(monkeypatch, capsys):
    from qattn.bench.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["decode", "--peers", "sage"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_eval_cli_rejects_an_unknown_grid(capsys):
    from qattn.eval.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--grid", "bogus", "--list"])
    assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["--grid", "quick", "--list"]) == 0
