"""The real model through the Pallas path (interpret mode) gives the XLA path's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule, leaf_paths, quantize_params
from llmeq_jax.models import forward, load_model
from llmeq_jax import kernel_dispatch as dispatch
from pallas_kernels import config
from tests.shared_data import shared_data_path

RECIPES = {
    "w8a8": Recipe((Rule(".*/kernel", weight=Spec(8), act=Spec(8, "token")),), name="w8a8"),
    "w4g128": Recipe((Rule(".*/kernel", weight=Spec(4, "group", group_size=128)),), name="w4g128"),
}


@pytest.fixture(scope="module")
def stories():
    cfg, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    ids = [cfg.bos_token_id] + tok("Once upon a time, there was a little girl", add_special_tokens=False)["input_ids"]
    return cfg, params, jnp.asarray([ids], jnp.int32)


@pytest.mark.parametrize("name", list(RECIPES))
def test_stories260k_logits_pallas_equal_xla(stories, name):
    cfg, params, tokens = stories
    qparams = quantize_params(params, RECIPES[name])
    # Every quantized kernel of the model must really take a kernel, or this test proves nothing.
    for path in leaf_paths(qparams):
        node = qparams
        for k in path.split("/"):
            node = node[k]
        if isinstance(node, QArray):
            kernel, why = dispatch.plan((tokens.shape[1], node.shape[0]), jnp.float32, node, node.act_spec)
            assert kernel is not None, f"{path}: {why}"
    with config.interpret(True):
        pallas_logits = jax.jit(lambda p, t: forward(cfg, p, t))(qparams, tokens)
    xla_logits = jax.jit(lambda p, t: forward(cfg, p, t))(qparams, tokens)
    scale = float(jnp.max(jnp.abs(xla_logits)))
    np.testing.assert_allclose(np.asarray(pallas_logits), np.asarray(xla_logits), rtol=1e-4, atol=1e-4 * scale)
    assert np.array_equal(np.argmax(pallas_logits, -1), np.argmax(xla_logits, -1))
