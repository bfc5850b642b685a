"""qattn: CuTe-DSL kernels for low-precision attention on Hopper (SM90) and Blackwell (SM100)."""

from . import quant, reference
from .layouts import FORMAT_NAMES, KVFormat, KVFormatPair, KVLayer, PagedKVCache, kv_format, kv_formats
from .reference import flatten_kv_reference, write_kv_reference
from .interface.decode import flash_attn_with_kvcache
from .interface.kv_cache_ops import flatten_kv, inspect_kv, write_kv
from .interface.prefill import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                               flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                               flash_attn_varlen_qkvpacked_func)
from .quant.transforms import RoPE

__version__ = "0.1.0"

__all__ = [
    "FORMAT_NAMES", "KVFormat", "KVFormatPair", "KVLayer", "PagedKVCache", "kv_format", "kv_formats",
    "flatten_kv_reference", "write_kv_reference", "write_kv", "flatten_kv", "inspect_kv", "RoPE",
    "flash_attn_with_kvcache", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "quant", "reference",
    "__version__",
]
