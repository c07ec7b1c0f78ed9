"""Building blocks shared by the model families (Flax linen).

Every parameter is read with ``self.variable("params", ...)`` rather than
``self.param``: linen's ``param`` re-runs the initializer's shape check against
the stored leaf, which a packed ``QArray`` (int4: half the rows) would fail.
``variable`` hands the stored leaf back as it is, so a quantized tree runs in
the same code and ``ops.linear`` picks the matmul path from the leaf's type.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import ops

_INIT_STD = 0.02
# Masked attention scores: a large finite value, so a row with no visible key
# (a left-padding query) gives a uniform softmax instead of NaN.
_MASKED = -1e30


def _normal_init(module: nn.Module, shape: tuple[int, ...]):
    return lambda: _INIT_STD * jax.random.normal(module.make_rng("params"), shape, jnp.float32)


class Linear(nn.Module):
    """``x @ kernel + bias`` through ``ops.linear``; kernel is ``(in, out)``, float or QArray."""

    features: int
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.variable("params", "kernel", _normal_init(self, (x.shape[-1], self.features))).value
        bias = None
        if self.use_bias:
            bias = self.variable("params", "bias", lambda: jnp.zeros((self.features,), jnp.float32)).value
        return ops.linear(x, kernel, bias)


class Embed(nn.Module):
    """Row lookup in an ``(num_embeddings, features)`` table, float or QArray (only the rows read are dequantized)."""

    num_embeddings: int
    features: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.variable("params", "embedding", _normal_init(self, (self.num_embeddings, self.features))).value
        return ops.take_rows(table, ids)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, output in the input dtype."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.variable("params", "scale", lambda: jnp.ones((x.shape[-1],), jnp.float32)).value
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with scale and bias, computed in float32."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.variable("params", "scale", lambda: jnp.ones((x.shape[-1],), jnp.float32)).value
        bias = self.variable("params", "bias", lambda: jnp.zeros((x.shape[-1],), jnp.float32)).value
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------- rotary embeddings


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Inverse frequencies (head_dim/2,), with Llama-3 style scaling when configured."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x`` [B, T, H, D] by ``positions`` [B, T] (rotate-half layout, as in HF Llama)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# --------------------------------------------------------------------------- attention


def attention_mask(
    query_index: jax.Array, key_valid: jax.Array, sliding_window: int | None = None
) -> jax.Array:
    """Boolean [B, T, S]: query t (at cache slot ``query_index[t]``) may see key slot s.

    Causal over cache slots, restricted to valid (non-padding, written) keys and,
    for sliding-window layers, to the last ``sliding_window`` slots (as HF does:
    ``key > query - window``).
    """
    key_index = jnp.arange(key_valid.shape[-1])
    allowed = key_index[None, :] <= query_index[:, None]  # [T, S]
    if sliding_window is not None:
        allowed &= key_index[None, :] > query_index[:, None] - sliding_window
    return allowed[None, :, :] & key_valid[:, None, :].astype(bool)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q [B, T, H, D]; k, v [B, KV, S, D]; mask [B, T, S] -> [B, T, H, D].
    Scores and softmax in float32.
    """
    if _native_attention_ok(q, k, v):
        from llmeq_jax import native

        return native.decode_attention(q, k, v, mask, masked=_MASKED, reference=_attention_xla)
    return _attention_xla(q, k, v, mask)


def _native_attention_ok(q, k, v) -> bool:
    """Decode-sized float32 attention on CPU goes to the native kernel (one call instead of
    XLA's two small dot fusions and softmax ops, whose launch overhead dominated a decode step)."""
    if not 0 < q.shape[0] * q.shape[1] <= ops.NATIVE_MAX_ROWS["attention"]:
        return False
    if any(a.dtype != jnp.float32 for a in (q, k, v)) or jax.default_backend() != "cpu":
        return False
    from llmeq_jax import native

    return native.enabled()


def _attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    b, t, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, d)
