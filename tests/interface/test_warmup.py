import os
import subprocess
import sys
from pathlib import Path

import pytest

from qattn.interface import variants, warmup

pytestmark = pytest.mark.compile
ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, cache_dir):
    env = dict(os.environ, QATTN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "qattn.interface.warmup", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_compiles_on_cpu_then_reports_cached(tmp_path):
    args = ["--arch", "sm_90a,sm_100a", "--kernels", "fp4_dequant,fp4_quantize", "--kv-formats", "nvfp4,mxfp4",
            "--head-dims", "64,128", "--jobs", "2"]
    first = run_cli(*args, cache_dir=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    # dequant: 2 formats x 2 head_dims; quantize: nvfp4 + mxfp4 floor/rceil, x 2 head_dims; x 2 arches
    n = 2 * (2 * 2 + 3 * 2)
    assert f"{n} variants, 0 failed" in first.stdout
    rows = [ln for ln in first.stdout.splitlines() if ln.startswith(("sm_90a", "sm_100a"))]
    assert len(rows) == n and all(" new " in ln for ln in rows)
    assert "]" in first.stderr  # the progress bar
    second = run_cli(*args, cache_dir=tmp_path)
    rows = [ln for ln in second.stdout.splitlines() if ln.startswith(("sm_90a", "sm_100a"))]
    assert second.returncode == 0 and len(rows) == n and all(" cached " in ln for ln in rows)
    assert len(list(tmp_path.rglob("*.o"))) == n


def test_list_dry_run_and_errors(tmp_path, capsys):
    assert warmup.main(["--arch", "sm_90a", "--list"]) == 0
    out = capsys.readouterr().out
    assert "fp4_dequant" in out and "nvfp4 D128" in out and "variants" in out
    assert warmup.main(["--arch", "sm_100a", "--dry-run", "--kernels", "fp4_quantize", "--head-dims", "64"]) == 0
    assert "5 variants" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        warmup.main(["--arch", "sm_80"])
    with pytest.raises(SystemExit):
        warmup.main(["--arch", "sm_90a", "--kernels", "nope"])


def test_failing_variant_exits_nonzero(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path))

    def broken_build():
        raise RuntimeError("ptxas exploded")

    @variants.register("broken_test_kind")
    def _enum(arch, **_):
        return [variants.Variant("broken_test_kind", ("b", arch), "always fails", broken_build)]

    try:
        assert warmup.main(["--arch", "sm_90a", "--kernels", "broken_test_kind"]) == 1
        out = capsys.readouterr().out
        assert "failed" in out and "ptxas exploded" in out
    finally:
        variants._ENUMERATORS.pop("broken_test_kind")
