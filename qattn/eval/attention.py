"""KV-quantized causal attention for the accuracy harness (full-sequence, teacher-forced, CPU).

A real cache quantizes each key/value row once, when it is written, and every later query reads the same
dequantized row. In one causal pass over a whole sequence that is exactly "fake-quantize K and V once, then
attend", except for the recent-token window: query ``i`` reads its newest ``W`` keys ``j > i - W`` (own token
included) unquantized and older keys ``j <= i - W`` (i.e. ``j < i + 1 - W``) from the quantized pages. That is a
per-(query, key) choice, done here exactly with a mask-combined attention: the keys are ``[K_quant ; K_full]``
(2S keys), query ``i`` may see quantized key ``j`` iff ``j <= i - W`` and full key ``j`` iff ``i - W < j <= i``.
One softmax over the union is the same as the cache's single softmax over its context.

The transforms (``qattn.quant.transforms``) are applied in the order the insert kernels will apply them:
post-RoPE ``k`` -> ``k - mean`` (smoothing) -> ``rotate`` -> quantize; ``v`` -> ``rotate`` -> quantize;
``q`` -> ``rotate``; output -> ``unrotate``. Window tokens go through the same transforms, only not quantized.

Attention sink (``^N``): the first N tokens of the sequence are read unquantized as well. This is exactly the
cache feature ``PagedKVCache(..., sink_tokens=N)``: query ``i`` reads a cache of ``i + 1`` tokens, whose sources
are ``qattn.layouts.paged.read_sources(i + 1, W, N)`` (positions < N from the sink buffer, positions
``>= max(N, i + 1 - W)`` from the ring, the rest from the pages); ``tests/reference/test_sink.py`` checks that
the harness equals token-by-token decoding from such a cache. Unquantized rows are kept in fp32 by default; the
spec suffix ``~bf16`` rounds them to bf16, as the cache's ring and sink buffers hold them (``dtype``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layouts.formats import KVFormat, kv_format
from ..quant.reference import E2M1_MAX, E4M3_MAX, SCALE_SEARCHES, fake_quantize
from ..quant.transforms import rotate, smooth_keys, unrotate

__all__ = [
    "KVQuantConfig",
    "LayerQuant",
    "parse_format",
    "parse_format_search",
    "GLOBAL_POLICIES",
    "format_label",
    "windowed_attention",
    "quantized_attention",
    "reference_attention",
    "nvfp4_global_scale",
]


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------
_FMT_RE = re.compile(r"^(bf16|fp8|int8|nvfp4|mxfp4|mxfp4_b16)(?::(floor|rceil))?(?::(" + "|".join(SCALE_SEARCHES)
                     + r"))?$")


def parse_format_search(spec: str | None) -> tuple[KVFormat | None, str | None]:
    """:func:`parse_format` plus the encoder's block-scale search (``quantize(..., scale_search=)``): an optional
    last field ``:mse`` (or another name of ``SCALE_SEARCHES``), FP4 formats only: ``"nvfp4:mse"``,
    ``"mxfp4:mse"`` (rceil first in the tie-break), ``"mxfp4:floor:mse"``."""
    if spec is None or spec == "none":
        return None, None
    m = _FMT_RE.match(spec)
    if not m:
        raise ValueError(f"unknown KV format spec {spec!r}")
    fmt = kv_format(m.group(1), scale_rule=m.group(2))
    if m.group(3) and fmt.payload != "e2m1":
        raise ValueError(f"KV format spec {spec!r}: only FP4 formats take a scale search")
    return fmt, m.group(3)


def parse_format(spec: str | None) -> KVFormat | None:
    """``"none"``/None (unquantized), ``"bf16"``, ``"fp8"``, ``"int8"``, ``"nvfp4"``, ``"mxfp4"``,
    ``"mxfp4_b16"``, with an optional MX scale rule: ``"mxfp4:rceil"``, ``"mxfp4_b16:floor"`` (and an optional
    scale search, see :func:`parse_format_search`, which this ignores)."""
    return parse_format_search(spec)[0]


def format_label(fmt: KVFormat | None, search: str | None = None) -> str:
    """Short label: ``none``, ``nvfp4``, ``mxfp4-floor-b32``, ``mxfp4-rceil-b16``, ``nvfp4-mse`` ..."""
    if fmt is None:
        return "none"
    if fmt.payload == "e2m1" and fmt.scale_rule in ("floor", "rceil"):
        lab = f"mxfp4-{fmt.scale_rule}-b{fmt.scale_block}"
    else:
        lab = fmt.name
    return lab + (f"-{search}" if search else "")


def _format_spec(fmt: KVFormat | None, search: str | None = None) -> str:
    if fmt is None:
        return "none"
    s = f"{fmt.name}:{fmt.scale_rule}" if fmt.scale_rule in ("floor", "rceil") else fmt.name
    return s + (f":{search}" if search else "")


GLOBAL_POLICIES_DOC = """NVFP4 global-scale policies (spec suffix ``%POLICY``; per (layer, kv head), over the calibration rows):

