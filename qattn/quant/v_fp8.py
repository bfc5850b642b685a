"""FP8 (E4M3) V for the FP8 P x V prefill: the format, its exact torch reference, and the GPU prepass launcher.

Format (dense): for V (B, Sk, Hkv, D) bf16/fp16,

* ``v_scale`` fp32 (B, Hkv, D): per (batch, kv head, channel), ``amax / 448`` with ``amax = max |v|`` over the
  sequence's ``Sk`` tokens, one correctly rounded fp32 division (``amax`` is exact: bf16/fp16 values widen
  exactly). ``inv = 1 / v_scale`` (RN) when ``v_scale`` is a normal fp32, else 0 (an all-zero channel encodes as 0).
* ``vt`` float8_e4m3fn (B, Hkv, D, Sk_pad), ``Sk_pad = ceil(Sk / 128) * 128`` (the attention kernel's tile_n;
  TMA needs 16-byte aligned rows and whole tiles): ``e4m3(v * inv)``, one RN fp32 product then RNE to E4M3,
  saturating at +-448 (``v * inv`` can exceed 448 by an ulp). Tokens are contiguous ("K-major" for wgmma), the
  padding tokens are 0, and inside every group of 32 tokens the order is permuted: stored position
  ``16h + 4t + 2a + c`` holds token ``16h + 8a + 2t + c`` (h, a, c in {0, 1}, t in 0..3; :func:`key_permutation`).
  That is the order in which a lane of the attention kernel finds its P values in the wgmma accumulator, so P
  goes into the 8-bit A fragment without moving bytes between lanes (``QKInt8PrefillSm90._store_p``).

Varlen (packed V (total_k, Hkv, D) with int32 ``cu_seqlens_k``, FlashAttention's layout; ``quantize_v_fp8_varlen``):
``v_scale`` (num_seqs, Hkv, D), each sequence's own channel amax; ``vt`` (Hkv, D, ``varlen_vt_keys(total_k,
num_seqs)``), sequence i's V^T (its dense ``vt`` of ``ceil(len_i / 128) * 128`` keys, zero padded, permuted the same
way) at key offset ``o_i = 32 * ceil(cu_seqlens_k[i] / 32) + 160 * i`` (:func:`varlen_vt_offsets`; ``VT_ALIGN``,
``VT_SEQ_GAP``). The offsets come from ``cu_seqlens_k`` alone, so the prepass and the attention kernel compute them
on the device (no host sync); they are 32-byte aligned (whole DRAM sectors: 16-byte alignment made the prepass
~13 % slower) and ``o_(i+1) - o_i >= len_i + 129`` keeps every padded region (and one whole tile for an empty
sequence) clear of the next one. Keys between the regions are not written and never read.

V = v_scale * e4m3_decode(vt) (un-permuted) approximates V with 3 mantissa bits per element, relative to its
channel's amax: per-channel scaling keeps channels with large values (V outlier channels) from drowning the rest.
"""

from __future__ import annotations

import functools

import torch

from ..cute_kernels.config_values import MAX_GRID_YZ
from .qk_int8 import _check_cu_seqlens
from .reference import E4M3_MAX, _div_const, _safe_reciprocal, e4m3_decode, e4m3_encode

__all__ = ["V_TILE", "VT_ALIGN", "VT_SEQ_GAP", "key_permutation", "quantize_v_fp8_reference", "dequantize_v_fp8_reference",
           "quantize_v_fp8", "varlen_vt_offset", "varlen_vt_offsets", "varlen_vt_keys", "quantize_v_fp8_varlen_reference",
           "quantize_v_fp8_varlen"]

V_TILE = 128
# varlen V^T: sequence b's region starts at its first key rounded up to VT_ALIGN keys (bytes), plus VT_SEQ_GAP * b
# (VT_SEQ_GAP >= VT_ALIGN + 127 keeps every region clear of the next one: module docstring). 32 = one DRAM sector:
# H100, 4 x 4096 keys, H16 D128, varlen V prepass 84.5-88.2 us aligned to 32 or 128 keys, 97.3-100.9 to 16.
VT_ALIGN = 32
VT_SEQ_GAP = VT_ALIGN + 128
_DTYPES = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (64, 128)


def key_permutation(device=None) -> torch.Tensor:
    """int64 (32,): ``perm[p]`` = the token (0..31) stored at position ``p`` of a group of 32."""
    p = torch.arange(32, device=device)
    h, t, a, c = p // 16, (p // 4) % 4, (p // 2) % 2, p % 2
    return 16 * h + 8 * a + 2 * t + c


