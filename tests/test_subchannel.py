"""llmeq_jax.subchannel: a prompt's int4 group-wise product in the form XLA's sub-channel fusion takes -- its
arithmetic (on this CPU: the same XLA program a GPU runs, unfused), which products take it, where (a GPU, the
switch, a dispatch table), and the jits that compile a prompt with its flag."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import dispatch_table, generate as gen, native, ops, pipeline, subchannel
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.layer_slice import LayerSlice
from llmeq_jax.models import forward, init_params
from llmeq_jax.models.config import ModelConfig
from pallas_kernels import config as kernel_config, hardware_checked

FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def _int4(k, n, group=128, symmetric=False, seed=0, offset=0.01):
    w = jax.random.normal(jax.random.key(seed), (k, n)) * 0.02 + (0 if symmetric else offset)
    return quantize(w, Spec(bits=4, granularity="group", group_size=group, symmetric=symmetric))


def _as_fused(x, w):
    """``x @ dequantize(w)`` in float32 as the fused GEMM rounds it: scales rounded to x's dtype, each code times its
    scale rounded to x's dtype (a weight, as the dequantized copy rounds it), each zero point times its scale too
    (met by x's group sums)."""
    dtype, k, group = x.dtype, w.shape[0], w.tile[0]
    scale = jnp.repeat(w.scale.astype(dtype), group, axis=0)
    codes = (w.values().astype(dtype) * scale).astype(jnp.float32)
    y = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), codes, precision=jax.lax.Precision.HIGHEST)
    if w.zero_point is None:
        return y
    sums = jnp.sum(x.astype(jnp.float32).reshape(*x.shape[:-1], k // group, group), axis=-1)
    zs = (w.zero_point.astype(dtype) * w.scale.astype(dtype)).astype(jnp.float32)
    return y - jnp.einsum("...g,gn->...n", sums, zs, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_the_product_is_the_dequantized_weights_with_half_precision_scales(symmetric, dtype, group):
    """``matmul`` is ``x @ (q s) - xg @ (z s)`` with ``s``, ``q s`` and ``z s`` rounded to x's dtype (:func:`_as_fused`),
    to the output's one rounding: x's group sums, two half-precision parts, lose nothing more. Leading dims of x kept;
    x's columns carry a mean, so each group's sum is large beside its terms (where one half-precision part of it
    would lose ~2^-9 of a sum times z s)."""
    w = _int4(384, 96, group, symmetric, offset=0.03)
    x = (jax.random.normal(jax.random.key(1), (2, 40, 384)) * 2 + 3).astype(dtype)
    got = np.asarray(jax.jit(subchannel.matmul)(x, w), np.float32)
    want = np.asarray(_as_fused(x, w))
    assert got.shape == (2, 40, 96)
    ulp = 2.0 ** -(8 if dtype == jnp.bfloat16 else 11)  # the output's rounding: half an ulp, an ulp near a boundary
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * np.abs(want).mean() * 0.1)
    # against the float weights: as close as XLA's usual path (the weights dequantized into x's dtype) gets
    exact = np.asarray(x.astype(jnp.float32) @ w.dequantize(jnp.float32))
    usual = np.asarray((x @ w.dequantize(dtype)).astype(jnp.float32))
    assert np.abs(got - exact).mean() <= 1.5 * np.abs(usual - exact).mean()


def test_zero_points_join_the_gemm_as_rows_of_each_group():
    """The zero points' share is in the one GEMM: a group's codes then its zero point twice, met by x's columns then
    minus the group's sum in two parts whose sum is the float32 sum."""
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 8).astype(jnp.bfloat16) * 100.3
    rows = subchannel._with_group_sums(x, 2)
    assert rows.shape == (1, 12)
    np.testing.assert_array_equal(np.asarray(rows[0, [0, 1, 2, 3, 6, 7, 8, 9]]), np.asarray(x[0]))
    sums = np.asarray(x, np.float32).reshape(2, 4).sum(-1)
    parts = np.asarray(rows, np.float32)[0].reshape(2, 6)[:, 4:]
    np.testing.assert_allclose(-parts.sum(-1), sums, rtol=2 ** -16)
    assert np.all(parts[:, 1] != 0)  # what the first part rounded off is kept
    codes = jnp.arange(2 * 4 * 3, dtype=jnp.int8).reshape(2, 4, 3) % 8
    zp = jnp.asarray([[-8, 0, 7], [1, -1, 3]], jnp.int8)
    with_zp = np.asarray(subchannel._with_zero_point_rows(codes, zp))
    assert with_zp.shape == (2, 6, 3)
    np.testing.assert_array_equal(with_zp[:, :4], np.asarray(codes))
    np.testing.assert_array_equal(with_zp[:, 4], np.asarray(zp))
    np.testing.assert_array_equal(with_zp[:, 5], np.asarray(zp))


def test_the_codes_are_unpacked_to_int4_in_a_fusion_of_their_own():
    """The GEMM's weight operand is int4 codes behind an optimization barrier, converted and scaled in x's dtype (the
    form XLA's flag fuses); the zero-point form's GEMM is (K + 2 G) deep."""
    for w, depth in ((_int4(256, 64, symmetric=True), 256), (_int4(256, 64), 256 + 2 * 2)):
        jaxpr = jax.make_jaxpr(subchannel.matmul)(jnp.zeros((70, 256), jnp.bfloat16), w)
        text = str(jaxpr)
        assert "optimization_barrier" in text and "i4[" in text
        dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert len(dots) == 1 and dots[0].invars[0].aval.shape == (70, depth)
        assert dots[0].invars[1].aval.dtype == jnp.bfloat16


@pytest.mark.parametrize("make, why", [
    (lambda: quantize(jnp.ones((256, 64)), Spec(bits=8, granularity="group", group_size=128)), "int8"),
    (lambda: quantize(jnp.ones((256, 64)), Spec(bits=4, granularity="channel")), "scales"),
    (lambda: quantize(jnp.ones((250, 64)), Spec(bits=4, granularity="group", group_size=128)), "scales"),
    (lambda: dataclasses.replace(_int4(256, 64), zero_point=_int4(256, 64).zero_point.astype(jnp.float32)), "float"),
    (lambda: quantize(jnp.ones((256, 64)), Spec(bits=4, granularity="group", group_size=128),
                      act_spec=Spec(bits=8, granularity="token")), "activations"),
])
def test_other_weights_say_why_they_do_not_take_it(make, why):
    assert why in subchannel.why_not(jnp.bfloat16, make())
    assert subchannel.why_not(jnp.bfloat16, _int4(256, 64)) == ""
    assert "float32" in subchannel.why_not(jnp.float32, _int4(256, 64))


def _measured(faster: str, zero_points: bool = True):
    """A dispatch table for FAKE_H100 that measured the path ``faster`` than XLA's on 256 x 64 at 128 rows."""
    kernel = "xla_subchannel_zp" if zero_points else "xla_subchannel"
    times = {"pallas_s": 1.0, "xla_s": 2.0, "bf16_s": 1.0} if faster == "path" else \
        {"pallas_s": 2.0, "xla_s": 1.0, "bf16_s": 1.0}
    key = dispatch_table.Key(FAKE_H100.device_kind, kernel, 4, 128, 256, 64, 128, "bfloat16")
    return dispatch_table.Table(FAKE_H100.device_kind, {key: times}, "test")


def test_a_gpu_takes_it_once_the_switch_allows_it_unless_a_table_measured_it_slower(monkeypatch):
    """Off on a CPU; on a GPU off until its gpu cases passed there (hardware_checked: unchecked), on where
    LLMEQ_UNCHECKED_KERNELS names it, off again with the kernels off or where a table measured XLA's usual path
    faster (the zero-point form by its own entries); the compile options follow the switch."""
    w = _int4(256, 64)
    assert "xla_subchannel" in hardware_checked.UNCHECKED
    assert not subchannel.takes(128, jnp.bfloat16, w) and subchannel.compiler_options() is None
    monkeypatch.delenv(hardware_checked.ENV, raising=False)
    with kernel_config.compiling_for(FAKE_H100):
        assert not subchannel.takes(128, jnp.bfloat16, w) and subchannel.compiler_options() is None
        monkeypatch.setenv(hardware_checked.ENV, "xla_subchannel")
        assert subchannel.takes(128, jnp.bfloat16, w)
        assert subchannel.compiler_options() == {subchannel.FLAG: True}
        assert not subchannel.takes(128, jnp.float32, w)
        with kernel_config.disabled():
            assert not subchannel.takes(128, jnp.bfloat16, w) and subchannel.compiler_options() is None
        with dispatch_table.use(_measured("xla")):
            assert not subchannel.takes(128, jnp.bfloat16, w)
            assert subchannel.takes(128, jnp.bfloat16, _int4(256, 64, symmetric=True))  # another entry
        with dispatch_table.use(_measured("path")):
            assert subchannel.takes(128, jnp.bfloat16, w)


def test_a_gpus_prompt_product_takes_it_and_a_decode_step_does_not(monkeypatch):
    """ops.linear of an int4 QArray traced for a GPU with the switch on: a prompt's rows (more than ops.SMALL_M) run
    subchannel.matmul, also on a stacked layer's slice; a decode step's few rows keep XLA's few-row form."""
    monkeypatch.setenv(hardware_checked.ENV, "xla_subchannel")
    calls = []
    real = subchannel.matmul
    monkeypatch.setattr(subchannel, "matmul", lambda x, w: calls.append(x.shape) or real(x, w))
    w = _int4(256, 64)
    stack = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.disabled():
        prompt = jnp.ones((2, 50, 256), jnp.bfloat16)
        jax.make_jaxpr(lambda x: ops.linear(x, w))(prompt)
        assert calls == []  # kernels off: XLA's usual path
    with native.disabled(), kernel_config.compiling_for(FAKE_H100):
        got = jax.jit(lambda x: ops.weight_only_xla(x, w))(prompt)
        jax.make_jaxpr(lambda x: ops.linear(x, LayerSlice(stack, jnp.int32(1)), backend="xla"))(prompt)
        jax.make_jaxpr(lambda x: ops.linear(x, w, backend="xla"))(jnp.ones((4, 256), jnp.bfloat16))
    assert calls == [(2, 50, 256), (2, 50, 256)]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(real(prompt, w), np.float32))


