"""Preallocated key/value cache for generation.

A :class:`KVCache` is a pytree of fixed-shape arrays, so a jitted decode step
never changes shape and never recompiles:

* ``k``, ``v``: ``[layers, batch, kv_heads, max_len, head_dim]``
* ``valid``: ``[batch, max_len]`` bool, which slots hold a real (non-padding) token
* ``length``: scalar int32, how many slots are written (the same for every row:
  prompts are left-padded to one length)
* ``positions``: ``[batch]`` int32, the position id the next real token gets

A step goes: :func:`append_mask` (mark the new slots), per layer :func:`update`
then :func:`read`, finally :func:`advance`. A quantized cache only has to
provide these same functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    positions: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init(num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for ``max_len`` tokens per row."""
    shape = (num_layers, batch, kv_heads, max_len, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch, max_len), bool),
        length=jnp.zeros((), jnp.int32),
        positions=jnp.zeros((batch,), jnp.int32),
    )


def new_positions(cache: KVCache, attention_mask: jax.Array) -> jax.Array:
    """Position ids [B, T] for the next T tokens: real tokens count up from ``cache.positions``.

    Padding tokens get the position of the next real token (they are masked out anyway).
    """
    mask = attention_mask.astype(jnp.int32)
    return cache.positions[:, None] + jnp.cumsum(mask, axis=1) - mask


def slots(cache: KVCache, num_new: int) -> jax.Array:
    """Cache slot index of each of the next ``num_new`` tokens."""
    return cache.length + jnp.arange(num_new, dtype=jnp.int32)


def append_mask(cache: KVCache, attention_mask: jax.Array) -> KVCache:
    """Mark the next T slots valid where ``attention_mask`` [B, T] is 1."""
    valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask.astype(bool), (0, cache.length))
    return dataclasses.replace(cache, valid=valid)


def update(cache: KVCache, layer: int, k: jax.Array, v: jax.Array) -> KVCache:
    """Write new keys/values ``[B, KV, T, D]`` of ``layer`` at slots ``length .. length+T``."""
    start = (layer, 0, 0, cache.length, 0)
    return dataclasses.replace(
        cache,
        k=jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start),
        v=jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start),
    )


def read(cache: KVCache, layer: int) -> tuple[jax.Array, jax.Array]:
    """All keys and values of ``layer``: ``[B, KV, max_len, D]`` each (use ``valid`` to mask)."""
    return cache.k[layer], cache.v[layer]


def advance(cache: KVCache, attention_mask: jax.Array) -> KVCache:
    """Close the step: T more slots written, position counters moved past the real tokens."""
    t = attention_mask.shape[1]
    return dataclasses.replace(
        cache,
        length=cache.length + t,
        positions=cache.positions + jnp.sum(attention_mask.astype(jnp.int32), axis=1),
    )
