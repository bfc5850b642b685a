"""CPU test of the decode and prefill arch dispatch: compute capability 10.0 -> SM100 kernel, 9.0 -> SM90, others
(10.3 too: sm_100a code runs on 10.0 only) a clear error (the capability is mocked; nothing launches); the SM100
decode config limits."""

from __future__ import annotations

import pytest
import torch

from qattn.interface import decode as dec
from qattn.interface import prefill as pf
from qattn.interface.decode_sm100 import sm100_config_for
from qattn.layouts.paged import PagedKVCache


KERNELS = pytest.mark.parametrize("kernel", [dec, pf], ids=["decode", "prefill"])


@KERNELS
@pytest.mark.parametrize("cap,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a")])
def test_arch_dispatch(monkeypatch, kernel, cap, arch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    assert kernel._check_arch(torch.device("cpu")) == arch


@KERNELS
@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (12, 0), (9, 1), (10, 3)])
def test_other_arch_is_a_clear_error(monkeypatch, kernel, cap):
    from qattn.interface.variants import supported_arch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    with pytest.raises(ValueError, match="SM90 .* and SM100"):
        kernel._check_arch(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="SM90 .* or SM100"):  # the prepass, insert and warm-up arch
        supported_arch(torch.device("cpu"))


def test_sm100_config_limits():
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    cfg = sm100_config_for(cache, "bf16", 4, 2, True, False)
    assert cfg.q_terms == 2 and cfg.kind == "nvf4"
    with pytest.raises(ValueError, match="128 query rows"):
        sm100_config_for(cache, "bf16", 16, 9, True, False)
    with pytest.raises(ValueError, match="FP4 keys"):
        sm100_config_for(PagedKVCache(1, 8, 16, 2, 128, "fp8"), "bf16", 4, 1, True, False)
    with pytest.raises(ValueError, match="ring"):
        sm100_config_for(PagedKVCache(1, 8, 16, 2, 128, "nvfp4", recent_window=64, max_seqs=2), "bf16", 4, 1,
                         True, False)
    with pytest.raises(ValueError, match="sink"):
        sm100_config_for(PagedKVCache(1, 8, 16, 2, 128, "nvfp4", sink_tokens=1, max_seqs=2), "bf16", 4, 1,
                         True, False)


def test_sm100_decode_window_reaches_the_kernel(monkeypatch):
    """window_size on SM100: the launcher gets the resolved Window (flags and runtime edges of the window variant,
    compile-checked and emulated only); windows no row reaches are the plain causal kernel; bad ones raise."""
    import qattn.interface.decode_sm100 as d100

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    seen = []
    monkeypatch.setattr(d100, "flash_attn_with_kvcache_sm100", lambda *a, **k: seen.append(k["window"]) or "sm100")
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    assert dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(16, 0)) == "sm100"
    w = seen[-1]
    assert (w.causal, w.local, w.edges) == (True, True, (16, 0))
    # no window, or one longer than the block table holds: the plain causal kernel
    dec.flash_attn_with_kvcache(q, cache, lens, table)
    dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(47, 0))
    assert all((w.causal, w.local) == (True, False) for w in seen[1:])
    with pytest.raises(ValueError, match="window_size"):
        dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(-3, 0))


def test_sm100_decode_window_config_and_split_context():
    """The window flag picks the kernel's window variant (its own compile-cache key); the split heuristic sizes
    on the keys the window reads."""
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    plain = sm100_config_for(cache, "bf16", 4, 1, True, False)
    local = sm100_config_for(cache, "bf16", 4, 1, True, False, window=True)
    assert local.window and not plain.window and local.key != plain.key and local.key[:-1] == plain.key

def test_sm100_decode_softcap_reaches_the_kernel(monkeypatch):
    """softcap on SM100 (compile-checked and emulated only): the tcgen05 launcher gets the validated cap and the
    config its key (its kernel's scale argument is ``window.score_scale``, tested in test_window.py); a smoothed
    cache still refuses it."""
    import qattn.interface.decode_sm100 as d100

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    seen = []
    monkeypatch.setattr(d100, "flash_attn_with_kvcache_sm100", lambda *a, **k: seen.append(k) or "sm100")
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    assert dec.flash_attn_with_kvcache(q, cache, lens, table, softcap=30) == "sm100"
    assert seen[-1]["softcap"] == 30.0 and isinstance(seen[-1]["softcap"], float)
    dec.flash_attn_with_kvcache(q, cache, lens, table)
    assert seen[-1]["softcap"] == 0.0
    assert sm100_config_for(cache, "bf16", 4, 1, True, False, softcap=30.0).softcap == 30.0
    cache.k_smoothed = True
    with pytest.raises(ValueError, match="smoothed"):
        dec.flash_attn_with_kvcache(q, cache, lens, table, softcap=30.0)


