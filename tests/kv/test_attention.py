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
    """Up to 16 query rows per KV head, several heads to a KV head: sums (no dot), the softmax behind a barrier (so
    XLA does not fuse it with the values' sum into a fusion that copies the layer's values out of the stack: an A100
    or L40, and an H100 at batch 16, in deviceless compiles), and the same numbers; one head per KV head (already
    reductions in XLA) or more rows: the dots. On a CPU: the dots."""
    q, k, v, mask = _inputs(t, heads, kv, jnp.bfloat16)

    def run(q, k, v):
        return attention.layer_attention(q, k, v, jnp.int32(1), mask)

    def traced():  # a fresh function each time: JAX's trace cache does not know compiling_for's device
        return str(jax.make_jaxpr(lambda *a: run(*a))(q, k, v))

    with config.compiling_for(GPU):
        assert attention.sums_read_in_place(q, k) == sums
        gpu_jaxpr = traced()
        assert ("dot_general" in gpu_jaxpr) != sums
        assert gpu_jaxpr.count("optimization_barrier") == int(sums)
        got = run(q, k, v)
    assert "dot_general" in traced()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(run(q, k, v), np.float32), atol=2e-2)


# --------------------------------------------------------------------------- a prompt's attention on a GPU: cuDNN


def _prompt(t=160, heads=8, kv=2, d=16, dtype=jnp.bfloat16, layers=2):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, t, heads, d)).astype(dtype)
    k, v = (jax.random.normal(key, (layers, 2, kv, t + 8, d)).astype(dtype) for key in keys[1:])
    pos = jnp.arange(t + 8)
    causal = pos[None, :t, None] >= pos[None, None, :]  # query t sees slots <= t
    left_pad = jnp.array([0, 5])[:, None, None] <= pos[None, None, :]  # the second row's prompt starts at slot 5
    return q, k, v, causal & left_pad


@pytest.mark.usefixtures("unchecked_kernels")
@pytest.mark.parametrize("heads, kv", [(8, 2), (4, 4)])
def test_a_gpus_prompt_goes_to_cudnn_with_the_same_numbers(cudnn_as_xla, heads, kv):
    """Traced for a GPU, a bf16 prompt's attention (the models' and a stacked cache's layer) is cuDNN's flash
    attention, given the cache's keys as they are ([B, KV, S, D], padded with masked-out slots to whole key tiles)
    and the mask per batch row; its numbers are attention_xla's."""
    q, k, v, mask = _prompt(heads=heads, kv=kv)
    want = attention.attention_xla(q, k[1], v[1], mask)
    with config.compiling_for(GPU):
        assert attention.flash_ok(q, k)
        whole = attention.dot_product_attention(q, k[1], v[1], mask)
        layer = jax.jit(lambda q, k, v, i: attention.layer_attention(q, k, v, i, mask))(q, k, v, jnp.int32(1))
    assert [c["layout"] for c in cudnn_as_xla] == ["BNTH", "BNTH"]
    padded = 192  # the 168 slots padded with masked-out keys to a multiple of FLASH_KEY_MULTIPLE
    assert cudnn_as_xla[0]["key"] == (2, kv, padded, 16) and cudnn_as_xla[0]["mask"] == (2, 1, 160, padded)
    for got in (whole, layer):
        assert got.dtype == q.dtype and got.shape == q.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("unchecked_kernels")
def test_what_stays_on_xlas_attention(cudnn_as_xla):
    """Short prompts and decode steps, float32, a head dim cuDNN does not take, a CPU, kernels turned off: no cuDNN."""
    q, k, v, mask = _prompt()
    with config.compiling_for(GPU):
        assert attention.flash_ok(q, k)
        assert not attention.flash_ok(q[:, :attention.FLASH_MIN_ROWS - 1], k)
        assert not attention.flash_ok(q.astype(jnp.float32), k.astype(jnp.float32))
        assert not attention.flash_ok(q, k.astype(jnp.float16))  # operands of two dtypes
        assert not attention.flash_ok(q[..., :12], k[..., :12])  # head dim not a multiple of 8
        with config.disabled():
            assert not attention.flash_ok(q, k)
            attention.dot_product_attention(q, k[1], v[1], mask)
    assert not attention.flash_ok(q, k)  # this CPU
    attention.dot_product_attention(q, k[1], v[1], mask)
    assert cudnn_as_xla == []


@pytest.mark.usefixtures("unchecked_kernels")
def test_the_environment_can_keep_prompts_on_xla(cudnn_as_xla, monkeypatch):
    """LLMEQ_PROMPT_ATTENTION=xla: no cuDNN call (the escape hatch for a GPU whose cuDNN fails the call); a value
    it does not know: one clear error."""
    q, k, v, mask = _prompt()
    monkeypatch.setenv(attention.PROMPT_ATTENTION_ENV, "xla")
    with config.compiling_for(GPU):
        assert not attention.flash_ok(q, k)
        attention.dot_product_attention(q, k[1], v[1], mask)
        monkeypatch.setenv(attention.PROMPT_ATTENTION_ENV, "cudnn")
        assert attention.flash_ok(q, k)
        monkeypatch.setenv(attention.PROMPT_ATTENTION_ENV, "flash")
        with pytest.raises(ValueError, match="LLMEQ_PROMPT_ATTENTION='flash': expected one of cudnn, xla"):
            attention.flash_ok(q, k)
    assert cudnn_as_xla == []


def test_a_measured_table_decides_the_prompt_attention(cudnn_as_xla):
    """A dispatch table's prompt_attention entry overrules FLASH_MIN_ROWS both ways."""
    from llmeq_jax import dispatch_table

    q, k, _, _ = _prompt()
    rows = dispatch_table.row_bucket(q.shape[1])

    def table(flash_s, short_flash_s):
        entry = {"kernel": "prompt_attention", "bits": 16, "group": None, "k": 16, "n": dispatch_table.row_bucket(168),
                 "dtype": "bfloat16", "xla_s": 1.0, "bf16_s": 1.0}
        return {"format": dispatch_table.FORMAT, "device": GPU.device_kind,
                "entries": [dict(entry, rows=rows, pallas_s=flash_s), dict(entry, rows=16, pallas_s=short_flash_s)]}

    with config.compiling_for(GPU):
        with dispatch_table.use(dispatch_table.from_json(table(2.0, 0.5))):
            assert not attention.flash_ok(q, k)  # measured slower: XLA's
            assert attention.flash_ok(q[:, :16], k)  # measured faster at 16 positions: cuDNN's
        with dispatch_table.use(dispatch_table.from_json(table(0.5, 2.0))):
            assert attention.flash_ok(q, k) and not attention.flash_ok(q[:, :16], k)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU's jaxlib has no cuDNN: the refusal is the case")
def test_without_cudnn_the_prompt_takes_xlas_attention():
    """Where cuDNN refuses at trace time (a jaxlib without it), attention_flash says so and XLA's path runs."""
    q, k, v, mask = _prompt()
    assert attention.attention_flash(q, k[1], v[1], mask) is None
    with config.compiling_for(GPU):
        got = attention.dot_product_attention(q, k[1], v[1], mask)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(attention.attention_xla(q, k[1], v[1], mask), np.float32))
