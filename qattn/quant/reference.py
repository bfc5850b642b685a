"""Exact torch reference encoders and decoders for the KV-cache formats.

These are the bit-exact oracle for the GPU kernels. They run on CPU or CUDA tensors, are fully vectorised,
and do all arithmetic in IEEE fp32 with the operations a kernel performs: correctly rounded (RN) division,
RN multiplication, RNE casts. Inputs in bf16 / fp16 (or fp8) are widened to fp32 exactly; float64 inputs are
first rounded to fp32 (the value that gets quantized is the fp32 one).

Rules shared by every scaled format:

* ``amax`` is ``max |x|`` over the scale block (a block of ``fmt.scale_block`` values, or the whole row).
* A reciprocal ``1 / d`` is only taken of a *normal* fp32 ``d`` (``d >= 2**-126``); a zero or subnormal
  divisor gives ``inv = 0`` (the elements encode as zeros). This only differs from ``where(d > 0, 1/d, 0)``
  for absurdly small blocks (``amax < 448 * 2**-126`` for fp8) and it avoids ``1/d = inf`` and ``0 * inf = NaN``.
* Divisions by constants are done tensor / tensor, never tensor / Python scalar: on CUDA, PyTorch computes
  ``t / scalar`` as ``t * (1 / scalar)``, which is not the correctly rounded quotient a kernel computes.

Per-format rules are in the docstring of :func:`quantize`.
"""

from __future__ import annotations

from numbers import Real

import torch

from ..layouts.formats import KVFormat, KVFormatPair, kv_format

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "INT8_MAX",
    "FP32_MIN_NORMAL",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "e4m3_encode",
    "e4m3_decode",
    "ue8m0_decode",
    "mx_shared_exponent",
    "SCALE_SEARCHES",
    "quantize",
    "dequantize",
    "fake_quantize",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
INT8_MAX = 127
FP32_MIN_NORMAL = 2.0**-126

