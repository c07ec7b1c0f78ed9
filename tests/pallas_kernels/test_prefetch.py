"""pallas_kernels/prefetch.py: a decode product's weights read ahead -- the bytes it reads, where a decode step
reads them (one read-ahead a product, none for a sibling of the same x), that the logits do not move, and the
settings' checks."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import generate as gen
from llmeq_jax import native, pipeline
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params, stacked
from pallas_kernels import config as kernel_config
from pallas_kernels import prefetch, settings

FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
CONFIG = ModelConfig("llama", 256, 256, 2, 8, 2, 32, 512, 1e-5, 128, False)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bfloat16, jnp.float32])
def test_the_token_is_the_xor_of_the_layers_leading_bytes(dtype):
    stack = jax.random.randint(jax.random.key(0), (3, 40, 6, 8), -100, 100).astype(dtype)
    row_bytes = 6 * 8 * stack.dtype.itemsize
    token = prefetch.read_token(stack, jnp.int32(1), jnp.ones(3), nbytes=7 * row_bytes)
    bits = np.asarray(stack[1, :7]).view(f"u{stack.dtype.itemsize}")
    got = int(token) & 0xFFFFFFFF  # the int32 token's bits
    assert got == int(np.bitwise_xor.reduce(bits.ravel()))
    other = np.asarray(stack[2, :7]).view(f"u{stack.dtype.itemsize}")
    assert got != int(np.bitwise_xor.reduce(other.ravel()))  # the layer it was given, not another
    assert int(prefetch.read_token(stack, 1, jnp.ones(3), nbytes=7 * row_bytes)) == int(token)  # a Python int layer


def test_leading_rows_stay_within_the_layer():
    assert prefetch.leading_rows((512, 1024), 4, 1) == 1  # at least a row
    assert prefetch.leading_rows((512, 1024), 4, 1 << 40) == 512  # at most the layer
    assert prefetch.leading_rows((512, 22016), 4, 16 << 20) == (16 << 20) // (4 * 22016)
    assert prefetch.leading_rows((100, 4, 8), 2, 640) == 10


def test_ahead_is_in_force_only_inside_its_block():
    assert prefetch.current() is None
    with prefetch.ahead(mb=0.5, stream="side"):
        assert prefetch.current() == prefetch.Ahead(1 << 19, "side")
        with prefetch.ahead(mb=2):
            assert prefetch.current() == prefetch.Ahead(2 << 20, "main")
        assert prefetch.current().stream == "side"
    assert prefetch.current() is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(mb=0), "positive number"), (dict(mb=-1), "positive number"), (dict(mb=float("nan")), "positive number"),
    (dict(mb=True), "positive number"), (dict(mb="16"), "positive number"), (dict(mb=16, stream="l2"), "stream"),
])
def test_a_bad_read_ahead_is_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with prefetch.ahead(**kwargs):
            pass


def test_setting_texts_parse_and_scope():
    assert prefetch.parse("prefetch:mb=16,stream=side") == {"mb": 16.0, "stream": "side"}
    assert prefetch.parse("prefetch: mb = 0.5") == {"mb": 0.5}
    for bad in ("prefetch", "prefetch:stream=side", "prefetch:mb=x", "prefetch:kb=3", "prefetch:mb=4,stream=l2",
                "int4_words:mb=4"):
        with pytest.raises(ValueError, match="prefetch"):
            prefetch.parse(bad)
    assert settings.is_prefetch("prefetch:mb=1") and not settings.is_prefetch("int4_words:bn=256")
    settings.check("prefetch:mb=1")
    settings.check("int4_words:bn=256")
    with pytest.raises(ValueError, match="unknown kernel"):
        settings.check("prefetched:mb=1")
    with settings.scope("prefetch:mb=1,stream=side"):
        assert prefetch.current() == prefetch.Ahead(1 << 20, "side") and settings.current() == ()
    with settings.scope("int4_words:bn=256"):
        assert prefetch.current() is None and settings.of("int4_words", 1).bn == 256


def test_nothing_is_read_ahead_outside_a_layer_chain_or_without_ahead():
    from llmeq_jax.layer_slice import LayerSlice

    w = LayerSlice(jnp.ones((2, 16, 8), jnp.bfloat16), jnp.int32(0))
    x = jnp.ones((1, 16), jnp.bfloat16)
    with prefetch.ahead(mb=1):
        assert prefetch.before(x, w) is x  # no chain open
    with prefetch.layer_chain(x):
        assert prefetch.before(x, w) is x  # no read-ahead asked
    with prefetch.ahead(mb=1), prefetch.layer_chain((None, {})):
        assert prefetch.before(x, w) is x  # a layer input with no array to follow: no chain
    with prefetch.ahead(mb=1), prefetch.layer_chain((x, None)):
        prompt = jnp.ones((17, 16), jnp.bfloat16)
        assert prefetch.before(prompt, w) is prompt  # a prompt's rows (more than a decode step's): as they are
        y = prefetch.before(x, w)
        assert y is not x and bool(jnp.array_equal(y, x))  # x with the token's zero joined
        assert prefetch.before(x, w) is x  # the same x again: a sibling product, nothing runs between


def _decode_step(params, recipe_tokens):
    """One decode step of the stacked model, traced for an H100 with the kernels in interpret mode: its logits,
    its jaxpr and its StableHLO for CUDA."""
    b = recipe_tokens.shape[0]
    step = lambda p, t, m, c: forward_step(CONFIG, p, t, m, c)  # noqa: E731  a fresh function: traced here
    cache = init_cache(CONFIG, b, 8, jnp.bfloat16)
    laid = gen.decode_params(params, b)
    args = (laid, recipe_tokens, jnp.ones((b, 1), jnp.int32), cache)
    logits, _ = jax.jit(step)(*args)
    lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return logits, str(jax.make_jaxpr(step)(*args)), lowered


@pytest.mark.parametrize("recipe, stream", [("bf16", "main"), ("bf16", "side"), ("rtn-w4-g128", "main")])
def test_a_decode_step_reads_each_products_weights_ahead_and_its_logits_do_not_move(recipe, stream):
    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(0)))
    if recipe != "bf16":
        params = pipeline.run_recipe(CONFIG, params, None, pipeline.read_recipe(recipe), None, 16,
                                     progress=False).params
    params = stacked.stack_blocks(CONFIG, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 1)))
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        want, plain, _ = _decode_step(params, tokens)
        with prefetch.ahead(mb=0.01, stream=stream):
            got, step, lowered = _decode_step(params, tokens)
    assert "reduce_xor" not in plain
    # one read-ahead a product that follows other work: q (k and v share its x: none), o, gate (up: none), down --
    # or the decode layout's fused q/k/v and gate/up -- in the scan's body, traced once for every layer
    assert step.count("reduce_xor") == 4
    assert ('_xla_stream_annotation = "1"' in lowered) == (stream == "side")  # XLA's second stream
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