* ``max`` (default): ``g = amax / (6 * 448)``.
* ``pow2``: ``g`` rounded up to a power of two (``2**ceil(log2(amax / 2688))``): nothing saturates more than with
  ``max``, and ``s_f * g`` is an E4M3 value times a power of two.
* ``pNN`` (e.g. ``p99``, ``p99.9``): ``g = q / (6 * 448)`` with ``q`` the NN-th percentile of the per-block amax
  (blocks above ``q`` saturate their block scale at 448).
* ``sK`` (K in 0..7, a sensitivity probe): ``g = g_max * 2**(K / 8)``, i.e. the ``max`` policy shifted by a
  fraction of an octave (nothing saturates more); the spread of results over K measures how much the E4M3
  rounding of the block scales alone moves a config.
* ``srch``: ``g = g_max * 2**(k / 8)`` for the ``k`` in 0..7 with the smallest total squared error of the
  calibration rows encoded with the config's block rule (ties: the smallest ``k``).
"""
GLOBAL_POLICIES = ("max", "pow2", "srch", "pNN", "sK")


@dataclass(frozen=True)
class KVQuantConfig:
    """One evaluation setting. ``k``/``v`` are :func:`parse_format` specs (None = unquantized).

    ``smooth``: subtract the calibrated per-(layer, kv_head) key channel mean before quantizing K.
    ``rotate``: randomized Hadamard rotation (seed ``seed``) of q, k, v, output rotated back.
    ``window``: the newest ``window`` tokens of each query's context stay unquantized.
    ``sink``: the first ``sink`` tokens of the sequence stay unquantized (``PagedKVCache(sink_tokens=N)``; spec
    suffix ``^N``).
    ``unquantized_dtype``: ``"fp32"`` (default) or ``"bf16"`` (spec suffix ``~bf16``): the dtype of the window and
    sink rows; bf16 is what the cache's ring and sink buffers hold.
    """

    k: str | None = None
    v: str | None = None
    smooth: bool = False
    rotate: bool = False
    window: int = 0
    seed: int = 0
    sink: int = 0
    unquantized_dtype: str = "fp32"
    gscale: str = "max"

    def __post_init__(self) -> None:
        parse_format(self.k), parse_format(self.v)
        if self.window < 0 or self.sink < 0:
            raise ValueError("window must be >= 0")
        if not re.match(r"^(max|pow2|srch|s[0-7]|p\d+(\.\d+)?)$", self.gscale) or (
                self.gscale.startswith("p") and self.gscale != "pow2" and not 0 < float(self.gscale[1:]) <= 100):
            raise ValueError(f"gscale: expected max, pow2, srch, sK (K in 0..7) or pNN (0 < NN <= 100), got "
                             f"{self.gscale!r}")
        if self.unquantized_dtype not in ("fp32", "bf16"):
            raise ValueError(f"unquantized_dtype: expected 'fp32' or 'bf16', got {self.unquantized_dtype!r}")

    @property
    def k_format(self) -> KVFormat | None:
        return parse_format(self.k)

    @property
    def v_format(self) -> KVFormat | None:
        return parse_format(self.v)

    @property
    def k_search(self) -> str | None:
        return parse_format_search(self.k)[1]

    @property
    def v_search(self) -> str | None:
        return parse_format_search(self.v)[1]

    @property
    def quantized(self) -> bool:
        return self.k_format is not None or self.v_format is not None

    @property
    def formats_label(self) -> str:
        kl, vl = format_label(self.k_format, self.k_search), format_label(self.v_format, self.v_search)
        s = kl if kl == vl else f"{kl} K / {vl} V"
        return s + (f", g {self.gscale}" if self.gscale != "max" else "")

    @property
    def name(self) -> str:
        """The spec string :meth:`parse` takes back: ``K[/V][+s][+r][@W][^N][%G][~bf16]``."""
        ks, vs = _format_spec(self.k_format, self.k_search), _format_spec(self.v_format, self.v_search)
        s = ks if ks == vs else f"{ks}/{vs}"
        if self.smooth:
            s += "+s"
        if self.rotate:
            s += "+r"
        if self.window:
            s += f"@{self.window}"
        if self.sink:
            s += f"^{self.sink}"
        if self.gscale != "max":
            s += f"%{self.gscale}"
        if self.unquantized_dtype != "fp32":
            s += f"~{self.unquantized_dtype}"
        return s

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> "KVQuantConfig":
        """``"nvfp4"``, ``"int8/nvfp4+s+r@64"``, ``"mxfp4:rceil+r"``, ``"mxfp4_b16@32"``, ``"nvfp4^4"``,
        ``"nvfp4+r@64^1~bf16"``, ``"nvfp4:mse+r"`` (block-scale search), ``"nvfp4+r%pow2"`` (NVFP4 global-scale
        policy, see ``GLOBAL_POLICIES_DOC``), ``"none"``."""
        m = re.match(r"^([^+@^~%]+)((?:\+[sr])*)(?:@(\d+))?(?:\^(\d+))?(?:%([a-z0-9.]+))?(?:~(bf16|fp32))?$",
                     spec.strip())
        if not m:
            raise ValueError(f"bad config spec {spec!r}; expected K[/V][+s][+r][@W][^N][%G][~bf16]")
        fmts = m.group(1).split("/")
        if len(fmts) > 2:
            raise ValueError(f"bad config spec {spec!r}")
        k = fmts[0]
        v = fmts[1] if len(fmts) == 2 else fmts[0]
        flags = m.group(2)
        return cls(k=None if k == "none" else k, v=None if v == "none" else v, smooth="+s" in flags,
                   rotate="+r" in flags, window=int(m.group(3) or 0), seed=seed,
                   sink=int(m.group(4) or 0), gscale=m.group(5) or "max", unquantized_dtype=m.group(6) or "fp32")


@dataclass
class LayerQuant:
    """Everything one layer's attention needs: the config and the calibrated per-(layer, kv_head) tensors."""

    config: KVQuantConfig
    k_mean: torch.Tensor | None = None  # (Hkv, D) fp32, smoothing vector
    k_global: torch.Tensor | None = None  # (Hkv,) fp32 NVFP4 global scale of (transformed) keys
    v_global: torch.Tensor | None = None  # (Hkv,) fp32 NVFP4 global scale of (transformed) values


