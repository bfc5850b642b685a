"""Paged KV pools: geometry, byte addressing and the cache object that owns (or views) them.

In-block layout ("HND", see docs/formats.md for byte diagrams). For one layer:

    data pool   (num_blocks, num_kv_heads, page_size, row_elems)   data_dtype of the format
    scale pool  (num_blocks, num_kv_heads, page_size, num_scales)  uint8   block-scaled formats (nvfp4, mxfp4)
                (num_blocks, num_kv_heads, page_size)              float32 per token-head formats (fp8, int8)
                none                                               bf16
    global scale (num_kv_heads,) float32                                   nvfp4 only
    ring        (max_seqs, num_kv_heads, recent_window, head_dim)  dtype   caches with a recent-token window
    sink        (max_seqs, num_kv_heads, sink_tokens, head_dim)    dtype   caches that pin the first tokens

Why heads before tokens: a decode CTA works on one (sequence, kv_head) and walks its pages, so the
page_size x row_bytes tile it loads for a block is one contiguous run of bytes (one TMA box, or 16-byte
cp.async vectors), and the matching scale tile (page_size x num_scales bytes) is contiguous as well.
Data and scale pools share block ids: block ``b`` of a sequence lives in ``data[b]`` and ``scale[b]``.

Every byte offset used anywhere (reference, kernels, inspector) comes from :class:`PoolGeometry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .formats import FormatSpec, KVFormat, kv_formats

PAGE_SIZES = (16, 32, 64, 128, 256)
# Sink tokens per sequence: the decode kernel reads a sequence's whole sink in one 64-token tile.
MAX_SINK_TOKENS = 64


def _check_pos_int(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise TypeError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class PoolGeometry:
    """Shapes, strides and byte offsets of one layer's K or V pools in one format."""

    num_blocks: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    fmt: KVFormat

    def __post_init__(self) -> None:
        _check_pos_int(self.num_blocks, "num_blocks")
        _check_pos_int(self.page_size, "page_size")
        _check_pos_int(self.num_kv_heads, "num_kv_heads")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size: {self.page_size} is not one of {PAGE_SIZES}")
        self.fmt.check_head_dim(self.head_dim)

    # --- shapes -------------------------------------------------------------------------------
    @property
    def row_elems(self) -> int:
        return self.fmt.row_elems(self.head_dim)

    @property
    def row_bytes(self) -> int:
        return self.fmt.payload_bytes(self.head_dim)

    @property
    def data_words(self) -> int:
        """The data pool's size in 32-bit words (the insert and flatten kernels index it with int32)."""
        return self.num_blocks * self.num_kv_heads * self.page_size * self.row_bytes // 4

    @property
    def data_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.page_size, self.row_elems)

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        if not self.fmt.is_quantized:
            return None
        if self.fmt.scale_block is None:
            return (self.num_blocks, self.num_kv_heads, self.page_size)
        return (self.num_blocks, self.num_kv_heads, self.page_size, self.fmt.num_scales(self.head_dim))

    @property
    def scale_row_bytes(self) -> int:
        return self.fmt.scale_bytes(self.head_dim)

    # --- byte addressing (what the kernels compute) ------------------------------------------
    def data_offset(self, block: int, head: int, offset: int) -> int:
        """Byte offset of the payload row of (block, kv_head, in-page offset) from the pool's base."""
        return ((block * self.num_kv_heads + head) * self.page_size + offset) * self.row_bytes

    def scale_offset(self, block: int, head: int, offset: int) -> int:
        """Byte offset of the scale row of (block, kv_head, in-page offset) from the scale pool's base."""
        return ((block * self.num_kv_heads + head) * self.page_size + offset) * self.scale_row_bytes

    @property
    def data_tile_bytes(self) -> int:
        """Bytes of one (block, kv_head) payload tile: contiguous in memory."""
        return self.page_size * self.row_bytes

    @property
    def scale_tile_bytes(self) -> int:
        """Bytes of one (block, kv_head) scale tile: contiguous in memory."""
        return self.page_size * self.scale_row_bytes

    @property
    def bytes_per_block(self) -> int:
        """Payload plus scale bytes of one block (all kv heads), for K or V alone."""
        return self.num_kv_heads * (self.data_tile_bytes + self.scale_tile_bytes)

    # --- allocation and checking -------------------------------------------------------------
    def empty_data(self, device, num_layers: int | None = None) -> torch.Tensor:
        shape = self.data_shape if num_layers is None else (num_layers, *self.data_shape)
        return torch.zeros(shape, dtype=self.fmt.data_dtype, device=device)

    def empty_scales(self, device, num_layers: int | None = None) -> torch.Tensor | None:
        if self.scale_shape is None:
            return None
        shape = self.scale_shape if num_layers is None else (num_layers, *self.scale_shape)
        return torch.zeros(shape, dtype=self.fmt.scale_storage_dtype, device=device)

    def check_data(self, t: torch.Tensor, name: str) -> None:
        _check_pool(t, self.data_shape, self.fmt.data_dtype, name, align=POOL_ALIGN)

    def check_scales(self, t: torch.Tensor | None, name: str) -> None:
        if self.scale_shape is None:
            if t is not None:
                raise ValueError(f"{name}: format {self.fmt.name!r} has no scales, expected None")
            return
        if t is None:
            raise ValueError(f"{name}: format {self.fmt.name!r} needs a scale pool of shape {self.scale_shape}")
        _check_pool(t, self.scale_shape, self.fmt.scale_storage_dtype, name, align=POOL_ALIGN)


