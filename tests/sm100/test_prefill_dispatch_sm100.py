"""CPU tests of the prefill dispatch: compute capability 10.x -> the SM100 INT8-QK kernel, 9.0 -> SM90 (the
capability -> arch mapping itself, other arches included, is tested in test_dispatch_sm100.py); SM100's missing
options raise before any launch. The capability is mocked and CPU tensors are made to look like CUDA tensors
(``is_cuda``); the prepass is the exact torch reference and the final kernel launch is replaced by a recorder,
so nothing launches (the SM100 kernel never ran on hardware): the ``gpu`` fixture of tests/conftest.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import qattn
from qattn.cute_kernels.sm100.prefill_config import PrefillConfigSm100
from qattn.cute_kernels.sm100.prefill_int8 import prefill_sm100_cache_key
from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
from qattn.interface import prefill as pf
from qattn.interface import prefill_sm100
from qattn.quant.qk_int8 import quantize_qk_int8_reference, quantize_qk_int8_varlen_reference


def _qkv(B=2, Sq=200, Sk=300, Hq=4, Hkv=2, D=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, Sq, Hq, D, generator=g).to(dtype), torch.randn(B, Sk, Hkv, D, generator=g).to(dtype),
            torch.randn(B, Sk, Hkv, D, generator=g).to(dtype))


@pytest.mark.parametrize("D,dtype,causal,gran,balance", [(128, torch.bfloat16, True, "per_warp", False),
                                                         (64, torch.float16, False, "per_block", False),
                                                         (128, torch.bfloat16, False, "per_warp", True)])
def test_flash_attn_func_reaches_the_sm100_kernel(gpu, D, dtype, causal, gran, balance):
    calls = gpu((10, 0))
    q, k, v = _qkv(D=D, dtype=dtype)
    # balance_qk: the balanced Q/K prepass (SM100 never quantizes Q in the kernel), the same SM100 kernel
    out, lse = qattn.flash_attn_func(q, k, v, causal=causal, granularity=gran, return_lse=True, balance_qk=balance)
    assert len(calls) == 1 and calls[0][0] == "sm100"
    _, cfg, args = calls[0]
    assert cfg == PrefillConfigSm100(D, "bf16" if dtype == torch.bfloat16 else "fp16", causal, gran)
    n_qg = 2 * (8 if gran == "per_warp" else 1)  # ceil(200 / 128) q blocks
    # (7 addresses) B, Sq, Sk, Hq, Hkv, q groups, k blocks, softmax_scale * log2 e
    assert args[7:14] == (2, 200, 300, 4, 2, n_qg, 3)
    assert math.isclose(args[14], math.log2(math.e) / math.sqrt(D))
    assert all(isinstance(a, int) and a != 0 for a in args[:7])
    assert args[17] != 0  # smooth_k (the default): K's mean, which the kernel puts back into the LSE
    assert args[18:] == (0, 0, 200)  # dense: no cu_seqlens, the grid from seqlen_q
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 200)
    # the compile-cache key: the arch first, then everything that changes the code
    assert prefill_sm100_cache_key("sm_100a", cfg)[:2] == ("sm_100a", "sm100_prefill_int8")


def test_sm90_still_gets_the_sm90_kernel(gpu):
    calls = gpu((9, 0))
    q, k, v = _qkv()
    qattn.flash_attn_func(q, k, v, causal=True)
    assert len(calls) == 1 and calls[0][0] == "sm90" and isinstance(calls[0][1], PrefillConfig)
    # per_warp: the SM90 kernel quantizes Q itself (Q passed unquantized, no q scales); per_block: the prepass
    assert calls[0][1].quantize_q and calls[0][2][0].dtype == torch.bfloat16 and calls[0][2][5] is None
    qattn.flash_attn_func(q, k, v, causal=True, granularity="per_block")
    assert not calls[1][1].quantize_q and calls[1][2][0].dtype == torch.int8


def test_sm100_limits_raise_before_any_launch(gpu, monkeypatch):
    calls = gpu((10, 0))
    import qattn.quant.launch as ql

    def no_prepass(*a, **k):
        raise AssertionError("the prepass must not run when the SM100 kernel cannot")

    monkeypatch.setattr(ql, "quantize_qk_int8", no_prepass)
    monkeypatch.setattr(ql, "quantize_qk_int8_varlen", no_prepass)
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="pv_dtype: 'fp8' P.V is not implemented on SM100"):
        qattn.flash_attn_func(q, k, v, pv_dtype="fp8")
    with pytest.raises(NotImplementedError, match="qk_quant: None .* not implemented on SM100"):
        qattn.flash_attn_func(q, k, v, qk_quant=None)
    # softcap with balance_qk needs the SM90 kernel that quantizes Q (it reads the balance the shift needs)
    with pytest.raises(NotImplementedError, match="softcap: with balance_qk=True only .* on SM90"):
        qattn.flash_attn_func(q, k, v, softcap=30.0, balance_qk=True)
    # varlen has the same limits (raised before the varlen prepass, which would fail here)
    cu = torch.tensor([0, 100, 200], dtype=torch.int32)
    qv, kv, vv = q[0], k[0, :200], v[0, :200]
    with pytest.raises(NotImplementedError, match=r"pv_dtype: 'fp8' P.V is not implemented on SM100 yet \(flash_attn_varlen"):
        qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 100, 100, pv_dtype="fp8")
    with pytest.raises(NotImplementedError, match="qk_quant: None .* not implemented on SM100"):
        qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 100, 100, qk_quant=None)
    with pytest.raises(NotImplementedError, match="softcap: with balance_qk=True only .* on SM90"):
        qattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 100, 100, softcap=30.0, balance_qk=True)
    # the kernel-only entry points too
    q8, qs, k8, ks, _ = quantize_qk_int8_reference(q, k)
    with pytest.raises(ValueError, match="SM90 kernel knobs"):
        qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, _tuning={"kv_stages": 3})
    with pytest.raises(ValueError, match="window_size"):
        qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, causal=True, window_size=(-5, 0))
    with pytest.raises(ValueError, match="k_mean: softcap > 0 needs K's smoothing mean"):
        qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, softcap=50.0)
    cu_q, cu_k = torch.tensor([0, 200], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32)
    varlen_int8 = (q8[0], qs[:1], k8[0], ks[:1], v[0], cu_q, cu_k, 200, 300)
    with pytest.raises(ValueError, match="SM90 kernel knobs"):
        qattn.interface.prefill.prefill_int8_varlen(*varlen_int8, _tuning={"kv_stages": 3})
    with pytest.raises(ValueError, match="k_mean: softcap > 0 needs K's smoothing mean"):
        qattn.interface.prefill.prefill_int8_varlen(*varlen_int8, softcap=50.0)
    with pytest.raises(ValueError, match=r"q_scale: None .* SM90 only"):  # Q quantized in the kernel: SM90's
        qattn.interface.prefill.prefill_int8_varlen(q[0], None, *varlen_int8[2:])
    from qattn.quant.v_fp8 import varlen_vt_keys

    vt = torch.zeros(2, 128, varlen_vt_keys(300, 1), dtype=torch.float8_e4m3fn)  # a valid varlen V^T: SM100 raises
    with pytest.raises(NotImplementedError, match="pv_dtype: 'fp8' P.V is not implemented on SM100"):
        qattn.interface.prefill.prefill_int8_varlen(*varlen_int8[:4], vt, *varlen_int8[5:], pv_dtype="fp8",
                                                    v_scale=torch.ones(1, 2, 128))
    assert calls == []


@pytest.mark.parametrize("causal,ws,local,upper,edges", [
    (True, (64, 0), True, True, (64, 0)),
    (False, (-1, 3), True, True, (1 << 30, 3)),  # a right edge only: no left edge at all
    (False, (30, 30), True, True, (30, 30)),
    (False, (100, -1), True, False, (100, 0)),
])
def test_sm100_window_reaches_the_kernel(gpu, causal, ws, local, upper, edges):
    """window_size on SM100: the window variant of the SM100 kernel (compile-checked and emulated only), with the
    runtime edges after the softmax scale."""
    calls = gpu((10, 0))
    q, k, v = _qkv()
    qattn.flash_attn_func(q, k, v, causal=causal, window_size=ws, return_lse=True)
    qattn.flash_attn_func(q, k, v, causal=causal, window_size=ws)
    assert len(calls) == 2 and calls[0][0] == "sm100"
    _, cfg, args = calls[0]
    assert cfg.local == local and cfg.causal == upper and "local" in cfg.key
    assert tuple(args[15:17]) == edges and args[17] != 0  # no softcap: K's mean still goes in (the LSE's shift)
    assert calls[1][2][17] == 0  # unless the call drops the LSE


def test_sm100_window_covering_everything_is_the_plain_kernel(gpu):
    calls = gpu((10, 0))
    q, k, v = _qkv()
    qattn.flash_attn_func(q, k, v, causal=True, window_size=(299, 5))  # left >= Sk - 1, right: causal
    qattn.flash_attn_func(q, k, v, window_size=(None, 199))  # right >= Sq - 1
    qattn.flash_attn_func(q, k, v, window_size=(-1, 0))  # right 0: the causal mask itself
    assert [c[0] for c in calls] == ["sm100"] * 3
    assert [c[1].causal for c in calls] == [True, False, True]


@pytest.mark.parametrize("causal,ws,gran,smooth", [(True, (-1, -1), "per_warp", True),
                                                (False, (64, 16), "per_block", True),
                                                (True, (-1, -1), "per_block", False)])
def test_sm100_softcap_reaches_the_kernel(gpu, causal, ws, gran, smooth):
    """softcap on SM100: the capped variant of the SM100 kernel (compile-checked and emulated only) with
    softmax_scale / softcap as its scale and the prepass's K mean (address 0 for an unsmoothed K)."""
    calls = gpu((10, 0))
    q, k, v = _qkv()
    qattn.flash_attn_func(q, k, v, causal=causal, window_size=ws, granularity=gran, smooth_k=smooth, softcap=30)
    assert len(calls) == 1 and calls[0][0] == "sm100"
    _, cfg, args = calls[0]
    assert cfg.softcap == 30.0 and ("softcap", 30.0) in cfg.key and cfg.granularity == gran
    assert cfg == prefill_sm100.sm100_prefill_config_for(128, torch.bfloat16, cfg.causal, gran, cfg.local, 30.0)
    assert math.isclose(args[14], 1 / math.sqrt(128) / 30.0, rel_tol=1e-12)
    assert (args[17] != 0) == smooth