@pytest.mark.parametrize("fmt,W,N,group,sq,head_dim", [
    ("fp8", 0, 0, 4, 1, 128), ("int8", 0, 0, 8, 2, 64), ("bf16", 0, 0, 4, 1, 128), (("int8", "nvfp4"), 0, 0, 4, 1, 128),
    ("nvfp4", 64, 0, 4, 1, 128), ("nvfp4", 0, 1, 4, 1, 128), ("nvfp4", 0, 0, 16, 16, 128), ("mxfp4", 0, 0, 4, 1, 64)])
def test_sm100_decode_runs_the_mma_sync_kernel_for_other_caches(monkeypatch, fmt, W, N, group, sq, head_dim):
    """On compute capability 10.x, caches the tcgen05 kernel does not take (non-FP4 K or V, a ring, sinks, more
    than 128 rows, mxfp4 at head_dim 64) run the portable mma.sync kernel compiled for sm_100a, not an error; FP4
    pages it takes still go to the tcgen05 launcher."""
    import qattn.interface.decode_sm100 as d100

    class Launched(Exception):
        pass

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(d100, "flash_attn_with_kvcache_sm100", lambda *a, **k: pytest.fail("tcgen05 path taken"))
    seen = []

    def kernels(arch, cache, qd, g, seqlen_q, *rest):
        seen.append((arch, g, seqlen_q))
        raise Launched

    monkeypatch.setattr(dec, "_kernels", kernels)
    cache = PagedKVCache(1, 8, 16, 2, head_dim, fmt, recent_window=W, sink_tokens=N, max_seqs=2 if W or N else 0)
    q = torch.randn(2, sq, 2 * group, head_dim, dtype=torch.bfloat16)
    lens = torch.tensor([20, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32) if W or N else None
    with pytest.raises(Launched):
        dec.flash_attn_with_kvcache(q, cache, lens, table, seq_slots=slots, num_splits=1)
    assert seen == [("sm_100a", group, sq)]


def test_sm100_decode_fp4_pages_take_the_tcgen05_kernel(monkeypatch):
    import qattn.interface.decode_sm100 as d100

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(d100, "flash_attn_with_kvcache_sm100", lambda *a, **k: "tcgen05")
    monkeypatch.setattr(dec, "_kernels", lambda *a, **k: pytest.fail("mma.sync path taken"))
    lens = torch.tensor([20, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    for fmt, D, group, sq in (("nvfp4", 128, 8, 16), ("mxfp4", 128, 4, 1), ("mxfp4_b16", 64, 16, 8)):
        q = torch.randn(2, sq, 2 * group, D, dtype=torch.bfloat16)
        assert dec.flash_attn_with_kvcache(q, PagedKVCache(1, 8, 16, 2, D, fmt), lens, table) == "tcgen05"


def test_mma_sync_decode_launch_gets_the_capped_scale(monkeypatch):
    """The mma.sync decode launch (SM90, and SM100 for the caches the tcgen05 kernel does not take) passes
    softmax_scale / softcap as the score scale with a cap, softmax_scale * log2 e without (launch arguments
    captured; nothing runs)."""
    import contextlib
    import math

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    launches = []
    monkeypatch.setattr(dec, "_kernels", lambda *a: (lambda *args: launches.append(args), None))
    monkeypatch.setattr(dec, "fast", lambda kern: kern)
    monkeypatch.setattr(dec, "on_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(dec, "stream_handle", lambda d: 0)
    cache = PagedKVCache(1, 8, 16, 2, 128, "fp8")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([20, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    dec.flash_attn_with_kvcache(q, cache, lens, table, num_splits=1, softmax_scale=0.125, softcap=30.0)
    dec.flash_attn_with_kvcache(q, cache, lens, table, num_splits=1, softmax_scale=0.125)
    (capped, plain) = [args[-4] for args in launches]  # ..., score scale, window_left, window_right, stream
    assert capped == 0.125 / 30.0 and plain == 0.125 * math.log2(math.e)
