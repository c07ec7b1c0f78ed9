"""A norm's output left for the products after it (llmeq_jax/normed_rows.py): when a norm comes back unevaluated,
what ops.linear does with it, and the scales a GPU's decode stores in the activations' dtype."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import decode_layout, generate as gen, ops
from llmeq_jax.layer_slice import LayerSlice
from llmeq_jax.models import ModelConfig, init_params, stacked
from llmeq_jax.normed_rows import NormedRows, normed, rms_norm
from pallas_kernels import config as kernel_config
from pallas_kernels import hardware_checked, settings
from pallas_kernels.rms_norm import rms_norm_reference

FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
EPS = 1e-5


def _stacked_scale(k=64, layers=3, dtype=jnp.float32):
    return LayerSlice(jax.random.uniform(jax.random.key(0), (layers, k), minval=0.5, maxval=1.5).astype(dtype),
                      jnp.int32(1))


def test_a_norm_is_left_unevaluated_only_where_its_products_may_fold_it(monkeypatch):
    x = jax.random.normal(jax.random.key(1), (2, 1, 64)).astype(jnp.bfloat16)
    scale = _stacked_scale()
    assert isinstance(normed(x, scale, EPS), jax.Array)  # a CPU: the norm as it was
    with kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        monkeypatch.delenv(hardware_checked.ENV, raising=False)
        assert isinstance(normed(x, scale, EPS), jax.Array)  # not yet run on a GPU: off unless named
        monkeypatch.setenv(hardware_checked.ENV, "norm_fold")
        assert isinstance(normed(x, scale, EPS), NormedRows)
        assert isinstance(normed(x, scale.value(), EPS), jax.Array)  # not a stacked block's scale
        assert isinstance(normed(jnp.ones((17, 64), jnp.bfloat16), scale, EPS), jax.Array)  # a prompt's rows
        assert isinstance(normed(x.astype(jnp.float16), scale, EPS), jax.Array)  # x * scale could overflow float16
        with kernel_config.disabled():
            assert isinstance(normed(x, scale, EPS), jax.Array)


def test_its_value_is_the_norm_evaluated_once():
    x = jax.random.normal(jax.random.key(2), (1, 64))
    rows = NormedRows(x, _stacked_scale(), EPS)
    assert rows.shape == x.shape and rows.dtype == x.dtype and rows.ndim == 2
    first = rows.value()
    assert rows.value() is first  # siblings share one evaluation
    np.testing.assert_array_equal(np.asarray(first), np.asarray(rms_norm(x, _stacked_scale(), EPS)))
    np.testing.assert_allclose(np.asarray(first), np.asarray(rms_norm_reference(x, _stacked_scale().value(), EPS)),
                               rtol=1e-6)
    assert rows.fold_for(rows.scale.layer) is not None and rows.fold_for(jnp.int32(1)) is None  # another layer


def test_a_product_that_cannot_fold_takes_the_norm_evaluated():
    """XLA's path, a kernel that is not a stack's layer: the product of ``value()``, bit for bit."""
    x = jax.random.normal(jax.random.key(3), (1, 64))
    rows = NormedRows(x, _stacked_scale(), EPS)
    w = jax.random.normal(jax.random.key(4), (64, 32))
    b = jnp.arange(32.0)
    want = ops.linear(rows.value(), w, b)
    np.testing.assert_array_equal(np.asarray(ops.linear(rows, w, b)), np.asarray(want))
    layer = LayerSlice(jnp.stack([w * 0, w, w * 2]), rows.scale.layer)
    np.testing.assert_array_equal(np.asarray(ops.linear(rows, layer, b, backend="xla")), np.asarray(want))


@pytest.mark.parametrize("apart", [False, True])
def test_a_stacked_float_product_folds_the_norm_where_the_float_kernel_takes_it(apart, monkeypatch):
    from pallas_kernels import float_matmul

    monkeypatch.setenv(hardware_checked.ENV, "norm_fold")
    calls, real = [], float_matmul.float_matmul

    def spy(x, w, **kw):
        calls.append(kw.get("norm"))
        return real(x, w, **kw)

    monkeypatch.setattr(float_matmul, "float_matmul", spy)
    x = jax.random.normal(jax.random.key(5), (2, 64)).astype(jnp.bfloat16)
    scale = _stacked_scale()
    w = LayerSlice(jax.random.normal(jax.random.key(6), (3, 64, 48)).astype(jnp.bfloat16), scale.layer)
    with kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        held = settings.override("float_matmul", norm="apart") if apart else settings.override("float_matmul")
        with held:
            got = ops.linear(NormedRows(x, scale, EPS), w)
    want = jnp.dot(rms_norm_reference(x, scale.value(), EPS).astype(jnp.float32), w.value().astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.02 * float(jnp.abs(want).max()))
    assert len(calls) == 1 and (calls[0] is None) == apart  # the float kernel either way, the norm in it or before
    if not apart:
        assert calls[0].scale is scale.stack and calls[0].eps == EPS


def test_exact_norm_scales_are_stored_in_the_activations_dtype():
    config = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, False)
    params = stacked.stack_blocks(config, init_params(config, jax.random.key(7)))
    blocks = params[stacked.BLOCKS]
    blocks["post_attn_norm"]["scale"] = blocks["post_attn_norm"]["scale"] + 1e-3  # not a bf16 value
    narrowed = decode_layout.narrow_norm_scales(params, jnp.bfloat16)
    assert narrowed[stacked.BLOCKS]["input_norm"]["scale"].dtype == jnp.bfloat16  # ones: exact
    assert narrowed[stacked.BLOCKS]["post_attn_norm"]["scale"].dtype == jnp.float32  # would round: kept
    assert narrowed[stacked.BLOCKS]["attn"]["q_proj"]["kernel"] is blocks["attn"]["q_proj"]["kernel"]  # the rest
    np.testing.assert_array_equal(np.asarray(narrowed[stacked.BLOCKS]["input_norm"]["scale"], np.float32),
                                  np.asarray(blocks["input_norm"]["scale"]))
    assert decode_layout.narrow_norm_scales(params, jnp.float32) is params


def test_a_gpus_decode_params_narrow_the_norm_scales_where_the_norms_may_fold(monkeypatch):
    config = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, False)
    params = stacked.stack_blocks(config, jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                                       init_params(config, jax.random.key(8))))
    params[stacked.BLOCKS]["input_norm"]["scale"] = params[stacked.BLOCKS]["input_norm"]["scale"].astype(jnp.float32)
    assert gen.decode_params(params, 1) is params  # a CPU: a float model's params as they are
    with kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        monkeypatch.setenv(hardware_checked.ENV, "rms_norm")
        assert gen.decode_params(params, 1) is params  # the fold not on: nothing to narrow for
        monkeypatch.setenv(hardware_checked.ENV, "norm_fold")
        laid = gen.decode_params(params, 1)
    assert laid[stacked.BLOCKS]["input_norm"]["scale"].dtype == jnp.bfloat16
    gen.release_decode_layout()
