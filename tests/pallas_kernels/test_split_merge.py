"""Flash decoding's split results merged in one kernel (pallas_kernels/split_merge.py): attention over keys cut into
splits, merged, is attention over all of them (and the float sinks); refusals; lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import split_merge as sm
from pallas_kernels.kv_cache import attention_reference, combine_splits


def _split_attention(q, k, v, ok, splits: int, rows: int):
    """Each split's normalized output and log-sum-exp [B, H, S, R(, D)] (rows past G zero-padded, a split with no
    allowed key at lse ~ -1e30), its unnormalized sum, max and weight sum, and the attention over all keys."""
    b, h, g, d = q.shape
    s = jnp.einsum("bhgd,bhtd->bhgt", q, k) / np.sqrt(d)
    s = jnp.where(ok[:, None, None, :], s, -1e30)
    s = jnp.moveaxis(s.reshape(b, h, g, splits, -1), 3, 2)  # [B, H, S, G, T / S]
    vs = v.reshape(b, h, splits, -1, d)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None]) * (s > -1e29)
    total = p.sum(-1)
    acc = jnp.einsum("bhsgt,bhstd->bhsgd", p, vs)
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    lse = jnp.where(total > 0, m + jnp.log(jnp.maximum(total, 1e-30)), -1e30)
    pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, rows - g)] + [(0, 0)] * (a.ndim - 4))  # noqa: E731
    return pad(out), pad(lse), (pad(acc), pad(m), pad(total))


def _inputs(b=2, h=3, g=4, t=96, d=64, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, h, g, d)) * 2
    k = jax.random.normal(ks[1], (b, h, t, d))
    v = jax.random.normal(ks[2], (b, h, t, d))
    ok = jax.random.bernoulli(ks[3], 0.7, (b, t)).at[0, :t // 6].set(False)  # row 0's first split: nothing allowed
    return q, k, v, ok


@pytest.mark.parametrize("splits,rows", [(6, 8), (16, 4), (1, 8)])
def test_merged_splits_are_attention_over_all_the_keys(splits, rows):
    """Normalized splits (the Mosaic GPU kernel's: log-sum-exps), S not a power of two, rows padded past G, an empty
    split, two programs a head (32 channels each); and the same splits unnormalized (max and weight sum, the Triton
    kernel's)."""
    q, k, v, ok = _inputs()
    out, lse, (acc, m, total) = _split_attention(q, k, v, ok, splits, rows)
    want, want_lse = attention_reference(q.reshape(2, 12, 64), k, v, ok, None)
    got, got_lse = sm.merge_splits(out, lse, 4, interpret=True)
    assert got.shape == (2, 3, 4, 64) and got_lse.shape == (2, 3, 4) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got).reshape(2, 12, 64), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lse).reshape(2, 12), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    got2, lse2 = sm.merge_splits(acc, m, 4, total=total, interpret=True)
    np.testing.assert_allclose(np.asarray(got2), np.asarray(got), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse2), np.asarray(got_lse), rtol=1e-5, atol=1e-5)
    # XLA's merge of the same unnormalized splits
    xla, xla_lse = combine_splits(acc[..., :4, :], m[..., :4, None], total[..., :4, None])
    np.testing.assert_allclose(np.asarray(got2), np.asarray(xla), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse2), np.asarray(xla_lse), rtol=1e-5, atol=1e-5)


