"""CPU: the prefill entry points reject bad inputs with clear errors before any launch."""

from __future__ import annotations

import pytest
import torch

from qattn.interface.prefill import flash_attn_func, prefill_int8


def _args(B=1, Sq=200, Sk=300, Hq=4, Hkv=2, D=64):
    q8 = torch.zeros(B, Sq, Hq, D, dtype=torch.int8)
    k8 = torch.zeros(B, Sk, Hkv, D, dtype=torch.int8)
    v = torch.ones(B, Sk, Hkv, D, dtype=torch.bfloat16)
    qs = torch.ones(B, Hq, 2 * 8)
    ks = torch.ones(B, Hkv, 3)
    return q8, qs, k8, ks, v


def test_valid_shapes_only_fail_on_device():
    with pytest.raises(ValueError, match="CUDA"):
        prefill_int8(*_args())


@pytest.mark.parametrize("mutate,err", [
    (lambda a: (a[0].float(),) + a[1:], "int8"),
    (lambda a: a[:4] + (a[4].float(),), "v: expected dtype"),
    (lambda a: (torch.zeros(1, 200, 4, 96, dtype=torch.int8),) + a[1:], "head_dim"),
    (lambda a: (torch.zeros(1, 200, 3, 64, dtype=torch.int8),) + a[1:], "num_kv_heads"),
    (lambda a: (a[0], torch.ones(1, 4, 2)) + a[2:], "q_scale"),
    (lambda a: a[:3] + (torch.ones(1, 2, 2),) + a[4:], "k_scale"),
    (lambda a: a[:4] + (a[4][:, :10],), "v: expected shape"),
])
def test_bad_inputs_are_rejected(mutate, err):
    with pytest.raises((TypeError, ValueError), match=err):
        prefill_int8(*mutate(_args()))


def test_per_block_scale_shape():
    q8, _, k8, ks, v = _args()
    with pytest.raises(ValueError, match="q_scale"):
        prefill_int8(q8, torch.ones(1, 4, 16), k8, ks, v, granularity="per_block")
    with pytest.raises(ValueError, match="CUDA"):
        prefill_int8(q8, torch.ones(1, 4, 2), k8, ks, v, granularity="per_block")


def test_flash_attn_func_rejects_unimplemented_modes():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="qk_quant"):
        flash_attn_func(q, q, q, qk_quant="fp8")
    with pytest.raises(ValueError, match="pv_dtype"):
        flash_attn_func(q, q, q, qk_quant=None, pv_dtype="fp8")
    with pytest.raises(ValueError, match="CUDA"):  # the unquantized path validates, then needs a GPU
        flash_attn_func(q, q, q, qk_quant=None)
    with pytest.raises(ValueError, match="pv_dtype"):
        flash_attn_func(q, q, q, pv_dtype="fp4")
    with pytest.raises(ValueError, match="CUDA"):  # fp8 P x V is implemented: only the device is wrong here
        flash_attn_func(q, q, q, pv_dtype="fp8")
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_func(*(torch.randn(1, 8, 2, 256, dtype=torch.bfloat16),) * 3, pv_dtype="fp8")
    with pytest.raises(TypeError, match="one dtype"):
        flash_attn_func(q, q.half(), q)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("pv_dtype", ["bf16", "fp8"])
