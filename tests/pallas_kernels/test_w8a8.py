import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core.quantize import Spec, quantize
from pallas_kernels.blocks import Blocks
from pallas_kernels.w8a8 import can_use, w8a8_matmul, w8a8_reference

# (M, K, N, group, zero points, bias)
SHAPES = [
    (1, 96, 80, None, False, False),  # decode row, N not a block multiple
    (37, 130, 90, None, True, True),  # ragged M/N/K
    (5, 100, 48, 32, True, False),  # ragged last group
    (20, 192, 40, 64, False, True),
    (3, 300, 24, 128, False, False),
]


def _operands(m, k, n, group, zp, bias, dtype=jnp.float32, seed=0):
    # numpy draws: an eager jax.random draw compiles once per shape (about 0.3 s each here)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32) * 2).astype(dtype)
    wq = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    groups = 1 if group is None else -(-k // group)
    s = jnp.asarray(rng.uniform(1e-3, 1e-2, (groups, n)), jnp.float32)
    z = jnp.asarray(rng.integers(-4, 5, (groups, n)), jnp.int8) if zp else None
    b = jnp.asarray(rng.standard_normal(n, np.float32)) if bias else None
    return x, wq, s, z, b


@pytest.mark.parametrize("m,k,n,group,zp,bias", SHAPES)
def test_kernel_matches_reference(m, k, n, group, zp, bias):
    x, wq, s, z, b = _operands(m, k, n, group, zp, bias)
    y = w8a8_matmul(x, wq, s, w_zero_point=z, bias=b, group=group, interpret=True)
    r = w8a8_reference(x, wq, s, w_zero_point=z, bias=b, group=group)
    assert y.shape == (m, n) and y.dtype == x.dtype
    np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("group,zp", [(None, True), (32, True), (None, False)])
def test_k_splits_and_kmajor_weights_match_one_pass(group, zp):
    """Split-K (decode grids): float32 partial sums, bias added once; K-major (transposed) weight tiles."""
    x, wq, s, z, b = _operands(3, 200, 40, group, zp, True)
    r = w8a8_reference(x, wq, s, w_zero_point=z, bias=b, group=group)
    for splits, transpose in ((1, False), (3, False), (1, True), (3, True)):
        y = w8a8_matmul(x, wq, s, w_zero_point=z, bias=b, group=group, k_splits=splits, transpose_w=transpose,
                        blocks=Blocks(16, 16, group or 32), interpret=True)
        np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(r))))


def test_integer_path_is_exact():
    """Integer-valued activations with unit scales: the output is the exact int8 x int8 product."""
    k, n = 77, 40
    rng = np.random.default_rng(0)
    xi = rng.integers(-127, 128, size=(9, k))
    wi = rng.integers(-127, 128, size=(k, n))
    y = w8a8_matmul(jnp.asarray(xi, jnp.float32), jnp.asarray(wi, jnp.int8), jnp.ones((1, n)), act_scale=1.0, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), (xi @ wi).astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_activations(dtype):
    x, wq, s, z, b = _operands(6, 64, 40, None, False, True, dtype=dtype)
    y = w8a8_matmul(x, wq, s, bias=b, interpret=True)
    r = w8a8_reference(x, wq, s, bias=b)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(r, np.float32), rtol=1e-2, atol=1e-2)


