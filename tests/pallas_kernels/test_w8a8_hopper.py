"""The Hopper W8A8 kernel in Mosaic GPU: GPU interpret mode against the W8A8 reference; lowering for CUDA."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core import fp8grid
from pallas_kernels import config, mosaic_interpret
from pallas_kernels.w8a8 import w8a8_reference
from pallas_kernels.hopper import snake_tile
from pallas_kernels.w8a8_hopper import HopperBlocks, can_use, default_blocks, w8a8_hopper

FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
FAKE_A100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


def _weights(n, k, seed, lead=()):
    rng = np.random.default_rng(seed)
    wq = jnp.asarray(rng.integers(-127, 128, (*lead, n, k)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (*lead, 1, n)), jnp.float32)
    return wq, scale


def _bits(a):
    return np.asarray(a).view(np.uint16)


CASES = [  # m, k, n, dtype, blocks, layer, static activation scale
    (200, 256, 512, jnp.bfloat16, HopperBlocks(stages=2), None, None),  # rows padded to the tile; 2 SMs, 4 tiles
    (128, 384, 256, jnp.float16, HopperBlocks(64, 64, stages=3, snake_minor_n=False, snake_width=2), None, None),
    (64, 256, 256, jnp.bfloat16, HopperBlocks(128, 64, stages=2), 2, 0.02),  # layer 2 of a stack, static scale
    (128, 256, 512, jnp.bfloat16, HopperBlocks(64, 128, stages=2), None, None),  # hung on 2 XLA threads (conftest)
]


@pytest.mark.parametrize("m,k,n,dtype,blocks,layer,act", CASES)
def test_kernel_is_the_w8a8_reference_bit_for_bit(m, k, n, dtype, blocks, layer, act):
    """Exact int32 sums, then the reference's float32 rescale in its order: the same bits."""
    lead = () if layer is None else (3,)
    wq, scale = _weights(n, k, seed=m, lead=lead)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    got = w8a8_hopper(x, wq, scale, act_scale=act, layer=None if layer is None else jnp.int32(layer), blocks=blocks,
                      interpret=True)
    one = (lambda a: a) if layer is None else (lambda a: a[layer])  # noqa: E731
    want = w8a8_reference(x, one(wq).T, one(scale), act_scale=act)
    assert got.dtype == x.dtype and got.shape == (m, n)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _fp8_weights(n, k, seed, lead=()):
    """E4M3 codes of per-channel scaled normal weights (bit patterns in int8, as a QArray stores them)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(*lead, n, k)).astype(np.float32)
    scale = np.abs(w).max(-1, keepdims=True) / fp8grid.MAX
    return fp8grid.encode(jnp.asarray(w / scale)), jnp.asarray(np.swapaxes(scale, -1, -2), jnp.float32)


FP8_CASES = [  # m, k, n, dtype, blocks, layer, static activation scale
    (100, 384, 512, jnp.bfloat16, None, None, None),  # the default 64 x 128 tiles, rows padded; 2 SMs, 2 tiles each
    (64, 256, 256, jnp.float16, HopperBlocks(128, 64, stages=2), 1, 0.02),  # layer 1 of a stack, static scale
]


@pytest.mark.parametrize("m,k,n,dtype,blocks,layer,act", FP8_CASES)
def test_fp8_kernel_is_the_fp8_reference(m, k, n, dtype, blocks, layer, act):
    """E4M3 x E4M3 products are exact in float32; the kernel sums them a 128-value step at a time and adds the steps
    (its promotion), the reference in one dot: the same values within one rounding of x's dtype."""
    lead = () if layer is None else (3,)
    wq, scale = _fp8_weights(n, k, seed=m, lead=lead)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    got = w8a8_hopper(x, wq, scale, act_scale=act, layer=None if layer is None else jnp.int32(layer), blocks=blocks,
                      fp8=True, interpret=True)
    one = (lambda a: a) if layer is None else (lambda a: a[layer])  # noqa: E731
    want = w8a8_reference(x, one(wq).T, one(scale), act_scale=act, fp8=True)
    as_int8 = w8a8_reference(x, one(wq).T, one(scale), act_scale=act)  # the same codes read as int8: not this
    assert got.dtype == x.dtype and got.shape == (m, n)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=eps, atol=eps)
    assert not np.allclose(np.asarray(got, np.float32), np.asarray(as_int8, np.float32), rtol=0.1)


def test_bias_is_added_after_the_rescale():
    """With a bias the float32 epilogue may fuse its multiply-add (on a GPU too): within one rounding of x's dtype."""
    m, k, n = 64, 256, 256
    wq, scale = _weights(n, k, seed=5)
    x = jax.random.normal(jax.random.key(5), (m, k)).astype(jnp.bfloat16)
    bias = jnp.linspace(-2, 2, n).astype(jnp.bfloat16)
    got = w8a8_hopper(x, wq, scale, bias=bias, blocks=HopperBlocks(128, 64, stages=2), interpret=True)
    want = w8a8_reference(x, wq.T, scale, bias=bias)
    no_bias = w8a8_reference(x, wq.T, scale)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=eps, atol=eps)
    assert not np.allclose(np.asarray(got, np.float32), np.asarray(no_bias, np.float32), atol=0.1)


