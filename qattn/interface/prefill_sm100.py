"""SM100 launcher of the INT8-QK prefill (``flash_attn_func`` / ``prefill_int8`` on compute capability 10.0,
reached through ``prefill.py``'s arch dispatch). NEVER RAN ON HARDWARE: no Blackwell GPU was available; the
kernel is compile-checked for sm_100a and emulated on the CPU (``qattn.cute_kernels.sm100.emulate_prefill``).

The caller's tensors were validated by ``prefill.py`` already (shapes, dtypes, the prepass's scale shapes,
which are the same on SM90 and SM100); this adds the SM100 kernel's own limits and launches it from the shared
``"prefill"`` compile cache with arch ``"sm_100a"``. What the SM100 kernel does not do raises here, never
falls back to another path: FP8 P.V, the unquantized 16-bit Q K^T path, tuning overrides. Soft-capping
(``softcap``), sliding windows and varlen (packed sequences, ``prefill_int8_sm100(cu_seqlens=...)``) are compile-time
variants of the kernel, as on SM90.
"""

from __future__ import annotations

from typing import Optional

import torch

from .variants import Variant, cache_for
from .window import score_scale

__all__ = ["ARCH", "sm100_prefill_config_for", "check_sm100_prefill_options", "prefill_int8_sm100",
           "sm100_prefill_variants"]

ARCH = "sm_100a"
_V_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_sm100_prefill_options(*, varlen: bool = False, pv_dtype: str = "bf16", qk_quant: Optional[str] = "int8",
                                tuning: Optional[dict] = None) -> None:
    """Raise for what the SM100 prefill kernel does not implement (before any launch, prepass included). Dense
    and varlen (``varlen``, only named in the messages) have the same limits."""
    what = "flash_attn_varlen_func / prefill_int8_varlen" if varlen else "flash_attn_func / prefill_int8"
    if pv_dtype != "bf16":
        raise NotImplementedError(f"pv_dtype: {pv_dtype!r} P.V is not implemented on SM100 yet ({what}); the SM100 "
                                  "prefill runs P.V in V's 16-bit dtype (pv_dtype='bf16')")
    if qk_quant != "int8":
        raise NotImplementedError(f"qk_quant: {qk_quant!r} (the unquantized 16-bit A/B path) is not implemented on "
                                  "SM100; the SM100 prefill kernel takes qk_quant='int8' only")
    if tuning:
        raise ValueError(f"_tuning: {sorted(tuning)} are SM90 kernel knobs; the SM100 prefill kernel has none")


def sm100_prefill_config_for(head_dim: int, v_dtype: torch.dtype, causal: bool, granularity: str,
                             local: bool = False, softcap: float = 0.0, varlen: bool = False):
    """The :class:`PrefillConfigSm100` that ``prefill_int8`` (``varlen``: ``prefill_int8_varlen``) uses on SM100
    for these arguments (``causal`` / ``local``: the flags of the call's ``qattn.interface.window.Window``;
    ``softcap``: the compile-time cap)."""
    from ..cute_kernels.sm100.prefill_config import PrefillConfigSm100

    if v_dtype not in _V_DTYPES:
        raise TypeError(f"v: expected torch.bfloat16 or torch.float16, got {v_dtype}")
    return PrefillConfigSm100(head_dim=head_dim, v_dtype=_V_DTYPES[v_dtype], causal=bool(causal),
                              granularity=granularity, local=bool(local), softcap=softcap, varlen=bool(varlen))


def _build(cfg):
    from ..cute_kernels.compile_utils import compile_for_arch
    from ..cute_kernels.sm100.prefill_int8 import QKInt8PrefillSm100, prefill_sm100_compile_args

    return compile_for_arch(QKInt8PrefillSm100(cfg), *prefill_sm100_compile_args(), arch=ARCH, keep_ptx=False)[0]


def _kernel(cfg):
    """The compiled kernel from the shared ``"prefill"`` cache (key = arch + config key, like SM90's)."""
    from ..cute_kernels.sm100.prefill_int8 import prefill_sm100_cache_key

    return cache_for("prefill").get(prefill_sm100_cache_key(ARCH, cfg), lambda: _build(cfg))


def _launch(cfg, args: tuple, device: torch.device) -> None:
    """Launch on torch's current stream of ``device`` (``args``: the kernel's arguments before the stream)."""
    from .fast_launch import fast, on_device, stream_handle

    kern = _kernel(cfg)
    with on_device(device):
        fast(kern)(*args, stream_handle(device))


