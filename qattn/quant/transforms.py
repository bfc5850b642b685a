"""Reference accuracy transforms for the KV cache: K smoothing and a randomized Hadamard rotation.

Both are *exact* in real arithmetic and change only how well K and V quantize:

* **K smoothing** subtracts a per-(layer, kv_head) channel mean ``m`` (a (head_dim,) vector per KV head) from
  every key before it is quantized: ``q · (k - m) = q · k - q · m`` and ``q · m`` is the same for every key of a
  query, so the softmax over keys is unchanged (SageAttention). Values are not touched.
* **Randomized Hadamard rotation** ``R = H · diag(s) / sqrt(d)`` (Sylvester ``H``, random signs ``s``,
  ``d = head_dim`` a power of two) is orthogonal, so ``(q R) · (k R) = q · k``; values are rotated the same way
  and the attention output is rotated back once with ``R^T`` (``softmax · (V R) · R^T = softmax · V``). Rotation
  spreads outlier channels over all of head_dim, which is what 4-bit block scales need (QuaRot, TurboQuant).

The order of the insert-side pipeline, which the fused insert kernel (``qattn.write_kv``) reproduces bit for
bit (:func:`transform_kv` is its reference), is::

    x  = fp32(k)                      # exact widening of bf16 / fp16
    x  = apply_rope(x, positions)     # optional, see RoPE below                   (rope given)
    k1 = x - mean                     # one fp32 subtraction per element            (k_mean given)
    k2 = rotate(k1, signs)            # fast Walsh-Hadamard transform, see below    (cache.rotate)
    payload, scales = quantize(k2, fmt, global_scale)   # qattn.quant.reference

and likewise for values (rotation only) and queries (rotation only, with the same ``signs``: done by
``qattn.flash_attn_with_kvcache`` with :func:`rotate_query_dense`, one fp32 product with the cache's dense R); the
decode output is mapped back with :func:`unrotate_output_dense` (:func:`rotate_query` / :func:`unrotate_output` are
the butterfly references of the two).

**RoPE** (:class:`RoPE`). ``cos_sin_cache`` is (max_position, rotary_dim) fp32, cos in the first rotary_dim / 2
columns and sin in the last (vLLM's layout); it is built once on the host (:meth:`RoPE.from_theta`), so the
kernel and this reference read the same fp32 cos / sin. Pairs: NeoX ``(i, i + rotary_dim / 2)``, GPT-J
``(2i, 2i + 1)``, frequency index ``i``; channels ``>= rotary_dim`` are untouched. Per pair ``(x1, x2)``, with
every product rounded on its own (no fused multiply-add on either side)::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin The global scale of an NVFP4 cache is calibrated on the
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
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "RoPE",
    "ROPE_STYLES",
    "apply_rope",
    "hadamard_matrix",
    "rotation_signs",
    "hadamard_rotation",
    "rotate",
    "unrotate",
    "rotate_rows",
    "unrotate_rows",
    "rotate_query",
    "unrotate_output",
    "key_channel_mean",
    "smooth_keys",
    "transform_kv",
]

ROPE_STYLES = ("neox", "gptj")


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


def _scale(d: int) -> float:
    """1/sqrt(d) as a Python float: torch rounds it once to the tensor's dtype, the same value as
    :func:`_scale_const`, without creating a CPU tensor (a host-to-device copy cannot be CUDA-graph captured)."""
    return 1.0 / math.sqrt(d)


def _rot_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x @ hadamard_rotation(d, seed)`` along the last dim, computed exactly as the module docstring says.

    Inputs are widened to fp32 (fp64 stays fp64, for tests); returns that dtype.
    """
    d = x.shape[-1]
    _check_pow2(d, "x.shape[-1]")
    return rotate_rows(x, rotation_signs(d, seed).to(x.device))


