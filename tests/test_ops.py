"""ops.linear on every path against float references, under jit / vmap / grad.

Two references per quantized path:
* tight: the same math in float64 numpy on the dequantized weight (and, for
  W8A8, on activations quantized here independently);
* loose: the float product ``x @ w``, with a relative error bound per path
  that says what the quantization costs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec, fake_quant, quantize

K, N = 200, 48  # K = 200 is not a multiple of the group size 64: the last group is shorter
TOKEN = Spec(bits=8, granularity="token")
TENSOR = Spec(bits=8, granularity="tensor")

# name -> (weight spec, activation spec, static activation scale?, relative error bound vs x @ w)
PATHS = {
    "w8-channel": (Spec(bits=8, granularity="channel"), None, False, 0.01),
    "w8-tensor-asym": (Spec(bits=8, granularity="tensor", symmetric=False), None, False, 0.02),
    "w4-g64": (Spec(bits=4, granularity="group", group_size=64), None, False, 0.15),
    "w4-g64-asym": (Spec(bits=4, granularity="group", group_size=64, symmetric=False), None, False, 0.15),
    "w3-g64": (Spec(bits=3, granularity="group", group_size=64), None, False, 0.3),
    "w2-channel-asym": (Spec(bits=2, granularity="channel", symmetric=False), None, False, 0.8),
    "w8a8-token": (Spec(bits=8, granularity="channel"), TOKEN, False, 0.02),
    "w8a8-static": (Spec(bits=8, granularity="channel"), TENSOR, True, 0.03),
    "w8a8-dynamic-tensor": (Spec(bits=8, granularity="channel"), TENSOR, False, 0.03),
    "w8a8-g64": (Spec(bits=8, granularity="group", group_size=64), TOKEN, False, 0.02),
    "w8a8-asym": (Spec(bits=8, granularity="channel", symmetric=False), TOKEN, False, 0.02),
    "w4a8-g64-asym": (Spec(bits=4, granularity="group", group_size=64, symmetric=False), TOKEN, False, 0.15),
}


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.lru_cache(maxsize=None)
def float_weight():
    return jnp.asarray(_rand((K, N), 0) / np.sqrt(K))


@functools.lru_cache(maxsize=None)
def activations(rows, seed=1):
    return jnp.asarray(_rand((rows, K), seed))


@functools.lru_cache(maxsize=None)
def make_weight(name):
    wspec, aspec, static, _ = PATHS[name]
    act_scale = None
    if static:  # a calibrated per-tensor scale: absmax of a calibration batch / 127
        act_scale = jnp.asarray(np.abs(_rand((64, K), 99)).max() / 127, jnp.float32)
    return quantize(float_weight(), wspec, act_spec=aspec, act_scale=act_scale)


def reference(x, w: QArray):
    """float64 numpy: (quantized activations) @ dequantized weight."""
    x = np.asarray(x, np.float64)
    wd = np.asarray(w.dequantize(jnp.float32), np.float64)
    if w.act_spec is not None:
        if w.act_scale is not None:
            s = float(w.act_scale)
        elif w.act_spec.granularity == "token":
            s = np.abs(x).max(-1, keepdims=True) / 127
        else:
            s = np.abs(x).max() / 127
        x = np.clip(np.round(x / s), -127, 127) * s
    return x @ wd


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


linear_xla = jax.jit(functools.partial(ops.linear, backend="xla"))


# --------------------------------------------------------------------------- float path


def test_float_weight_is_a_plain_matmul_with_bias():
    x, w = activations(5), float_weight()
    b = jnp.asarray(_rand((N,), 3))
    np.testing.assert_allclose(np.asarray(ops.linear(x, w, b)), np.asarray(x @ w + b), rtol=1e-6, atol=1e-6)
    y16 = ops.linear(x.astype(jnp.bfloat16), w)
    assert y16.dtype == jnp.bfloat16


# --------------------------------------------------------------------------- quantized paths


@pytest.mark.parametrize("rows", [1, 3, ops.SMALL_M + 16])  # small-M path, then the matmul path
@pytest.mark.parametrize("name", list(PATHS))
def test_quantized_paths_against_references(name, rows):
    w = make_weight(name)
    x = activations(rows)
    y = linear_xla(x, w)
    assert y.shape == (rows, N) and y.dtype == jnp.float32
    # Tight: the same math in float64. (W8A8 may differ by one activation rounding
    # step where x / s lands within float32 error of a .5 tie; that shows up as a tiny error.)
    tight = 1e-5 if w.act_spec is None else 1e-4
    assert rel_err(y, reference(x, w)) < tight
    # Loose: what quantization costs against the float product.
    bound = PATHS[name][3]
    assert rel_err(y, x @ float_weight()) < bound


@pytest.mark.parametrize("name", ["w8-channel", "w4-g64-asym", "w8a8-token", "w8a8-static", "w8a8-g64"])
def test_bias_batch_dims_and_default_backend(name):
    w = make_weight(name)
    x = jnp.asarray(_rand((2, 3, K), 5))
    b = jnp.asarray(_rand((N,), 6))
    y = ops.linear(x, w, b)  # default backend: falls back to XLA without a kernel
    assert y.shape == (2, 3, N)
    want = reference(x.reshape(6, K), w).reshape(2, 3, N) + np.asarray(b)
    assert rel_err(y, want) < 1e-4


def _matmul_path(x, w):
    return jnp.matmul(x, w.dequantize(x.dtype))


@pytest.mark.parametrize("name", ["w8-channel", "w4-g64", "w4-g64-asym", "w3-g64", "w2-channel-asym", "w8-tensor-asym"])
def test_small_m_formulations_match_the_matmul_path(name):
    w = make_weight(name)
    x = activations(ops.SMALL_M)
    large = jax.jit(_matmul_path)(x, w)
    for small in (ops._weight_only_reduce, ops._weight_only_chunked):
        np.testing.assert_allclose(np.asarray(jax.jit(small)(x, w)), np.asarray(large), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "k,spec,pack_axis,chunked",
    [
        (200, Spec(bits=4, granularity="group", group_size=48), None, True),  # chunk 16, ragged last group
        (130, Spec(bits=2, granularity="channel"), None, True),  # K not a multiple of the chunk
        (100, Spec(bits=4, granularity="group", group_size=7), None, False),  # group too small to chunk
        (96, Spec(bits=4, granularity="channel"), 1, False),  # packed along out: not row chunks
        (64, Spec(bits=8, granularity="channel", axis=0), None, False),  # one scale per input row
    ],
)
def test_small_m_layouts(k, spec, pack_axis, chunked):
    w = jnp.asarray(_rand((k, 24), 11))
    q = quantize(w, spec, pack_axis=pack_axis)
    assert (ops._chunk_rows(q) is not None) == chunked
    x = jnp.asarray(_rand((2, k), 12))
    y = linear_xla(x, q)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference(x, q)), rtol=1e-5, atol=1e-5)


def test_one_dimensional_input():
    for name in ["w4-g64", "w8a8-token"]:
        w = make_weight(name)
        x = activations(1)[0]
        y = linear_xla(x, w)
        assert y.shape == (N,)
        assert rel_err(y, reference(x, w)) < 1e-4


def test_act_argument_overrides_the_weight_spec():
    w = make_weight("w8-channel")  # weight-only by itself
    x = activations(16)
    y = ops.linear(x, w, act=TOKEN, backend="xla")
    w_a = make_weight("w8a8-token")
    np.testing.assert_allclose(np.asarray(y), np.asarray(linear_xla(x, w_a)), rtol=1e-6, atol=1e-6)
    assert rel_err(y, reference(x, w)) > 1e-6  # activation rounding really happened


def test_bf16_activations_on_quantized_weight():
    w = make_weight("w4-g64")
    for rows in (1, 16):
        x = activations(rows).astype(jnp.bfloat16)
        y = linear_xla(x, w)
        assert y.dtype == jnp.bfloat16
        assert rel_err(y, reference(x.astype(jnp.float32), w)) < 2e-2


# --------------------------------------------------------------------------- jit / vmap / grad


@pytest.mark.parametrize("name", ["w8-channel", "w4-g64-asym", "w8a8-token", "w8a8-static"])
def test_jit_and_vmap_agree_with_eager(name):
    w = make_weight(name)
    xb = jnp.asarray(_rand((4, 6, K), 7))  # a batch of (tokens, features)
    eager = ops.linear(xb, w, backend="xla")
    np.testing.assert_allclose(np.asarray(linear_xla(xb, w)), np.asarray(eager), rtol=1e-5, atol=1e-5)
    per_example = jax.jit(jax.vmap(lambda a: ops.linear(a, w, backend="xla")))(xb)
    np.testing.assert_allclose(np.asarray(per_example), np.asarray(eager), rtol=1e-5, atol=1e-5)
    # vmap over single tokens takes the small-M path inside; same numbers.
    per_token = jax.jit(jax.vmap(jax.vmap(lambda a: ops.linear(a, w, backend="xla"))))(xb)
    np.testing.assert_allclose(np.asarray(per_token), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_vmap_over_stacked_quantized_weights():
    ws = jnp.stack([float_weight(), 2 * float_weight()])
    qs = jax.vmap(lambda a: quantize(a, Spec(bits=4, granularity="group", group_size=64)))(ws)
    x = activations(3)
    y = jax.vmap(lambda q: ops.linear(x, q, backend="xla"))(qs)
    np.testing.assert_allclose(np.asarray(y[1]), 2 * np.asarray(y[0]), rtol=1e-5, atol=1e-6)


def test_grad_wrt_x_through_float_and_quantized_weights():
    x = activations(4)
    c = jnp.asarray(_rand((4, N), 8))
    w = float_weight()
    g = jax.jit(jax.grad(lambda a: jnp.sum(ops.linear(a, w) * c)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(c @ w.T), rtol=1e-5, atol=1e-5)
    q = make_weight("w4-g64")
    gq = jax.jit(jax.grad(lambda a: jnp.sum(ops.linear(a, q, backend="xla") * c)))(x)
    np.testing.assert_allclose(np.asarray(gq), np.asarray(c @ q.dequantize().T), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clip", [None, 0.6])
def test_grad_wrt_weight_through_fake_quant(clip):
    """QAT: d/dw of linear(x, fake_quant(w)) is x^T c where w is inside the clip range, else 0."""
    spec = Spec(bits=4, granularity="group", group_size=64, clip=clip)
    x = activations(8)
    c = jnp.asarray(_rand((8, N), 9))
    w = float_weight()
    loss = lambda v: jnp.sum(ops.linear(x, fake_quant(v, spec)) * c)  # noqa: E731
    g = np.asarray(jax.jit(jax.grad(loss))(w))
    q = quantize(w, spec)
    bound = 7 * np.repeat(np.asarray(q.scale), 64, axis=0)[:K]
    inside = np.abs(np.asarray(w)) <= bound * (1 - 1e-6)
    outside = np.abs(np.asarray(w)) > bound * (1 + 1e-6)
    full = np.asarray(x.T @ c)
    np.testing.assert_allclose(g[inside], full[inside], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(g[outside], 0.0)
    assert outside.any() == (clip is not None)
    # Forward equals the real quantize -> dequantize product.
    np.testing.assert_allclose(
        float(loss(w)), float(jnp.sum((x @ q.dequantize()) * c)), rtol=1e-5
    )


# --------------------------------------------------------------------------- other entry points / errors


def test_qeinsum_and_dequantize_leaf():
    w = make_weight("w4-g64")
    x = jnp.asarray(_rand((2, 3, K), 10))
    y = ops.qeinsum("btk,kn->btn", x, w)
    assert rel_err(y, reference(x.reshape(6, K), w).reshape(2, 3, N)) < 1e-5
    np.testing.assert_array_equal(np.asarray(ops.dequantize_tree_leaf(w)), np.asarray(w.dequantize()))
    assert ops.dequantize_tree_leaf(float_weight()) is float_weight()


def test_bad_input_errors():
    x = activations(2)
    with pytest.raises(ValueError, match=r"input has 200 features but the kernel expects 100"):
        ops.linear(x, jnp.ones((100, 8)))
    with pytest.raises(ValueError, match=r"expects an \(in, out\) kernel, got shape \(200,\)"):
        ops.linear(x, jnp.ones((200,)))
    with pytest.raises(ValueError, match=r"input has 200 features but the kernel expects 100"):
        ops.linear(x, quantize(jnp.ones((100, 8)), Spec(bits=4)))
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        ops.linear(x, float_weight(), backend="cuda")


def _dot_dtypes(fn, *args):
    """(lhs dtype, rhs dtype, preferred type) of every dot_general in the traced program."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                lhs, rhs = (str(v.aval.dtype) for v in eqn.invars)
                out.append((lhs, rhs, str(eqn.params["preferred_element_type"])))
            for p in eqn.params.values():  # nested programs (jit, custom_vjp, ...)
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


