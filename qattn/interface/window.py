"""FlashAttention's ``window_size=(left, right)`` (sliding-window attention) for the prefill and decode entry
points: validated once, normalized, and turned into the kernels' compile-time flags and runtime edges; and the
other checks both entry points share (softmax_scale, softcap, forward-only inputs).

Query i of a sequence sees keys j with i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
-1 (or None) leaves that side unbounded and ``causal=True`` sets right to 0.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..cute_kernels.config_values import (softcap_value, softmax_scale_value,  # noqa: F401 (the entry points' checks)
                                          window_ints)

__all__ = ["NO_LEFT_EDGE", "Window", "FULL", "resolve_window", "window_ints", "window_bounds", "window_flags",
           "kernel_edges", "softcap_value", "softmax_scale_value", "score_scale", "check_forward_only"]

# the kernels' window_left for a window with a right edge only: no row's window starts past key 0 (lengths < 2^30)
NO_LEFT_EDGE = 1 << 30


def window_bounds(window_size: tuple, causal: bool, max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """(left, right) of ``window_ints(window_size)`` with ``causal`` folded in (right = 0). A bound that no row of
    any sequence up to these lengths reaches becomes -1, which changes no output and keeps the plain kernels for
    windows longer than the sequences: left >= max_seqlen_k - 1 (row Sq - 1 starts at key <= 0), and without
    causal right >= max_seqlen_q - 1 (row 0 ends at key >= Sk - 1)."""
    left, right = window_size
    if causal:
        right = 0
    if left >= max_seqlen_k - 1:
        left = -1
    if not causal and right >= max_seqlen_q - 1:
        right = -1
    return left, right


def window_flags(left: int, right: int) -> tuple[bool, bool]:
    """(causal, window) compile-time flags of a :func:`window_bounds` result: a right edge is the causal bound
    (right 0: the causal mask itself, whatever ``causal`` said), moved by ``window_right`` in a window kernel;
    ``window`` for any edge a plain causal / full kernel lacks."""
    return right >= 0, left >= 0 or right > 0


def kernel_edges(left: int, right: int) -> tuple[int, int]:
    """The (window_left, window_right) runtime arguments of a window kernel."""
    return (NO_LEFT_EDGE if left < 0 else left), max(right, 0)


class Window(NamedTuple):
    """A call's window as the kernels take it: the normalized bounds, the compile-time flags, the runtime edges."""

    left: int
    right: int
    causal: bool  # the kernel's upper bound (a causal mask, moved by ``right`` when ``local``)
    local: bool  # the kernel's window variant

    @property
    def edges(self) -> tuple[int, int]:
        return kernel_edges(self.left, self.right)

    def keys_read(self, max_seqlen_k: int, seqlen_q: int, tile_n: int) -> int:
        """How many keys per sequence a decode kernel reads at most (the split-KV heuristic's context): all of
        them without a left edge, else the window plus the query rows, plus one tile for its alignment."""
        return max_seqlen_k if self.left < 0 else min(max_seqlen_k, self.left + seqlen_q + tile_n)


FULL = Window(-1, -1, False, False)


def resolve_window(window_size, causal: bool, max_seqlen_q: int, max_seqlen_k: int) -> Window:
    """``window_size`` (validated) and ``causal`` for sequences of at most these lengths: :func:`window_bounds`,
    then :func:`window_flags` (remembered per argument tuple: no Python work per call beyond the validation)."""
    return _resolved(window_ints(window_size), bool(causal), max_seqlen_q, max_seqlen_k)


@functools.lru_cache(maxsize=4096)
def _resolved(window_size: tuple, causal: bool, max_seqlen_q: int, max_seqlen_k: int) -> Window:
    left, right = window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    return Window(left, right, *window_flags(left, right))


def score_scale(softmax_scale: float, softcap: float) -> float:
    """The score scale every attention kernel takes (prefill and decode, SM90 and SM100): softmax_scale * log2 e
    (scores in the log2 domain of ``ex2``), or softmax_scale / softcap with a cap (the kernel's tanh argument z /
    softcap; ``common/softcap.py`` multiplies the tanh by softcap * log2 e)."""
    scale = softmax_scale / softcap if softcap else softmax_scale * math.log2(math.e)
    if not _FP32_TINY <= scale <= _FP32_MAX:  # the kernels take it as an fp32 (inf would give NaN outputs)
        raise ValueError(f"softmax_scale / softcap: the score scale {scale!r} they give "
                         f"({'softmax_scale / softcap' if softcap else 'softmax_scale * log2 e'}) is not a normal fp32")
    return scale


_FP32_MAX = 3.4028234663852886e38
_FP32_TINY = 1.1754943508222875e-38


def check_forward_only(*tensors) -> None:
    """The kernels have no backward: an input that needs a gradient would silently get none, so it is refused
    (inference calls run under no_grad / inference_mode, where nothing needs one)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError("an input requires grad, but qattn's kernels are forward-only (no backward): call under "
                           "torch.no_grad() / torch.inference_mode(), or pass detached tensors")
