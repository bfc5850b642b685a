"""Reference accuracy transforms for the KV cache: K smoothing and a randomized Hadamard rotation.

Both are *exact* in real arithmetic and change only how well K and V quantize:

* **K smoothing** subtracts a per-(layer, kv_head) channel mean ``m`` (a (head_dim,) vector per KV head) from
  every key before it is quantized: ``q · (k - m) = q · k - q · m`` and ``q · m`` is the same for every key of a
  query, so the softmax over keys is unchanged (SageAttention). Values are not touched.
* **Randomized Hadamard rotation** ``R = H · diag(s) / sqrt(d)`` (Sylvester ``H``, random signs ``s``,
  ``d = head_dim`` a power of two) is orthogonal, so ``(q R) · (k R) = q · k``; values are rotated the same way
  and the attention output is rotated back once with ``R^T`` (``softmax · (V R) · R^T = softmax · V``). Rotation
  spreads outlier channels over all of head_dim, which is what 4-bit block scales need (QuaRot, TurboQuant).

The order of the insert-side pipeline, which the fused insert kernels must reproduce bit for bit, is::

    k  (post-RoPE, widened to fp32)
    k1 = k - mean                     # one fp32 subtraction per element        (smoothing on)
    k2 = rotate(k1, signs)            # fast Walsh-Hadamard transform, see below (rotation on)
    payload, scales = quantize(k2, fmt, global_scale)   # qattn.quant.reference

and likewise for values (rotation only) and queries (rotation only, with the same ``signs``); the decode
output is mapped back with :func:`unrotate`. The global scale of an NVFP4 cache is calibrated on the
*transformed* tensor (``k2``), since that is what gets quantized.

**Exact arithmetic of the rotation.** :func:`rotate` is not a matrix product (whose fp32 summation order is
implementation-defined) but the fast Walsh-Hadamard transform in a fixed butterfly order: for ``h = 1, 2, 4, ...,
d/2`` every pair ``(i, i + h)`` with ``i & h == 0`` becomes ``(a + b, a - b)`` (fp32, round to nearest); then each
element ``j`` is multiplied by ``s_j`` (exact) and by ``c = fp32(1/sqrt(d))`` (one rounding; exact when ``d`` is
a power of four, e.g. 64 or 256, where ``c`` is a power of two). The result equals ``x @ hadamard_rotation(d,
seed)`` up to fp32 rounding of the summation. :func:`unrotate` computes ``y @ R^T = FWHT(y * s) * c``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "hadamard_matrix",
    "rotation_signs",
    "hadamard_rotation",
    "rotate",
    "unrotate",
    "key_channel_mean",
    "smooth_keys",
]


def _check_pow2(d: int, name: str = "head_dim") -> None:
    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ValueError(f"{name}: the Sylvester Hadamard rotation needs a power of two, got {d!r}")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two): entries ±1, symmetric, ``H H^T = n I``.

    ``H[i, j] = (-1) ** popcount(i & j)``; the same ordering the butterflies of :func:`rotate` produce.
    """
    _check_pow2(n, "n")
    idx = torch.arange(n)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def rotation_signs(head_dim: int, seed: int) -> torch.Tensor:
    """The random ±1 vector ``s`` of :func:`hadamard_rotation` (fp32, shape (head_dim,)).

    Deterministic from ``seed``: ``torch.Generator().manual_seed(seed)`` (CPU generator, the same on every
    machine), ``s = 1 - 2 * randint(0, 2, (head_dim,))``.
    """
    _check_pow2(head_dim)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def hadamard_rotation(head_dim: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Randomized Hadamard rotation ``R = H · diag(s) / sqrt(head_dim)``, an orthogonal (head_dim, head_dim) matrix.

    ``H`` is the Sylvester Hadamard matrix, ``s = rotation_signs(head_dim, seed)``. Applied on the right to rows:
    ``x @ R`` (queries, keys and values); the attention output goes back with ``o @ R.T``. Built in fp64 and
    rounded once to ``dtype`` (fp32 by default).
    """
    _check_pow2(head_dim)
    h = hadamard_matrix(head_dim, torch.float64)
    s = rotation_signs(head_dim, seed).to(torch.float64)
    return (h * s[None, :] / math.sqrt(head_dim)).to(dtype)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dim (= ``x @ H``), fixed butterfly order."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def _scale_const(d: int, dtype: torch.dtype) -> torch.Tensor:
    # fp32(1/sqrt(d)) computed in fp64 then rounded once: exact for powers of four.
    return torch.tensor(1.0 / math.sqrt(d), dtype=torch.float64).to(dtype)


def _rot_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x @ hadamard_rotation(d, seed)`` along the last dim, computed exactly as the module docstring says.

    Inputs are widened to fp32 (fp64 stays fp64, for tests); returns that dtype.
    """
    d = x.shape[-1]
    _check_pow2(d, "x.shape[-1]")
    dt = _rot_dtype(x)
    s = rotation_signs(d, seed).to(device=x.device, dtype=dt)
    y = _fwht(x.to(dt))
    return (y * s) * _scale_const(d, dt).to(x.device)


def unrotate(y: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``y @ hadamard_rotation(d, seed).T = FWHT(y * s) * fp32(1/sqrt(d))``."""
    d = y.shape[-1]
    _check_pow2(d, "y.shape[-1]")
    dt = _rot_dtype(y)
    s = rotation_signs(d, seed).to(device=y.device, dtype=dt)
    return _fwht(y.to(dt) * s) * _scale_const(d, dt).to(y.device)


def key_channel_mean(k: torch.Tensor, token_dim: int = 0) -> torch.Tensor:
    """Per-channel mean of keys over tokens: the K-smoothing vector of one layer.

    ``k`` is e.g. (tokens, kv_heads, head_dim) post-RoPE keys of a calibration set (``token_dim`` says which dim
    holds tokens; several dims can be given as a tuple); returns (kv_heads, head_dim) fp32, accumulated in fp64
    and rounded once. How the calibration tokens are chosen is the caller's policy (``qattn.eval`` uses the
    first tokens of the text, see ``docs/accuracy.md``): the vector must be fixed before the tokens it applies
    to are written to the cache, because smoothed keys are stored.
    """
    if k.shape[token_dim if isinstance(token_dim, int) else token_dim[0]] == 0:
        raise ValueError("key_channel_mean: no calibration tokens")
    return k.to(torch.float64).mean(dim=token_dim).to(torch.float32)


def smooth_keys(k: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``fp32(k) - mean`` (one fp32 subtraction per element); ``mean`` broadcasts against ``k``, e.g. (kv_heads, D)
    against (tokens, kv_heads, D). Softmax(q · k) over keys is unchanged; only queries' scores shift by
    ``q · mean``, the same for all keys of one query."""
    dt = _rot_dtype(k)
    return k.to(dt) - mean.to(device=k.device, dtype=dt)
