"""Peer implementations for A/B rows. A peer that is not installed is reported as skipped, never faked."""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F


def available(name: str) -> tuple[bool, str]:
    """(installed?, note). ``sdpa`` is torch itself; ``fa4`` is flash-attn-4; ``sage`` is sageattention."""
    module = {"sdpa": "torch", "fa4": "flash_attn.cute", "sage": "sageattention"}.get(name)
    if module is None:
        return False, f"unknown peer {name!r}"
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as e:  # ImportError, or a broken install
        return False, f"{name} not installed ({type(e).__name__})"


def fa4_paged_decode(q, k_pages, v_pages, page_table, seqused_k, causal=True) -> Callable[[], torch.Tensor]:
    """FlashAttention-4 bf16 paged decode: q (B, Sq, H, D); pages (num_pages, page_size, H_kv, D)."""
    from flash_attn.cute import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(q, k_pages, v_pages, page_table=page_table, seqused_k=seqused_k,
                                          causal=causal)[0]


def sdpa_dense(q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    """torch SDPA on dense bf16: q (B, Sq, H, D), k/v (B, Sk, H_kv, D); transposed views made once."""
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    # a square causal mask is FA's end-aligned mask only when Sq == Sk; decode (Sq == 1) needs none
    is_causal = causal and q.shape[1] == k.shape[1]
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal, enable_gqa=True).transpose(1, 2)


def fa4_dense(q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    from flash_attn.cute import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal)[0]


def sage_dense(q, k, v, causal: bool) -> Callable[[], torch.Tensor]:
    from sageattention import sageattn

    return lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal)
