import json
import math

import pytest
import torch

from qattn.bench import report
from qattn.bench.metrics import DecodeShape, attention_flops, decode_bytes, errors, insert_bytes
from qattn.bench.timing import _quantile


def test_decode_bytes_by_hand():
    sh = DecodeShape(32, 8192, 32, 8, 128, 128)
    tokens = 32 * 8192
    qo = 2 * 32 * 32 * 128 * 2
    table = 32 * (64 + 1) * 4
    assert decode_bytes(sh, "bf16") == tokens * 8 * 512 + qo + table
    assert decode_bytes(sh, "nvfp4") == tokens * 8 * 144 + qo + table
    assert decode_bytes(sh, ("int8", "nvfp4")) == tokens * 8 * (132 + 72) + qo + table
    # the ideal nvfp4 speed-up over bf16 at this shape (what the headline target is measured against)
    assert 3.5 < decode_bytes(sh, "bf16") / decode_bytes(sh, "nvfp4") < 3.56


def test_insert_bytes_and_flops():
    assert insert_bytes(10, 2, 64, "fp8") == 2 * 10 * 2 * 64 * 2 + 10 * 8 + 10 * 2 * 2 * (64 + 4)
    assert attention_flops(2, 16, 8192, 8192, 128) == 4 * 2 * 16 * 8192 * 8192 * 128
    assert attention_flops(2, 16, 8192, 8192, 128, causal=True) == 2 * 2 * 16 * 8192 * 8192 * 128


def test_errors():
    ref = torch.randn(100, dtype=torch.float64)
    e = errors(ref.float(), ref)
    assert e.nrmse < 1e-7 and e.cosine > 0.9999999 and e.max_abs < 1e-6
    noisy = ref + 0.1 * torch.randn(100, dtype=torch.float64)
    assert 0.05 < errors(noisy, ref).nrmse < 0.2
    bad = ref.clone()
    bad[3] = float("nan")
    assert math.isnan(errors(bad, ref).nrmse) and math.isnan(errors(bad, ref).cosine)
    with pytest.raises(ValueError, match="out"):
        errors(ref[:5], ref)


def test_quantile():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert _quantile(xs, 0.0) == 1.0 and _quantile(xs, 0.5) == 3.0 and _quantile(xs, 1.0) == 5.0


ROWS = [
    {"config": "B32x8K", "impl": "fa4", "kv_format": "bf16", "scope": "kernel", "median_us": 367.0, "spread": 0.02,
     "gbs": 2920.0, "pct_copy": 0.97, "speedup": 1.0, "nrmse": 3e-3, "cosine": 0.99999, "kv_bytes_per_token": 512},
    {"config": "B32x8K", "impl": "qattn", "kv_format": "nvfp4", "scope": "kernel", "note": "not built yet",
     "kv_bytes_per_token": 144},
]
META = {"bench": "decode", "device": "NVIDIA H100 80GB HBM3", "copy_gbs": 3020, "baseline": "fa4",
        "command": "python -m qattn.bench decode"}


def test_outputs(tmp_path):
    t = report.table(ROWS)
    lines = t.splitlines()
    assert len(lines) == 3 and "median µs" in lines[0] and "367.0" in lines[1] and "97%" in lines[1]
    assert "not built yet" in lines[2] and "TFLOP/s" not in lines[0]  # empty columns are left out
    md = report.markdown(ROWS, META)
    assert md.startswith("# qattn decode benchmark — NVIDIA H100") and "| fa4 |" in md.replace("  ", " ")
    assert md.count("\n|") == 4  # header, rule, two rows
    report.write_json(tmp_path / "r.json", ROWS, META)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["rows"] == ROWS and back["meta"]["device"] == META["device"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report.plot(tmp_path / "p.png", ROWS, META)
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000


def test_insert_slot_orders():
    import torch

    from qattn.bench.runners import insert_slots

    g = torch.Generator().manual_seed(0)
    for order in ("page-ordered", "random"):
        s = insert_slots(100, 16, 12, order, g)
        assert s.shape == (100,) and len(set(s.tolist())) == 100 and int(s.min()) >= 0 and int(s.max()) < 12 * 16
    s = insert_slots(100, 16, 12, "page-ordered", g)
    pages, offs = s // 16, s % 16
    assert torch.equal(offs, torch.arange(100) % 16)  # tokens in order inside each page
    assert all(len(set(pages[i:i + 16].tolist())) == 1 for i in range(0, 100, 16))
    assert len(set(pages.tolist())) == 7
    import pytest
    with pytest.raises(ValueError, match="order"):
        insert_slots(10, 16, 4, "sorted", g)


def test_bench_interleaved_takes_turns(monkeypatch):
    """Every key gets a share of samples in every round (a clock drift weighs on all alike), graph keys only as
    graphs, and each key's Timing is over all of its samples."""
    import qattn.bench.timing as T

    prepared, order = {}, []

    def fake_prepared(fn, arg_sets, warmup, use_graph):
        prepared[fn()] = use_graph
        return [fn]

    monkeypatch.setattr(T, "_prepared_calls", fake_prepared)
    value = {"a": 10.0, "b": 20.0, "c": 30.0}

    def fake_samples(calls, reps, inner, first=0):
        key = calls[0]()
        order.append((key, first))
        return [value[key] + first] * reps

    monkeypatch.setattr(T, "_samples", fake_samples)
    settled = []
    monkeypatch.setattr(T, "_settle", lambda calls, seconds: settled.append((calls[0](), seconds)))
    out = T.bench_interleaved({k: (lambda k=k: k) for k in "abc"}, rounds=3, reps=7, graph_keys=["c"])
    assert prepared == {"a": False, "b": False, "c": True}
    assert [k for k, _ in order] == list("abc") * 3  # turns, not one key after the other
    assert settled == [(k, 0.3) for k in "abc"] * 3  # every turn settles first
    assert [f for _, f in order] == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert {k: t.reps for k, t in out.items()} == {"a": 9, "b": 9, "c": 9}  # ceil(7 / 3) per round
    assert out["a"].median_us == 13.0 and out["c"].p10_us == 30.0 and out["c"].p90_us == 36.0
