"""Bytes of a KV cache, counted from its arrays, and the longest context a budget holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmeq_jax.kv.cache import KVCache


def _slot_leaves(cache) -> tuple[list, list]:
    """(leaves with a per-slot axis, the rest) of a cache."""
    if isinstance(cache, KVCache):
        return [cache.k, cache.v, cache.valid], [cache.length, cache.positions]
    per_slot = jax.tree.leaves((cache.k, cache.v, cache.valid, cache.slot_pos, cache.rope_cos, cache.rope_sin))
    fixed = jax.tree.leaves((cache.k_scale, cache.k_lo, cache.k_hi, cache.k_win, cache.v_win, cache.k_sink,
                             cache.v_sink, cache.sink_slot, cache.inv_freq, cache.length, cache.positions))
    return per_slot, fixed


def _nbytes(leaves) -> int:
    return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in leaves)


def memory(cache) -> dict:
    """Bytes of a cache, from its arrays: per token (one row, all layers) and fixed (window, sinks, key grids)."""
    per_slot, fixed = _slot_leaves(cache)
    batch = cache.valid.shape[0]
    return {
        "bytes_per_token": _nbytes(per_slot) / (cache.max_len * batch),
        "fixed_bytes": _nbytes(fixed),
        "total_bytes": _nbytes(per_slot) + _nbytes(fixed),
    }


def longest_context(bytes_per_token: float, fixed_bytes: int, budget_bytes: float, batch: int = 1) -> int:
    """The most tokens per row whose cache fits ``budget_bytes`` (0 if not even the fixed part fits)."""
    return max(int((budget_bytes - fixed_bytes) // (bytes_per_token * batch)), 0)
