"""CPU: launch plans record a call's buffers and launches and replay them on new inputs of the same signature
(``qattn.interface.launch_plan``), with a stand-in launcher and host tensors in place of the GPU's."""

from __future__ import annotations

import ctypes

import pytest
import torch

from qattn.interface import fast_launch
from qattn.interface.launch_plan import LaunchPlan, Planner

CPU = torch.device("cpu")


class FakeLaunch:
    """What the recorder sees of a FastLaunch: argument C types, stream slots, and the report of each call."""

    def __init__(self, ctypes_, stream_slots=()):
        self._ctypes = list(ctypes_)
        self._stream_slots = frozenset(stream_slots)
        self.calls = []

    def __call__(self, *values):
        fast_launch.report_launch(self, values)
        self.calls.append(values)


I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
K1 = FakeLaunch([I64, I64, I32, F32, PTR], stream_slots=[4])
K2 = FakeLaunch([I64, I64, I64, I32, PTR], stream_slots=[4])


def slow(x, y):
    """A stand-in entry point: a scratch buffer (freed before the output is allocated, as the prepass's partials
    are), a zeroed counter, an output and a second output, two launches (one at an offset inside a buffer)."""
    n = x.numel()
    scratch = torch.empty(n * 4, dtype=torch.float32)
    K1(x.data_ptr(), scratch.data_ptr(), n, 0.5, 0)
    counter = torch.zeros(3, dtype=torch.int32)
    out = torch.empty(x.shape, dtype=torch.float16)
    lse = torch.empty(n, dtype=torch.float32)
    K2(scratch.data_ptr() + 8 * n, y.data_ptr(), out.data_ptr() if n else 0, lse.shape[0], 0)
    K2(counter.data_ptr(), lse.data_ptr(), out.data_ptr(), 7, 0)
    return out, lse


def _roles(values, inputs, buffers):
    """Each launch argument as (what it points into, offset) or the constant."""
    named = [(f"in{i}", t.data_ptr(), t.numel() * t.element_size()) for i, t in enumerate(inputs)]
    named += [(f"buf{j}", t.data_ptr(), t.numel() * t.element_size()) for j, t in enumerate(buffers)]
    out = []
    for v in values:
        hit = [(name, v - p) for name, p, n in named if isinstance(v, int) and p <= v < p + max(n, 1)]
        out.append(hit[0] if hit else v)
    return out


def _call(planner, key, x, y):
    for k in (K1, K2):
        k.calls.clear()
    result = planner.call(key, (x, y), lambda: slow(x, y), device=CPU)
    return result, [c for k in (K1, K2) for c in k.calls]


def test_second_call_records_third_replays():
    planner = Planner()
    x, y = torch.randn(16), torch.randn(8)
    _call(planner, "k", x, y)
    assert len(planner) == 0  # seen once: not recorded
    _call(planner, "k", x, y)
    assert len(planner) == 1 and planner.recorded == 1 and planner.hits == 0
    x2, y2 = torch.randn(16), torch.randn(8)
    (out, lse), calls = _call(planner, "k", x2, y2)
    assert planner.hits == 1
    assert out.shape == (16,) and out.dtype == torch.float16 and lse.shape == (16,) and lse.dtype == torch.float32
    # the same launches as the slow path would make on these inputs, argument by argument: inputs by address,
    # the output and LSE of this call, constants unchanged, the scratch offset kept
    assert len(calls) == 3
    k1, k2a, k2b = calls
    assert k1[0] == x2.data_ptr() and k1[2:] == (16, 0.5, 0)
    assert k2a[1] == y2.data_ptr() and k2a[2] == out.data_ptr() and k2a[3:] == (16, 0)
    assert k2b[1] == lse.data_ptr() and k2b[2] == out.data_ptr() and k2b[3:] == (7, 0)
    assert k2a[0] - k1[1] == 8 * 16  # inside the same scratch buffer, at the recorded offset
    assert k2b[0] != k1[1]  # the counter is a buffer of its own (it is zeroed)


