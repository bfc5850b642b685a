"""KV formats and paged pool geometry: the single source of truth for byte addressing."""

from .formats import FORMAT_NAMES, KVFormat, KVFormatPair, kv_format, kv_formats
from .paged import PAGE_SIZES, KVLayer, PagedKVCache, PoolGeometry, RingGeometry

__all__ = [
    "FORMAT_NAMES", "KVFormat", "KVFormatPair", "kv_format", "kv_formats",
    "PAGE_SIZES", "KVLayer", "PagedKVCache", "PoolGeometry", "RingGeometry",
]
