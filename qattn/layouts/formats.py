"""KV-cache formats: payload dtype, scale dtype, scale block and scale rule.

A format says how one token-head row of ``head_dim`` values is stored: the payload bytes and the scale
bytes that decode it. Everything that reads or writes a cache (reference encoders, kernels, the inspector)
takes its byte counts from here. The numeric rules themselves are in ``qattn.quant.reference`` and
``docs/formats.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

import torch

# payload -> (bits per element, torch storage dtype of the data pool)
_PAYLOADS = {
    "e2m1": (4, torch.uint8),  # two values per byte, element 2i in the low nibble
    "e4m3": (8, torch.uint8),  # raw FP8 E4M3FN bits; ``pool.view(torch.float8_e4m3fn)`` to read them
    "int8": (8, torch.int8),
    "bf16": (16, torch.bfloat16),
}
# scale dtype -> (bytes per scale, torch storage dtype of the scale pool)
_SCALES = {
    "e4m3": (1, torch.uint8),  # FP8 E4M3FN bits (NVFP4 block scale)
    "ue8m0": (1, torch.uint8),  # power-of-two exponent, byte = e + 127 (MX block scale)
    "fp32": (4, torch.float32),  # one scale per token-head row
}
# encoder-side block-scale searches a cache can be written with (KVFormat.scale_search; docs/accuracy.md,
# "Encoder-side scale search": the best perplexity for nvfp4 and for MX)
CACHE_SCALE_SEARCHES = ("msenb",)
_RULES = {
    "none": ("bf16",),
    "absmax": ("e4m3", "int8"),  # per token-head: scale = amax / qmax
    "nvfp4": ("e2m1",),  # two-level: E4M3 block scale times fp32 global scale
    "floor": ("e2m1",),  # OCP MX: e = floor(log2(amax)) - 2
    "rceil": ("e2m1",),  # e = ceil(log2(amax / 6)), computed exactly from the fp32 bits
}


@dataclass(frozen=True)
class KVFormat:
    """How one token-head row is quantized and stored.

    Attributes:
        name: the registered name (``"nvfp4"``, ``"mxfp4"``...).
        payload: element encoding, one of ``"e2m1"``, ``"e4m3"``, ``"int8"``, ``"bf16"``.
        scale_dtype: ``"e4m3"``, ``"ue8m0"``, ``"fp32"`` or ``None`` (no scale).
        scale_block: values per scale along head_dim; ``None`` means one scale for the whole row.
        has_global_scale: whether a per-(layer, kv_head) fp32 scale multiplies every decoded value.
        scale_rule: how the scale is chosen: ``"none"``, ``"absmax"``, ``"nvfp4"``, ``"floor"``, ``"rceil"``.
        scale_search: FP4 only, None or ``"msenb"``: the writer tries neighbouring block scales and keeps the one
            with the smallest block squared error (``qattn.quant.reference.quantize``'s ``scale_search``; nvfp4:
            the rule's E4M3 byte and its two neighbours, MX: the rule's exponent and the other of floor /
            floor + 1). Encoder-side only: the stored bytes mean the same, readers ignore it.
    """

    name: str
    payload: str
    scale_dtype: str | None
    scale_block: int | None
    has_global_scale: bool
    scale_rule: str
    scale_search: str | None = None

    def __post_init__(self) -> None:
        if self.payload not in _PAYLOADS:
            raise ValueError(f"payload: unknown element encoding {self.payload!r}; expected one of {sorted(_PAYLOADS)}")
        if self.scale_dtype is not None and self.scale_dtype not in _SCALES:
            raise ValueError(f"scale_dtype: unknown {self.scale_dtype!r}; expected one of {sorted(_SCALES)} or None")
        if self.scale_rule not in _RULES or self.payload not in _RULES[self.scale_rule]:
            raise ValueError(f"scale_rule: {self.scale_rule!r} does not apply to payload {self.payload!r}")
        if self.scale_block is not None and self.scale_block not in (16, 32):
            raise ValueError(f"scale_block: must be 16, 32 or None, got {self.scale_block}")
        if (self.scale_dtype is None) != (self.scale_rule == "none"):
            raise ValueError("scale_dtype: a format has a scale exactly when its scale_rule is not 'none'")
        if self.scale_rule in ("floor", "rceil") and self.scale_dtype != "ue8m0":
            raise ValueError("scale_dtype: MX rules need 'ue8m0' scales")
        if self.scale_rule == "nvfp4" and not (self.scale_dtype == "e4m3" and self.has_global_scale):
            raise ValueError("scale_dtype: nvfp4 needs 'e4m3' block scales and a global scale")
        if self.scale_search is not None:
            if self.scale_search not in CACHE_SCALE_SEARCHES:
                raise ValueError(f"scale_search: expected None or one of {CACHE_SCALE_SEARCHES}, "
                                 f"got {self.scale_search!r}")
            if self.payload != "e2m1":
                raise ValueError(f"scale_search: only FP4 formats take a scale search, not {self.name!r}")

    # --- element and byte counts -------------------------------------------------------------
    @property
    def bits(self) -> int:
        return _PAYLOADS[self.payload][0]

    @property
    def is_packed(self) -> bool:
        """Two elements per byte (FP4)."""
        return self.bits == 4

    @property
    def is_quantized(self) -> bool:
        return self.scale_rule != "none"

    @property
    def data_dtype(self) -> torch.dtype:
        """Storage dtype of the data pool."""
        return _PAYLOADS[self.payload][1]

    @property
    def scale_storage_dtype(self) -> torch.dtype | None:
        """Storage dtype of the scale pool, ``None`` when the format has no scale."""
        return None if self.scale_dtype is None else _SCALES[self.scale_dtype][1]

    def head_dim_multiple(self) -> int:
        """head_dim must be a multiple of this: the scale block for block-scaled formats, else 16
        (so that every payload row is a whole number of 16-byte vectors for the kernels' loads)."""
        return self.scale_block if self.scale_block else 16

    def check_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        """Raise ``ValueError`` naming ``name`` when this format cannot store rows of ``head_dim`` values."""
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise TypeError(f"{name}: expected a positive int, got {head_dim!r}")
        m = self.head_dim_multiple()
        if head_dim % m:
            raise ValueError(f"{name}: {head_dim} is not a multiple of {m}, which format {self.name!r} needs")

    def row_elems(self, head_dim: int) -> int:
        """Elements of ``data_dtype`` in one token-head payload row."""
        self.check_head_dim(head_dim)
        return head_dim // 2 if self.is_packed else head_dim

    def payload_bytes(self, head_dim: int) -> int:
        """Bytes of payload in one token-head row."""
        self.check_head_dim(head_dim)
        return head_dim * self.bits // 8

    def num_scales(self, head_dim: int) -> int:
        """Scales per token-head row (0 for unscaled formats)."""
        self.check_head_dim(head_dim)
        if self.scale_dtype is None:
            return 0
        return head_dim // self.scale_block if self.scale_block else 1

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of scales per token-head row."""
        n = self.num_scales(head_dim)
        return 0 if n == 0 else n * _SCALES[self.scale_dtype][0]

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Payload plus scale bytes for one token of one KV head, for K or for V alone."""
        return self.payload_bytes(head_dim) + self.scale_bytes(head_dim)

    @property
    def key(self) -> tuple:
        """Everything that changes the code that reads this format or writes it plainly (for compile caches);
        ``scale_search``, which only the insert kernel sees, is in that kernel's own key."""
        return (self.payload, self.scale_dtype, self.scale_block, self.has_global_scale, self.scale_rule)

    def __repr__(self) -> str:
        extra = f", rule={self.scale_rule}" if self.scale_rule in ("floor", "rceil") else ""
        extra += f", scale_search={self.scale_search}" if self.scale_search else ""
        return f"KVFormat({self.name}{extra})"


_REGISTRY: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("bf16", "bf16", None, None, False, "none"),
        KVFormat("fp8", "e4m3", "fp32", None, False, "absmax"),
        KVFormat("int8", "int8", "fp32", None, False, "absmax"),
        KVFormat("nvfp4", "e2m1", "e4m3", 16, True, "nvfp4"),
        # rceil by default: better or equal to the OCP floor rule in every paired perplexity comparison of the
        # accuracy harness (docs/accuracy.md, "What the numbers argue for"); floor stays available by name.
        KVFormat("mxfp4", "e2m1", "ue8m0", 32, False, "rceil"),
        KVFormat("mxfp4_b16", "e2m1", "ue8m0", 16, False, "rceil"),
    )
}