def test_cpu_tensors_point_to_the_cpu_reference(varlen, pv_dtype):
    """Valid CPU inputs fail last, naming the fp64 CPU reference (not the prepass's hint)."""
    from qattn.interface.prefill import flash_attn_varlen_func

    q = torch.randn(1, 40, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 56, 2, 64, dtype=torch.bfloat16)
    name = "flash_attn_varlen_func" if varlen else "flash_attn_func"
    ref = "prefill_fp8pv\\.prefill_fp8pv_emulation" if pv_dtype == "fp8" else "prefill_reference"
    with pytest.raises(ValueError, match=r"^q, k, v: expected CUDA tensors on one device, got cpu, cpu, cpu \("
                       + name + r" runs on the GPU; its fp64 CPU reference is qattn\.reference\." + ref):
        if varlen:
            cq, ck = (torch.tensor([0, n], dtype=torch.int32) for n in (40, 56))
            flash_attn_varlen_func(q[0], k[0], k[0], cq, ck, 40, 56, pv_dtype=pv_dtype, causal=True)
        else:
            flash_attn_func(q, k, k, pv_dtype=pv_dtype, causal=True)


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attn_keywords_at_their_off_values(varlen):
    """FlashAttention's dropout_p / window_size / softcap / alibi_slopes / deterministic: the "off" values (and
    the implemented window_size / softcap values) pass through (the call then fails only for want of a GPU);
    dropout and ALiBi are a NotImplementedError naming the argument, a bad softcap a ValueError, before any
    launch."""
    from qattn.interface.prefill import flash_attn_varlen_func

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)

    def call(**kw):
        if varlen:
            return flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, **kw)
        return flash_attn_func(q, q, q, **kw)

    for off in (dict(dropout_p=0.0), dict(window_size=(-1, -1)), dict(window_size=(None, None)),
                dict(window_size=[-1, -1]), dict(softcap=0.0), dict(softcap=None), dict(alibi_slopes=None),
                dict(softcap=30.0), dict(softcap=50), dict(softcap=1e-3),  # soft-capping is implemented (SM90)
                dict(deterministic=True), dict(dropout_p=0, window_size=(-1, -1), softcap=0.0, deterministic=False),
                # sliding windows are implemented: these too fail only for want of a GPU
                dict(window_size=(128, 0)), dict(window_size=(-1, 0)), dict(window_size=(3, 5)),
                dict(window_size=(None, 2)), dict(window_size=[0, 0], causal=True)):
        with pytest.raises(ValueError, match="CUDA"):
            call(**off)
    for on, name in ((dict(dropout_p=0.1), "dropout_p"), (dict(dropout_p=True), "dropout_p"),
                     (dict(alibi_slopes=torch.ones(2)), "alibi_slopes")):
        with pytest.raises(NotImplementedError, match=name):
            call(**on)
    for bad in (-1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="softcap"):
            call(softcap=bad)
    for bad in (4, (1, 2, 3), (-2, 0), (1.5, 0), (True, 0), ("8", 0), None):
        with pytest.raises(ValueError, match="window_size"):
            call(window_size=bad)
    with pytest.raises(TypeError, match="deterministic"):
        call(deterministic="yes")


@pytest.mark.parametrize("causal,window,sq,sk,expect", [
    (False, (-1, -1), 100, 300, (-1, -1)),
    (True, (-1, -1), 100, 300, (-1, 0)),        # causal: right edge 0
    (True, (64, 7), 100, 300, (64, 0)),         # causal overrides the right edge
    (False, (64, 7), 100, 300, (64, 7)),
    (False, (298, -1), 100, 300, (298, -1)),    # row 99 sees from key 299 - 298 = 1: key 0 cut
    (False, (299, -1), 100, 300, (-1, -1)),     # row 99's window starts at key 0: no left edge at all
    (False, (None, 98), 100, 300, (-1, 98)),    # row 0 sees up to key 200 + 98 = 298: key 299 cut
    (False, (None, 99), 100, 300, (-1, -1)),    # row 0 sees key 299: no right edge
    (True, (None, 99), 100, 300, (-1, 0)),
])
def test_window_bounds_that_cut_nothing_are_dropped(causal, window, sq, sk, expect):
    """``_window``: FlashAttention's (left, right) with causal folded in; a bound no row reaches becomes -1 (the
    plain kernels), checked against the reference mask (same output)."""
    from qattn.interface.window import window_bounds as _window, window_ints as _window_ints
    from qattn.reference import attention_reference

    got = _window(_window_ints(window), causal, sq, sk)
    assert got == expect
    q, k = torch.randn(1, sq, 1, 64, dtype=torch.float64), torch.randn(1, sk, 1, 64, dtype=torch.float64)
    v = torch.randn(1, sk, 1, 64, dtype=torch.float64)
    a = attention_reference(q, k, v, causal=causal, window_size=window)
    b = attention_reference(q, k, v, window_size=got)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_warmup_lists_the_runtime_prefill_keys():
    from qattn.cute_kernels.sm90.prefill_config import PrefillConfig
    from qattn.interface.variants import enumerate_variants

    keys = {v.key for v in enumerate_variants("prefill", "sm_90a")}
    # head_dim x V dtype x causal x (granularity x (dense, varlen) x (16-bit, fp8 P.V) + unquantized dense /
    # varlen), plus the 192-row tile of long dense causal grids at head_dim 128 (per_warp, 16-bit P.V), per V dtype
    assert len(keys) == 2 * 2 * 2 * (2 * 4 + 2) + 2
    for vd in ("bf16", "fp16"):
        assert ("sm_90a",) + PrefillConfig(head_dim=128, v_dtype=vd, causal=True, granularity="per_warp",
                                           quantize_q=True, tile_m=192).key in keys
    for causal in (False, True):  # what flash_attn_func / flash_attn_varlen_func build at run time
        for varlen, pv in ((False, "bf16"), (True, "bf16"), (False, "fp8"), (True, "fp8")):
            for gran in ("per_warp", "per_block"):  # per_warp: Q quantized in the kernel
                cfg = PrefillConfig(head_dim=128, v_dtype="bf16", causal=causal, granularity=gran, varlen=varlen,
                                    pv_dtype=pv, quantize_q=gran == "per_warp")
                assert ("sm_90a",) + cfg.key in keys
        for varlen in (False, True):
            cfg = PrefillConfig(head_dim=128, v_dtype="bf16", causal=causal, granularity="per_block", varlen=varlen,
                                qk_dtype="bf16")
            assert ("sm_90a",) + cfg.key in keys
    # sm_100a: the SM100 kernel's 16 dense variants and their 16 varlen twins (tests/sm100/test_prefill_dispatch_sm100.py)
    assert len(enumerate_variants("prefill", "sm_100a")) == 32
    # --sliding-window: every variant's twin with a left window edge (causal ones: the right edge too)
    wkeys = {v.key for v in enumerate_variants("prefill", "sm_90a", sliding_window=True)}
    assert len(wkeys) == 2 * len(keys) and keys < wkeys
    for causal in (False, True):
        for varlen, pv, gran, qk in ((False, "bf16", "per_warp", "int8"), (True, "bf16", "per_warp", "int8"),
                                     (False, "fp8", "per_block", "int8"), (True, "bf16", "per_block", "bf16")):
            cfg = PrefillConfig(head_dim=64, v_dtype="fp16", causal=causal, granularity=gran, varlen=varlen,
                                pv_dtype=pv, qk_dtype=qk, quantize_q=gran == "per_warp", local=True)
            assert ("sm_90a",) + cfg.key in wkeys