def test_replayed_fills_and_fresh_outputs():
    planner = Planner()
    x, y = torch.randn(4), torch.randn(4)
    for _ in range(2):
        _call(planner, "k", x, y)
    plan = next(iter(planner._plans.values()))
    assert isinstance(plan, LaunchPlan) and plan.num_launches == 3
    assert [s[0] for s in plan.steps] == ["launch", "launch", "launch"]  # zeros: filled where allocated
    (o1, l1), _ = _call(planner, "k", x, y)
    (o2, l2), _ = _call(planner, "k", x, y)
    assert o1.data_ptr() != o2.data_ptr() and l1.data_ptr() != l2.data_ptr()  # every call returns new tensors


def test_keys_are_separate_and_lru_bounded():
    planner = Planner(max_plans=2)
    x, y = torch.randn(4), torch.randn(4)
    for key in ("a", "a", "b", "b", "c", "c"):
        _call(planner, key, x, y)
    assert len(planner) == 2 and "a" not in planner._plans  # least recently used dropped


def test_unknown_address_makes_the_signature_unplanned():
    stray = torch.empty(64)  # memory the call neither got nor allocated

    def bad_slow(x, y):
        out = torch.empty(4)
        K1(stray.data_ptr(), out.data_ptr(), 4, 1.0, 0)
        return (out,)

    planner = Planner()
    x, y = torch.randn(4), torch.randn(4)
    for _ in range(3):
        K1.calls.clear()
        (out,) = planner.call("k", (x, y), lambda: bad_slow(x, y), device=CPU)
        assert K1.calls[0][0] == stray.data_ptr()  # the normal path every time
    assert len(planner) == 0 and "address outside" in planner.unplanned["k"]


@pytest.mark.parametrize("op", ["copy", "compute", "view_return", "input_fill", "host_read"])
def test_other_device_work_makes_the_signature_unplanned(op):
    def other(x, y):
        out = torch.empty(4)
        if op == "copy":
            x = x.clone()  # e.g. a misaligned input copied before the launch
        elif op == "compute":
            out = out + 1
        elif op == "input_fill":
            y.zero_()
        elif op == "host_read":  # a launch argument from a tensor's value: not a function of the signature
            K1(x.data_ptr(), out.data_ptr(), int(y[0] > 0), 1.0, 0)
        K1(x.data_ptr(), out.data_ptr(), 4, 1.0, 0)
        return (out[:2],) if op == "view_return" else (out,)

    planner = Planner()
    x, y = torch.randn(4), torch.randn(4)
    for _ in range(3):
        planner.call("k", (x, y), lambda: other(x, y), device=CPU)
    assert len(planner) == 0 and planner.hits == 0 and planner.unplanned["k"]


def test_views_and_recorded_fills_are_fine():
    def viewing(x, y):
        out = torch.empty(8, dtype=torch.uint8)
        cnt = torch.empty(2, dtype=torch.int32)
        cnt.zero_()
        v = out.view(torch.int8).view(2, 4)[0]
        K2(cnt.data_ptr(), x.unsqueeze(0).data_ptr(), v.data_ptr(), 1, 0)
        return (out,)

    planner = Planner()
    x, y = torch.randn(4), torch.randn(4)
    for _ in range(2):
        planner.call("k", (x, y), lambda: viewing(x, y), device=CPU)
    plan = planner._plans["k"]
    assert isinstance(plan, LaunchPlan)
    assert [s[0] for s in plan.steps] == ["fill", "launch"]
    K2.calls.clear()
    (out,) = planner.call("k", (x, y), lambda: viewing(x, y), device=CPU)
    assert K2.calls[0][1] == x.data_ptr() and K2.calls[0][2] == out.data_ptr()


def test_errors_are_not_recorded():
    planner = Planner()

    def failing():
        raise ValueError("bad input")

    for _ in range(3):
        with pytest.raises(ValueError, match="bad input"):
            planner.call("k", (torch.randn(2),), failing, device=CPU)
    assert len(planner) == 0 and "k" not in planner._plans


def test_recorder_is_per_thread():
    import threading

    planner = Planner()
    x, y = torch.randn(4), torch.randn(4)
    seen = []

    def other_thread():  # launches of another thread while this one records are not part of its plan
        K1(x.data_ptr(), x.data_ptr(), 1, 1.0, 0)
        seen.append(1)

    def slow_with_thread(x, y):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return slow(x, y)

    for _ in range(2):
        planner.call("k", (x, y), lambda: slow_with_thread(x, y), device=CPU)
    assert planner._plans["k"].num_launches == 3 and len(seen) == 2


