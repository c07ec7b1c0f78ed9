"""The causal LM as functions over a plain param dict, with Flax linen modules underneath.

Param tree (top level)::

    embed/embedding            (vocab, hidden)
    pos_embed/embedding        (max_positions, hidden)   gpt2 only
    layers_{i}/...             one decoder block (see llama.py / gpt2.py)
    blocks/...                 instead of layers_{i}: all blocks stacked, run as one scan (stacked.py)
    norm/scale (+ norm/bias for gpt2)
    lm_head/kernel             (hidden, vocab), absent when embeddings are tied (unless a rotation untied them)

The pieces are separate functions (``embed``, ``apply_block``, ``head``) so that
calibration can run the model one block at a time; ``forward`` and
``forward_step`` compose them (``hidden_states`` is ``forward`` without the head).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from llmeq_jax import ops
from llmeq_jax.core.rope import rope_inv_freq, rope_tables
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv.spec import KVQuantizer
from llmeq_jax.models import stacked
from llmeq_jax.models.config import ModelConfig
from llmeq_jax.models.gpt2 import GPT2Block
from llmeq_jax.models.layers import Embed, LayerNorm, Linear, RMSNorm, attention_mask
from llmeq_jax.models.llama import LlamaBlock

Params = dict[str, Any]


def _block_module(config: ModelConfig, layer: int):
    return (GPT2Block if config.family == "gpt2" else LlamaBlock)(config, layer)


def _norm_module(config: ModelConfig):
    return LayerNorm(config.norm_eps) if config.family == "gpt2" else RMSNorm(config.norm_eps)


def default_positions(attention_mask_: jax.Array) -> jax.Array:
    """Position ids [B, T] from a left-padded mask: real tokens count 0, 1, ...; pads get 0."""
    mask = attention_mask_.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def embed(config: ModelConfig, params: Params, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Token embeddings (+ learned positions for gpt2): [B, T] -> [B, T, hidden]."""
    h = Embed(config.vocab_size, config.hidden_size).apply({"params": params["embed"]}, tokens)
    if config.family == "gpt2":
        h = h + Embed(config.max_position_embeddings, config.hidden_size).apply(
            {"params": params["pos_embed"]}, positions
        )
    return h


def same_block_layer(config: ModelConfig, layer: int) -> int:
    """The first layer whose cache-free :func:`apply_block` computes the same function as ``layer``'s.

    Without a cache a block's code depends on its index only through sliding-window
    attention, so jitted block functions keyed on this layer compile once per kind of
    layer (one for most models) instead of once per layer.
    """
    kind = config.is_sliding(layer)
    return next(i for i in range(config.num_layers) if config.is_sliding(i) == kind)


def apply_block(
    config: ModelConfig,
    block_params: Params,
    hidden: jax.Array,
    positions: jax.Array,
    mask: jax.Array | None = None,
    *,
    layer: int = 0,
) -> jax.Array:
    """One decoder block without a cache. ``mask`` is the [B, T] padding mask (1 = real token).

    ``layer`` matters only for models whose layers differ (sliding-window layers).
    """
    b, t = hidden.shape[:2]
    valid = jnp.ones((b, t), bool) if mask is None else mask.astype(bool)
    window = config.sliding_window if config.is_sliding(layer) else None
    full_mask = attention_mask(jnp.arange(t), valid, window)
    out, _ = _block_module(config, layer).apply({"params": block_params}, hidden, positions, full_mask, None)
    return out


