import os
import re
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


def check_compiles_then_cached(args, arch: str, n: int, cache_dir) -> None:
    """The warmup CLI with ``args`` on an empty cache compiles ``n`` variants with no failure; run again, it lists
    the same ``n`` rows of ``arch``, all cached."""
    first = run_cli(*args, cache_dir=cache_dir)
    assert first.returncode == 0 and f"{n} variants, 0 failed" in first.stdout, first.stdout + first.stderr
    second = run_cli(*args, cache_dir=cache_dir)
    rows = [ln for ln in second.stdout.splitlines() if ln.startswith(arch)]
    assert second.returncode == 0 and len(rows) == n and all(" cached " in ln for ln in rows)


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


@pytest.mark.parametrize("args,err", [
    (["--head-dims", "64,abc"], "--head-dims: expected a comma list of ints"),
    (["--gqa", "0"], "--gqa"), (["--page-sizes", "7"], "--page-sizes"), (["--seqlen-q", "0"], "--seqlen-q"),
    (["--recent-windows", "-1"], "--recent-windows"), (["--sink-tokens", "999"], "--sink-tokens"),
    (["--softcap", "nan"], "--softcap"), (["--softcap", "abc"], "--softcap"), (["--q-dtypes", "fp32"], "--q-dtypes"),
    (["--kv-formats", "nvfp4,nvfp5"], "unknown \\['nvfp5'\\]"), (["--jobs", "-3"], "--jobs"),
    (["--scale-search", "mse"], "--scale-search"),
    (["--kernels", "kv_insert", "--head-dims", "96"], "not supported by the insert kernel"),
])
def test_bad_filter_values_are_argparse_errors(capsys, args, err):
    """A bad value is a usage error naming its flag (exit 2), not a traceback from inside an enumerator."""
    with pytest.raises(SystemExit) as e:
        warmup.main(["--arch", "sm_90a", "--list", *args])
    assert e.value.code == 2
    assert re.search(err, capsys.readouterr().err)


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


# --------------------------------------------------------------------------------------------------
# decode and combine: the warmed variants are the ones the launcher asks for
# --------------------------------------------------------------------------------------------------
def test_decode_and_combine_listed(capsys):
    assert "decode" in variants.kinds() and "combine" in variants.kinds()
    assert warmup.main(["--arch", "sm_90a", "--list", "--kernels", "decode,combine"]) == 0
    out = capsys.readouterr().out
    # defaults: 6 formats x 2 head_dims x gqa {1,4,8} x pages {16,64,128} x split on/off; combine: 2 head_dims
    assert "decode" in out and "combine" in out and f"{6 * 2 * 3 * 3 * 2 + 2} variants" in out
    assert "nvfp4 D128 gqa8 page16 sq1 split" in out and "D128 out bf16" in out
    # sm_100a (tests/sm100/test_warmup_sm100.py): the tcgen05 kernel's FP4 variants (nvfp4 and mxfp4_b16 at both
    # head dims, mxfp4 at 128: 5 x 3 x 3 x 2), the mma.sync kernel's for the rest of the same grid, the combine
    assert warmup.main(["--arch", "sm_100a", "--dry-run", "--kernels", "decode,combine"]) == 0
    out = capsys.readouterr().out
    assert f"{6 * 2 * 3 * 3 * 2 + 2} variants" in out and "D128 out bf16" in out
    lines = out.splitlines()
    assert sum(line.endswith("(sm100, never ran)") for line in lines) == 5 * 3 * 3 * 2
    assert any(line.endswith(" fp8 D64 gqa1 page16 sq1 (mma.sync on sm100, never ran)") for line in lines)
    assert not any(" nvfp4 " in line and "mma.sync" in line for line in lines)