FORMAT_NAMES: tuple[str, ...] = tuple(_REGISTRY)


@dataclass(frozen=True)
class KVFormatPair:
    """Separate formats for keys and values (keys are more sensitive to 4-bit quantization)."""

    k: KVFormat
    v: KVFormat

    @property
    def key(self) -> tuple:
        return (self.k.key, self.v.key)

    def bytes_per_token_head(self, head_dim: int) -> int:
        """K plus V bytes for one token of one KV head."""
        return self.k.bytes_per_token_head(head_dim) + self.v.bytes_per_token_head(head_dim)

    def check_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        self.k.check_head_dim(head_dim, name)
        self.v.check_head_dim(head_dim, name)

    def __repr__(self) -> str:
        return f"KVFormatPair(k={self.k!r}, v={self.v!r})"


FormatSpec = Union[str, KVFormat, KVFormatPair, tuple]


def _one(spec: str | KVFormat, scale_rule: str | None, arg: str, scale_search: str | None = None) -> KVFormat:
    if isinstance(spec, KVFormat):
        fmt = spec
    elif isinstance(spec, str):
        if spec not in _REGISTRY:
            raise ValueError(f"{arg}: unknown KV format {spec!r}; expected one of {list(FORMAT_NAMES)}")
        fmt = _REGISTRY[spec]
    else:
        raise TypeError(f"{arg}: expected a format name or KVFormat, got {type(spec).__name__}")
    if scale_rule is not None and scale_rule != fmt.scale_rule:
        if fmt.scale_rule not in ("floor", "rceil"):
            raise ValueError(f"scale_rule: only MX formats take a scale rule, not {fmt.name!r}")
        fmt = dataclasses.replace(fmt, scale_rule=scale_rule)  # __post_init__ validates the rule
    if scale_search is not None and scale_search != fmt.scale_search:
        fmt = dataclasses.replace(fmt, scale_search=scale_search)  # __post_init__ validates the search
    return fmt


