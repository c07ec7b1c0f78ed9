"""A decode step's attention over a float cache with its key/value written by the same kernel
(pallas_kernels/decode_attention.py): interpret mode against the reference, refusals, lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as da

L = 3


def _case(b, h, kv, s, d, dtype, stacked, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (L, b, kv, s, d) if stacked else (b, kv, s, d)
    k_cache, v_cache = (jax.random.normal(k, shape).astype(dtype) for k in keys[:2])
    q = (jax.random.normal(keys[2], (b, h, d)) * 2).astype(dtype)
    k_new, v_new = (jax.random.normal(k, (b, kv, d)).astype(dtype) for k in keys[3:])
    return q, k_new, v_new, k_cache, v_cache


def _check(got, want, dtype):
    tol = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}[dtype]
    out, k_cache, v_cache = got
    assert out.dtype == want[0].dtype and out.shape == want[0].shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want[0], np.float32), atol=tol, rtol=tol)
    # the cache: exactly the old one with the token's key and value at its slot
    np.testing.assert_array_equal(np.asarray(k_cache, np.float32), np.asarray(want[1], np.float32))
    np.testing.assert_array_equal(np.asarray(v_cache, np.float32), np.asarray(want[2], np.float32))


@pytest.mark.parametrize("b, h, kv, s, d, dtype, stacked, slot, splits, block_t", [
    (1, 32, 32, 160, 64, jnp.bfloat16, True, 40, None, 64),  # multi-head (G = 1), one split: normalized in-kernel
    (2, 8, 2, 100, 32, jnp.float32, True, 99, None, 16),  # GQA, the last slot
    (2, 8, 2, 300, 64, jnp.float32, True, 170, 4, 32),  # flash decoding: splits merged, the later ones empty
    (3, 12, 4, 48, 16, jnp.float16, False, 0, None, 16),  # the first slot: nothing before it
    (2, 4, 1, 64, 128, jnp.bfloat16, False, 37, 3, 16),  # one kv head for all, ragged splits
])
def test_matches_the_reference(b, h, kv, s, d, dtype, stacked, slot, splits, block_t):
    q, k_new, v_new, k_cache, v_cache = _case(b, h, kv, s, d, dtype, stacked, seed=s)
    # padding at the front of row 0, a hole in row 1's history; every row sees its own slot
    allowed = jnp.ones((b, s), bool).at[0, : slot // 3].set(False)
    if b > 1 and slot > 1:
        allowed = allowed.at[1, slot // 2].set(False)
    layer = jnp.int32(1) if stacked else None
    got = da.append_decode_attention(q, k_new, v_new, k_cache, v_cache, jnp.int32(slot), allowed, layer=layer,
                                     num_splits=splits, block_t=block_t, interpret=True)
    want = da.append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, slot, allowed,
                                                layer=None if layer is None else 1)
    _check(got, want, dtype)


@pytest.mark.parametrize("b, h, kv, s, d, dtype, cache_dtype, slot, splits", [
    (2, 8, 2, 100, 64, jnp.bfloat16, jnp.bfloat16, 70, None),  # a GQA model's bf16 step
    (1, 4, 4, 96, 32, jnp.float32, jnp.float32, 50, 3),  # float32, the smallest halves, splits merged after
    (2, 4, 2, 64, 128, jnp.bfloat16, jnp.float32, 33, None),  # a float32 cache under bf16 projections
])
def test_rope_rotates_the_query_and_key_in_the_kernel(b, h, kv, s, d, dtype, cache_dtype, slot, splits):
    """``rope=(cos, sin)``: the query and key arrive before RoPE and the kernel rotates them as
    ``core.rope.apply_rope`` (rounded to their dtype), the key written rotated -- within the dtype's rounding of
    the reference (XLA's rotation, then the same attention), far from the unrotated step's."""
    q, k_new, v_new, k_cache, v_cache = _case(b, h, kv, s, d, dtype, True, seed=d)
    k_cache, v_cache = k_cache.astype(cache_dtype), v_cache.astype(cache_dtype)
    angles = jnp.asarray(np.random.default_rng(d).uniform(-40, 40, (b, d // 2)), jnp.float32)
    rope = (jnp.cos(angles), jnp.sin(angles))
    allowed = jnp.ones((b, s), bool).at[0, : slot // 4].set(False)
    got = da.append_decode_attention(q, k_new, v_new, k_cache, v_cache, jnp.int32(slot), allowed, layer=jnp.int32(2),
                                     rope=rope, num_splits=splits, block_t=16, interpret=True)
    want = da.append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, slot, allowed, layer=2, rope=rope)
    tol = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=tol, rtol=tol)
    # the rotated key in the cache: the rotation rounded to its dtype, as XLA's (1 ulp where it contracts an FMA)
    np.testing.assert_allclose(np.asarray(got[1][2, :, :, slot], np.float32),
                               np.asarray(want[1][2, :, :, slot], np.float32), rtol=1e-2 if dtype != jnp.float32
                               else 1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1][:, :, :, :slot]), np.asarray(k_cache[:, :, :, :slot]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    unrotated = da.append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, slot, allowed, layer=2)
    assert float(jnp.max(jnp.abs(unrotated[0].astype(jnp.float32) - want[0].astype(jnp.float32)))) > 20 * tol


def test_slots_after_the_steps_are_not_read():
    """Unwritten slots (garbage here) past the step's slot change nothing, even where ``allowed`` says yes."""
    q, k_new, v_new, k_cache, v_cache = _case(1, 4, 2, 64, 32, jnp.float32, True)
    allowed = jnp.ones((1, 64), bool)
    run = lambda kc, vc: da.append_decode_attention(q, k_new, v_new, kc, vc, jnp.int32(20), allowed, layer=jnp.int32(0),
                                                    block_t=16, interpret=True)[0]
    garbage = k_cache.at[:, :, :, 21:].set(1e4), v_cache.at[:, :, :, 21:].set(jnp.nan)
    np.testing.assert_array_equal(np.asarray(run(k_cache, v_cache)), np.asarray(run(*garbage)))


def test_a_sliding_window_and_an_unseen_own_slot():
    """Only the allowed slots count; a padding query that sees nothing gets zeros, one that sees only old slots
    does not see its own key."""
    q, k_new, v_new, k_cache, v_cache = _case(2, 4, 2, 32, 16, jnp.float32, False)
    allowed = jnp.zeros((2, 32), bool).at[1, 10:20].set(True)  # row 0 sees nothing, row 1 a window without itself
    out, k_cache2, _ = da.append_decode_attention(q, k_new, v_new, k_cache, v_cache, jnp.int32(25), allowed,
                                                  block_t=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    want = da.append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, 25, allowed)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(want[0][1]), atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(k_cache2[:, :, 25]), np.asarray(k_new))  # written all the same