def nvfp4_global_scale(x: torch.Tensor, head_dim_axis: int = -1, head_axis: int = 0, policy: str = "max",
                       scale_search: str | None = None) -> torch.Tensor:
    """Per-kv-head NVFP4 global (decode) scale of calibration rows ``x``; default ``amax / (6 * 448)``.

    ``x`` is e.g. (Hkv, tokens, D) (``head_dim_axis`` must be the last); returns (Hkv,) fp32; an all-zero head
    gets 1.0. ``policy``: see ``GLOBAL_POLICIES_DOC`` (``scale_search`` is the block rule ``srch`` scores with).
    """
    xh = x.movedim(head_axis, 0).float()
    H = xh.shape[0]
    amax = xh.abs().reshape(H, -1).amax(-1)
    div = torch.tensor(E2M1_MAX * E4M3_MAX)
    g = amax / div
    if policy == "pow2":
        g = torch.exp2(torch.ceil(torch.log2(g)))
        g = torch.where(g * div < amax, g * 2, g)  # guard against log2 rounding
    elif policy.startswith("p") and policy != "pow2":
        bam = xh.abs().reshape(H, -1, 16).amax(-1)  # per-block (16) amax
        qv = torch.quantile(bam.double(), float(policy[1:]) / 100.0, dim=-1).float()
        g = torch.where(qv > 0, qv / div, g)
    elif len(policy) == 2 and policy[0] == "s" and policy[1] in "01234567":
        g = g * (2.0 ** (int(policy[1]) / 8))
    elif policy == "srch":
        rows = xh.reshape(H, -1, xh.shape[-1]).transpose(0, 1)  # (N, H, D)
        best_g, best_e = g.clone(), None
        for k in range(8):
            gk = g * (2.0 ** (k / 8))
            err = ((fake_quantize(rows, "nvfp4", torch.where(amax > 0, gk, torch.ones_like(gk)),
                                  scale_search=scale_search) - rows) ** 2).double().sum((0, 2))
            if best_e is None:
                best_e = err
            else:
                take = err < best_e
                best_g, best_e = torch.where(take, gk, best_g), torch.where(take, err, best_e)
        g = best_g
    elif policy != "max":
        raise ValueError(f"policy: unknown NVFP4 global-scale policy {policy!r}")
    return torch.where(amax > 0, g, torch.ones_like(g))


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal GQA attention. q (Hq, S, D), k/v (Hkv, S, D) -> (Hq, S, D)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                          enable_gqa=True)[0]


