import os
import subprocess
import sys
from pathlib import Path

import pytest

from qattn.interface import CompileCache, cache_size, clear_cache, key_hash, source_fingerprint

pytestmark = pytest.mark.compile
WORKER = [sys.executable, "-m", "tests.interface._cache_worker"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path / "qc"))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    return tmp_path / "qc"


BASE = ("decode", "sm_90a", ("e2m1", "e4m3", 16, True, "nvfp4"), 128, "bf16", 8, 64, True, False)


def test_key_hash_stable_and_unique():
    assert key_hash(BASE) == key_hash(tuple(BASE))
    # a fresh interpreter computes the same hash (no salted str hashing)
    out = subprocess.run([sys.executable, "-c", f"from qattn.interface import key_hash; print(key_hash({BASE!r}))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == key_hash(BASE)
    variants = {key_hash(BASE)}
    for i, field in enumerate(BASE):
        other = ("x",) if isinstance(field, tuple) else (not field if isinstance(field, bool) else
                                                          field + 1 if isinstance(field, int) else field + "x")
        variants.add(key_hash(BASE[:i] + (other,) + BASE[i + 1:]))
    assert len(variants) == len(BASE) + 1  # every field changes the key
    assert key_hash((1,)) != key_hash(("1",)) and key_hash((True,)) != key_hash((1,))
    with pytest.raises(TypeError, match="key"):
        key_hash((object(),))


def test_memory_then_disk(cache_dir):
    from tests.interface._cache_worker import build

    c1 = CompileCache("test")
    f1 = c1.get(("twice", 1), build())
    assert c1.events[-1].source == "compiled" and c1.get(("twice", 1), build()) is f1
    assert len(c1.events) == 1  # the second lookup was served from memory
    objs = list(cache_dir.rglob("*.o"))
    assert len(objs) == 1 and objs[0].parent.parent.name == source_fingerprint()
    c2 = CompileCache("test")  # a fresh in-memory cache finds the object on disk
    c2.get(("twice", 1), build())
    assert c2.events[-1].source == "disk" and c2.events[-1].seconds < 0.5
    assert cache_size()["objects"] == 1


def test_corrupt_object_is_rebuilt(cache_dir):
    from tests.interface._cache_worker import build

    CompileCache("test").get(("twice", 2), build())
    obj = next(cache_dir.rglob("*.o"))
    obj.write_bytes(b"not an object file")
    c = CompileCache("test")
    c.get(("twice", 2), build())
    assert c.events[-1].source == "compiled" and obj.stat().st_size > 1000


def test_two_processes_compile_once(cache_dir, tmp_path):
    log = tmp_path / "builds.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(WORKER + [str(log), "1.0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    sources = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert sources == ["compiled", "disk"]
    assert log.read_text().count("built") == 1
    assert len(list(cache_dir.rglob("*.o"))) == 1 and not list(cache_dir.rglob(".*"))  # no temp dirs left


def test_disabled_and_clear(cache_dir, monkeypatch):
    from tests.interface._cache_worker import build

    CompileCache("test").get(("twice", 3), build())
    stale = cache_dir / "0000stale" / "test"
    stale.mkdir(parents=True)
    (stale / "x.o").write_bytes(b"old")
    assert clear_cache(stale_only=True) == 1 and cache_size()["objects"] == 1
    assert clear_cache() >= 1 and cache_size() == {"bytes": 0, "objects": 0}
    monkeypatch.setenv("QATTN_CACHE_DIR", "off")
    c = CompileCache("test")
    c.get(("twice", 4), build())
    assert c.events[-1].path is None and not any(cache_dir.rglob("*.o"))


@pytest.fixture
def read_only(cache_dir, monkeypatch):
    """The cache directory as a read-only mount shows it: opening a file there for writing fails with EROFS."""
    import errno

    real_open = os.open

    def ro_open(path, flags, *a):
        if str(path).startswith(str(cache_dir)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    return lambda: monkeypatch.setattr(os, "open", ro_open)


def test_read_only_cache_loads_and_compiles_in_memory(cache_dir, read_only):
    """A cache warmed at image build and mounted read-only: its objects load (shared lock on the existing lock
    file opened read-only); a variant it lacks compiles and stays in memory, with one warning."""
    from tests.interface._cache_worker import build

    CompileCache("test").get(("ro", 1), build())
    read_only()
    c = CompileCache("test")
    c.get(("ro", 1), build())
    assert c.events[-1].source == "disk"
    for lock in cache_dir.rglob("*.lock"):
        lock.unlink()  # a warmed image without lock files: read unlocked
    c = CompileCache("test")
    c.get(("ro", 1), build())
    assert c.events[-1].source == "disk"
    with pytest.warns(RuntimeWarning, match="cannot store new kernels"):
        c.get(("ro", 2), build())
    assert c.events[-1].source == "compiled" and c.events[-1].path is None
    assert len(list(cache_dir.rglob("*.o"))) == 1


@pytest.mark.parametrize("rel", ["cute_kernels/sm90/prefill_int8.py", "layouts/paged.py", "quant/v_fp8.py",
                                 "quant/transforms.py"])
def test_fingerprint_covers_the_sources_kernels_are_traced_from(tmp_path, monkeypatch, rel):
    """An edit of any module whose code or constants end up in a compiled kernel (the V^T region offsets of
    quant/v_fp8.py, the RoPE styles of quant/transforms.py...) must change the fingerprint."""
    import shutil

    from qattn.interface import compile_cache

    pkg = Path(compile_cache.__file__).resolve().parents[1]
    copy = tmp_path / "qattn"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(compile_cache, "_PKG_ROOT", copy)
    compile_cache.source_fingerprint.cache_clear()
    before = compile_cache.source_fingerprint()
    with open(copy / rel, "a") as f:
        f.write("\n# edited\n")
    compile_cache.source_fingerprint.cache_clear()
    try:
        assert compile_cache.source_fingerprint() != before
    finally:
        compile_cache.source_fingerprint.cache_clear()


def test_file_system_without_locks(cache_dir, monkeypatch):
    """flock failing (ENOLCK, e.g. NFS without locking): objects still load unlocked, a new variant compiles into
    memory with a warning, and no lock file descriptor is left open."""
    import errno
    import fcntl

    from qattn.interface import compile_cache
    from tests.interface._cache_worker import build

    CompileCache("test").get(("nolock", 1), build())

    def no_locks(fd, op):
        if op != fcntl.LOCK_UN:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(compile_cache.fcntl, "flock", no_locks)
    fds = len(os.listdir("/proc/self/fd"))
    c = CompileCache("test")
    c.get(("nolock", 1), build())
    assert c.events[-1].source == "disk"
    with pytest.warns(RuntimeWarning, match="cannot store new kernels"):
        c.get(("nolock", 2), build())
    assert c.events[-1].source == "compiled" and c.events[-1].path is None
    assert len(os.listdir("/proc/self/fd")) == fds