def test_can_use_names_what_the_kernel_does_not_take():
    ok = lambda **kw: can_use(**{**dict(x_shape=(64, 256), x_dtype=jnp.bfloat16, wq_dtype=jnp.int8, k=256,  # noqa: E731
                                        n=256, group=None, has_zero_point=False), **kw})
    with config.interpret(True):
        assert ok() == (True, "")
        assert "bfloat16/float16" in ok(x_dtype=jnp.float32)[1]
        assert "per-channel" in ok(group=128)[1] and "per-channel" in ok(has_zero_point=True)[1]
        assert "not of 256" in ok(n=384)[1] and "multiple of 128" in ok(k=320, x_shape=(64, 320))[1]
        assert "int8" in ok(wq_dtype=jnp.int4)[1]
        assert "at least two" in ok(k=128, x_shape=(64, 128))[1]  # int8's slots released a step late: 2 steps
        assert ok(fp8=True) == (True, "") and default_blocks(fp8=True).tile_m == 64
        assert "promoted every 128" in ok(fp8=True, blocks=HopperBlocks(tile_k=256))[1]
    with config.compiling_for(FAKE_H100):
        assert ok() == (True, "")
    with config.compiling_for(FAKE_A100):
        assert not ok()[0] and "Hopper" in ok()[1]


def test_bad_input_gets_one_clear_error():
    wq, scale = _weights(256, 256, seed=1)
    x = jnp.zeros((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="K-major"):
        w8a8_hopper(jnp.zeros((8, 128), jnp.bfloat16), wq, scale, interpret=True)
    with pytest.raises(ValueError, match="per channel"):
        w8a8_hopper(x, wq, jnp.ones((2, 256)), interpret=True)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        w8a8_hopper(x.astype(jnp.float32), wq, scale, interpret=True)
    with pytest.raises(ValueError, match="bias"):
        w8a8_hopper(x, wq, scale, bias=jnp.zeros((7,)), interpret=True)
    with pytest.raises(ValueError, match="tile_m and tile_n multiples of 64"):
        HopperBlocks(tile_m=96)


@pytest.mark.parametrize("m_tiles,n_tiles,width,minor_n", [(16, 43, 8, True), (8, 16, 8, True), (16, 16, 8, False),
                                                           (3, 5, 2, False), (1, 1, 8, True)])
def test_the_snake_order_visits_every_tile_once(m_tiles, n_tiles, width, minor_n):
    """Including minor sizes that are multiples of the width (Llama's 4096 / 256 = 16 column blocks)."""
    tiles = jax.vmap(lambda t: jnp.stack(snake_tile(t, m_tiles, n_tiles, width, minor_n)))(
        jnp.arange(m_tiles * n_tiles, dtype=jnp.int32))
    assert sorted(map(tuple, np.asarray(tiles).tolist())) == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]
    first = np.asarray(tiles[: min(width, n_tiles if minor_n else m_tiles)])
    assert len({int(v) for v in first[:, 0 if minor_n else 1]}) == 1  # a band starts along one row (column) block


def test_jaxs_own_interpreter_still_lacks_transposed_wgmma_operands():
    """Canary for ``mosaic_interpret``: JAX's GPU interpret mode reads a wgmma operand's range from index
    transforms only and fails on the transpose the kernel's B operand carries (running the kernel with it hangs:
    the failing warpgroup leaves the others at their barriers). When this fails, the module can go."""
    from jax._src.pallas.mosaic.interpret import utils
    from jax._src.state import indexing, types

    index = indexing.NDIndexer.from_indices_shape((slice(0, 64), slice(0, 128)), (64, 128))
    assert utils.to_range((index,)) == (slice(0, 64, 1), slice(0, 128, 1))
    with pytest.raises(AttributeError, match="indices"):
        utils.to_range((index, types.TransposeTransform((1, 0))))
    assert mosaic_interpret._split_transposes((index, types.TransposeTransform((1, 0)))) == ((index,), [(1, 0)])


@pytest.mark.parametrize("stacked,bias,fp8", [(False, False, False), (True, True, False), (True, False, True)])
def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call(stacked, bias, fp8):
    """Lowered for a Hopper GPU on this CPU: Mosaic GPU's layout inference and lowering accept the kernel (the
    row and column scale vectors broadcast onto the accumulator's layout failed there before; FP8's float32 sum
    carried through the K loop)."""
    m, k, n = 256, 512, 1024
    lead = (4,) if stacked else ()
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((*lead, n, k), jnp.int8),
            jax.ShapeDtypeStruct((*lead, 1, n), jnp.float32)]
    extra = [jax.ShapeDtypeStruct((), jnp.int32)] if stacked else []
    extra += [jax.ShapeDtypeStruct((n,), jnp.bfloat16)] if bias else []

    def f(x, w, s, *rest):
        layer = rest[0] if stacked else None
        b = rest[-1] if bias else None
        return w8a8_hopper(x, w, s, layer=layer, bias=b, fp8=fp8)

    with config.compiling_for(FAKE_H100):
        text = jax.jit(f).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "__gpu$xla.gpu.triton" not in text
