"""Row-wise FP4 kernels: dequantize packed NVFP4 / MXFP4 rows to fp32 (and quantize rows to FP4).

These are small, self-contained kernels: they check the device FP4 helpers (``common/fp4.py``) bit for bit
against the reference codec on a GPU, and they dequantize or fill KV-cache rows outside the attention kernels.

Data, per row of ``head_dim`` = D values (formats in ``qattn.layouts.formats``):
    payload       (N, D/2)      uint8, element 2i in the low nibble of byte i
    scales        (N, D/block)  uint8, E4M3FN (nvfp4) or UE8M0 (mxfp4, mxfp4_b16) bits
    global_scale  (N,)          fp32, nvfp4 only: x = (e2m1 * e4m3) * g
    out           (N, D)        fp32

Work split: one thread decodes 16 payload bytes (32 values: one 16-byte load, eight 16-byte stores) when D is
a multiple of 32, else 8 bytes (16 values); ``D / values_per_thread`` threads share a row and a CTA of about 128
threads covers ``rows_per_cta`` rows; the grid is ``ceil(N / rows_per_cta)`` CTAs.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32

from qattn.cute_kernels.common import fp4
from qattn.interface.variants import Variant, cache_for, register
from qattn.layouts.formats import KVFormat, kv_format

__all__ = ["Fp4DequantRows", "Fp4QuantizeRows", "dequantize_rows", "quantize_rows", "FP4_FORMATS"]

FP4_FORMATS = ("nvfp4", "mxfp4", "mxfp4_b16")
_THREADS = 128


def _fp4_format(fmt, scale_rule: Optional[str] = None) -> KVFormat:
    f = kv_format(fmt, scale_rule=scale_rule) if isinstance(fmt, (str, KVFormat)) else None
    if not isinstance(f, KVFormat) or f.payload != "e2m1":
        raise ValueError(f"fmt: expected an FP4 format {FP4_FORMATS}, got {fmt!r}")
    return f


class _RowsConfig:
    """Constexpr work split shared by both kernels."""

    def __init__(self, fmt, head_dim: int, scale_rule: Optional[str] = None):
        f = _fp4_format(fmt, scale_rule)
        f.check_head_dim(head_dim)
        self.fmt = f
        self.head_dim = head_dim
        self.block = f.scale_block
        self.is_nvfp4 = f.scale_dtype == "e4m3"
        self.words = 4 if head_dim % 32 == 0 else 2  # 32-bit payload words per thread (16 or 8 bytes)
        self.elems = 8 * self.words  # values per thread
        self.row_words = head_dim // 8
        self.threads_per_row = head_dim // self.elems
        self.rows_per_cta = max(1, _THREADS // self.threads_per_row)
        self.threads = self.rows_per_cta * self.threads_per_row
        self.scales_per_thread = self.elems // self.block  # 1 or 2 (block divides elems by construction)
        self.scales_per_row = head_dim // self.block
        assert self.elems % self.block == 0


# ==================================================================================================
# Dequantize
# ==================================================================================================
class Fp4DequantRows(_RowsConfig):
    """Packed FP4 rows -> fp32 rows.

    ``Fp4DequantRows("nvfp4", 128)`` makes a kernel for one (format, head_dim); ``__call__`` is the host-side
    ``@cute.jit`` entry point taking raw global-memory pointers (payload and out 16-byte aligned, so the
    kernel can use 128-bit accesses) and the row count.
    """

    @cute.jit
    def __call__(
        self,
        payload: cute.Pointer,  # Uint32 view of the (N, D/2) uint8 payload, 16-byte aligned
        scales: cute.Pointer,  # Uint8 (N, D/block)
        global_scale: cute.Pointer,  # Float32 (N,); ignored (any pointer) for MX formats
        out: cute.Pointer,  # Float32 (N, D), 16-byte aligned
        num_rows: Int32,
        stream: cuda.CUstream,  # annotated: AOT export (the compile cache) needs every type
    ):
        W, G, S = self.words, self.threads_per_row, self.scales_per_thread
        # Per-thread views: mode 0 is what one thread touches (contiguous), mode 1 the thread in its row,
        # mode 2 the row. Strides are static multiples of the vector width, so the slices stay aligned.
        mP = cute.make_tensor(payload, cute.make_layout((W, G, num_rows), stride=(1, W, self.row_words)))
        mS = cute.make_tensor(scales, cute.make_layout((S, G, num_rows), stride=(1, S, self.scales_per_row)))
        mG = cute.make_tensor(global_scale, cute.make_layout((num_rows,)))
        mO = cute.make_tensor(out, cute.make_layout((self.elems, G, num_rows), stride=(1, self.elems, self.head_dim)))
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mP, mS, mG, mO, num_rows).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mP: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor, mO: cute.Tensor, num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        part = tidx % self.threads_per_row
        if row < num_rows:
            # 16-byte (or 8-byte) payload load, one instruction.
            rP = cute.make_rmem_tensor((self.words,), Uint32)
            load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * self.words)
            cute.copy(load, mP[None, part, row], rP)
            rS = cute.make_rmem_tensor((self.scales_per_thread,), Uint8)
            cute.autovec_copy(mS[None, part, row], rS)

            rO = cute.make_rmem_tensor((self.elems,), Float32)
            if cutlass.const_expr(self.is_nvfp4):
                g = mG[row]
                for j in cutlass.range_constexpr(self.words):
                    # word j holds values 8j..8j+7, all in scale block (8j) // 16 of this thread
                    s2 = fp4.e4m3_to_f16x2(Uint32(rS[(8 * j) // self.block]), 0)
                    halves = fp4.e2m1x8_to_f16x8(rP[j])
                    for h in cutlass.range_constexpr(4):
                        lo, hi = fp4.f16x2_to_f32x2(fp4.f16x2_mul(halves[h], s2))  # exact product
                        rO[8 * j + 2 * h] = lo * g  # one rounding, by the global scale
                        rO[8 * j + 2 * h + 1] = hi * g
            else:
                for j in cutlass.range_constexpr(self.words):
                    s = fp4.ue8m0_to_f32(Uint32(rS[(8 * j) // self.block]))
                    halves = fp4.e2m1x8_to_f16x8(rP[j])
                    for h in cutlass.range_constexpr(4):
                        lo, hi = fp4.f16x2_to_f32x2(halves[h])
                        rO[8 * j + 2 * h] = lo * s  # power of two: exact unless it overflows to inf
                        rO[8 * j + 2 * h + 1] = hi * s
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            cute.copy(store, rO, mO[None, part, row])


# ==================================================================================================
# Quantize
# ==================================================================================================
class Fp4QuantizeRows(_RowsConfig):
    """fp32 rows -> packed FP4 payload + block scales, bit-exact with ``qattn.quant.reference.quantize``.

    nvfp4 (per-row fp32 global scale g, default 1.0): den = g*6; t = amax/den; s = e4m3_rne_satfinite(t);
        s_f = decode(s); inv = s_f*g >= 2^-126 ? 1/(s_f*g) : 0 (IEEE RN division); code = e2m1_rne_sat(x * inv)
    mxfp4 / mxfp4_b16 ("floor" or "rceil" exponent rule): byte = e + 127 from integer ops on amax's bits;
        code = e2m1_rne_sat(x * 2^-e)
    """

    @cute.jit
    def __call__(
        self,
        x: cute.Pointer,  # Float32 (N, D), 16-byte aligned
        global_scale: cute.Pointer,  # Float32 (N,); ignored for MX formats
        payload: cute.Pointer,  # Uint32 view of the (N, D/2) uint8 payload, 16-byte aligned
        scales: cute.Pointer,  # Uint8 (N, D/block)
        num_rows: Int32,
        stream: cuda.CUstream,  # annotated: AOT export (the compile cache) needs every type
    ):
        W, G, S = self.words, self.threads_per_row, self.scales_per_thread
        mX = cute.make_tensor(x, cute.make_layout((self.elems, G, num_rows), stride=(1, self.elems, self.head_dim)))
        mG = cute.make_tensor(global_scale, cute.make_layout((num_rows,)))
        mP = cute.make_tensor(payload, cute.make_layout((W, G, num_rows), stride=(1, W, self.row_words)))
        mS = cute.make_tensor(scales, cute.make_layout((S, G, num_rows), stride=(1, S, self.scales_per_row)))
        grid_x = (num_rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(mX, mG, mP, mS, num_rows).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mG: cute.Tensor, mP: cute.Tensor, mS: cute.Tensor, num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.rows_per_cta + tidx // self.threads_per_row
        part = tidx % self.threads_per_row
        if row < num_rows:
            rX = cute.make_rmem_tensor((self.elems,), Float32)
            load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            cute.copy(load, mX[None, part, row], rX)
            rP = cute.make_rmem_tensor((self.words,), Uint32)
            rS = cute.make_rmem_tensor((self.scales_per_thread,), Uint8)
            g = Float32(1.0)
            if cutlass.const_expr(self.is_nvfp4):
                g = mG[row]
            for b in cutlass.range_constexpr(self.scales_per_thread):
                # amax of the block: fmax ignores NaN (as torch.amax does not; NaN input is out of contract)
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(self.block):
                    amax = cute.arch.fmax(amax, abs(rX[b * self.block + i]))
                sbyte, mul = fp4.fp4_block_scale(amax, g, self.is_nvfp4, self.fmt.scale_rule == "rceil")
                rS[b] = Uint8(sbyte)
                for wj in cutlass.range_constexpr(self.block // 8):
                    base = b * self.block + 8 * wj
                    c = [fp4.f32_to_e2m1(rX[base + k] * mul) for k in range(8)]
                    rP[base // 8] = fp4.pack_e2m1x8(*c)
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * self.words)
            cute.copy(store, rP, mP[None, part, row])
            cute.autovec_copy(rS, mS[None, part, row])


# ==================================================================================================
# torch launchers
# ==================================================================================================
def _torch():
    import torch

    return torch


def _check_cuda_tensor(t, name: str, dtype, shape: tuple):
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _aligned(t, align: int = 16):
    """Contiguous, and its data pointer a multiple of ``align`` (a fresh allocation is 256-byte aligned)."""
    t = t.contiguous()
    if t.data_ptr() % align:
        t = t.clone()
    return t


def _ptr(dtype, t, align: int):
    return cute.runtime.make_ptr(dtype, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(_torch().cuda.current_stream().cuda_stream)


def _key(kind: str, cfg: _RowsConfig, arch: str) -> tuple:
    return (kind, arch, cfg.fmt.key, cfg.head_dim)


def _compiled(kind: str, cfg: _RowsConfig, arch: str, ptrs: tuple, stream):
    """The compiled kernel from the in-memory / on-disk compile cache (compiled on first use)."""
    from qattn.cute_kernels.compile_utils import compile_for_arch

    def build():
        return compile_for_arch(cfg, *ptrs, Int32(1), stream, arch=arch, keep_ptx=False)[0]

    return cache_for(f"fp4_{kind}").get(_key(kind, cfg, arch), build)


def _fake_ptrs(dtypes_aligns):
    return tuple(cute.runtime.make_ptr(d, 0, cute.AddressSpace.gmem, assumed_align=a) for d, a in dtypes_aligns)


def make_dequant_compile_args(fmt, head_dim: int):
    """(kernel object, args) to compile ``Fp4DequantRows`` without a GPU (fake pointers, fake stream)."""
    cfg = Fp4DequantRows(fmt, head_dim)
    args = _fake_ptrs([(Uint32, 16), (Uint8, 4), (Float32, 4), (Float32, 16)]) + (
        Int32(1), cute.runtime.make_fake_stream())
    return cfg, args


def make_quantize_compile_args(fmt, head_dim: int, scale_rule: Optional[str] = None):
    """(kernel object, args) to compile ``Fp4QuantizeRows`` without a GPU."""
    cfg = Fp4QuantizeRows(fmt, head_dim, scale_rule)
    args = _fake_ptrs([(Float32, 16), (Float32, 4), (Uint32, 16), (Uint8, 4)]) + (
        Int32(1), cute.runtime.make_fake_stream())
    return cfg, args


def _global_scale_rows(global_scale, f: KVFormat, n: int, device):
    """(N,) fp32 CUDA tensor of per-row global scales for nvfp4 (None means 1.0, as in the reference;
    a float, a 0-d or a broadcastable tensor is expanded); ``None`` for MX formats."""
    torch = _torch()
    if not f.has_global_scale:
        if global_scale is not None:
            raise ValueError(f"global_scale: format {f.name!r} has no global scale; pass None")
        return None
    if global_scale is None:
        global_scale = 1.0
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float, torch.Tensor)):
        raise TypeError(f"global_scale: expected a float or a torch.Tensor, got {type(global_scale).__name__}")
    if not isinstance(global_scale, torch.Tensor):
        global_scale = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"global_scale: expected dtype torch.float32, got {global_scale.dtype}")
    if not global_scale.is_cuda:
        raise ValueError(f"global_scale: expected a CUDA tensor, got device {global_scale.device}")
    if global_scale.device != device:
        raise ValueError(f"global_scale: on {global_scale.device}, the data on {device}")
    try:
        global_scale = global_scale.expand(n)
    except RuntimeError:
        raise ValueError(f"global_scale: expected shape ({n},) or one that broadcasts to it, "
                         f"got {tuple(global_scale.shape)}") from None
    return _aligned(global_scale, 4)


def _check_index_range(n: int, head_dim: int, name: str) -> None:
    # the kernels index elements with 32-bit integers
    if n * head_dim >= 2**31:
        raise ValueError(f"{name}: {n} rows of {head_dim} values exceed the kernels' 32-bit indexing; split the call")


def _check_out(t, name: str, dtype, shape: tuple, device, align: int):
    _check_cuda_tensor(t, name, dtype, shape)
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, the input on {device}")
    if not t.is_contiguous() or t.data_ptr() % align:
        raise ValueError(f"{name}: must be contiguous with a {align}-byte aligned data pointer")


def dequantize_rows(payload, scales, fmt, global_scale=None, out=None):
    """Dequantize FP4 rows on the GPU: ``payload`` (N, D/2) uint8, ``scales`` (N, D/block) uint8 and, for
    nvfp4, ``global_scale`` (N,) fp32 (None means 1.0; a float or a broadcastable tensor is expanded).
    Returns (N, D) fp32, written into ``out`` when given (contiguous, 16-byte aligned).

    Matches ``qattn.quant.reference.dequantize`` bit for bit. Compiles once per (format, D, arch) (the persistent
    compile cache, ``qattn.interface.compile_cache``) and launches on torch's current stream.
    """
    torch = _torch()
    f = _fp4_format(fmt)
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload: expected a torch.Tensor, got {type(payload).__name__}")
    if payload.dim() != 2:
        raise ValueError(f"payload: expected shape (N, head_dim/2), got {tuple(payload.shape)}")
    n, half = payload.shape
    head_dim = 2 * half
    f.check_head_dim(head_dim, "payload.shape[1] * 2")
    _check_cuda_tensor(payload, "payload", torch.uint8, (n, half))
    _check_cuda_tensor(scales, "scales", torch.uint8, (n, head_dim // f.scale_block))
    if scales.device != payload.device:
        raise ValueError(f"scales: on {scales.device}, payload on {payload.device}")
    _check_index_range(n, head_dim, "payload")
    g = _global_scale_rows(global_scale, f, n, payload.device)

    if out is None:
        out = torch.empty((n, head_dim), dtype=torch.float32, device=payload.device)
    else:
        _check_out(out, "out", torch.float32, (n, head_dim), payload.device, 16)
    if n == 0:
        return out
    from qattn.cute_kernels.compile_utils import device_arch

    with torch.cuda.device(payload.device):
        payload, scales = _aligned(payload, 16), _aligned(scales, 4)
        g = g if g is not None else out  # MX: an unused pointer
        stream = _stream()
        ptrs = (_ptr(Uint32, payload, 16), _ptr(Uint8, scales, 4), _ptr(Float32, g, 4), _ptr(Float32, out, 16))
        fn = _compiled("dequant", Fp4DequantRows(f, head_dim), device_arch(payload.device), ptrs, stream)
        fn(*ptrs, Int32(n), stream)
    return out


def quantize_rows(x, fmt, global_scale=None, scale_rule: Optional[str] = None, out=None):
    """Quantize rows to FP4 on the GPU: ``x`` (N, D) fp32 or bf16 (bf16 is widened exactly). Returns
    ``(payload (N, D/2) uint8, scales (N, D/block) uint8)``, equal byte for byte to
    ``qattn.quant.reference.quantize`` for finite ``x``. nvfp4 takes ``global_scale`` as the reference does
    (None means 1.0; a float or an (N,)-broadcastable fp32 tensor); ``scale_rule`` picks "floor" (the
    format's default) or "rceil" for MX formats. Values are not scanned for NaN/Inf (that would synchronise).
    ``out=(payload, scales)`` writes into given tensors (contiguous; payload 16-byte aligned).
    """
    torch = _torch()
    f = _fp4_format(fmt, scale_rule)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x: expected dtype float32 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected shape (N, head_dim), got {tuple(x.shape)}")
    if not x.is_cuda:
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device}")
    n, head_dim = x.shape
    f.check_head_dim(head_dim, "x.shape[1]")
    _check_index_range(n, head_dim, "x")
    g = _global_scale_rows(global_scale, f, n, x.device)

    if out is None:
        payload = torch.empty((n, head_dim // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((n, head_dim // f.scale_block), dtype=torch.uint8, device=x.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a (payload, scales) pair of tensors")
        payload, scales = out
        _check_out(payload, "out[0] (payload)", torch.uint8, (n, head_dim // 2), x.device, 16)
        _check_out(scales, "out[1] (scales)", torch.uint8, (n, head_dim // f.scale_block), x.device, 4)
    if n == 0:
        return payload, scales
    from qattn.cute_kernels.compile_utils import device_arch

    with torch.cuda.device(x.device):
        xf = _aligned(x.float(), 16)
        g = g if g is not None else xf
        stream = _stream()
        ptrs = (_ptr(Float32, xf, 16), _ptr(Float32, g, 4), _ptr(Uint32, payload, 16), _ptr(Uint8, scales, 4))
        fn = _compiled("quant", Fp4QuantizeRows(f, head_dim), device_arch(x.device), ptrs, stream)
        fn(*ptrs, Int32(n), stream)
    return payload, scales


# ==================================================================================================
# variants for qattn-warmup
# ==================================================================================================
def _head_dims(head_dims):
    return head_dims or [64, 128, 256]


@register("fp4_dequant")
def _dequant_variants(arch: str, kv_formats=None, head_dims=None, **_):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    out = []
    for name in [f for f in (kv_formats or FP4_FORMATS) if f in FP4_FORMATS]:
        for d in _head_dims(head_dims):
            cfg, args = make_dequant_compile_args(name, d)
            build = (lambda cfg=cfg, args=args: compile_for_arch(cfg, *args, arch=arch, keep_ptx=False)[0])
            out.append(Variant("fp4_dequant", _key("dequant", cfg, arch), f"{name} D{d}", build))
    return out


@register("fp4_quantize")
def _quantize_variants(arch: str, kv_formats=None, head_dims=None, **_):
    from qattn.cute_kernels.compile_utils import compile_for_arch

    out = []
    for name in [f for f in (kv_formats or FP4_FORMATS) if f in FP4_FORMATS]:
        for rule in (None,) if name == "nvfp4" else ("floor", "rceil"):
            for d in _head_dims(head_dims):
                cfg, args = make_quantize_compile_args(name, d, rule)
                build = (lambda cfg=cfg, args=args: compile_for_arch(cfg, *args, arch=arch, keep_ptx=False)[0])
                label = f"{name}{'' if rule is None else ' ' + rule} D{d}"
                out.append(Variant("fp4_quantize", _key("quantize", cfg, arch), label, build))
    return out
