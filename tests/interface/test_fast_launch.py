"""CPU: FastLaunch derives the C argument layout from a compiled kernel's own signature."""

from __future__ import annotations

import ctypes

import pytest

from qattn.interface.fast_launch import FastLaunch, fast

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def prefill_fn():
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
    from qattn.cute_kernels.sm90.prefill_int8 import QKInt8PrefillSm90
    from qattn.interface.prefill import prefill_compile_args

    cfg = PrefillConfig(head_dim=64, v_dtype="bf16", causal=False, granularity="per_warp")
    return compile_for_arch(QKInt8PrefillSm90(cfg), *prefill_compile_args(), arch="sm_90a", keep_ptx=False)[0]


def test_layout_follows_the_signature(prefill_fn):
    f = FastLaunch(prefill_fn)
    # 9 addresses, 9 sizes, the softmax scale, the fp8 V-scale and channel-balance addresses, the causal grouping, the
    # split tail's plan (whole units, splits) and buffers (partials, counters), the pdl flag, the window's left and
    # right edges, the Q / K / V strides, the soft-cap's K mean address, the stream
    assert f._ctypes == ([ctypes.c_int64] * 9 + [ctypes.c_int32] * 9
                         + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
                         + [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
                         + [ctypes.c_int32, ctypes.c_int32]
                         + [ctypes.c_int32] * 9 + [ctypes.c_int64, ctypes.c_void_p])
    assert fast(prefill_fn) is fast(prefill_fn)


def test_wrong_argument_count_is_rejected_before_any_launch(prefill_fn):
    with pytest.raises(TypeError, match="expected 40 arguments"):
        FastLaunch(prefill_fn)(1, 2, 3)


def test_pointer_arguments_map_to_addresses():
    from qattn.cute_kernels.kv_insert import _compiled, make_insert_compile_args
    from qattn.layouts import kv_format

    cfg, _ = make_insert_compile_args(kv_format("fp8"), kv_format("fp8"), 64)
    f = FastLaunch(_compiled(cfg, "sm_90a"))
    assert f._ctypes == [ctypes.c_void_p] * 18 + [ctypes.c_int32] * 12 + [ctypes.c_void_p]  # 8 sizes, 4 strides
