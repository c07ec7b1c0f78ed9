"""SmoothQuant: the fold is exact on the float model, factors follow the formula, and it helps static W8A8."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, RecipeError, Rule
from llmeq_jax.methods import folding, quantize_model, smoothquant
from llmeq_jax.models import forward
from tests.methods.tiny_models import tiny_model, tiny_windows


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_fold_leaves_float_logits_unchanged(family):
    config, params = tiny_model(family)
    windows = tiny_windows(config)
    stats, _ = calibrate.calibrate(config, params, windows, wants=("absmax",))
    smoothed = dict(params)
    n_folded = 0
    for i in range(config.num_layers):
        block_stats = {p[len(f"layers_{i}/"):]: s for p, s in stats.items() if p.startswith(f"layers_{i}/")}
        smoothed[f"layers_{i}"], _, factors = smoothquant.smooth_block(config, params[f"layers_{i}"], block_stats, 0.5)
        n_folded += len(factors)
        # Every exact fold of the architecture was applied, with non-trivial factors.
        assert set(factors) == {g.producer for g in folding.scale_groups(config)}
        assert all(float(jnp.max(jnp.abs(jnp.log(s)))) > 0.1 for s in factors.values())
    tokens = jnp.asarray(windows)
    ref, got = forward(config, params, tokens), forward(config, smoothed, tokens)
    assert float(jnp.max(jnp.abs(smoothed["layers_0"]["attn"]["o_proj"]["kernel"]
                                 - params["layers_0"]["attn"]["o_proj"]["kernel"]))) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
    assert n_folded == config.num_layers * len(folding.scale_groups(config))


def test_factors_follow_the_formula():
    x = jnp.asarray([4.0, 1.0, 0.0, 9.0])
    w = jnp.asarray([0.5, 2.0, 1.0, 0.0])
    s = np.asarray(smoothquant.smoothing_factors(x, w, 0.75))
    np.testing.assert_allclose(s[:2], [4.0 ** 0.75 / 0.5 ** 0.25, 1.0 / 2.0 ** 0.25], rtol=1e-6)
    np.testing.assert_array_equal(s[2:], [1.0, 1.0])  # a zero max keeps the channel as it is


def test_gqa_o_proj_factor_is_shared_per_kv_head():
    config, params = tiny_model("qwen2")
    g = next(g for g in folding.scale_groups(config) if g.producer == "attn/v_proj")
    idx = folding.consumer_index(config, g)
    # 4 query heads on 2 KV heads, head_dim 8: o rows 0-7 and 8-15 read v columns 0-7.
    np.testing.assert_array_equal(idx[:16], np.r_[np.arange(8), np.arange(8)])
    np.testing.assert_array_equal(idx[16:], np.r_[np.arange(8, 16), np.arange(8, 16)])
    per_input = jnp.arange(32.0)
    np.testing.assert_array_equal(np.asarray(folding.reduce_to_scales(config, g, per_input, "max"))[:8],
                                  np.arange(8, 16))


def _recipe(method, static, **args):
    return Recipe(rules=(Rule(".*lm_head.*", skip=True),
                         Rule(".*/kernel", weight=Spec(8, "channel"), act=Spec(8, "tensor" if static else "token"),
                              act_static=static)),
                  method=method, method_args=args, name=f"{method}-test")


def _mse(config, a, b, tokens):
    return float(jnp.mean((forward(config, a, tokens) - forward(config, b, tokens)) ** 2))


def test_smoothing_helps_static_w8a8_on_outlier_channels():
    config, params = tiny_model("qwen2")
    windows = tiny_windows(config, n=8)
    tokens = jnp.asarray(tiny_windows(config, n=4, seed=9))
    naive, _ = quantize_model(config, params, _recipe("rtn", True), windows)
    smooth, info = quantize_model(config, params, _recipe("smoothquant", True, alpha=0.5), windows)
    auto, info_auto = quantize_model(config, params, _recipe("smoothquant", True, alpha="auto"), windows)
    e_naive, e_smooth, e_auto = (_mse(config, params, q, tokens) for q in (naive, smooth, auto))
    assert e_smooth < e_naive
    assert e_auto < e_naive
    assert info["calib_samples"] == 8 and set(info_auto["alpha"]) == {0, 1}
    # Static scales are those of the smoothed activations: the served model carries them.
    q = smooth["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.act_scale is not None and q.act_spec == Spec(8, "tensor")


def test_bad_method_args():
    config, params = tiny_model("qwen2")
    with pytest.raises(RecipeError, match="alpha must be a number in"):
        quantize_model(config, params, _recipe("smoothquant", True, alpha=1.5), tiny_windows(config))
    with pytest.raises(RecipeError, match="unknown method_args"):
        quantize_model(config, params, _recipe("smoothquant", True, beta=0.5), tiny_windows(config))
    with pytest.raises(RecipeError, match="needs calibration windows"):
        quantize_model(config, params, _recipe("smoothquant", True), None)