def test_prompt_jit_compiles_with_the_options_of_each_call(monkeypatch):
    """One jit per set of options, chosen when called: the flag where the path may run, none elsewhere; ``lower``
    and ``trace`` as a jit's, ``__wrapped__`` the function."""
    made = []
    real_jit = jax.jit
    monkeypatch.setattr(subchannel.jax, "jit", lambda f, **kw: made.append(kw.get("compiler_options")) or
                        real_jit(f, **kw))
    fn = subchannel.prompt_jit(lambda x: x * 2)
    np.testing.assert_array_equal(fn(jnp.ones(3)), 2 * np.ones(3))
    fn(jnp.ones(3))
    monkeypatch.setattr(subchannel, "compiler_options", lambda: {subchannel.FLAG: True})
    np.testing.assert_array_equal(fn(jnp.ones(3)), 2 * np.ones(3))  # the CPU takes the flag (and ignores it)
    assert made == [None, {subchannel.FLAG: True}]
    assert "mul" in fn.lower(jnp.ones(3)).as_text() and fn.trace(jnp.ones(3)).jaxpr is not None
    assert fn.__wrapped__(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_generates_prefill_and_a_benchmarks_forward_run_it_on_a_gpu(monkeypatch):
    """A prompt of 2 x 40 positions through generate.prefill and pipeline.run_layout's forward, traced for a GPU with
    the switch on (interpret mode runs it here): every projection of rtn-w4-g128's blocks runs the fused form (q/k/v
    and gate/up joined by the prompt layout: four a block), with the CPU's logits."""
    config = ModelConfig("llama", 256, 256, 2, 8, 2, 32, 512, 1e-5, 128, False)  # grouped-query: 8 heads over 2
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_params(config, jax.random.key(3)))
    params = pipeline.run_recipe(config, params, None, pipeline.read_recipe("rtn-w4-g128"), None, 16,
                                 progress=False).params
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (2, 40)))
    with native.disabled(), kernel_config.disabled():
        want = jax.jit(lambda p, t: forward(config, p, t))(pipeline.run_layout(config, params, scan_layers=True), tokens)
    monkeypatch.setenv(hardware_checked.ENV, "xla_subchannel")
    calls = []
    real = subchannel.matmul
    monkeypatch.setattr(subchannel, "matmul", lambda x, w: calls.append(w.shape) or real(x, w))
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        laid = pipeline.run_layout(config, params, scan_layers=True)
        got = subchannel.prompt_jit(lambda p, t: forward(config, p, t))(laid, tokens)  # a fresh function: traced here
        cache = gen.init_cache(config, 2, 48)
        last, _ = gen.prefill(config, laid, tokens, jnp.ones_like(tokens), cache, kernels=gen.kernel_state())
    assert len(calls) == 2 * 4  # traced once a scan: four products a block, each of the two traces
    # the CPU's path multiplies float32 scales: the fused one's half-precision scales and weights differ by ~2^-9
    scale = float(jnp.max(jnp.abs(want)))
    for logits, expected in ((got, want), (last, want[:, -1])):
        diff = np.abs(np.asarray(logits, np.float32) - np.asarray(expected, np.float32))
        assert diff.max() <= 0.03 * scale and diff.mean() <= 0.005 * scale, (diff.max(), diff.mean(), scale)
