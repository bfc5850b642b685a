"""Plain-Python checks of the scalar options that kernel configs and entry points share (no cutlass import: the
config modules, the launchers and the CPU tests read them)."""

from __future__ import annotations

import math

__all__ = ["MAX_GRID_YZ", "softcap_value", "softmax_scale_value", "window_ints"]

MAX_GRID_YZ = 65535  # CUDA's limit of a grid's y and z, where the kernels put heads, sequences or unit groups


def softmax_scale_value(softmax_scale, head_dim: int) -> float:
    """FlashAttention's ``softmax_scale`` (prefill and decode entry points): None is 1 / sqrt(head_dim), else a
    finite positive float; anything else a ValueError."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")
    return softmax_scale


def softcap_value(softcap) -> float:
    """FlashAttention's ``softcap`` as a float: 0.0 (or None) is off, else a finite positive cap; anything else a
    ValueError. One check for the entry points (prefill, decode) and every kernel config (SM90, SM100)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap: expected a finite float >= 0 (0.0: no soft-capping), got {softcap!r}")
    return float(softcap)


def window_ints(window_size) -> tuple[int, int]:
    """``window_size`` as two ints >= -1 (None: -1, unbounded); raises ValueError on anything else."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    ws = tuple(-1 if w is None else w for w in window_size)
    if any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in ws):
        raise ValueError(f"window_size: expected ints >= -1 (or None), -1 meaning unbounded, got {window_size!r}")
    return ws
