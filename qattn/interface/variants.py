"""Registry of compilable kernel variants: what ``qattn-warmup`` enumerates and the launchers compile.

A kernel family registers an enumerator ``fn(arch, **filters) -> list[Variant]``; a :class:`Variant` knows its
cache key and how to build itself for its arch (``compile_for_arch``: the ``--gpu-arch`` option, which also
works on a machine without a GPU). Launchers and the CLI go through the same :class:`CompileCache` per kind, so a variant compiled by
the CLI is the one a launcher loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .compile_cache import CompileCache

ARCHES = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class Variant:
    kind: str  # kernel kind: "fp4_dequant", "decode", "insert", ...
    key: tuple  # full structural key, arch included
    label: str  # short human description for tables
    build: Callable[[], Any] = field(compare=False, repr=False)


_ENUMERATORS: dict[str, Callable[..., list[Variant]]] = {}
_CACHES: dict[str, CompileCache] = {}


def register(kind: str):
    """Decorator: register the variant enumerator of a kernel kind."""
    def deco(fn):
        _ENUMERATORS[kind] = fn
        return fn
    return deco


def kinds() -> list[str]:
    _import_families()
    return sorted(_ENUMERATORS)


def enumerate_variants(kind: str, arch: str, **filters) -> list[Variant]:
    _import_families()
    if kind not in _ENUMERATORS:
        raise ValueError(f"kernels: unknown kernel kind {kind!r}; known: {sorted(_ENUMERATORS)}")
    return _ENUMERATORS[kind](arch, **filters)


def cache_for(kind: str) -> CompileCache:
    if kind not in _CACHES:
        _CACHES[kind] = CompileCache(kind)
    return _CACHES[kind]


_CAPABILITY: dict[int, tuple[int, int]] = {}


def device_capability(device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, remembered per CUDA device index (it cannot change; the
    query costs ~5 µs, and an eager ``flash_attn_func`` asked it five times)."""
    import torch

    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
        cap = _CAPABILITY.get(device.index)
        if cap is None:
            cap = _CAPABILITY[device.index] = tuple(torch.cuda.get_device_capability(device))
        return cap
    return tuple(torch.cuda.get_device_capability(device))


def kernel_arch(device, kernels: str) -> str:
    """The arch whose ``kernels`` (e.g. "decode") a call on ``device`` runs: compute capability 10.0 ->
    "sm_100a" (Blackwell kernels, never run on hardware here), 9.0 -> "sm_90a", anything else a clear error
    (the same devices as :func:`supported_arch`: "a" targets run on their exact capability only, so 10.3 is
    refused too)."""
    major, minor = device_capability(device)
    if (major, minor) == (10, 0):
        return "sm_100a"
    if (major, minor) != (9, 0):
        raise ValueError(f"q: device {device} is sm_{major}{minor}; the {kernels} kernels are built for SM90 "
                         "(H100/H200) and SM100 (B200/GB200) only (no fallback)")
    return "sm_90a"


def supported_arch(device=None) -> str:
    """The arch name of a CUDA device, or a clear error when qattn has no kernels for it."""
    from ..cute_kernels.compile_utils import device_arch

    arch = device_arch(device)
    if arch not in ARCHES:
        raise RuntimeError(f"qattn kernels need an SM90 (Hopper) or SM100 (Blackwell) GPU; this one is {arch}")
    return arch


def _import_families() -> None:
    # Importing a kernel family's module registers it; keep this list in step with the families.
    from ..cute_kernels import fp4_rows  # noqa: F401
    from ..cute_kernels import kv_flatten, kv_insert  # noqa: F401
    from ..cute_kernels import combine  # noqa: F401
    from ..cute_kernels.sm90 import chunk_reduce  # noqa: F401
    from ..cute_kernels.sm90 import decode, qk_int8_kmean, qk_int8_quant, v_fp8_quant  # noqa: F401
    from . import prefill  # noqa: F401
