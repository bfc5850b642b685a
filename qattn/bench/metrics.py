"""What a benchmark row counts: bytes moved, FLOPs, and errors against an fp64 reference.

Bytes are the fewest a kernel must move through device memory (each input read once, each output written
once), so "% of copy bandwidth" says how close a kernel is to the memory floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts.formats import FormatSpec, kv_formats


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    seqlen: int  # context length per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    seqlen_q: int = 1

    @property
    def label(self) -> str:
        return (f"B{self.batch}x{_k(self.seqlen)} GQA{self.num_heads}/{self.num_kv_heads} D{self.head_dim} "
                f"p{self.page_size}" + (f" q{self.seqlen_q}" if self.seqlen_q > 1 else ""))


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    seqlen: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        return (f"B{self.batch} S{_k(self.seqlen)} H{self.num_heads}/{self.num_kv_heads} D{self.head_dim}"
                + (" causal" if self.causal else ""))


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def decode_bytes(shape: DecodeShape, kv_format: FormatSpec, act_bytes: int = 2) -> int:
    """Bytes a paged decode step must move: the cache's K and V (payload + scales) of every sequence's
    tokens, q read once, out written once, the block table and lengths (int32)."""
    kf, vf = kv_formats(kv_format)
    tokens = shape.batch * shape.seqlen
    kv = tokens * shape.num_kv_heads * (kf.bytes_per_token_head(shape.head_dim)
                                        + vf.bytes_per_token_head(shape.head_dim))
    qo = 2 * shape.batch * shape.seqlen_q * shape.num_heads * shape.head_dim * act_bytes
    table = shape.batch * (-(-shape.seqlen // shape.page_size) + 1) * 4
    return kv + qo + table


def insert_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, kv_format: FormatSpec,
                 act_bytes: int = 2) -> int:
    """Bytes an insert must move: K and V read in the activation dtype, payload + scales written, slots read."""
    kf, vf = kv_formats(kv_format)
    rows = num_tokens * num_kv_heads
    read = 2 * rows * head_dim * act_bytes + num_tokens * 8
    written = rows * (kf.bytes_per_token_head(head_dim) + vf.bytes_per_token_head(head_dim))
    return read + written


def attention_flops(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool = False) -> float:
    """4·B·H·Sq·Sk·D (QK^T and PV), halved for a causal square problem (FlashAttention's convention)."""
    f = 4.0 * batch * num_heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


@dataclass(frozen=True)
class Errors:
    max_abs: float
    nrmse: float  # ||out - ref|| / ||ref||
    cosine: float

    def as_dict(self) -> dict:
        return {"max_abs": self.max_abs, "nrmse": self.nrmse, "cosine": self.cosine}


def errors(out: torch.Tensor, ref: torch.Tensor) -> Errors:
    """Errors of ``out`` against an fp64 reference; NaN anywhere in ``out`` gives NaN metrics (never a pass)."""
    o, r = out.detach().double().flatten().cpu(), ref.detach().double().flatten().cpu()
    if o.shape != r.shape:
        raise ValueError(f"out: shape {tuple(out.shape)} does not match the reference {tuple(ref.shape)}")
    if not bool(torch.isfinite(o).all()):
        nan = float("nan")
        return Errors(nan, nan, nan)
    d = o - r
    rn = float(r.norm())
    cos = float(torch.dot(o, r) / (o.norm() * r.norm())) if rn > 0 and float(o.norm()) > 0 else float("nan")
    return Errors(float(d.abs().max()) if d.numel() else 0.0, float(d.norm()) / rn if rn > 0 else float("nan"), cos)
