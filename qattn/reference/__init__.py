"""Exact torch references: cache writes/reads and fp64 attention, the oracles every kernel is tested against."""

from .attention import attention_reference, lse_smoothing_shift, paged_decode_reference, prefill_reference
from .kv_ops import check_block_table, flatten_kv_reference, write_kv_reference

__all__ = ["attention_reference", "lse_smoothing_shift", "paged_decode_reference", "prefill_reference",
           "check_block_table", "flatten_kv_reference", "write_kv_reference"]