def test_sm100_prefill_int8_passes_k_mean(gpu):
    """prefill_int8(..., k_mean) on SM100: the mean's address reaches the kernel, capped (into the scores) or not
    (into the LSE); without one (or from an unsmoothed K) address 0, no shift; its shape is checked either way."""
    calls = gpu((10, 0))
    q, k, v = _qkv()
    q8, qs, k8, ks, k_mean = quantize_qk_int8_reference(q, k)
    qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, causal=True, softcap=50.0, k_mean=k_mean)
    _, cfg, args = calls[0]
    assert cfg.softcap == 50.0 and args[17] == k_mean.data_ptr()
    qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, causal=True)
    assert calls[1][1].softcap == 0.0 and calls[1][2][17] == 0
    assert math.isclose(calls[1][2][14], math.log2(math.e) / math.sqrt(128))
    qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, causal=True, k_mean=k_mean)
    assert calls[2][1].softcap == 0.0 and calls[2][2][17] == k_mean.data_ptr() and calls[2][2][0] == q8.data_ptr()
    qattn.flash_attn_func(q, k, v, smooth_k=False)  # an unsmoothed K: nothing to put back
    assert calls[3][2][17] == 0 and len(calls) == 4
    for cap in (50.0, 0.0):
        with pytest.raises(ValueError, match="k_mean"):
            qattn.interface.prefill.prefill_int8(q8, qs, k8, ks, v, softcap=cap, k_mean=k_mean[:, :1])


