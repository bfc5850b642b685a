"""GPU tests: the CuTe-DSL FP4 row kernels against ``qattn.quant.reference``, bit for bit.

Skipped without CUDA. Every output buffer is poisoned (NaN / 0xAB bytes) before the launch so that an
element the kernel fails to write is caught. The reference runs on the CPU (IEEE fp32, no flush to zero).

Run as a script for a small memcheck case: ``compute-sanitizer --tool memcheck python tests/gpu/test_fp4_rows_gpu.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from qattn.layouts.formats import kv_format
from qattn.quant import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ("nvfp4", "mxfp4", "mxfp4_b16")
HEAD_DIMS = (64, 128, 256)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same NaN positions, and identical fp32 bit patterns everywhere else (so -0.0 != +0.0)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"NaN mismatch at {torch.nonzero(gn != wn)[:8].tolist()}"
    gb, wb = got.view(torch.int32)[~wn], want.view(torch.int32)[~wn]
    if not torch.equal(gb, wb):
        bad = torch.nonzero((got.view(torch.int32) != want.view(torch.int32)) & ~wn)[:8].tolist()
        idx = tuple(bad[0])
        raise AssertionError(f"{int((gb != wb).sum())} values differ, first at {bad}: got {got[idx].item()!r} "
                             f"want {want[idx].item()!r}")
    # torch.equal as well, as the brief asks (NaN-free positions)
    assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(want, nan=0.0))


def _random_fp4_rows(fmt: str, n: int, head_dim: int, gen: torch.Generator, all_scale_bytes: bool = False):
    f = kv_format(fmt)
    payload = torch.randint(0, 256, (n, head_dim // 2), dtype=torch.uint8, generator=gen)
    flat = payload.view(-1)
    k = min(256, flat.numel())
    flat[:k] = torch.arange(k, dtype=torch.int32).to(torch.uint8)  # every byte value appears (n*D >= 512)
    nb = head_dim // f.scale_block
    if all_scale_bytes:
        scales = torch.randint(0, 256, (n, nb), dtype=torch.uint8, generator=gen)
        k = min(256, scales.numel())
        scales.view(-1)[:k] = torch.arange(k, dtype=torch.int32).to(torch.uint8)
    elif f.scale_dtype == "e4m3":
        valid = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
        scales = valid[torch.randint(0, valid.numel(), (n, nb), generator=gen)]
        k = min(valid.numel(), scales.numel())
        scales.view(-1)[:k] = valid[:k]
    else:
        scales = torch.randint(0, 255, (n, nb), dtype=torch.uint8, generator=gen)
        k = min(255, scales.numel())
        scales.view(-1)[:k] = torch.arange(k, dtype=torch.int32).to(torch.uint8)
    g = None
    if f.has_global_scale:
        # log-uniform over 2^-40 .. 2^40 with random mantissas, a few exact 1.0
        g = torch.exp2(torch.rand(n, generator=gen) * 80 - 40) * (1 + torch.rand(n, generator=gen))
        g[:3] = 1.0
        g = g.float()
    return payload, scales, g


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_bit_exact(fmt, head_dim):
    from qattn.cute_kernels.fp4_rows import dequantize_rows

    gen = torch.Generator().manual_seed(zlib.crc32(f'{fmt}/{head_dim}'.encode()))
    n = 1037  # not a multiple of any CTA's row count: exercises the tail
    payload, scales, g = _random_fp4_rows(fmt, n, head_dim, gen)
    want = ref.dequantize(payload, scales, fmt, global_scale=g)
    out = torch.full((n, head_dim), float("nan"), device="cuda")
    got = dequantize_rows(payload.cuda(), scales.cuda(), fmt, None if g is None else g.cuda(), out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    _bits_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_nan_scales_and_small_shapes(fmt):
    from qattn.cute_kernels.fp4_rows import dequantize_rows

    gen = torch.Generator().manual_seed(7)
    head_dims = (64, 48) if fmt != "mxfp4" else (64, 96)  # 48: 16-value groups per thread (nvfp4, b16)
    for head_dim in head_dims:
        for n in (1, 3, 300):
            payload, scales, g = _random_fp4_rows(fmt, max(n, 300), head_dim, gen, all_scale_bytes=True)
            payload, scales = payload[:n].contiguous(), scales[:n].contiguous()
            g = None if g is None else g[:n].contiguous()
            want = ref.dequantize(payload, scales, fmt, global_scale=g)
            got = dequantize_rows(payload.cuda(), scales.cuda(), fmt, None if g is None else g.cuda())
            _bits_equal(got, want)
    # scalar / default global scale, and an empty batch
    if fmt == "nvfp4":
        payload, scales, _ = _random_fp4_rows(fmt, 64, 64, gen)
        _bits_equal(dequantize_rows(payload.cuda(), scales.cuda(), fmt, 0.37),
                    ref.dequantize(payload, scales, fmt, global_scale=0.37))
        _bits_equal(dequantize_rows(payload.cuda(), scales.cuda(), fmt),
                    ref.dequantize(payload, scales, fmt))
    empty = dequantize_rows(torch.zeros(0, 32, dtype=torch.uint8, device="cuda"),
                            torch.zeros(0, 64 // kv_format(fmt).scale_block, dtype=torch.uint8, device="cuda"), fmt)
    assert empty.shape == (0, 64)


def test_dequantize_rows_on_side_stream_and_validation():
    from qattn.cute_kernels.fp4_rows import dequantize_rows

    gen = torch.Generator().manual_seed(11)
    payload, scales, _ = _random_fp4_rows("mxfp4", 512, 128, gen)
    p, s = payload.cuda(), scales.cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = dequantize_rows(p, s, "mxfp4")
    side.synchronize()
    _bits_equal(got, ref.dequantize(payload, scales, "mxfp4"))
    with pytest.raises(TypeError, match="scales"):
        dequantize_rows(p, s.float(), "mxfp4")
    with pytest.raises(ValueError, match="scales"):
        dequantize_rows(p, s[:, :2].contiguous(), "mxfp4")
    with pytest.raises(ValueError, match="global_scale"):
        dequantize_rows(p, s, "mxfp4", global_scale=1.0)


# --------------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------------
def _rows_to_quantize(n: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, head_dim, generator=gen)
    # per-row magnitudes over a huge range, including subnormal-producing ones
    x *= torch.exp2(torch.randint(-130, 100, (n, 1), generator=gen).float())
    k = n // 8
    x[:k] = torch.randn(k, head_dim, generator=gen)  # ordinary rows
    x[k, :] = 0.0  # all-zero row
    x[k + 1, :] = -0.0
    # outliers: one large value per block in some rows
    rows = torch.arange(k + 2, 2 * k)
    x[rows, torch.randint(0, head_dim, (rows.numel(),), generator=gen)] *= 1000.0
    # exact E2M1 midpoints times powers of two (RNE ties)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0])
    r = torch.arange(2 * k, 3 * k)
    x[r] = mids[torch.randint(0, mids.numel(), (r.numel(), head_dim), generator=gen)] * torch.where(
        torch.rand(r.numel(), head_dim, generator=gen) < 0.5, -1.0, 1.0)
    # subnormal inputs
    x[3 * k] = torch.randn(head_dim, generator=gen) * 2.0**-140
    return x.float()


QUANT_CASES = [("nvfp4", None), ("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp4_b16", "floor"), ("mxfp4_b16", "rceil")]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("fmt,rule", QUANT_CASES)
def test_quantize_rows_bit_exact(fmt, rule, head_dim):
    from qattn.cute_kernels.fp4_rows import dequantize_rows, quantize_rows

    gen = torch.Generator().manual_seed(zlib.crc32(f'{fmt}/{rule}/{head_dim}'.encode()))
    n = 777
    x = _rows_to_quantize(n, head_dim, gen)
    f = kv_format(fmt, scale_rule=rule)
    g = None
    if f.has_global_scale:
        amax = x.abs().amax(-1)
        g = torch.where(amax > 0, amax / torch.full_like(amax, 448.0 * 6.0), torch.ones_like(amax))
        g[::5] = torch.exp2(torch.rand(g[::5].shape, generator=gen) * 60 - 30)  # unrelated global scales
        g = torch.where(g > 0, g, torch.ones_like(g)).float()  # amax/2688 underflows for the subnormal row
    want_p, want_s = ref.quantize(x, f, global_scale=g)
    pay = torch.full((n, head_dim // 2), 0xAB, dtype=torch.uint8, device="cuda")
    sc = torch.full((n, head_dim // f.scale_block), 0xAB, dtype=torch.uint8, device="cuda")
    got_p, got_s = quantize_rows(x.cuda(), fmt, None if g is None else g.cuda(), scale_rule=rule, out=(pay, sc))
    torch.cuda.synchronize()
    assert torch.equal(got_s.cpu(), want_s), "scale bytes differ"
    if not torch.equal(got_p.cpu(), want_p):
        bad = torch.nonzero(got_p.cpu() != want_p)[:8].tolist()
        raise AssertionError(f"payload bytes differ at {bad}")
    # bf16 input is widened exactly
    xb = x.to(torch.bfloat16)
    wp, ws = ref.quantize(xb, f, global_scale=g)
    gp, gs = quantize_rows(xb.cuda(), f, None if g is None else g.cuda())
    assert torch.equal(gp.cpu(), wp) and torch.equal(gs.cpu(), ws)
    # round trip through the GPU dequantizer equals the reference fake-quantize
    _bits_equal(dequantize_rows(got_p, got_s, f, None if g is None else g.cuda()),
                ref.dequantize(want_p, want_s, f, global_scale=g))


def _sanitizer_smoke() -> None:
    """One small case per format (run under compute-sanitizer)."""
    from qattn.cute_kernels.fp4_rows import dequantize_rows, quantize_rows

    gen = torch.Generator().manual_seed(0)
    for fmt in FORMATS:
        payload, scales, g = _random_fp4_rows(fmt, 37, 64, gen)
        got = dequantize_rows(payload.cuda(), scales.cuda(), fmt, None if g is None else g.cuda())
        _bits_equal(got, ref.dequantize(payload, scales, fmt, global_scale=g))
        x = _rows_to_quantize(37, 64, gen)
        gg = None if g is None else torch.ones(37)
        p, s = quantize_rows(x.cuda(), fmt, None if gg is None else gg.cuda())
        wp, ws = ref.quantize(x, fmt, global_scale=gg)
        assert torch.equal(p.cpu(), wp) and torch.equal(s.cpu(), ws)
    torch.cuda.synchronize()
    print("sanitizer smoke: OK")


if __name__ == "__main__":
    _sanitizer_smoke()
