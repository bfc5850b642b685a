import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests skip cleanly on machines without CUDA (CI, developer laptops).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or os.sep + "gpu" + os.sep in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _launch_plans(request):
    """Launch plans (``qattn.interface.launch_plan``) replay a call signature's recorded launches: tests that
    monkeypatch the launch decisions between calls would replay another test's (or their own earlier) choices,
    so plans are off and empty in every test but those marked ``launch_plans`` (which check replay == the
    normal path)."""
    from qattn.interface import launch_plan

    saved = launch_plan.set_enabled(request.node.get_closest_marker("launch_plans") is not None)
    for p in launch_plan.PLANNERS:
        p.clear()
    yield
    launch_plan.set_enabled(saved)
    for p in launch_plan.PLANNERS:
        p.clear()


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(cap, log=None)``: pretend CPU tensors live on a GPU of compute capability ``cap``; the prefill
    prepasses are the exact torch references and the kernel launches are recorded, so nothing launches. Returns
    the list the recorders fill with ('sm90' | 'sm100', cfg, args); ``log``, a list, also gets 'k prepass' /
    'qk prepass' / 'kernel' in launch order."""
    import qattn.quant.launch as ql
    from qattn.interface import prefill as pf
    from qattn.interface import prefill_sm100
    from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference

    calls = []

    def set_cap(cap, log=None):
        def note(what):
            if log is not None:
                log.append(what)

        def fake_prepass(q, k, *, granularity, smooth_k, block_q, warp_q, block_k, balance_qk=False):
            note("qk prepass")
            return quantize_qk_int8_reference(q, k, granularity=granularity, smooth_k=smooth_k, block_q=block_q,
                                              warp_q=warp_q, block_k=block_k, balance_qk=balance_qk)

        def fake_k_prepass(k, *, smooth_k, block_k, balance_q=None):
            note("k prepass")
            out = quantize_qk_int8_reference(k if balance_q is None else balance_q, k, smooth_k=smooth_k,
                                             block_k=block_k, balance_qk=balance_q is not None)
            return out[2:]

        def fake_varlen_prepass(q, k, cu_q, cu_k, max_q, max_k, *, granularity, smooth_k, block_q, warp_q, block_k,
                                balance_qk=False):
            note("qk prepass")
            return quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, max_q, max_k, granularity=granularity,
                                                     smooth_k=smooth_k, block_q=block_q, warp_q=warp_q,
                                                     block_k=block_k, balance_qk=balance_qk)

        def fake_k_varlen_prepass(k, cu_k, max_k, *, smooth_k, block_k, balance_q=None, cu_seqlens_q=None,
                                  max_seqlen_q=None):
            note("k prepass")
            return quantize_qk_int8_varlen_reference(k, k, cu_k, cu_k, max_k, max_k, smooth_k=smooth_k,
                                                     block_k=block_k)[2:]

        def record(arch):
            def launch(cfg, *args, **kw):
                note("kernel")
                calls.append((arch, cfg, args[0] if arch == "sm100" else args))
            return launch

        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        monkeypatch.setattr(ql, "quantize_qk_int8", fake_prepass)
        monkeypatch.setattr(ql, "quantize_qk_int8_varlen", fake_varlen_prepass)
        monkeypatch.setattr(ql, "quantize_k_int8", fake_k_prepass)
        monkeypatch.setattr(ql, "quantize_k_int8_varlen", fake_k_varlen_prepass)
        monkeypatch.setattr(prefill_sm100, "_launch", record("sm100"))
        monkeypatch.setattr(pf, "_launch", record("sm90"))
        return calls

    return set_cap