def test_sm100_softcap_variants_are_the_launcher_keys(capsys):
    """qattn-warmup --softcap 50 on sm_100a: each SM100 prefill variant's capped twin, with the launcher's key."""
    from qattn.interface import warmup
    from qattn.interface.variants import enumerate_variants

    def keys(**kw):
        return {v.key for v in enumerate_variants("prefill", "sm_100a", head_dims=[64], **kw)}

    plain, capped = keys(), keys(softcaps=[50.0])
    assert plain < capped and len(capped) == 2 * len(plain)
    assert len(keys(softcaps=[50.0, 30.0], sliding_window=True)) == 3 * len(keys(sliding_window=True))
    cfg = prefill_sm100.sm100_prefill_config_for(64, torch.bfloat16, True, "per_warp", softcap=50)
    assert prefill_sm100_cache_key("sm_100a", cfg) in capped - plain
    assert warmup.main(["--arch", "sm_100a", "--dry-run", "--kernels", "prefill", "--head-dims", "64",
                        "--q-dtypes", "bf16", "--softcap", "50"]) == 0
    out = capsys.readouterr().out
    assert "16 variants" in out and "softcap 50" in out and "varlen softcap 50" in out


def test_sm100_variants_are_the_launcher_keys():
    from qattn.interface.variants import enumerate_variants

    keys = {v.key for v in enumerate_variants("prefill", "sm_100a")}
    assert len(keys) == 2 * 2 * 2 * 2 * 2  # head_dim x v dtype x causal x granularity x (dense, varlen)
    for d in (64, 128):
        for dt in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                for gran in ("per_warp", "per_block"):
                    for varlen in (False, True):
                        cfg = prefill_sm100.sm100_prefill_config_for(d, dt, causal, gran, varlen=varlen)
                        assert prefill_sm100_cache_key("sm_100a", cfg) in keys
    assert not keys & {v.key for v in enumerate_variants("prefill", "sm_90a")}
    assert {v.key for v in enumerate_variants("prefill", "sm_100a", head_dims=[64], q_dtypes=["bf16", "f16"])} \
        == {prefill_sm100_cache_key("sm_100a", prefill_sm100.sm100_prefill_config_for(64, dt, c, g, varlen=vl))
            for dt in (torch.bfloat16, torch.float16) for c in (False, True) for g in ("per_warp", "per_block")
            for vl in (False, True)}