def test_bad_inputs_are_refused_with_what_was_expected():
    q, k_new, v_new, k_cache, v_cache = _case(1, 4, 2, 32, 16, jnp.float32, True)
    allowed = jnp.ones((1, 32), bool)
    call = lambda **kw: da.append_decode_attention(**{**dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache,
                                                              v_cache=v_cache, slot=jnp.int32(3), allowed=allowed,
                                                              layer=jnp.int32(0), interpret=True), **kw})
    with pytest.raises(ValueError, match=r"must be \[batch, kv_heads, slots, head_dim\], got \(3, 1, 2, 32, 16\)"):
        call(layer=None)
    with pytest.raises(ValueError, match="heads % kv"):
        call(q=jnp.ones((1, 3, 16)))
    with pytest.raises(ValueError, match="head_dim 24 is not a power of two"):
        call(q=jnp.ones((1, 4, 24)), k_cache=jnp.ones((L, 1, 2, 32, 24)), v_cache=jnp.ones((L, 1, 2, 32, 24)))
    with pytest.raises(ValueError, match=r"k_new must be \(1, 2, 16\), got \(1, 4, 16\)"):
        call(k_new=jnp.ones((1, 4, 16)))
    with pytest.raises(ValueError, match=r"allowed must be \(1, 32\)"):
        call(allowed=jnp.ones((1, 31), bool))
    with pytest.raises(ValueError, match="v_cache bfloat16"):
        call(v_cache=v_cache.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="cache dtype int8"):
        call(k_cache=k_cache.astype(jnp.int8), v_cache=v_cache.astype(jnp.int8))
    with pytest.raises(ValueError, match="slot must be an integer scalar"):
        call(slot=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="block_t must be a power of two"):
        call(block_t=24)
    with pytest.raises(ValueError, match=r"rope must be \(cos, sin\), each \(1, 8\)"):
        call(rope=(jnp.ones((1, 16)), jnp.ones((1, 16))))
    with pytest.raises(ValueError, match="with rope, head_dim must be >= 32"):
        call(rope=(jnp.ones((1, 8)), jnp.ones((1, 8))))
    with pytest.raises(ValueError, match="must share a dtype"):
        call(q=jnp.ones((1, 4, 32)), k_new=jnp.ones((1, 2, 32), jnp.bfloat16), v_new=jnp.ones((1, 2, 32)),
             k_cache=jnp.ones((L, 1, 2, 32, 32)), v_cache=jnp.ones((L, 1, 2, 32, 32)),
             rope=(jnp.ones((1, 16)), jnp.ones((1, 16))))


@pytest.mark.parametrize("splits, rope", [(1, False), (8, False), (8, True)])
def test_lowers_for_cuda_in_place(cuda_lowering, splits, rope):
    """Lowered for CUDA (Llama-2-7B's heads, bf16, 2048 slots; RoPE in the kernel or not): one Triton call whose
    cache outputs alias the cache inputs (no copy of the cache for the update)."""
    q, k_new, v_new = jnp.ones((1, 32, 128), jnp.bfloat16), jnp.ones((1, 32, 128), jnp.bfloat16), \
        jnp.ones((1, 32, 128), jnp.bfloat16)
    cache = jnp.ones((2, 1, 32, 2048, 128), jnp.bfloat16)
    tables = (jnp.ones((1, 64)), jnp.zeros((1, 64))) if rope else None
    text = cuda_lowering(lambda q, kn, vn, kc, vc, slot, i: da.append_decode_attention(
        q, kn, vn, kc, vc, slot, jnp.ones((1, 2048), bool), layer=i, num_splits=splits, rope=tables),
        q, k_new, v_new, cache, cache, jnp.int32(5), jnp.int32(1))
    assert text.count("#stablehlo.output_operand_alias<") == 2
