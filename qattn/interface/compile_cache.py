"""Compile cache: an in-memory dict in front of a persistent, process-safe store of AOT-compiled kernels.

``cute.compile`` keeps no disk cache and a kernel variant takes seconds to build, so every compiled variant is
exported once to an object file (``export_to_c``) and later processes load it (``cute.runtime.load_module``,
about a millisecond). Layout on disk::

    $QATTN_CACHE_DIR (default ~/.cache/qattn)/<fingerprint>/<kernel kind>/<key hash>.o   (+ .h, .lock)

The fingerprint hashes what makes old objects invalid: the qattn version and the bytes of every source file
the kernels are built from, the cutlass-dsl version and the Python version. The key hash covers every field of
the variant's key (arch, formats, head_dim, dtypes, tile and flag choices...). Writers compile under an
exclusive lock and publish with ``os.replace``, so concurrent processes compile a cold variant once and a
killed writer never leaves a truncated object; an object that fails to load is deleted and rebuilt.
Set ``QATTN_CACHE_DIR=off`` to keep compiled kernels in memory only. A cache directory that cannot be written
(a warmed image mounted read-only, a full disk) still serves its objects; variants it lacks are compiled into
memory, with a warning.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_PKG_ROOT = Path(__file__).resolve().parent.parent
# Sources whose bytes decide the generated code: the kernels, the layouts and the host-side modules whose
# constants and helpers the kernels call at trace time (the V^T region offsets, the RoPE styles and scales).
_SOURCE_DIRS = ("cute_kernels", "layouts")
_SOURCE_FILES = ("quant/v_fp8.py", "quant/transforms.py")


def cache_root() -> Path | None:
    """The persistent cache directory, or None when disabled (``QATTN_CACHE_DIR=off``)."""
    env = os.environ.get("QATTN_CACHE_DIR")
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(env) if env else Path.home() / ".cache" / "qattn"


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """Hash of qattn's kernel sources and the toolchain versions; changes invalidate every cached object."""
    import cutlass

    from .. import __version__

    h = hashlib.sha256()
    for part in (__version__, getattr(cutlass, "__version__", "?"), f"py{sys.version_info[0]}.{sys.version_info[1]}"):
        h.update(part.encode() + b"\0")
    paths = [p for sub in _SOURCE_DIRS for p in sorted((_PKG_ROOT / sub).rglob("*.py"))]
    for path in paths + [_PKG_ROOT / f for f in _SOURCE_FILES]:
        h.update(str(path.relative_to(_PKG_ROOT)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def key_hash(key: tuple) -> str:
    """Stable hash of a variant key made of str / int / float / bool / None / nested tuples."""
    return hashlib.sha256(_canonical(key).encode()).hexdigest()[:32]


def _canonical(x: Any) -> str:
    if isinstance(x, tuple):
        return "(" + ",".join(_canonical(i) for i in x) + ")"
    if isinstance(x, (bool, type(None))):
        return repr(x)
    if isinstance(x, (str, int, float)):
        return f"{type(x).__name__}:{x!r}"
    raise TypeError(f"key: unsupported element {x!r} of type {type(x).__name__} (use str/int/float/bool/None/tuple)")


@dataclass
class CacheEvent:
    """What happened for one lookup, for progress bars and the warm-up table."""

    kind: str
    key: tuple
    source: str  # "memory", "disk" or "compiled"
    seconds: float
    path: str | None


class _FileLock:
    """flock on ``path``. A shared lock on a read-only cache (an image warmed at build time, mounted read-only)
    opens an existing lock file read-only, and without one (or without flock support) reads unlocked: objects
    are published by rename, so a reader never sees a partial one. An exclusive lock that cannot be taken raises
    OSError."""

    def __init__(self, path: Path, exclusive: bool) -> None:
        self.path, self.exclusive = path, exclusive

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            if self.exclusive:
                raise
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                self.fd = None
                return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
        except OSError:  # e.g. ENOLCK on a file system without locks: a reader goes on unlocked, a writer fails
            os.close(self.fd)
            self.fd = None
            if self.exclusive:
                raise
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


class CompileCache:
    """Compiled kernels of one kind (``"decode"``, ``"insert"``...), looked up by a structural key."""

    def __init__(self, kind: str) -> None:
        if not kind.isidentifier():
            raise ValueError(f"kind: expected an identifier, got {kind!r}")
        self.kind = kind
        self._memory: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.events: list[CacheEvent] = []

    def _dir(self) -> Path | None:
        root = cache_root()
        return None if root is None else root / source_fingerprint() / self.kind

    def __contains__(self, key: tuple) -> bool:
        return key in self._memory

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The compiled function for ``key``: from memory, else from disk, else ``build()`` (which must return
        what ``cute.compile`` returns) exported to disk and loaded back."""
        fn = self._memory.get(key)
        if fn is not None:
            return fn
        with self._lock:  # one thread compiles; the others wait and then find it in memory
            fn = self._memory.get(key)
            if fn is None:
                t0 = time.perf_counter()
                fn, source, path = self._load_or_build(key, build)
                self.events.append(CacheEvent(self.kind, key, source, time.perf_counter() - t0, path))
                self._memory[key] = fn
        return fn

    def _load_or_build(self, key: tuple, build: Callable[[], Any]):
        d = self._dir()
        if d is None:
            return build(), "compiled", None
        _load_runtime_libraries()
        name = f"{self.kind}_{key_hash(key)}"
        obj = d / f"{name}.o"
        lock = d / f"{name}.lock"
        if obj.exists():
            with _FileLock(lock, exclusive=False):
                fn = _try_load(obj, name)
            if fn is not None:
                return fn, "disk", str(obj)
        try:
            d.mkdir(parents=True, exist_ok=True)
            writer = _FileLock(lock, exclusive=True).__enter__()
        except OSError as e:  # a read-only (or otherwise unwritable) cache: compile, keep it in memory only
            _warn_unwritable(d, e)
            return build(), "compiled", None
        try:
            if obj.exists():  # another process built it while we waited
                fn = _try_load(obj, name)
                if fn is not None:
                    return fn, "disk", str(obj)
                obj.unlink(missing_ok=True)  # corrupt: rebuild
            compiled = build()
            tmp = None
            try:
                tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=d))
                compiled.export_to_c(str(tmp), name, function_prefix=name)
                os.replace(tmp / f"{name}.h", d / f"{name}.h")
                os.replace(tmp / f"{name}.o", obj)  # the object last: its presence means "complete"
            except OSError as e:  # e.g. the disk is full: the kernel still runs, from memory
                _warn_unwritable(d, e)
                return compiled, "compiled", None
            finally:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            writer.__exit__()
        return compiled, "compiled", str(obj)


_WARNED: set = set()


def _warn_unwritable(d: Path, err: OSError) -> None:
    """One warning per kernel-kind directory: kernels compiled in this process stay in memory."""
    if d not in _WARNED:
        _WARNED.add(d)
        warnings.warn(f"qattn compile cache {d} cannot store new kernels ({err}); they are kept in memory only "
                      "(QATTN_CACHE_DIR=off silences this)", RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=1)
def _load_runtime_libraries() -> None:
    """Load CuTe-DSL's runtime libraries with RTLD_GLOBAL once: exporting an object resolves the CUDA runtime
    symbols (cudaLaunchKernelEx...) through them, and a loaded object calls into them."""
    import ctypes

    import cutlass.cute as cute

    for path in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _try_load(obj: Path, name: str):
    import cutlass.cute as cute

    try:
        return cute.runtime.load_module(str(obj))[name]
    except Exception:  # a truncated or foreign object: the caller rebuilds it
        return None


def cache_size() -> dict[str, int]:
    """Bytes and object count of the persistent cache (all fingerprints)."""
    root = cache_root()
    if root is None or not root.exists():
        return {"bytes": 0, "objects": 0}
    objs = list(root.rglob("*.o"))
    return {"bytes": sum(p.stat().st_size for p in root.rglob("*") if p.is_file()), "objects": len(objs)}


def clear_cache(stale_only: bool = False) -> int:
    """Delete cached objects (only those of other fingerprints with ``stale_only``); returns files removed."""
    root = cache_root()
    if root is None or not root.exists():
        return 0
    keep = source_fingerprint() if stale_only else None
    removed = 0
    for sub in root.iterdir():
        if sub.is_dir() and sub.name != keep:
            removed += sum(1 for p in sub.rglob("*") if p.is_file())
            shutil.rmtree(sub, ignore_errors=True)
    return removed
