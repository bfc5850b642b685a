"""SageAttention-style INT8 quantization of Q and K for prefill: the exact torch reference.

Layout is FlashAttention's: ``q`` (batch, seqlen_q, num_q_heads, head_dim), ``k`` (batch, seqlen_k,
num_kv_heads, head_dim). Scales follow SageAttention's conventions, (batch, heads, groups), one scale per
group of consecutive rows of one head (all head_dim columns):

* ``granularity="per_block"``: q groups are ``block_q`` rows, ``q_scale`` is (B, Hq, ceil(Sq / block_q)).
* ``granularity="per_warp"``: q groups are ``warp_q`` rows, ``q_scale`` is
  (B, Hq, ceil(Sq / block_q) * (block_q // warp_q)); warp ``w`` covers rows [w * warp_q, (w + 1) * warp_q).
* ``k_scale`` is always per block: (B, Hkv, ceil(Sk / block_k)).

Ragged last groups use only the rows that exist; groups with no rows at all (the tail of the last q block
in per-warp mode) get scale 0. The int8 rule is the one of the ``int8`` KV format: ``s = amax / 127``
(fp32 RN division), ``inv = 1 / s`` (0 unless ``s`` is a normal fp32), ``q = clamp(round_half_even(x * inv),
-127, 127)``.
"""

from __future__ import annotations

import torch

from .reference import INT8_MAX, _div_const, _safe_reciprocal

__all__ = ["quantize_qk_int8_reference", "dequantize_qk_int8_reference"]

_GRANULARITIES = ("per_block", "per_warp")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_int(v, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name}: must be > 0, got {v}")
    return v


def _check_blocks(granularity, block_q, warp_q, block_k) -> None:
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity: expected one of {_GRANULARITIES}, got {granularity!r}")
    _check_int(block_q, "block_q")
    _check_int(warp_q, "warp_q")
    _check_int(block_k, "block_k")
    if block_q % warp_q:
        raise ValueError(f"warp_q: block_q ({block_q}) must be a multiple of warp_q ({warp_q})")


