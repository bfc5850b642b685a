"""Low-overhead calls of compiled CuTe-DSL host functions whose arguments are scalars and raw pointers.

Every qattn kernel takes raw device addresses (Int64), sizes (Int32), scalars (Float32) and a CUDA stream, so
that one compiled object serves any tensor (and can be exported to disk). Calling the compiled function the
normal way (``fn(Int64(a), ...)``) converts each argument through the DSL's typed wrappers: ~70-100 µs of
Python per launch in CuTe-DSL 4.8, more than a decode step's kernel. :class:`FastLaunch` packs the same C ABI
itself: one preallocated ctypes slot per argument (thread-local), the addresses of those slots handed to the
DSL's executor (``run_compiled_program``, which keeps its CUDA error check). The argument C types come from the
compiled function's own signature, so a kernel whose signature changes cannot be called with a stale layout.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

__all__ = ["FastLaunch", "fast", "stream_handle", "on_device"]


def _ctype_of(annotation) -> type:
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.typing import Pointer

    # a gmem Pointer argument is passed like the stream: the address of a slot holding the raw address
    table = {Int64: ctypes.c_int64, Int32: ctypes.c_int32, Float32: ctypes.c_float, cuda.CUstream: ctypes.c_void_p,
             Pointer: ctypes.c_void_p}
    if annotation not in table:
        raise TypeError(f"FastLaunch: unsupported argument type {annotation!r} (scalars and a stream only)")
    return table[annotation]


class FastLaunch:
    """Call ``fn`` (a compiled CuTe-DSL function) with plain Python ints / floats; pointers (``cute.Pointer``
    arguments) as int addresses, the stream as an int handle."""

    def __init__(self, fn: Any):
        self._fn = fn
        self._ctypes = [_ctype_of(p.annotation) for p in fn.execution_args.signature.parameters.values()]
        self._executor = None
        self._lock = threading.Lock()
        self._tls = threading.local()

    def __call__(self, *values) -> None:
        if len(values) != len(self._ctypes):
            raise TypeError(f"FastLaunch: expected {len(self._ctypes)} arguments, got {len(values)}")
        tls = self._tls
        slots = getattr(tls, "slots", None)
        if slots is None:
            slots = tls.slots = [t() for t in self._ctypes]
            tls.ptrs = [ctypes.c_void_p(ctypes.addressof(s)) for s in slots]
        for slot, v in zip(slots, values):
            slot.value = v
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = self._fn.to()  # loads the CUDA library on every device, once
        self._executor.run_compiled_program(tls.ptrs)


_FAST: dict[int, FastLaunch] = {}


def fast(fn: Any) -> FastLaunch:
    """The :class:`FastLaunch` of a compiled function (one per function object)."""
    f = _FAST.get(id(fn))
    if f is None or f._fn is not fn:
        f = _FAST[id(fn)] = FastLaunch(fn)
    return f


def stream_handle(device) -> int:
    """The raw handle of ``device``'s current CUDA stream, as a launch takes it: torch's C getter (the one
    torch's inductor launches with, ~0.3 µs) where this torch has it, else ``torch.cuda.current_stream(device)
    .cuda_stream`` (~4 µs: it builds a Stream object)."""
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None and isinstance(device, torch.device) and device.index is not None:
        return getter(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_SAME = contextlib.nullcontext()  # reusable


def on_device(device):
    """``torch.cuda.device(device)``, or a no-op context when ``device`` is already the current one (the
    switch and switch back cost ~3 µs per launch sequence)."""
    import torch

    if isinstance(device, torch.device) and device.index is not None and device.index == torch.cuda.current_device():
        return _SAME
    return torch.cuda.device(device)