@pytest.mark.compile
def test_warmup_cli_compiles_sm100_prefill_on_the_cpu(tmp_path):
    from tests.interface.test_warmup import check_compiles_then_cached

    args = ["--arch", "sm_100a", "--kernels", "prefill", "--head-dims", "64", "--q-dtypes", "bf16", "--jobs", "2"]
    check_compiles_then_cached(args, "sm_100a", 8, tmp_path)  # 4 dense + their varlen twins


# ---- varlen ----------------------------------------------------------------------------------------------------
def _packed_qkv(lens_q, lens_k, Hq=4, Hkv=2, D=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)  # noqa: E731
    return (torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype),
            torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype),
            torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype), cu(lens_q), cu(lens_k))


@pytest.mark.parametrize("D,dtype,causal,gran,ws,cap,balance", [
    (128, torch.bfloat16, True, "per_warp", (-1, -1), 0.0, False),
    (64, torch.float16, False, "per_block", (-1, -1), 0.0, True),
    (128, torch.bfloat16, True, "per_block", (64, 0), 30.0, False),
    (64, torch.bfloat16, False, "per_warp", (30, 30), 0.0, False),
])
def test_flash_attn_varlen_func_reaches_the_sm100_kernel(gpu, D, dtype, causal, gran, ws, cap, balance):
    """flash_attn_varlen_func on 10.x: the varlen prepass, then the varlen variant of the SM100 kernel with
    batch = num_seqs, the packed totals as seqlen_q / seqlen_k, the padded scales, the cu_seqlens addresses and
    max_seqlen_q (the grid); out (total_q, Hq, D), LSE (Hq, total_q). Nothing is read from cu_seqlens on the host
    by the launcher (the prepass reference here does, the GPU prepass does not)."""
    calls = gpu((10, 0))
    lens_q, lens_k = [1, 300, 129, 64], [5, 300, 400, 1]
    q, k, v, cu_q, cu_k = _packed_qkv(lens_q, lens_k, D=D, dtype=dtype)
    out, lse = qattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 400, causal=causal, granularity=gran,
                                            window_size=ws, softcap=cap, balance_qk=balance, return_lse=True)
    assert len(calls) == 1 and calls[0][0] == "sm100"
    _, cfg, args = calls[0]
    window = qattn.interface.window.resolve_window(ws, causal, 300, 400)
    assert cfg == prefill_sm100.sm100_prefill_config_for(D, dtype, window.causal, gran, window.local, cap,
                                                         varlen=True)
    assert cfg.varlen and cfg.key[-1] == "varlen"
    n_qg = 3 * (8 if gran == "per_warp" else 1)  # groups of max_seqlen_q = 300
    assert args[7:14] == (4, sum(lens_q), sum(lens_k), 4, 2, n_qg, 4)
    scale = 1 / math.sqrt(D) / cap if cap else math.log2(math.e) / math.sqrt(D)
    assert math.isclose(args[14], scale, rel_tol=1e-12)
    assert tuple(args[15:17]) == window.edges and args[17] != 0  # K's mean: into the scores (capped) or the LSE
    assert args[18:] == (cu_q.data_ptr(), cu_k.data_ptr(), 300)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (4, sum(lens_q))