def prefill_int8_sm100(q_int8: torch.Tensor, q_scale: torch.Tensor, k_int8: torch.Tensor, k_scale: torch.Tensor,
                       v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, window, softmax_scale: float,
                       granularity: str, softcap: float = 0.0, k_mean: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[tuple] = None) -> None:
    """Run the SM100 kernel on validated, contiguous, 16-byte aligned tensors (``prefill.prefill_int8``'s):
    q_int8 (B, Sq, Hq, D), k_int8 / v (B, Sk, Hkv, D), q_scale (B, Hq, groups), k_scale (B, Hkv, k blocks);
    writes out (B, Sq, Hq, D) and lse (B, Hq, Sq). ``window``: the call's ``qattn.interface.window.Window``
    (causal mask and sliding window). ``softcap > 0``: the soft-capped variant. ``k_mean`` (B, Hkv, D) fp32,
    contiguous, is K's smoothing mean, which every variant puts back per row (q . k_mean): into the scores before
    the cap, else into the returned LSE (that of the unsmoothed K, as FlashAttention's); None: an unsmoothed K, no
    shift (address 0).

    ``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q): packed sequences (``prefill.prefill_int8_varlen``'s
    tensors): q_int8 (total_q, Hq, D), k_int8 / v (total_k, Hkv, D), int32 cu_seqlens (num_seqs + 1,) on the
    device (read by the kernel only: no host sync), scales and k_mean with num_seqs rows, padded per sequence; out
    (total_q, Hq, D), lse (Hq, total_q); ``window`` resolved with the longest lengths, as SM90's."""
    if cu_seqlens is None:
        batch, Sq, Hq, D = q_int8.shape
        Sk, Hkv = k_int8.shape[1], k_int8.shape[2]
        cu = (0, 0, Sq)  # no cu_seqlens: dense
    else:  # the kernel's batch is the number of sequences, its lengths the packed totals
        (Sq, Hq, D), (Sk, Hkv) = q_int8.shape, k_int8.shape[:2]
        cu_q, cu_k, max_seqlen_q = cu_seqlens
        batch = cu_q.shape[0] - 1
        cu = (cu_q.data_ptr(), cu_k.data_ptr(), int(max_seqlen_q))
    if max(out.numel(), v.numel(), q_int8.numel(), k_int8.numel()) >= 2**31:
        raise ValueError("q_int8: too large for the SM100 kernel's 32-bit indexing; split the batch")
    cfg = sm100_prefill_config_for(D, v.dtype, window.causal, granularity, window.local, softcap,
                                   varlen=cu_seqlens is not None)
    # capped, the kernel's scale gives z / softcap (its tanh argument) instead of z * log2 e (as on SM90). K's mean
    # (0: none) goes to every variant, with q_int8's address (its rows give the shift q . k_mean)
    args = (q_int8.data_ptr(), k_int8.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), q_scale.data_ptr(),
            k_scale.data_ptr(), batch, Sq, Sk, Hq, Hkv, q_scale.shape[2], k_scale.shape[2],
            score_scale(softmax_scale, softcap), *window.edges,
            0 if k_mean is None else k_mean.data_ptr(), *cu)
    _launch(cfg, args, q_int8.device)


def sm100_prefill_variants(arch: str, head_dims=None, q_dtypes=None, sliding_window: bool = False,
                           softcaps=None) -> list:
    """``qattn-warmup`` variants of the SM100 prefill kernel: head_dim x V dtype x causal x q-scale granularity
    x (dense, varlen) (INT8 Q K^T, P.V in V's dtype; ``sliding_window``: each one's window twin; ``softcaps``: each
    one's twin per positive cap), with the launcher's own keys. Never ran on hardware: these variants are compiled for
    images, not tested on a GPU."""
    from ..cute_kernels.sm100.prefill_config import HEAD_DIMS
    from ..cute_kernels.sm100.prefill_int8 import prefill_sm100_cache_key

    if arch != ARCH:
        return []
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16}
    out, seen = [], set()
    for d in [x for x in (head_dims or HEAD_DIMS) if x in HEAD_DIMS]:
        for name in q_dtypes or ["bf16", "fp16"]:
            if name not in dts or (d, dts[name]) in seen:
                continue
            seen.add((d, dts[name]))
            for causal in (False, True):
                for gran in ("per_warp", "per_block"):
                    for varlen in (False, True):
                        for local in (False, True) if sliding_window else (False,):
                            for cap in [0.0] + [float(c) for c in softcaps or () if c]:
                                cfg = sm100_prefill_config_for(d, dts[name], causal, gran, local, cap, varlen)
                                label = (f"D{d} {cfg.v_dtype} {'causal' if causal else 'full'} {gran}"
                                         f"{' varlen' if varlen else ''}{' window' if local else ''}"
                                         f"{f' softcap {cap:g}' if cap else ''} (sm100, never ran)")
                                out.append(Variant("prefill", prefill_sm100_cache_key(arch, cfg), label,
                                                   lambda cfg=cfg: _build(cfg)))
    return out
