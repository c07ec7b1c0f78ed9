"""The Hopper int4 / int8 decode kernel in Mosaic GPU, weight-only and W8A8 (int8 / FP8): GPU interpret mode against
the real-valued product or the W8A8 reference; lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core import fp8grid
from pallas_kernels import config
from pallas_kernels.decode_hopper import DecodeBlocks, can_use, decode_hopper, split_steps, splits_for, \
    transpose_codes, w8a8_decode_hopper
from pallas_kernels.w8a8 import w8a8_reference
from tests.pallas_kernels.weight_only_cases import FAKE_A100, FAKE_H100, kernel_scales, quantized


def _quantized(k, n, group, zero_point, seed, bits=4):
    return quantized(k, n, group, zero_point, seed, bits)


def _kernel_args(q, group):
    """The kernel's (rows, scale, zero point) of an int4 or int8 QArray: (N, K) int4 / int8, (G, N) float32, (G, N)
    int8."""
    rows = transpose_codes(q.values()) if q.bits == 4 else jnp.swapaxes(q.qvalue, -1, -2)
    return (rows, *kernel_scales(q, group))


def _exact_product(x, q):
    """``x @ ((q - z) s)`` in float64: the real-valued product of the codes the kernel multiplies."""
    k, n = q.shape
    codes = np.asarray(q.values(), np.float64)
    groups = q.scale.shape[-2]
    scale = np.repeat(np.asarray(q.scale, np.float64).reshape(groups, n), k // groups, axis=0)
    if q.zero_point is not None:
        codes = codes - np.repeat(np.asarray(q.zero_point, np.float64).reshape(groups, n), k // groups, axis=0)
    return np.asarray(x, np.float64) @ (codes * scale)


def _assert_one_rounding(got, exact, dtype):
    """Within one rounding of x's dtype of the exact product (float32 sums add far less at these K)."""
    eps = float(jnp.finfo(dtype).eps)
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - exact) <= eps * np.abs(exact) + 1e-5 * np.abs(exact).max())


CASES = [  # m, k, n, group, zero point, dtype, blocks
    (1, 512, 256, 128, True, jnp.bfloat16, None),  # batch-1 decode: x padded to 8 rows, two groups a step
    (5, 1024, 384, 128, False, jnp.float16, DecodeBlocks(stages=3, splits=3)),  # 3 blocks; splits of 1, 1, 2 steps
    (16, 512, 256, None, True, jnp.bfloat16, DecodeBlocks(stages=2, splits=1)),  # per channel: one group over K
    (9, 1024, 256, 512, True, jnp.bfloat16, DecodeBlocks(stages=4, splits=2)),  # a group over two steps
    (12, 512, 256, 128, True, jnp.bfloat16, DecodeBlocks(tile_k=128, stages=2)),  # one chunk a step
    (2, 1024, 256, 128, True, jnp.bfloat16, DecodeBlocks(tile_k=512, stages=2)),  # four chunks, four groups a step
    (3, 640, 256, 128, True, jnp.bfloat16, None),  # K = 5 x 128: the defaults take one chunk a step
]


@pytest.mark.parametrize("m,k,n,group,zp,dtype,blocks", CASES)
def test_kernel_is_the_real_valued_product_rounded_once(m, k, n, group, zp, dtype, blocks):
    q = _quantized(k, n, group, zp, seed=m + k)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    rows, scale, zero = _kernel_args(q, group)
    got = decode_hopper(x, rows, scale, zero_point=zero, group=group, blocks=blocks, interpret=True)
    assert got.dtype == x.dtype and got.shape == (m, n)
    _assert_one_rounding(got, _exact_product(x, q), dtype)


@pytest.mark.parametrize("m,group,zp", [(1, None, False), (7, 128, True)])
def test_int8_rows_are_the_real_valued_product_too(m, group, zp):
    """int8 codes (N, K), as rtn-w8's decode layout stores them (per channel, symmetric), or grouped with zero points
    (|q - z| <= 255: exact in bf16)."""
    q = _quantized(512, 256, group, zp, seed=m, bits=8)
    x = jax.random.normal(jax.random.key(m), (m, 512)).astype(jnp.bfloat16)
    rows, scale, zero = _kernel_args(q, group)
    assert rows.dtype == jnp.int8 and rows.shape == (256, 512)
    got = decode_hopper(x, rows, scale, zero_point=zero, group=group, interpret=True)
    _assert_one_rounding(got, _exact_product(x, q), jnp.bfloat16)


