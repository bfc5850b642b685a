"""KV formats and paged pool geometry: the single source of truth for byte addressing."""

from .formats import FORMAT_NAMES, KVFormat, KVFormatPair, kv_format, kv_formats
from .paged import (MAX_SINK_TOKENS, PAGE_SIZES, KVLayer, PagedKVCache, PoolGeometry, RingGeometry, SinkGeometry,
                    read_sources)

__all__ = [
    "FORMAT_NAMES", "KVFormat", "KVFormatPair", "kv_format", "kv_formats",
    "PAGE_SIZES", "KVLayer", "PagedKVCache", "PoolGeometry", "RingGeometry", "SinkGeometry", "MAX_SINK_TOKENS",
    "read_sources",
]