def window_masks(seq_len: int, window: int, device=None, sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (S, S) masks: ``full[i, j] = j <= i and (j > i - W or j < sink)`` (newest ``W`` tokens of query
    ``i``'s context, plus the first ``sink`` tokens of the sequence) and ``quant[i, j] = j <= i and not full``."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    full = (j <= i) & ((j > i - window) | (j < sink))
    quant = (j <= i) & ~full
    return quant, full


def windowed_attention(q: torch.Tensor, k_quant: torch.Tensor, v_quant: torch.Tensor, k_full: torch.Tensor,
                       v_full: torch.Tensor, window: int, scale: float, block: int = 256,
                       sink: int = 0) -> torch.Tensor:
    """Causal GQA attention where query ``i`` reads keys/values ``j <= i - window`` from ``k_quant``/``v_quant``
    and ``i - window < j <= i`` from ``k_full``/``v_full``. q (Hq, S, D), the rest (Hkv, S, D).
    ``sink > 0`` also keeps the first ``sink`` tokens unquantized (the cache's sink buffer).

    ``window == 0`` (and no sink): everything quantized (plain causal attention on the quantized rows);
    ``window >= S``: nothing quantized. Otherwise, per block of ``block`` queries ``[a, b)``, one SDPA over the
    quantized keys ``[0, b - W)`` and the full keys ``[0, sink) + [a - W + 1, b)`` concatenated, with the exact
    mask of :func:`window_masks` restricted to those keys (the blocks only skip keys the mask excludes anyway).
    """
    S = q.shape[1]
    if window == 0 and sink == 0:
        return reference_attention(q, k_quant, v_quant, scale)
    if window >= S:
        return reference_attention(q, k_full, v_full, scale)
    out = torch.empty_like(q)
    dev = q.device
    for a in range(0, S, block):
        b = min(a + block, S)
        nq = max(b - window, 0)  # quantized keys [0, nq)
        f0 = max(a - window + 1, 0)  # full keys [f0, b), plus sink keys [0, min(sink, f0))
        ns = min(sink, f0)
        i = torch.arange(a, b, device=dev)[:, None]
        jq = torch.arange(nq, device=dev)[None, :]
        jf = torch.cat((torch.arange(ns, device=dev), torch.arange(f0, b, device=dev)))[None, :]
        mq = (jq <= i - window) & (jq >= sink)
        mf = (jf <= i) & ((jf > i - window) | (jf < sink))
        mask = torch.cat((mq, mf), dim=1)
        kk = torch.cat((k_quant[:, :nq], k_full[:, :ns], k_full[:, f0:b]), dim=1)
        vv = torch.cat((v_quant[:, :nq], v_full[:, :ns], v_full[:, f0:b]), dim=1)
        out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], kk[None], vv[None], attn_mask=mask,
                                                     scale=scale, enable_gqa=True)[0]
    return out


def _fq(x: torch.Tensor, fmt: KVFormat | None, g: torch.Tensor | None, search: str | None = None) -> torch.Tensor:
    """Fake-quantize (Hkv, S, D) rows through the reference encoder (rows = token-head)."""
    if fmt is None:
        return x
    gs = g if fmt.has_global_scale else None
    y = fake_quantize(x.transpose(0, 1), fmt, gs, dtype=torch.float32, scale_search=search).transpose(0, 1)
    return y.to(x.dtype)


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lq: LayerQuant | None,
                        scale: float) -> torch.Tensor:
    """Attention of one layer with its KV cache held in ``lq.config``'s formats.

    q (Hq, S, D) and k, v (Hkv, S, D) are the layer's post-RoPE projections (fp32). Returns (Hq, S, D) in the
    original (unrotated) basis.
    """
    if lq is None or not lq.config.quantized:
        return reference_attention(q, k, v, scale)
    cfg = lq.config
    kf, vf = cfg.k_format, cfg.v_format
    if cfg.smooth:
        if lq.k_mean is None:
            raise ValueError("smoothing needs a calibrated k_mean")
        k = smooth_keys(k, lq.k_mean[:, None, :]).to(q.dtype)
    if cfg.rotate:
        q, k, v = (rotate(t, cfg.seed).to(t.dtype) for t in (q, k, v))
    kq = _fq(k, kf, lq.k_global, cfg.k_search)
    vq = _fq(v, vf, lq.v_global, cfg.v_search)
    if cfg.unquantized_dtype == "bf16":  # the window / sink rows as the cache's ring and sink hold them
        k, v = k.to(torch.bfloat16).to(q.dtype), v.to(torch.bfloat16).to(q.dtype)
    out = windowed_attention(q, kq, vq, k, v, cfg.window, scale, sink=cfg.sink)
    if cfg.rotate:
        out = unrotate(out, cfg.seed).to(q.dtype)
    return out
