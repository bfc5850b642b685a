"""Compile CuTe-DSL callables for a named GPU architecture, also on a machine without a GPU.

What works in nvidia-cutlass-dsl 4.8.1 (checked on a CPU-only machine):

* The DSL reads ``CUTE_DSL_ARCH`` once, when ``cutlass`` is imported; setting it later changes nothing. The
  arch that counts during tracing (``get_arch_enum``, used by wgmma / tcgen05 op checks) and code generation is
  the ``--gpu-arch`` compile option, so :func:`compile_for_arch` passes that (and also sets ``CUTE_DSL_ARCH``
  for the duration of the call, for any tool that reads the environment, then restores it).
* ``compiled.artifacts.PTX`` is ``None`` unless PTX is kept. ``--keep-ptx --dump-dir DIR`` fills it (the DSL
  writes ``DIR/<name>.<arch>.ptx`` and reads it back); a temporary directory holds it and is removed after.
* Without a GPU the DSL's detected arch defaults to sm_100a; compiling for another arch builds no JIT engine,
  which is fine for PTX checks. On a GPU, compile for the device's own arch to get a launchable function.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from typing import Any, Iterator

import cutlass.cute as cute

__all__ = ["compile_for_arch", "device_arch", "ptx_has", "ptx_count", "ptx_lines", "last_compile_seconds"]

_ARCH_RE = re.compile(r"^sm_\d+[af]?$")
last_compile_seconds: float = 0.0  # wall time of the most recent compile_for_arch call


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def device_arch(device: Any = None) -> str:
    """The arch string for a CUDA device (``sm_90a`` for an H100), as compile_for_arch takes it."""
    from ..interface.variants import device_capability

    major, minor = device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def compile_for_arch(
    fn: Any, *args: Any, arch: str = "sm_90a", options: str | None = None, keep_ptx: bool = True
) -> tuple[Any, str | None]:
    """``cute.compile(fn, *args)`` for ``arch``; returns ``(compiled, ptx_text)``.

    ``options`` are extra ``cute.compile`` option flags (a string such as ``"--opt-level 3"``). With
    ``keep_ptx=False`` no PTX is written and ``ptx_text`` is ``None`` (the launchers use this). The process
    environment is the same after the call as before it, whether the compile succeeds or raises.
    """
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(f"arch: expected a name like 'sm_90a' or 'sm_100a', got {arch!r}")
    global last_compile_seconds
    flags = [f"--gpu-arch {arch}"]
    if options:
        flags.append(options)
    t0 = time.perf_counter()
    with _env("CUTE_DSL_ARCH", arch), contextlib.ExitStack() as stack:
        if keep_ptx:
            dump_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="qattn_ptx_"))
            flags.append(f"--keep-ptx --dump-dir {dump_dir}")
        compiled = cute.compile(fn, *args, options=" ".join(flags))
        ptx = None
        if keep_ptx:
            ptx = getattr(getattr(compiled, "artifacts", None), "PTX", None)
            if ptx is None:  # fall back to the dumped file
                files = [f for f in os.listdir(dump_dir) if f.endswith(".ptx")]
                if files:
                    with open(os.path.join(dump_dir, sorted(files)[-1])) as fh:
                        ptx = fh.read()
    last_compile_seconds = time.perf_counter() - t0
    return compiled, ptx


# --------------------------------------------------------------------------------------------------
# PTX inspection
# --------------------------------------------------------------------------------------------------
def _strip_comments(ptx: str) -> str:
    return re.sub(r"//[^\n]*", "", ptx)


def ptx_lines(ptx: str, pattern: str) -> list[str]:
    """Instruction lines (comments stripped) that match the regular expression ``pattern``."""
    rx = re.compile(pattern)
    return [ln.strip() for ln in _strip_comments(ptx).splitlines() if rx.search(ln)]


def ptx_count(ptx: str, pattern: str) -> int:
    """How many lines of ``ptx`` (comments stripped) match the regular expression ``pattern``."""
    return len(ptx_lines(ptx, pattern))


def ptx_has(ptx: str, pattern: str) -> bool:
    """Whether any line of ``ptx`` (comments stripped) matches the regular expression ``pattern``."""
    return ptx_count(ptx, pattern) > 0