def test_decode_dry_run_filters(capsys):
    args = ["--arch", "sm_90a", "--dry-run", "--kernels", "decode,combine", "--kv-formats", "nvfp4,int8+nvfp4",
            "--head-dims", "64,128", "--gqa", "4,16", "--page-sizes", "16", "--seqlen-q", "1,16",
            "--recent-windows", "0,64", "--q-dtypes", "bf16,f16"]
    assert warmup.main(args) == 0
    out = capsys.readouterr().out
    # 2 formats x 2 D x 2 gqa x 1 page x 2 seqlen_q x 2 windows x 2 q dtypes x 2 (split); combine 2 D x 2 dtypes
    assert f"{2 * 2 * 2 * 2 * 2 * 2 * 2 + 4} variants" in out
    assert "int8+nvfp4 D128 gqa16 page16 sq16 W64 f16 split" in out


@pytest.mark.parametrize("fmt,window,dtype", [("nvfp4", 0, "bf16"), (("int8", "nvfp4"), 64, "bf16"),
                                              ("bf16", 64, "f16"), ("mxfp4", 0, "f16")])
def test_warmed_keys_equal_runtime_keys(monkeypatch, fmt, window, dtype):
    """The keys ``flash_attn_with_kvcache`` looks up (through its real ``_kernels``, with the compile step
    replaced by a recorder) are among the keys ``qattn-warmup`` compiles for the same filters."""
    import torch

    from qattn import PagedKVCache
    from qattn.interface import decode as idec

    asked = []
    monkeypatch.setattr(idec, "_get", lambda kind, key, build, args: asked.append((kind, key)) or key)
    monkeypatch.setattr(idec, "_KERNELS", {})
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    name = fmt if isinstance(fmt, str) else "+".join(fmt)
    for D in (64, 128):
        for page in (16, 128):
            cache = PagedKVCache(1, 4, page, 2, D, fmt, recent_window=window, max_seqs=2 if window else 0,
                                 dtype=tdt)
            for group, sq in ((1, 1), (8, 4), (16, 16)):
                for split in (False, True):
                    idec._kernels("sm_90a", cache, dtype, group, sq, True, split)
                    idec._kernels("sm_90a", cache, dtype, group, sq, True, split, True)  # window_size
    warm = set()
    for kind in ("decode", "combine"):
        warm |= {(kind, v.key) for v in variants.enumerate_variants(
            kind, "sm_90a", kv_formats=[name], head_dims=[64, 128], gqa=[1, 8, 16], page_sizes=[16, 128],
            seqlen_q=[1, 4, 16], recent_windows=[window], q_dtypes=[dtype], sliding_window=True)}
    assert asked and {k for k, _ in asked} == {"decode", "combine"}
    missing = [k for k in asked if k not in warm]
    assert not missing, missing