@pytest.mark.compile
def test_warmup_cli_compiles_prefill_then_reports_cached(tmp_path):
    from tests.interface.test_warmup import check_compiles_then_cached

    args = ["--arch", "sm_90a", "--kernels", "prefill", "--head-dims", "64", "--q-dtypes", "bf16", "--jobs", "2"]
    check_compiles_then_cached(args, "sm_90a", 20, tmp_path)


def test_varlen_fp8_pv_checked_before_launch():
    from qattn.interface.prefill import flash_attn_varlen_func

    q = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):  # implemented: only the device is wrong here
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, pv_dtype="fp8")
    with pytest.raises(ValueError, match="pv_dtype"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, pv_dtype="e5m2")
    with pytest.raises(ValueError, match="pv_dtype"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, qk_quant=None, pv_dtype="fp8")
    q96 = torch.randn(8, 2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_varlen_func(q96, q96, q96, cu, cu, 8, 8, pv_dtype="fp8")


def test_prefill_int8_varlen_fp8_inputs_checked():
    from qattn.interface.prefill import prefill_int8_varlen
    from qattn.quant.v_fp8 import varlen_vt_keys

    q8, k8 = torch.zeros(200, 4, 64, dtype=torch.int8), torch.zeros(300, 2, 64, dtype=torch.int8)
    cu_q, cu_k = torch.tensor([0, 50, 200], dtype=torch.int32), torch.tensor([0, 100, 300], dtype=torch.int32)
    qs, ks = torch.ones(2, 4, 16), torch.ones(2, 2, 2)  # per_warp groups of 150 rows, k blocks of 200
    keys = varlen_vt_keys(300, 2)
    assert keys == 320 + 2 * 160  # 300 rounded up to 32, and 160 per sequence
    vt, vs = torch.zeros(2, 64, keys, dtype=torch.float8_e4m3fn), torch.ones(2, 2, 64)
    args = (q8, qs, k8, ks)
    with pytest.raises(ValueError, match="CUDA"):
        prefill_int8_varlen(*args, vt, cu_q, cu_k, 150, 200, pv_dtype="fp8", v_scale=vs)
    with pytest.raises(ValueError, match="v: expected shape"):
        prefill_int8_varlen(*args, vt[..., :300], cu_q, cu_k, 150, 200, pv_dtype="fp8", v_scale=vs)
    with pytest.raises(ValueError, match="v_scale: expected shape"):
        prefill_int8_varlen(*args, vt, cu_q, cu_k, 150, 200, pv_dtype="fp8", v_scale=vs[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        prefill_int8_varlen(*args, torch.ones(300, 2, 64, dtype=torch.bfloat16), cu_q, cu_k, 150, 200,
                            pv_dtype="fp8", v_scale=vs)
    with pytest.raises(ValueError, match="v_scale"):
        prefill_int8_varlen(*args, torch.ones(300, 2, 64, dtype=torch.bfloat16), cu_q, cu_k, 150, 200, v_scale=vs)


def _fp8_args(B=1, Sk=300, Hkv=2, D=64):
    q8, qs, k8, ks, _ = _args(B=B, Sk=Sk, Hkv=Hkv, D=D)
    vt = torch.zeros(B, Hkv, D, 384, dtype=torch.float8_e4m3fn)
    vs = torch.ones(B, Hkv, D)
    return q8, qs, k8, ks, vt, vs


def test_prefill_int8_fp8_inputs_checked():
    q8, qs, k8, ks, vt, vs = _fp8_args()
    with pytest.raises(ValueError, match="CUDA"):
        prefill_int8(q8, qs, k8, ks, vt, pv_dtype="fp8", v_scale=vs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        prefill_int8(q8, qs, k8, ks, torch.ones(1, 300, 2, 64, dtype=torch.bfloat16), pv_dtype="fp8", v_scale=vs)
    with pytest.raises(ValueError, match="v: expected shape"):  # keys padded to 128: 384, not 300
        prefill_int8(q8, qs, k8, ks, vt[..., :300], pv_dtype="fp8", v_scale=vs)
    with pytest.raises(TypeError, match="v_scale"):
        prefill_int8(q8, qs, k8, ks, vt, pv_dtype="fp8", v_scale=None)
    with pytest.raises(ValueError, match="v_scale: expected shape"):
        prefill_int8(q8, qs, k8, ks, vt, pv_dtype="fp8", v_scale=vs[:, :1])
    with pytest.raises(TypeError, match="out_dtype"):
        prefill_int8(q8, qs, k8, ks, vt, pv_dtype="fp8", v_scale=vs, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="pv_dtype"):
        prefill_int8(q8, qs, k8, ks, vt, pv_dtype="e5m2", v_scale=vs)
    with pytest.raises(ValueError, match="v_scale"):
        prefill_int8(*_args(), v_scale=vs)


def test_prefill_traces_as_one_op_without_graph_breaks():
    """torch.compile(fullgraph=True) of a prefill layer: flash_attn_func / flash_attn_varlen_func become the
    qattn::prefill / qattn::prefill_varlen custom ops (fake shapes on the CPU; the kernels never run here)."""
    import qattn

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [torch.zeros(1)] * n_out

    def layer(q, k, v, cu):
        o, lse = qattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
        ov = qattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16, causal=True)
        return o * 2, lse, ov

    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=record)(q, k, k.clone(), cu)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("qattn.prefill.default" in t for t in targets) and any("qattn.prefill_varlen" in t for t in targets)


def test_prefill_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import qattn.interface.torch_ops  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 500, 2, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.qattn.prefill(q, k, k, True, 0.1, "per_warp", True, "bf16", "int8")
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 300)
        qv = torch.empty(700, 8, 64, dtype=torch.float16)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = torch.ops.qattn.prefill_varlen(qv, qv[:, :2], qv[:, :2], cu, cu, 300, 300, False, 0.1,
                                                  "per_block", True, "none")
        assert out.shape == qv.shape and lse.shape == (8, 700)


@pytest.mark.parametrize("mq,mk,tq,tk,ns,ok", [(1, 1, 5, 7, 8, True), (5, 7, 5, 7, 8, True), (0, 3, 0, 3, 8, True),
                                               (1, 0, 4, 0, 8, True), (0, 0, 0, 0, 8, True), (1, 1, 0, 0, 8, True),
                                               (3, 4, 5, 7, 2, True), (0, 1, 4, 7, 8, False), (6, 1, 5, 7, 8, False),
                                               (1, 2, 4, 0, 8, False), (True, 1, 4, 7, 8, False),
                                               (1.0, 1, 4, 7, 8, False), (2, 4, 5, 7, 2, False),
                                               (3, 3, 5, 7, 2, False)])
def test_varlen_max_seqlens(mq, mk, tq, tk, ns, ok):
    """Each max_seqlen an int in [1, total]; 0 is taken only where the packed total is 0 (such a call launches
    nothing: out 0, LSE -inf, tests/gpu/test_prefill_gpu.py::test_varlen_packed_totals_zero); num_seqs x
    max_seqlen must reach the total (else a sequence is longer than max_seqlen)."""
    from qattn.interface.prefill import _check_max_seqlens

    if ok:
        _check_max_seqlens(mq, mk, tq, tk, ns)
    else:
        with pytest.raises(ValueError, match="max_seqlen"):
            _check_max_seqlens(mq, mk, tq, tk, ns)


@pytest.mark.parametrize("m,total,ns,ok", [(0, 0, 2, True), (5, 9, 2, True), (500, 9, 2, True), (4, 9, 2, False),
                                           (0, 3, 4, False), (-1, 0, 1, False), (True, 1, 1, False),
                                           (2.0, 1, 1, False)])
def test_prepass_max_seqlen(m, total, ns, ok):
    """The varlen prepasses take a max_seqlen past every sequence (padding groups) but not one that some
    sequence must exceed (num_seqs x max_seqlen < total: rows the grid would never reach)."""
    from qattn.quant.launch import _check_max_seqlen

    if ok:
        assert _check_max_seqlen(m, "max_seqlen_k", total, ns) == m
    else:
        with pytest.raises((TypeError, ValueError), match="max_seqlen_k"):
            _check_max_seqlen(m, "max_seqlen_k", total, ns)


def test_varlen_totals_zero_still_checked():
    """A varlen call with packed totals of 0 skips the launches, not the checks."""
    from qattn.interface.prefill import flash_attn_varlen_func

    cu = torch.zeros(3, dtype=torch.int32)
    q = torch.zeros(0, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(0, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        flash_attn_varlen_func(q, kv, kv, cu, cu, 0, 0)
    kv = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match="cu_seqlens"):
        flash_attn_varlen_func(q, kv, kv, cu.long(), cu, 0, 0)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, kv, kv, cu, cu, -1, 0)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_varlen_func(q, kv, kv, cu, cu, 0, 0)


@pytest.mark.parametrize("return_lse, softcap, smooth, sent", [(False, 0.0, True, False), (True, 0.0, True, True),
                                                               (False, 30.0, True, True), (True, 0.0, False, False)])
def test_k_mean_reaches_the_kernel_only_where_read(monkeypatch, return_lse, softcap, smooth, sent):
    """K's mean goes to the kernel for a soft cap or a returned LSE (its shift costs up to 4 %), else not."""
    import qattn.interface.prefill as PF
    import qattn.quant.launch as L

    seen = []
    monkeypatch.setattr(PF, "prefill_int8", lambda *a, k_mean=None, **kw: (seen.append(k_mean), ("o", "l"))[1])
    monkeypatch.setattr(L, "quantize_k_int8", lambda k, smooth_k, **kw: ("k8", "ks", "km" if smooth_k else None))
    monkeypatch.setattr(L, "_check_pair", lambda q, k: None)
    monkeypatch.setattr(PF, "_check_cuda_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(PF, "_kernel_quantizes_q", lambda q, granularity: True)
    q, k, v = (torch.randn(1, 64, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    PF._flash_attn_func_eager(q, k, v, False, 0.125, "per_warp", smooth, "bf16", "int8", False, (-1, -1), softcap,
                              return_lse)
    assert (seen[0] == "km") == sent and (seen[0] is not None or not softcap)


@pytest.mark.parametrize("return_lse", [False, True])
def test_balanced_prepass_q_gets_k_mean_over_balance(monkeypatch, return_lse):
    import qattn.interface.prefill as PF
    import qattn.quant.launch as L

    seen, lam = [], torch.full((1, 2, 64), 2.0)
    monkeypatch.setattr(PF, "prefill_int8", lambda *a, k_mean=None, **kw: (seen.append(k_mean), ("o", "l"))[1])
    monkeypatch.setattr(L, "quantize_qk_int8", lambda q, k, **kw: ("q8", "qs", "k8", "ks", torch.ones(1, 2, 64), lam))
    monkeypatch.setattr(PF, "_check_cuda_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(PF, "_kernel_quantizes_q", lambda q, granularity: False)
    q, k, v = (torch.randn(1, 64, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    PF._flash_attn_func_eager(q, k, v, False, 0.125, "per_block", True, "bf16", "int8", True, (-1, -1), 0.0,
                              return_lse)
    assert seen[0] is None if not return_lse else torch.equal(seen[0], torch.full((1, 2, 64), 0.5))
