import pytest

import qattn
from qattn.layouts import FORMAT_NAMES, KVFormat, KVFormatPair, kv_format, kv_formats

# Bytes per token per kv head, K + V, data + scales (design notes: bf16 512, fp8 ~264, nvfp4 144, mxfp4 136).
EXPECTED_KV_BYTES = {
    "bf16": {64: 256, 128: 512, 256: 1024},
    "fp8": {64: 136, 128: 264, 256: 520},
    "int8": {64: 136, 128: 264, 256: 520},
    "nvfp4": {64: 72, 128: 144, 256: 288},
    "mxfp4": {64: 68, 128: 136, 256: 272},
    "mxfp4_b16": {64: 72, 128: 144, 256: 288},
}


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bytes_per_token(name, head_dim):
    f = kv_format(name)
    assert 2 * f.bytes_per_token_head(head_dim) == EXPECTED_KV_BYTES[name][head_dim]
    assert f.payload_bytes(head_dim) + f.scale_bytes(head_dim) == f.bytes_per_token_head(head_dim)
    assert f.payload_bytes(head_dim) % 16 == 0  # every payload row is whole 16-byte vectors


def test_format_fields():
    nv = kv_format("nvfp4")
    assert (nv.payload, nv.scale_dtype, nv.scale_block, nv.has_global_scale) == ("e2m1", "e4m3", 16, True)
    mx = kv_format("mxfp4")
    assert (mx.scale_dtype, mx.scale_block, mx.scale_rule) == ("ue8m0", 32, "rceil")
    assert kv_format("mxfp4_b16").scale_block == 16
    assert kv_format("fp8").scale_dtype == "fp32" and kv_format("fp8").scale_block is None
    assert not kv_format("bf16").is_quantized and nv.is_packed


def test_pairs_and_rules():
    p = kv_format(("int8", "nvfp4"))
    assert isinstance(p, KVFormatPair) and p.k.name == "int8" and p.v.name == "nvfp4"
    assert p.bytes_per_token_head(128) == 132 + 72
    assert kv_formats("nvfp4") == (kv_format("nvfp4"), kv_format("nvfp4"))
    rc = kv_format("mxfp4", scale_rule="floor")
    assert rc.scale_rule == "floor" and rc.key != kv_format("mxfp4").key
    assert qattn.kv_format(rc) is rc


def test_keys_unique():
    keys = {kv_format(n).key for n in FORMAT_NAMES} | {kv_format("mxfp4", scale_rule="floor").key}
    assert len(keys) == len(FORMAT_NAMES) + 1


def test_bad_specs():
    with pytest.raises(ValueError, match="kv_format"):
        kv_format("fp4")
    with pytest.raises(TypeError, match="kv_format"):
        kv_format(3)
    with pytest.raises(ValueError, match="kv_format"):
        kv_format(("int8", "nvfp4", "bf16"))
    with pytest.raises(ValueError, match="v_format"):
        kv_format(("int8", "nope"))
    with pytest.raises(ValueError, match="scale_rule"):
        kv_format("nvfp4", scale_rule="rceil")
    with pytest.raises(ValueError, match="scale_rule"):
        kv_format("mxfp4", scale_rule="round")
    with pytest.raises(ValueError, match="scale_block"):
        KVFormat("x", "e2m1", "e4m3", 64, True, "nvfp4")


def test_scale_search():
    nv = kv_format("nvfp4", scale_search="msenb")
    assert nv.scale_search == "msenb" and kv_format("nvfp4").scale_search is None
    assert nv.key == kv_format("nvfp4").key and nv != kv_format("nvfp4")  # readers share variants
    assert "scale_search=msenb" in repr(nv) and qattn.kv_format(nv) is nv
    mx = kv_format("mxfp4", scale_rule="floor", scale_search="msenb")
    assert (mx.scale_rule, mx.scale_search) == ("floor", "msenb")
    p = kv_format(("int8", "nvfp4"), scale_search="msenb")  # the FP4 side of a pair only
    assert p.k.scale_search is None and p.v.scale_search == "msenb"
    p = kv_format(("mxfp4_b16", "nvfp4"), scale_search="msenb")
    assert p.k.scale_search == p.v.scale_search == "msenb"
    assert kv_format(kv_format(("int8", "nvfp4")), scale_search="msenb") == kv_format(("int8", "nvfp4"),
                                                                                       scale_search="msenb")
    for bad, match in ((lambda: kv_format("fp8", scale_search="msenb"), "only FP4"),
                       (lambda: kv_format(("int8", "bf16"), scale_search="msenb"), "only FP4"),
                       (lambda: kv_format("nvfp4", scale_search="mse"), "msenb"),
                       (lambda: KVFormat("x", "int8", "fp32", None, False, "absmax", "msenb"), "only FP4")):
        with pytest.raises(ValueError, match="scale_search"):
            bad()


@pytest.mark.parametrize("name,bad", [("nvfp4", 72), ("mxfp4", 48), ("int8", 40), ("nvfp4", 8)])
def test_head_dim_checks(name, bad):
    with pytest.raises(ValueError, match="head_dim"):
        kv_format(name).payload_bytes(bad)
    with pytest.raises(TypeError, match="head_dim"):
        kv_format(name).payload_bytes(64.0)