def test_aliasing_beyond_the_signature_is_unplanned():
    """Inputs past ``keyed`` are not in the key: two of them (or one and a keyed one) at one address would map
    every launch argument there to the first, which another call of the signature need not share."""
    planner = Planner()
    x, y, shared = torch.randn(4), torch.randn(4), torch.randn(4)
    for _ in range(3):
        planner.call("k", (x, y, shared, shared), lambda: slow(x, y), keyed=2, device=CPU)
    assert len(planner) == 0 and "one address" in planner.unplanned["k"]
    for _ in range(3):  # keyed aliasing is the signature's business
        planner.call("k2", (x, x), lambda: slow(x, x), keyed=2, device=CPU)
    assert len(planner) == 1


def test_a_returned_input_comes_back_as_itself():
    def into(x, out):
        K1(x.data_ptr(), out.data_ptr(), 4, 1.0, 0)
        return (out,)

    planner = Planner()
    x = torch.randn(4)
    for _ in range(4):
        out = torch.empty(4)
        alias = out.view_as(out)  # same address and metadata as ``out``, another object
        (r,) = planner.call("k", (x, alias, out), lambda: into(x, out), device=CPU)
        assert r is out
    assert planner.hits == 2


def test_no_recording_inside_another():
    inner = Planner()
    outer = Planner()
    x, y = torch.randn(4), torch.randn(4)

    def nested():
        inner.call("i", (x, y), lambda: slow(x, y), device=CPU)  # its second sighting happens while outer records
        return slow(x, y)

    for _ in range(2):  # the outer's second call records; the inner's second sighting comes inside it
        outer.call("o", (x, y), nested, device=CPU)
    assert outer._plans["o"].num_launches == 6  # the inner call's launches are in the outer plan
    assert len(inner) == 0 and "i" not in inner._plans


def test_options_keep_their_type():
    from qattn.interface.launch_plan import _types

    def key(o):
        return (o, _types(o))

    assert key((True, (-1, -1))) != key((1, (-1, -1))) and key((1, (-1.0, -1))) != key((1, (-1, -1)))
    assert key((0.0,)) != key((False,)) and key((None, (1, 2))) == key((None, (1, 2)))


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False), (" False ", False),
                                      ("no", False), ("yes", True)])
def test_env_switch(monkeypatch, value, on):
    from qattn.interface.launch_plan import plans_enabled

    if value is None:
        monkeypatch.delenv("QATTN_LAUNCH_PLANS", raising=False)
    else:
        monkeypatch.setenv("QATTN_LAUNCH_PLANS", value)
    assert plans_enabled() is on


def test_no_key_for_host_tensors_or_when_off():
    from qattn.interface import launch_plan

    x = torch.randn(4)
    assert launch_plan.signature_key((x,), ()) is None  # host tensors: the normal path
    old = launch_plan.set_enabled(False)
    try:
        assert launch_plan.signature_key((None,), ()) is None
    finally:
        launch_plan.set_enabled(old)


def test_layer_tensors_cover_every_kvlayer_field():
    """A field added to KVLayer must become a plan input too (else its address is unmapped and every decode /
    insert signature of such a cache stays unplanned)."""
    import dataclasses

    import qattn
    from qattn.interface.launch_plan import cache_signature, layer_tensors

    cache = qattn.PagedKVCache(2, 8, 16, 2, 64, "nvfp4", recent_window=16, max_seqs=2, sink_tokens=4)
    lay = cache.layer(1)
    assert layer_tensors(lay) == tuple(getattr(lay, f.name) for f in dataclasses.fields(lay))
    sig = cache_signature(cache)
    assert sig is cache_signature(cache)  # kept on the cache
    other = qattn.PagedKVCache(2, 8, 16, 2, 64, "fp8", recent_window=16, max_seqs=2, sink_tokens=4)
    assert cache_signature(other) != sig
    hash(sig)
