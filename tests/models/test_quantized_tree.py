"""A quantized param tree (QArray kernels) runs in the same model code and stays close to float."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule, quantize_params
from llmeq_jax.generate import generate
from llmeq_jax.models import forward as _forward
from llmeq_jax.models import load_model
from tests.shared_data import shared_data_path

forward = jax.jit(_forward, static_argnums=0)

SPECS = {
    "int8-channel": Spec(8, granularity="channel", axis=-1),
    "int4-g32": Spec(4, granularity="group", group_size=32),
}
# Mean |logit error| relative to the mean |logit|: int8 is near-exact, int4 g32 coarser.
BOUND = {"int8-channel": 0.02, "int4-g32": 0.25}


@pytest.fixture(scope="module")
def stories():
    return load_model(str(shared_data_path("stories260K.gguf")))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_quantized_tree_runs_and_is_close(stories, name):
    config, params, tokenizer = stories
    qparams = quantize_params(params, Recipe(rules=(Rule(".*/kernel", weight=SPECS[name]),)))
    kernels = [leaf for leaf in jax.tree.leaves(qparams, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(leaf, QArray)]
    assert len(kernels) == 7 * config.num_layers + 1  # q, k, v, o, gate, up, down per layer + lm_head
    tokens = jnp.asarray([tokenizer.encode("Once upon a time, there was a little girl named Lily.")])
    ref = forward(config, params, tokens)
    got = forward(config, qparams, tokens)
    rel = float(jnp.mean(jnp.abs(got - ref)) / jnp.mean(jnp.abs(ref)))
    assert 0 < rel < BOUND[name]
    # And generation runs on it (decode uses ops.linear's few-row path).
    out = generate(config, qparams, tokens, 4)
    assert out.shape == (1, 4)


def test_int8_greedy_text_matches_float(stories):
    config, params, tokenizer = stories
    qparams = quantize_params(params, Recipe(rules=(Rule(".*/kernel", weight=SPECS["int8-channel"]),)))
    prompt = jnp.asarray([tokenizer.encode("Once upon a time")])
    np.testing.assert_array_equal(generate(config, qparams, prompt, 20), generate(config, params, prompt, 20))