@pytest.mark.parametrize("name", ["w8a8-token", "w8a8-static", "w8a8-g64", "w4a8-g64-asym"])
def test_w8a8_is_an_int8_dot_accumulating_in_int32(name):
    dots = _dot_dtypes(functools.partial(ops.linear, backend="xla"), activations(16), make_weight(name))
    assert dots and all(d == ("int8", "int8", "int32") for d in dots), dots


# --------------------------------------------------------------------------- native CPU dispatch


def _lowered(f, x):
    return jax.jit(f).lower(x).as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are CPU kernels")
def test_native_dispatch_and_its_switches(monkeypatch):
    from llmeq_jax import native
    from pallas_kernels import config

    if not native.available():
        pytest.skip(f"native library: {native.unavailable_reason()}")
    w4 = make_weight("w4-g64")
    w8a8 = make_weight("w8a8-token")
    x1 = activations(1)
    assert "llmeq_wo_matmul" in _lowered(lambda a: ops.linear(a, w4), x1)
    assert "llmeq_w8a8_matmul" in _lowered(lambda a: ops.linear(a, w8a8), x1)
    # What forces XLA: the backend argument, both off switches, the env var, too many rows.
    assert "llmeq_" not in _lowered(lambda a: ops.linear(a, w4, backend="xla"), x1)
    with native.disabled():
        assert "llmeq_" not in _lowered(lambda a: ops.linear(a, w4), x1)
    with config.disabled():
        assert "llmeq_" not in _lowered(lambda a: ops.linear(a, w8a8), x1)
    big = activations(ops.NATIVE_MAX_ROWS["int4"] + 1)  # past the row-streaming kernel: the panels need AVX-512
    assert ("llmeq_" in _lowered(lambda a: ops.linear(a, w4), big)) == native.avx512()
    monkeypatch.setenv("LLMEQ_NATIVE", "0")
    assert "llmeq_" not in _lowered(lambda a: ops.linear(a, w4), x1)
    monkeypatch.delenv("LLMEQ_NATIVE")
    # 2-bit weights are re-packed into int4 slots for the int4 kernel in the same call.
    w2 = make_weight("w2-channel-asym")  # made outside the trace (its finiteness check reads values)
    assert "llmeq_wo_matmul" in _lowered(lambda a: ops.linear(a, w2), x1)
    # The results agree with XLA (float32 summation order only).
    for w in (w4, w8a8, w2):
        np.testing.assert_allclose(
            np.asarray(ops.linear(x1, w)), np.asarray(linear_xla(x1, w)), rtol=1e-5, atol=1e-5 * np.sqrt(K)
        )


