"""Thin torch entry points, compile caches and the warm-up CLI."""

from .compile_cache import CompileCache, cache_root, cache_size, clear_cache, key_hash, source_fingerprint

__all__ = ["CompileCache", "cache_root", "cache_size", "clear_cache", "key_hash", "source_fingerprint"]
