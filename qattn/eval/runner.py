"""The accuracy harness: calibrate, run a grid of KV configurations, report perplexity and per-layer attention error.

Per configuration one teacher-forced causal pass over the whole text (one sequence). Metrics:

* ``ppl``: exp(mean NLL) of tokens 1..S-1; ``delta_pct``: relative to the ``bf16`` KV configuration.
* per layer, **local** error: the layer's attention output with the quantized cache vs the same layer's attention
  on the same (q, k, v) unquantized, in this run (isolates the layer's own quantization error);
  ``cos`` = cosine similarity of the flattened (Hq, S, D) outputs, ``nrmse`` = ||o - o_ref|| / ||o_ref||.
* per layer, **drift**: this run's attention output vs the unquantized run's at the same layer (accumulated error).

Calibration (per (layer, kv_head); from the unquantized run, on the keys/values *after* the config's transforms):
the K-smoothing mean and the NVFP4 global scales ``amax / (6 * 448)``. ``calib_tokens = N`` uses the first N
tokens of the text (causal: a deployment would calibrate on the prefill, or offline on other text); ``0`` uses
the whole text (peeks at the future: slightly optimistic for NVFP4, whose later blocks above the calibrated amax
saturate).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..quant.transforms import key_channel_mean, rotate, smooth_keys
from .attention import KVQuantConfig, LayerQuant, nvfp4_global_scale, quantized_attention, reference_attention
from .model import forward

__all__ = ["Calibration", "ConfigResult", "calibrate", "layer_quants", "evaluate_config", "run_grid", "GRIDS",
           "grid_configs", "markdown_table"]


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Per layer post-RoPE keys and values of the calibration tokens, (Hkv, N, D) fp32, from the unquantized run."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    tokens: int
    policy: str


def calibrate(kv: list[tuple[torch.Tensor, torch.Tensor]], calib_tokens: int) -> Calibration:
    """Keep the calibration rows: the first ``calib_tokens`` positions (``0`` = all)."""
    n = kv[0][0].shape[1] if calib_tokens <= 0 else min(calib_tokens, kv[0][0].shape[1])
    policy = "whole text" if calib_tokens <= 0 else f"first {n} tokens"
    return Calibration([k[:, :n].clone() for k, _ in kv], [v[:, :n].clone() for _, v in kv], n, policy)


def layer_quants(cfg: KVQuantConfig, cal: Calibration | None) -> list[LayerQuant] | None:
    """The per-layer calibrated state of ``cfg`` (None when nothing is quantized)."""
    if not cfg.quantized:
        return None
    if cal is None:
        raise ValueError("a quantized configuration needs a calibration")
    out = []
    kf, vf = cfg.k_format, cfg.v_format
    for kc, vc in zip(cal.k, cal.v):
        lq = LayerQuant(cfg)
        kt = kc
        if cfg.smooth:
            lq.k_mean = key_channel_mean(kc, token_dim=1)  # (Hkv, D)
            kt = smooth_keys(kt, lq.k_mean[:, None, :])
        vt = vc
        if cfg.rotate:
            kt, vt = rotate(kt, cfg.seed), rotate(vt, cfg.seed)
        if kf is not None and kf.has_global_scale:
            lq.k_global = nvfp4_global_scale(kt, policy=cfg.gscale, scale_search=cfg.k_search)
        if vf is not None and vf.has_global_scale:
            lq.v_global = nvfp4_global_scale(vt, policy=cfg.gscale, scale_search=cfg.v_search)
        out.append(lq)
    return out


# --------------------------------------------------------------------------------------------------
# one configuration
# --------------------------------------------------------------------------------------------------
def _cos_nrmse(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.flatten(), b.flatten()
    ab = float((a * b).sum(dtype=torch.float64))
    aa = float((a * a).sum(dtype=torch.float64))
    bb = float((b * b).sum(dtype=torch.float64))
    d = a - b
    dd = float((d * d).sum(dtype=torch.float64))
    cos = ab / max(math.sqrt(aa * bb), 1e-300)
    nrmse = math.sqrt(dd) / max(math.sqrt(bb), 1e-300)
    return cos, nrmse


@dataclass
class ConfigResult:
    name: str
    formats: str
    smooth: bool
    rotate: bool
    window: int
    ppl: float
    nll: float
    seconds: float
    delta_pct: float | None = None
    local_cos: list[float] = field(default_factory=list)
    local_nrmse: list[float] = field(default_factory=list)
    drift_cos: list[float] = field(default_factory=list)
    drift_nrmse: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        d = {"cos_mean": None, "cos_min": None, "cos_min_layer": None, "nrmse_mean": None, "nrmse_max": None,
             "drift_cos_last": None}
        if self.local_cos:
            cmin = min(self.local_cos)
            d.update(cos_mean=sum(self.local_cos) / len(self.local_cos), cos_min=cmin,
                     cos_min_layer=self.local_cos.index(cmin),
                     nrmse_mean=sum(self.local_nrmse) / len(self.local_nrmse), nrmse_max=max(self.local_nrmse))
        if self.drift_cos:
            d["drift_cos_last"] = self.drift_cos[-1]
        return d


def evaluate_config(model, ids: torch.Tensor, cfg: KVQuantConfig, cal: Calibration | None,
                    baseline_attn: list[torch.Tensor] | None = None) -> ConfigResult:
    """One teacher-forced pass with ``cfg``; per-layer local error and (given the unquantized run's attention
    outputs) drift."""
    lqs = layer_quants(cfg, cal)
    res = ConfigResult(cfg.name, cfg.formats_label, cfg.smooth, cfg.rotate, cfg.window, 0.0, 0.0, 0.0)

    def attn_fn(li, q, k, v, scale):
        if lqs is None:
            o = reference_attention(q, k, v, scale)
            res.local_cos.append(1.0)
            res.local_nrmse.append(0.0)
        else:
            o = quantized_attention(q, k, v, lqs[li], scale)
            c, n = _cos_nrmse(o, reference_attention(q, k, v, scale))
            res.local_cos.append(c)
            res.local_nrmse.append(n)
        if baseline_attn is not None:
            c, n = _cos_nrmse(o, baseline_attn[li])
            res.drift_cos.append(c)
            res.drift_nrmse.append(n)
        return o

    t0 = time.perf_counter()
    fr = forward(model, ids, attn_fn)
    res.seconds = time.perf_counter() - t0
    res.nll = float(fr.nll.mean())
    res.ppl = math.exp(res.nll)
    return res


# --------------------------------------------------------------------------------------------------
# grids
# --------------------------------------------------------------------------------------------------
_FOUR_BIT = ["nvfp4", "mxfp4:floor", "mxfp4:rceil", "mxfp4_b16:floor", "mxfp4_b16:rceil"]
_MIXED = ["int8/nvfp4", "fp8/nvfp4", "int8/mxfp4:floor"]
_EIGHT = ["fp8", "int8"]
_TRANSFORMS = ["", "+s", "+r", "+s+r"]


def _grid_full() -> list[str]:
    """The grid of docs/accuracy.md (51 configs; the full cross product, ~160, does not fit 20 CPU minutes).

    * every 4-bit format (nvfp4, mxfp4 floor/rceil x block 32/16) x every transform combination (none, smoothing,
      rotation, both), W = 0;
    * 8-bit (fp8, int8) without and with both transforms; mixed pairs without transforms, rotated, and both;
    * the window sweep W = 32/64/128 for nvfp4 and mxfp4 (floor, block 32), without and with both transforms;
      W = 64 for the other MX variants (both transforms) and for int8 K / nvfp4 V.
    """
    g = ["none", "bf16"]
    g += [f + t for f in _EIGHT for t in ("", "+s+r")]
    g += [f + t for f in _FOUR_BIT for t in _TRANSFORMS]
    g += [f + t for f in _MIXED for t in ("", "+r", "+s+r")]
    g += [f + t + f"@{w}" for f in ("nvfp4", "mxfp4:floor") for t in ("", "+s+r") for w in (32, 64, 128)]
    g += ["mxfp4:rceil+s+r@64", "mxfp4_b16:floor+s+r@64", "int8/nvfp4@64", "int8/nvfp4+s+r@64"]
    return g


def _grid_cross() -> list[str]:
    """The whole cross product (formats and pairs x transforms x W in 0/32/64/128): ~160 configs, ~1 CPU hour."""
    g = ["none", "bf16"]
    g += [f + t + (f"@{w}" if w else "") for f in _EIGHT + _FOUR_BIT + _MIXED for t in _TRANSFORMS
          for w in (0, 32, 64, 128)]
    return g


def _grid_extra() -> list[str]:
    """Things tried beyond the main grid: attention-sink tokens kept unquantized, windows on rotated mixed pairs."""
    return ["none", "bf16", "nvfp4^1", "nvfp4+r^1", "nvfp4+s+r^1", "nvfp4+s+r^4", "nvfp4@64^1", "nvfp4+r@64^1",
            "nvfp4+s+r@64^1", "nvfp4+r@64", "nvfp4+s@64", "nvfp4@128^1", "nvfp4@256", "mxfp4:floor+r@64^1",
            "int8/nvfp4@32", "int8/nvfp4+r@64", "fp8/nvfp4+r@64"]


def _grid_sink() -> list[str]:
    """The attention-sink cache (``PagedKVCache(sink_tokens=N)``): the shipped 4-bit configurations with one sink
    token, their windows without the sink, and the recommended ones with bf16 window / sink rows (``~bf16``: what
    the cache holds)."""
    return ["none", "bf16", "nvfp4+r@64^1", "nvfp4+r@128^1", "nvfp4@64^1", "nvfp4@128^1", "nvfp4+r@32^1",
            "nvfp4+r@64^4", "mxfp4:floor+r@64^1", "mxfp4:rceil+r@64^1", "int8/nvfp4+r@64^1", "nvfp4+r@64",
            "nvfp4@128", "nvfp4+r@64^1~bf16", "nvfp4+r@128^1~bf16", "mxfp4:rceil+r@64^1~bf16"]


def _grid_quick() -> list[str]:
    return ["none", "bf16", "int8", "nvfp4", "nvfp4+s+r", "mxfp4:floor+s+r", "nvfp4@64", "int8/nvfp4+s+r"]


GRIDS = {"full": _grid_full, "quick": _grid_quick, "cross": _grid_cross, "extra": _grid_extra, "sink": _grid_sink}


def grid_configs(name: str, seed: int = 0) -> list[KVQuantConfig]:
    return [KVQuantConfig.parse(s, seed=seed) for s in GRIDS[name]()]


# --------------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------------
def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def markdown_table(results: list[ConfigResult]) -> str:
    head = ("| config | K / V formats | smooth | rotate | W | ppl | Δ vs bf16 | attn cos mean | attn cos min (layer) "
            "| attn NRMSE mean / max | drift cos, last layer |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in results:
        s = r.summary()
        cmin = "–" if s["cos_min"] is None else f"{s['cos_min']:.5f} ({s['cos_min_layer']})"
        rows.append(
            f"| `{r.name}` | {r.formats} | {'yes' if r.smooth else ''} | {'yes' if r.rotate else ''} | {r.window} "
            f"| {r.ppl:.3f} | {_f(r.delta_pct, '+.2f')}% | {_f(s['cos_mean'], '.5f')} | {cmin} "
            f"| {_f(s['nrmse_mean'], '.4f')} / {_f(s['nrmse_max'], '.4f')} | {_f(s['drift_cos_last'], '.5f')} |")
    return head + "\n".join(rows) + "\n"


def run_grid(model, ids: torch.Tensor, configs: list[KVQuantConfig], *, calib_tokens: int = 512,
             log=print, meta: dict | None = None) -> dict:
    """Baseline pass (unquantized, keeps k/v for calibration and attention outputs for drift), then every config.
    Returns a JSON-able dict with ``meta`` and ``results``."""
    t_start = time.perf_counter()
    base = forward(model, ids, keep_attn=True, keep_kv=True)
    cal = calibrate(base.kv, calib_tokens)
    base_attn = base.attn_out
    base.kv.clear()
    log(f"baseline (unquantized fp32 KV): ppl {base.ppl:.4f} over {ids.numel() - 1} predicted tokens "
        f"({time.perf_counter() - t_start:.1f} s); calibration: {cal.policy}")
    results: list[ConfigResult] = []
    bf16_nll = None
    for i, cfg in enumerate(configs):
        r = evaluate_config(model, ids, cfg, cal, base_attn)
        if cfg.name == "bf16":
            bf16_nll = r.nll
        results.append(r)
        done = time.perf_counter() - t_start
        avg = sum(x.seconds for x in results) / len(results)
        eta = avg * (len(configs) - i - 1)
        s = r.summary()
        log(f"[{i + 1:3d}/{len(configs)}] {cfg.name:28s} ppl {r.ppl:8.4f}  cos_mean {_f(s['cos_mean'], '.5f')}  "
            f"nrmse_max {_f(s['nrmse_max'], '.4f')}  {r.seconds:5.1f}s  elapsed {done / 60:5.1f} min  "
            f"eta {eta / 60:5.1f} min")
    ref_nll = bf16_nll if bf16_nll is not None else float(base.nll.mean())
    for r in results:
        r.delta_pct = 100.0 * (math.exp(r.nll - ref_nll) - 1.0)
    import transformers  # noqa: F401  (version only)

    out = {
        "meta": {
            "tokens": int(ids.numel()),
            "predicted_tokens": int(ids.numel() - 1),
            "baseline_fp32_ppl": base.ppl,
            "delta_reference": "bf16" if bf16_nll is not None else "unquantized fp32",
            "calibration": cal.policy,
            "seconds": time.perf_counter() - t_start,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            **(meta or {}),
        },
        "results": [dict(asdict(r), summary=r.summary()) for r in results],
    }
    return out


def results_markdown(out: dict) -> str:
    results = [ConfigResult(**{k: v for k, v in d.items() if k != "summary"}) for d in out["results"]]
    m = out["meta"]
    lines = [f"Model: {m.get('model', '?')}; {m['tokens']} tokens ({m['predicted_tokens']} predicted) of "
             f"`{m.get('text', '?')}`; unquantized fp32 KV ppl {m['baseline_fp32_ppl']:.4f}; Δ vs "
             f"{m['delta_reference']} KV; calibration: {m['calibration']}; {m['seconds'] / 60:.1f} min on "
             f"{m['threads']} CPU threads.", "", markdown_table(results)]
    return "\n".join(lines)


def dump(out: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