def test_a_layer_of_a_stack_is_read_in_place_with_a_bias():
    k, n, group = 512, 256, 128
    qs = [_quantized(k, n, group, True, seed=s) for s in range(3)]
    args = [_kernel_args(q, group) for q in qs]
    stack, scales, zps = (jnp.stack([a[i] for a in args]) for i in range(3))
    x = jax.random.normal(jax.random.key(4), (3, k)).astype(jnp.bfloat16)
    bias = jnp.linspace(-2, 2, n).astype(jnp.bfloat16)
    got = decode_hopper(x, stack, scales, zero_point=zps, group=group, bias=bias, layer=jnp.int32(1),
                             interpret=True)
    _assert_one_rounding(got, _exact_product(x, qs[1]) + np.asarray(bias, np.float64), jnp.bfloat16)
    other = _exact_product(x, qs[0]) + np.asarray(bias, np.float64)
    assert not np.allclose(np.asarray(got, np.float64), other, atol=0.1)


def test_transposed_codes_are_the_qarrays_values_out_by_in():
    q = _quantized(256, 128, 128, True, seed=3)
    rows = transpose_codes(q.values())
    assert rows.dtype == jnp.int4 and rows.shape == (128, 256)
    np.testing.assert_array_equal(np.asarray(rows, np.int8).T, np.asarray(q.values()))


