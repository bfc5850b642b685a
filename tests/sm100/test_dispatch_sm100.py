"""CPU test of the decode and prefill arch dispatch: compute capability 10.x -> SM100 kernel, 9.0 -> SM90, others
a clear error (the capability is mocked; nothing launches); the SM100 decode config limits."""

from __future__ import annotations

import pytest
import torch

from qattn.interface import decode as dec
from qattn.interface import prefill as pf
from qattn.interface.decode_sm100 import sm100_config_for
from qattn.layouts.paged import PagedKVCache


KERNELS = pytest.mark.parametrize("kernel", [dec, pf], ids=["decode", "prefill"])


@KERNELS
@pytest.mark.parametrize("cap,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_100a")])
def test_arch_dispatch(monkeypatch, kernel, cap, arch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    assert kernel._check_arch(torch.device("cpu")) == arch


@KERNELS
@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (12, 0), (9, 1)])
def test_other_arch_is_a_clear_error(monkeypatch, kernel, cap):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    with pytest.raises(ValueError, match="SM90 .* and SM100"):
        kernel._check_arch(torch.device("cpu"))


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


def test_sm100_decode_window_raises_before_any_launch(monkeypatch):
    import qattn.interface.decode_sm100 as d100

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(d100, "flash_attn_with_kvcache_sm100", lambda *a, **k: "sm100")
    cache = PagedKVCache(1, 8, 16, 2, 128, "nvfp4")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([4, 41], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="window_size: sliding-window decode is not implemented on SM100"):
        dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(16, 0))
    # no window, or one longer than the block table holds: the SM100 kernel
    assert dec.flash_attn_with_kvcache(q, cache, lens, table) == "sm100"
    assert dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(47, 0)) == "sm100"
    with pytest.raises(ValueError, match="window_size"):
        dec.flash_attn_with_kvcache(q, cache, lens, table, window_size=(-3, 0))