def test_linear_nk_is_the_transposed_product():
    wt = quantize(float_weight().T, Spec(bits=4, granularity="group", group_size=64, axis=1), pack_axis=1)
    x = activations(3)
    ref = np.asarray(x, np.float64) @ np.asarray(wt.dequantize(), np.float64).T
    for backend in ("auto", "xla"):
        y = jax.jit(functools.partial(ops.linear_nk, backend=backend))(x, wt)
        assert rel_err(y, ref) < 1e-6
    dense = float_weight().T
    np.testing.assert_allclose(np.asarray(ops.linear_nk(x, dense)), np.asarray(x @ dense.T), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_nk(activations(1)[:, :10], wt)


# --------------------------------------------------------------------------- quantized embedding tables


@pytest.mark.parametrize(
    "spec",
    [Spec(bits=8), Spec(bits=4, granularity="group", group_size=32, symmetric=False), Spec(bits=8, granularity="tensor")],
)
def test_take_rows_dequantizes_only_the_rows_read(spec):
    from llmeq_jax.core.rules import quantize_table

    table = quantize_table(_rand((300, 96), 7), spec)
    ids = jnp.asarray([[0, 299, 5], [5, 17, 42]])
    rows = jax.jit(ops.take_rows)(table, ids)
    assert rows.shape == (2, 3, 96)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(table.dequantize())[np.asarray(ids)])


