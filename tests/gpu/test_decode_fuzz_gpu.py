"""Randomized sweep of ``qattn.flash_attn_with_kvcache`` on the GPU (paged decode).

``test_decode_gpu.py`` runs a fixed matrix (GQA 1/4/8/16, seqlen_q 1/4/16, pages 16/64/128); here each seeded
case draws its own: format (and K/V pairs), head_dim, kv heads 1-4, any GQA ratio whose rows fit the kernel
(3, 5, 6, 7, 12 included), seqlen_q 1-16 (speculative decoding), page size 16-256, lengths from 1 token to
several thousand (partial last pages), split count (off, fixed, more than tiles, automatic), recent window and
attention sinks, causal or not, bf16 / fp16 q and cache. Same oracle and poisoning as ``test_decode_gpu.py``:
``paged_decode_reference`` (fp64) over the same quantized cache, pools poisoned before the write, the output
poisoned before the call.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from .test_decode_gpu import _check, _poison_sink_pages, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORMATS = ["bf16", "nvfp4", "mxfp4", "mxfp4_b16", "fp8", "int8", ("int8", "nvfp4"), ("nvfp4", "bf16"),
           ("fp8", "mxfp4")]
# QATTN_FUZZ_CASES / QATTN_FUZZ_SEED: more cases, or a fresh draw (any other base), for a re-run on shapes
# nobody has seen; the default draw is the one CI-era runs used
NUM_CASES = int(os.environ.get("QATTN_FUZZ_CASES", 40))
SEED_BASE = int(os.environ.get("QATTN_FUZZ_SEED", 5000))


def _draw(i: int) -> dict:
    r = random.Random(SEED_BASE + i)
    sq = r.choice([1, 1, 2, 3, 5, 8, 16])
    gqa = r.choice([g for g in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16) if g * sq <= 256])
    page = r.choice([16, 32, 64, 128, 256])
    ring = r.random() < 0.3
    sink = r.choice([0, 0, 0, 1, 4])
    batch = r.randint(1, 4)
    lens = [r.choice([1, r.randint(1, page + 3), r.randint(1, 700), r.randint(700, 6000)]) for _ in range(batch)]
    cache_dtype = r.choice([torch.bfloat16, torch.float16])
    return dict(fmt=r.choice(FORMATS), D=r.choice([64, 128]), hkv=r.randint(1, 4), gqa=gqa, sq=sq, page=page,
                window=r.choice([64, 128]) if ring else 0, sink=sink, lens=lens,
                splits=r.choice([1, 2, 5, 40, 0, 0]), causal=r.random() < 0.7, cache_dtype=cache_dtype,
                q_dtype=cache_dtype, seed=i + SEED_BASE - 5000)


CASES = [_draw(i) for i in range(NUM_CASES)]


def _case_id(c: dict) -> str:
    f = c["fmt"] if isinstance(c["fmt"], str) else "+".join(c["fmt"])
    return (f"{f}-D{c['D']}-h{c['hkv']}x{c['gqa']}-q{c['sq']}-p{c['page']}-w{c['window']}-s{c['sink']}"
            f"-n{c['splits']}-{'causal' if c['causal'] else 'full'}-{str(c['cache_dtype'])[6:]}-L{max(c['lens'])}")


@pytest.mark.parametrize("c", CASES, ids=_case_id)
def test_random_decode_call_matches_reference(c):
    from qattn import flash_attn_with_kvcache
    from qattn.reference import paged_decode_reference

    case = make_case(c["fmt"], c["D"], c["gqa"], c["sq"], c["page"], c["lens"], num_kv_heads=c["hkv"],
                     q_dtype=c["q_dtype"], seed=c["seed"], window=c["window"], cache_dtype=c["cache_dtype"],
                     sink=c["sink"])
    cache, q, seqlens, table = case[:4]
    seq_slots = case[4] if (c["window"] or c["sink"]) else None
    if c["sink"]:
        _poison_sink_pages(cache, table.cpu(), c["lens"])
    q0 = q.clone()
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, cache, seqlens, table, seq_slots=seq_slots, causal=c["causal"],
                                       num_splits=c["splits"], return_lse=True, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(q, q0)
    ref_out, ref_lse = paged_decode_reference(q, cache, seqlens, table, causal=c["causal"], seq_slots=seq_slots,
                                              return_lse=True)
    _check(got, lse, ref_out, ref_lse)