def head(config: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head: [B, T, hidden] -> float32 logits [B, T, vocab]."""
    h = _norm_module(config).apply({"params": params["norm"]}, hidden)
    # A tied model whose tree has its own lm_head was untied (a rotated model, methods/rotate.py): use it.
    if config.tie_word_embeddings and "lm_head" not in params:
        logits = ops.linear_nk(h, params["embed"]["embedding"])
    else:
        logits = Linear(config.vocab_size).apply({"params": params["lm_head"]}, h)
    return logits.astype(jnp.float32)


def _run_blocks(config, params, h, positions, query_slots, valid, cache):
    if config.family != "gpt2":  # every layer rotates by the same angles: their cos / sin once for all
        positions = rope_tables(positions, rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    if stacked.is_stacked(params):  # one scan body for all blocks (models/stacked.py: all of one kind)
        window = config.sliding_window if config.is_sliding(0) else None
        mask = attention_mask(query_slots, valid, window)

        def run_block(block_params, layer, carry):
            h, cache = carry
            return _block_module(config, layer).apply({"params": block_params}, h, positions, mask, cache)

        # a quantized cache's per-step masks and counters once for all layers (XLA evaluated them in every one)
        carry = (h, kvcache.with_step_plan(cache, mask))
        h, cache = stacked.scan_blocks(run_block, params[stacked.BLOCKS], carry, config.num_layers)
        return h, kvcache.with_step_plan(cache, None)
    masks = {}
    for i in range(config.num_layers):
        window = config.sliding_window if config.is_sliding(i) else None
        if window not in masks:
            masks[window] = attention_mask(query_slots, valid, window)
        h, cache = _block_module(config, i).apply({"params": params[f"layers_{i}"]}, h, positions, masks[window], cache)
    return h, cache


def hidden_states(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    kv: KVQuantizer | None = None,
) -> jax.Array:
    """The last block's output [B, T, hidden] (before the final norm): :func:`forward` without :func:`head`.

    Arguments as :func:`forward`. Perplexity applies the head a chunk of positions at a time
    (``evaluate.chunked_token_nll``) instead of holding [B, T, vocab] logits.
    """
    b, t = tokens.shape
    mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask
    if kv is not None:
        cache = init_cache(config, b, t, kv=kv)
        prompt = kv.spec.prompt_tokens if kv.spec.online_keys else t
        if prompt >= t:
            return _step_hidden(config, params, tokens, mask, cache)[0]
        # Online key ranges come from the first write: a prompt, then the rest (as in generation).
        first, cache = _step_hidden(config, params, tokens[:, :prompt], mask[:, :prompt], cache)
        rest, _ = _step_hidden(config, params, tokens[:, prompt:], mask[:, prompt:], cache)
        return jnp.concatenate([first, rest], axis=1)
    positions = default_positions(mask)
    h = embed(config, params, tokens, positions)
    h, _ = _run_blocks(config, params, h, positions, jnp.arange(t), mask.astype(bool), None)
    return h


def forward(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    kv: KVQuantizer | None = None,
) -> jax.Array:
    """Full-sequence logits [B, T, vocab] (float32). Left padding: pass ``attention_mask`` (1 = real).

    ``kv``: the "prefill path" of a quantized KV cache: attention reads keys/values
    through a fresh quantized cache of T slots, exactly as generation would see them
    (online key ranges: the first ``kv.spec.prompt_tokens`` tokens are the prompt).
    """
    return head(config, params, hidden_states(config, params, tokens, attention_mask, kv=kv))


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, kv=None):
    """An empty KV cache: float, or quantized when ``kv`` (a :class:`llmeq_jax.kv.spec.KVQuantizer`) is given."""
    if kv is None:
        return kvcache.init(config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim, dtype)
    inv_freq = None if config.family == "gpt2" else rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return kvcache.init_quantized(config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim, kv,
                                  inv_freq=inv_freq, dtype=dtype)


def forward_step(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    cache: kvcache.KVCache,
    *,
    last_only: bool = False,
) -> tuple[jax.Array, kvcache.KVCache]:
    """Run T new tokens against the cache (prefill: T = prompt length; decode: T = 1).

    Returns float32 logits [B, T, vocab] (``last_only``: [B, 1, vocab], the last position's) and the
    cache with the new keys/values written.

    ``last_only`` is what a prompt's prefill wants: the head then multiplies one position per row, not
    T. XLA does not move the slice in front of a quantized head's native kernel (an opaque call), which
    then multiplied every prompt position by the vocabulary: a third of a 128-token prefill for a
    2048-wide, 4-block model with a 49k vocabulary, a fifth for SmolLM2-135M.
    """
    h, cache = _step_hidden(config, params, tokens, attention_mask, cache)
    if last_only:
        h = h[:, -1:]
    return head(config, params, h), cache


def _step_hidden(config, params, tokens, attention_mask, cache):
    """:func:`forward_step` without the head: (hidden [B, T, hidden], advanced cache)."""
    t = tokens.shape[1]
    positions = kvcache.new_positions(cache, attention_mask)
    query_slots = kvcache.slots(cache, t)
    cache = kvcache.append_mask(cache, attention_mask)
    h = embed(config, params, tokens, positions)
    h, cache = _run_blocks(config, params, h, positions, query_slots, cache.valid, cache)
    return h, kvcache.advance(cache, attention_mask)


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random params in ``dtype`` (float32 by default) with the tree layout the loaders produce (for tests,
    smoke runs and random-weight benchmarks). Each part is compiled on its own and the blocks share one
    program (a block's params do not depend on its index), so a 32-layer 7B model compiles a few small
    programs and never holds more than one block in float32."""
    dtype = jnp.dtype(dtype)
    keys = list(jax.random.split(rng, config.num_layers + 4))
    params: Params = {"embed": _init_embed(config.vocab_size, config.hidden_size, keys.pop(0), dtype)}
    if config.family == "gpt2":
        params["pos_embed"] = _init_embed(config.max_position_embeddings, config.hidden_size, keys.pop(0), dtype)
    for i in range(config.num_layers):
        params[f"layers_{i}"] = _init_block(config, keys.pop(0), dtype)
    params.update(_init_head(config, keys.pop(0), keys.pop(0), dtype))
    return params


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


@functools.partial(jax.jit, static_argnums=(0, 1, 3))
def _init_embed(rows: int, width: int, key: jax.Array, dtype) -> Params:
    return _cast(Embed(rows, width).init(key, jnp.zeros((1, 1), jnp.int32))["params"], dtype)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_block(config: ModelConfig, key: jax.Array, dtype) -> Params:
    x, one, mask = jnp.zeros((1, 1, config.hidden_size)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 1), bool)
    return _cast(_block_module(config, 0).init(key, x, one, mask, None)["params"], dtype)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _init_head(config: ModelConfig, norm_key: jax.Array, head_key: jax.Array, dtype) -> Params:
    x = jnp.zeros((1, 1, config.hidden_size))
    params = {"norm": _norm_module(config).init(norm_key, x)["params"]}
    if not config.tie_word_embeddings:
        params["lm_head"] = Linear(config.vocab_size).init(head_key, x)["params"]
    return _cast(params, dtype)
