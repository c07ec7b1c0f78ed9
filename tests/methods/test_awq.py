"""AWQ: the chosen scales lower the group error vs s = 1, the clip search lowers the tile error, folds are exact."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import Recipe, RecipeError, Rule, get_path
from llmeq_jax.methods import awq, folding, quantize_model
from llmeq_jax.models import forward
from tests.methods.tiny_models import tiny_model, tiny_windows

SPEC = Spec(4, "group", group_size=16)


def _group_error(config, group, x, kernels, s):
    """Independent dense reference: sum_c ||X W_c - (X/s) RTN(s W_c)||^2 in NumPy."""
    rows = np.asarray(folding.expand_scales(config, group, jnp.asarray(s)))
    total = 0.0
    for w in kernels:
        wq = np.asarray(quantize(jnp.asarray(w * rows[:, None]), SPEC).dequantize())
        total += np.sum((x @ w - (x / rows) @ wq) ** 2, dtype=np.float64)
    return total


@pytest.mark.parametrize("producer", ["input_norm", "attn/v_proj", "mlp/up_proj"])
def test_scale_search_lowers_block_error(producer):
    config, params = tiny_model("qwen2")
    stats, _ = calibrate.calibrate(config, params, tiny_windows(config, n=8), wants=awq.wants(awq.parse_args({})))
    g = next(g for g in folding.scale_groups(config) if g.producer == producer)
    st = stats[f"layers_0/{g.consumers[0]}/kernel"]
    x = np.asarray(st["sample"])
    kernels = [np.asarray(get_path(params["layers_0"], f"{c}/kernel")) for c in g.consumers]
    s, a, errs = awq.search_scale(config, g, jnp.asarray(x), st["abs_sum"] / st["count"],
                                  [jnp.asarray(k) for k in kernels], [SPEC] * len(kernels), n_grid=20)
    ones = np.ones(s.shape, np.float32)
    e_best, e_one = _group_error(config, g, x, kernels, np.asarray(s)), _group_error(config, g, x, kernels, ones)
    assert len(errs) == 20 and a > 0
    assert e_best < e_one
    np.testing.assert_allclose(min(errs), e_best, rtol=1e-3)


def test_clip_search_lowers_tile_error():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    w = (rng.standard_t(3, size=(64, 24)) * 0.05).astype(np.float32)  # heavy tails: clipping pays
    rule = Rule(".*", weight=SPEC)
    clipped = np.asarray(awq.quantize_clipped(jnp.asarray(x), jnp.asarray(w), rule, 20, 0.5, True).dequantize())
    plain = np.asarray(quantize(jnp.asarray(w), SPEC).dequantize())
    err = lambda wq: np.sum((x @ w - x @ wq) ** 2)
    assert err(clipped) < err(plain)


def test_scaled_hessian_is_the_hessian_of_the_scaled_inputs():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 12)).astype(np.float32)
    rows = rng.uniform(0.3, 3.0, size=12).astype(np.float32)
    got = np.asarray(awq.scaled_hessian(jnp.asarray(x.T @ x), jnp.asarray(rows)))
    np.testing.assert_allclose(got, (x / rows).T @ (x / rows), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,gptq", [("qwen2", False), ("gpt2", False), ("qwen2", True), ("gpt2", True)])
def test_awq_model_beats_rtn(family, gptq):
    config, params = tiny_model(family, seed=2)
    windows, tokens = tiny_windows(config, n=8), jnp.asarray(tiny_windows(config, n=4, seed=5))
    rules = (Rule(".*lm_head.*", skip=True), Rule(".*/kernel", weight=Spec(3, "group", group_size=16)))
    rtn, _ = quantize_model(config, params, Recipe(rules=rules), windows)
    q, info = quantize_model(config, params, Recipe(rules=rules, method="awq", method_args={"gptq": gptq}), windows)
    ref = forward(config, params, tokens)
    mse = lambda p: float(jnp.mean((forward(config, p, tokens) - ref) ** 2))
    assert mse(q) < mse(rtn)
    assert set(info["exponent"]) == {0, 1}


def test_awq_refuses_what_it_cannot_do():
    config, params = tiny_model("qwen2")
    windows = tiny_windows(config)
    with pytest.raises(RecipeError, match="lm_head"):
        quantize_model(config, params, Recipe(rules=(Rule(".*/kernel", weight=SPEC),), method="awq"), windows)
    static = Rule(".*layers.*", weight=Spec(8, "channel"), act=Spec(8, "tensor"), act_static=True)
    with pytest.raises(RecipeError, match="static activation scales are not supported"):
        quantize_model(config, params, Recipe(rules=(static,), method="awq"), windows)
    with pytest.raises(RecipeError, match="n_grid must be a positive integer"):
        quantize_model(config, params, Recipe(rules=(Rule(".*layers.*", weight=SPEC),), method="awq",
                                              method_args={"n_grid": 0}), windows)
    with pytest.raises(RecipeError, match="damp must be a number"):
        quantize_model(config, params, Recipe(rules=(Rule(".*layers.*", weight=SPEC),), method="awq",
                                              method_args={"gptq": True, "damp": 0.0}), windows)


def test_awq_gptq_on_stories260k_fits_the_calibration_windows_better_than_rtn():
    """Real model: the composite's logits on its calibration windows are closer to the float ones than RTN's."""
    from llmeq_jax.models import load_model
    from tests.shared_data import shared_data_path

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    windows = calibrate.calibration_windows(tok, shared_data_path("wikitext2_valid.txt"), 4, 64)
    rules = (Rule(".*lm_head.*", skip=True), Rule("embed/embedding", skip=True),
             Rule(".*/kernel", weight=Spec(4, "group", group_size=32, symmetric=False)))
    rtn, _ = quantize_model(config, params, Recipe(rules=rules), windows)
    q, info = quantize_model(config, params, Recipe(rules=rules, method="awq", method_args={"gptq": True}), windows)
    tokens = jnp.asarray(windows)
    ref = forward(config, params, tokens)
    mse = lambda p: float(jnp.mean((forward(config, p, tokens) - ref) ** 2))
    assert mse(q) < mse(rtn)
    assert len(info["exponent"]) == config.num_layers


def test_awq_gptq_recipe_loads_with_gptq_on_and_asymmetric_int4_groups():
    from llmeq_jax.pipeline import read_recipe

    recipe = read_recipe("awq-gptq-w4-g128")
    args = awq.parse_args(dict(recipe.method_args))
    spec = recipe.rule_for("layers_0/mlp/down_proj/kernel").weight
    assert recipe.method == "awq" and args.gptq is True and args.damp == 0.01
    assert (spec.bits, spec.group_size, spec.symmetric) == (4, 128, False)
    assert awq.wants(args)[-1] == "hessian"


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_picks_the_ratio_a_direct_search_picks(symmetric):
    """The clip search (errors through each group's Gram matrix) against a direct search on the tokens."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 80)).astype(np.float32) * (1 + 5 * (rng.random(80) < 0.1)).astype(np.float32)
    w = (rng.standard_t(3, size=(80, 12)) * 0.05).astype(np.float32)
    spec = Spec(4, "group", group_size=32, symmetric=symmetric)
    ratios = tuple(float(r) for r in np.linspace(1.0, 0.5, 11))
    scale, zp = awq.clip_scale(jnp.asarray(x), jnp.asarray(w), spec=spec, ratios=ratios)
    best = np.full((3, 12), np.inf)
    want_s = np.zeros((3, 12))
    for r in ratios:
        for gi in range(3):
            rows = slice(32 * gi, min(32 * gi + 32, 80))
            wg = w[rows]
            lo, hi = np.minimum(wg.min(0), 0) * r, np.maximum(wg.max(0), 0) * r
            if symmetric:
                s = np.maximum(-lo, hi) / 7
                deq = np.clip(np.round(wg / s), -7, 7) * s
            else:
                s = (hi - lo) / 15
                z = np.clip(np.round(-8 - lo / s), -8, 7)
                deq = (np.clip(np.round(wg / s) + z, -8, 7) - z) * s
            err = np.sum((x[:, rows].astype(np.float64) @ (wg - deq)) ** 2, axis=0)
            better = err < best[gi]
            best[gi] = np.where(better, err, best[gi])
            want_s[gi] = np.where(better, s, want_s[gi])
    np.testing.assert_allclose(np.asarray(scale), want_s, rtol=1e-5)
