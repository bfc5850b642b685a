"""CPU: the FP8 V prepass kernels compile for sm_90a with the instructions their numerics depend on."""

from __future__ import annotations

import pytest

from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count, ptx_has
from qattn.cute_kernels.sm90 import v_fp8_quant as m

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("in_bf16", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_v_prepass_compiles(D, in_bf16, varlen):
    ptx = compile_for_arch(m.VAmaxPartial(D, in_bf16, varlen), *m.amax_placeholder_args(), arch="sm_90a")[1]
    assert ptx_count(ptx, r"ld\.global\.v4") == m.UNROLL  # 16-byte loads, UNROLL in flight
    # varlen: the sequence's row range, two cu_seqlens entries
    assert ptx_count(ptx, r"ld\.global\.b32") == (2 if varlen else 0)
    assert not ptx_has(ptx, r"\.local")
    # PDL: the fold may be scheduled from the start; the wait for the kernel before (which did not write V) comes
    # after the V loads and before the first global store (a buffer the kernels before still read may be the
    # one the allocator handed to this grid's output)
    assert ptx_count(ptx, r"griddepcontrol\.launch_dependents") == 1 and ptx_count(ptx, r"griddepcontrol\.wait") == 1
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global.v4")
    assert ptx.rindex("ld.global.v4") < ptx.index("griddepcontrol.wait") < ptx.index("st.global")
    cfg = m.VFp8TransposeQuant(D, in_bf16, varlen)
    ptx = compile_for_arch(cfg, *m.transpose_placeholder_args(), arch="sm_90a")[1]
    assert ptx_count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 8 * cfg.items  # 16 values per item
    assert ptx_count(ptx, r"st\.global\.v4") == cfg.items  # one 16-byte store per item
    assert ptx_count(ptx, r"ld\.global\.v4") == cfg.passes
    assert ptx_count(ptx, r"griddepcontrol\.launch_dependents") == 1  # the FP8 attention kernel may start early
    # PDL: the V tile's loads are issued before the wait for the partials, which are read after it (and every
    # store comes after it)
    assert ptx_count(ptx, r"griddepcontrol\.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("st.global")
    # V tile, then the partials (varlen: the two cu_seqlens entries come first)
    assert ptx.rindex("ld.global.v4") < wait < ptx.index("ld.global.b32", ptx.rindex("ld.global.v4"))
    # scale = amax / 448 and 1 / scale, both correctly rounded
    assert ptx_count(ptx, r"div\.rn\.f32") == 1 and ptx_count(ptx, r"rcp\.rn\.f32") == 1
    assert ptx_has(ptx, r"mul\.rn\.f32")
    assert not ptx_has(ptx, r"\.local")


def test_prepass_config_checks():
    with pytest.raises(ValueError, match="head_dim"):
        m.VAmaxPartial(256)
    with pytest.raises(ValueError, match="head_dim"):
        m.VFp8TransposeQuant(96)