def _padded(sk: int) -> int:
    return -(-sk // V_TILE) * V_TILE


def varlen_vt_offset(first_key, index):
    """The key offset of sequence ``index``'s region in a varlen ``vt`` (``first_key`` = its cu_seqlens_k entry);
    ``(total_k, num_seqs)`` gives the keys per row. The one formula of the layout: Python ints, torch tensors and
    CuTe-DSL integers alike (the V prepass and the attention kernel call it in device code)."""
    return (first_key + VT_ALIGN - 1) // VT_ALIGN * VT_ALIGN + VT_SEQ_GAP * index


def varlen_vt_offsets(cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """int64 (num_seqs,): the key offset of each sequence's region in a varlen ``vt`` (module docstring)."""
    cu = cu_seqlens_k[:-1].to(torch.int64)
    return varlen_vt_offset(cu, torch.arange(cu.shape[0], device=cu.device))


def varlen_vt_keys(total_k: int, num_seqs: int) -> int:
    """Keys per (kv head, channel) row of a varlen ``vt``: room for every sequence's region at its offset."""
    return varlen_vt_offset(total_k, num_seqs)


def _check_v(v) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v: expected a torch.Tensor, got {type(v).__name__}")
    if v.dtype not in _DTYPES:
        raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
    if v.dim() != 4:
        raise ValueError(f"v: expected shape (batch, seqlen_k, num_kv_heads, head_dim), got {tuple(v.shape)}")
    if v.shape[-1] not in _HEAD_DIMS:
        raise ValueError(f"v: head_dim must be one of {_HEAD_DIMS}, got {v.shape[-1]}")


def quantize_v_fp8_reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact reference of the V prepass (module docstring): returns ``(vt, v_scale)``, ``vt`` float8_e4m3fn
    (B, Hkv, D, Sk_pad) with tokens permuted within groups of 32, ``v_scale`` fp32 (B, Hkv, D). V must be finite
    (a ValueError here; the GPU prepass, which cannot check without a sync, gives undefined codes for NaN / Inf)."""
    _check_v(v)
    if v.numel() and not bool(torch.isfinite(v).all()):
        raise ValueError("v: contains NaN or Inf")
    B, Sk, H, D = v.shape
    x = v.float().permute(0, 2, 3, 1)  # B H D Sk, exact
    amax = x.abs().amax(dim=-1) if Sk else torch.zeros(B, H, D, device=v.device)
    scale = _div_const(amax, E4M3_MAX)
    inv = _safe_reciprocal(scale)
    codes = e4m3_encode(x * inv[..., None])
    sk_pad = _padded(Sk)
    vt = torch.zeros(B, H, D, sk_pad, dtype=torch.uint8, device=v.device)
    vt[..., :Sk] = codes
    vt = vt.view(B, H, D, sk_pad // 32, 32)[..., key_permutation(v.device)].reshape(B, H, D, sk_pad)
    return vt.view(torch.float8_e4m3fn), scale.contiguous()


def quantize_v_fp8_varlen_reference(v: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact reference of the varlen V prepass: ``(vt, v_scale)``, ``vt`` float8_e4m3fn (Hkv, D,
    ``varlen_vt_keys(total_k, num_seqs)``) holding each sequence's dense reference V^T at its offset (zeros
    between the regions), ``v_scale`` fp32 (num_seqs, Hkv, D)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 3:
        raise ValueError(f"v: expected a packed (total_k, num_kv_heads, head_dim) tensor, got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    _check_v(v.unsqueeze(0))
    total, H, D = v.shape
    cu = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total, total, "max_seqlen_k")  # int32, 0 .. total, sorted
    offsets = varlen_vt_offsets(cu_seqlens_k).tolist()
    vt = torch.zeros(H, D, varlen_vt_keys(total, len(cu) - 1), dtype=torch.uint8, device=v.device)
    scales = []
    for i, o in enumerate(offsets):
        t, s = quantize_v_fp8_reference(v[cu[i]:cu[i + 1]].unsqueeze(0))
        vt[:, :, o:o + t.shape[-1]] = t[0].view(torch.uint8)
        scales.append(s)
    scale = torch.cat(scales) if scales else torch.zeros(0, H, D, device=v.device)
    return vt.view(torch.float8_e4m3fn), scale


def dequantize_v_fp8_reference(vt: torch.Tensor, v_scale: torch.Tensor, seqlen_k: int, *,
                               scaled: bool = True) -> torch.Tensor:
    """(B, seqlen_k, Hkv, D) fp32 values of ``vt`` in token order: ``v_scale * e4m3`` (``scaled``) or the bare
    E4M3 values (what the tensor core multiplies)."""
    if not isinstance(vt, torch.Tensor) or vt.dim() != 4 or vt.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError("vt: expected the dense V prepass's V^T, float8_e4m3fn (batch, num_kv_heads, head_dim, "
                         "padded seqlen_k)")
    B, H, D, sk_pad = vt.shape
    if sk_pad % 32 or isinstance(seqlen_k, bool) or not isinstance(seqlen_k, int) or not 0 <= seqlen_k <= sk_pad:
        raise ValueError(f"seqlen_k: expected an int in [0, {sk_pad}] (vt's padded keys, a multiple of 32), got "
                         f"{seqlen_k!r}")
    if scaled and (not isinstance(v_scale, torch.Tensor) or tuple(v_scale.shape) != (B, H, D)):
        raise ValueError(f"v_scale: expected shape {(B, H, D)}, got "
                         f"{tuple(v_scale.shape) if isinstance(v_scale, torch.Tensor) else type(v_scale).__name__}")
    codes = vt.view(torch.uint8).reshape(B, H, D, sk_pad // 32, 32)
    inv_perm = torch.argsort(key_permutation(vt.device))
    codes = codes[..., inv_perm].reshape(B, H, D, sk_pad)[..., :seqlen_k]
    vals = e4m3_decode(codes.contiguous())
    if scaled:
        vals = vals * v_scale[..., None]
    return vals.permute(0, 3, 1, 2).contiguous()


# ------------------------------------------------------------------------------------------------
# GPU launcher
# ------------------------------------------------------------------------------------------------
def _alloc(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (tests may replace it with one that poisons the memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _v_kernels(arch: str, head_dim: int, in_bf16: bool, varlen: bool = False):
    """(rows_per_step of the amax kernel, amax launcher, transpose launcher), remembered per argument tuple like
    the Q/K prepass's kernel lookups (``qattn.quant.launch``)."""
    from ..cute_kernels.sm90 import v_fp8_quant as m
    from ..interface.fast_launch import fast

    acfg = m.VAmaxPartial(head_dim, in_bf16, varlen)
    return (acfg.rows_per_step, fast(m.compiled_amax(acfg, arch)),
            fast(m.compiled_transpose(m.VFp8TransposeQuant(head_dim, in_bf16, varlen), arch)))


def quantize_v_fp8(v: torch.Tensor, *, _pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The V prepass on the GPU (:mod:`qattn.cute_kernels.sm90.v_fp8_quant`, two or three launches on the
    current stream, no host sync): ``(vt, v_scale)`` equal to :func:`quantize_v_fp8_reference` byte for byte on
    finite V (NaN / Inf are not checked: no sync; their codes are undefined).

    ``v`` (B, Sk, Hkv, D) bf16/fp16, head_dim 64 or 128, last dimension contiguous (other strides are used as
    they are when 16-byte aligned, otherwise ``v`` is copied). ``_pdl`` (``flash_attn_func`` only): the kernel
    launched just before did not write ``v``, so the first launch may start while it ends."""
    if torch.compiler.is_compiling():  # traced as the custom op qattn::quantize_v_fp8
        from ..interface.torch_ops import quantize_v_fp8_traced

        return quantize_v_fp8_traced(v)
    _check_v(v)
    if not v.is_cuda:
        raise ValueError(f"v: expected a CUDA tensor, got device {v.device} (use quantize_v_fp8_reference on the CPU)")
    B, Sk, H, D = v.shape
    if max(B, H) > MAX_GRID_YZ:
        raise ValueError(f"v: at most {MAX_GRID_YZ} batches / kv heads (grid limit)")
    dev = v.device
    sk_pad = _padded(Sk)
    if B * H * D * sk_pad >= 2**31 or Sk >= 2**30:
        raise ValueError("v: too large for the prepass's 32-bit indexing; split the batch")
    vt = _alloc((B, H, D, sk_pad), torch.uint8, dev)
    scale = _alloc((B, H, D), torch.float32, dev)
    if B == 0 or H == 0:
        return vt.view(torch.float8_e4m3fn), scale
    if Sk == 0:
        scale.zero_()
        return vt.view(torch.float8_e4m3fn), scale
    _launch(v, None, B, Sk, B * H, vt, scale, sk_pad // V_TILE, sk_pad, _pdl)
    return vt.view(torch.float8_e4m3fn), scale


def quantize_v_fp8_varlen(v: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int, *,
                          _pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen V prepass on the GPU (same kernels, sequences from ``cu_seqlens_k`` on the device, no host
    sync): ``(vt, v_scale)`` in the varlen format of the module docstring, equal to
    :func:`quantize_v_fp8_varlen_reference` byte for byte inside every sequence's region (the keys between the
    regions are not written).

    ``v`` (total_k, Hkv, D) bf16/fp16, head_dim 64 or 128, last dimension contiguous; ``cu_seqlens_k`` int32
    (num_seqs + 1,) on v's device, non-decreasing from 0 to total_k, no sequence longer than ``max_seqlen_k``
    (not checked on the host: that would sync). ``_pdl`` as in :func:`quantize_v_fp8`."""
    from .launch import _check_cu, _check_max_seqlen, _varlen_rows

    if torch.compiler.is_compiling():  # traced as the custom op qattn::quantize_v_fp8_varlen
        from ..interface.torch_ops import quantize_v_fp8_varlen_traced

        return quantize_v_fp8_varlen_traced(v, cu_seqlens_k, max_seqlen_k)
    if not isinstance(v, torch.Tensor) or v.dim() != 3:
        raise ValueError(f"v: expected a packed (total_k, num_kv_heads, head_dim) tensor, got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    _check_v(v.unsqueeze(0))
    if not v.is_cuda:
        raise ValueError(f"v: expected a CUDA tensor, got device {v.device} (use quantize_v_fp8_varlen_reference "
                         "on the CPU)")
    _check_cu(cu_seqlens_k, "cu_seqlens_k", v.device)
    total, H, D = v.shape
    n = cu_seqlens_k.shape[0] - 1
    Sk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", total, n)
    if max(n, H) > MAX_GRID_YZ:
        raise ValueError(f"v: at most {MAX_GRID_YZ} sequences / kv heads (grid limit)")
    dev = v.device
    keys = varlen_vt_keys(total, n)
    if H * D * keys >= 2**31 or max(total, Sk) >= 2**30:
        raise ValueError("v: too large for the prepass's 32-bit indexing; split the batch")
    vt = _alloc((H, D, keys), torch.uint8, dev)
    scale = _alloc((n, H, D), torch.float32, dev)
    if n == 0 or H == 0:
        return vt.view(torch.float8_e4m3fn), scale
    _launch(v, cu_seqlens_k.contiguous(), n, Sk, _varlen_rows(n, total, Sk, H), vt, scale,
            max(-(-Sk // V_TILE), 1), keys, _pdl)
    return vt.view(torch.float8_e4m3fn), scale


def _launch(v: torch.Tensor, cu, batch: int, seqlen: int, rows: int, vt, scale, num_tiles: int, vt_keys: int,
            pdl: bool) -> None:
    """The launches of both entry points: channel amax per chunk, their fold, the V^T transpose. ``cu``:
    cu_seqlens_k (varlen, ``batch`` sequences of at most ``seqlen`` rows) or None (dense); ``rows``: the work in
    sequences x heads that sizes the chunks (``launch._k_chunks``)."""
    from ..interface.fast_launch import on_device, stream_handle
    from ..interface.variants import supported_arch
    from .launch import _fold_chunks, _k_chunks, _kernel_view, _num_sms, _strides

    dev, (H, D) = v.device, v.shape[-2:]
    v = _kernel_view(v)
    sb, ss, sh = _strides(v) if cu is None else (0, *_strides(v))  # varlen: one packed "batch"
    cu_addr = 0 if cu is None else cu.data_ptr()
    with on_device(dev):
        arch = supported_arch(dev)
        stream = stream_handle(dev)
        rows_per_step, amax_k, tq = _v_kernels(arch, D, v.dtype == torch.bfloat16, cu is not None)
        # two or more chunks are folded anyway: chunks down to 32 KB of rows (H200, B2 H16 D128: S3K / S4K V
        # prepass 0.91 / 0.92x the time, S8K and head_dim 64 unchanged)
        num_chunks, chunk_rows = _k_chunks(max(seqlen, 1), rows, rows_per_step, _num_sms(dev), D * 2, 1)
        partial = _alloc((batch, H, num_chunks, D), torch.float32, dev)
        amax_k(v.data_ptr(), cu_addr, partial.data_ptr(), batch, seqlen, H, num_chunks, chunk_rows, sb, ss, sh,
               int(pdl), stream)
        partial, num_chunks = _fold_chunks(partial, "max_f32", arch, stream)  # one amax per channel
        # pdl: after the kernel that wrote the partials (the fold, or the amax kernel for one chunk)
        tq(v.data_ptr(), cu_addr, partial.data_ptr(), vt.data_ptr(), scale.data_ptr(), batch, seqlen, H, num_chunks,
           num_tiles, vt_keys, sb, ss, sh, 1, stream)
