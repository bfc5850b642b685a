"""Launch plans: an eager call's launch sequence, recorded once per call signature and replayed
(``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``, ``write_kv``).

An eager ``flash_attn_func`` call spends most of its host time in Python (validation, kernel lookups, grid and
chunk arithmetic, four to six ``torch.empty``): H100 machine, B1 S128 H2 D128, 135 µs per call with int8 Q K^T
(two launches) and 274 µs with FP8 P x V (four), while the GPU needs 12 / 15 µs; at B2 S2K H16 causal the call
is host-bound (147 µs per call against 88 µs of GPU time). Everything that work decides is fixed by the call's
signature (shapes, strides, dtypes, device, pointer alignment, the options), never by tensor values (the entry
points never read the device on the host). So the second time a signature comes, the call runs once more the
normal way under a recorder, which notes:

* every buffer the call allocates (``torch.empty`` and friends, seen by a ``TorchDispatchMode``) and every
  ``zero_`` / ``fill_`` of one;
* every kernel launch through :class:`~qattn.interface.fast_launch.FastLaunch`, argument by argument: an address
  inside an input or a buffer becomes a reference (input i / buffer j plus an offset), the stream argument the
  current stream, everything else a constant.

Later calls of that signature replay the plan: one workspace allocation for the intermediate buffers, one per
returned tensor (and per buffer that is filled), the launches with the new addresses, same order, same stream,
same arguments otherwise, hence the same bytes. Anything the recorder cannot map makes the signature
"unplanned" (the normal path for good): a launch argument that looks like an address (>= 2^32) but lies in no
input or buffer, an input copied (misaligned views), any other tensor operation on device tensors (computes,
copies, host reads such as ``item()``), a returned tensor that is neither a whole buffer nor an input (the
caller's ``out``), addresses below 2^32. Signatures seen once are not recorded (a
workload whose shapes never repeat pays a dictionary lookup, not a recording); at most ``MAX_PLANS`` plans are
kept (least recently used dropped). ``QATTN_LAUNCH_PLANS=0`` turns plans off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import fast_launch
from .fast_launch import on_device, stream_handle

__all__ = ["LaunchPlan", "Planner", "plans_enabled", "signature_key", "set_enabled", "cache_signature", "layer_tensors",
           "MAX_PLANS", "PLANNERS"]

MAX_PLANS = 256
_ALIGN = 512  # workspace sub-buffers start (and are rounded) like torch caching-allocator blocks
_MIN_ADDRESS = 2**32  # device addresses are above this; launch scalars (sizes, strides) below
_FACTORIES = {"aten::empty", "aten::empty_strided", "aten::zeros", "aten::ones", "aten::full", "aten::empty_like",
              "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::new_empty", "aten::new_zeros",
              "aten::new_full", "aten::new_empty_strided"}
_FILL_VALUE = {"aten::zeros": 0, "aten::zeros_like": 0, "aten::new_zeros": 0, "aten::ones": 1, "aten::ones_like": 1}
_FILLS = {"aten::zero_", "aten::fill_"}


def plans_enabled() -> bool:
    """``QATTN_LAUNCH_PLANS`` (read at import): plans are on unless it is 0 / false / off / no."""
    return os.environ.get("QATTN_LAUNCH_PLANS", "1").strip().lower() not in ("0", "false", "off", "no")


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a replay allocates comes from here (tests may replace it with one that poisons memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s data pointer to the end of its last element."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


class _Buffer:
    __slots__ = ("ptr", "nbytes", "shape", "dtype", "stride", "fill", "returned", "offset")

    def __init__(self, t: torch.Tensor, fill):
        self.ptr, self.nbytes = t.data_ptr(), t.untyped_storage().nbytes()
        self.shape, self.dtype, self.stride = tuple(t.shape), t.dtype, t.stride()
        self.fill = fill  # None, or the value it is filled with where it is allocated
        self.returned = None  # index in the call's returned tensors
        self.offset = None  # in the workspace


class _Recorder(TorchDispatchMode):
    """Records one call (see the module docstring); ``bad`` says why it cannot be a plan."""

    def __init__(self, inputs: Sequence[torch.Tensor], device: torch.device, keyed: int):
        super().__init__()
        self.inputs = [(0, 0) if t is None else (t.data_ptr(), _extent(t)) for t in inputs]
        self.input_objs = list(inputs)  # (dropped once the plan is made)
        self.device = device
        self.buffers: list[_Buffer] = []
        self.events: list[tuple] = []  # ("alloc", j) | ("fill", j, value) | ("launch", launcher, template, subs)
        self.bad: Optional[str] = None
        if any(p and p < _MIN_ADDRESS for p, _ in self.inputs):
            self.bad = "an input address below 2^32"
        # an address is mapped to the first input that starts there: fine among the ``keyed`` inputs (which of them
        # share an address is part of the signature), not for the others (e.g. a cache's K and V global scales
        # given as one tensor: another cache of that geometry would get its K scale for V)
        starts = [p for p, _ in self.inputs]
        if any(starts[i] and starts[i] in starts[:i] for i in range(keyed, len(starts))):
            self.bad = "two inputs at one address, not all of them in the signature"

    # ---- tensor operations
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.bad is None:
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func, args, kwargs, out) -> None:
        schema = func._schema
        name = schema.name
        if name in _FACTORIES:
            if not isinstance(out, torch.Tensor) or out.device.type != self.device.type:
                return  # host tensors: no device work
            if out.storage_offset() or out.data_ptr() < _MIN_ADDRESS:
                self.bad = f"{name}: an unexpected allocation"
                return
            fill = _FILL_VALUE.get(name)
            if name in ("aten::full", "aten::full_like"):
                fill = args[1]
            elif name == "aten::new_full":
                fill = args[2]
            self.buffers.append(_Buffer(out, fill))
            self.events.append(("alloc", len(self.buffers) - 1))
            return
        if name in _FILLS:
            target = args[0]
            j = self._whole_buffer(target)
            if j is None:
                self.bad = f"{name} of a tensor that is not a whole buffer of the call"
                return
            value = 0 if name == "aten::zero_" else args[1]
            if isinstance(value, torch.Tensor):
                self.bad = f"{name} with a tensor value"
                return
            self.events.append(("fill", j, value))
            return
        if schema.is_mutable:
            self.bad = f"{name}: an in-place operation"
            return
        if schema.returns and all(r.alias_info is not None for r in schema.returns):
            return  # views: no device work
        # anything else that touches device tensors: computes, copies, or reads values on the host (item())
        results = out if isinstance(out, (tuple, list)) else (out,)
        given = list(args) + list(kwargs.values())
        touched = list(results) + given + [a for a in given if isinstance(a, (tuple, list)) for a in a]
        if any(isinstance(t, torch.Tensor) and t.device.type == self.device.type for t in touched):
            self.bad = f"{name}: device work other than the recorded launches"

    def _buffer_at(self, ptr: int) -> Optional[int]:
        """The newest buffer starting at ``ptr`` (an older one there was freed before it was allocated)."""
        for j in range(len(self.buffers) - 1, -1, -1):
            if self.buffers[j].ptr == ptr:
                return j
        return None

    def _whole_buffer(self, t) -> Optional[int]:
        if not isinstance(t, torch.Tensor):
            return None
        j = self._buffer_at(t.data_ptr())
        if j is None or not t.is_contiguous() or t.numel() * t.element_size() != self.buffers[j].nbytes:
            return None
        return j

    # ---- kernel launches (FastLaunch.__call__)
    def launch(self, launcher, values: tuple) -> None:
        if self.bad is not None:
            return
        subs = []
        for i, (ctype, v) in enumerate(zip(launcher._ctypes, values)):
            if i in launcher._stream_slots or ctype not in (ctypes.c_int64, ctypes.c_void_p):
                continue
            if not isinstance(v, float) and int(v) >= _MIN_ADDRESS:
                ref = self._resolve(int(v))
                if ref is None:
                    self.bad = f"launch argument {i}: an address outside the inputs and the call's buffers"
                    return
                subs.append((i, *ref))
        self.events.append(("launch", launcher, list(values), tuple(subs), tuple(launcher._stream_slots)))

    def _resolve(self, v: int):
        for i, (p, _) in enumerate(self.inputs):
            if v == p:
                return (0, i, 0)
        for j in range(len(self.buffers) - 1, -1, -1):  # the newest covering buffer is the live one
            b = self.buffers[j]
            if b.ptr <= v < b.ptr + max(b.nbytes, 1):
                return (1, j, v - b.ptr)
        hits = [(i, v - p) for i, (p, n) in enumerate(self.inputs) if p <= v < p + n]
        return (0, *hits[0]) if len(hits) == 1 else None

    # ---- the plan
    def plan(self, returned: Sequence[torch.Tensor]) -> Optional["LaunchPlan"]:
        if self.bad is not None:
            return None
        self.returned_inputs = {}
        objs, self.input_objs = self.input_objs, None
        for r, t in enumerate(returned):
            same = [i for i, x in enumerate(objs) if x is t]
            if same:  # e.g. the caller's ``out``
                self.returned_inputs[r] = same[0]
                continue
            j = self._buffer_at(t.data_ptr())
            b = None if j is None else self.buffers[j]
            if (b is None or b.returned is not None or tuple(t.shape) != b.shape or t.dtype != b.dtype
                    or t.stride() != b.stride):
                self.bad = "a returned tensor that is not a whole buffer of the call"
                return None
            b.returned = r
        filled = {e[1] for e in self.events if e[0] == "fill"}
        size = 0
        for j, b in enumerate(self.buffers):
            if b.returned is None and b.fill is None and j not in filled:
                b.offset = size
                size += -(-max(b.nbytes, 1) // _ALIGN) * _ALIGN
        return LaunchPlan(self.device, self.buffers, self.events, size, len(returned), self.returned_inputs)


class LaunchPlan:
    """A recorded call (module docstring): :meth:`run` replays it on new inputs of the same signature."""

    def __init__(self, device: torch.device, buffers: list, events: list, workspace_bytes: int, num_returned: int,
                 returned_inputs: Optional[dict] = None):
        self.device = device
        self.workspace_bytes = workspace_bytes
        self.num_returned = num_returned
        # buffers: (workspace offset or None, shape, dtype, stride or None when contiguous, fill)
        self.buffers = [(b.offset, b.shape, b.dtype, None if b.stride == _contiguous_stride(b.shape) else b.stride,
                         b.fill) for b in buffers]
        self.returned = [None] * num_returned  # (0, input index) or (1, buffer index) per returned tensor
        for j, b in enumerate(buffers):
            if b.returned is not None:
                self.returned[b.returned] = (1, j)
        for r, i in (returned_inputs or {}).items():
            self.returned[r] = (0, i)
        # ("fill", j, value) | ("launch", launcher, template, subs, stream slots); allocations happen up front
        self.steps = [e for e in events if e[0] != "alloc"]
        self.num_launches = sum(1 for e in self.steps if e[0] == "launch")

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        dev = self.device
        in_ptrs = [0 if t is None else t.data_ptr() for t in inputs]
        ws = _empty((self.workspace_bytes,), torch.uint8, dev) if self.workspace_bytes else None
        base = ws.data_ptr() if ws is not None else 0
        tensors = []
        ptrs = []
        for off, shape, dtype, stride, fill in self.buffers:
            if off is not None:
                tensors.append(None)
                ptrs.append(base + off)
                continue
            t = _empty(shape, dtype, dev) if stride is None else torch.empty_strided(shape, stride, dtype=dtype,
                                                                                      device=dev)
            if fill is not None:
                t.fill_(fill)
            tensors.append(t)
            ptrs.append(t.data_ptr())
        table = (in_ptrs, ptrs)
        cuda = dev.type == "cuda"  # (the CPU serves the mechanism's tests)
        with on_device(dev) if cuda else _NO_CONTEXT:
            stream = stream_handle(dev) if cuda else 0
            for step in self.steps:
                if step[0] == "launch":
                    _, launcher, template, subs, stream_slots = step
                    values = template.copy()
                    for i, kind, j, off in subs:
                        values[i] = table[kind][j] + off
                    for i in stream_slots:
                        values[i] = stream
                    launcher(*values)
                else:
                    _, j, value = step
                    tensors[j].fill_(value)
        return tuple(tensors[j] if kind else inputs[j] for kind, j in self.returned)


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def signature_key(tensors: Sequence[Optional[torch.Tensor]], options: tuple) -> Optional[tuple]:
    """The call signature of an entry point whose host work depends on nothing else (module docstring): per
    tensor its shape, strides, dtype, address modulo 256 and device (None stays None), which tensors share an
    address, and ``options`` (every other argument, hashable), each with its type; None when plans do not apply
    (off, torch.compile tracing, a non-CUDA or subclassed tensor, an unhashable option, a first tensor's device
    other than SM90)."""
    if not _ENABLED[0] or torch.compiler.is_compiling():
        return None
    parts = []
    ptrs = []
    dev = None
    for t in tensors:
        if t is None:
            parts.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_cuda:
            return None
        p = t.data_ptr()
        ptrs.append(p)
        d = t.device
        parts.append((t.shape, t.stride(), t.dtype, p & 255, d))
        dev = dev or d
    if dev is None or not _sm90(dev):
        return None
    alias = tuple((i, j) for i in range(len(ptrs)) for j in range(i) if ptrs[i] == ptrs[j])
    # options by value and type: True == 1 == 1.0 hash alike, but the entry points' checks tell them apart
    key = (dev, tuple(parts), alias, options, _types(options))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _types(options: tuple) -> tuple:
    """The type of every option, and of every element of a tuple option (e.g. ``window_size``)."""
    return tuple([type(x) if type(x) is not tuple else tuple(map(type, x)) for x in options])


def set_enabled(on: bool) -> bool:
    """Turn plans on or off for the process (``QATTN_LAUNCH_PLANS`` sets the start); returns the old setting."""
    old, _ENABLED[0] = _ENABLED[0], bool(on)
    return old


def cache_signature(cache) -> tuple:
    """What a :class:`~qattn.layouts.PagedKVCache`'s geometry contributes to a call signature (every field the
    decode and insert entry points read besides the layer's tensors, which are plan inputs); kept on the
    cache (its geometry is fixed at construction)."""
    sig = cache.__dict__.get("_plan_signature")
    if sig is None:
        sig = cache.__dict__["_plan_signature"] = (
            cache.k_format, cache.v_format, cache.num_layers, cache.num_blocks, cache.page_size, cache.num_kv_heads,
            cache.head_dim, cache.dtype, cache.recent_window, cache.sink_tokens, cache.max_seqs, cache.rotate,
            cache.device)
    return sig


def layer_tensors(lay) -> tuple:
    """A :class:`~qattn.layouts.KVLayer`'s ten tensors (None where absent), in field order: plan inputs."""
    return (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_global_scale, lay.v_global_scale,
            lay.k_ring, lay.v_ring, lay.k_sink, lay.v_sink)