def test_splits_keep_two_steps_a_split_fill_the_sms_and_cover_k_evenly():
    def splits(k, n, rows=8, sms=132, tile_k=256):
        return splits_for(n // 128, k // tile_k, sms, step_bytes=128 * tile_k // 2, split_bytes=n * rows * 4)

    assert splits(4096, 4096) == 4  # 32 blocks of 128 outputs: 128 work items on 132 SMs
    assert splits(11008, 4096) == 4  # 43 steps (a prime): splits of 10 and 11 steps, 128 items
    for k, n in ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (4096, 22016)):
        s = splits(k, n)
        assert (k // 256) // s >= 2 and (n // 128) * s >= 64  # at least half the SMs busy
    assert splits(512, 4096) == 1  # two steps: not split
    assert splits(4096, 4096, sms=2) == 1  # two SMs: the 32 blocks keep them busy
    assert splits(11008, 4096, rows=16) <= splits(11008, 4096, rows=8)  # more partial sums: never more splits
    for si_steps in ((43, 4), (16, 4), (5, 3), (2, 2)):
        k_steps, n_splits = si_steps
        ranges = [split_steps(si, k_steps, n_splits) for si in range(n_splits)]
        assert [f for f, _ in ranges] == [0] + list(np.cumsum([c for _, c in ranges])[:-1])  # contiguous
        assert sum(c for _, c in ranges) == k_steps and max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


def test_can_use_names_what_the_kernel_does_not_take():
    ok = lambda **kw: can_use(**{**dict(x_shape=(1, 512), x_dtype=jnp.bfloat16, w_dtype=jnp.int4, k=512,  # noqa: E731
                                        n=256, group=128), **kw})
    with config.interpret(True):
        assert ok() == (True, "") and ok(group=None) == (True, "") and ok(x_shape=(16, 512)) == (True, "")
        assert "at most 16" in ok(x_shape=(17, 512))[1]
        assert "bfloat16/float16" in ok(x_dtype=jnp.float32)[1]
        assert "expected int4 or int8" in ok(w_dtype=jnp.uint8)[1] and ok(w_dtype=jnp.int8) == (True, "")
        assert "not of 128" in ok(n=320)[1] and "multiple of 128" in ok(k=576, x_shape=(1, 576))[1]
        assert ok(k=640, x_shape=(1, 640)) == (True, "")  # not a multiple of 256: one 128-value chunk a step
        assert "multiple of 256" in ok(k=640, x_shape=(1, 640), blocks=DecodeBlocks(tile_k=256))[1]
        assert "group 64" in ok(group=64)[1] and "group 384" in ok(group=384)[1]  # 384 does not divide 512
        assert ok(group=128, blocks=DecodeBlocks(tile_k=512)) == (True, "")  # four groups a step
        assert "tile_k 256" in ok(group=384, k=768, x_shape=(1, 768))[1]  # neither divides the other
    with config.compiling_for(FAKE_H100):
        assert ok() == (True, "")
    with config.compiling_for(FAKE_A100):
        assert not ok()[0] and "Hopper" in ok()[1]


def test_bad_input_gets_one_clear_error():
    q = _quantized(512, 256, 128, False, seed=1)
    rows, scale, _ = _kernel_args(q, 128)
    x = jnp.zeros((2, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"expects x \(M, K\) and w_t \(N, K\)"):
        decode_hopper(jnp.zeros((2, 256), jnp.bfloat16), rows, scale, group=128, interpret=True)
    with pytest.raises(ValueError, match="groups of 128"):
        decode_hopper(x, rows, scale[:2], group=128, interpret=True)
    with pytest.raises(ValueError, match="per channel"):
        decode_hopper(x, rows, scale, interpret=True)
    with pytest.raises(ValueError, match="zero_point"):
        decode_hopper(x, rows, scale, zero_point=jnp.zeros_like(scale), group=128, interpret=True)
    with pytest.raises(ValueError, match="bias"):
        decode_hopper(x, rows, scale, bias=jnp.zeros((7,)), group=128, interpret=True)
    with pytest.raises(ValueError, match="at most 16"):
        decode_hopper(jnp.zeros((17, 512), jnp.bfloat16), rows, scale, group=128, interpret=True)
    with pytest.raises(ValueError, match="3 K splits of 2 steps"):
        decode_hopper(x, rows, scale, group=128, blocks=DecodeBlocks(splits=3), interpret=True)
    with pytest.raises(ValueError, match="tile_k a multiple of 128"):
        DecodeBlocks(tile_k=64)


@pytest.mark.parametrize("m,group,zp,bias,stacked,codes", [(1, 128, True, False, False, jnp.int4),
                                                           (16, None, False, True, True, jnp.int4),
                                                           (4, 128, False, True, True, jnp.int4),
                                                           (12, 128, False, False, True, jnp.int4),
                                                           (1, None, False, False, True, jnp.int8),
                                                           (16, 128, True, True, False, jnp.int8)])
def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call(m, group, zp, bias, stacked, codes):
    """Lowered for a Hopper GPU on this CPU: Mosaic GPU's layout inference accepts the int4 tile loaded from shared
    memory into wgmma's register layout, converted to bf16 there and given as the A operand. 9-15 rows: x padded to
    16 first (its (8, 64)-tiled TMA box takes 8 rows or 16, a box past a shorter x's end filled with zeros)."""
    k, n = 1024, 512
    lead = (4,) if stacked else ()
    groups = 1 if group is None else k // group
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((*lead, n, k), codes),
            jax.ShapeDtypeStruct((*lead, groups, n), jnp.float32),
            jax.ShapeDtypeStruct((*lead, groups, n), jnp.int8) if zp else None,
            jax.ShapeDtypeStruct((n,), jnp.bfloat16) if bias else None,
            jax.ShapeDtypeStruct((), jnp.int32) if stacked else None]

    def f(x, w, s, z, b, layer):
        return decode_hopper(x, w, s, zero_point=z, group=group, bias=b, layer=layer)

    with config.compiling_for(FAKE_H100):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "__gpu$xla.gpu.triton" not in text


# --------------------------------------------------------------------------- W8A8 at decode rows


def _w8a8_weights(n, k, seed, fp8, lead=()):
    """(N, K) int8 codes (``fp8``: E4M3 bit patterns) and per-channel scales (..., 1, N), as a K-major W8A8 QArray
    stores them."""
    rng = np.random.default_rng(seed)
    if not fp8:
        return (jnp.asarray(rng.integers(-127, 128, (*lead, n, k)), jnp.int8),
                jnp.asarray(rng.uniform(0.001, 0.01, (*lead, 1, n)), jnp.float32))
    w = rng.normal(size=(*lead, n, k)).astype(np.float32)
    scale = np.abs(w).max(-1, keepdims=True) / fp8grid.MAX
    return fp8grid.encode(jnp.asarray(w / scale)), jnp.asarray(np.swapaxes(scale, -1, -2), jnp.float32)


W8A8_CASES = [  # m, k, n, fp8, layer, static activation scale, blocks
    (1, 512, 256, False, None, None, None),  # batch-1 decode: x's codes padded to 8 rows
    (16, 1280, 256, False, 2, 0.05, DecodeBlocks(splits=2)),  # layer 2 of a stack, static scale; splits of 2 and 3
    (5, 768, 384, True, None, None, DecodeBlocks(tile_k=128, stages=3, splits=2)),  # FP8; three blocks of outputs
    (12, 1024, 256, True, 1, None, None),  # FP8, a layer of a stack
]


@pytest.mark.parametrize("m,k,n,fp8,layer,act,blocks", W8A8_CASES)
def test_w8a8_decode_is_the_w8a8_reference(m, k, n, fp8, layer, act, blocks):
    """int8: exact int32 sums, then the reference's float32 rescale in its order -- the same bits. FP8: exact
    float32 products, summed a 128-value chunk at a time (promoted) -- within one rounding of x's dtype. A shorter
    split's void last step adds nothing."""
    lead = () if layer is None else (3,)
    wq, scale = _w8a8_weights(n, k, m, fp8, lead)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(jnp.bfloat16)
    got = w8a8_decode_hopper(x, wq, scale, act_scale=act, layer=None if layer is None else jnp.int32(layer), fp8=fp8,
                             blocks=blocks, interpret=True)
    one = (lambda a: a) if layer is None else (lambda a: a[layer])  # noqa: E731
    want = w8a8_reference(x, one(wq).T, one(scale), act_scale=act, fp8=fp8)
    assert got.dtype == x.dtype and got.shape == (m, n)
    if fp8:
        eps = float(jnp.finfo(jnp.bfloat16).eps)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=eps, atol=eps)
    else:
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_w8a8_decode_bad_input_gets_one_clear_error():
    wq, scale = _w8a8_weights(256, 512, 0, False)
    x = jnp.zeros((2, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"expects x \(M, K\) and wq_t \(N, K\)"):
        w8a8_decode_hopper(jnp.zeros((2, 256), jnp.bfloat16), wq, scale, interpret=True)
    with pytest.raises(ValueError, match="expected int8"):
        w8a8_decode_hopper(x, wq.astype(jnp.int4), scale, interpret=True)
    with pytest.raises(ValueError, match="per channel"):
        w8a8_decode_hopper(x, wq, jnp.ones((4, 256)), interpret=True)
    with pytest.raises(ValueError, match="at most 16"):
        w8a8_decode_hopper(jnp.zeros((17, 512), jnp.bfloat16), wq, scale, interpret=True)
    with pytest.raises(ValueError, match="bias"):
        w8a8_decode_hopper(x, wq, scale, bias=jnp.zeros((7,)), interpret=True)


@pytest.mark.parametrize("m,fp8,stacked,bias", [(1, False, True, False), (16, True, True, True),
                                                 (4, True, False, False), (9, True, False, False)])
def test_w8a8_decode_lowers_for_cuda_to_one_mosaic_gpu_call(m, fp8, stacked, bias):
    """Lowered for a Hopper GPU on this CPU: int8 / E4M3 codes as wgmma's A operand from shared memory, x's codes its
    transposed B, int32 / float32 accumulators carried through the K loop."""
    k, n = 1024, 512
    lead = (4,) if stacked else ()
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((*lead, n, k), jnp.int8),
            jax.ShapeDtypeStruct((*lead, 1, n), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.bfloat16) if bias else None,
            jax.ShapeDtypeStruct((), jnp.int32) if stacked else None]

    def f(x, w, s, b, layer):
        return w8a8_decode_hopper(x, w, s, bias=b, layer=layer, fp8=fp8)

    with config.compiling_for(FAKE_H100):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "__gpu$xla.gpu.triton" not in text
