"""A decode step's key and value quantized into the quantized KV store in place (pallas_kernels/kv_store_append.py):
interpret mode bit for bit against kv.grid's quantizers and XLA's dynamic-update-slices, refusals, lowering for
CUDA (the decode-level check, the kernel inside a quantized cache's step: tests/kv/test_cache_kernel.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_store_append as ka

L, B, KV, S, D = 3, 2, 3, 16, 64


def _store(bits, grid_dtype, rng, stacked=True):
    row = D if bits == 8 else D // 2
    lead = (L, B, KV, S) if stacked else (B, KV, S)
    codes = jnp.asarray(rng.integers(0, 100, (*lead, row)), jnp.int8 if bits == 8 else jnp.uint8)
    scale = jnp.asarray(rng.normal(size=(*lead, 1)), grid_dtype)
    return codes, codes + 1, scale, scale * 2  # every slot holds something: a write past its slot would show


def _step(rng, dtype, per_row):
    k = jnp.asarray(rng.normal(size=(B, KV, D)) * 3, dtype)
    # values: per-head magnitudes 1e-3 .. 300 (grids near float16's floor and far above it), a constant row, one
    # all negative (the grid's low end rounded down away from zero), two spanning zero only just
    v = rng.normal(size=(B, KV, D)) * np.array([1, 1e-3, 300])[None, :, None]
    v[0, 0], v[1, 1] = 0.7, -np.abs(v[1, 1]) - 0.01
    v[1, 2] = np.linspace(-1e-6, 1e-6, D)  # the low end a float16 subnormal
    v[0, 2] = np.linspace(-1e-9, 1e-9, D)  # the low end rounds to -0 in float16: the grid starts one step below
    grid = (B if per_row else 1, KV, D)
    k_scale = jnp.asarray(np.abs(rng.normal(size=grid)) * 0.05 + 1e-3, jnp.float32)
    k_lo = jnp.asarray(rng.normal(size=grid) - 3, jnp.float32)  # keys past the grid on both sides: clipped codes
    return k, jnp.asarray(v, dtype), k_scale, k_lo


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("grid_dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("slot", [5, 0, 15, 99])  # 99: clamped to the last slot, as XLA clamps
@pytest.mark.parametrize("dtype, per_row, stacked", [(jnp.float32, False, True), (jnp.bfloat16, True, True),
                                                     (jnp.float16, False, False)])
def test_writes_xlas_bits_in_place(bits, grid_dtype, slot, dtype, per_row, stacked):
    rng = np.random.default_rng(slot + bits)
    store = _store(bits, grid_dtype, rng, stacked)
    k, v, k_scale, k_lo = _step(rng, dtype, per_row)
    layer = 1 if stacked else None
    got = ka.store_append(*store, k, v, k_scale, k_lo, jnp.int32(slot), bits=bits,
                          layer=None if layer is None else jnp.int32(layer), interpret=True)
    want = ka.store_append_reference(*store, k, v, k_scale, k_lo, min(slot, S - 1), bits=bits, layer=layer)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))
    # only the slot changed
    assert not np.array_equal(_bits(got[0]), _bits(store[0]))
    changed = np.any(_bits(got[1]) != _bits(store[1]), axis=-1)
    where = changed.nonzero()
    assert set(where[-1]) == {min(slot, S - 1)} and (not stacked or set(where[0]) == {1})


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("rotated", [True, False], ids=["preRoPE", "postRoPE"])
def test_a_sink_tokens_float_copies_are_written_with_it(bits, stacked, rotated):
    """sinks=(k_sink, v_sink, at, k_rotated): a row whose token is a sink (at < N) also writes its key (after RoPE:
    ``k_rotated``, else ``k``) and value into the float sink stores, in their dtype; a row at N or past writes none."""
    rng = np.random.default_rng(bits)
    store = _store(bits, jnp.float16, rng, stacked)
    k, v, k_scale, k_lo = _step(rng, jnp.bfloat16, False)
    n = 4
    lead = (L, B, KV) if stacked else (B, KV)
    k_sink = jnp.asarray(rng.normal(size=(*lead, n, D)), jnp.bfloat16)
    sinks = (k_sink, k_sink * 3, jnp.array([2, n], jnp.int32), k * 2 if rotated else None)
    layer = 1 if stacked else None
    got = ka.store_append(*store, k, v, k_scale, k_lo, jnp.int32(5), bits=bits, sinks=sinks, interpret=True,
                          layer=None if layer is None else jnp.int32(layer))
    want = ka.store_append_reference(*store, k, v, k_scale, k_lo, 5, bits=bits, layer=layer, sinks=sinks)
    assert len(got) == 6
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_bits(g), _bits(w))
    key = (1, 0) if stacked else (0,)
    np.testing.assert_array_equal(_bits(got[4][(*key, slice(None), 2)]), _bits((k * 2 if rotated else k)[0]))
    np.testing.assert_array_equal(_bits(got[5][(*key, slice(None), 2)]), _bits(v[0]))
    changed = np.argwhere(_bits(got[4]) != _bits(k_sink))[:, :-1]  # (layer,) row, head, sink of each changed value
    if stacked:
        assert set(changed[:, 0]) == {1}
        changed = changed[:, 1:]
    assert {(int(r), int(i)) for r, _, i in changed} == {(0, 2)}  # row 0's sink 2 only: row 1's token is no sink


def test_a_one_token_axis_is_taken_and_bad_inputs_are_refused():
    rng = np.random.default_rng(0)
    store = _store(4, jnp.float16, rng)
    k, v, k_scale, k_lo = _step(rng, jnp.float32, False)
    one = ka.store_append(*store, k[:, :, None], v[:, :, None], k_scale[:, :, None], k_lo[:, :, None], jnp.int32(3),
                          bits=4, layer=jnp.int32(0), interpret=True)
    flat = ka.store_append(*store, k, v, k_scale, k_lo, jnp.int32(3), bits=4, layer=jnp.int32(0), interpret=True)
    for a, b in zip(one, flat):
        np.testing.assert_array_equal(_bits(a), _bits(b))

    def call(*, bits=4, layer=jnp.int32(0), slot=jnp.int32(3), **kw):
        args = dict(k_codes=store[0], v_codes=store[1], v_scale=store[2], v_lo=store[3], k=k, v=v, k_scale=k_scale,
                    k_lo=k_lo)
        args.update(kw)
        return ka.store_append(**args, slot=slot, bits=bits, layer=layer, interpret=True)

    with pytest.raises(ValueError, match="2-bit codes"):
        call(bits=2)
    with pytest.raises(ValueError, match="codes must be"):
        call(bits=8)  # int4 bytes read as int8 rows
    with pytest.raises(ValueError, match="one token a row"):
        call(k=jnp.stack([k, k], 2), v=jnp.stack([v, v], 2))
    with pytest.raises(ValueError, match="value grids must be"):
        call(v_scale=store[2].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="the key grid must be"):
        call(k_scale=k_scale[:, :2])
    with pytest.raises(ValueError, match="slot must be an integer scalar"):
        call(slot=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="head_dim 48"):
        call(k=k[..., :48], v=v[..., :48])
    sink = jnp.zeros((L, B, KV, 4, D), jnp.float32)
    with pytest.raises(ValueError, match="sinks must be"):
        call(sinks=(sink[0], sink[0], jnp.zeros(B, jnp.int32), None))  # one layer's sinks for a stacked store
    with pytest.raises(ValueError, match="rotated keys must be"):
        call(sinks=(sink, sink, jnp.zeros(B, jnp.int32), k[..., :32]))


@pytest.mark.parametrize("bits", [8, 4])
def test_lowers_for_cuda_in_place(cuda_lowering, bits):
    """Lowered for CUDA (Llama-2-7B's heads, 2048 slots, a bf16 step): one Triton call whose four outputs alias the
    store's inputs (no copy of the store for the write)."""
    row = 128 if bits == 8 else 64
    codes = jnp.zeros((2, 1, 32, 2048, row), jnp.int8 if bits == 8 else jnp.uint8)
    grid = jnp.zeros((2, 1, 32, 2048, 1), jnp.float16)
    new = jnp.ones((1, 32, 128), jnp.bfloat16)
    ks = jnp.ones((1, 32, 128), jnp.float32)
    text = cuda_lowering(lambda kc, vc, vs, vl, k, v, s, lo, slot, i: ka.store_append(
        kc, vc, vs, vl, k, v, s, lo, slot, bits=bits, layer=i), codes, codes, grid, grid, new, new, ks, ks,
        jnp.int32(5), jnp.int32(1))
    assert text.count("#stablehlo.output_operand_alias<") == 4


@pytest.mark.parametrize("per_row", [False, True])
def test_every_layers_key_grid_is_read_at_the_layer(per_row):
    """With layer=, the key grid may be every layer's [L, 1 or B, KV, 1, D] (what kv.cache passes: the layer's
    slice was a launch of its own every layer): the kernel reads layer ``layer``'s grid in place, writing the codes
    that grid gives -- and another layer's grid gives other codes."""
    rng = np.random.default_rng(7)
    store = _store(8, jnp.float16, rng)
    k, v, _, _ = _step(rng, jnp.float32, per_row)
    grids = [_step(np.random.default_rng(20 + i), jnp.float32, per_row)[2:] for i in range(L)]
    every = [jnp.stack([g[j] for g in grids])[:, :, :, None, :] for j in (0, 1)]  # [L, 1 or B, KV, 1, D]
    got = ka.store_append(*store, k, v, *every, jnp.int32(4), bits=8, layer=jnp.int32(2), interpret=True)
    want = ka.store_append(*store, k, v, *grids[2], jnp.int32(4), bits=8, layer=jnp.int32(2), interpret=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    other = ka.store_append(*store, k, v, *grids[0], jnp.int32(4), bits=8, layer=jnp.int32(2), interpret=True)
    assert not np.array_equal(_bits(got[0]), _bits(other[0]))
    ref = ka.store_append_reference(*store, k, v, *every, 4, bits=8, layer=2)
    np.testing.assert_array_equal(_bits(got[0]), _bits(ref[0]))
    with pytest.raises(ValueError, match="every layer's"):
        ka.store_append(*store, k, v, every[0][:2], every[1][:2], jnp.int32(4), bits=8, layer=jnp.int32(2),
                        interpret=True)
