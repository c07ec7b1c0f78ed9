"""ZeroQuant: group weights + per-token activations; LKD lowers the block MSE and the served model's error."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, RecipeError, Rule
from llmeq_jax.methods import quantize_model
from llmeq_jax.models import forward
from tests.methods.tiny_models import tiny_model, tiny_windows

RULES = (Rule(".*lm_head.*", skip=True),
         Rule(".*/kernel", weight=Spec(4, "group", group_size=16), act=Spec(8, "token")))


def test_lkd_lowers_block_mse_and_model_error():
    config, params = tiny_model("qwen2", seed=3)
    windows, tokens = tiny_windows(config, n=8), jnp.asarray(tiny_windows(config, n=4, seed=6))
    plain, info0 = quantize_model(config, params, Recipe(rules=RULES, method="zeroquant"), windows)
    lkd, info = quantize_model(config, params, Recipe(rules=RULES, method="zeroquant",
                                                      method_args={"lkd_steps": 60, "lkd_lr": 3e-5,
                                                                   "lkd_batch": 4}), windows)
    assert info0["lkd"] == {} and set(info["lkd"]) == {0, 1}
    for m in info["lkd"].values():
        assert m["mse_after"] < 0.95 * m["mse_before"]
    k = lkd["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k, QArray) and k.act_spec == Spec(8, "token") and k.tile[0] == 16
    ref = forward(config, params, tokens)
    mse = lambda p: float(jnp.mean((forward(config, p, tokens) - ref) ** 2))
    assert mse(lkd) < mse(plain)



def test_lkd_never_returns_kernels_worse_than_it_started_from():
    """A learning rate far too large makes every step worse: LKD keeps the untrained kernels (the best it measured),
    so the block is what plain ZeroQuant gives."""
    config, params = tiny_model("qwen2", seed=3)
    windows = tiny_windows(config, n=4)
    plain, _ = quantize_model(config, params, Recipe(rules=RULES, method="zeroquant"), windows)
    lkd, info = quantize_model(config, params, Recipe(rules=RULES, method="zeroquant",
                                                      method_args={"lkd_steps": 8, "lkd_lr": 1.0}), windows)
    for m in info["lkd"].values():
        assert m["mse_after"] == m["mse_before"]
    k, k0 = (p["layers_1"]["mlp"]["down_proj"]["kernel"] for p in (lkd, plain))
    assert jnp.array_equal(k.qvalue, k0.qvalue) and jnp.array_equal(k.scale, k0.scale)

def test_bad_lkd_args():
    config, params = tiny_model("qwen2")
    with pytest.raises(RecipeError, match="lkd_steps must be a non-negative integer"):
        quantize_model(config, params, Recipe(rules=RULES, method="zeroquant", method_args={"lkd_steps": -2}),
                       tiny_windows(config))