def test_take_rows_float_table_and_bad_layouts():
    table = _rand((10, 8), 3)
    np.testing.assert_array_equal(np.asarray(ops.take_rows(table, jnp.asarray([3, 1]))), np.asarray(table)[[3, 1]])
    packed_rows = quantize(_rand((10, 8), 3), Spec(bits=4), pack_axis=0)  # int4 pairs across rows
    with pytest.raises(ValueError, match="pack_axis=1"):
        ops.take_rows(packed_rows, jnp.asarray([1]))


def test_model_with_an_int8_table_equals_the_model_with_its_dequantized_table():
    from llmeq_jax.core.rules import Recipe, Rule, quantize_params
    from llmeq_jax.models import forward, init_params
    from llmeq_jax.models.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, intermediate_size=48, norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True, rope_theta=10000.0)
    params = init_params(config, jax.random.key(0))
    q = quantize_params(params, Recipe(rules=(Rule("embed/embedding", weight=Spec(bits=8)),)))
    table = q["embed"]["embedding"]
    assert isinstance(table, QArray) and table.nbytes < params["embed"]["embedding"].nbytes / 3
    floats = {**q, "embed": {"embedding": table.dequantize()}}
    toks = jnp.asarray([[1, 7, 299, 42, 5]])
    np.testing.assert_allclose(np.asarray(forward(config, q, toks)), np.asarray(forward(config, floats, toks)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symmetric,dtype", [(True, jnp.bfloat16), (False, jnp.bfloat16), (True, jnp.float16)])
def test_a_gpus_prompt_product_over_per_channel_int8_codes_is_one_gemm_over_them(symmetric, dtype):
    """Traced for a GPU, a prompt's (> SMALL_M rows) product with per-channel int8 weights multiplies x by the codes
    themselves and scales the output (XLA converts the codes in its GEMM's operand loads): no dequantized [K, N]
    weight is made, as it is on a CPU; the result is the dequantized product's within the output dtype's rounding.
    The GEMM writes bfloat16 for symmetric codes and bfloat16 x (the scaling then fuses into what follows), float32
    where a zero point's correction or float16's range needs it."""
    import types

    from pallas_kernels import config as kernel_config

    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    k, n = 96, 80
    x = jax.random.normal(jax.random.key(0), (3, 100, k)).astype(dtype) + (0.0 if symmetric else 0.5)
    w = quantize(jax.random.normal(jax.random.key(1), (k, n)) + (0.0 if symmetric else 0.3),
                 Spec(bits=8, granularity="channel", symmetric=symmetric))
    assert (w.zero_point is None) == symmetric

    def weight_sized(jaxpr):  # equations that make a [K, N] float array: the dequantized weight
        return [e for e in jaxpr.eqns if e.primitive.name in ("mul", "sub")
                and any(v.aval.shape == (k, n) for v in e.outvars)]

    want = np.asarray(x, np.float32) @ np.asarray(w.dequantize(jnp.float32))
    # (fresh lambdas: JAX's trace caches do not see the target the trace is for)
    with kernel_config.compiling_for(gpu):
        jaxpr = jax.make_jaxpr(lambda a, b: ops.weight_only_xla(a, b))(x, w).jaxpr
        got = jax.jit(lambda a, b: ops.weight_only_xla(a, b))(x, w)
    assert not weight_sized(jaxpr)
    gemms = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [e.outvars[0].aval.dtype for e in gemms] == [jnp.bfloat16 if symmetric and dtype == jnp.bfloat16
                                                        else jnp.float32]
    assert weight_sized(jax.make_jaxpr(lambda a, b: ops.weight_only_xla(a, b))(x, w).jaxpr)  # a CPU's: unchanged
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2 * float(np.max(np.abs(want))))