def _normalize_device(device) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``: tensors always carry an index, and launchers compare devices."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


POOL_ALIGN = 16  # bytes: where a data, scale, ring or sink pool given to from_tensors must start


def _check_pool(t, shape, dtype, name: str, align: int = 1) -> None:
    """A pool given to ``from_tensors``: dtype, shape, contiguous and (``align``) its base's byte alignment."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        # Kernels address pools with the byte offsets above; a strided view would break them.
        raise ValueError(f"{name}: must be contiguous (the kernels address it by byte offset)")
    if t.data_ptr() % align:
        # the kernels move pool rows in 16-byte loads and stores (cp.async, st.v4)
        raise ValueError(f"{name}: its data must start on a {align}-byte boundary, got address {t.data_ptr():#x}")


@dataclass(frozen=True)
class RingGeometry:
    """The recent-token window: a bf16/fp16 ring of each sequence's newest ``window`` tokens.

    Token at position ``p`` of the sequence in ring slot ``s`` lives at ``ring[s, head, p % window]``.
    """

    max_seqs: int
    num_kv_heads: int
    window: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.max_seqs, self.num_kv_heads, self.window, self.head_dim)

    def offset(self, seq_slot: int, head: int, position: int) -> int:
        """Byte offset of (ring slot, kv_head, token position) from the ring's base."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        return ((seq_slot * self.num_kv_heads + head) * self.window + position % self.window) * self.head_dim * esize

    def check(self, t: torch.Tensor, name: str) -> None:
        _check_pool(t, self.shape, self.dtype, name, align=POOL_ALIGN)


@dataclass(frozen=True)
class SinkGeometry:
    """The attention sink: each sequence's first ``sink_tokens`` tokens, unquantized (bf16/fp16).

    Token at position ``p < sink_tokens`` of the sequence in slot ``s`` (the ring's ``seq_slots``) lives at
    ``sink[s, head, p]``; a sink entry is written once, when its token is, and never wraps.
    """

    max_seqs: int
    num_kv_heads: int
    sink_tokens: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.max_seqs, self.num_kv_heads, self.sink_tokens, self.head_dim)

    def offset(self, seq_slot: int, head: int, position: int) -> int:
        """Byte offset of (slot, kv_head, token position < sink_tokens) from the sink buffer's base."""
        if not 0 <= position < self.sink_tokens:
            raise ValueError(f"position: expected an int in [0, {self.sink_tokens}), got {position!r}")
        esize = torch.empty((), dtype=self.dtype).element_size()
        return ((seq_slot * self.num_kv_heads + head) * self.sink_tokens + position) * self.head_dim * esize

    def check(self, t: torch.Tensor, name: str) -> None:
        _check_pool(t, self.shape, self.dtype, name, align=POOL_ALIGN)