def test_static_activation_scale_clips_like_the_core():
    x, wq, s, _, _ = _operands(4, 64, 24, None, False, False)
    act_scale = jnp.float32(0.01)  # small: many activations clip at +-127
    y = w8a8_matmul(x, wq, s, act_scale=act_scale, interpret=True)
    np.testing.assert_allclose(y, w8a8_reference(x, wq, s, act_scale=act_scale), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [
        Spec(bits=8, granularity="channel"),
        Spec(bits=8, granularity="group", group_size=32),
        Spec(bits=8, granularity="channel", symmetric=False),
    ],
    ids=lambda s: s.describe(),
)
def test_matches_core_xla_w8a8(spec):
    w = jax.random.normal(jax.random.key(1), (100, 56))
    x = jax.random.normal(jax.random.key(2), (7, 100))
    q = quantize(w, spec, act_spec=Spec(bits=8, granularity="token"))
    groups = q.scale.shape[0]
    y = w8a8_matmul(
        x, q.qvalue, q.scale, w_zero_point=q.zero_point, group=None if groups == 1 else q.tile[0], interpret=True
    )
    r = ops.w8a8_xla(x, q, q.act_spec)
    np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m,k,n,group,zp,bias,static",
    [(1, 4096, 4096, None, False, False, False), (4096, 4096, 11008, 128, True, True, False), (17, 11008, 4096, None, False, True, True), (3, 100, 70, 32, True, False, False)],
)
def test_lowers_for_cuda(cuda_lowering, dtype, m, k, n, group, zp, bias, static):
    groups = 1 if group is None else -(-k // group)
    sds = jax.ShapeDtypeStruct
    args = [sds((m, k), dtype), sds((k, n), jnp.int8), sds((groups, n), jnp.float32)]
    args += [sds((groups, n), jnp.int8) if zp else None, sds((n,), jnp.float32) if bias else None]
    args += [sds((), jnp.float32) if static else None]

    def f(x, wq, s, z, b, a):
        return w8a8_matmul(x, wq, s, w_zero_point=z, bias=b, act_scale=a, group=group)

    text = cuda_lowering(f, *args)
    assert "w8a8_matmul" in text


def test_bad_input_is_rejected_clearly():
    x, wq, s, _, _ = _operands(2, 64, 16, None, False, False)
    with pytest.raises(ValueError, match="w_scale has shape"):
        w8a8_matmul(x, wq, s[:, :8], interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        w8a8_matmul(x, wq, jnp.ones((3, 16)), group=24, interpret=True)
    with pytest.raises(ValueError, match="must be int8"):
        w8a8_matmul(x, wq.astype(jnp.int32), s, interpret=True)
    assert can_use((2, 64), jnp.float32, jnp.int8, 64, None) == (True, "")
    assert not can_use((2, 64), jnp.int32, jnp.int8, 64, None)[0]
    assert not can_use((2, 64), jnp.float32, jnp.int8, 64, 48)[0]


@pytest.mark.parametrize("group,zp,transpose", [(None, False, False), (32, True, False), (None, True, True)])
def test_a_layer_of_a_stack_is_read_in_place(group, zp, transpose):
    """layer=l on stacked weights [L, ...] gives what the kernel gives on layer l alone (a traced index
    too); the K-major path slices the layer (it transposes a copy anyway)."""
    m, k, n, layers = 3, 96, 40, 3
    ops_ = [_operands(m, k, n, group, zp, True, seed=s) for s in range(layers)]
    x, b = ops_[0][0], ops_[0][4]
    wq, s, z = (None if ops_[0][i] is None else jnp.stack([o[i] for o in ops_]) for i in (1, 2, 3))
    kw = dict(bias=b, group=group, transpose_w=transpose, interpret=True)
    at = jax.jit(lambda x, wq, s, z, layer: w8a8_matmul(x, wq, s, w_zero_point=z, layer=layer, **kw))
    for layer in range(layers):
        want = w8a8_matmul(x, ops_[layer][1], ops_[layer][2], w_zero_point=ops_[layer][3], **kw)
        np.testing.assert_array_equal(np.asarray(at(x, wq, s, z, jnp.int32(layer))), np.asarray(want))
    with pytest.raises(ValueError, match="must be stacks"):
        w8a8_matmul(x, ops_[0][1], ops_[0][2], layer=0, **kw)
    # the layer transposed per call is pinned row-major (common.row_major): unpinned, a GPU compile laid out the
    # whole stack transposed inside the layer loop (a copy of every layer before it; scripts/gpu_aot.py --prefill)
    lowered = at.trace(x, wq, s, z, jnp.int32(0)).lower(lowering_platforms=("cuda",)).as_text()
    assert ("@LayoutConstraint" in lowered) == transpose


# --------------------------------------------------------------------------- FP8 (E4M3)


def _fp8_operands(m, k, n, group, seed=0):
    from llmeq_jax.core import fp8grid

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32) * 2)
    # E4M3 bit patterns, spread over the range
    wq = fp8grid.encode(jnp.asarray(rng.standard_normal((k, n), np.float32) * 100))
    groups = 1 if group is None else -(-k // group)
    s = jnp.asarray(rng.uniform(1e-3, 1e-2, (groups, n)), jnp.float32)
    return x, wq, s


@pytest.mark.parametrize("m,k,n,group,static,transpose", [
    (1, 96, 80, None, False, False), (37, 130, 90, None, True, False), (5, 100, 48, 32, False, True),
    (20, 192, 40, 64, False, False)])
def test_fp8_kernel_matches_its_definition(m, k, n, group, static, transpose):
    x, wq, s = _fp8_operands(m, k, n, group)
    a = jnp.float32(0.05) if static else None
    y = w8a8_matmul(x, wq, s, act_scale=a, group=group, fp8=True, transpose_w=transpose, interpret=True)
    r = w8a8_reference(x, wq, s, act_scale=a, group=group, fp8=True)
    assert y.shape == (m, n) and y.dtype == x.dtype
    np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_fp8_kernel_is_what_ops_linear_runs_in_xla():
    from pallas_kernels import config

    w = jax.random.normal(jax.random.key(4), (160, 48))
    x = jax.random.normal(jax.random.key(5), (3, 160)).astype(jnp.bfloat16)
    for spec in (Spec(8, "channel", grid="fp8"), Spec(8, "group", group_size=32, grid="fp8")):
        q = quantize(w, spec, act_spec=Spec(8, "token", grid="fp8"))
        with config.interpret(True):
            y = ops.linear(x, q, backend="pallas")
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ops.linear(x, q, backend="xla"), np.float32),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 4096])
def test_fp8_kernel_lowers_for_cuda(cuda_lowering, m):
    sds = jax.ShapeDtypeStruct
    args = [sds((m, 4096), jnp.bfloat16), sds((4096, 11008), jnp.int8), sds((1, 11008), jnp.float32)]
    text = cuda_lowering(lambda x, wq, s: w8a8_matmul(x, wq, s, fp8=True), *args)
    assert "w8a8_matmul" in text


def test_fp8_kernel_refuses_zero_points():
    x, wq, s = _fp8_operands(2, 64, 16, None)
    with pytest.raises(ValueError, match="no zero point"):
        w8a8_matmul(x, wq, s, w_zero_point=jnp.zeros_like(s, jnp.int8), fp8=True, interpret=True)