def test_cli_compiles_decode_and_combine_on_cpu(tmp_path):
    args = ["--arch", "sm_90a", "--kernels", "decode,combine", "--kv-formats", "nvfp4", "--head-dims", "64",
            "--gqa", "4", "--page-sizes", "16", "--recent-windows", "64"]
    first = run_cli(*args, cache_dir=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3 variants, 0 failed" in first.stdout  # decode with and without split, one combine
    rows = [ln for ln in first.stdout.splitlines() if ln.startswith("sm_90a")]
    assert len(rows) == 3 and all(" new " in ln for ln in rows)
    assert len(list((tmp_path).rglob("decode/*.o"))) == 2 and len(list(tmp_path.rglob("combine/*.o"))) == 1


def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    """--cache-info reports the size; --clear-stale keeps this version's objects; --clear removes all."""
    from qattn.interface.compile_cache import source_fingerprint

    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path))
    mine, old = tmp_path / source_fingerprint() / "decode", tmp_path / "0123456789abcdef0000" / "decode"
    for d in (mine, old):
        d.mkdir(parents=True)
        (d / "k.o").write_bytes(b"x" * 2048)
    assert warmup.main(["--cache-info"]) == 0
    assert "2 objects" in capsys.readouterr().out
    assert warmup.main(["--clear-stale"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 files" in out and "1 objects, " in out and "1 objects for this version" in out
    assert (mine / "k.o").exists() and not old.exists()
    assert warmup.main(["--clear"]) == 0
    assert "0 objects" in capsys.readouterr().out and not mine.exists()
    monkeypatch.setenv("QATTN_CACHE_DIR", "off")
    assert warmup.main(["--cache-info"]) == 0 and "disabled" in capsys.readouterr().out


@pytest.mark.parametrize("fmt,window,sink,dtype", [("nvfp4", 0, 0, "bf16"), (("int8", "nvfp4"), 64, 1, "bf16"),
                                                   ("fp8", 0, 4, "f16"), ("mxfp4", 32, 0, "f16"),
                                                   (("fp8", "mxfp4_b16"), 0, 0, "f16")])
def test_warmed_insert_keys_equal_runtime_keys(fmt, window, sink, dtype):
    """The insert variant ``write_kv`` launches (``insert_config_for``) is among those ``qattn-warmup``
    compiles for the same filters."""
    import torch

    from qattn import PagedKVCache
    from qattn.interface.kv_cache_ops import insert_config_for

    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    name = fmt if isinstance(fmt, str) else "+".join(fmt)
    warm = {v.key for v in variants.enumerate_variants(
        "kv_insert", "sm_90a", kv_formats=[name], head_dims=[64, 128], recent_windows=[window],
        sink_tokens=[sink], q_dtypes=[dtype])}
    for D in (64, 128):
        cache = PagedKVCache(1, 4, 16, 2, D, fmt, recent_window=window, sink_tokens=sink,
                             max_seqs=2 if window or sink else 0, dtype=tdt)
        assert ("kv_insert", "sm_90a") + insert_config_for(cache, tdt).key in warm


@pytest.mark.parametrize("fmt", ["nvfp4", ("int8", "nvfp4"), "mxfp4", ("mxfp4_b16", "fp8")])
def test_scale_search_insert_variants(fmt):
    """--scale-search adds the insert variant a searched cache launches (for formats with an FP4 side), and only
    with it."""
    from qattn import PagedKVCache, kv_format
    from qattn.interface.kv_cache_ops import insert_config_for

    name = fmt if isinstance(fmt, str) else "+".join(fmt)

    def warm(**kw):
        return {v.key for v in variants.enumerate_variants("kv_insert", "sm_90a", kv_formats=[name],
                                                           head_dims=[128], **kw)}

    cache = PagedKVCache(1, 4, 16, 2, 128, kv_format(fmt, scale_search="msenb"))
    key = ("kv_insert", "sm_90a") + insert_config_for(cache, cache.dtype).key
    assert key in warm(scale_searches=["msenb"]) and key not in warm()
    assert warm() < warm(scale_searches=["msenb"])


def test_balance_qk_variants_are_the_runtime_ones(capsys):
    """--balance-qk adds what flash_attn_func(balance_qk=True) launches on SM90 (per_warp: the K-only prepass with
    Q's amax + the kernel quantizing q * lam; per_block: the balanced Q/K prepass), nothing without it."""
    from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
    from qattn.cute_kernels.sm90.qk_int8_kmean import KMeanPartial
    from qattn.cute_kernels.sm90.qk_int8_quant import QKInt8Quant

    def keys(kind, **kw):
        return {v.key for v in variants.enumerate_variants(kind, "sm_90a", head_dims=[128], **kw)}

    runtime = {
        "prefill": {("sm_90a",) + PrefillConfig(head_dim=128, v_dtype=vd, causal=c, granularity="per_warp",
                                                varlen=vl, pv_dtype=pv, quantize_q=True, balance_qk=True).key
                    for vd in ("bf16", "fp16") for c in (False, True)
                    for vl, pv in ((False, "bf16"), (True, "bf16"), (False, "fp8"), (True, "fp8"))}
        | {("sm_90a",) + PrefillConfig(head_dim=128, v_dtype=vd, causal=True, granularity="per_warp",  # long causal
                                       quantize_q=True, balance_qk=True, tile_m=192).key for vd in ("bf16", "fp16")},
        "qk_int8_kmean": {("qk_int8_kmean", "sm_90a") + KMeanPartial(128, b, vl, st).key
                          for b in (True, False) for vl in (False, True) for st in ("sum_range", "range", "absmax")},
        "qk_int8_quant": {("qk_int8_quant", "sm_90a") + QKInt8Quant(128, rows, b, mean, vl, bal).key
                          for b in (True, False) for vl in (False, True)
                          for rows, mean, bal in ((128, True, "k"), (128, False, "k"), (16, False, "q"),
                                                  (128, False, "q"))},
    }
    for kind, want in runtime.items():
        plain, balanced = keys(kind), keys(kind, balance_qk=True)
        assert not (want & plain) and balanced == plain | want, kind
    assert warmup.main(["--arch", "sm_90a", "--dry-run", "--kernels", "qk_int8_kmean", "--head-dims", "64",
                        "--balance-qk"]) == 0
    assert "16 variants" in capsys.readouterr().out


def test_softcap_variants_are_the_runtime_ones(capsys):
    """--softcap 50 adds, for every SM90 prefill variant, its twin with softcap=50.0 (the key prefill_int8 uses for
    flash_attn_func(softcap=50)); on sm_100a likewise for its kernel (compile-checked only)."""
    from qattn.cute_kernels.sm90.prefill_config import PrefillConfig

    def keys(**kw):
        return [v.key for v in variants.enumerate_variants("prefill", "sm_90a", head_dims=[64], **kw)]

    plain, capped = keys(), keys(softcaps=[50.0])
    assert len(capped) == 2 * len(plain) and set(plain) < set(capped)
    want = ("sm_90a",) + PrefillConfig(head_dim=64, v_dtype="bf16", causal=True, granularity="per_warp",
                                       varlen=True, quantize_q=True, softcap=50.0).key
    assert want in capped and want not in plain
    assert len(keys(softcaps=[50.0, 30.0], sliding_window=True)) == 3 * len(keys(sliding_window=True))
    assert (len(variants.enumerate_variants("prefill", "sm_100a", head_dims=[64], softcaps=[50.0]))
            == 2 * len(variants.enumerate_variants("prefill", "sm_100a", head_dims=[64])))
    assert warmup.main(["--arch", "sm_90a", "--dry-run", "--kernels", "prefill", "--head-dims", "64",
                        "--q-dtypes", "bf16", "--softcap", "50"]) == 0
    assert f"{2 * len(keys(q_dtypes=['bf16']))} variants" in capsys.readouterr().out


def test_decode_softcap_variants():
    """--softcap adds the decode kernels' softcap twins (the keys flash_attn_with_kvcache(softcap=...) uses)."""
    from qattn.cute_kernels.sm90.decode_config import choose_config
    from qattn.layouts.formats import kv_format

    kw = dict(kv_formats=["nvfp4"], head_dims=[128], gqa=[4], page_sizes=[16])
    plain = [v.key for v in variants.enumerate_variants("decode", "sm_90a", **kw)]
    capped = [v.key for v in variants.enumerate_variants("decode", "sm_90a", softcaps=[50.0], **kw)]
    assert len(capped) == 2 * len(plain) and set(plain) < set(capped)
    f = kv_format("nvfp4")
    assert ("sm_90a",) + choose_config(f, f, 128, 16, "bf16", 4, 1, True, True, softcap=50.0).key in capped


def test_dead_worker_is_a_failed_row(tmp_path, monkeypatch, capsys):
    """--jobs > 1: a compile worker that dies (BrokenProcessPool) fails its variant; the table still prints."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path))

    class DeadPool:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, *_):
            f = Future()
            f.set_exception(BrokenProcessPool("a child process terminated abruptly"))
            return f

    monkeypatch.setattr(warmup, "ProcessPoolExecutor", DeadPool)
    assert warmup.main(["--arch", "sm_90a", "--kernels", "chunk_reduce", "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("sm_90a")]
    assert rows and all(" failed " in ln for ln in rows) and "BrokenProcessPool" in out
    assert f"{len(rows)} variants, {len(rows)} failed" in out
