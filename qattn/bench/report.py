"""Benchmark output: a terminal table, JSON, a markdown page and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

COLUMNS = [  # (key, header, format)
    ("config", "config", "{}"), ("impl", "impl", "{}"), ("kv_format", "KV", "{}"), ("scope", "scope", "{}"),
    ("median_us", "median µs", "{:.1f}"), ("spread", "spread", "{:.0%}"), ("gbs", "GB/s", "{:.0f}"),
    ("pct_copy", "% copy", "{:.0%}"), ("tflops", "TFLOP/s", "{:.0f}"), ("speedup", "speedup", "{:.2f}x"),
    ("max_abs", "max abs", "{:.1e}"), ("nrmse", "NRMSE", "{:.1e}"), ("cosine", "cosine", "{:.5f}"),
    ("kv_bytes_per_token", "KV B/tok", "{}"), ("note", "note", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _used(rows: list[dict]) -> list[tuple[str, str, str]]:
    return [c for c in COLUMNS if any(r.get(c[0]) not in (None, "") for r in rows)]


def table(rows: list[dict]) -> str:
    cols = _used(rows)
    cells = [[h for _, h, _ in cols]] + [[_cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def markdown(rows: list[dict], meta: dict) -> str:
    cols = _used(rows)
    head = [f"# qattn {meta.get('bench', '')} benchmark — {meta.get('device', '?')}", ""]
    for k in ("command", "date", "copy_gbs", "bf16_gemm_tflops", "torch", "cutlass_dsl", "notes"):
        if meta.get(k) is not None:
            head.append(f"- {k}: {meta[k]}")
    head += ["", "| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    body = ["| " + " | ".join(_cell(r, k, f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(head + body) + "\n"


def write_json(path: str | Path, rows: list[dict], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def plot(path: str | Path, rows: list[dict], meta: dict) -> None:
    """Speedup over the baseline per config, one bar group per implementation/format (small PNG). When rows
    were timed both ways, the CUDA-graph rows are plotted (how engines run decode steps)."""
    import matplotlib

    if any(r.get("scope") == "graph" for r in rows):
        rows = [r for r in rows if r.get("scope") == "graph"]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows if r.get("speedup") is not None))
    series = list(dict.fromkeys(f"{r['impl']} {r.get('kv_format') or ''}".strip() for r in rows
                                if r.get("speedup") is not None))
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(configs) + 2), 3), dpi=80)
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        ys = [next((r["speedup"] for r in rows if r["config"] == c and r.get("speedup") is not None
                    and f"{r['impl']} {r.get('kv_format') or ''}".strip() == s), 0.0) for c in configs]
        ax.bar([j + i * width for j in range(len(configs))], ys, width, label=s)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], configs, fontsize=7, rotation=15)
    scope = rows[0].get("scope", "") if rows else ""
    ax.set_ylabel(f"speedup vs {meta.get('baseline', 'baseline')} ({scope})")
    ax.set_title(f"qattn {meta.get('bench', '')} — {meta.get('device', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