def read_sources(seq_len: int, recent_window: int, sink_tokens: int) -> tuple[range, range, range]:
    """Which positions of a sequence of ``seq_len`` tokens attention reads from where:
    ``(sink, pages, ring)`` as disjoint ranges that cover ``[0, seq_len)``.

    * sink:  ``[0, min(N, len))``                  from ``sink[slot, h, p]`` (N = sink_tokens)
    * pages: ``[N, max(N, len - W))`` (W > 0), ``[N, len)`` (W = 0)   quantized
    * ring:  ``[max(N, len - W), len)``             from ``ring[slot, h, p % W]``

    The sink wins where it and the window overlap (a short sequence): both hold the same unquantized row, and
    one rule keeps the sources disjoint. Every reader (reference, kernels, the eval harness) follows it.
    """
    n = min(sink_tokens, seq_len)
    page_end = max(sink_tokens, seq_len - recent_window) if recent_window else max(sink_tokens, seq_len)
    page_end = min(page_end, seq_len)
    return range(0, n), range(min(sink_tokens, seq_len), page_end), range(max(page_end, n), seq_len)


@dataclass
class KVLayer:
    """The plain tensors of one layer: what a serving engine allocates and passes around."""

    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale_pool: torch.Tensor | None
    v_scale_pool: torch.Tensor | None
    k_global_scale: torch.Tensor | None  # (num_kv_heads,) float32, nvfp4 only
    v_global_scale: torch.Tensor | None
    k_ring: torch.Tensor | None = None  # (max_seqs, num_kv_heads, window, head_dim)
    v_ring: torch.Tensor | None = None
    k_sink: torch.Tensor | None = None  # (max_seqs, num_kv_heads, sink_tokens, head_dim)
    v_sink: torch.Tensor | None = None


