"""qattn: CuTe-DSL kernels for low-precision attention on Hopper (SM90) and Blackwell (SM100)."""

from .layouts import FORMAT_NAMES, KVFormat, KVFormatPair, kv_format, kv_formats

__version__ = "0.1.0"

__all__ = ["FORMAT_NAMES", "KVFormat", "KVFormatPair", "kv_format", "kv_formats", "__version__"]
