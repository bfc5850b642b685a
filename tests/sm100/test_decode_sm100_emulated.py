"""CPU emulation of the SM100 decode kernel (never ran on hardware) against the fp64 reference.

``emulate_decode_sm100`` models the kernel's arithmetic (Q quantized to FP4 by the prepass, block-scaled
products, fp32 scores, P rounded to the V MMA type, fp32 accumulation, split-KV + combine). Two errors are
checked separately:
  kernel error  = emulation vs ``paged_decode_reference`` (fp64 over the *same* quantized cache)
  format error  = reference vs attention over the unquantized K/V (printed in docs/sm100.md, not asserted here)
Bounds (NRMSE of the output, measured values in docs/sm100.md, ~1.5-3x margin):
  q_terms=2 (default): random <= 0.03, outliers <= 0.15;  q_terms=1: random <= 0.2, outliers <= 0.6.
"""

from __future__ import annotations

import pytest
import torch

from qattn.cute_kernels.sm100.emulate import emulate_decode_sm100
from qattn.cute_kernels.sm100.q_prepass import dequantize_q, quantize_q, sf_atom_offset
from qattn.layouts.formats import kv_format
from qattn.reference.attention import paged_decode_reference
from tests.sm100._cases import make_case

BOUNDS = {(2, False): 0.03, (2, True): 0.15, (1, False): 0.2, (1, True): 0.6}


def _nrmse(a, b):
    return float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())


@pytest.mark.parametrize("fmt,outliers,q_terms,splits", [
    ("nvfp4", False, 2, 1), ("nvfp4", True, 2, 3), ("mxfp4", False, 2, 2), ("mxfp4_b16", True, 2, 1),
    ("nvfp4", False, 1, 1), ("mxfp4", True, 1, 2),
])
def test_emulation_matches_reference(fmt, outliers, q_terms, splits):
    q, k, v, cache, lens, bt = make_case(fmt, outliers=outliers, Sq=2, lens=(300, 77), seed=1)
    ref, ref_lse = paged_decode_reference(q, cache, lens, bt, return_lse=True)
    em, lse = emulate_decode_sm100(q, cache, lens, bt, q_terms=q_terms, num_splits=splits, return_lse=True)
    assert torch.isfinite(em).all()
    err = _nrmse(em, ref)
    assert err <= BOUNDS[(q_terms, outliers)], f"{fmt} q_terms={q_terms}: NRMSE {err:.4f}"
    # the LSE moves with the score error only
    tol = 0.1 if q_terms == 2 and not outliers else 2.0 + 0.1 * float(ref_lse.abs().max())
    assert float((lse.double() - ref_lse).abs().max()) < tol


@pytest.mark.parametrize("window,Sq,splits,lens", [((100, 0), 1, 1, (300, 77)), ((0, 0), 2, 2, (300, 150)),
                                                   ((130, 0), 3, 3, (520, 129)), ((5, 0), 1, 2, (260, 4))])
def test_sliding_window_vs_reference(window, Sq, splits, lens):
    """window_size: the kernel's tile range (every split starts from the tile of the first query's first visible
    key) and the per-row left edge, against the fp64 reference over the same cache and window."""
    q, k, v, cache, lens_t, bt = make_case("nvfp4", Sq=Sq, lens=lens, seed=sum(lens) + Sq)
    ref, ref_lse = paged_decode_reference(q, cache, lens_t, bt, return_lse=True, window_size=window)
    em, lse = emulate_decode_sm100(q, cache, lens_t, bt, q_terms=2, num_splits=splits, return_lse=True,
                                   window_size=window)
    assert torch.isfinite(em).all()
    assert _nrmse(em, ref) <= BOUNDS[(2, False)]
    assert float((lse.double() - ref_lse).abs().max()) < 0.1
    full = paged_decode_reference(q, cache, lens_t, bt)
    assert _nrmse(full, ref) > 0.05  # the window changed the output


def test_two_terms_beat_one():
    q, k, v, cache, lens, bt = make_case("nvfp4", Sq=1, lens=(200, 130), seed=2)
    ref = paged_decode_reference(q, cache, lens, bt)
    e1 = _nrmse(emulate_decode_sm100(q, cache, lens, bt, q_terms=1), ref)
    e2 = _nrmse(emulate_decode_sm100(q, cache, lens, bt, q_terms=2), ref)
    assert e2 < e1 / 4


def test_splits_agree():
    q, k, v, cache, lens, bt = make_case("mxfp4", Sq=1, lens=(520, 129), seed=3)
    a = emulate_decode_sm100(q, cache, lens, bt, num_splits=1)
    b = emulate_decode_sm100(q, cache, lens, bt, num_splits=3)
    # P is rounded to bf16 relative to each split's own running max: splits change the rounding, not the math
    torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_b16"])
def test_q_prepass_layout(fmt):
    """Q bytes: rows packed r = i_q * G + g, padding rows zero, scales at the atom offsets."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 8, 128, generator=g)
    qd, qsf, qrs = quantize_q(q, 2, kv_format(fmt), 2)
    assert qd.shape == (2, 2, 2, 128, 64) and qrs.shape == (2, 2, 128)
    assert (qd[:, :, :, 12:] == 0).all()  # rows 12..127 are padding (3 x 4 rows)
    vals = dequantize_q(qd, qsf, qrs, kv_format(fmt)).sum(0) * qrs[..., None]
    x = q.reshape(2, 3, 2, 4, 128).permute(0, 2, 1, 3, 4).reshape(2, 2, 12, 128)
    assert _nrmse(vals[:, :, :12], x) < 0.03
    offs = sf_atom_offset(torch.arange(128)[:, None], torch.arange(8)[None, :], 8)
    assert sorted(offs.reshape(-1).tolist()) == list(range(1024))  # a bijection onto the tile's bytes


@pytest.mark.parametrize("fmt,cap,Sq,splits,window", [("nvfp4", 1.0, 1, 1, (-1, -1)), ("mxfp4", 2.0, 2, 3, (-1, -1)),
                                                      ("mxfp4_b16", 50.0, 1, 2, (-1, -1)),
                                                      ("nvfp4", 1.5, 2, 2, (100, 0))])
def test_softcap_vs_reference(fmt, cap, Sq, splits, window):
    """softcap: the emulated kernel against the fp64 reference with the same cap (and window) over the same cache;
    the small caps change the output far more than the kernel's error, so a kernel ignoring them fails."""
    q, k, v, cache, lens, bt = make_case(fmt, Sq=Sq, lens=(300, 77), seed=int(10 * cap) + Sq)
    if cap <= 2.0:
        q = q * 3  # logits of std ~3: caps of 1-2 bite hard
    ref, ref_lse = paged_decode_reference(q, cache, lens, bt, return_lse=True, softcap=cap, window_size=window)
    em, lse = emulate_decode_sm100(q, cache, lens, bt, q_terms=2, num_splits=splits, return_lse=True, softcap=cap,
                                   window_size=window)
    assert torch.isfinite(em).all()
    err = _nrmse(em, ref)
    assert err <= BOUNDS[(2, False)], f"{fmt} softcap {cap}: NRMSE {err:.4f}"
    assert float((lse.double() - ref_lse).abs().max()) < 0.1
    if cap <= 2.0:
        plain = paged_decode_reference(q, cache, lens, bt, window_size=window)
        assert _nrmse(plain, ref) > 5 * err