def test_sm100_prefill_int8_varlen_passes_its_tensors(gpu):
    """prefill_int8_varlen on SM100: the caller's int8 tensors, scales and K mean reach the kernel unchanged (no
    copies of contiguous tensors), with the same validation as on SM90 (k_mean's per-sequence shape)."""
    calls = gpu((10, 0))
    lens_q, lens_k = [200, 0, 3], [300, 7, 0]
    q, k, v, cu_q, cu_k = _packed_qkv(lens_q, lens_k)
    q8, qs, k8, ks, k_mean = quantize_qk_int8_varlen_reference(q, k, cu_q, cu_k, 200, 300)
    out, lse = qattn.interface.prefill.prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, 200, 300, causal=True,
                                                           softcap=50.0, k_mean=k_mean, return_lse=True)
    _, cfg, args = calls[0]
    assert cfg == PrefillConfigSm100(128, "bf16", True, "per_warp", softcap=50.0, varlen=True)
    assert args[:7] == (q8.data_ptr(), k8.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), qs.data_ptr(),
                        ks.data_ptr())
    assert args[7:14] == (3, 203, 307, 4, 2, qs.shape[2], 3) and args[17] == k_mean.data_ptr()
    assert lse.shape == (4, 203)
    with pytest.raises(ValueError, match="k_mean"):
        qattn.interface.prefill.prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, 200, 300, softcap=50.0,
                                                    k_mean=k_mean[:1])
    qattn.interface.prefill.prefill_int8_varlen(q8, qs, k8, ks, v, cu_q, cu_k, 200, 300)
    assert not calls[1][1].causal and calls[1][2][17] == 0 and len(calls) == 2


def test_sm100_varlen_packed_forms(gpu):
    """flash_attn_varlen_qkvpacked_func / _kvpacked_func on SM100: the same varlen kernel (views are copied to
    contiguous tensors for the SM100 kernel, which takes no strides)."""
    calls = gpu((10, 0))
    q, k, v, cu, _ = _packed_qkv([100, 28], [100, 28], Hkv=4)
    qattn.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 100, causal=True)
    qattn.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 100, 100)
    assert [c[0] for c in calls] == ["sm100"] * 2 and all(c[1].varlen for c in calls)
    assert [c[1].causal for c in calls] == [True, False]


@pytest.mark.parametrize("cap", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
@pytest.mark.parametrize("lens_q,lens_k", [([0, 0], [3, 5]), ([4, 7], [0, 0]), ([0], [0])])
def test_varlen_packed_totals_zero_launch_nothing(gpu, cap, lens_q, lens_k):
    """Packed totals of 0 (no query row, or no key for any row): out 0 and LSE -inf (qattn's kernels' convention
    for a row without keys), no prepass and no kernel launch, on both arches; every option still checked."""
    calls = gpu(cap)
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)  # noqa: E731
    Tq, Tk, Hq, Hkv, D = sum(lens_q), sum(lens_k), 4, 2, 128
    q = torch.randn(Tq, Hq, D).bfloat16()
    k, v = torch.randn(Tk, Hkv, D).bfloat16(), torch.randn(Tk, Hkv, D).bfloat16()
    cq, ck, mq, mk = cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)
    for qk_quant in ("int8", None) if cap == (9, 0) else ("int8",):
        out, lse = qattn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, qk_quant=qk_quant, return_lse=True)
        assert out.shape == (Tq, Hq, D) and out.dtype == q.dtype and torch.all(out == 0)
        assert lse.shape == (Hq, Tq) and lse.dtype == torch.float32 and torch.all(torch.isneginf(lse))
    with pytest.raises(ValueError, match="granularity"):
        qattn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, granularity="per_row")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        qattn.flash_attn_varlen_func(q, k, v, cq[:1], ck[:1], mq, mk)
    if cap == (9, 0):  # the kernel that reads the balance is the one that quantizes Q (per_warp)
        with pytest.raises(NotImplementedError, match="softcap"):
            qattn.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, softcap=5.0, balance_qk=True, granularity="per_block")
    # the kernel-level call: its own out zeroed in place
    n_qg, n_kb = pf._scale_groups("per_warp", mq, mk)
    S = len(lens_q)
    args = (q.to(torch.int8), torch.ones(S, Hq, n_qg), k.to(torch.int8), torch.ones(S, Hkv, n_kb), v, cq, ck, mq, mk)
    out = torch.full((Tq, Hq, D), float("nan"), dtype=torch.bfloat16)
    o, lse = pf.prefill_int8_varlen(*args, return_lse=True, out=out)
    assert o.data_ptr() == out.data_ptr() and torch.all(o == 0) and torch.all(torch.isneginf(lse))
    with pytest.raises(ValueError, match="k_mean"):  # softcap needs K's smoothing mean, totals or not
        pf.prefill_int8_varlen(*args, softcap=5.0)
    if cap == (10, 0):
        with pytest.raises(ValueError, match="_tuning"):
            pf.prefill_int8_varlen(*args, _tuning={"tile_m": 128})
    assert calls == []
