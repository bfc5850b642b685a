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

Varlen (FlashAttention's packed layout): ``q`` (total_q, num_q_heads, head_dim), ``k`` (total_k, num_kv_heads,
head_dim), sequence ``i`` is rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` (``cu_seqlens`` int32 (num_seqs + 1,),
starting at 0). Every sequence is quantized as a batch of one: groups start at the sequence's first row and
never cross into the next sequence, and K is smoothed with that sequence's own mean. ``q_int8`` / ``k_int8``
keep the packed layout of ``q`` / ``k``. Scales are padded per sequence to the longest one, so that the
attention kernel indexes them as ``[seq, head, group]``:

* ``q_scale`` (num_seqs, Hq, G_q) with ``G_q`` the dense group count of ``max_seqlen_q`` (above);
* ``k_scale`` (num_seqs, Hkv, ceil(max_seqlen_k / block_k));
* ``k_mean`` (num_seqs, Hkv, D) fp32 (zeros for an empty sequence), or None without smoothing.

Groups past a shorter sequence's own group count are 0 (so are its per-warp groups with no rows).

Channel balancing (``balance_qk=True``, off by default; SmoothQuant's migration applied to attention): a channel
that is large in Q (or in K) sets the int8 step of every other channel of its group. Scaling channel ``c`` of
Q by ``lam[c]`` and of K by ``1 / lam[c]`` leaves ``Q K^T`` unchanged, and ``lam = sqrt(amax_k / amax_q)``
gives both the same amax in that channel. ``lam`` is a power of two (the scalings are exact), one per
(batch, kv head, channel), shared by the kv head's group of q heads:

* ``amax_k[c] = max |K[:, c] - mean[c]|`` over the sequence (after smoothing; ``max |K[:, c]|`` without),
  ``amax_q[c] = max |Q[:, h, c]|`` over the sequence and the group's q heads h, both fp32;
* ``lam = 2^e``, ``e`` the integer nearest ``log2(amax_k / amax_q) / 2``: with ``amax = m * 2^E``
  (``1 <= m < 2``), ``E(t) = E_k - E_q - (m_k < m_q)`` is the exponent of the exact ratio and
  ``e = floor((E(t) + 1) / 2)``, clamped to +-32; ``e = 0`` where either amax is below 2^-126 (0 included);
* Q is quantized from ``q * lam`` and K from ``(k - mean) * (1 / lam)`` (fp32, exact), with the usual rules.

Measured through ``flash_attn_func`` on the H100 (B2 S1024 H4/2 D128, vs fp64 attention): the "heavy" input (Q
channels 0-3 x4, K channels 5-7 x4, K offsets) NRMSE 3.8 % -> 1.8 % causal, 4.4 % -> 2.1 % full; an fp64 model
of the quantization alone leaves random and K-offset inputs unchanged (1.1 %). Cost: one more read of Q
(D128 S8K B2 H16: the prepass 114 -> 155 us).
"""

from __future__ import annotations

import torch

from .reference import INT8_MAX, _div_const, _safe_reciprocal

__all__ = ["quantize_qk_int8_reference", "quantize_qk_int8_varlen_reference", "dequantize_qk_int8_reference",
           "qk_balance_reference", "BALANCE_MAX_LOG2"]

BALANCE_MAX_LOG2 = 32

_GRANULARITIES = ("per_block", "per_warp")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


MAX_BLOCK_ROWS = 4096  # block_q / warp_q / block_k: rows of one scale group (the kernels use 16-128)


def _check_int(v, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name}: must be > 0, got {v}")
    return v


def _check_blocks(granularity, block_q, warp_q, block_k) -> None:
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity: expected one of {_GRANULARITIES}, got {granularity!r}")
    for v, name in ((block_q, "block_q"), (warp_q, "warp_q"), (block_k, "block_k")):
        # the cap keeps a huge block from sizing a huge scale tensor (per_warp: block_q / warp_q groups per block)
        if _check_int(v, name) > MAX_BLOCK_ROWS:
            raise ValueError(f"{name}: at most {MAX_BLOCK_ROWS} rows, got {v}")
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


def qk_balance_reference(amax_q: torch.Tensor, amax_k: torch.Tensor) -> torch.Tensor:
    """The power-of-two channel balance ``lam`` (fp32, shaped like ``amax_k``) from fp32 channel amaxes of Q and
    K (module docstring): integer arithmetic on the fp32 bits, so kernels reproduce it exactly."""
    from .reference import FP32_MIN_NORMAL

    aq, ak = amax_q.float().contiguous(), amax_k.float().contiguous()
    bq, bk = aq.view(torch.int32), ak.view(torch.int32)
    d = ((bk >> 23) - (bq >> 23)) - ((bk & 0x7FFFFF) < (bq & 0x7FFFFF)).to(torch.int32)
    e = ((d + 1) >> 1).clamp(-BALANCE_MAX_LOG2, BALANCE_MAX_LOG2)
    e = torch.where((aq >= FP32_MIN_NORMAL) & (ak >= FP32_MIN_NORMAL), e, torch.zeros_like(e))
    return torch.ldexp(torch.ones_like(ak), e)


def _channel_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the sequence: (B, S, H, D) -> (B, H, D) (0 for S == 0)."""
    if x.shape[1] == 0:
        return x.new_zeros((x.shape[0], x.shape[2], x.shape[3]), dtype=torch.float32)
    return x.float().abs().amax(dim=1)


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
    balance_qk: bool = False,
):
    """Quantize Q and K to int8, SageAttention style; returns ``(q_int8, q_scale, k_int8, k_scale, k_mean)``,
    with ``balance_qk`` also ``qk_balance`` (B, Hkv, D) fp32 (module docstring): then ``q_int8 * q_scale``
    approximates ``q * qk_balance`` and ``k_int8 * k_scale`` approximates ``(k - k_mean) / qk_balance``.

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

    q32 = q.float()
    lam = None
    if balance_qk:
        amax_q = _channel_amax(q32).reshape(B, Hkv, Hq // Hkv, D).amax(dim=2)
        lam = qk_balance_reference(amax_q, _channel_amax(k32))
        q32 = q32 * lam.repeat_interleave(Hq // Hkv, dim=1).unsqueeze(1)
        k32 = k32 * (1.0 / lam).unsqueeze(1)  # powers of two: both products exact (but for underflow)

    group, ngroups = _num_groups(Sq, granularity, block_q, warp_q)
    q_int8, q_scale = _quantize_groups(q32, group, ngroups)
    k_int8, k_scale = _quantize_groups(k32, block_k, -(-Sk // block_k))
    out = (q_int8, q_scale, k_int8, k_scale, (k_mean if smooth_k else None))
    return out + (lam,) if balance_qk else out


def _check_cu_seqlens(cu, name: str, total: int, max_seqlen, max_name: str) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
        raise TypeError(f"{name}: expected a 1-d torch.int32 tensor (num_seqs + 1,)")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{max_name}: expected an int >= 0, got {max_seqlen!r}")
    bounds = [int(v) for v in cu.cpu()]
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"{name}: must start at 0 and end at the total row count {total}, got {bounds[0]} .. "
                         f"{bounds[-1]}")
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name}: must be non-decreasing")
    if lens and max(lens) > max_seqlen:
        raise ValueError(f"{max_name}: {max_seqlen} is shorter than the longest sequence ({max(lens)})")
    return bounds


def quantize_qk_int8_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    granularity: str = "per_warp",
    smooth_k: bool = True,
    block_q: int = 128,
    warp_q: int = 16,
    block_k: int = 128,
    k_mean: torch.Tensor | None = None,
    balance_qk: bool = False,
):
    """Varlen :func:`quantize_qk_int8_reference` (layout in the module docstring): each sequence is the dense
    reference on a batch of one, its scales written into the sequence's row of the padded scale tensors
    (``balance_qk``: also its ``qk_balance`` row, (num_seqs, Hkv, D), all ones for an empty sequence).

    ``k_mean`` (num_seqs, Hkv, D) fp32, optional: the means to subtract (as in the dense reference).
    """
    _check_blocks(granularity, block_q, warp_q, block_k)
    for t, name in ((q, "q"), (k, "k")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected shape (total, heads, head_dim), got {tuple(t.shape)}")
    _check_qk_shapes(q.unsqueeze(0), k.unsqueeze(0), "q", "k")
    bq = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
    bk = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
    n = len(bq) - 1
    if len(bk) - 1 != n:
        raise ValueError(f"cu_seqlens_k: {len(bk) - 1} sequences, cu_seqlens_q has {n}")
    Hq, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    if k_mean is not None and (not isinstance(k_mean, torch.Tensor) or tuple(k_mean.shape) != (n, Hkv, D)):
        raise ValueError(f"k_mean: expected a tensor of shape {(n, Hkv, D)}")

    dev = q.device
    q_int8 = torch.zeros(tuple(q.shape), dtype=torch.int8, device=dev)
    k_int8 = torch.zeros(tuple(k.shape), dtype=torch.int8, device=dev)
    q_scale = torch.zeros((n, Hq, _num_groups(max_seqlen_q, granularity, block_q, warp_q)[1]),
                          dtype=torch.float32, device=dev)
    k_scale = torch.zeros((n, Hkv, -(-max_seqlen_k // block_k)), dtype=torch.float32, device=dev)
    k_means = torch.zeros((n, Hkv, D), dtype=torch.float32, device=dev)
    lams = torch.ones((n, Hkv, D), dtype=torch.float32, device=dev)
    for i in range(n):
        qa, qb, ka, kb = bq[i], bq[i + 1], bk[i], bk[i + 1]
        qi, qs, ki, ks, km, *lam = quantize_qk_int8_reference(
            q[qa:qb].unsqueeze(0), k[ka:kb].unsqueeze(0), granularity=granularity, smooth_k=smooth_k,
            block_q=block_q, warp_q=warp_q, block_k=block_k,
            k_mean=None if k_mean is None else k_mean[i : i + 1], balance_qk=balance_qk)
        if balance_qk:
            lams[i] = lam[0][0]
        q_int8[qa:qb] = qi[0]
        k_int8[ka:kb] = ki[0]
        q_scale[i, :, : qs.shape[2]] = qs[0]
        k_scale[i, :, : ks.shape[2]] = ks[0]
        if smooth_k:
            k_means[i] = km[0]
    out = (q_int8, q_scale, k_int8, k_scale, (k_means if smooth_k else None))
    return out + (lams,) if balance_qk else out


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
