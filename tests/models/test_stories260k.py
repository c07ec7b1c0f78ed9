"""Real model: stories260K.gguf reproduces the known-good text and NLL (../shared/data/README.md)."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.generate import generate
from llmeq_jax.models import forward as _forward
from llmeq_jax.models import load_model
from tests.shared_data import shared_data_path

SENTENCE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)
EXPECTED_TEXT = SENTENCE + " She wanted to play with it, but it was too high.\nLily"

forward = jax.jit(_forward, static_argnums=0)  # one compile per shape instead of op-by-op dispatch


@pytest.fixture(scope="module")
def stories():
    return load_model(str(shared_data_path("stories260K.gguf")))


def _mean_nll(config, params, ids):
    x = jnp.asarray([ids])
    logp = jax.nn.log_softmax(forward(config, params, x)[0, :-1])
    return float(-jnp.mean(jnp.take_along_axis(logp, x[0, 1:, None], axis=1)))


def test_config_from_metadata(stories):
    config, params, _ = stories
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 5, 8, 4)
    assert config.vocab_size == 512 and not config.tie_word_embeddings
    assert params["layers_0"]["attn"]["k_proj"]["kernel"].shape == (64, 32)


def test_tokenizer_from_gguf_metadata(stories):
    _, _, tokenizer = stories
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tokenizer.decode(tokenizer.encode(SENTENCE, add_special_tokens=False)) == SENTENCE


def test_greedy_text(stories):
    config, params, tokenizer = stories
    prompt = tokenizer.encode("Once upon a time")
    new = np.asarray(generate(config, params, jnp.asarray([prompt]), 60))[0].tolist()
    assert tokenizer.decode(prompt + new, skip_special_tokens=True) == EXPECTED_TEXT


def test_nll_of_known_sentence(stories):
    # The reference figure is the mean over the sentence's 44 predicted tokens with
    # BOS as context: 45 ids in all, BOS itself never scored.
    config, params, tokenizer = stories
    ids = [config.bos_token_id] + tokenizer.encode(SENTENCE, add_special_tokens=False)
    assert len(ids) == 45
    assert _mean_nll(config, params, ids) == pytest.approx(0.324, abs=0.01)


def test_shuffled_sentence_is_far_less_likely(stories):
    config, params, tokenizer = stories
    words = SENTENCE.split()
    nlls = []
    for seed in range(3):
        shuffled = words[:]
        random.Random(seed).shuffle(shuffled)
        ids = [config.bos_token_id] + tokenizer.encode(" ".join(shuffled), add_special_tokens=False)
        nlls.append(_mean_nll(config, params, ids))
    # README: "about 7.1" for a shuffle; the exact value depends on the permutation.
    assert 6.0 < np.mean(nlls) < 8.0


def test_qk_unpermutation_is_needed(stories, monkeypatch):
    """Loading without undoing llama.cpp's row order must break the model (guards the unpermute)."""
    from llmeq_jax.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda w, n: w)
    config, params, tokenizer = load_model(str(shared_data_path("stories260K.gguf")))
    ids = [config.bos_token_id] + tokenizer.encode(SENTENCE, add_special_tokens=False)
    assert _mean_nll(config, params, ids) > 0.5


def test_sequence_nll_equals_the_logits_nll(stories):
    """pipeline.sequence_nll (blocks once, head a chunk at a time) scores every position as the
    full logits do, and the head is applied to the final-normed hidden states (a wrong head or
    a skipped norm would move these by far more than 1e-5)."""
    from llmeq_jax import evaluate
    from llmeq_jax.pipeline import sequence_nll

    config, params, tokenizer = stories
    ids = tokenizer.encode(SENTENCE + " " + SENTENCE, add_special_tokens=False)[:64]
    x = jnp.asarray([ids, ids[::-1]], jnp.int32)
    full = evaluate.token_nll(forward(config, params, x), x)
    chunked = jax.jit(sequence_nll(config))(params, x)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-5)