def unrotate(y: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``y @ hadamard_rotation(d, seed).T = FWHT(y * s) * fp32(1/sqrt(d))``."""
    d = y.shape[-1]
    _check_pow2(d, "y.shape[-1]")
    return unrotate_rows(y, rotation_signs(d, seed).to(y.device))


def rotate_rows(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` given the sign vector ``signs`` (head_dim,) instead of a seed: ``(FWHT(x) * s) * c``.

    No random generator runs here, so torch.compile traces it (decode rotates q with the cache's stored signs).
    Inputs are widened to fp32 (fp64 stays fp64); returns that dtype.
    """
    d = x.shape[-1]
    dt = _rot_dtype(x)
    y = _fwht(x.to(dt))
    return (y * signs.to(device=x.device, dtype=dt)) * _scale(d)


def unrotate_rows(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate_rows`: ``FWHT(y * s) * c``."""
    d = y.shape[-1]
    dt = _rot_dtype(y)
    return _fwht(y.to(dt) * signs.to(device=y.device, dtype=dt)) * _scale(d)


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """The dense (d, d) fp32 matrix ``R`` of :func:`rotate_rows` (``x @ R``; ``R^T`` undoes it), on ``signs``'s
    device: the rows of ``R`` are the rotated unit vectors."""
    d = signs.shape[-1]
    return rotate_rows(torch.eye(d, device=signs.device, dtype=torch.float32), signs)


def rotate_query_dense(q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_query` as one fp32 matrix product with ``r = rotation_matrix(signs)`` (the decode
    wrapper's path: three kernels instead of the butterflies' dozens; equal up to fp32 rounding, or TF32's when
    ``torch.backends.cuda.matmul.allow_tf32`` is set)."""
    return (q.float() @ r).to(q.dtype)


def unrotate_output_dense(o: torch.Tensor, r: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`unrotate_output` as one fp32 matrix product with ``r = rotation_matrix(signs)``."""
    y = (o.float() @ r.transpose(0, 1)).to(o.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def rotate_query(q: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Queries in the rotated basis of a cache with ``rotate=True``, in q's dtype: ``(q R)`` so that
    ``(q R) · (k R) = q · k``. The pre-step of ``qattn.flash_attn_with_kvcache`` on a rotated cache."""
    return rotate_rows(q, signs).to(q.dtype)


def unrotate_output(o: torch.Tensor, signs: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention output back from the rotated basis (``o R^T``), in o's dtype; written into ``out`` when given.
    The post-step of ``qattn.flash_attn_with_kvcache`` on a rotated cache."""
    y = unrotate_rows(o, signs).to(o.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RoPE:
    """Rotary position embedding of keys, applied by ``qattn.write_kv`` before smoothing, rotation and quantization.

    ``cos_sin_cache`` (max_position, rotary_dim) fp32, contiguous: ``cos`` in columns ``[0, rotary_dim / 2)``,
    ``sin`` in ``[rotary_dim / 2, rotary_dim)`` (vLLM's layout), row = token position. ``style``: ``"neox"`` pairs
    channels ``(i, i + rotary_dim / 2)`` (rotate-half, Llama / NeoX), ``"gptj"`` pairs ``(2i, 2i + 1)``
    (interleaved); pair ``i`` uses column ``i``. ``rotary_dim <= head_dim``; channels from rotary_dim on are left
    untouched (partial rotary). Bring your model's own cache, or build one with :meth:`from_theta`. The tensor must
    live on the cache's device for ``qattn.write_kv``.
    """

    cos_sin_cache: torch.Tensor
    style: str = "neox"

    def __post_init__(self) -> None:
        t = self.cos_sin_cache
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cos_sin_cache: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"cos_sin_cache: expected dtype torch.float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] < 1 or t.shape[1] < 2 or t.shape[1] % 2:
            raise ValueError(f"cos_sin_cache: expected shape (max_position >= 1, even rotary_dim >= 2), "
                             f"got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError("cos_sin_cache: must be contiguous")
        if self.style not in ROPE_STYLES:
            raise ValueError(f"style: expected one of {ROPE_STYLES}, got {self.style!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.cos_sin_cache.shape[1])

    @property
    def max_position(self) -> int:
        return int(self.cos_sin_cache.shape[0])

    @classmethod
    def from_theta(cls, theta: float, rotary_dim: int, max_position: int, style: str = "neox",
                   device: torch.device | str = "cpu") -> "RoPE":
        """The standard RoPE table: ``inv_freq_i = theta ** (-2i / rotary_dim)``, angle ``= position * inv_freq_i``,
        cos and sin computed in fp64 and rounded once to fp32 (on the host, once; then moved to ``device``)."""
        if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even int >= 2, got {rotary_dim!r}")
        if not isinstance(max_position, int) or max_position < 1:
            raise ValueError(f"max_position: expected an int >= 1, got {max_position!r}")
        if not float(theta) > 0:
            raise ValueError(f"theta: expected a positive number, got {theta!r}")
        inv_freq = float(theta) ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        table = torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float32)
        return cls(table.to(device).contiguous(), style)

    def to(self, device: torch.device | str) -> "RoPE":
        return RoPE(self.cos_sin_cache.to(device).contiguous(), self.style)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """RoPE on ``x`` (num_tokens, num_heads, head_dim) at ``positions`` (num_tokens,) int, exactly as the insert
    kernel: fp32, ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` with each product rounded (separate torch
    ops, so no fused multiply-add). Returns fp32; channels from rotary_dim on are copied unchanged."""
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope: expected a qattn.RoPE, got {type(rope).__name__}")
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    if x.dim() != 3 or rd > x.shape[-1]:
        raise ValueError(f"rope: rotary_dim {rd} does not fit x of shape {tuple(x.shape)} (tokens, heads, head_dim)")
    if (not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64)
            or tuple(positions.shape) != (x.shape[0],)):
        got = (f"{tuple(positions.shape)} {positions.dtype}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(f"positions: expected an int32 / int64 tensor of shape ({x.shape[0]},) (one per token), got "
                         f"{got}")
    pos = positions.long()
    if pos.numel() and bool(((pos < 0) | (pos >= rope.max_position)).any()):
        raise ValueError(f"positions: values must be in [0, {rope.max_position}) (the RoPE table's rows)")
    x = x.float().clone()
    cs = rope.cos_sin_cache.to(x.device)[pos]  # (T, rd)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if rope.style == "neox":
        x1, x2 = x[..., :half], x[..., half:rd]
    else:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if rope.style == "neox":
        x[..., :half], x[..., half:rd] = o1, o2
    else:
        x[..., 0:rd:2], x[..., 1:rd:2] = o1, o2
    return x


def transform_kv(k: torch.Tensor, v: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
                 rope: Optional[RoPE] = None, k_mean: Optional[torch.Tensor] = None,
                 rotation_signs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The insert-side transforms (module docstring order), fp32 in and out: ``k`` -> RoPE -> minus ``k_mean``
    (num_kv_heads, head_dim) -> rotation; ``v`` -> rotation. ``k``, ``v``: (num_tokens, num_kv_heads, head_dim).
    What ``qattn.write_kv`` quantizes (and stores in the ring): the reference of the fused kernel."""
    x = k.float()
    if rope is not None:
        if positions is None:
            raise ValueError("positions: RoPE needs each token's position")
        x = apply_rope(x, positions, rope)
    if k_mean is not None:
        if not isinstance(k_mean, torch.Tensor) or tuple(k_mean.shape) != tuple(x.shape[1:]):
            raise ValueError(f"k_mean: expected shape {tuple(x.shape[1:])} (num_kv_heads, head_dim), got "
                             f"{tuple(k_mean.shape) if isinstance(k_mean, torch.Tensor) else type(k_mean).__name__}")
        x = x - k_mean.to(device=x.device, dtype=torch.float32)
    y = v.float()
    if rotation_signs is not None:
        x, y = rotate_rows(x, rotation_signs), rotate_rows(y, rotation_signs)
    return x, y


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