def test_a_shift_moves_every_splits_log_sum_exp_and_sinks_join_the_softmax():
    """``shift`` (the post-RoPE kernel's folded key offset: every score of a query moved alike) and float sinks read
    from a stack at ``layer`` (seen by row 0 only): attention over the keys and the sinks, in bfloat16 out. 24 splits
    of 16 rows (the sinks' dots) take two chunks, the second one part empty."""
    q, k, v, ok = _inputs(seed=1)
    b, h, g, d = q.shape
    assert sm.TILE // (16 * sm.COLS) < 24 < 2 * sm.TILE // (16 * sm.COLS)
    shift = jax.random.normal(jax.random.key(9), (b, h, g)) * 3
    out, lse, _ = _split_attention(q, k, v, ok, 24, 8)
    sink_k = jax.random.normal(jax.random.key(10), (3, b, h, 2, d)).astype(jnp.bfloat16) * 2
    sink_v = (jax.random.normal(jax.random.key(11), (3, b, h, 2, d)) + 3).astype(jnp.bfloat16)
    seen = jnp.array([[True, True], [False, False]])
    got, got_lse = sm.merge_splits(out, lse, 4, shift=shift, sinks=(q, sink_k, sink_v, seen), layer=jnp.int32(1),
                                   sm_scale=1 / np.sqrt(d), out_dtype=jnp.bfloat16, interpret=True)
    assert got.dtype == jnp.bfloat16
    # the reference: scores shifted by the shift, the sinks' scores not (they are plain q . k)
    keys = jnp.concatenate([k, sink_k[1].astype(jnp.float32)], axis=2)
    values = jnp.concatenate([v, sink_v[1].astype(jnp.float32)], axis=2)
    s = jnp.einsum("bhgd,bhtd->bhgt", q, keys) / np.sqrt(d)
    s = s + jnp.concatenate([jnp.broadcast_to(shift[..., None], (b, h, g, k.shape[2])),
                             jnp.zeros((b, h, g, 2))], axis=-1)
    allowed = jnp.concatenate([ok, seen], axis=1)[:, None, None, :]
    s = jnp.where(allowed, s, -jnp.inf)
    want_lse = jax.nn.logsumexp(s, axis=-1)
    want = jnp.einsum("bhgt,bhtd->bhgd", jnp.exp(s - want_lse[..., None]), values)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-5, atol=1e-4)
    alone, _ = sm.merge_splits(out, lse, 4, shift=shift, out_dtype=jnp.bfloat16, interpret=True)
    # row 1 sees no sink: the same up to the summation order (its chunks differ: 16 rows with sinks, 4 without)
    np.testing.assert_allclose(np.asarray(alone[1], np.float32), np.asarray(got[1], np.float32), rtol=8e-3,
                               atol=4e-3)
    assert float(jnp.abs(alone[0].astype(jnp.float32) - got[0].astype(jnp.float32)).max()) > 0.1


def test_bad_input_gets_one_clear_error():
    out, lse = jnp.zeros((1, 2, 4, 8, 64)), jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="R >= G"):
        sm.merge_splits(out, lse, 9, interpret=True)
    with pytest.raises(ValueError, match=r"expected \[B, H, S, R, D\]"):
        sm.merge_splits(out, lse[..., :4], 4, interpret=True)
    with pytest.raises(ValueError, match=r"shift must be \(1, 2, 4\)"):
        sm.merge_splits(out, lse, 4, shift=jnp.zeros((1, 2, 8)), interpret=True)
    sink = jnp.zeros((1, 2, 3, 64))
    with pytest.raises(ValueError, match="sinks q"):
        sm.merge_splits(out, lse, 4, sinks=(jnp.zeros((1, 2, 4, 64)), sink, sink, jnp.zeros((1, 2), bool)),
                        interpret=True)


def test_kernel_lowers_for_cuda(cuda_lowering):
    b, h, s, r, d, layers = 1, 32, 16, 8, 128, 2
    parts = [jnp.zeros((b, h, s, r, d)), jnp.zeros((b, h, s, r))]
    sinks = [jnp.zeros((b, h, 1, d), jnp.bfloat16), jnp.zeros((layers, b, h, 4, d), jnp.bfloat16),
             jnp.zeros((layers, b, h, 4, d), jnp.bfloat16), jnp.ones((b, 4), bool)]
    cuda_lowering(lambda o, l, q, k, v, seen, i: sm.merge_splits(o, l, 1, sinks=(q, k, v, seen), layer=i,
                                                                 out_dtype=jnp.bfloat16), *parts, *sinks, jnp.int32(1))
    cuda_lowering(lambda o, l, t, sh: sm.merge_splits(o, l, 4, total=t, shift=sh), *parts, parts[1],
                  jnp.zeros((b, h, 4)))