class PagedKVCache:
    """A paged, quantized KV cache: per layer a K and a V data pool, scale pools with the same block ids,
    per-(layer, kv_head) fp32 global scales (nvfp4) and, optionally, a bf16 ring of the newest tokens and a
    bf16 copy of the first tokens (the attention sink).

    It is a thin owner of plain torch tensors. Build one that allocates (``PagedKVCache(...)``) or one that
    views tensors you allocated (:meth:`from_tensors`); every function that takes a cache reads only the
    tensors of :meth:`layer` plus the geometry.

    Args:
        num_layers, num_blocks, page_size, num_kv_heads, head_dim: pool geometry (page_size in 16..256,
            a power of two).
        kv_format: a format name, :class:`KVFormat`, or ``(k_format, v_format)`` pair (FP4 formats may carry
            ``scale_search="msenb"``: ``qattn.kv_format("nvfp4", scale_search="msenb")``, written with a
            block-scale search, read as usual).
        device, dtype: where the pools live; ``dtype`` (bf16 or fp16) is the activation dtype, used by the
            recent-token ring and the sink buffer.
        recent_window: keep each sequence's newest ``recent_window`` tokens in a ring (0 = off).
        sink_tokens: also keep each sequence's first ``sink_tokens`` tokens (0..MAX_SINK_TOKENS) unquantized
            in a sink buffer ``sink[seq_slot, head, position]`` (0 = off). The pages still hold every token.
            Which source attention reads for each position: :func:`read_sources`.
        max_seqs: ring / sink slots (sequences that can be live at once); required with a window or sinks.
        rotate: store K and V in a randomized-Hadamard-rotated basis (``qattn.quant.transforms.rotate_rows`` with
            :attr:`rotation_signs`, one fixed rotation per cache, head_dim a power of two). ``qattn.write_kv``
            rotates what it stores (pages and ring), ``qattn.flash_attn_with_kvcache`` rotates q and rotates the
            output back, so callers see attention of the unrotated q, K, V (up to quantization error).
        rotation_seed: seed of the random signs (``qattn.quant.transforms.rotation_signs(head_dim, seed)``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_format: FormatSpec = "nvfp4",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        *,
        recent_window: int = 0,
        max_seqs: int = 0,
        rotate: bool = False,
        rotation_seed: int = 0,
        sink_tokens: int = 0,
        _layers: Sequence[KVLayer] | None = None,
        _rotation_signs: torch.Tensor | None = None,
    ) -> None:
        _check_pos_int(num_layers, "num_layers")
        # set by ``write_kv(..., k_mean=...)``: some K row was stored smoothed (a shift soft-capping is not
        # invariant to, so ``flash_attn_with_kvcache(softcap=...)`` refuses the cache)
        self.k_smoothed = False
        self.k_format, self.v_format = kv_formats(kv_format)
        self.k_geometry = PoolGeometry(num_blocks, page_size, num_kv_heads, head_dim, self.k_format)
        self.v_geometry = PoolGeometry(num_blocks, page_size, num_kv_heads, head_dim, self.v_format)
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
        if isinstance(recent_window, bool) or not isinstance(recent_window, int) or recent_window < 0:
            raise ValueError(f"recent_window: expected an int >= 0, got {recent_window!r}")
        if recent_window and (isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs <= 0):
            raise ValueError(f"max_seqs: a cache with recent_window={recent_window} needs max_seqs > 0")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or not 0 <= sink_tokens <= MAX_SINK_TOKENS:
            raise ValueError(f"sink_tokens: expected an int in [0, {MAX_SINK_TOKENS}], got {sink_tokens!r}")
        if sink_tokens and (isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs <= 0):
            raise ValueError(f"max_seqs: a cache with sink_tokens={sink_tokens} needs max_seqs > 0 "
                             "(one sink slot per live sequence, indexed by seq_slots like the ring)")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.recent_window = recent_window
        self.sink_tokens = sink_tokens
        self.max_seqs = max_seqs if (recent_window or sink_tokens) else 0
        self.ring_geometry = (
            RingGeometry(self.max_seqs, num_kv_heads, recent_window, head_dim, dtype) if recent_window else None
        )
        self.sink_geometry = (
            SinkGeometry(self.max_seqs, num_kv_heads, sink_tokens, head_dim, dtype) if sink_tokens else None
        )
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate: expected a bool, got {rotate!r}")
        if isinstance(rotation_seed, bool) or not isinstance(rotation_seed, int):
            raise TypeError(f"rotation_seed: expected an int, got {rotation_seed!r}")
        if rotate and head_dim & (head_dim - 1):
            raise ValueError(f"rotate: the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
        self.rotate = rotate
        self.rotation_seed = rotation_seed if rotate else None
        if _layers is not None:
            self.device = torch.device(_layers[0].k_data.device)
            self._layers = list(_layers)
        else:
            self.device = _normalize_device(device)
            self._layers = self._allocate()
        self.rotation_signs = self._make_rotation_signs(_rotation_signs) if rotate else None
        # the dense rotation matrix of decode's q / output transforms, built here (not inside a CUDA graph capture
        # or a torch.compile trace); views that the custom ops build (rotation_signs given) never need it
        self._rotation_matrix = None
        if rotate and _rotation_signs is None:
            self.rotation_matrix  # noqa: B018 (builds it now)

    @property
    def rotation_matrix(self) -> torch.Tensor | None:
        """(head_dim, head_dim) fp32 ``R`` of a rotated cache (``k R`` is stored), None without rotation."""
        if self.rotate and self._rotation_matrix is None:
            from ..quant.transforms import rotation_matrix

            self._rotation_matrix = rotation_matrix(self.rotation_signs)
        return self._rotation_matrix

    def _make_rotation_signs(self, given: torch.Tensor | None) -> torch.Tensor:
        """The (head_dim,) fp32 ±1 vector of the cache's rotation, on the cache's device (built once here, so that
        no later call copies from the host: write_kv and decode may run inside CUDA graphs)."""
        from ..quant.transforms import rotation_signs

        if given is None:
            return rotation_signs(self.head_dim, self.rotation_seed).to(self.device)
        _check_pool(given, (self.head_dim,), torch.float32, "rotation_signs")
        if _normalize_device(given.device) != self.device:
            raise ValueError(f"rotation_signs: expected device {self.device}, got {given.device}")
        return given

    # --- construction ------------------------------------------------------------------------
    def _allocate(self) -> list[KVLayer]:
        L, dev = self.num_layers, self.device
        # One allocation per pool kind; layers are contiguous views into it.
        k_data, v_data = self.k_geometry.empty_data(dev, L), self.v_geometry.empty_data(dev, L)
        k_sc, v_sc = self.k_geometry.empty_scales(dev, L), self.v_geometry.empty_scales(dev, L)
        k_gs = torch.ones(L, self.num_kv_heads, dtype=torch.float32, device=dev) if self.k_format.has_global_scale else None
        v_gs = torch.ones(L, self.num_kv_heads, dtype=torch.float32, device=dev) if self.v_format.has_global_scale else None
        rings = sinks = None
        if self.ring_geometry is not None:
            rings = [torch.zeros((L, *self.ring_geometry.shape), dtype=self.dtype, device=dev) for _ in range(2)]
        if self.sink_geometry is not None:
            sinks = [torch.zeros((L, *self.sink_geometry.shape), dtype=self.dtype, device=dev) for _ in range(2)]
        return [
            KVLayer(
                k_data[i], v_data[i],
                None if k_sc is None else k_sc[i], None if v_sc is None else v_sc[i],
                None if k_gs is None else k_gs[i], None if v_gs is None else v_gs[i],
                None if rings is None else rings[0][i], None if rings is None else rings[1][i],
                None if sinks is None else sinks[0][i], None if sinks is None else sinks[1][i],
            )
            for i in range(L)
        ]

    @classmethod
    def from_tensors(
        cls,
        layers: Sequence[KVLayer],
        page_size: int,
        head_dim: int,
        kv_format: FormatSpec,
        dtype: torch.dtype = torch.bfloat16,
        *,
        rotate: bool = False,
        rotation_seed: int = 0,
        rotation_signs: torch.Tensor | None = None,
        k_smoothed: bool = False,
    ) -> "PagedKVCache":
        """A cache viewing tensors the caller allocated (no copy). ``layers`` holds one :class:`KVLayer` per
        layer; shapes, dtypes, contiguity and devices are checked against the geometry. ``rotate`` /
        ``rotation_seed`` as in the constructor; ``rotation_signs`` optionally passes the device sign vector of
        an existing cache (``cache.rotation_signs``) instead of building it (trusted to match the seed).
        The window, sink size and max_seqs are read from the ring / sink tensors' shapes. ``k_smoothed``: the
        tensors' K was written smoothed (``write_kv(k_mean=...)``), the one fact the tensors do not carry; a view
        that says so refuses ``flash_attn_with_kvcache(softcap=...)`` as the cache that wrote them does."""
        if not layers:
            raise ValueError("layers: need at least one KVLayer")
        for i, lay in enumerate(layers):
            if not isinstance(lay, KVLayer):
                raise TypeError(f"layers[{i}]: expected a KVLayer, got {type(lay).__name__}")
        first = layers[0]
        if not isinstance(first.k_data, torch.Tensor) or first.k_data.dim() != 4:
            raise ValueError("layers[0].k_data: expected a 4-d tensor (num_blocks, num_kv_heads, page_size, row)")
        num_blocks, num_kv_heads = int(first.k_data.shape[0]), int(first.k_data.shape[1])
        ring, sink = first.k_ring, first.k_sink
        for t, nm in ((ring, "k_ring"), (sink, "k_sink")):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4):
                raise ValueError(f"layers[0].{nm}: expected a 4-d tensor (max_seqs, num_kv_heads, tokens, head_dim)")
        window = int(ring.shape[2]) if ring is not None else 0
        sink_tokens = int(sink.shape[2]) if sink is not None else 0
        max_seqs = int(ring.shape[0]) if ring is not None else (int(sink.shape[0]) if sink is not None else 0)
        cache = cls(len(layers), num_blocks, page_size, num_kv_heads, head_dim, kv_format, first.k_data.device,
                    dtype, recent_window=window, max_seqs=max_seqs, rotate=rotate, rotation_seed=rotation_seed,
                    sink_tokens=sink_tokens, _layers=layers, _rotation_signs=rotation_signs)
        for i, lay in enumerate(layers):
            cache._check_layer(lay, f"layers[{i}]")
        cache.k_smoothed = bool(k_smoothed)
        return cache

    def _check_layer(self, lay: KVLayer, name: str) -> None:
        self.k_geometry.check_data(lay.k_data, f"{name}.k_data")
        self.v_geometry.check_data(lay.v_data, f"{name}.v_data")
        self.k_geometry.check_scales(lay.k_scale_pool, f"{name}.k_scale_pool")
        self.v_geometry.check_scales(lay.v_scale_pool, f"{name}.v_scale_pool")
        for fmt, gs, nm in ((self.k_format, lay.k_global_scale, "k_global_scale"),
                            (self.v_format, lay.v_global_scale, "v_global_scale")):
            if fmt.has_global_scale:
                if gs is None:
                    raise ValueError(f"{name}.{nm}: format {fmt.name!r} needs a ({self.num_kv_heads},) fp32 tensor")
                _check_pool(gs, (self.num_kv_heads,), torch.float32, f"{name}.{nm}")
            elif gs is not None:
                raise ValueError(f"{name}.{nm}: format {fmt.name!r} has no global scale, expected None")
        for ring, nm in ((lay.k_ring, "k_ring"), (lay.v_ring, "v_ring")):
            if self.ring_geometry is None:
                if ring is not None:
                    raise ValueError(f"{name}.{nm}: the cache has no recent window, expected None")
            else:
                self.ring_geometry.check(ring, f"{name}.{nm}")
        for sink, nm in ((lay.k_sink, "k_sink"), (lay.v_sink, "v_sink")):
            if self.sink_geometry is None:
                if sink is not None:
                    raise ValueError(f"{name}.{nm}: the cache keeps no sink tokens, expected None")
            else:
                self.sink_geometry.check(sink, f"{name}.{nm}")
        devices = {t.device for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool,
                                      lay.k_global_scale, lay.v_global_scale, lay.k_ring, lay.v_ring,
                                      lay.k_sink, lay.v_sink) if t is not None}
        if len(devices) != 1 or devices.pop() != self.device:
            raise ValueError(f"{name}: all tensors must be on one device ({self.device})")

    @staticmethod
    def pool_shapes(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                    kv_format: FormatSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
        """Shapes and dtypes of one layer's pools, for engines that allocate their own memory."""
        kf, vf = kv_formats(kv_format)
        out = {}
        for side, fmt in (("k", kf), ("v", vf)):
            g = PoolGeometry(num_blocks, page_size, num_kv_heads, head_dim, fmt)
            out[f"{side}_data"] = (g.data_shape, fmt.data_dtype)
            out[f"{side}_scale_pool"] = None if g.scale_shape is None else (g.scale_shape, fmt.scale_storage_dtype)
            out[f"{side}_global_scale"] = ((num_kv_heads,), torch.float32) if fmt.has_global_scale else None
        return out

    # --- access --------------------------------------------------------------------------------
    def layer(self, i: int) -> KVLayer:
        if not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {i!r}")
        return self._layers[i]

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, headroom: float = 1.0,
                  positions: torch.Tensor | None = None, rope=None,
                  k_mean: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Set ``layer``'s NVFP4 global scales (per kv head, K and V separately) from a prefill batch.

        ``k``, ``v`` (num_tokens, num_kv_heads, head_dim) are the rows that will be written, before the insert
        transforms: the same ``positions`` / ``rope`` / ``k_mean`` as ``qattn.write_kv`` are applied (and the
        cache's rotation), because the scale must fit what is quantized. Per head:
        ``g = fp32(amax · headroom / (6 · 448))`` (computed in fp64, rounded once), at least ``2^-116`` so every
        block's decode scale stays a normal fp32; a head whose rows are all zero gets ``g = 1``. Later values
        above ``amax · headroom`` saturate (block scale 448, codes ±6): never Inf or NaN. Sides that are not
        nvfp4 have no global scale and are left alone. Returns the (K, V) global-scale tensors that were set
        (views into the cache; None for a non-nvfp4 side). Host-side torch: call it outside CUDA graphs.
        """
        from ..quant.transforms import transform_kv

        lay = self.layer(layer)
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 < headroom < math.inf:
            raise ValueError(f"headroom: expected a finite number > 0, got {headroom!r}")
        for t, nm in ((k, "k"), (v, "v")):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{nm}: expected a floating-point torch.Tensor")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim) or t.shape[0] < 1:
                raise ValueError(f"{nm}: expected shape (num_tokens >= 1, {self.num_kv_heads}, {self.head_dim}), "
                                 f"got {tuple(t.shape)}")
            if _normalize_device(t.device) != self.device:
                raise ValueError(f"{nm}: expected device {self.device}, got {t.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"v: {v.shape[0]} tokens but k has {k.shape[0]}")
        kt, vt = transform_kv(k, v, positions=positions, rope=rope, k_mean=k_mean,
                              rotation_signs=self.rotation_signs)
        out = []
        for x, gs in ((kt, lay.k_global_scale), (vt, lay.v_global_scale)):
            if gs is None:
                out.append(None)
                continue
            amax = x.abs().amax(dim=(0, 2)).double()  # (num_kv_heads,)
            if not bool(torch.isfinite(amax).all()):
                raise ValueError("calibrate: the (transformed) rows contain NaN or Inf")
            g = (amax * float(headroom) / (6.0 * 448.0)).clamp(min=2.0**-116)
            g = torch.where(amax > 0, g, torch.ones_like(g)).to(torch.float32)
            if not bool(torch.isfinite(g).all()):  # a huge headroom: the scale itself would be inf
                raise ValueError(f"headroom: {headroom!r} makes a global scale past fp32 "
                                 f"(amax {float(amax.max()):.3g})")
            gs.copy_(g)
            out.append(gs)
        return out[0], out[1]

    @property
    def kv_format(self):
        return self.k_format if self.k_format == self.v_format else (self.k_format, self.v_format)

    # --- sizes ---------------------------------------------------------------------------------
    def bytes_per_token(self, *, all_layers: bool = True) -> int:
        """Paged bytes one token costs: K and V payload plus scales, all kv heads, all layers (or one).
        The ring and global scales are fixed costs, not per token: see :attr:`nbytes`."""
        per_layer = self.num_kv_heads * (self.k_format.bytes_per_token_head(self.head_dim)
                                         + self.v_format.bytes_per_token_head(self.head_dim))
        return per_layer * (self.num_layers if all_layers else 1)

    @property
    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache (pools, scales, global scales, rings, sinks)."""
        total = 0
        for lay in self._layers:
            for t in (lay.k_data, lay.v_data, lay.k_scale_pool, lay.v_scale_pool, lay.k_global_scale,
                      lay.v_global_scale, lay.k_ring, lay.v_ring, lay.k_sink, lay.v_sink):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    @staticmethod
    def blocks_for_budget(budget_bytes: int, page_size: int, num_kv_heads: int, head_dim: int,
                          kv_format: FormatSpec = "nvfp4", num_layers: int = 1, *, recent_window: int = 0,
                          max_seqs: int = 0, dtype: torch.dtype = torch.bfloat16, sink_tokens: int = 0) -> int:
        """How many blocks fit in ``budget_bytes`` (all layers, K and V, scales, ring and sink included)."""
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes: expected an int >= 0, got {budget_bytes!r}")
        _check_pos_int(num_layers, "num_layers")
        kf, vf = kv_formats(kv_format)
        gk = PoolGeometry(1, page_size, num_kv_heads, head_dim, kf)
        gv = PoolGeometry(1, page_size, num_kv_heads, head_dim, vf)
        per_block = num_layers * (gk.bytes_per_block + gv.bytes_per_block)
        fixed = num_layers * num_kv_heads * 4 * (int(kf.has_global_scale) + int(vf.has_global_scale))
        if recent_window or sink_tokens:
            esize = torch.empty((), dtype=dtype).element_size()
            fixed += num_layers * 2 * max_seqs * num_kv_heads * (recent_window + sink_tokens) * head_dim * esize
        return max(0, (budget_bytes - fixed) // per_block)

    def blocks_needed(self, seqlen: int) -> int:
        return math.ceil(seqlen / self.page_size)

    def __repr__(self) -> str:
        ring = f", recent_window={self.recent_window}" if self.recent_window else ""
        ring += f", sink_tokens={self.sink_tokens}" if self.sink_tokens else ""
        ring += f", max_seqs={self.max_seqs}" if self.max_seqs else ""
        if self.rotate:
            ring += f", rotate=True, rotation_seed={self.rotation_seed}"
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, page_size={self.page_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, k={self.k_format!r}, "
                f"v={self.v_format!r}, device={self.device}{ring})")
