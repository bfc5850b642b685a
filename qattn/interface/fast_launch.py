"""Low-overhead calls of compiled CuTe-DSL host functions whose arguments are scalars and raw pointers.

Every qattn kernel takes raw device addresses (Int64), sizes (Int32), scalars (Float32) and a CUDA stream, so
that one compiled object serves any tensor (and can be exported to disk). Calling the compiled function the
normal way (``fn(Int64(a), ...)``) converts each argument through the DSL's typed wrappers: ~70-100 µs of
Python per launch in CuTe-DSL 4.8, more than a decode step's kernel. :class:`FastLaunch` packs the same C ABI
itself: one preallocated buffer of 8-byte argument slots per thread, filled by one ``struct.pack_into``, whose
slot addresses the DSL's executor packed once; a call then goes straight to the compiled host function and checks
its CUDA result (what ``run_compiled_program`` does per call, minus re-packing the same addresses). The argument
C types come from the compiled function's own signature, so a kernel whose signature changes cannot be called
with a stale layout.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
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


def _is_stream(annotation) -> bool:
    import cuda.bindings.driver as cuda

    return annotation is cuda.CUstream


# launch plans being recorded (``launch_plan._Recorder``), by thread: FastLaunch reports that thread's calls
_recorders: dict = {}


def set_recorder(recorder) -> None:
    """Report this thread's launches to ``recorder`` (None: stop)."""
    if recorder is None:
        _recorders.pop(threading.get_ident(), None)
    else:
        _recorders[threading.get_ident()] = recorder


def recording() -> bool:
    """Whether this thread is recording a launch plan."""
    return threading.get_ident() in _recorders


def report_launch(launcher, values: tuple) -> None:
    """Tell this thread's recorder, if any, that ``launcher`` (``_ctypes``, ``_stream_slots``) is called with
    ``values``."""
    rec = _recorders.get(threading.get_ident())
    if rec is not None:
        rec.launch(launcher, values)


# one 8-byte little-endian slot per argument: the C ABI reads an int32 / float from the slot's first bytes
_SLOT_FORMAT = {ctypes.c_int64: "q", ctypes.c_int32: "i4x", ctypes.c_float: "f4x", ctypes.c_void_p: "Q"}
_pack_into = struct.pack_into


class FastLaunch:
    """Call ``fn`` (a compiled CuTe-DSL function) with plain Python ints / floats; pointers (``cute.Pointer``
    arguments) as int addresses, the stream as an int handle.

    Per thread, the arguments live in one buffer of 8-byte slots filled by a single ``struct.pack_into``, and the
    executor's packed argument array (the slots' addresses, its CUDA result slot and kernel pointers, all
    constant) is built once; a call packs the values and calls the compiled host function, then checks its CUDA
    result as ``run_compiled_program`` does."""

    def __init__(self, fn: Any):
        self._fn = fn
        params = list(fn.execution_args.signature.parameters.values())
        self._ctypes = [_ctype_of(p.annotation) for p in params]
        self._stream_slots = frozenset(i for i, p in enumerate(params) if _is_stream(p.annotation))
        self._format = "<" + "".join(_SLOT_FORMAT[t] for t in self._ctypes)
        self._executor = None
        self._lock = threading.Lock()
        self._tls = threading.local()

    def _thread_state(self):
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = self._fn.to()  # loads the CUDA library on every device, once
        ex = self._executor
        buf = ctypes.create_string_buffer(8 * max(len(self._ctypes), 1))
        base = ctypes.addressof(buf)
        ptrs = [ctypes.c_void_p(base + 8 * i) for i in range(len(self._ctypes))]
        # the executor's own packing of those (constant) addresses, copied into an array of this launcher's (the
        # executor reuses its array for any later call of the same thread, whatever its arguments): a call only
        # rewrites the slots
        shared = ex._get_invoke_packed_args_func(ptrs)
        packed = (ctypes.c_void_p * len(shared))()
        ctypes.memmove(packed, shared, ctypes.sizeof(packed))
        state = (buf, packed, ex.capi_func, ex.cuda_result if ex._has_cuda_result else None)
        self._tls.state = state
        return state

    def __call__(self, *values) -> None:
        if len(values) != len(self._ctypes):
            raise TypeError(f"FastLaunch: expected {len(self._ctypes)} arguments, got {len(values)}")
        state = getattr(self._tls, "state", None)
        if state is None:
            state = self._thread_state()
        buf, packed, capi, result = state
        try:
            _pack_into(self._format, buf, 0, *values)
        except struct.error as e:
            raise TypeError(f"FastLaunch: {e} (arguments {values})") from None
        if _recorders:  # a launch plan is being recorded (launch_plan.py)
            report_launch(self, values)
        capi(packed)
        if result is not None and result.value != 0:
            from cutlass.base_dsl.jit_executor import cuda_helpers

            raise cuda_helpers.create_cuda_runtime_error(result.value, cuda_helpers.cudart.cudaError_t)


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

    # the raw getter skips torch.cuda.current_device()'s lazy-init checks (~1 µs): a CUDA tensor exists already
    current = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    if isinstance(device, torch.device) and device.index is not None and device.index == current():
        return _SAME
    return torch.cuda.device(device)


# ------------------------------------------------------------------------------------------------
# tensors as kernel arguments: what a kernel can read in place
# ------------------------------------------------------------------------------------------------
def contiguous16(t):
    """``t`` as a contiguous tensor whose data pointer is 16-byte aligned (a copy only when it is not)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def kernel_view(t, offset_limit: int | None = None):
    """``t`` itself when the kernels that take strides can read it in place, else :func:`contiguous16` of it:
    last dim contiguous, the data pointer and the byte stride of every other dimension longer than 1 multiples of
    16 and not 0 (16-byte loads, TMA descriptors; a broadcast, ``expand``ed dimension is copied; a size-1
    dimension's stride is never used), and with ``offset_limit``
    (kernels with 32-bit strides) its largest element offset below it. E.g. q, k, v sliced out of one packed QKV
    projection pass. The common contiguous case costs a fraction of a microsecond."""
    if t.is_contiguous():
        return t if t.data_ptr() % 16 == 0 else t.clone()
    eb, shape, stride = t.element_size(), t.shape, t.stride()
    ok = stride[-1] == 1 and t.data_ptr() % 16 == 0 and all(
        n == 1 or (st > 0 and st * eb % 16 == 0) for n, st in zip(shape[:-1], stride[:-1]))
    if ok and offset_limit is not None:
        ok = sum((n - 1) * st for n, st in zip(shape, stride)) < offset_limit
    return t if ok else contiguous16(t)