def kv_format(spec: FormatSpec, *, scale_rule: str | None = None,
              scale_search: str | None = None) -> KVFormat | KVFormatPair:
    """Look up a KV format.

    ``spec`` is a name (``"bf16"``, ``"fp8"``, ``"int8"``, ``"nvfp4"``, ``"mxfp4"``, ``"mxfp4_b16"``), a
    :class:`KVFormat`, or a ``(k_format, v_format)`` pair, which gives a :class:`KVFormatPair`.
    ``scale_rule`` picks the MX exponent rule (``"rceil"``, qattn's default, or ``"floor"``, the OCP MX v1.0
    rule) for MX formats. ``scale_search="msenb"`` makes writers search the block scale (FP4 formats; of a pair,
    the FP4 sides only, and at least one side must be FP4): see :class:`KVFormat`.
    """
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"kv_format: a pair is (k_format, v_format), got {len(spec)} entries")
        spec = KVFormatPair(_one(spec[0], None, "k_format"), _one(spec[1], None, "v_format"))
    if isinstance(spec, KVFormatPair):
        if scale_rule is None and scale_search is None:
            return spec
        if scale_search is not None and "e2m1" not in (spec.k.payload, spec.v.payload):
            raise ValueError(f"scale_search: only FP4 formats take a scale search, not {spec.k.name!r} / "
                             f"{spec.v.name!r}")
        return KVFormatPair(*(_one(f, scale_rule, arg, scale_search if f.payload == "e2m1" else None)
                              for f, arg in ((spec.k, "k_format"), (spec.v, "v_format"))))
    return _one(spec, scale_rule, "kv_format", scale_search)


def kv_formats(spec: FormatSpec) -> tuple[KVFormat, KVFormat]:
    """``(k_format, v_format)`` for any spec that :func:`kv_format` takes."""
    f = kv_format(spec)
    return (f.k, f.v) if isinstance(f, KVFormatPair) else (f, f)
