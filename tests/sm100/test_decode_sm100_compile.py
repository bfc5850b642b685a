"""CPU CI: every SM100 decode variant class compiles for sm_100a and its PTX holds the block-scaled tcgen05.mma,
TMEM allocation, the SMEM->TMEM scale copies and TMA loads; ptxas keeps the D128 kernels free of spills, and the
V dequantization's PTX, run on the CPU, writes the MMA's V tile. Compile times are recorded in
``$QATTN_COMPILE_TIMES`` (default: none) and printed. NOTE: these kernels never ran on hardware."""

from __future__ import annotations

import shutil

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import pytest
import torch
from cutlass import Int32, Uint8

from qattn.cute_kernels.compile_utils import compile_for_arch, ptx_count
from qattn.cute_kernels.sm100.decode import DecodeSm100, decode_sm100_compile_args
from qattn.cute_kernels.sm100.decode_config import TILE_N, DecodeConfigSm100
from qattn.layouts.formats import kv_format
from tests.sm100._cases import compile_sm100_timed

# (format, head_dim, page, group, causal, split, q_terms) -> expected MMA kind
CASES = [
    ("nvfp4", 128, 16, 8, True, True, 2, r"kind::mxf4nvf4\.block_scale\.block16"),
    ("nvfp4", 64, 256, 4, True, False, 1, r"kind::mxf4nvf4\.block_scale\.block16"),
    ("mxfp4", 128, 64, 8, True, True, 2, r"kind::mxf4nvf4\.block_scale\.block32"),  # MmaMXF4Op lowers to this
    ("mxfp4_b16", 64, 128, 16, False, False, 2, r"kind::mxf4nvf4\.block_scale\.block16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-p{c[2]}-g{c[3]}-qt{c[6]}"
                         f"{'-split' if c[5] else ''}")
def test_decode_sm100_compiles(case):
    fmt, D, page, group, causal, split, qt, kind = case
    cfg = DecodeConfigSm100(kv_format(fmt), kv_format(fmt), D, "bf16", group, page, causal, split, q_terms=qt)
    ptx = compile_sm100_timed("sm100_decode", case[:7], DecodeSm100(cfg), decode_sm100_compile_args())
    n_qk = ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\." + kind)
    assert n_qk >= qt * (D // 64), f"block-scaled QK MMA missing ({n_qk})"
    assert ptx_count(ptx, r"tcgen05\.mma\.cta_group::1\.kind::f16") > 0  # P.V
    assert ptx_count(ptx, r"tcgen05\.alloc") > 0 and ptx_count(ptx, r"tcgen05\.dealloc") > 0
    assert ptx_count(ptx, r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4") > 0  # scale factors SMEM -> TMEM
    assert ptx_count(ptx, r"cp\.async\.bulk\.tensor") > 0  # TMA
    assert ptx_count(ptx, r"tcgen05\.commit") > 0 and ptx_count(ptx, r"mbarrier") > 0
    assert ptx_count(ptx, r"tcgen05\.ld\.sync") > 0 and ptx_count(ptx, r"tcgen05\.st\.sync") > 0
    # tcgen05.ld is asynchronous: each load of S / O is waited on before its registers are read
    assert ptx_count(ptx, r"tcgen05\.wait::ld") >= 3


def test_config_rejects():
    with pytest.raises(ValueError, match="FP4 keys"):
        DecodeConfigSm100(kv_format("fp8"), kv_format("nvfp4"), 128, "bf16", 8, 16, True, False)
    with pytest.raises(ValueError, match="scale-factor atom"):
        DecodeConfigSm100(kv_format("mxfp4"), kv_format("mxfp4"), 64, "bf16", 8, 16, True, False)
    with pytest.raises(ValueError, match="page_size"):
        DecodeConfigSm100(kv_format("nvfp4"), kv_format("nvfp4"), 128, "bf16", 8, 8, True, False)


@pytest.mark.parametrize("split", [False, True])
def test_decode_sm100_window_compiles(split):
    """The sliding-window variant (``window``): the same MMAs, TMEM traffic and loads as the causal kernel; the
    splits start at the first visible tile and each row masks its left edge (never ran on hardware)."""
    fmt = kv_format("nvfp4")
    plain = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split)
    cfg = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, window=True)
    assert cfg.key == plain.key + ("window",)
    ptx = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "window", split), DecodeSm100(cfg),
                              decode_sm100_compile_args())
    ref = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "plain", split), DecodeSm100(plain),
                              decode_sm100_compile_args())
    for op in (r"tcgen05\.mma\.cta_group::1\.", r"tcgen05\.cp\.", r"cp\.async\.bulk\.tensor", r"tcgen05\.ld\.sync",
               r"tcgen05\.st\.sync", r"tcgen05\.commit"):
        assert ptx_count(ptx, op) == ptx_count(ref, op) > 0, op
    # one more compare-and-select per score (the left edge) than the causal kernel
    assert ptx_count(ptx, r"selp\.f32") >= ptx_count(ref, r"selp\.f32") + 128