def _sm90(dev: torch.device) -> bool:
    ok = _SM90.get(dev)
    if ok is None:
        from .variants import device_capability

        ok = _SM90[dev] = tuple(device_capability(dev)) == (9, 0)
    return ok


_SM90: dict = {}
PLANNERS: list = []  # every entry point's Planner (tests clear them)
# plans on / off for the whole process (QATTN_LAUNCH_PLANS; tests flip it)
_ENABLED = [plans_enabled()]
_UNPLANNED = object()
_NO_CONTEXT = contextlib.nullcontext()


class Planner:
    """Plans of one entry point, by call signature (module docstring)."""

    def __init__(self, max_plans: int = MAX_PLANS):
        PLANNERS.append(self)
        self.max_plans = max_plans
        self._plans: OrderedDict = OrderedDict()  # key -> LaunchPlan | _UNPLANNED
        self._seen: OrderedDict = OrderedDict()  # keys seen once
        self._lock = threading.Lock()
        self.hits = 0
        self.recorded = 0
        self.unplanned: dict = {}  # key -> why (for tests and debugging)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._seen.clear()
            self.unplanned.clear()
            self.hits = self.recorded = 0

    def __len__(self) -> int:
        return sum(1 for p in self._plans.values() if p is not _UNPLANNED)

    def call(self, key, inputs: Sequence[torch.Tensor], slow: Callable[[], tuple], keyed: Optional[int] = None,
             device: Optional[torch.device] = None) -> tuple:
        """``slow()`` (the normal path, returning a tuple of tensors) or the replay of its plan for ``key`` (None:
        plans do not apply, the normal path). ``inputs``: every tensor whose address a launch may take, the first
        ``keyed`` (default all) being those whose signature is in ``key``. ``device``: where the launches run
        (default ``key[0]``, the device of a :func:`signature_key`)."""
        if key is None:
            return slow()
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # dropped by another thread meanwhile: the plan object is still good
                pass
            if plan is _UNPLANNED:
                return slow()
            self.hits += 1
            return plan.run(inputs)
        with self._lock:
            first = key not in self._seen
            if first:
                self._seen[key] = True
                if len(self._seen) > 4 * self.max_plans:
                    self._seen.popitem(last=False)
        if first or fast_launch.recording():  # (a recording inside another's would hide launches from it)
            return slow()
        return self._record(key, inputs, key[0] if device is None else device, slow,
                            len(inputs) if keyed is None else keyed)

    def _record(self, key, inputs, device, slow, keyed: int) -> tuple:
        rec = _Recorder(inputs, device, keyed)
        fast_launch.set_recorder(rec)
        try:
            with rec:
                result = slow()
        finally:
            fast_launch.set_recorder(None)
        plan = rec.plan(result)
        with self._lock:
            self._seen.pop(key, None)
            if plan is None:
                self.unplanned[key] = rec.bad
                self._plans[key] = _UNPLANNED
            else:
                self.recorded += 1
                self._plans[key] = plan
            while len(self._plans) > self.max_plans:
                old, _ = self._plans.popitem(last=False)
                self.unplanned.pop(old, None)
        return result
