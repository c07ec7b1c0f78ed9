"""Grouped-query decode attention as sums on a GPU (llmeq_jax/kv/attention.py): the same numbers as the dots,
and traced for a GPU, no dot over one layer of the stacked cache (XLA copied that layer out for its GEMMs)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.kv import attention
from pallas_kernels import config

GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")


def _inputs(t, heads, kv, dtype, layers=3, slots=40, d=16):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, t, heads, d)).astype(dtype)
    k = jax.random.normal(keys[1], (layers, 2, kv, slots, d)).astype(dtype)
    v = jax.random.normal(keys[2], (layers, 2, kv, slots, d)).astype(dtype)
    mask = jax.random.bernoulli(keys[3], 0.7, (2, t, slots)).at[:, :, 0].set(True)
    return q, k, v, mask


@pytest.mark.parametrize("t, heads, kv", [(1, 8, 2), (2, 12, 3), (1, 4, 4)])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_sums_give_the_dots_numbers(t, heads, kv, dtype, tol):
    q, k, v, mask = _inputs(t, heads, kv, dtype)
    got = attention.attention_sums(q, k[1], v[1], mask)
    want = attention.attention_xla(q.astype(jnp.float32), k[1].astype(jnp.float32), v[1].astype(jnp.float32), mask)
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("t, heads, kv, sums", [(1, 8, 2, True), (4, 8, 2, True), (8, 8, 2, False), (1, 8, 8, False)])
def test_a_gpus_grouped_decode_reads_the_layer_by_sums(t, heads, kv, sums):
    """Up to 16 query rows per KV head, several heads to a KV head: sums (no dot), and the same numbers; one head
    per KV head (already reductions in XLA) or more rows: the dots. On a CPU: the dots."""
    q, k, v, mask = _inputs(t, heads, kv, jnp.bfloat16)

    def run(q, k, v):
        return attention.layer_attention(q, k, v, jnp.int32(1), mask)

    def traced():  # a fresh function each time: JAX's trace cache does not know compiling_for's device
        return str(jax.make_jaxpr(lambda *a: run(*a))(q, k, v))

    with config.compiling_for(GPU):
        assert attention.sums_read_in_place(q, k) == sums
        assert ("dot_general" in traced()) != sums
        got = run(q, k, v)
    assert "dot_general" in traced()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(run(q, k, v), np.float32), atol=2e-2)