@pytest.mark.parametrize("split", [False, True])
def test_decode_sm100_softcap_compiles(split):
    """``softcap``: its own key per cap, one ``tanh.approx.f32`` per score of a thread's row (128) and the same
    MMAs, TMEM traffic and loads as the plain kernel (never ran on hardware)."""
    fmt = kv_format("nvfp4")
    plain = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split)
    cfg = DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, softcap=50)
    assert cfg.key == plain.key + (("softcap", 50.0),) and cfg.softcap == 50.0
    ptx = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "softcap", split), DecodeSm100(cfg),
                              decode_sm100_compile_args())
    ref = compile_sm100_timed("sm100_decode", ("nvfp4", 128, 64, 8, "plain", split), DecodeSm100(plain),
                              decode_sm100_compile_args())
    assert ptx_count(ptx, r"tanh\.approx\.f32") == 128 and ptx_count(ref, r"tanh\.approx") == 0
    for op in (r"tcgen05\.mma\.cta_group::1\.", r"tcgen05\.cp\.", r"cp\.async\.bulk\.tensor", r"tcgen05\.ld\.sync",
               r"tcgen05\.st\.sync", r"tcgen05\.commit", r"ex2\.approx"):
        assert ptx_count(ptx, op) == ptx_count(ref, op) > 0, op
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="softcap"):
            DecodeConfigSm100(fmt, fmt, 128, "bf16", 8, 64, True, split, softcap=bad)


@pytest.mark.parametrize("kf,vf,D,group,sq,split,W,N,window,cap", [
    ("fp8", "fp8", 128, 4, 1, True, 0, 0, False, 0.0),
    ("nvfp4", "nvfp4", 128, 8, 1, False, 64, 1, True, 30.0),
    ("int8", "nvfp4", 64, 16, 16, True, 0, 0, False, 0.0),
])
def test_mma_sync_decode_compiles_for_sm100(kf, vf, D, group, sq, split, W, N, window, cap):
    """What the tcgen05 kernel does not take runs on SM100 as the portable mma.sync decode kernel compiled for
    sm_100a: its PTX is the sm_90a PTX (the kernel the H100 tests run) but for the ``.target`` line, and ptxas
    builds it for sm_100a. Never ran on a Blackwell GPU."""
    from qattn.cute_kernels.compile_utils import compile_for_arch
    from qattn.cute_kernels.sm90.decode import DecodeSm90, decode_compile_args
    from qattn.cute_kernels.sm90.decode_config import choose_config

    cfg = choose_config(kv_format(kf), kv_format(vf), D, 16, "bf16", group, sq, True, split, ring_window=W,
                        sink_tokens=N, window=window, softcap=cap)
    ptx = compile_sm100_timed("mma_sync_decode", (kf, vf, D, group, sq, split, W, N, window, cap), DecodeSm90(cfg),
                              decode_compile_args())
    _, ptx90 = compile_for_arch(DecodeSm90(cfg), *decode_compile_args(), arch="sm_90a")
    lines, lines90 = ptx.splitlines(), ptx90.splitlines()
    assert ".target sm_100a" in lines and ".target sm_90a" in lines90
    assert [x for x in lines if not x.startswith(".target")] == [x for x in lines90 if not x.startswith(".target")]
    assert ptx_count(ptx, r"mma\.sync\.aligned\.m16n8k16") > 0 and ptx_count(ptx, r"tcgen05") == 0


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs the CUDA toolkit's ptxas on PATH")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_b16"])
@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("extra", [{}, {"window": True}, {"softcap": 30.0}, {"window": True, "softcap": 30.0}],
                         ids=["plain", "window", "softcap", "window-softcap"])
