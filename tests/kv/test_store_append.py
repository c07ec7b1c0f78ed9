"""native.kv_store_append: a step's keys and values quantized and written into the store in place, bit for bit what
kv.grid's quantizers and XLA's dynamic_update_slice write (the decode-level check: tests/kv/test_cache_kernel.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import native
from llmeq_jax.kv import grid as kvgrid

# tests/test_native.py fails where the library is not built; here it only says why these cannot run
pytestmark = pytest.mark.skipif(not native.available(), reason=f"native library: {native.unavailable_reason()}")
L, B, KV, S, D = 3, 2, 3, 16, 64


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8 if np.asarray(a).dtype.itemsize == 1 else np.uint16
                              if np.asarray(a).dtype.itemsize == 2 else np.uint32)


def _store(bits, grid_dtype, rng):
    row = D if bits == 8 else D // 2
    codes = jnp.asarray(rng.integers(0, 100, (L, B, KV, S, row)), jnp.int8 if bits == 8 else jnp.uint8)
    scale = jnp.asarray(rng.normal(size=(L, B, KV, S, 1)), grid_dtype)
    return codes, codes + 1, scale, scale * 2  # every slot holds something: a write past its slots would show


def _step(t, rng):
    k = jnp.asarray(rng.normal(size=(B, KV, t, D)) * 3, jnp.float32)
    # values: per-head magnitudes 1e-3 .. 300 (grids near float16's floor and far above it), a constant row
    v = jnp.asarray(rng.normal(size=(B, KV, t, D)) * np.array([1, 1e-3, 300])[None, :, None, None], jnp.float32)
    return k, v.at[0, 0, 0].set(0.7)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("grid_dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("t, start", [(1, 5), (3, 14), (2, 0), (1, 99)])  # 14 + 3 and 99 are clamped, as XLA clamps
@pytest.mark.parametrize("per_row_keys", [False, True])
def test_append_writes_xlas_codes_and_grids(bits, grid_dtype, t, start, per_row_keys):
    rng = np.random.default_rng(bits + t + start)
    store = _store(bits, grid_dtype, rng)
    k, v = _step(t, rng)
    lo = jnp.asarray(rng.normal(size=(B if per_row_keys else 1, KV, D)) - 4, jnp.float32)
    hi = lo + 8
    k_scale, k_lo = kvgrid.grid_from_range(lo, hi, bits)
    got = jax.jit(lambda *s: native.kv_store_append(*s, k, v, k_scale, k_lo, start, bits=bits, layer=1))(*store)
    keys = kvgrid.quantize_per_channel(k, k_scale[:, :, None], k_lo[:, :, None], hi[:, :, None], bits, 0)
    values = kvgrid.quantize_per_token(v, bits, 0)
    new = (keys.q, values.q, values.scale, values.lo)
    want = [jax.lax.dynamic_update_slice(a, n[None].astype(a.dtype), (1, 0, 0, start, 0)) for a, n in zip(store, new)]
    for name, g, w, before in zip(("key codes", "value codes", "value scales", "value mins"), got, want, store):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)
        assert not np.array_equal(_bits(g), _bits(before)), f"{name}: nothing was written"


def test_append_aliases_the_store():
    """The outputs alias the store's buffers: with the store donated, the compiled program copies none of it."""
    rng = np.random.default_rng(0)
    store = _store(4, jnp.float16, rng)
    k, v = _step(1, rng)
    k_scale, k_lo = kvgrid.grid_from_range(jnp.full((1, KV, D), -4.0), jnp.full((1, KV, D), 4.0), 4)
    f = jax.jit(lambda *s: native.kv_store_append(*s, k, v, k_scale, k_lo, 3, bits=4, layer=2),
                donate_argnums=(0, 1, 2, 3))
    text = f.lower(*store).compile().as_text()
    assert "llmeq_kv_store_append" in text
    assert not [line for line in text.splitlines() if " copy(" in line and f"{L},{B},{KV},{S}" in line]


def test_bad_shapes_are_refused_with_what_was_expected():
    rng = np.random.default_rng(0)
    codes, v_codes, scale, lo = _store(8, jnp.float16, rng)
    k, v = _step(1, rng)
    grid = (jnp.ones((1, KV, D)), jnp.zeros((1, KV, D)))
    with pytest.raises(ValueError, match="do not hold 8-bit rows"):
        native.kv_store_append(codes, v_codes, scale, lo, k[..., :32], v[..., :32], *grid, 0, bits=8, layer=0)
    with pytest.raises(ValueError, match="do not hold 4-bit rows"):
        native.kv_store_append(codes, v_codes, scale, lo, k, v, *grid, 0, bits=4, layer=0)
    with pytest.raises(ValueError, match="do not hold"):
        native.kv_store_append(codes, v_codes, scale[..., 0], lo, k, v, *grid, 0, bits=8, layer=0)
