"""CPU: FlashAttention's ``window_size`` as the kernels see it (``qattn.interface.window``). The host turns (left,
right, causal) into compile-time flags (causal, window) and runtime edges; the kernels mask keys with those. Here
the mask the kernels apply is spelled out from the flags and edges and compared, for every query and key, with
FlashAttention's definition, over random lengths and windows (dense prefill, varlen with per-sequence lengths up to
the maxima, decode with lengths up to the block table's capacity)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qattn.interface.window import (NO_LEFT_EDGE, kernel_edges, score_scale, softcap_value, window_bounds,
                                    window_flags, window_ints)


def fa_mask(sq: int, sk: int, left: int, right: int, causal: bool) -> torch.Tensor:
    """FlashAttention's docstring: query i sees keys i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded;
    causal: right 0)."""
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        m &= j <= i + right
    if left >= 0:
        m &= j >= i - left
    return m


def kernel_mask(sq: int, sk: int, upper: bool, window: bool, edges: tuple) -> torch.Tensor:
    """What the SM90 kernels mask: the causal bound (moved by window_right in a window kernel) when ``upper``, the
    left edge when ``window``; nothing else (keys < sk always)."""
    wl, wr = edges
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if upper:
        m &= j <= i + (wr if window else 0)
    if window:
        m &= j >= i - wl
    return m


windows = st.tuples(st.integers(-1, 70), st.integers(-1, 70))


@settings(max_examples=400, deadline=None)
@given(sq=st.integers(1, 60), sk=st.integers(1, 60), w=windows, causal=st.booleans())
def test_dense_prefill_masks_equal_flash_attention(sq, sk, w, causal):
    left, right = window_bounds(window_ints(w), causal, sq, sk)
    upper, window = window_flags(left, right)
    assert torch.equal(kernel_mask(sq, sk, upper, window, kernel_edges(left, right)), fa_mask(sq, sk, *w, causal))


@settings(max_examples=200, deadline=None)
@given(max_q=st.integers(1, 50), max_k=st.integers(1, 50), w=windows, causal=st.booleans(),
       lens=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=4))
def test_varlen_and_decode_masks_equal_flash_attention(max_q, max_k, w, causal, lens):
    """One normalization from the maxima (varlen: max_seqlen_q / _k; decode: seqlen_q and the block table's key
    capacity) must hold for every sequence of at most those lengths."""
    left, right = window_bounds(window_ints(w), causal, max_q, max_k)
    upper, window = window_flags(left, right)
    edges = kernel_edges(left, right)
    for fq, fk in lens:
        sq, sk = max(1, round(fq * max_q)), max(1, round(fk * max_k))
        assert torch.equal(kernel_mask(sq, sk, upper, window, edges), fa_mask(sq, sk, *w, causal)), (sq, sk)


def test_edges_and_flags():
    assert window_flags(-1, -1) == (False, False)  # full
    assert window_flags(-1, 0) == (True, False)  # the plain causal kernel
    assert window_flags(5, 0) == (True, True) and window_flags(-1, 3) == (True, True)
    assert window_flags(5, -1) == (False, True)  # a left edge only: no upper bound
    assert kernel_edges(-1, 3) == (NO_LEFT_EDGE, 3) and kernel_edges(7, -1) == (7, 0)
    for bad in (4, (1,), (1, 2, 3), (-2, 0), (0, -5), (1.0, 0), (False, 0), ("1", 0), None):
        with pytest.raises(ValueError, match="window_size"):
            window_ints(bad)
    assert window_ints([None, 4]) == (-1, 4)


def test_score_scale_and_softcap_value():
    """The kernels' score scale: softmax_scale * log2 e (log2 domain of ex2), or softmax_scale / softcap with a cap
    (the tanh argument); softcap values as FlashAttention takes them."""
    import math

    assert score_scale(0.125, 0.0) == 0.125 * math.log2(math.e)
    assert score_scale(0.125, 50.0) == 0.125 / 50.0
    assert softcap_value(None) == 0.0 and softcap_value(50) == 50.0 and isinstance(softcap_value(50), float)
    for bad in (-1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ValueError, match="softcap"):
            softcap_value(bad)