def test_decode_sm100_d128_does_not_spill(fmt, split, extra):
    """ptxas keeps the D128 kernels in registers: V is dequantized eight values (one 16-byte store) at a time.
    Value by value (128 16-bit stores per token row) they spilled up to 488 bytes at 255 registers."""
    from tests.sm100._cases import ptxas_spill_bytes

    f = kv_format(fmt)
    cfg = DecodeConfigSm100(f, f, 128, "bf16", 8, 64, True, split, **extra)
    _, ptx = compile_for_arch(DecodeSm100(cfg), *decode_sm100_compile_args(), arch="sm_100a")
    regs, spills = ptxas_spill_bytes(ptx)
    assert spills == 0, (regs, spills)
    assert ptx_count(ptx, r"st\.shared\.v4\.b32") == 128 // 8 and ptx_count(ptx, r"st\.shared\.b16") == 0


class _DequantV:
    """A test kernel around ``DecodeSm100._dequant_v``: the V staging buffers of both stages and the V tile laid out
    as in the decode kernel (the tile first, at shared address 0); thread t dequantizes token t of ``stage``, tokens
    from ``valid_rows`` on count as past the sequence end."""

    def __init__(self, dec: DecodeSm100):
        self.dec = dec

    @cute.jit
    def __call__(self, stage: Int32, valid_rows: Int32):
        d = self.dec
        v_smem = sm100_utils.make_smem_layout_b(d._pv_mma(), d.pv_tiler, d.v_dtype, 1)
        self.kernel(v_smem, stage, valid_rows).launch(grid=(1, 1, 1), block=(TILE_N, 1, 1))

    @cute.kernel
    def kernel(self, v_smem: cute.ComposedLayout, stage: Int32, valid_rows: Int32):
        d, S = self.dec, self.dec.cfg.stages
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.utils.SmemAllocator()
        sV = smem.allocate_tensor(d.v_dtype, v_smem.outer, byte_alignment=1024, swizzle=v_smem.inner)  # as the kernel
        sVraw = smem.allocate_tensor(Uint8, cute.make_layout((TILE_N, d.v_rb, S), stride=(d.v_rb, 1, TILE_N * d.v_rb)),
                                     byte_alignment=128)
        sVSraw = smem.allocate_tensor(Uint8, cute.make_layout((TILE_N * d.v_srb // 16, 16, S),
                                                              stride=(16, 1, TILE_N * d.v_srb)), byte_alignment=128)
        d._dequant_v(sVraw, sVSraw, sV, stage, tidx, tidx < valid_rows)


def _v_tile_reference(fmt, D: int, payload: torch.Tensor, scales: torch.Tensor, valid_rows: int) -> torch.Tensor:
    """The V tile as the P.V MMA reads it, as 16-bit words at their shared-memory addresses / 2: token t, column d
    at byte 2 * (64 * t + d % 64 + 64 * 128 * (d // 64)) (64-column panels of 128-byte token rows), with the 128B
    swizzle (16-byte unit index ^= token % 8); E2M1 x block scale in fp32, rounded to f16 (nvfp4) / bf16 (MX)."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.stack([payload & 0xF, payload >> 4], dim=-1).reshape(TILE_N, D).long()
    if fmt.scale_dtype == "e4m3":
        sc = scales.view(torch.float8_e4m3fn).float()
    else:  # UE8M0 as the kernel builds it: 2^(byte - 127), byte 0 the subnormal 2^-127
        sc = torch.where(scales == 0, 2.0 ** -127, torch.exp2(scales.double() - 127)).float()
    sc = torch.where(torch.arange(TILE_N)[:, None] < valid_rows, sc, torch.zeros(()))
    vals = e2m1[codes] * sc.repeat_interleave(fmt.scale_block, dim=1)
    bits = vals.to(torch.float16 if fmt.scale_dtype == "e4m3" else torch.bfloat16).view(torch.int16)
    t, d = torch.meshgrid(torch.arange(TILE_N), torch.arange(D), indexing="ij")
    byte = 2 * (64 * t + d % 64 + 64 * TILE_N * (d // 64))
    byte = byte ^ ((byte >> 3) & 0x70)
    tile = torch.zeros(TILE_N * D, dtype=torch.int16)
    tile[(byte // 2).flatten()] = bits.flatten()
    return tile


@pytest.mark.parametrize("fmt,D", [("nvfp4", 128), ("mxfp4", 128), ("mxfp4_b16", 128), ("nvfp4", 64)])
def test_decode_sm100_v_dequant_writes_the_mma_layout(fmt, D):
    """The kernel's own V dequantization (its PTX, run for all 128 threads by a CPU interpreter over random
    staging bytes, NaN / inf scales included) writes every cell of the V tile exactly once, with E2M1 x scale
    rounded to V's type, at the address the MMA's swizzled B layout gives (the emulation tests model this
    arithmetic in torch, not the kernel code)."""
    import numpy as np

    from tests.sm100._ptx_sim import run_block

    f = kv_format(fmt)
    dec = DecodeSm100(DecodeConfigSm100(f, f, D, "bf16", 8, 64, True, False))
    _, ptx = compile_for_arch(_DequantV(dec), Int32(0), Int32(0), arch="sm_100a")
    tile_bytes, S = TILE_N * D * 2, dec.cfg.stages
    raw0 = tile_bytes  # the allocator's offsets: the tile, then V payload, then V scales (all 128-aligned)
    sraw0 = raw0 + S * TILE_N * dec.v_rb
    rng = np.random.default_rng(D)
    for stage, valid_rows in ((0, 128), (1, 77), (0, 0)):
        smem = rng.integers(0, 256, sraw0 + S * TILE_N * dec.v_srb, dtype=np.uint8)
        staged = torch.from_numpy(smem.copy())
        stores = run_block(ptx, TILE_N, [stage, valid_rows], smem)
        assert (stores[:tile_bytes] == 1).all() and (stores[tile_bytes:] == 0).all()
        payload = staged[raw0 + stage * TILE_N * dec.v_rb:][:TILE_N * dec.v_rb].reshape(TILE_N, dec.v_rb)
        scales = staged[sraw0 + stage * TILE_N * dec.v_srb:][:TILE_N * dec.v_srb].reshape(TILE_N, dec.v_srb)
        want = _v_tile_reference(f, D, payload, scales, valid_rows)
        got = torch.from_numpy(smem[:tile_bytes].copy()).view(torch.int16)
        vt = torch.float16 if f.scale_dtype == "e4m3" else torch.bfloat16
        nan = torch.isnan(want.view(vt))
        assert torch.equal(torch.isnan(got.view(vt)), nan)  # NaN scales: NaN, whatever its payload bits
        assert torch.equal(got[~nan], want[~nan]), (stage, valid_rows)
