import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qattn.layouts import FORMAT_NAMES, PAGE_SIZES, KVLayer, PagedKVCache, PoolGeometry, kv_format


def _byte_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    return t.data_ptr() - base.data_ptr()


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(FORMAT_NAMES),
    page_size=st.sampled_from(PAGE_SIZES),
    num_kv_heads=st.integers(1, 8),
    head_dim=st.sampled_from([64, 128, 256]),
    num_blocks=st.integers(1, 5),
    data=st.data(),
)
def test_offsets_match_tensor_layout(name, page_size, num_kv_heads, head_dim, num_blocks, data):
    """The byte offsets kernels compute equal the addresses torch uses for the same element."""
    g = PoolGeometry(num_blocks, page_size, num_kv_heads, head_dim, kv_format(name))
    pool, scales = g.empty_data("cpu"), g.empty_scales("cpu")
    b = data.draw(st.integers(0, num_blocks - 1))
    h = data.draw(st.integers(0, num_kv_heads - 1))
    o = data.draw(st.integers(0, page_size - 1))
    assert _byte_offset(pool[b, h, o], pool) == g.data_offset(b, h, o)
    assert pool[b, h, o].numel() * pool.element_size() == g.row_bytes
    if scales is not None:
        assert _byte_offset(scales[b, h, o], scales) == g.scale_offset(b, h, o)
    # A (block, head) tile is one contiguous run of bytes: what one TMA box or cp.async sweep loads.
    tile = pool[b, h]
    assert tile.is_contiguous() and tile.numel() * pool.element_size() == g.data_tile_bytes
    assert g.data_tile_bytes % 16 == 0 and g.data_offset(b, h, 0) % 16 == 0
    if scales is not None:
        assert scales[b, h].is_contiguous() and g.scale_offset(b, h, 0) % 16 == 0


def test_cache_allocation_and_layer_views():
    c = PagedKVCache(3, 7, 16, 4, 128, ("int8", "nvfp4"), recent_window=32, max_seqs=2)
    lay = c.layer(1)
    assert lay.k_data.shape == (7, 4, 16, 128) and lay.k_data.dtype == torch.int8
    assert lay.v_data.shape == (7, 4, 16, 64) and lay.v_data.dtype == torch.uint8
    assert lay.k_scale_pool.shape == (7, 4, 16) and lay.k_scale_pool.dtype == torch.float32
    assert lay.v_scale_pool.shape == (7, 4, 16, 8) and lay.v_scale_pool.dtype == torch.uint8
    assert lay.k_global_scale is None and lay.v_global_scale.shape == (4,)
    assert torch.equal(lay.v_global_scale, torch.ones(4))
    assert lay.k_ring.shape == (2, 4, 32, 128) and lay.k_ring.dtype == torch.bfloat16
    assert c.bytes_per_token() == 3 * 4 * (132 + 72)
    # nbytes counts every tensor: pools, scales, global scales and rings.
    expect = 3 * (7 * 4 * 16 * (128 + 4 + 64 + 8) + 4 * 4 + 2 * 2 * 4 * 32 * 128 * 2)
    assert c.nbytes == expect
    with pytest.raises(ValueError, match="layer"):
        c.layer(3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "bf16", ("fp8", "mxfp4_b16")])
def test_from_tensors_views_without_copy(fmt):
    shapes = PagedKVCache.pool_shapes(5, 32, 2, 64, fmt)
    def alloc(key):
        s = shapes[key]
        return None if s is None else torch.randn(s[0]).to(s[1]) if s[1].is_floating_point else torch.zeros(s[0], dtype=s[1])
    layers = [KVLayer(**{k: alloc(k) for k in shapes}) for _ in range(2)]
    c = PagedKVCache.from_tensors(layers, page_size=32, head_dim=64, kv_format=fmt)
    assert c.num_layers == 2 and c.num_blocks == 5 and c.num_kv_heads == 2
    assert c.layer(1).k_data.data_ptr() == layers[1].k_data.data_ptr()
    # the one host-side fact a view cannot read from the tensors (write_kv(k_mean=...) sets it on its cache)
    assert not c.k_smoothed
    assert PagedKVCache.from_tensors(layers, page_size=32, head_dim=64, kv_format=fmt, k_smoothed=True).k_smoothed


def test_from_tensors_rejects_bad_pools():
    shapes = PagedKVCache.pool_shapes(5, 16, 2, 64, "nvfp4")
    good = {k: torch.zeros(s[0], dtype=s[1]) for k, s in shapes.items()}
    good["k_global_scale"] = torch.ones(2)
    good["v_global_scale"] = torch.ones(2)
    with pytest.raises(TypeError, match=r"layers\[0\].k_data"):
        PagedKVCache.from_tensors([KVLayer(**{**good, "k_data": good["k_data"].to(torch.int8)})], 16, 64, "nvfp4")
    with pytest.raises(ValueError, match=r"layers\[0\].v_scale_pool"):
        PagedKVCache.from_tensors([KVLayer(**{**good, "v_scale_pool": torch.zeros(5, 2, 16, 2, dtype=torch.uint8)})],
                                  16, 64, "nvfp4")
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros(5, 16, 2, 32, dtype=torch.uint8).transpose(1, 2)
        PagedKVCache.from_tensors([KVLayer(**{**good, "v_data": t})], 16, 64, "nvfp4")
    with pytest.raises(ValueError, match="k_global_scale"):
        PagedKVCache.from_tensors([KVLayer(**{**good, "k_global_scale": None})], 16, 64, "nvfp4")
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache.from_tensors([KVLayer(**good)], 24, 64, "nvfp4")


def test_constructor_errors():
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 4, 48, 2, 64)
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache(1, 4, 16, 2, 72, "nvfp4")
    with pytest.raises(TypeError, match="num_blocks"):
        PagedKVCache(1, 0, 16, 2, 64)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(1, 4, 16, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_seqs"):
        PagedKVCache(1, 4, 16, 2, 64, recent_window=64)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("window", [0, 64])
def test_blocks_for_budget_is_tight(fmt, window):
    budget = 3 * 1024 * 1024 + 12345
    kw = dict(recent_window=window, max_seqs=4 if window else 0)
    n = PagedKVCache.blocks_for_budget(budget, 16, 4, 128, fmt, 2, **kw)
    assert n > 0
    assert PagedKVCache(2, n, 16, 4, 128, fmt, **kw).nbytes <= budget
    assert PagedKVCache(2, n + 1, 16, 4, 128, fmt, **kw).nbytes > budget