def _check_4d(t, name: str, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected shape (batch, seqlen, heads, head_dim), got {tuple(t.shape)}")


def _check_qk_shapes(q: torch.Tensor, k: torch.Tensor, qname: str, kname: str) -> None:
    if k.device != q.device:
        raise ValueError(f"{kname}: expected device {q.device} (that of {qname}), got {k.device}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{kname}: batch {k.shape[0]} differs from {qname}'s batch {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{kname}: head_dim {k.shape[3]} differs from {qname}'s head_dim {q.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"{kname}: num_kv_heads ({k.shape[2]}) must divide num_q_heads ({q.shape[2]})")


def _num_groups(S: int, granularity: str, block_q: int, warp_q: int) -> tuple[int, int]:
    """(rows per q group, number of q groups)."""
    nblk = -(-S // block_q)
    if granularity == "per_block":
        return block_q, nblk
    return warp_q, nblk * (block_q // warp_q)


def _group_amax(x: torch.Tensor, group: int, ngroups: int) -> torch.Tensor:
    """max |x| over ``group`` consecutive rows x all of head_dim: (B, S, H, D) -> (B, H, ngroups)."""
    B, S, H, D = x.shape
    pad = ngroups * group - S
    a = x.abs()
    if pad:
        a = torch.cat([a, a.new_zeros(B, pad, H, D)], dim=1)  # zeros never raise a max of |x|
    return a.reshape(B, ngroups, group, H, D).amax(dim=(2, 4)).transpose(1, 2)


def _rows(per_group: torch.Tensor, group: int, S: int) -> torch.Tensor:
    """(B, H, ngroups) -> (B, S, H, 1): the value of each row's group."""
    return per_group.repeat_interleave(group, dim=2)[:, :, :S].transpose(1, 2).unsqueeze(-1)


def _quantize_groups(x: torch.Tensor, group: int, ngroups: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = _div_const(_group_amax(x, group, ngroups), float(INT8_MAX))
    y = x * _rows(_safe_reciprocal(s), group, x.shape[1])
    return torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), s


def quantize_qk_int8_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
    k_mean: torch.Tensor | None = None,
):
    """Quantize Q and K to int8, SageAttention style; returns ``(q_int8, q_scale, k_int8, k_scale, k_mean)``.

    ``q_int8`` (B, Sq, Hq, D) and ``k_int8`` (B, Sk, Hkv, D) are int8; the scales are fp32 with the shapes in
    the module docstring. With ``smooth_k`` the per-(batch, kv-head, channel) mean of K over the sequence,
    ``k_mean`` (B, Hkv, D) fp32, is subtracted (in fp32) before quantizing; softmax is invariant to it, so the
    attention kernel never adds it back. Without ``smooth_k``, ``k_mean`` is None.

    The mean is summed in float64 and rounded once to fp32 (independent of summation order; 0 when Sk == 0).
    A kernel that accumulates in fp32 may differ by a few ulps: pass its mean as ``k_mean`` to get the
    reference bytes for that exact mean.
    """
    _check_blocks(granularity, block_q, warp_q, block_k)
    _check_4d(q, "q", _FLOAT_DTYPES)
    _check_4d(k, "k", _FLOAT_DTYPES)
    _check_qk_shapes(q, k, "q", "k")
    for t, name in ((q, "q"), (k, "k")):
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or Inf")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]

    k32 = k.float()
    if k_mean is not None:
        if not smooth_k:
            raise ValueError("k_mean: only used with smooth_k=True")
        if not isinstance(k_mean, torch.Tensor) or k_mean.dtype != torch.float32:
            raise TypeError("k_mean: expected a float32 tensor")
        if tuple(k_mean.shape) != (B, Hkv, D) or k_mean.device != k.device:
            raise ValueError(f"k_mean: expected shape {(B, Hkv, D)} on {k.device}, got {tuple(k_mean.shape)} "
                             f"on {k_mean.device}")
        if not bool(torch.isfinite(k_mean).all()):
            raise ValueError("k_mean: contains NaN or Inf")
    elif smooth_k:
        k_mean = k32.double().sum(dim=1).div(max(Sk, 1)).float()
    if smooth_k:
        k32 = k32 - k_mean.unsqueeze(1)

    group, ngroups = _num_groups(Sq, granularity, block_q, warp_q)
    q_int8, q_scale = _quantize_groups(q.float(), group, ngroups)
    k_int8, k_scale = _quantize_groups(k32, block_k, -(-Sk // block_k))
    return q_int8, q_scale, k_int8, k_scale, (k_mean if smooth_k else None)


def dequantize_qk_int8_reference(
    q_int8: torch.Tensor,
    q_scale: torch.Tensor,
    k_int8: torch.Tensor,
    k_scale: torch.Tensor,
    *,
    granularity: str = "per_warp",
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``q_int8 * q_scale`` and ``k_int8 * k_scale`` (one RN product each), shaped like the inputs.

    K is returned without the mean added back: it is the smoothed K that the kernel's Q K^T uses. The
    block arguments must be the ones given to :func:`quantize_qk_int8_reference`.
    """
    _check_blocks(granularity, block_q, warp_q, block_k)
    _check_4d(q_int8, "q_int8", (torch.int8,))
    _check_4d(k_int8, "k_int8", (torch.int8,))
    _check_qk_shapes(q_int8, k_int8, "q_int8", "k_int8")
    B, Sq, Hq, _ = q_int8.shape
    Sk, Hkv = k_int8.shape[1], k_int8.shape[2]
    group, ngroups = _num_groups(Sq, granularity, block_q, warp_q)
    out = []
    for x, s, name, g, n, H in ((q_int8, q_scale, "q_scale", group, ngroups, Hq),
                                (k_int8, k_scale, "k_scale", block_k, -(-Sk // block_k), Hkv)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor")
        if tuple(s.shape) != (B, H, n) or s.device != x.device:
            raise ValueError(f"{name}: expected shape {(B, H, n)} on {x.device} for {granularity} with these "
                             f"block sizes, got {tuple(s.shape)} on {s.device}")
        out.append(x.float() * _rows(s, g, x.shape[1]))
    return out[0], out[1]
