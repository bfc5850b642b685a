"""CPU: the eager host path's shortcuts (capability remembered per CUDA device, no-op device switch, the raw
stream getter with its public fallback, remembered configs and kernel lookups) keep their meaning."""

from __future__ import annotations

import pytest
import torch

from qattn.interface import fast_launch, variants


@pytest.fixture
def fake_capability(monkeypatch):
    calls = []

    def cap(device=None):
        calls.append(device)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", cap)
    monkeypatch.setattr(variants, "_CAPABILITY", {})
    return calls


def test_capability_is_asked_once_per_cuda_device(fake_capability):
    dev = torch.device("cuda", 3)
    assert variants.kernel_arch(dev, "prefill") == "sm_90a"
    assert variants.kernel_arch(dev, "prefill") == "sm_90a"
    assert variants.device_capability(dev) == (9, 0)
    assert len(fake_capability) == 1
    variants.device_capability(torch.device("cuda", 4))
    assert len(fake_capability) == 2


def test_capability_of_other_devices_is_not_remembered(fake_capability, monkeypatch):
    # tests (and callers) that pass a CPU device or None ask torch every time: nothing stale survives a change
    for _ in range(2):
        variants.device_capability(torch.device("cpu"))
        variants.device_capability(None)
        variants.device_capability(torch.device("cuda"))  # no index: "the current device", which can change
    assert len(fake_capability) == 6
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(ValueError, match="sm_80"):
        variants.kernel_arch(torch.device("cpu"), "prefill")


def test_on_device_switches_only_when_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert fast_launch.on_device(torch.device("cuda", 1)) is fast_launch._SAME
    with fast_launch.on_device(torch.device("cuda", 1)):
        pass
    assert isinstance(fast_launch.on_device(torch.device("cuda", 0)), torch.cuda.device)


def test_stream_handle_uses_the_raw_getter_or_the_public_stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    assert fast_launch.stream_handle(torch.device("cuda", 2)) == 1002
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")

    class Stream:
        cuda_stream = 77

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    assert fast_launch.stream_handle(torch.device("cuda", 2)) == 77


def test_prefill_config_and_kernel_lookups_are_remembered():
    from qattn.interface import prefill
    from qattn.quant import launch

    a = prefill._config(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp", quantize_q=True)
    b = prefill._config(head_dim=128, v_dtype="bf16", causal=True, granularity="per_warp", quantize_q=True)
    assert a is b and a.early_kv_wait
    with pytest.raises(ValueError, match="head_dim"):  # errors are raised every time, not remembered
        prefill._config(head_dim=96, v_dtype="bf16", causal=True, granularity="per_warp")
    with pytest.raises(ValueError, match="head_dim"):
        prefill._config(head_dim=96, v_dtype="bf16", causal=True, granularity="per_warp")
    for fn in (launch._quant_kernel, launch._kmean_kernel, launch._chunk_reduce_kernel, launch._check_group,
               prefill._prefill_kernel):
        assert hasattr(fn, "cache_info"), fn