# E2M1 magnitudes by code (bit 3 is the sign).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------
def _as_fp32(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x.float()


def _check_uint8(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: expected dtype torch.uint8, got {t.dtype}")


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for an int32 tensor ``e`` in [-149, 127], built from the bits (2**-127 is subnormal)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(1, 254) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def _safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """``1 / d`` (RN division) where ``d`` is a normal fp32, else 0 (see the module docstring)."""
    return torch.where(d >= FP32_MIN_NORMAL, torch.ones_like(d) / d, torch.zeros_like(d))


def _div_const(t: torch.Tensor, c: float) -> torch.Tensor:
    """Correctly rounded fp32 ``t / c`` on any device (tensor / tensor, see the module docstring)."""
    return t / torch.full_like(t, c)


# --------------------------------------------------------------------------------------------------
# element casts
# --------------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (uint8, 0..15) of ``x``: round to nearest, ties to even, saturating to +-6.

    Magnitude codes 0..7 stand for 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign, copied from the fp32 sign
    bit (so -0.0, and negative values that round to 0, give 0x8, as ``ml_dtypes.float4_e2m1fn`` does).
    +-inf saturates to +-6. NaN gives code 0 or 8 (unspecified; quantize rejects NaN).
    The magnitude is found by comparing with the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; at a
    midpoint the even code wins, hence ``>`` where the lower code is even and ``>=`` where the upper is.
    """
    x = _as_fp32(x, "x")
    a = x.abs()
    mag = (
        (a > 0.25).to(torch.uint8)  # 0.25: codes 0 | 1 -> 0
        + (a >= 0.75).to(torch.uint8)  # 0.75: codes 1 | 2 -> 2
        + (a > 1.25).to(torch.uint8)  # 1.25: codes 2 | 3 -> 2
        + (a >= 1.75).to(torch.uint8)  # 1.75: codes 3 | 4 -> 4
        + (a > 2.5).to(torch.uint8)  # 2.5:  codes 4 | 5 -> 4
        + (a >= 3.5).to(torch.uint8)  # 3.5:  codes 5 | 6 -> 6
        + (a > 5.0).to(torch.uint8)  # 5:    codes 6 | 7 -> 6
    )
    sign = (x.view(torch.int32) < 0).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8, only the low 4 bits are read)."""
    _check_uint8(codes, "codes")
    mags = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([mags, -mags])  # codes 8..15 are negative (code 8 is -0.0)
    return table[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes (..., 2n) into bytes (..., n): element 2i in the low nibble, 2i+1 in the high nibble."""
    _check_uint8(codes, "codes")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last dimension must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("codes: E2M1 codes must be in [0, 15]")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: bytes (..., n) to codes (..., 2n)."""
    _check_uint8(packed, "packed")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dimension")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3FN bits (uint8) of ``x``: RNE (subnormals down to 2**-9 included), saturating to +-448.

    Clamping first makes the result independent of the torch version (eager casts of out-of-range values
    gave NaN before torch 2.12). NaN stays NaN (0x7F / 0xFF).
    """
    x = _as_fp32(x, "x")
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 E4M3FN bytes (0x7F / 0xFF decode to NaN)."""
    _check_uint8(bits, "bits")
    return bits.view(torch.float8_e4m3fn).float()


def ue8m0_decode(bits: torch.Tensor) -> torch.Tensor:
    """fp32 value of UE8M0 scale bytes: ``2**(byte - 127)`` (byte 0 is the subnormal 2**-127; 255 is NaN)."""
    _check_uint8(bits, "bits")
    b = bits.to(torch.int32)
    return torch.where(b == 255, torch.full_like(b, 0x7FC00000).view(torch.float32), _pow2((b - 127).clamp(max=127)))


# --------------------------------------------------------------------------------------------------
# MX shared exponent
# --------------------------------------------------------------------------------------------------
def _mx_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    bits = amax.view(torch.int32)
    bexp = (bits >> 23) & 0xFF  # biased exponent; the sign bit (-0.0) is masked off
    man = bits & 0x7FFFFF
    # Normal amax = 1.M * 2**E with E = bexp - 127, so floor(log2(amax)) - 2 = bexp - 129. rceil: the smallest e
    # with 1.M * 2**E <= 6 * 2**e = 1.5 * 2**(e + 2) is E - 2 when 1.M <= 1.5, else E - 1.
    e = bexp - 129
    if rule == "rceil":
        e = e + (man > 0x400000).to(torch.int32)
    # Zero and subnormal amax (bexp == 0, amax < 2**-126) need no normalisation: their exact exponent is at most
    # -129 (floor: floor(log2(amax)) <= -127) or -128 (rceil: 6 * 2**-128 > 2**-126 > amax), so it clamps to
    # -127, which is also what bexp - 129 (+ 1) <= -128 clamps to. At the top, rceil reaches 126 for amax above
    # 1.5 * 2**127; it is clamped to 125 (floor's own maximum), so that 6 * 2**e stays finite: such blocks
    # saturate at 6 * 2**125 instead of decoding to inf.
    return e.clamp(-127, 125)


def mx_shared_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Unbiased MX shared exponent ``e`` (int32, scale = 2**e, UE8M0 byte = e + 127) of a block with ``amax``.

    Computed with integer operations on the fp32 bits of ``amax`` (no float log2), clamped to [-127, 125]
    (125 = floor's maximum for finite amax; rceil's 126, for amax > 1.5 * 2**127, would decode codes >= 4 to inf);
    ``amax == 0`` gives -127. ``amax`` must be >= 0 and finite (any floating dtype, widened to fp32).

    * ``rule="floor"`` (OCP MX v1.0): ``e = floor(log2(amax)) - 2``; ``amax / 2**e`` lies in [4, 8), and values
      above 6 saturate.
    * ``rule="rceil"``: the smallest ``e`` with ``amax <= 6 * 2**e``, i.e. the exact value of
      ``ceil(log2(amax / 6))``; nothing saturates (except above 1.5 * 2**127, by the clamp). For normal ``amax = 1.M * 2**E`` this is
      ``E - 2 + (M > 0x400000)`` (mantissa above 1.5).

    For normal ``amax`` both come straight from the exponent field: ``biased_exp - 129`` (``+ 1`` for rceil when
    the mantissa field exceeds 0x400000). Zero and subnormal ``amax`` have an exact exponent of at most -128
    under either rule, so they all clamp to -127 (the same as normalising them first). Implementations that
      compute ``ceil(log2(amax / 6))`` in floating point (torchao's eager RCEIL, ModelOpt) can differ by one
      near powers of two, because both the division and the log2 round.
    """
    a = _as_fp32(amax, "amax")
    if rule not in ("floor", "rceil"):
        raise ValueError(f"rule: expected 'floor' or 'rceil', got {rule!r}")
    if a.numel() and not bool(((a >= 0) & torch.isfinite(a)).all()):
        raise ValueError("amax: values must be finite and >= 0")
    return _mx_exponent(a, rule)


# --------------------------------------------------------------------------------------------------
# encoder-side block-scale search (the stored format is unchanged)
# --------------------------------------------------------------------------------------------------
SCALE_SEARCHES = ("mse", "mse46", "msenb", "mseup", "msewide")
"""Names of the block-scale searches :func:`quantize` takes as ``scale_search`` (None: the format's plain rule).

``"mse"`` is the proposed rule (4 NVFP4 candidates, 2 MX candidates, see :func:`quantize`); ``"mse46"``,
``"msenb"`` and ``"mseup"`` are its NVFP4 subsets (default + 4/6; default + both neighbours; default + 4/6 + the
upper neighbour, i.e. no candidate that clips the block max more than the default) and ``"msewide"`` is an
exploration upper bound with many candidates, not meant for a kernel. For MX all but ``"msewide"`` are the same
two candidates."""


def _block_sse(xb: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """Squared error of each block in fp32, summed in a fixed order: ``e = x - deq`` (RN), ``sq = e * e`` (RN, no
    FMA), then a halving tree over the block: ``sq[i] += sq[i + n/2]`` for ``i < n/2``, repeated down to one value
    (the order of a shuffle-down / xor reduction; every addition is one RN fp32 add, so the result is bit-exact on
    any device)."""
    e = xb - deq
    sq = e * e
    n = sq.shape[-1]
    while n > 1:
        n //= 2
        sq = sq[..., :n] + sq[..., n:2 * n]
    return sq[..., 0]


def _nvfp4_dequant_blocks(xb: torch.Tensor, s_byte: torch.Tensor, gb: torch.Tensor):
    """Codes and dequantized values of blocks ``xb`` (..., nb, blk) with E4M3 scale bytes ``s_byte`` (..., nb)."""
    s_f = e4m3_decode(s_byte)
    inv = _safe_reciprocal(s_f * gb)
    codes = e2m1_encode(xb * inv.unsqueeze(-1))
    deq = (e2m1_decode(codes) * s_f.unsqueeze(-1)) * gb.unsqueeze(-1)
    return codes, deq


def _nvfp4_candidates(amax: torch.Tensor, gb: torch.Tensor, search: str) -> list[torch.Tensor]:
    """Candidate E4M3 scale bytes (each (..., nb) uint8), in tie-break order (the first is the default rule's)."""
    s0 = e4m3_encode(amax / (gb * E2M1_MAX))  # today's rule: RN of amax / (6 g)
    s46 = e4m3_encode(amax / (gb * 4.0))  # "4 over 6": the block max maps onto E2M1 4
    b = s0.to(torch.int16)
    # E4M3 bytes 0x00..0x7E are the non-negative finite values in increasing order (0x7F is NaN): the neighbours of
    # a byte are byte -+ 1, clamped to that range.
    nb = lambda k: (b + k).clamp(0, 0x7E).to(torch.uint8)  # noqa: E731
    if search == "mse":
        return [s0, s46, nb(-1), nb(1)]
    if search == "mse46":
        return [s0, s46]
    if search == "msenb":
        return [s0, nb(-1), nb(1)]
    if search == "mseup":
        return [s0, s46, nb(1)]
    if search == "msewide":
        return [s0, s46] + [nb(k) for k in range(-8, 9) if k]
    raise ValueError(f"scale_search: expected None or one of {SCALE_SEARCHES}, got {search!r}")


def _mx_candidates(amax: torch.Tensor, rule: str, search: str) -> list[torch.Tensor]:
    """Candidate MX exponents (int32 (..., nb)), in tie-break order: the format rule's exponent first, then the
    other one of {floor, floor + 1} (rceil is always one of these two)."""
    e_rule = _mx_exponent(amax, rule)
    e_f = _mx_exponent(amax, "floor")
    e_f1 = (e_f + 1).clamp(max=125)
    other = torch.where(e_rule == e_f, e_f1, e_f)
    if search in ("mse", "mse46", "msenb", "mseup"):
        return [e_rule, other]
    if search == "msewide":
        return [e_rule, other, (e_f - 1).clamp(min=-127), (e_f + 2).clamp(max=125)]
    raise ValueError(f"scale_search: expected None or one of {SCALE_SEARCHES}, got {search!r}")


def _pick(cands: list[torch.Tensor], sses: list[torch.Tensor]):
    """Sequential argmin: candidate c replaces the best so far only if its SSE is strictly smaller (ties keep the
    earlier candidate; NaN never wins)."""
    best, best_sse = cands[0], sses[0]
    for c, e in zip(cands[1:], sses[1:]):
        take = e < best_sse
        best = torch.where(take, c, best)
        best_sse = torch.where(take, e, best_sse)
    return best, best_sse


# --------------------------------------------------------------------------------------------------
# format quantization
# --------------------------------------------------------------------------------------------------
def _resolve_format(fmt) -> KVFormat:
    if isinstance(fmt, KVFormatPair) or isinstance(fmt, (tuple, list)):
        raise TypeError("fmt: expected one KVFormat or format name; quantize K and V separately (got a pair)")
    if isinstance(fmt, KVFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fmt: expected a format name or KVFormat, got {type(fmt).__name__}")
    try:
        return kv_format(fmt)
    except ValueError as err:
        raise ValueError(f"fmt: {err}") from None


def _global_scale(global_scale, fmt: KVFormat, lead: tuple, device, check: bool) -> torch.Tensor | None:
    """Validate ``global_scale`` and return it as fp32 on ``device`` (None -> 1.0 for nvfp4)."""
    if not fmt.has_global_scale:
        if global_scale is not None:
            raise ValueError(f"global_scale: format {fmt.name!r} has no global scale; pass None")
        return None
    if global_scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(global_scale, torch.Tensor):
        if not global_scale.is_floating_point():
            raise ValueError(f"global_scale: expected a floating-point tensor, got {global_scale.dtype}")
        if global_scale.device != device:
            raise ValueError(f"global_scale: expected device {device}, got {global_scale.device}")
        g = global_scale.float()
    elif isinstance(global_scale, Real) and not isinstance(global_scale, bool):
        g = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    else:
        raise ValueError(f"global_scale: expected a float or a tensor, got {type(global_scale).__name__}")
    try:
        ok = torch.broadcast_shapes(g.shape, lead) == torch.Size(lead)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"global_scale: shape {tuple(g.shape)} does not broadcast to the leading shape {tuple(lead)}")
    if check and g.numel() and not bool((torch.isfinite(g) & (g > 0)).all()):
        raise ValueError("global_scale: values must be finite and > 0 (in fp32)")
    return g


def quantize(x: torch.Tensor, fmt, global_scale=None, *, check: bool = True, scale_search: str | None = None):
    """Quantize rows ``x`` (..., head_dim) to format ``fmt``; returns ``(payload, scales)``.

    ``fmt`` is a format name or a :class:`KVFormat` (not a pair). ``amax`` below is ``max |x|`` over the
    scale block (block formats) or the row (fp8, int8); all arithmetic is fp32.

    * ``bf16``: ``payload = x.to(bfloat16)``, ``scales = None``.
    * ``fp8``: ``s = amax / 448``; ``inv = 1/s`` (0 unless ``s`` is a normal fp32);
      ``payload = e4m3_encode(x * inv)`` uint8 (..., D); ``scales = s`` fp32 (...).
    * ``int8``: ``s = amax / 127``; ``inv`` as above; ``payload = clamp(round_half_even(x * inv), -127, 127)``
      int8 (..., D); ``scales = s`` fp32 (...).
    * ``nvfp4`` (blocks of 16; ``global_scale`` g: None means 1.0, or a float, or a tensor broadcastable to
      ``x.shape[:-1]``, e.g. (num_kv_heads,) against (tokens, heads, D)): per block
      ``t = amax_b / (g * 6)``, ``s_byte = e4m3_encode(t)``, ``s_f = e4m3_decode(s_byte)``,
      ``inv = 1 / (s_f * g)`` (0 unless the divisor is a normal fp32), ``codes = e2m1_encode(x * inv)``;
      ``payload = pack_e2m1(codes)`` uint8 (..., D/2); ``scales = s_byte`` uint8 (..., D/16).
    * ``mxfp4`` / ``mxfp4_b16`` (blocks of 32 / 16): ``e = mx_shared_exponent(amax_b, fmt.scale_rule)``,
      ``codes = e2m1_encode(x * 2**-e)`` (an exact power-of-two scaling); payload packed uint8 (..., D/2),
      ``scales = e + 127`` uint8 (..., D/block).

    ``scale_search`` (FP4 formats only; None = the format's ``scale_search``, which is None, the plain rule above,
    unless the format was made with one) is an *encoder-side* block-scale search: the
    stored bytes keep their meaning and every decoder reads them unchanged. Per block, each candidate scale is
    applied exactly as above (``codes = e2m1_encode(x * inv)``), the block is dequantized exactly as
    :func:`dequantize` does (nvfp4 ``(e2m1 * s_f) * g``, MX ``e2m1 * 2**e``), its squared error is summed in fp32
    in a fixed order (``e = x - deq``; ``e * e``; halving tree ``sq[i] += sq[i + n/2]``, no FMA), and the
    candidate with the smallest SSE wins; ties (and NaN) keep the earlier candidate. ``"mse"`` (the proposed rule):

    * nvfp4, 4 candidates in this order: ``s0 = e4m3_encode(amax / (g * 6))`` (the plain rule),
      ``s46 = e4m3_encode(amax / (g * 4))`` (block max onto E2M1 4), then the E4M3 neighbours of ``s0``:
      byte ``s0 - 1`` and ``s0 + 1``, clamped to [0x00, 0x7E] (duplicates are harmless).
    * MX, 2 candidates: the format rule's exponent (``mx_shared_exponent(amax, fmt.scale_rule)``), then the other
      one of {floor, floor + 1} (floor + 1 clamped to 125).

    ``"msenb"``: the same without ``s46`` (nvfp4: ``s0``, ``s0 - 1``, ``s0 + 1``; MX: as ``"mse"``). On the accuracy
    harness ``"msenb"`` gives the best perplexity for nvfp4 and ``"mse"`` for MX (docs/accuracy.md, "Encoder-side
    scale search"). The chosen scale never has a larger block SSE than the plain rule's. ``"mse46"``,
    ``"mseup"`` and ``"msewide"`` are experimental candidate sets (see :data:`SCALE_SEARCHES`).

    With ``check=True`` the values of ``x`` (no NaN/Inf) and of ``global_scale`` (finite, > 0) are checked;
    ``check=False`` skips only these value scans (they synchronise a GPU). Type and shape checks always run.
    """
    fmt = _resolve_format(fmt)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected shape (..., head_dim), got a 0-d tensor")
    fmt.check_head_dim(x.shape[-1], "x.shape[-1]")
    lead, D = tuple(x.shape[:-1]), x.shape[-1]
    g = _global_scale(global_scale, fmt, lead, x.device, check)
    if check and x.numel() and not bool(torch.isfinite(x.float()).all()):  # what is quantized: x in fp32
        raise ValueError("x: contains NaN or Inf (in fp32)")

    if scale_search is None:  # the format's own (a cache written with a search: KVFormat.scale_search)
        scale_search = fmt.scale_search
    if scale_search is not None:
        if scale_search not in SCALE_SEARCHES:
            raise ValueError(f"scale_search: expected None or one of {SCALE_SEARCHES}, got {scale_search!r}")
        if fmt.payload != "e2m1":
            raise ValueError(f"scale_search: only FP4 formats take a scale search, not {fmt.name!r}")
    if fmt.payload == "bf16":
        return x.to(torch.bfloat16), None

    x32 = x.float()
    if fmt.scale_block is None:  # fp8 / int8: one fp32 scale per row
        amax = x32.abs().amax(-1)
        qmax = E4M3_MAX if fmt.payload == "e4m3" else float(INT8_MAX)
        s = _div_const(amax, qmax)
        y = x32 * _safe_reciprocal(s).unsqueeze(-1)
        if fmt.payload == "e4m3":
            return e4m3_encode(y), s
        return torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), s

    blk = fmt.scale_block
    xb = x32.reshape(*lead, D // blk, blk)
    amax = xb.abs().amax(-1)  # (..., nb)
    if fmt.scale_rule == "nvfp4":
        gb = g.expand(lead).unsqueeze(-1)  # (..., 1) against (..., nb)
        if scale_search is None:
            t = amax / (gb * E2M1_MAX)
            s_byte = e4m3_encode(t)
        else:
            cands = _nvfp4_candidates(amax, gb, scale_search)
            sses = [_block_sse(xb, _nvfp4_dequant_blocks(xb, c, gb)[1]) for c in cands]
            s_byte, _ = _pick(cands, sses)
        inv = _safe_reciprocal(e4m3_decode(s_byte) * gb)
        codes = e2m1_encode(xb * inv.unsqueeze(-1))
        scales = s_byte
    else:  # MX: power-of-two scale
        if scale_search is None:
            e = _mx_exponent(amax, fmt.scale_rule)
        else:
            cands = _mx_candidates(amax, fmt.scale_rule, scale_search)
            sses = []
            for c in cands:
                p2 = _pow2(c).unsqueeze(-1)
                sses.append(_block_sse(xb, e2m1_decode(e2m1_encode(xb * _pow2(-c).unsqueeze(-1))) * p2))
            e, _ = _pick(cands, sses)
        codes = e2m1_encode(xb * _pow2(-e).unsqueeze(-1))
        scales = (e + 127).to(torch.uint8)
    return pack_e2m1(codes.reshape(*lead, D)), scales


def dequantize(payload: torch.Tensor, scales, fmt, global_scale=None, dtype: torch.dtype = torch.float32):
    """Decode ``(payload, scales)`` of format ``fmt`` to (..., head_dim) values: exact fp32, then cast to ``dtype``.

    * ``nvfp4``: ``(e2m1 * s_f) * g``: the first product is exact, then one rounding by the global scale
      (kernels use the same order).
    * ``mxfp4``: ``e2m1 * 2**e`` (exact unless it overflows: the rceil rule can give inf for values within one
      E2M1 step of the fp32 maximum).
    * ``fp8``: ``e4m3 * s``; ``int8``: ``q * s``; ``bf16``: ``payload.to(dtype)``.
    """
    fmt = _resolve_format(fmt)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload: expected a torch.Tensor, got {type(payload).__name__}")
    if payload.dtype != fmt.data_dtype:
        raise TypeError(f"payload: format {fmt.name!r} stores {fmt.data_dtype}, got {payload.dtype}")
    if payload.dim() == 0:
        raise ValueError("payload: expected shape (..., row), got a 0-d tensor")
    lead = tuple(payload.shape[:-1])
    D = payload.shape[-1] * (2 if fmt.is_packed else 1)
    fmt.check_head_dim(D, "payload (head_dim)")
    g = _global_scale(global_scale, fmt, lead, payload.device, True)

    if fmt.scale_dtype is None:
        if scales is not None:
            raise ValueError(f"scales: format {fmt.name!r} has no scales; pass None")
        return payload.to(dtype)
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales: expected a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != fmt.scale_storage_dtype:
        raise TypeError(f"scales: format {fmt.name!r} stores {fmt.scale_storage_dtype} scales, got {scales.dtype}")
    want = lead if fmt.scale_block is None else lead + (D // fmt.scale_block,)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales: expected shape {want} for payload of shape {tuple(payload.shape)}, "
                         f"got {tuple(scales.shape)}")
    if scales.device != payload.device:
        raise ValueError(f"scales: expected device {payload.device}, got {scales.device}")

    if fmt.scale_block is None:
        q = e4m3_decode(payload) if fmt.payload == "e4m3" else payload.float()
        return (q * scales.unsqueeze(-1)).to(dtype)

    blk = fmt.scale_block
    vals = e2m1_decode(unpack_e2m1(payload)).reshape(*lead, D // blk, blk)
    if fmt.scale_rule == "nvfp4":
        out = (vals * e4m3_decode(scales).unsqueeze(-1)) * g.expand(lead)[..., None, None]
    else:
        out = vals * ue8m0_decode(scales).unsqueeze(-1)
    return out.reshape(*lead, D).to(dtype)


def fake_quantize(x: torch.Tensor, fmt, global_scale=None, *, dtype: torch.dtype = torch.float32,
                  scale_search: str | None = None) -> torch.Tensor:
    """``dequantize(*quantize(x, fmt, global_scale, scale_search=...), fmt, global_scale, dtype)``: what a kernel
    reading the cache sees, in fp32 by default."""
    payload, scales = quantize(x, fmt, global_scale, scale_search=scale_search)
    return dequantize(payload, scales, fmt, global_scale, dtype=dtype)
