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
